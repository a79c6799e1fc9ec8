// custom_attention: a small attention kernel library, C ABI.
//
//   out[b] = softmax(q[b] · k[b]^T / sqrt(64)) · v[b]
//
// q, k, v, out: (batch_size, seq_len, 64) float32, contiguous, row-major.
// Returns 0 on success. seq_len above CUSTOM_ATTENTION_MAX_SEQ_LEN is refused with a
// nonzero code and nothing is written.
#pragma once

#define CUSTOM_ATTENTION_HEAD_DIM 64
#define CUSTOM_ATTENTION_MAX_SEQ_LEN 4096

#ifdef __cplusplus
extern "C" {
#endif

int launch_attention_kernel(const float* q, const float* k, const float* v, float* out,
                            int batch_size, int seq_len);

#ifdef __cplusplus
}
#endif
