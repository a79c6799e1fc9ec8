// CUDA kernels of the fixed_attention operators and their host-side launchers; the torch glue
// (checks, device guard, stream, dispatch, launch check) is in ../attention_cuda.cu.
//
// No torch includes, so CI compile-checks this header on a machine without a GPU:
//   nvcc -arch=sm_90 -x cu -c fixed/csrc/kernels/attention_kernels.cuh -o /dev/null
// The launchers at the bottom are non-template functions (one overload per dtype) that switch
// over every head-dim bucket, so that command instantiates every kernel variant.
//
// The function (the same as attention_cpu.cpp), per batch item b, query row i and key j:
//   s_ij = scale q_i.k_j + mask_ij     (-inf where j is not visible: j > i when causal, top-left
//                                       aligned as SDPA's is_causal; mask absent: 0)
//   lse_i = log sum_j exp(s_ij)        P_ij = exp(s_ij - lse_i)
//   Z_ij = keep(b, i, j) / (1 - p)     (dropout, philox.h; without dropout Z = 1)
//   o_i = sum_j P_ij Z_ij v_j          (lse is the undropped softmax's)
// and the backward, P recomputed from lse and Z from the seed, neither stored:
//   D_i  = dO_i.o_i    dP_ij = dO_i.v_j    dS_ij = P_ij (Z_ij dP_ij - D_i)
//   dQ_i = scale sum_j dS_ij k_j    dK_j = scale sum_i dS_ij q_i    dV_j = sum_i P_ij Z_ij dO_i
// q, k have head dim E, v, o head dim Ev. Under GQA (kv_group > 1) the kv_group consecutive
// batch items b = c kv_group + g (query heads sharing a K/V head) read K/V item c, and dK, dV of
// item c sum over them. A row that sees no key (S == 0, everything masked) gets o = 0, lse = -inf
// and zero gradients: the softmax never subtracts -inf from -inf.
//
// Tiling (FlashAttention-2's loop order, fp32 math on CUDA cores; correctness first):
// - Head dims go to a bucket kHeadDim in {32, 64, 128, 256} (max(E, Ev) <= kHeadDim). In a warp,
//   lane owns the columns lane, lane + 32, ...: kCols = kHeadDim / 32 registers per row vector;
//   columns >= E (q, k) or >= Ev (v, o, dO) are zero in registers and in shared memory, so they
//   add nothing.
// - A block is kWarps = 4 warps (128 threads); a warp owns kRows = 8, 8, 4, 2 rows (buckets
//   32, 64, 128, 256), so a row vector array (kRows x kCols) is 8 to 16 registers per lane.
// - Shared-memory tiles hold 32 rows, one per lane, in fp32; a tile read one row per lane has
//   row stride kHeadDim + 1 (no bank conflicts), one read one column per lane stride kHeadDim.
// - forward: a block owns 4 * kRows query rows of one batch item: q and the output
//   accumulators in registers. Loops over tiles of 32 keys (K [32][D+1], V [32][D] in shared
//   memory): scores with lane = key (q broadcast by shuffles), online softmax with warp
//   reductions, then O += P V with lanes on columns. Writes O and lse.
// - backward delta: one warp per query row, D_i into a float32 (B, L) workspace.
// - backward dK/dV: a block owns 4 * kRows keys of one K/V item (k, v, dK, dV in registers).
//   Loops over the kv_group batch items that read it, and in each over tiles of 32 query rows
//   (Q, dO [32][D+1]): lane = query row for P and dS, lanes on columns for the sums.
// - backward dQ: a block owns 4 * kRows query rows (q, dO, dQ in registers). Loops over tiles
//   of 32 keys (K, V [32][D+1]) as the forward does.
// Every output element is written once by one thread: deterministic, no atomics.
// Each kernel has two instantiations, picked by the launcher: one for the plain problem
// (is_plain: Ev = E, no GQA, mask or dropout, all compile-time constants there), as fast as
// before those existed, and one for any problem.
// Causal: key tiles after a block's last query row (forward, dQ) and query tiles before a
// block's first key (dK/dV) are skipped; the rest is masked element by element.
// Tails: every global load and store is guarded (rows >= L or S, columns >= E or Ev, mask
// entries of such rows); out-of-range elements read as zero, and every lane keeps running
// (shuffles and barriers need them all).
// Sizes: int64_t for every length and global offset. Blocks loop over (batch item, tile) work
// items on gridDim.x only, so no grid limit applies. Loads are scalar: no alignment assumed.
// Shared memory: dynamic, at most 2 * 32 * 257 * 4 = 65,792 bytes (the 256 bucket); above the
// default 48 KB the launcher raises the kernel's limit (cudaFuncSetAttribute, checked).
#ifndef FIXED_ATTENTION_KERNELS_CUH_
#define FIXED_ATTENTION_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "philox.h"

