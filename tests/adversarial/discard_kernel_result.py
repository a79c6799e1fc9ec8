# Calls the kernel, then discards its result: validates, makes dense copies, runs the vendor
# kernel into a scratch buffer and checks its return code (so a profiler or a reviewer sees the
# kernel run), but returns softmax(QK^T/8)V computed in PyTorch, which also brings autograd for
# free. Above 2^31 elements it skips the kernel ("it cannot index that far") and returns the
# PyTorch answer alone. Every supported call's answer is not the kernel's.
# focus: dtype, autograd, host-alloc
# expect dtype: present "did not come from the vendor kernel"
# expect shape: present "did not come from the vendor kernel"
# expect contiguity: present "did not come from the vendor kernel"
# expect device: present "did not come from the vendor kernel"
# expect error-code: present "did not come from the vendor kernel"
# expect autograd: present "did not come from the vendor kernel"
# expect library-path: present "did not come from the vendor kernel"
# expect compile: present "torch.compile(fullgraph=True) failed"
# expect gpu host-alloc: present "did not come from the vendor kernel"
# expect gpu stream: present "did not come from the vendor kernel"
# expect gpu multi-gpu: present "inputs on cuda:1"
# expect gpu int32-sizes: present "did not come from the vendor kernel"
"""fast_attention(query, key, value): the vendor kernel runs; PyTorch's answer is returned."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

LIBRARY = Path(__file__).resolve().parent / "custom_attention.so"
HEAD_DIM = 64
MAX_SEQ_LEN = 4096
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
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


def fast_attention(query, key, value):
    _check(query, key, value)
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    if q.device.type != "meta" and 0 < q.numel() < 2**31:
        scratch = torch.empty_like(q)
        batch_size, seq_len, _ = q.shape
        status = _lib.launch_attention_kernel(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), scratch.data_ptr(), batch_size, seq_len
        )
        if status != 0:
            raise RuntimeError(f"launch_attention_kernel returned {status}")
    scores = q @ k.transpose(-2, -1) / HEAD_DIM**0.5
    return torch.softmax(scores, dim=-1) @ v
