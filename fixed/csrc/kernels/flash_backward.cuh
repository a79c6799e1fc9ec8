// FlashAttention-2-style backward for half and bfloat16 on tensor cores (mma.sync m16n8k16,
// ldmatrix, cp.async: sm_80 and later), head dims 64, 128 and 256. The launcher at the bottom
// returns false, launching nothing, for every case it does not cover (float32, other head dims,
// Ev != E, tensors not 16-byte aligned, no sm_80+ image for the device; GQA it takes, with dK
// and dV per query head for the caller to sum, and a mask and dropout, as the forward does);
// the caller then runs the generic kernels of attention_kernels.cuh, which compute the same
// gradients. On Hopper (compute capability 9.0) flash_backward_sm90.cuh (wgmma) is tried
// first; it reuses the prologue and dq kernels here (and this file's kernel runs where the
// library has no sm_90a image).
//
// No torch includes: CI compile-checks it without a GPU (kata/toolchain/builders.py). The fragment
// layouts of mma.m16n8k16 and ldmatrix are spelled out in flash_common.cuh's header comment.
//
// The gradients, per batch item, for visible pairs (query i, key j) (all, or j <= i when causal):
//   P_ij  = exp(scale q_i.k_j - lse_i)            (lse from the forward: no softmax statistics)
//   dP_ij = dO_i . v_j        delta_i = dO_i . O_i
//   dS_ij = P_ij (dP_ij - delta_i)
//   dV_j = sum_i P_ij dO_i    dK_j = scale sum_i dS_ij q_i    dQ_i = scale sum_j dS_ij k_j
//
// ------------------------------------------------------------------------------- kernels
// The prologue kernel (delta, lse log2(e), the zeroed dQ accumulator), then
// flash_backward_kernel: one CTA per (batch item, block of kBlockN = 128 keys), looping over the
// query blocks of kBlockM rows (128 for D = 64, 64 for D = 128) that can see those keys. dK and
// dV of its keys stay in registers for the whole loop; dQ gets each CTA's contribution by
// float32 atomics. Then the dq kernel (dQ = scale * accumulator). The prologue and dq kernels
// are in flash_backward_rows.cuh, shared with the wgmma backward.
//
// ---------------------------------------------------------------------- the main kernel
// 8 warps; warp w owns keys [16 w, 16 w + 16) of the CTA's block, so that it computes the
// TRANSPOSED scores, keys as the M dimension, for each slice of R = kSliceRows queries of the
// block of kBlockM (D = 64: 4 slices of 32; D = 128: 4 slices of 16):
//   S^T  = K Q^T     dP^T = V dO^T        (16 keys x R queries per warp: R / 8 n-tiles each)
//   P^T  = exp2(S^T scale log2(e) - lse log2(e))   dS^T = P^T (dP^T - delta)   in registers
//   dV  += P^T dO    dK  += dS^T Q        (k = the R queries; N = the head dim)
// The A fragments of K and V (the warp's 16 rows, all of D) are the same for every query
// block: they are taken once per work item and held in registers (8 x 4, D = 64; 16 x 4, D =
// 128). Slices keep S^T and dP^T at 2 x R / 2 registers, which is what makes room for them.
// The C fragments of P^T and dS^T are, packed in pairs, the A fragments of the dV and dK
// products (the identity the forward uses for P V), so P and dS never touch shared memory for
// dV and dK. dQ = dS K needs dS with queries as rows, spread over all 8 warps: each warp stores
// its dS^T (bf16/fp16) to a shared tile slice by slice, a barrier, then each warp computes one
// 16-row m-tile of dQ over part of the head dim (kBlockM = 64: 4 m-tiles x 2 halves of D;
// 128: 8 m-tiles x all of D) over all 128 keys, reading dS by ldmatrix.trans, and adds its
// float32 fragments to the global accumulator with red.global.add (vector v2 on sm_90). Two
// barriers per iteration. Operands from shared memory:
//   Q, dO as B of S^T, dP^T (plain ldmatrix)   Q, dO as B of dK, dV (.trans)
//   dS^T as A of dQ (.trans)                   K as B of dQ (.trans)
// Every warp reads all of Q and dO twice per iteration. What bounds the kernel is the latency
// of those loads at two warps per scheduler (ncu, H200, D = 64, before the K and V fragments
// moved to registers: L1/shared 77% busy, issue slots about 27%, 37% of the stall cycles
// waiting on shared-memory loads). Loads per iteration and warp (ldmatrix.x4, D = 64): 64 for
// S^T and dP^T, 64 for dV and dK, 40 for dQ. Holding the K and V fragments saved 8 of 176,
// and 9-10% of the time at D = 64, 7% at D = 128 (perf/NOTES.md, v8).
// Causal: a key block's loop starts at the query block holding its first key (earlier rows see
// none of its keys); only query blocks that reach above the diagonal (m0 < n0 + 127) are masked,
// element by element. Key blocks wholly past the last query row run no loop and write zeros.
// Work items (batch item, key block) go out in blockIdx order, and the block scheduler starts
// them about in that order. Causal: key block n has the most query blocks when n is lowest, so
// where it pays (flash_common.cuh, longest_first_pays) items go longest first over the whole
// grid: every batch item's first key block, then every item's second, and so on (5% faster at
// S = 4096, perf/NOTES.md v6). Otherwise batch-major, lowest key block first: one batch item's
// key blocks together (its Q and dO shared in L2).
// Tails, all zero-filled in shared memory (nothing past a tensor's end is read, nothing NaN):
// rows of Q and dO past L have lse +inf (the padding), so their P, hence dS, is exactly 0; rows
// of K and V past S get P = 0 (from their zero rows of K it would be 2^-lse, large where a row's
// scores are all far below 0: fp16's dS^T overflows past 65504, float32 past 2^128, and inf x 0
// in dQ is NaN), and their dK and dV rows are never stored.
//
// Shared memory, 2-byte elements, XOR-swizzled 16-byte chunks (flash_common.cuh), M = kBlockM:
//   K, V [128][D]  +  2 x (Q, dO [M][D])  +  dS^T [128][M]  +  2 x (lse, delta [M] float32)
//   D = 64, M = 128: 130 KB;  D = 128, M = 64: 145 KB.  One CTA (8 warps) per SM.
// Q, dO, lse and delta are double-buffered with cp.async: query block m + 1 is in flight while
// block m is computed (the barrier at the top of each iteration proves the other buffer free).
// Registers (nvcc 13.0, sm_90): 255 per thread for both variants, with 20 (D = 64) and 60
// (D = 128) bytes of spill; accumulators dK, dV 2 x D / 2 fp32, S^T and dP^T 2 x R / 2, the K
// and V fragments D / 2.
// D = 256 (BackwardTiling256): dK and dV of all 256 dims would take every register, so a key
// block is two work items, each computing dK, dV and dQ for 128 of the head dims from S^T and
// dP^T over all of them (1.4x the products' FLOPs); the K and V fragments are read at each
// k-step instead of held; K, V [128][256] + Q, dO [64][256] in one buffer, refilled once the
// dK and dV products are done (under dQ): 208 KB. 255 registers, 0-16 bytes of spill.
// Sizes: int64_t for lengths and global offsets; work items loop over gridDim.x only.
#ifndef FIXED_FLASH_BACKWARD_CUH_
#define FIXED_FLASH_BACKWARD_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attention_problem.cuh"  // AttentionProblem, ceil_div, min64, detail::grid_for, ...
#include "flash_backward_f32.cuh"   // float32 in 3xTF32
#include "flash_backward_rows.cuh"  // prologue and dq kernels, shared-memory helpers
#include "flash_backward_tiling.cuh"  // BackwardTiling and the variants the launcher uses
#include "flash_common.cuh"         // PTX wrappers, swizzled tiles, load_tile

