// The CTA of flash_backward_sm90.cuh's wgmma backward (sm_90a): its tiling, the order of its
// products, shared memory and registers (the constants of each head dim are BackwardTile, in
// flash_backward_tiling.cuh), the consumers' loop (consume_blocks) and wgmma_backward_cta, the
// body of flash_backward_sm90.cuh's kernel in sm_90a images; the producer warpgroup's loader and
// reducer are in flash_backward_sm90_producer.cuh. What the launchers cover, the kernel and the
// launchers are in flash_backward_sm90.cuh.
//
// The gradients are flash_backward.cuh's: P_ij = exp(scale q_i.k_j - lse_i), dP_ij = dO_i.v_j,
// delta_i = dO_i.O_i, dS_ij = P_ij (dP_ij - delta_i); dV_j = sum_i P_ij dO_i,
// dK_j = scale sum_i dS_ij q_i, dQ_i = scale sum_j dS_ij k_j (the scale of dQ applied by the dq
// kernel, that of dK in the epilogue here, as there).
//
// ---------------------------------------------------------------------------------- tiling
// One CTA per work item (a batch item, or GroupSummingTile's K/V item and its group of batch
// items; a block of kBlockN = 128 keys): a producer warpgroup and 2 consumer warpgroups (8 warps,
// 256 threads); consumer warpgroup wg owns keys [64 wg, 64 wg + 64) of the block (wgmma's
// M = 64), its warp w (0..3) keys 16 w .. 16 w + 15 of those, so consumer warp `warp` owns keys
// key_row0 = 16 warp ...
// The loop runs over the query blocks of kBlockM rows that can see the keys, flash_backward.cuh's
// blocks (D = 64: kBlockM = 128; D = 128: 64), so that the workspace rows (flash_backward_rows)
// serve both kernels. Per query block m0 and warpgroup, M = R = kBlockM queries:
//   1. S^T (64 keys x R, f32, R / 2 per thread) = K Q^T: D / 16 wgmma m64nRk16 (all of them with
//      kAsIs too: a loop cut at E ran 6-17% slower, v26), A = the warpgroup's 64 rows of K, B = Q,
//      both K-major in shared memory.
//   2. dP^T (64 x R) = V dO^T: the same with V and dO. Committed as a second group: P^T is
//      computed while dP^T is in flight.
//   3. P^T = 2^(S^T scale log2(e) - lse log2(e)) (0 where causal hides the pair), in place.
//      Accumulator element s[4 j + e] (wgmma.cuh) is key key_row0 + g + 8 (e >> 1), query
//      m0 + 8 j + 2 t + (e & 1); lse and delta of that query column come from shared memory.
//   4. dV (64 x D, f32, D / 2 per thread) += P^T dO: R / 16 wgmma m64nDk16, A = P^T from
//      registers: k-step kk's fragment is S^T's n-tiles 2 kk, 2 kk + 1 packed in pairs,
//      p_frag[kk][r] = pack(s[8 kk + 2 r], s[8 kk + 2 r + 1]) (the forward's identity for P V);
//      B = dO MN-major (k-step kk starts 16 rows further). Issued before dS^T is computed
//      (kEarlyDv: at D = 128 without SDPA's arguments), or after it (elsewhere).
//   5. dS^T = P^T (dP^T - delta), in place in dP^T's registers, packed as P^T was.
//   6. dS^T (bf16/fp16) to shared memory: the packed pair of rows key_row0 + g + 8 h, query
//      columns 8 j + 2 t, + 1 is one 4-byte store, j = 2 kk + (r >> 1), h = r & 1.
//      fence.proxy.async, then:
//   8. Barrier (both consumer warpgroups' dS^T rows are in shared memory: a named barrier of
//      their 256 threads), then dQ = dS K, one 64 x 64
//      tile per warpgroup (D = 64, R = 128: warpgroup wg takes queries 64 wg .., all of D;
//      D = 128, R = 64: both take the 64 queries, warpgroup wg head dims 64 wg ..): 8 wgmma
//      m64n64k16 over the 128 keys, A = dS read from the stored dS^T ([key][query], query
//      contiguous) as an MN-major A (imm-trans-a), B = K ([key][d]) MN-major (imm-trans-b).
//      With dropout, the next block's keep bits are drawn before the barrier, while dV runs
//      (after dQ's issue, 24 bytes more spill at D = 128: ptxas, perf/NOTES.md v34).
//   7. dK (64 x D) += dS^T Q: as dV, A = the packed dS^T registers, B = Q MN-major. Issued
//      behind dQ (FlashAttention-3's order), it runs while dQ is staged (step 9).
//   9. Wait for dQ; its f32 accumulator to the dQ stage in shared memory (element
//      dq[4 j + e] is query 64 (row group) + 16 (warp & 3) + g + 8 (e >> 1) of the block, head
//      dim 64 (column group) + 8 j + 2 t + (e & 1)), in the layout of the workspace rows
//      m0 .. m0 + kBlockM - 1, with flash_backward.cuh's swizzled_dq_chunk (a warp's 8 rows on
//      8 chunks: conflict-free 8-byte stores). Once all 256 threads have staged theirs (staged),
//      the reducer adds the whole stage to those rows with one cp.reduce.async.bulk .add.f32
//      (per thread red.global.add stalled on the memory queue, v14).
// The producer warpgroup (flash_backward_sm90_producer.cuh; 24 registers a thread, setmaxnreg
// gives the consumers 240): the loader issues TMA for K and V once per item, and for Q, dO
// (lse, delta by 1-D bulk copies) one block ahead into two buffers; mbarriers tell when a
// buffer has landed (full) and when all 256 consumer threads are done with it (empty), and when the
// consumers have stored the last item's dK and dV from the K and V tiles (kv_empty). One
// consumer barrier per query block, before dQ. dS^T has two buffers, so that one warpgroup
// stores the next block's while the other may still read this one's in dQ (at D = 64 with a
// mask, one: its stores wait for the last block's empty phase). A dQ stage is rewritten once the
// reducer has seen its bulk reduction read it (stage_free); without SDPA's arguments there are
// two, so that a reduction has a block's time. No ping-pong (FlashAttention-3's backward has
// none either: perf/NOTES.md, issue 30's plan for the backward).
//
// Causal (top-left, key j visible to query i when j <= i): the loop starts at the query block
// holding the block's first key, as flash_backward.cuh; per warp, only query blocks with
// m0 < n0 + key_row0 + 15 (some query of the block before some key of the warp) are masked,
// element by element: query m0 + 8 j + 2 t + (e & 1) < key n0 + key_row0 + g + 8 (e >> 1) gives
// P = 0, hence dS = 0. Key blocks past the last query row write zero dK and dV. Work items go
// out in flash_backward.cuh's order (longest first where wgmma_backward_longest_first_pays, else
// batch-major).
// Tails, zero-filled by TMA: query rows past L have lse +inf in the padded workspace,
// so P = dS = 0; key rows past S get P = 0 (step 3; from their zero rows of K, P would be
// 2^-lse, which can overflow the 16-bit dS^T), and their dK, dV rows are never stored.
//
// Shared memory (BackwardTile, flash_backward_tiling.cuh, lists it): K, V; Q, dO, lse, delta,
// dS^T in two buffers each; the dQ stage (or two); a mask's entries of one block. The mask
// tile has one buffer: each warp copies its keys' entries of the next block by cp.async as
// soon as step 3 has read this block's (load_mask_part; in registers their latency was
// exposed: perf/NOTES.md, v24). Registers (nvcc 13.0, sm_90a): the launch's 168 a thread,
// then 24 for the producer and 240 for the consumers (setmaxnreg). ptxas's spill stores, the
// producer's included: plain 28-48 bytes (the consumers' none at D = 128), dropout 66-98, the
// mask alone 258-272 (mostly the producer's search for hidden blocks at 24 registers, 72-90
// without it); one CTA per SM (12 warps). Per consumer thread: dK, dV 2 x D / 2 f32
// accumulators; S^T, dP^T 2 x R / 2; dQ 32; the packed P^T, dS^T 2 x R / 4. int64_t for
// lengths and global offsets.
#ifndef FIXED_FLASH_BACKWARD_SM90_CTA_CUH_
#define FIXED_FLASH_BACKWARD_SM90_CTA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "attention_problem.cuh"  // AttentionProblem, ceil_div, min64, detail::grid_for, ...
#include "flash_backward.cuh"      // prologue and dq kernels, tilings
#include "flash_backward_sm90_epilogue.cuh"  // store_dk_dv
#include "flash_backward_sm90_producer.cuh"  // BackwardSmem, the loader and the reducer
#include "flash_common.cuh"        // cp.async, exp2, pack2, ...
#include "flash_forward_sm90.cuh"  // sw128_offset, current_device_is_sm90
#include "sm90_pipeline.cuh"       // mbarriers, setmaxnreg, named barriers
#include "wgmma.cuh"               // wgmma.mma_async and descriptors

