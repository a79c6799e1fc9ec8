"""Deeper tests of fixed/: the operator against the float64 reference, its gradients, the
torch.library machinery (opcheck, compile, meta) and every bad input it must reject.

Inputs are fresh each run. Every test that draws them prints its seed; replay a failure with
FIXED_TEST_SEED=<seed> python -m pytest tests/test_fixed.py -k <test>.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pytest_check import check

import fixed
from fixed import _build
from kata.harness import reference
from kata.harness.reference import (
    TOLERANCE,
    attention,
    attention_with_grads,
    random_inputs,
    relative_error,
)

REPO = Path(__file__).resolve().parents[1]
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
forward_op = torch.ops.fixed_attention.attention_forward
backward_op = torch.ops.fixed_attention.attention_backward


class Rng:
    """A seeded generator whose seed goes into every assertion message."""

    def __init__(self, seed: int):
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def __str__(self) -> str:
        return f"[seed {self.seed}]"

    def inputs(self, *shape, dtype=torch.float32, kv_len=None):
        return random_inputs(*shape, dtype=dtype, generator=self.generator, kv_len=kv_len)

    def randn(self, *shape, dtype=torch.float32):
        return torch.randn(shape, generator=self.generator).to(dtype)


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("FIXED_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed {seed}: replay with FIXED_TEST_SEED={seed} pytest '{request.node.nodeid}'")
    return Rng(seed)


# (leading dims, L, S, E): no/one/two leading dims, L < S, L > S, L == S, lengths 1, 7, 33,
# every head dim class from 16 to 256.
SHAPES = (
    ((), 7, 33, 64),
    ((3,), 33, 7, 16),
    ((2, 2), 1, 1, 128),
    ((2,), 33, 33, 256),
    ((1, 2), 7, 1, 16),
    ((2,), 1, 7, 128),
)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_matches_reference(rng, dtype):
    for leading, len_q, len_kv, head_dim in SHAPES:
        for causal in (False, True):
            q, k, v = rng.inputs(*leading, len_q, head_dim, dtype=dtype, kv_len=len_kv)
            out, lse = forward_op(q, k, v, 1 / math.sqrt(head_dim), causal)
            case = f"{rng} {dtype} {list(q.shape)} S={len_kv} causal={causal}"
            error = relative_error(out, attention(q, k, v, causal=causal))
            with check:
                assert error <= TOLERANCE[dtype], f"{case}: relative error {error:.2e}"
            with check:
                assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous(), case
            expected_lse = reference.logsumexp(q, k, scale=1 / math.sqrt(head_dim), causal=causal)
            lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            with check:
                assert lse.dtype == lse_dtype and lse.shape == q.shape[:-1], case
            lse_error = relative_error(lse, expected_lse)
            with check:
                assert lse_error <= TOLERANCE[dtype], f"{case}: logsumexp error {lse_error:.2e}"


@pytest.mark.parametrize("scale", [0.3, 2.0, -0.5])
def test_custom_scale(rng, scale):
    for causal in (False, True):
        q, k, v = rng.inputs(2, 9, 32, kv_len=12)
        out = fixed.fast_attention(q, k, v, scale=scale, is_causal=causal)
        error = relative_error(out, attention(q, k, v, scale=scale, causal=causal))
        assert error <= TOLERANCE[torch.float32], f"{rng} scale={scale}: error {error:.2e}"


def non_contiguous_cases(rng, dtype):
    """(name, query, key, value) with at least one non-contiguous view among them."""
    # (B, L, H, E) and (B, S, H, E) buffers seen as (B, H, L, E): SDPA's usual layout.
    q4, k4, v4 = (rng.randn(2, n, 3, 32, dtype=dtype) for n in (9, 5, 5))
    yield "transposed", q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2)
    q, k, v = rng.inputs(2, 18, 64, dtype=dtype, kv_len=14)
    yield "sliced rows and head dim", q[:, ::2, :32], k[:, 1::2, 16:48], v[:, ::2, ::2]
    q, k, v = rng.inputs(1, 7, 16, dtype=dtype, kv_len=11)
    yield "expanded batch", q.expand(3, 7, 16), k.expand(3, 11, 16), v.expand(3, 11, 16)
    q, k, v = rng.inputs(16, 7, dtype=dtype, kv_len=16)  # (E, L): a 2-D transpose
    yield "2-D transposed", q.t(), k.t(), v.t()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(rng, dtype):
    for name, q, k, v in non_contiguous_cases(rng, dtype):
        assert not all(t.is_contiguous() for t in (q, k, v)), f"{name} must be a view"
        for causal in (False, True):
            out = fixed.fast_attention(q, k, v, is_causal=causal)
            error = relative_error(out, attention(q, k, v, causal=causal))
            with check:
                assert error <= TOLERANCE[dtype], f"{rng} {name} causal={causal}: {error:.2e}"
            with check:
                assert out.is_contiguous(), f"{name}: output strides {out.stride()}"


# (leading dims, L, S, E) for gradients: L < S, L > S, 2-D.
GRAD_SHAPES = (((2,), 5, 11, 32), ((2, 2), 9, 4, 16), ((), 7, 7, 64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradients_match_reference(rng, dtype, causal):
    for leading, len_q, len_kv, head_dim in GRAD_SHAPES:
        q, k, v = (
            t.requires_grad_()
            for t in rng.inputs(*leading, len_q, head_dim, dtype=dtype, kv_len=len_kv)
        )
        out = fixed.fast_attention(q, k, v, is_causal=causal)
        grad_out = rng.randn(*out.shape, dtype=dtype)
        out.backward(grad_out)
        expected = attention_with_grads(q, k, v, grad_out, causal=causal)
        for name, got, want in zip(
            ("output", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), expected, strict=True
        ):
            error = relative_error(got, want)
            with check:
                assert error <= TOLERANCE[dtype], (
                    f"{rng} {list(q.shape)} S={len_kv} {name}: {error:.2e}"
                )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_of_non_contiguous_inputs(rng, dtype):
    tolerance = TOLERANCE[dtype] * (1 if dtype == torch.float32 else 2)
    for name, q, k, v in non_contiguous_cases(rng, dtype):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = fixed.fast_attention(q, k, v, is_causal=True)
        grad_out = rng.randn(*out.shape, dtype=dtype).expand_as(out)  # non-contiguous too
        out.backward(grad_out.transpose(-2, -1).contiguous().transpose(-2, -1))
        expected = attention_with_grads(q, k, v, grad_out, causal=True)[1:]
        for grad_name, got, want in zip(
            ("dq", "dk", "dv"), (q.grad, k.grad, v.grad), expected, strict=True
        ):
            error = relative_error(got, want)
            with check:
                assert error <= tolerance, f"{rng} {name} {grad_name}: {error:.2e}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck(rng, causal):
    for len_q, len_kv in ((3, 5), (5, 2)):
        q, k, v = (
            t.requires_grad_() for t in rng.inputs(2, len_q, 16, dtype=torch.float64, kv_len=len_kv)
        )
        assert torch.autograd.gradcheck(
            lambda q, k, v: fixed.fast_attention(q, k, v, scale=0.7, is_causal=causal), (q, k, v)
        ), f"{rng} L={len_q} S={len_kv}"


def test_logsumexp_is_not_differentiable(rng):
    q, k, v = (t.requires_grad_() for t in rng.inputs(2, 4, 16))
    out, lse = forward_op(q, k, v, 0.25, False)
    assert out.requires_grad
    assert not lse.requires_grad, "a gradient through logsumexp would be silently dropped"


def forward_samples(rng):
    """(args, requires_grad) samples: contiguous, views, 2-D, causal and empty inputs."""
    q, k, v = rng.inputs(2, 5, 16, dtype=torch.float64, kv_len=7)
    yield (q, k, v, 0.25, False), True
    yield (q, k, v, 0.25, True), True
    q4, k4, v4 = (rng.randn(2, n, 3, 16) for n in (6, 4, 4))
    yield (q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), 0.5, True), True
    q, k, v = rng.inputs(1, 3, 32, dtype=torch.float16, kv_len=4)
    yield (q[0], k.expand(2, 4, 32)[1], v[0, :, ::1], 0.1, False), False
    for name, (shape, kv_len) in {
        "batch 0": ((0, 3, 16), 4),
        "L 0": ((2, 0, 16), 4),
        "S 0": ((2, 3, 16), 0),
    }.items():
        q, k, v = rng.inputs(*shape, kv_len=kv_len)
        yield (q, k, v, 0.25, name == "S 0"), True


def test_opcheck_forward(rng):
    for args, requires_grad in forward_samples(rng):
        if requires_grad:
            args = (*(t.detach().requires_grad_() for t in args[:3]), *args[3:])
        torch.library.opcheck(forward_op, args)


def test_opcheck_backward(rng):
    for args, _ in forward_samples(rng):
        q, k, v, scale, causal = args
        out, lse = forward_op(q, k, v, scale, causal)
        grad_out = rng.randn(*reversed(out.shape), dtype=out.dtype).permute(
            *reversed(range(out.dim()))
        )
        torch.library.opcheck(backward_op, (grad_out, q, k, v, out, lse, scale, causal))


def test_compile_fullgraph_with_gradients(rng):
    torch._dynamo.reset()

    def loss_fn(q, k, v, grad_out):
        return (fixed.fast_attention(q, k, v, is_causal=True) * grad_out).sum()

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    for leading, len_q, len_kv, head_dim in GRAD_SHAPES[:2]:
        q, k, v = (t.requires_grad_() for t in rng.inputs(*leading, len_q, head_dim, kv_len=len_kv))
        grad_out = rng.randn(*q.shape)
        compiled(q, k, v, grad_out).backward()
        expected = attention_with_grads(q, k, v, grad_out, causal=True)[1:]
        for name, got, want in zip(
            ("dq", "dk", "dv"), (q.grad, k.grad, v.grad), expected, strict=True
        ):
            error = relative_error(got, want)
            with check:
                assert error <= TOLERANCE[torch.float32], (
                    f"{rng} {list(q.shape)} {name}: {error:.2e}"
                )


def test_compiled_bad_input_is_loud(rng):
    torch._dynamo.reset()
    compiled = torch.compile(fixed.fast_attention, fullgraph=True, backend="aot_eager")
    q, k, v = rng.inputs(2, 5, 32)
    with pytest.raises(Exception, match=r"key.*\[2, 5, 16\]"):
        compiled(q, k[..., :16], v[..., :16])


def test_meta_tensors():
    q = torch.empty(2, 3, 5, 64, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(2, 3, 9, 64, device="meta", dtype=torch.bfloat16)
    out = fixed.fast_attention(q, kv, kv, is_causal=True)
    assert (out.device.type, out.shape, out.dtype) == ("meta", q.shape, q.dtype)
    out, lse = forward_op(q, kv, kv, 0.125, False)
    assert (lse.device.type, lse.shape, lse.dtype) == ("meta", (2, 3, 5), torch.float32)
    grads = backward_op(out, q, kv, kv, out, lse, 0.125, False)
    assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]


def test_parallel_result_does_not_depend_on_thread_count(rng):
    q, k, v = (t.requires_grad_() for t in rng.inputs(4, 64, 64, kv_len=64))
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            out = fixed.fast_attention(q, k, v, is_causal=True)
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            results.append((out, *grads))
    finally:
        torch.set_num_threads(threads)
    for one, many in zip(*results, strict=True):
        assert torch.equal(one, many), f"{rng}: results differ between 1 and several threads"


# Bad inputs: (id, make(q, k, v) -> args for fast_attention, exception type, message pattern).
# Since issue 15 leading dims broadcast as SDPA's, any head dim works on the CPU and Ev may differ
# from E: those cases moved to test_head_dims_sdpa_accepts and test_broadcast_leading_dims.
BAD_INPUTS = (
    ("int32", lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, r"query must be .*got int32"),
    ("mixed dtypes", lambda q, k, v: (q, k.half(), v), TypeError, r"key .*float32.*float16"),
    ("1-D query", lambda q, k, v: (q[0, 0], k, v), ValueError, r"query must have shape .*\[16\]"),
    (
        "leading dims do not broadcast",
        lambda q, k, v: (q, torch.cat([k, k[:1]]), v),
        ValueError,
        r"key.*\[3, 5, 16\]",
    ),
    (
        "ranks differ, trailing leading dims do not broadcast",
        lambda q, k, v: (q, k.unsqueeze(1).expand(2, 3, 5, 16), v),
        ValueError,
        r"key.*\[2, 3, 5, 16\]",
    ),
    (
        "kv lengths differ",
        lambda q, k, v: (q, k, v[:, :3]),
        ValueError,
        r"value .*5.*\[2, 3, 16\]",
    ),
    (
        "kv head dim",
        lambda q, k, v: (q, k[..., :8], v),
        ValueError,
        r"key must .*(head dim|query's E).*\[2, 5, 8\]",
    ),
    (
        "head dim 0",
        lambda q, k, v: (q[..., :0], k[..., :0], v),
        ValueError,
        r"head dim",
    ),
    (
        "value head dim 0",
        lambda q, k, v: (q, k, v[..., :0]),
        ValueError,
        r"head dim",
    ),
    ("key on meta", lambda q, k, v: (q, k.to("meta"), v), ValueError, r"query on cpu, key on meta"),
    (
        "query on meta",
        lambda q, k, v: (q.to("meta"), k, v),
        ValueError,
        r"query on meta, key on cpu",
    ),
)


@pytest.mark.parametrize(
    ("make", "error", "pattern"), [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_raises(rng, make, error, pattern):
    q, k, v = rng.inputs(2, 3, 16, kv_len=5)
    with pytest.raises(error, match=pattern):
        fixed.fast_attention(*make(q, k, v))


@pytest.mark.parametrize(
    ("make", "error", "pattern"),
    [b[1:] for b in BAD_INPUTS[:-2]],
    ids=[b[0] for b in BAD_INPUTS[:-2]],
)
def test_bad_meta_input_raises_in_fake_kernel(make, error, pattern):
    """Meta and fake tensors never reach C++: the fake kernel must reject the same inputs."""
    q, k, v = (torch.empty(s, device="meta") for s in ((2, 3, 16), (2, 5, 16), (2, 5, 16)))
    with pytest.raises(error, match=pattern):
        fixed.fast_attention(*make(q, k, v))


@pytest.mark.parametrize("position", ["query", "key", "value"])
def test_non_tensor_raises_type_error(rng, position):
    args = dict(zip(("query", "key", "value"), rng.inputs(2, 3, 16), strict=True))
    args[position] = args[position].tolist()
    with pytest.raises(TypeError, match=rf"{position} must be a torch.Tensor; got list"):
        fixed.fast_attention(**args)


@pytest.mark.parametrize(
    ("head_dim", "head_dim_v"), [(8, 8), (12, 12), (264, 264), (16, 32), (12, 264), (1, 1)]
)
def test_head_dims_sdpa_accepts(rng, head_dim, head_dim_v):
    """Head dims that used to be refused (8, 12, 264: any E on the CPU since issue 15) and a
    value head dim Ev != E: output (..., L, Ev) and gradients against the reference."""
    q, k, _ = rng.inputs(2, 3, head_dim, dtype=torch.float64, kv_len=5)
    v = rng.randn(2, 5, head_dim_v, dtype=torch.float64)
    grad_out = rng.randn(2, 3, head_dim_v, dtype=torch.float64)
    for causal in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fixed.fast_attention(*leaves, is_causal=causal)
        out.backward(grad_out)
        assert out.shape == (2, 3, head_dim_v), f"{rng} E={head_dim} Ev={head_dim_v}"
        expected = attention_with_grads(q, k, v, grad_out, causal=causal)
        for name, got, want in zip(
            ("output", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), expected, strict=True
        ):
            error = relative_error(got, want)
            with check:
                assert error <= TOLERANCE[torch.float64], (
                    f"{rng} E={head_dim} Ev={head_dim_v} causal={causal} {name}: {error:.2e}"
                )


def test_broadcast_leading_dims(rng):
    """Leading dims broadcast as SDPA's (these were errors before issue 15): a key without the
    batch dim, a batch of 1; the gradient of a broadcast input is summed over the broadcast."""
    q, k, v = rng.inputs(2, 3, 16, dtype=torch.float64, kv_len=5)
    for name, key, value in (
        ("key and value without the batch dim", k[0], v[0]),
        ("key and value with batch 1", k[:1], v[:1]),
    ):
        leaves = [t.clone().requires_grad_() for t in (q, key, value)]
        out = fixed.fast_attention(*leaves, is_causal=True)
        grad_out = rng.randn(*out.shape, dtype=torch.float64)
        out.backward(grad_out)
        expanded = [t.expand(2, 5, 16) for t in (key, value)]
        _, dq, dk, dv = attention_with_grads(q, *expanded, grad_out, causal=True)
        want = (dq, dk.sum(0).view(key.shape), dv.sum(0).view(value.shape))
        for grad_name, leaf, w in zip(("dq", "dk", "dv"), leaves, want, strict=True):
            error = relative_error(leaf.grad, w)
            with check:
                assert error <= TOLERANCE[torch.float64], f"{rng} {name} {grad_name}: {error:.2e}"


def test_validation_lives_in_cpp(rng):
    """The operator is callable without fast_attention: the C++ checks must catch bad input."""
    q, k, v = rng.inputs(2, 3, 16, kv_len=5)
    with pytest.raises(
        TypeError, match=r"query must be float32, float64, float16 or bfloat16; got int64"
    ):
        forward_op(q.long(), k.long(), v.long(), 0.25, False)
    with pytest.raises(
        ValueError, match=r"key must have shape \(\.\.\., S, 16\).*got \[2, 5, 24\]"
    ):
        forward_op(q, torch.cat([k, k[..., :8]], -1), v, 0.25, False)
    out, lse = forward_op(q, k, v, 0.25, False)
    with pytest.raises(TypeError, match=r"logsumexp must be float32 .*got float16"):
        backward_op(out, q, k, v, out, lse.half(), 0.25, False)
    with pytest.raises(ValueError, match=r"logsumexp must have shape \[2, 3\].*got \[2, 4\]"):
        backward_op(out, q, k, v, out, torch.zeros(2, 4), 0.25, False)
    with pytest.raises(ValueError, match=r"grad_output must have the output's shape"):
        backward_op(out[:, :2], q, k, v, out, lse, 0.25, False)


@pytest.mark.parametrize(
    ("shape", "kv_len"), [((0, 3, 16), 4), ((2, 0, 16), 4), ((2, 3, 16), 0), ((0, 0, 16), 0)]
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_empty_inputs(rng, shape, kv_len, causal):
    q, k, v = (t.requires_grad_() for t in rng.inputs(*shape, kv_len=kv_len))
    out, lse = forward_op(q, k, v, 0.25, causal)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    assert torch.equal(out, torch.zeros_like(out)), "S == 0 must give zeros, as SDPA"
    assert torch.equal(lse, torch.full_like(lse, -math.inf)), "S == 0 must give logsumexp -inf"
    fixed.fast_attention(q, k, v, is_causal=causal).sum().backward()
    for name, t in (("query", q), ("key", k), ("value", v)):
        assert t.grad is not None and t.grad.shape == t.shape, f"grad of {name}"
        assert torch.equal(t.grad, torch.zeros_like(t)), f"grad of {name} must be zeros"


def test_warm_import_uses_the_stamped_library_from_any_directory(tmp_path):
    """Import from elsewhere (no relative library path), and take the fast path when built."""
    script = (
        "import sys, torch, fixed\n"
        "from fixed import _build\n"
        "q = torch.randn(2, 3, 16)\n"
        "assert fixed.fast_attention(q, q, q).shape == q.shape\n"
        "print(_build._loaded.name, 'torch.utils.cpp_extension' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    name, cpp_extension_imported = result.stdout.split()
    config = _build._build_config(_build._flavour())
    assert name == f"{config['name']}-{_build._stamp(config)}.so", (
        "warm import must use the stamped copy"
    )
    assert cpp_extension_imported == "False", "warm import must not import cpp_extension"


def test_missing_toolchain_says_what_is_missing(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    with pytest.raises(RuntimeError, match=r"^C\+\+ compiler 'no-such-c\+\+-compiler' not found"):
        _build._check_toolchain("cpu")
    monkeypatch.setenv("CXX", sys.executable)  # any existing absolute path
    monkeypatch.setenv("PATH", "")
    with pytest.raises(RuntimeError, match=r"^ninja not found: .*pip install ninja"):
        _build._check_toolchain("cpu")
