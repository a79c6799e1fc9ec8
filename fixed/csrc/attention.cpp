// The fixed_attention operators' schemas and their autograd formula, defined apart from their
// kernels: each backend registers its kernels in its own file (attention_cpu.cpp,
// attention_cuda.cu), the fake kernels live in fixed/ops.py (pytorch/extension-cpp's layout).
//
// No PYBIND11_MODULE: the library only registers operators, so _build.py builds it with
// is_python_module=False and loads it with torch.ops.load_library. That skips the pybind11
// headers (a faster build) and lets the warm-import fast path load it the same way.
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
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
  // The backward is an operator of its own, so that the autograd formula below can call it and
  // torch.compile / AOTAutograd see it as one opaque node with a fake kernel.
  m.def(
      "attention_backward(Tensor grad_output, Tensor query, Tensor key, Tensor value, "
      "Tensor output, Tensor logsumexp, float scale, bool causal, Tensor? attn_mask=None, "
      "bool enable_gqa=False, float dropout_p=0.0, Tensor? dropout_seed=None) "
      "-> (Tensor grad_query, Tensor grad_key, Tensor grad_value)",
      {at::Tag::pt2_compliant_tag});
}

// The autograd formula, in C++ rather than torch.library.register_autograd: the Python one
// (its wrappers, fill_defaults, the Python redispatch) made a forward + backward cost 144 µs of
// host time instead of 77 on a CPU, and 0.46 ms instead of 0.18 on an H200's host, where the
// kernels of a (4, 16, 1024, 64) problem take 0.22 ms (perf/NOTES.md, v16).
namespace fixed_attention {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;

using ForwardSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool,
    const OptionalTensor&, bool, double, const OptionalTensor&);
using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, double, bool, const OptionalTensor&, bool, double,
    const OptionalTensor&);

// The operators through the dispatcher: the backend kernels below autograd, or the fake ones.
const c10::TypedOperatorHandle<ForwardSignature>& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fixed_attention::attention_forward", "")
                             .typed<ForwardSignature>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSignature>& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("fixed_attention::attention_backward", "")
                             .typed<BackwardSignature>();
  return op;
}

bool requires_grad(const at::Tensor& tensor) { return tensor.requires_grad(); }
bool requires_grad(const OptionalTensor& tensor) {
  return tensor.has_value() && tensor->defined() && tensor->requires_grad();
}

// Whether this call must be recorded for a backward. Checked before Function::apply, as
// register_autograd does: a call that records nothing skips the graph node, and vmap and other
// functorch transforms (which refuse C++ autograd Functions) still run the forward.
template <typename... Tensors>
bool records_graph(const Tensors&... tensors) {
  return c10::GradMode::is_enabled() && (requires_grad(tensors) || ...);
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& query,
                               const at::Tensor& key, const at::Tensor& value, double scale,
                               bool causal, const OptionalTensor& attn_mask, bool enable_gqa,
                               double dropout_p, const OptionalTensor& dropout_seed) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [output, logsumexp] = forward_op().call(query, key, value, scale, causal, attn_mask,
                                                 enable_gqa, dropout_p, dropout_seed);
    ctx->save_for_backward({query, key, value, output, logsumexp});
    // The mask and the seed are inputs the backward needs as they were: neither is
    // differentiated (the mask gets no gradient).
    ctx->saved_data["attn_mask"] = attn_mask;
    ctx->saved_data["dropout_seed"] = dropout_seed;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["enable_gqa"] = enable_gqa;
    ctx->saved_data["dropout_p"] = dropout_p;
    // logsumexp is an auxiliary output for the backward: no gradient flows through it. Its
    // gradient slot is then always empty; not materialising it saves a zeros tensor per call.
    ctx->mark_non_differentiable({logsumexp});
    ctx->set_materialize_grads(false);
    return {output, logsumexp};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& output = saved[3];
    // Without materialised grads an unused output would arrive undefined: zeros, as before.
    const at::Tensor grad_output = grads[0].defined() ? grads[0] : at::zeros_like(output);
    const auto& data = ctx->saved_data;
    // Through the dispatcher with autograd on when create_graph is: the backward operator's own
    // autograd kernel (below) then makes a second differentiation raise.
    auto [grad_query, grad_key, grad_value] = backward_op().call(
        grad_output, saved[0], saved[1], saved[2], output, saved[4], data.at("scale").toDouble(),
        data.at("causal").toBool(), data.at("attn_mask").toOptional<at::Tensor>(),
        data.at("enable_gqa").toBool(), data.at("dropout_p").toDouble(),
        data.at("dropout_seed").toOptional<at::Tensor>());
    // One gradient per forward argument; none for scale, causal, the mask, gqa, p, the seed.
    return {grad_query, grad_key, grad_value, {}, {}, {}, {}, {}, {}};
  }
};