namespace fixed_attention {
namespace kernels {
namespace flash {
namespace sm90 {

#if FIXED_HAS_TENSOR_MAPS
// The consumer warpgroups' part of the wgmma body (flash_backward_sm90_producer.cuh has the
// producer's): every query block of every work item of the grid-stride loop (sm_90a images
// only). kArgs: the instantiation that reads the mask and draws dropout, as flash_backward_cta's;
// kAsIs: E and Ev from the problem, else D; kNarrowMask: the mask's entries in T
// (AttentionProblem::mask_in_input_dtype), else float32 (one form per instance: both in one
// spilled 250 bytes more). consumer_tid: 0 .. 255, the thread among the consumers.
template <typename T, class F, int kArgs, bool kAsIs, bool kNarrowMask>
__device__ __forceinline__ void consume_blocks(T* __restrict__ dk,  // (work items, S, E)
                                               T* __restrict__ dv,  // (work items, S, Ev)
                                               const AttentionProblem& p,
                                               const bool longest_first,
                                               const BackwardSmem<F, kArgs>& sm,
                                               const int consumer_tid) {
  constexpr int D = F::kHeadDim, BM = F::kBlockM, BN = F::kBlockN;
  constexpr int kQTiles = F::kQTiles, kQSteps = F::kQSteps, kDTiles = F::kDTiles;
  constexpr uint32_t kRowBytes = F::kRowBytes;
  constexpr float kLog2e = 1.4426950408889634f;
  using Smem = BackwardSmem<F, kArgs>;
  constexpr bool kEarlyDv = F::kEarlyDvPlain && kArgs == kNoArgs;  // step 4's place
  const uint32_t k_tile = sm.k_tile, v_tile = sm.v_tile, q_tiles = sm.q_tiles;
  const uint32_t do_tiles = sm.do_tiles, ds_tile = sm.ds_tile, stats = sm.stats;
  const uint32_t ds_second = sm.ds_second, mask_tile = sm.mask_tile;
  const bool has_mask = kArgs != kNoArgs && p.mask != nullptr;
  const bool ds_single = sm.ds_single;
  // The K tile through a generic pointer, for the epilogue's 16-byte reads.
  extern __shared__ uint4 sm90_bwd_smem[];
  const unsigned char* const kv_bytes =
      reinterpret_cast<const unsigned char*>(sm90_bwd_smem) + (k_tile - smem_addr(sm90_bwd_smem));

  const int lane = consumer_tid & 31;
  const int warp = consumer_tid >> 5;  // the consumer warp, 0 .. 7
  // Read from lane 0, the compiler knows it is the same across the warp and keeps the
  // descriptor arithmetic that depends on it in uniform registers (kUniformWarpgroup).
  const int warpgroup =
      F::kUniformWarpgroup ? __shfl_sync(0xffffffffu, warp >> 2, 0) : warp >> 2;
  const int g = lane >> 2;  // fragment row (groupID)
  const int t = lane & 3;   // fragment column pair (threadID_in_group)
  const int key_row0 = warp * 16;  // = 64 warpgroup + 16 (warp & 3): this warp's first key
  // This warpgroup's 64 rows of K and V (8 swizzle atoms in each 64-column run).
  const uint32_t k_rows = k_tile + static_cast<uint32_t>(warpgroup * 64) * kRowBytes;
  const uint32_t v_rows = v_tile + static_cast<uint32_t>(warpgroup * 64) * kRowBytes;
  // dQ: this warpgroup's 64 x 64 tile: queries 64 dq_row .., head dims 64 dq_col ..
  const int dq_row = F::kDqRowGroups == 2 ? warpgroup : 0;
  const int dq_col = F::kDqRowGroups == 2 ? 0 : warpgroup;
  // Descriptors of the tiles every block reads (wgmma.cuh's TileDescriptor): this warpgroup's
  // rows of K and V, K-major (S^T, dP^T), and K's head dims 64 dq_col .., MN-major (dQ).
  const TileDescriptor k_rows_desc(k_rows, 16, 1024), v_rows_desc(v_rows, 16, 1024);
  const TileDescriptor k_mn_major(k_tile + dq_col * BN * kRowBytes, BN * kRowBytes, 1024);

  const int64_t L = p.len_q, S = p.len_kv;
  // Q, K, dK rows of E elements, V, dO, dV rows of Ev (at most D, multiples of 8): the tiles'
  // columns past them are zeros, which add nothing to the products (the dQ workspace is D wide).
  const int E = kAsIs ? static_cast<int>(p.head_dim) : D;
  const int Ev = kAsIs ? static_cast<int>(value_dim(p)) : D;
  const int64_t key_blocks = ceil_div(S, BN);
  const float scale_log2 = p.scale * kLog2e;  // any sign; 0 gives P = 2^-lse, as the mma.sync body
  // The mask enters P's exponent beside lse; dropout's Z scales P in dV and dP in dS. Z is kept
  // as one bit per score element between steps 3 and 5 (kQTiles * 4 of them per thread).
  const bool has_dropout = kArgs == kMaskAndDropout && p.dropout_p > 0.f;
  const float keep_scale = dropout_scale(p.dropout_p);
  const uint32_t keep_threshold = dropout::threshold(p.dropout_p);
  const int slot = g & 3;  // the lane's place among those sharing Philox blocks
  const uint64_t counter_rows8 = 4 * dropout::block_cols(S);  // the counter's step per 8 rows
  static_assert(kQTiles % 2 == 0, "dropout's Philox blocks are drawn for two n-tiles at once");
  constexpr int kKeptWords = (kQTiles * 4 + 31) / 32;  // 2 at D = 64, 1 at D = 128
  const bool skips = skips_blocks<kArgs>(p);
  const bool skips_zero = has_mask && skips_zero_blocks(p);
  const bool quads = has_mask && mask_in_quads(p);
  const uint32_t pair_base = mask_pair_base(mask_tile, key_row0, lane);  // kNarrowMask

  // Query blocks computed so far over all of this CTA's items (block `blocks` uses buffer
  // blocks & 1 of Q, dO, lse, delta and dQ stage Smem::stage(blocks)), and items so far: the
  // producer's walk (visit_blocks) in the same order.
  uint32_t blocks = 0, items = 0;
  const int64_t work_items = p.batch / walked_items<F>(p);
  for (int64_t item = blockIdx.x; item < work_items * key_blocks; item += gridDim.x, ++items) {
    const BackwardItem it = backward_item<F>(item, key_blocks, work_items, longest_first);
    const ItemWalk walk = walk_of<F>(p, skips, it);
    const int64_t b = walk.first.b, n0 = it.n0;  // b: the mask's and dropout's query item
    QueryBlock at = walk.first;                   // this iteration's query block
    using MaskEntry = std::conditional_t<kNarrowMask, uint16_t, float>;
    const MaskEntry* const mask_b = has_mask ? mask_slice_of<MaskEntry>(p, b) : nullptr;
    // dK, dV per work item (kSumsGroup: the group's sum); without kAsIs one product (E = Ev = D).
    const int64_t dk_b = it.kv * S * E, dv_b = kAsIs ? it.kv * S * Ev : dk_b;
    // Whether this thread's keys (rows g and g + 8 of the warp's 16) lie past S: their rows of K
    // are TMA's zeros, so S^T is 0 and P would be 2^-lse, large where a row's scores are all far
    // below 0; dS = -P delta then overflows the 16-bit dS^T (fp16: past 65504) or float32
    // itself, and inf x 0 in dQ = dS K is NaN. Step 3 sets their P to 0.
    const int64_t first_key = n0 + key_row0 + g;
    const bool past_s[2] = {first_key >= S, first_key + 8 >= S};
    // Whether block m reads mask entries: not where they are all 0 (zero_block), as P is then
    // the unmasked one; the copies of its mask tile are then skipped too.
    const auto reads_mask = [&](int64_t m) {
      return has_mask && m < L && !(skips_zero && zero_block(p, b, m, BM, n0, BN));
    };
    bool masked = reads_mask(at.m0);
    // Dropout's keep bits of query block m: bit i for element s[i]. Tiles j, j + 1 are one
    // Philox call each for four lanes, whose bit 4 jj + e is element e of tile j + jj. Drawn
    // for the next block before step 8's barrier (beside S^T they ran 5% slower at D = 64, v29).
    const auto draw_keep_bits = [&](int64_t m, uint32_t(&bits)[kKeptWords]) {
      uint64_t counter = dropout::block_counter(b, m + 8 * (slot >> 1) + 2 * t,
                                                n0 + key_row0 + g + 8 * (slot & 1), L, S);
#pragma unroll
      for (int j = 0; j < kQTiles; j += 2, counter += 2 * counter_rows8) {
        const uint32_t drawn = dropout_keep_bits_at<DropoutPair::kAlongRows>(
                                   p, keep_threshold, counter, slot) << ((4 * j) % 32);
        uint32_t& word = bits[(4 * j) / 32];
        word = (4 * j) % 32 == 0 ? drawn : word | drawn;  // a word's first tiles start it
      }
    };
    uint32_t kept[kKeptWords];  // every element kept (and keep_scale 1) without dropout
#pragma unroll
    for (uint32_t& word : kept) {
      word = ~0u;
    }
    if (has_dropout && at.m0 < L) {
      draw_keep_bits(at.m0, kept);
    }

    // Each warp's part of the mask's tile by cp.async (K, V and the query blocks: the loader).
    if (masked) {
      load_mask_part<BM, kNarrowMask>(mask_tile, p, mask_b, at.m0, n0, key_row0, quads, lane);
    }
    cp_async_commit();
    mbarrier_wait(sm.kv_full(), items & 1u);  // also before the epilogue's stores into them

    float dk_acc[kDTiles * 4];
    float dv_acc[kDTiles * 4];
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) {
      dk_acc[i] = 0.f;
      dv_acc[i] = 0.f;
    }

#pragma unroll 1
    for (; at.m0 < L; ++blocks) {
      const int64_t m0 = at.m0;
      const uint32_t buf = blocks & 1u;
      const uint32_t q_buf = q_tiles + buf * F::kQBytes;
      const uint32_t do_buf = do_tiles + buf * F::kQBytes;
      const uint32_t lse_buf = stats + buf * F::kStatsBytes;
      const uint32_t delta_buf = lse_buf + BM * 4;
      const uint32_t ds_buf = (buf != 0u && !ds_single) ? ds_second : ds_tile;
      mbarrier_wait(sm.full(buf), (blocks >> 1) & 1u);  // this block's Q, dO, lse, delta
      cp_async_wait<0>();  // this thread's copies of the warp's mask entries ...
      __syncwarp();        // ... and its lanes' (and the warp converged for .sync.aligned)
      const QueryBlock next = next_query_block<F>(p, skips, at, walk.last, n0);
      const int64_t following = next.m0;

      // 1, 2: S^T = K Q^T, then dP^T = V dO^T, two groups. k-step ks covers head dims
      // 16 ks .. + 15: run ks / 4 of the tiles, 32 bytes into each 128-byte row.
      float s[kQTiles * 4];
      float dp[kQTiles * 4];
      // K-major tiles (Q, dO) and MN-major ones (dO for dV, Q for dK): this buffer's descriptors.
      const TileDescriptor q_k_major(q_buf, 16, 1024), do_k_major(do_buf, 16, 1024);
      const TileDescriptor do_mn_major(do_buf, BM * kRowBytes, 1024);
      const TileDescriptor q_mn_major(q_buf, BM * kRowBytes, 1024);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        const uint32_t run = static_cast<uint32_t>(ks >> 2);
        const uint32_t step = static_cast<uint32_t>(ks & 3) * 32;
        wgmma_m64k16_ss<T, BM>(s, k_rows_desc.at(run * BN * kRowBytes + step),
                               q_k_major.at(run * BM * kRowBytes + step), ks > 0);
      }
      wgmma_commit_group();
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        const uint32_t run = static_cast<uint32_t>(ks >> 2);
        const uint32_t step = static_cast<uint32_t>(ks & 3) * 32;
        wgmma_m64k16_ss<T, BM>(dp, v_rows_desc.at(run * BN * kRowBytes + step),
                               do_k_major.at(run * BM * kRowBytes + step), ks > 0);
      }
      wgmma_commit_group();
      // The mask's entries of this block (0 past L or S), in its tile. At D = 128 a thread's 32
      // are read into registers while the products run (read in step 3 instead, the masked
      // backward ran 6-12% slower); at D = 64 in step 3 (64 registers more spilled 216 bytes with
      // dropout, a window of them as many or more; ptxas). 16-bit: two n-tiles per ldmatrix.
      constexpr bool kPrefetch = kQTiles <= 8;
      const auto mask_at = [&](int j, int e) {  // element e of n-tile j (float32)
        return mask_fragment_entry(mask_tile, key_row0, g, t, j, e);
      };
      float bias[kArgs != kNoArgs && kPrefetch ? 4 * kQTiles : 1];
      float pairs[8];  // 16-bit, read in step 3: n-tiles j & ~1, j | 1
      if (kArgs != kNoArgs && kPrefetch && masked) {  // uniform
        mask_fragments<T, kNarrowMask>(bias, mask_tile, pair_base, key_row0, g, t);
      }
      wgmma_wait_group<1>();  // S^T has landed; dP^T may still be in flight
      wgmma_fence_operands(s);

