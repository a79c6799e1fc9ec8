"""fixed.fast_attention's gradients and dropout on the CPU in float64: gradcheck for every
feature, the dropout keep mask (reproducible, the spec's Philox, scaled by 1/(1-p), the same in
the backward), second-order gradients (loud, never silently zero), torch.library.opcheck on the
new arguments, torch.compile(fullgraph=True) and meta tensors.

Inputs are fresh each run; replay a failure with SDPA_SEED=<seed> python -m pytest
tests/test_sdpa_autograd.py -k <test>.
"""

from __future__ import annotations

import math

import pytest
import torch

import fixed
from tests.sdpa_support import (
    FLOAT64_TOLERANCE,
    PHILOX_ROUNDS,
    check_like_sdpa,
    keep_mask,
    philox4x32,
    rng_fixture,
    sdpa64,
)

rng = rng_fixture("SDPA_SEED")
forward_op = torch.ops.fixed_attention.attention_forward
backward_op = torch.ops.fixed_attention.attention_backward


def leaves(*tensors):
    return tuple(t.detach().clone().requires_grad_(True) for t in tensors)


# ------------------------------------------------------------------------------- gradcheck

# (id, query, key, value shapes, kwargs maker): E = 4, L = 3, S = 5 unless the case is about them.
GRADCHECK_CASES = {
    "plain": ((2, 3, 4), (2, 5, 4), (2, 5, 4), lambda rng: {}),
    "causal L<S": ((2, 3, 4), (2, 5, 4), (2, 5, 4), lambda rng: {"is_causal": True}),
    "causal L>S": ((2, 5, 4), (2, 3, 4), (2, 3, 4), lambda rng: {"is_causal": True}),
    "float mask": (
        (2, 3, 4),
        (2, 5, 4),
        (2, 5, 4),
        lambda rng: {"attn_mask": rng.float_mask(3, 5)},
    ),
    "bool mask, a dead row": (
        (2, 3, 4),
        (2, 5, 4),
        (2, 5, 4),
        lambda rng: {"attn_mask": torch.tensor([[1, 0, 1, 1, 0], [0] * 5, [0, 0, 1, 0, 0]]) > 0},
    ),
    "GQA 4/2": ((1, 4, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), lambda rng: {"enable_gqa": True}),
    "MQA 4/1": ((1, 4, 3, 4), (1, 1, 5, 4), (1, 1, 5, 4), lambda rng: {"enable_gqa": True}),
    "Ev != E": ((2, 3, 4), (2, 5, 4), (2, 5, 6), lambda rng: {}),
    "broadcast batch": ((2, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 3), lambda rng: {}),
    "negative scale": ((2, 3, 4), (2, 5, 4), (2, 5, 4), lambda rng: {"scale": -0.8}),
    "odd head dim 3": ((2, 3, 3), (2, 5, 3), (2, 5, 3), lambda rng: {"is_causal": True}),
    "all combined": (
        (2, 4, 3, 5),
        (1, 2, 5, 5),
        (1, 2, 5, 2),
        lambda rng: {"enable_gqa": True, "attn_mask": rng.float_mask(4, 3, 5), "scale": 0.7},
    ),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck(rng, case):
    q_shape, k_shape, v_shape, make_kwargs = GRADCHECK_CASES[case]
    q, k, v = leaves(*rng.qkv(q_shape, k_shape, v_shape))
    kwargs = make_kwargs(rng)
    assert torch.autograd.gradcheck(
        lambda q, k, v: fixed.fast_attention(q, k, v, **kwargs), (q, k, v)
    ), f"{case} {rng}"


def test_gradcheck_with_dropout_through_the_operator(rng):
    """Each fast_attention call draws a new seed, so gradcheck goes through the operator with a
    fixed dropout_seed: the same keep mask in every evaluation."""
    seed = torch.tensor(20240607, dtype=torch.int64)
    for name, (q_shape, k_shape, v_shape), mask, causal, gqa in (
        ("plain", ((2, 3, 4), (2, 5, 4), (2, 5, 6)), None, False, False),
        ("causal", ((2, 5, 4), (2, 3, 4), (2, 3, 4)), None, True, False),
        ("mask+GQA", ((1, 4, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4)), rng.float_mask(3, 5), False, True),
    ):
        q, k, v = leaves(*rng.qkv(q_shape, k_shape, v_shape))

        def f(q, k, v, mask=mask, causal=causal, gqa=gqa):
            return forward_op(q, k, v, 0.6, causal, mask, gqa, 0.4, seed)[0]

        undropped = forward_op(q, k, v, 0.6, causal, mask, gqa, 0.0, None)[0]
        assert not torch.equal(f(q, k, v), undropped), f"dropout {name} changed nothing"
        assert torch.autograd.gradcheck(f, (q, k, v)), f"dropout {name} {rng}"


# ------------------------------------------------------------------------------- dropout


def test_python_philox_matches_the_published_answers():
    """The Python Philox the keep-mask tests use, against Random123's known answers (its
    kat_vectors file) for the spec's 7 rounds and for the default 10."""
    ones = 0xFFFFFFFF
    pi = ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0))
    assert PHILOX_ROUNDS == 7
    assert philox4x32((0,) * 4, (0, 0)) == (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)
    assert philox4x32((ones,) * 4, (ones, ones)) == (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)
    assert philox4x32(*pi) == (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)
    ten = {"rounds": 10}
    assert philox4x32((0,) * 4, (0, 0), **ten) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32((ones,) * 4, (ones, ones), **ten) == (
        0x408F276D,
        0x41C83B0E,
        0xA20BC7C6,
        0x6D5451FD,
    )
    assert philox4x32(*pi, **ten) == (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def dropped_probabilities(q, k, p, seed=None, **kwargs):
    """With value = I (Ev = S) the output IS the dropped probability matrix P∘D/(1-p)."""
    len_kv = k.shape[-2]
    eye = torch.eye(len_kv, dtype=q.dtype).expand(*k.shape[:-2], len_kv, len_kv)
    if seed is None:
        return fixed.fast_attention(q, k, eye, dropout_p=p, **kwargs)
    scale = kwargs.get("scale", 1 / math.sqrt(q.shape[-1]))
    return forward_op(q, k, eye, scale, kwargs.get("is_causal", False), None, False, p, seed)[0]


@pytest.mark.parametrize("p", [0.25, 0.5, 0.3])
def test_dropout_keeps_probabilities_scaled_by_one_over_one_minus_p(rng, p):
    q, k, _ = rng.qkv((4, 4, 64, 8), (4, 4, 64, 8), (1,))
    mask = rng.float_mask(64, 64, neg_inf=0.1)
    probs = sdpa64(q, k, torch.eye(64, dtype=torch.float64).expand(4, 4, 64, 64), attn_mask=mask)
    dropped = dropped_probabilities(q, k, p, attn_mask=mask)
    kept = dropped != 0
    assert torch.equal(dropped[~kept], torch.zeros_like(dropped[~kept])), f"not 0 or kept {rng}"
    scaled = probs[kept] / (1 - p)
    error = ((dropped[kept] - scaled).abs() / scaled).max().item()
    assert error <= FLOAT64_TOLERANCE, f"kept values are not P/(1-p): {error:.2e} {rng}"
    assert not (kept & (probs == 0)).any(), f"masked-out keys came back {rng}"
    # Binomial bound on the kept fraction among the keys that take part (P > 0): 6 sigma.
    n = int((probs > 0).sum())
    fraction = kept.sum().item() / n
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(fraction - (1 - p)) <= 6 * sigma, (
        f"kept {fraction:.4f}, want {1 - p} ±{6 * sigma:.4f}"
    )
    # The mask varies with the batch item and the row, not only the key.
    rows = kept.flatten(0, 1)  # (16, 64, 64)
    assert not torch.equal(rows[0], rows[1]), f"same keep mask for two batch items {rng}"
    assert not torch.equal(rows[0, 0], rows[0, 1]), f"same keep mask for two rows {rng}"


@pytest.mark.parametrize("seed", [0, 12345, 2**40 + 7, -1, -(2**63)])
def test_dropout_mask_is_the_specs_philox(rng, seed):
    """Element (b, i, j) kept iff its 16-bit uniform from the spec's Philox (its 2 x 4 block's
    call, sdpa_support.keep_mask) is >= p: the same bits the CUDA kernels must produce."""
    p, batch, len_q, len_kv = 0.3, 6, 5, 7
    q, k, _ = rng.qkv((2, 3, len_q, 8), (2, 3, len_kv, 8), (1,))
    dropped = dropped_probabilities(q, k, p, seed=torch.tensor(seed, dtype=torch.int64))
    expected = keep_mask(seed, p, batch, len_q, len_kv)
    got = (dropped != 0).view(batch, len_q, len_kv)
    assert torch.equal(got, expected), (
        f"seed {seed}: {int((got != expected).sum())} of {got.numel()} elements differ from the "
        f"spec's keep mask {rng}"
    )


def test_fast_attention_draws_its_seed_from_torchs_generator(rng):
    """fast_attention's seed is torch.randint(0, 2**62, ()) from the default CPU
    generator; b is the flattened index of the output's leading dims (GQA and broadcast too)."""
    q, k, _ = rng.qkv((2, 4, 5, 8), (1, 2, 7, 8), (1,))
    eye = torch.eye(7, dtype=torch.float64).expand(1, 2, 7, 7)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng.seed)
        seed = torch.randint(0, 2**62, (), dtype=torch.int64).item()
        torch.manual_seed(rng.seed)
        dropped = fixed.fast_attention(q, k, eye, dropout_p=0.25, enable_gqa=True)
    got = (dropped != 0).view(8, 5, 7)
    assert torch.equal(got, keep_mask(seed, 0.25, 8, 5, 7)), f"seed {seed}: mask differs {rng}"


