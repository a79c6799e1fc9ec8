// Standalone check and timing of the wgmma backward (fixed/csrc/kernels/flash_backward_sm90.cuh)
// against the mma.sync backward (flash_backward.cuh) and a float64 host reference. No torch.
// Needs a GPU of compute capability 9.0 (H100/H200). One command, from the repository root:
//
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a -o /tmp/bwd_sm90_check perf/bwd_sm90_check.cu && /tmp/bwd_sm90_check
//
// (`/tmp/bwd_sm90_check --no-timing` runs the checks only; `--timing-only` the timings only;
// `--seq N` times L = S = N instead of 4096. `--mma-sync-body` is refused: since perf/NOTES.md
// v33 the wgmma kernel has no other body, and outside sm_90a its launcher declines, so
// flash_backward.cuh's own kernel runs.)
//
// Checks: for bf16 and fp16, head dims 64 and 128, causal and not, batch 3, (L, S) = (128, 128),
// (1000, 1000), (300, 700), (700, 300), and two scale cases, (257, 513) with a negative scale and
// (200, 200) with scale 0: random Q, K, V, dO (fixed seed), the forward's O and lse in double
// precision on the host (O rounded to the dtype, lse to float32: what the operator's forward
// hands the backward), then both backwards through their launchers, each writing into buffers
// filled with NaN first. Then (77, 1) and (300, 130) with every score far below 0 (Q all -6, K
// 6 + 0.25 x normal: -36 sqrt(D) +- 1.5 after the scale), where P of the keys past S, from their
// zero rows of K, would be 2^-lse and overflow (perf/NOTES.md, v41). With a constant K, dQ's
// reference was 0 and its relative error meaningless (2e11 at (300, 130), both kernels alike).
// dQ, dK, dV of each against the float64 reference (relative Frobenius error); a case fails if
// any gradient of either kernel is not finite or the wgmma kernel's error exceeds 2 x the
// mma.sync kernel's + 1e-3. Exit status 1 if any case fails.
// Timing: B x H = 64, L = S = 4096 (or --seq N), bf16, head dims 64 and 128, causal and not;
// the three launches of each backward (prologue, main kernel, dq), CUDA events, 3 warm-up calls,
// then 20 rounds alternating the two kernels; median ms and TFLOP/s (backward FLOPs =
// 2.5 x 4 B H L S D, half that when causal).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "sm90_check_common.cuh"
#include "../fixed/csrc/kernels/flash_backward_sm90.cuh"

namespace fk = fixed_attention::kernels;

// The float64 reference on the rounded inputs: (B, L, D) q, dout; (B, S, D) k, v. Fills out
// and lse (the forward) and dq, dk, dv.
struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
};

Reference reference(const std::vector<double>& q, const std::vector<double>& k,
                    const std::vector<double>& v, const std::vector<double>& dout, int64_t B,
                    int64_t L, int64_t S, int64_t D, double scale, bool causal) {
  Reference r;
  r.out.assign(B * L * D, 0.0);
  r.lse.assign(B * L, 0.0);
  r.dq.assign(B * L * D, 0.0);
  r.dk.assign(B * S * D, 0.0);
  r.dv.assign(B * S * D, 0.0);
  std::vector<double> prob(L * S), ds(L * S);
  for (int64_t b = 0; b < B; ++b) {
    const double* qb = q.data() + b * L * D;
    const double* kb = k.data() + b * S * D;
    const double* vb = v.data() + b * S * D;
    const double* ob = dout.data() + b * L * D;
    parallel_for(L, [&](int64_t i) {
      const int64_t visible = causal ? std::min<int64_t>(S, i + 1) : S;  // keys j <= i
      double* p_row = prob.data() + i * S;
      double* ds_row = ds.data() + i * S;
      std::fill(p_row, p_row + S, 0.0);
      std::fill(ds_row, ds_row + S, 0.0);
      double row_max = -INFINITY;
      for (int64_t j = 0; j < visible; ++j) {
        double dot = 0.0;
        for (int64_t d = 0; d < D; ++d) {
          dot += qb[i * D + d] * kb[j * D + d];
        }
        p_row[j] = scale * dot;
        row_max = std::max(row_max, p_row[j]);
      }
      double sum = 0.0;
      for (int64_t j = 0; j < visible; ++j) {
        sum += std::exp(p_row[j] - row_max);
      }
      const double lse = row_max + std::log(sum);
      r.lse[b * L + i] = lse;
      double* o_row = r.out.data() + (b * L + i) * D;
      for (int64_t j = 0; j < visible; ++j) {
        p_row[j] = std::exp(p_row[j] - lse);
        for (int64_t d = 0; d < D; ++d) {
          o_row[d] += p_row[j] * vb[j * D + d];
        }
      }
      double delta = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        delta += ob[i * D + d] * o_row[d];
      }
      double* dq_row = r.dq.data() + (b * L + i) * D;
      for (int64_t j = 0; j < visible; ++j) {
        double dp = 0.0;
        for (int64_t d = 0; d < D; ++d) {
          dp += ob[i * D + d] * vb[j * D + d];
        }
        ds_row[j] = p_row[j] * (dp - delta);
        for (int64_t d = 0; d < D; ++d) {
          dq_row[d] += scale * ds_row[j] * kb[j * D + d];
        }
      }
    });
    parallel_for(S, [&](int64_t j) {
      double* dk_row = r.dk.data() + (b * S + j) * D;
      double* dv_row = r.dv.data() + (b * S + j) * D;
      for (int64_t i = 0; i < L; ++i) {
        const double p = prob[i * S + j], dsv = ds[i * S + j];
        if (p == 0.0 && dsv == 0.0) {
          continue;
        }
        for (int64_t d = 0; d < D; ++d) {
          dv_row[d] += p * ob[i * D + d];
          dk_row[d] += scale * dsv * qb[i * D + d];
        }
      }
    });
  }
  return r;
}

