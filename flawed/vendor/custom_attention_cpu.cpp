// CPU build of custom_attention: the same function and limits on host memory, so the kata
// runs on machines without a GPU.
#include <math.h>

#include <vector>

#include "custom_attention.h"

static const int kErrorInvalidValue = 1;  // cudaErrorInvalidValue in the CUDA build

extern "C" int launch_attention_kernel(const float* q, const float* k, const float* v, float* out,
                                       int batch_size, int seq_len) {
    if (seq_len > CUSTOM_ATTENTION_MAX_SEQ_LEN) {
        return kErrorInvalidValue;
    }
    const float scale = 1.0f / sqrtf((float)CUSTOM_ATTENTION_HEAD_DIM);
    std::vector<float> scores(seq_len > 0 ? seq_len : 1);
    for (int row = 0; row < batch_size * seq_len; ++row) {
        int batch = row / seq_len;
        const float* q_row = q + row * CUSTOM_ATTENTION_HEAD_DIM;
        const float* k_batch = k + batch * seq_len * CUSTOM_ATTENTION_HEAD_DIM;
        const float* v_batch = v + batch * seq_len * CUSTOM_ATTENTION_HEAD_DIM;

        float row_max = -INFINITY;
        for (int j = 0; j < seq_len; ++j) {
            float dot = 0.f;
            for (int d = 0; d < CUSTOM_ATTENTION_HEAD_DIM; ++d) {
                dot += q_row[d] * k_batch[j * CUSTOM_ATTENTION_HEAD_DIM + d];
            }
            scores[j] = dot * scale;
            row_max = fmaxf(row_max, scores[j]);
        }
        float row_sum = 0.f;
        for (int j = 0; j < seq_len; ++j) {
            scores[j] = expf(scores[j] - row_max);
            row_sum += scores[j];
        }
        for (int d = 0; d < CUSTOM_ATTENTION_HEAD_DIM; ++d) {
            float acc = 0.f;
            for (int j = 0; j < seq_len; ++j) {
                acc += scores[j] * v_batch[j * CUSTOM_ATTENTION_HEAD_DIM + d];
            }
            out[row * CUSTOM_ATTENTION_HEAD_DIM + d] = acc / row_sum;
        }
    }
    return 0;
}
