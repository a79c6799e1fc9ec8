// The backward for Hopper (compute capability 9.0), bf16/fp16, head dims 64 and 128: the
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
// capability 9.0 it takes bf16/fp16 at head dim 64 or 128 (takes_tensor_cores: GQA, a mask and
// dropout included, query blocks a mask hides entirely skipped; 16-byte aligned tensors) on this
// kernel, otherwise it calls flash_backward.cuh's
// launch_flash_backward_mma_sync (which declines what neither covers: the caller then runs the
// generic kernels). The wgmma body
// exists only in an sm_90a image (fixed/_build.py compiles sm_90a wherever the arch list has
// 9.0); in any other image this kernel runs flash_backward.cuh's mma.sync body
// (flash_backward_cta) with that file's tiling of the same CTA shape (256 threads, 128 keys, the
// same query blocks): slower, never wrong, and the launcher needs no way to tell images apart.
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

#include "attention_problem.cuh"        // AttentionProblem
#include "flash_backward.cuh"           // launch_flash_backward_mma_sync, detail::backward
#include "flash_backward_sm90_cta.cuh"  // BackwardTile, wgmma_backward_cta
#include "flash_common.cuh"             // for_score_args, takes_tensor_cores, aligned16, ...
#include "flash_forward_sm90.cuh"       // current_device_is_sm90

namespace fixed_attention {
namespace kernels {
namespace flash {
namespace sm90 {

template <typename T, class F, int kArgs>
__global__ void __launch_bounds__(F::kThreads, 1)
    flash_backward_sm90_kernel(const T* __restrict__ q,             // (B, L, D)
                               const T* __restrict__ k,             // (B, S, D)
                               const T* __restrict__ v,             // (B, S, D)
                               const T* __restrict__ dout,          // (B, L, D)
                               const float* __restrict__ lse_log2,  // (B, Lp)
                               const float* __restrict__ delta,     // (B, Lp)
                               float* __restrict__ dq_accum,        // (B, Lp, D)
                               T* __restrict__ dk,                  // (B, S, D)
                               T* __restrict__ dv,                  // (B, S, D)
                               const AttentionProblem p, const int64_t rows_padded,
                               const bool longest_first) {  // causal work order
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  wgmma_backward_cta<T, F, kArgs>(q, k, v, dout, lse_log2, delta, dq_accum, dk, dv, p,
                                  rows_padded, longest_first);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  flash_backward_cta<T, typename F::Fallback, true, kArgs>(q, k, v, dout, lse_log2, delta,
                                                           dq_accum, dk, dv, p, rows_padded,
                                                           longest_first);
#endif
}

// Launches the three kernels (prologue, this main kernel, dq) on `stream`, or returns false
// having launched nothing when no sm_80+ image of the kernel exists for the device.
template <typename T, class F>
bool launch_backward(const T* dout, const T* q, const T* k, const T* v, const T* out,
                     const float* lse, float* lse_log2, float* delta, float* dq_accum, T* dq,
                     T* dk, T* dv, const AttentionProblem& p, cudaStream_t stream) {
  auto* kernel = for_score_args(p, flash_backward_sm90_kernel<T, F, kNoArgs>,
                                flash_backward_sm90_kernel<T, F, kMaskOnly>,
                                flash_backward_sm90_kernel<T, F, kMaskAndDropout>);
  if (!detail::has_tensor_core_image(kernel)) {
    return false;
  }
  const std::size_t smem = p.mask != nullptr ? F::kMaskedSmemBytes : F::kSmemBytes;
  detail::backward<T, typename F::Fallback, true>(kernel, smem, dout, q, k, v, out, lse, lse_log2,
                                                  delta, dq_accum, dq, dk, dv, p, stream);
  return true;
}

// The wgmma backward where it covers the case: bf16/fp16 (T), head dim 64 or 128,
// takes_tensor_cores, compute capability 9.0, 16-byte aligned tensors. Otherwise false,
// nothing launched.
// The workspace: flash_backward_rows's rows (the query blocks are flash_backward.cuh's).
template <typename T>
bool backward(const T* dout, const T* q, const T* k, const T* v, const T* out, const float* lse,
              float* lse_log2, float* delta, float* dq_accum, T* dq, T* dk, T* dv,
              const AttentionProblem& p, cudaStream_t stream) {
  if (!detail::takes_tensor_cores(p) || (p.head_dim != 64 && p.head_dim != 128) ||
      !current_device_is_sm90()) {
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
  return p.head_dim == 64
             ? launch_backward<T, BackwardTile<64>>(dout, q, k, v, out, lse, lse_log2, delta,
                                                    dq_accum, dq, dk, dv, p, stream)
             : launch_backward<T, BackwardTile<128>>(dout, q, k, v, out, lse, lse_log2, delta,
                                                     dq_accum, dq, dk, dv, p, stream);
}

}  // namespace sm90
}  // namespace flash

// The glue's entry point, one overload per dtype (non-templates, so that nvcc's compile check of
// this header instantiates every kernel): the arguments and contract of flash_backward.cuh's
// launch_flash_backward_mma_sync, whose workspace (flash_backward_rows) it takes. On compute
// capability 9.0 the wgmma kernel, otherwise (or where it declines) the mma.sync one; false,
// having launched nothing, where neither covers the case.
inline bool launch_flash_backward(const float* dout, const float* q, const float* k,
                                  const float* v, const float* out, const float* lse,
                                  float* lse_log2, float* delta, float* dq_accum, float* dq,
                                  float* dk, float* dv, const AttentionProblem& p,
                                  cudaStream_t stream) {
  return launch_flash_backward_mma_sync(dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq,
                                        dk, dv, p, stream);  // float32: 3xTF32 on mma.sync
}
inline bool launch_flash_backward(const __half* dout, const __half* q, const __half* k,
                                  const __half* v, const __half* out, const float* lse,
                                  float* lse_log2, float* delta, float* dq_accum, __half* dq,
                                  __half* dk, __half* dv, const AttentionProblem& p,
                                  cudaStream_t stream) {
  return flash::sm90::backward(dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq, dk, dv,
                               p, stream) ||
         launch_flash_backward_mma_sync(dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq,
                                        dk, dv, p, stream);
}
inline bool launch_flash_backward(const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                  const __nv_bfloat16* k, const __nv_bfloat16* v,
                                  const __nv_bfloat16* out, const float* lse, float* lse_log2,
                                  float* delta, float* dq_accum, __nv_bfloat16* dq,
                                  __nv_bfloat16* dk, __nv_bfloat16* dv,
                                  const AttentionProblem& p, cudaStream_t stream) {
  return flash::sm90::backward(dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq, dk, dv,
                               p, stream) ||
         launch_flash_backward_mma_sync(dout, q, k, v, out, lse, lse_log2, delta, dq_accum, dq,
                                        dk, dv, p, stream);
}

}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_BACKWARD_SM90_CUH_
