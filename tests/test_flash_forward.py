"""fixed/'s tensor-core forwards (bf16 and fp16, head dims 64 and 128: fixed/csrc/kernels/
flash_forward.cuh, mma.sync; on compute capability 9.0 flash_forward_sm90.cuh, wgmma; float32:
flash_forward_f32.cuh, 3xTF32) on a GPU: output and logsumexp against the float64 reference,
half precision against the float32 kernel, ragged lengths, L != S, causal, non-contiguous and
misaligned inputs, that the kernel is the one that ran (and on Hopper that its image has wgmma),
and compute-sanitizer.
Every test needs CUDA and skips, saying so, without it. Inputs are fresh each run;
FLASH_SEED=<seed> replays a failure."""

from __future__ import annotations

import contextlib
import math
import subprocess
import textwrap

import pytest
import torch

from kata.harness import reference
from kata.harness.reference import TOLERANCE, attention, relative_error
from tests.cuda_support import (
    NEEDS_CUDA,
    TENSOR_CORE_SANITIZER_TOOLS,
    dtype_id,
    find_cuda_tool,
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

HALF_DTYPES = [torch.bfloat16, torch.float16]
DTYPES = [*HALF_DTYPES, torch.float32]  # float32: 3xTF32, held to float32's tolerance
# The head dims the tensor-core kernels cover as they are (256: bf16/fp16 only; float32's
# tensor-core kernels stop at 128, and over it float32 runs generic).
HEAD_DIMS = [64, 128, 256]
LSE_TOLERANCE = 1e-5  # on |lse - ref| / (1 + |ref|): fp32 softmax statistics
# (leading dims, L, S): lengths around the 64- and 128-row tiles, L == S and L != S both ways,
# batch * heads from 1 to 140, one length past 4096; at 140 more work items than an H100's or
# H200's 132 SMs, so that CTAs take several (the Hopper forward's O leaves through an earlier
# item's K and V buffers).
CASES = [
    ((), 1, 1),
    ((3,), 15, 15),
    ((2, 2), 63, 64),
    ((1,), 64, 63),
    ((5,), 65, 127),
    ((2, 3), 129, 65),
    ((4, 16), 127, 129),
    ((1,), 1000, 1000),
    ((2,), 1000, 15),
    ((1,), 15, 1000),
    ((1,), 4097, 4097),
    ((2, 70), 200, 333),
]
FLASH_KERNEL = "flash_forward_kernel"  # mma.sync
# Compute capability 9.0: without a mask or dropout the warp-specialized kernel (TMA, ping-pong),
# with them the wgmma kernel (flash_forward_sm90.cuh).
SM90_KERNEL = "flash_forward_sm90_ws_kernel"
SM90_ARGS_KERNEL = "flash_forward_sm90_kernel"
F32_KERNEL = "flash_forward_f32_kernel"  # float32, on every device with sm_80+


fixed = pytest.fixture(fixed_with_cuda_kernels, scope="module", name="fixed")
seed = seed_fixture("FLASH_SEED")
replay = replay_hint("FLASH_SEED", __file__)


def forward(q, k, v, scale, causal):
    """(out, lse) from the operator, after poisoning the blocks they will land in."""
    poison_allocator((q.shape, q.dtype), (q.shape[:-1], torch.float32))
    return torch.ops.fixed_attention.attention_forward(q, k, v, scale, causal)


def check_against_reference(q, k, v, scale, causal, where):
    out, lse = forward(q, k, v, scale, causal)
    with check:
        assert (out.shape, out.dtype, lse.shape, lse.dtype) == (
            q.shape,
            q.dtype,
            q.shape[:-1],
            torch.float32,
        ), where
    error = relative_error(out, attention(q, k, v, scale=scale, causal=causal))
    with check:
        assert error <= TOLERANCE[q.dtype], f"output relative error {error:.2e}: {where}"
    error = lse_error(lse, reference.logsumexp(q, k, scale=scale, causal=causal))
    with check:
        assert error <= LSE_TOLERANCE, f"logsumexp error {error:.2e}: {where}"


# ------------------------------------------------------------------------------- results


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda e: f"e{e}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_forward_matches_reference(fixed, seed, dtype, head_dim, causal):
    generator = torch.Generator().manual_seed(seed)
    scale = 1.0 / math.sqrt(head_dim)
    for lead, len_q, len_kv in CASES:
        q, k, v = make_inputs(lead, len_q, len_kv, head_dim, dtype, generator)
        where = (
            f"{dtype_id(dtype)} q{list(q.shape)} kv{list(k.shape)} causal={causal}; {replay(seed)}"
        )
        check_against_reference(q, k, v, scale, causal, where)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_forward_past_8192_keys_matches_reference(fixed, seed, dtype, causal):
    """The Hopper forward's tilings at head dim 128 from S = 8192 on (with_ws_tiles in
    flash_forward_sm90.cuh): 192-row items without causality, 176-key blocks with it."""
    generator = torch.Generator().manual_seed(seed)
    for lead, len_q, len_kv in (((), 8200, 8200), ((2,), 300, 8193)):
        q, k, v = make_inputs(lead, len_q, len_kv, 128, dtype, generator)
        where = f"{dtype_id(dtype)} q{list(q.shape)} causal={causal}; {replay(seed)}"
        check_against_reference(q, k, v, 1.0 / math.sqrt(128), causal, where)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda e: f"e{e}")
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=dtype_id)
def test_forward_matches_the_float32_kernel(fixed, seed, dtype, head_dim, causal):
    """The same inputs upcast to float32 take the float32 kernel (3xTF32, held to float32's
    tolerance above): the half-precision result must agree with it within its own tolerance, and
    the logsumexp (fp32 statistics in both) much more tightly."""
    generator = torch.Generator().manual_seed(seed)
    scale = 0.7 / math.sqrt(head_dim)
    for lead, len_q, len_kv in [((2, 8), 300, 300), ((3,), 200, 77), ((1,), 77, 520)]:
        q, k, v = make_inputs(lead, len_q, len_kv, head_dim, dtype, generator)
        where = (
            f"{dtype_id(dtype)} q{list(q.shape)} kv{list(k.shape)} causal={causal}; {replay(seed)}"
        )
        out, lse = forward(q, k, v, scale, causal)
        out32, lse32 = torch.ops.fixed_attention.attention_forward(
            q.float(), k.float(), v.float(), scale, causal
        )
        error = relative_error(out, out32.double().cpu())
        with check:
            assert error <= TOLERANCE[dtype], f"vs float32 kernel: output {error:.2e}: {where}"
        error = lse_error(lse, lse32.double().cpu())
        with check:
            assert error <= LSE_TOLERANCE, f"vs float32 kernel: logsumexp {error:.2e}: {where}"


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda e: f"e{e}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_non_contiguous_inputs_and_other_scales(fixed, seed, dtype, head_dim):
    """Transposed, strided and expanded views (one contiguous copy in the glue), and scales
    other than 1/√E: a negative one (the kernel negates Q, as its softmax needs a positive
    factor) and zero (uniform weights; masked keys must still get none)."""
    generator = torch.Generator().manual_seed(seed)
    batch, heads, len_q, len_kv = 2, 3, 145, 203
    # (B, L, H, E) memory seen as (B, H, L, E); every other key; one value head broadcast.
    q = randn((batch, len_q, heads, head_dim), dtype, generator).transpose(1, 2)
    k = randn((batch, heads, 2 * len_kv, head_dim), dtype, generator)[:, :, ::2]
    v = randn((batch, 1, len_kv, head_dim), dtype, generator).expand(-1, heads, -1, -1)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    cases = ((0.3, False), (0.05, True), (-0.2, False), (-0.2, True), (0.0, True))
    for scale, causal in cases:
        where = f"{dtype_id(dtype)} e{head_dim} scale={scale} causal={causal}; {replay(seed)}"
        check_against_reference(q, k, v, scale, causal, where)
        out = fixed.fast_attention(q, k, v, scale=scale, is_causal=causal)
        expected = fixed.fast_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), scale=scale, is_causal=causal
        )
        with check:
            assert torch.equal(out, expected), f"views vs contiguous copies differ: {where}"


