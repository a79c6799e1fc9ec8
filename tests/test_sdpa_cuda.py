"""fixed.fast_attention as an SDPA drop-in on CUDA, in bfloat16, float16 and float32: masks (bool
and additive, broadcast), fully masked rows, is_causal with L != S, scale, GQA/MQA, Ev != E, odd
head dims, lengths 1 and 0, broadcast leading dims and views, judged by flash-attention's peer rule
(tests/sdpa_support.peer_check); dropout (the CPU's keep mask bit for bit, reproducible, refused
under graph capture); the head-dim limit; opcheck; compute-sanitizer on the new paths. Every test
needs CUDA and skips, saying so, without it. SDPA_CUDA_SEED=<seed> replays a failure."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from tests.cuda_support import (
    NEEDS_CUDA,
    dtype_id,
    fixed_with_cuda_kernels,
    sanitize,
)
from tests.sdpa_support import (
    delta_rounding_shift,
    keep_mask,
    peer_check,
    peer_reference,
    peer_slack,
    rng_fixture,
)

pytestmark = NEEDS_CUDA

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
fixed = pytest.fixture(fixed_with_cuda_kernels, scope="module", name="fixed")
rng = rng_fixture("SDPA_CUDA_SEED")


def forward_op():
    """The operator, looked up once the fixed fixture has loaded the library (not at import)."""
    return torch.ops.fixed_attention.attention_forward


def check_peer(fixed, rng, dtype, q_shape, k_shape, v_shape, *, view=None, where="", **kwargs):
    """The kernel on CUDA in `dtype` against the float64 reference, allowed twice the error of
    PyTorch's same-dtype matmul/softmax (plus one rounding), for the output and the gradients;
    dQ and dK also the shift that delta from the rounded output brings (delta_rounding_shift).
    Masks in kwargs are given on the CPU (bool, or floating: rounded to `dtype`)."""
    view = view or (lambda *ts: ts)
    # Drawn in `dtype` (the mask too): the float64 reference sees exactly the kernel's inputs.
    q, k, v = rng.qkv(q_shape, k_shape, v_shape, dtype=dtype)
    mask = kwargs.pop("attn_mask", None)
    if mask is not None and mask.dtype.is_floating_point:
        mask = mask.to(dtype)
    results = {}
    for name, run_dtype in (("kernel", dtype), ("peer", dtype), ("reference", torch.float64)):
        leaves = [t.to("cuda", run_dtype).requires_grad_(True) for t in (q, k, v)]
        run_mask = None
        if mask is not None:
            run_mask = mask.to("cuda", run_dtype if mask.dtype.is_floating_point else torch.bool)
        fn = fixed.fast_attention if name == "kernel" else peer_reference
        out = fn(*view(*leaves), attn_mask=run_mask, **kwargs)
        if name == "kernel":  # one grad_output for all three
            grad = rng.randn(*out.shape, dtype=dtype).cuda()
        grads = torch.autograd.grad(out, leaves, grad.to(run_dtype))
        results[name] = [t.detach() for t in (out, *grads)]
    # The backward reads delta from its rounded output; run_mask is the reference's here.
    out, exact = results["kernel"][0], results["reference"][0]
    shifts = delta_rounding_shift(
        q.cuda(), k.cuda(), out, exact, grad, view=view, attn_mask=run_mask, **kwargs
    )
    allowances = [0.0, *(s.abs().max().item() if s.numel() else 0.0 for s in shifts), 0.0]
    where = f"{dtype_id(dtype)} {where} {rng}"
    failures = []
    for i, part in enumerate(("output", "dq", "dk", "dv")):
        kernel, peer, reference = (results[n][i] for n in ("kernel", "peer", "reference"))
        assert kernel.shape == reference.shape and kernel.dtype == dtype, f"{part}: {where}"
        slack = peer_slack(dtype)
        failure = peer_check(part, kernel, peer, reference, slack, where, allowance=allowances[i])
        if failure:
            failures.append(failure)
    assert not failures, "\n".join(failures)
    return results["kernel"][0]


B, H, L, S, E, EV = 2, 4, 37, 53, 64, 40

MASK_SHAPES = [(L, S), (1, 1, L, S), (B, 1, L, S), (H, L, S), (B, H, L, S), (B, 1, 1, S), (L, 1)]


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_masks(fixed, rng, dtype, kind):
    for shape in MASK_SHAPES:
        mask = rng.bool_mask(*shape) if kind == "bool" else rng.float_mask(*shape)
        where = f"{kind} mask {shape}"
        check_peer(
            fixed, rng, dtype, (B, H, L, E), (B, H, S, E), (B, H, S, E), attn_mask=mask, where=where
        )
    mask = rng.float_mask(B, 2 * H, S, L)[:, ::2].transpose(-1, -2)  # a strided view
    check_peer(
        fixed, rng, dtype, (B, H, L, E), (B, H, S, E), (B, H, S, EV), attn_mask=mask, where="view"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_fully_masked_rows_are_zero(fixed, rng, dtype):
    mask = rng.bool_mask(B, H, L, S)
    mask[0, 1, 3] = False
    mask[1, :, :5] = False
    mask[1, 2] = False
    dead = ~mask.any(-1)
    q, k, v = (
        rng.randn(*s, dtype=torch.float32).to("cuda", dtype)
        for s in ((B, H, L, E), (B, H, S, E), (B, H, S, EV))
    )
    q.requires_grad_(True)
    for name, m in (("bool", mask), ("float -inf", torch.where(mask, 0.5, -math.inf).to(dtype))):
        out = fixed.fast_attention(q, k, v, attn_mask=m.cuda())
        (dq,) = torch.autograd.grad(out, q, torch.randn_like(out))
        assert not out[dead.cuda()].any(), f"{dtype_id(dtype)} {name}: dead rows not 0 {rng}"
        assert not dq[dead.cuda()].any(), f"{dtype_id(dtype)} {name}: dq of dead rows not 0 {rng}"
        assert torch.isfinite(out).all() and torch.isfinite(dq).all(), f"{name}: NaN/inf {rng}"
    check_peer(
        fixed,
        rng,
        dtype,
        (B, H, L, E),
        (B, H, S, E),
        (B, H, S, EV),
        attn_mask=mask,
        where="dead rows",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_causal_scale_and_lengths(fixed, rng, dtype):
    for len_q, len_kv in ((L, S), (S, L), (64, 64), (1, 77), (77, 1), (1, 1), (130, 70)):
        for scale in (None, 0.05, -0.3, 0.0):
            where = f"L={len_q} S={len_kv} scale={scale} causal"
            check_peer(
                fixed,
                rng,
                dtype,
                (B, H, len_q, E),
                (B, H, len_kv, E),
                (B, H, len_kv, EV),
                is_causal=True,
                scale=scale,
                where=where,
            )


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=lambda h: f"hkv{h}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gqa(fixed, rng, dtype, kv_heads):
    shapes = ((B, 4, L, E), (B, kv_heads, S, E), (B, kv_heads, S, EV))
    for kw in ({}, {"is_causal": True}, {"attn_mask": rng.float_mask(4, L, S)}):
        check_peer(
            fixed, rng, dtype, *shapes, enable_gqa=True, where=f"GQA 4/{kv_heads} {list(kw)}", **kw
        )
    if kv_heads == 1:  # MQA as a broadcast, without enable_gqa
        check_peer(fixed, rng, dtype, *shapes, where="Hkv=1 broadcast")


@pytest.mark.parametrize(
    ("head_dim", "head_dim_v"),
    [
        (1, 1),
        (3, 3),
        (8, 8),
        (59, 59),
        (111, 111),
        (256, 256),
        (24, 40),
        (64, 8),
        (256, 3),
        (3, 256),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_head_dims(fixed, rng, dtype, head_dim, head_dim_v):
    shapes = ((B, H, L, head_dim), (B, H, S, head_dim), (B, H, S, head_dim_v))
    for kw in ({}, {"is_causal": True}, {"attn_mask": rng.bool_mask(L, S)}):
        check_peer(
            fixed, rng, dtype, *shapes, where=f"E={head_dim} Ev={head_dim_v} {list(kw)}", **kw
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_leading_dims_and_views(fixed, rng, dtype):
    for q_shape, k_shape in (
        ((L, E), (S, E)),
        ((2, H, L, E), (1, H, S, E)),
        ((2, 1, L, E), (1, 3, S, E)),
        ((2, 2, 2, L, E), (2, 2, 2, S, E)),
    ):
        check_peer(
            fixed, rng, dtype, q_shape, k_shape, (*k_shape[:-1], EV), where=f"q{q_shape} k{k_shape}"
        )

    def view(q, k, v):  # (B, L, H, E) memory seen as (B, H, L, E), every other key
        return q.transpose(1, 2), k.transpose(1, 2)[:, :, ::2], v.transpose(1, 2)[:, :, ::2]

    check_peer(
        fixed,
        rng,
        dtype,
        (B, L, 6, E),
        (B, 2 * S, 2, E),
        (B, 2 * S, 2, EV),
        view=view,
        enable_gqa=True,
        attn_mask=rng.float_mask(6, L, S),
        where="views + GQA + mask",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_empty(fixed, rng, dtype):
    for q_shape, k_shape in (
        ((0, H, L, E), (0, H, S, E)),
        ((B, H, 0, E), (B, H, S, E)),
        ((B, H, L, E), (B, H, 0, E)),
    ):
        leaves = [
            t.cuda().to(dtype).requires_grad_(True)
            for t in rng.qkv(q_shape, k_shape, (*k_shape[:-1], EV))
        ]
        mask = torch.ones(q_shape[-2], k_shape[-2], dtype=torch.bool, device="cuda")
        out = fixed.fast_attention(*leaves, attn_mask=mask)
        assert out.shape == (*q_shape[:-1], EV) and not out.any(), f"q{q_shape} k{k_shape}"
        out.sum().backward()
        for t in leaves:
            assert t.grad.shape == t.shape and not t.grad.any(), f"q{q_shape} k{k_shape}"


# ------------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_dropout_mask_is_the_cpus(fixed, rng, dtype):
    """The CUDA kernels' keep mask is the spec's Philox mask, the CPU kernels' bit for bit."""
    seed = torch.tensor(-1234567890123, dtype=torch.int64)
    q, k = (rng.randn(2, 3, n, 16, dtype=torch.float32) for n in (9, 11))
    eye = torch.eye(11).expand(2, 3, 11, 11)
    cuda = forward_op()(
        q.cuda().to(dtype),
        k.cuda().to(dtype),
        eye.cuda().to(dtype),
        0.25,
        False,
        None,
        False,
        0.3,
        seed,
    )[0]
    cpu = forward_op()(q.double(), k.double(), eye.double(), 0.25, False, None, False, 0.3, seed)[0]
    expected = keep_mask(seed.item(), 0.3, 6, 9, 11).view(2, 3, 9, 11)
    assert torch.equal(cpu != 0, expected), "the CPU kernel's mask is not the spec's"
    assert torch.equal(cuda.cpu() != 0, expected), f"{dtype_id(dtype)}: CUDA mask differs {rng}"