namespace fixed_attention {
namespace kernels {
namespace flash {

// ------------------------------------------------------------------------ the main kernel

// kArgs: which of the mask and dropout it compiles (flash_common.cuh, ScoreArgs).
template <typename T, class F, int kArgs>
__device__ __forceinline__ void flash_backward_cta(const T* __restrict__ q,             // (B, L, D)
                                                   const T* __restrict__ k,             // (B, S, D)
                                                   const T* __restrict__ v,             // (B, S, D)
                                                   const T* __restrict__ dout,          // (B, L, D)
                                                   const float* __restrict__ lse_log2,  // (B, Lp)
                                                   const float* __restrict__ delta,     // (B, Lp)
                                                   float* __restrict__ dq_accum,  // (B, Lp, D)
                                                   T* __restrict__ dk,            // (B, S, D)
                                                   T* __restrict__ dv,            // (B, S, D)
                                                   const AttentionProblem p,
                                                   const int64_t rows_padded,
                                                   const bool longest_first) {
  constexpr int D = F::kHeadDim, BM = F::kBlockM, BN = F::kBlockN;
  constexpr int kSliceTiles = F::kSliceTiles, kDTiles = F::kDTiles, kDqTiles = F::kDqTiles;
  constexpr int kOutChunks = F::kOutDims / 8;  // chunks of dK, dV, dQ per work item
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ uint4 flash_smem[];  // 16-byte aligned
  const uint32_t k_tile = smem_addr(flash_smem);
  const uint32_t v_tile = k_tile + F::kKVElems * 2;
  const uint32_t q_tiles = v_tile + F::kKVElems * 2;  // kQBuffers buffers of kQElems
  const uint32_t do_tiles = q_tiles + F::kQBuffers * F::kQElems * 2;
  const uint32_t ds_tile = do_tiles + F::kQBuffers * F::kQElems * 2;  // [BN][BM]
  const uint32_t stats = ds_tile + F::kDsElems * 2;  // kQBuffers x (lse [BM], delta [BM])
  constexpr uint32_t kQBytes = F::kQElems * 2;
  constexpr uint32_t kStatsBytes = 2 * BM * 4;

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int x = lane & 7;
  const int key_row0 = warp * 16;  // this warp's keys in the CTA's block

  // Per-lane ldmatrix addresses at chunk pair 0 (rows start at multiples of 8, so each row's
  // swizzle key is lane & 7; see flash_forward.cuh).
  // A operands from own rows (K, V) and .trans B operands (Q, dO, K): row lane & 15, chunk
  // lane >> 4.
  const uint32_t a_chunk = static_cast<uint32_t>((lane >> 4) ^ x);
  const uint32_t k_a_lane = k_tile + static_cast<uint32_t>((key_row0 + (lane & 15)) * D * 2);
  const uint32_t v_a_lane = v_tile + static_cast<uint32_t>((key_row0 + (lane & 15)) * D * 2);
  const uint32_t trans_row = static_cast<uint32_t>((lane & 15) * D * 2);
  // Plain B operands (Q, dO of S^T, dP^T): row x + 8 (lane >> 4), chunk (lane >> 3) & 1.
  const uint32_t b_chunk = static_cast<uint32_t>(((lane >> 3) & 1) ^ x);
  const uint32_t b_row = static_cast<uint32_t>((x + ((lane >> 4) << 3)) * D * 2);
  // dQ: m-tile dq_mt, columns from chunk dq_c0; A = dS from the dS^T tile by .trans: key row
  // x + 8 (lane >> 4), query chunk 2 dq_mt + ((lane >> 3) & 1).
  const int dq_mt = warp % F::kRowTiles;
  const int dq_c0 = (warp / F::kRowTiles) * (F::kDqCols / 8);
  const uint32_t ds_lane = ds_tile + static_cast<uint32_t>((x + ((lane >> 4) << 3)) * BM * 2) +
                           ((static_cast<uint32_t>(2 * dq_mt + ((lane >> 3) & 1)) ^ x) << 4);

  const int64_t L = p.len_q, S = p.len_kv;
  const int64_t key_blocks = ceil_div(S, BN);
  const float scale_log2 = p.scale * kLog2e;
  // The mask enters P's exponent beside lse; dropout's Z scales P in dV and dP in dS.
  const bool has_mask = kArgs != kNoArgs && p.mask != nullptr;
  const bool has_dropout = kArgs == kMaskAndDropout && p.dropout_p > 0.f;
  const float keep_scale = dropout_scale(p.dropout_p);
  const uint32_t keep_threshold = dropout::threshold(p.dropout_p);
  const int slot = g & 3;  // the lane's place among those sharing Philox blocks
  static_assert(kSliceTiles % 2 == 0, "dropout's Philox blocks are drawn for two n-tiles at once");

  for (int64_t item = blockIdx.x; item < p.batch * key_blocks * F::kDimParts; item += gridDim.x) {
    // A key block's kDimParts items are adjacent (they read the same K, V, Q and dO); item %
    // kDimParts picks the head dims of dK, dV and dQ this one computes, from chunk out_chunk0.
    const int64_t block_item = item / F::kDimParts;
    const int out_chunk0 = static_cast<int>(item % F::kDimParts) * kOutChunks;
    const int64_t b = longest_first ? block_item % p.batch : block_item / key_blocks;
    const int64_t n0 = (longest_first ? block_item / p.batch : block_item % key_blocks) * BN;
    const void* const mask_b = has_mask ? mask_slice_of(p, b) : nullptr;
    const int64_t kv_b = b * S * D;  // where dK and dV go: per batch item, also under GQA
    const int64_t kv_read = (b / p.kv_group) * S * D;  // K and V: under GQA, its group's
    // Whether this thread's keys (rows g and g + 8 of the warp's 16) lie past S (see Tails).
    const int64_t first_key = n0 + key_row0 + g;
    const bool past_s[2] = {first_key >= S, first_key + 8 >= S};
    // Causal: rows before n0 see none of these keys; start at the query block holding row n0.
    const int64_t m_begin = p.causal ? (n0 / BM) * BM : 0;
    // Fits an int: L rows of D 2-byte elements are in device memory.
    const int n_iters = m_begin < L ? static_cast<int>(ceil_div(L - m_begin, BM)) : 0;

    // Prologue: K, V of this key block (one group), then Q, dO, lse, delta of the first query
    // block (another), so that the K and V fragments can be taken while the second is in flight.
    load_tile<F, BN>(k_tile, k + kv_read + n0 * D, S - n0, tid);
    load_tile<F, BN>(v_tile, v + kv_read + n0 * D, S - n0, tid);
    cp_async_commit();
    if (n_iters > 0) {
      load_tile<F, BM>(q_tiles, q + (b * L + m_begin) * D, L - m_begin, tid);
      load_tile<F, BM>(do_tiles, dout + (b * L + m_begin) * D, L - m_begin, tid);
      load_row_stats<BM>(stats, stats + BM * 4, lse_log2 + b * rows_padded + m_begin,
                         delta + b * rows_padded + m_begin, tid);
    }
    cp_async_commit();

    // The A fragments of this warp's 16 keys of K and V over the whole head dim, held in
    // registers for the whole work item (kHoldKV): every query block multiplies by them.
    cp_async_wait<1>();
    __syncthreads();
    uint32_t k_frag[F::kHoldKV ? F::kKSteps : 1][4];
    uint32_t v_frag[F::kHoldKV ? F::kKSteps : 1][4];
#pragma unroll
    for (int ks = 0; F::kHoldKV && ks < F::kKSteps; ++ks) {  // d = 16 ks .. + 15
      const uint32_t pair = static_cast<uint32_t>(2 * ks);
      ldmatrix_x4(k_frag[ks], k_a_lane + ((a_chunk ^ pair) << 4));
      ldmatrix_x4(v_frag[ks], v_a_lane + ((a_chunk ^ pair) << 4));
    }

    float dk_acc[kDTiles][4];
    float dv_acc[kDTiles][4];
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dk_acc[j][e] = 0.f;
        dv_acc[j][e] = 0.f;
      }
    }

#pragma unroll 1
    for (int it = 0; it < n_iters; ++it) {
      const int64_t m0 = m_begin + static_cast<int64_t>(it) * BM;
      const uint32_t buf = F::kQBuffers == 2 ? static_cast<uint32_t>(it & 1) : 0u;
      const uint32_t q_buf = q_tiles + buf * kQBytes;
      const uint32_t do_buf = do_tiles + buf * kQBytes;
      const uint32_t lse_buf = stats + buf * kStatsBytes;
      const uint32_t delta_buf = lse_buf + BM * 4;
      cp_async_wait<0>();  // this thread's copies of block `it` have landed
      __syncthreads();     // everyone's have; every warp is done with block it - 1
      if (F::kQBuffers == 2 && it + 1 < n_iters) {
        const int64_t next = m0 + BM;
        const uint32_t other = (buf ^ 1u) * kQBytes;
        const uint32_t other_stats = stats + (buf ^ 1u) * kStatsBytes;
        load_tile<F, BM>(q_tiles + other, q + (b * L + next) * D, L - next, tid);
        load_tile<F, BM>(do_tiles + other, dout + (b * L + next) * D, L - next, tid);
        load_row_stats<BM>(other_stats, other_stats + BM * 4, lse_log2 + b * rows_padded + next,
                           delta + b * rows_padded + next, tid);
      }
      cp_async_commit();  // possibly empty: keeps the group count uniform

      // Causal: only blocks reaching above the diagonal are masked, element by element.
      const bool diagonal = p.causal && m0 < n0 + BN - 1;  // uniform over the CTA
      // Query - key at element (0, 0) of the block; |.| < BM + BN whenever diagonal is true.
      const int diag = diagonal ? static_cast<int>(m0 - n0) - key_row0 : 0;
      // P = 0 where query 8 qt + 2 t + (e & 1) < zero_below[e >> 1] + 2 t: all for a key past S,
      // else those before the key on the diagonal. Each element: one compare with a constant.
      int zero_below[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        zero_below[h] = past_s[h] ? (1 << 30) : diagonal ? g + 8 * h - diag - 2 * t : -(1 << 30);
      }
#pragma unroll
      for (int slice = 0; slice < F::kSlices; ++slice) {  // queries m0 + kSliceRows slice ..
        // S^T = K Q^T and dP^T = V dO^T: s[j], dp[j] are the 16x8 tiles of this warp's keys and
        // the slice's queries 8 j ..
        float s[kSliceTiles][4];
        float dp[kSliceTiles][4];
#pragma unroll
        for (int j = 0; j < kSliceTiles; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[j][e] = 0.f;
            dp[j][e] = 0.f;
          }
        }
#pragma unroll
        for (int ks = 0; ks < F::kKSteps; ++ks) {  // d = 16 ks .. + 15
          uint32_t k_step[4], v_step[4];  // this k-step's K and V fragments, when not held
          if constexpr (!F::kHoldKV) {
            const uint32_t pair = static_cast<uint32_t>(2 * ks);
            ldmatrix_x4(k_step, k_a_lane + ((a_chunk ^ pair) << 4));
            ldmatrix_x4(v_step, v_a_lane + ((a_chunk ^ pair) << 4));
          }
          const uint32_t(&ka)[4] = F::kHoldKV ? k_frag[F::kHoldKV ? ks : 0] : k_step;
          const uint32_t(&va)[4] = F::kHoldKV ? v_frag[F::kHoldKV ? ks : 0] : v_step;
#pragma unroll
          for (int np = 0; np < kSliceTiles / 2; ++np) {  // the slice's queries 16 np .. + 15
            const uint32_t row = b_row + (slice * F::kSliceRows + np * 16) * D * 2 +
                                 ((b_chunk ^ static_cast<uint32_t>(2 * ks)) << 4);
            uint32_t qb[4];
            ldmatrix_x4(qb, q_buf + row);
            mma_16816<T>(s[2 * np], ka, qb[0], qb[1]);
            mma_16816<T>(s[2 * np + 1], ka, qb[2], qb[3]);
            uint32_t ob[4];
            ldmatrix_x4(ob, do_buf + row);
            mma_16816<T>(dp[2 * np], va, ob[0], ob[1]);
            mma_16816<T>(dp[2 * np + 1], va, ob[2], ob[3]);
          }
        }

        // P^T and dS^T in place, and dS^T (bf16/fp16) to shared memory for dQ. Element e of
        // tile j: key n0 + key_row0 + g + 8 (e >> 1), query m0 + 8 qt + 2 t + (e & 1), where
        // qt = kSliceTiles slice + j is the tile's place in the block.
        float2 z[4] = {};  // dropout's factors of two n-tiles (dropout_factors)
#pragma unroll
        for (int j = 0; j < kSliceTiles; ++j) {
          const int qt = slice * kSliceTiles + j;
          const float2 lse2 = ld_shared_f32x2(lse_buf + (8 * qt + 2 * t) * 4);
          const float2 dl = ld_shared_f32x2(delta_buf + (8 * qt + 2 * t) * 4);
          // Dropout's Z of queries 8 qt + 2 t, + 1 for key g + 8 h: Philox block 2 (j & 1) + h,
          // drawn for tiles j and j + 1 together.
          if (has_dropout && (j & 1) == 0) {
            dropout_factors<DropoutPair::kAlongRows>(
                p, keep_scale, keep_threshold, b, m0 + 8 * (qt + (slot >> 1)) + 2 * t,
                n0 + key_row0 + g + 8 * (slot & 1), slot, z);
          }
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float row_lse = (e & 1) ? lse2.y : lse2.x;
            const float row_delta = (e & 1) ? dl.y : dl.x;
            const int64_t query = m0 + 8 * qt + 2 * t + (e & 1);
            const int64_t key = n0 + key_row0 + g + 8 * (e >> 1);
            float exponent = -row_lse;
            if (has_mask && query < L && key < S) {
              exponent = fmaf(mask_value<T>(p, mask_b, query, key), kLog2e, exponent);
            }
            float prob = exp2_approx(fmaf(s[j][e], scale_log2, exponent));
            if (8 * qt + (e & 1) < zero_below[e >> 1]) {
              prob = 0.f;  // query before key, or key past S
            }
            if (has_dropout) {
              const float2 z_pair = z[2 * (j & 1) + (e >> 1)];
              const float z_e = (e & 1) ? z_pair.y : z_pair.x;
              s[j][e] = prob * z_e;
              dp[j][e] = prob * (dp[j][e] * z_e - row_delta);
            } else {
              s[j][e] = prob;
              dp[j][e] = prob * (dp[j][e] - row_delta);
            }
          }
          // Key rows key_row0 + g + 8 h, query columns 8 qt + 2 t, + 1.
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t offset = swizzled<BM>(key_row0 + g + 8 * h, qt) + 4 * t;
            st_shared_b32(ds_tile + offset, pack2<T>(dp[j][2 * h], dp[j][2 * h + 1]));
          }
        }