def test_misaligned_inputs_fall_back_and_stay_correct(fixed, seed):
    """A contiguous tensor at an odd storage offset is not 16-byte aligned: the tensor-core
    launcher declines it (its copies are 16 bytes wide) and the generic kernel answers."""
    generator = torch.Generator().manual_seed(seed)
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            shapes = [(2, 70, head_dim), (2, 90, head_dim), (2, 90, head_dim)]
            q, k, v = (
                randn((math.prod(shape) + 1,), dtype, generator)[1:].view(shape) for shape in shapes
            )
            assert q.is_contiguous() and q.data_ptr() % 16 != 0
            where = f"{dtype_id(dtype)} e{head_dim} misaligned; {replay(seed)}"
            check_against_reference(q, k, v, 1.0 / math.sqrt(head_dim), True, where)


def test_deterministic(fixed, seed):
    """One thread writes each output element, no atomics on them: two runs agree bit for bit."""
    generator = torch.Generator().manual_seed(seed)
    for head_dim in HEAD_DIMS:
        q, k, v = make_inputs((2, 4), 333, 517, head_dim, torch.bfloat16, generator)
        first = torch.ops.fixed_attention.attention_forward(q, k, v, 0.1, True)
        second = torch.ops.fixed_attention.attention_forward(q, k, v, 0.1, True)
        for name, a, b in zip(["out", "lse"], first, second, strict=True):
            assert torch.equal(a, b), f"e{head_dim} {name} differs between two runs: {replay(seed)}"


