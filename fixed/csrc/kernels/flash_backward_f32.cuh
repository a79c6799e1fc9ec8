// The backward for float32 on tensor cores: flash_backward.cuh's algorithm (FlashAttention-2)
// with all five products in 3xTF32 on mma.sync m16n8k8 (sm_80 and later), head dim 64, Ev = E,
// GQA (dK and dV per query head, which the glue sums), causal or not, an additive mask and
// dropout (ScoreArgs, as flash_backward.cuh reads them). The launcher declines the rest (other
// head dims, tensors not 16-byte aligned, no sm_80+ image), launching nothing; the glue then
// runs the generic kernels. 3xTF32, the fragment layouts and
// why each key block's sums get accumulators of their own: flash_forward_f32.cuh.
//
// The gradients, per batch item, for visible pairs (query i, key j) (all, or j <= i causal):
//   P_ij = exp(scale q_i.k_j - lse_i)   dP_ij = dO_i.v_j   delta_i = dO_i.O_i
//   dS_ij = P_ij (dP_ij - delta_i)
//   dV_j = sum_i P_ij dO_i   dK_j = scale sum_i dS_ij q_i   dQ_i = scale sum_j dS_ij k_j
//
// ------------------------------------------------------------------------------- kernels
// A prologue kernel (delta, lse log2(e), the zeroed float32 dQ accumulator, padded to whole
// query blocks), the main kernel, and a dq kernel (dQ = scale accumulator), as flash_backward.cuh.
// The main kernel: one CTA of 4 warps per (batch item, block of kBlockN = 64 keys), looping over
// the query blocks of kBlockM = 32 rows that can see those keys; warp w owns keys 16 w .. + 15
// and computes, per query block, the TRANSPOSED scores (keys as the M dimension):
//   S^T = K Q^T   dP^T = V dO^T           (16 keys x 32 queries: 4 n-tiles each)
//   P^T = 2^(S^T c - lse log2(e))   dS^T = P^T (dP^T - delta)      in registers
//   dV += P^T dO   dK += dS^T Q           (k: the 32 queries, P^T and dS^T's C fragments as A)
//   dQ += dS K     (dS^T through shared memory; each warp one 16-row m-tile x half of D, its
//                  float32 fragments added to the accumulator by red.global.add)
// dK and dV of the warp's keys stay in registers for the whole loop; each query block's part is
// summed in accumulators of its own and added to them by FADD (the tensor cores truncate).
// K and V are split into TF32 hi and lo parts once per work item, in shared memory (every warp
// and every query block reads them); Q, dO and dS are split where they are read.
//
// Shared memory, float32 rows of E + 4 floats (4 mod 32 words apart): every fragment read is
// conflict-free: a lane reads (row g, column t or t + 4) with k in natural order, banks 4 g + t,
// or (rows 2t, 2t + 1, column g) with k as in the forward, banks 8 t + g.
//   K hi, K lo, V hi, V lo [64][68]  +  2 x (Q, dO [32][68])  +  dS^T [64][36]  +  2 x (lse,
//   delta [32]): 68 + 34 + 9 + 0.5 = 112 KB: two CTAs per SM.
// Q, dO, lse and delta are double-buffered with cp.async: query block m + 1 is in flight while
// block m is computed. Two barriers per query block (the top one, and dS^T's).
// Registers (nvcc 13.0, sm_90a): 255, no spill without arguments; 16 bytes of spill with a mask,
// 32 with a mask and dropout.
// Causal: a key block's loop starts at the query block holding its first key; only blocks that
// cross the diagonal are masked. Tails: rows of Q and dO past L are zeros with lse +inf (P = 0);
// rows of K and V past S are zeros, their dK and dV rows never stored.
#ifndef FIXED_FLASH_BACKWARD_F32_CUH_
#define FIXED_FLASH_BACKWARD_F32_CUH_

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "attention_problem.cuh"  // AttentionProblem, ceil_div, min64, detail::grid_for, ...
#include "flash_common.cuh"       // cp.async, red_add_f32x2, takes_tensor_cores, ...
#include "flash_forward_f32.cuh"  // split_tf32, mma_3xtf32, SplitFragment, ld_shared_f32

