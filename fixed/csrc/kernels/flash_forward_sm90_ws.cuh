// The forward for Hopper, warp-specialized (FlashAttention-3's structure; perf/NOTES.md, v20,
// v21): bf16/fp16, causal or not, GQA, an additive mask (loaded by TMA; blocks it hides
// skipped) and dropout; head dims E and Ev up to 256, multiples of 8, computed at D = 64, 128 or
// 256 (V and O at 64 where Ev <= 64 < E <= 128, without a mask or dropout: Tile128Ev64 and
// Tile128Ev64Wide): the TMA loads fill the columns past E (Q, K) and Ev (V) with zeros, which
// add nothing to Q K^T and give output columns the kernel does not write. No padded copies. A
// TMA producer warp, two or three consumer warpgroups with setmaxnreg, each one's softmax under
// the others' products, turns at issuing them (ping-pong between two at D = 128 and up, a
// rotation of three at D = 64 without a mask or dropout), one persistent CTA per SM: the CTA is
// flash_forward_sm90_ws_cta.cuh, the SDPA arguments' parts flash_forward_sm90_ws_args.cuh. This
// file holds the kernel and its launcher, which makes the TMA descriptors of Q, K, V, the mask
// and O (stored by TMA in the two-consumer tilings without a mask or dropout) and declines what
// the kernel does not cover (a mask TMA cannot read: keys not contiguous, rows not 16-byte
// aligned; flash_forward_sm90.cuh's kernel takes those).
//
// Outside an sm_90a image the kernel body is a marker and a trap: its launcher reads the marker
// (has_sm90a_image) and declines there, and flash_forward_sm90.cuh's kernel runs instead.
//
// No torch includes: CI compile-checks this header for sm_90a and sm_90 without a GPU.
#ifndef FIXED_FLASH_FORWARD_SM90_WS_CUH_
#define FIXED_FLASH_FORWARD_SM90_WS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "attention_problem.cuh"           // AttentionProblem, ceil_div, ...
#include "flash_common.cuh"                // smem_addr, ScoreArgs, ...
#include "flash_forward_sm90_ws_cta.cuh"   // Tile, produce, consume
#include "sm90_pipeline.cuh"               // setmaxnreg, tensor maps

