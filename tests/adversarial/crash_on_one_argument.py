# Crashes on one argument: clear_errors' careful wrapper with key left out of its device check. A
# meta key next to a good query reaches the kernel as a null pointer (SIGSEGV on a CPU; on a GPU
# an illegal address that poisons the CUDA context, as a CPU key does). The crash used to end the
# device probe before the cases of value ran: present. A crash now fails its own case, the next
# case runs in a fresh runner, and credit follows the rubric: query and value handled, partial.
# focus: device
# expect dtype: fixed
# expect shape: fixed
# expect contiguity: fixed
# expect device: partial "key unchecked"
# expect error-code: fixed
# expect autograd: present "no grad_fn"
# expect library-path: fixed
# expect compile: present "torch.compile(fullgraph=True) failed"
# expect gpu host-alloc: fixed
# expect gpu stream: present "graph"
# expect gpu multi-gpu: present "inputs on cuda:1"
# expect gpu int32-sizes: present "past 2^31 elements"
"""fast_attention(query, key, value) over the vendor library, with its inputs checked."""

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
    for name, tensor in tensors.items():
        if name != "key" and tensor.device.type != DEVICE:
            raise ValueError(
                f"{name} must be on {DEVICE} like the vendor library, got {tensor.device}"
            )
    if len({tensors[name].device for name in ("query", "value")}) > 1:
        where = ", ".join(f"{name} on {tensor.device}" for name, tensor in tensors.items())
        raise ValueError(f"query, key and value must be on one device, got {where}")
    for name, tensor in tensors.items():
        if tensor.dim() != 3 or tensor.shape[-1] != HEAD_DIM:
            raise ValueError(
                f"{name} must have shape (batch, seq, {HEAD_DIM}), got {tuple(tensor.shape)}"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
    for name in ("key", "value"):
        if tensors[name].shape != query.shape:
            raise ValueError(
                f"{name} must have the shape of query {tuple(query.shape)}, "
                f"got {tuple(tensors[name].shape)}"
            )
    if query.shape[1] > MAX_SEQ_LEN:
        raise ValueError(f"seq_len {query.shape[1]} is above the kernel's limit of {MAX_SEQ_LEN}")


def fast_attention(query, key, value):
    _check(query, key, value)
    batch_size, seq_len, _ = query.shape
    output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if output.numel() == 0:
        return output
    status = _lib.launch_attention_kernel(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), output.data_ptr(), batch_size, seq_len
    )
    if status != 0:
        raise RuntimeError(f"launch_attention_kernel returned {status} for seq_len {seq_len}")
    return output
