// The CTA of the warp-specialized Hopper forward (flash_forward_sm90_ws.cuh): its pipeline, the
// producer (flash_forward_sm90_ws_producer.cuh) and the consumers (sm_90a); its tilings are
// flash_forward_sm90_ws_tile.cuh's. The arithmetic is flash_forward_sm90.cuh's, operation for
// operation (same online softmax on raw scores, same masks, same dropout bits); with key blocks
// of 64 the outputs are the same bits (perf/fwd_sm90_check.cu checks it).
//
// ---------------------------------------------------------------------------------- roles
// One CTA per SM, persistent: in round r CTA c takes work item r G + c (G CTAs; odd rounds
// reversed; a last round at most half full split along the keys: flash_forward_sm90_ws_
// schedule.cuh), an item being kBlockM (128 or 192) query rows of one batch item,
// numbered in flash_forward_sm90.cuh's order (under causality the blocks end at L, and the first
// may start before row 0: work_item). A producer warpgroup and kConsumers (2 or 3)
// consumer warpgroups (384 or 512 threads):
//   producer (warpgroup 0, one thread): TMA loads of Q (once per item) and of K, V and the
//     mask's tile (per key block; blocks the mask hides entirely are skipped) into shared memory,
//     each announced on an mbarrier ("full"), each waiting for its buffer's "empty" mbarrier
//     first. K and V live in a ring of kStages buffers each, the mask in one of kMaskStages.
//   consumers (warpgroups 1, 2 (and 3), rows 0-63, 64-127 (and 128-191) of the item): wgmma on
//     the buffers, softmax in registers, and each warp signals "empty" once its products have
//     read a buffer.
// setmaxnreg moves registers from the producer (24 or 32 per thread) to the consumers (240 of
// two, 160 of three): 128 x 24 + 256 x 240 = 384 x 168, 128 x 32 + 384 x 160 = 512 x 128.
//
// ----------------------------------------------------------------- the consumers' loop
// Per key block j, with S_j = Q K_j^T and P_j its probabilities:
//   issue S_j; issue O += P_(j-1) V_(j-1); wait for S_j (K_j released); softmax of S_j; wait
//   for the second product (V_(j-1) released); O *= the rescale of block j; P_j packed to 16
//   bits. ptxas moves that second wait to the top of the softmax's basic block (perf/NOTES.md,
//   v48, v49), so the softmax runs under the other warpgroups' products, not its own (the loop
//   says why its code follows that order, except in ping-pong between two).
// After the last block, O += P_last V_last, then O / row sums and lse out
// (flash_forward_sm90_ws_epilogue.cuh; in the tilings with kStagesO, the two-consumer ping-pong
// ones and Tile64Staged, through the item's last K and V buffers and TMA stores). The sequence of
// operations on O, the row maxima and the row sums is flash_forward_sm90.cuh's; only the issue
// order differs.
// Ping-pong (kPingPong): the consumers take turns issuing their products (named barriers 1, 2
// and, with three consumers, 4; 3 is the split's), in rotation where there are three, so one
// warpgroup's softmax runs while the others' products occupy the tensor cores. Left to the
// warp schedulers, three warpgroups at D = 64 ran 2-4% slower (perf/NOTES.md, v55).
//
// ------------------------------------------------------------------------- shared memory
// 1024-byte aligned: Q (kBlockM x D), kStages K (kBlockN x D) and V (kBlockN x kValueDim)
// buffers, each as 64-column halves of [rows][64] with the 128-byte swizzle (TMA's 64-element
// box with CU_TENSOR_MAP_SWIZZLE_128B, wgmma.cuh's descriptors); kMaskStages mask tiles
// (flash_forward_sm90_ws_args.cuh). Then the mbarriers: "full" ones expect the producer's
// arrival with the bytes, "empty" ones one arrival per consumer warp.
//
// No torch includes: CI compile-checks this header for sm_90a and sm_90 without a GPU.
#ifndef FIXED_FLASH_FORWARD_SM90_WS_CTA_CUH_
#define FIXED_FLASH_FORWARD_SM90_WS_CTA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstddef>
#include <cstdint>

