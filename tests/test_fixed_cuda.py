"""fixed/'s CUDA kernels (fixed/csrc/attention_cuda.cu, kernels/attention_kernels.cuh) on a GPU:
results against the float64 reference, opcheck, torch.compile, CUDA graphs, the current stream, the
device guard, bad and empty inputs, and compute-sanitizer. Every test needs CUDA and skips,
saying so, without it. Inputs are fresh each run; FIXED_CUDA_SEED=<seed> replays a failure."""

from __future__ import annotations

import contextlib
import math
import textwrap

import pytest
import torch

from kata.harness import reference
from kata.harness.reference import TOLERANCE, attention, attention_with_grads, relative_error
from tests.cuda_support import (
    NEEDS_CUDA,
    dtype_id,
    fixed_with_cuda_kernels,
    lse_error,
    make_inputs,
    poison_allocator,
    randn,
    replay_hint,
    sanitize,
    seed_fixture,
)

try:
    from pytest_check import check
except ImportError:  # pytest-check may be missing on the GPU machine: stop at the first failure
    check = contextlib.nullcontext()

pytestmark = NEEDS_CUDA

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIMS = [16, 24, 64, 128, 256]
# (leading dims, L, S): ragged lengths, L < S and L > S, none, one or two leading dims.
FORWARD_CASES = [
    ((), 1, 1),
    ((2,), 7, 33),
    ((2, 3), 33, 7),
    ((3,), 129, 257),
    ((), 257, 129),
    ((1,), 1000, 1000),
]
GRADIENT_CASES = [((), 1, 1), ((2,), 7, 33), ((2, 3), 33, 7), ((), 129, 257), ((1,), 300, 200)]


fixed = pytest.fixture(fixed_with_cuda_kernels, scope="module", name="fixed")
seed = seed_fixture("FIXED_CUDA_SEED")
replay = replay_hint("FIXED_CUDA_SEED", __file__)


# ------------------------------------------------------------------------- results, forward


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_forward_matches_reference(fixed, seed, dtype, head_dim, causal):
    generator = torch.Generator().manual_seed(seed)
    scale = 1.0 / math.sqrt(head_dim)
    for lead, len_q, len_kv in FORWARD_CASES:
        q, k, v = make_inputs(lead, len_q, len_kv, head_dim, dtype, generator)
        where = (
            f"{dtype_id(dtype)} q{list(q.shape)} kv{list(k.shape)} causal={causal}; {replay(seed)}"
        )
        poison_allocator((q.shape, dtype), (q.shape[:-1], torch.float32))
        out, lse = torch.ops.fixed_attention.attention_forward(q, k, v, scale, causal)
        with check:
            assert (out.shape, out.dtype, out.device) == (q.shape, dtype, q.device), where
        with check:
            assert (lse.shape, lse.dtype) == (q.shape[:-1], torch.float32), where
        error = relative_error(out, attention(q, k, v, scale=scale, causal=causal))
        with check:
            assert error <= TOLERANCE[dtype], f"output relative error {error:.2e}: {where}"
        error = lse_error(lse, reference.logsumexp(q, k, scale=scale, causal=causal))
        with check:
            assert error <= 1e-5, f"logsumexp error {error:.2e}: {where}"


def test_views_and_custom_scale(fixed, seed):
    """Transposed, sliced and expanded inputs (one contiguous copy in the glue), scale ≠ 1/√E."""
    generator = torch.Generator().manual_seed(seed)
    batch, heads, len_q, len_kv, head_dim = 2, 3, 45, 70, 64
    for dtype in DTYPES:
        # (B, L, H, E) memory seen as (B, H, L, E); every other row; one head broadcast by stride 0.
        q = randn((batch, len_q, heads, head_dim), dtype, generator).transpose(1, 2)
        k = randn((batch, heads, 2 * len_kv, head_dim), dtype, generator)[:, :, ::2]
        v = randn((batch, 1, len_kv, head_dim), dtype, generator).expand(-1, heads, -1, -1)
        grad = randn((batch, len_q, heads, head_dim), dtype, generator).transpose(1, 2)
        assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
        for scale, causal in ((0.3, False), (0.05, True)):
            where = f"{dtype_id(dtype)} scale={scale} causal={causal}; {replay(seed)}"
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            out = fixed.fast_attention(*leaves, scale=scale, is_causal=causal)
            out.backward(grad)
            ref_out, *ref_grads = attention_with_grads(q, k, v, grad, scale=scale, causal=causal)
            error = relative_error(out, ref_out)
            with check:
                assert error <= TOLERANCE[dtype], f"output relative error {error:.2e}: {where}"
            for name, leaf, ref in zip("qkv", leaves, ref_grads, strict=True):
                error = relative_error(leaf.grad, ref)
                with check:
                    assert error <= TOLERANCE[dtype], f"d{name} relative error {error:.2e}: {where}"