// ||x - ref||_F / ||ref||_F; +inf if x has a non-finite element.
template <typename T>
double relative_error(const std::vector<T>& x, const std::vector<double>& ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double value = to_f(x[i]);
    if (!std::isfinite(value)) {
      return INFINITY;
    }
    num += (value - ref[i]) * (value - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The device buffers of one backward problem.
template <typename T>
struct Buffers {
  T *q = nullptr, *k = nullptr, *v = nullptr, *dout = nullptr, *out = nullptr;
  float* lse = nullptr;
  T *dq = nullptr, *dk = nullptr, *dv = nullptr;
  float *row_stats = nullptr, *dq_accum = nullptr;  // the workspace
  int64_t rows = 0;
  size_t q_elems = 0, kv_elems = 0;

  void allocate_outputs(const fk::AttentionProblem& p) {
    rows = fk::flash_backward_rows(static_cast<const T*>(nullptr), p);
    if (rows <= 0) {
      std::fprintf(stderr, "flash_backward_rows declined the case\n");
      std::exit(2);
    }
    CHECK_CUDA(cudaMalloc(&dq, q_elems * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&dk, kv_elems * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&dv, kv_elems * sizeof(T)));
    CHECK_CUDA(cudaMalloc(&row_stats, 2 * p.batch * rows * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&dq_accum, p.batch * rows * p.head_dim * sizeof(float)));
  }
  void poison(const fk::AttentionProblem& p) {  // NaN bytes (0xFF..): unwritten shows up
    CHECK_CUDA(cudaMemset(dq, 0xFF, q_elems * sizeof(T)));
    CHECK_CUDA(cudaMemset(dk, 0xFF, kv_elems * sizeof(T)));
    CHECK_CUDA(cudaMemset(dv, 0xFF, kv_elems * sizeof(T)));
    CHECK_CUDA(cudaMemset(row_stats, 0xFF, 2 * p.batch * rows * sizeof(float)));
    CHECK_CUDA(cudaMemset(dq_accum, 0xFF, p.batch * rows * p.head_dim * sizeof(float)));
  }
  void free_all() {
    for (void* pointer : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v),
                          static_cast<void*>(dout), static_cast<void*>(out),
                          static_cast<void*>(lse), static_cast<void*>(dq), static_cast<void*>(dk),
                          static_cast<void*>(dv), static_cast<void*>(row_stats),
                          static_cast<void*>(dq_accum)}) {
      CHECK_CUDA(cudaFree(pointer));
    }
  }
};

enum class Kernel { kMmaSync, kWgmma };

// One backward through the launchers; false if the launcher declined.
template <typename T>
bool run_backward(Kernel which, Buffers<T>& d, const fk::AttentionProblem& p,
                  cudaStream_t stream) {
  float* const lse_log2 = d.row_stats;
  float* const delta = d.row_stats + p.batch * d.rows;
  if (which == Kernel::kMmaSync) {
    return fk::launch_flash_backward_mma_sync(d.dout, d.q, d.k, d.v, d.out, d.lse, lse_log2,
                                              delta, d.dq_accum, d.dq, d.dk, d.dv, p, stream);
  }
  return fk::flash::sm90::backward<T>(d.dout, d.q, d.k, d.v, d.out, d.lse, lse_log2, delta,
                                      d.dq_accum, d.dq, d.dk, d.dv, p, stream);
}

