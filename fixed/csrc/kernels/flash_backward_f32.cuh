// The backward for float32 on tensor cores: flash_backward.cuh's algorithm (FlashAttention-2)
// with all five products in 3xTF32 on mma.sync m16n8k8 (sm_80 and later), head dims 64 and 128,
// Ev = E, GQA (dK and dV per query head, which the glue sums), causal or not, an additive mask
// and dropout (ScoreArgs, as flash_backward.cuh reads them). The launcher declines the rest
// (other head dims, which the glue pads; tensors not 16-byte aligned, no sm_80+ image),
// launching nothing; the glue then runs the generic kernels. 3xTF32, the fragment layouts and
// why each block's sums get accumulators of their own: flash_forward_f32.cuh.
//
// The gradients, per batch item, for visible pairs (query i, key j) (all, or j <= i causal):
//   P_ij = exp(scale q_i.k_j - lse_i)   dP_ij = dO_i.v_j   delta_i = dO_i.O_i
//   dS_ij = P_ij (dP_ij - delta_i)
//   dV_j = sum_i P_ij dO_i   dK_j = scale sum_i dS_ij q_i   dQ_i = scale sum_j dS_ij k_j
//
// ------------------------------------------------------------------------------- kernels
// A prologue kernel (delta, lse log2(e), the zeroed float32 dQ accumulator, padded to whole
// blocks of 32 rows), the main kernel, and a dq kernel (dQ = scale accumulator): as
// flash_backward.cuh, in flash_backward_f32_rows.cuh.
// The main kernel: one CTA per (batch item, block of kBlockN = 64 keys), looping over the query
// blocks of kBlockM rows that can see those keys. Warp w owns keys 16 (w % 4) .. + 15 and the
// head dims 64 (w / 4) .. + 63 (its dim group; D = 128 has two, so 8 warps), and computes, per
// query block, the TRANSPOSED scores (keys as the M dimension):
//   S^T = K Q^T   dP^T = V dO^T           (16 keys x kBlockM queries; at D = 128 each warp of
//                                          a pair sums its group's dims and the pair adds the
//                                          two halves through shared memory)
//   P^T = 2^(S^T c - lse log2(e))   dS^T = P^T (dP^T - delta)      in registers
//   dV += P^T dO   dK += dS^T Q           (the group's dims; k: the queries, P^T and dS^T's C
//                                          fragments as A)
//   dQ += dS K     (dS^T through shared memory; the warps share the block's m-tiles and the
//                  D dims, their float32 fragments added to the accumulator by red.global.add)
// A warp's 64 dims of dK and dV stay in registers for the whole loop (64 registers; all 128 at
// D = 128 would leave none for the rest), which is why D = 128 splits the dims between two warps
// rather than taking two work items per key block, each computing S^T and dP^T over all of D
// (1.4x the FLOPs; perf/NOTES.md v38). Each query block's part is summed in accumulators of its
// own and added to them by FADD (the tensor cores truncate). K and V are split into TF32 hi and
// lo parts once per work item, in shared memory (every warp and every query block reads them);
// Q, dO and dS are split where they are read.
//
// Shared memory, float32 rows of E + 4 floats (4 mod 32 words apart): every fragment read is
// conflict-free: a lane reads (row g, column t or t + 4) with k in natural order, banks 4 g + t,
// or (rows 2t, 2t + 1, column g) with k as in the forward, banks 8 t + g.
//   D = 64, kBlockM = 32: K hi, K lo, V hi, V lo [64][68] + 2 x (Q, dO [32][68]) + dS^T [64][36]
//   + 2 x (lse, delta [32]): 68 + 34 + 9 + 0.5 = 112 KB; 4 warps, two CTAs per SM.
//   D = 128, kBlockM = 16: K hi, K lo, V hi, V lo [64][132] + 2 x (Q, dO [16][132]) + dS^T
//   [64][20] + 2 x (lse, delta [16]) + the pairs' halves of S^T and dP^T (8 warps x 32 lanes x
//   16 floats): 132 + 33 + 5 + 0.25 + 16 = 186 KB; 8 warps, one CTA per SM.
// Q, dO, lse and delta are double-buffered with cp.async: query block m + 1 is in flight while
// block m is computed. Two barriers per query block (the top one, dS^T's), and at D = 128 one of
// each warp pair between its halves of S^T and dP^T.
// Registers (nvcc 13.0, sm_90): 255; at D = 64 no spill without a mask or dropout, 12 to 36
// bytes with; at D = 128 none.
// Causal: a key block's loop starts at the query block holding its first key; only blocks that
// cross the diagonal are masked. Tails: rows of Q and dO past L are zeros with lse +inf (P = 0);
// rows of K and V past S are zeros, with P = 0 (else 2^-lse, which overflows to inf where a
// row's scores are all below -88, and inf x 0 is NaN in dQ), their dK and dV rows never stored.
#ifndef FIXED_FLASH_BACKWARD_F32_CUH_
#define FIXED_FLASH_BACKWARD_F32_CUH_

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attention_problem.cuh"        // AttentionProblem, ceil_div, detail::grid_for, ...
#include "flash_backward_f32_rows.cuh"  // prologue and dq kernels, f32_backward_rows
#include "flash_common.cuh"             // cp.async, red_add_f32x2, takes_tensor_cores, ...
#include "flash_forward_f32.cuh"        // split_tf32, mma_3xtf32, SplitFragment, load_rows, ...

