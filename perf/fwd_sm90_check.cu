// Standalone check and timing of the wgmma forward (fixed/csrc/kernels/flash_forward_sm90.cuh)
// against the mma.sync forward (flash_forward.cuh) and a float64 host reference: the bench for
// a change to the forward kernel, run before the operator is built (perf/NOTES.md, v15). No
// torch. Needs compute capability 9.0 (H100/H200). One command, from the repository root:
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/fwd_sm90_check perf/fwd_sm90_check.cu && timeout 300 /tmp/fwd_sm90_check
//
// (`--no-timing` runs the checks only, `--timing-only` the timings only, `--seq N` times
// L = S = N instead of 4096. Built for plain sm_90 and run with `--mma-sync-body`, it checks the
// kernel's other body: flash_forward.cuh's mma.sync code, which images without wgmma run.)
//
// Checks: bf16 and fp16, head dims 64 and 128, causal and not, batch 3, (L, S) = (128, 128),
// (1000, 1000), (300, 700), (700, 300), (257, 513) with a negative scale and (200, 200) with
// scale 0; and in bf16 GQA (12 query heads on 3 K/V heads, (300, 700)) and batch 64 at
// (640, 640) (320 work items: the persistent kernel's CTAs take several); and SDPA's arguments
// (v21): an (L, S) float mask broadcast over the batch (a quarter of it -inf, one dead row) at
// (300, 700), with dropout 0.2 and GQA in fp16 at (700, 300), dropout 0.1 alone at (257, 513)
// (the float64 reference draws philox.h's keep mask). Random inputs (fixed
// seed), outputs filled with NaN first; O's relative Frobenius error and lse's largest absolute
// error against float64. A case fails if an output is not finite, O's error exceeds 2 x the
// mma.sync kernel's + 1e-3, or lse's exceeds 1e-3. Which kernels give the wgmma kernel's bits
// is printed, not judged (mma.sync's did in v11, and the warp-specialized one with key blocks
// of 64 in v20). Exit status 1 if a case fails.
// Timing: B x H = 64, L = S = 4096 (or --seq N), bf16, head dims 64 and 128, causal and not;
// CUDA events around each launch, 3 warm-up launches, then 20 rounds alternating the kernels;
// medians and TFLOP/s (4 B H L S D, half that when causal).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

#include "sm90_check_common.cuh"
#include "../fixed/csrc/kernels/flash_forward_sm90.cuh"
#include "../fixed/csrc/kernels/flash_forward_sm90_ws.cuh"

namespace fk = fixed_attention::kernels;
namespace sm90 = fixed_attention::kernels::flash::sm90;
namespace ws = fixed_attention::kernels::flash::sm90_ws;

// The SDPA arguments of a check case: an additive (L, S) mask broadcast over the batch (empty:
// none) and dropout (philox.h's keep mask, which the kernels draw).
struct Args {
  std::vector<float> mask;
  float dropout_p = 0.f;
  uint64_t seed = 0;
};

// The float64 forward on the rounded inputs: out (B, L, D), lse (B, L), natural log; a row
// whose every key is masked gives zeros and lse -inf.
void reference(const std::vector<double>& q, const std::vector<double>& k,
               const std::vector<double>& v, int64_t B, int64_t L, int64_t S, int64_t D,
               double scale, bool causal, int64_t group, const Args& args,
               std::vector<double>& out, std::vector<double>& lse) {
  out.assign(B * L * D, 0.0);
  lse.assign(B * L, 0.0);
  parallel_for(B * L, [&](int64_t row) {
    const int64_t b = row / L, i = row % L, kv = b / group;  // GQA: the group's K and V
    const int64_t visible = causal ? std::min<int64_t>(S, i + 1) : S;  // keys j <= i
    std::vector<double> score(visible);
    double row_max = -INFINITY;
    for (int64_t j = 0; j < visible; ++j) {
      double dot = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        dot += q[row * D + d] * k[(kv * S + j) * D + d];
      }
      score[j] = scale * dot + (args.mask.empty() ? 0.0 : args.mask[i * S + j]);
      row_max = std::max(row_max, score[j]);
    }
    if (row_max == -INFINITY) {
      lse[row] = -INFINITY;
      return;
    }
    double sum = 0.0;
    for (int64_t j = 0; j < visible; ++j) {
      sum += std::exp(score[j] - row_max);
    }
    lse[row] = row_max + std::log(sum);
    const double keep_scale = fk::dropout_scale(args.dropout_p);
    for (int64_t j = 0; j < visible; ++j) {
      double p = std::exp(score[j] - lse[row]);
      if (args.dropout_p > 0.f) {
        p *= fixed_attention::dropout::keep(args.seed, args.dropout_p, b, i, j, L, S) ? keep_scale
                                                                                      : 0.0;
      }
      for (int64_t d = 0; d < D; ++d) {
        out[row * D + d] += p * v[(kv * S + j) * D + d];
      }
    }
  });
}


