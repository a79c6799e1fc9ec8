// The wgmma backward at head dims over 128 (up to 256; sm_90a): the CTA of
// flash_backward_sm90.cuh's wide kernel, its tiling and shared memory. Same gradients, workspace,
// prologue and dq kernels, causal convention, tails and work order as flash_backward_sm90_cta.cuh;
// another split of the work, because dK and dV of 64 keys over 256 dims would take 256 registers
// per thread (FlashAttention-3 splits its head dim 256 backward the same way).
//
// ---------------------------------------------------------------------------------- tiling
// One CTA per (batch item, block of 64 keys): 2 warpgroups (256 threads) on the same 64 keys, warp
// w (0..3) of a warpgroup keys 16 w .. 16 w + 15 of them. Warpgroup wg owns queries 32 wg .. + 31
// of each 64-query block in the scores, and head dims 128 wg .. + 127 in the gradients. Per query
// block m0:
//   1, 2. S^T (64 keys x 32 queries, f32, 16 per thread) = K Q^T and dP^T = V dO^T: 16 wgmma
//      m64n32k16 each over the 256 dims, both operands K-major in shared memory. Two groups: P^T
//      is computed while dP^T is in flight.
//   3. P^T = 2^(S^T scale log2(e) - lse log2(e) [+ mask log2(e)]), 0 where causal hides the
//      pair; P^T Z (dropout's keep factor) to shared memory as bf16/fp16. Element s[4 j + e] is
//      key 16 w + g + 8 (e >> 1), query 32 wg + 8 j + 2 t + (e & 1) (wgmma.cuh's layout).
//   4. dS^T = P^T (dP^T Z - delta) to shared memory. Barrier: both warpgroups' halves are there.
//   5. dV (64 x 128, 64 per thread) += P^T dO and dK += dS^T Q over the 64 queries: 4 wgmma
//      m64n128k16 each, A (P^T, dS^T) K-major and B (dO, Q; this warpgroup's 128 dims) MN-major,
//      all in shared memory: each warpgroup reads the other's half of P^T and dS^T there.
//   6. dQ (64 queries x 128 dims) = dS K: 2 x 4 wgmma m64n64k16, A = dS read from the stored
//      dS^T as an MN-major A, B = K MN-major.
//   7. Barrier (every wgmma of the block is done with Q and dO), then dQ to a stage in shared
//      memory that takes the place of this block's Q and dO, in the swizzled layout of the
//      workspace rows (swizzled_dq_chunk); after the next barrier one thread adds the stage to
//      the workspace with one 64 KB bulk reduction (cp.reduce.async.bulk .add.f32).
// Q, dO, lse and delta are double-buffered: block m0 + 1's copies are issued after the barrier
// of step 4, into the region whose stage the reduction issued at the top has read by then (the
// issuing thread waits for that read before the barrier). The item's last block issues the next
// item's first block there, and the next item's K and V into L2, so that the prologue, which
// every CTA reaches at about the same time, loads K and V alone, from L2 (perf/NOTES.md, v51).
// Causal, tails, masks, dropout, GQA, E and Ev as they are (kAsIs): as flash_backward_sm90_cta.cuh
// (hidden blocks are skipped with dropout too).
// The mask's entries are read from global memory into registers while S^T runs (a mask at these
// head dims is rare; the CTA has no room for a mask tile).
//
// Shared memory (128-byte swizzle, [columns / 64][rows][64], wgmma.cuh): K, V [64][256] 2 x 32 KB;
// 2 regions of Q [64][256] + dO [64][256] (each 64 KB, in turn dQ's f32 stage [64][256]);
// P^T, dS^T [64 keys][64 queries] 2 x 8 KB; lse, delta 2 x 512 B; + 1 KB of alignment: 210 KB.
// Registers per thread: dK, dV 2 x 64; dQ 64; S^T, dP^T 2 x 16 (+ 16 mask entries).
#ifndef FIXED_FLASH_BACKWARD_SM90_WIDE_CUH_
#define FIXED_FLASH_BACKWARD_SM90_WIDE_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "attention_problem.cuh"   // AttentionProblem, ceil_div, value_dim
#include "flash_backward_rows.cuh"  // swizzled_dq_chunk, load_row_stats, st_shared_*
#include "flash_common.cuh"         // cp.async, exp2, pack2, masks, dropout
#include "flash_forward_sm90.cuh"   // sw128_offset, load_tile_sw128
#include "wgmma.cuh"                // wgmma.mma_async and descriptors