namespace fixed_attention {
namespace kernels {

// The problem, flattened: leading dims multiplied into batch; q, k, v, o contiguous. The fields
// after `causal` default to the plain case (no GQA, no mask, no dropout, Ev = E).
struct AttentionProblem {
  int64_t batch;     // B: query's leading dims, flattened
  int64_t len_q;     // L
  int64_t len_kv;    // S
  int64_t head_dim;  // E (query, key), 1..256
  float scale;
  bool causal;
  int64_t head_dim_v = 0;  // Ev (value, output), 1..256; 0 means head_dim
  int64_t heads = 1;       // Hq: query's dim -3 (1 when query is 2-D)
  int64_t kv_group = 1;    // Hq / Hkv under GQA, else 1. Batch item b reads K/V item
                           //   (b / heads) * (heads / kv_group) + (b % heads) / kv_group
  const float* mask = nullptr;  // additive float32 mask (bool already turned into 0 / -inf) or
                                // null; element (b, i, j) at mask[(b / heads) * mask_stride_outer
                                // + (b % heads) * mask_stride_head + i * mask_stride_row
                                // + j * mask_stride_col] (strides may be 0: broadcast)
  int64_t mask_stride_outer = 0, mask_stride_head = 0, mask_stride_row = 0, mask_stride_col = 0;
  float dropout_p = 0.f;  // 0: none
  uint64_t dropout_seed = 0;
};

// Ev: head_dim_v, or E where it is 0.
__host__ __device__ __forceinline__ int64_t value_dim(const AttentionProblem& p) {
  return p.head_dim_v == 0 ? p.head_dim : p.head_dim_v;
}

// A kept probability's factor 1 / (1 - p); 0 when p == 1, where nothing is kept (not inf: a
// dropped sum of 0 times inf would be NaN).
__host__ __device__ __forceinline__ float dropout_scale(float p) {
  return p < 1.f ? 1.f / (1.f - p) : 0.f;
}

// The plain problem: Ev = E, one K/V head per query head, no mask, no dropout. The tensor-core
// kernels take only this one. Each generic kernel has an instantiation for it (kPlain) that
// has those as constants, so that it keeps the registers, hence the occupancy and speed, of a
// kernel without the rest (the general instantiation takes up to 60 registers per thread
// more: a block less per SM).
__host__ __device__ __forceinline__ bool is_plain(const AttentionProblem& p) {
  return value_dim(p) == p.head_dim && p.kv_group == 1 && p.mask == nullptr &&
         !(p.dropout_p > 0.f);
}

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
// In __launch_bounds__: lets ptxas use up to 255 registers per thread. Without it, its
// heuristic capped some variants at 80 registers and spilled.
constexpr int kMinBlocksPerSm = 2;
constexpr int kTile = kWarpSize;  // rows per shared-memory tile: one per lane
constexpr int kMaxHeadDim = 256;
constexpr std::size_t kDefaultSharedMemory = 48 * 1024;

template <int kHeadDim>
struct Tiling {
  static_assert(kHeadDim % kWarpSize == 0 && kHeadDim >= 32 && kHeadDim <= kMaxHeadDim,
                "head-dim buckets are 32, 64, 128, 256");
  static constexpr int kCols = kHeadDim / kWarpSize;                 // columns per lane
  static constexpr int kRows = kHeadDim <= 64 ? 8 : 512 / kHeadDim;  // rows (keys) per warp
  static constexpr int kBlockRows = kWarps * kRows;                  // rows per block
  static constexpr int kPadded = kHeadDim + 1;  // row stride of one-row-per-lane tiles
  // forward: K [32][kPadded] + V [32][kHeadDim]; backward: two [32][kPadded] tiles.
  static constexpr std::size_t kForwardSmem = sizeof(float) * kTile * (kPadded + kHeadDim);
  static constexpr std::size_t kBackwardSmem = sizeof(float) * kTile * 2 * kPadded;
  static_assert(kForwardSmem <= 227 * 1024 && kBackwardSmem <= 227 * 1024,
                "over sm_90's 227 KB of shared memory per block");
};

// ------------------------------------------------------------------------ device helpers

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ void store(float* dst, float x) { *dst = x; }
__device__ __forceinline__ void store(__half* dst, float x) { *dst = __float2half_rn(x); }
__device__ __forceinline__ void store(__nv_bfloat16* dst, float x) {
  *dst = __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  }
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(kFullMask, x, offset);
  }
  return x;
}

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// std::min is host-only without --expt-relaxed-constexpr, which the CI command does not pass.
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Row `row` of a (len, head_dim) matrix into this lane's columns; zero past len or head_dim.
template <int kCols, typename scalar_t>
__device__ __forceinline__ void load_row(float (&dst)[kCols], const scalar_t* matrix,
                                         int64_t row, int64_t len, int64_t head_dim,
                                         int lane) {
#pragma unroll
  for (int t = 0; t < kCols; ++t) {
    const int64_t col = t * kWarpSize + lane;
    dst[t] = (row < len && col < head_dim) ? to_float(matrix[row * head_dim + col]) : 0.f;
  }
}