def test_dropout_reproducible_and_p_one(fixed, rng):
    q, k, v = (rng.randn(2, 4, n, 64, dtype=torch.float32).cuda().half() for n in (100, 150, 150))
    outs = []
    with torch.random.fork_rng(devices=[]):
        for seed in (5, 5, 6):
            torch.manual_seed(seed)
            outs.append(fixed.fast_attention(q, k, v, dropout_p=0.2))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2]), f"{rng}"
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = fixed.fast_attention(*leaves, dropout_p=1.0)
    out.backward(torch.randn_like(out))
    for t in (out, *(leaf.grad for leaf in leaves)):
        assert torch.equal(t, torch.zeros_like(t)), "dropout_p=1 must give zeros, no NaN"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_dropout_past_every_uniform_keeps_nothing(fixed, rng, head_dim):
    """p in (1 - 2^-16, 1): no 16-bit uniform reaches it, so the tensor-core kernels keep nothing
    (their threshold is 2^16 there, and the compare's limit T 2^16 - 1 wraps to 0xFFFFFFFF,
    flash_common.cuh): zeros, never a value scaled by 1 / (1 - p) = 2^17."""
    q, k, v = (
        rng.randn(2, 4, n, head_dim, dtype=torch.float32).cuda().bfloat16() for n in (130, 200, 200)
    )
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = fixed.fast_attention(*leaves, dropout_p=1 - 2**-17)
    out.backward(torch.randn_like(out))
    for name, t in zip(
        ("out", "dq", "dk", "dv"), (out, *(leaf.grad for leaf in leaves)), strict=True
    ):
        assert torch.equal(t, torch.zeros_like(t)), f"D={head_dim}: {name} is not 0 {rng}"