namespace fixed_attention {
namespace kernels {
namespace flash {

// kHeadDim: 64 or 128. Each warp computes dK and dV for kGroupDim = 64 of the head dims, its
// dim group (kDimGroups warps per 16 keys). kBlockM: query rows per iteration.
template <int kHeadDim_, int kBlockM_>
struct F32BackwardTiling {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kGroupDim = 64;  // dims of dK and dV per warp
  static constexpr int kDimGroups = kHeadDim / kGroupDim;
  static constexpr int kKeyWarps = 4;  // warps along the keys, 16 keys each
  static constexpr int kWarps = kKeyWarps * kDimGroups;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kCtasPerSm = kDimGroups == 1 ? 2 : 1;
  static constexpr int kBlockN = 16 * kKeyWarps;  // keys per CTA
  static constexpr int kBlockM = kBlockM_;        // query rows per iteration
  static constexpr int kStride = kHeadDim + 4;    // floats per row of Q, dO, K, V
  static constexpr int kDsStride = kBlockM + 4;   // floats per row (key) of dS^T
  static constexpr int kKSteps = kGroupDim / 8;   // k-steps of a warp's S^T, dP^T
  static constexpr int kQTiles = kBlockM / 8;     // n-tiles of S^T, dP^T; k-steps of dV, dK
  static constexpr int kDTiles = kGroupDim / 8;   // n-tiles of dV, dK (of the group)
  static constexpr int kDqMTiles = kBlockM / 16;  // dQ: m-tiles, and n-tiles per warp
  static constexpr int kDqNTiles = kHeadDim / 8 * kDqMTiles / kWarps;
  static constexpr int kKVFloats = kBlockN * kStride;
  static constexpr int kQFloats = kBlockM * kStride;
  // A warp's half of S^T and dP^T for its pair (one float4 per lane per n-tile of each).
  static constexpr int kHalvesFloats = kDimGroups == 1 ? 0 : kWarps * 32 * 8 * kQTiles;
  // K hi, K lo, V hi, V lo; 2 x (Q, dO); dS^T; 2 x (lse, delta); the pairs' halves.
  static constexpr std::size_t kSmemBytes = 4 * (4 * kKVFloats + 4 * kQFloats +
                                                 kBlockN * kDsStride + 4 * kBlockM + kHalvesFloats);

