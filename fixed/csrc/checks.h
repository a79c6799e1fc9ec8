// Input validation shared by every kernel entry (CPU now, the CUDA glue later), so that all
// backends accept the same inputs and fail with the same typed, readable errors:
// TORCH_CHECK_TYPE -> TypeError, TORCH_CHECK_VALUE -> ValueError in Python.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace fixed_attention {

// The problem size, flattened: kernels index (batch, row, column) with int64_t offsets.
struct AttentionShape {
  int64_t batch;     // product of the leading dims (1 when there are none)
  int64_t len_q;     // L
  int64_t len_kv;    // S
  int64_t head_dim;  // E
};

// Head dims both backends support: 16 <= E <= 256, E % 8 == 0.
bool is_supported_head_dim(int64_t head_dim);

// The dtype of logsumexp: float32, or float64 for float64 inputs.
at::ScalarType logsumexp_dtype(at::ScalarType input_dtype);

AttentionShape check_attention_inputs(const at::Tensor& query,   // (..., L, E)
                                      const at::Tensor& key,     // (..., S, E)
                                      const at::Tensor& value);  // (..., S, E)

// The extra tensors the backward receives; query must already have passed
// check_attention_inputs.
void check_backward_inputs(const at::Tensor& grad_output,  // (..., L, E), query's dtype
                           const at::Tensor& query,        // (..., L, E)
                           const at::Tensor& output,       // (..., L, E), query's dtype
                           const at::Tensor& logsumexp);   // (..., L), logsumexp_dtype

}  // namespace fixed_attention