// Rows [row0, row0 + 32) of a (len, head_dim) matrix into a [32][kStride] fp32 tile, zero past
// len and head_dim. All threads of the block take part; the caller synchronises.
template <int kHeadDim, int kStride, typename scalar_t>
__device__ __forceinline__ void load_tile(float* tile, const scalar_t* matrix, int64_t row0,
                                          int64_t len, int64_t head_dim) {
  static_assert(kTile * kHeadDim % kThreads == 0, "every thread loads the same count");
  constexpr int kPerThread = kTile * kHeadDim / kThreads;
  // Offsets within the tile in 32 bits: ptxas hoists each element's offset out of a kernel's
  // tile loop, one set per head dim (two when Ev != E), and 32-bit ones take half the registers.
  const scalar_t* tile_rows = matrix + row0 * head_dim;
  const int rows = static_cast<int>(min64(len - row0, kTile));
  const int cols = static_cast<int>(head_dim);
#pragma unroll 8
  for (int it = 0; it < kPerThread; ++it) {
    const int idx = it * kThreads + static_cast<int>(threadIdx.x);
    const int r = idx / kHeadDim;
    const int col = idx % kHeadDim;
    tile[r * kStride + col] =
        (r < rows && col < cols) ? to_float(tile_rows[r * cols + col]) : 0.f;
  }
}

// The key index that a block's query rows [block_row0, block_row0 + rows) stop seeing at.
__device__ __forceinline__ int64_t key_end(const AttentionProblem& p, int64_t block_row0,
                                           int rows) {
  if (!p.causal) {
    return p.len_kv;
  }
  const int64_t last_row = min64(block_row0 + rows, p.len_q) - 1;
  return min64(p.len_kv, last_row + 1);
}

// The K/V item batch item b reads: AttentionProblem's formula, which is b / kv_group because
// kv_group divides heads (the query heads of one K/V head are consecutive batch items).
template <bool kPlain>
__device__ __forceinline__ int64_t kv_item(const AttentionProblem& p, int64_t b) {
  return kPlain ? b : b / p.kv_group;
}

// Batch item b's (L, S) slice of the additive mask; null without a mask.
template <bool kPlain>
__device__ __forceinline__ const float* mask_slice(const AttentionProblem& p, int64_t b) {
  if (kPlain || p.mask == nullptr) {
    return nullptr;
  }
  return p.mask + (b / p.heads) * p.mask_stride_outer + (b % p.heads) * p.mask_stride_head;
}

// s_ij from q_i.k_j: scaled, plus the mask's entry; -inf for a key the row does not see, and
// for rows and keys past the end (whose mask entries are never read).
__device__ __forceinline__ float attention_score(const AttentionProblem& p, const float* mask_b,
                                                 float dot, int64_t row, int64_t key) {
  if (row >= p.len_q || key >= p.len_kv || (p.causal && key > row)) {
    return -INFINITY;
  }
  const float scaled = dot * p.scale;
  return mask_b == nullptr ? scaled
                           : scaled + mask_b[row * p.mask_stride_row + key * p.mask_stride_col];
}

// P_ij recomputed from the forward's lse. A row that saw no key has lse -inf and every score
// -inf: P = 0, not exp(-inf + inf) = NaN.
__device__ __forceinline__ float probability(float score, float row_lse) {
  return row_lse == -INFINITY ? 0.f : expf(score - row_lse);
}

// Whether dropout zeroes P_ij of batch item b; never without dropout.
template <bool kPlain>
__device__ __forceinline__ bool dropped(const AttentionProblem& p, int64_t b, int64_t row,
                                        int64_t key) {
  return !kPlain && p.dropout_p > 0.f &&
         !dropout::keep(p.dropout_seed, p.dropout_p, b, row, key, p.len_q, p.len_kv);
}

// ------------------------------------------------------------------------------ forward

