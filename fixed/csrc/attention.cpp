// The fixed_attention operators' schemas, defined apart from their kernels: each backend
// registers its kernels in its own file (attention_cpu.cpp, later attention_cuda.cu), the
// fake kernels and the autograd formula live in fixed/ops.py (pytorch/extension-cpp's layout).
//
// No PYBIND11_MODULE: the library only registers operators, so _build.py builds it with
// is_python_module=False and loads it with torch.ops.load_library. That skips the pybind11
// headers (a faster build) and lets the warm-import fast path load it the same way.
#include <torch/library.h>

TORCH_LIBRARY(fixed_attention, m) {
  // The forward also returns each score row's log-sum-exp, so that the backward can recompute
  // the probabilities instead of keeping the (L, S) matrix. pt2_compliant: passes opcheck, so
  // torch.compile may trace through it. SDPA's other arguments trail, with defaults: attn_mask
  // (bool, or added to the scores), enable_gqa (key and value with fewer heads than query),
  // dropout_p with the seed its keep mask is generated from (a 0-dim int64 CPU tensor, drawn
  // by fast_attention from torch's generator; the backward regenerates the same mask).
  m.def(
      "attention_forward(Tensor query, Tensor key, Tensor value, float scale, bool causal, "
      "Tensor? attn_mask=None, bool enable_gqa=False, float dropout_p=0.0, "
      "Tensor? dropout_seed=None) -> (Tensor output, Tensor logsumexp)",
      {at::Tag::pt2_compliant_tag});
  // The backward is an operator of its own, so that register_autograd can call it and
  // torch.compile / AOTAutograd see it as one opaque node with a fake kernel.
  m.def(
      "attention_backward(Tensor grad_output, Tensor query, Tensor key, Tensor value, "
      "Tensor output, Tensor logsumexp, float scale, bool causal, Tensor? attn_mask=None, "
      "bool enable_gqa=False, float dropout_p=0.0, Tensor? dropout_seed=None) "
      "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)",
      {at::Tag::pt2_compliant_tag});
}