      // 3: P^T in place. Causal masks only where this warp's keys reach past the block's first
      // query; diag = query - key at the warp's element (0, 0), |diag| < BM + BN there.
      const bool diagonal = p.causal && m0 < n0 + key_row0 + 15;  // uniform over the warp
      const int diag = diagonal ? static_cast<int>(m0 - n0) - key_row0 : 0;
      // P = 0 where the element's query offset in the block, 8 j + 2 t + (e & 1), is below
      // zero_below[e >> 1] + 2 t: for every query if the key is past S, else for queries before
      // the key (query + diag < key) on the diagonal. 2 t taken out here leaves each element
      // one compare with a constant (perf/NOTES.md, v41).
      int zero_below[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        zero_below[h] = past_s[h] ? (1 << 30) : diagonal ? g + 8 * h - diag - 2 * t : -(1 << 30);
      }
      // with_mask: whether the block reads mask entries (a zero block's would add
      // fmaf(0, log2 e, x) = x: the same P), a run-time bool or a constant.
      const auto probabilities = [&](auto with_mask) {
#pragma unroll
        for (int j = 0; j < kQTiles; ++j) {
          const float2 lse2 = ld_shared_f32x2(lse_buf + (8 * j + 2 * t) * 4);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float row_lse = (e & 1) ? lse2.y : lse2.x;
            float exponent = -row_lse;
            if (with_mask) {
              if constexpr (kNarrowMask && !kPrefetch) {
                if (j % 2 == 0 && e == 0) {
                  mask_fragment_pairs<T>(pair_base, j, pairs);
                }
              }
              const float entry = kPrefetch      ? bias[4 * j + e]
                                  : kNarrowMask ? pairs[4 * (j % 2) + e]
                                                : mask_at(j, e);
              exponent = fmaf(entry, kLog2e, exponent);
            }
            s[4 * j + e] = exp2_approx(fmaf(s[4 * j + e], scale_log2, exponent));
          }
        }
      };
      // At D = 64 the loop is compiled twice, with and without the entries: tested per element,
      // `masked` cost three instructions an element, a branch among them, in the instances with
      // SDPA's arguments (192 a block, also where only dropout is on; perf/NOTES.md v46). At
      // D = 128 the entries are in registers and the test is predicated; two loops there spilled
      // 32 to 90 bytes more (ptxas).
      if constexpr (kPrefetch) {
        probabilities(masked);
      } else if (kArgs != kNoArgs && masked) {  // uniform
        probabilities(std::true_type{});
      } else {
        probabilities(std::false_type{});
      }
      // The zeros, where this warp has any: on the diagonal, or with keys past S (the last key
      // block). Elsewhere the compares are skipped: two instructions an element (v46).
      if (diagonal || n0 + key_row0 + 15 >= S) {  // uniform over the warp
#pragma unroll
        for (int i = 0; i < kQTiles * 4; ++i) {
          if (8 * (i / 4) + (i & 1) < zero_below[(i % 4) >> 1]) {
            s[i] = 0.f;  // query before key, or key past S
          }
        }
      }
      // The warp's part of the mask tile is free: its entries of the next block, whose copies
      // run during the rest of this one (the wait at the top takes them with Q and dO's).
      masked = reads_mask(following);
      if (masked) {
        __syncwarp();  // every lane's reads of this block's entries are done
        load_mask_part<BM, kNarrowMask>(mask_tile, p, mask_b, following, n0, key_row0, quads,
                                        lane);
      }
      cp_async_commit();
      // Z_i of element i: 1 without dropout (every bit set, keep_scale 1), so that the
      // instances with dropout multiply by it without a select on has_dropout per element (64
      // instructions a block at D = 64; perf/NOTES.md v46).
      const auto factor = [&](int i) {
        if constexpr (kArgs != kMaskAndDropout) {
          return 1.f;
        } else {
          return (kept[i / 32] >> (i % 32)) & 1u ? keep_scale : 0.f;
        }
      };
      // P^T's A fragments (queries 16 kk .. + 15 per k-step), Z applied.
      uint32_t p_frag[kQSteps][4];
#pragma unroll
      for (int kk = 0; kk < kQSteps; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int i = 8 * kk + 2 * r;
          p_frag[kk][r] = pack2<T>(s[i] * factor(i), s[i + 1] * factor(i + 1));
        }
      }