// The warp-specialized kernel (flash_forward_sm90_ws.cuh) in the operator's tilings and five
// others: key blocks of 64 (meant to give wgmma's bits), ping-pong, the number of K and V
// stages and of consumer warpgroups each the other way than the operator's, and the other
// causal work order. Only the operator's tilings and n64 take a mask or dropout.
constexpr int kKernels = 8;
const char* const kKernelNames[kKernels] = {"mma.sync",         "wgmma",
                                            "ws",               "ws n64",
                                            "ws pp flipped",    "ws stages flipped",
                                            "ws order flipped", "ws consumers flipped"};

bool g_sm90a_image = true;  // false with --mma-sync-body

// Kernel `which` through its launcher; false if it declined the case.
template <typename T>
bool run_forward(int which, const T* q, const T* k, const T* v, T* out, float* lse,
                 const fk::AttentionProblem& p) {
  const bool d64 = p.head_dim == 64;
  switch (which) {
    case 0:
      return fk::launch_flash_forward(q, k, v, out, lse, p, nullptr);
    case 1:
      return d64 ? sm90::launch<T, sm90::Tile<64>>(q, k, v, out, lse, p, nullptr)
                 : sm90::launch<T, sm90::Tile<128>>(q, k, v, out, lse, p, nullptr);
    case 2:
      return d64 && ws::d64_stages_o(p.causal, p.len_kv)
                 ? ws::launch<T, ws::Tile64Staged, ws::Tile64Args>(q, k, v, out, lse, p, nullptr)
             : d64 ? ws::launch<T, ws::Tile64, ws::Tile64Args>(q, k, v, out, lse, p, nullptr)
                   : ws::launch<T, ws::Tile128, ws::Tile128Args>(q, k, v, out, lse, p, nullptr);
    case 3:  // with a mask or dropout too (the others decline those)
      return d64 ? ws::launch<T, ws::Tile<64, 64, 2, false>, ws::Tile<64, 64, 2, false, 2>>(
                       q, k, v, out, lse, p, nullptr)
                 : ws::launch<T, ws::Tile<128, 64, 3, true>, ws::Tile<128, 64, 2, true, 1>>(
                       q, k, v, out, lse, p, nullptr);
    case 4:  // ping-pong takes two consumer warpgroups
      return d64 ? ws::launch<T, ws::Tile<64, 128, 2, true>>(q, k, v, out, lse, p, nullptr)
                 : ws::launch<T, ws::Tile<128, 128, 3, false>>(q, k, v, out, lse, p, nullptr);
    case 5:
      return d64 ? ws::launch<T, ws::Tile<64, 128, 2, false, 0, 3>>(q, k, v, out, lse, p, nullptr)
                 : ws::launch<T, ws::Tile<128, 128, 2, true>>(q, k, v, out, lse, p, nullptr);
    case 7:  // 2 consumer warpgroups at D = 64, 3 at D = 128 (key blocks of 64: 160 registers)
      return d64 ? ws::launch<T, ws::Tile<64, 128, 3, false>>(q, k, v, out, lse, p, nullptr)
                 : ws::launch<T, ws::Tile<128, 64, 2, false, 0, 3>>(q, k, v, out, lse, p,
                                                                    nullptr);
    default: {
      // The other causal order than the one launch takes.
      const bool flipped = d64 ? !ws::longest_first_for<ws::Tile64>(true, p.batch)
                               : !ws::longest_first_for<ws::Tile128>(true, p.batch);
      return d64 ? ws::launch_in_order<T, ws::Tile64>(q, k, v, out, lse, p, flipped, nullptr)
                 : ws::launch_in_order<T, ws::Tile128>(q, k, v, out, lse, p, flipped, nullptr);
    }
  }
}

