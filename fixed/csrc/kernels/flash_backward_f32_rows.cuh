// The per-row kernels around flash_backward_f32.cuh's main kernel (float32, head dims 64 and
// 128), as flash_backward_rows.cuh's are around the half-precision one:
//   flash_backward_f32_prologue_kernel: delta_i = dO_i . O_i, lse_i log2(e) (+inf for pad rows
//     and rows that saw no key, so that their P is exactly 0), and the float32 dQ accumulator
//     zeroed, every buffer padded to whole blocks of kF32RowPadding rows. One warp per row.
//   flash_backward_f32_dq_kernel: dQ = scale * accumulator, for the L real rows.
//
// No torch includes: CI compile-checks it without a GPU (kata/toolchain/builders.py).
#ifndef FIXED_FLASH_BACKWARD_F32_ROWS_CUH_
#define FIXED_FLASH_BACKWARD_F32_ROWS_CUH_

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_problem.cuh"  // ceil_div

namespace fixed_attention {
namespace kernels {
namespace flash {

constexpr int kF32RowThreads = 256;
// The per-row buffers hold whole blocks of 32 rows: a multiple of every tiling's query block.
constexpr int kF32RowPadding = 32;

// The rows of the padded per-row buffers (lse log2(e), delta, dQ accumulator) per batch item.
inline int64_t f32_backward_rows(int64_t len_q) {
  return ceil_div(len_q, kF32RowPadding) * kF32RowPadding;
}

template <int kHeadDim>
__global__ void __launch_bounds__(kF32RowThreads)
    flash_backward_f32_prologue_kernel(const float* __restrict__ dout,  // (B, L, D)
                                       const float* __restrict__ out,   // (B, L, D)
                                       const float* __restrict__ lse,   // (B, L)
                                       float* __restrict__ lse_log2,    // (B, Lp)
                                       float* __restrict__ delta,       // (B, Lp)
                                       float* __restrict__ dq_accum,    // (B, Lp, D)
                                       const int64_t batch, const int64_t len_q,
                                       const int64_t rows_padded) {
  constexpr int kPerLane = kHeadDim / 32;  // 2 or 4 floats: one 8- or 16-byte access
  static_assert(kPerLane == 2 || kPerLane == 4, "head dims 64 and 128");
  using Vector = std::conditional_t<kPerLane == 2, float2, float4>;
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
      const int64_t offset = (b * len_q + i) * kHeadDim + kPerLane * lane;
      const Vector d = *reinterpret_cast<const Vector*>(dout + offset);
      const Vector o = *reinterpret_cast<const Vector*>(out + offset);
      const float* const d_floats = reinterpret_cast<const float*>(&d);
      const float* const o_floats = reinterpret_cast<const float*>(&o);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        dot = fmaf(d_floats[e], o_floats[e], dot);
      }
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
    *reinterpret_cast<Vector*>(dq_accum + row * kHeadDim + kPerLane * lane) = Vector{};
  }
}

template <int kHeadDim>
__global__ void __launch_bounds__(kF32RowThreads)
    flash_backward_f32_dq_kernel(const float* __restrict__ dq_accum,  // (B, Lp, D)
                                 float* __restrict__ dq,              // (B, L, D)
                                 const int64_t batch, const int64_t len_q,
                                 const int64_t rows_padded, const float scale) {
  constexpr int kChunks = kHeadDim / 4;  // float4s per row
  const int64_t total = batch * len_q * kChunks;
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * kF32RowThreads + threadIdx.x;
       index < total; index += static_cast<int64_t>(gridDim.x) * kF32RowThreads) {
    const int64_t row = index / kChunks;  // in (B, L)
    const int64_t chunk = index % kChunks;
    const int64_t b = row / len_q;
    const int64_t i = row % len_q;
    const float4 sum =
        reinterpret_cast<const float4*>(dq_accum)[(b * rows_padded + i) * kChunks + chunk];
    reinterpret_cast<float4*>(dq)[index] =
        make_float4(sum.x * scale, sum.y * scale, sum.z * scale, sum.w * scale);
  }
}

}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_BACKWARD_F32_ROWS_CUH_
