"""fixed.fast_attention over flash-attention's test matrix (the seqlen pairs and head dims of
Dao-AILab/flash-attention's tests/test_flash_attn.py, causal and not, MHA/GQA/MQA), judged by its
error rule: the kernel's max error against a float64 reference is at most twice that of plain
PyTorch in the same dtype (matmul/softmax/matmul with no upcast) plus one unit of the dtype's
rounding at the result's scale (16 in float32), for the output and for dQ, dK and dV.

CPU: a small float32 subset (short lengths: seconds). CUDA: the full matrix in bfloat16 and
float16, a float32 subset and the GQA/MQA variants; skipped, saying so, without a GPU. Inputs
are fresh each run; PEER_SEED=<seed> replays a failure.
"""

from __future__ import annotations

import pytest
import torch

from tests.cuda_support import NEEDS_CUDA, dtype_id
from tests.sdpa_support import (
    delta_rounding_shift,
    peer_check,
    peer_reference,
    peer_slack,
    rng_fixture,
)

rng = rng_fixture("PEER_SEED")

# flash-attention's (seqlen_q, seqlen_k) pairs and head dims.
SEQLENS = [
    (113, 203),
    (128, 217),
    (113, 211),
    (108, 256),
    (256, 512),
    (512, 256),
    (1024, 1024),
    (1023, 1024),
    (1024, 1023),
    (2048, 2048),
]
HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]


def run_peer_case(rng, device, dtype, batch, heads, kv_heads, len_q, len_kv, head_dim, causal):
    """One case of the matrix; returns the failures (empty when the kernel meets the rule)."""
    import fixed

    gqa = kv_heads != heads
    shapes = ((batch, heads, len_q, head_dim), (batch, kv_heads, len_kv, head_dim))
    # Drawn in `dtype`: the float64 reference sees exactly the kernel's inputs.
    q, k, v = (rng.randn(*s, dtype=dtype) for s in (shapes[0], shapes[1], shapes[1]))
    grad = rng.randn(batch, heads, len_q, head_dim, dtype=dtype)
    where = (
        f"{dtype_id(dtype)} B={batch} H={heads}/{kv_heads} L={len_q} S={len_kv} E={head_dim} "
        f"causal={causal} {rng}"
    )
    results = {}
    for name, run_dtype in (("kernel", dtype), ("peer", dtype), ("reference", torch.float64)):
        leaves = [t.to(device, run_dtype).requires_grad_(True) for t in (q, k, v)]
        if name == "kernel":
            out = fixed.fast_attention(*leaves, is_causal=causal, enable_gqa=gqa)
        else:  # the peer in the same dtype; the reference is the same formula in float64
            out = peer_reference(*leaves, is_causal=causal, enable_gqa=gqa)
        grads = torch.autograd.grad(out, leaves, grad.to(device, run_dtype))
        results[name] = [t.detach() for t in (out, *grads)]
        del out, grads, leaves
    # One rounding of the result where the peer happens to be exact; float32's error is the
    # summation order rather than storage (sequential vs blocked sums differ by a few ulps).
    slack = peer_slack(dtype)
    failures = []
    for i, part in enumerate(("output", "dQ", "dK", "dV")):
        kernel, peer, reference = (results[n][i] for n in ("kernel", "peer", "reference"))
        assert kernel.shape == reference.shape and kernel.dtype == dtype, f"{part}: {where}"
        failure = peer_check(part, kernel, peer, reference, slack, where)
        if failure:
            failures.append(failure)
    return failures


# ------------------------------------------------------------------------------------- CPU

# (L, S, E, Hkv): flash-attention's ragged pairs cut short, its odd head dims, GQA and MQA.
CPU_CASES = [
    (113, 203, 59, 2),
    (128, 217, 32, 2),
    (113, 211, 111, 2),
    (108, 256, 40, 1),
    (203, 113, 80, 2),
    (64, 64, 256, 2),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(("len_q", "len_kv", "head_dim", "kv_heads"), CPU_CASES, ids=str)
def test_peer_rule_cpu_float32(rng, len_q, len_kv, head_dim, kv_heads, causal):
    failures = run_peer_case(
        rng, "cpu", torch.float32, 1, 2, kv_heads, len_q, len_kv, head_dim, causal
    )
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------------ CUDA


def needs_cuda(test):
    for mark in reversed(NEEDS_CUDA):
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def cuda_kernels():
    from tests.cuda_support import fixed_with_cuda_kernels

    return fixed_with_cuda_kernels()


@needs_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda e: f"e{e}")
@pytest.mark.parametrize(("len_q", "len_kv"), SEQLENS, ids=lambda n: str(n))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_peer_rule_cuda(cuda_kernels, rng, dtype, len_q, len_kv, head_dim, causal):
    batch = 2 if len_kv <= 1024 else 1
    failures = run_peer_case(rng, "cuda", dtype, batch, 6, 6, len_q, len_kv, head_dim, causal)
    assert not failures, "\n".join(failures)


@needs_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [32, 59, 64, 128, 256], ids=lambda e: f"e{e}")
@pytest.mark.parametrize(("len_q", "len_kv"), SEQLENS[:4] + SEQLENS[7:9], ids=lambda n: str(n))
def test_peer_rule_cuda_float32(cuda_kernels, rng, len_q, len_kv, head_dim, causal):
    failures = run_peer_case(rng, "cuda", torch.float32, 2, 4, 4, len_q, len_kv, head_dim, causal)
    assert not failures, "\n".join(failures)


