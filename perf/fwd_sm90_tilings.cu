// Kernel times of the warp-specialized Hopper forward's tilings side by side
// (flash_forward_sm90_ws.cuh's `Tile`): one binary, the same inputs, launches alternating between
// the tilings, CUDA events around each, medians. A tiling is a template argument, so a candidate
// (more consumers, another key block, turns or none) is one line here, with no library build;
// perf/NOTES.md v55 found the D = 64 rotation this way. No torch. Needs compute capability 9.0.
// From the repository root:
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/fwd_sm90_tilings perf/fwd_sm90_tilings.cu
//   /tmp/fwd_sm90_tilings [D: 64 or 128] [causal: 0 or 1] [B x H] [S ...]
//                                               (default 64 0 64 2048 4096 8192)
//
// Per shape (L = S, bf16, Q K V from sm90_check_common.cuh's fill_kernel): each tiling's median
// over 30 launches after 3 of warm-up, its TFLOP/s (4 B H L S D, half where causal), and the
// largest difference of its output from the first tiling's (0: the same bits). The first is the
// operator's tiling, but at D = 128 from S = 8192 on, where the operator takes Tile128Wide under
// causality and Tile128Three without (flash_forward_sm90.cuh's with_ws_tiles). Kernel time
// alone: the operator's own A/B, with its allocations and launch path, is perf/ab.py. Exit
// status 1 if a launcher declines or an output is not finite, 2 after a usage or CUDA error (one
// line each).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "sm90_check_common.cuh"  // CHECK_CUDA, fill_kernel, device_ready, parse_count, median
#include "../fixed/csrc/kernels/flash_forward_sm90_ws.cuh"

namespace fk = fixed_attention::kernels;
namespace ws = fixed_attention::kernels::flash::sm90_ws;
using bf16 = __nv_bfloat16;

namespace {

// The candidates beside the operator's tilings (flash_forward_sm90_ws.cuh names those).
using Tile64FreeRunning = ws::Tile<64, 128, 3, false, 0, 3>;  // v54's: three without turns

constexpr int kWarmup = 3, kTimed = 30;

// One tiling's launches: its split workspace (the 192-row tilings split the last round) and
// its output buffer.
template <class F>
struct Candidate {
  const char* name;
  fk::SplitWorkspace workspace{};
  bf16* out = nullptr;
  std::vector<double> us;

