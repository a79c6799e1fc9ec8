// The backward for Hopper (compute capability 9.0), bf16/fp16, head dims up to 128 (over it, to
// 256, the wide kernel below): the
// algorithm of flash_backward.cuh (transposed scores with keys as the M dimension, P from the
// forward's lse, dK and dV of a 128-key block in registers, dQ summed over key blocks in a float32
// workspace; the same prologue kernel, the same causal convention, tails and work order) with all
// five products on warpgroup MMA (wgmma.mma_async, sm_90a; wrappers and operand layouts in
// wgmma.cuh). A wgmma reads its shared-memory operands through descriptors, without the ldmatrix
// round trips through registers that bound the mma.sync kernel (perf/NOTES.md, v2, v7, v8):
// 1.2-1.3x its speed (v13). Each query block's dQ is staged in shared memory and added to the
// workspace by one bulk reduction instead of per-thread atomics: 1.2-1.3x more (v14).
//
// launch_flash_backward at the bottom is the glue's entry point: on a device of compute
// capability 9.0 it takes bf16/fp16 with E and Ev up to 128 (GQA, a mask and dropout included,
// query blocks a mask hides entirely skipped; 16-byte aligned tensors) on this kernel, up to 256
// on the wide kernel (flash_backward_sm90_wide.cuh: sm_90a images only), otherwise it calls
// flash_backward.cuh's
// launch_flash_backward_mma_sync (which declines what neither covers: the caller then runs the
// generic kernels). The wgmma body
// exists only in an sm_90a image (fixed/_build.py compiles sm_90a wherever the arch list has
// 9.0); in any other image both kernels are a marker and a trap: the launchers read the marker
// (has_sm90a_image) and decline, and flash_backward.cuh's mma.sync kernel (the same query
// blocks and workspace) runs instead.
//
// No torch includes: CI compile-checks this header for sm_90 and sm_90a without a GPU.
//
// The algorithm (tiling, the products' order, shared memory, registers) and the CTA's body:
// flash_backward_sm90_cta.cuh.
#ifndef FIXED_FLASH_BACKWARD_SM90_CUH_
#define FIXED_FLASH_BACKWARD_SM90_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "attention_problem.cuh"        // AttentionProblem
#include "flash_backward.cuh"           // launch_flash_backward_mma_sync, detail::backward
#include "flash_backward_sm90_cta.cuh"  // wgmma_backward_cta (and BackwardTile, through it)
#include "flash_backward_sm90_wide.cuh"  // BackwardTileWide, wgmma_backward_wide_cta
#include "flash_common.cuh"             // for_score_args, takes_tensor_cores, aligned16, ...
#include "flash_forward_sm90.cuh"       // current_device_is_sm90
#include "sm90_pipeline.cuh"            // tensor maps