        // dV += P^T dO and dK += dS^T Q over the slice's queries.
#pragma unroll
        for (int np = 0; np < kSliceTiles / 2; ++np) {
          const int kk = slice * (kSliceTiles / 2) + np;  // queries m0 + 16 kk .. + 15
          uint32_t pa[4];
          uint32_t da[4];
          pa[0] = pack2<T>(s[2 * np][0], s[2 * np][1]);
          pa[1] = pack2<T>(s[2 * np][2], s[2 * np][3]);
          pa[2] = pack2<T>(s[2 * np + 1][0], s[2 * np + 1][1]);
          pa[3] = pack2<T>(s[2 * np + 1][2], s[2 * np + 1][3]);
          da[0] = pack2<T>(dp[2 * np][0], dp[2 * np][1]);
          da[1] = pack2<T>(dp[2 * np][2], dp[2 * np][3]);
          da[2] = pack2<T>(dp[2 * np + 1][0], dp[2 * np + 1][1]);
          da[3] = pack2<T>(dp[2 * np + 1][2], dp[2 * np + 1][3]);
#pragma unroll
          for (int dp2 = 0; dp2 < kDTiles / 2; ++dp2) {  // d = 8 out_chunk0 + 16 dp2 .. + 15
            const uint32_t chunk = static_cast<uint32_t>(out_chunk0 + 2 * dp2);
            const uint32_t row = trans_row + kk * 16 * D * 2 + ((a_chunk ^ chunk) << 4);
            uint32_t ob[4];
            ldmatrix_x4_trans(ob, do_buf + row);
            mma_16816<T>(dv_acc[2 * dp2], pa, ob[0], ob[1]);
            mma_16816<T>(dv_acc[2 * dp2 + 1], pa, ob[2], ob[3]);
            uint32_t qb[4];
            ldmatrix_x4_trans(qb, q_buf + row);
            mma_16816<T>(dk_acc[2 * dp2], da, qb[0], qb[1]);
            mma_16816<T>(dk_acc[2 * dp2 + 1], da, qb[2], qb[3]);
          }
        }
      }
      __syncthreads();  // the whole dS^T tile is written; every warp is done with Q and dO
      if (F::kQBuffers == 1 && it + 1 < n_iters) {  // the one buffer's next block, under dQ
        const int64_t next = m0 + BM;
        load_tile<F, BM>(q_tiles, q + (b * L + next) * D, L - next, tid);
        load_tile<F, BM>(do_tiles, dout + (b * L + next) * D, L - next, tid);
        load_row_stats<BM>(stats, stats + BM * 4, lse_log2 + b * rows_padded + next,
                           delta + b * rows_padded + next, tid);
        cp_async_commit();
      }

