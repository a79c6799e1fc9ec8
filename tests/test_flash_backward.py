"""fixed/'s tensor-core backward (fixed/csrc/kernels/flash_backward.cuh: mma.sync, bf16 and fp16,
head dims 64 and 128; on compute capability 9.0 flash_backward_sm90.cuh, wgmma, with the same
prologue and dq kernels; float32 at head dim 64: flash_backward_f32.cuh, 3xTF32) on a GPU: dQ,
dK and dV against the float64 reference and, half precision, against the float32 kernels,
ragged lengths around the 64-query and 128-key blocks, L != S both ways, causal, views,
negative scales, misaligned inputs, which kernels ran (compute-sanitizer on them:
test_flash_backward_sanitizer.py). Every test needs CUDA and skips, saying so, without it.
Inputs are fresh each run; FLASH_SEED=<seed> replays a failure."""

from __future__ import annotations

import contextlib
import math
import subprocess

import pytest
import torch

from kata.harness.reference import TOLERANCE, attention_with_grads, relative_error
from tests.cuda_support import (
    NEEDS_CUDA,
    dtype_id,
    find_cuda_tool,
    fixed_with_cuda_kernels,
    poison_allocator,
    randn,
    replay_hint,
    seed_fixture,
)

try:
    from pytest_check import check
except ImportError:  # pytest-check may be missing on the GPU machine: stop at the first failure
    check = contextlib.nullcontext()

pytestmark = NEEDS_CUDA

HALF_DTYPES = [torch.bfloat16, torch.float16]
# float32: 3xTF32 (flash_backward_f32.cuh), held to float32's tolerance.
DTYPES = [*HALF_DTYPES, torch.float32]
# The head dims the tensor-core backward covers as they are (256: bf16/fp16 only, on the wide
# wgmma kernel on compute capability 9.0, the mma.sync one elsewhere; float32's tensor-core
# kernels stop at 128, and over it float32 runs generic).
HEAD_DIMS = [64, 128, 256]
# (leading dims, L, S): around the 64-row query blocks and 128-key blocks, L == S and L != S both
# ways (causal: keys past the last row get zero gradients), batch * heads from 1 to 64.
CASES = [
    ((), 1, 1),
    ((3,), 15, 15),
    ((2, 2), 63, 64),
    ((1,), 64, 63),
    ((5,), 65, 129),
    ((2, 3), 129, 65),
    ((4, 16), 127, 129),
    ((1,), 300, 1000),
    ((2,), 1000, 15),
    ((1,), 15, 1000),
    ((1,), 1100, 1100),
]
BACKWARD_KERNEL = "flash_backward_kernel"  # mma.sync
SM90_BACKWARD_KERNEL = "flash_backward_sm90_kernel"  # wgmma: compute capability 9.0
SM90_WIDE_BACKWARD_KERNEL = "flash_backward_sm90_wide_kernel"  # the same, head dims over 128
F32_BACKWARD_KERNEL = "flash_backward_f32_kernel"  # float32, every sm_80+ device
MAIN_KERNELS = (
    BACKWARD_KERNEL,
    SM90_BACKWARD_KERNEL,
    SM90_WIDE_BACKWARD_KERNEL,
    F32_BACKWARD_KERNEL,
)


def main_kernels(names):
    """The launched kernels that are a tensor-core backward's main kernel."""
    return [name for name in names if any(kernel in name for kernel in MAIN_KERNELS)]


fixed = pytest.fixture(fixed_with_cuda_kernels, scope="module", name="fixed")
seed = seed_fixture("FLASH_SEED")
replay = replay_hint("FLASH_SEED", __file__)


def make_inputs(lead, len_q, len_kv, head_dim, dtype, generator):
    return (
        randn((*lead, len_q, head_dim), dtype, generator),
        randn((*lead, len_kv, head_dim), dtype, generator),
        randn((*lead, len_kv, head_dim), dtype, generator),
        randn((*lead, len_q, head_dim), dtype, generator),  # the output's gradient
    )