  void setup(const fk::AttentionProblem& p, int64_t elements) {
    workspace = ws::split_workspace<F>(p);
    if (workspace.counts > 0) {
      CHECK_CUDA(cudaMalloc(&workspace.partial, workspace.floats * sizeof(float)));
      CHECK_CUDA(cudaMalloc(&workspace.arrivals, workspace.counts * sizeof(unsigned)));
    }
    CHECK_CUDA(cudaMalloc(&out, elements * sizeof(bf16)));
  }
  // Launches once between two events; false if the launcher declined.
  bool time(const bf16* q, const bf16* k, const bf16* v, float* lse,
            const fk::AttentionProblem& p, cudaEvent_t start, cudaEvent_t stop, bool record) {
    if (workspace.arrivals != nullptr) {
      CHECK_CUDA(cudaMemset(workspace.arrivals, 0, workspace.counts * sizeof(unsigned)));
    }
    CHECK_CUDA(cudaEventRecord(start));
    if (!ws::launch<bf16, F, F>(q, k, v, out, lse, p, nullptr, workspace)) {
      return false;
    }
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (record) {
      us.push_back(ms * 1e3);
    }
    return true;
  }
  void release() {
    cudaFree(out);
    cudaFree(workspace.partial);
    cudaFree(workspace.arrivals);
  }
};

// The tilings Fs on one (batch, seq, D) problem; 0, or 1 after a line on stderr.
template <class... Fs>
int compare(int64_t batch, int64_t seq, bool causal, Candidate<Fs>... candidates) {
  constexpr int64_t D = std::max({Fs::kHeadDim...});
  static_assert(((Fs::kHeadDim == D) && ...), "one head dim per comparison");
  const int64_t elements = batch * seq * D;
  const fk::AttentionProblem p{batch, seq, seq, D, 1.f / std::sqrt(static_cast<float>(D)), causal};
  bf16* qkv[3];
  for (int i = 0; i < 3; ++i) {
    CHECK_CUDA(cudaMalloc(&qkv[i], elements * sizeof(bf16)));
    fill_kernel<<<264, 256>>>(qkv[i], elements, 0x9e3779b9u * (i + 1));
  }
  CHECK_CUDA(cudaGetLastError());
  float* lse = nullptr;
  CHECK_CUDA(cudaMalloc(&lse, batch * seq * sizeof(float)));
  (candidates.setup(p, elements), ...);
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int round = 0; round < kWarmup + kTimed; ++round) {
    if (!(candidates.time(qkv[0], qkv[1], qkv[2], lse, p, start, stop, round >= kWarmup) && ...)) {
      std::fprintf(stderr, "fwd_sm90_tilings: a launcher declined (no sm_90a image?)\n");
      return 1;
    }
  }
  const double flop = 4.0 * batch * seq * seq * D * (causal ? 0.5 : 1.0);
  std::printf("(B x H %lld, S %lld, D %lld)%s:", static_cast<long long>(batch),
              static_cast<long long>(seq), static_cast<long long>(D), causal ? " causal" : "");
  std::vector<bf16> first(elements), other(elements);
  bool finite = true;
  const auto report = [&](auto& c, bool is_first) {
    CHECK_CUDA(cudaMemcpy(is_first ? first.data() : other.data(), c.out, elements * sizeof(bf16),
                          cudaMemcpyDeviceToHost));
    double diff = 0.0;
    for (int64_t i = 0; i < elements; ++i) {
      const float x = __bfloat162float(is_first ? first[i] : other[i]);
      finite = finite && std::isfinite(x);
      diff = std::max(diff, static_cast<double>(std::fabs(x - __bfloat162float(first[i]))));
    }
    const double us = median(c.us);
    std::printf("  %s %.1f us %.0f TFLOP/s (diff %.3g)", c.name, us, flop / us * 1e-6, diff);
  };
  bool is_first = true;
  ((report(candidates, is_first), is_first = false), ...);
  std::printf("\n");
  (candidates.release(), ...);
  for (bf16* x : qkv) {
    cudaFree(x);
  }
  cudaFree(lse);
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  if (!finite) {
    std::fprintf(stderr, "fwd_sm90_tilings: an output is not finite\n");
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t D = 64, causal = 0, batch = 64;
  std::vector<int64_t> seqs;
  bool ok = (argc < 2 || (parse_count(argv[1], 64, 128, D) && (D == 64 || D == 128))) &&
            (argc < 3 || parse_count(argv[2], 0, 1, causal)) &&
            (argc < 4 || parse_count(argv[3], 1, 4096, batch));
  for (int i = 4; ok && i < argc; ++i) {
    int64_t seq = 0;
    ok = parse_count(argv[i], 1, 1 << 17, seq);
    seqs.push_back(seq);
  }
  if (!ok) {
    std::fprintf(stderr, "usage: fwd_sm90_tilings [D: 64 or 128] [causal: 0 or 1] "
                         "[B x H: 1-4096] [S: 1-131072 ...]\n");
    return 2;
  }
  if (seqs.empty()) {
    seqs = {2048, 4096, 8192};
  }
  if (!device_ready(false)) {
    return 2;
  }
  for (const int64_t seq : seqs) {
    int status = 0;
    if (D == 64 && ws::d64_stages_o(causal != 0, seq)) {
      status = compare(batch, seq, false, Candidate<ws::Tile64Staged>{"Tile64Staged"},
                       Candidate<ws::Tile64>{"Tile64"},
                       Candidate<Tile64FreeRunning>{"three free-running"});
    } else if (D == 64) {
      status = compare(batch, seq, causal != 0, Candidate<ws::Tile64>{"Tile64"},
                       Candidate<ws::Tile64Staged>{"Tile64Staged"},
                       Candidate<Tile64FreeRunning>{"three free-running"});
    } else if (causal != 0) {
      status = compare(batch, seq, true, Candidate<ws::Tile128>{"Tile128"},
                       Candidate<ws::Tile128Wide>{"Tile128Wide"},
                       Candidate<ws::Tile128Three>{"Tile128Three"});
    } else {
      status = compare(batch, seq, false, Candidate<ws::Tile128Wide>{"Tile128Wide"},
                       Candidate<ws::Tile128>{"Tile128"},
                       Candidate<ws::Tile128Three>{"Tile128Three"});
    }
    if (status != 0) {
      return status;
    }
  }
  return 0;
}
