// fast_attention's launchers, shared by the torch glue (attention.cpp), the CPU launcher
// (attention_cpu.cpp) and the CUDA launcher (attention_cuda.cu). No torch includes here.
#pragma once

#include <cstdint>

// out[b] = softmax(q[b] · k[b]^T / sqrt(head_dim)) · v[b]
// q, k, v, out: (batch, seq_len, head_dim), contiguous, row-major.
struct AttentionParams {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  int64_t batch;
  int64_t seq_len;
};

// The longest sequence the launchers take: a row of scores lives in shared memory.
constexpr int64_t kMaxSeqLen = 4096;

// Both return 0 on success, or a nonzero status (a cudaError_t value) without writing anything.
int launch_attention_cpu(const AttentionParams& params);
int launch_attention_cuda(const AttentionParams& params);
