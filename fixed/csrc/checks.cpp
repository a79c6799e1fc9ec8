#include "checks.h"

#include <limits>
#include <string>
#include <vector>

#include <ATen/ExpandUtils.h>
#include <ATen/ops/zeros.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

namespace fixed_attention {
namespace {

// "float32", "int32": the names Python users know, not c10's "Float", "Int".
std::string dtype_name(at::ScalarType dtype) {
  return std::string(c10::getDtypeNames(dtype).first);
}

// Numbers and shapes go into error messages as strings formatted here. Built with one GPU
// machine's default C++ compiler (not the system g++), an extension that streamed an int64_t
// into a TORCH_CHECK message crashed (SIGSEGV) instead of raising; std::to_string did not.
// "[2, 64, 32]" for a shape.
std::string shape_of(c10::IntArrayRef sizes) {
  std::string text = "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    text += (i ? ", " : "") + std::to_string(sizes[i]);
  }
  return text + "]";
}

bool is_supported_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
         dtype == at::kBFloat16;
}

void check_same_dtype(const at::Tensor& tensor, const char* name, const at::Tensor& query) {
  TORCH_CHECK_TYPE(tensor.scalar_type() == query.scalar_type(), name,
                   " must have query's dtype; got query ", dtype_name(query.scalar_type()),
                   ", ", name, " ", dtype_name(tensor.scalar_type()));
}

// Same rank and leading dims as query (fast_attention broadcasts them before the operator),
// except the head dim (-3) under enable_gqa: a divisor of query's.
void check_leading_dims(const at::Tensor& tensor, const char* name, const at::Tensor& query,
                        bool enable_gqa) {
  const int64_t leading = query.dim() - 2;
  bool same = tensor.dim() == query.dim();
  for (int64_t d = 0; same && d < leading; ++d) {
    same = tensor.size(d) == query.size(d) || (enable_gqa && d == leading - 1);
  }
  TORCH_CHECK_VALUE(same, name, " must have shape (..., S, ", name[0] == 'k' ? "E" : "Ev",
                    ") with query's leading dims ", shape_of(query.sizes().slice(0, leading)),
                    enable_gqa ? " (the heads, dim -3, may divide query's)" : "", "; got ", name,
                    " ", shape_of(tensor.sizes()), ", query ", shape_of(query.sizes()));
}

}  // namespace

