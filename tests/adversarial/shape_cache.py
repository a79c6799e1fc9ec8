# Per-shape cache: a careful wrapper that "memoises" its output by (shape, dtype, device): the
# first call of a shape runs the kernel, every later call of that shape returns that first
# tensor whatever the data. The first checked call before a probe's own takes the shape of that
# call, on fresh data, so the probe's own call gets the cached answer in every probe that makes
# one of a supported shape.
# focus: dtype, contiguity, library-path, host-alloc, stream
# expect dtype: present "wrong result"
# expect shape: present "wrong result"
# expect contiguity: present "wrong result"
# expect device: present "wrong result"
# expect error-code: present "wrong result"
# expect autograd: present "no grad_fn"
# expect library-path: present "wrong result"
# expect compile: present "wrong result" | "fullgraph=True) failed"
# expect gpu host-alloc: present "wrong result"
# expect gpu stream: present "wrong in"
# expect gpu multi-gpu: present "inputs on cuda:1"
# expect gpu int32-sizes: present
"""fast_attention(query, key, value), memoised per shape."""

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


_cache: dict[tuple, torch.Tensor] = {}


def fast_attention(query, key, value):
    _check(query, key, value)
    signature = (tuple(query.shape), query.dtype, query.device)
    if signature in _cache:
        return _cache[signature]
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    output = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if output.numel() == 0 or q.device.type == "meta":
        return output
    _launch(q, k, v, output)
    _cache[signature] = output
    return output