template <typename T>
bool check_case(int64_t D, bool causal, const Case& c, uint64_t seed, int64_t group = 1,
                int64_t batch = 3, bool masked = false, float dropout_p = 0.f) {
  const int64_t B = batch * group, L = c.len_q, S = c.len_kv;
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
  std::vector<T> hq, hk, hv;
  std::vector<double> q, k, v, ref_out, ref_lse;
  make(B * L * D, hq, q);
  make(B / group * S * D, hk, k);
  make(B / group * S * D, hv, v);
  Args args;
  if (masked) {  // normal entries, a quarter -inf, and row 3 entirely (a dead row)
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    args.mask.resize(L * S);
    for (int64_t i = 0; i < L * S; ++i) {
      const double entry = normal(rng);
      args.mask[i] = (uniform(rng) < 0.25 || i / S == 3) ? -INFINITY : static_cast<float>(entry);
    }
  }
  args.dropout_p = dropout_p;
  args.seed = seed * 7919 + 11;
  reference(q, k, v, B, L, S, D, scale, causal, group, args, ref_out, ref_lse);

  fk::AttentionProblem p{B, L, S, D, static_cast<float>(scale), causal};
  p.heads = 2 * group;  // (B / heads, heads) query heads, heads / group K/V heads
  p.kv_group = group;
  float* dmask = args.mask.empty() ? nullptr : device_copy(args.mask);
  if (dmask != nullptr) {  // (L, S), broadcast over the batch
    p.mask = dmask;
    p.mask_stride_row = S;
    p.mask_stride_col = 1;
  }
  p.dropout_p = dropout_p;
  p.dropout_seed = args.seed;
  T* const dq = device_copy(hq);
  T* const dk = device_copy(hk);
  T* const dv = device_copy(hv);
  T* dout = nullptr;
  float* dlse = nullptr;
  CHECK_CUDA(cudaMalloc(&dout, B * L * D * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&dlse, B * L * sizeof(float)));

  std::printf("%s D=%3lld causal=%d L=%4lld S=%4lld scale=%+.4f group=%lld%s%s |",
              type_name<T>(), static_cast<long long>(D), causal ? 1 : 0,
              static_cast<long long>(L), static_cast<long long>(S), scale,
              static_cast<long long>(group), masked ? " mask" : "",
              dropout_p > 0.f ? " dropout" : "");
  double out_error[kKernels], lse_error[kKernels];
  bool declined[kKernels] = {};
  std::vector<T> outs[kKernels];
  std::vector<float> lses[kKernels];
  bool ok = true;
  for (int which = 0; which < kKernels; ++which) {
    CHECK_CUDA(cudaMemset(dout, 0xFF, B * L * D * sizeof(T)));  // NaN: unwritten shows up
    CHECK_CUDA(cudaMemset(dlse, 0xFF, B * L * sizeof(float)));
    if (!run_forward(which, dq, dk, dv, dout, dlse, p)) {
      // The warp-specialized kernel is sm_90a only; of its variants only the operator's tilings
      // and n64 take a mask or dropout.
      if ((which >= 2 && !g_sm90a_image) || (which >= 4 && (masked || dropout_p > 0.f))) {
        declined[which] = true;
        std::printf(" %s declined |", kKernelNames[which]);
        continue;
      }
      std::printf(" %s declined FAIL\n", kKernelNames[which]);
      return false;
    }
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    outs[which] = download(dout, B * L * D);
    lses[which] = download(dlse, B * L);
    double num = 0.0, den = 0.0, worst_lse = 0.0;
    for (int64_t i = 0; i < B * L * D; ++i) {
      const double value = to_f(outs[which][i]);
      num += std::isfinite(value) ? (value - ref_out[i]) * (value - ref_out[i]) : INFINITY;
      den += ref_out[i] * ref_out[i];
    }
    for (int64_t i = 0; i < B * L; ++i) {
      const double value = lses[which][i];
      const bool both_dead = value == -INFINITY && ref_lse[i] == -INFINITY;
      worst_lse = std::max(worst_lse, both_dead             ? 0.0
                                      : std::isfinite(value) ? std::fabs(value - ref_lse[i])
                                                             : static_cast<double>(INFINITY));
    }
    out_error[which] = den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
    lse_error[which] = worst_lse;
    std::printf(" %s O %.2e lse %.1e |", kKernelNames[which], out_error[which], worst_lse);
  }
  for (int which = 1; which < kKernels; ++which) {
    ok = ok && (declined[which] ||
                (std::isfinite(out_error[which]) &&
                 out_error[which] <= 2.0 * out_error[0] + 1e-3 && lse_error[which] <= 1e-3));
  }
  // Which kernels give wgmma's bits (in v11 mma.sync's did; ws n64 is meant to).
  std::printf(" same bits as wgmma:");
  for (int which = 0; which < kKernels; ++which) {
    const bool identical =
        !declined[which] &&
        std::memcmp(outs[which].data(), outs[1].data(), outs[1].size() * sizeof(T)) == 0 &&
        std::memcmp(lses[which].data(), lses[1].data(), lses[1].size() * sizeof(float)) == 0;
    if (which != 1 && identical) {
      std::printf(" %s", kKernelNames[which]);
    }
  }
  std::printf(" | %s\n", ok ? "ok" : "FAIL");
  for (void* pointer : {static_cast<void*>(dq), static_cast<void*>(dk), static_cast<void*>(dv),
                        static_cast<void*>(dout), static_cast<void*>(dlse),
                        static_cast<void*>(dmask)}) {
    CHECK_CUDA(cudaFree(pointer));
  }
  return ok;
}