      // dQ rows m0 + 16 dq_mt .., columns 8 (out_chunk0 + dq_c0) .. + kDqCols, over the block's
      // 128 keys.
      const int dq_chunk0 = out_chunk0 + dq_c0;
      float dq[kDqTiles][4];
#pragma unroll
      for (int j = 0; j < kDqTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dq[j][e] = 0.f;
        }
      }
#pragma unroll
      for (int kk = 0; kk < F::kKeySteps; ++kk) {  // keys n0 + 16 kk .. + 15
        uint32_t dsa[4];
        ldmatrix_x4_trans(dsa, ds_lane + kk * 16 * BM * 2);
#pragma unroll
        for (int dp2 = 0; dp2 < kDqTiles / 2; ++dp2) {
          uint32_t kb[4];
          ldmatrix_x4_trans(kb, k_tile + trans_row + kk * 16 * D * 2 +
                                    ((a_chunk ^ static_cast<uint32_t>(dq_chunk0 + 2 * dp2)) << 4));
          mma_16816<T>(dq[2 * dp2], dsa, kb[0], kb[1]);
          mma_16816<T>(dq[2 * dp2 + 1], dsa, kb[2], kb[3]);
        }
      }
      // Rows m0 + 16 dq_mt + g (+ 8): row & 7 == g (Lp and m0 are multiples of 8).
      float* const dq_rows = dq_accum + (b * rows_padded + m0 + 16 * dq_mt + g) * D + 2 * t;
