// The warp-specialized Hopper forward's schedule (flash_forward_sm90_ws.cuh): which work item a
// persistent CTA takes in each round, and the split of the last round's items along the keys.
//
// One CTA per SM; in round r CTA c takes item r G + c (G CTAs; odd rounds reversed). Items of
// one problem without causality are all alike, so a problem of R G + T items runs R + 1
// rounds however small T is: at D = 64, (B x H, S) = (64, 2048), 704 items of 192 rows over 132
// CTAs fill 5.3 rounds of 6 (perf/NOTES.md, v34). Where the last round is at most half full,
// each of its T items is split into P parts of about n_blocks / P key blocks (P <= G / T), one
// part per CTA: each part leaves its unnormalised output and its rows' maxima and sums in a
// float32 workspace, and the last part of an item to finish (an atomic count per item) combines
// the P parts in part order, so the result does not depend on which part finished last.
//
// No torch includes: CI compile-checks this header for sm_90a and sm_90 without a GPU.
#ifndef FIXED_FLASH_FORWARD_SM90_WS_SCHEDULE_CUH_
#define FIXED_FLASH_FORWARD_SM90_WS_SCHEDULE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "attention_problem.cuh"  // AttentionProblem, ceil_div, min64, value_dim
#include "flash_common.cuh"       // exp2_approx, pack2, st/ld_shared_b32
#include "sm90_pipeline.cuh"      // named barriers

