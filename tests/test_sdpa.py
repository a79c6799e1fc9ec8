"""fixed.fast_attention as a drop-in for torch.nn.functional.scaled_dot_product_attention, on the
CPU in float64: every argument alone and combined, against SDPA itself on the same inputs (output
and the gradients of query, key and value). Masks (bool and additive, every broadcast), fully
masked rows, is_causal with L < S, L > S, L == S, scale, enable_gqa (GQA and MQA), Ev != E, any
head dim, lengths 1 and 0, leading dims (none, several, broadcast) and non-contiguous views.

Gradients, dropout, opcheck and torch.compile: tests/test_sdpa_autograd.py; bad arguments:
tests/test_sdpa_errors.py; CUDA: tests/test_sdpa_cuda.py. Inputs are fresh each run; replay a
failure with SDPA_SEED=<seed> python -m pytest tests/test_sdpa.py -k <test>.
"""

from __future__ import annotations

import math

import pytest
import torch

import fixed
from tests.sdpa_support import check_like_sdpa, rng_fixture, sdpa64

rng = rng_fixture("SDPA_SEED")

B, H, L, S, E, EV = 2, 3, 5, 7, 8, 6

# Mask shapes for query (B, H, L, E) and S keys: every way a mask broadcasts to (B, H, L, S).
MASK_SHAPES = {
    "(L,S)": (L, S),
    "(1,1,L,S)": (1, 1, L, S),
    "(B,1,L,S)": (B, 1, L, S),
    "(H,L,S)": (H, L, S),
    "(1,H,L,S)": (1, H, L, S),
    "(B,H,L,S)": (B, H, L, S),
    "(1,S) keys only": (1, S),
    "(B,1,1,S) key padding": (B, 1, 1, S),
    "(L,1) rows only": (L, 1),
}


def make_mask(rng, kind, shape):
    if kind == "bool":
        return rng.bool_mask(*shape)
    if kind == "float64":
        return rng.float_mask(*shape)
    return rng.float_mask(*shape, dtype=torch.float32)  # a float32 mask on float64 inputs


@pytest.mark.parametrize("kind", ["bool", "float64", "float32"])
@pytest.mark.parametrize("mask_shape", list(MASK_SHAPES.values()), ids=list(MASK_SHAPES))
def test_attn_mask_broadcasts_like_sdpa(rng, kind, mask_shape):
    q, k, v = rng.qkv((B, H, L, E), (B, H, S, E), (B, H, S, EV))
    mask = make_mask(rng, kind, mask_shape)
    check_like_sdpa(fixed, rng, (q, k, v), attn_mask=mask, where=f"{kind} mask {mask_shape}")


@pytest.mark.parametrize("kind", ["bool", "float64"])
def test_attn_mask_on_3d_and_2d_inputs(rng, kind):
    for q_shape, k_shape, mask_shape in (
        ((B, L, E), (B, S, E), (L, S)),
        ((B, L, E), (B, S, E), (B, L, S)),
        ((B, L, E), (B, S, E), (B, 1, S)),
        ((L, E), (S, E), (L, S)),
        ((L, E), (S, E), (S,)),
    ):
        q, k, v = rng.qkv(q_shape, k_shape, (*k_shape[:-1], EV))
        mask = make_mask(rng, kind, mask_shape)
        where = f"{kind} mask {mask_shape} q{list(q_shape)}"
        check_like_sdpa(fixed, rng, (q, k, v), attn_mask=mask, where=where)


def test_non_contiguous_masks(rng):
    q, k, v = rng.qkv((B, H, L, E), (B, H, S, E), (B, H, S, EV))
    masks = {
        "transposed (S, L) buffer": rng.float_mask(S, L).t(),
        "expanded key bias (stride 0)": rng.float_mask(1, 1, 1, S).expand(B, H, L, S),
        "every other key of a wider mask": rng.bool_mask(B, 1, L, 2 * S)[..., ::2],
        "heads sliced from a bigger mask": rng.float_mask(B, 2 * H, L, S)[:, 1::2],
    }
    for name, mask in masks.items():
        assert not mask.is_contiguous(), name
        check_like_sdpa(fixed, rng, (q, k, v), attn_mask=mask, where=name)