def backward(q, k, v, grad, scale, causal):
    """(dq, dk, dv) from the operators, after poisoning the blocks they will land in."""
    out, lse = torch.ops.fixed_attention.attention_forward(q, k, v, scale, causal)
    poison_allocator((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype))
    return torch.ops.fixed_attention.attention_backward(grad, q, k, v, out, lse, scale, causal)


def check_against_reference(q, k, v, grad, scale, causal, where, tolerance=None):
    tolerance = TOLERANCE[q.dtype] if tolerance is None else tolerance
    grads = backward(q, k, v, grad, scale, causal)
    _, *reference = attention_with_grads(q, k, v, grad, scale=scale, causal=causal)
    # One key (S = 1): P = 1, so dS = P (dP - delta), dq and dk are exactly 0, and a kernel's are
    # the rounding noise of dP - delta. Measure them against the gradients' size, as
    # test_fixed_cuda.py does (float32's tolerance sees that noise).
    zero_floor = max(ref.norm().item() for ref in reference)
    for name, got, ref, leaf in zip(("dq", "dk", "dv"), grads, reference, (q, k, v), strict=True):
        with check:
            assert (got.shape, got.dtype) == (leaf.shape, leaf.dtype), f"{name}: {where}"
        error = relative_error(got, ref, floor=zero_floor if ref.norm().item() == 0 else 0.0)
        with check:
            assert error <= tolerance, f"{name} relative error {error:.2e}: {where}"


