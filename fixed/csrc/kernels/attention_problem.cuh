// What every kernel of fixed_attention takes: the problem (AttentionProblem: sizes, scale, the
// SDPA arguments) and the host helpers every launcher uses (grid size, shared-memory opt-in).
// Kept apart from the kernels, so that a header of tensor-core kernels includes this and not
// the generic kernels (each translation unit would otherwise compile those again).
//
// No torch includes: CI compile-checks it without a GPU (kata/toolchain/builders.py).
#ifndef FIXED_ATTENTION_PROBLEM_CUH_
#define FIXED_ATTENTION_PROBLEM_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "philox.h"

namespace fixed_attention {
namespace kernels {


// The problem, flattened: leading dims multiplied into batch; q, k, v, o contiguous. The fields
// after `causal` default to the plain case (no GQA, no mask, no dropout, Ev = E).
struct AttentionProblem {
  int64_t batch;     // B: query's leading dims, flattened
  int64_t len_q;     // L
  int64_t len_kv;    // S
  int64_t head_dim;  // E (query, key), 1..256
  float scale;
  bool causal;
  // The mask's entries (`mask` below): float32, or (true) the inputs' own half or bfloat16, half
  // the bytes for the kernels to move, with keys contiguous and every row 16-byte aligned (whole
  // 16-byte copies). Every backward reads either; of the forwards only the warp-specialized
  // Hopper one reads the 16-bit form (the others decline it: mask_rows is float32, and the glue
  // retries with a float32 mask). Here, in the padding after `causal`, so that no other field
  // moves.
  bool mask_in_input_dtype = false;
  // The backward's dK and dV under GQA (kv_group below): per K/V item, each the sum over its
  // kv_group query items (true: only Hopper's group-summing kernel takes that, and only where it
  // pays), or per query item, which the caller then sums (false). In the same padding.
  bool dkv_per_kv_item = false;
  int64_t head_dim_v = 0;  // Ev (value, output), 1..256; 0 means head_dim
  int64_t heads = 1;       // Hq: query's dim -3 (1 when query is 2-D)
  int64_t kv_group = 1;    // Hq / Hkv under GQA, else 1. Batch item b reads K/V item
                           //   (b / heads) * (heads / kv_group) + (b % heads) / kv_group
  const void* mask = nullptr;  // additive mask (bool already turned into 0 / -inf) or null;
                               // element (b, i, j) at mask[(b / heads) * mask_stride_outer
                               // + (b % heads) * mask_stride_head + i * mask_stride_row
                               // + j * mask_stride_col] (strides may be 0: broadcast)
  int64_t mask_stride_outer = 0, mask_stride_head = 0, mask_stride_row = 0, mask_stride_col = 0;
  // Optional, for the tensor-core kernels only: which kHiddenTile x kHiddenTile tiles (rows x
  // keys) the mask hides entirely (1: every entry -inf) and which it leaves as they are (2:
  // every entry 0), indexed as the mask is, by tile, with strides (0 where broadcast). Those
  // kernels skip blocks made of hidden tiles, and the Hopper ones the mask's loads in blocks
  // made of zero tiles; null: none.
  const uint8_t* hidden_tiles = nullptr;
  const int* any_hidden = nullptr;  // with hidden_tiles: bit 0 some tile hidden, bit 1 some zero
  int64_t hidden_stride_outer = 0, hidden_stride_head = 0, hidden_stride_row = 0,
          hidden_stride_col = 0;
  float dropout_p = 0.f;  // 0: none
  uint64_t dropout_seed = 0;
};

// Whether a backward that writes dK and dV per query item can take the problem.
__host__ __device__ __forceinline__ bool dkv_per_query_item(const AttentionProblem& p) {
  return p.kv_group == 1 || !p.dkv_per_kv_item;
}

// Ev: head_dim_v, or E where it is 0.
__host__ __device__ __forceinline__ int64_t value_dim(const AttentionProblem& p) {
  return p.head_dim_v == 0 ? p.head_dim : p.head_dim_v;
}

// The mask's entries in bytes: 2 in the inputs' dtype, else 4 (float32).
__host__ __device__ __forceinline__ int64_t mask_entry_bytes(const AttentionProblem& p) {
  return p.mask_in_input_dtype ? 2 : 4;
}

// A kept probability's factor 1 / (1 - p); 0 when p == 1, where nothing is kept (not inf: a
// dropped sum of 0 times inf would be NaN).
__host__ __device__ __forceinline__ float dropout_scale(float p) {
  return p < 1.f ? 1.f / (1.f - p) : 0.f;
}

// The plain problem: Ev = E, one K/V head per query head, no mask, no dropout. Each generic
// kernel has an instantiation for it (kPlain) that
// has those as constants, so that it keeps the registers, hence the occupancy and speed, of a
// kernel without the rest (the general instantiation takes up to 60 registers per thread
// more: a block less per SM).
__host__ __device__ __forceinline__ bool is_plain(const AttentionProblem& p) {
  return value_dim(p) == p.head_dim && p.kv_group == 1 && p.mask == nullptr &&
         !(p.dropout_p > 0.f);
}

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// std::min is host-only without --expt-relaxed-constexpr, which the CI command does not pass.
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// An element of any of the kernels' dtypes as float.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Batch item b's (L, S) slice of the mask (strides may be 0) as entries of type Entry (float,
// or uint16_t for the bits of a 16-bit one), for a kernel that knows the form; null without one.
template <typename Entry>
__device__ __forceinline__ const Entry* mask_slice_of(const AttentionProblem& p, int64_t b) {
  return p.mask == nullptr ? nullptr
                           : static_cast<const Entry*>(p.mask) +
                                 (b / p.heads) * p.mask_stride_outer +
                                 (b % p.heads) * p.mask_stride_head;
}
// The same in the problem's form (mask_value reads it).
__device__ __forceinline__ const void* mask_slice_of(const AttentionProblem& p, int64_t b) {
  if (p.mask_in_input_dtype) {
    return mask_slice_of<uint16_t>(p, b);
  }
  return mask_slice_of<float>(p, b);
}

// The entry (row, key) of a slice as float, through the read-only cache (a broadcast mask is
// read by many CTAs). T: the kernel's input dtype; only a 16-bit one can be the mask's.
template <typename T>
__device__ __forceinline__ float mask_value(const AttentionProblem& p, const void* slice,
                                            int64_t row, int64_t key) {
  const int64_t at = row * p.mask_stride_row + key * p.mask_stride_col;
  if constexpr (sizeof(T) == 2) {
    if (p.mask_in_input_dtype) {
      return to_float(__ldg(static_cast<const T*>(slice) + at));
    }
  }
  return __ldg(static_cast<const float*>(slice) + at);
}

inline constexpr std::size_t kDefaultSharedMemory = 48 * 1024;

namespace detail {

// Blocks loop over work items, so any count up to gridDim.x's limit is correct.
inline unsigned grid_for(int64_t work_items) {
  return static_cast<unsigned>(
      std::min<int64_t>(work_items, std::numeric_limits<int32_t>::max()));
}

// Kernels above 48 KB of dynamic shared memory must opt in, on the current device.
template <typename Kernel>
void allow_shared_memory(Kernel* kernel, std::size_t bytes) {
  if (bytes <= kDefaultSharedMemory) {
    return;
  }
  const cudaError_t status = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // reported here; do not leave it for an unrelated later check
    throw std::runtime_error("fixed_attention kernels: cannot raise the shared memory limit to " +
                             std::to_string(bytes) + " bytes: " + cudaGetErrorString(status));
  }
}

}  // namespace detail
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_ATTENTION_PROBLEM_CUH_