def split_batch(sms, row_blocks):
    """The smallest batch whose work items (row_blocks per batch item) fill a round of `sms`
    CTAs and leave a last round at most half full."""
    return next(
        batch
        for batch in range(1, 4 * sms)
        if batch * row_blocks >= sms and 0 < batch * row_blocks % sms <= sms // 2
    )


@pytest.mark.parametrize("head_dim", [40, 64], ids=lambda e: f"e{e}")
def test_hopper_splits_a_last_round_that_is_mostly_empty(fixed, seed, head_dim):
    """On compute capability 9.0, without a mask, dropout or causality, the warp-specialized
    forward's 192-row tiling (head dims up to 64) splits the work items of a last round at most
    half full along the keys and combines the parts (flash_forward_sm90_ws_schedule.cuh). A
    batch that makes such a round on this GPU, keys past the last full block: out and lse
    against float64, and two runs bit for bit (the parts combine in a fixed order)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialized forward needs compute capability 9.0")
    generator = torch.Generator().manual_seed(seed)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    len_q, len_kv = 1000, 1100
    batch = split_batch(sms, math.ceil(len_q / 192))
    q, k, v = make_inputs((batch,), len_q, len_kv, head_dim, torch.bfloat16, generator)
    scale = 1.0 / math.sqrt(head_dim)
    where = f"e{head_dim} batch {batch} on {sms} SMs; {replay(seed)}"
    check_against_reference(q, k, v, scale, False, where)
    first = torch.ops.fixed_attention.attention_forward(q, k, v, scale, False)
    second = torch.ops.fixed_attention.attention_forward(q, k, v, scale, False)
    for name, a, b in zip(["out", "lse"], first, second, strict=True):
        with check:
            assert torch.equal(a, b), f"{name} differs between two runs: {where}"


# ---------------------------------------------------------------------- which kernel ran


def kernels_launched(q, k, v, causal=False):
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        torch.ops.fixed_attention.attention_forward(q, k, v, 0.125, causal)
        torch.cuda.synchronize()
    return [e.name for e in profile.events() if "attention" in e.name and "kernel" in e.name]


def test_the_tensor_core_kernel_runs_where_it_should(fixed, seed):
    """bf16/fp16 with head dim 64, 128, 256 (or 192: padded to 256 but on Hopper) take a flash
    kernel, one launch: the warp-specialized one on compute capability 9.0, the mma.sync one
    elsewhere; float32 up to 128 the 3xTF32 one; float32 over 128 and misaligned inputs take the
    generic one (other head dims up to 128 run a flash kernel, padded but on Hopper's bf16/fp16
    forward: test_flash_backward.py).
    Without this, a dispatch that always falls back would pass every result test above."""
    generator = torch.Generator().manual_seed(seed)
    probe = make_inputs((2,), 100, 100, 64, torch.float32, generator)
    if not kernels_launched(*probe):
        pytest.skip("the profiler records no CUDA kernels here (CUPTI unavailable?)")
    hopper = torch.cuda.get_device_capability() == (9, 0)
    for dtype in DTYPES:
        for head_dim in (*HEAD_DIMS, 192):
            if dtype == torch.float32 and head_dim > 128:
                continue  # generic: below
            half_kernel = SM90_KERNEL if hopper else FLASH_KERNEL
            expected = F32_KERNEL if dtype == torch.float32 else half_kernel
            for causal in (False, True):
                names = kernels_launched(
                    *make_inputs((2, 3), 100, 150, head_dim, dtype, generator), causal=causal
                )
                with check:
                    assert len(names) == 1 and expected in names[0], (
                        f"{dtype_id(dtype)} e{head_dim} causal={causal}: launched {names}, "
                        f"expected {expected}"
                    )
    declined = {
        "float32 e192": make_inputs((2,), 100, 100, 192, torch.float32, generator),
        "float32 e256": make_inputs((2,), 100, 100, 256, torch.float32, generator),
        "float16 e64 misaligned": tuple(
            randn((2 * 100 * 64 + 1,), torch.float16, generator)[1:].view(2, 100, 64)
            for _ in range(3)
        ),
    }
    for label, inputs in declined.items():
        names = kernels_launched(*inputs)
        with check:
            assert len(names) == 1 and "flash_forward" not in names[0], f"{label}: launched {names}"


def test_hopper_reads_other_head_dims_as_they_are(fixed, seed):
    """On compute capability 9.0 the warp-specialized forward takes head dims other than 64 and
    128, and Ev != E, as they are: its TMA loads fill the columns up to the tile's width with
    zeros. One launch and nothing else on the GPU: no padded copies of Q, K and V, no copy of
    the output (elsewhere they run padded: test_flash_backward.py checks their values up to 128,
    test_flash_arguments.py over it); the output against float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialized forward needs compute capability 9.0")
    generator = torch.Generator().manual_seed(seed)
    cases = (
        (80, 80),
        (128, 64),
        (96, 40),
        (48, 96),
        (32, 32),
        (8, 16),
        (192, 192),
        (256, 136),
        (72, 200),
    )
    for head_dim, head_dim_v in cases:
        q, k = (randn((2, 3, n, head_dim), torch.bfloat16, generator) for n in (100, 150))
        v = randn((2, 3, 150, head_dim_v), torch.bfloat16, generator)
        scale = 1.0 / math.sqrt(head_dim)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            out, _ = torch.ops.fixed_attention.attention_forward(q, k, v, scale, False)
            torch.cuda.synchronize()
        on_gpu = torch.autograd.DeviceType.CUDA
        names = [e.name for e in profile.events() if e.device_type == on_gpu]
        where = f"E={head_dim} Ev={head_dim_v}; {replay(seed)}"
        with check:
            assert len(names) == 1 and SM90_KERNEL in names[0], (
                f"{where}: launched {names}, expected {SM90_KERNEL} alone"
            )
        error = relative_error(out, attention(q, k, v, scale=scale, causal=False))
        with check:
            assert error <= TOLERANCE[torch.bfloat16], f"output relative error {error:.2e}: {where}"


