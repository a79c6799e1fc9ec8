// When each CTA of the warp-specialized Hopper forward (flash_forward_sm90_ws.cuh, the operator's
// D = 64 tiling, no mask or dropout) takes each round's work item, and when it runs out: the
// anatomy of the kernel's tail (perf/NOTES.md, v42). No torch. Needs compute capability 9.0.
// The kernel records nothing unless perf/fwd_sm90_trace.patch is applied (a hook in consume()
// behind FWD_TRACE, which this file defines); from the repository root:
//
//   git apply perf/fwd_sm90_trace.patch && nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/fwd_sm90_trace perf/fwd_sm90_trace.cu; git apply -R perf/fwd_sm90_trace.patch
//   /tmp/fwd_sm90_trace [B x H] [S] [split: 1 or 0]     (default 64 2048 1)
//
// Q, K, V of (B x H, S, 64) from sm90_check_common.cuh's fill_kernel, L = S, not causal.
// `split` 1 hands the launcher the workspace of the last round's split
// (flash_forward_sm90_ws_schedule.cuh), as the operator does; 0 withholds it. Eight launches;
// per launch: its time (CUDA events), the CTAs' end times after the first CTA's start
// (globaltimer, read by consumer 0 of each CTA), and the durations of whole items and of
// split parts (a round's duration: from taking its work to taking the next). Then, for the last
// launch, each CTA's rounds: start time (us) and f(ull item) or p(art), with its key blocks.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

struct FwdTraceEntry {
  unsigned long long time;  // globaltimer, ns; 0: not reached
  int part;                 // -1: a whole item, >= 0: a split part's unit, -2: no work left
  int blocks;               // key blocks of the round's work
};
#define FWD_TRACE 1
#define FWD_TRACE_CTAS 1024
#define FWD_TRACE_ROUNDS 64
__device__ FwdTraceEntry fwd_trace[FWD_TRACE_CTAS * FWD_TRACE_ROUNDS];

#include "sm90_check_common.cuh"  // CHECK_CUDA, fill_kernel, device_ready
#include "../fixed/csrc/kernels/flash_forward_sm90_ws.cuh"

namespace fk = fixed_attention::kernels;
namespace ws = fixed_attention::kernels::flash::sm90_ws;

namespace {

bool parse_count(const char* text, int64_t low, int64_t high, int64_t& value) {
  char* end = nullptr;
  const long long parsed = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || parsed < low || parsed > high) {
    return false;
  }
  value = parsed;
  return true;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0.0 : values[values.size() / 2];
}