def test_fully_masked_rows_are_zero(rng):
    """A row with no visible key: output 0 and no gradient (torch 2.13's SDPA), never NaN."""
    q, k, v = rng.qkv((B, H, L, E), (B, H, S, E), (B, H, S, EV))
    bool_mask = rng.bool_mask(B, H, L, S)
    bool_mask[0, 1, 2] = False  # one row
    bool_mask[1, :, 0] = False  # row 0 in every head of item 1
    bool_mask[1, 2] = False  # a whole head
    float_mask = torch.where(bool_mask, rng.randn(B, H, L, S), -math.inf)
    dead = ~bool_mask.any(-1)  # (B, H, L)
    for name, mask in (("bool", bool_mask), ("float -inf", float_mask)):
        out, _ = check_like_sdpa(fixed, rng, (q, k, v), attn_mask=mask, where=name)
        assert torch.equal(out[dead], torch.zeros_like(out[dead])), f"{name}: dead rows not 0"
        leaf = q.clone().requires_grad_(True)
        fixed.fast_attention(leaf, k, v, attn_mask=mask).sum().backward()
        dq = leaf.grad[dead]
        assert torch.equal(dq, torch.zeros_like(dq)), f"{name}: dq of dead rows not 0 {rng}"
    all_masked = torch.zeros(L, S, dtype=torch.bool)
    out = fixed.fast_attention(q, k, v, attn_mask=all_masked)
    assert torch.equal(out, torch.zeros_like(out)), f"everything masked: output not 0 {rng}"


def test_large_finite_negative_biases_are_not_masking(rng):
    """A row whose biases are all about -1e4 (finite) still attends: softmax is shift-invariant,
    so only -inf masks a key. (A -1e300 row still gives the right output, but its gradient is
    ill-conditioned for any logsumexp-based backward: s - lse cancels; only the output is
    checked there.)"""
    q, k, v = rng.qkv((B, L, E), (B, S, E), (B, S, EV))
    bias = rng.randn(L, S)
    bias[1] = -1e4 + rng.randn(S)
    out, _ = check_like_sdpa(fixed, rng, (q, k, v), attn_mask=bias, where="-1e4 row")
    assert out[:, 1].abs().sum() > 0, f"a finite row was zeroed {rng}"
    bias[3] = -1e300
    out = fixed.fast_attention(q, k, v, attn_mask=bias)
    error = (out - sdpa64(q, k, v, attn_mask=bias)).abs().max().item()
    assert error <= 1e-12, f"-1e300 row: output error {error:.2e} {rng}"


@pytest.mark.parametrize(
    ("len_q", "len_kv"),
    [(5, 5), (3, 9), (9, 3), (1, 7), (7, 1), (1, 1), (16, 40), (40, 16)],
    ids=lambda n: str(n),
)
def test_is_causal_top_left_for_any_lengths(rng, len_q, len_kv):
    q, k, v = rng.qkv((B, H, len_q, E), (B, H, len_kv, E), (B, H, len_kv, EV))
    check_like_sdpa(fixed, rng, (q, k, v), is_causal=True, where=f"causal L={len_q} S={len_kv}")
    # SDPA's math backend: tril of ones(L, S), whatever L and S; check that meaning directly.
    tril = torch.ones(len_q, len_kv, dtype=torch.bool).tril()
    out = fixed.fast_attention(q, k, v, is_causal=True)
    error = (out - sdpa64(q, k, v, attn_mask=tril)).abs().max().item()
    assert error <= 1e-12, f"is_causal is not tril(ones(L, S)): {error:.2e} {rng}"


@pytest.mark.parametrize("scale", [0.3, -0.7, 2, 0.0, 1e-3, None], ids=str)
def test_scale(rng, scale):
    q, k, v = rng.qkv((B, H, L, E), (B, H, S, E), (B, H, S, EV))
    for is_causal in (False, True):
        where = f"scale={scale} causal={is_causal}"
        check_like_sdpa(fixed, rng, (q, k, v), scale=scale, is_causal=is_causal, where=where)
    mask = rng.float_mask(L, S)
    check_like_sdpa(fixed, rng, (q, k, v), scale=scale, attn_mask=mask, where=f"scale={scale}")


