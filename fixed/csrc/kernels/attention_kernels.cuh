// The generic CUDA kernels of the fixed_attention operators: the forward and its launcher here,
// the backward in attention_backward_kernels.cuh; the problem they take is attention_problem.cuh.
// The torch glue (checks, device guard, stream, dispatch, launch check) is in ../attention_cuda.cu.
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

#include "attention_problem.cuh"  // AttentionProblem, ceil_div, grid_for, philox.h

namespace fixed_attention {
namespace kernels {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
// In __launch_bounds__: lets ptxas use up to 255 registers per thread. Without it, its
// heuristic capped some variants at 80 registers and spilled.
constexpr int kMinBlocksPerSm = 2;
constexpr int kTile = kWarpSize;  // rows per shared-memory tile: one per lane
constexpr int kMaxHeadDim = 256;

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

// Batch item b's (L, S) slice of the additive mask (either form); null without a mask.
template <bool kPlain>
__device__ __forceinline__ const void* mask_slice(const AttentionProblem& p, int64_t b) {
  return kPlain ? nullptr : mask_slice_of(p, b);
}

// s_ij from q_i.k_j: scaled, plus the mask's entry; -inf for a key the row does not see, and
// for rows and keys past the end (whose mask entries are never read).
template <typename scalar_t>
__device__ __forceinline__ float attention_score(const AttentionProblem& p, const void* mask_b,
                                                 float dot, int64_t row, int64_t key) {
  if (row >= p.len_q || key >= p.len_kv || (p.causal && key > row)) {
    return -INFINITY;
  }
  const float scaled = dot * p.scale;
  return mask_b == nullptr ? scaled : scaled + mask_value<scalar_t>(p, mask_b, row, key);
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
    const void* mask_b = mask_slice<kPlain>(p, b);

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
        const float score = attention_score<scalar_t>(p, mask_b, s[r], row, key);
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

// ------------------------------------------------------------------------ host launchers

namespace detail {

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

}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_ATTENTION_KERNELS_CUH_