@pytest.mark.parametrize(
    ("dtype", "head_dim"),
    [(d, e) for d in DTYPES for e in HEAD_DIMS if d != torch.float32 or e <= 128],
    ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else f"e{v}",
)
def test_keys_past_s_stay_out_of_the_gradients(fixed, seed, dtype, head_dim):
    """The last key block's rows past S are zeros in shared memory, so their score is 0 and,
    unmasked, their P would be 2^-lse: here every real score is -36 sqrt(D) (-288 at D = 64)
    after the scale, so 2^-lse overflows float32 and dS = -P delta is inf; dQ = dS K then gave
    NaN (inf x 0). In fp16 the 16-bit dS^T overflows already at 65504: seen in test_sdpa_cuda.py's
    causal L = 77, S = 1 case at scale -0.3 on an H200. One real key: P = 1, dQ and dK are 0
    (to rounding), dV is the sum of the output's gradient over the rows. A float32 score this
    large holds its value only to |score| eps (4.9e-5 at D = 128): P, and so dV, is 1 to about
    that, in any float32 implementation; the tolerance allows twice it."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.full((2, 77, head_dim), -6.0, device="cuda", dtype=dtype)
    k = torch.full((2, 1, head_dim), 6.0, device="cuda", dtype=dtype)
    v = randn((2, 1, head_dim), dtype, generator)
    grad = randn((2, 77, head_dim), dtype, generator)
    score = 36 * head_dim**0.5
    tolerance = max(TOLERANCE[dtype], 2 * score * torch.finfo(torch.float32).eps)
    check_against_reference(q, k, v, grad, head_dim**-0.5, False, replay(seed), tolerance)
    kernels = main_kernels(kernels_launched(q, k, v, grad))
    assert kernels and tensor_core_kernels(dtype, head_dim)[1] in kernels[0], kernels


# ------------------------------------------------------------------------------- results


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda e: f"e{e}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gradients_match_reference(fixed, seed, dtype, head_dim, causal):
    generator = torch.Generator().manual_seed(seed)
    scale = 1.0 / math.sqrt(head_dim)
    for lead, len_q, len_kv in CASES:
        q, k, v, grad = make_inputs(lead, len_q, len_kv, head_dim, dtype, generator)
        where = (
            f"{dtype_id(dtype)} q{list(q.shape)} kv{list(k.shape)} causal={causal}; {replay(seed)}"
        )
        check_against_reference(q, k, v, grad, scale, causal, where)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda e: f"e{e}")
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_gradients_match_the_float32_kernels(fixed, seed, dtype, head_dim, causal):
    """The same inputs upcast to float32 take the float32 backward (3xTF32, held to float32's
    tolerance above): the half-precision gradients must agree with it within their own
    tolerance."""
    generator = torch.Generator().manual_seed(seed)
    scale = 0.7 / math.sqrt(head_dim)
    for lead, len_q, len_kv in [((2, 8), 300, 300), ((3,), 200, 77), ((1,), 77, 520)]:
        q, k, v, grad = make_inputs(lead, len_q, len_kv, head_dim, dtype, generator)
        where = (
            f"{dtype_id(dtype)} q{list(q.shape)} kv{list(k.shape)} causal={causal}; {replay(seed)}"
        )
        grads = backward(q, k, v, grad, scale, causal)
        grads32 = backward(q.float(), k.float(), v.float(), grad.float(), scale, causal)
        for name, got, ref in zip(("dq", "dk", "dv"), grads, grads32, strict=True):
            error = relative_error(got, ref.double().cpu())
            with check:
                assert error <= TOLERANCE[dtype], f"vs float32 kernels: {name} {error:.2e}: {where}"


def test_long_causal_batches_in_batch_major_order(fixed, seed):
    """Causal work goes longest first over the grid only while the streamed tensors (K and V
    forward, Q and dO backward) fit in about 3 L2 sizes (flash_common.cuh, longest_first_pays);
    the cases above all do. This one streams 4 L2 sizes, so both launchers take batch-major
    order: output and gradients must agree with the float32 kernels there too."""
    generator = torch.Generator().manual_seed(seed)
    head_dim, length = 128, 8192
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    batch = -(-4 * l2_bytes // (length * head_dim * 2 * 2))  # two 2-byte tensors of (B, S, D)
    q, k, v, grad = make_inputs((batch,), length, length, head_dim, torch.bfloat16, generator)
    scale = 1.0 / math.sqrt(head_dim)
    where = f"bf16 q{list(q.shape)} causal; {replay(seed)}"
    out, _ = torch.ops.fixed_attention.attention_forward(q, k, v, scale, True)
    out32, _ = torch.ops.fixed_attention.attention_forward(
        q.float(), k.float(), v.float(), scale, True
    )
    grads = backward(q, k, v, grad, scale, True)
    grads32 = backward(q.float(), k.float(), v.float(), grad.float(), scale, True)
    for name, got, ref in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), (out32, *grads32), strict=True
    ):
        # On the GPU: the float64 copies of these on the host would take gigabytes.
        error = ((got.float() - ref).norm() / ref.norm()).item()
        with check:
            assert error <= TOLERANCE[torch.bfloat16], (
                f"vs float32 kernels: {name} {error:.2e}: {where}"
            )


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda e: f"e{e}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_views_and_other_scales_through_autograd(fixed, seed, dtype, head_dim):
    """Transposed and strided views of leaves that require grad (the glue copies them once),
    through fast_attention's autograd, with scales other than 1/√E, negative ones included."""
    generator = torch.Generator().manual_seed(seed)
    batch, heads, len_q, len_kv = 2, 3, 145, 203
    for scale, causal in ((0.3, False), (0.05, True), (-0.2, False), (-0.2, True)):
        q = randn((batch, len_q, heads, head_dim), dtype, generator).transpose(1, 2)
        k = randn((batch, heads, 2 * len_kv, head_dim), dtype, generator)[:, :, ::2]
        v = randn((batch, len_kv, heads, head_dim), dtype, generator).transpose(1, 2)
        grad = randn((batch, heads, len_q, head_dim), dtype, generator)
        assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        fixed.fast_attention(*leaves, scale=scale, is_causal=causal).backward(grad)
        _, *reference = attention_with_grads(q, k, v, grad, scale=scale, causal=causal)
        where = f"{dtype_id(dtype)} e{head_dim} scale={scale} causal={causal}; {replay(seed)}"
        for name, leaf, ref in zip("qkv", leaves, reference, strict=True):
            error = relative_error(leaf.grad, ref)
            with check:
                assert error <= TOLERANCE[dtype], f"d{name} relative error {error:.2e}: {where}"