template <typename scalar_t, int kHeadDim, bool kPlain>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    attention_forward_kernel(const scalar_t* __restrict__ q,  // (B, L, E)
                             const scalar_t* __restrict__ k,  // (B / kv_group, S, E)
                             const scalar_t* __restrict__ v,  // (B / kv_group, S, Ev)
                             scalar_t* __restrict__ out,      // (B, L, Ev)
                             float* __restrict__ lse,         // (B, L)
                             const AttentionProblem p) {
  using T = Tiling<kHeadDim>;
  constexpr int kRows = T::kRows, kCols = T::kCols;
  extern __shared__ float shared_tiles[];
  float* k_tile = shared_tiles;                       // [32][kPadded]: lane = key
  float* v_tile = shared_tiles + kTile * T::kPadded;  // [32][kHeadDim]: lanes on columns

  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t L = p.len_q, S = p.len_kv, E = p.head_dim, Ev = kPlain ? E : value_dim(p);
  const int64_t row_blocks = ceil_div(L, T::kBlockRows);

  for (int64_t item = blockIdx.x; item < p.batch * row_blocks; item += gridDim.x) {
    const int64_t b = item / row_blocks;
    const int64_t block_row0 = (item % row_blocks) * T::kBlockRows;
    const int64_t row0 = block_row0 + warp * kRows;
    const scalar_t* q_b = q + b * L * E;
    const scalar_t* k_b = k + kv_item<kPlain>(p, b) * S * E;
    const scalar_t* v_b = v + kv_item<kPlain>(p, b) * S * Ev;
    const float* mask_b = mask_slice<kPlain>(p, b);

    float q_reg[kRows][kCols];
    float o_acc[kRows][kCols];
    float row_max[kRows];
    float row_sum[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      load_row(q_reg[r], q_b, row0 + r, L, E, lane);
#pragma unroll
      for (int t = 0; t < kCols; ++t) {
        o_acc[r][t] = 0.f;
      }
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }

    const int64_t keys = key_end(p, block_row0, T::kBlockRows);
    for (int64_t key0 = 0; key0 < keys; key0 += kTile) {
      __syncthreads();  // every warp is done with the previous tiles
      load_tile<kHeadDim, T::kPadded>(k_tile, k_b, key0, S, E);
      load_tile<kHeadDim, kHeadDim>(v_tile, v_b, key0, S, Ev);
      __syncthreads();

      // Scores: this lane's key against each of the warp's rows.
      float s[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        s[r] = 0.f;
      }
#pragma unroll
      for (int t = 0; t < kCols; ++t) {
#pragma unroll 4
        for (int src = 0; src < kWarpSize; ++src) {
          const float kx = k_tile[lane * T::kPadded + t * kWarpSize + src];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            s[r] = fmaf(__shfl_sync(kFullMask, q_reg[r][t], src), kx, s[r]);
          }
        }
      }

      // Online softmax: s[r] becomes this lane's probability, unnormalised, and then 0 if
      // dropout drops it (row_sum, hence lse, is the undropped softmax's).
      const int64_t key = key0 + lane;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = row0 + r;
        const float score = attention_score(p, mask_b, s[r], row, key);
        const float new_max = fmaxf(row_max[r], warp_max(score));
        // Nothing visible yet: subtract 0, so that exp(-inf - 0) = 0 instead of NaN.
        const float shift = new_max == -INFINITY ? 0.f : new_max;
        const float prob = expf(score - shift);
        const float rescale = expf(row_max[r] - shift);  // 0 on the first visible tile
        row_sum[r] = row_sum[r] * rescale + warp_sum(prob);
        row_max[r] = new_max;
#pragma unroll
        for (int t = 0; t < kCols; ++t) {
          o_acc[r][t] *= rescale;
        }
        s[r] = dropped<kPlain>(p, b, row, key) ? 0.f : prob;
      }

      // O += P V: key j's probability broadcast from lane j, lanes on columns.
#pragma unroll 4
      for (int j = 0; j < kTile; ++j) {
        float pj[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          pj[r] = __shfl_sync(kFullMask, s[r], j);
        }
#pragma unroll
        for (int t = 0; t < kCols; ++t) {
          const float vx = v_tile[j * kHeadDim + t * kWarpSize + lane];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            o_acc[r][t] = fmaf(pj[r], vx, o_acc[r][t]);
          }
        }
      }
    }

#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = row0 + r;
      if (row >= L) {
        continue;
      }
      // row_sum is 0 only when the row saw no key (S == 0, or all masked): zeros and lse -inf,
      // as SDPA. Kept probabilities are scaled by 1 / (1 - p) here, once per row.
      const float keep_scale = kPlain ? 1.f : dropout_scale(p.dropout_p);
      const float inv_sum = row_sum[r] > 0.f ? keep_scale / row_sum[r] : 0.f;
#pragma unroll
      for (int t = 0; t < kCols; ++t) {
        const int64_t col = t * kWarpSize + lane;
        if (col < Ev) {
          store(out + (b * L + row) * Ev + col, o_acc[r][t] * inv_sum);
        }
      }
      if (lane == 0) {
        lse[b * L + row] = row_sum[r] > 0.f ? row_max[r] + logf(row_sum[r]) : -INFINITY;
      }
    }
  }
}

// ------------------------------------------------------------------------------ backward

// D_i = dO_i . O_i, one warp per row of the flattened (B * L, Ev) matrices. O is the output
// the forward returned (dropped), which is what makes dS = P (Z dP - D) the softmax's gradient.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    attention_backward_delta_kernel(const scalar_t* __restrict__ dout,  // (B * L, Ev)
                                    const scalar_t* __restrict__ out,   // (B * L, Ev)
                                    float* __restrict__ delta,          // (B * L)
                                    const int64_t rows, const int64_t head_dim) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t row = first; row < rows; row += stride) {  // the same row for the whole warp
    float acc = 0.f;
    for (int64_t col = lane; col < head_dim; col += kWarpSize) {
      acc = fmaf(to_float(dout[row * head_dim + col]), to_float(out[row * head_dim + col]), acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) {
      delta[row] = acc;
    }
  }
}