template <typename T>
void time_case(int64_t D, bool causal, int64_t length) {
  const int64_t B = 64, L = length, S = length;
  const fk::AttentionProblem p{B, L, S, D, static_cast<float>(1.0 / std::sqrt(double(D))),
                               causal};
  T *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr;
  float* lse = nullptr;
  uint32_t salt = 1;
  for (T** tensor : {&q, &k, &v, &out}) {
    CHECK_CUDA(cudaMalloc(tensor, B * L * D * sizeof(T)));
    fill_kernel<T><<<1024, 256>>>(*tensor, B * L * D, 0x9E3779B9u * salt++);
  }
  CHECK_CUDA(cudaMalloc(&lse, B * L * sizeof(float)));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int warm = 0; warm < 3; ++warm) {
    for (int which = 0; which < kKernels; ++which) {
      if (!run_forward(which, q, k, v, out, lse, p)) {
        std::fprintf(stderr, "%s declined the timing case\n", kKernelNames[which]);
        std::exit(2);
      }
      CHECK_CUDA(cudaGetLastError());
    }
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> ms[kKernels];
  for (int round = 0; round < 20; ++round) {
    for (int which = 0; which < kKernels; ++which) {
      CHECK_CUDA(cudaEventRecord(start));
      run_forward(which, q, k, v, out, lse, p);
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      CHECK_CUDA(cudaGetLastError());
      float elapsed = 0.f;
      CHECK_CUDA(cudaEventElapsedTime(&elapsed, start, stop));
      ms[which].push_back(elapsed);
    }
  }
  const double flops = 4.0 * static_cast<double>(B) * L * S * D * (causal ? 0.5 : 1.0);
  std::printf("%s B*H=%lld L=S=%lld D=%3lld causal=%d |", type_name<T>(),
              static_cast<long long>(B), static_cast<long long>(L), static_cast<long long>(D),
              causal ? 1 : 0);
  double median[kKernels];
  for (int which = 0; which < kKernels; ++which) {
    std::sort(ms[which].begin(), ms[which].end());
    median[which] = 0.5 * (ms[which][9] + ms[which][10]);
    std::printf(" %s %.3f ms %.0f TFLOP/s |", kKernelNames[which], median[which],
                flops / (median[which] * 1e-3) / 1e12);
  }
  std::printf(" ws / wgmma speed %.2fx\n", median[1] / median[2]);
  for (void* pointer : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v),
                        static_cast<void*>(out), static_cast<void*>(lse)}) {
    CHECK_CUDA(cudaFree(pointer));
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
}

int main(int argc, char** argv) {
  CheckOptions options;
  if (!parse_options(argc, argv, options) || !device_ready(options.mma_sync_body)) {
    return 2;
  }
  g_sm90a_image = !options.mma_sync_body;
  int failures = 0, cases = 0;
  if (options.checks) {
    uint64_t seed = 20261124;
    for (int64_t D : {64, 128}) {
      for (bool causal : {false, true}) {
        for (const Case& c : kCheckShapes) {
          failures += check_case<__nv_bfloat16>(D, causal, c, seed++) ? 0 : 1;
          failures += check_case<__half>(D, causal, c, seed++) ? 0 : 1;
          cases += 2;
        }
        failures += check_case<__nv_bfloat16>(D, causal, kCheckShapes[2], seed++, 4) ? 0 : 1;
        // 320 work items: more than one per SM, so that persistent CTAs take several each.
        failures += check_case<__nv_bfloat16>(D, causal, {640, 640, 1.0}, seed++, 1, 64) ? 0 : 1;
        // Past 8192 keys, where the operator's tilings at D = 128 change (with_ws_tiles).
        failures += check_case<__nv_bfloat16>(D, causal, {300, 8200, 1.0}, seed++, 1, 2) ? 0 : 1;
        // A mask (a dead row, tails), with dropout and GQA, dropout alone with a negative scale.
        failures += check_case<__nv_bfloat16>(D, causal, kCheckShapes[2], seed++, 1, 3, true)
                        ? 0 : 1;
        failures += check_case<__half>(D, causal, kCheckShapes[3], seed++, 2, 3, true, 0.2f)
                        ? 0 : 1;
        failures += check_case<__nv_bfloat16>(D, causal, kCheckShapes[4], seed++, 1, 3, false,
                                              0.1f)
                        ? 0 : 1;
        cases += 6;
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