  static_assert(kDimGroups == 1 || kDimGroups == 2, "head dims 64 and 128");
  static_assert(kStride % 16 == 4 && kDsStride % 16 == 4, "conflict-free fragment reads");
  static_assert(kBlockM % 16 == 0 && kF32RowPadding % kBlockM == 0, "whole padded blocks");
  static_assert(kCtasPerSm * kSmemBytes <= 227 * 1024, "kCtasPerSm CTAs per SM");
};

// D = 64: 112 KB, two CTAs per SM. D = 128: query blocks of 16, 186 KB, one CTA of 8 warps.
using F32Backward64 = F32BackwardTiling<64, 32>;
using F32Backward128 = F32BackwardTiling<128, 16>;

// The barrier of one warp pair (64 threads; ids 1 to 4, __syncthreads has 0). Not
// sm90_pipeline.cuh's named_barrier_sync, which emits only in sm_90a images: this kernel runs on
// sm_80 and later.
__device__ __forceinline__ void pair_barrier(int id) {
  asm volatile("bar.sync %0, 64;\n" ::"r"(id) : "memory");
}

__device__ __forceinline__ void st_shared_f32x4(uint32_t address, const float (&v)[4]) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "f"(v[0]), "f"(v[1]),
               "f"(v[2]), "f"(v[3])
               : "memory");
}

// acc += the four floats at `address`.
__device__ __forceinline__ void add_shared_f32x4(float (&acc)[4], uint32_t address) {
  float x, y, z, w;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(x), "=f"(y), "=f"(z), "=f"(w)
               : "r"(address)
               : "memory");
  acc[0] += x;
  acc[1] += y;
  acc[2] += z;
  acc[3] += w;
}

// ------------------------------------------------------------------------- the main kernel

// The A fragment (k in natural order, flash_forward_f32.cuh's header) of K or V: rows row0 + g,
// + 8, columns col0 + t, + 4 at `lane_offset` bytes into the tile at `tile`, read as hi and lo
// tiles (uint32 TF32 patterns, the lo tile kKVFloats after).
template <class F>
__device__ __forceinline__ SplitFragment<4> kv_a_fragment(uint32_t tile, uint32_t lane_offset) {
  constexpr uint32_t kRow8 = 8 * F::kStride * 4;
  SplitFragment<4> a;
  const uint32_t at[4] = {lane_offset, lane_offset + kRow8, lane_offset + 16,
                          lane_offset + kRow8 + 16};
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    a.hi[r] = __float_as_uint(ld_shared_f32(tile + at[r]));
    a.lo[r] = __float_as_uint(ld_shared_f32(tile + F::kKVFloats * 4 + at[r]));
  }
  return a;
}

// A float32 tile's B fragment, split: b[0] at `address`, b[1] `second` bytes further.
__device__ __forceinline__ SplitFragment<2> split_b_fragment(uint32_t address, uint32_t second) {
  SplitFragment<2> b;
  split_tf32(ld_shared_f32(address), b.hi[0], b.lo[0]);
  split_tf32(ld_shared_f32(address + second), b.hi[1], b.lo[1]);
  return b;
}

// acc += A B over one query block: A from the C fragments `scores` (P^T or dS^T, keys x the
// block's queries), B the block's tile at `b_lane` (dO or Q; this lane's offset included), the
// group's columns from col0. Summed in zeroed accumulators, then added to acc by FFMA: the tensor
// cores' accumulation truncates, a drift over many blocks (perf/NOTES.md, v22).
template <class F>
__device__ __forceinline__ void add_block_product(float (&acc)[F::kDTiles][4],
                                                  const float (&scores)[F::kQTiles][4],
                                                  uint32_t b_lane, int col0) {
  float part[F::kDTiles][4] = {};
#pragma unroll
  for (int kk = 0; kk < F::kQTiles; ++kk) {
    SplitFragment<4> a;
    split_tf32(scores[kk][0], a.hi[0], a.lo[0]);
    split_tf32(scores[kk][2], a.hi[1], a.lo[1]);
    split_tf32(scores[kk][1], a.hi[2], a.lo[2]);
    split_tf32(scores[kk][3], a.hi[3], a.lo[3]);
#pragma unroll
    for (int dj = 0; dj < F::kDTiles; ++dj) {
      const uint32_t at = b_lane + (kk * 8 * F::kStride + col0 + dj * 8) * 4;
      mma_3xtf32(part[dj], a, split_b_fragment(at, F::kStride * 4));
    }
  }
#pragma unroll
  for (int dj = 0; dj < F::kDTiles; ++dj) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc[dj][e] += part[dj][e];
    }
  }
}