#include "attention_problem.cuh"  // AttentionProblem, ceil_div, min64, ...
#include "flash_common.cuh"       // exp2_approx, pack2, smem_addr, ...
#include "flash_forward_sm90_ws_args.cuh"  // the mask's tiles, dropout's bits
#include "flash_forward_sm90_ws_epilogue.cuh"  // an item's O and lse out
#include "flash_forward_sm90_ws_producer.cuh"  // the producer, next_visible
#include "flash_forward_sm90_ws_schedule.cuh"  // items, rounds, the last round's split
#include "flash_forward_sm90_ws_tile.cuh"  // Tile, Barriers
#include "sm90_pipeline.cuh"      // mbarriers, TMA, setmaxnreg, named barriers
#include "wgmma.cuh"              // wgmma.mma_async and descriptors

namespace fixed_attention {
namespace kernels {
namespace flash {
namespace sm90_ws {

// The scores of key block `block` (in s: raw, or scaled and masked where there is a mask) to
// probabilities: the online softmax step of both Hopper forwards (flash_forward_sm90.cuh's
// kernel calls it too, so that their bits agree by construction): masks where the block crosses the
// end of the keys or (causal) the diagonal, the new row maxima, the rescale of rows whose maximum
// grew (1 for the others), the row sums (of the undropped probabilities), dropout's factors
// (has_dropout: kept holds the block's keep bits). `unit`: c = |scale| log2(e) for raw scores, 1
// for masked ones. Returns whether some row of this thread grew.
template <class F>
__device__ __forceinline__ bool softmax_step(float (&s)[F::kNTiles * 4], Rows& r,
                                             float (&rescale)[2], int block,
                                             const AttentionProblem& p, float unit,
                                             const uint32_t (&kept)[2][F::kNTiles / 4],
                                             bool has_dropout, float keep_scale) {
  constexpr int kBlockM = F::kBlockM, kBlockN = F::kBlockN, kNTiles = F::kNTiles;
  constexpr unsigned kFullMask = 0xffffffffu;
  const int64_t n0 = static_cast<int64_t>(block) * kBlockN;
  const bool tail = n0 + kBlockN > p.len_kv;
  const bool diagonal = p.causal && n0 + kBlockN - 1 > r.m0 + r.warp_row0;
  if (tail || diagonal) {
    const int key_limit = static_cast<int>(min64(p.len_kv - n0, kBlockN));
    // Key column c of row i (of the warp) is visible while c <= diag + i; clamped to int.
    int64_t diag = p.causal ? r.m0 + r.warp_row0 - n0 : kBlockN;
    diag = diag > kBlockN ? kBlockN : diag < -kBlockM ? -kBlockM : diag;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = r.g + 8 * (e >> 1);
        const int col = 8 * j + 2 * r.t + (e & 1);
        if (col >= key_limit || col > static_cast<int>(diag) + row) {
          s[4 * j + e] = -INFINITY;
        }
      }
    }
  }
  bool grew = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float block_max = r.row_max[h];
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      block_max = fmaxf(block_max, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
    }
    block_max = fmaxf(block_max, __shfl_xor_sync(kFullMask, block_max, 1));
    block_max = fmaxf(block_max, __shfl_xor_sync(kFullMask, block_max, 2));
    // A row with every key so far masked keeps max -inf: its probabilities are 2^-inf = 0.
    const float max_log2 = block_max == -INFINITY ? 0.f : block_max * unit;
    const bool same = block_max == r.row_max[h];
    grew = grew || !same;
    rescale[h] = same ? 1.f : exp2_approx(fmaf(r.row_max[h], unit, -max_log2));
    r.row_max[h] = block_max;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float prob = exp2_approx(fmaf(s[4 * j + 2 * h + c], unit, -max_log2));
        sum += prob;
        s[4 * j + 2 * h + c] =
            has_dropout ? prob * dropout_factor(kept[h][j / 4], 2 * (j % 4) + c, keep_scale)
                        : prob;
      }
    }
    r.row_sum[h] = r.row_sum[h] * rescale[h] + sum;
  }
  return grew;
}

