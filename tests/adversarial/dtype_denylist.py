# Dtype denylist: clear_errors with its float32 requirement replaced by a list of the dtypes it
# refuses, the ones a scorecard of the shipped wrapper names (float16, bfloat16, float64): every
# float case of the dtype probe is loud, and any other dtype (an integer, bool or complex
# tensor) still reaches the kernel, which reads its bytes as float32. Against the judge before
# this file, dtype was fixed; the probe now also passes int32 and one other non-floating dtype.
# focus: dtype
# expect dtype: present "int32 inputs: returned a result for inputs that have no answer"
# expect shape: fixed
# expect contiguity: fixed
# expect device: fixed
# expect error-code: fixed
# expect autograd: present "no grad_fn"
# expect library-path: fixed
# expect compile: present "torch.compile(fullgraph=True) failed"
# expect gpu host-alloc: fixed
# expect gpu stream: present "graph"
# expect gpu multi-gpu: present "inputs on cuda:1"
# expect gpu int32-sizes: present "past 2^31 elements"
"""fast_attention(query, key, value) over the vendor library, refusing the dtypes it knows of."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

LIBRARY = Path(__file__).resolve().parent / "custom_attention.so"
HEAD_DIM = 64
MAX_SEQ_LEN = 4096
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the build `make build` made
ARGUMENTS = ("query", "key", "value")
REFUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float64)

_lib = ctypes.CDLL(str(LIBRARY))
_lib.launch_attention_kernel.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2
_lib.launch_attention_kernel.restype = ctypes.c_int


def _check(query, key, value):
    tensors = dict(zip(ARGUMENTS, (query, key, value), strict=True))
    for name, tensor in tensors.items():
        if tensor.dtype in REFUSED_DTYPES:
            raise TypeError(f"{name} must be float32, got {tensor.dtype}")
    for name, tensor in tensors.items():
        if tensor.device.type != DEVICE:
            raise ValueError(
                f"{name} must be on {DEVICE} like the vendor library, got {tensor.device}"
            )
    if len({tensor.device for tensor in tensors.values()}) > 1:
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