namespace fixed_attention {
namespace kernels {
namespace flash {

struct F32BackwardTiling {
  static constexpr int kHeadDim = 64;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockN = 16 * kWarps;  // keys per CTA, 16 per warp
  static constexpr int kBlockM = 32;           // query rows per iteration
  static constexpr int kStride = kHeadDim + 4;  // floats per row of Q, dO, K, V
  static constexpr int kDsStride = kBlockM + 4;  // floats per row (key) of dS^T
  static constexpr int kKSteps = kHeadDim / 8;   // k-steps of S^T, dP^T
  static constexpr int kQTiles = kBlockM / 8;    // n-tiles of S^T, dP^T; k-steps of dV, dK
  static constexpr int kDTiles = kHeadDim / 8;   // n-tiles of dV, dK
  static constexpr int kKVFloats = kBlockN * kStride;
  static constexpr int kQFloats = kBlockM * kStride;
  // K hi, K lo, V hi, V lo; 2 x (Q, dO); dS^T; 2 x (lse, delta).
  static constexpr std::size_t kSmemBytes =
      4 * (4 * kKVFloats + 4 * kQFloats + kBlockN * kDsStride + 4 * kBlockM);

  static_assert(kStride % 32 == 4 && kDsStride % 32 == 4, "conflict-free fragment reads");
  static_assert(2 * kSmemBytes <= 227 * 1024, "two CTAs per SM");
};

// The rows of the padded per-row buffers (lse log2(e), delta, dQ accumulator) per batch item.
inline int64_t f32_backward_rows(int64_t len_q) {
  return ceil_div(len_q, F32BackwardTiling::kBlockM) * F32BackwardTiling::kBlockM;
}

// --------------------------------------------------------------------- prologue and dq kernels

constexpr int kF32RowThreads = 256;

// One warp per padded row: delta = dO . O, lse log2(e) (+inf for pad rows and rows that saw no
// key, so that their P is exactly 0), and the row of the dQ accumulator zeroed.
__global__ void __launch_bounds__(kF32RowThreads)
    flash_backward_f32_prologue_kernel(const float* __restrict__ dout,  // (B, L, 64)
                                       const float* __restrict__ out,   // (B, L, 64)
                                       const float* __restrict__ lse,   // (B, L)
                                       float* __restrict__ lse_log2,    // (B, Lp)
                                       float* __restrict__ delta,       // (B, Lp)
                                       float* __restrict__ dq_accum,    // (B, Lp, 64)
                                       const int64_t batch, const int64_t len_q,
                                       const int64_t rows_padded) {
  constexpr int D = F32BackwardTiling::kHeadDim;
  constexpr float kLog2e = 1.4426950408889634f;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kF32RowThreads / 32);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * (kF32RowThreads / 32) + (threadIdx.x >> 5);
       row < batch * rows_padded; row += warps) {
    const int64_t b = row / rows_padded;
    const int64_t i = row % rows_padded;
    const bool real = i < len_q;
    float dot = 0.f;
    if (real) {
      const int64_t offset = (b * len_q + i) * D + 2 * lane;
      const float2 d = *reinterpret_cast<const float2*>(dout + offset);
      const float2 o = *reinterpret_cast<const float2*>(out + offset);
      dot = fmaf(d.x, o.x, d.y * o.y);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    }
    if (lane == 0) {
      delta[row] = dot;
      const float row_lse = real ? lse[b * len_q + i] : -INFINITY;
      lse_log2[row] = row_lse == -INFINITY ? INFINITY : row_lse * kLog2e;
    }
    *reinterpret_cast<float2*>(dq_accum + row * D + 2 * lane) = make_float2(0.f, 0.f);
  }
}

// dQ = scale accumulator, for the L real rows of each batch item.
__global__ void __launch_bounds__(kF32RowThreads)
    flash_backward_f32_dq_kernel(const float* __restrict__ dq_accum,  // (B, Lp, 64)
                                 float* __restrict__ dq,              // (B, L, 64)
                                 const int64_t batch, const int64_t len_q,
                                 const int64_t rows_padded, const float scale) {
  constexpr int kChunks = F32BackwardTiling::kHeadDim / 4;  // float4s per row
  const int64_t total = batch * len_q * kChunks;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * kF32RowThreads + threadIdx.x;
       index < total; index += static_cast<int64_t>(gridDim.x) * kF32RowThreads) {
    const int64_t row = index / kChunks;  // in (B, L)
    const int64_t chunk = index % kChunks;
    const int64_t b = row / len_q;
    const int64_t i = row % len_q;
    const float4 sum = reinterpret_cast<const float4*>(dq_accum)[(b * rows_padded + i) * kChunks +
                                                                 chunk];
    reinterpret_cast<float4*>(dq)[index] =
        make_float4(sum.x * scale, sum.y * scale, sum.z * scale, sum.w * scale);
  }
}