def test_misaligned_inputs_fall_back_and_stay_correct(fixed, seed):
    """A contiguous tensor at an odd storage offset is not 16-byte aligned: the tensor-core
    launcher declines it and the generic kernels answer."""
    generator = torch.Generator().manual_seed(seed)
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            shapes = [(2, 70, head_dim), (2, 90, head_dim), (2, 90, head_dim), (2, 70, head_dim)]
            q, k, v, grad = (
                randn((math.prod(shape) + 1,), dtype, generator)[1:].view(shape) for shape in shapes
            )
            assert q.is_contiguous() and q.data_ptr() % 16 != 0
            where = f"{dtype_id(dtype)} e{head_dim} misaligned; {replay(seed)}"
            check_against_reference(q, k, v, grad, 1.0 / math.sqrt(head_dim), True, where)


def test_dk_and_dv_are_deterministic(fixed, seed):
    """dK and dV: one CTA owns each key row, no atomics, bit-equal across runs. dQ sums by
    atomics in no fixed order: equal within rounding, not bit for bit."""
    generator = torch.Generator().manual_seed(seed)
    for head_dim in HEAD_DIMS:
        q, k, v, grad = make_inputs((2, 4), 333, 517, head_dim, torch.bfloat16, generator)
        first = backward(q, k, v, grad, 0.1, True)
        second = backward(q, k, v, grad, 0.1, True)
        for name, a, b in zip(["dk", "dv"], first[1:], second[1:], strict=True):
            assert torch.equal(a, b), f"e{head_dim} {name} differs between two runs: {replay(seed)}"
        error = relative_error(first[0], second[0].double().cpu())
        assert error <= 1e-2, f"e{head_dim} dq differs by {error:.2e} between runs: {replay(seed)}"


# ---------------------------------------------------------------------- which kernel ran


def kernels_launched(q, k, v, grad, causal=False):
    out, lse = torch.ops.fixed_attention.attention_forward(q, k, v, 0.125, causal)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        torch.ops.fixed_attention.attention_backward(grad, q, k, v, out, lse, 0.125, causal)
        torch.cuda.synchronize()
    return [e.name for e in profile.events() if "kernel" in e.name]


def test_the_tensor_core_backward_runs_where_it_should(fixed, seed):
    """bf16/fp16 with head dim 64 or 128 take the tensor-core backward (the wgmma kernel on
    compute capability 9.0, the mma.sync one elsewhere), at 256 and 192 the wide wgmma kernel on
    9.0 (192 as it is) and the mma.sync one elsewhere (192 padded to 256); float32 up to 128
    the 3xTF32 one; float32 over 128, misaligned inputs and deterministic mode take the generic
    one. Without this, a dispatch that always
    fell back would pass every result test above."""
    generator = torch.Generator().manual_seed(seed)
    if not kernels_launched(*make_inputs((2,), 100, 100, 64, torch.float32, generator)):
        pytest.skip("the profiler records no CUDA kernels here (CUPTI unavailable?)")
    for dtype in DTYPES:
        for head_dim in (*HEAD_DIMS, 192):
            if dtype == torch.float32 and head_dim > 128:
                continue  # generic: below
            expected = tensor_core_kernels(dtype, head_dim)[1]
            for causal in (False, True):
                names = kernels_launched(
                    *make_inputs((2, 3), 100, 150, head_dim, dtype, generator), causal=causal
                )
                main = main_kernels(names)
                with check:
                    assert len(main) == 1 and expected in main[0], (
                        f"{dtype_id(dtype)} e{head_dim} causal={causal}: launched {names}, "
                        f"expected {expected}"
                    )
    declined = {
        "float32 e192": make_inputs((2,), 100, 100, 192, torch.float32, generator),
        "float32 e256": make_inputs((2,), 100, 100, 256, torch.float32, generator),
        "float16 e64 misaligned": tuple(
            randn((2 * 100 * 64 + 1,), torch.float16, generator)[1:].view(2, 100, 64)
            for _ in range(4)
        ),
        "float32 e64 misaligned": tuple(
            randn((2 * 100 * 64 + 1,), torch.float32, generator)[1:].view(2, 100, 64)
            for _ in range(4)
        ),
    }
    for label, inputs in declined.items():
        names = kernels_launched(*inputs)
        with check:
            assert names and not main_kernels(names), f"{label}: launched {names}"
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for dtype in (torch.bfloat16, torch.float32):
            names = kernels_launched(*make_inputs((2,), 100, 100, 64, dtype, generator))
            with check:
                assert names and not main_kernels(names), (
                    f"{dtype_id(dtype)} deterministic mode: launched {names}"
                )
    finally:
        torch.use_deterministic_algorithms(previous)


