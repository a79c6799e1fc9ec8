// Standalone check of the mma.sync forward's tilings (fixed/csrc/kernels/flash_forward.cuh:
// Tiling64, Tiling128, Tiling128Causal, Tiling256) against the generic forward kernel
// (attention_kernels.cuh) on the same device and inputs. On compute capability 9.0 the operator
// runs Hopper's kernels instead, so its tests never reach these tilings there: this program
// does, on any sm_80+ GPU (the operator's path on Ampere and Ada). No torch. From the
// repository root:
//
//   nvcc -std=c++17 -O3 -arch=native -o /tmp/fwd_mma_sync_check perf/fwd_mma_sync_check.cu && /tmp/fwd_mma_sync_check
//
// Cases per tiling and dtype (bf16, fp16), batch items of several heads: tails in L and S, L < S
// and L > S, causal where the tiling takes it, a negative scale; an additive (L, S) mask (every
// seventh entry -inf) with dropout 0.2 and GQA (2 query heads per K/V head); dropout alone with
// 3 query heads per K/V head. Inputs from sm90_check_common.cuh's fill kernel (not zeros);
// outputs filled with NaN first. A case fails if an output is not finite, O's relative Frobenius
// error to the generic kernel's exceeds 1e-2 (both round O to 16 bits: about 2e-3 apart), or
// lse's largest |difference| / (1 + |lse|) exceeds 1e-5 (both float32). Exit status 1 if any fails.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "sm90_check_common.cuh"
#include "../fixed/csrc/kernels/attention_kernels.cuh"
#include "../fixed/csrc/kernels/flash_forward.cuh"

namespace fk = fixed_attention::kernels;
namespace flash = fixed_attention::kernels::flash;

struct MmaCase {
  int heads, kv_group, len_q, len_kv;
  bool causal, mask;
  float dropout_p, scale_factor;
};

constexpr MmaCase kCases[] = {
    {4, 1, 200, 333, false, false, 0.f, 1.f},   {4, 1, 333, 200, false, false, 0.f, -0.7f},
    {2, 1, 1000, 1000, false, false, 0.f, 1.f}, {4, 2, 300, 300, false, true, 0.2f, 1.f},
    {3, 3, 77, 520, false, false, 0.1f, 1.f},
};