// ------------------------------------------------------------------------- the main kernel

// A fragment (k in natural order, flash_forward_f32.cuh's header) of a split tile: rows row0 +
// g, + 8, columns col0 + t, + 4, from the hi and lo tiles (uint32 TF32 patterns).
__device__ __forceinline__ SplitFragment<4> split_a_fragment(uint32_t hi, uint32_t lo,
                                                             uint32_t lane_offset) {
  constexpr uint32_t kRow8 = 8 * F32BackwardTiling::kStride * 4;
  SplitFragment<4> a;
  const uint32_t at[4] = {lane_offset, lane_offset + kRow8, lane_offset + 16,
                          lane_offset + kRow8 + 16};
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    a.hi[r] = __float_as_uint(ld_shared_f32(hi + at[r]));
    a.lo[r] = __float_as_uint(ld_shared_f32(lo + at[r]));
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

template <class F, int kRows>
__device__ __forceinline__ void load_f32_rows(uint32_t dst, const float* src, int64_t valid_rows,
                                              int tid) {
  constexpr int kChunks = F::kHeadDim / 4;
  static_assert((kRows * kChunks) % F::kThreads == 0, "whole passes");
#pragma unroll
  for (int pass = 0; pass < kRows * kChunks / F::kThreads; ++pass) {
    const int c = tid + pass * F::kThreads;
    const int row = c / kChunks;
    const int chunk = c % kChunks;
    const uint32_t at = dst + static_cast<uint32_t>((row * F::kStride + 4 * chunk) * 4);
    if (row < valid_rows) {
      cp_async_16(at, src + static_cast<int64_t>(row) * F::kHeadDim + 4 * chunk);
    } else {
      st_shared_zero_16(at);
    }
  }
}

template <int kArgs>
__global__ void __launch_bounds__(F32BackwardTiling::kThreads, 2)
    flash_backward_f32_kernel(const float* __restrict__ q,         // (B, L, 64)
                              const float* __restrict__ k,         // (B / kv_group, S, 64)
                              const float* __restrict__ v,         // (B / kv_group, S, 64)
                              const float* __restrict__ dout,      // (B, L, 64)
                              const float* __restrict__ lse_log2,  // (B, Lp)
                              const float* __restrict__ delta,     // (B, Lp)
                              float* __restrict__ dq_accum,        // (B, Lp, 64)
                              float* __restrict__ dk,              // (B, S, 64)
                              float* __restrict__ dv,              // (B, S, 64)
                              const AttentionProblem p, const int64_t rows_padded,
                              const bool longest_first) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using F = F32BackwardTiling;
  constexpr int D = F::kHeadDim;
  constexpr int kQTiles = F::kQTiles, kDTiles = F::kDTiles;
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ uint4 flash_f32_backward_smem[];
  float* const smem = reinterpret_cast<float*>(flash_f32_backward_smem);
  const uint32_t k_hi = smem_addr(smem);
  const uint32_t k_lo = k_hi + F::kKVFloats * 4;
  const uint32_t v_hi = k_lo + F::kKVFloats * 4;
  const uint32_t v_lo = v_hi + F::kKVFloats * 4;
  const uint32_t q_tiles = v_lo + F::kKVFloats * 4;          // 2 buffers
  const uint32_t do_tiles = q_tiles + 2 * F::kQFloats * 4;   // 2 buffers
  const uint32_t ds_tile = do_tiles + 2 * F::kQFloats * 4;   // [kBlockN][kDsStride]
  const uint32_t stats = ds_tile + F::kBlockN * F::kDsStride * 4;  // 2 x (lse, delta)
  float* const ds_floats = smem + (ds_tile - k_hi) / 4;
  const float* const stat_floats = smem + (stats - k_hi) / 4;

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int key0 = 16 * warp;  // the warp's first key in the CTA's block
  // Lane offsets (bytes): A of K and V (rows key0 + g, column t), B of Q^T and dO^T (row g,
  // column t), B of dO and Q in dV, dK (rows 2t, column g), A of dS in dQ and B of K there.
  const uint32_t kv_a_lane = static_cast<uint32_t>(((key0 + g) * F::kStride + t) * 4);
  const uint32_t qt_lane = static_cast<uint32_t>((g * F::kStride + t) * 4);
  const uint32_t qdk_lane = static_cast<uint32_t>((2 * t * F::kStride + g) * 4);
  const int dq_mtile = warp & 1;     // the warp's 16 rows of dQ
  const int dq_half = warp >> 1;     // and its half of D
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
    const float* const mask_b = has_mask ? mask_rows(p, b) : nullptr;
    const int64_t first_block = p.causal ? n0 / F::kBlockM : 0;
    const int64_t n_blocks = ceil_div(L, F::kBlockM) - first_block;

    // K and V of the block (group 0), then the first query block (group 1).
    load_f32_rows<F, F::kBlockN>(k_hi, k + kv_b + n0 * D, S - n0, tid);
    load_f32_rows<F, F::kBlockN>(v_hi, v + kv_b + n0 * D, S - n0, tid);
    cp_async_commit();
    auto load_query_block = [&](int64_t block, int buffer) {
      const int64_t m0 = (first_block + block) * F::kBlockM;
      load_f32_rows<F, F::kBlockM>(q_tiles + buffer * F::kQFloats * 4, q + (b * L + m0) * D,
                                   L - m0, tid);
      load_f32_rows<F, F::kBlockM>(do_tiles + buffer * F::kQFloats * 4, dout + (b * L + m0) * D,
                                   L - m0, tid);
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

    // K and V split into hi and lo once: each thread its own copies' floats, in place (hi) and
    // into the lo tiles.
    cp_async_wait<1>();
    {
      constexpr int kChunks = D / 4;
#pragma unroll
      for (int pass = 0; pass < F::kBlockN * kChunks / F::kThreads; ++pass) {
        const int c = tid + pass * F::kThreads;
        const int offset = (c / kChunks) * F::kStride + 4 * (c % kChunks);
#pragma unroll
        for (int tensor = 0; tensor < 2; ++tensor) {
          float* const hi = smem + tensor * 2 * F::kKVFloats + offset;
          float* const lo = hi + F::kKVFloats;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            uint32_t h, l;
            split_tf32(hi[e], h, l);
            hi[e] = __uint_as_float(h);
            lo[e] = __uint_as_float(l);
          }
        }
      }
    }

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

      // S^T = K Q^T and dP^T = V dO^T: [j] is keys key0 .. + 15 x queries m0 + 8 j .. + 7.
      float st[kQTiles][4] = {};
      float dpt[kQTiles][4] = {};
#pragma unroll
      for (int ks = 0; ks < F::kKSteps; ++ks) {
        const uint32_t column = static_cast<uint32_t>(ks * 8 * 4);
        const SplitFragment<4> ka = split_a_fragment(k_hi, k_lo, kv_a_lane + column);
        const SplitFragment<4> va = split_a_fragment(v_hi, v_lo, kv_a_lane + column);
#pragma unroll
        for (int j = 0; j < kQTiles; ++j) {
          const uint32_t row = static_cast<uint32_t>(j * 8 * F::kStride * 4) + column + qt_lane;
          mma_3xtf32(st[j], ka, split_b_fragment(q_tile + row, 16));
          mma_3xtf32(dpt[j], va, split_b_fragment(do_tile + row, 16));
        }
      }

      // P^T and dS^T in place: element (key key0 + g + 8 (e >> 1), query 8 j + 2 t + (e & 1)).
      const bool diagonal = p.causal && m0 < n0 + F::kBlockN - 1;
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
            exponent = fmaf(mask_entry(p, mask_b, m0 + query, n0 + key), kLog2e, exponent);
          }
          float prob = exp2_approx(fmaf(st[j][e], scale_log2, exponent));
          if (diagonal && n0 + key > m0 + query) {
            prob = 0.f;
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
      {
        float part[kDTiles][4] = {};
#pragma unroll
        for (int kk = 0; kk < kQTiles; ++kk) {
          SplitFragment<4> pa;
          split_tf32(st[kk][0], pa.hi[0], pa.lo[0]);
          split_tf32(st[kk][2], pa.hi[1], pa.lo[1]);
          split_tf32(st[kk][1], pa.hi[2], pa.lo[2]);
          split_tf32(st[kk][3], pa.hi[3], pa.lo[3]);
#pragma unroll
          for (int dj = 0; dj < kDTiles; ++dj) {
            const uint32_t at = do_tile + qdk_lane + (kk * 8 * F::kStride + dj * 8) * 4;
            mma_3xtf32(part[dj], pa, split_b_fragment(at, F::kStride * 4));
          }
        }
#pragma unroll
        for (int dj = 0; dj < kDTiles; ++dj) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            dv_acc[dj][e] += part[dj][e];
            part[dj][e] = 0.f;
          }
        }
