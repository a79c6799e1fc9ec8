# Warnings instead of errors: every check is there with a clear message, but as warnings.warn,
# and then it computes anyway (dense copies, output from empty_like of the dense query, return
# code "checked" with a warning too). Invalid inputs reach the kernel as before: garbage or a
# crash, next to a warning nobody reads. (Were the probes run with warnings as errors, these
# would be loud: the harness must not run them so.) On a GPU, CPU inputs reach the CUDA kernel:
# an illegal access, or with HMM a plausible answer, so the first failing case varies.
# focus: dtype, error-code
# expect dtype: present "float16 inputs"
# expect shape: present "head dim 32"
# expect contiguity: fixed
# expect cpu device: present "process died with SIGSEGV"
# expect gpu device: present
# expect error-code: present "seq_len 4097: wrong result"
# expect autograd: present "no grad_fn"
# expect library-path: fixed
# expect compile: present "torch.compile(fullgraph=True) failed"
# expect gpu host-alloc: fixed
# expect gpu stream: present "graph"
# expect gpu multi-gpu: present "inputs on cuda:1"
# expect gpu int32-sizes: present "past 2^31 elements"
"""fast_attention(query, key, value), which complains and carries on."""

from __future__ import annotations

import ctypes
import warnings
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


def _warn_unless_valid(query, key, value):
    try:
        _check(query, key, value)
    except (TypeError, ValueError) as problem:
        warnings.warn(f"fast_attention: {problem}", stacklevel=3)


def fast_attention(query, key, value):
    _warn_unless_valid(query, key, value)
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    output = torch.empty_like(q)
    batch_size, seq_len, _ = q.shape
    status = _lib.launch_attention_kernel(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), output.data_ptr(), batch_size, seq_len
    )
    if status != 0:
        warnings.warn(f"launch_attention_kernel returned {status}", stacklevel=2)
    return output