def tensor_core_kernels(dtype, head_dim=64) -> tuple[str, str]:
    """The forward and backward kernels a problem of `dtype` whose wider head dim (E or Ev) is
    `head_dim` runs on this device (float32: up to 128). Over 128 the wgmma backward is the wide
    kernel."""
    if dtype == torch.float32:
        return ("flash_forward_f32_kernel", F32_BACKWARD_KERNEL)
    if torch.cuda.get_device_capability() == (9, 0):
        backward = SM90_BACKWARD_KERNEL if head_dim <= 128 else SM90_WIDE_BACKWARD_KERNEL
        return ("flash_forward_sm90_ws_kernel", backward)
    return ("flash_forward_kernel", BACKWARD_KERNEL)


GQA_CASES = [(2, 130, 200), (1, 64, 63), (2, 300, 300)]  # (K/V heads of 8, L, S)


def gqa_reference(q, k, v, grad, scale, causal):
    """float64 output and gradients with K and V repeated for each query head: each K/V head's
    gradient is the sum over the query heads that read it."""
    group = q.shape[-3] // k.shape[-3]
    q64, k64, v64 = (t.detach().to("cpu", torch.float64).requires_grad_(True) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q64,
        k64.repeat_interleave(group, dim=-3),
        v64.repeat_interleave(group, dim=-3),
        scale=scale,
        is_causal=causal,
    )
    out.backward(grad.detach().to("cpu", torch.float64))
    return out.detach(), q64.grad, k64.grad, v64.grad


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gqa_runs_on_the_tensor_cores_and_sums_each_groups_gradients(fixed, seed, dtype, causal):
    """GQA and MQA (8 query heads on 2 K/V heads, and on 1): forward and backward on the
    tensor-core kernels, reading the shared K/V head (never a repeated copy); the output and dQ,
    dK, dV against float64, each K/V head's gradient the sum over its query heads."""
    generator = torch.Generator().manual_seed(seed)
    for head_dim in HEAD_DIMS if dtype != torch.float32 else [64, 128]:
        expected = tensor_core_kernels(dtype, head_dim)
        scale = 1.0 / math.sqrt(head_dim)
        for kv_heads, len_q, len_kv in GQA_CASES:
            q = randn((2, 8, len_q, head_dim), dtype, generator)
            k, v = (randn((2, kv_heads, len_kv, head_dim), dtype, generator) for _ in range(2))
            grad = randn(q.shape, dtype, generator)
            where = (
                f"{dtype_id(dtype)} q{list(q.shape)} kv{list(k.shape)} causal={causal}; "
                f"{replay(seed)}"
            )
            ops = torch.ops.fixed_attention
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]
            ) as profile:
                out, lse = ops.attention_forward(q, k, v, scale, causal, None, True)
                poison_allocator((k.shape, k.dtype), (v.shape, v.dtype))
                grads = ops.attention_backward(grad, q, k, v, out, lse, scale, causal, None, True)
                torch.cuda.synchronize()
            names = [e.name for e in profile.events() if "kernel" in e.name]
            for kernel in expected:
                with check:
                    assert not names or any(kernel in name for name in names), (
                        f"{kernel} did not run: launched {names}; {where}"
                    )
            if SM90_BACKWARD_KERNEL in expected:  # Hopper, head dim 64 or 128
                # Without a causal mask each group's dK, dV is summed in the kernel, not after it.
                summed = any("GroupSummingTile" in name for name in names)
                with check:
                    assert not names or summed != causal, (
                        f"the group-summing backward ran: {summed}; {where}"
                    )
            reference = gqa_reference(q, k, v, grad, scale, causal)
            answers = zip(("out", "dq", "dk", "dv"), (out, *grads), reference, strict=True)
            for name, got, ref in answers:
                with check:
                    assert got.shape == ref.shape, f"{name} {list(got.shape)}: {where}"
                error = relative_error(got, ref)
                with check:
                    assert error <= TOLERANCE[dtype], f"{name} relative error {error:.2e}: {where}"


