// CUDA build of custom_attention: one block per query row, the row of scores in shared memory.
#include <cuda_runtime.h>
#include <math.h>

#include "custom_attention.h"

static const int kThreads = 128;

__device__ float block_reduce(float value, float* scratch, bool is_max) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    for (int offset = 16; offset > 0; offset /= 2) {
        float other = __shfl_down_sync(0xffffffff, value, offset);
        value = is_max ? fmaxf(value, other) : value + other;
    }
    if (lane == 0) scratch[warp] = value;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = scratch[0];
        for (int w = 1; w < kThreads / 32; ++w) {
            total = is_max ? fmaxf(total, scratch[w]) : total + scratch[w];
        }
        scratch[0] = total;
    }
    __syncthreads();
    float result = scratch[0];
    __syncthreads();
    return result;
}

__global__ void attention_row_kernel(const float* q, const float* k, const float* v, float* out,
                                     int seq_len, float scale) {
    extern __shared__ float scores[];
    __shared__ float scratch[kThreads / 32];
    __shared__ float q_row[CUSTOM_ATTENTION_HEAD_DIM];

    int row = blockIdx.x;
    int batch = row / seq_len;
    const float* k_batch = k + batch * seq_len * CUSTOM_ATTENTION_HEAD_DIM;
    const float* v_batch = v + batch * seq_len * CUSTOM_ATTENTION_HEAD_DIM;

    for (int d = threadIdx.x; d < CUSTOM_ATTENTION_HEAD_DIM; d += blockDim.x) {
        q_row[d] = q[row * CUSTOM_ATTENTION_HEAD_DIM + d];
    }
    __syncthreads();

    float local_max = -INFINITY;
    for (int j = threadIdx.x; j < seq_len; j += blockDim.x) {
        float dot = 0.f;
        for (int d = 0; d < CUSTOM_ATTENTION_HEAD_DIM; ++d) {
            dot += q_row[d] * k_batch[j * CUSTOM_ATTENTION_HEAD_DIM + d];
        }
        scores[j] = dot * scale;
        local_max = fmaxf(local_max, scores[j]);
    }
    float row_max = block_reduce(local_max, scratch, true);

    float local_sum = 0.f;
    for (int j = threadIdx.x; j < seq_len; j += blockDim.x) {
        scores[j] = expf(scores[j] - row_max);
        local_sum += scores[j];
    }
    float row_sum = block_reduce(local_sum, scratch, false);

    for (int d = threadIdx.x; d < CUSTOM_ATTENTION_HEAD_DIM; d += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < seq_len; ++j) {
            acc += scores[j] * v_batch[j * CUSTOM_ATTENTION_HEAD_DIM + d];
        }
        out[row * CUSTOM_ATTENTION_HEAD_DIM + d] = acc / row_sum;
    }
}

extern "C" int launch_attention_kernel(const float* q, const float* k, const float* v, float* out,
                                       int batch_size, int seq_len) {
    if (seq_len > CUSTOM_ATTENTION_MAX_SEQ_LEN) {
        return cudaErrorInvalidValue;
    }
    int rows = batch_size * seq_len;
    if (rows <= 0) {
        return cudaSuccess;
    }
    float scale = 1.0f / sqrtf((float)CUSTOM_ATTENTION_HEAD_DIM);
    size_t shared_bytes = seq_len * sizeof(float);
    attention_row_kernel<<<rows, kThreads, shared_bytes>>>(q, k, v, out, seq_len, scale);
    return cudaGetLastError();
}
