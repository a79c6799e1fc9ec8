// CPU kernels of the fixed_attention operators: exact softmax attention, one query row at a
// time, accumulating in at::opmath_type (float for half types, double for float64). Every
// argument of scaled_dot_product_attention: an additive mask (bool masks arrive as 0 / -inf),
// grouped-query heads, Ev != E, any head dim, and dropout with the CUDA kernels' generator.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
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
#include "kernels/philox.h"

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

// 8 independent partial sums, then the tail: the compiler vectorises the main loop without
// -ffast-math, and the result does not depend on the thread count.
template <typename acc_t, typename scalar_t>
acc_t dot(const scalar_t* a, const scalar_t* b, int64_t n) {
  acc_t partial[8] = {};
  const int64_t whole = n - n % 8;
  for (int64_t e = 0; e < whole; e += 8) {
    for (int64_t lane = 0; lane < 8; ++lane) {
      partial[lane] += static_cast<acc_t>(a[e + lane]) * static_cast<acc_t>(b[e + lane]);
    }
  }
  for (int64_t e = whole; e < n; ++e) {
    partial[e - whole] += static_cast<acc_t>(a[e]) * static_cast<acc_t>(b[e]);
  }
  return ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
         ((partial[4] + partial[5]) + (partial[6] + partial[7]));
}

// What the kernels need besides the tensors: sizes, the head layout, the mask and dropout.
template <typename acc_t>
struct Problem {
  AttentionShape shape;
  acc_t scale;
  bool causal;
  const acc_t* mask;  // additive (outer, heads, L, S) with the strides below, or null
  int64_t mask_strides[4];
  float dropout_p;
  uint64_t seed;
  acc_t keep_scale;  // 1 / (1 - p), or 0 when p == 1 (everything dropped)

  // The key/value item that query item b reads: its own, or under GQA its group's.
  int64_t kv_item(int64_t b) const {
    const int64_t heads = shape.heads;
    return (b / heads) * (heads / shape.kv_group) + (b % heads) / shape.kv_group;
  }
  // Query items reading key/value item kv: kv_group consecutive heads of one outer index.
  int64_t first_query_item(int64_t kv) const {
    const int64_t kv_heads = shape.heads / shape.kv_group;
    return (kv / kv_heads) * shape.heads + (kv % kv_heads) * shape.kv_group;
  }
  // scale·q·k + mask for query item b, row i, key j.
  acc_t score(acc_t dot_qk, int64_t b, int64_t i, int64_t j) const {
    acc_t s = scale * dot_qk;
    if (mask != nullptr) {
      s += mask[(b / shape.heads) * mask_strides[0] + (b % shape.heads) * mask_strides[1] +
                i * mask_strides[2] + j * mask_strides[3]];
    }
    return s;
  }
  // The factor dropout puts on probability (b, i, j): 1 without dropout, 0 or 1 / (1 - p).
  acc_t dropout_factor(int64_t b, int64_t i, int64_t j) const {
    if (dropout_p == 0.f) {
      return acc_t(1);
    }
    return dropout::keep(seed, dropout_p, b, i, j, shape.len_q, shape.len_kv) ? keep_scale
                                                                               : acc_t(0);
  }
};

template <typename acc_t>
Problem<acc_t> make_problem(const AttentionShape& shape, double scale, bool causal,
                            const std::optional<at::Tensor>& mask, double dropout_p,
                            uint64_t seed) {
  Problem<acc_t> problem{shape, static_cast<acc_t>(scale), causal, nullptr, {0, 0, 0, 0},
                         static_cast<float>(dropout_p), seed, acc_t(0)};
  if (mask.has_value()) {
    problem.mask = mask->const_data_ptr<acc_t>();
    for (int d = 0; d < 4; ++d) {
      problem.mask_strides[d] = mask->stride(d);
    }
  }
  problem.keep_scale = dropout_p < 1.0 ? static_cast<acc_t>(1.0 / (1.0 - dropout_p)) : acc_t(0);
  return problem;
}