def test_more_batch_items_than_a_grid_dim_holds(fixed, seed):
    """70,000 batch items: more than gridDim.y/z (65,535) could hold."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = make_inputs((70_000,), 3, 5, 16, torch.float16, generator)
    grad = randn(q.shape, torch.float16, generator)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    out = fixed.fast_attention(*leaves, is_causal=True)
    out.backward(grad)
    ref_out, *ref_grads = attention_with_grads(q, k, v, grad, causal=True)
    for name, got, ref in zip(
        ["out", "dq", "dk", "dv"],
        [out, *(t.grad for t in leaves)],
        [ref_out, *ref_grads],
        strict=True,
    ):
        error = relative_error(got, ref)
        assert error <= TOLERANCE[torch.float16], (
            f"{name} relative error {error:.2e}: {replay(seed)}"
        )


# ----------------------------------------------------------------------- results, gradients


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gradients_match_reference(fixed, seed, dtype, head_dim, causal):
    generator = torch.Generator().manual_seed(seed)
    for lead, len_q, len_kv in GRADIENT_CASES:
        inputs = make_inputs(lead, len_q, len_kv, head_dim, dtype, generator)
        grad = randn(inputs[0].shape, dtype, generator)
        shapes = f"q{list(inputs[0].shape)} kv{list(inputs[1].shape)}"
        where = f"{dtype_id(dtype)} {shapes} causal={causal}; {replay(seed)}"
        leaves = [t.requires_grad_(True) for t in inputs]
        out = fixed.fast_attention(*leaves, is_causal=causal)
        poison_allocator(*((t.shape, dtype) for t in leaves), (grad.shape[:-1], torch.float32))
        out.backward(grad)
        _, *ref_grads = attention_with_grads(*inputs, grad, causal=causal)
        # One key (S = 1): P = 1, so dS = P (dP − delta), dq and dk are exactly 0, and a kernel's
        # are the rounding noise of dP − delta. Measure them against the gradients' size (|dv|).
        zero_floor = max(ref.norm().item() for ref in ref_grads)
        for name, leaf, ref in zip("qkv", leaves, ref_grads, strict=True):
            with check:
                assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == dtype, where
            floor = zero_floor if ref.norm().item() == 0 else 0.0
            error = relative_error(leaf.grad, ref, floor=floor)
            with check:
                assert error <= TOLERANCE[dtype], f"d{name} relative error {error:.2e}: {where}"


def test_backward_is_deterministic(fixed, seed):
    """float32 at head dim 160 (over 128: the generic kernels, one thread per gradient element,
    no atomics), and float32 and bf16 at 64 under torch.use_deterministic_algorithms(True), where
    the glue turns away from the tensor-core backwards (their dQ sums by atomics): two runs
    agree bit for bit."""
    generator = torch.Generator().manual_seed(seed)
    cases = ((torch.float32, 160, False), (torch.float32, 64, True), (torch.bfloat16, 64, True))
    for dtype, head_dim, deterministic in cases:
        q, k, v = make_inputs((2, 4), 300, 300, head_dim, dtype, generator)
        grad = randn(q.shape, dtype, generator)
        out, lse = torch.ops.fixed_attention.attention_forward(q, k, v, 0.1, True)
        previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic)
        try:
            first, second = (
                torch.ops.fixed_attention.attention_backward(grad, q, k, v, out, lse, 0.1, True)
                for _ in range(2)
            )
        finally:
            torch.use_deterministic_algorithms(previous)
        for name, a, b in zip(["dq", "dk", "dv"], first, second, strict=True):
            assert torch.equal(a, b), (
                f"{dtype_id(dtype)} e{head_dim} {name} differs between runs: {replay(seed)}"
            )


# --------------------------------------------------------------- the PyTorch operator contract


def _opcheck_forward_samples(generator):
    def t(*shape, dtype=torch.float32):
        return randn(shape, dtype, generator)

    def transposed(*shape, dtype=torch.float32):  # (B, L, H, E) memory seen as (B, H, L, E)
        return randn(shape, dtype, generator).transpose(1, 2)

    return {
        "float32": (t(2, 5, 32), t(2, 7, 32), t(2, 7, 32), 0.2, False),
        "bfloat16-causal-4d": (
            t(2, 3, 9, 64, dtype=torch.bfloat16),
            t(2, 3, 5, 64, dtype=torch.bfloat16),
            t(2, 3, 5, 64, dtype=torch.bfloat16),
            0.125,
            True,
        ),
        "float16-e256-non-contiguous": (
            transposed(2, 6, 2, 256, dtype=torch.float16),
            transposed(2, 11, 2, 256, dtype=torch.float16),
            transposed(2, 11, 2, 256, dtype=torch.float16),
            0.0625,
            True,
        ),
        "empty-batch": (t(0, 4, 32), t(0, 6, 32), t(0, 6, 32), 0.2, False),
        "empty-L": (t(2, 0, 32), t(2, 6, 32), t(2, 6, 32), 0.2, True),
        "empty-S": (t(2, 4, 32), t(2, 0, 32), t(2, 0, 32), 0.2, False),
    }


OPCHECK_SAMPLES = [
    "float32",
    "bfloat16-causal-4d",
    "float16-e256-non-contiguous",
    "empty-batch",
    "empty-L",
    "empty-S",
]


@pytest.mark.parametrize("sample", OPCHECK_SAMPLES)
def test_opcheck_forward(fixed, seed, sample):
    samples = _opcheck_forward_samples(torch.Generator().manual_seed(seed))
    assert list(samples) == OPCHECK_SAMPLES, "OPCHECK_SAMPLES must name every sample"
    query, key, value, scale, causal = samples[sample]
    # Leaves that require grad: opcheck's aot_dispatch test runs the backward op through autograd.
    args = (*(t.detach().requires_grad_(True) for t in (query, key, value)), scale, causal)
    torch.library.opcheck(torch.ops.fixed_attention.attention_forward.default, args)


@pytest.mark.parametrize("sample", ["float32", "float16-e256-non-contiguous", "empty-S"])
def test_opcheck_backward(fixed, seed, sample):
    generator = torch.Generator().manual_seed(seed)
    query, key, value, scale, causal = _opcheck_forward_samples(generator)[sample]
    out, lse = torch.ops.fixed_attention.attention_forward(query, key, value, scale, causal)
    grad = randn(out.shape, out.dtype, generator)
    if not query.is_contiguous():
        grad = grad.transpose(-2, -1).contiguous().transpose(-2, -1)  # a strided view too
    args = (grad, query, key, value, out, lse, scale, causal)
    torch.library.opcheck(torch.ops.fixed_attention.attention_backward.default, args)


def test_torch_compile_inductor_forward_and_backward(fixed, seed):
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs((2, 3), 40, 56, 64, torch.float32, generator)
    weight = randn(inputs[0].shape, torch.float32, generator)

    def loss_fn(q, k, v):
        out = fixed.fast_attention(q * 0.5, k, v, is_causal=True)
        return out, (out * weight).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="inductor")
    results = {}
    for name, fn in (("eager", loss_fn), ("compiled", compiled)):
        leaves = [t.detach().requires_grad_(True) for t in inputs]
        out, loss = fn(*leaves)
        results[name] = (out, *torch.autograd.grad(loss, leaves))
    ref = attention_with_grads(inputs[0] * 0.5, inputs[1], inputs[2], weight, causal=True)
    for i, name in enumerate(["out", "dq", "dk", "dv"]):
        compiled_result, eager_result = results["compiled"][i], results["eager"][i]
        error = relative_error(compiled_result, eager_result.double().cpu())
        with check:
            assert error <= 1e-6, (
                f"compiled {name} differs from eager by {error:.2e}: {replay(seed)}"
            )
        reference = ref[i] * 0.5 if name == "dq" else ref[i]  # d(0.5 q)/dq
        error = relative_error(compiled_result, reference)
        with check:
            assert error <= TOLERANCE[torch.float32], (
                f"compiled {name}: {error:.2e}: {replay(seed)}"
            )


@pytest.mark.parametrize("head_dim", [64, 256], ids=["e64", "e256-smem-opt-in"])
def test_cuda_graph_capture_and_replay(fixed, seed, head_dim):
    """Forward and backward captured once, replayed on new inputs copied into the static ones."""
    generator = torch.Generator().manual_seed(seed)
    dtype, shape = torch.float16, ((2, 4), 77, 90)
    static = [t.requires_grad_(True) for t in make_inputs(*shape, head_dim, dtype, generator)]
    static_grad = randn(static[0].shape, dtype, generator)

    def step():
        out = fixed.fast_attention(*static, is_causal=True)
        return (out, *torch.autograd.grad(out, static, static_grad))

    side = torch.cuda.Stream()  # warm-up off the capture, as torch.cuda.graph's docs advise
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_results = step()

    for trial in range(3):
        new_inputs = make_inputs(*shape, head_dim, dtype, generator)
        new_grad = randn(static_grad.shape, dtype, generator)
        with torch.no_grad():
            for target, source in zip([*static, static_grad], [*new_inputs, new_grad], strict=True):
                target.copy_(source)
        graph.replay()
        results = [t.cpu() for t in static_results]  # read right after the replay
        refs = attention_with_grads(*new_inputs, new_grad, causal=True)
        for name, got, ref in zip(["out", "dq", "dk", "dv"], results, refs, strict=True):
            error = relative_error(got, ref)
            with check:
                assert error <= TOLERANCE[dtype], (
                    f"replay {trial} {name}: {error:.2e}: {replay(seed)}"
                )


def test_memory_is_flat_over_1000_calls(fixed, seed):
    generator = torch.Generator().manual_seed(seed)
    leaves = [
        t.requires_grad_(True) for t in make_inputs((2, 4), 128, 96, 64, torch.float16, generator)
    ]
    grad = randn(leaves[0].shape, torch.float16, generator)

    def step():
        fixed.fast_attention(*leaves, is_causal=True).backward(grad)
        for leaf in leaves:
            leaf.grad = None

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(1000):
        step()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    assert after == before, f"memory_allocated grew by {after - before} bytes over 1000 calls"


def test_runs_on_the_current_stream(fixed, seed):
    """Under torch.cuda.stream(s), inputs written on s just before the call and the output read
    on s right after it: a kernel on any other stream reads stale inputs or is read too early."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = make_inputs((16, 8), 1024, 1024, 64, torch.float16, generator)
    expected = fixed.fast_attention(q, k, v)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for trial in range(3):
        with torch.cuda.stream(side):
            q_on_side = torch.full_like(q, math.nan)
            torch.cuda._sleep(50_000_000)  # tens of ms: s is busy, other streams run ahead
            q_on_side.copy_(q)
            result = fixed.fast_attention(q_on_side, k, v).clone()
        torch.cuda.synchronize()
        assert torch.equal(result, expected), (
            f"trial {trial}: the result read on the current stream differs from the one on the "
            f"default stream (max diff {(result.float() - expected.float()).abs().max().item()}): "
            "the kernel ran on another stream"
        )


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("head_dim", [64, 256], ids=["e64", "e256-smem-opt-in"])
def test_inputs_on_the_second_gpu(fixed, seed, head_dim):
    generator = torch.Generator().manual_seed(seed)
    device = torch.device("cuda", 1)
    with torch.cuda.device(0):  # current device 0, inputs on 1: the op must follow the inputs
        inputs = make_inputs((2,), 50, 70, head_dim, torch.bfloat16, generator, device)
        grad = randn(inputs[0].shape, torch.bfloat16, generator, device)
        leaves = [t.requires_grad_(True) for t in inputs]
        out = fixed.fast_attention(*leaves, is_causal=True)
        out.backward(grad)
        torch.cuda.synchronize(device)
    refs = attention_with_grads(*inputs, grad, causal=True)
    for name, got, ref in zip(
        ["out", "dq", "dk", "dv"], [out, *(t.grad for t in leaves)], refs, strict=True
    ):
        assert got.device == device, f"{name} on {got.device}, inputs on {device}"
        error = relative_error(got, ref)
        assert error <= TOLERANCE[torch.bfloat16], f"{name}: {error:.2e}: {replay(seed)}"


