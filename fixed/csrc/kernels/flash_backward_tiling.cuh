// The tilings of the backward kernels: BackwardTiling, flash_backward.cuh's mma.sync backward
// (its header comment describes the kernel), and sm90::BackwardTile, the wgmma backward's CTA
// (flash_backward_sm90_cta.cuh describes it): what each work item, warp and loop iteration
// covers, and their shared memory. Apart so that the kernels' files stay readable. No torch
// includes.
#ifndef FIXED_FLASH_BACKWARD_TILING_CUH_
#define FIXED_FLASH_BACKWARD_TILING_CUH_

#include <cstddef>
#include <cstdint>
#include <type_traits>

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

namespace sm90 {

// The wgmma backward's CTA (flash_backward_sm90_cta.cuh) for head dim 64 or 128. Its shared
// memory, 128-byte swizzle (wgmma.cuh; flash_forward_sm90.cuh's sw128_offset): every tile is
// stored as [columns / 64][rows][64] (128-byte rows, 16-byte chunk c of row r at c ^ (r & 7)):
//   K, V [128 keys][D]              2 x 16 KB (D = 64), 2 x 32 KB (D = 128)
//   Q, dO [R][D], 2 buffers         4 x 16 KB (both)
//   dS^T [128 keys][R], 2 buffers   2 x 32 KB (D = 64), 2 x 16 KB (D = 128)
//   lse, delta [R] f32, 2 buffers   2 KB, 1 KB
//   dQ stage [R][D] f32             32 KB (both)
//   a mask's entries [R][128 keys]  64 KB (D = 64, in place of dS^T's second buffer), 32 KB
//                                   (D = 128); half of it with kNarrowMask
//   or, without arguments, a 2nd dQ stage  32 KB
// and 1 KB to align the tiles to 1024 bytes, where the mbarriers go (or past the tiles where
// alignment leaves too little). D = 64: 227 KB, D = 128: 226 KB, with a mask or without.
template <int kHeadDim_>
struct BackwardTile {
  static constexpr int kHeadDim = kHeadDim_;
  // A work item: one query item's dK, dV (here), or GQA's group summed (GroupSummingTile).
  static constexpr bool kSumsGroup = false;
  // flash_backward.cuh's tiling of the same keys per CTA and query blocks: the tiling of the
  // shared prologue and dq kernels and of the workspace rows, and the mma.sync backward that
  // runs instead where the library has no sm_90a image.
  using Fallback = std::conditional_t<kHeadDim == 64, BackwardTiling64, BackwardTiling128>;
  // A producer warpgroup (the loader and the reducer, flash_backward_sm90_producer.cuh) and
  // two consumer warpgroups; setmaxnreg moves the producer's registers to the consumers.
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr uint32_t kProducerRegisters = 24;
  static constexpr uint32_t kConsumerRegisters = 240;  // (65536 - 128 * 24) / 256, rounded to 8
  static constexpr uint32_t kConsumersBarrier = 1;     // the consumers' named barrier (0: CTA)
  static constexpr int kBlockN = 128;                 // keys per CTA, 64 per warpgroup
  static constexpr int kBlockM = Fallback::kBlockM;   // queries per loop iteration (R)
  static constexpr int kChunks = kHeadDim / 8;        // 16-byte chunks per row of Q, K, V, dO
  static constexpr int kQTiles = kBlockM / 8;         // 8-query n-tiles of S^T, dP^T
  static constexpr int kQSteps = kBlockM / 16;        // k-steps of dV, dK (queries)
  static constexpr int kDTiles = kHeadDim / 8;        // 8-wide n-tiles of dV, dK
  static constexpr int kKeySteps = kBlockN / 16;      // k-steps of dQ (keys)
  // dQ: one 64 x 64 tile per warpgroup: kBlockM / 64 row groups x kHeadDim / 64 column groups.
  static constexpr int kDqRowGroups = kBlockM / 64;
  // dV += P^T dO issued before dS^T is computed (overlapping it), at the price of holding the
  // P^T fragments and S^T together with dP^T: in the instances without SDPA's arguments at
  // D = 128 (kEarlyDvPlain), elsewhere after it. At 255 registers both orders fit at both head
  // dims (perf/NOTES.md, v13); at the consumers' 240 (ptxas, v33), D = 64's early dV has the
  // wgmmas serialized (C7512), and at D = 128 the mask and dropout instances spill 68 and 156
  // bytes more with it; the plain D = 128 one spills nothing either way.
  static constexpr bool kEarlyDvPlain = kHeadDim != 64;
  // The warpgroup index read from lane 0 (CUTLASS's canonical_warp_group_idx), so that the
  // descriptors of K, V and dQ are computed in uniform registers: measured on an H200 at S = 4096
  // (perf/NOTES.md, v15), 4-5% faster at D = 64 and 1-3% slower at D = 128.
  static constexpr bool kUniformWarpgroup = kHeadDim == 64;
  static constexpr uint32_t kRowBytes = 128;                     // one 64-element run
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * 2;   // K or V
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * 2;    // one buffer of Q or dO
  static constexpr uint32_t kDsBytes = kBlockN * kBlockM * 2;    // one buffer of dS^T
  static constexpr uint32_t kStatsBytes = 2 * kBlockM * 4;       // one buffer of lse, delta
  static constexpr uint32_t kDqBytes = kBlockM * kHeadDim * 4;   // the staged f32 dQ block
  // The mbarriers (8 bytes each; 16 of them at most): in the 1024 bytes spare for aligning the
  // tiles, where the CTA finds room for them (BackwardSmem, flash_backward_sm90_producer.cuh).
  static constexpr uint32_t kBarrierBytes = 128;
  // Two buffers of dS^T, the tiles 1024-byte aligned.
  static constexpr std::size_t kSmemBytes =
      2 * kKVBytes + 4 * kQBytes + 2 * kDsBytes + 2 * kStatsBytes + kDqBytes + 1024;
  // With a mask: its entries of one block, [kBlockM queries][kBlockN keys] (mask_slot), room
  // for float32; at D = 64 in place of the second dS^T buffer and 32 KB more (227 KB in all).
  static constexpr uint32_t kMaskBytes = kBlockM * kBlockN * 4;
  static constexpr bool kMaskedDsSingle = kHeadDim == 64;
  static constexpr std::size_t kMaskedSmemBytes =
      kSmemBytes - (kMaskedDsSingle ? kDsBytes : 0) + kMaskBytes;
  // Without a mask, room for a second dQ stage in the mask tile's place (the instances without
  // SDPA's arguments use it): a block's bulk reduction then has the next block's time to read
  // its stage (with one, the CTA waited for it: perf/NOTES.md, v32).
  static constexpr std::size_t kUnmaskedSmemBytes = kSmemBytes + kDqBytes;

  static_assert(kHeadDim == 64 || kHeadDim == 128, "one or two 64-element runs per row");
  static_assert(kBlockM == 64 || kBlockM == 128, "wgmma N of S^T: 64 or 128 queries");
  static_assert(kDqRowGroups * (kHeadDim / 64) == 2, "one 64 x 64 dQ tile per warpgroup");
  static_assert(Fallback::kBlockN == kBlockN, "the mma.sync backward's grid and workspace");
  static_assert(128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters <= 65536,
                "setmaxnreg: more registers than the SM has");
  static_assert(kMaskedSmemBytes <= 227 * 1024 && kUnmaskedSmemBytes <= 227 * 1024,
                "over sm_90's 227 KB of shared memory per block");
};

// Tile's kernel with a work item per K/V item and key block, walking the kv_group query items
// that read it and summing their dK and dV in registers (flash_backward_sm90_producer.cuh's
// walk_of), stored once per K/V item. A separate instance, so that the per-query-item kernels
// keep their registers (the walk in them spilled 50-150 bytes more, ptxas).
template <class Tile>
struct GroupSummingTile : Tile {
  static constexpr bool kSumsGroup = true;
};

}  // namespace sm90

}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_BACKWARD_TILING_CUH_
