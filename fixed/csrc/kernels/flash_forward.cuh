// FlashAttention-2-style forward for half and bfloat16 on tensor cores (mma.sync m16n8k16,
// ldmatrix, cp.async: sm_80 and later, Ampere and Hopper), head dims 64, 128 and 256. The launchers
// at the bottom return false, launching nothing, for every case they do not cover (float32,
// other head dims, Ev != E, inputs not 16-byte aligned, no sm_80+ image of the kernel for the
// device); the caller then runs the generic kernel of attention_kernels.cuh: the same function.
// GQA they take (each query head reads its group's K and V), and an additive mask and dropout,
// in separate instantiations (flash_common.cuh's ScoreArgs): the mask's entry is added to each
// scaled score, dropout scales the probabilities that go into P V. On Hopper
// (compute capability 9.0) the caller tries flash_forward_sm90.cuh (wgmma) first, which takes
// both head dims; its kernel runs flash_forward_cta (flash_forward_cta.cuh) in images without
// wgmma.
//
// No torch includes, so CI compile-checks this header on a machine without a GPU:
//   nvcc -arch=sm_90 -x cu -c fixed/csrc/kernels/flash_forward.cuh -o /dev/null
// The launchers are non-template functions, so that command instantiates every kernel variant.
//
// The algorithm (tiling, shared memory, pipeline) and the CTA's body: flash_forward_cta.cuh.
#ifndef FIXED_FLASH_FORWARD_CUH_
#define FIXED_FLASH_FORWARD_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention_problem.cuh"  // AttentionProblem, ceil_div, detail::grid_for, ...
#include "flash_common.cuh"       // for_score_args, has_tensor_core_image, aligned16, ...
#include "flash_forward_cta.cuh"  // Tiling64, Tiling128(Causal), Tiling256, flash_forward_cta
#include "flash_forward_f32.cuh"  // forward_f32: float32 in 3xTF32

namespace fixed_attention {
namespace kernels {
namespace flash {

template <typename T, class F, int kArgs>
__global__ void __launch_bounds__(F::kThreads, 8 / F::kWarps)
    flash_forward_kernel(const T* __restrict__ q,  // (B, L, D)
                         const T* __restrict__ k,  // (B, S, D)
                         const T* __restrict__ v,  // (B, S, D)
                         T* __restrict__ out,      // (B, L, D)
                         float* __restrict__ lse,  // (B, L)
                         const AttentionProblem p,
                         const bool longest_first) {  // causal work order (see the launcher)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  flash_forward_cta<T, F, kArgs>(q, k, v, out, lse, p, longest_first);
#endif
}

// ------------------------------------------------------------------------ host launchers

namespace detail {

// Launches, or returns false having launched nothing.
template <typename T, class F>
bool launch(const T* q, const T* k, const T* v, T* out, float* lse, const AttentionProblem& p,
            cudaStream_t stream) {
  auto* kernel = for_score_args(p, flash_forward_kernel<T, F, kNoArgs>,
                                flash_forward_kernel<T, F, kMaskOnly>,
                                flash_forward_kernel<T, F, kMaskAndDropout>);
  if (!has_tensor_core_image(kernel)) {
    return false;
  }
  const int64_t work = p.batch * ceil_div(p.len_q, F::kBlockM);
  if (work <= 0) {
    return true;  // empty: nothing to launch (a zero-sized grid is an invalid launch)
  }
  kernels::detail::allow_shared_memory(kernel, F::kSmemBytes);
  const bool longest_first = p.causal && longest_first_pays(p.batch, p.len_kv, p.head_dim);  // K, V
  kernel<<<kernels::detail::grid_for(work), F::kThreads, F::kSmemBytes, stream>>>(
      q, k, v, out, lse, p, longest_first);
  return true;
}

template <typename T>
bool forward(const T* q, const T* k, const T* v, T* out, float* lse, const AttentionProblem& p,
             cudaStream_t stream) {
  if (!takes_tensor_cores(p) || p.mask_in_input_dtype) {
    return false;  // a mask in the inputs' dtype: the glue makes a float32 one and tries again
  }
  // 16-byte cp.async and stores: a contiguous tensor at an odd storage offset is not aligned.
  if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(out)) {
    return false;
  }
  switch (p.head_dim) {
    case 64: return launch<T, Tiling64>(q, k, v, out, lse, p, stream);
    case 128:
      return p.causal ? launch<T, Tiling128Causal>(q, k, v, out, lse, p, stream)
                      : launch<T, Tiling128>(q, k, v, out, lse, p, stream);
    case 256: return launch<T, Tiling256>(q, k, v, out, lse, p, stream);
    default: return false;
  }
}

}  // namespace detail
}  // namespace flash

// The launchers the glue calls first, one overload per dtype, same arguments as
// launch_attention_forward (contiguous (B, L, E) q, (B, S, E) k and v, out (B, L, E),
// lse (B, L) float32). Returns true when it has taken the case (one launch on `stream`, or none
// for empty work): the caller then checks the launch. Returns false, having launched nothing,
// when the case is not covered; the caller then runs launch_attention_forward.
// Throws std::runtime_error if the shared-memory opt-in fails, as the generic launchers do.
inline bool launch_flash_forward(const float* q, const float* k, const float* v, float* out,
                                 float* lse, const AttentionProblem& p, cudaStream_t stream) {
  return flash::detail::forward_f32(q, k, v, out, lse, p, stream);  // 3xTF32: float32's accuracy
}
inline bool launch_flash_forward(const __half* q, const __half* k, const __half* v, __half* out,
                                 float* lse, const AttentionProblem& p, cudaStream_t stream) {
  return flash::detail::forward(q, k, v, out, lse, p, stream);
}
inline bool launch_flash_forward(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                 const __nv_bfloat16* v, __nv_bfloat16* out, float* lse,
                                 const AttentionProblem& p, cudaStream_t stream) {
  return flash::detail::forward(q, k, v, out, lse, p, stream);
}

}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_FORWARD_CUH_