def test_scale_none_is_one_over_sqrt_of_query_head_dim(rng):
    """With Ev != E the default scale comes from E (query's last dim), not Ev."""
    q, k, v = rng.qkv((B, L, 9), (B, S, 9), (B, S, 25))
    expected = sdpa64(q, k, v, scale=1 / 3)
    out = fixed.fast_attention(q, k, v)
    assert (out - expected).abs().max().item() <= 1e-12, f"default scale is not 1/sqrt(E) {rng}"


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=lambda h: f"hkv{h}")
@pytest.mark.parametrize("lead", [(), (2,), (2, 3)], ids=lambda d: f"lead{list(d)}")
def test_enable_gqa(rng, kv_heads, lead):
    q_heads = 4
    q, k, v = rng.qkv((*lead, q_heads, L, E), (*lead, kv_heads, S, E), (*lead, kv_heads, S, EV))
    where = f"GQA Hq={q_heads} Hkv={kv_heads} lead={list(lead)}"
    check_like_sdpa(fixed, rng, (q, k, v), enable_gqa=True, where=where)
    check_like_sdpa(fixed, rng, (q, k, v), enable_gqa=True, is_causal=True, where=where + " causal")
    mask = rng.float_mask(q_heads, L, S)  # a per-query-head mask: not the K/V head's
    check_like_sdpa(fixed, rng, (q, k, v), enable_gqa=True, attn_mask=mask, where=where + " mask")