def test_hopper_images_hold_the_wgmma_forward(fixed):
    """The test above sees a kernel's name, not which of its two bodies ran: wgmma in an sm_90a
    image, mma.sync in any other. fixed/_build.py builds sm_90 code as sm_90a, so a build with
    code for compute capability 9.0 must hold an sm_90a image whose wgmma kernel has HGMMA
    instructions (and no plain sm_90 image for the driver to pick instead)."""
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
    parts = sass.split("Function : ")[1:]
    # Both: 2 dtypes x 3 head dims (64, 128, 256) x 3 sets of SDPA arguments (flash_common.cuh's
    # ScoreArgs); the warp-specialized one with its TMA loads, its two sets with a mask once
    # more with the mask in the inputs' dtype (the tiling's MaskEntry), and per dtype the tiles
    # under head dim 128 without arguments with V at 64 columns (Tile128Ev64, and in 176-key
    # blocks Tile128Ev64Wide), with 176-key blocks (Tile128Wide) and in 192-row items
    # (Tile128Three), and at head dim 64 the 192-row tile with O staged (Tile64Staged).
    for kernel, count, instructions in (
        (SM90_ARGS_KERNEL, 18, ("HGMMA",)),
        (SM90_KERNEL, 40, ("HGMMA", "UTMALDG", "SYNCS")),
    ):
        functions = [part for part in parts if kernel in part[:300]]
        assert len(functions) == count, f"expected {kernel} x {count}: {len(functions)}"
        for function in functions:
            for instruction in instructions:
                assert instruction in function, f"no {instruction} in {function.splitlines()[0]}"


# --------------------------------------------------------------------------- compute-sanitizer

