"""fast_attention and the Python side of the fixed_attention operators: fake kernels (meta
tensors, torch.compile) and the autograd formula, as pytorch/extension-cpp registers them."""

from __future__ import annotations

import math

import torch

from fixed import _build

_build.load_library()

_SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def fast_attention(query, key, value, *, scale=None, causal=False):
    """softmax(query·keyᵀ·scale)·value, as scaled_dot_product_attention computes it.

    query (..., L, E), key (..., S, E), value (..., S, E), the same leading dims (no
    broadcasting); E a multiple of 8 from 16 to 256. `scale` defaults to 1/sqrt(E); `causal`
    masks as SDPA's is_causal (query row i sees keys 0..i). Returns (..., L, E).
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            # The dispatcher would say only "expected Tensor", without the argument's name.
            raise TypeError(f"{name} must be a torch.Tensor; got {type(tensor).__name__}")
    if scale is None:
        # A bad rank or head dim is left to the C++ checks, which say what is wrong.
        head_dim = query.shape[-1] if query.dim() >= 1 else 0
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    output, _ = torch.ops.fixed_attention.attention_forward(query, key, value, scale, causal)
    return output


# Fake and meta tensors never reach the C++ checks (checks.cpp), so the same rules are restated
# here, briefly, with the same error types; torch._check_* also accept symbolic sizes.
def _check_inputs(query, key, value):
    torch._check_type(
        query.dtype in _SUPPORTED_DTYPES,
        lambda: f"query must be float32, float64, float16 or bfloat16; got {_name(query.dtype)}",
    )
    torch._check_value(
        query.device == key.device == value.device,
        lambda: (
            "query, key and value must be on one device; got query on "
            f"{query.device}, key on {key.device}, value on {value.device}"
        ),
    )
    torch._check_value(
        query.dim() >= 2, lambda: f"query must have shape (..., L, E); got {list(query.shape)}"
    )
    head_dim = query.shape[-1]
    torch._check_value(
        head_dim % 8 == 0 and 16 <= head_dim <= 256,
        lambda: f"query's head dim E must be a multiple of 8 from 16 to 256; got {head_dim}",
    )
    _check_like_query("key", key, query, key.shape[-2] if key.dim() >= 2 else None)
    _check_like_query("value", value, query, key.shape[-2])


def _check_like_query(name, tensor, query, len_kv):
    """tensor (..., S, E): query's dtype, leading dims and head dim, key's length S."""
    torch._check_type(
        tensor.dtype == query.dtype,
        lambda: (
            f"{name} must have query's dtype; got query {_name(query.dtype)}, "
            f"{name} {_name(tensor.dtype)}"
        ),
    )
    expected = [*query.shape[:-2], len_kv, query.shape[-1]]
    torch._check_value(
        tensor.dim() == query.dim()
        and all(got == want for got, want in zip(tensor.shape, expected, strict=True)),
        lambda: (
            f"{name} must have shape {expected} (query's leading dims and head dim, "
            f"key's length); got {list(tensor.shape)}"
        ),
    )


def _name(dtype):
    return str(dtype).removeprefix("torch.")


@torch.library.register_fake("fixed_attention::attention_forward")
def _attention_forward_fake(query, key, value, scale, causal):
    _check_inputs(query, key, value)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    # new_empty(shape): contiguous, as the kernels return, whatever the inputs' strides.
    return query.new_empty(query.shape), query.new_empty(query.shape[:-1], dtype=lse_dtype)


@torch.library.register_fake("fixed_attention::attention_backward")
def _attention_backward_fake(grad_output, query, key, value, output, logsumexp, scale, causal):
    _check_inputs(query, key, value)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


def _setup_context(ctx, inputs, output):
    query, key, value, scale, causal = inputs
    out, logsumexp = output
    ctx.save_for_backward(query, key, value, out, logsumexp)
    ctx.scale, ctx.causal = scale, causal
    # logsumexp is an auxiliary output for the backward: no gradient flows through it.
    ctx.mark_non_differentiable(logsumexp)


def _backward(ctx, grad_output, _grad_logsumexp):
    query, key, value, out, logsumexp = ctx.saved_tensors
    grad_query, grad_key, grad_value = torch.ops.fixed_attention.attention_backward(
        grad_output, query, key, value, out, logsumexp, ctx.scale, ctx.causal
    )
    return grad_query, grad_key, grad_value, None, None


torch.library.register_autograd(
    "fixed_attention::attention_forward", _backward, setup_context=_setup_context
)