namespace fixed_attention {
namespace kernels {
namespace flash {
namespace sm90_ws {

#if FIXED_HAS_TENSOR_MAPS
// kArgs: flash_common.cuh's ScoreArgs (kNoArgs compiles no mask or dropout code).
template <typename T, class F, int kArgs>
__global__ void __launch_bounds__(F::kThreads, 1)
    flash_forward_sm90_ws_kernel(const __grid_constant__ CUtensorMap q_map,  // (B, L, D)
                            const __grid_constant__ CUtensorMap k_map,  // (B / group, S, D)
                            const __grid_constant__ CUtensorMap v_map,  // (B / group, S, D)
                            const __grid_constant__ CUtensorMap mask_map,  // unused without
                            const __grid_constant__ CUtensorMap o_map,  // (B, L, Ev)
                            T* __restrict__ out,                        // (B, L, D)
                            float* __restrict__ lse,                    // (B, L)
                            const AttentionProblem p,
                            const bool longest_first,  // causal work order
                            const SplitTail split) {   // the last round's split, if any
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint4 ws_smem[];
  const uint32_t q_tile = (smem_addr(ws_smem) + 1023u) & ~1023u;  // swizzle atoms: 1024 bytes
  const uint32_t k_tiles = q_tile + F::kQBytes;
  const uint32_t v_tiles = k_tiles + F::kStages * F::kKBytes;
  const uint32_t mask_tiles = v_tiles + F::kStages * F::kVBytes;
  const Barriers<F> bar{mask_tiles + F::kMaskStages * F::kMaskBytes};
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  // Read from lane 0 so that the compiler knows it is warp-uniform (flash_forward_sm90.cuh).
  const int warp = __shfl_sync(0xffffffffu, tid >> 5, 0);
  if (tid == 0) {
    mbarrier_init(bar.q_full(), 1);
    mbarrier_init(bar.q_empty(), F::kConsumerWarps);
    for (uint32_t stage = 0; stage < F::kStages; ++stage) {
      mbarrier_init(bar.k_full(stage), 1);
      mbarrier_init(bar.v_full(stage), 1);
      mbarrier_init(bar.k_empty(stage), F::kConsumerWarps);
      mbarrier_init(bar.v_empty(stage), F::kConsumerWarps);
    }
    for (int stage = 0; stage < F::kMaskStages; ++stage) {
      mbarrier_init(bar.mask_full(stage), 1);
      mbarrier_init(bar.mask_empty(stage), F::kConsumerWarps);
    }
    fence_mbarrier_init();
    prefetch_tensor_map(&q_map);
    prefetch_tensor_map(&k_map);
    prefetch_tensor_map(&v_map);
    if (kArgs != kNoArgs && p.mask != nullptr) {
      prefetch_tensor_map(&mask_map);
    }
    if (stages_o<F, kArgs>()) {
      prefetch_tensor_map(&o_map);
    }
  }
  __syncthreads();  // the last CTA-wide barrier: the producer's idle warps leave below
  // A constant "no split" where the tiling or the arguments rule it out: no code for it there.
  const SplitTail tail = kArgs == kNoArgs && F::kSplitsTail ? split : SplitTail{};
  if (warp < 4) {
    setmaxnreg_dec<F::kProducerRegisters>();
    if (tid == 0) {
      produce<F, kArgs>(&q_map, &k_map, &v_map, &mask_map, bar, q_tile, k_tiles, v_tiles,
                        mask_tiles, p, longest_first, tail);
    }
    return;
  }
  setmaxnreg_inc<F::kConsumerRegisters>();
  consume<T, F, kArgs>(out, lse, &o_map, bar, q_tile, k_tiles, v_tiles, mask_tiles, p,
                       longest_first, tail, (warp >> 2) - 1, warp & 3, lane);
#elif defined(__CUDA_ARCH__)
  // Any other image: a marker the launcher reads on the host (has_sm90a_image: the sm_90a body
  // has no static shared memory, this one 16 bytes), and a trap, were it launched all the same.
  __shared__ uint32_t no_sm90a_body[4];
  if (p.batch < 0) {  // never: keeps the marker
    reinterpret_cast<volatile uint32_t*>(no_sm90a_body)[threadIdx.x & 3] = 0;
  }
  __trap();
#endif
}

// The map of the problem's mask for tiling F (flash_forward_sm90_ws_args.cuh), false where TMA
// cannot read it.
template <class F>
bool encode_mask_map(CUtensorMap* map, const AttentionProblem& p) {
  const int64_t sizes[4] = {p.len_kv, p.len_q, p.heads, p.heads > 0 ? p.batch / p.heads : 0};
  const int64_t strides[4] = {p.mask_stride_col, p.mask_stride_row, p.mask_stride_head,
                              p.mask_stride_outer};
  // Entries of F::MaskEntry: float, or the inputs' 16-bit dtype (mask_in_input_dtype).
  return flash::encode_mask_map(map, static_cast<const typename F::MaskEntry*>(p.mask), sizes,
                                strides, mask_box_rows<F>(p));
}

// The last round's split for tiling F on `grid` CTAs (flash_forward_sm90_ws_schedule.cuh):
// problems without causality, a mask or dropout only.
template <class F>
SplitTail split_plan(const AttentionProblem& p, int64_t grid) {
  const bool plain = F::kSplitsTail && !p.causal && p.mask == nullptr && !(p.dropout_p > 0.f);
  return plan_split_tail(p.batch * ceil_div(p.len_q, F::kBlockM), grid,
                         ceil_div(p.len_kv, F::kBlockN), plain);
}

// The workspace split_plan needs on the current device (sizes only; none: zeros).
template <class F>
SplitWorkspace split_workspace(const AttentionProblem& p) {
  const int64_t items = p.batch * ceil_div(p.len_q, F::kBlockM), sms = detail::multiprocessors();
  const SplitTail plan = split_plan<F>(p, items < sms ? items : sms);
  return {nullptr, split_tail_floats(plan, F::kBlockM, F::kValueDim), nullptr,
          plan.parts > 1 ? plan.tail_items : 0};
}

// One instantiation's launch: the tensor maps, one CTA per SM. False, having launched nothing,
// where the image or a map is missing. `workspace`: for the last round's split, which runs
// only where it holds what split_workspace asks for.
template <typename T, class F, int kArgs>
bool launch_kernel(const T* q, const T* k, const T* v, T* out, float* lse,
                   const AttentionProblem& p, bool longest_first, cudaStream_t stream,
                   const SplitWorkspace& workspace) {
  auto* kernel = flash_forward_sm90_ws_kernel<T, F, kArgs>;
  if (!has_sm90a_image(kernel)) {
    return false;
  }
  const int64_t work = p.batch * ceil_div(p.len_q, F::kBlockM);
  if (work <= 0) {
    return true;  // empty: nothing to launch
  }
  CUtensorMap q_map, k_map, v_map, mask_map{}, o_map{};
  const int64_t kv_items = p.batch / p.kv_group;
  if (!encode_rows_map(&q_map, q, p.batch, p.len_q, p.head_dim, F::kBlockM) ||
      !encode_rows_map(&k_map, k, kv_items, p.len_kv, p.head_dim, F::kBlockN) ||
      !encode_rows_map(&v_map, v, kv_items, p.len_kv, value_dim(p), F::kBlockN) ||
      (stages_o<F, kArgs>() &&  // O stored by TMA, a warp's 16 rows at a time
       !encode_rows_map(&o_map, static_cast<const T*>(out), p.batch, p.len_q, value_dim(p), 16)) ||
      (p.mask != nullptr && !encode_mask_map<F>(&mask_map, p))) {
    return false;
  }
  const int64_t sms = detail::multiprocessors();
  if (sms <= 0) {
    return false;  // the caller takes another kernel
  }
  kernels::detail::allow_shared_memory(kernel, F::kSmemBytes);
  const unsigned grid = static_cast<unsigned>(work < sms ? work : sms);  // one CTA per SM
  SplitTail split = kArgs == kNoArgs ? split_plan<F>(p, grid) : SplitTail{};
  if (split.parts > 1 && workspace.partial != nullptr && workspace.arrivals != nullptr &&
      workspace.floats >= split_tail_floats(split, F::kBlockM, F::kValueDim) &&
      workspace.counts >= split.tail_items) {
    split.partial = workspace.partial;
    split.arrivals = workspace.arrivals;
  } else {
    split = SplitTail{};  // whole items in every round
  }
  // The kernel's longest_first: items batch-minor (the order of both cases).
  const bool batch_minor = (p.causal && longest_first) || detail::mask_shared_by_neighbours(p);
  kernel<<<grid, F::kThreads, F::kSmemBytes, stream>>>(q_map, k_map, v_map, mask_map, o_map, out,
                                                       lse, p, batch_minor, split);
  return true;
}

// Launches the kernel for a case it covers (see the header comment) and returns true; returns
// false, having launched nothing, for any other. The caller checked the device (9.0), the
// dtype and 16-byte aligned inputs, and chose F's head dim: E and Ev at most it. F: the tiling
// without a mask or dropout, FArgs: with them (a tiling without mask stages declines those
// problems). longest_first: the causal work order (launch's is longest_first_for;
// perf/fwd_sm90_check.cu times both).
template <typename T, class F, class FArgs = F>
bool launch_in_order(const T* q, const T* k, const T* v, T* out, float* lse,
                     const AttentionProblem& p, bool longest_first, cudaStream_t stream,
                     const SplitWorkspace& workspace = {}) {
  constexpr int64_t kMaxCoordinate = std::numeric_limits<int32_t>::max();  // TMA's coordinates
  static_assert(FArgs::kHeadDim == F::kHeadDim);
  const int64_t E = p.head_dim, Ev = value_dim(p);
  if (E <= 0 || E > F::kHeadDim || E % 8 != 0 || Ev <= 0 || Ev > F::kValueDim || Ev % 8 != 0 ||
      p.len_kv <= 0 || p.kv_group <= 0 || p.batch % p.kv_group != 0 || p.len_q > kMaxCoordinate ||
      p.len_kv > kMaxCoordinate || p.batch > kMaxCoordinate) {
    return false;
  }
  if (p.mask == nullptr && !(p.dropout_p > 0.f)) {
    return launch_kernel<T, F, kNoArgs>(q, k, v, out, lse, p, longest_first, stream,
                                        workspace);
  }
  if constexpr (FArgs::kMaskStages == 0) {
    return false;
  } else if (p.mask_in_input_dtype) {  // the tiling with 16-bit mask boxes
    using FNarrow = typename FArgs::template WithMaskEntry<T>;
    return p.dropout_p > 0.f
               ? launch_kernel<T, FNarrow, kMaskAndDropout>(q, k, v, out, lse, p, longest_first,
                                                            stream, {})
               : launch_kernel<T, FNarrow, kMaskOnly>(q, k, v, out, lse, p, longest_first, stream,
                                                      {});
  } else {
    return p.dropout_p > 0.f
               ? launch_kernel<T, FArgs, kMaskAndDropout>(q, k, v, out, lse, p, longest_first,
                                                          stream, {})
               : launch_kernel<T, FArgs, kMaskOnly>(q, k, v, out, lse, p, longest_first, stream,
                                                    {});
  }
}

// The causal work order as measured for this kernel on an H100 (perf/NOTES.md, v21 and v23;
// B x H = 4 to 128, S = 2048 to 8192): longest first at D = 64 (0.99-1.76x batch-major's
// speed); at D = 128 and 256 longest first where there are at most 16 batch items (B x H),
// 0.98-1.75x, and batch-major with more, where longest first ran at 0.60-0.99x. The wgmma
// kernel's L2 rule (flash_common.cuh's longest_first_pays, fitted on an H200) chose the slower
// order in three of v21's six cells.
template <class F>
constexpr bool longest_first_for(bool causal, int64_t batch) {
  return causal && (F::kHeadDim == 64 || batch <= 16);
}

template <typename T, class F, class FArgs = F>
bool launch(const T* q, const T* k, const T* v, T* out, float* lse, const AttentionProblem& p,
            cudaStream_t stream, const SplitWorkspace& workspace = {}) {
  return launch_in_order<T, F, FArgs>(q, k, v, out, lse, p,
                                      longest_first_for<F>(p.causal, p.batch), stream, workspace);
}
#else  // a toolkit without tensor maps
template <typename T, class F, class FArgs = F>
bool launch_in_order(const T*, const T*, const T*, T*, float*, const AttentionProblem&, bool,
                     cudaStream_t, const SplitWorkspace& = {}) {
  return false;
}
template <typename T, class F, class FArgs = F>
bool launch(const T*, const T*, const T*, T*, float*, const AttentionProblem&, cudaStream_t,
            const SplitWorkspace& = {}) {
  return false;
}
template <class F>
SplitWorkspace split_workspace(const AttentionProblem&) {
  return {};
}
#endif  // FIXED_HAS_TENSOR_MAPS

// The tilings the operator uses (perf/NOTES.md, v20, v21): ping-pong paid at D = 128 (1.14x)
// and cost at D = 64 (0.92x), where the products are short beside the softmax; a third stage of
// K and V paid at D = 128 (1.04x; 225 KB of shared memory); at D = 64 three consumer
// warpgroups (192-row items) paid 1.10-1.15x, and then a third stage 1.00-1.02x (120 KB); at
// D = 128 three consumers paid only from S = 8192 on (Tile128Three, below). With a
// mask or dropout (v21): two consumers (three spilled 224-352 bytes), 64 KB per mask stage, two
// at D = 64 (209 KB in all); at D = 128 one, and two K and V stages. The three consumers at D =
// 64 take turns in rotation (v55: 1.02-1.04x over the same tile without turns; 1.05-1.07x without
// causality and 0.99-1.05x causal over v54's, which also had each warpgroup stop at its rows'
// diagonal).
using Tile64 = Tile<64, 128, 3, true, 0, 3>;
// The same tile with O through shared memory and TMA stores, as the two-consumer tilings store it
// (v56), for short items: kernels alone 1.01-1.03x at S <= 2048, 1.00x at 4096 (0.97x in the
// operator with cold inputs), 0.99x at S >= 8192 and about 1.00x under causality, where the
// writers' waits for the other warpgroups cost about what the stores saved (v57, v58).
using Tile64Staged = Tile<64, 128, 3, true, 0, 3, float, 64, true>;
constexpr bool d64_stages_o(bool causal, int64_t len_kv) {  // Tile64Staged, not Tile64
  return !causal && len_kv <= 2048;
}
using Tile128 = Tile<128, 128, 3, true>;
using Tile64Args = Tile<64, 128, 2, false, 2>;
using Tile128Args = Tile<128, 128, 2, true, 1>;
// Ev <= 64 under 64 < E <= 128 (the bench's Ev = D / 2 at D = 128), without a mask or
// dropout: P V at 64 columns, not 128 of which half are zeros (perf/NOTES.md, v34); without
// causality in key blocks of 176 as Tile128Wide (two stages, 168 KB; v47).
using Tile128Ev64 = Tile<128, 128, 3, true, 0, 2, float, 64>;
using Tile128Ev64Wide = Tile<128, 176, 2, true, 0, 2, float, 64>;
// 64 < E <= 128 without a mask or dropout, without causality below S = 8192 and with it from
// 8192 on: key blocks of 176 (FlashAttention-3's), two stages (214 KB): fewer softmax steps and
// barrier rounds per key (perf/NOTES.md, v35; causal, kernels alone, 1.02-1.03x at S = 8192,
// 1.04-1.06x at 16384, 1.00x at 4096 and 0.96x at 2048 against Tile128: v61, v62).
using Tile128Wide = Tile<128, 176, 2, true>;
// 64 < E <= 128 without causality, a mask or dropout, and with S >= 8192: three consumers
// (192-row items) in rotation, key blocks of 80 (to fit their 160 registers), three stages
// (169 KB), O stored from registers (a K or V stage holds one consumer's 16 KB, not three).
// Kernels alone, over Tile128Wide: 1.02x at (B x H, S) = (64, 8192) and (64, 16384), 1.03x at
// (16, 16384), 1.01x at (16, 8192); 0.94x at 2048, 0.99x at 3072, 0.96-0.98x at 4096 (perf/
// NOTES.md, v55, v62).
using Tile128Three = Tile<128, 80, 3, true, 0, 3>;
constexpr bool d128_long_keys(int64_t len_kv) {  // Tile128Three, or causal Tile128Wide
  return len_kv >= 8192;
}
// D = 256 (O is 128 of a consumer's 240 registers): key blocks of 80 (FlashAttention-3's; 64
// with a mask), two K and V stages (225 KB; with a mask stage 225 KB), ping-pong (v35).
using Tile256 = Tile<256, 80, 2, true>;
using Tile256Args = Tile<256, 64, 2, true, 1>;

}  // namespace sm90_ws
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_FORWARD_SM90_WS_CUH_