at::ScalarType logsumexp_dtype(at::ScalarType input_dtype) {
  return input_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

AttentionShape check_attention_inputs(const at::Tensor& query,  // (..., L, E)
                                      const at::Tensor& key,    // (..., S, E)
                                      const at::Tensor& value,  // (..., S, Ev)
                                      bool enable_gqa) {
  TORCH_CHECK_TYPE(is_supported_dtype(query.scalar_type()),
                   "query must be float32, float64, float16 or bfloat16; got ",
                   dtype_name(query.scalar_type()));
  check_same_dtype(key, "key", query);
  check_same_dtype(value, "value", query);

  TORCH_CHECK_VALUE(query.device() == key.device() && query.device() == value.device(),
                    "query, key and value must be on one device; got query on ", query.device(),
                    ", key on ", key.device(), ", value on ", value.device());
  TORCH_CHECK_TYPE(!(query.is_cuda() && query.scalar_type() == at::kDouble),
                   "float64 is supported on CPU only (for gradcheck); got query on ",
                   query.device());

  TORCH_CHECK_VALUE(query.dim() >= 2, "query must have shape (..., L, E), at least 2 dims; got ",
                    shape_of(query.sizes()));
  TORCH_CHECK_VALUE(!enable_gqa || query.dim() >= 3,
                    "enable_gqa needs query of shape (..., Hq, L, E), at least 3 dims; got ",
                    shape_of(query.sizes()));
  check_leading_dims(key, "key", query, enable_gqa);
  check_leading_dims(value, "value", query, enable_gqa);

  const int64_t head_dim = query.size(-1);
  const std::string head_dim_text = std::to_string(head_dim);
  TORCH_CHECK_VALUE(head_dim >= 1, "query's head dim E must be at least 1; got query ",
                    shape_of(query.sizes()));
  TORCH_CHECK_VALUE(key.size(-1) == head_dim, "key must have shape (..., S, ", head_dim_text,
                    ") matching query's head dim ", head_dim_text, "; got ",
                    shape_of(key.sizes()));
  const int64_t len_kv = key.size(-2);
  const std::string len_kv_text = std::to_string(len_kv);
  TORCH_CHECK_VALUE(value.size(-2) == len_kv, "value must have shape (..., ", len_kv_text,
                    ", Ev) matching key's length ", len_kv_text, "; got ",
                    shape_of(value.sizes()));
  TORCH_CHECK_VALUE(value.size(-1) >= 1, "value's head dim Ev must be at least 1; got value ",
                    shape_of(value.sizes()));
  TORCH_CHECK_VALUE(key.dim() < 3 || value.size(-3) == key.size(-3),
                    "key and value must have the same number of heads (dim -3); got key ",
                    shape_of(key.sizes()), ", value ", shape_of(value.sizes()));

  const int64_t heads = query.dim() >= 3 ? query.size(-3) : 1;
  int64_t kv_group = 1;
  if (enable_gqa) {
    const int64_t kv_heads = key.size(-3);
    TORCH_CHECK_VALUE((kv_heads >= 1 && heads % kv_heads == 0) || heads == 0,
                      "enable_gqa: query's heads (dim -3) must be a multiple of key's and "
                      "value's; got query ",
                      shape_of(query.sizes()), ", key ", shape_of(key.sizes()));
    kv_group = kv_heads == 0 ? 1 : heads / kv_heads;
  }
  int64_t batch = 1;
  for (int64_t d = 0; d < query.dim() - 2; ++d) {
    batch *= query.size(d);
  }
  return {batch, query.size(-2), len_kv, head_dim, value.size(-1), heads, kv_group};
}

void check_cuda_head_dims(const AttentionShape& shape) {
  constexpr int64_t kMax = 256;  // the generic kernels' largest head-dim bucket
  TORCH_CHECK_VALUE(shape.head_dim <= kMax && shape.head_dim_v <= kMax,
                    "on CUDA the head dims E and Ev must be at most 256; got E = ",
                    std::to_string(shape.head_dim), ", Ev = ", std::to_string(shape.head_dim_v));
}

namespace {

// The checks of attn_mask (see additive_mask); returns (..., L, S), the shape SDPA broadcasts
// it to.
std::vector<int64_t> check_mask(const at::Tensor& mask, const at::Tensor& query,
                                const AttentionShape& shape, bool causal) {
  TORCH_CHECK_VALUE(!causal,
                    "attn_mask and is_causal=True cannot be combined (as in "
                    "scaled_dot_product_attention): put the causal mask into attn_mask");
  TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool || at::isFloatingType(mask.scalar_type()),
                   "attn_mask must be bool (True takes part) or floating (added to the scores); "
                   "got ",
                   dtype_name(mask.scalar_type()));
  TORCH_CHECK_VALUE(mask.device() == query.device(), "attn_mask must be on query's device ",
                    query.device(), "; got ", mask.device());
  // (..., L, S): query's shape with E replaced by S, the shape SDPA broadcasts the mask to.
  std::vector<int64_t> scores(query.sizes().begin(), query.sizes().end());
  scores.back() = shape.len_kv;
  TORCH_CHECK_VALUE(at::is_expandable_to(mask.sizes(), scores),
                    "attn_mask must broadcast to (..., L, S) = ", shape_of(scores), "; got ",
                    shape_of(mask.sizes()));
  return scores;
}

// `mask` (own elements) broadcast to `scores` and viewed as (batch / heads, heads, L, S):
// stride 0 where it broadcasts, wherever the strides allow, else one copy.
at::Tensor as_four_dims(const at::Tensor& mask, const std::vector<int64_t>& scores,
                        const AttentionShape& shape) {
  const int64_t outer = shape.heads == 0 ? 0 : shape.batch / shape.heads;
  return mask.expand(scores).reshape({outer, shape.heads, shape.len_q, shape.len_kv});
}

}  // namespace