#if FIXED_HAS_TENSOR_MAPS
// S = Q K^T for one key block: k-step ks covers head dims 16 ks .. 16 ks + 15, half ks / 4 of
// each tile, 32 bytes into each 128-byte row.
template <typename T, class F>
__device__ __forceinline__ void issue_s(float (&s)[F::kNTiles * 4], uint32_t q_rows,
                                        uint32_t k_tile) {
  const TileDescriptor q_desc(q_rows, 16, 1024), k_desc(k_tile, 16, 1024);
#pragma unroll
  for (int ks = 0; ks < F::kHeadDim / 16; ++ks) {
    const uint32_t half = static_cast<uint32_t>(ks >> 2);
    const uint32_t step = static_cast<uint32_t>(ks & 3) * 32;
    const uint64_t desc_q = q_desc.at(half * F::kBlockM * F::kRowBytes + step);
    const uint64_t desc_k = k_desc.at(half * F::kBlockN * F::kRowBytes + step);
    if constexpr (F::kBlockN == 80) {
      wgmma_m64n80k16_ss<T>(s, desc_q, desc_k, ks > 0);
    } else if constexpr (F::kBlockN == 176) {
      wgmma_m64n176k16_ss<T>(s, desc_q, desc_k, ks > 0);
    } else if constexpr (F::kBlockN == 128) {
      wgmma_m64n128k16_ss<T>(s, desc_q, desc_k, ks > 0);
    } else {
      wgmma_m64n64k16_ss<T>(s, desc_q, desc_k, ks > 0);
    }
  }
  wgmma_commit_group();
}

// O += P V for one key block: P's A fragment per 16 keys, V MN-major (flash_forward_sm90.cuh).
// live_steps: the 16-key steps where P may be nonzero, from the first (the caller's bound: the
// end of the keys, or a causal diagonal); past them P is 0, and their products add nothing to O.
template <typename T, class F>
__device__ __forceinline__ void issue_pv(float (&o)[F::kDTiles * 4],
                                         const uint32_t (&p_frag)[F::kBlockN / 16][4],
                                         uint32_t v_tile, int live_steps = F::kBlockN / 16) {
  const TileDescriptor v_desc(v_tile, F::kBlockN * F::kRowBytes, 1024);
#pragma unroll
  for (int kk = 0; kk < F::kBlockN / 16; ++kk) {
    if (kk >= live_steps) {
      break;
    }
    const uint64_t desc_v = v_desc.at(kk * 16 * F::kRowBytes);
    if constexpr (F::kValueDim == 256) {  // two products of 128 columns: V's parts 0-1, 2-3
      const uint64_t desc_v_upper =
          v_desc.at(2 * F::kBlockN * F::kRowBytes + kk * 16 * F::kRowBytes);
      wgmma_m64n256k16_rs<T>(o, p_frag[kk], desc_v, desc_v_upper);
    } else if constexpr (F::kValueDim == 128) {
      wgmma_m64n128k16_rs<T>(o, p_frag[kk], desc_v);
    } else {
      wgmma_m64n64k16_rs<T>(o, p_frag[kk], desc_v);
    }
  }
  wgmma_commit_group();
}

// P's A fragment for keys 16 kk .. 16 kk + 15: S's n-tiles 2 kk and 2 kk + 1 in pairs.
template <typename T, class F>
__device__ __forceinline__ void pack_p(uint32_t (&p_frag)[F::kBlockN / 16][4],
                                       const float (&s)[F::kNTiles * 4]) {
#pragma unroll
  for (int kk = 0; kk < F::kBlockN / 16; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      p_frag[kk][r] = pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
    }
  }
}