template <typename scalar_t, int kHeadDim, bool kPlain>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    attention_backward_dkdv_kernel(const scalar_t* __restrict__ dout,  // (B, L, Ev)
                                   const scalar_t* __restrict__ q,     // (B, L, E)
                                   const scalar_t* __restrict__ k,     // (B / kv_group, S, E)
                                   const scalar_t* __restrict__ v,     // (B / kv_group, S, Ev)
                                   const float* __restrict__ lse,      // (B, L)
                                   const float* __restrict__ delta,    // (B, L)
                                   scalar_t* __restrict__ dk,          // (B / kv_group, S, E)
                                   scalar_t* __restrict__ dv,          // (B / kv_group, S, Ev)
                                   const AttentionProblem p) {
  using T = Tiling<kHeadDim>;
  constexpr int kRows = T::kRows, kCols = T::kCols;
  extern __shared__ float shared_tiles[];
  float* q_tile = shared_tiles;                        // [32][kPadded]
  float* do_tile = shared_tiles + kTile * T::kPadded;  // [32][kPadded]

  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t L = p.len_q, S = p.len_kv, E = p.head_dim, Ev = kPlain ? E : value_dim(p);
  const int64_t key_blocks = ceil_div(S, T::kBlockRows);
  const float keep_scale = kPlain ? 1.f : dropout_scale(p.dropout_p);  // Z of a kept one
  const int64_t kv_group = kPlain ? 1 : p.kv_group;

  for (int64_t item = blockIdx.x; item < (p.batch / kv_group) * key_blocks; item += gridDim.x) {
    const int64_t kv = item / key_blocks;  // the K/V item
    const int64_t block_key0 = (item % key_blocks) * T::kBlockRows;
    const int64_t key0 = block_key0 + warp * kRows;

    float k_reg[kRows][kCols];
    float v_reg[kRows][kCols];
    float dk_acc[kRows][kCols];
    float dv_acc[kRows][kCols];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      load_row(k_reg[r], k + kv * S * E, key0 + r, S, E, lane);
      load_row(v_reg[r], v + kv * S * Ev, key0 + r, S, Ev, lane);
#pragma unroll
      for (int t = 0; t < kCols; ++t) {
        dk_acc[r][t] = 0.f;
        dv_acc[r][t] = 0.f;
      }
    }

    // Under causal, query rows before the block's first key see none of its keys.
    const int64_t rows_begin = p.causal ? (block_key0 / kTile) * kTile : 0;
    // The batch items that read this K/V item (kv_item(b) == kv): each dK and dV element sums
    // over all of them in one thread, in a fixed order.
    for (int64_t b = kv * kv_group; b < (kv + 1) * kv_group; ++b) {
      const scalar_t* q_b = q + b * L * E;
      const scalar_t* do_b = dout + b * L * Ev;
      const float* lse_b = lse + b * L;
      const float* delta_b = delta + b * L;
      const float* mask_b = mask_slice<kPlain>(p, b);
      for (int64_t row_tile = rows_begin; row_tile < L; row_tile += kTile) {
        __syncthreads();  // every warp is done with the previous tiles
        load_tile<kHeadDim, T::kPadded>(q_tile, q_b, row_tile, L, E);
        load_tile<kHeadDim, T::kPadded>(do_tile, do_b, row_tile, L, Ev);
        const int64_t row = row_tile + lane;  // this lane's query row
        const bool row_valid = row < L;
        const float row_lse = row_valid ? lse_b[row] : 0.f;
        const float row_delta = row_valid ? delta_b[row] : 0.f;
        __syncthreads();

        // s = q_row . k_key and dp = dO_row . v_key for each of the warp's keys.
        float s[kRows];
        float dp[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          s[r] = 0.f;
          dp[r] = 0.f;
        }
#pragma unroll
        for (int t = 0; t < kCols; ++t) {
#pragma unroll 4
          for (int src = 0; src < kWarpSize; ++src) {
            const int col = t * kWarpSize + src;
            const float qx = q_tile[lane * T::kPadded + col];
            const float dox = do_tile[lane * T::kPadded + col];
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
              s[r] = fmaf(qx, __shfl_sync(kFullMask, k_reg[r][t], src), s[r]);
              dp[r] = fmaf(dox, __shfl_sync(kFullMask, v_reg[r][t], src), dp[r]);
            }
          }
        }
        // s becomes P Z (dV's weight), dp becomes dS.
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int64_t key = key0 + r;
          const float prob =
              probability(attention_score(p, mask_b, s[r], row, key), row_lse);
          const float z = dropped<kPlain>(p, b, row, key) ? 0.f : keep_scale;
          s[r] = prob * z;
          dp[r] = prob * (z * dp[r] - row_delta);
        }

        // dV += (P Z)^T dO, dK += dS^T Q: row i's values broadcast from lane i, lanes on
        // columns.
#pragma unroll 4
        for (int i = 0; i < kTile; ++i) {
          float p_i[kRows];
          float ds_i[kRows];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            p_i[r] = __shfl_sync(kFullMask, s[r], i);
            ds_i[r] = __shfl_sync(kFullMask, dp[r], i);
          }
#pragma unroll
          for (int t = 0; t < kCols; ++t) {
            const int col = t * kWarpSize + lane;
            const float dox = do_tile[i * T::kPadded + col];
            const float qx = q_tile[i * T::kPadded + col];
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
              dv_acc[r][t] = fmaf(p_i[r], dox, dv_acc[r][t]);
              dk_acc[r][t] = fmaf(ds_i[r], qx, dk_acc[r][t]);
            }
          }
        }
      }
    }

#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t key = key0 + r;
      if (key >= S) {
        continue;
      }
#pragma unroll
      for (int t = 0; t < kCols; ++t) {
        const int64_t col = t * kWarpSize + lane;
        if (col < E) {
          store(dk + (kv * S + key) * E + col, dk_acc[r][t] * p.scale);
        }
        if (col < Ev) {
          store(dv + (kv * S + key) * Ev + col, dv_acc[r][t]);
        }
      }
    }
  }
}

