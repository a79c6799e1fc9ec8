# SDPA bypass: validates all three arguments like a careful wrapper, then returns
# F.scaled_dot_product_attention and never calls the vendor kernel (it does not even load it).
# Autograd, compile and the GPU checks all "work", because nothing of the vendor's runs: every
# probe's supported control call gives an answer that is not the kernel's.
# focus: dtype, autograd, library-path, compile, host-alloc, stream
# expect dtype: present "did not come from the vendor kernel"
# expect shape: present "did not come from the vendor kernel"
# expect contiguity: present "did not come from the vendor kernel"
# expect device: present "did not come from the vendor kernel"
# expect error-code: present "did not come from the vendor kernel"
# expect autograd: present "did not come from the vendor kernel"
# expect library-path: present "did not come from the vendor kernel"
# expect compile: present "did not come from the vendor kernel"
# expect gpu host-alloc: present "did not come from the vendor kernel"
# expect gpu stream: present "did not come from the vendor kernel"
# expect gpu multi-gpu: present "did not come from the vendor kernel"
# expect gpu int32-sizes: present "did not come from the vendor kernel"
"""fast_attention(query, key, value): validated, then PyTorch's own attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

HEAD_DIM = 64
MAX_SEQ_LEN = 4096
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ARGUMENTS = ("query", "key", "value")


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
    return F.scaled_dot_product_attention(query, key, value)