def test_dropout_under_graph_capture_raises(fixed, rng):
    q = rng.randn(2, 3, 16, 32, dtype=torch.float32).cuda().half()
    fixed.fast_attention(q, q, q, dropout_p=0.0)  # warm up
    graph = torch.cuda.CUDAGraph()
    error = None
    # Refused before any launch, so the (empty) capture itself still ends cleanly.
    with torch.cuda.graph(graph):
        try:
            fixed.fast_attention(q, q, q, dropout_p=0.1)
        except RuntimeError as raised:
            error = raised
    assert error is not None, "dropout under graph capture must raise: the seed would be frozen"
    assert "captur" in str(error).lower(), f"the message should say why: {error}"


# ------------------------------------------------------------------------ limits, opcheck


@pytest.mark.parametrize(("head_dim", "head_dim_v"), [(264, 64), (64, 264), (257, 257)])
def test_head_dims_over_256_are_refused_on_cuda(fixed, head_dim, head_dim_v):
    q, k = (torch.randn(2, n, head_dim, device="cuda") for n in (5, 7))
    v = torch.randn(2, 7, head_dim_v, device="cuda")
    with pytest.raises(ValueError, match="at most 256"):
        fixed.fast_attention(q, k, v)
    fixed.fast_attention(q.cpu(), k.cpu(), v.cpu())  # the CPU has no limit


