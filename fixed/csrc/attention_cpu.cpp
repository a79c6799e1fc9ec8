// CPU kernels of the fixed_attention operators: exact softmax attention, one query row at a
// time, accumulating in at::opmath_type (float for half types, double for float64).
#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "checks.h"

namespace fixed_attention {
namespace {

// Rows per parallel_for chunk: about 64k multiply-adds each, so that small calls (gradcheck,
// opcheck) stay on one thread instead of paying OpenMP's start-up per call.
int64_t grain_rows(int64_t len_kv, int64_t head_dim) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, len_kv * head_dim));
}

// Keys a query row sees: all, or 0..row when causal (top-left aligned, as SDPA's is_causal).
int64_t visible_keys(int64_t row, int64_t len_kv, bool causal) {
  return causal ? std::min(row + 1, len_kv) : len_kv;
}

// E % 8 == 0 (checks.h), so 8 independent partial sums: the compiler vectorises this
// reduction without -ffast-math, and the result does not depend on the thread count.
template <typename acc_t, typename scalar_t>
acc_t dot(const scalar_t* a, const scalar_t* b, int64_t n) {
  acc_t partial[8] = {};
  for (int64_t e = 0; e < n; e += 8) {
    for (int64_t lane = 0; lane < 8; ++lane) {
      partial[lane] += static_cast<acc_t>(a[e + lane]) * static_cast<acc_t>(b[e + lane]);
    }
  }
  return ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
         ((partial[4] + partial[5]) + (partial[6] + partial[7]));
}

template <typename scalar_t>
void forward_kernel(const scalar_t* q,  // (B, L, E) contiguous
                    const scalar_t* k,  // (B, S, E) contiguous
                    const scalar_t* v,  // (B, S, E) contiguous
                    scalar_t* out,      // (B, L, E)
                    at::opmath_type<scalar_t>* lse,  // (B, L)
                    const AttentionShape& shape, double scale_, bool causal) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t L = shape.len_q, S = shape.len_kv, E = shape.head_dim;
  const acc_t scale = static_cast<acc_t>(scale_);
  // (batch, row) pairs flattened: parallel over batch items and blocks of rows.
  at::parallel_for(0, shape.batch * L, grain_rows(S, E), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scores(S);
    std::vector<acc_t> acc(E);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / L, i = row % L;
      const scalar_t* q_row = q + row * E;
      const scalar_t* k_b = k + b * S * E;
      const scalar_t* v_b = v + b * S * E;
      const int64_t n = visible_keys(i, S, causal);
      acc_t max_score = -std::numeric_limits<acc_t>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        scores[j] = scale * dot<acc_t>(q_row, k_b + j * E, E);
        max_score = std::max(max_score, scores[j]);
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      acc_t sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        const acc_t p = std::exp(scores[j] - max_score);
        sum += p;
        const scalar_t* v_row = v_b + j * E;
        for (int64_t e = 0; e < E; ++e) {
          acc[e] += p * static_cast<acc_t>(v_row[e]);
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        out[row * E + e] = static_cast<scalar_t>(acc[e] / sum);
      }
      lse[row] = max_score + std::log(sum);
    }
  });
}

