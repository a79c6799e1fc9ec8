"""compute-sanitizer (memcheck, racecheck, synccheck) on fixed/'s tensor-core backward
(test_flash_backward.py checks its values): one script of ragged, causal, GQA, masked, dropout
and padded-head-dim cases on every backward kernel family. Needs CUDA and skips, saying so,
without it."""

from __future__ import annotations

import textwrap

import pytest

from tests.cuda_support import (
    NEEDS_CUDA,
    TENSOR_CORE_SANITIZER_TOOLS,
    fixed_with_cuda_kernels,
    sanitize,
)

pytestmark = NEEDS_CUDA

fixed = pytest.fixture(fixed_with_cuda_kernels, scope="module", name="fixed")


SANITIZER_SCRIPT = textwrap.dedent(
    """
    import torch

    import fixed

    generator = torch.Generator().manual_seed(0)
    # Several query blocks (both shared-memory buffers in use) and key blocks, tails in L and S,
    # causal with L < S (key blocks past the last row) and L > S, full.
    for dtype, head_dim, len_q, len_kv, causal in (
        (torch.bfloat16, 128, 200, 333, True),
        (torch.float16, 128, 131, 70, False),
        (torch.bfloat16, 64, 130, 300, False),
        (torch.float16, 64, 300, 129, True),
        (torch.float32, 64, 130, 300, False),
        (torch.float32, 64, 300, 129, True),
        (torch.float32, 128, 200, 333, True),
        (torch.float32, 128, 131, 70, False),
        (torch.bfloat16, 256, 200, 333, True),
        (torch.float16, 256, 131, 70, False),
    ):
        q, k, v = (
            torch.randn(2, n, head_dim, generator=generator).to("cuda", dtype).requires_grad_()
            for n in (len_q, len_kv, len_kv)
        )
        fixed.fast_attention(q, k, v, is_causal=causal).sum().backward()
    # GQA: 6 query heads on 2 K/V heads, each read by 3: causal (dK and dV per query head, then
    # summed), and full, where Hopper's kernel sums each group (GroupSummingTile, E = 64, and
    # E = 96 read as it is on the 128 tile).
    for dtype, head_dim, causal in (
        (torch.bfloat16, 64, True),
        (torch.float32, 64, True),
        (torch.bfloat16, 64, False),
        (torch.float16, 96, False),
    ):
        q, k, v = (
            torch.randn(2, h, n, head_dim, generator=generator).to("cuda", dtype).requires_grad_()
            for h, n in ((6, 150), (2, 200), (2, 200))
        )
        fixed.fast_attention(q, k, v, is_causal=causal, enable_gqa=True).sum().backward()
    # A boolean mask broadcast over heads (a row with every key hidden) with dropout, at a padded
    # head dim; an additive mask read through a transposed view, with GQA.
    q, k, v = (
        torch.randn(2, 3, n, 80, generator=generator).to("cuda", torch.float16).requires_grad_()
        for n in (150, 200, 200)
    )
    mask = torch.rand(2, 1, 150, 200, generator=generator) > 0.3
    mask[:, :, 7] = False
    fixed.fast_attention(q, k, v, attn_mask=mask.cuda(), dropout_p=0.2).sum().backward()
    q, k, v = (
        torch.randn(2, h, n, 128, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
        for h, n in ((4, 130), (2, 300), (2, 300))
    )
    mask = torch.randn(2, 4, 300, 130, generator=generator).cuda().transpose(-1, -2)
    fixed.fast_attention(q, k, v, attn_mask=mask, enable_gqa=True).sum().backward()
    # Head dim 64: an additive mask per head (16-byte copies into the mask tile, a key tail) with
    # dropout, and a key padding mask of odd length (copies of one entry each).
    q, k, v = (
        torch.randn(2, 4, n, 64, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
        for n in (150, 200, 200)
    )
    mask = torch.randn(4, 150, 200, generator=generator).cuda()
    fixed.fast_attention(q, k, v, attn_mask=mask, dropout_p=0.1).sum().backward()
    q, k, v = (
        torch.randn(2, 4, n, 64, generator=generator).to("cuda", torch.float16).requires_grad_()
        for n in (150, 203, 203)
    )
    mask = (torch.arange(203) < torch.tensor([203, 150]).view(2, 1, 1, 1)).cuda()
    fixed.fast_attention(q, k, v, attn_mask=mask.float()).sum().backward()
    # float32 at head dim 128 (warp pairs sharing S^T and dP^T) with an additive mask and dropout.
    q, k, v = (
        torch.randn(2, 2, n, 128, generator=generator).to("cuda").requires_grad_()
        for n in (150, 200, 200)
    )
    mask = torch.randn(2, 1, 150, 200, generator=generator).cuda()
    fixed.fast_attention(q, k, v, attn_mask=mask, dropout_p=0.1).sum().backward()
    # Masks in the inputs' dtype, read as 16-bit entries: at head dim 64 rows of 203 keys (copied
    # with rows padded to 16 bytes), at 128 an aligned one read in place, with dropout.
    for head_dim, keys, dropout_p in ((64, 203, 0.0), (128, 200, 0.1)):
        q, k, v = (
            torch.randn(2, 4, n, head_dim, generator=generator)
            .to("cuda", torch.bfloat16)
            .requires_grad_()
            for n in (150, keys, keys)
        )
        mask = torch.randn(2, 1, 150, keys, generator=generator).to("cuda", torch.bfloat16)
        fixed.fast_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p).sum().backward()
    # Head dims the wgmma backward reads as they are (E = 72, Ev = 120 on the 128 tile): loads
    # zero-fill the columns past them, stores write E and Ev columns.
    q, k, v = (
        torch.randn(2, 3, n, d, generator=generator).to("cuda", torch.float16).requires_grad_()
        for n, d in ((150, 72), (200, 72), (200, 120))
    )
    fixed.fast_attention(q, k, v, is_causal=True).sum().backward()
    # Head dim 200 (padded to 256): GQA, a boolean mask and dropout.
    q, k, v = (
        torch.randn(2, h, n, 200, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
        for h, n in ((4, 150), (2, 200), (2, 200))
    )
    mask = (torch.rand(150, 200, generator=generator) > 0.3).cuda()
    out = fixed.fast_attention(q, k, v, attn_mask=mask, dropout_p=0.1, enable_gqa=True)
    out.sum().backward()
    torch.cuda.synchronize()
    print("sanitizer script done")
    """
)


@pytest.mark.parametrize(("tool", "clean"), TENSOR_CORE_SANITIZER_TOOLS)
def test_compute_sanitizer_on_the_tensor_core_backward(fixed, tmp_path, tool, clean):
    sanitize(tool, SANITIZER_SCRIPT, tmp_path, clean)
