"""fast_attention and the Python side of the fixed_attention operators: the fake kernels (meta
tensors, torch.compile), as pytorch/extension-cpp registers them. The autograd formula is C++
(csrc/attention.cpp), for its host time."""

from __future__ import annotations

import math

import torch

from fixed import _build

_build.load_library()

_SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_CUDA_MAX_HEAD_DIM = 256  # the generic CUDA kernels' largest head-dim bucket
# A tuple, not int | float: torch 2.6's Dynamo cannot trace isinstance with a union type
# (torch.compile fails: "Unexpected type in sourceless builder types.UnionType").
_REAL = (int, float)


def fast_attention(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    """torch.nn.functional.scaled_dot_product_attention, argument for argument, on the CPU and
    CUDA, forward and backward: softmax(query·keyᵀ·scale + mask)·value, with dropout.

    query (..., Hq, L, E), key (..., Hkv, S, E), value (..., Hkv, S, Ev) -> (..., Hq, L, Ev).
    Leading dims broadcast as SDPA broadcasts them. Any head dims E and Ev (at most 256 on CUDA).
    `attn_mask`: bool (True takes part) or floating (added to the scores), broadcastable to
    (..., Hq, L, S); no gradient flows to it (a mask that requires grad is refused).
    `dropout_p`: the keep mask comes from torch's generator (reproducible under
    torch.manual_seed), the backward regenerates it. `is_causal`: query row i sees keys 0..i.
    `scale`: defaults to 1/sqrt(E). `enable_gqa`: Hq a multiple of Hkv, K and V never repeated.
    Second-order gradients raise instead of being silently zero.
    """
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            # The dispatcher would say only "expected Tensor", without the argument's name.
            raise TypeError(f"{name} must be a torch.Tensor; got {type(tensor).__name__}")
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None; got {type(attn_mask).__name__}")
    _check_flag("is_causal", is_causal)
    _check_flag("enable_gqa", enable_gqa)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, _REAL):
        raise TypeError(f"dropout_p must be a float; got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be from 0 to 1; got {dropout_p}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, _REAL)):
        # A tensor scale would be read back to the host (a sync) or traced as a constant.
        raise TypeError(f"scale must be a float or None; got {type(scale).__name__}")
    if query.dim() >= 2 and key.dim() >= 2 and value.dim() >= 2:
        query, key, value = _broadcast_leading_dims(query, key, value, enable_gqa)
    if scale is None:
        # A bad rank or head dim is left to the C++ checks, which say what is wrong.
        head_dim = query.shape[-1] if query.dim() >= 1 else 0
        scale = 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    seed = None
    if dropout_p > 0:
        # From torch's default generator: torch.manual_seed replays the same keep mask.
        seed = torch.randint(0, 2**62, (), dtype=torch.int64)
    output, _ = torch.ops.fixed_attention.attention_forward(
        query, key, value, float(scale), is_causal, attn_mask, enable_gqa, float(dropout_p), seed
    )
    return output


def _check_flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}")


def _broadcast_leading_dims(query, key, value, enable_gqa):
    """query, key and value expanded to one shape of leading dims, as SDPA broadcasts them (the
    operator takes no broadcasting; autograd of expand sums the gradients back). Under
    enable_gqa the heads (dim -3) stay each tensor's own."""
    kept = 3 if enable_gqa and min(query.dim(), key.dim(), value.dim()) >= 3 else 2
    shapes = [tensor.shape[:-kept] for tensor in (query, key, value)]
    if shapes[0] == shapes[1] == shapes[2]:  # the common case, without broadcast_shapes' cost
        return query, key, value
    try:
        leading = torch.broadcast_shapes(*shapes)
    except RuntimeError:
        raise ValueError(
            "query, key and value must have broadcastable leading dims; got query "
            f"{list(query.shape)}, key {list(key.shape)}, value {list(value.shape)}"
        ) from None
    return tuple(
        tensor
        if tensor.shape[:-kept] == leading
        else tensor.expand(*leading, *tensor.shape[-kept:])
        for tensor in (query, key, value)
    )


