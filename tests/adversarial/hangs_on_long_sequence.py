# Hang on some inputs: the careful wrapper without the seq_len check, which retries the launch
# until the kernel accepts it ("transient errors"). seq_len > 4096 is never accepted: it sleeps
# forever (sleeping, not spinning, so it costs CI nothing but the time limit).
# focus: error-code
# A 30 s limit on the CPU, not the harness's 60: the hang costs CI half as long, and the compile
# probe (torch.compile on two busy cores) still finishes well inside it (10 s was once too few).
# timeout cpu: 30
# expect dtype: fixed
# expect shape: fixed
# expect contiguity: fixed
# expect device: fixed
# expect error-code: present "timed out after"
# expect autograd: present "no grad_fn"
# expect library-path: fixed
# expect compile: present "torch.compile(fullgraph=True) failed"
# expect gpu host-alloc: fixed
# expect gpu stream: present "graph"
# expect gpu multi-gpu: present "inputs on cuda:1"
# expect gpu int32-sizes: present "past 2^31 elements"
"""fast_attention(query, key, value) that retries failed launches."""

from __future__ import annotations

import ctypes
import time
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
    output = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if output.numel() == 0 or q.device.type == "meta":
        return output
    batch_size, seq_len, _ = q.shape
    while _lib.launch_attention_kernel(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), output.data_ptr(), batch_size, seq_len
    ):
        time.sleep(0.05)  # transient: try again
    return output