      // 4: dV += P^T dO. dO is MN-major: LBO = the distance between the 64-column runs (unused
      // at D = 64), SBO = between 8-row atoms; k-step kk starts 16 rows further.
      if constexpr (kEarlyDv) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kQSteps; ++kk) {
          wgmma_m64k16_rs<T, D>(dv_acc, p_frag[kk], do_mn_major.at(kk * 16 * kRowBytes));
        }
        wgmma_commit_group();
        wgmma_wait_group<1>();  // dP^T has landed (dV may still be in flight)
      } else {
        wgmma_wait_group<0>();
      }
      wgmma_fence_operands(dp);

      // 5: dS^T = P^T (dP^T - delta) in place, and its A fragments.
#pragma unroll
      for (int j = 0; j < kQTiles; ++j) {
        const float2 dl = ld_shared_f32x2(delta_buf + (8 * j + 2 * t) * 4);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float row_delta = (e & 1) ? dl.y : dl.x;
          dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] * factor(4 * j + e) - row_delta);
        }
      }
      uint32_t ds_frag[kQSteps][4];
#pragma unroll
      for (int kk = 0; kk < kQSteps; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          ds_frag[kk][r] = pack2<T>(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);
        }
      }

      // 6: dS^T to shared memory (before any wgmma reads ds_frag: registers an in-flight wgmma
      // reads must not be accessed). Key row key_row0 + g + 8 (r & 1), query chunk
      // 2 kk + (r >> 1), columns 2 t, + 1 of it. Two buffers: the other warpgroup may still
      // read the last block's in its dQ. With one, wait until every warp is done with the last
      // block (its empty phase: dQ's wgmmas waited for), not for all to reach this point.
      if (ds_single && blocks > 0) {
        mbarrier_wait(sm.empty((blocks - 1) & 1u), ((blocks - 1) >> 1) & 1u);
      }