// One correctness case; returns true if it passes.
template <typename T>
bool check_case(int64_t D, bool causal, const Case& c, uint64_t seed, bool far_below = false) {
  const int64_t B = 3, L = c.len_q, S = c.len_kv;
  const double scale = c.scale_factor / std::sqrt(static_cast<double>(D));
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  auto make = [&](int64_t n, std::vector<T>& rounded, std::vector<double>& exact) {
    rounded.resize(n);
    exact.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      rounded[i] = from_f<T>(static_cast<float>(normal(rng)));
      exact[i] = to_f(rounded[i]);
    }
  };
  std::vector<T> hq, hk, hv, hdo;
  std::vector<double> q, k, v, dout;
  make(B * L * D, hq, q);
  make(B * S * D, hk, k);
  make(B * S * D, hv, v);
  make(B * L * D, hdo, dout);
  if (far_below) {  // every score near -36 D x scale, spread by 1.5 (K's noise, 0.25 normal)
    std::fill(hq.begin(), hq.end(), from_f<T>(-6.f));
    std::fill(q.begin(), q.end(), -6.0);
    for (size_t i = 0; i < hk.size(); ++i) {  // K not constant: dQ's reference is not 0
      hk[i] = from_f<T>(static_cast<float>(6.0 + 0.25 * k[i]));
      k[i] = to_f(hk[i]);
    }
  }
  const Reference ref = reference(q, k, v, dout, B, L, S, D, scale, causal);
  std::vector<T> hout(B * L * D);
  std::vector<float> hlse(B * L);
  for (size_t i = 0; i < hout.size(); ++i) {
    hout[i] = from_f<T>(static_cast<float>(ref.out[i]));
  }
  for (size_t i = 0; i < hlse.size(); ++i) {
    hlse[i] = static_cast<float>(ref.lse[i]);
  }

  fk::AttentionProblem p{B, L, S, D, static_cast<float>(scale), causal};
  Buffers<T> d;
  d.q_elems = B * L * D;
  d.kv_elems = B * S * D;
  d.q = device_copy(hq);
  d.k = device_copy(hk);
  d.v = device_copy(hv);
  d.dout = device_copy(hdo);
  d.out = device_copy(hout);
  d.lse = device_copy(hlse);
  d.allocate_outputs(p);

  double errors[2][3];
  std::vector<T> grads[2][3];
  bool ok = true;
  for (int which = 0; which < 2; ++which) {
    d.poison(p);
    const Kernel kernel = which == 0 ? Kernel::kMmaSync : Kernel::kWgmma;
    if (!run_backward(kernel, d, p, nullptr)) {
      std::printf("  %s launcher declined the case\n", which == 0 ? "mma.sync" : "wgmma");
      ok = false;
      continue;
    }
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    grads[which][0] = download(d.dq, d.q_elems);
    grads[which][1] = download(d.dk, d.kv_elems);
    grads[which][2] = download(d.dv, d.kv_elems);
    errors[which][0] = relative_error(grads[which][0], ref.dq);
    errors[which][1] = relative_error(grads[which][1], ref.dk);
    errors[which][2] = relative_error(grads[which][2], ref.dv);
  }
  d.free_all();
  const char* names[3] = {"dq", "dk", "dv"};
  std::printf("%s D=%3lld causal=%d L=%4lld S=%4lld scale=%+.4f%s |", type_name<T>(),
              static_cast<long long>(D), causal ? 1 : 0, static_cast<long long>(L),
              static_cast<long long>(S), scale, far_below ? " far below 0" : "");
  if (!ok) {
    std::printf(" FAIL (declined)\n");
    return false;
  }
  for (int g = 0; g < 3; ++g) {
    const bool pass = std::isfinite(errors[0][g]) && std::isfinite(errors[1][g]) &&
                      errors[1][g] <= 2.0 * errors[0][g] + 1e-3;
    ok = ok && pass;
    std::printf(" %s mma %.2e wgmma %.2e%s |", names[g], errors[0][g], errors[1][g],
                pass ? "" : " FAIL");
  }
  // How far the two kernels are from each other (dK, dV: same products, other instructions).
  double diff = 0.0;
  for (int g = 1; g < 3; ++g) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < grads[0][g].size(); ++i) {
      const double a = to_f(grads[0][g][i]), b = to_f(grads[1][g][i]);
      num += (a - b) * (a - b);
      den += a * a;
    }
    diff = std::max(diff, den > 0.0 ? std::sqrt(num / den) : std::sqrt(num));
  }
  std::printf(" dk,dv wgmma vs mma %.1e %s\n", diff, ok ? "ok" : "FAIL");
  return ok;
}