SANITIZER_SCRIPT = textwrap.dedent(
    """
    import torch
    import fixed

    generator = torch.Generator().manual_seed(0)
    # Several key blocks (both shared-memory buffers in use), tails in L and S, causal and not.
    for dtype, head_dim, len_q, len_kv, causal in (
        (torch.bfloat16, 128, 200, 333, True),
        (torch.bfloat16, 128, 190, 333, True),  # causal row blocks from row -64 (work_item)
        (torch.float16, 128, 131, 70, False),
        (torch.bfloat16, 96, 200, 600, False),  # 176-key blocks: both stages, twice, and a tail
        (torch.bfloat16, 128, 200, 8200, False),  # S >= 8192: 192-row items, 80-key blocks
        (torch.float16, 128, 200, 8200, True),  # and causal in 176-key blocks
        (torch.bfloat16, 64, 130, 300, False),
        (torch.float16, 64, 300, 129, True),
        (torch.float32, 64, 200, 333, True),
        (torch.float32, 128, 131, 70, False),
        (torch.bfloat16, 256, 200, 333, True),
        (torch.float16, 256, 131, 70, False),
    ):
        q, k, v = (
            torch.randn(2, n, head_dim, generator=generator).to("cuda", dtype)
            for n in (len_q, len_kv, len_kv)
        )
        fixed.fast_attention(q, k, v, is_causal=causal)
    # V at 64 columns under head dim 128: 176-key blocks (both stages, a tail), and causal.
    q, k = (
        torch.randn(2, n, 128, generator=generator).to("cuda", torch.bfloat16) for n in (200, 600)
    )
    v = torch.randn(2, 600, 64, generator=generator).to("cuda", torch.bfloat16)
    for causal in (False, True):
        fixed.fast_attention(q, k, v, is_causal=causal)
    # SDPA's arguments in the same kernel: GQA with a mask that hides whole blocks (skipped) and
    # a tail in every dimension; a key padding mask (one row, broadcast) with dropout.
    for head_dim, dtype in (
        (64, torch.bfloat16),
        (128, torch.bfloat16),
        (64, torch.float32),
        (256, torch.float16),
    ):
        q = torch.randn(2, 4, 300, head_dim, generator=generator).to("cuda", dtype)
        k, v = (
            torch.randn(2, 2, 333, head_dim, generator=generator).to("cuda", dtype)
            for _ in range(2)
        )
        lower = torch.ones(300, 333, dtype=torch.bool).tril().cuda()
        fixed.fast_attention(q, k, v, attn_mask=lower, enable_gqa=True)
        padding = (torch.arange(333) < torch.tensor([200, 333]).view(2, 1, 1, 1)).cuda()
        fixed.fast_attention(q, k, v, attn_mask=padding, dropout_p=0.2, enable_gqa=True)
    # On compute capability 9.0, the forward's split of a last round at most half full (192-row
    # items at D = 64): a batch that leaves one here, as split_batch picks it.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    items = 2  # per batch item: 300 query rows in items of 192
    batch = next(
        b for b in range(1, 4 * sms) if b * items >= sms and 0 < b * items % sms <= sms // 2
    )
    q, k, v = (
        torch.randn(batch, n, 64, generator=generator).to("cuda", torch.bfloat16)
        for n in (300, 1100, 1100)
    )
    fixed.fast_attention(q, k, v)
    # More items than SMs: CTAs take several, and O leaves each item through a K or V buffer
    # that the producer reloads for the next (head dim 128: Tile128Wide, causal Tile128; 64:
    # Tile64Staged, in three rounds, none split).
    for head_dim, batch, len_q, len_kv, causal in (
        (128, sms + 4, 128, 400, False),
        (128, sms + 4, 256, 256, True),
        (64, 3 * sms - 1, 192, 400, False),
    ):
        q, k, v = (
            torch.randn(batch, n, head_dim, generator=generator).to("cuda", torch.bfloat16)
            for n in (len_q, len_kv, len_kv)
        )
        fixed.fast_attention(q, k, v, is_causal=causal)
    torch.cuda.synchronize()
    print("sanitizer script done")
    """
)


@pytest.mark.parametrize(("tool", "clean"), TENSOR_CORE_SANITIZER_TOOLS)
def test_compute_sanitizer_on_the_tensor_core_kernel(fixed, tmp_path, tool, clean):
    sanitize(tool, SANITIZER_SCRIPT, tmp_path, clean)