#pragma unroll
      for (int kk = 0; kk < kQSteps; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const uint32_t offset =
              sw128_offset<BN>(key_row0 + g + 8 * (r & 1), 2 * kk + (r >> 1)) + 4 * t;
          st_shared_b32(ds_buf + offset, ds_frag[kk][r]);
        }
      }
      fence_proxy_async_shared();  // this thread's dS^T stores, to the wgmmas of dQ

      // 4 (late): dV += P^T dO where not issued yet.
      if constexpr (!kEarlyDv) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kQSteps; ++kk) {
          wgmma_m64k16_rs<T, D>(dv_acc, p_frag[kk], do_mn_major.at(kk * 16 * kRowBytes));
        }
        wgmma_commit_group();
      }

      // 8: dQ = dS K, once both warpgroups' dS^T is in shared memory. A: queries 64 dq_row ..
      // of the stored dS^T, MN-major (k-step kk: keys 16 kk .. + 15, 16 rows further; LBO
      // unused at M = 64). B: head dims 64 dq_col .. of K, MN-major. The consumers' one barrier
      // per block (a named barrier: the producer warpgroup does not take part).
      if (has_dropout && following < L) {  // kept's bits of this block are in p_frag, dS^T
        draw_keep_bits(following, kept);
      }
      named_barrier_sync(F::kConsumersBarrier, F::kConsumerThreads);
      float dq[32];
      wgmma_fence();
      const TileDescriptor ds_mn_major(ds_buf + dq_row * BN * kRowBytes, BN * kRowBytes, 1024);
