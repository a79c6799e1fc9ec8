// CUDA launcher: one block per query row, the row of scores in shared memory, launched on
// PyTorch's current stream.
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

#include <cmath>

#include "attention.h"

namespace {

constexpr int kThreads = 128;

__device__ float block_reduce(float value, float* scratch, bool is_max) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_down_sync(0xffffffff, value, offset);
    value = is_max ? fmaxf(value, other) : value + other;
  }
  if (lane == 0) {
    scratch[warp] = value;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = scratch[0];
    for (int w = 1; w < kThreads / 32; ++w) {
      total = is_max ? fmaxf(total, scratch[w]) : total + scratch[w];
    }
    scratch[0] = total;
  }
  __syncthreads();
  const float result = scratch[0];
  __syncthreads();
  return result;
}

__global__ void __launch_bounds__(kThreads)
    attention_row_kernel(const float* __restrict__ q, const float* __restrict__ k,
                         const float* __restrict__ v, float* __restrict__ out, int64_t seq_len,
                         int64_t head_dim, float scale) {
  extern __shared__ float shared[];
  float* q_row = shared;              // head_dim
  float* scores = shared + head_dim;  // seq_len
  __shared__ float scratch[kThreads / 32];

  const int64_t row = blockIdx.x;
  const int64_t batch = row / seq_len;
  const float* k_batch = k + batch * seq_len * head_dim;
  const float* v_batch = v + batch * seq_len * head_dim;

  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    q_row[d] = q[row * head_dim + d];
  }
  __syncthreads();

  float local_max = -INFINITY;
  for (int64_t j = threadIdx.x; j < seq_len; j += blockDim.x) {
    float dot = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) {
      dot += q_row[d] * k_batch[j * head_dim + d];
    }
    scores[j] = dot * scale;
    local_max = fmaxf(local_max, scores[j]);
  }
  const float row_max = block_reduce(local_max, scratch, true);

  float local_sum = 0.f;
  for (int64_t j = threadIdx.x; j < seq_len; j += blockDim.x) {
    scores[j] = expf(scores[j] - row_max);
    local_sum += scores[j];
  }
  const float row_sum = block_reduce(local_sum, scratch, false);

  for (int64_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int64_t j = 0; j < seq_len; ++j) {
      acc += scores[j] * v_batch[j * head_dim + d];
    }
    out[row * head_dim + d] = acc / row_sum;
  }
}

}  // namespace

int launch_attention_cuda(const AttentionParams& params) {
  constexpr int64_t kHeadDim = 64;
  if (params.seq_len > kMaxSeqLen) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = params.batch * params.seq_len;
  if (rows == 0) {
    return cudaSuccess;
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  const size_t shared_bytes = (kHeadDim + params.seq_len) * sizeof(float);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  attention_row_kernel<<<static_cast<unsigned int>(rows), kThreads, shared_bytes, stream>>>(
      params.q, params.k, params.v, params.out, params.seq_len, kHeadDim, scale);
  return cudaGetLastError();
}