#pragma unroll
      for (int j = 0; j < kDqTiles; ++j) {
        const int chunk = dq_chunk0 + j;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          red_add_f32x2(dq_rows + 8 * h * D + 8 * chunk, dq[j][2 * h], dq[j][2 * h + 1]);
        }
      }
    }

    // Epilogue: dK (times scale) and dV through this warp's own rows of the K and V tiles, then
    // 16-byte stores of the item's part of each row. The barrier: no copies in flight, every
    // warp done with K.
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = key_row0 + g + 8 * h;  // row & 7 == g
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
        // Columns 8 (out_chunk0 + j) + 2 t, + 1.
        const uint32_t offset = swizzled<D>(row, out_chunk0 + j) + 4 * t;
        st_shared_b32(k_tile + offset,
                      pack2<T>(dk_acc[j][2 * h] * p.scale, dk_acc[j][2 * h + 1] * p.scale));
        st_shared_b32(v_tile + offset, pack2<T>(dv_acc[j][2 * h], dv_acc[j][2 * h + 1]));
      }
    }
    __syncwarp();
    const unsigned char* const smem_bytes = reinterpret_cast<const unsigned char*>(flash_smem);
    constexpr int kRowsPerStep = 32 / kOutChunks;
#pragma unroll
    for (int step = 0; step < 16 / kRowsPerStep; ++step) {
      const int row = key_row0 + step * kRowsPerStep + lane / kOutChunks;
      const int chunk = out_chunk0 + lane % kOutChunks;
      const int64_t key = n0 + row;
      const uint32_t offset = swizzled<D>(row, chunk);
      if (key < S) {
        const int64_t to = kv_b + key * D + chunk * 8;
        *reinterpret_cast<uint4*>(dk + to) =
            *reinterpret_cast<const uint4*>(smem_bytes + offset);
        *reinterpret_cast<uint4*>(dv + to) =
            *reinterpret_cast<const uint4*>(smem_bytes + F::kKVElems * 2 + offset);
      }
    }
    __syncthreads();  // the next work item's copies overwrite the K and V tiles
  }
}