@needs_cuda
@pytest.mark.parametrize("kv_heads", [3, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [59, 64, 128, 256], ids=lambda e: f"e{e}")
@pytest.mark.parametrize(("len_q", "len_kv"), SEQLENS[::3], ids=lambda n: str(n))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_peer_rule_cuda_gqa(cuda_kernels, rng, dtype, len_q, len_kv, head_dim, causal, kv_heads):
    failures = run_peer_case(rng, "cuda", dtype, 2, 6, kv_heads, len_q, len_kv, head_dim, causal)
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------- the yardstick


def test_peer_reference_is_sdpa_in_float64(rng):
    """The peer formula, run in float64, is SDPA (masks, dead rows, causal L != S, GQA): the
    reference and the peer of the matrix measure the right function."""
    import torch.nn.functional as F

    q, k, v = rng.qkv((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 3))
    mask = rng.float_mask(4, 5, 7)
    mask[1, 2] = -float("inf")  # a dead row
    for kwargs in (
        {"attn_mask": mask, "enable_gqa": True},
        {"attn_mask": mask > 0, "enable_gqa": True, "scale": -0.3},
        {"is_causal": True, "enable_gqa": True},
    ):
        ours = [t.clone().requires_grad_(True) for t in (q, k, v)]
        theirs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = peer_reference(*ours, **kwargs)
        ref = F.scaled_dot_product_attention(*theirs, **kwargs)
        grad = rng.randn(*ref.shape)
        got = (out, *torch.autograd.grad(out, ours, grad))
        want = (ref, *torch.autograd.grad(ref, theirs, grad))
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            error = (a - b).abs().max().item()
            assert error <= 1e-12, f"{sorted(kwargs)} {name}: {error:.2e} {rng}"


def test_delta_rounding_shift_is_the_backward_from_the_rounded_output(rng):
    """delta_rounding_shift plus the float64 reference's gradients are FlashAttention's backward
    written out in float64 (P explicit, delta = rowsum(dO * O) from O rounded to float16): GQA
    with an additive mask and a dead row, causal with a scale, a bool mask through a view, and
    leading dims that broadcast."""
    gqa = ((2, 4, 5, 3), (2, 2, 7, 3), (2, 2, 7, 2))
    mask = rng.float_mask(4, 5, 7)
    mask[1, 2] = -float("inf")  # a dead row
    transposed = lambda *ts: [t.transpose(-2, -3) for t in ts]  # noqa: E731
    for shapes, view, kwargs in (
        (gqa, None, {"attn_mask": mask, "enable_gqa": True}),
        (gqa, None, {"is_causal": True, "scale": -0.3, "enable_gqa": True}),
        (gqa, transposed, {"attn_mask": mask > 0, "enable_gqa": True}),
        (((2, 1, 5, 3), (1, 4, 7, 3), (1, 4, 7, 2)), None, {"attn_mask": mask}),
    ):
        seen = view or (lambda *ts: ts)
        leaves = [t.requires_grad_(True) for t in rng.qkv(*shapes)]
        if view:  # leaves whose view has the shapes
            leaves = [
                t.detach().transpose(-2, -3).contiguous().requires_grad_(True) for t in leaves
            ]
        out = peer_reference(*seen(*leaves), **kwargs)
        grad = rng.randn(*out.shape)
        dq, dk, _ = torch.autograd.grad(out, leaves, grad)
        rounded = out.detach().half()
        dq_shift, dk_shift = delta_rounding_shift(
            leaves[0], leaves[1], rounded, out, grad, view=view, **kwargs
        )
        # The same backward by hand: P from the forward's formula, delta from the rounded output.
        qs, ks, vs = (t.detach() for t in seen(*leaves))
        group = qs.shape[-3] // ks.shape[-3] if kwargs.get("enable_gqa") else 1
        ks_all, vs_all = ks.repeat_interleave(group, -3), vs.repeat_interleave(group, -3)
        scale = kwargs.get("scale", 1 / qs.shape[-1] ** 0.5)
        scores = scale * qs @ ks_all.transpose(-1, -2)
        if kwargs.get("is_causal"):
            scores = scores.masked_fill(~torch.ones(5, 7, dtype=torch.bool).tril(), -float("inf"))
        extra = kwargs.get("attn_mask")
        if extra is not None and extra.dtype == torch.bool:
            scores = scores.masked_fill(~extra, -float("inf"))
        elif extra is not None:
            scores = scores + extra
        dead = (scores == -float("inf")).all(-1, keepdim=True)
        probs = scores.masked_fill(dead, 0).softmax(-1).masked_fill(dead, 0)
        delta = (grad * rounded.double()).sum(-1, keepdim=True)
        ds = probs * (grad @ vs_all.transpose(-1, -2) - delta)
        want_dq = (scale * ds @ ks_all).sum_to_size(qs.shape)
        want_dk = (scale * ds.transpose(-1, -2) @ qs).unflatten(-3, (-1, group)).sum(-3)
        want_dk = want_dk.sum_to_size(ks.shape)
        if view:
            want_dq, want_dk = want_dq.transpose(-2, -3), want_dk.transpose(-2, -3)
        for name, got, want in (("dq", dq + dq_shift, want_dq), ("dk", dk + dk_shift, want_dk)):
            error = (got - want).abs().max().item()
            assert error <= 1e-12, f"{sorted(kwargs)} view={bool(view)} {name}: {error:.2e} {rng}"
        assert dk_shift.abs().max() > 1e-6, f"{sorted(kwargs)}: the rounding moved nothing {rng}"