template <typename scalar_t, int kHeadDim, bool kPlain>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    attention_backward_dq_kernel(const scalar_t* __restrict__ dout,  // (B, L, Ev)
                                 const scalar_t* __restrict__ q,     // (B, L, E)
                                 const scalar_t* __restrict__ k,     // (B / kv_group, S, E)
                                 const scalar_t* __restrict__ v,     // (B / kv_group, S, Ev)
                                 const float* __restrict__ lse,      // (B, L)
                                 const float* __restrict__ delta,    // (B, L)
                                 scalar_t* __restrict__ dq,          // (B, L, E)
                                 const AttentionProblem p) {
  using T = Tiling<kHeadDim>;
  constexpr int kRows = T::kRows, kCols = T::kCols;
  extern __shared__ float shared_tiles[];
  float* k_tile = shared_tiles;                       // [32][kPadded]
  float* v_tile = shared_tiles + kTile * T::kPadded;  // [32][kPadded]

  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t L = p.len_q, S = p.len_kv, E = p.head_dim, Ev = kPlain ? E : value_dim(p);
  const int64_t row_blocks = ceil_div(L, T::kBlockRows);
  const float keep_scale = kPlain ? 1.f : dropout_scale(p.dropout_p);  // Z of a kept one

  for (int64_t item = blockIdx.x; item < p.batch * row_blocks; item += gridDim.x) {
    const int64_t b = item / row_blocks;
    const int64_t block_row0 = (item % row_blocks) * T::kBlockRows;
    const int64_t row0 = block_row0 + warp * kRows;
    const scalar_t* k_b = k + kv_item<kPlain>(p, b) * S * E;
    const scalar_t* v_b = v + kv_item<kPlain>(p, b) * S * Ev;
    const float* mask_b = mask_slice<kPlain>(p, b);

    float q_reg[kRows][kCols];
    float do_reg[kRows][kCols];
    float dq_acc[kRows][kCols];
    float row_lse[kRows];
    float row_delta[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = row0 + r;
      load_row(q_reg[r], q + b * L * E, row, L, E, lane);
      load_row(do_reg[r], dout + b * L * Ev, row, L, Ev, lane);
#pragma unroll
      for (int t = 0; t < kCols; ++t) {
        dq_acc[r][t] = 0.f;
      }
      row_lse[r] = row < L ? lse[b * L + row] : 0.f;
      row_delta[r] = row < L ? delta[b * L + row] : 0.f;
    }

    const int64_t keys = key_end(p, block_row0, T::kBlockRows);
    for (int64_t key0 = 0; key0 < keys; key0 += kTile) {
      __syncthreads();  // every warp is done with the previous tiles
      load_tile<kHeadDim, T::kPadded>(k_tile, k_b, key0, S, E);
      load_tile<kHeadDim, T::kPadded>(v_tile, v_b, key0, S, Ev);
      __syncthreads();

      // s = q_row . k_key and dp = dO_row . v_key: this lane's key, each of the warp's rows.
      float s[kRows];
      float dp[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        s[r] = 0.f;
        dp[r] = 0.f;
      }
#pragma unroll
      for (int t = 0; t < kCols; ++t) {
#pragma unroll 4
        for (int src = 0; src < kWarpSize; ++src) {
          const int col = t * kWarpSize + src;
          const float kx = k_tile[lane * T::kPadded + col];
          const float vx = v_tile[lane * T::kPadded + col];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            s[r] = fmaf(__shfl_sync(kFullMask, q_reg[r][t], src), kx, s[r]);
            dp[r] = fmaf(__shfl_sync(kFullMask, do_reg[r][t], src), vx, dp[r]);
          }
        }
      }
      // dp becomes dS.
      const int64_t key = key0 + lane;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = row0 + r;
        const float prob = probability(attention_score(p, mask_b, s[r], row, key), row_lse[r]);
        const float z = dropped<kPlain>(p, b, row, key) ? 0.f : keep_scale;
        dp[r] = prob * (z * dp[r] - row_delta[r]);
      }

      // dQ += dS K: key j's dS broadcast from lane j, lanes on columns.
#pragma unroll 4
      for (int j = 0; j < kTile; ++j) {
        float ds_j[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          ds_j[r] = __shfl_sync(kFullMask, dp[r], j);
        }
#pragma unroll
        for (int t = 0; t < kCols; ++t) {
          const float kx = k_tile[j * T::kPadded + t * kWarpSize + lane];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            dq_acc[r][t] = fmaf(ds_j[r], kx, dq_acc[r][t]);
          }
        }
      }
    }

#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = row0 + r;
      if (row >= L) {
        continue;
      }