template <typename scalar_t>
void forward_kernel(const scalar_t* q,  // (B, L, E) contiguous
                    const scalar_t* k,  // (Bkv, S, E) contiguous
                    const scalar_t* v,  // (Bkv, S, Ev) contiguous
                    scalar_t* out,      // (B, L, Ev)
                    at::opmath_type<scalar_t>* lse,  // (B, L)
                    const Problem<at::opmath_type<scalar_t>>& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const AttentionShape& shape = p.shape;
  const int64_t L = shape.len_q, S = shape.len_kv, E = shape.head_dim, Ev = shape.head_dim_v;
  // (batch, row) pairs flattened: parallel over batch items and blocks of rows.
  at::parallel_for(0, shape.batch * L, grain_rows(S, E + Ev), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> scores(S);
    std::vector<acc_t> acc(Ev);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / L, i = row % L, kv = p.kv_item(b);
      const scalar_t* q_row = q + row * E;
      const scalar_t* k_b = k + kv * S * E;
      const scalar_t* v_b = v + kv * S * Ev;
      const int64_t n = visible_keys(i, S, p.causal);
      acc_t max_score = -std::numeric_limits<acc_t>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        scores[j] = p.score(dot<acc_t>(q_row, k_b + j * E, E), b, i, j);
        max_score = std::max(max_score, scores[j]);
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      if (max_score == -std::numeric_limits<acc_t>::infinity()) {
        // No key takes part (all masked): zeros, as SDPA returns, and lse -inf.
        std::copy(acc.begin(), acc.end(), out + row * Ev);
        lse[row] = max_score;
        continue;
      }
      acc_t sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        const acc_t prob = std::exp(scores[j] - max_score);
        sum += prob;  // dropout scales the probabilities after the softmax, not its sum
        const acc_t weight = prob * p.dropout_factor(b, i, j);
        if (weight == acc_t(0)) {
          continue;
        }
        const scalar_t* v_row = v_b + j * Ev;
        for (int64_t e = 0; e < Ev; ++e) {
          acc[e] += weight * static_cast<acc_t>(v_row[e]);
        }
      }
      for (int64_t e = 0; e < Ev; ++e) {
        out[row * Ev + e] = static_cast<scalar_t>(acc[e] / sum);
      }
      lse[row] = max_score + std::log(sum);
    }
  });
}

