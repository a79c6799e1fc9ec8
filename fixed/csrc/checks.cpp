#include "checks.h"

#include <string>

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

// Same rank and same leading dims as query: no broadcasting.
void check_leading_dims(const at::Tensor& tensor, const char* name, const at::Tensor& query) {
  const auto leading = query.sizes().slice(0, query.dim() - 2);
  TORCH_CHECK_VALUE(tensor.dim() == query.dim() &&
                        tensor.sizes().slice(0, tensor.dim() - 2) == leading,
                    name, " must have shape (..., S, E) with query's leading dims ",
                    shape_of(leading), " (no broadcasting); got ", name, " ",
                    shape_of(tensor.sizes()), ", query ", shape_of(query.sizes()));
}

}  // namespace

bool is_supported_head_dim(int64_t head_dim) {
  return head_dim >= 16 && head_dim <= 256 && head_dim % 8 == 0;
}

at::ScalarType logsumexp_dtype(at::ScalarType input_dtype) {
  return input_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

AttentionShape check_attention_inputs(const at::Tensor& query,  // (..., L, E)
                                      const at::Tensor& key,    // (..., S, E)
                                      const at::Tensor& value) {  // (..., S, E)
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
  check_leading_dims(key, "key", query);
  check_leading_dims(value, "value", query);

  const int64_t head_dim = query.size(-1);
  const std::string head_dim_text = std::to_string(head_dim);
  TORCH_CHECK_VALUE(is_supported_head_dim(head_dim),
                    "query's head dim E must be a multiple of 8 from 16 to 256; got ",
                    head_dim_text,
                    " in query ", shape_of(query.sizes()));
  TORCH_CHECK_VALUE(key.size(-1) == head_dim, "key must have shape (..., S, ",
                    head_dim_text, ") matching query's head dim ", head_dim_text, "; got ",
                    shape_of(key.sizes()));
  const int64_t len_kv = key.size(-2);
  const std::string len_kv_text = std::to_string(len_kv);
  TORCH_CHECK_VALUE(value.size(-2) == len_kv && value.size(-1) == head_dim,
                    "value must have shape (..., ", len_kv_text, ", ", head_dim_text,
                    ") matching key's length ", len_kv_text, " and query's head dim ",
                    head_dim_text, "; got ", shape_of(value.sizes()));

  int64_t batch = 1;
  for (int64_t d = 0; d < query.dim() - 2; ++d) {
    batch *= query.size(d);
  }
  return {batch, query.size(-2), len_kv, head_dim};
}

void check_backward_inputs(const at::Tensor& grad_output,  // (..., L, E), query's dtype
                           const at::Tensor& query,        // (..., L, E)
                           const at::Tensor& output,       // (..., L, E), query's dtype
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
  TORCH_CHECK_VALUE(grad_output.sizes() == query.sizes(),
                    "grad_output must have query's shape ", shape_of(query.sizes()), "; got ",
                    shape_of(grad_output.sizes()));
  TORCH_CHECK_VALUE(output.sizes() == query.sizes(), "output must have query's shape ",
                    shape_of(query.sizes()), "; got ", shape_of(output.sizes()));
  const auto rows = query.sizes().slice(0, query.dim() - 1);
  TORCH_CHECK_VALUE(logsumexp.sizes() == rows, "logsumexp must have shape ", shape_of(rows),
                    " (query's shape without E); got ", shape_of(logsumexp.sizes()));
}

}  // namespace fixed_attention