template <class F, int kArgs>
__global__ void __launch_bounds__(F::kThreads, F::kCtasPerSm)
    flash_backward_f32_kernel(const float* __restrict__ q,         // (B, L, D)
                              const float* __restrict__ k,         // (B / kv_group, S, D)
                              const float* __restrict__ v,         // (B / kv_group, S, D)
                              const float* __restrict__ dout,      // (B, L, D)
                              const float* __restrict__ lse_log2,  // (B, Lp)
                              const float* __restrict__ delta,     // (B, Lp)
                              float* __restrict__ dq_accum,        // (B, Lp, D)
                              float* __restrict__ dk,              // (B, S, D)
                              float* __restrict__ dv,              // (B, S, D)
                              const AttentionProblem p, const int64_t rows_padded,
                              const bool longest_first) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int D = F::kHeadDim;
  constexpr int kQTiles = F::kQTiles, kDTiles = F::kDTiles, kDqNTiles = F::kDqNTiles;
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ uint4 flash_f32_backward_smem[];
  float* const smem = reinterpret_cast<float*>(flash_f32_backward_smem);
  const uint32_t k_tile = smem_addr(smem);                       // K hi, then K lo
  const uint32_t v_tile = k_tile + 2 * F::kKVFloats * 4;          // V hi, then V lo
  const uint32_t q_tiles = v_tile + 2 * F::kKVFloats * 4;         // 2 buffers
  const uint32_t do_tiles = q_tiles + 2 * F::kQFloats * 4;        // 2 buffers
  const uint32_t ds_tile = do_tiles + 2 * F::kQFloats * 4;        // [kBlockN][kDsStride]
  const uint32_t stats = ds_tile + F::kBlockN * F::kDsStride * 4;  // 2 x (lse, delta)
  const uint32_t halves = stats + 4 * F::kBlockM * 4;  // [warp][2 kQTiles][lane] float4
  float* const ds_floats = smem + (ds_tile - k_tile) / 4;
  const float* const stat_floats = smem + (stats - k_tile) / 4;

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  // The warp's keys and dim group (written so that one group leaves no arithmetic behind).
  const int key_warp = F::kDimGroups == 1 ? warp : warp % F::kKeyWarps;
  const int key0 = 16 * key_warp;  // the warp's first key in the CTA's block
  const int col0 = F::kDimGroups == 1 ? 0 : (warp / F::kKeyWarps) * F::kGroupDim;
  // Lane offsets (bytes): A of K and V (rows key0 + g, column t), B of Q^T and dO^T (row g,
  // column t), B of dO and Q in dV, dK (rows 2t, column g), A of dS in dQ and B of K there.
  const uint32_t kv_a_lane = static_cast<uint32_t>(((key0 + g) * F::kStride + t) * 4);
  const uint32_t qt_lane = static_cast<uint32_t>((g * F::kStride + t) * 4);
  const uint32_t qdk_lane = static_cast<uint32_t>((2 * t * F::kStride + g) * 4);
  const int dq_mtile = warp % F::kDqMTiles;                 // the warp's 16 rows of dQ
  const int dq_tile0 = (warp / F::kDqMTiles) * kDqNTiles;  // and its first n-tile in the pass
  const uint32_t ds_a_lane =
      ds_tile + static_cast<uint32_t>((2 * t * F::kDsStride + 16 * dq_mtile + g) * 4);

  const int64_t L = p.len_q, S = p.len_kv;
  const int64_t key_blocks = ceil_div(S, F::kBlockN);
  const float scale_log2 = p.scale * kLog2e;  // signed: P from the raw score
  // The mask enters P's exponent beside lse; dropout's Z scales P in dV and dP in dS.
  const bool has_mask = kArgs != kNoArgs && p.mask != nullptr;
  const bool has_dropout = kArgs == kMaskAndDropout && p.dropout_p > 0.f;
  const float keep_scale = dropout_scale(p.dropout_p);
  const uint32_t keep_threshold = dropout::threshold(p.dropout_p);
  const int slot = g & 3;  // the lane's place among those sharing Philox blocks
  static_assert(kQTiles % 2 == 0, "dropout's Philox blocks are drawn for two n-tiles at once");

  for (int64_t item = blockIdx.x; item < p.batch * key_blocks; item += gridDim.x) {
    const int64_t b = longest_first ? item % p.batch : item / key_blocks;
    const int64_t n0 = (longest_first ? item / p.batch : item % key_blocks) * F::kBlockN;
    const int64_t kv_b = (b / p.kv_group) * S * D;
    const void* const mask_b = has_mask ? mask_slice_of<float>(p, b) : nullptr;
    // Whether this thread's keys (rows g and g + 8 of the warp's 16) lie past S (see Tails).
    const bool past_s[2] = {n0 + key0 + g >= S, n0 + key0 + g + 8 >= S};
    const int64_t first_block = p.causal ? n0 / F::kBlockM : 0;
    const int64_t n_blocks = ceil_div(L, F::kBlockM) - first_block;

    // K and V of the block (group 0), then the first query block (group 1).
    load_rows<F, F::kBlockN, F::kStride>(k_tile, k + kv_b + n0 * D, S - n0, tid);
    load_rows<F, F::kBlockN, F::kStride>(v_tile, v + kv_b + n0 * D, S - n0, tid);
    cp_async_commit();
    auto load_query_block = [&](int64_t block, int buffer) {
      const int64_t m0 = (first_block + block) * F::kBlockM;
      const uint32_t offset = buffer * F::kQFloats * 4;
      load_rows<F, F::kBlockM, F::kStride>(q_tiles + offset, q + (b * L + m0) * D, L - m0, tid);
      load_rows<F, F::kBlockM, F::kStride>(do_tiles + offset, dout + (b * L + m0) * D, L - m0,
                                           tid);
      if (tid < F::kBlockM / 4) {  // lse and delta: padded buffers, always in bounds
        const uint32_t at = stats + buffer * 2 * F::kBlockM * 4;
        cp_async_16(at + tid * 16, lse_log2 + b * rows_padded + m0 + 4 * tid);
        cp_async_16(at + F::kBlockM * 4 + tid * 16, delta + b * rows_padded + m0 + 4 * tid);
      }
    };
    if (n_blocks > 0) {
      load_query_block(0, 0);
    }
    cp_async_commit();

    // K and V split into hi (in place) and lo once: each thread its own copies' chunks.
    cp_async_wait<1>();
    split_rows_in_place<F, F::kBlockN, F::kStride, F::kKVFloats>(smem, tid);
    split_rows_in_place<F, F::kBlockN, F::kStride, F::kKVFloats>(smem + 2 * F::kKVFloats, tid);

    float dk_acc[kDTiles][4] = {};
    float dv_acc[kDTiles][4] = {};
    for (int64_t block = 0; block < n_blocks; ++block) {
      const int buffer = static_cast<int>(block & 1);
      const int64_t m0 = (first_block + block) * F::kBlockM;
      cp_async_wait<0>();
      __syncthreads();  // the block's Q, dO, stats (and the split K, V) seen by all; dS^T free
      if (block + 1 < n_blocks) {
        load_query_block(block + 1, 1 - buffer);
      }
      cp_async_commit();
      const uint32_t q_tile = q_tiles + buffer * F::kQFloats * 4;
      const uint32_t do_tile = do_tiles + buffer * F::kQFloats * 4;
      const float* const lse_block = stat_floats + buffer * 2 * F::kBlockM;
      const float* const delta_block = lse_block + F::kBlockM;

      // S^T = K Q^T and dP^T = V dO^T: [j] is keys key0 .. + 15 x queries m0 + 8 j .. + 7, over
      // the warp's dim group.
      float st[kQTiles][4] = {};
      float dpt[kQTiles][4] = {};
#pragma unroll
      for (int ks = 0; ks < F::kKSteps; ++ks) {
        const uint32_t column = static_cast<uint32_t>((col0 + ks * 8) * 4);
        const SplitFragment<4> ka = kv_a_fragment<F>(k_tile, kv_a_lane + column);
        const SplitFragment<4> va = kv_a_fragment<F>(v_tile, kv_a_lane + column);
#pragma unroll
        for (int j = 0; j < kQTiles; ++j) {
          const uint32_t row = static_cast<uint32_t>(j * 8 * F::kStride * 4) + column + qt_lane;
          mma_3xtf32(st[j], ka, split_b_fragment(q_tile + row, 16));
          mma_3xtf32(dpt[j], va, split_b_fragment(do_tile + row, 16));
        }
      }
      if constexpr (F::kDimGroups == 2) {
        // The pair (warps w and w + 4, the same keys) swaps its halves and adds them: a + b and
        // b + a are the same float, so both warps hold the same S^T and dP^T.
        constexpr int kWarpBytes = 2 * kQTiles * 32 * 16;
        const uint32_t mine = halves + static_cast<uint32_t>(warp * kWarpBytes + lane * 16);
        const uint32_t partner =
            halves + static_cast<uint32_t>((warp ^ F::kKeyWarps) * kWarpBytes + lane * 16);
#pragma unroll
        for (int j = 0; j < kQTiles; ++j) {
          st_shared_f32x4(mine + (2 * j) * 32 * 16, st[j]);
          st_shared_f32x4(mine + (2 * j + 1) * 32 * 16, dpt[j]);
        }
        pair_barrier(1 + key_warp);
#pragma unroll
        for (int j = 0; j < kQTiles; ++j) {
          add_shared_f32x4(st[j], partner + (2 * j) * 32 * 16);
          add_shared_f32x4(dpt[j], partner + (2 * j + 1) * 32 * 16);
        }
      }

      // P^T and dS^T in place: element (key key0 + g + 8 (e >> 1), query 8 j + 2 t + (e & 1)).
      const bool diagonal = p.causal && m0 < n0 + F::kBlockN - 1;
      // P = 0 where query offset 8 j + 2 t + (e & 1) is below zero_below[e >> 1] + 2 t: every
      // query for a key past S, else the queries before the key (m0 + query < n0 + key) on the
      // diagonal, where |n0 - m0| < kBlockM + kBlockN. One compare with a constant per element.
      int zero_below[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        zero_below[h] = past_s[h]  ? (1 << 30)
                        : diagonal ? static_cast<int>(n0 - m0) + key0 + g + 8 * h - 2 * t
                                   : -(1 << 30);
      }
      float2 z[4] = {};  // dropout's factors of two n-tiles (dropout_factors)
#pragma unroll
      for (int j = 0; j < kQTiles; ++j) {
        // Dropout's Z of queries 8 j + 2 t, + 1 for key g + 8 h: Philox block 2 (j & 1) + h,
        // drawn for tiles j and j + 1 together (as flash_backward.cuh).
        if (has_dropout && (j & 1) == 0) {
          dropout_factors<DropoutPair::kAlongRows>(p, keep_scale, keep_threshold, b,
                                                   m0 + 8 * (j + (slot >> 1)) + 2 * t,
                                                   n0 + key0 + g + 8 * (slot & 1), slot, z);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int query = 8 * j + 2 * t + (e & 1);
          const int key = key0 + g + 8 * (e >> 1);
          float exponent = -lse_block[query];
          if (has_mask && m0 + query < L && n0 + key < S) {
            exponent = fmaf(mask_value<float>(p, mask_b, m0 + query, n0 + key), kLog2e, exponent);
          }
          float prob = exp2_approx(fmaf(st[j][e], scale_log2, exponent));
          if (8 * j + (e & 1) < zero_below[e >> 1]) {
            prob = 0.f;  // query before key, or key past S
          }
          if (has_dropout) {
            const float2 z_pair = z[2 * (j & 1) + (e >> 1)];
            const float z_e = (e & 1) ? z_pair.y : z_pair.x;
            st[j][e] = prob * z_e;
            dpt[j][e] = prob * (dpt[j][e] * z_e - delta_block[query]);
          } else {
            st[j][e] = prob;
            dpt[j][e] = prob * (dpt[j][e] - delta_block[query]);
          }
        }
      }

      // dV += P^T dO, then dK += dS^T Q, each block's sums in accumulators of their own.
      add_block_product<F>(dv_acc, st, do_tile + qdk_lane, col0);
      add_block_product<F>(dk_acc, dpt, q_tile + qdk_lane, col0);

      // dS^T to shared memory (row: key, column: query; written by the first dim group, the
      // pairs' copies being equal), then dQ += dS K for the warp's m-tile and n-tiles over the
      // CTA's 64 keys.
      if (col0 == 0) {
#pragma unroll
        for (int j = 0; j < kQTiles; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            *reinterpret_cast<float2*>(ds_floats + (key0 + g + 8 * h) * F::kDsStride + 8 * j +
                                       2 * t) = make_float2(dpt[j][2 * h], dpt[j][2 * h + 1]);
          }
        }
      }
      __syncthreads();
      float dq_part[kDqNTiles][4] = {};
#pragma unroll
      for (int ks = 0; ks < F::kBlockN / 8; ++ks) {  // keys 8 ks .. + 7, as 2t, 2t + 1
        const uint32_t at = ds_a_lane + static_cast<uint32_t>(ks * 8 * F::kDsStride * 4);
        const float a[4] = {ld_shared_f32(at), ld_shared_f32(at + 8 * 4),
                            ld_shared_f32(at + F::kDsStride * 4),
                            ld_shared_f32(at + (F::kDsStride + 8) * 4)};
        SplitFragment<4> dsa;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          split_tf32(a[r], dsa.hi[r], dsa.lo[r]);
        }
#pragma unroll
        for (int dj = 0; dj < kDqNTiles; ++dj) {
          const uint32_t kb =
              k_tile + qdk_lane +
              static_cast<uint32_t>((ks * 8 * F::kStride + (dq_tile0 + dj) * 8) * 4);
          SplitFragment<2> kf;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            kf.hi[r] = __float_as_uint(ld_shared_f32(kb + r * F::kStride * 4));
            kf.lo[r] = __float_as_uint(ld_shared_f32(kb + F::kKVFloats * 4 + r * F::kStride * 4));
          }
          mma_3xtf32(dq_part[dj], dsa, kf);
        }
      }
      float* const dq_rows =
          dq_accum + (b * rows_padded + m0 + 16 * dq_mtile + g) * D + dq_tile0 * 8 + 2 * t;