// P = exp(scale·QKᵀ + mask − lse) is recomputed, never stored; Z is dropout's factor (0 or
// 1/(1-p)). Two passes, so that every output row is written by one thread (no atomics,
// deterministic): rows for dQ, then key columns for dK, dV (under GQA summing over the query
// heads that share the key).
template <typename scalar_t>
void backward_kernel(const scalar_t* dout,  // (B, L, Ev) contiguous
                     const scalar_t* q,     // (B, L, E)
                     const scalar_t* k,     // (Bkv, S, E)
                     const scalar_t* v,     // (Bkv, S, Ev)
                     const scalar_t* out,   // (B, L, Ev)
                     const at::opmath_type<scalar_t>* lse,  // (B, L)
                     scalar_t* dq,          // (B, L, E)
                     scalar_t* dk,          // (Bkv, S, E)
                     scalar_t* dv,          // (Bkv, S, Ev)
                     const Problem<at::opmath_type<scalar_t>>& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const AttentionShape& shape = p.shape;
  const int64_t L = shape.len_q, S = shape.len_kv, E = shape.head_dim, Ev = shape.head_dim_v;
  const acc_t no_key = -std::numeric_limits<acc_t>::infinity();

  // D_i = rowsum(dO_i ∘ O_i), the softmax Jacobian's correction term (O as returned, dropped).
  std::vector<acc_t> delta(shape.batch * L);
  at::parallel_for(0, shape.batch * L, grain_rows(1, Ev), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      delta[row] = dot<acc_t>(dout + row * Ev, out + row * Ev, Ev);
    }
  });
  // P_ij, 0 for a row that sees no key (lse -inf) or a masked-out key.
  auto prob = [&](acc_t score, int64_t row) {
    return lse[row] == no_key ? acc_t(0) : std::exp(score - lse[row]);
  };

  // dQ_i = scale · Σ_j P_ij (Z_ij dP_ij − D_i) K_j, with dP_ij = dO_i · V_j.
  at::parallel_for(0, shape.batch * L, grain_rows(S, E + Ev), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(E);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / L, i = row % L, kv = p.kv_item(b);
      const scalar_t* k_b = k + kv * S * E;
      const scalar_t* v_b = v + kv * S * Ev;
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t j = 0, n = visible_keys(i, S, p.causal); j < n; ++j) {
        const acc_t pij = prob(p.score(dot<acc_t>(q + row * E, k_b + j * E, E), b, i, j), row);
        if (pij == acc_t(0)) {
          continue;
        }
        const acc_t dp = dot<acc_t>(dout + row * Ev, v_b + j * Ev, Ev);
        const acc_t ds = pij * (p.dropout_factor(b, i, j) * dp - delta[row]);
        for (int64_t e = 0; e < E; ++e) {
          acc[e] += ds * static_cast<acc_t>(k_b[j * E + e]);
        }
      }
      for (int64_t e = 0; e < E; ++e) {
        dq[row * E + e] = static_cast<scalar_t>(p.scale * acc[e]);
      }
    }
  });

  // dV_j = Σ_i Z_ij P_ij dO_i and dK_j = scale · Σ_i P_ij (Z_ij dP_ij − D_i) Q_i, over the
  // query items that read key item kv; when causal, key j is seen by rows i >= j only.
  const int64_t kv_items = shape.batch / shape.kv_group;
  at::parallel_for(0, kv_items * S, grain_rows(L * shape.kv_group, E + Ev),
                   [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc_k(E), acc_v(Ev);
    for (int64_t col = begin; col < end; ++col) {
      const int64_t kv = col / S, j = col % S;
      const scalar_t* k_col = k + col * E;
      const scalar_t* v_col = v + col * Ev;
      std::fill(acc_k.begin(), acc_k.end(), acc_t(0));
      std::fill(acc_v.begin(), acc_v.end(), acc_t(0));
      const int64_t first = p.first_query_item(kv);
      for (int64_t b = first; b < first + shape.kv_group; ++b) {
        for (int64_t i = p.causal ? j : 0; i < L; ++i) {
          const int64_t row = b * L + i;
          const scalar_t* q_row = q + row * E;
          const scalar_t* dout_row = dout + row * Ev;
          const acc_t pij = prob(p.score(dot<acc_t>(q_row, k_col, E), b, i, j), row);
          if (pij == acc_t(0)) {
            continue;
          }
          const acc_t z = p.dropout_factor(b, i, j);
          const acc_t ds = pij * (z * dot<acc_t>(dout_row, v_col, Ev) - delta[row]);
          for (int64_t e = 0; e < Ev; ++e) {
            acc_v[e] += z * pij * static_cast<acc_t>(dout_row[e]);
          }
          for (int64_t e = 0; e < E; ++e) {
            acc_k[e] += ds * static_cast<acc_t>(q_row[e]);
          }
        }
      }
      for (int64_t e = 0; e < Ev; ++e) {
        dv[col * Ev + e] = static_cast<scalar_t>(acc_v[e]);
      }
      for (int64_t e = 0; e < E; ++e) {
        dk[col * E + e] = static_cast<scalar_t>(p.scale * acc_k[e]);
      }
    }
  });
}

