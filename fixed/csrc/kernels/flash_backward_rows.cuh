// What both tensor-core backwards (flash_backward.cuh, flash_backward_sm90.cuh) share besides the
// main kernel: the per-row kernels around it and the shared-memory helpers of its loop.
//   flash_backward_prologue_kernel: delta_i = dO_i . O_i and lse_i log2(e) (the main kernels work
//     in the log2 domain), both padded to a whole number of query blocks (pad rows, and rows
//     that saw no key: lse +inf, so their P is exactly 0), and zeros the float32 dQ
//     accumulator. Memory-bound: reads dO and O.
//   flash_backward_dq_kernel: dQ = scale * accumulator, rounded to the input dtype. The
//     accumulator is plain row-major (B, Lp, D) for the mma.sync kernel; the wgmma kernel's
//     swizzles it (swizzled_dq_chunk).
//
// No torch includes: CI compile-checks it without a GPU (kata/toolchain/builders.py).
#ifndef FIXED_FLASH_BACKWARD_ROWS_CUH_
#define FIXED_FLASH_BACKWARD_ROWS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "attention_problem.cuh"  // ceil_div, to_float
#include "flash_common.cuh"       // cp.async, pack2

namespace fixed_attention {
namespace kernels {
namespace flash {

// The prologue and dQ kernels: 256 threads, 16-byte accesses.
constexpr int kRowKernelThreads = 256;

// Rows of the padded per-row buffers (lse log2(e), delta, dQ accumulator): whole query blocks.
template <class F>
inline int64_t padded_rows(int64_t len_q) {
  return ceil_div(len_q, F::kBlockM) * F::kBlockM;
}

// ------------------------------------------------------------------------ the prologue kernel

// Thread group of kChunks lanes per row (one 16-byte chunk of dO and O each); rows past L are
// the padding. A warp covers 32 / kChunks consecutive rows, so shuffles never leave the warp
// and every lane of it runs the same number of iterations. dO and O rows hold D elements, or
// with kAsIs value_dim (Ev, a multiple of 8, at most D): lanes past them add 0.
template <typename T, int kHeadDim, bool kAsIs>
__global__ void __launch_bounds__(kRowKernelThreads)
    flash_backward_prologue_kernel(const T* __restrict__ dout,     // (B, L, Ev)
                                   const T* __restrict__ out,      // (B, L, Ev)
                                   const float* __restrict__ lse,  // (B, L), natural log
                                   float* __restrict__ lse_log2,   // (B, Lp), lse log2(e)
                                   float* __restrict__ delta,      // (B, Lp)
                                   float* __restrict__ dq_accum,   // (B, Lp, D), zeroed here
                                   const int64_t batch, const int64_t len_q,
                                   const int64_t rows_padded, const int value_dim) {
  constexpr int kChunks = kHeadDim / 8;
  const int columns = kAsIs ? value_dim : kHeadDim;
  constexpr int kRowsPerWarp = 32 / kChunks;
  constexpr float kLog2e = 1.4426950408889634f;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int chunk = lane % kChunks;
  const int64_t total_rows = batch * rows_padded;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kRowKernelThreads / 32);
  const int64_t first_warp =
      static_cast<int64_t>(blockIdx.x) * (kRowKernelThreads / 32) + (threadIdx.x >> 5);
  for (int64_t base = first_warp * kRowsPerWarp; base < total_rows;
       base += warps * kRowsPerWarp) {
    const int64_t row = base + lane / kChunks;  // in (B, Lp)
    const int64_t b = row / rows_padded;
    const int64_t i = row % rows_padded;
    const bool real = row < total_rows && i < len_q;
    float dot = 0.f;
    if (real && chunk * 8 < columns) {
      const int64_t offset = (b * len_q + i) * columns + chunk * 8;
      const uint4 dout_bits = *reinterpret_cast<const uint4*>(dout + offset);
      const uint4 out_bits = *reinterpret_cast<const uint4*>(out + offset);
      const T* const d8 = reinterpret_cast<const T*>(&dout_bits);
      const T* const o8 = reinterpret_cast<const T*>(&out_bits);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        dot = fmaf(to_float(d8[e]), to_float(o8[e]), dot);
      }
    }
#pragma unroll
    for (int offset = kChunks / 2; offset > 0; offset /= 2) {
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    }
    if (row < total_rows) {
      if (chunk == 0) {
        delta[row] = real ? dot : 0.f;
        // +inf for pad rows, and for rows that saw no key (lse -inf: a mask hid every key), so
        // that their P is exactly 0 (2^(-inf - inf)), never 2^(-inf + inf) = NaN.
        const float row_lse = real ? lse[b * len_q + i] : -INFINITY;
        lse_log2[row] = row_lse == -INFINITY ? INFINITY : row_lse * kLog2e;
      }
      float4* const accum = reinterpret_cast<float4*>(dq_accum + row * kHeadDim + chunk * 8);
      accum[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      accum[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
}

// ------------------------------------------------------------------------ shared-memory helpers

// Two floats (8-byte aligned): the wgmma backwards' dQ stage.
__device__ __forceinline__ void st_shared_f32x2(uint32_t address, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(address), "f"(a), "f"(b) : "memory");
}

// ------------------------------------------------------------------ the wgmma backward's mask

// Whether a float32 mask's rows can be copied in aligned runs of four (16-byte copies): keys
// contiguous, every row start 16-byte aligned (uniform over the grid).
__device__ __forceinline__ bool mask_in_quads(const AttentionProblem& p) {
  return p.mask_stride_col == 1 &&
         ((p.mask_stride_row | p.mask_stride_head | p.mask_stride_outer) & 3) == 0 &&
         (reinterpret_cast<std::uintptr_t>(p.mask) & 15) == 0;
}
// The same for a mask in the inputs' dtype, in runs of eight: what the glue promises for that
// form (AttentionProblem::mask_in_input_dtype), checked by the launcher.
__host__ __device__ __forceinline__ bool mask_in_octets(const AttentionProblem& p) {
  return p.mask_stride_col == 1 &&
         ((p.mask_stride_row | p.mask_stride_head | p.mask_stride_outer) & 7) == 0 &&
         (reinterpret_cast<std::uintptr_t>(p.mask) & 15) == 0;
}

// The mask tile in shared memory: row r (query m0 + r) holds the entries of keys n0 .. n0 + 127
// (512 bytes of float32, or 256 of the inputs' 16-bit dtype: kNarrow), 16-byte chunk c at
// c ^ (r & 7). A warp's float32 load of one element of its S^T fragments (keys 16 w + g,
// queries 2 t, + 8 j) then meets 8 chunks of 4 rows on all 32 banks; each 8-lane phase of the
// 16-bit tile's ldmatrix (mask_fragment_pairs) reads 8 rows' chunks, on all 32 banks too. Each
// warp copies and reads only its own 16 keys' part, so it refills that part for the next block
// as soon as it has used it, with no barrier.
template <bool kNarrow>
__device__ __forceinline__ uint32_t mask_slot(int row, int column) {
  constexpr int kShift = kNarrow ? 3 : 2, kBytes = kNarrow ? 2 : 4;  // 2^kShift entries a chunk
  return static_cast<uint32_t>(row * 128 * kBytes + (((column >> kShift) ^ (row & 7)) << 4) +
                               (column & ((1 << kShift) - 1)) * kBytes);
}

// Element e of n-tile j of a thread's S^T fragments (query 8 j + 2 t + (e & 1), key
// column0 + g + 8 (e >> 1) of the tile) from the float32 tile.
__device__ __forceinline__ float mask_fragment_entry(uint32_t tile, int column0, int g, int t,
                                                     int j, int e) {
  const int row = 8 * j + 2 * t + (e & 1), column = column0 + g + 8 * (e >> 1);
  return ld_shared_f32(tile + mask_slot<false>(row, column));
}

// The 16-bit tile's entries of n-tiles j, j + 1 (j even) of a thread's S^T fragments, by one
// ldmatrix.x4.trans: an 8 x 8 matrix of the tile (8 queries, one chunk of 8 keys) transposed
// gives lane (g, t) its queries 2 t, 2 t + 1 at key g in one register, the pair of elements
// e, e + 1 (e even). Matrix m = lane / 8 holds queries 8 (j + m / 2) .. + 7, keys
// column0 + 8 (m & 1) .. + 7: lane_base (mask_pair_base) is lane's row of it at j = 0, and an
// n-tile is 8 rows (2 KB) further. entries[4 jj + e]: element e of n-tile j + jj, as float.
__device__ __forceinline__ uint32_t mask_pair_base(uint32_t tile, int column0, int lane) {
  const int row = 8 * (lane >> 4) + (lane & 7), column = column0 + 8 * ((lane >> 3) & 1);
  return tile + mask_slot<true>(row, column);
}
template <typename T>
__device__ __forceinline__ void mask_fragment_pairs(uint32_t lane_base, int j,
                                                    float (&entries)[8]) {
  uint32_t pairs[4];  // n-tile j keys g, g + 8; n-tile j + 1 keys g, g + 8
  ldmatrix_x4_trans(pairs, lane_base + static_cast<uint32_t>(j) * 8 * 256);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __half>) {
      const float2 both = __half22float2(*reinterpret_cast<const __half2*>(&pairs[i]));
      entries[2 * i] = both.x;
      entries[2 * i + 1] = both.y;
    } else {  // bfloat16: the high 16 bits of a float32
      entries[2 * i] = __uint_as_float(pairs[i] << 16);
      entries[2 * i + 1] = __uint_as_float(pairs[i] & 0xFFFF0000u);
    }
  }
}

// All of a thread's entries, bias[4 j + e] = element e of n-tile j, in either form.
template <typename T, bool kNarrow, int N>
__device__ __forceinline__ void mask_fragments(float (&bias)[N], uint32_t tile,
                                               uint32_t pair_base, int column0, int g, int t) {
  float pairs[8];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if constexpr (kNarrow) {
      if (i % 8 == 0) {
        mask_fragment_pairs<T>(pair_base, i / 4, pairs);
      }
      bias[i] = pairs[i % 8];
    } else {
      bias[i] = mask_fragment_entry(tile, column0, g, t, i / 4, i % 4);
    }
  }
}

// Copies the mask's entries of queries m0 .. m0 + kRows - 1 and the warp's keys n0 + column0 ..
// + 15 into the tile by cp.async, 0 past L or S. Float32: 16-byte copies where quads (uniform,
// mask_in_quads), otherwise one per entry through the strides; each lane 8-row passes of 4
// chunks. The inputs' dtype (kNarrow; mask_in_octets holds): 16-byte copies, each lane 16-row
// passes of 2 chunks.
template <int kRows, bool kNarrow>
__device__ __forceinline__ void load_mask_part(uint32_t tile, const AttentionProblem& p,
                                               const void* mask_b, int64_t m0, int64_t n0,
                                               int column0, bool quads, int lane) {
  constexpr int kPerChunk = kNarrow ? 8 : 4;  // entries per 16-byte chunk
  constexpr int kLanesPerRow = kNarrow ? 2 : 4, kRowShift = kNarrow ? 1 : 2;
  const int column = column0 + kPerChunk * (lane & (kLanesPerRow - 1));
  const int64_t key = n0 + column;
#pragma unroll
  for (int pass = 0; pass < kRows * kLanesPerRow / 32; ++pass) {
    const int row = (32 / kLanesPerRow) * pass + (lane >> kRowShift);
    const int64_t query = m0 + row;
    const int64_t left = query < p.len_q ? p.len_kv - key : 0;
    const int keys = left <= 0 ? 0 : left >= kPerChunk ? kPerChunk : static_cast<int>(left);
    const uint32_t to = tile + mask_slot<kNarrow>(row, column);
    if constexpr (kNarrow) {
      const uint16_t* const entries = static_cast<const uint16_t*>(mask_b);
      cp_async_16_zfill(to, keys > 0 ? entries + query * p.mask_stride_row + key : entries,
                        2 * keys);
    } else {
      const float* const entries = static_cast<const float*>(mask_b);
      const float* const from =
          keys > 0 ? entries + query * p.mask_stride_row + key * p.mask_stride_col : entries;
      if (quads) {
        cp_async_16_zfill(to, from, 4 * keys);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          cp_async_4_zfill(to + 4 * e, e < keys ? from + e * p.mask_stride_col : entries,
                           e < keys ? 4 : 0);
        }
      }
    }
  }
}

