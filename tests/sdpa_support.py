"""What the SDPA drop-in tests share: seeded inputs, torch's own scaled_dot_product_attention as
the reference (output and gradients), the peer error rule of flash-attention's tests, and an
independent Python Philox4x32-7 for the dropout keep mask the spec pins down."""

from __future__ import annotations

import math
import os
import secrets

import pytest
import torch
import torch.nn.functional as F

from kata.harness.reference import relative_error

# Relative error allowed against SDPA in float64: both sides accumulate in float64.
FLOAT64_TOLERANCE = 1e-10


class Rng:
    """A seeded CPU generator whose seed goes into every failure message."""

    def __init__(self, seed: int, variable: str):
        self.seed = seed
        self.variable = variable
        self.generator = torch.Generator().manual_seed(seed)

    def __str__(self) -> str:
        return f"[seed {self.seed}; replay with {self.variable}={self.seed}]"

    def randn(self, *shape, dtype=torch.float64):
        # Drawn in float64 on the CPU, then cast: never zeros, the same values for every dtype.
        return torch.randn(shape, generator=self.generator, dtype=torch.float64).to(dtype)

    def qkv(self, q_shape, k_shape, v_shape, dtype=torch.float64):
        return (
            self.randn(*q_shape, dtype=dtype),
            self.randn(*k_shape, dtype=dtype),
            self.randn(*v_shape, dtype=dtype),
        )

    def bool_mask(self, *shape, keep=0.7):
        return torch.rand(shape, generator=self.generator) < keep

    def float_mask(self, *shape, dtype=torch.float64, neg_inf=0.2):
        """Finite additive biases with about `neg_inf` of the entries -inf (masked out)."""
        bias = self.randn(*shape, dtype=dtype) * 2
        return bias.masked_fill(torch.rand(shape, generator=self.generator) < neg_inf, -math.inf)


def rng_fixture(variable: str):
    """An `rng` fixture: a fresh seed per test, or the one in `variable` to replay a failure."""

    @pytest.fixture
    def rng() -> Rng:
        return Rng(int(os.environ.get(variable) or secrets.randbelow(2**31)), variable)

    return rng


def sdpa64(query, key, value, attn_mask=None, **kwargs):
    """torch's SDPA on float64 CPU copies (masks: bool stays bool, floating becomes float64)."""
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (query, key, value))
    if attn_mask is not None:
        attn_mask = attn_mask.detach().cpu()
        if attn_mask.dtype.is_floating_point:
            attn_mask = attn_mask.double()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)


def check_like_sdpa(fixed, rng, leaves, *, view=None, where="", tolerance=FLOAT64_TOLERANCE, **kw):
    """fast_attention(*view(*leaves), **kw) against SDPA in float64 on the same inputs: output
    shape, dtype, values, and the gradients of the leaves for a random grad_output. `view`
    builds the inputs from the leaves (transposes, slices, expands) inside the graph, so the
    gradients must flow back through it. Returns (output, reference output)."""
    view = view or (lambda *ts: ts)
    mine = [t.detach().clone().requires_grad_(True) for t in leaves]
    theirs = [t.detach().to(torch.float64).clone().requires_grad_(True) for t in leaves]
    out = fixed.fast_attention(*view(*mine), **kw)
    ref_kw = dict(kw)
    mask = ref_kw.pop("attn_mask", None)
    if mask is not None and mask.dtype.is_floating_point:
        mask = mask.double()
    ref = F.scaled_dot_product_attention(*view(*theirs), attn_mask=mask, **ref_kw)
    where = f"{where} {rng}"
    assert out.shape == ref.shape, (
        f"output shape {list(out.shape)}, SDPA {list(ref.shape)}: {where}"
    )
    assert out.dtype == leaves[0].dtype, f"output dtype {out.dtype}: {where}"
    error = relative_error(out, ref.detach())
    assert error <= tolerance, f"output relative error {error:.2e}: {where}"
    if out.numel() == 0:
        return out, ref
    grad = rng.randn(*out.shape)
    got = torch.autograd.grad(out, mine, grad.to(out.dtype), allow_unused=True)
    want = torch.autograd.grad(ref, theirs, grad, allow_unused=True)
    # Where the exact gradient is zero (S = 1 makes dq vanish) measure against the largest one.
    floor = max(w.norm().item() for w in want if w is not None)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert g is not None and g.shape == w.shape, f"{name} shape: {where}"
        error = relative_error(g, w, floor=floor if w.norm().item() == 0 else 0.0)
        assert error <= tolerance, f"{name} relative error {error:.2e}: {where}"
    return out, ref


# ----------------------------------------------------------------------- the peer error rule