// This warp's signal that it is done with a buffer (the "empty" barriers count warps).
__device__ __forceinline__ void release(uint32_t barrier, int lane) {
  __syncwarp();
  if (lane == 0) {
    mbarrier_arrive(barrier);
  }
}

// A consumer warpgroup (`consumer` 0 .. kConsumers - 1: rows 64 consumer .. of each item). The
// first key block is peeled off the loop, so that no wgmma is issued under a condition inside
// it: ptxas then keeps the two products of an iteration in flight together (with a conditional
// one it serialized them). kArgs: the instantiation that adds a mask and draws dropout.
template <typename T, class F, int kArgs>
__device__ __forceinline__ void consume(T* __restrict__ out, float* __restrict__ lse,
                                        const CUtensorMap* o_map, const Barriers<F> bar,
                                        uint32_t q_tile, uint32_t k_tiles, uint32_t v_tiles,
                                        uint32_t mask_tiles,
                                        const AttentionProblem& p, bool longest_first,
                                        const SplitTail split, int consumer, int warp_in_group,
                                        int lane) {
  constexpr int Dv = F::kValueDim, kBlockM = F::kBlockM, kBlockN = F::kBlockN;
  constexpr int kNTiles = F::kNTiles, kDTiles = F::kDTiles, kStages = F::kStages;
  constexpr int kMaskRing = F::kMaskStages > 0 ? F::kMaskStages : 1;
  constexpr uint32_t kKBytes = F::kKBytes, kVBytes = F::kVBytes;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr unsigned kFullMask = 0xffffffffu;
  constexpr uint32_t kTurnThreads = 256;  // the warpgroup that passes the turn, the one taking it
  const auto turn_barrier = [](int c) { return c == 2 ? 4u : 1u + static_cast<uint32_t>(c); };
  const uint32_t my_turn = turn_barrier(consumer),
                 next_turn = turn_barrier(consumer + 1 == F::kConsumers ? 0 : consumer + 1);
  // Without turns, and with three warpgroups in rotation, the wait for P V goes before the
  // softmax (below); with two in ping-pong, after it.
  constexpr bool kFusedOrder = !F::kPingPong || F::kConsumers == 3;
  // O staged (stages_o) at a whole item's end: the last consumer in the turns' order writes it
  // into V_last's buffer once every other consumer's last P V is done, each other consumer c into
  // its 64 rows of K_last's once every other consumer's last S is done (named barrier 5 + c:
  // consumer c waits, the others arrive; one use per item, as the turns keep any warpgroup from
  // arriving twice before the waiting one has waited). Each warp releases its buffer before its
  // next item's first S, when its stores have read it (by then long done); the producer reloads
  // that buffer one or more blocks into the next item.
  constexpr bool kStagesO = stages_o<F, kArgs>();
  constexpr uint32_t kStageBarrier = 5, kStageThreads = 128 * F::kConsumers;
  // (With two consumers the tests are spelled as before three could stage: ptxas then keeps
  // the code of v56, whose kernels were measured.)
  constexpr bool kPair = F::kConsumers == 2;
  const bool o_in_k = kPair ? consumer == 0 : consumer + 1 < F::kConsumers;  // else V_last's
  int o_stage = -1;  // the stage whose buffer holds this warp's staged O; -1: none
  const auto release_o_buffer = [&] {
    if (kStagesO && o_stage >= 0) {
      bulk_wait_group_read_all();  // a no-op but in the lane that issued the stores
      release(o_in_k ? bar.k_empty(o_stage) : bar.v_empty(o_stage), lane);
      o_stage = -1;
    }
  };
  // After S_j's wait: releases K_j, but the item's last K where O goes into it; and tells the
  // consumers that write O into K_last that this one is done with it. (A part of a split item
  // keeps the same steps, though its O goes to the split's workspace: a branch on it here
  // serialized the 192-row tiling's wgmma, C7520.)
  const auto release_k = [&](uint32_t stage, bool last) {
    if (!(kStagesO && last && o_in_k)) {
      release(bar.k_empty(stage), lane);
    }
    if (kStagesO && last) {
#pragma unroll
      for (int c = 0; c + 1 < F::kConsumers; ++c) {
        if (kPair ? consumer == 1 : c != consumer) {
          named_barrier_arrive(kStageBarrier + static_cast<uint32_t>(c), kStageThreads);
        }
      }
    }
  };
  const uint32_t q_rows = q_tile + static_cast<uint32_t>(consumer * 64) * F::kRowBytes;
  const int64_t L = p.len_q;
  const int64_t row_blocks = ceil_div(L, kBlockM);
  // Raw scores, c = |scale| log2(e) > 0; with a mask, scaled scores (unit 1); dropout after the
  // row sums (flash_forward_sm90.cuh).
  const bool negate = p.scale < 0.f;
  const float scale_log2 = fmaxf(fabsf(p.scale) * kLog2e, FLT_MIN);
  const bool has_mask = kArgs != kNoArgs && F::kMaskStages > 0 && p.mask != nullptr;
  const bool has_dropout = kArgs == kMaskAndDropout && p.dropout_p > 0.f;
  const bool skips = kArgs != kNoArgs && skips_hidden_blocks(p);
  const bool skips_zero = has_mask && skips_zero_blocks(p);
  const float unit = has_mask ? 1.f : scale_log2;
  const float mask_scale = fabsf(p.scale) * kLog2e;
  const bool mask_rows_vary = p.mask_stride_row != 0;
  const float keep_scale = dropout_scale(p.dropout_p);
  const uint32_t keep_threshold = dropout::threshold(p.dropout_p);
  const auto take_turn = [&] {
    if (F::kPingPong) {
      named_barrier_sync(my_turn, kTurnThreads);
    }
  };
  const auto pass_turn = [&] {
    if (F::kPingPong) {
      named_barrier_arrive(next_turn, kTurnThreads);
    }
  };

  if (F::kPingPong && consumer == F::kConsumers - 1) {
    named_barrier_arrive(next_turn, kTurnThreads);  // consumer 0 issues first
  }
  uint32_t pipe = 0;       // key blocks consumed so far, over all items: the K/V rings' position
  uint32_t mask_pipe = 0;  // mask tiles consumed so far: the mask ring's
  for (uint32_t round = 0;; ++round) {
    WorkItem w;
    int part = -1;  // the part's unit in the last round's split, -1 for a whole item
    if (!schedule<F>(p, round, row_blocks, longest_first, split, w, part)) {
      break;
    }
    Rows r{w.m0, consumer * 64 + warp_in_group * 16, lane >> 2, lane & 3,
           {-INFINITY, -INFINITY}, {0.f, 0.f}};
    float o[kDTiles * 4];
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) {
      o[i] = 0.f;
    }
    float s[kNTiles * 4];
    float rescale[2];
    uint32_t p_frag[kBlockN / 16][4];
    uint32_t kept[2][kNTiles / 4];
    // S_j's scores once its product is done: negated for a negative scale (exactly what
    // flash_forward_sm90.cuh's negated Q gives), then the block's mask added (scaled only where
    // the block's entries are all 0: the producer loaded none).
    const auto take_scores = [&](int block) {
      if (negate) {
#pragma unroll
        for (int i = 0; i < kNTiles * 4; ++i) {
          s[i] = -s[i];
        }
      }
      if (!has_mask) {
        return;
      }
      const int64_t n0 = static_cast<int64_t>(block) * kBlockN;
      if (skips_zero && zero_block(p, w.b, w.m0, kBlockM, n0, kBlockN)) {
        scale_unmasked<F>(s, r.warp_row0 + r.g, L - w.m0, mask_scale);
        return;
      }
      const uint32_t mask_stage = mask_pipe % kMaskRing;
      mbarrier_wait(bar.mask_full(mask_stage), (mask_pipe / kMaskRing) & 1);
      add_mask_tile<F>(s, mask_tiles + mask_stage * F::kMaskBytes, r.warp_row0 + r.g, r.t,
                       mask_rows_vary, L - w.m0, mask_scale);
      release(bar.mask_empty(mask_stage), lane);
      ++mask_pipe;
    };
    const auto draw = [&](int block) {  // dropout's bits, while the products run
      if (has_dropout) {
        draw_keep_bits<F>(kept, p, keep_threshold, w.b, w.m0 + r.warp_row0 + r.g,
                          static_cast<int64_t>(block) * kBlockN, r.g, r.t);
      }
    };
    mbarrier_wait(bar.q_full(), round & 1);
    int block = next_visible<F>(p, w, w.first - 1, skips);
    int following = block;  // the block after `block`
    if (block >= w.n_blocks) {
      release_o_buffer();
      release(bar.q_empty(), lane);  // every key hidden: zeros and lse -inf, as the wgmma kernel
    } else {
      // The first block: S alone.
      following = next_visible<F>(p, w, block, skips);
      uint32_t stage = pipe % kStages;
      mbarrier_wait(bar.k_full(stage), (pipe / kStages) & 1);
      release_o_buffer();
      take_turn();
      wgmma_fence_operands(s);
      wgmma_fence();
      issue_s<T, F>(s, q_rows, k_tiles + stage * kKBytes);
      pass_turn();
      draw(block);
      wgmma_wait_group<0>();
      wgmma_fence_operands(s);
      release_k(stage, following >= w.n_blocks);
      if (following >= w.n_blocks) {
        release(bar.q_empty(), lane);  // the item's last read of Q
      }
      take_scores(block);
      // O is 0: nothing to rescale.
      softmax_step<F>(s, r, rescale, block, p, unit, kept, has_dropout, keep_scale);
      pack_p<T, F>(p_frag, s);
      ++pipe;

      // Then S_j and P_(j-1) V_(j-1) in flight together, softmax of S_j under the latter.
      for (; following < w.n_blocks; ++pipe) {
        block = following;
        following = next_visible<F>(p, w, block, skips);
        stage = pipe % kStages;
        const uint32_t previous = (pipe - 1) % kStages;
        mbarrier_wait(bar.k_full(stage), (pipe / kStages) & 1);
        mbarrier_wait(bar.v_full(previous), ((pipe - 1) / kStages) & 1);
        take_turn();
        // Pin the accumulators' last writes (O's rescale) before the fence: ptxas serializes
        // every wgmma of a stage whose accumulators other instructions define inside it.
        wgmma_fence_operands(o);
        wgmma_fence_operands(s);
        wgmma_fence();
        issue_s<T, F>(s, q_rows, k_tiles + stage * kKBytes);
        issue_pv<T, F>(o, p_frag, v_tiles + previous * kVBytes);
        pass_turn();
        draw(block);
        wgmma_wait_group<1>();  // S_j done; P V may still run
        wgmma_fence_operands(s);
        release_k(stage, following >= w.n_blocks);
        if (following >= w.n_blocks) {
          release(bar.q_empty(), lane);
        }
        take_scores(block);
        const auto finish_previous = [&] {  // P_(j-1) V_(j-1): O may be rescaled, V reused
          wgmma_wait_group<0>();
          wgmma_fence_operands(o);
          wgmma_fence_fragments(p_frag);
          release(bar.v_empty(previous), lane);
        };
        // The fused order: the wait for P V goes before the softmax, where ptxas puts it
        // anyway (it moves the wait to the top of its basic block; perf/NOTES.md, v48, v49),
        // and O's rescale, unconditional, and P's packing join the softmax's block: ptxas then
        // fills the gaps of the exponentials' stream with them (v54: the D = 64 forward
        // 1.01-1.04x; v55: 1.01-1.04x over the vote's order within three warpgroups' turns).
        // With two in ping-pong (D = 128 and up) it paid nothing (v54); there the vote skips
        // the rescale where no row of the warp grew.
        if constexpr (kFusedOrder) {
          finish_previous();
        }
        const bool grew =
            softmax_step<F>(s, r, rescale, block, p, unit, kept, has_dropout, keep_scale);
        if constexpr (!kFusedOrder) {
          finish_previous();
        }
        if (kFusedOrder || __any_sync(kFullMask, grew)) {  // exact: 1 where a row did not grow
#pragma unroll
          for (int j = 0; j < kDTiles; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              o[4 * j + e] *= rescale[e >> 1];
            }
          }
        }
        pack_p<T, F>(p_frag, s);
      }

      // The last block's P V, without the steps whose keys are past the end or (causal) past
      // this warpgroup's last row: P is 0 there for all its rows. Not with a mask or dropout
      // (their tilings spill a few bytes more with it).
      const uint32_t last = (pipe - 1) % kStages;
      const int64_t key_end = p.causal ? min64(p.len_kv, w.m0 + 64 * consumer + 64) : p.len_kv;
      const int64_t keys_left = key_end - static_cast<int64_t>(block) * kBlockN;
      const int live_steps = kArgs == kNoArgs && keys_left < kBlockN
                                 ? static_cast<int>(ceil_div(keys_left, 16))
                                 : kBlockN / 16;
      mbarrier_wait(bar.v_full(last), ((pipe - 1) / kStages) & 1);
      take_turn();
      wgmma_fence_operands(o);
      wgmma_fence();
      issue_pv<T, F>(o, p_frag, v_tiles + last * kVBytes, live_steps);
      pass_turn();
      wgmma_wait_group<0>();
      wgmma_fence_operands(o);
      wgmma_fence_fragments(p_frag);
      if constexpr (kStagesO) {  // the last consumer keeps V_last for O
        if (o_in_k) {
          release(bar.v_empty(last), lane);
          named_barrier_arrive(kStageBarrier + F::kConsumers - 1, kStageThreads);
        }
        o_stage = static_cast<int>(last);
      } else {
        release(bar.v_empty(last), lane);
      }
    }
    if (kStagesO && o_stage >= 0) {  // (an item with every key hidden has no buffer)
      named_barrier_sync(kPair ? (consumer == 0 ? kStageBarrier : kStageBarrier + 1)
                               : kStageBarrier + static_cast<uint32_t>(consumer),
                         kStageThreads);
    }
    if (part >= 0) {  // a part of a split item (flash_forward_sm90_ws_schedule.cuh)
      finish_part<T, F>(out, lse, o, r, w, part, split, unit, bar.split_flag(), p,
                        consumer == 0 && warp_in_group == 0 && lane == 0);
      continue;
    }
    if (kStagesO && o_stage >= 0) {
      const uint32_t buffer =
          (o_in_k ? k_tiles + static_cast<uint32_t>(o_stage) * kKBytes +
                        static_cast<uint32_t>(kPair ? 0 : consumer) * 64 * Dv * 2
                  : v_tiles + static_cast<uint32_t>(o_stage) * kVBytes) +
          static_cast<uint32_t>(warp_in_group) * (Dv / 64) * 16 * F::kRowBytes;
      stage_rows<T, F>(o_map, buffer, lse, o, r, w, p, unit, lane);
    } else {
      store_rows<T, F>(out, lse, o, r, w, p, unit);
    }
  }
  if (F::kPingPong && consumer == 0) {
    named_barrier_sync(my_turn, kTurnThreads);  // the last consumer's last turn handed back
  }
  if constexpr (kStagesO) {
    bulk_wait_group_all();  // the last stores done before the CTA's shared memory is freed
  }
}

#endif  // FIXED_HAS_TENSOR_MAPS

}  // namespace sm90_ws
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_FORWARD_SM90_WS_CTA_CUH_