# (E, Ev) the tensor-core kernels do not take as they are: run at head dim 64 or 128 with zero
# columns (attention_cuda.cu's padded_head_dim), the extra output and gradient columns cut off;
# over 128 (bf16/fp16 only) at 256. On compute capability 9.0 both passes take them as they are
# (test_hopper_backward_reads_other_head_dims_as_they_are).
PADDED_HEAD_DIMS = [(80, 80), (96, 96), (32, 32), (128, 64), (48, 80), (8, 16)]
WIDE_PADDED_HEAD_DIMS = [(192, 192), (200, 136), (72, 256)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_other_head_dims_run_padded_on_the_tensor_cores(fixed, seed, dtype, causal):
    """Head dims other than 64 and 128, and Ev != E: forward and backward on the tensor-core
    kernels at the padded width; the output and dQ, dK, dV, in the caller's shapes, against
    float64. float32 over 128 stays generic (test_the_tensor_core_backward_runs_where_it_should)."""
    generator = torch.Generator().manual_seed(seed)
    ops = torch.ops.fixed_attention
    wide = WIDE_PADDED_HEAD_DIMS if dtype != torch.float32 else []
    for head_dim, head_dim_v in PADDED_HEAD_DIMS + wide:
        expected = tensor_core_kernels(dtype, max(head_dim, head_dim_v))
        scale = 1.0 / math.sqrt(head_dim)
        q, k = (randn((2, 3, n, head_dim), dtype, generator) for n in (130, 200))
        v = randn((2, 3, 200, head_dim_v), dtype, generator)
        grad = randn((2, 3, 130, head_dim_v), dtype, generator)
        where = f"{dtype_id(dtype)} E={head_dim} Ev={head_dim_v} causal={causal}; {replay(seed)}"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            out, lse = ops.attention_forward(q, k, v, scale, causal)
            grads = ops.attention_backward(grad, q, k, v, out, lse, scale, causal)
            torch.cuda.synchronize()
        names = [e.name for e in profile.events() if "kernel" in e.name]
        for kernel in expected:
            with check:
                assert not names or any(kernel in name for name in names), (
                    f"{kernel} did not run: launched {names}; {where}"
                )
        reference = attention_with_grads(q, k, v, grad, scale=scale, causal=causal)
        answers = zip(("out", "dq", "dk", "dv"), (out, *grads), reference, strict=True)
        for name, got, ref in answers:
            with check:
                assert got.shape == ref.shape and got.is_contiguous(), f"{name}: {where}"
            error = relative_error(got, ref)
            with check:
                assert error <= TOLERANCE[dtype], f"{name} relative error {error:.2e}: {where}"


def test_hopper_backward_reads_other_head_dims_as_they_are(fixed, seed):
    """On compute capability 9.0 the wgmma backward takes E and Ev up to 256 (multiples of 8) as
    they are, as the forward does: its loads fill the tile's columns past them with zeros (over
    128 the wide kernel's). Three launches (the prologue, the wgmma kernel, the dq kernel) and
    nothing else: no padded copies of the five inputs, no copies of the three gradients; the
    gradients against float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma backward needs compute capability 9.0")
    generator = torch.Generator().manual_seed(seed)
    cases = (
        (80, 80, False),
        (128, 64, True),
        (48, 96, False),
        (8, 16, True),
        (72, 120, False),
        (192, 192, True),
        (200, 136, False),
        (72, 256, True),
    )
    for dtype in HALF_DTYPES:
        for head_dim, head_dim_v, causal in cases:
            scale = 1.0 / math.sqrt(head_dim)
            q, k = (randn((2, 3, n, head_dim), dtype, generator) for n in (130, 200))
            v = randn((2, 3, 200, head_dim_v), dtype, generator)
            grad = randn((2, 3, 130, head_dim_v), dtype, generator)
            out, lse = torch.ops.fixed_attention.attention_forward(q, k, v, scale, causal)
            torch.cuda.synchronize()
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]
            ) as profile:
                grads = torch.ops.fixed_attention.attention_backward(
                    grad, q, k, v, out, lse, scale, causal
                )
                torch.cuda.synchronize()
            on_gpu = torch.autograd.DeviceType.CUDA
            names = [e.name for e in profile.events() if e.device_type == on_gpu]
            where = (
                f"{dtype_id(dtype)} E={head_dim} Ev={head_dim_v} causal={causal}; {replay(seed)}"
            )
            main = tensor_core_kernels(dtype, max(head_dim, head_dim_v))[1]
            stages = ("flash_backward_prologue_kernel", main, "flash_backward_dq_kernel")
            with check:
                assert len(names) == 3 and all(
                    stage in name for stage, name in zip(stages, names, strict=True)
                ), f"{where}: launched {names}, expected {stages} alone"
            reference = attention_with_grads(q, k, v, grad, scale=scale, causal=causal)[1:]
            for name, got, ref in zip(("dq", "dk", "dv"), grads, reference, strict=True):
                error = relative_error(got, ref)
                with check:
                    assert got.shape == ref.shape and error <= TOLERANCE[dtype], (
                        f"{name} {list(got.shape)} relative error {error:.2e}: {where}"
                    )


def test_hopper_images_hold_the_wgmma_backward(fixed):
    """As test_flash_forward.py's test of the forward: a build with code for compute capability
    9.0 holds one sm_90a image, whose wgmma backward kernel has HGMMA instructions in all 48
    instances (two dtypes by two tile head dims by six: five sets of SDPA arguments, none, and a
    mask alone or with dropout, its entries float32 or in the inputs' dtype, and the group-summing
    tile without arguments; each with E = Ev = D and with head dims read as they are), and the
    wide kernel in all 12 of its own."""
    from fixed import _build

    cuobjdump = find_cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump is not on PATH (nor in CUDA_HOME/bin)")
    library = str(_build.load_library())
    images = subprocess.run(
        [cuobjdump, "--list-elf", library], capture_output=True, text=True, check=True
    ).stdout
    if ".sm_90" not in images:
        pytest.skip(f"this build has no image for compute capability 9.0:\n{images}")
    assert ".sm_90a." in images and ".sm_90." not in images, images
    sass = subprocess.run(
        [cuobjdump, "--dump-sass", "--gpu-architecture", "sm_90a", library],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for kernel, instances in ((SM90_BACKWARD_KERNEL, 48), (SM90_WIDE_BACKWARD_KERNEL, 12)):
        functions = [part for part in sass.split("Function : ")[1:] if kernel in part[:300]]
        assert len(functions) == instances, f"expected {kernel} x {instances}: {len(functions)}"
        for function in functions:
            assert "HGMMA" in function, f"no HGMMA in {function.splitlines()[0]}"