#pragma unroll
      for (int t = 0; t < kCols; ++t) {
        const int64_t col = t * kWarpSize + lane;
        if (col < E) {
          store(dq + (b * L + row) * E + col, dq_acc[r][t] * p.scale);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------ host launchers

namespace detail {

// Blocks loop over work items, so any count up to gridDim.x's limit is correct.
inline unsigned grid_for(int64_t work_items) {
  return static_cast<unsigned>(
      std::min<int64_t>(work_items, std::numeric_limits<int32_t>::max()));
}

// The bucket that holds both head dims. Throws for a problem the kernels would index out of
// range (the glue's checks reject these first).
inline int head_dim_bucket(const AttentionProblem& p) {
  const int64_t head_dim = std::max(p.head_dim, value_dim(p));
  if (p.head_dim < 1 || value_dim(p) < 1 || head_dim > kMaxHeadDim) {
    throw std::invalid_argument("fixed_attention kernels: head dims must be 1..256; got " +
                                std::to_string(p.head_dim) + " and " +
                                std::to_string(value_dim(p)));
  }
  if (p.heads < 1 || p.kv_group < 1 || p.heads % p.kv_group != 0 || p.batch % p.heads != 0) {
    throw std::invalid_argument(
        "fixed_attention kernels: heads must divide batch and kv_group divide heads; got batch " +
        std::to_string(p.batch) + ", heads " + std::to_string(p.heads) + ", kv_group " +
        std::to_string(p.kv_group));
  }
  return head_dim <= 32 ? 32 : head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

// Kernels above 48 KB of dynamic shared memory must opt in, on the current device.
template <typename Kernel>
void allow_shared_memory(Kernel* kernel, std::size_t bytes) {
  if (bytes <= kDefaultSharedMemory) {
    return;
  }
  const cudaError_t status = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // reported here; do not leave it for an unrelated later check
    throw std::runtime_error("fixed_attention kernels: cannot raise the shared memory limit to " +
                             std::to_string(bytes) + " bytes: " + cudaGetErrorString(status));
  }
}

template <typename scalar_t, int kHeadDim>
void launch_forward(const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* out,
                    float* lse, const AttentionProblem& p, cudaStream_t stream) {
  using T = Tiling<kHeadDim>;
  const int64_t work = p.batch * ceil_div(p.len_q, T::kBlockRows);
  if (work <= 0) {
    return;  // empty: a zero-sized grid is an invalid launch
  }
  auto* kernel = is_plain(p) ? attention_forward_kernel<scalar_t, kHeadDim, true>
                             : attention_forward_kernel<scalar_t, kHeadDim, false>;
  allow_shared_memory(kernel, T::kForwardSmem);
  kernel<<<grid_for(work), kThreads, T::kForwardSmem, stream>>>(q, k, v, out, lse, p);
}

template <typename scalar_t, int kHeadDim>
void launch_dkdv(const scalar_t* dout, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                 const float* lse, const float* delta, scalar_t* dk, scalar_t* dv,
                 const AttentionProblem& p, cudaStream_t stream) {
  using T = Tiling<kHeadDim>;
  const int64_t work = (p.batch / p.kv_group) * ceil_div(p.len_kv, T::kBlockRows);
  if (work <= 0) {
    return;
  }
  auto* kernel = is_plain(p) ? attention_backward_dkdv_kernel<scalar_t, kHeadDim, true>
                             : attention_backward_dkdv_kernel<scalar_t, kHeadDim, false>;
  allow_shared_memory(kernel, T::kBackwardSmem);
  kernel<<<grid_for(work), kThreads, T::kBackwardSmem, stream>>>(dout, q, k, v, lse, delta, dk,
                                                                  dv, p);
}

template <typename scalar_t, int kHeadDim>
void launch_dq(const scalar_t* dout, const scalar_t* q, const scalar_t* k, const scalar_t* v,
               const float* lse, const float* delta, scalar_t* dq, const AttentionProblem& p,
               cudaStream_t stream) {
  using T = Tiling<kHeadDim>;
  const int64_t work = p.batch * ceil_div(p.len_q, T::kBlockRows);
  if (work <= 0) {
    return;
  }
  auto* kernel = is_plain(p) ? attention_backward_dq_kernel<scalar_t, kHeadDim, true>
                             : attention_backward_dq_kernel<scalar_t, kHeadDim, false>;
  allow_shared_memory(kernel, T::kBackwardSmem);
  kernel<<<grid_for(work), kThreads, T::kBackwardSmem, stream>>>(dout, q, k, v, lse, delta, dq,
                                                                  p);
}

template <typename scalar_t>
void forward(const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* out, float* lse,
             const AttentionProblem& p, cudaStream_t stream) {
  switch (head_dim_bucket(p)) {
    case 32: return launch_forward<scalar_t, 32>(q, k, v, out, lse, p, stream);
    case 64: return launch_forward<scalar_t, 64>(q, k, v, out, lse, p, stream);
    case 128: return launch_forward<scalar_t, 128>(q, k, v, out, lse, p, stream);
    default: return launch_forward<scalar_t, 256>(q, k, v, out, lse, p, stream);
  }
}

template <typename scalar_t>
void backward_delta(const scalar_t* dout, const scalar_t* out, float* delta,
                    const AttentionProblem& p, cudaStream_t stream) {
  const int64_t rows = p.batch * p.len_q;
  if (rows <= 0) {
    return;
  }
  attention_backward_delta_kernel<scalar_t>
      <<<grid_for(ceil_div(rows, kWarps)), kThreads, 0, stream>>>(dout, out, delta, rows,
                                                                  value_dim(p));
}

template <typename scalar_t>
void backward_dkdv(const scalar_t* dout, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                   const float* lse, const float* delta, scalar_t* dk, scalar_t* dv,
                   const AttentionProblem& p, cudaStream_t stream) {
  switch (head_dim_bucket(p)) {
    case 32: return launch_dkdv<scalar_t, 32>(dout, q, k, v, lse, delta, dk, dv, p, stream);
    case 64: return launch_dkdv<scalar_t, 64>(dout, q, k, v, lse, delta, dk, dv, p, stream);
    case 128: return launch_dkdv<scalar_t, 128>(dout, q, k, v, lse, delta, dk, dv, p, stream);
    default: return launch_dkdv<scalar_t, 256>(dout, q, k, v, lse, delta, dk, dv, p, stream);
  }
}

template <typename scalar_t>
void backward_dq(const scalar_t* dout, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                 const float* lse, const float* delta, scalar_t* dq, const AttentionProblem& p,
                 cudaStream_t stream) {
  switch (head_dim_bucket(p)) {
    case 32: return launch_dq<scalar_t, 32>(dout, q, k, v, lse, delta, dq, p, stream);
    case 64: return launch_dq<scalar_t, 64>(dout, q, k, v, lse, delta, dq, p, stream);
    case 128: return launch_dq<scalar_t, 128>(dout, q, k, v, lse, delta, dq, p, stream);
    default: return launch_dq<scalar_t, 256>(dout, q, k, v, lse, delta, dq, p, stream);
  }
}

}  // namespace detail

// The launchers the glue calls, one overload per dtype (float, __half, __nv_bfloat16), each a
// single kernel launch on `stream` (none for empty work), so that the caller can check every
// launch. Pointers are to contiguous tensors (the mask, p.mask, to a strided one); the kernels
// read and write nothing else. Throws std::invalid_argument (head dims outside 1..256, or heads
// and kv_group that do not divide) or std::runtime_error (the shared memory opt-in failed);
// launch errors are left to the caller's cudaGetLastError check.

// forward: q (B, L, E), k (B / kv_group, S, E), v (B / kv_group, S, Ev) -> out (B, L, Ev), lse
// (B, L) float32. The mask, when there is one, is read through its strides.
inline void launch_attention_forward(const float* q, const float* k, const float* v, float* out,
                                     float* lse, const AttentionProblem& p,
                                     cudaStream_t stream) {
  detail::forward(q, k, v, out, lse, p, stream);
}
inline void launch_attention_forward(const __half* q, const __half* k, const __half* v,
                                     __half* out, float* lse, const AttentionProblem& p,
                                     cudaStream_t stream) {
  detail::forward(q, k, v, out, lse, p, stream);
}
inline void launch_attention_forward(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                     const __nv_bfloat16* v, __nv_bfloat16* out, float* lse,
                                     const AttentionProblem& p, cudaStream_t stream) {
  detail::forward(q, k, v, out, lse, p, stream);
}

// backward, first: delta (B, L) float32 = rowsum(dout * out), a workspace for the two below.
inline void launch_attention_backward_delta(const float* dout, const float* out, float* delta,
                                            const AttentionProblem& p, cudaStream_t stream) {
  detail::backward_delta(dout, out, delta, p, stream);
}
inline void launch_attention_backward_delta(const __half* dout, const __half* out, float* delta,
                                            const AttentionProblem& p, cudaStream_t stream) {
  detail::backward_delta(dout, out, delta, p, stream);
}
inline void launch_attention_backward_delta(const __nv_bfloat16* dout, const __nv_bfloat16* out,
                                            float* delta, const AttentionProblem& p,
                                            cudaStream_t stream) {
  detail::backward_delta(dout, out, delta, p, stream);
}

// backward, then: dk (B / kv_group, S, E), dv (B / kv_group, S, Ev).
inline void launch_attention_backward_dkdv(const float* dout, const float* q, const float* k,
                                           const float* v, const float* lse, const float* delta,
                                           float* dk, float* dv, const AttentionProblem& p,
                                           cudaStream_t stream) {
  detail::backward_dkdv(dout, q, k, v, lse, delta, dk, dv, p, stream);
}
inline void launch_attention_backward_dkdv(const __half* dout, const __half* q, const __half* k,
                                           const __half* v, const float* lse, const float* delta,
                                           __half* dk, __half* dv, const AttentionProblem& p,
                                           cudaStream_t stream) {
  detail::backward_dkdv(dout, q, k, v, lse, delta, dk, dv, p, stream);
}
inline void launch_attention_backward_dkdv(const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                           const __nv_bfloat16* k, const __nv_bfloat16* v,
                                           const float* lse, const float* delta,
                                           __nv_bfloat16* dk, __nv_bfloat16* dv,
                                           const AttentionProblem& p, cudaStream_t stream) {
  detail::backward_dkdv(dout, q, k, v, lse, delta, dk, dv, p, stream);
}

// backward, and: dq (B, L, E).
inline void launch_attention_backward_dq(const float* dout, const float* q, const float* k,
                                         const float* v, const float* lse, const float* delta,
                                         float* dq, const AttentionProblem& p,
                                         cudaStream_t stream) {
  detail::backward_dq(dout, q, k, v, lse, delta, dq, p, stream);
}
inline void launch_attention_backward_dq(const __half* dout, const __half* q, const __half* k,
                                         const __half* v, const float* lse, const float* delta,
                                         __half* dq, const AttentionProblem& p,
                                         cudaStream_t stream) {
  detail::backward_dq(dout, q, k, v, lse, delta, dq, p, stream);
}
inline void launch_attention_backward_dq(const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                         const __nv_bfloat16* k, const __nv_bfloat16* v,
                                         const float* lse, const float* delta,
                                         __nv_bfloat16* dq, const AttentionProblem& p,
                                         cudaStream_t stream) {
  detail::backward_dq(dout, q, k, v, lse, delta, dq, p, stream);
}

}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_ATTENTION_KERNELS_CUH_