def test_dropout_is_reproducible_under_manual_seed(rng):
    q, k, v = rng.qkv((2, 3, 16, 8), (2, 3, 24, 8), (2, 3, 24, 5))
    grad = rng.randn(2, 3, 16, 5)

    mask = rng.bool_mask(16, 24, keep=0.8)

    def run(seed):
        torch.manual_seed(seed)
        mine = leaves(q, k, v)
        out = fixed.fast_attention(*mine, dropout_p=0.3, attn_mask=mask)
        return (out.detach(), *torch.autograd.grad(out, mine, grad))

    with torch.random.fork_rng(devices=[]):
        first, again, other = run(7), run(7), run(8)
        torch.manual_seed(7)
        fixed.fast_attention(q, k, v, dropout_p=0.3)
        next_call = fixed.fast_attention(q, k, v, dropout_p=0.3, attn_mask=mask)
    for name, a, b in zip(("out", "dq", "dk", "dv"), first, again, strict=True):
        assert torch.equal(a, b), f"{name} differs under the same seed {rng}"
    assert not torch.equal(first[0], other[0]), f"seeds 7 and 8 give the same output {rng}"
    assert not torch.equal(first[0], next_call), f"a second call reused the first's mask {rng}"


def test_dropout_zero_is_no_dropout(rng):
    q, k, v = rng.qkv((2, 3, 6, 8), (2, 3, 9, 8), (2, 3, 9, 4))
    grad = rng.randn(2, 3, 6, 4)
    results = []
    for kw in ({}, {"dropout_p": 0.0}):
        mine = leaves(q, k, v)
        out = fixed.fast_attention(*mine, is_causal=True, **kw)
        results.append((out, *torch.autograd.grad(out, mine, grad)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert torch.equal(a, b), f"dropout_p=0 changes {name} {rng}"


@pytest.mark.parametrize("p", [1.0, 1 - 2**-17])
def test_dropout_one_gives_zeros_without_nan(rng, p):
    """Every probability dropped: output 0 and gradients 0 (not 0·inf = NaN from 1/(1-p)). At
    p = 1 - 2^-17 no 16-bit uniform reaches p: nothing kept either."""
    q, k, v = leaves(*rng.qkv((2, 3, 6, 8), (2, 3, 9, 8), (2, 3, 9, 4)))
    out = fixed.fast_attention(q, k, v, dropout_p=p)
    out.backward(rng.randn(*out.shape))
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.equal(t, torch.zeros_like(t)), f"dropout_p={p}: {name} is not 0 {rng}"


@pytest.mark.parametrize("p", [0.2, 0.6])
def test_dropout_gradients_use_the_forward_mask(rng, p):
    """Output and gradients against a float64 reference built from the realised keep mask
    (read through value = I under the same seed): the backward regenerates the forward's mask."""
    q, k, v = rng.qkv((2, 4, 10, 8), (2, 2, 13, 8), (2, 2, 13, 6))
    bias = rng.float_mask(4, 10, 13)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rng.seed)
        eye = torch.eye(13, dtype=torch.float64).expand(2, 2, 13, 13)
        keep = fixed.fast_attention(q, k, eye, attn_mask=bias, dropout_p=p, enable_gqa=True) != 0
        torch.manual_seed(rng.seed)
        mine = leaves(q, k, v)
        out = fixed.fast_attention(*mine, attn_mask=bias, dropout_p=p, enable_gqa=True)
    theirs = leaves(q, k, v)
    kr, vr = (t.repeat_interleave(2, dim=1) for t in theirs[1:])
    probs = torch.softmax(theirs[0] @ kr.transpose(-2, -1) / math.sqrt(8) + bias, dim=-1)
    ref = (probs * keep / (1 - p)) @ vr
    grad = rng.randn(*ref.shape)
    got = (out, *torch.autograd.grad(out, mine, grad))
    want = (ref, *torch.autograd.grad(ref, theirs, grad))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        error = ((g - w).norm() / w.norm()).item()
        assert error <= FLOAT64_TOLERANCE, f"dropout p={p} {name}: {error:.2e} {rng}"


# -------------------------------------------------------------------------- second order


def test_double_backward_is_loud(rng):
    q, k, v = rng.qkv((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6))
    mask = rng.float_mask(5, 7)
    # The first backward with create_graph=True works and is right.
    check_like_sdpa(fixed, rng, (q, k, v), attn_mask=mask, enable_gqa=True, where="first order")
    mine = leaves(q, k, v)
    out = fixed.fast_attention(*mine, attn_mask=mask, enable_gqa=True)
    grads = torch.autograd.grad(out, mine, rng.randn(*out.shape), create_graph=True)
    for name, g in zip(("dq", "dk", "dv"), grads, strict=True):
        assert g.requires_grad, f"{name} has no graph under create_graph=True {rng}"
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(g.square().sum(), mine, retain_graph=True, allow_unused=True)


# ----------------------------------------------------------------------------- opcheck


def opcheck_samples(rng):
    """(name, forward args) with the new trailing arguments: masks, GQA, Ev != E, odd head
    dims, dropout with a fixed seed, dead rows, S = 0."""
    seed = torch.tensor(99, dtype=torch.int64)
    q, k, v = rng.qkv((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8))
    yield "float mask (B,1,L,S)", (q, k, v, 0.3, False, rng.float_mask(2, 1, 5, 7))
    yield (
        "bool mask (L,S), dead row",
        (q, k, v, 0.3, False, torch.arange(7) < torch.arange(5)[:, None]),
    )
    yield "expanded mask", (q, k, v, 0.3, False, rng.float_mask(1, 1, 1, 7).expand(2, 3, 5, 7))
    gq, gk, gv = rng.qkv((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8))
    yield "GQA causal", (gq, gk, gv, 0.3, True, None, True)
    yield "MQA with mask", (gq, gk[:, :1], gv[:, :1], 0.3, False, rng.bool_mask(4, 5, 7), True)
    eq, ek, ev = rng.qkv((2, 5, 24), (2, 7, 24), (2, 7, 40))
    yield "Ev != E", (eq, ek, ev, 0.2, True)
    oq, ok, ov = rng.qkv((3, 5, 59), (3, 7, 59), (3, 7, 3))
    yield "odd head dims", (oq, ok, ov, 0.13, False, rng.float_mask(5, 7))
    yield "dropout", (q, k, v, 0.3, False, None, False, 0.25, seed)
    yield "dropout GQA mask", (gq, gk, gv, 0.3, False, rng.float_mask(5, 7), True, 0.5, seed)
    yield "S=0 with mask", (q, k[..., :0, :], v[..., :0, :], 0.3, False, rng.bool_mask(5, 0))


@pytest.mark.parametrize("index", range(10))
def test_opcheck_forward(rng, index):
    name, args = list(opcheck_samples(rng))[index]
    args = (*leaves(*args[:3]), *args[3:])
    try:
        torch.library.opcheck(forward_op, args)
    except Exception as error:
        raise AssertionError(f"opcheck forward {name}: {error} {rng}") from error


@pytest.mark.parametrize("index", range(10))
def test_opcheck_backward(rng, index):
    name, args = list(opcheck_samples(rng))[index]
    out, lse = forward_op(*args)
    grad = rng.randn(*out.shape).to(out.dtype)
    full = list(args) + [None, False, 0.0, None][len(args) - 5 :]
    q, k, v, scale, causal, mask, gqa, p, seed = full
    try:
        torch.library.opcheck(
            backward_op, (grad, q, k, v, out, lse, scale, causal, mask, gqa, p, seed)
        )
    except Exception as error:
        raise AssertionError(f"opcheck backward {name}: {error} {rng}") from error


# ----------------------------------------------------------------------- compile and meta


def test_compile_fullgraph_with_mask_and_gqa(rng):
    torch._dynamo.reset()

    def loss_fn(q, k, v, mask, weight):
        out = fast(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.4)
        return out, (out * weight).sum()

    fast = fixed.fast_attention
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    for len_q, len_kv in ((5, 7), (9, 4)):  # a second shape: a recompile, maybe dynamic
        q, k, v = rng.qkv((2, 4, len_q, 8), (1, 2, len_kv, 8), (1, 2, len_kv, 6))
        mask = rng.float_mask(4, len_q, len_kv)
        weight = rng.randn(2, 4, len_q, 6)
        results = []
        for fn in (loss_fn, compiled):
            mine = leaves(q, k, v)
            out, loss = fn(*mine, mask, weight)
            results.append((out, *torch.autograd.grad(loss, mine)))
        for name, eager, comp in zip(("out", "dq", "dk", "dv"), *results, strict=True):
            assert eager.shape == comp.shape, f"compiled {name} shape {rng}"
            error = (comp - eager).abs().max().item()
            assert error <= 1e-12, f"compiled {name} differs from eager by {error:.2e} {rng}"
        check_like_sdpa(fixed, rng, (q, k, v), attn_mask=mask, enable_gqa=True, scale=0.4)


def test_compile_fullgraph_with_dropout_is_reproducible(rng):
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: fixed.fast_attention(q, k, v, dropout_p=0.4),
        fullgraph=True,
        backend="aot_eager",
    )
    q, k, v = rng.qkv((2, 3, 6, 8), (2, 3, 9, 8), (2, 3, 9, 8))
    with torch.random.fork_rng(devices=[]):
        outs = []
        for seed in (3, 3, 4):
            torch.manual_seed(seed)
            outs.append(compiled(q, k, v))
    assert torch.equal(outs[0], outs[1]), f"compiled dropout not reproducible {rng}"
    assert not torch.equal(outs[0], outs[2]), f"compiled dropout ignores the seed {rng}"
    undropped = fixed.fast_attention(q, k, v)
    assert not torch.equal(outs[0], undropped), f"compiled dropout dropped nothing {rng}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        eager = fixed.fast_attention(q, k, v, dropout_p=0.4)
    assert torch.equal(outs[0], eager), f"compiled and eager masks differ for one seed {rng}"


def test_meta_tensors_take_the_new_shapes():
    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, device="meta", dtype=dtype)

    out = fixed.fast_attention(
        meta(2, 8, 5, 24),
        meta(1, 2, 9, 24),
        meta(1, 2, 9, 40),
        attn_mask=meta(8, 5, 9, dtype=torch.bool),
        enable_gqa=True,
        dropout_p=0.1,
    )
    assert (out.device.type, out.shape, out.dtype) == ("meta", (2, 8, 5, 40), torch.bfloat16)
    out, lse = forward_op(meta(3, 5, 7), meta(3, 9, 7), meta(3, 9, 2), 0.5, True)
    assert out.shape == (3, 5, 2) and lse.shape == (3, 5) and lse.dtype == torch.float32
    grads = backward_op(out, meta(3, 5, 7), meta(3, 9, 7), meta(3, 9, 2), out, lse, 0.5, True)
    assert [tuple(g.shape) for g in grads] == [(3, 5, 7), (3, 9, 7), (3, 9, 2)]