namespace fixed_attention {
namespace kernels {
namespace flash {
namespace sm90 {

// The wide CTA's shape (what flash_backward_rows.cuh's detail::backward reads of it, and the
// shared memory).
struct BackwardTileWide {
  static constexpr int kHeadDim = 256;
  static constexpr int kThreads = 256;  // 2 warpgroups
  static constexpr int kBlockN = 64;    // keys per CTA, shared by both warpgroups
  static constexpr int kBlockM = 64;    // queries per loop iteration, 32 per warpgroup in S^T
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row of Q, K, V, dO
  static constexpr int kDimParts = 1;           // work items per key block
  static constexpr uint32_t kTileBytes = 64 * kHeadDim * 2;  // K, V, Q or dO: 32 KB
  static constexpr uint32_t kScoresBytes = 64 * 64 * 2;      // P^T or dS^T: 8 KB
  static constexpr uint32_t kStatsBytes = 2 * kBlockM * 4;   // lse and delta of one block
  static constexpr uint32_t kDqBytes = kBlockM * kHeadDim * 4;  // dQ's stage: one Q + dO region
  static constexpr std::size_t kSmemBytes =
      2 * kTileBytes + 2 * (2 * kTileBytes) + 2 * kScoresBytes + 2 * kStatsBytes + 1024;
  static_assert(kDqBytes == 2 * kTileBytes, "the stage fills one region of Q and dO");
  static_assert(kSmemBytes <= 227 * 1024, "over sm_90's 227 KB of shared memory per block");
};

// The wide body: every work item of the grid-stride loop (sm_90a images only). kArgs, kAsIs: as
// wgmma_backward_cta's.
template <typename T, int kArgs, bool kAsIs>
__device__ __forceinline__ void wgmma_backward_wide_cta(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const float* __restrict__ lse_log2,
    const float* __restrict__ delta, float* __restrict__ dq_accum, T* __restrict__ dk,
    T* __restrict__ dv, const AttentionProblem p, const int64_t rows_padded,
    const bool longest_first) {
  using F = BackwardTileWide;
  constexpr int D = F::kHeadDim, BM = F::kBlockM, BN = F::kBlockN;
  constexpr uint32_t kRowBytes = 128;
  constexpr uint32_t kRun = 64 * kRowBytes;  // one 64-column run of a 64-row tile
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ uint4 sm90_bwd_wide_smem[];
  const uint32_t smem_base = smem_addr(sm90_bwd_wide_smem);
  const uint32_t k_tile = (smem_base + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const uint32_t v_tile = k_tile + F::kTileBytes;
  const uint32_t regions = v_tile + F::kTileBytes;  // 2 x (Q, dO), each in turn dQ's stage
  const uint32_t pt_tile = regions + 4 * F::kTileBytes;  // P^T Z [64 keys][64 queries]
  const uint32_t ds_tile = pt_tile + F::kScoresBytes;    // dS^T [64 keys][64 queries]
  const uint32_t stats = ds_tile + F::kScoresBytes;      // 2 x (lse [64], delta [64])
  // The fixed tiles' descriptors (wgmma.cuh's TileDescriptor): K and V K-major (S^T, dP^T),
  // P^T and dS^T as A (dV, dK), dS^T and K MN-major (dQ).
  const TileDescriptor k_desc(k_tile, 16, 1024), v_desc(v_tile, 16, 1024);
  const TileDescriptor pt_desc(pt_tile, 16, 1024), ds_desc(ds_tile, 16, 1024);
  const TileDescriptor ds_mn_major(ds_tile, kRun, 1024), k_mn_major(k_tile, kRun, 1024);
  // The K and V tiles through a generic pointer, for the epilogue's 16-byte reads.
  const unsigned char* const kv_bytes =
      reinterpret_cast<const unsigned char*>(sm90_bwd_wide_smem) + (k_tile - smem_base);

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  // From lane 0: uniform, so the descriptors that depend on it stay in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
  const int g = lane >> 2;                 // fragment row (groupID)
  const int t = lane & 3;                  // fragment column pair (threadID_in_group)
  const int key_row0 = 16 * (warp & 3);    // this warp's first key of the block
  const int query0 = 32 * wg;              // this warpgroup's queries of S^T, dP^T
  const uint32_t dim_run0 = 2u * wg;       // its 128 dims of dV, dK, dQ: runs 2 wg, 2 wg + 1

  const int64_t L = p.len_q, S = p.len_kv;
  const int E = kAsIs ? static_cast<int>(p.head_dim) : D;
  const int Ev = kAsIs ? static_cast<int>(value_dim(p)) : D;
  const int64_t key_blocks = ceil_div(S, BN);
  const float scale_log2 = p.scale * kLog2e;
  const bool has_mask = kArgs != kNoArgs && p.mask != nullptr;
  const bool has_dropout = kArgs == kMaskAndDropout && p.dropout_p > 0.f;
  const float keep_scale = dropout_scale(p.dropout_p);
  const uint32_t keep_threshold = dropout::threshold(p.dropout_p);
  const int slot = g & 3;  // the lane's place among those sharing Philox blocks
  const bool skips = kArgs != kNoArgs && skips_hidden_blocks(p);
  const bool skips_zero = has_mask && skips_zero_blocks(p);

  const int64_t items = p.batch * key_blocks;
  struct KeyBlock {
    int64_t b, n0;  // batch item, first key
  };
  const auto key_block_of = [&](int64_t item) {
    return KeyBlock{longest_first ? item % p.batch : item / key_blocks,
                    (longest_first ? item / p.batch : item % key_blocks) * BN};
  };
  // The first query block after m that key block n0 of batch item b sees.
  const auto visible_after = [&](int64_t b, int64_t n0, int64_t m) {
    do {
      m += BM;
    } while (skips && m < L && hidden_block(p, b, m, BM, n0, BN));
    return m;
  };
  // Query block m0's Q, dO, lse and delta into region `region` (0 or 1) and its stats buffer.
  const auto load_queries = [&](uint32_t region, int64_t b, int64_t m0) {
    const uint32_t at = regions + region * 2 * F::kTileBytes;
    const uint32_t stats_at = stats + region * F::kStatsBytes;
    load_tile_sw128<F, BM>(at, q + (b * L + m0) * E, L - m0, tid, E);
    load_tile_sw128<F, BM>(at + F::kTileBytes, dout + (b * L + m0) * Ev, L - m0, tid, Ev);
    load_row_stats<BM>(stats_at, stats_at + BM * 4, lse_log2 + b * rows_padded + m0,
                       delta + b * rows_padded + m0, tid);
  };
  uint32_t region_turn = 0;         // the region of the next block's Q and dO
  bool first_block_loaded = false;  // by the previous item's last block, into region_turn

  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const KeyBlock here = key_block_of(item);
    const int64_t b = here.b, n0 = here.n0;
    const void* const mask_b = has_mask ? mask_slice_of(p, b) : nullptr;
    const int64_t dk_b = b * S * E, dv_b = b * S * Ev;
    // Whether this thread's keys (rows g and g + 8 of the warp's 16) lie past S: step 3 sets
    // their P to 0 (flash_backward_sm90_cta.cuh says why).
    const int64_t first_key = n0 + key_row0 + g;
    const bool past_s[2] = {first_key >= S, first_key + 8 >= S};
    const int64_t k_read = (b / p.kv_group) * S * E, v_read = (b / p.kv_group) * S * Ev;
    const int64_t m_begin = p.causal ? n0 : 0;  // BM = BN: the block holding row n0
    const auto next_visible = [&](int64_t m) { return visible_after(b, n0, m); };
    int64_t m0 = next_visible(m_begin - BM);
    int64_t done_m0 = -1;  // the last block computed, whose dQ is staged in done_stage
    uint32_t done_stage = regions;

    // K, V (the tiles are free: the previous item's epilogue has read them), and the first
    // block's Q, dO, lse, delta unless the previous item's last block loaded them (region_turn:
    // free, its last stage was read before that block's barrier of step 4).
    load_tile_sw128<F, BN>(k_tile, k + k_read + n0 * E, S - n0, tid, E);
    load_tile_sw128<F, BN>(v_tile, v + v_read + n0 * Ev, S - n0, tid, Ev);
    if (m0 < L && !first_block_loaded) {
      load_queries(region_turn, b, m0);
    }
    first_block_loaded = false;
    cp_async_commit();

    float dk_acc[64];
    float dv_acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      dk_acc[i] = 0.f;
      dv_acc[i] = 0.f;
    }

#pragma unroll 1
    for (int it = 0; m0 < L; ++it) {
      const uint32_t buf = region_turn;
      region_turn ^= 1u;
      const uint32_t q_buf = regions + buf * 2 * F::kTileBytes;
      const uint32_t do_buf = q_buf + F::kTileBytes;
      const uint32_t lse_buf = stats + buf * F::kStatsBytes;
      const uint32_t delta_buf = lse_buf + BM * 4;
      cp_async_wait<0>();          // this thread's copies of this block (and K, V) have landed
      fence_proxy_async_shared();  // ... and its copies, zeros and dQ stores, to the async proxy
      __syncthreads();             // everyone's; the previous block's wgmmas are all done
      if (it > 0 && tid == 0) {    // the previous block's staged dQ, as one bulk reduction
        bulk_reduce_add_f32(dq_accum + (b * rows_padded + done_m0) * D, done_stage, F::kDqBytes);
        bulk_commit_group();
      }
      const int64_t following = next_visible(m0);
      if (following >= L && tid == 32 && item + gridDim.x < items) {
        // The item's last block: the next item's K and V into L2 while it runs, so that its
        // prologue does not wait on DRAM with every other CTA at once (the rounds stay in step).
        const KeyBlock next = key_block_of(item + gridDim.x);
        const int64_t kv_b = next.b / p.kv_group;
        const auto keys = static_cast<uint32_t>(min64(S - next.n0, BN));
        bulk_prefetch_l2(k + (kv_b * S + next.n0) * E, keys * E * sizeof(T));
        bulk_prefetch_l2(v + (kv_b * S + next.n0) * Ev, keys * Ev * sizeof(T));
      }

      // 1, 2: S^T = K Q^T, dP^T = V dO^T over this warpgroup's 32 queries. k-step ks: head dims
      // 16 ks .. + 15, run ks / 4, 32 bytes into each 128-byte row.
      float s[16];
      float dp[16];
      wgmma_fence();
      // K-major (S^T, dP^T) and MN-major (dV, dK: B's two 64-wide runs kRun apart) descriptors
      // of this block's buffers (wgmma.cuh's TileDescriptor).
      const TileDescriptor q_rows(q_buf + query0 * kRowBytes, 16, 1024);
      const TileDescriptor do_rows(do_buf + query0 * kRowBytes, 16, 1024);
      const TileDescriptor q_runs(q_buf, kRun, 1024), do_runs(do_buf, kRun, 1024);
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        const uint32_t at = static_cast<uint32_t>(ks >> 2) * kRun + (ks & 3) * 32;
        wgmma_m64n32k16_ss<T>(s, k_desc.at(at), q_rows.at(at), ks > 0);
      }
      wgmma_commit_group();
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        const uint32_t at = static_cast<uint32_t>(ks >> 2) * kRun + (ks & 3) * 32;
        wgmma_m64n32k16_ss<T>(dp, v_desc.at(at), do_rows.at(at), ks > 0);
      }
      wgmma_commit_group();
      // The mask's entries (0 past L or S) and dropout's keep bits, while the products run.
      const bool masked = has_mask && !(skips_zero && zero_block(p, b, m0, BM, n0, BN));
      float bias[kArgs != kNoArgs ? 16 : 1];
      if (kArgs != kNoArgs && masked) {  // uniform
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int64_t query = m0 + query0 + 8 * (i / 4) + 2 * t + (i & 1);
          const int64_t key = n0 + key_row0 + g + 8 * ((i % 4) >> 1);
          bias[i] = query < L && key < S ? mask_value<T>(p, mask_b, query, key) : 0.f;
        }
      }
      uint32_t kept = ~0u;  // bit i: element s[i] kept (all of them without dropout)
      if (has_dropout) {  // tiles 2 and 3 are 16 rows (8 block rows) after tiles 0 and 1
        const uint64_t counter = dropout::block_counter(b, m0 + query0 + 8 * (slot >> 1) + 2 * t,
                                                        n0 + key_row0 + g + 8 * (slot & 1), L, S);
        const uint64_t rows16 = 8 * dropout::block_cols(S);
        kept = dropout_keep_bits_at<DropoutPair::kAlongRows>(p, keep_threshold, counter, slot) |
               dropout_keep_bits_at<DropoutPair::kAlongRows>(p, keep_threshold, counter + rows16,
                                                             slot)
                   << 8;
      }
      const auto factor = [&](int i) {  // Z of element i: 1 without dropout (keep_scale 1)
        if constexpr (kArgs != kMaskAndDropout) {
          return 1.f;
        } else {
          return (kept >> i) & 1u ? keep_scale : 0.f;
        }
      };
      wgmma_wait_group<1>();  // S^T has landed; dP^T may still be in flight
      wgmma_fence_operands(s);