#pragma unroll
      for (int kk = 0; kk < F::kKeySteps; ++kk) {
        wgmma_m64n64k16_ss_mn<T>(dq, ds_mn_major.at(kk * 16 * kRowBytes),
                                 k_mn_major.at(kk * 16 * kRowBytes), kk > 0);
      }
      wgmma_commit_group();
      // 7: dK += dS^T Q, issued behind dQ so that it runs while dQ is staged (FlashAttention-3's
      // order; issued before the barrier, the tensor cores idled while dQ was stored).
#pragma unroll
      for (int kk = 0; kk < kQSteps; ++kk) {
        wgmma_m64k16_rs<T, D>(dk_acc, ds_frag[kk], q_mn_major.at(kk * 16 * kRowBytes));
      }
      wgmma_commit_group();
      wgmma_wait_group<1>();  // dV and dQ; dK may still be in flight
      wgmma_fence_operands(dq);

      // 9: dQ to its stage, once the bulk reduction that last used it has read it (the phase
      // before this use's): rows 64 dq_row + 16 (warp & 3) + g (+ 8) of the block (row & 7 ==
      // g), columns 64 dq_col + 8 j + 2 t; the reducer sends the stage to dq_accum once every
      // warp has staged its part.
      mbarrier_wait(sm.stage_free(Smem::stage_index(blocks)), Smem::stage_parity(blocks) ^ 1u);
      const int dq_row_element = (64 * dq_row + 16 * (warp & 3) + g) * D + 2 * t;
      const uint32_t dq_row_bytes = sm.stage(blocks) + static_cast<uint32_t>(dq_row_element) * 4;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t chunk = static_cast<uint32_t>(swizzled_dq_chunk(8 * dq_col + j, g));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          st_shared_f32x2(dq_row_bytes + (8 * h * D + 8 * chunk) * 4, dq[4 * j + 2 * h],
                          dq[4 * j + 2 * h + 1]);
        }
      }
      fence_proxy_async_shared();  // this thread's dQ stores, to the bulk reduction
      mbarrier_arrive(sm.staged(Smem::stage_index(blocks)));
      wgmma_wait_group<0>();  // dK; p_frag and ds_frag are free again
      wgmma_fence_operands(dv_acc);
      wgmma_fence_operands(dk_acc);
      mbarrier_arrive(sm.empty(buf));  // this thread is done with the block's buffers (dK read Q)
      at = next;
    }

    // Epilogue: dK (times scale) and dV through this warp's own rows of the K and V tiles, then
    // 16-byte stores of whole rows. The barrier: no copies in flight, every warpgroup done with
    // K (dQ reads all of its rows; each waited for its wgmmas above).
    cp_async_wait<0>();
    named_barrier_sync(F::kConsumersBarrier, F::kConsumerThreads);
    store_dk_dv<T, F>(dk, dv, dk_b, dv_b, dk_acc, dv_acc, p.scale, k_tile, v_tile, kv_bytes,
                      key_row0, lane, n0, S, E, Ev);
    fence_proxy_async_shared();  // the reads of the K and V tiles, before TMA writes them
    mbarrier_arrive(sm.kv_empty());  // the next item's K and V may overwrite the tiles
  }
}