def peer_reference(q, k, v, *, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """softmax(q·kᵀ·scale + mask)·v computed in the inputs' own dtype and on their device, with
    no upcast (flash-attention's `upcast=False` reference): what plain PyTorch gets in that
    dtype. Rows with no visible key give 0, as SDPA. Differentiable."""
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q * scale) @ k.transpose(-2, -1)
    if is_causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask.to(scores.dtype)
    # Rows with no visible key: softmax of all -inf is NaN (and so is its gradient); give them
    # finite scores, then zero probabilities, so the output and the gradients there are 0.
    dead = (scores == -math.inf).all(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return probs @ v


def max_abs_error(got, want) -> float:
    """max |got − want| in float64; inf if got has a NaN or inf."""
    got = got.detach().to(want.device, torch.float64)
    if not torch.isfinite(got).all():
        return math.inf
    return (got - want).abs().max().item() if got.numel() else 0.0


def peer_slack(dtype) -> float:
    """peer_check's absolute slack: one unit of rounding in half types; in float32, where the
    summation order dominates, 256. The case that sets it: a key gradient that is exactly zero
    (causal L=77, S=1: dS = dP - delta, each rounded), summed over 77 rows and scaled. Measured
    on an H200: 2.8e-6 (23 units) at the default scale, and 7.6e-6 to 8.8e-6 (64-74 units) at
    scale -0.3, over the former 64 units in 5 of 15 runs of test_causal_scale_and_lengths."""
    return torch.finfo(dtype).eps * (256 if dtype == torch.float32 else 1)


def peer_check(name, kernel, peer, reference, slack, where, factor=2.0, allowance=0.0):
    """flash-attention's rule: the kernel's max error against the float64 reference is at most
    `factor` times the same-dtype PyTorch peer's, plus an absolute slack scaled to the
    reference's size (where the peer happens to be exact). The size is at least 1, the scale of
    the standard-normal inputs: a gradient that is exactly zero (causal L=1, S=1: one visible
    key) comes out of the kernel as D_i - dP_ij rounded, a few units of rounding at that scale,
    while the peer's matmul order cancels exactly. `allowance` adds an error the kernel is
    specified to make (delta_rounding_shift). Returns the failure text or None."""
    mine, theirs = max_abs_error(kernel, reference), max_abs_error(peer, reference)
    size = reference.abs().max().item() if reference.numel() else 0.0
    bound = factor * theirs + slack * max(size, 1.0) + allowance
    if mine <= bound:
        return None
    allowed = f" + {allowance:.3e} (rounded output in delta)" if allowance else ""
    return f"{name}: max error {mine:.3e} > {factor}·{theirs:.3e} (peer){allowed} + slack: {where}"


def delta_rounding_shift(q, k, out, exact_out, grad, *, view=None, **kwargs):
    """How far the float64 reference's dQ and dK move when the backward takes
    delta_i = sum_d dO_id O_id from `out`, the output rounded to its dtype as the kernel
    returned it, instead of the exact output: FlashAttention's backward, fixed/'s included,
    reads delta so. When E = Ev = 1 a row's delta is one product and its rounding is not
    averaged away; dK's error at float16 then exceeds the peer rule's bound (NOTES v56).

    With P the probabilities and e_i = sum_d dO_id (out - exact_out)_id, dS_ij moves by
    -P_ij e_i, so dQ_i moves by -scale e_i (P K)_i and dK by -scale P^T (e Q): the output of
    attention(q, k, k) and its value gradient for the grad_output e Q. `kwargs` are the
    reference's (mask, is_causal, scale, enable_gqa); `view` as in check_peer. Float64, on q's
    device; returns the two shifts shaped as q and k."""
    view = view or (lambda *ts: ts)
    q64, k64, keys_as_values = (t.detach().double().requires_grad_(True) for t in (q, k, k))
    q_seen, k_seen, k_as_v_seen = view(q64, k64, keys_as_values)
    p_k = peer_reference(q_seen, k_seen, k_as_v_seen, **kwargs)  # (P K)_i
    e = ((out.double() - exact_out.double()) * grad.double()).sum(-1, keepdim=True)
    scale = kwargs.get("scale")
    scale = 1.0 / math.sqrt(q_seen.shape[-1]) if scale is None else scale
    q_rows = q_seen.expand_as(p_k)  # leading dims broadcast as the output's
    (dk_shift,) = torch.autograd.grad(
        p_k, keys_as_values, -scale * e * q_rows.detach(), retain_graph=True
    )
    (dq_shift,) = torch.autograd.grad(q_rows, q64, -scale * e * p_k.detach())
    return dq_shift, dk_shift


# --------------------------------------------------------------- dropout's keep mask (Philox)

_MASK32 = 0xFFFFFFFF


PHILOX_ROUNDS = 7  # philox.h's kRounds


def philox4x32(counter, key, rounds=PHILOX_ROUNDS):
    """Philox4x32-R (Salmon et al., SC 2011) on Python ints: four 32-bit counter words, two
    32-bit key words -> four 32-bit outputs after `rounds` rounds."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (
            (p1 >> 32) ^ c1 ^ k0,
            p1 & _MASK32,
            (p0 >> 32) ^ c3 ^ k1,
            p0 & _MASK32,
        )
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return c0, c1, c2, c3


def keep_mask(seed: int, dropout_p: float, batch: int, len_q: int, len_kv: int):
    """The spec's keep mask, (batch, L, S) bool: element (b, i, j) is kept iff
    uniform >= dropout_p, uniform = half·2^-16, half = the low (j even) or high 16 bits of
    word = philox(counter, key)[2·(i % 2) + (j // 2) % 2]: one Philox call per 2 x 4 block,
    counter = (b·⌈L/2⌉ + i // 2)·⌈S/4⌉ + j // 4, key = the seed's two 32-bit halves."""
    seed &= 2**64 - 1  # the int64 seed's bits, as uint64
    key = (seed & _MASK32, seed >> 32)
    block_rows, block_cols = (len_q + 1) // 2, (len_kv + 3) // 4
    keep = torch.empty(batch, len_q, len_kv, dtype=torch.bool)
    for b in range(batch):
        for r in range(block_rows):
            for c in range(block_cols):
                counter = (b * block_rows + r) * block_cols + c
                words = philox4x32((counter & _MASK32, counter >> 32, 0, 0), key)
                for di in range(2):
                    for dj in range(4):
                        i, j = 2 * r + di, 4 * c + dj
                        if i < len_q and j < len_kv:
                            half = (words[2 * di + dj // 2] >> (16 * (dj % 2))) & 0xFFFF
                            keep[b, i, j] = half * 2.0**-16 >= dropout_p
    return keep
