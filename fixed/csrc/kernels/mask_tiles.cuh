// The map of an attention mask's tiles that the tensor-core kernels skip or read without the
// mask (AttentionProblem::hidden_tiles), made in one pass over the mask's own elements, the same
// pass writing them in the form the kernels read where the mask does not come in it: additive
// float32, or (the backward, AttentionProblem::mask_in_input_dtype) the inputs' half or
// bfloat16, from a bool mask or one of that dtype, rows padded to 16 bytes. The glue made the
// float32 copy with torch's ops and then scanned the copy: two passes over the largest tensor of
// a masked problem, as long as the attention kernel's own forward at S = 8192 (perf/NOTES.md,
// v25).
//
// No torch includes: nvcc compile-checks it without a GPU (kata/toolchain/builders.py).
#ifndef FIXED_MASK_TILES_CUH_
#define FIXED_MASK_TILES_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "flash_common.cuh"  // kHiddenTile, kHiddenTileHidden, kHiddenTileZero

namespace fixed_attention {
namespace kernels {
namespace flash {

// An element of the mask as the scores take it (additive_mask's meaning, checks.h): a bool
// takes part (0) or is hidden (-inf); a floating entry is added as it is, float64 rounded to
// float32 as Tensor.to rounds it.
__device__ __forceinline__ float additive_entry(bool takes_part) {
  return takes_part ? 0.f : -INFINITY;
}
__device__ __forceinline__ float additive_entry(float entry) { return entry; }
__device__ __forceinline__ float additive_entry(double entry) { return static_cast<float>(entry); }
__device__ __forceinline__ float additive_entry(__half entry) { return __half2float(entry); }
__device__ __forceinline__ float additive_entry(__nv_bfloat16 entry) {
  return __bfloat162float(entry);
}
// The same in the kernels' form: exact where a 16-bit one is made (0, -inf, or the entry itself).
template <typename Dst>
__device__ __forceinline__ Dst kernel_entry(float additive) {
  if constexpr (std::is_same_v<Dst, __half>) {
    return __float2half_rn(additive);
  } else if constexpr (std::is_same_v<Dst, __nv_bfloat16>) {
    return __float2bfloat16_rn(additive);
  } else {
    return additive;
  }
}

// The mask's own elements (size 1 where it broadcasts) and their tiles: tile_rows x tile_keys
// (kHiddenTile, or 1 along a dimension of size 1), numbered (outer, head, row tile, key tile)
// row-major.
struct MaskTiles {
  int64_t stride_outer, stride_head, stride_row, stride_col;  // the source's, in elements
  int64_t heads, rows, keys;                                  // own sizes: heads, L, S or 1
  int tile_rows, tile_keys;
  int64_t row_tiles, key_tiles, tiles;
  int64_t converted_row;  // the converted copy's row stride: keys, or more (padding)
};

constexpr int kMaskTileThreads = 256;

// One block per tile (consecutive threads on consecutive keys, 16 independent loads each):
// hidden[tile] = kHiddenTileHidden when every entry is -inf, kHiddenTileZero when every one is
// 0 (either sign), else 0; *any_hidden (zeroed before) gets those bits of every tile. Where
// `converted` is not null, the entries go there too as Dst, in the own sizes, rows
// converted_row apart.
template <typename Src, typename Dst>
__global__ void __launch_bounds__(kMaskTileThreads)
    mask_tiles_kernel(const Src* __restrict__ mask, const MaskTiles m,
                      Dst* __restrict__ converted, uint8_t* __restrict__ hidden,
                      int* __restrict__ any_hidden) {
  static_assert(kHiddenTile == 64, "a tile's row and key are i >> 6 and i & 63");
  constexpr int kPerThread = kHiddenTile * kHiddenTile / kMaskTileThreads;
  const int count = m.tile_rows * m.tile_keys;
  const bool wide = m.tile_keys != 1;
  for (int64_t tile = blockIdx.x; tile < m.tiles; tile += gridDim.x) {
    const int64_t key_tile = tile % m.key_tiles, row_tile = (tile / m.key_tiles) % m.row_tiles;
    const int64_t slice = tile / (m.key_tiles * m.row_tiles);
    const Src* const source =
        mask + (slice / m.heads) * m.stride_outer + (slice % m.heads) * m.stride_head;
    Dst* const target =
        converted == nullptr ? nullptr : converted + slice * m.rows * m.converted_row;
    bool all_hidden = true, all_zero = true;
#pragma unroll
    for (int step = 0; step < kPerThread; ++step) {
      const int i = step * kMaskTileThreads + static_cast<int>(threadIdx.x);
      const int64_t row = row_tile * m.tile_rows + (wide ? i >> 6 : i);
      const int64_t key = key_tile * m.tile_keys + (wide ? i & 63 : 0);
      if (i < count && row < m.rows && key < m.keys) {
        const float entry = additive_entry(source[row * m.stride_row + key * m.stride_col]);
        if (target != nullptr) {
          target[row * m.converted_row + key] = kernel_entry<Dst>(entry);
        }
        all_hidden = all_hidden && entry == -INFINITY;
        all_zero = all_zero && entry == 0.f;
      }
    }
    all_hidden = __syncthreads_and(all_hidden);
    all_zero = __syncthreads_and(all_zero);
    if (threadIdx.x == 0) {
      const uint8_t kind = all_hidden ? kHiddenTileHidden : all_zero ? kHiddenTileZero : 0;
      hidden[tile] = kind;
      if (kind != 0) {
        atomicOr(any_hidden, kind);
      }
    }
  }
}

template <typename Src, typename Dst>
void launch_mask_tiles(const Src* mask, const MaskTiles& tiles, Dst* converted,
                       uint8_t* hidden, int* any_hidden, cudaStream_t stream) {
  const unsigned grid = kernels::detail::grid_for(tiles.tiles);
  mask_tiles_kernel<Src, Dst><<<grid, kMaskTileThreads, 0, stream>>>(mask, tiles, converted,
                                                                     hidden, any_hidden);
}

// The glue's entry point, one overload per mask dtype (non-templates, so that nvcc's compile
// check of this header instantiates every kernel): the map of `tiles` into `hidden` and
// *any_hidden (zeroed before), and the entries into `converted` where it is not null: float32
// from any dtype, half or bfloat16 from a bool mask or one of that dtype.
inline void launch_mask_tiles(const bool* mask, const MaskTiles& tiles, float* converted,
                              uint8_t* hidden, int* any_hidden, cudaStream_t stream) {
  launch_mask_tiles<bool, float>(mask, tiles, converted, hidden, any_hidden, stream);
}
inline void launch_mask_tiles(const __half* mask, const MaskTiles& tiles, float* converted,
                              uint8_t* hidden, int* any_hidden, cudaStream_t stream) {
  launch_mask_tiles<__half, float>(mask, tiles, converted, hidden, any_hidden, stream);
}
inline void launch_mask_tiles(const __nv_bfloat16* mask, const MaskTiles& tiles, float* converted,
                              uint8_t* hidden, int* any_hidden, cudaStream_t stream) {
  launch_mask_tiles<__nv_bfloat16, float>(mask, tiles, converted, hidden, any_hidden, stream);
}
inline void launch_mask_tiles(const float* mask, const MaskTiles& tiles, float* converted,
                              uint8_t* hidden, int* any_hidden, cudaStream_t stream) {
  launch_mask_tiles<float, float>(mask, tiles, converted, hidden, any_hidden, stream);
}
inline void launch_mask_tiles(const double* mask, const MaskTiles& tiles, float* converted,
                              uint8_t* hidden, int* any_hidden, cudaStream_t stream) {
  launch_mask_tiles<double, float>(mask, tiles, converted, hidden, any_hidden, stream);
}
inline void launch_mask_tiles(const bool* mask, const MaskTiles& tiles, __half* converted,
                              uint8_t* hidden, int* any_hidden, cudaStream_t stream) {
  launch_mask_tiles<bool, __half>(mask, tiles, converted, hidden, any_hidden, stream);
}
inline void launch_mask_tiles(const __half* mask, const MaskTiles& tiles, __half* converted,
                              uint8_t* hidden, int* any_hidden, cudaStream_t stream) {
  launch_mask_tiles<__half, __half>(mask, tiles, converted, hidden, any_hidden, stream);
}
inline void launch_mask_tiles(const bool* mask, const MaskTiles& tiles, __nv_bfloat16* converted,
                              uint8_t* hidden, int* any_hidden, cudaStream_t stream) {
  launch_mask_tiles<bool, __nv_bfloat16>(mask, tiles, converted, hidden, any_hidden, stream);
}
inline void launch_mask_tiles(const __nv_bfloat16* mask, const MaskTiles& tiles,
                              __nv_bfloat16* converted, uint8_t* hidden, int* any_hidden,
                              cudaStream_t stream) {
  launch_mask_tiles<__nv_bfloat16, __nv_bfloat16>(mask, tiles, converted, hidden, any_hidden,
                                                  stream);
}

}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_MASK_TILES_CUH_