#pragma unroll
      for (int dj = 0; dj < kDqNTiles; ++dj) {
        red_add_f32x2(dq_rows + 8 * dj, dq_part[dj][0], dq_part[dj][1]);
        red_add_f32x2(dq_rows + 8 * D + 8 * dj, dq_part[dj][2], dq_part[dj][3]);
      }
    }

    // dK = scale sum dS^T Q and dV, the warp's rows that are keys of the problem.
    cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t key = n0 + key0 + g + 8 * h;
      if (key < S) {
        float* const dk_row = dk + (b * S + key) * D + col0 + 2 * t;
        float* const dv_row = dv + (b * S + key) * D + col0 + 2 * t;
#pragma unroll
        for (int dj = 0; dj < kDTiles; ++dj) {
          *reinterpret_cast<float2*>(dk_row + 8 * dj) =
              make_float2(dk_acc[dj][2 * h] * p.scale, dk_acc[dj][2 * h + 1] * p.scale);
          *reinterpret_cast<float2*>(dv_row + 8 * dj) =
              make_float2(dv_acc[dj][2 * h], dv_acc[dj][2 * h + 1]);
        }
      }
    }
    __syncthreads();  // the next work item's copies overwrite K, V, Q and dO
  }
#endif
}

// ------------------------------------------------------------------------ host launcher

