// Input validation shared by every kernel entry (the CPU kernels and the CUDA glue), so that all
// backends accept the same inputs and fail with the same typed, readable errors:
// TORCH_CHECK_TYPE -> TypeError, TORCH_CHECK_VALUE -> ValueError in Python.
#pragma once

#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>

namespace fixed_attention {

// The problem size, flattened: kernels index (batch, row, column) with int64_t offsets.
struct AttentionShape {
  int64_t batch;       // product of query's leading dims (1 when there are none)
  int64_t len_q;       // L
  int64_t len_kv;      // S
  int64_t head_dim;    // E: query and key
  int64_t head_dim_v;  // Ev: value and output
  int64_t heads;       // Hq: query's dim -3 (1 for a 2-D query); batch item b is head b % heads
  int64_t kv_group;    // Hq / Hkv under enable_gqa (query head h reads key/value head
                       // h / kv_group), else 1
};

// The dtype of logsumexp: float32, or float64 for float64 inputs.
at::ScalarType logsumexp_dtype(at::ScalarType input_dtype);

// query (..., L, E) or (..., Hq, L, E); key (..., S, E) and value (..., S, Ev) with query's
// leading dims, except under enable_gqa dim -3: Hkv, a divisor of Hq.
AttentionShape check_attention_inputs(const at::Tensor& query, const at::Tensor& key,
                                      const at::Tensor& value, bool enable_gqa);

// The CUDA kernels' limits (E and Ev at most 256); the CPU has none.
void check_cuda_head_dims(const AttentionShape& shape);

// attn_mask checked (bool or floating, on query's device, broadcastable to (..., L, S), not with
// is_causal) and made additive: bool True -> 0, False -> -inf; cast to `dtype`. Returned as
// (batch / heads, heads, L, S): a view, stride 0 where the mask broadcasts, copied only where its
// strides cannot be flattened that way. std::nullopt without a mask.
std::optional<at::Tensor> additive_mask(const std::optional<at::Tensor>& attn_mask,
                                        const at::Tensor& query, const AttentionShape& shape,
                                        bool causal, at::ScalarType dtype);

// attn_mask checked as additive_mask checks it and returned in its own dtype as
// (batch / heads, heads, L, S), viewed and copied as additive_mask's: for a kernel that makes
// the entries additive itself. std::nullopt without a mask.
std::optional<at::Tensor> checked_mask(const std::optional<at::Tensor>& attn_mask,
                                       const at::Tensor& query, const AttentionShape& shape,
                                       bool causal);

// dropout_p in [0, 1]; with dropout_p > 0 a 0-dim int64 CPU dropout_seed is required. Returns the
// seed (0 without dropout).
uint64_t dropout_seed_of(double dropout_p, const std::optional<at::Tensor>& dropout_seed);

// The extra tensors the backward receives; query, key and value must already have passed
// check_attention_inputs.
void check_backward_inputs(const at::Tensor& grad_output,  // (..., L, Ev), query's dtype
                           const at::Tensor& query,        // (..., L, E)
                           const at::Tensor& value,        // (..., S, Ev)
                           const at::Tensor& output,       // (..., L, Ev), query's dtype
                           const at::Tensor& logsumexp);   // (..., L), logsumexp_dtype

}  // namespace fixed_attention