template <typename T, class F, int kArgs>
__global__ void __launch_bounds__(F::kThreads, 1)
    flash_backward_kernel(const T* __restrict__ q,               // (B, L, D)
                          const T* __restrict__ k,               // (B, S, D)
                          const T* __restrict__ v,               // (B, S, D)
                          const T* __restrict__ dout,            // (B, L, D)
                          const float* __restrict__ lse_log2,    // (B, Lp)
                          const float* __restrict__ delta,       // (B, Lp)
                          float* __restrict__ dq_accum,          // (B, Lp, D)
                          T* __restrict__ dk,                    // (B, S, D)
                          T* __restrict__ dv,                    // (B, S, D)
                          const AttentionProblem p, const int64_t rows_padded,
                          const bool longest_first) {  // causal work order (see the launcher)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  flash_backward_cta<T, F, kArgs>(q, k, v, dout, lse_log2, delta, dq_accum, dk, dv, p,
                                  rows_padded, longest_first);
#endif  // __CUDA_ARCH__ >= 800
}

// ------------------------------------------------------------------------ host launchers

namespace detail {

template <typename T, class F>
bool launch_backward(const T* dout, const T* q, const T* k, const T* v, const T* out,
                     const float* lse, float* lse_log2, float* delta, float* dq_accum, T* dq,
                     T* dk, T* dv, const AttentionProblem& p, cudaStream_t stream) {
  // 16-byte copies and stores: a tensor at an odd storage offset is not aligned.
  for (const void* pointer : {static_cast<const void*>(dout), static_cast<const void*>(q),
                              static_cast<const void*>(k), static_cast<const void*>(v),
                              static_cast<const void*>(out), static_cast<const void*>(dq),
                              static_cast<const void*>(dk), static_cast<const void*>(dv)}) {
    if (!aligned16(pointer)) {
      return false;
    }
  }
  auto* kernel = for_score_args(p, flash_backward_kernel<T, F, kNoArgs>,
                                flash_backward_kernel<T, F, kMaskOnly>,
                                flash_backward_kernel<T, F, kMaskAndDropout>);
  if (!has_tensor_core_image(kernel)) {
    return false;
  }
  backward<T, F>(kernel, F::kSmemBytes, dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq,
                 dk, dv, p, stream);
  return true;
}

template <typename T>
bool launch_backward(const T* dout, const T* q, const T* k, const T* v, const T* out,
                     const float* lse, float* lse_log2, float* delta, float* dq_accum, T* dq,
                     T* dk, T* dv, const AttentionProblem& p, cudaStream_t stream) {
  if (!takes_tensor_cores(p)) {
    return false;
  }
  switch (p.head_dim) {
    case 64:
      return launch_backward<T, BackwardTiling64>(dout, q, k, v, out, lse, lse_log2, delta,
                                                    dq_accum, dq, dk, dv, p, stream);
    case 128:
      return launch_backward<T, BackwardTiling128>(dout, q, k, v, out, lse, lse_log2, delta,
                                                     dq_accum, dq, dk, dv, p, stream);
    case 256:
      return launch_backward<T, BackwardTiling256>(dout, q, k, v, out, lse, lse_log2, delta,
                                                     dq_accum, dq, dk, dv, p, stream);
    default: return false;
  }
}

// Workspace rows for the head dims the kernel covers: whole query blocks of that variant.
inline int64_t backward_rows(const AttentionProblem& p) {
  if (!takes_tensor_cores(p)) {
    return 0;
  }
  switch (p.head_dim) {
    case 64: return padded_rows<BackwardTiling64>(p.len_q);
    case 128: return padded_rows<BackwardTiling128>(p.len_q);
    case 256: return padded_rows<BackwardTiling256>(p.len_q);
    default: return 0;
  }
}

}  // namespace detail
}  // namespace flash