// The wgmma body: the mbarriers, then the producer warpgroup (warps 0-3, 24 registers a thread:
// the loader and the reducer, flash_backward_sm90_producer.cuh) and the two consumer warpgroups
// (240 registers a thread, consume_blocks) go their ways.
template <typename T, class F, int kArgs, bool kAsIs, bool kNarrowMask>
__device__ __forceinline__ void wgmma_backward_cta(const CUtensorMap* q_map,   // (B, L, E)
                                                   const CUtensorMap* k_map,   // (B / g, S, E)
                                                   const CUtensorMap* v_map,   // (B / g, S, Ev)
                                                   const CUtensorMap* do_map,  // (B, L, Ev)
                                                   const float* __restrict__ lse_log2,  // (B, Lp)
                                                   const float* __restrict__ delta,     // (B, Lp)
                                                   float* __restrict__ dq_accum,  // (B, Lp, D)
                                                   T* __restrict__ dk,  // (work items, S, E)
                                                   T* __restrict__ dv,  // (work items, S, Ev)
                                                   const AttentionProblem p,
                                                   const int64_t rows_padded,
                                                   const bool longest_first) {
  extern __shared__ uint4 sm90_bwd_smem[];
  const BackwardSmem<F, kArgs> sm(smem_addr(sm90_bwd_smem),
                                  kArgs != kNoArgs && p.mask != nullptr);
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);  // warp-uniform, known so
  if (tid == 0) {
    sm.init();
    prefetch_tensor_map(q_map);
    prefetch_tensor_map(k_map);
    prefetch_tensor_map(v_map);
    prefetch_tensor_map(do_map);
  }
  __syncthreads();  // the last CTA-wide barrier: the producer's idle warps leave below
  if (warp < 4) {
    setmaxnreg_dec<F::kProducerRegisters>();
    if (tid == 0) {
      load_blocks<F, kArgs>(q_map, k_map, v_map, do_map, lse_log2, delta, p, rows_padded,
                            longest_first, sm);
    } else if (tid == 32) {
      reduce_dq<F, kArgs>(dq_accum, p, rows_padded, longest_first, sm);
    }
    return;
  }
  setmaxnreg_inc<F::kConsumerRegisters>();
  consume_blocks<T, F, kArgs, kAsIs, kNarrowMask>(dk, dv, p, longest_first, sm, tid - 128);
}

#endif  // FIXED_HAS_TENSOR_MAPS

}  // namespace sm90
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_BACKWARD_SM90_CTA_CUH_
