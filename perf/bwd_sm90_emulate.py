"""A float64 emulation, on the CPU, of flash_backward_sm90.cuh's address arithmetic and fragment
mappings, against a float64 reference: `python perf/bwd_sm90_emulate.py` (about a minute).

Shared memory is a flat array of 2-byte slots. Tiles are written at the kernel's own offsets
(sw128_offset, the dS^T stores, the epilogue), and wgmma operands are read through a model of
the matrix descriptors: CUTLASS's canonical 128-byte-swizzle layouts, K-major element (r, k) at
start + (r // 8) SBO + (r % 8) 128 + 2 k, MN-major element (mn, k) at start + (mn // 64) LBO +
(k // 8) SBO + (k % 8) 128 + 2 (mn % 64), then the swizzle on the address (bits 4-6 ^= bits
7-9). Register fragments follow the wgmma accumulator and A layouts (wgmma.cuh). Everything
else (descriptor start addresses, LBO and SBO, masks, lse and delta columns, dQ tiles, the dQ
stage and its swizzle, the dq kernel's read, epilogue) transcribes the kernel's expressions,
warpgroup by warpgroup, in the kernel's order. No rounding: a right mapping agrees with the
reference to about 1e-15, a wrong one by O(1) (a swapped dS^T store, a wrong dQ column group, no
swizzle, a dQ stage or dq read without its swizzle: all caught).

What it cannot tell: whether the descriptor model is the hardware's; the GPU check
(bwd_sm90_check.cu) settled that on an H200 (perf/NOTES.md, v13), and nothing about ordering
(it runs the warpgroups one after the other). Drafted with the kernel, before any GPU run;
needs torch (CPU) only."""

import math
import sys

import torch

LOG2E = 1.4426950408889634


def sw128_offset(rows, row, chunk):
    return (chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4)


def swz(addr):
    return addr ^ (((addr >> 7) & 7) << 4)