#pragma unroll
        for (int kk = 0; kk < kQTiles; ++kk) {
          SplitFragment<4> dsa;
          split_tf32(dpt[kk][0], dsa.hi[0], dsa.lo[0]);
          split_tf32(dpt[kk][2], dsa.hi[1], dsa.lo[1]);
          split_tf32(dpt[kk][1], dsa.hi[2], dsa.lo[2]);
          split_tf32(dpt[kk][3], dsa.hi[3], dsa.lo[3]);
#pragma unroll
          for (int dj = 0; dj < kDTiles; ++dj) {
            const uint32_t at = q_tile + qdk_lane + (kk * 8 * F::kStride + dj * 8) * 4;
            mma_3xtf32(part[dj], dsa, split_b_fragment(at, F::kStride * 4));
          }
        }
#pragma unroll
        for (int dj = 0; dj < kDTiles; ++dj) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            dk_acc[dj][e] += part[dj][e];
          }
        }
      }

      // dS^T to shared memory (row: key, column: query), then dQ += dS K for the warp's m-tile
      // and half of D over the CTA's 64 keys.
#pragma unroll
      for (int j = 0; j < kQTiles; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          *reinterpret_cast<float2*>(ds_floats + (key0 + g + 8 * h) * F::kDsStride + 8 * j +
                                     2 * t) = make_float2(dpt[j][2 * h], dpt[j][2 * h + 1]);
        }
      }
      __syncthreads();
      float dq_part[kDTiles / 2][4] = {};
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
        for (int dj = 0; dj < kDTiles / 2; ++dj) {
          const uint32_t kb = qdk_lane +
                              static_cast<uint32_t>((ks * 8 * F::kStride +
                                                     (dq_half * kDTiles / 2 + dj) * 8) * 4);
          SplitFragment<2> kf;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            kf.hi[r] = __float_as_uint(ld_shared_f32(k_hi + kb + r * F::kStride * 4));
            kf.lo[r] = __float_as_uint(ld_shared_f32(k_lo + kb + r * F::kStride * 4));
          }
          mma_3xtf32(dq_part[dj], dsa, kf);
        }
      }
      float* const dq_rows = dq_accum + (b * rows_padded + m0 + 16 * dq_mtile + g) * D +
                             (dq_half * kDTiles / 2) * 8 + 2 * t;