namespace detail {

// Whether the float32 backward takes the problem (head dim 64 or 128, Ev = E).
inline bool f32_backward_takes(const AttentionProblem& p) {
  return takes_tensor_cores(p) && (p.head_dim == 64 || p.head_dim == 128);
}

// The three launches of tiling F on `stream`, or false having launched nothing. After a failed
// launch it stops, leaving the error for the caller's launch check.
template <class F>
bool launch_backward_f32(const float* dout, const float* q, const float* k, const float* v,
                         const float* out, const float* lse, float* lse_log2, float* delta,
                         float* dq_accum, float* dq, float* dk, float* dv,
                         const AttentionProblem& p, cudaStream_t stream) {
  auto* kernel = for_score_args(p, flash_backward_f32_kernel<F, kNoArgs>,
                                flash_backward_f32_kernel<F, kMaskOnly>,
                                flash_backward_f32_kernel<F, kMaskAndDropout>);
  if (!has_tensor_core_image(kernel)) {
    return false;
  }
  constexpr int D = F::kHeadDim;
  const int64_t rows = f32_backward_rows(p.len_q);
  constexpr int kRowsPerBlock = kF32RowThreads / 32;
  flash_backward_f32_prologue_kernel<D>
      <<<kernels::detail::grid_for(ceil_div(p.batch * rows, kRowsPerBlock)), kF32RowThreads, 0,
         stream>>>(dout, out, lse, lse_log2, delta, dq_accum, p.batch, p.len_q, rows);
  if (cudaPeekAtLastError() != cudaSuccess) {
    return true;
  }
  kernels::detail::allow_shared_memory(kernel, F::kSmemBytes);
  const int64_t work = p.batch * ceil_div(p.len_kv, F::kBlockN);
  // longest_first_pays counts 2-byte elements: float32's Q and dO are twice as wide.
  const bool longest_first = p.causal && longest_first_pays(p.batch, p.len_q, 2 * p.head_dim);
  kernel<<<kernels::detail::grid_for(work), F::kThreads, F::kSmemBytes, stream>>>(
      q, k, v, dout, lse_log2, delta, dq_accum, dk, dv, p, rows, longest_first);
  if (cudaPeekAtLastError() != cudaSuccess) {
    return true;
  }
  flash_backward_f32_dq_kernel<D>
      <<<kernels::detail::grid_for(ceil_div(p.batch * p.len_q * (D / 4), kF32RowThreads)),
         kF32RowThreads, 0, stream>>>(dq_accum, dq, p.batch, p.len_q, rows, p.scale);
  return true;
}

inline bool backward_f32(const float* dout, const float* q, const float* k, const float* v,
                         const float* out, const float* lse, float* lse_log2, float* delta,
                         float* dq_accum, float* dq, float* dk, float* dv,
                         const AttentionProblem& p, cudaStream_t stream) {
  if (!f32_backward_takes(p)) {
    return false;
  }
  for (const void* pointer : {static_cast<const void*>(dout), static_cast<const void*>(q),
                              static_cast<const void*>(k), static_cast<const void*>(v),
                              static_cast<const void*>(out), static_cast<const void*>(dq),
                              static_cast<const void*>(dk), static_cast<const void*>(dv)}) {
    if (!aligned16(pointer)) {
      return false;
    }
  }
  return p.head_dim == 64
             ? launch_backward_f32<F32Backward64>(dout, q, k, v, out, lse, lse_log2, delta,
                                                  dq_accum, dq, dk, dv, p, stream)
             : launch_backward_f32<F32Backward128>(dout, q, k, v, out, lse, lse_log2, delta,
                                                   dq_accum, dq, dk, dv, p, stream);
}

}  // namespace detail
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_BACKWARD_F32_CUH_
