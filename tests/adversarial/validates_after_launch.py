# Validates after the launch: clear_errors' careful wrapper with its checks moved after the kernel
# call. Every refusal is clear, but the kernel has already read past the inputs it cannot take
# (float16 read as float32, head dim 32 read as 64, an expanded value read as dense). Those reads
# used to land in an allocator's neighbouring bytes unseen (a float32 output, so nothing was
# written past one): dtype, shape and contiguity were fixed on both kinds of machine. Probe inputs
# now end where their mapping ends, so the first read past one faults (SIGSEGV on a CPU, an illegal
# address on a GPU) and fails that case alone: dtype and shape present, contiguity partial.
# focus: dtype, shape, contiguity
# expect cpu dtype: present "SIGSEGV"
# expect gpu dtype: present "CUDA failed after the call returned"
# expect cpu shape: present "SIGSEGV"
# expect gpu shape: present "CUDA failed after the call returned"
# expect contiguity: partial "value unchecked"
# expect device: present
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
    # The launch first, the checks after: every refusal is clear, but comes too late.
    if query.dim() == 3 and query.numel() > 0:
        batch_size, seq_len, _ = query.shape
        output = torch.empty(query.shape, dtype=torch.float32, device=query.device)
        status = _lib.launch_attention_kernel(
            query.data_ptr(),
            key.data_ptr(),
            value.data_ptr(),
            output.data_ptr(),
            batch_size,
            seq_len,
        )
    _check(query, key, value)
    batch_size, seq_len, _ = query.shape
    if query.numel() == 0:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if status != 0:
        raise RuntimeError(f"launch_attention_kernel returned {status} for seq_len {seq_len}")
    return output
