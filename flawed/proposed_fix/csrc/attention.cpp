// fast_attention, the torch side: checks the inputs, picks the CPU or the CUDA launcher and
// hands its status back to Python (0 on success).
#include <torch/extension.h>

#ifdef WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

#include "attention.h"

#define CHECK_CUDA(x) TORCH_CHECK((x).is_cuda(), #x " must be a CUDA tensor")
#define CHECK_CONTIGUOUS(x) TORCH_CHECK((x).is_contiguous(), #x " must be contiguous")
#define CHECK_FLOAT(x) \
  TORCH_CHECK((x).scalar_type() == at::kFloat, #x " must be float32, got ", (x).scalar_type())
#define CHECK_INPUT(x) \
  CHECK_CUDA(x);       \
  CHECK_CONTIGUOUS(x); \
  CHECK_FLOAT(x)

namespace {

void check_shapes(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const at::Tensor& output) {
  TORCH_CHECK(query.dim() == 3, "query must be (batch, seq_len, head_dim), got ", query.dim(),
              " dims: ", query.sizes());
  TORCH_CHECK(key.sizes() == query.sizes(), "key must have the shape of query ", query.sizes(),
              ", got ", key.sizes());
  TORCH_CHECK(value.sizes() == query.sizes(), "value must have the shape of query ",
              query.sizes(), ", got ", value.sizes());
  TORCH_CHECK(output.sizes() == query.sizes(), "output must have the shape of query ",
              query.sizes(), ", got ", output.sizes());
}

AttentionParams make_params(const at::Tensor& query,   // (batch, seq_len, head_dim)
                            const at::Tensor& key,     // (batch, seq_len, head_dim)
                            const at::Tensor& value,   // (batch, seq_len, head_dim)
                            at::Tensor& output) {      // (batch, seq_len, head_dim)
  AttentionParams params;
  params.q = static_cast<const float*>(query.const_data_ptr());
  params.k = static_cast<const float*>(key.const_data_ptr());
  params.v = static_cast<const float*>(value.const_data_ptr());
  params.out = static_cast<float*>(output.mutable_data_ptr());
  params.batch = query.size(0);
  params.seq_len = query.size(1);
  return params;
}

}  // namespace

int64_t attention_forward(const at::Tensor& query, const at::Tensor& key,
                          const at::Tensor& value, at::Tensor& output) {
  check_shapes(query, key, value, output);
  const AttentionParams params = make_params(query, key, value, output);
  if (query.is_cuda()) {
#ifdef WITH_CUDA
    CHECK_INPUT(query);
    CHECK_INPUT(key);
    CHECK_INPUT(value);
    CHECK_INPUT(output);
    const c10::cuda::CUDAGuard device_guard(query.device());
    return launch_attention_cuda(params);
#else
    TORCH_CHECK(false, "fast_attention was built without CUDA; got a tensor on ", query.device());
#endif
  }
  return launch_attention_cpu(params);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &attention_forward,
        "output = softmax(query · key^T / sqrt(head_dim)) · value; returns the launcher's status",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("output"));
}