# Fake and meta tensors never reach the C++ checks (checks.cpp), so the same rules are restated
# here, briefly, with the same error types; torch._check_* also accept symbolic sizes.
def _check_inputs(query, key, value, attn_mask, causal, enable_gqa):
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
    torch._check_value(
        not enable_gqa or query.dim() >= 3,
        lambda: f"enable_gqa needs query of shape (..., Hq, L, E); got {list(query.shape)}",
    )
    for name, tensor in (("key", key), ("value", value)):
        torch._check_type(
            tensor.dtype == query.dtype,
            lambda name=name, tensor=tensor: (
                f"{name} must have query's dtype; got query {_name(query.dtype)}, "
                f"{name} {_name(tensor.dtype)}"
            ),
        )
        torch._check_value(
            tensor.dim() == query.dim() and _same_leading(tensor, query, enable_gqa),
            lambda name=name, tensor=tensor: (
                f"{name} must have query's leading dims; got {name} {list(tensor.shape)}, "
                f"query {list(query.shape)}"
            ),
        )
    torch._check_value(
        query.shape[-1] >= 1 and value.shape[-1] >= 1,
        lambda: (
            f"the head dims E and Ev must be at least 1; got query {list(query.shape)}, "
            f"value {list(value.shape)}"
        ),
    )
    torch._check_value(
        key.dim() < 3 or key.shape[-3] == value.shape[-3],
        lambda: (
            "key and value must have the same number of heads (dim -3); got key "
            f"{list(key.shape)}, value {list(value.shape)}"
        ),
    )
    torch._check_value(
        key.shape[-1] == query.shape[-1] and value.shape[-2] == key.shape[-2],
        lambda: (
            f"key must be (..., S, E) with query's E and value (..., S, Ev) with key's S; got "
            f"query {list(query.shape)}, key {list(key.shape)}, value {list(value.shape)}"
        ),
    )
    if enable_gqa:
        torch._check_value(
            query.shape[-3] % key.shape[-3] == 0,
            lambda: "enable_gqa: query's heads (dim -3) must be a multiple of key's",
        )
    if query.device.type == "cuda":
        torch._check_value(
            query.shape[-1] <= _CUDA_MAX_HEAD_DIM and value.shape[-1] <= _CUDA_MAX_HEAD_DIM,
            lambda: "on CUDA the head dims E and Ev must be at most 256",
        )
    if attn_mask is not None:
        torch._check_value(not causal, lambda: "attn_mask and is_causal=True cannot be combined")
        torch._check_type(
            attn_mask.dtype == torch.bool or attn_mask.dtype.is_floating_point,
            lambda: f"attn_mask must be bool or floating; got {_name(attn_mask.dtype)}",
        )
        torch._check_value(
            attn_mask.device == query.device,
            lambda: f"attn_mask must be on query's device {query.device}",
        )
        scores = (*query.shape[:-1], key.shape[-2])
        torch._check_value(
            _broadcasts_to(attn_mask.shape, scores),
            lambda: (
                f"attn_mask must broadcast to (..., L, S) = {list(scores)}; got "
                f"{list(attn_mask.shape)}"
            ),
        )


def _broadcasts_to(shape, target):
    """`shape` expands to `target` as torch broadcasts: right-aligned, each dim 1 or equal."""
    if len(shape) > len(target):
        return False
    pairs = zip(reversed(shape), reversed(target), strict=False)
    return all(got == 1 or got == want for got, want in pairs)


def _same_leading(tensor, query, enable_gqa):
    return all(
        got == want or (enable_gqa and d == query.dim() - 3)
        for d, (got, want) in enumerate(zip(tensor.shape[:-2], query.shape[:-2], strict=True))
    )


def _name(dtype):
    return str(dtype).removeprefix("torch.")


@torch.library.register_fake("fixed_attention::attention_forward")
def _attention_forward_fake(
    query,
    key,
    value,
    scale,
    causal,
    attn_mask=None,
    enable_gqa=False,
    dropout_p=0.0,
    dropout_seed=None,
):
    _check_inputs(query, key, value, attn_mask, causal, enable_gqa)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    # new_empty(shape): contiguous, as the kernels return, whatever the inputs' strides.
    output = query.new_empty((*query.shape[:-1], value.shape[-1]))
    return output, query.new_empty(query.shape[:-1], dtype=lse_dtype)


@torch.library.register_fake("fixed_attention::attention_backward")
def _attention_backward_fake(
    grad_output,
    query,
    key,
    value,
    output,
    logsumexp,
    scale,
    causal,
    attn_mask=None,
    enable_gqa=False,
    dropout_p=0.0,
    dropout_seed=None,
):
    _check_inputs(query, key, value, attn_mask, causal, enable_gqa)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


# The autograd formula (and the refusal of second-order gradients) is registered in C++, under
# the Autograd key (csrc/attention.cpp): register_autograd's Python path cost more host time
# per training step than the kernels themselves.