// The swizzled dQ accumulator (flash_backward_sm90.cuh): row r's 8-float (32-byte) chunk c is
// stored at chunk c ^ (r & 7) of the same row, r counted in the padded (B, Lp) rows (Lp and
// every query block start are multiples of 8, so a block's local row has the same r & 7). The
// wgmma kernel stages a block's dQ in shared memory in this layout: a warp's 8 fragment rows
// then fall on 8 different chunks, conflict-free, and the staged tile goes to global memory as
// one contiguous bulk reduction.
__host__ __device__ __forceinline__ int swizzled_dq_chunk(int chunk, int64_t row) {
  return chunk ^ static_cast<int>(row & 7);
}

// kBlockM floats of each padded row buffer (lse log2(e), delta) into shared memory: the first
// kBlockM / 4 threads copy lse, the next kBlockM / 4 delta, 16 bytes each (the buffers are
// padded: always in bounds).
template <int kBlockM>
__device__ __forceinline__ void load_row_stats(uint32_t lse_dst, uint32_t delta_dst,
                                               const float* lse_src, const float* delta_src,
                                               int tid) {
  constexpr int kCopies = kBlockM / 4;
  if (tid < kCopies) {
    cp_async_16(lse_dst + tid * 16, lse_src + tid * 4);
  } else if (tid < 2 * kCopies) {
    cp_async_16(delta_dst + (tid - kCopies) * 16, delta_src + (tid - kCopies) * 4);
  }
}