std::optional<at::Tensor> additive_mask(const std::optional<at::Tensor>& attn_mask,
                                        const at::Tensor& query, const AttentionShape& shape,
                                        bool causal, at::ScalarType dtype) {
  if (!attn_mask.has_value()) {
    return std::nullopt;
  }
  const at::Tensor& mask = *attn_mask;
  const std::vector<int64_t> scores = check_mask(mask, query, shape, causal);
  // On the mask's own (unbroadcast) elements: True -> 0, False -> -inf.
  at::Tensor additive =
      mask.scalar_type() == at::kBool
          ? at::zeros(mask.sizes(), mask.options().dtype(dtype))
                .masked_fill_(mask.logical_not(), -std::numeric_limits<double>::infinity())
          : mask.to(dtype);
  return as_four_dims(additive, scores, shape);
}

std::optional<at::Tensor> checked_mask(const std::optional<at::Tensor>& attn_mask,
                                       const at::Tensor& query, const AttentionShape& shape,
                                       bool causal) {
  if (!attn_mask.has_value()) {
    return std::nullopt;
  }
  return as_four_dims(*attn_mask, check_mask(*attn_mask, query, shape, causal), shape);
}

uint64_t dropout_seed_of(double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p <= 1.0,
                    "dropout_p must be from 0 to 1; got ", std::to_string(dropout_p));
  if (dropout_p == 0.0) {
    return 0;
  }
  TORCH_CHECK_VALUE(dropout_seed.has_value(),
                    "dropout_p > 0 needs dropout_seed, a 0-dim int64 CPU tensor");
  const at::Tensor& seed = *dropout_seed;
  TORCH_CHECK_TYPE(seed.scalar_type() == at::kLong, "dropout_seed must be an int64 tensor; got ",
                   dtype_name(seed.scalar_type()));
  TORCH_CHECK_VALUE(seed.dim() == 0 && seed.device().is_cpu(),
                    "dropout_seed must be a 0-dim CPU tensor; got shape ", shape_of(seed.sizes()),
                    " on ", seed.device());
  return static_cast<uint64_t>(seed.item<int64_t>());
}

void check_backward_inputs(const at::Tensor& grad_output,  // (..., L, Ev), query's dtype
                           const at::Tensor& query,        // (..., L, E)
                           const at::Tensor& value,        // (..., S, Ev)
                           const at::Tensor& output,       // (..., L, Ev), query's dtype
                           const at::Tensor& logsumexp) {  // (..., L), logsumexp_dtype
  const auto expected_lse = logsumexp_dtype(query.scalar_type());
  check_same_dtype(grad_output, "grad_output", query);
  check_same_dtype(output, "output", query);
  TORCH_CHECK_TYPE(logsumexp.scalar_type() == expected_lse, "logsumexp must be ",
                   dtype_name(expected_lse), " for ", dtype_name(query.scalar_type()),
                   " inputs; got ", dtype_name(logsumexp.scalar_type()));
  TORCH_CHECK_VALUE(grad_output.device() == query.device() &&
                        output.device() == query.device() &&
                        logsumexp.device() == query.device(),
                    "grad_output, output and logsumexp must be on query's device ",
                    query.device(), "; got grad_output on ", grad_output.device(),
                    ", output on ", output.device(), ", logsumexp on ", logsumexp.device());
  std::vector<int64_t> expected(query.sizes().begin(), query.sizes().end());
  expected.back() = value.size(-1);
  TORCH_CHECK_VALUE(grad_output.sizes() == c10::IntArrayRef(expected),
                    "grad_output must have the output's shape ", shape_of(expected), "; got ",
                    shape_of(grad_output.sizes()));
  TORCH_CHECK_VALUE(output.sizes() == c10::IntArrayRef(expected), "output must have shape ",
                    shape_of(expected), "; got ", shape_of(output.sizes()));
  const auto rows = query.sizes().slice(0, query.dim() - 1);
  TORCH_CHECK_VALUE(logsumexp.sizes() == rows, "logsumexp must have shape ", shape_of(rows),
                    " (query's shape without E); got ", shape_of(logsumexp.sizes()));
}

}  // namespace fixed_attention