// The entry points, one overload per dtype (non-templates, so that nvcc's compile check of this
// header instantiates every kernel). Problem: batch, len_q and len_kv > 0. The glue calls
// flash_backward_rows and flash_backward_sm90.cuh's launch_flash_backward, which tries the
// wgmma kernel on compute capability 9.0 and then launch_flash_backward_mma_sync (the same
// workspace rows serve both: their query blocks are the same).
//
// flash_backward_rows: 0 when the tensor-core backward does not cover the case (dtype, head
// dim, or a problem it does not take: flash_common.cuh's takes_tensor_cores); otherwise the
// rows (per batch item) of the float32 workspace the caller allocates before launch_flash_backward:
// lse_log2 and delta (B, rows), dq_accum (B, rows, D), no zeroing needed.
//
// launch_flash_backward_mma_sync: contiguous (B, L, D) dout, q, out, dq; (B / kv_group, S, D)
// k, v; (B, S, D) dk, dv, per batch item (under GQA the caller sums each group's kv_group of
// them); lse (B, L) float32 from the forward. Returns false, having launched nothing, when the case
// is not covered (then the caller runs the generic backward kernels); true after the launches on
// `stream`, which the caller then checks. Throws std::runtime_error if the shared-memory opt-in
// fails, as the generic launchers do.
inline int64_t flash_backward_rows(const float*, const AttentionProblem& p) {
  return flash::detail::f32_backward_takes(p) ? flash::f32_backward_rows(p.len_q) : 0;
}
inline int64_t flash_backward_rows(const __half*, const AttentionProblem& p) {
  return flash::detail::backward_rows(p);
}
inline int64_t flash_backward_rows(const __nv_bfloat16*, const AttentionProblem& p) {
  return flash::detail::backward_rows(p);
}

