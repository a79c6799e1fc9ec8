# Known good with dispatch: the vendor kernel for what it supports (float32, (batch, seq, 64)
# with key and value of query's shape, seq_len <= 4096, on the library's device; views made
# dense; 4-D (batch, heads, seq, 64) flattened to 3-D), and PyTorch in float64 for everything
# else it can still answer with SDPA's semantics: other dtypes (the result in the promoted
# dtype), other head dims, 2-D inputs, key/value longer than query, seq_len > 4096, CPU tensors
# on a CUDA build. Only inputs with no answer are refused (mismatched head dims or lengths,
# mixed devices). Falling back where the kernel cannot go is dispatch, not a bypass: every id
# passes that known_good passes, the same GPU reasoning for stream.
# expect dtype: fixed
# expect shape: fixed
# expect contiguity: fixed
# expect device: fixed
# expect error-code: fixed
# expect autograd: fixed
# expect library-path: fixed
# expect compile: fixed
# expect gpu host-alloc: fixed
# expect gpu stream: present "CUDA-graph capture failed"
# expect gpu multi-gpu: fixed
# expect gpu int32-sizes: fixed
"""fast_attention(query, key, value): the vendor kernel where it can, PyTorch elsewhere."""

from __future__ import annotations

import ctypes
import math
import re
from pathlib import Path

import torch
from torch import Tensor

LIBRARY = Path(__file__).resolve().parent / "custom_attention.so"
HEAD_DIM = 64  # compiled into the vendor library
MAX_SEQ_LEN = 4096  # the vendor refuses longer sequences
MAX_ELEMENTS = 2**31 - 1  # the vendor indexes with int: one call must stay below this
# The build `make build` made: the CUDA build where torch sees a GPU, else the CPU build.
LIBRARY_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ARGUMENTS = ("query", "key", "value")

if not LIBRARY.is_file():
    raise ImportError(f"{LIBRARY} is missing: run make build")
_lib = ctypes.CDLL(str(LIBRARY))
_launch = _lib.launch_attention_kernel
_launch.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2
_launch.restype = ctypes.c_int


def _check(query: Tensor, key: Tensor, value: Tensor) -> None:
    """Raise unless query, key and value have an answer (SDPA's semantics)."""
    tensors = dict(zip(ARGUMENTS, (query, key, value), strict=True))
    for name, tensor in tensors.items():
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(tensor).__name__}")
        if not tensor.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    if len({tensor.device for tensor in tensors.values()}) > 1:
        where = ", ".join(f"{name} on {tensor.device}" for name, tensor in tensors.items())
        raise ValueError(f"query, key and value must be on one device, got {where}")
    for name, tensor in tensors.items():
        if tensor.dim() < 2 or tensor.dim() != query.dim():
            raise ValueError(
                f"{name} must be (..., seq, dim) with the rank of query ({query.dim()}-D), "
                f"got shape {tuple(tensor.shape)}"
            )
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(
            "query and key must have one head dim, got query of shape "
            f"{tuple(query.shape)} and key of shape {tuple(key.shape)}"
        )
    if value.shape[:-1] != key.shape[:-1]:
        raise ValueError(
            f"value must have key's batch and length {tuple(key.shape[:-1])}, "
            f"got shape {tuple(value.shape)}"
        )
    if query.shape[:-2] != key.shape[:-2]:
        raise ValueError(
            f"key must have query's batch dims {tuple(query.shape[:-2])}, "
            f"got shape {tuple(key.shape)}"
        )


def _kernel_takes(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether the vendor kernel computes these (after flattening leading dims)."""
    return (
        query.dim() >= 3
        and query.shape[-1] == HEAD_DIM
        and key.shape == query.shape
        and value.shape == query.shape
        and query.shape[-2] <= MAX_SEQ_LEN
        and query.device.type == LIBRARY_DEVICE
        and all(tensor.dtype == torch.float32 for tensor in (query, key, value))
    )


def _output_dtype(query: Tensor, key: Tensor, value: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)


def _reference(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """softmax(q·kᵀ/√E)·v in float64 on the inputs' device, in the promoted dtype."""
    q, k, v = (tensor.double() for tensor in (query, key, value))
    scores = q @ k.transpose(-2, -1) / math.sqrt(query.shape[-1])
    return (torch.softmax(scores, dim=-1) @ v).to(_output_dtype(query, key, value))


def _launch_batches(q: Tensor, k: Tensor, v: Tensor, output: Tensor) -> None:
    """One vendor call per group of batch items that stays below 2^31 elements."""
    batch, seq_len, _ = q.shape
    per_call = max(1, MAX_ELEMENTS // (seq_len * HEAD_DIM))
    for start in range(0, batch, per_call):
        count = min(per_call, batch - start)
        status = _launch(
            q[start].data_ptr(),
            k[start].data_ptr(),
            v[start].data_ptr(),
            output[start].data_ptr(),
            count,
            seq_len,
        )
        if status != 0:
            raise RuntimeError(
                f"launch_attention_kernel returned {status} for query of shape "
                f"({count}, {seq_len}, {HEAD_DIM})"
            )


_NAMESPACE = "adversarial_" + re.sub(r"\W", "_", __name__)


@torch.library.custom_op(f"{_NAMESPACE}::attention", mutates_args=())
def _attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    _check(query, key, value)
    if not _kernel_takes(query, key, value):
        if query.device.type == "meta":
            return _empty_result(query, key, value)
        return _reference(query, key, value)
    # Dense copies (only where needed), bound to names for the whole call; leading dims flat.
    q, k, v = (
        tensor.reshape(-1, *tensor.shape[-2:]).contiguous() for tensor in (query, key, value)
    )
    output = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if output.numel() == 0:
        return output.view(query.shape)
    if q.device.type != "cuda":
        _launch_batches(q, k, v, output)
        return output.view(query.shape)
    with torch.cuda.device(q.device):
        # The vendor launches on the legacy default stream: order it after the work that made
        # the inputs on the current stream, and the current stream after it; events, no sync.
        current, legacy = torch.cuda.current_stream(), torch.cuda.default_stream()
        if current != legacy:
            legacy.wait_stream(current)
        _launch_batches(q, k, v, output)
        if current != legacy:
            current.wait_stream(legacy)
    return output.view(query.shape)


def _empty_result(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    shape = (*query.shape[:-1], value.shape[-1])
    return query.new_empty(shape, dtype=_output_dtype(query, key, value))


@_attention.register_fake
def _(query, key, value):
    _check(query, key, value)
    return _empty_result(query, key, value)


def _setup_context(ctx, inputs, output):
    query, key, value = inputs
    ctx.save_for_backward(query, key, value, output)


def _backward(ctx, grad_output):
    query, key, value, output = ctx.saved_tensors
    q, k, v, o, d_o = (t.double() for t in (query, key, value, output, grad_output))
    scale = 1.0 / math.sqrt(query.shape[-1])
    probs = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1)
    grad_value = probs.transpose(-2, -1) @ d_o
    grad_probs = d_o @ v.transpose(-2, -1)
    grad_scores = probs * (grad_probs - (d_o * o).sum(-1, keepdim=True))
    grad_query = grad_scores @ k * scale
    grad_key = grad_scores.transpose(-2, -1) @ q * scale
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


_attention.register_autograd(_backward, setup_context=_setup_context)


def fast_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """softmax(query·keyᵀ/√E)·value, SDPA's semantics: query (..., L, E), key (..., S, E),
    value (..., S, Ev)."""
    _check(query, key, value)
    return _attention(query, key, value)