namespace fixed_attention {
namespace kernels {
namespace flash {
namespace sm90 {

#if FIXED_HAS_TENSOR_MAPS
// kAsIs: E and Ev read from the problem (at most D, multiples of 8), else D at compile time (the
// code E = Ev = D had before kAsIs existed: reading them at run time made it 5-9% slower).
// The loader reads Q, K, V and dO through the tensor maps.
template <typename T, class F, int kArgs, bool kAsIs, bool kNarrowMask>
__global__ void __launch_bounds__(F::kThreads, 1)
    flash_backward_sm90_kernel(const __grid_constant__ CUtensorMap q_map,   // (B, L, E)
                               const __grid_constant__ CUtensorMap k_map,   // (B / group, S, E)
                               const __grid_constant__ CUtensorMap v_map,   // (B / group, S, Ev)
                               const __grid_constant__ CUtensorMap do_map,  // (B, L, Ev)
                               const float* __restrict__ lse_log2,  // (B, Lp)
                               const float* __restrict__ delta,     // (B, Lp)
                               float* __restrict__ dq_accum,        // (B, Lp, D)
                               T* __restrict__ dk,                  // (work items, S, E)
                               T* __restrict__ dv,                  // (work items, S, Ev)
                               const AttentionProblem p, const int64_t rows_padded,
                               const bool longest_first) {  // causal work order
  static_assert(!F::kSumsGroup || kArgs == kNoArgs, "a group's walk reads no mask, no dropout");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  wgmma_backward_cta<T, F, kArgs, kAsIs, kNarrowMask>(&q_map, &k_map, &v_map, &do_map, lse_log2,
                                                      delta, dq_accum, dk, dv, p, rows_padded,
                                                      longest_first);
#elif defined(__CUDA_ARCH__)
  // Any other image: a marker for the launcher (has_sm90a_image: 16 bytes of static shared
  // memory here, none in the sm_90a body), and a trap, were it launched all the same.
  __shared__ uint32_t no_sm90a_body[4];
  if (p.batch < 0) {  // never: keeps the marker
    reinterpret_cast<volatile uint32_t*>(no_sm90a_body)[threadIdx.x & 3] = 0;
  }
  __trap();
#endif
}
#endif  // FIXED_HAS_TENSOR_MAPS

// Head dims over 128 (flash_backward_sm90_wide.cuh): sm_90a only. Other images hold a marker
// for the launcher (has_sm90a_image) and a trap, were it launched all the same.
template <typename T, int kArgs, bool kAsIs>
__global__ void __launch_bounds__(BackwardTileWide::kThreads, 1)
    flash_backward_sm90_wide_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                    const T* __restrict__ v, const T* __restrict__ dout,
                                    const float* __restrict__ lse_log2,
                                    const float* __restrict__ delta,
                                    float* __restrict__ dq_accum, T* __restrict__ dk,
                                    T* __restrict__ dv, const AttentionProblem p,
                                    const int64_t rows_padded, const bool longest_first) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  wgmma_backward_wide_cta<T, kArgs, kAsIs>(q, k, v, dout, lse_log2, delta, dq_accum, dk, dv, p,
                                           rows_padded, longest_first);
#elif defined(__CUDA_ARCH__)
  __shared__ uint32_t no_sm90a_body[4];
  if (p.batch < 0) {  // never: keeps the marker
    reinterpret_cast<volatile uint32_t*>(no_sm90a_body)[threadIdx.x & 3] = 0;
  }
  __trap();
#endif
}

// Whether the problem asks for GQA's dK and dV per K/V item (AttentionProblem::dkv_per_kv_item):
// the group-summing tile's work (GroupSummingTile), F::kSumsGroup.
inline bool sums_group(const AttentionProblem& p) { return !dkv_per_query_item(p); }
// Where that tile runs: without SDPA's arguments or causal masking, at D = 64 and 128. A group's
// sum in registers saves writing dK, dV per query head and the sums after; causal, its 4x fewer
// and more unequal work items ran slower (perf/NOTES.md, v49), as would the masks' walks.
inline bool sums_group_pays(const AttentionProblem& p, int tile_dim) {
  return tile_dim != 256 && !p.causal && p.mask == nullptr && p.dropout_p == 0.f;
}

// Launches the three kernels (prologue, this main kernel, dq) on `stream`, or returns false
// having launched nothing when no image of the kernel that can take the problem exists for the
// device (sm_80+; with kAsIs, sm_90a) or TMA cannot read its tensors.
template <typename T, class F, bool kAsIs>
bool launch_backward(const T* dout, const T* q, const T* k, const T* v, const T* out,
                     const float* lse, float* lse_log2, float* delta, float* dq_accum, T* dq,
                     T* dk, T* dv, const AttentionProblem& p, cudaStream_t stream) {
#if FIXED_HAS_TENSOR_MAPS
  auto* kernel = flash_backward_sm90_kernel<T, F, kNoArgs, kAsIs, false>;
  if constexpr (!F::kSumsGroup) {  // the group-summing tile: no SDPA arguments (sums_group_pays)
    kernel = p.mask_in_input_dtype
                 ? for_score_args(p, kernel,
                                  flash_backward_sm90_kernel<T, F, kMaskOnly, kAsIs, true>,
                                  flash_backward_sm90_kernel<T, F, kMaskAndDropout, kAsIs, true>)
                 : for_score_args(p, kernel,
                                  flash_backward_sm90_kernel<T, F, kMaskOnly, kAsIs, false>,
                                  flash_backward_sm90_kernel<T, F, kMaskAndDropout, kAsIs, false>);
  }
  if (!has_sm90a_image(kernel)) {
    return false;  // the mma.sync kernel runs instead (launch_flash_backward)
  }
  if (p.mask_in_input_dtype && !mask_in_octets(p)) {  // the glue's promise (16-byte copies)
    throw std::invalid_argument(
        "fixed_attention kernels: a mask in the inputs' dtype needs contiguous keys and "
        "16-byte aligned rows");
  }
  constexpr int64_t kMaxCoordinate = std::numeric_limits<int32_t>::max();  // TMA's coordinates
  // dK and dV per K/V item under GQA (dkv_per_kv_item) from the group-summing tile alone.
  if (p.kv_group <= 0 || p.batch % p.kv_group != 0 || sums_group(p) != F::kSumsGroup ||
      p.len_q > kMaxCoordinate || p.len_kv > kMaxCoordinate || p.batch > kMaxCoordinate ||
      !detail::aligned16(lse_log2) || !detail::aligned16(delta)) {
    return false;
  }
  CUtensorMap q_map, k_map, v_map, do_map;
  const int64_t kv_items = p.batch / p.kv_group, E = p.head_dim, Ev = value_dim(p);
  if (!encode_rows_map(&q_map, q, p.batch, p.len_q, E, F::kBlockM) ||
      !encode_rows_map(&k_map, k, kv_items, p.len_kv, E, F::kBlockN) ||
      !encode_rows_map(&v_map, v, kv_items, p.len_kv, Ev, F::kBlockN) ||
      !encode_rows_map(&do_map, dout, p.batch, p.len_q, Ev, F::kBlockM)) {
    return false;
  }
  const std::size_t smem = p.mask != nullptr ? F::kMaskedSmemBytes : F::kUnmaskedSmemBytes;
  // The group-summing tile's work items: (K/V item, key block), not (query item, key block).
  const unsigned summed_grid =
      kernels::detail::grid_for(kv_items * ceil_div(p.len_kv, F::kBlockN));
  const auto launch_main = [&](unsigned grid, int64_t rows, bool longest_first) {
    kernels::detail::allow_shared_memory(kernel, smem);
    kernel<<<F::kSumsGroup ? summed_grid : grid, F::kThreads, smem, stream>>>(
        q_map, k_map, v_map, do_map, lse_log2, delta, dq_accum, dk, dv, p, rows, longest_first);
  };
  detail::backward_launches<T, typename F::Fallback, true, kAsIs, true>(
      launch_main, dout, out, lse, lse_log2, delta, dq_accum, dq, p, stream);
  return true;
#else  // a toolkit without tensor maps (nor wgmma)
  return false;
#endif
}

// The head dim D of the wgmma tile that takes the problem's E and Ev as they are (multiples of
// 8, at most 256: the narrowest of 64, 128 and 256 that holds both), 0 where none does.
inline int tile_head_dim(const AttentionProblem& p) {
  const int64_t E = p.head_dim, Ev = value_dim(p), widest = E > Ev ? E : Ev;
  if (E <= 0 || Ev <= 0 || E % 8 != 0 || Ev % 8 != 0 || widest > 256) {
    return 0;
  }
  return widest <= 64 ? 64 : widest <= 128 ? 128 : 256;
}

// The wide kernel's launches; false, having launched nothing, without an sm_90a image.
template <typename T, bool kAsIs>
bool launch_backward_wide(const T* dout, const T* q, const T* k, const T* v, const T* out,
                          const float* lse, float* lse_log2, float* delta, float* dq_accum,
                          T* dq, T* dk, T* dv, const AttentionProblem& p, cudaStream_t stream) {
  auto* kernel = for_score_args(p, flash_backward_sm90_wide_kernel<T, kNoArgs, kAsIs>,
                                flash_backward_sm90_wide_kernel<T, kMaskOnly, kAsIs>,
                                flash_backward_sm90_wide_kernel<T, kMaskAndDropout, kAsIs>);
  if (!has_sm90a_image(kernel)) {
    return false;
  }
  detail::backward<T, BackwardTileWide, true, kAsIs, true>(kernel, BackwardTileWide::kSmemBytes,
                                                           dout, q, k, v, out, lse, lse_log2,
                                                           delta, dq_accum, dq, dk, dv, p, stream);
  return true;
}

// The wgmma backward where it covers the case: bf16/fp16 (T), E and Ev of a tile_head_dim,
// compute capability 9.0, 16-byte aligned tensors. Otherwise false, nothing launched.
// The workspace: flash_backward_workspace's (the query blocks are flash_backward.cuh's).
template <typename T>
bool backward(const T* dout, const T* q, const T* k, const T* v, const T* out, const float* lse,
              float* lse_log2, float* delta, float* dq_accum, T* dq, T* dk, T* dv,
              const AttentionProblem& p, cudaStream_t stream) {
  const int tile_dim = tile_head_dim(p);
  if (tile_dim == 0 || !current_device_is_sm90()) {
    return false;
  }
  for (const void* pointer : {static_cast<const void*>(dout), static_cast<const void*>(q),
                              static_cast<const void*>(k), static_cast<const void*>(v),
                              static_cast<const void*>(out), static_cast<const void*>(dq),
                              static_cast<const void*>(dk), static_cast<const void*>(dv)}) {
    if (!detail::aligned16(pointer)) {
      return false;  // 16-byte copies and stores
    }
  }
  const bool as_is = p.head_dim != tile_dim || value_dim(p) != tile_dim;
  // One launch_backward per (tile, as_is), the tags carrying both as types.
  const auto launch = [&](auto tile, auto columns_as_is) {
    return launch_backward<T, decltype(tile), decltype(columns_as_is)::value>(
        dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq, dk, dv, p, stream);
  };
  if (sums_group(p) && !sums_group_pays(p, tile_dim)) {
    return false;  // the caller writes them per query item and sums (launch_flash_backward)
  }
  if (tile_dim == 256) {
    return as_is ? launch_backward_wide<T, true>(dout, q, k, v, out, lse, lse_log2, delta,
                                                 dq_accum, dq, dk, dv, p, stream)
                 : launch_backward_wide<T, false>(dout, q, k, v, out, lse, lse_log2, delta,
                                                  dq_accum, dq, dk, dv, p, stream);
  }
  if (sums_group(p)) {
    if (tile_dim == 64) {
      return as_is ? launch(GroupSummingTile<BackwardTile<64>>{}, std::true_type{})
                   : launch(GroupSummingTile<BackwardTile<64>>{}, std::false_type{});
    }
    return as_is ? launch(GroupSummingTile<BackwardTile<128>>{}, std::true_type{})
                 : launch(GroupSummingTile<BackwardTile<128>>{}, std::false_type{});
  }
  if (tile_dim == 64) {
    return as_is ? launch(BackwardTile<64>{}, std::true_type{})
                 : launch(BackwardTile<64>{}, std::false_type{});
  }
  return as_is ? launch(BackwardTile<128>{}, std::true_type{})
               : launch(BackwardTile<128>{}, std::false_type{});
}

}  // namespace sm90
}  // namespace flash