inline bool launch_flash_backward_mma_sync(const float* dout, const float* q, const float* k,
                                           const float* v, const float* out, const float* lse,
                                           float* lse_log2, float* delta, float* dq_accum,
                                           float* dq, float* dk, float* dv,
                                           const AttentionProblem& p, cudaStream_t stream) {
  return flash::detail::backward_f32(dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq, dk,
                                     dv, p, stream);  // 3xTF32 (flash_backward_f32.cuh)
}
inline bool launch_flash_backward_mma_sync(const __half* dout, const __half* q, const __half* k,
                                           const __half* v, const __half* out, const float* lse,
                                           float* lse_log2, float* delta, float* dq_accum,
                                           __half* dq, __half* dk, __half* dv,
                                           const AttentionProblem& p, cudaStream_t stream) {
  return flash::detail::launch_backward(dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq,
                                        dk, dv, p, stream);
}
inline bool launch_flash_backward_mma_sync(const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                           const __nv_bfloat16* k, const __nv_bfloat16* v,
                                           const __nv_bfloat16* out, const float* lse,
                                           float* lse_log2, float* delta, float* dq_accum,
                                           __nv_bfloat16* dq, __nv_bfloat16* dk,
                                           __nv_bfloat16* dv, const AttentionProblem& p,
                                           cudaStream_t stream) {
  return flash::detail::launch_backward(dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq,
                                        dk, dv, p, stream);
}

}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_BACKWARD_CUH_
