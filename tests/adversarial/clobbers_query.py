# Writes the answer into the caller's query: the careful wrapper, but "to save an allocation" the
# kernel writes its output over query's buffer (when query is dense) and returns it. Each row's
# query is read before its output row is written, so the returned values are right, but the
# caller's query is destroyed: silent corruption of the caller's data, and the call must fail
# for it. The runner compares the inputs before and after each call and the judge says which
# one was written into.
# focus: dtype, contiguity, host-alloc
# expect dtype: present "wrote into its input query"
# expect shape: present "wrote into its input query"
# expect contiguity: present "wrote into its input query"
# expect device: present "wrote into its input query"
# expect error-code: present "wrote into its input query"
# expect autograd: present "no grad_fn"
# expect library-path: present "wrote into its input query"
# expect compile: present "torch.compile(fullgraph=True) failed"
# expect gpu host-alloc: present
# expect gpu stream: present "graph"
# expect gpu multi-gpu: present "inputs on cuda:1"
# expect gpu int32-sizes: present "past 2^31 elements"
"""fast_attention(query, key, value), in place."""

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


def fast_attention(query, key, value):
    _check(query, key, value)
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    if q.numel() == 0 or q.device.type == "meta":
        return torch.empty_like(q)
    _launch(q, k, v, q)  # row by row, each query row is read before its output row is written
    return q