std::tuple<at::Tensor, at::Tensor> attention_forward_autograd(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale,
    bool causal, const OptionalTensor& attn_mask, bool enable_gqa, double dropout_p,
    const OptionalTensor& dropout_seed) {
  if (!records_graph(query, key, value, attn_mask)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return forward_op().call(query, key, value, scale, causal, attn_mask, enable_gqa, dropout_p,
                             dropout_seed);
  }
  // Here, not in fast_attention, so that a direct torch.ops call is refused too: a learned mask
  // would otherwise get no gradient at all, silently.
  TORCH_CHECK_NOT_IMPLEMENTED(!requires_grad(attn_mask),
                              "fast_attention computes no gradient for attn_mask: detach it, or "
                              "use torch.nn.functional.scaled_dot_product_attention for a "
                              "learned mask");
  const variable_list outputs = AttentionFunction::apply(
      query, key, value, scale, causal, attn_mask, enable_gqa, dropout_p, dropout_seed);
  return {outputs[0], outputs[1]};
}

// The backward's own backward (second-order gradients) is not implemented. Without this,
// autograd would treat attention_backward as a constant and return silently zero second
// derivatives; this makes the second differentiation raise instead (correct or loud).
class NoDoubleBackward : public torch::autograd::Function<NoDoubleBackward> {
 public:
  static variable_list forward(AutogradContext*, const at::Tensor& grad_output,
                               const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const at::Tensor& output,
                               const at::Tensor& logsumexp, double scale, bool causal,
                               const OptionalTensor& attn_mask, bool enable_gqa,
                               double dropout_p, const OptionalTensor& dropout_seed) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_query, grad_key, grad_value] =
        backward_op().call(grad_output, query, key, value, output, logsumexp, scale, causal,
                           attn_mask, enable_gqa, dropout_p, dropout_seed);
    return {grad_query, grad_key, grad_value};
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false,
                "fast_attention: double backward (second-order gradients, e.g. a Hessian-vector "
                "product or gradient penalty) is not supported; use "
                "torch.nn.functional.scaled_dot_product_attention's math backend for that");
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_autograd(
    const at::Tensor& grad_output, const at::Tensor& query, const at::Tensor& key,
    const at::Tensor& value, const at::Tensor& output, const at::Tensor& logsumexp, double scale,
    bool causal, const OptionalTensor& attn_mask, bool enable_gqa, double dropout_p,
    const OptionalTensor& dropout_seed) {
  if (!records_graph(grad_output, query, key, value, output, logsumexp, attn_mask)) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return backward_op().call(grad_output, query, key, value, output, logsumexp, scale, causal,
                              attn_mask, enable_gqa, dropout_p, dropout_seed);
  }
  const variable_list grads =
      NoDoubleBackward::apply(grad_output, query, key, value, output, logsumexp, scale, causal,
                              attn_mask, enable_gqa, dropout_p, dropout_seed);
  return {grads[0], grads[1], grads[2]};
}

}  // namespace

// The Autograd alias key: one formula for every backend (CPU, CUDA) and for fake tensors.
TORCH_LIBRARY_IMPL(fixed_attention, Autograd, m) {
  m.impl("attention_forward", &attention_forward_autograd);
  m.impl("attention_backward", &attention_backward_autograd);
}

}  // namespace fixed_attention
