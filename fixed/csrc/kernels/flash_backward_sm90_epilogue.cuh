// The wgmma backward's epilogue (flash_backward_sm90_cta.cuh): a work item's dK and dV, summed
// in the consumer warps' registers over its query blocks, staged through shared memory and
// stored as whole rows. No torch includes: CI compile-checks the kernels without a GPU.
#ifndef FIXED_FLASH_BACKWARD_SM90_EPILOGUE_CUH_
#define FIXED_FLASH_BACKWARD_SM90_EPILOGUE_CUH_

#include <cstdint>

#include "flash_common.cuh"        // st_shared_b32, pack2
#include "flash_forward_sm90.cuh"  // sw128_offset

namespace fixed_attention {
namespace kernels {
namespace flash {
namespace sm90 {

// dK (times scale) and dV of keys n0 + key_row0 .. + 15, this warp's, through its own rows of
// the K and V tiles (k_tile, v_tile: shared addresses; kv_bytes: the K tile through a generic
// pointer, V's following it), then 16-byte stores of whole rows: dK's E columns at
// dk + dk_b, dV's Ev at dv + dv_b, keys past S left alone. The caller has made the tiles free
// (no copies in flight, every warpgroup done with K) and fences them for TMA after.
template <typename T, class F>
__device__ __forceinline__ void store_dk_dv(T* __restrict__ dk, T* __restrict__ dv,
                                            const int64_t dk_b, const int64_t dv_b,
                                            const float (&dk_acc)[F::kDTiles * 4],
                                            const float (&dv_acc)[F::kDTiles * 4],
                                            const float scale, const uint32_t k_tile,
                                            const uint32_t v_tile,
                                            const unsigned char* const kv_bytes,
                                            const int key_row0, const int lane, const int64_t n0,
                                            const int64_t S, const int E, const int Ev) {
  constexpr int BN = F::kBlockN;
  const int g = lane >> 2, t = lane & 3;  // fragment row and column pair
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = key_row0 + g + 8 * h;  // row & 7 == g
#pragma unroll
    for (int j = 0; j < F::kDTiles; ++j) {
      const uint32_t offset = sw128_offset<BN>(row, j) + 4 * t;  // columns 8 j + 2 t, + 1
      st_shared_b32(k_tile + offset, pack2<T>(dk_acc[4 * j + 2 * h] * scale,
                                              dk_acc[4 * j + 2 * h + 1] * scale));
      st_shared_b32(v_tile + offset, pack2<T>(dv_acc[4 * j + 2 * h], dv_acc[4 * j + 2 * h + 1]));
    }
  }
  __syncwarp();
  constexpr int kRowsPerStep = 32 / F::kChunks;
#pragma unroll
  for (int step = 0; step < 16 / kRowsPerStep; ++step) {
    const int row = key_row0 + step * kRowsPerStep + lane / F::kChunks;
    const int chunk = lane % F::kChunks;
    const int64_t key = n0 + row;
    const uint32_t offset = sw128_offset<BN>(row, chunk);
    if (key < S) {
      if (chunk * 8 < E) {  // dK's E columns, dV's Ev
        *reinterpret_cast<uint4*>(dk + dk_b + key * E + chunk * 8) =
            *reinterpret_cast<const uint4*>(kv_bytes + offset);
      }
      if (chunk * 8 < Ev) {
        *reinterpret_cast<uint4*>(dv + dv_b + key * Ev + chunk * 8) =
            *reinterpret_cast<const uint4*>(kv_bytes + F::kKVBytes + offset);
      }
    }
  }
}

}  // namespace sm90
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_BACKWARD_SM90_EPILOGUE_CUH_