def test_gqa_reads_the_right_kv_head(rng):
    """Query head h reads key/value head h // (Hq / Hkv): with a value per K/V head constant
    and distinct, every output row shows which head it read."""
    q_heads, kv_heads = 6, 3
    q, k, _ = rng.qkv((2, q_heads, L, E), (2, kv_heads, S, E), (1,))
    v = torch.arange(2 * kv_heads, dtype=torch.float64).view(2, kv_heads, 1, 1).expand(-1, -1, S, 3)
    out = fixed.fast_attention(q, k, v, enable_gqa=True)
    expected = (torch.arange(q_heads) // (q_heads // kv_heads)).view(1, q_heads, 1, 1)
    expected = expected + kv_heads * torch.arange(2).view(2, 1, 1, 1)
    error = (out - expected.double()).abs().max().item()
    assert error <= 1e-12, f"query heads read the wrong K/V heads: {error:.2e} {rng}"


def test_one_kv_head_broadcasts_without_enable_gqa(rng):
    """Hkv == 1 broadcasts like any leading dim of size 1 (SDPA's math backend does)."""
    q, k, v = rng.qkv((B, 4, L, E), (B, 1, S, E), (B, 1, S, EV))
    check_like_sdpa(fixed, rng, (q, k, v), where="Hq=4 Hkv=1 enable_gqa=False")
    check_like_sdpa(fixed, rng, (q, k, v), is_causal=True, where="Hq=4 Hkv=1 causal")


@pytest.mark.parametrize(
    ("head_dim", "head_dim_v"),
    [(24, 40), (64, 8), (1, 5), (7, 1), (3, 300), (264, 3)],
    ids=lambda e: str(e),
)
def test_value_head_dim_differs(rng, head_dim, head_dim_v):
    q, k, v = rng.qkv((B, H, L, head_dim), (B, H, S, head_dim), (B, H, S, head_dim_v))
    for is_causal in (False, True):
        where = f"E={head_dim} Ev={head_dim_v} causal={is_causal}"
        check_like_sdpa(fixed, rng, (q, k, v), is_causal=is_causal, where=where)


@pytest.mark.parametrize("head_dim", [1, 3, 4, 8, 12, 59, 100, 111, 264, 300])
def test_any_head_dim(rng, head_dim):
    q, k, v = rng.qkv((B, H, L, head_dim), (B, H, S, head_dim), (B, H, S, head_dim))
    for is_causal in (False, True):
        where = f"E={head_dim} causal={is_causal}"
        check_like_sdpa(fixed, rng, (q, k, v), is_causal=is_causal, where=where)
    mask = rng.bool_mask(L, S)
    check_like_sdpa(fixed, rng, (q, k, v), attn_mask=mask, where=f"E={head_dim} mask")


@pytest.mark.parametrize(("len_q", "len_kv"), [(1, 1), (1, 9), (9, 1)], ids=str)
def test_length_one(rng, len_q, len_kv):
    q, k, v = rng.qkv((B, H, len_q, E), (B, H, len_kv, E), (B, H, len_kv, EV))
    for kw in ({}, {"is_causal": True}, {"attn_mask": rng.float_mask(len_q, len_kv, neg_inf=0)}):
        check_like_sdpa(fixed, rng, (q, k, v), where=f"L={len_q} S={len_kv} {list(kw)}", **kw)


EMPTY_CASES = {
    "B=0": ((0, H, L, E), (0, H, S, E)),
    "L=0": ((B, H, 0, E), (B, H, S, E)),
    "S=0": ((B, H, L, E), (B, H, 0, E)),
    "L=S=0": ((B, H, 0, E), (B, H, 0, E)),
    "S=0 2-D": ((L, E), (0, E)),
}


@pytest.mark.parametrize("case", list(EMPTY_CASES))
@pytest.mark.parametrize("kw", ["plain", "causal", "bool mask", "float mask"])
def test_empty(rng, case, kw):
    """Zero-size problems: SDPA's shapes; with S = 0 the output is 0 (nothing to attend to)
    and every gradient is 0, of its input's shape."""
    q_shape, k_shape = EMPTY_CASES[case]
    q, k, v = rng.qkv(q_shape, k_shape, (*k_shape[:-1], EV))
    mask_shape = (q_shape[-2], k_shape[-2])
    kwargs = {
        "plain": {},
        "causal": {"is_causal": True},
        "bool mask": {"attn_mask": rng.bool_mask(*mask_shape)},
        "float mask": {"attn_mask": rng.float_mask(*mask_shape)},
    }[kw]
    out, _ = check_like_sdpa(fixed, rng, (q, k, v), where=f"{case} {kw}", **kwargs)
    assert torch.equal(out, torch.zeros_like(out)), f"{case}: output not 0 {rng}"
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    fixed.fast_attention(*leaves, **kwargs).sum().backward()
    for name, leaf in zip(("query", "key", "value"), leaves, strict=True):
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape, f"{case} grad of {name}"
        assert not leaf.grad.any(), f"{case}: gradient of {name} not 0 {rng}"


# (query shape, key shape): leading dims none, one, two, three; then every broadcast SDPA does
# (size-1 dims either side, fewer dims on either side).
LEADING = {
    "2-D": ((L, E), (S, E)),
    "3-D": ((B, L, E), (B, S, E)),
    "4-D": ((B, H, L, E), (B, H, S, E)),
    "5-D": ((2, 2, 2, L, E), (2, 2, 2, S, E)),
    "query batch 2, key batch 1": ((2, H, L, E), (1, H, S, E)),
    "query batch 1, key batch 2": ((1, H, L, E), (2, H, S, E)),
    "query (2,1), key (1,3)": ((2, 1, L, E), (1, 3, S, E)),
    "key has fewer dims": ((2, H, L, E), (H, S, E)),
    "2-D query, 3-D key": ((L, E), (2, S, E)),
}


@pytest.mark.parametrize("case", list(LEADING))
def test_leading_dims_broadcast_like_sdpa(rng, case):
    q_shape, k_shape = LEADING[case]
    q, k, v = rng.qkv(q_shape, k_shape, (*k_shape[:-1], EV))
    check_like_sdpa(fixed, rng, (q, k, v), where=case)
    check_like_sdpa(fixed, rng, (q, k, v), is_causal=True, where=f"{case} causal")
    mask = rng.bool_mask(q_shape[-2], k_shape[-2])
    check_like_sdpa(fixed, rng, (q, k, v), attn_mask=mask, where=f"{case} mask")


def test_value_broadcasts_separately_from_key(rng):
    q, k, v = rng.qkv((2, H, L, E), (2, H, S, E), (1, H, S, EV))
    check_like_sdpa(fixed, rng, (q, k, v), where="value batch 1, key batch 2")


def test_non_contiguous_views(rng):
    """Transposed, sliced and expanded inputs: the gradients flow back through the views."""
    cases = {
        # (B, L, H, E) memory seen as (B, H, L, E): SDPA's usual layout.
        "transposed": (
            rng.qkv((B, L, H, E), (B, S, H, E), (B, S, H, EV)),
            lambda q, k, v: (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
        ),
        "sliced rows and head dims": (
            rng.qkv((B, H, 2 * L, 2 * E), (B, H, 2 * S, 2 * E), (B, H, S, 3 * EV)),
            lambda q, k, v: (q[..., ::2, :E], k[..., 1::2, E:], v[..., ::3]),
        ),
        "expanded (stride 0)": (
            rng.qkv((1, H, L, E), (B, 1, S, E), (1, 1, S, EV)),
            lambda q, k, v: (
                q.expand(B, -1, -1, -1),
                k.expand(-1, H, -1, -1),
                v.expand(B, H, -1, -1),
            ),
        ),
        "2-D transposed": (
            rng.qkv((E, L), (E, S), (EV, S)),
            lambda q, k, v: (q.t(), k.t(), v.t()),
        ),
    }
    for name, (leaves, view) in cases.items():
        assert not all(t.is_contiguous() for t in view(*leaves)), name
        for kw in ({}, {"is_causal": True}, {"attn_mask": rng.float_mask(L, S)}):
            check_like_sdpa(fixed, rng, leaves, view=view, where=f"{name} {list(kw)}", **kw)


def test_everything_combined(rng):
    """Broadcast leading dims, GQA, a broadcast non-contiguous float mask, a custom scale,
    Ev != E and transposed inputs, all at once."""
    q_heads, kv_heads, e, ev = 6, 2, 11, 17
    leaves = rng.qkv((2, 3, L, q_heads, e), (1, 3, S, kv_heads, e), (1, 3, S, kv_heads, ev))

    def view(q, k, v):
        return q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)

    mask = rng.float_mask(1, q_heads, S, L).transpose(-1, -2)  # (1, Hq, L, S) view
    for kw in (
        {"attn_mask": mask, "scale": -0.4},
        {"attn_mask": mask > -math.inf, "scale": 0.9},
        {"is_causal": True, "scale": 1.7},
    ):
        where = f"combined {sorted(kw)}"
        check_like_sdpa(fixed, rng, leaves, view=view, enable_gqa=True, where=where, **kw)


def test_positional_arguments_follow_sdpa(rng):
    """SDPA's positional order: (query, key, value, attn_mask, dropout_p, is_causal)."""
    q, k, v = rng.qkv((B, L, E), (B, S, E), (B, S, EV))
    mask = rng.float_mask(L, S)
    expected = sdpa64(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    assert (fixed.fast_attention(q, k, v, mask, 0.0, False) - expected).abs().max() <= 1e-12
    expected = sdpa64(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
    assert (fixed.fast_attention(q, k, v, None, 0.0, True) - expected).abs().max() <= 1e-12


def test_int_dropout_zero_and_int_scale_are_accepted(rng):
    q, k, v = rng.qkv((B, L, E), (B, S, E), (B, S, EV))
    out = fixed.fast_attention(q, k, v, dropout_p=0, scale=1)
    assert (out - sdpa64(q, k, v, scale=1.0)).abs().max() <= 1e-12, f"{rng}"


def test_no_grad_and_a_detached_mask(rng):
    """A float mask that requires grad is fine under torch.no_grad (nothing to differentiate)."""
    q, k, v = rng.qkv((B, L, E), (B, S, E), (B, S, EV))
    mask = rng.float_mask(L, S, neg_inf=0).requires_grad_(True)
    with torch.no_grad():
        out = fixed.fast_attention(q, k, v, attn_mask=mask)
    assert (out - sdpa64(q, k, v, attn_mask=mask)).abs().max() <= 1e-12, f"{rng}"
    check_like_sdpa(fixed, rng, (q, k, v), attn_mask=mask.detach(), where="detached mask")
