// The end of a whole item in the warp-specialized Hopper forward (flash_forward_sm90_ws_cta.cuh):
// each consumer thread's O divided by its rows' sums, in 16 bits, and their lse; the split
// tail's parts end in flash_forward_sm90_ws_schedule.cuh instead. Two ways out for O:
//   store_rows: straight from registers to global memory, 4 bytes a store (every tiling);
//   stage_rows: through a shared-memory buffer the item no longer reads, by stmatrix, then one
//     TMA store per warp and 64 columns (the tilings whose consumers take turns, without a mask
//     or dropout, where the tiling asks for it: stages_o).
//     A thread's 32 four-byte stores at D = 128 (each a warp's write into 8 partial cache
//     lines) took 5% of the kernel at S = 2048 (timed without them); staged, the D = 128
//     forward ran 1.02-1.06x faster at S = 2048-8192, kernels alone (perf/NOTES.md, v56).
//
// No torch includes: CI compile-checks this header for sm_90a and sm_90 without a GPU.
#ifndef FIXED_FLASH_FORWARD_SM90_WS_EPILOGUE_CUH_
#define FIXED_FLASH_FORWARD_SM90_WS_EPILOGUE_CUH_

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_problem.cuh"               // AttentionProblem, value_dim
#include "flash_common.cuh"                    // pack2, kNoArgs
#include "flash_forward_sm90_ws_schedule.cuh"  // Rows, WorkItem
#include "sm90_pipeline.cuh"                   // tma_store_3d
#include "wgmma.cuh"                           // stmatrix_x4, the bulk group's fence and commit

namespace fixed_attention {
namespace kernels {
namespace flash {
namespace sm90_ws {

// Whether tiling F's instantiation kArgs stages O: not with a mask or dropout, whose tilings
// spilled more with it (up to 86 bytes of stores and 156 of loads; perf/NOTES.md, v56).
template <class F, int kArgs>
__host__ __device__ constexpr bool stages_o() {
  return F::kStagesO && kArgs == kNoArgs;
}

// The reciprocal of the sum of this thread's row h (rows g and g + 8 of the warp; 0 for a row
// with every key masked), after writing the row's lse (natural log; -inf for such a row). unit:
// the softmax's log2 scale.
__device__ __forceinline__ float finish_row(int h, float* __restrict__ lse, const Rows& r,
                                            const WorkItem& w, const AttentionProblem& p,
                                            float unit) {
  constexpr float kLn2 = 0.6931471805599453f;
  constexpr unsigned kFullMask = 0xffffffffu;
  float sum = r.row_sum[h];
  sum += __shfl_xor_sync(kFullMask, sum, 1);
  sum += __shfl_xor_sync(kFullMask, sum, 2);
  const int64_t row = w.m0 + r.warp_row0 + r.g + 8 * h;
  if (row >= 0 && row < p.len_q && r.t == 0) {  // rows before 0: work_item
    lse[w.b * p.len_q + row] = sum > 0.f ? r.row_max[h] * unit * kLn2 + logf(sum) : -INFINITY;
  }
  return sum > 0.f ? 1.f / sum : 0.f;
}

// O straight to global memory: each warp writes whole rows. Only the first Ev of the tile's Dv
// columns exist (Ev a multiple of 8: whole column tiles).
template <typename T, class F>
__device__ __forceinline__ void store_rows(T* __restrict__ out, float* __restrict__ lse,
                                           const float (&o)[F::kDTiles * 4], const Rows& r,
                                           const WorkItem& w, const AttentionProblem& p,
                                           float unit) {
  constexpr int Dv = F::kValueDim;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float inv_sum = finish_row(h, lse, r, w, p, unit);
    const int64_t row = w.m0 + r.warp_row0 + r.g + 8 * h;
    if (row >= 0 && row < p.len_q) {
      T* const out_row = out + (w.b * p.len_q + row) * value_dim(p);
#pragma unroll
      for (int j = 0; j < F::kDTiles; ++j) {
        if (Dv == value_dim(p) || 8 * j < value_dim(p)) {
          *reinterpret_cast<uint32_t*>(out_row + 8 * j + 2 * r.t) =
              pack2<T>(o[4 * j + 2 * h] * inv_sum, o[4 * j + 2 * h + 1] * inv_sum);
        }
      }
    }
  }
}

#if FIXED_HAS_TENSOR_MAPS
// O through shared memory: the warp's 16 rows into `buffer` (Dv / 64 boxes of 16 rows x 128
// bytes, 2 KB each, with the 128-byte swizzle of o_map's boxes), then, from lane 0, one TMA store
// per box as a bulk group. The caller makes sure no product still reads `buffer`, and releases it
// once bulk_wait_group_read_all returns in lane 0. TMA writes no row past L and no column past
// Ev; a warp whose rows are all before row 0 stores nothing.
template <typename T, class F>
__device__ __forceinline__ void stage_rows(const CUtensorMap* o_map, uint32_t buffer,
                                           float* __restrict__ lse,
                                           const float (&o)[F::kDTiles * 4], const Rows& r,
                                           const WorkItem& w, const AttentionProblem& p,
                                           float unit, int lane) {
  constexpr int kBoxes = F::kValueDim / 64;
  constexpr uint32_t kBoxBytes = 16 * F::kRowBytes;
  const float inv_sum[2] = {finish_row(0, lse, r, w, p, unit), finish_row(1, lse, r, w, p, unit)};
  // stmatrix: lane l addresses row l % 8 of tile l / 8 of four: (rows 0-7 | 8-15) x (column
  // tiles j | j + 1), which are its words 0-3 in that order.
  const uint32_t row = static_cast<uint32_t>(((lane >> 3) & 1) * 8 + (lane & 7));
#pragma unroll
  for (int j = 0; j < F::kDTiles; j += 2) {
    const uint32_t tile = static_cast<uint32_t>(j + (lane >> 4));
    const uint32_t address = buffer + (tile / 8) * kBoxBytes + row * F::kRowBytes +
                             (((tile % 8) ^ (row % 8)) << 4);  // the 16-byte chunk, swizzled
    stmatrix_x4(address, pack2<T>(o[4 * j] * inv_sum[0], o[4 * j + 1] * inv_sum[0]),
                pack2<T>(o[4 * j + 2] * inv_sum[1], o[4 * j + 3] * inv_sum[1]),
                pack2<T>(o[4 * j + 4] * inv_sum[0], o[4 * j + 5] * inv_sum[0]),
                pack2<T>(o[4 * j + 6] * inv_sum[1], o[4 * j + 7] * inv_sum[1]));
  }
  fence_proxy_async_shared();  // the warp's writes, to the TMA unit
  __syncwarp();
  // A warp's 16 rows lie all before row 0 or none (work_item's blocks start at multiples of 64):
  // no store for the first (a box at a negative row stopped the kernel: illegal instruction).
  if (lane == 0 && w.m0 + r.warp_row0 >= 0) {
#pragma unroll
    for (int box = 0; box < kBoxes; ++box) {
      tma_store_3d(o_map, buffer + box * kBoxBytes, 64 * box,
                   static_cast<int>(w.m0 + r.warp_row0), static_cast<int>(w.b));
    }
    bulk_commit_group();
  }
}
#endif  // FIXED_HAS_TENSOR_MAPS

}  // namespace sm90_ws
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_FORWARD_SM90_WS_EPILOGUE_CUH_