namespace fixed_attention {
namespace kernels {

// A split's workspace as the glue allocates it (flash_forward_sm90_split_workspace gives the
// sizes): `floats` float32 entries, `counts` arrival counts set to zero.
struct SplitWorkspace {
  float* partial = nullptr;
  int64_t floats = 0;
  unsigned* arrivals = nullptr;
  int64_t counts = 0;
};

namespace flash {
namespace sm90_ws {

// The split of the last round: round full_rounds takes parts of its items (parts > 1), part q
// of item full_rounds G + i being unit q tail_items + i, run by CTA unit. The workspace: per
// unit kBlockM rows of Ev floats (the part's O, unnormalised), then per unit kBlockM rows of
// (row maximum in log2 units, row sum); one arrival count per tail item, zero at launch.
struct SplitTail {
  uint32_t full_rounds = 0;
  int tail_items = 0;
  int parts = 1;  // 1: no split
  float* partial = nullptr;
  unsigned* arrivals = nullptr;
  __host__ __device__ int units() const { return parts > 1 ? tail_items * parts : 0; }
};

// The plan for `items` work items of `key_blocks` key blocks each on `grid` CTAs (`splittable`:
// no causality, mask or dropout): parts for a last round at most half full, at most 4 and with
// at least 2 key blocks each.
inline SplitTail plan_split_tail(int64_t items, int64_t grid, int64_t key_blocks,
                                 bool splittable) {
  SplitTail plan;
  const int64_t tail = grid > 0 ? items % grid : 0;
  if (!splittable || items < grid || tail == 0 || 2 * tail > grid || items / grid >= (1u << 31)) {
    return plan;
  }
  int64_t parts = grid / tail;
  parts = parts < 4 ? parts : 4;
  parts = parts < key_blocks / 2 ? parts : key_blocks / 2;
  if (parts < 2) {
    return plan;
  }
  plan.full_rounds = static_cast<uint32_t>(items / grid);
  plan.tail_items = static_cast<int>(tail);
  plan.parts = static_cast<int>(parts);
  return plan;
}

// The float32 entries a plan's workspace holds for tiles of `block_rows` rows, Ev columns.
inline int64_t split_tail_floats(const SplitTail& plan, int64_t block_rows, int64_t value_dim) {
  return static_cast<int64_t>(plan.units()) * block_rows * (value_dim + 2);
}

// The item this CTA takes in its round `round` (0, 1, ...): rounds cover items [round G,
// (round + 1) G) of the grid's G CTAs, even rounds in CTA order and odd ones reversed, so that
// with items ordered longest first (causal) no CTA takes the longest of every round.
__device__ __forceinline__ int64_t scheduled_item(uint32_t round) {
  const int64_t first = static_cast<int64_t>(round) * gridDim.x;
  return first + ((round & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
}

// Work item `item`: its batch item, first query row and key blocks [first, n_blocks), in
// flash_forward_sm90.cuh's order (longest_first: causal items longest first across the batch);
// a part of a split item takes a range of them. Under causality the row blocks end at L, not
// start at row 0: where L leaves 64 or more rows of the last block empty, the first block
// starts that many rows (whole 64s) before row 0 instead. A consumer warpgroup with no row in
// [0, L) still computes, and under causality rows past L would see every key: at D = 64
// (192-row items), S = 4096, two of the three warpgroups of each longest item did, 6% of the
// products (perf/NOTES.md, v61). Rows before 0 see no key (they stay -inf and are not written);
// each row's arithmetic is unchanged. Not with a mask, whose map of hidden tiles starts at row 0
// (the checks never pass a mask with causality).
struct WorkItem {
  int64_t b, m0;
  int n_blocks;
  int first = 0;
};
template <class F>
__device__ __forceinline__ WorkItem work_item(const AttentionProblem& p, int64_t item,
                                              int64_t row_blocks, bool longest_first) {
  const int64_t b = longest_first ? item % p.batch : item / row_blocks;
  const int64_t rank = longest_first ? item / p.batch : item % row_blocks;  // 0: the longest
  const int64_t first_row =
      p.causal && p.mask == nullptr ? -((row_blocks * F::kBlockM - p.len_q) / 64 * 64) : 0;
  const int64_t m0 = first_row + (row_blocks - 1 - rank) * F::kBlockM;
  const int64_t key_end =
      p.causal ? min64(p.len_kv, min64(m0 + F::kBlockM, p.len_q)) : p.len_kv;
  return {b, m0, static_cast<int>(ceil_div(key_end, F::kBlockN))};
}

// This CTA's work in round `round` into w (and unit: the part's unit, or -1 for a whole
// item); false once it has none left.
template <class F>
__device__ __forceinline__ bool schedule(const AttentionProblem& p, uint32_t round,
                                         int64_t row_blocks, bool longest_first,
                                         const SplitTail split, WorkItem& w, int& unit) {
  unit = -1;
  if (split.parts > 1 && round >= split.full_rounds) {
    const int tail_unit = static_cast<int>(blockIdx.x);
    if (round > split.full_rounds || tail_unit >= split.units()) {
      return false;
    }
    w = work_item<F>(p, static_cast<int64_t>(split.full_rounds) * gridDim.x +
                            tail_unit % split.tail_items,
                     row_blocks, longest_first);
    const int part = tail_unit / split.tail_items, blocks = w.n_blocks;
    w.first = part * blocks / split.parts;
    w.n_blocks = (part + 1) * blocks / split.parts;
    unit = tail_unit;
    return true;
  }
  const int64_t item = scheduled_item(round);
  if (item >= p.batch * row_blocks) {
    return false;
  }
  w = work_item<F>(p, item, row_blocks, longest_first);
  return true;
}

// One warp's rows of the item (a consumer's here, a warpgroup's in flash_forward_sm90.cuh):
// where they start, and the online softmax's state.
struct Rows {
  int64_t m0;     // the item's first query row
  int warp_row0;  // this warp's first row in the item
  int g, t;       // fragment row (groupID) and column pair (threadID_in_group)
  float row_max[2], row_sum[2];  // rows g and g + 8 of the warp
};

// The end of a part (unit `unit` of `split`), by every consumer thread: its O (unnormalised),
// row maxima (log2 units: `unit_scale` the softmax's factor) and row sums to the workspace, then
// one arrival per CTA on the item's count (by `leader`; `flag`: a shared word for the answer).
// The CTA whose arrival is the item's last writes its output and lse from every part, in part
// order (max-rescaled sums, as the online softmax's), reading past L1: other SMs wrote them.
template <typename T, class F>
__device__ __forceinline__ void finish_part(T* __restrict__ out, float* __restrict__ lse,
                                            const float (&o)[F::kDTiles * 4], const Rows& r,
                                            const WorkItem& w, int unit, const SplitTail split,
                                            float unit_scale, uint32_t flag,
                                            const AttentionProblem& p, bool leader) {
  constexpr int Dv = F::kValueDim, kBlockM = F::kBlockM, kDTiles = F::kDTiles;
  constexpr float kLn2 = 0.6931471805599453f;
  constexpr unsigned kFullMask = 0xffffffffu;
  constexpr uint32_t kSplitBarrier = 3, kThreads = 128 * F::kConsumers;  // 1, 2, 4: turns
  const int64_t L = p.len_q;
  const int item = unit % split.tail_items;
  float* const stats = split.partial + static_cast<int64_t>(split.units()) * kBlockM * Dv;
  const auto row_of = [&](int part_unit, int row) {
    return static_cast<int64_t>(part_unit) * kBlockM + row;
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = r.row_sum[h];
    sum += __shfl_xor_sync(kFullMask, sum, 1);
    sum += __shfl_xor_sync(kFullMask, sum, 2);
    const int row = r.warp_row0 + r.g + 8 * h;
    float* const part_row = split.partial + row_of(unit, row) * Dv + 2 * r.t;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) {
      *reinterpret_cast<float2*>(part_row + 8 * j) =
          make_float2(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]);
    }
    if (r.t == 0) {
      const float row_max = r.row_max[h] == -INFINITY ? -INFINITY : r.row_max[h] * unit_scale;
      *reinterpret_cast<float2*>(stats + 2 * row_of(unit, row)) = make_float2(row_max, sum);
    }
  }
  __threadfence();  // this thread's part, before the CTA's arrival
  named_barrier_sync(kSplitBarrier, kThreads);
  if (leader) {
    st_shared_b32(flag, atomicAdd(split.arrivals + item, 1u) + 1 == unsigned(split.parts));
  }
  named_barrier_sync(kSplitBarrier, kThreads);
  if (ld_shared_b32(flag) == 0) {
    return;  // another part's CTA combines
  }
  __threadfence();  // the other parts' writes, seen through their arrivals
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = r.warp_row0 + r.g + 8 * h;
    const int64_t query = w.m0 + row;
    float row_max = -INFINITY;
    for (int part = 0; part < split.parts; ++part) {
      row_max = fmaxf(row_max, __ldcg(stats + 2 * row_of(part * split.tail_items + item, row)));
    }
    float total = 0.f, acc[kDTiles][2] = {};
    for (int part = 0; part < split.parts; ++part) {
      const int part_unit = part * split.tail_items + item;
      const float2 stat =
          __ldcg(reinterpret_cast<const float2*>(stats + 2 * row_of(part_unit, row)));
      const float weight = row_max == -INFINITY ? 0.f : exp2_approx(stat.x - row_max);
      total += weight * stat.y;
      const float* const part_row = split.partial + row_of(part_unit, row) * Dv + 2 * r.t;
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
        const float2 value = __ldcg(reinterpret_cast<const float2*>(part_row + 8 * j));
        acc[j][0] = fmaf(weight, value.x, acc[j][0]);
        acc[j][1] = fmaf(weight, value.y, acc[j][1]);
      }
    }
    if (query < L) {
      const float inv_total = total > 0.f ? 1.f / total : 0.f;
      T* const out_row = out + (w.b * L + query) * value_dim(p);
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
        if (Dv == value_dim(p) || 8 * j < value_dim(p)) {
          *reinterpret_cast<uint32_t*>(out_row + 8 * j + 2 * r.t) =
              pack2<T>(acc[j][0] * inv_total, acc[j][1] * inv_total);
        }
      }
      if (r.t == 0) {
        lse[w.b * L + query] = total > 0.f ? row_max * kLn2 + logf(total) : -INFINITY;
      }
    }
  }
}

}  // namespace sm90_ws
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_FORWARD_SM90_WS_SCHEDULE_CUH_