// One launch's summary; the per-CTA rounds too when `rounds` is set.
void report(const std::vector<FwdTraceEntry>& trace, int ctas, int launch, float ms,
            bool rounds) {
  unsigned long long first = ~0ull;
  for (int c = 0; c < ctas; ++c) {
    if (trace[c * FWD_TRACE_ROUNDS].time != 0) {
      first = std::min(first, trace[c * FWD_TRACE_ROUNDS].time);
    }
  }
  std::vector<double> ends, items, parts;
  for (int c = 0; c < ctas; ++c) {
    const FwdTraceEntry* entry = &trace[c * FWD_TRACE_ROUNDS];
    for (int r = 0; r + 1 < FWD_TRACE_ROUNDS && entry[r].time != 0; ++r) {
      if (entry[r].part == -2) {
        ends.push_back((entry[r].time - first) / 1e3);
        break;
      }
      const double us = (entry[r + 1].time - entry[r].time) / 1e3;
      (entry[r].part == -1 ? items : parts).push_back(us);
    }
  }
  if (ends.empty()) {
    std::printf("launch %d: %.1f us; no CTA's end recorded\n", launch, ms * 1e3);
    return;
  }
  double mean_end = 0.0;
  for (double end : ends) {
    mean_end += end / ends.size();
  }
  std::sort(ends.begin(), ends.end());
  std::printf("launch %d: %.1f us; CTA ends (us) min %.1f median %.1f mean %.1f max %.1f; "
              "%zu items, median %.2f us [%.2f, %.2f]; %zu parts, median %.2f us [%.2f, %.2f]\n",
              launch, ms * 1e3, ends.front(), median(ends), mean_end, ends.back(), items.size(),
              median(items), items.empty() ? 0.0 : *std::min_element(items.begin(), items.end()),
              items.empty() ? 0.0 : *std::max_element(items.begin(), items.end()), parts.size(),
              median(parts), parts.empty() ? 0.0 : *std::min_element(parts.begin(), parts.end()),
              parts.empty() ? 0.0 : *std::max_element(parts.begin(), parts.end()));
  if (!rounds) {
    return;
  }
  for (int c = 0; c < ctas; ++c) {
    std::printf("cta %3d:", c);
    const FwdTraceEntry* entry = &trace[c * FWD_TRACE_ROUNDS];
    for (int r = 0; r < FWD_TRACE_ROUNDS && entry[r].time != 0; ++r) {
      const double at = (entry[r].time - first) / 1e3;
      if (entry[r].part == -2) {
        std::printf(" %.1f end", at);
        break;
      }
      std::printf(" %.1f %c%d", at, entry[r].part == -1 ? 'f' : 'p', entry[r].blocks);
    }
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  int64_t batch = 64, seq = 2048, split = 1;
  if (argc > 4 || (argc > 1 && !parse_count(argv[1], 1, 4096, batch)) ||
      (argc > 2 && !parse_count(argv[2], 1, 1 << 17, seq)) ||
      (argc > 3 && !parse_count(argv[3], 0, 1, split))) {
    std::fprintf(stderr, "usage: fwd_sm90_trace [B x H, 1-4096] [S, 1-131072] [split, 0 or 1]\n");
    return 2;
  }
  if (!device_ready(false)) {
    return 2;
  }
  int device = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t D = 64, elements = batch * seq * D;
  fk::AttentionProblem p{batch, seq, seq, D, 0.125f, false};
  __nv_bfloat16* qkvo[4];
  for (int i = 0; i < 4; ++i) {
    CHECK_CUDA(cudaMalloc(&qkvo[i], elements * sizeof(__nv_bfloat16)));
    fill_kernel<<<264, 256>>>(qkvo[i], elements, 0x9e3779b9u * (i + 1));
  }
  CHECK_CUDA(cudaGetLastError());
  float* lse = nullptr;
  CHECK_CUDA(cudaMalloc(&lse, batch * seq * sizeof(float)));
  fk::SplitWorkspace workspace = ws::split_workspace<ws::Tile64>(p);
  if (split != 0 && workspace.counts > 0) {
    CHECK_CUDA(cudaMalloc(&workspace.partial, workspace.floats * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&workspace.arrivals, workspace.counts * sizeof(unsigned)));
  } else {
    workspace = fk::SplitWorkspace{};
  }
  const int64_t items = batch * ((seq + ws::Tile64::kBlockM - 1) / ws::Tile64::kBlockM);
  const int ctas = static_cast<int>(std::min<int64_t>(sms, items));
  // Rounds per CTA: whole items, one split round and the one that finds no work left.
  const int64_t rounds = (items + ctas - 1) / ctas + 2;
  if (ctas > FWD_TRACE_CTAS || rounds > FWD_TRACE_ROUNDS) {
    std::fprintf(stderr, "fwd_sm90_trace: %d CTAs of %lld rounds, the trace holds %d of %d\n",
                 ctas, static_cast<long long>(rounds), FWD_TRACE_CTAS, FWD_TRACE_ROUNDS);
    return 2;
  }
  std::printf("B x H %lld, S %lld, D 64, %d SMs; split workspace: %s\n",
              static_cast<long long>(batch), static_cast<long long>(seq), sms,
              workspace.counts > 0 ? "given" : split != 0 ? "none needed" : "withheld");
  std::vector<FwdTraceEntry> trace(FWD_TRACE_CTAS * FWD_TRACE_ROUNDS);
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  constexpr int kLaunches = 8;
  for (int launch = 0; launch < kLaunches; ++launch) {
    if (workspace.arrivals != nullptr) {
      CHECK_CUDA(cudaMemset(workspace.arrivals, 0, workspace.counts * sizeof(unsigned)));
    }
    std::fill(trace.begin(), trace.end(), FwdTraceEntry{0, 0, 0});
    CHECK_CUDA(cudaMemcpyToSymbol(fwd_trace, trace.data(), trace.size() * sizeof(FwdTraceEntry)));
    CHECK_CUDA(cudaEventRecord(start));
    if (!ws::launch<__nv_bfloat16, ws::Tile64, ws::Tile64Args>(qkvo[0], qkvo[1], qkvo[2], qkvo[3],
                                                               lse, p, nullptr, workspace)) {
      std::fprintf(stderr, "fwd_sm90_trace: the launcher declined (no sm_90a image?)\n");
      return 1;
    }
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaDeviceSynchronize());
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    CHECK_CUDA(cudaMemcpyFromSymbol(trace.data(), fwd_trace, trace.size() * sizeof(FwdTraceEntry)));
    if (trace[0].time == 0) {
      std::fprintf(stderr, "fwd_sm90_trace: the kernel recorded nothing: build with "
                           "perf/fwd_sm90_trace.patch applied (see the header)\n");
      return 1;
    }
    report(trace, ctas, launch, ms, launch == kLaunches - 1);
  }
  return 0;
}