// ------------------------------------------------------------------------ the dq kernel

// dQ's rows hold D elements, or with kAsIs head_dim (E, a multiple of 8, at most D): the
// accumulator's first E.
template <typename T, int kHeadDim, bool kSwizzledDq, bool kAsIs>
__global__ void __launch_bounds__(kRowKernelThreads)
    flash_backward_dq_kernel(const float* __restrict__ dq_accum,  // (B, Lp, D)
                             T* __restrict__ dq,                  // (B, L, E)
                             const int64_t batch, const int64_t len_q, const int64_t rows_padded,
                             const float scale, const int head_dim) {
  // One thread per 8 elements: two 16-byte loads, one 16-byte store.
  const int columns = kAsIs ? head_dim : kHeadDim;
  const int kChunks = columns / 8;
  const int64_t total = batch * len_q * kChunks;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * kRowKernelThreads + threadIdx.x;
       index < total; index += static_cast<int64_t>(gridDim.x) * kRowKernelThreads) {
    const int64_t row = index / kChunks;  // in (B, L)
    const int chunk = static_cast<int>(index % kChunks);
    const int64_t b = row / len_q;
    const int64_t i = row % len_q;
    const int stored = kSwizzledDq ? swizzled_dq_chunk(chunk, i) : chunk;
    const float4* const from =
        reinterpret_cast<const float4*>(dq_accum + (b * rows_padded + i) * kHeadDim + stored * 8);
    const float4 lo = from[0];
    const float4 hi = from[1];
    uint4 bits;
    bits.x = pack2<T>(lo.x * scale, lo.y * scale);
    bits.y = pack2<T>(lo.z * scale, lo.w * scale);
    bits.z = pack2<T>(hi.x * scale, hi.y * scale);
    bits.w = pack2<T>(hi.z * scale, hi.w * scale);
    *reinterpret_cast<uint4*>(dq + row * columns + chunk * 8) = bits;
  }
}