def read_kmajor(smem, start, rows, sbo=1024):
    """[rows][16] operand, K-major (rows = M of A or N of B)."""
    r = torch.arange(rows)[:, None]
    k = torch.arange(16)[None, :]
    logical = start + (r // 8) * sbo + (r % 8) * 128 + 2 * k
    return smem[swz(logical) // 2]


def read_mnmajor(smem, start, mn, lbo, sbo=1024):
    """[mn][16] operand, MN-major."""
    m = torch.arange(mn)[:, None]
    k = torch.arange(16)[None, :]
    logical = start + (m // 64) * lbo + (k // 8) * sbo + (k % 8) * 128 + 2 * (m % 64)
    return smem[swz(logical) // 2]


# Thread fragments of a warpgroup: thread tid (0..127): w = tid // 32, g, t.
TIDS = torch.arange(128)
W, G, T = TIDS // 32, (TIDS % 32) >> 2, TIDS & 3


def to_thread_c(full, n):
    """Accumulator [64][n] -> per-thread d[4 j + e]."""
    d = torch.empty(128, n // 2)
    for j in range(n // 8):
        for e in range(4):
            d[:, 4 * j + e] = full[16 * W + G + 8 * (e >> 1), 8 * j + 2 * T + (e & 1)]
    return d


def a_from_regs(frag):
    """frag[tid][4][2] (lo, hi of a0..a3) -> A [64][16]."""
    a = torch.zeros(64, 16)
    for r in range(4):
        row = 16 * W + G + 8 * (r & 1)
        col = 8 * (r >> 1) + 2 * T
        a[row, col] = frag[:, r, 0]
        a[row, col + 1] = frag[:, r, 1]
    return a


def backward(q, k, v, dout, out, lse, scale, causal, D, longest_first=False):
    B, L, _ = q.shape
    S = k.shape[1]
    BM = 128 if D == 64 else 64
    BN = 128
    rows_padded = math.ceil(L / BM) * BM
    # Prologue.
    lse2 = torch.full((B, rows_padded), math.inf)
    lse2[:, :L] = lse * LOG2E
    delta = torch.zeros(B, rows_padded)
    delta[:, :L] = (dout * out).sum(-1)
    dq_accum = torch.zeros(B, rows_padded, D)
    dk = torch.full(k.shape, math.nan)
    dv = torch.full(v.shape, math.nan)
    kv_bytes = BN * D * 2
    q_bytes = BM * D * 2
    ds_bytes = BN * BM * 2
    k_tile = 0
    v_tile = k_tile + kv_bytes
    q_tiles = v_tile + kv_bytes
    do_tiles = q_tiles + 2 * q_bytes
    ds_tile = do_tiles + 2 * q_bytes
    total = ds_tile + ds_bytes
    scale_log2 = scale * LOG2E
    key_blocks = math.ceil(S / BN)
    chunks = D // 8
    dq_row_groups = BM // 64

    def load_tile(smem, tile, src, valid, nrows):
        for row in range(nrows):
            for c in range(chunks):
                addr = (tile + sw128_offset(nrows, row, c)) // 2
                smem[addr : addr + 8] = src[row, 8 * c : 8 * c + 8] if row < valid else 0.0

    for item in range(B * key_blocks):
        b = item % B if longest_first else item // key_blocks
        n0 = (item // B if longest_first else item % key_blocks) * BN
        m_begin = (n0 // BM) * BM if causal else 0
        n_iters = math.ceil((L - m_begin) / BM) if m_begin < L else 0
        smem = torch.full((total // 2,), math.nan)
        kpad = torch.zeros(BN, D)
        kpad[: min(BN, S - n0)] = k[b, n0 : n0 + BN]
        vpad = torch.zeros(BN, D)
        vpad[: min(BN, S - n0)] = v[b, n0 : n0 + BN]
        load_tile(smem, k_tile, kpad, S - n0, BN)
        load_tile(smem, v_tile, vpad, S - n0, BN)
        dk_acc = [torch.zeros(64, D) for _ in range(2)]
        dv_acc = [torch.zeros(64, D) for _ in range(2)]
        for it in range(n_iters):
            m0 = m_begin + it * BM
            buf = it & 1
            q_buf = q_tiles + buf * q_bytes
            do_buf = do_tiles + buf * q_bytes
            qpad = torch.zeros(BM, D)
            qpad[: min(BM, L - m0)] = q[b, m0 : m0 + BM]
            opad = torch.zeros(BM, D)
            opad[: min(BM, L - m0)] = dout[b, m0 : m0 + BM]
            load_tile(smem, q_buf, qpad, L - m0, BM)
            load_tile(smem, do_buf, opad, L - m0, BM)
            lse_buf = lse2[b, m0 : m0 + BM]
            delta_buf = delta[b, m0 : m0 + BM]
            for wg in range(2):
                k_rows = k_tile + wg * 64 * 128
                v_rows = v_tile + wg * 64 * 128
                s_full = torch.zeros(64, BM)
                dp_full = torch.zeros(64, BM)
                for ks in range(D // 16):
                    run, step = ks >> 2, (ks & 3) * 32
                    a = read_kmajor(smem, k_rows + run * BN * 128 + step, 64)
                    bq = read_kmajor(smem, q_buf + run * BM * 128 + step, BM)
                    s_full += a @ bq.T
                    a = read_kmajor(smem, v_rows + run * BN * 128 + step, 64)
                    bo = read_kmajor(smem, do_buf + run * BM * 128 + step, BM)
                    dp_full += a @ bo.T
                s = to_thread_c(s_full, BM)
                dp = to_thread_c(dp_full, BM)
                warp = 4 * wg + W
                key_row0 = warp * 16
                diagonal = causal & (m0 < n0 + key_row0 + 15)
                diag = torch.where(diagonal, m0 - n0 - key_row0, 0)
                for j in range(BM // 8):
                    for e in range(4):
                        row_lse = lse_buf[8 * j + 2 * T + (e & 1)]
                        prob = torch.exp2(s[:, 4 * j + e] * scale_log2 - row_lse)
                        masked = diagonal & (diag + 8 * j + 2 * T + (e & 1) < G + 8 * (e >> 1))
                        s[:, 4 * j + e] = torch.where(masked, 0.0, prob)
                p_frag = torch.empty(128, BM // 16, 4, 2)
                for kk in range(BM // 16):
                    for r in range(4):
                        p_frag[:, kk, r, 0] = s[:, 8 * kk + 2 * r]
                        p_frag[:, kk, r, 1] = s[:, 8 * kk + 2 * r + 1]
                for kk in range(BM // 16):
                    a = a_from_regs(p_frag[:, kk])
                    bo = read_mnmajor(smem, do_buf + kk * 16 * 128, D, BM * 128)
                    dv_acc[wg] += a @ bo.T
                for j in range(BM // 8):
                    for e in range(4):
                        row_delta = delta_buf[8 * j + 2 * T + (e & 1)]
                        dp[:, 4 * j + e] = s[:, 4 * j + e] * (dp[:, 4 * j + e] - row_delta)
                ds_frag = torch.empty(128, BM // 16, 4, 2)
                for kk in range(BM // 16):
                    for r in range(4):
                        ds_frag[:, kk, r, 0] = dp[:, 8 * kk + 2 * r]
                        ds_frag[:, kk, r, 1] = dp[:, 8 * kk + 2 * r + 1]
                for kk in range(BM // 16):
                    for r in range(4):
                        offset = (
                            sw128_offset(BN, key_row0 + G + 8 * (r & 1), 2 * kk + (r >> 1)) + 4 * T
                        )
                        addr = (ds_tile + offset) // 2
                        smem[addr] = ds_frag[:, kk, r, 0]
                        smem[addr + 1] = ds_frag[:, kk, r, 1]
                for kk in range(BM // 16):
                    a = a_from_regs(ds_frag[:, kk])
                    bq = read_mnmajor(smem, q_buf + kk * 16 * 128, D, BM * 128)
                    dk_acc[wg] += a @ bq.T
            # dQ: each warpgroup's 64 x 64 tile into the f32 stage [BM][D] (swizzled_dq_chunk:
            # row r's 8-float chunk c at c ^ (r & 7)), then the whole stage added to the
            # workspace rows m0 .. m0 + BM - 1 at once (the bulk reduction).
            stage = torch.zeros(BM * D)
            for wg in range(2):
                dq_row = wg if dq_row_groups == 2 else 0
                dq_col = 0 if dq_row_groups == 2 else wg
                dq_full = torch.zeros(64, 64)
                for kk in range(BN // 16):
                    a = read_mnmajor(
                        smem, ds_tile + dq_row * BN * 128 + kk * 16 * 128, 64, BN * 128
                    )
                    bk = read_mnmajor(
                        smem, k_tile + dq_col * BN * 128 + kk * 16 * 128, 64, BN * 128
                    )
                    dq_full += a @ bk.T
                dqt = to_thread_c(dq_full, 64)
                warp = 4 * wg + W
                for j in range(8):
                    chunk = (8 * dq_col + j) ^ G
                    for h in range(2):
                        row = 64 * dq_row + 16 * (warp & 3) + G + 8 * h
                        at = row * D + 8 * chunk + 2 * T
                        stage.index_put_((at,), dqt[:, 4 * j + 2 * h], accumulate=True)
                        stage.index_put_((at + 1,), dqt[:, 4 * j + 2 * h + 1], accumulate=True)
            start = (b * rows_padded + m0) * D
            dq_accum.view(-1)[start : start + BM * D] += stage
        # Epilogue.
        for wg in range(2):
            dkt = to_thread_c(dk_acc[wg], D)
            dvt = to_thread_c(dv_acc[wg], D)
            warp = 4 * wg + W
            key_row0 = warp * 16
            for h in range(2):
                row = key_row0 + G + 8 * h
                for j in range(D // 8):
                    offset = sw128_offset(BN, row, j) + 4 * T
                    smem[(k_tile + offset) // 2] = dkt[:, 4 * j + 2 * h] * scale
                    smem[(k_tile + offset) // 2 + 1] = dkt[:, 4 * j + 2 * h + 1] * scale
                    smem[(v_tile + offset) // 2] = dvt[:, 4 * j + 2 * h]
                    smem[(v_tile + offset) // 2 + 1] = dvt[:, 4 * j + 2 * h + 1]
        rows_per_step = 32 // chunks
        for warp in range(8):
            key_row0 = warp * 16
            for step in range(16 // rows_per_step):
                for lane in range(32):
                    row = key_row0 + step * rows_per_step + lane // chunks
                    chunk = lane % chunks
                    key = n0 + row
                    off = sw128_offset(BN, row, chunk)
                    if key < S:
                        dk[b, key, 8 * chunk : 8 * chunk + 8] = smem[
                            (k_tile + off) // 2 : (k_tile + off) // 2 + 8
                        ]
                        dv[b, key, 8 * chunk : 8 * chunk + 8] = smem[
                            (v_tile + off) // 2 : (v_tile + off) // 2 + 8
                        ]
    # The dq kernel: row i's chunk c is read from chunk c ^ (i & 7).
    rows = torch.arange(rows_padded).view(-1, 1)
    chunks = torch.arange(D // 8).view(1, -1) ^ (rows & 7)
    columns = (8 * chunks).unsqueeze(-1) + torch.arange(8)  # (rows, D / 8, 8)
    unswizzled = torch.gather(dq_accum, 2, columns.reshape(1, rows_padded, D).expand(B, -1, -1))
    dq = unswizzled[:, :L] * scale
    return dq, dk, dv


def reference(q, k, v, dout, scale, causal):
    s = torch.einsum("bld,bsd->bls", q, k) * scale
    if causal:
        visible = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    out = p @ v
    dp = dout @ v.transpose(1, 2)
    delta = (dout * out).sum(-1)
    ds = p * (dp - delta[..., None])
    return out, lse, scale * ds @ k, scale * ds.transpose(1, 2) @ q, p.transpose(1, 2) @ dout


# (D, causal, L, S, scale, longest_first): tails in L and S, L < S and L > S, several query
# blocks (both buffers), causal blocks past the last row, negative and zero scale.
CASES = [
    (64, False, 130, 200, 0.125, False),
    (64, True, 300, 140, -0.2, True),
    (128, True, 140, 300, 0.09, False),
    (128, False, 70, 129, 0.0, True),
    (64, True, 129, 129, 0.11, False),
    (128, True, 200, 200, 0.1, True),
]


def main():
    torch.set_default_dtype(torch.float64)
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for D, causal, L, S, scale, longest_first in CASES:
        B = 2
        q, dout = torch.randn(2, B, L, D, generator=generator)
        k, v = torch.randn(2, B, S, D, generator=generator)
        out, lse, *grads = reference(q, k, v, dout, scale, causal)
        emulated = backward(q, k, v, dout, out, lse, scale, causal, D, longest_first)
        errors = []
        for x, r in zip(emulated, grads, strict=True):
            error = float((x - r).norm() / r.norm().clamp_min(1e-300))
            errors.append(error if bool(x.isfinite().all()) else math.inf)
        worst = max(worst, *errors)
        print(
            f"D={D} causal={causal} L={L} S={S} scale={scale}: dq {errors[0]:.1e} "
            f"dk {errors[1]:.1e} dv {errors[2]:.1e}",
            flush=True,
        )
    print(f"worst relative error {worst:.1e}: {'ok' if worst < 1e-10 else 'FAIL'}")
    sys.exit(0 if worst < 1e-10 else 1)


if __name__ == "__main__":
    main()
