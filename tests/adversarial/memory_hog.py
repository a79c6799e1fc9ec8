# Exhausts the sandbox's memory: the careful wrapper (clear_errors) that, on every call, first
# hoards host memory in 1 GiB tensors until an allocation fails, and lets that failure out. The
# hoard is never touched (a judge without the memory cap lends it address space, not memory) and
# stops at 1 TiB, so it cannot take a machine without the cap down: there the wrapper goes on
# and earns clear_errors' verdicts. With the cap, every call raises PyTorch's "can't allocate
# memory", which the evidence names as the cap it ran into (the runner holding on, or dying):
# present everywhere (compile: dynamo cannot trace the ctypes call, and the hoard it traces is
# fake).
# focus: dtype, error-code
# expect dtype: present "memory cap"
# expect shape: present "memory cap"
# expect contiguity: present "memory cap"
# expect device: present "memory cap"
# expect error-code: present "memory cap"
# expect autograd: present "memory cap"
# expect library-path: present "memory cap"
# expect compile: present "torch.compile(fullgraph=True) failed"
# expect gpu host-alloc: present "memory cap"
# expect gpu stream: present "memory cap"
# expect gpu multi-gpu: present "memory cap"
# expect gpu int32-sizes: present "memory cap"
"""fast_attention(query, key, value) over the vendor library, after a memory hoard."""

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


_HOARD = []
CHUNK = 2**30
BOUND = 2**40  # without a cap: 1 TiB of untouched address space, then on with the work


def _hoard():
    while len(_HOARD) * CHUNK < BOUND:
        _HOARD.append(torch.empty(CHUNK, dtype=torch.uint8))  # never touched


def fast_attention(query, key, value):
    _hoard()
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