@pytest.mark.bigmem
def test_more_than_2_to_the_31_elements(fixed, seed):
    """int64 offsets: query, output and grad_query hold 2**31 + 65,536 elements."""
    free, _ = torch.cuda.mem_get_info()
    if free < 24 * 2**30:
        pytest.skip(f"needs about 24 GiB of free GPU memory; {free / 2**30:.1f} GiB free")
    generator = torch.Generator(device="cuda").manual_seed(seed)
    batch, len_q, len_kv, head_dim = 2**19 + 16, 64, 8, 64
    q = torch.randn(batch, len_q, head_dim, device="cuda", dtype=torch.float16, generator=generator)
    k, v = (
        torch.randn(
            batch, len_kv, head_dim, device="cuda", dtype=torch.float16, generator=generator
        )
        for _ in range(2)
    )
    assert q.numel() > 2**31
    out, lse = torch.ops.fixed_attention.attention_forward(q, k, v, 0.125, True)
    grads = torch.ops.fixed_attention.attention_backward(out, q, k, v, out, lse, 0.125, True)
    rows = [0, batch // 2, batch - 1]  # the last items lie past 2**31 elements
    sample = [t[rows] for t in (q, k, v, out)]
    refs = attention_with_grads(*sample[:3], sample[3], scale=0.125, causal=True)
    for name, got, ref in zip(["out", "dq", "dk", "dv"], [out, *grads], refs, strict=True):
        error = relative_error(got[rows], ref)
        assert error <= TOLERANCE[torch.float16], f"{name} rows {rows}: {error:.2e}: {replay(seed)}"


# --------------------------------------------------------------------------- bad and empty


def test_float64_on_cuda_is_a_type_error(fixed):
    q = torch.randn(2, 5, 64, device="cuda", dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        fixed.fast_attention(q, q, q)


@pytest.mark.parametrize("cpu_argument", ["query", "key", "value"])
def test_cuda_cpu_mix_names_both_devices(fixed, cpu_argument):
    tensors = {name: torch.randn(2, 5, 64, device="cuda") for name in ("query", "key", "value")}
    tensors[cpu_argument] = tensors[cpu_argument].cpu()
    with pytest.raises((ValueError, RuntimeError)) as raised:
        fixed.fast_attention(**tensors)
    message = str(raised.value)
    assert "cpu" in message and "cuda" in message, f"message names both devices: {message}"


def test_backward_with_a_cpu_grad_output_names_both_devices(fixed):
    q = torch.randn(2, 5, 64, device="cuda")
    out, lse = torch.ops.fixed_attention.attention_forward(q, q, q, 0.125, False)
    with pytest.raises((ValueError, RuntimeError)) as raised:
        torch.ops.fixed_attention.attention_backward(out.cpu(), q, q, q, out, lse, 0.125, False)
    message = str(raised.value)
    assert "cpu" in message and "cuda" in message, f"message names both devices: {message}"


@pytest.mark.parametrize(("head_dim", "head_dim_v"), [(264, 264), (264, 64), (64, 264)])
def test_head_dim_over_256_is_a_value_error(fixed, head_dim, head_dim_v):
    q = torch.randn(2, 5, head_dim, device="cuda")
    v = torch.randn(2, 5, head_dim_v, device="cuda")
    with pytest.raises(ValueError, match="at most 256"):
        fixed.fast_attention(q, q, v)


@pytest.mark.parametrize("head_dim", [1, 8, 20, 59])
def test_any_head_dim_up_to_256_is_accepted(fixed, seed, head_dim):
    """Head dims 8 and 20 were refused before issue 15; every E from 1 to 256 is accepted now."""
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs((2,), 7, 9, head_dim, torch.float32, generator)
    grad = randn(inputs[0].shape, torch.float32, generator)
    leaves = [t.requires_grad_(True) for t in inputs]
    out = fixed.fast_attention(*leaves, is_causal=True)
    out.backward(grad)
    refs = attention_with_grads(*inputs, grad, causal=True)
    for name, got, ref in zip(
        ["out", "dq", "dk", "dv"], [out, *(t.grad for t in leaves)], refs, strict=True
    ):
        error = relative_error(got, ref)
        assert error <= TOLERANCE[torch.float32], f"e{head_dim} {name}: {error:.2e}: {replay(seed)}"


@pytest.mark.parametrize(
    ("q_shape", "kv_shape"),
    [((0, 5, 64), (0, 7, 64)), ((2, 0, 64), (2, 7, 64)), ((2, 5, 64), (2, 0, 64))],
    ids=["batch-0", "L-0", "S-0"],
)
def test_empty_inputs(fixed, q_shape, kv_shape):
    leaves = [
        torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
        for shape in (q_shape, kv_shape, kv_shape)
    ]
    out, lse = torch.ops.fixed_attention.attention_forward(*leaves, 0.125, False)
    assert out.shape == q_shape and lse.shape == q_shape[:-1]
    assert out.device.type == "cuda" and lse.dtype == torch.float32
    out = fixed.fast_attention(*leaves)
    out.backward(torch.randn_like(out))
    for leaf in leaves:
        assert leaf.grad.shape == leaf.shape
    if kv_shape[-2] == 0:  # nothing to attend to: zeros, as SDPA; lse -inf; no gradient
        assert torch.equal(out, torch.zeros_like(out))
        assert bool((lse == -math.inf).all())
        assert not any(leaf.grad.any() for leaf in leaves)


def test_empty_inputs_launch_no_kernel(fixed):
    def kernels_launched(*shapes):
        q, k, v = (torch.randn(s, device="cuda") for s in shapes)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            torch.ops.fixed_attention.attention_forward(q, k, v, 0.125, False)
            torch.cuda.synchronize()
        return [e.name for e in profile.events() if "attention" in e.name and "kernel" in e.name]

    if not kernels_launched((2, 5, 64), (2, 7, 64), (2, 7, 64)):
        pytest.skip("the profiler records no CUDA kernels here (CUPTI unavailable?)")
    assert kernels_launched((0, 5, 64), (0, 7, 64), (0, 7, 64)) == []
    assert kernels_launched((2, 0, 64), (2, 7, 64), (2, 7, 64)) == []


# --------------------------------------------------------------------------- compute-sanitizer

SANITIZER_SCRIPT = textwrap.dedent(
    """
    import torch
    import fixed

    generator = torch.Generator().manual_seed(0)
    for dtype, head_dim, len_q, len_kv, causal in (
        (torch.float32, 24, 37, 45, True),
        (torch.bfloat16, 64, 45, 37, False),
        (torch.float16, 256, 33, 20, True),
    ):
        q, k, v = (
            torch.randn(2, n, head_dim, generator=generator).to("cuda", dtype).requires_grad_()
            for n in (len_q, len_kv, len_kv)
        )
        out = fixed.fast_attention(q, k, v, is_causal=causal)
        out.backward(torch.randn(out.shape, generator=generator).to("cuda", dtype))
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
def test_compute_sanitizer(fixed, tmp_path, tool, clean):
    sanitize(tool, SANITIZER_SCRIPT, tmp_path, clean)