// P = exp(scale·QKᵀ − lse) is recomputed, never stored. Two passes, so that every output row is
// written by one thread (no atomics, deterministic): rows for dQ, then key columns for dK, dV.
template <typename scalar_t>
void backward_kernel(const scalar_t* dout,  // (B, L, E) contiguous
                     const scalar_t* q,     // (B, L, E)
                     const scalar_t* k,     // (B, S, E)
                     const scalar_t* v,     // (B, S, E)
                     const scalar_t* out,   // (B, L, E)
                     const at::opmath_type<scalar_t>* lse,  // (B, L)
                     scalar_t* dq,          // (B, L, E)
                     scalar_t* dk,          // (B, S, E)
                     scalar_t* dv,          // (B, S, E)
                     const AttentionShape& shape, double scale_, bool causal) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t L = shape.len_q, S = shape.len_kv, E = shape.head_dim;
  const acc_t scale = static_cast<acc_t>(scale_);

  // D_i = rowsum(dO_i ∘ O_i), the softmax Jacobian's correction term.
  std::vector<acc_t> delta(shape.batch * L);
  at::parallel_for(0, shape.batch * L, grain_rows(1, E), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      delta[row] = dot<acc_t>(dout + row * E, out + row * E, E);
    }
  });

  // dQ_i = scale · Σ_j P_ij (dP_ij − D_i) K_j, with dP_ij = dO_i · V_j.
  at::parallel_for(0, shape.batch * L, grain_rows(S, E), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(E);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / L, i = row % L;
      const scalar_t* k_b = k + b * S * E;
      const scalar_t* v_b = v + b * S * E;
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t j = 0, n = visible_keys(i, S, causal); j < n; ++j) {
        const acc_t p = std::exp(scale * dot<acc_t>(q + row * E, k_b + j * E, E) - lse[row]);
        const acc_t ds = p * (dot<acc_t>(dout + row * E, v_b + j * E, E) - delta[row]);
        for (int64_t e = 0; e < E; ++e) {
          acc[e] += ds * static_cast<acc_t>(k_b[j * E + e]);
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        dq[row * E + e] = static_cast<scalar_t>(scale * acc[e]);
      }
    }
  });

  // dV_j = Σ_i P_ij dO_i and dK_j = scale · Σ_i P_ij (dP_ij − D_i) Q_i; when causal, key j is
  // seen by rows i >= j only.
  at::parallel_for(0, shape.batch * S, grain_rows(L, E), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc_k(E), acc_v(E);
    for (int64_t col = begin; col < end; ++col) {
      const int64_t b = col / S, j = col % S;
      const scalar_t* k_col = k + col * E;
      const scalar_t* v_col = v + col * E;
      std::fill(acc_k.begin(), acc_k.end(), acc_t(0));
      std::fill(acc_v.begin(), acc_v.end(), acc_t(0));
      for (int64_t i = causal ? j : 0; i < L; ++i) {
        const int64_t row = b * L + i;
        const scalar_t* q_row = q + row * E;
        const scalar_t* dout_row = dout + row * E;
        const acc_t p = std::exp(scale * dot<acc_t>(q_row, k_col, E) - lse[row]);
        const acc_t ds = p * (dot<acc_t>(dout_row, v_col, E) - delta[row]);
        for (int64_t e = 0; e < E; ++e) {
          acc_v[e] += p * static_cast<acc_t>(dout_row[e]);
          acc_k[e] += ds * static_cast<acc_t>(q_row[e]);
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        dv[col * E + e] = static_cast<scalar_t>(acc_v[e]);
        dk[col * E + e] = static_cast<scalar_t>(scale * acc_k[e]);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(const at::Tensor& query,  // (..., L, E)
                                                         const at::Tensor& key,    // (..., S, E)
                                                         const at::Tensor& value,  // (..., S, E)
                                                         double scale, bool causal) {
  const AttentionShape shape = check_attention_inputs(query, key, value);
  TORCH_INTERNAL_ASSERT(query.device().is_cpu());
  const auto lse_dtype = logsumexp_dtype(query.scalar_type());
  // Sizes only, so both outputs are contiguous whatever the inputs' strides.
  at::Tensor output = at::empty(query.sizes(), query.options());  // (..., L, E)
  at::Tensor logsumexp =
      at::empty(query.sizes().slice(0, query.dim() - 1), query.options().dtype(lse_dtype));
  if (shape.batch == 0 || shape.len_q == 0) {
    return {output, logsumexp};
  }
  if (shape.len_kv == 0) {  // as SDPA: nothing to attend to gives zeros
    output.zero_();
    logsumexp.fill_(-std::numeric_limits<double>::infinity());
    return {output, logsumexp};
  }
  // One copy for views (transposed, sliced, expanded); a no-op when already contiguous.
  const at::Tensor q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, query.scalar_type(), "attention_forward_cpu", [&] {
        forward_kernel<scalar_t>(q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(),
                                 v.const_data_ptr<scalar_t>(), output.mutable_data_ptr<scalar_t>(),
                                 logsumexp.mutable_data_ptr<at::opmath_type<scalar_t>>(), shape,
                                 scale, causal);
      });
  return {output, logsumexp};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_output,  // (..., L, E)
    const at::Tensor& query,        // (..., L, E)
    const at::Tensor& key,          // (..., S, E)
    const at::Tensor& value,        // (..., S, E)
    const at::Tensor& output,       // (..., L, E)
    const at::Tensor& logsumexp,    // (..., L), float32 (float64 for float64 inputs)
    double scale, bool causal) {
  const AttentionShape shape = check_attention_inputs(query, key, value);
  check_backward_inputs(grad_output, query, output, logsumexp);
  TORCH_INTERNAL_ASSERT(query.device().is_cpu());
  if (shape.batch == 0 || shape.len_q == 0 || shape.len_kv == 0) {
    // The output does not depend on any element: every gradient is zero.
    return {at::zeros(query.sizes(), query.options()), at::zeros(key.sizes(), key.options()),
            at::zeros(value.sizes(), value.options())};
  }
  at::Tensor grad_query = at::empty(query.sizes(), query.options());  // (..., L, E)
  at::Tensor grad_key = at::empty(key.sizes(), key.options());        // (..., S, E)
  at::Tensor grad_value = at::empty(value.sizes(), value.options());  // (..., S, E)
  const at::Tensor dout = grad_output.contiguous(), q = query.contiguous(),
                   k = key.contiguous(), v = value.contiguous(), out = output.contiguous(),
                   lse = logsumexp.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, query.scalar_type(), "attention_backward_cpu", [&] {
        backward_kernel<scalar_t>(
            dout.const_data_ptr<scalar_t>(), q.const_data_ptr<scalar_t>(),
            k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
            out.const_data_ptr<scalar_t>(), lse.const_data_ptr<at::opmath_type<scalar_t>>(),
            grad_query.mutable_data_ptr<scalar_t>(), grad_key.mutable_data_ptr<scalar_t>(),
            grad_value.mutable_data_ptr<scalar_t>(), shape, scale, causal);
      });
  return {grad_query, grad_key, grad_value};
}

}  // namespace

// The CPU kernels; CUDA ones register under the CUDA key in attention_cuda.cu. Other devices
// get the dispatcher's NotImplementedError, meta and fake tensors the Python fake kernels.
TORCH_LIBRARY_IMPL(fixed_attention, CPU, m) {
  m.impl("attention_forward", &attention_forward_cpu);
  m.impl("attention_backward", &attention_backward_cpu);
}

}  // namespace fixed_attention