// ------------------------------------------------------------------------ host launcher

namespace detail {

// The main kernel's signature: flash_backward_kernel's, and flash_backward_sm90.cuh's.
template <typename T>
using BackwardMainKernel = void(const T*, const T*, const T*, const T*, const float*,
                                const float*, float*, T*, T*, const AttentionProblem,
                                const int64_t, const bool);

// The backward's three launches on `stream`: the prologue and dq kernels of tiling F, and
// between them the main kernel, launched by `launch_main(grid, rows, longest_first)`: F's
// flash_backward_kernel, or a kernel of F's CTA shape (kThreads threads, blocks of kBlockN keys,
// F::kDimParts work items each, the workspace padded to F::kBlockM rows, which are `rows`);
// kSwizzledDq: it leaves the dQ accumulator swizzled (swizzled_dq_chunk); kAsIs: E and Ev from
// the problem (the rows of dQ, dO, O), else F's D. After a failed launch it stops, leaving the
// error for the caller's launch check. kWgmmaOrder: the causal order of the wgmma kernels
// (wgmma_backward_longest_first_pays), else longest_first_pays.
template <typename T, class F, bool kSwizzledDq, bool kAsIs, bool kWgmmaOrder, class LaunchMain>
void backward_launches(const LaunchMain& launch_main, const T* dout, const T* out,
                       const float* lse, float* lse_log2, float* delta, float* dq_accum, T* dq,
                       const AttentionProblem& p, cudaStream_t stream) {
  const int64_t rows = padded_rows<F>(p.len_q);
  constexpr int kRowsPerBlock = kRowKernelThreads / F::kChunks;
  flash_backward_prologue_kernel<T, F::kHeadDim, kAsIs>
      <<<kernels::detail::grid_for(ceil_div(p.batch * rows, kRowsPerBlock)), kRowKernelThreads,
         0, stream>>>(dout, out, lse, lse_log2, delta, dq_accum, p.batch, p.len_q, rows,
                      static_cast<int>(value_dim(p)));
  if (cudaPeekAtLastError() != cudaSuccess) {
    return;
  }
  const int64_t work = p.batch * ceil_div(p.len_kv, F::kBlockN) * F::kDimParts;
  // The streams: Q and dO, and the float32 dQ accumulator the kernel adds to once per key block:
  // a kernel of 64-key blocks (the wide one) adds twice as often per FLOP as the 128-key ones
  // the rule was fitted to, its head dim counted twice (perf/NOTES.md, v26); the mask.
  const int64_t streamed_dims = p.head_dim * (128 / F::kBlockN);
  const bool pays = kWgmmaOrder
                        ? wgmma_backward_longest_first_pays(p.batch, p.len_q, streamed_dims)
                        : longest_first_pays(p.batch, p.len_q, streamed_dims);
  const bool longest_first = (p.causal && pays) || mask_shared_by_neighbours(p);
  launch_main(kernels::detail::grid_for(work), rows, longest_first);
  if (cudaPeekAtLastError() != cudaSuccess) {
    return;
  }
  const int dq_columns = kAsIs ? static_cast<int>(p.head_dim) : F::kHeadDim;
  flash_backward_dq_kernel<T, F::kHeadDim, kSwizzledDq, kAsIs>
      <<<kernels::detail::grid_for(ceil_div(p.batch * p.len_q * (dq_columns / 8),
                                            kRowKernelThreads)),
         kRowKernelThreads, 0, stream>>>(dq_accum, dq, p.batch, p.len_q, rows, p.scale,
                                         dq_columns);
}

// backward_launches with `kernel` as the main kernel, `smem_bytes` of dynamic shared memory.
template <typename T, class F, bool kSwizzledDq = false, bool kAsIs = false,
          bool kWgmmaOrder = false>
void backward(BackwardMainKernel<T>* kernel, std::size_t smem_bytes, const T* dout, const T* q,
              const T* k, const T* v, const T* out, const float* lse, float* lse_log2,
              float* delta, float* dq_accum, T* dq, T* dk, T* dv, const AttentionProblem& p,
              cudaStream_t stream) {
  const auto launch_main = [&](unsigned grid, int64_t rows, bool longest_first) {
    kernels::detail::allow_shared_memory(kernel, smem_bytes);
    kernel<<<grid, F::kThreads, smem_bytes, stream>>>(q, k, v, dout, lse_log2, delta, dq_accum,
                                                      dk, dv, p, rows, longest_first);
  };
  backward_launches<T, F, kSwizzledDq, kAsIs, kWgmmaOrder>(launch_main, dout, out, lse, lse_log2,
                                                           delta, dq_accum, dq, p, stream);
}

}  // namespace detail
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_BACKWARD_ROWS_CUH_