def test_mask_on_the_cpu_is_refused(fixed):
    q = torch.randn(2, 5, 64, device="cuda")
    with pytest.raises(ValueError, match=r"(?s)attn_mask.*cuda"):
        fixed.fast_attention(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.bool))


def test_opcheck_new_arguments(fixed, rng):
    seed = torch.tensor(7, dtype=torch.int64)

    def t(*shape, dtype=torch.bfloat16):
        return rng.randn(*shape, dtype=torch.float32).to("cuda", dtype).requires_grad_(True)

    samples = [
        (
            t(2, 4, 9, 64),
            t(2, 2, 13, 64),
            t(2, 2, 13, 40),
            0.2,
            False,
            rng.float_mask(9, 13).cuda().bfloat16(),
            True,
        ),
        (
            t(2, 9, 59, dtype=torch.float16),
            t(2, 13, 59, dtype=torch.float16),
            t(2, 13, 59, dtype=torch.float16),
            0.1,
            True,
        ),
        (
            t(2, 3, 9, 32, dtype=torch.float32),
            t(2, 3, 13, 32, dtype=torch.float32),
            t(2, 3, 13, 32, dtype=torch.float32),
            0.2,
            False,
            None,
            False,
            0.3,
            seed,
        ),
    ]
    for args in samples:
        torch.library.opcheck(forward_op(), args)


# --------------------------------------------------------------------------- compute-sanitizer

SANITIZER_SCRIPT = textwrap.dedent(
    """
    import torch
    import fixed

    g = torch.Generator().manual_seed(0)

    def t(*shape, dtype):
        return torch.randn(shape, generator=g).to("cuda", dtype).requires_grad_()

    # A broadcast float mask with dead rows; GQA with a bool mask; an odd head dim with Ev != E,
    # causal; dropout.
    mask = torch.randn(1, 4, 37, 45, generator=g).to("cuda", torch.bfloat16)
    mask[..., 3, :] = float("-inf")
    cases = (
        (t(2, 4, 37, 64, dtype=torch.bfloat16), t(2, 4, 45, 64, dtype=torch.bfloat16),
         t(2, 4, 45, 64, dtype=torch.bfloat16), dict(attn_mask=mask)),
        (t(2, 6, 33, 128, dtype=torch.float16), t(2, 2, 70, 128, dtype=torch.float16),
         t(2, 2, 70, 128, dtype=torch.float16),
         dict(enable_gqa=True, attn_mask=torch.rand(33, 70, generator=g).cuda() > 0.3)),
        (t(3, 41, 59, dtype=torch.float32), t(3, 29, 59, dtype=torch.float32),
         t(3, 29, 111, dtype=torch.float32), dict(is_causal=True)),
        (t(2, 2, 50, 59, dtype=torch.float16), t(2, 2, 61, 59, dtype=torch.float16),
         t(2, 2, 61, 59, dtype=torch.float16), dict(dropout_p=0.3)),
    )
    for q, k, v, kwargs in cases:
        out = fixed.fast_attention(q, k, v, **kwargs)
        out.backward(torch.randn(out.shape, generator=g).to("cuda", out.dtype))
    torch.cuda.synchronize()
    print("sanitizer script done")
    """
)


@pytest.mark.parametrize(
    ("tool", "clean"),
    [
        ("memcheck", "ERROR SUMMARY: 0 errors"),
        ("racecheck", "RACECHECK SUMMARY: 0 hazards displayed"),
    ],
)
def test_compute_sanitizer_on_masks_gqa_and_odd_head_dims(fixed, tmp_path, tool, clean):
    sanitize(tool, SANITIZER_SCRIPT, tmp_path, clean)
