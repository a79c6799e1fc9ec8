"""The float64 reference every probe and test compares against, and how close is close enough."""

from __future__ import annotations

import math

import torch

# Relative error ‖out − ref‖ / ‖ref‖ allowed per input dtype. Float accumulation lands far
# below these; the storage dtype's rounding sets the floor for half precision.
TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 3e-2,
}


def attention(query, key, value, *, scale=None, causal=False):
    """softmax(q·kᵀ·scale)·v in float64 on the CPU, with SDPA's semantics.

    query (..., L, E), key (..., S, E), value (..., S, E). `causal` masks as SDPA's
    `is_causal`: top-left aligned, query i sees keys 0..i. With S == 0 the result is zeros.
    """
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (query, key, value))
    return _attention64(q, k, v, scale, causal)


def attention_with_grads(query, key, value, grad_output, *, scale=None, causal=False):
    """The reference output and d(output·grad_output)/d(query, key, value), all float64."""
    q, k, v = (
        t.detach().to("cpu", torch.float64).requires_grad_(True) for t in (query, key, value)
    )
    out = _attention64(q, k, v, scale, causal)
    out.backward(grad_output.detach().to("cpu", torch.float64))
    return out.detach(), q.grad, k.grad, v.grad


def logsumexp(query, key, *, scale=None, causal=False):
    """float64 log-sum-exp of each row of scale·QKᵀ, masked as SDPA's is_causal: the logsumexp
    rows the forward op returns (-inf for a row with no keys)."""
    q, k = (t.detach().to("cpu", torch.float64) for t in (query, key))
    return _scores64(q, k, scale, causal).logsumexp(dim=-1)


def _scores64(q, k, scale, causal):
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


def _attention64(q, k, v, scale, causal):
    return torch.softmax(_scores64(q, k, scale, causal), dim=-1) @ v


def relative_error(result, reference, floor: float = 0.0) -> float:
    """‖result − reference‖ / max(‖reference‖, floor) in float64; inf when result has NaN or
    inf. `floor` is the scale to measure against where the exact result is (near) zero."""
    result = result.detach().to("cpu", torch.float64)
    if not torch.isfinite(result).all():
        return math.inf
    denominator = max(reference.norm().item(), floor)
    error = (result - reference).norm().item()
    return error / denominator if denominator > 0 else error


def close_enough(result, reference, dtype) -> bool:
    return relative_error(result, reference) <= TOLERANCE[dtype]


def random_inputs(*shape, dtype=torch.float32, device="cpu", generator=None, kv_len=None):
    """Fresh standard-normal query, key, value of shape (..., L, E); key/value get kv_len rows."""
    kv_shape = (*shape[:-2], shape[-2] if kv_len is None else kv_len, shape[-1])
    return tuple(
        torch.randn(s, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
        for s in (shape, kv_shape, kv_shape)
    )
