// The producer warpgroup of the wgmma backward (flash_backward_sm90_cta.cuh; FlashAttention-3's
// split, issue 30): the CTA's shared-memory map and mbarriers, the order in which work items and
// query blocks are visited, and the two threads that serve the consumer warpgroups:
//   - the loader (thread 0 of warp 0) loads K and V once per work item and Q, dO, lse and delta
//     of every query block into two buffers by TMA and 1-D bulk copies;
//   - the reducer (thread 0 of warp 1) adds each block's staged dQ to the float32 workspace
//     with one cp.reduce.async.bulk once every consumer thread has staged its part.
// Both walk the consumers' sequence of items and blocks (visit_blocks) and meet them only on
// mbarriers, so no consumer warp carries a load or waits on a bulk copy's progress itself, and
// the consumers' one CTA barrier per block is a named barrier among themselves.
//
// No torch includes: CI compile-checks the kernels for sm_90a and sm_90 without a GPU.
#ifndef FIXED_FLASH_BACKWARD_SM90_PRODUCER_CUH_
#define FIXED_FLASH_BACKWARD_SM90_PRODUCER_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "attention_problem.cuh"     // AttentionProblem, ceil_div
#include "flash_backward_tiling.cuh"  // BackwardTile
#include "flash_common.cuh"           // ScoreArgs, masks' hidden blocks
#include "sm90_pipeline.cuh"          // mbarriers, TMA loads
#include "wgmma.cuh"                  // bulk reductions

namespace fixed_attention {
namespace kernels {
namespace flash {
namespace sm90 {

#if FIXED_HAS_TENSOR_MAPS
// Shared memory (BackwardTile lists it), from the dynamic allocation's address: K, V; Q, dO,
// lse, delta in two buffers; dS^T's first buffer; the dQ stage; then dS^T's second buffer and
// the mask's tile [BM][BN] (mask_slot). At D = 64 with a mask, the mask's tile in place of dS^T's
// second buffer (kMaskedDsSingle). Without SDPA's arguments, a second dQ stage in the mask
// tile's place (with them, one: registers); block n stages into stage(n).
template <class F, int kArgs>
struct BackwardSmem {
  static constexpr bool kTwoStages = kArgs == kNoArgs;
  uint32_t k_tile, v_tile, q_tiles, do_tiles, ds_tile, stats, dq_stage, ds_second, mask_tile;
  uint32_t barriers;
  bool ds_single;