#pragma unroll
      for (int dj = 0; dj < kDTiles / 2; ++dj) {
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
        float* const dk_row = dk + (b * S + key) * D + 2 * t;
        float* const dv_row = dv + (b * S + key) * D + 2 * t;
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

// Whether the float32 backward takes the problem (head dim 64, Ev = E).
inline bool f32_backward_takes(const AttentionProblem& p) {
  return takes_tensor_cores(p) && p.head_dim == F32BackwardTiling::kHeadDim;
}

// The three launches on `stream`, or false having launched nothing. After a failed launch it
// stops, leaving the error for the caller's launch check.
inline bool backward_f32(const float* dout, const float* q, const float* k, const float* v,
                         const float* out, const float* lse, float* lse_log2, float* delta,
                         float* dq_accum, float* dq, float* dk, float* dv,
                         const AttentionProblem& p, cudaStream_t stream) {
  using F = F32BackwardTiling;
  auto* kernel = for_score_args(p, flash_backward_f32_kernel<kNoArgs>,
                                flash_backward_f32_kernel<kMaskOnly>,
                                flash_backward_f32_kernel<kMaskAndDropout>);
  if (!f32_backward_takes(p) || !has_tensor_core_image(kernel)) {
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
  const int64_t rows = f32_backward_rows(p.len_q);
  constexpr int kRowsPerBlock = kF32RowThreads / 32;
  flash_backward_f32_prologue_kernel<<<kernels::detail::grid_for(
                                           ceil_div(p.batch * rows, kRowsPerBlock)),
                                       kF32RowThreads, 0, stream>>>(
      dout, out, lse, lse_log2, delta, dq_accum, p.batch, p.len_q, rows);
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
  constexpr int kChunks = F::kHeadDim / 4;
  flash_backward_f32_dq_kernel<<<kernels::detail::grid_for(
                                     ceil_div(p.batch * p.len_q * kChunks, kF32RowThreads)),
                                 kF32RowThreads, 0, stream>>>(dq_accum, dq, p.batch, p.len_q,
                                                              rows, p.scale);
  return true;
}

}  // namespace detail
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_BACKWARD_F32_CUH_