// query's shape with the last dim (E) replaced by value's (Ev): the output's shape.
std::vector<int64_t> output_shape(const at::Tensor& query, const at::Tensor& value) {
  std::vector<int64_t> sizes(query.sizes().begin(), query.sizes().end());
  sizes.back() = value.size(-1);
  return sizes;
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(
    const at::Tensor& query,  // (..., L, E)
    const at::Tensor& key,    // (..., S, E)
    const at::Tensor& value,  // (..., S, Ev)
    double scale, bool causal, const std::optional<at::Tensor>& attn_mask, bool enable_gqa,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  const AttentionShape shape = check_attention_inputs(query, key, value, enable_gqa);
  const uint64_t seed = dropout_seed_of(dropout_p, dropout_seed);
  const auto lse_dtype = logsumexp_dtype(query.scalar_type());
  // The mask in the kernels' accumulation type (float64 for float64 inputs).
  const auto acc_dtype = at::toOpMathType(query.scalar_type());
  const std::optional<at::Tensor> mask = additive_mask(attn_mask, query, shape, causal, acc_dtype);
  TORCH_INTERNAL_ASSERT(query.device().is_cpu());
  // Sizes only, so both outputs are contiguous whatever the inputs' strides.
  at::Tensor output = at::empty(output_shape(query, value), query.options());  // (..., L, Ev)
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
        using acc_t = at::opmath_type<scalar_t>;
        forward_kernel<scalar_t>(
            q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(),
            v.const_data_ptr<scalar_t>(), output.mutable_data_ptr<scalar_t>(),
            logsumexp.mutable_data_ptr<acc_t>(),
            make_problem<acc_t>(shape, scale, causal, mask, dropout_p, seed));
      });
  return {output, logsumexp};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_output,  // (..., L, Ev)
    const at::Tensor& query,        // (..., L, E)
    const at::Tensor& key,          // (..., S, E)
    const at::Tensor& value,        // (..., S, Ev)
    const at::Tensor& output,       // (..., L, Ev)
    const at::Tensor& logsumexp,    // (..., L), float32 (float64 for float64 inputs)
    double scale, bool causal, const std::optional<at::Tensor>& attn_mask, bool enable_gqa,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  const AttentionShape shape = check_attention_inputs(query, key, value, enable_gqa);
  check_backward_inputs(grad_output, query, value, output, logsumexp);
  const uint64_t seed = dropout_seed_of(dropout_p, dropout_seed);
  const auto acc_dtype = at::toOpMathType(query.scalar_type());
  const std::optional<at::Tensor> mask = additive_mask(attn_mask, query, shape, causal, acc_dtype);
  TORCH_INTERNAL_ASSERT(query.device().is_cpu());
  if (shape.batch == 0 || shape.len_q == 0 || shape.len_kv == 0) {
    // The output does not depend on any element: every gradient is zero.
    return {at::zeros(query.sizes(), query.options()), at::zeros(key.sizes(), key.options()),
            at::zeros(value.sizes(), value.options())};
  }
  at::Tensor grad_query = at::empty(query.sizes(), query.options());  // (..., L, E)
  at::Tensor grad_key = at::empty(key.sizes(), key.options());        // (..., S, E)
  at::Tensor grad_value = at::empty(value.sizes(), value.options());  // (..., S, Ev)
  const at::Tensor dout = grad_output.contiguous(), q = query.contiguous(),
                   k = key.contiguous(), v = value.contiguous(), out = output.contiguous(),
                   lse = logsumexp.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, query.scalar_type(), "attention_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        backward_kernel<scalar_t>(
            dout.const_data_ptr<scalar_t>(), q.const_data_ptr<scalar_t>(),
            k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
            out.const_data_ptr<scalar_t>(), lse.const_data_ptr<acc_t>(),
            grad_query.mutable_data_ptr<scalar_t>(), grad_key.mutable_data_ptr<scalar_t>(),
            grad_value.mutable_data_ptr<scalar_t>(),
            make_problem<acc_t>(shape, scale, causal, mask, dropout_p, seed));
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