// The float32 workspace the glue allocates for launch_flash_backward: rows per batch item
// (flash_backward_rows's; 0 where no tensor-core backward takes the problem as it is) and the dQ
// accumulator's width: on compute capability 9.0 the wgmma tile's D for bf16/fp16 head dims it
// takes as they are (E, Ev narrower than D included), else E.
struct BackwardWorkspace {
  int64_t rows = 0, width = 0;
};
inline BackwardWorkspace flash_backward_workspace(const float* q, const AttentionProblem& p) {
  return {flash_backward_rows(q, p), p.head_dim};
}
template <typename T>
BackwardWorkspace flash_backward_workspace(const T* q, const AttentionProblem& p) {
  const int tile_dim = flash::sm90::tile_head_dim(p);
  if (tile_dim == 0 || !flash::sm90::current_device_is_sm90()) {
    return {flash_backward_rows(q, p), p.head_dim};
  }
  const int64_t rows =
      tile_dim == 64    ? flash::padded_rows<flash::BackwardTiling64>(p.len_q)
      : tile_dim == 128 ? flash::padded_rows<flash::BackwardTiling128>(p.len_q)
                        : flash::padded_rows<flash::sm90::BackwardTileWide>(p.len_q);
  return {rows, tile_dim};
}

// The glue's entry point, one overload per dtype (non-templates, so that nvcc's compile check of
// this header instantiates every kernel): the arguments and contract of flash_backward.cuh's
// launch_flash_backward_mma_sync, whose workspace (flash_backward_rows) it takes. On compute
// capability 9.0 the wgmma kernel, otherwise (or where it declines) the mma.sync one; false,
// having launched nothing, where neither covers the case. Under GQA, dk and dv hold B / kv_group
// items where p.dkv_per_kv_item (only Hopper's group-summing kernel takes that, where
// sums_group_pays), else B.
inline bool launch_flash_backward(const float* dout, const float* q, const float* k,
                                  const float* v, const float* out, const float* lse,
                                  float* lse_log2, float* delta, float* dq_accum, float* dq,
                                  float* dk, float* dv, const AttentionProblem& p,
                                  cudaStream_t stream) {
  return dkv_per_query_item(p) &&  // float32: 3xTF32 on mma.sync
         launch_flash_backward_mma_sync(dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq,
                                        dk, dv, p, stream);
}
inline bool launch_flash_backward(const __half* dout, const __half* q, const __half* k,
                                  const __half* v, const __half* out, const float* lse,
                                  float* lse_log2, float* delta, float* dq_accum, __half* dq,
                                  __half* dk, __half* dv, const AttentionProblem& p,
                                  cudaStream_t stream) {
  return flash::sm90::backward(dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq, dk, dv,
                               p, stream) ||
         (dkv_per_query_item(p) &&
          launch_flash_backward_mma_sync(dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq,
                                         dk, dv, p, stream));
}
inline bool launch_flash_backward(const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                  const __nv_bfloat16* k, const __nv_bfloat16* v,
                                  const __nv_bfloat16* out, const float* lse, float* lse_log2,
                                  float* delta, float* dq_accum, __nv_bfloat16* dq,
                                  __nv_bfloat16* dk, __nv_bfloat16* dv,
                                  const AttentionProblem& p, cudaStream_t stream) {
  return flash::sm90::backward(dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq, dk, dv,
                               p, stream) ||
         (dkv_per_query_item(p) &&
          launch_flash_backward_mma_sync(dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq,
                                         dk, dv, p, stream));
}

}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_BACKWARD_SM90_CUH_