      // 3: P^T in place, P^T Z to shared memory: key row key_row0 + g + 8 h, query chunk
      // 4 wg + j, columns 2 t, + 1 of it.
      const bool diagonal = p.causal && m0 + query0 < n0 + key_row0 + 15;  // uniform per warp
      const int diag = diagonal ? static_cast<int>(m0 + query0 - n0) - key_row0 : 0;
      // P = 0 below query offset zero_below[e >> 1] + 2 t: every query for a key past S, else
      // the queries before the key on the diagonal (flash_backward_sm90_cta.cuh, step 3).
      int zero_below[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        zero_below[h] = past_s[h] ? (1 << 30) : diagonal ? g + 8 * h - diag - 2 * t : -(1 << 30);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 lse2 = ld_shared_f32x2(lse_buf + (query0 + 8 * j + 2 * t) * 4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float exponent = -((e & 1) ? lse2.y : lse2.x);
          if (kArgs != kNoArgs && masked) {
            exponent = fmaf(bias[4 * j + e], kLog2e, exponent);
          }
          float prob = exp2_approx(fmaf(s[4 * j + e], scale_log2, exponent));
          if (8 * j + (e & 1) < zero_below[e >> 1]) {
            prob = 0.f;  // query before key, or key past S
          }
          s[4 * j + e] = prob;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = 4 * j + 2 * h;
          const uint32_t offset = sw128_offset<BN>(key_row0 + g + 8 * h, 4 * wg + j) + 4 * t;
          st_shared_b32(pt_tile + offset, pack2<T>(s[i] * factor(i), s[i + 1] * factor(i + 1)));
        }
      }
      wgmma_wait_group<0>();  // dP^T has landed
      wgmma_fence_operands(dp);

