# Unclear errors: checks everything, but no message names the problem: a bare assert for the
# dtypes (AssertionError, no message), ValueError("bad input") for devices and shapes, an
# exception class that was never defined for non-contiguous views (a NameError on the error
# path nobody ran; lint: noqa F821), RuntimeError("kernel failed") for the return code. Loud,
# but telling the caller nothing: none of it counts.
# focus: dtype, shape, contiguity, error-code
# expect dtype: present "does not name the problem"
# expect shape: present "does not name the problem"
# expect contiguity: present "does not name the problem"
# expect device: present "does not name the problem"
# expect error-code: present "does not name the problem"
# expect autograd: present "no grad_fn"
# expect library-path: fixed
# expect compile: present "torch.compile(fullgraph=True) failed"
# expect gpu host-alloc: fixed
# expect gpu stream: present "graph"
# expect gpu multi-gpu: present "inputs on cuda:1"
# expect gpu int32-sizes: present "past 2^31 elements"
"""fast_attention(query, key, value), strict and terse."""

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


def fast_attention(query, key, value):
    tensors = (query, key, value)
    assert all(tensor.dtype == torch.float32 for tensor in tensors)
    if any(tensor.device.type != DEVICE for tensor in tensors):
        raise ValueError("bad input")
    if any(tensor.dim() != 3 or tensor.shape != query.shape for tensor in tensors):
        raise ValueError("bad input")
    if query.shape[-1] != HEAD_DIM:
        raise ValueError("bad input")
    if not all(tensor.is_contiguous() for tensor in tensors):
        raise StridedInputError()  # noqa: F821
    output = torch.empty_like(query)
    batch_size, seq_len, _ = query.shape
    status = _lib.launch_attention_kernel(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), output.data_ptr(), batch_size, seq_len
    )
    if status != 0:
        raise RuntimeError("kernel failed")
    return output
