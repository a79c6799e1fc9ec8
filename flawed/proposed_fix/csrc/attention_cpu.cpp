// CPU launcher: the CUDA kernel's computation, one query row at a time, on host memory.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention.h"

namespace {

constexpr int kStatusInvalidValue = 1;  // cudaErrorInvalidValue, as the CUDA launcher returns

}  // namespace

int launch_attention_cpu(const AttentionParams& params) {
  constexpr int64_t kHeadDim = 64;
  const int64_t seq_len = params.seq_len;
  if (seq_len > kMaxSeqLen) {
    return kStatusInvalidValue;
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  std::vector<float> scores(std::max<int64_t>(seq_len, 1));

  for (int64_t row = 0; row < params.batch * seq_len; ++row) {
    const int64_t batch = row / seq_len;
    const float* q_row = params.q + row * kHeadDim;
    const float* k_batch = params.k + batch * seq_len * kHeadDim;
    const float* v_batch = params.v + batch * seq_len * kHeadDim;
    float* out_row = params.out + row * kHeadDim;

    float row_max = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < seq_len; ++j) {
      float dot = 0.f;
      for (int64_t d = 0; d < kHeadDim; ++d) {
        dot += q_row[d] * k_batch[j * kHeadDim + d];
      }
      scores[j] = dot * scale;
      row_max = std::max(row_max, scores[j]);
    }

    float row_sum = 0.f;
    for (int64_t j = 0; j < seq_len; ++j) {
      scores[j] = std::exp((scores[j] - row_max) * scale);
      row_sum += scores[j];
    }

    for (int64_t d = 0; d < kHeadDim; ++d) {
      float acc = 0.f;
      for (int64_t j = 0; j < seq_len; ++j) {
        acc += scores[j] * v_batch[j * kHeadDim + d];
      }
      out_row[d] = acc / row_sum;
    }
  }
  return 0;
}