// One case: the tiling's launcher and the generic one on the same inputs; true if it passes.
template <typename T, class F>
bool check_case(const char* tiling, const MmaCase& c, bool causal) {
  constexpr int D = F::kHeadDim;
  const int64_t batch = 2 * c.heads;
  const size_t q_elems = static_cast<size_t>(batch) * c.len_q * D;
  const size_t kv_elems = static_cast<size_t>(batch / c.kv_group) * c.len_kv * D;
  const size_t rows = static_cast<size_t>(batch) * c.len_q;
  T *q, *k, *v, *out_flash, *out_generic;
  float *lse_flash, *lse_generic, *mask = nullptr;
  CHECK_CUDA(cudaMalloc(&q, q_elems * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&k, kv_elems * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&v, kv_elems * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&out_flash, q_elems * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&out_generic, q_elems * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&lse_flash, rows * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&lse_generic, rows * sizeof(float)));
  fill_kernel<<<256, 256>>>(q, static_cast<int64_t>(q_elems), 11u);
  fill_kernel<<<256, 256>>>(k, static_cast<int64_t>(kv_elems), 23u);
  fill_kernel<<<256, 256>>>(v, static_cast<int64_t>(kv_elems), 37u);
  CHECK_CUDA(cudaMemset(out_flash, 0xFF, q_elems * sizeof(T)));  // NaN in both dtypes
  CHECK_CUDA(cudaMemset(lse_flash, 0xFF, rows * sizeof(float)));
  fk::AttentionProblem p{};
  p.batch = batch;
  p.len_q = c.len_q;
  p.len_kv = c.len_kv;
  p.head_dim = D;
  p.scale = c.scale_factor / std::sqrt(static_cast<float>(D));
  p.causal = causal;
  p.heads = c.heads;
  p.kv_group = c.kv_group;
  if (c.mask) {
    std::vector<float> host(static_cast<size_t>(c.len_q) * c.len_kv);
    for (size_t i = 0; i < host.size(); ++i) {
      host[i] = i % 7 == 3 ? -INFINITY : static_cast<float>((i * 2654435761u) % 1000) / 500.f - 1.f;
    }
    mask = device_copy(host);
    p.mask = mask;
    p.mask_stride_row = c.len_kv;
    p.mask_stride_col = 1;
  }
  p.dropout_p = c.dropout_p;
  p.dropout_seed = 12345;
  const bool took = flash::detail::launch<T, F>(q, k, v, out_flash, lse_flash, p, nullptr);
  fk::launch_attention_forward(q, k, v, out_generic, lse_generic, p, nullptr);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<T> a = download(out_flash, q_elems), b = download(out_generic, q_elems);
  const std::vector<float> la = download(lse_flash, rows), lb = download(lse_generic, rows);
  double num = 0, den = 0, lse_error = 0;
  bool finite = true;
  for (size_t i = 0; i < q_elems; ++i) {
    const double x = to_f(a[i]), y = to_f(b[i]);
    finite = finite && std::isfinite(x);
    num += (x - y) * (x - y);
    den += y * y;
  }
  for (size_t i = 0; i < rows; ++i) {
    if (std::isinf(lb[i]) && la[i] == lb[i]) {
      continue;  // a row with every key masked: -inf in both
    }
    finite = finite && std::isfinite(la[i]);
    lse_error = std::fmax(lse_error, std::fabs(la[i] - lb[i]) / (1.0 + std::fabs(lb[i])));
  }
  const double error = std::sqrt(num / (den > 0 ? den : 1.0));
  const bool ok = took && finite && error <= 1e-2 && lse_error <= 1e-5;
  std::printf("%s %-16s %s heads %d/%d L %4d S %4d causal %d mask %d dropout %.1f scale %+.1f: "
              "O %.2e lse %.2e%s\n",
              ok ? "PASS" : "FAIL", tiling, type_name<T>(), c.heads, c.heads / c.kv_group,
              c.len_q, c.len_kv, causal, c.mask, c.dropout_p, c.scale_factor, error, lse_error,
              took ? "" : " (the launcher declined)");
  for (void* pointer : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v),
                        static_cast<void*>(out_flash), static_cast<void*>(out_generic),
                        static_cast<void*>(lse_flash), static_cast<void*>(lse_generic),
                        static_cast<void*>(mask)}) {
    CHECK_CUDA(cudaFree(pointer));
  }
  return ok;
}

// Every case for one tiling: causal or not as the launcher uses it (Tiling128Causal: causal).
template <typename T, class F>
int check_tiling(const char* tiling, bool causal_only, bool non_causal_only) {
  int failed = 0;
  for (const MmaCase& c : kCases) {
    for (const bool causal : {false, true}) {
      if ((causal && non_causal_only) || (!causal && causal_only) || (causal && c.mask)) {
        continue;  // the operator never combines a mask with causal
      }
      failed += check_case<T, F>(tiling, c, causal) ? 0 : 1;
    }
  }
  return failed;
}

template <typename T>
int check_dtype() {
  return check_tiling<T, flash::Tiling64>("Tiling64", false, false) +
         check_tiling<T, flash::Tiling128>("Tiling128", false, true) +
         check_tiling<T, flash::Tiling128Causal>("Tiling128Causal", true, false) +
         check_tiling<T, flash::Tiling256>("Tiling256", false, false);
}

int main() {
  const int failed = check_dtype<__nv_bfloat16>() + check_dtype<__half>();
  std::printf("%s\n", failed ? "SOME CASES FAILED" : "every case passed");
  return failed ? 1 : 0;
}
