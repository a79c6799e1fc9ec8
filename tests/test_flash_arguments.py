"""fixed/'s tensor-core kernels with SDPA's other arguments on a GPU: boolean and additive masks
in the broadcast forms SDPA accepts (fully masked rows included; masks that hide whole tiles, which
the wgmma kernels skip: causal, documents, key padding), dropout, and both together,
with GQA and with padded head dims. Forward and backward must run on the tensor-core kernels
(wgmma on compute capability 9.0, over head dim 128 the wide wgmma backward; mma.sync elsewhere) and
agree with the CPU kernels of the same operator in float64: the same mask entries, the same
Philox keep mask (philox.h), so the whole output and every gradient can be compared, dropout
included. The mask cases are also compared with an independent float64 formula. Inputs are fresh
each run; FLASH_SEED=<seed> replays a failure."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from kata.harness.reference import TOLERANCE, relative_error
from tests.cuda_support import (
    NEEDS_CUDA,
    dtype_id,
    fixed_with_cuda_kernels,
    lse_error,
    randn,
    replay_hint,
    seed_fixture,
)

try:
    from pytest_check import check
except ImportError:  # pytest-check may be missing on the GPU machine: stop at the first failure
    check = contextlib.nullcontext()

pytestmark = NEEDS_CUDA

fixed = pytest.fixture(fixed_with_cuda_kernels, scope="module", name="fixed")
seed = seed_fixture("FLASH_SEED")
replay = replay_hint("FLASH_SEED", __file__)

DTYPES = [torch.bfloat16, torch.float16]
LSE_TOLERANCE = 1e-5
B, H, L, S = 2, 4, 150, 200  # several query and key blocks, tails in both


def make_mask(kind: str, generator: torch.Generator) -> torch.Tensor | None:
    """The masks SDPA takes, each broadcast to (B, H, L, S) differently, in every dtype the map of
    hidden tiles converts (mask_tiles.cuh: those whose own elements are at most an eighth of the
    scores). Boolean ones hide about a third of the keys and every key of query rows 3 and 77
    (their output is zero)."""
    if kind == "none":
        return None
    if kind == "bool (L, S)":
        mask = torch.rand((L, S), generator=generator) > 0.3
        mask[3] = mask[77] = False
        return mask.cuda()
    if kind == "bool (B, 1, L, S)":
        mask = torch.rand((B, 1, L, S), generator=generator) > 0.3
        mask[:, :, 3] = mask[:, :, 77] = False
        return mask.cuda()
    if kind == "bool causal (L, S)":  # hides whole tiles above the diagonal (skipped blocks)
        return torch.ones((L, S), dtype=torch.bool).tril().cuda()
    if kind == "bool documents (1, 1, L, S)":  # block-diagonal: documents of 70 rows and keys
        document = torch.arange(max(L, S)) // 70
        return (document[:L, None] == document[None, :S]).view(1, 1, L, S).cuda()
    if kind == "bool key padding (B, 1, 1, S)":
        lengths = torch.tensor([S - 37, 91])
        return (torch.arange(S) < lengths.view(B, 1, 1, 1)).cuda()
    if kind == "float (H, L, S)":
        mask = torch.randn((H, L, S), generator=generator)
        mask[:, 5, ::3] = -math.inf
        return mask.cuda()
    if kind == "float (B, H, L, S) transposed view":
        return torch.randn((B, H, S, L), generator=generator).cuda().transpose(-1, -2)
    if kind == "bfloat16 (1, 1, L, S)":
        return torch.randn((1, 1, L, S), generator=generator).to("cuda", torch.bfloat16)
    if kind == "float64 (1, 1, L, S) hiding a tile":  # rows 64-127 x keys 0-63 hidden
        mask = torch.randn((1, 1, L, S), generator=generator, dtype=torch.float64)
        mask[..., 64:128, :64] = -math.inf
        return mask.cuda()
    if kind == "float16 (L, 1) expanded over keys":  # rows 3 and 77 hidden
        mask = torch.randn((L, 1), generator=generator)
        mask[3] = mask[77] = -math.inf
        return mask.to("cuda", torch.float16).expand(L, S)
    raise ValueError(kind)


MASKS = [
    "bool (L, S)",
    "bool causal (L, S)",
    "bool documents (1, 1, L, S)",
    "bool (B, 1, L, S)",
    "bool key padding (B, 1, 1, S)",
    "float (H, L, S)",
    "float (B, H, L, S) transposed view",
    "bfloat16 (1, 1, L, S)",
    "float64 (1, 1, L, S) hiding a tile",
    "float16 (L, 1) expanded over keys",
]
# (mask, dropout_p, E, Ev, K/V heads, causal): every mask alone at head dim 64 and 128, then
# with dropout, GQA and padded head dims; dropout alone, causal and not.
CASES = [
    *((mask, 0.0, 64, 64, H, False) for mask in MASKS),
    *((mask, 0.0, 128, 128, H, False) for mask in MASKS[::2]),
    ("bool (B, 1, L, S)", 0.2, 64, 64, H, False),
    ("bool causal (L, S)", 0.2, 128, 128, H, False),
    ("bool documents (1, 1, L, S)", 0.1, 64, 64, 2, False),
    ("float (H, L, S)", 0.3, 128, 128, 2, False),
    ("bool key padding (B, 1, 1, S)", 0.0, 128, 128, 1, False),
    ("float (B, H, L, S) transposed view", 0.1, 80, 80, H, False),
    ("bool (L, S)", 0.0, 48, 96, H, False),
    ("none", 0.2, 64, 64, H, False),
    ("none", 0.25, 128, 128, H, True),
    ("none", 0.1, 64, 64, 2, True),
    ("none", 0.5, 96, 96, H, True),
    # Ev <= 64 under E <= 128, no mask or dropout: the Hopper forward's tiles with P V at 64
    # columns (flash_forward_sm90_ws.cuh's Tile128Ev64, causal; Tile128Ev64Wide), under GQA.
    ("none", 0.0, 128, 64, 2, True),
    ("none", 0.0, 128, 64, 2, False),
    # Head dims over 128: the half-precision kernels at 256 (the forward as they are on Hopper,
    # padded to 256 elsewhere and for the transposed mask).
    ("bool (B, 1, L, S)", 0.2, 256, 256, 2, False),
    ("bool causal (L, S)", 0.0, 256, 256, H, False),
    ("float (B, H, L, S) transposed view", 0.0, 200, 200, H, False),
    ("none", 0.1, 192, 160, H, True),
]


def case_id(case) -> str:
    mask, dropout_p, head_dim, head_dim_v, kv_heads, causal = case
    parts = [
        mask,
        f"p{dropout_p}",
        f"e{head_dim}" + ("" if head_dim_v == head_dim else f"v{head_dim_v}"),
    ]
    parts += [f"kv{kv_heads}"] if kv_heads != H else []
    parts += ["causal"] if causal else []
    return " ".join(parts)


def run(ops, device, dtype, q, k, v, grad, mask, dropout_p, seed_tensor, causal):
    """Forward and backward of the operator on `device` in `dtype`: out, lse, dq, dk, dv."""
    q, k, v, grad = (t.to(device, dtype) for t in (q, k, v, grad))
    mask = None if mask is None else mask.to(device)
    scale = 1.0 / math.sqrt(q.shape[-1])
    gqa = k.shape[-3] != q.shape[-3]
    out, lse = ops.attention_forward(q, k, v, scale, causal, mask, gqa, dropout_p, seed_tensor)
    grads = ops.attention_backward(
        grad, q, k, v, out, lse, scale, causal, mask, gqa, dropout_p, seed_tensor
    )
    return (out, lse, *grads)


def check_against(got, reference, dtype, where):
    """run()'s five results against the float64 CPU operator's: shapes, lse's absolute error,
    the others' relative error within the dtype's tolerance."""
    for name, result, expected_value in zip(
        ("out", "lse", "dq", "dk", "dv"), got, reference, strict=True
    ):
        with check:
            assert result.shape == expected_value.shape, f"{name} {list(result.shape)}: {where}"
        if name == "lse":
            error = lse_error(result, expected_value)
            with check:
                assert error <= LSE_TOLERANCE, f"lse error {error:.2e}: {where}"
            continue
        error = relative_error(result, expected_value)
        with check:
            assert error <= TOLERANCE[dtype], f"{name} relative error {error:.2e}: {where}"


def formula64(q, k, v, mask):
    """softmax(q kᵀ scale + mask) v in float64, a row with every key hidden giving zeros."""
    q, k, v = (t.to("cpu", torch.float64) for t in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = (t.repeat_interleave(group, dim=-3) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        mask = mask.cpu()
        additive = (
            torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -math.inf)
            if mask.dtype == torch.bool
            else mask.to(torch.float64)
        )
        scores = scores + additive
    weights = torch.softmax(scores, dim=-1).nan_to_num(nan=0.0)
    return weights @ v


def widest(case) -> int:
    return max(case[2], case[3])


# float32 runs on tensor cores in 3xTF32 (flash_forward_f32.cuh, flash_backward_f32.cuh), other
# head dims up to 128 padded as half precision's are (wider: the generic kernels, whose float32
# cases are test_fixed_cuda.py's).
PARAMS = [
    (case, dtype)
    for dtype in [*DTYPES, torch.float32]
    for case in CASES
    if dtype != torch.float32 or widest(case) <= 128
]


def expected_kernels(dtype, mask, head_dim) -> tuple[str, ...]:
    """Substrings of the kernels that must run: the forward's, the backward's main one."""
    if dtype == torch.float32:
        return ("flash_forward_f32_kernel", "flash_backward_f32_kernel")
    if torch.cuda.get_device_capability() != (9, 0):
        return ("flash_forward_kernel", "flash_backward_kernel")
    # On compute capability 9.0 the backward over head dim 128 is the wide wgmma kernel.
    backward = "flash_backward_sm90_wide_kernel" if head_dim > 128 else None
    # On compute capability 9.0 the forward is the warp-specialized kernel, whose producer loads
    # the mask by TMA; a mask whose keys are not contiguous (the transposed view) is for the
    # wgmma kernel's per-thread loads.
    sm90_forward = (
        "flash_forward_sm90_kernel"
        if mask is not None and mask.dim() >= 2 and mask.stride(-1) != 1
        else "flash_forward_sm90_ws_kernel"
    )
    return (sm90_forward, backward or "flash_backward_sm90_kernel")


@pytest.mark.parametrize(
    ("case", "dtype"), PARAMS, ids=[f"{dtype_id(d)}-{case_id(c)}" for c, d in PARAMS]
)
def test_masks_and_dropout_run_on_the_tensor_cores(fixed, seed, case, dtype):
    mask_kind, dropout_p, head_dim, head_dim_v, kv_heads, causal = case
    generator = torch.Generator().manual_seed(seed)
    q = randn((B, H, L, head_dim), torch.float32, generator, "cpu")
    k = randn((B, kv_heads, S, head_dim), torch.float32, generator, "cpu")
    v = randn((B, kv_heads, S, head_dim_v), torch.float32, generator, "cpu")
    grad = randn((B, H, L, head_dim_v), torch.float32, generator, "cpu")
    mask = make_mask(mask_kind, generator)
    seed_tensor = torch.tensor(seed * 7919 + 11, dtype=torch.int64) if dropout_p > 0 else None
    where = f"{dtype_id(dtype)} {case_id(case)}; {replay(seed)}"
    ops = torch.ops.fixed_attention
    # The inputs rounded to dtype, so that the reference sees what the kernels see.
    q, k, v, grad = (t.to(dtype).to(torch.float32) for t in (q, k, v, grad))

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        got = run(ops, "cuda", dtype, q, k, v, grad, mask, dropout_p, seed_tensor, causal)
        torch.cuda.synchronize()
    names = [e.name for e in profile.events() if "kernel" in e.name]
    for kernel in expected_kernels(dtype, mask, widest(case)):
        with check:
            assert not names or any(kernel in name for name in names), (
                f"{kernel} did not run: launched {names}; {where}"
            )
    with check:
        assert not any("attention_forward_kernel" in name for name in names), (
            f"a generic kernel ran: {names}; {where}"
        )

    reference = run(ops, "cpu", torch.float64, q, k, v, grad, mask, dropout_p, seed_tensor, causal)
    check_against(got, reference, dtype, where)
    if dropout_p == 0 and not causal:
        error = relative_error(got[0], formula64(q, k, v, mask))
        with check:
            assert error <= TOLERANCE[dtype], f"out vs the float64 formula {error:.2e}: {where}"


# The backward reads a bool mask, or one in the inputs' dtype, in that dtype (attention_cuda.cu's
# kernel_mask; half the bytes of float32): a bool one, or one whose rows are not 16-byte runs
# (S not a multiple of 8), copied with its rows padded; an aligned one read in place. (kind, S,
# E): the wgmma backward at both tilings and the wide one.
NARROW_CASES = [
    ("bool", 203, 64),
    ("own dtype", 203, 64),
    ("own dtype", 200, 128),
    ("bool", 197, 128),
    ("own dtype", 203, 256),
]
NARROW_PARAMS = [(case, dtype) for dtype in DTYPES for case in NARROW_CASES]


@pytest.mark.parametrize(
    ("case", "dtype"),
    NARROW_PARAMS,
    ids=[f"{dtype_id(d)}-{c[0]}-s{c[1]}-e{c[2]}" for c, d in NARROW_PARAMS],
)
def test_backward_reads_the_mask_in_the_inputs_dtype(fixed, seed, case, dtype):
    kind, keys, head_dim = case
    generator = torch.Generator().manual_seed(seed)
    q = randn((B, H, L, head_dim), torch.float32, generator, "cpu")
    k = randn((B, H, keys, head_dim), torch.float32, generator, "cpu")
    v = randn((B, H, keys, head_dim), torch.float32, generator, "cpu")
    grad = randn((B, H, L, head_dim), torch.float32, generator, "cpu")
    q, k, v, grad = (t.to(dtype).to(torch.float32) for t in (q, k, v, grad))
    if kind == "bool":
        mask = torch.rand((L, keys), generator=generator) > 0.3
        mask[3] = False  # a row that sees no key
    else:
        mask = torch.randn((1, 1, L, keys), generator=generator).to(dtype)
        mask[..., 5, ::3] = -math.inf
    mask = mask.cuda()
    where = f"{dtype_id(dtype)} {kind} S={keys} E={head_dim}; {replay(seed)}"
    ops = torch.ops.fixed_attention

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        got = run(ops, "cuda", dtype, q, k, v, grad, mask, 0.0, None, False)
        torch.cuda.synchronize()
    names = [e.name for e in profile.events() if "mask_tiles_kernel" in e.name]
    entry = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half"}[dtype]
    made = f"mask_tiles_kernel<{'bool' if kind == 'bool' else entry}, {entry}>"
    with check:  # the backward's pass over the mask writes (or, in place, maps) the 16-bit form
        assert not names or any(made in name for name in names), f"{made}: {names}; {where}"

    reference = run(ops, "cpu", torch.float64, q, k, v, grad, mask, 0.0, None, False)
    check_against(got, reference, dtype, where)