  __device__ __forceinline__ BackwardSmem(uint32_t smem_base, bool has_mask) {
    k_tile = (smem_base + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
    v_tile = k_tile + F::kKVBytes;
    q_tiles = v_tile + F::kKVBytes;         // 2 buffers of kQBytes
    do_tiles = q_tiles + 2 * F::kQBytes;    // 2 buffers of kQBytes
    ds_tile = do_tiles + 2 * F::kQBytes;    // [BM / 64][BN][64]
    stats = ds_tile + F::kDsBytes;          // 2 x (lse [BM], delta [BM])
    dq_stage = stats + 2 * F::kStatsBytes;  // [BM][D] f32, swizzled_dq_chunk
    ds_single = F::kMaskedDsSingle && has_mask;
    ds_second = dq_stage + F::kDqBytes;
    mask_tile = ds_second + (ds_single ? 0u : F::kDsBytes);
    // The mbarriers: below the tiles where aligning them left room, else past them (the
    // launch's 1024 spare bytes hold either way).
    const uint32_t past_tiles = has_mask ? F::kMaskBytes : kTwoStages ? F::kDqBytes : 0u;
    barriers = k_tile - smem_base >= F::kBarrierBytes ? smem_base : mask_tile + past_tiles;
  }
  // Buffer c of Q, dO, lse and delta has landed (full) / every consumer thread is done with it
  // (empty); K and V have landed (kv_full) / every consumer thread has stored its dK and dV
  // from their tiles (kv_empty); dQ stage s is staged by every consumer thread (staged) / read
  // by its bulk reduction (stage_free). Each consumer thread arrives itself (as CUTLASS's
  // pipelines count consumer threads): its own accesses then come before the producer's.
  __device__ __forceinline__ uint32_t full(uint32_t c) const { return barriers + 8 * c; }
  __device__ __forceinline__ uint32_t empty(uint32_t c) const { return barriers + 16 + 8 * c; }
  __device__ __forceinline__ uint32_t kv_full() const { return barriers + 32; }
  __device__ __forceinline__ uint32_t kv_empty() const { return barriers + 40; }
  __device__ __forceinline__ uint32_t staged(uint32_t s) const { return barriers + 48 + 8 * s; }
  __device__ __forceinline__ uint32_t stage_free(uint32_t s) const {
    return barriers + 64 + 8 * s;
  }
  // Block n's dQ stage, its index and the parity of its use (n / stages) on that stage's
  // barriers.
  static __device__ __forceinline__ uint32_t stage_index(uint32_t n) {
    return kTwoStages ? n & 1u : 0u;
  }
  static __device__ __forceinline__ uint32_t stage_parity(uint32_t n) {
    return (kTwoStages ? n >> 1 : n) & 1u;
  }
  __device__ __forceinline__ uint32_t stage(uint32_t n) const {
    return stage_index(n) != 0u ? mask_tile : dq_stage;
  }

  // Thread 0, before the CTA's first barrier.
  __device__ __forceinline__ void init() const {
    static_assert(80 <= F::kBarrierBytes, "ten mbarriers");
    for (uint32_t c = 0; c < 2; ++c) {
      mbarrier_init(full(c), 1);
      mbarrier_init(empty(c), F::kConsumerThreads);
      mbarrier_init(staged(c), F::kConsumerThreads);
      mbarrier_init(stage_free(c), 1);
    }
    mbarrier_init(kv_full(), 1);
    mbarrier_init(kv_empty(), F::kConsumerThreads);
    fence_mbarrier_init();
  }
};

// Work item `item` of the grid-stride loop: its K/V item kv and first key n0 (flash_backward.cuh's
// order: longest first where wgmma_backward_longest_first_pays, else batch-major). In a tile
// that sums GQA's groups (F::kSumsGroup) an item covers the kv_group query items that read K/V
// item kv (kv_group kv ..): its dK and dV sum theirs in registers, so that no per-head dK, dV
// is written and summed after the kernel. In the others kv is the query item (walked_items 1).
struct BackwardItem {
  int64_t kv, n0;
};
template <class F>
__device__ __forceinline__ BackwardItem backward_item(int64_t item, int64_t key_blocks,
                                                      int64_t work_items, bool longest_first) {
  const int64_t kv = longest_first ? item % work_items : item / key_blocks;
  const int64_t n0 = (longest_first ? item / work_items : item % key_blocks) * F::kBlockN;
  return {kv, n0};
}

// The first query block after m that can see keys n0 .. n0 + BN - 1 of query item b and that
// the mask does not hide entirely (L or more: none); without a map of hidden tiles (`skips`
// false), m + BM.
template <class F>
__device__ __forceinline__ int64_t next_visible(const AttentionProblem& p, bool skips, int64_t b,
                                                int64_t n0, int64_t m) {
  do {
    m += F::kBlockM;
  } while (skips && m < p.len_q && hidden_block(p, b, m, F::kBlockM, n0, F::kBlockN));
  return m;
}
// The row before a query item's walk over keys n0 ..: causal rows before n0 see none of them,
// so it starts at the query block holding row n0.
template <class F>
__device__ __forceinline__ int64_t first_row(const AttentionProblem& p, int64_t n0) {
  return (p.causal ? (n0 / F::kBlockM) * F::kBlockM : 0) - F::kBlockM;
}
// A query block of a work item: query item b and first row m0 (L or more: the item has no
// block left). An item walks each of its query items' blocks in turn, from its first query
// item to `last` (kv_group (kv + 1) - 1): next_query_block gives the block after `at`, and
// {b, first_row} stands before query item b's first.
struct QueryBlock {
  int64_t b, m0;
};
template <class F>
__device__ __forceinline__ QueryBlock next_query_block(const AttentionProblem& p, bool skips,
                                                       QueryBlock at, int64_t last,
                                                       int64_t n0) {
  if constexpr (!F::kSumsGroup) {  // one query item: no walk to the next (nor its registers)
    return {at.b, next_visible<F>(p, skips, at.b, n0, at.m0)};
  } else {
    while (true) {
      const int64_t m = next_visible<F>(p, skips, at.b, n0, at.m0);
      if (m < p.len_q || at.b >= last) {
        return {at.b, m};
      }
      at = {at.b + 1, first_row<F>(p, n0)};  // a query item none of whose blocks sees n0 ..
    }
  }
}
// The query items a work item walks: its K/V item's kv_group where the tile sums them, else one.
template <class F>
__device__ __forceinline__ int64_t walked_items(const AttentionProblem& p) {
  if constexpr (F::kSumsGroup) {
    return p.kv_group;
  } else {
    return 1;
  }
}
// A work item's first query block (before it: {first query item, first_row}) and `last`.
struct ItemWalk {
  QueryBlock first;
  int64_t last;
};
template <class F>
__device__ __forceinline__ ItemWalk walk_of(const AttentionProblem& p, bool skips,
                                            const BackwardItem& it) {
  const int64_t group = walked_items<F>(p), first = it.kv * group, last = first + group - 1;
  return {next_query_block<F>(p, skips, {first, first_row<F>(p, it.n0)}, last, it.n0), last};
}

// Whether the walk skips the blocks that the mask hides: the mask-only instance (with dropout,
// the search spilled 500 bytes more at D = 64, ptxas).
template <int kArgs>
__device__ __forceinline__ bool skips_blocks(const AttentionProblem& p) {
  return kArgs == kMaskOnly && p.mask != nullptr && skips_hidden_blocks(p);
}

// Calls start_item(b, n0, items, m0, number) once per work item of this CTA (b: its first query
// item with a visible block; m0: that block, L or more if none; `number`: the number that block
// gets), then block(b, m0, number) for each of its query blocks, `number` counting the CTA's
// blocks over all of its items.
template <class F, int kArgs, class StartItem, class Block>
__device__ __forceinline__ void visit_blocks(const AttentionProblem& p, bool longest_first,
                                             const StartItem& start_item, const Block& block) {
  const bool skips = skips_blocks<kArgs>(p);
  const int64_t key_blocks = ceil_div(p.len_kv, F::kBlockN);
  const int64_t work_items = p.batch / walked_items<F>(p);
  uint32_t number = 0, items = 0;
  for (int64_t item = blockIdx.x; item < work_items * key_blocks; item += gridDim.x, ++items) {
    const BackwardItem it = backward_item<F>(item, key_blocks, work_items, longest_first);
    const ItemWalk walk = walk_of<F>(p, skips, it);
    QueryBlock at = walk.first;
    start_item(at.b, it.n0, items, at.m0, number);
    for (; at.m0 < p.len_q; at = next_query_block<F>(p, skips, at, walk.last, it.n0), ++number) {
      block(at.b, at.m0, number);
    }
  }
}

// The loader: K and V of each item once the consumers have stored the last item's dK and dV
// from their tiles; Q, dO (past L: zeros), lse, delta of block `number` into buffer number & 1
// once every consumer thread is done with block number - 2. An item's first block is requested
// before its K and V, so that it loads while the consumers finish the last item.
template <class F, int kArgs>
__device__ __forceinline__ void load_blocks(const CUtensorMap* q_map, const CUtensorMap* k_map,
                                            const CUtensorMap* v_map, const CUtensorMap* do_map,
                                            const float* lse_log2, const float* delta,
                                            const AttentionProblem& p, int64_t rows_padded,
                                            bool longest_first,
                                            const BackwardSmem<F, kArgs>& sm) {
  constexpr int D = F::kHeadDim, BM = F::kBlockM, BN = F::kBlockN;
  constexpr uint32_t kRowBytes = F::kRowBytes;
  const auto load_query_block = [&](int64_t b, int64_t m, uint32_t number) {
    const uint32_t c = number & 1u;
    mbarrier_wait(sm.empty(c), ((number >> 1) & 1u) ^ 1u);  // round 0: free at once
    mbarrier_arrive_expect_tx(sm.full(c), 2 * F::kQBytes + F::kStatsBytes);
#pragma unroll
    for (int run = 0; run < D / 64; ++run) {
      const uint32_t to = c * F::kQBytes + static_cast<uint32_t>(run) * BM * kRowBytes;
      tma_load_3d(sm.q_tiles + to, q_map, 64 * run, static_cast<int>(m), static_cast<int>(b),
                  sm.full(c));
      tma_load_3d(sm.do_tiles + to, do_map, 64 * run, static_cast<int>(m), static_cast<int>(b),
                  sm.full(c));
    }
    const uint32_t stats_c = sm.stats + c * F::kStatsBytes;
    bulk_load(stats_c, lse_log2 + b * rows_padded + m, BM * 4, sm.full(c));
    bulk_load(stats_c + BM * 4, delta + b * rows_padded + m, BM * 4, sm.full(c));
  };
  uint32_t first_number = 0;  // the number of the item's first block, loaded with K and V
  visit_blocks<F, kArgs>(
      p, longest_first,
      [&](int64_t b, int64_t n0, uint32_t items, int64_t m0, uint32_t number) {
        if (m0 < p.len_q) {
          load_query_block(b, m0, number);
        }
        first_number = number;
        mbarrier_wait(sm.kv_empty(), (items & 1u) ^ 1u);  // the first item: free at once
        const int kv_item = static_cast<int>(b / p.kv_group);
        mbarrier_arrive_expect_tx(sm.kv_full(), 2 * F::kKVBytes);
#pragma unroll
        for (int run = 0; run < D / 64; ++run) {
          const uint32_t to = static_cast<uint32_t>(run) * BN * kRowBytes;
          tma_load_3d(sm.k_tile + to, k_map, 64 * run, static_cast<int>(n0), kv_item,
                      sm.kv_full());
          tma_load_3d(sm.v_tile + to, v_map, 64 * run, static_cast<int>(n0), kv_item,
                      sm.kv_full());
        }
      },
      [&](int64_t b, int64_t m0, uint32_t number) {
        if (number != first_number) {
          load_query_block(b, m0, number);
        }
      });
}

// The reducer: block `number`'s staged dQ, once every consumer thread has staged its part, added
// to the workspace rows m0 .. m0 + BM - 1 as one bulk reduction; its stage is free again once
// the reduction has read it. The consumers see nothing of the reduction but stage_free.
template <class F, int kArgs>
__device__ __forceinline__ void reduce_dq(float* dq_accum, const AttentionProblem& p,
                                          int64_t rows_padded, bool longest_first,
                                          const BackwardSmem<F, kArgs>& sm) {
  using Smem = BackwardSmem<F, kArgs>;
  visit_blocks<F, kArgs>(
      p, longest_first, [](int64_t, int64_t, uint32_t, int64_t, uint32_t) {},
      [&](int64_t b, int64_t m0, uint32_t number) {
        const uint32_t s = Smem::stage_index(number);
        mbarrier_wait(sm.staged(s), Smem::stage_parity(number));
        bulk_reduce_add_f32(dq_accum + (b * rows_padded + m0) * F::kHeadDim, sm.stage(number),
                            F::kDqBytes);
        bulk_commit_group();
        bulk_wait_group_read_all();
        mbarrier_arrive(sm.stage_free(s));
      });
  bulk_wait_group_all();  // dq_accum written before the CTA exits
}
#endif  // FIXED_HAS_TENSOR_MAPS

}  // namespace sm90
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_BACKWARD_SM90_PRODUCER_CUH_