      // 4: dS^T = P^T (dP^T Z - delta) to shared memory, as P^T.
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 dl = ld_shared_f32x2(delta_buf + (query0 + 8 * j + 2 * t) * 4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float row_delta = (e & 1) ? dl.y : dl.x;
          dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] * factor(4 * j + e) - row_delta);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = 4 * j + 2 * h;
          const uint32_t offset = sw128_offset<BN>(key_row0 + g + 8 * h, 4 * wg + j) + 4 * t;
          st_shared_b32(ds_tile + offset, pack2<T>(dp[i], dp[i + 1]));
        }
      }
      fence_proxy_async_shared();  // this thread's P^T and dS^T stores, to the wgmmas
      if (tid == 0) {
        bulk_wait_group_read_all();  // the previous stage (the other region) has been read
      }
      __syncthreads();  // both halves of P^T and dS^T are stored; the other region is free

      // The next block's Q, dO, lse, delta into the other region and stats buffer; after the
      // item's last block, the next item's first block (its prologue then loads K and V alone).
      if (following < L) {
        load_queries(buf ^ 1u, b, following);
      } else if (item + gridDim.x < items) {
        const KeyBlock next = key_block_of(item + gridDim.x);
        const int64_t next_m0 = visible_after(next.b, next.n0, (p.causal ? next.n0 : 0) - BM);
        if (next_m0 < L) {
          load_queries(buf ^ 1u, next.b, next_m0);
          first_block_loaded = true;
        }
      }
      cp_async_commit();  // possibly empty: keeps the group count uniform

      // 5: dV += P^T dO, dK += dS^T Q. k-step kk: queries 16 kk .. + 15 (32 bytes into P^T's
      // rows, 16 rows into dO's and Q's); B's two 64-wide runs of N are kRun apart.
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        const uint32_t rows = dim_run0 * kRun + kk * 16 * kRowBytes;
        wgmma_m64n128k16_ss_bmn<T>(dv_acc, pt_desc.at(kk * 32), do_runs.at(rows));
      }
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        const uint32_t rows = dim_run0 * kRun + kk * 16 * kRowBytes;
        wgmma_m64n128k16_ss_bmn<T>(dk_acc, ds_desc.at(kk * 32), q_runs.at(rows));
      }
      wgmma_commit_group();
      // 6: dQ = dS K over the 64 keys (k-step kk: keys 16 kk .. + 15), dims of runs dim_run0 + h.
      float dq0[32];
      float dq1[32];
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        const uint64_t desc_ds = ds_mn_major.at(kk * 16 * kRowBytes);
        const uint32_t k_rows = dim_run0 * kRun + kk * 16 * kRowBytes;  // into the K tile
        wgmma_m64n64k16_ss_mn<T>(dq0, desc_ds, k_mn_major.at(k_rows), kk > 0);
        wgmma_m64n64k16_ss_mn<T>(dq1, desc_ds, k_mn_major.at(k_rows + kRun), kk > 0);
      }
      wgmma_commit_group();
      wgmma_wait_group<0>();
      wgmma_fence_operands(dv_acc);
      wgmma_fence_operands(dk_acc);
      wgmma_fence_operands(dq0);
      wgmma_fence_operands(dq1);
      __syncthreads();  // 7: every wgmma of this block is done with its Q and dO: the stage

      // dQ to the stage: query row 16 (warp & 3) + g + 8 h (row & 7 == g), dims
      // 128 wg + 64 half + 8 j + 2 t, chunk 16 wg + 8 half + j swizzled.
      const auto stage = [&](const float(&dq)[32], int half) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int chunk = swizzled_dq_chunk(16 * wg + 8 * half + j, g);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = 16 * (warp & 3) + g + 8 * h;
            st_shared_f32x2(q_buf + static_cast<uint32_t>(row * D + 8 * chunk + 2 * t) * 4,
                                 dq[4 * j + 2 * h], dq[4 * j + 2 * h + 1]);
          }
        }
      };
      stage(dq0, 0);
      stage(dq1, 1);
      done_m0 = m0;
      done_stage = q_buf;
      m0 = following;
    }

    // Epilogue: the last stage's reduction; dK (times scale) and dV through the K and V tiles
    // (every wgmma is done with them), each warp its 16 rows x this warpgroup's 128 dims, then
    // 16-byte stores of those rows' 16 chunks.
    cp_async_wait<0>();
    fence_proxy_async_shared();  // the dQ stores, to the bulk reduction
    __syncthreads();
    if (done_m0 >= 0 && tid == 0) {
      bulk_reduce_add_f32(dq_accum + (b * rows_padded + done_m0) * D, done_stage, F::kDqBytes);
      bulk_commit_group();
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = key_row0 + g + 8 * h;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const uint32_t offset = sw128_offset<BN>(row, 16 * wg + j) + 4 * t;
        st_shared_b32(k_tile + offset, pack2<T>(dk_acc[4 * j + 2 * h] * p.scale,
                                                dk_acc[4 * j + 2 * h + 1] * p.scale));
        st_shared_b32(v_tile + offset, pack2<T>(dv_acc[4 * j + 2 * h], dv_acc[4 * j + 2 * h + 1]));
      }
    }
    __syncwarp();
#pragma unroll
    for (int step = 0; step < 8; ++step) {
      const int row = key_row0 + 2 * step + (lane >> 4);
      const int chunk = 16 * wg + (lane & 15);
      const int64_t key = n0 + row;
      const uint32_t offset = sw128_offset<BN>(row, chunk);
      if (key < S) {
        if (chunk * 8 < E) {
          *reinterpret_cast<uint4*>(dk + dk_b + key * E + chunk * 8) =
              *reinterpret_cast<const uint4*>(kv_bytes + offset);
        }
        if (chunk * 8 < Ev) {
          *reinterpret_cast<uint4*>(dv + dv_b + key * Ev + chunk * 8) =
              *reinterpret_cast<const uint4*>(kv_bytes + F::kTileBytes + offset);
        }
      }
    }
    __syncthreads();  // the next item's copies overwrite K and V (the stage's region waits at
                      // its first block's barrier of step 4)
  }
  if (tid == 0) {
    bulk_wait_group_all();  // the stage is read and dq_accum written before the CTA exits
  }
}

}  // namespace sm90
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_BACKWARD_SM90_WIDE_CUH_