template <typename T>
void time_case(int64_t D, bool causal, int64_t length) {
  const int64_t B = 64, L = length, S = length;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  fk::AttentionProblem p{B, L, S, D, scale, causal};
  Buffers<T> d;
  d.q_elems = d.kv_elems = B * L * D;
  T** const inputs[] = {&d.q, &d.k, &d.v, &d.dout, &d.out};
  for (T** tensor : inputs) {
    CHECK_CUDA(cudaMalloc(tensor, d.q_elems * sizeof(T)));
  }
  CHECK_CUDA(cudaMalloc(&d.lse, B * L * sizeof(float)));
  uint32_t salt = 1;
  T* const filled[] = {d.q, d.k, d.v, d.dout};
  for (T* tensor : filled) {
    fill_kernel<T><<<1024, 256>>>(tensor, static_cast<int64_t>(d.q_elems), 0x9E3779B9u * salt++);
  }
  // O and lse from the operator's forward kernels (wgmma on 9.0).
  if (!fk::launch_flash_forward_sm90(d.q, d.k, d.v, d.out, d.lse, p, nullptr) &&
      !fk::launch_flash_forward(d.q, d.k, d.v, d.out, d.lse, p, nullptr)) {
    std::fprintf(stderr, "no tensor-core forward for the timing case\n");
    std::exit(2);
  }
  CHECK_CUDA(cudaGetLastError());
  d.allocate_outputs(p);
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  const Kernel kernels[2] = {Kernel::kMmaSync, Kernel::kWgmma};
  for (int warm = 0; warm < 3; ++warm) {
    for (Kernel kernel : kernels) {
      if (!run_backward(kernel, d, p, nullptr)) {
        std::fprintf(stderr, "a launcher declined the timing case\n");
        std::exit(2);
      }
    }
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> ms[2];
  for (int round = 0; round < 20; ++round) {
    for (int which = 0; which < 2; ++which) {
      CHECK_CUDA(cudaEventRecord(start));
      run_backward(kernels[which], d, p, nullptr);
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      CHECK_CUDA(cudaGetLastError());
      float elapsed = 0.f;
      CHECK_CUDA(cudaEventElapsedTime(&elapsed, start, stop));
      ms[which].push_back(elapsed);
    }
  }
  const double flops =
      2.5 * 4.0 * static_cast<double>(B) * L * S * D * (causal ? 0.5 : 1.0);
  double median[2];
  for (int which = 0; which < 2; ++which) {
    std::sort(ms[which].begin(), ms[which].end());
    median[which] = 0.5 * (ms[which][9] + ms[which][10]);
  }
  std::printf("%s B*H=%lld L=S=%lld D=%3lld causal=%d | mma.sync %.3f ms %.0f TFLOP/s | "
              "wgmma %.3f ms %.0f TFLOP/s (range %.3f-%.3f) | wgmma / mma.sync speed %.2fx\n",
              type_name<T>(), static_cast<long long>(B), static_cast<long long>(L),
              static_cast<long long>(D), causal ? 1 : 0, median[0],
              flops / (median[0] * 1e-3) / 1e12, median[1], flops / (median[1] * 1e-3) / 1e12,
              ms[1].front(), ms[1].back(), median[0] / median[1]);
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  d.free_all();
}

int main(int argc, char** argv) {
  CheckOptions options;
  if (!parse_options(argc, argv, options)) {
    return 2;
  }
  if (options.mma_sync_body) {  // the forward's check still has one (fwd_sm90_check.cu)
    std::printf("--mma-sync-body: the wgmma backward has no mma.sync body since perf/NOTES.md "
                "v33 (outside sm_90a flash_backward.cuh's kernel runs instead)\n");
    return 2;
  }
  if (!device_ready(false)) {
    return 2;
  }
  int failures = 0, cases = 0;
  if (options.checks) {
    uint64_t seed = 20240611;
    for (int64_t D : {64, 128}) {
      for (bool causal : {false, true}) {
        for (const Case& c : kCheckShapes) {
          failures += check_case<__nv_bfloat16>(D, causal, c, seed++) ? 0 : 1;
          failures += check_case<__half>(D, causal, c, seed++) ? 0 : 1;
          cases += 2;
        }
        for (const Case& c : {Case{77, 1, 1.0}, Case{300, 130, 1.0}}) {
          failures += check_case<__nv_bfloat16>(D, causal, c, seed++, true) ? 0 : 1;
          failures += check_case<__half>(D, causal, c, seed++, true) ? 0 : 1;
          cases += 2;
        }
      }
    }
    std::printf("%d of %d cases passed\n", cases - failures, cases);
  }
  if (options.timing) {
    for (int64_t D : {64, 128}) {
      for (bool causal : {false, true}) {
        time_case<__nv_bfloat16>(D, causal, options.length);
      }
    }
  }
  return failures == 0 ? 0 : 1;
}
