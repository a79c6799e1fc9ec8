// The tiling of flash_backward.cuh's mma.sync backward (its header comment describes the
// kernel): what each work item, warp and loop iteration covers, and its shared memory. Apart so
// that the kernel's file stays readable. No torch includes.
#ifndef FIXED_FLASH_BACKWARD_TILING_CUH_
#define FIXED_FLASH_BACKWARD_TILING_CUH_

#include <cstddef>

namespace fixed_attention {
namespace kernels {
namespace flash {

// kHeadDim: 64, 128 or 256 (E must equal it). kBlockM: query rows per loop iteration, 64 or 128.
// kSliceRows: query rows per slice, the unit in which S^T, dP^T, P^T and dS^T live in registers.
// kOutDims: the head dims of dK, dV and dQ one work item computes: all of them, or 128 of 256
// (dK and dV of 256 dims would take all 256 registers), each of a key block's two items then
// computing S^T and dP^T over the whole head dim (1.4x the products' FLOPs). kQBuffers: Q, dO,
// lse and delta double-buffered (2), or one buffer, refilled once every warp is done with it
// (1: the 208 KB of D = 256).
template <int kHeadDim_, int kBlockM_, int kSliceRows_, int kOutDims_ = kHeadDim_,
          int kQBuffers_ = 2>
struct BackwardTiling {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = 16 * kWarps;  // keys per CTA, 16 per warp
  static constexpr int kBlockM = kBlockM_;     // query rows per loop iteration
  static constexpr int kSliceRows = kSliceRows_;
  static constexpr int kSlices = kBlockM / kSliceRows;
  static constexpr int kSliceTiles = kSliceRows / 8;  // n-tiles of S^T, dP^T per slice
  static constexpr int kOutDims = kOutDims_;
  static constexpr int kDimParts = kHeadDim / kOutDims;  // work items per key block
  // The A fragments of the warp's K and V rows, all of D, held for the work item (D / 2
  // registers) or, with part of the head dim per item, read at every k-step.
  static constexpr bool kHoldKV = kDimParts == 1;
  static constexpr int kQBuffers = kQBuffers_;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row of Q, K, V, dO
  static constexpr int kKSteps = kHeadDim / 16;  // k-steps of S^T, dP^T
  static constexpr int kDTiles = kOutDims / 8;   // n-tiles of dV, dK
  // dQ: warp w takes m-tile w % kRowTiles and column group w / kRowTiles of the item's dims.
  static constexpr int kRowTiles = kBlockM / 16;
  static constexpr int kColGroups = kWarps / kRowTiles;
  static constexpr int kDqCols = kOutDims / kColGroups;
  static constexpr int kDqTiles = kDqCols / 8;
  static constexpr int kKeySteps = kBlockN / 16;  // k-steps of dQ (keys)
  static constexpr int kKVElems = kBlockN * kHeadDim;
  static constexpr int kQElems = kBlockM * kHeadDim;
  static constexpr int kDsElems = kBlockN * kBlockM;
  // K + V + kQBuffers x (Q + dO) + dS^T, 2 bytes each; kQBuffers x (lse + delta), 4 bytes each.
  static constexpr std::size_t kSmemBytes =
      2 * (2 * kKVElems + 2 * kQBuffers * kQElems + kDsElems) + kQBuffers * 2 * kBlockM * 4;

  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dims 64, 128, 256");
  static_assert(kHeadDim % kOutDims == 0 && kOutDims <= 128, "dK, dV: at most 128 dims per item");
  static_assert(kQBuffers == 1 || kQBuffers == 2, "one or two buffers of Q and dO");
  static_assert(kBlockM == 64 || kBlockM == 128, "dS^T rows of 8 or 16 chunks (swizzle)");
  static_assert(kSliceRows % 16 == 0 && kBlockM % kSliceRows == 0, "whole k-steps per slice");
  static_assert(kWarps % kRowTiles == 0 && kDqTiles % 2 == 0, "whole dQ tiles per warp");
  static_assert(kThreads % kChunks == 0 && 32 % kChunks == 0, "whole rows per copy pass");
  static_assert(kSmemBytes <= 227 * 1024, "over sm_90's 227 KB of shared memory per block");
};

// The variants the launcher uses (perf/NOTES.md, v5 and v8): at D = 64, 128-row query blocks
// (half the barriers and fixed costs per FLOP) in slices of 32; at D = 128, dK and dV take 128
// registers, and the K and V fragments 64 more: 64-row query blocks in slices of 16; at D = 256,
// 128 dims of dK, dV and dQ per work item, one buffer of Q and dO (208 KB).
using BackwardTiling64 = BackwardTiling<64, 128, 32>;
using BackwardTiling128 = BackwardTiling<128, 64, 16>;
using BackwardTiling256 = BackwardTiling<256, 64, 16, 128, 1>;

}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_BACKWARD_TILING_CUH_
