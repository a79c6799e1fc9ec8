// The producer of the warp-specialized Hopper forward's CTA (flash_forward_sm90_ws_cta.cuh, whose
// header comment gives the roles, the pipeline and shared memory): one thread that issues every
// TMA load, and the walk over an item's key blocks that it and the consumers share.
//
// No torch includes: CI compile-checks this header for sm_90a and sm_90 without a GPU.
#ifndef FIXED_FLASH_FORWARD_SM90_WS_PRODUCER_CUH_
#define FIXED_FLASH_FORWARD_SM90_WS_PRODUCER_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "attention_problem.cuh"               // AttentionProblem, ceil_div
#include "flash_forward_sm90_ws_args.cuh"      // the mask's tiles: which to skip, their loads
#include "flash_forward_sm90_ws_schedule.cuh"  // WorkItem, schedule, SplitTail
#include "flash_forward_sm90_ws_tile.cuh"      // Barriers
#include "sm90_pipeline.cuh"                   // mbarriers, TMA

namespace fixed_attention {
namespace kernels {
namespace flash {
namespace sm90_ws {

// The next key block of item w after `block` that the mask does not hide entirely (w.n_blocks:
// none left); without a map of hidden tiles (`skips` false), block + 1. Producer and consumers
// walk the same blocks.
template <class F>
__device__ __forceinline__ int next_visible(const AttentionProblem& p, const WorkItem& w,
                                            int block, bool skips) {
  do {
    ++block;
  } while (skips && block < w.n_blocks &&
           hidden_block(p, w.b, w.m0, F::kBlockM, static_cast<int64_t>(block) * F::kBlockN,
                        F::kBlockN));
  return block;
}

#if FIXED_HAS_TENSOR_MAPS
// The producer: one thread issues every load. Q once per item; per key block that the mask
// leaves visible K, its mask tile (kArgs, with a mask) and V.
template <class F, int kArgs>
__device__ __forceinline__ void produce(const CUtensorMap* q_map, const CUtensorMap* k_map,
                                        const CUtensorMap* v_map, const CUtensorMap* mask_map,
                                        const Barriers<F> bar, uint32_t q_tile, uint32_t k_tiles,
                                        uint32_t v_tiles, uint32_t mask_tiles,
                                        const AttentionProblem& p, bool longest_first,
                                        const SplitTail split) {
  constexpr int kHalves = F::kHeadDim / 64, kValueHalves = F::kValueDim / 64;
  const int64_t row_blocks = ceil_div(p.len_q, F::kBlockM);
  const bool has_mask = kArgs != kNoArgs && p.mask != nullptr;
  const bool skips = kArgs != kNoArgs && skips_hidden_blocks(p);
  const bool skips_zero = has_mask && skips_zero_blocks(p);
  uint32_t mask_pipe = 0;  // mask tiles loaded so far: the mask ring's position
  uint32_t pipe = 0;  // key blocks loaded so far, over all items: the ring's position
  for (uint32_t round = 0;; ++round) {
    WorkItem w;
    int part = -1;  // the part's unit in the last round's split, -1 for a whole item
    if (!schedule<F>(p, round, row_blocks, longest_first, split, w, part)) {
      break;
    }
    const int kv_item = static_cast<int>(w.b / p.kv_group);  // under GQA, its group's K and V
    mbarrier_wait(bar.q_empty(), (round & 1) ^ 1);  // every consumer warp done with Q
    mbarrier_arrive_expect_tx(bar.q_full(), F::kQBytes);
#pragma unroll
    for (int half = 0; half < kHalves; ++half) {
      tma_load_3d(q_tile + half * F::kBlockM * F::kRowBytes, q_map, 64 * half,
                  static_cast<int>(w.m0), static_cast<int>(w.b), bar.q_full());
    }
    for (int block = next_visible<F>(p, w, w.first - 1, skips); block < w.n_blocks;
         block = next_visible<F>(p, w, block, skips), ++pipe) {
      const uint32_t stage = pipe % F::kStages;
      const uint32_t parity = (pipe / F::kStages) & 1;
      const int key0 = block * F::kBlockN;
      mbarrier_wait(bar.k_empty(stage), parity ^ 1);
      mbarrier_arrive_expect_tx(bar.k_full(stage), F::kKBytes);
#pragma unroll
      for (int half = 0; half < kHalves; ++half) {
        tma_load_3d(k_tiles + stage * F::kKBytes + half * F::kBlockN * F::kRowBytes, k_map,
                    64 * half, key0,
                    kv_item, bar.k_full(stage));
      }
      if constexpr (kArgs != kNoArgs && F::kMaskStages > 0) {
        if (has_mask && !(skips_zero && zero_block(p, w.b, w.m0, F::kBlockM, key0, F::kBlockN))) {
          const uint32_t mask_stage = mask_pipe % F::kMaskStages;
          mbarrier_wait(bar.mask_empty(mask_stage), ((mask_pipe / F::kMaskStages) & 1) ^ 1);
          mbarrier_arrive_expect_tx(bar.mask_full(mask_stage), mask_block_bytes<F>(p));
          load_mask_block<F>(mask_map, mask_tiles + mask_stage * F::kMaskBytes, p, w.b, w.m0,
                             key0, bar.mask_full(mask_stage));
          ++mask_pipe;
        }
      }
      mbarrier_wait(bar.v_empty(stage), parity ^ 1);
      mbarrier_arrive_expect_tx(bar.v_full(stage), F::kVBytes);
#pragma unroll
      for (int half = 0; half < kValueHalves; ++half) {
        tma_load_3d(v_tiles + stage * F::kVBytes + half * F::kBlockN * F::kRowBytes, v_map,
                    64 * half, key0,
                    kv_item, bar.v_full(stage));
      }
    }
  }
}
#endif  // FIXED_HAS_TENSOR_MAPS

}  // namespace sm90_ws
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_FORWARD_SM90_WS_PRODUCER_CUH_
