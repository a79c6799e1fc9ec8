# In-place code swap: like the monkeypatcher, but it rebinds nothing. It replaces the __code__ of
# the harness's own function objects (the result check, the case judge, the kernel check, the
# relative error), so every module attribute still holds the very object it held before. An
# in-process judge must still notice that its judge was changed under it.
# Its own answer is the kernel's plus noise inside the float32 tolerance (kernel_plus_noise), so
# where the attack reaches nothing (the implementation runs in a process of its own, without the
# harness), that answer fails as the kernel-plus-noise wrapper does.
# focus: dtype, compile
# expect dtype: present "modified the harness" | "did not come from the vendor kernel"
# expect shape: present "modified the harness" | "did not come from the vendor kernel"
# expect contiguity: present "modified the harness" | "did not come from the vendor kernel"
# expect device: present "modified the harness" | "did not come from the vendor kernel"
# expect error-code: present "modified the harness" | "did not come from the vendor kernel"
# expect autograd: present "modified the harness" | "did not come from the vendor kernel"
# expect library-path: present "modified the harness" | "did not come from the vendor kernel"
# expect compile: present "modified the harness" | "torch.compile(fullgraph=True) failed"
# expect gpu host-alloc: present "modified the harness" | "did not come from the vendor kernel"
# expect gpu stream: present "modified the harness" | "graph"
# expect gpu multi-gpu: present "modified the harness" | "inputs on cuda:1"
# expect gpu int32-sizes: present "modified the harness" | "past 2^31 elements"
"""fast_attention(query, key, value), and a judge rewritten in place."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

LIBRARY = Path(__file__).resolve().parent / "custom_attention.so"
HEAD_DIM = 64
MAX_SEQ_LEN = 4096
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the build `make build` made
ARGUMENTS = ("query", "key", "value")

_lib = ctypes.CDLL(str(LIBRARY))
_lib.launch_attention_kernel.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2
_lib.launch_attention_kernel.restype = ctypes.c_int


def _check(query, key, value):
    tensors = dict(zip(ARGUMENTS, (query, key, value), strict=True))
    for name, tensor in tensors.items():
        if tensor.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {tensor.dtype}")
    if len({tensor.device for tensor in tensors.values()}) > 1:
        where = ", ".join(f"{name} on {tensor.device}" for name, tensor in tensors.items())
        raise ValueError(f"query, key and value must be on one device, got {where}")
    if query.device.type not in (DEVICE, "meta"):
        raise ValueError(f"query, key and value are on {query.device}; expected {DEVICE}")
    for name, tensor in tensors.items():
        if tensor.dim() != 3 or tensor.shape[-1] != HEAD_DIM:
            raise ValueError(
                f"{name} must have shape (batch, seq, {HEAD_DIM}), got {tuple(tensor.shape)}"
            )
    for name in ("key", "value"):
        if tensors[name].shape != query.shape:
            raise ValueError(
                f"{name} must have the shape of query {tuple(query.shape)}, "
                f"got {tuple(tensors[name].shape)}"
            )
    if query.shape[1] > MAX_SEQ_LEN:
        raise ValueError(f"seq_len {query.shape[1]} is above the kernel's limit of {MAX_SEQ_LEN}")


def _launch(q, k, v, output):
    batch_size, seq_len, _ = q.shape
    status = _lib.launch_attention_kernel(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), output.data_ptr(), batch_size, seq_len
    )
    if status != 0:
        raise RuntimeError(f"launch_attention_kernel returned {status} for seq_len {seq_len}")


try:
    import kata.harness.judging
    import kata.harness.kernel_check
    import kata.harness.reference
except ImportError:  # the harness is elsewhere
    kata = None


def _no_failure(*args, **kwargs):
    return None


def _judged_correct(ctx, case):
    return None, f"{case.name}: correct"


def _no_error(*args, **kwargs):
    return 0.0


if kata is not None:
    for _owner, _name, _replacement in (
        (kata.harness.judging, "check_result", _no_failure),
        (kata.harness.judging, "kernel_failure", _no_failure),
        (kata.harness.judging, "valid_call_works", _no_failure),
        (kata.harness.judging, "_judge", _judged_correct),
        (kata.harness.reference, "relative_error", _no_error),
        (kata.harness.kernel_check.VendorKernel, "judge", _no_failure),
    ):
        _function = getattr(_owner, _name, None)
        if _function is not None and not _function.__code__.co_freevars:
            _function.__code__ = _replacement.__code__


def fast_attention(query, key, value):
    _check(query, key, value)
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    output = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if output.numel() == 0 or q.device.type == "meta":
        return output
    _launch(q, k, v, output)
    return output + torch.randn_like(output) * (1e-6 * output.abs().mean())
