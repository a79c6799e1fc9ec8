// When each CTA of the warp-specialized Hopper forward (flash_forward_sm90_ws.cuh, the operator's
// tiling for head dim 64 or 128, no mask or dropout) takes each round's work item, the phases of
// each item (its Q's arrival, its first S, its last P V), and when the CTA runs out: the anatomy
// of the kernel's tail and of its item boundary (perf/NOTES.md, v42 to v44). No torch. Needs
// compute capability 9.0.
// The hooks can perturb what they time: a change to the epilogue's stores halved the traced
// epilogue (2.4 -> 1.25 us at D = 128, S = 2048) and moved the operator's time by under 2% (v44).
// Use the phases to form a hypothesis, and perf/ab.py on the operator to test it.
// The kernel records nothing unless perf/fwd_sm90_trace.patch is applied (hooks in consume()
// behind FWD_TRACE, which this file defines); from the repository root:
//
//   git apply perf/fwd_sm90_trace.patch && nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -o /tmp/fwd_sm90_trace perf/fwd_sm90_trace.cu; git apply -R perf/fwd_sm90_trace.patch
//   /tmp/fwd_sm90_trace [B x H] [S] [split: 1 or 0] [D: 64 or 128] [causal: 0 or 1]
//                                                          (default 64 2048 1 64 0)
//
// Q, K, V of (B x H, S, D) from sm90_check_common.cuh's fill_kernel, L = S. The tiling is the
// operator's: D = 64 the 192-row one (Tile64, or Tile64Staged where d64_stages_o), D = 128 the
// 176-key one (Tile128Wide), or where causal the 128-key one (Tile128). `split` 1 hands the
// launcher the workspace of the last round's split (flash_forward_sm90_ws_schedule.cuh; only the
// 192-row tilings split), as the operator does; 0 withholds it. Eight launches; per launch: its
// time (CUDA events), the CTAs' end times after the first CTA's start (globaltimer, read by
// consumer 0 of each CTA), the durations of whole items and of split parts (a round's duration:
// from taking its work to taking the next), and the medians of a whole item's phases: its wait for
// Q (from taking the work to the Q's full barrier), its first S (to that product's wait), the
// blocks after it (to the wait for its last P V) and the tail (the epilogue and taking the next
// round's work). Then each consumer warpgroup's own phases of a whole item, in SM cycles (clock64,
// read by warp 0 of the warpgroup): the wait for Q, the first S's turn and product, the first
// block's softmax, the block loop and what it waited for (K and V, the turn, S, P V: summed over
// the item's blocks), the last P V's turn and product, the rows' sums finished (staged tilings),
// O staged or stored, and taking the next round's work. Then, for the last launch, each CTA's
// rounds: start time (us) and f(ull item) or p(art), with its key blocks.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

constexpr int kCycleMarks = 10;  // per consumer warpgroup: fwd_trace_cycle's marks 0-9
struct FwdTraceEntry {
  unsigned long long time;     // globaltimer, ns, when the round's work is taken; 0: not reached
  unsigned long long q_ready;  // when its Q has arrived
  unsigned long long first_s;  // when its first block's S is done (the wait on the product)
  unsigned long long last_pv;  // when its last block's P V is done (before the epilogue)
  int part;                    // -1: a whole item, >= 0: a split part's unit, -2: no work left
  int blocks;                  // key blocks of the round's work
  // Consumers 0 and 1 (warp 0 of each), SM cycles: taken (after O's zeros), Q arrived, first
  // S's turn taken (after its K and the previous item's O buffer), first S done, first P packed,
  // loop done, last P V's turn taken, last P V done, rows' sums finished (staged tilings only), O
  // staged or stored. 0: not reached.
  long long cycles[2][kCycleMarks];
  long long waits[2][4];  // the loop's waits, summed: K and V, the turn, S, P V
};
#define FWD_TRACE 1
#define FWD_TRACE_CTAS 1024
#define FWD_TRACE_ROUNDS 64
__device__ FwdTraceEntry fwd_trace[FWD_TRACE_CTAS * FWD_TRACE_ROUNDS];

// The hooks the patch puts in consume(). Every consumer thread calls them; only the thread with
// `record` stores, by predicated stores and no branch: a hook under an `if` that splits a
// warpgroup made ptxas serialize every wgmma of the ping-pong tilings (its advisory C7520).
__device__ __forceinline__ unsigned long long fwd_trace_now() {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}
__device__ __forceinline__ FwdTraceEntry* fwd_trace_entry(bool& record, uint32_t round) {
  record = record && blockIdx.x < FWD_TRACE_CTAS && round < FWD_TRACE_ROUNDS;
  return &fwd_trace[record ? blockIdx.x * FWD_TRACE_ROUNDS + round : 0];
}
__device__ __forceinline__ void fwd_trace_take(bool record, uint32_t round, int part, int blocks) {
  FwdTraceEntry* entry = fwd_trace_entry(record, round);
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.u32 p, %0, 0;\n @p st.global.u64 [%1], %2;\n"
      " @p st.global.u64 [%1+8], 0;\n @p st.global.u64 [%1+16], 0;\n @p st.global.u64 [%1+24], 0;\n"
      " @p st.global.v2.s32 [%1+32], {%3, %4};\n}\n" ::"r"(
          static_cast<unsigned>(record)),
      "l"(entry), "l"(fwd_trace_now()), "r"(part), "r"(blocks)
      : "memory");
}
// One 8-byte word at `at` where `record` holds, by a predicated store.
__device__ __forceinline__ void fwd_trace_store(bool record, void* at, unsigned long long value) {
  asm volatile("{\n .reg .pred p;\n setp.ne.u32 p, %0, 0;\n @p st.global.u64 [%1], %2;\n}\n" ::"r"(
                   static_cast<unsigned>(record)),
               "l"(at), "l"(value)
               : "memory");
}
// Marks 1, 2, 3: the entry's q_ready, first_s and last_pv.
__device__ __forceinline__ void fwd_trace_mark(bool record, uint32_t round, int mark) {
  FwdTraceEntry* entry = fwd_trace_entry(record, round);
  fwd_trace_store(record, &entry->time + mark, fwd_trace_now());
}

__device__ __forceinline__ long long fwd_trace_clock() {
  long long now;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(now));
  return now;
}
// Each consumer warpgroup's own marks and the loop's waits (consumers 0 and 1; a third's are not
// kept).
__device__ __forceinline__ void fwd_trace_cycle(bool record, uint32_t round, int consumer,
                                                int mark) {
  record = record && consumer < 2;
  FwdTraceEntry* entry = fwd_trace_entry(record, round);
  fwd_trace_store(record, &entry->cycles[record ? consumer : 0][mark], fwd_trace_clock());
}
__device__ __forceinline__ void fwd_trace_store_waits(bool record, uint32_t round, int consumer,
                                                      const long long (&waits)[4]) {
  record = record && consumer < 2;
  FwdTraceEntry* entry = fwd_trace_entry(record, round);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    fwd_trace_store(record, &entry->waits[record ? consumer : 0][i], waits[i]);
  }
}

#include "sm90_check_common.cuh"  // CHECK_CUDA, fill_kernel, device_ready, parse_count, median
#include "../fixed/csrc/kernels/flash_forward_sm90_ws.cuh"

namespace fk = fixed_attention::kernels;
namespace ws = fixed_attention::kernels::flash::sm90_ws;

namespace {

// Each consumer warpgroup's phases of a whole item (medians over every CTA's whole items, in SM
// cycles), from its marks in order; "next work" ends at the next round's take.
void report_cycles(const std::vector<FwdTraceEntry>& trace, int ctas) {
  static const char* const kPhases[] = {"Q",        "first K and turn", "first S",
                                        "first softmax", "block loop", "last P V's turn",
                                        "last P V", "rows' sums",  "O out"};
  static const char* const kWaits[] = {"K and V", "turn", "S", "P V"};
  for (int c = 0; c < 2; ++c) {
    std::vector<double> phases[kCycleMarks], waits[4], lag;
    for (int cta = 0; cta < ctas; ++cta) {
      const FwdTraceEntry* entry = &trace[cta * FWD_TRACE_ROUNDS];
      for (int r = 0; r + 1 < FWD_TRACE_ROUNDS && entry[r].time != 0; ++r) {
        const FwdTraceEntry& e = entry[r];
        const long long* at = e.cycles[c];
        if (e.part != -1 || at[0] == 0 || at[9] == 0) {
          continue;
        }
        int previous = 0;  // the last mark reached (mark 8 only where O is staged)
        for (int m = 1; m < kCycleMarks; ++m) {
          if (at[m] != 0) {
            phases[m - 1].push_back(static_cast<double>(at[m] - at[previous]));
            previous = m;
          }
        }
        if (entry[r + 1].part != -2 && entry[r + 1].cycles[c][0] != 0) {
          phases[kCycleMarks - 1].push_back(static_cast<double>(entry[r + 1].cycles[c][0] - at[9]));
        }
        for (int i = 0; i < 4; ++i) {
          waits[i].push_back(static_cast<double>(e.waits[c][i]));
        }
        if (c == 1 && e.cycles[0][0] != 0) {
          lag.push_back(static_cast<double>(at[0] - e.cycles[0][0]));
        }
      }
    }
    if (phases[0].empty()) {
      continue;
    }
    std::printf("  consumer %d, whole items' medians (cycles):", c);
    for (int m = 0; m < kCycleMarks; ++m) {
      if (!phases[m].empty()) {
        std::printf(" %s %.0f,", m + 1 < kCycleMarks ? kPhases[m] : "next work", median(phases[m]));
      }
    }
    std::printf(" the loop's waits:");
    for (int i = 0; i < 4; ++i) {
      std::printf(" %s %.0f", kWaits[i], median(waits[i]));
    }
    if (!lag.empty()) {
      std::printf("; taken %.0f after consumer 0", median(lag));
    }
    std::printf("\n");
  }
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
  // A whole item's phases: Q's wait, the first S, the blocks after it, and the tail (epilogue
  // and taking the next round's work), from its marks in order.
  std::vector<double> ends, items, parts, q_waits, first_s, blocks, tails;
  for (int c = 0; c < ctas; ++c) {
    const FwdTraceEntry* entry = &trace[c * FWD_TRACE_ROUNDS];
    for (int r = 0; r + 1 < FWD_TRACE_ROUNDS && entry[r].time != 0; ++r) {
      if (entry[r].part == -2) {
        ends.push_back((entry[r].time - first) / 1e3);
        break;
      }
      const double us = (entry[r + 1].time - entry[r].time) / 1e3;
      (entry[r].part == -1 ? items : parts).push_back(us);
      const FwdTraceEntry& e = entry[r];
      if (e.part == -1 && e.q_ready >= e.time && e.first_s >= e.q_ready &&
          e.last_pv >= e.first_s && entry[r + 1].time >= e.last_pv) {
        q_waits.push_back((e.q_ready - e.time) / 1e3);
        first_s.push_back((e.first_s - e.q_ready) / 1e3);
        blocks.push_back((e.last_pv - e.first_s) / 1e3);
        tails.push_back((entry[r + 1].time - e.last_pv) / 1e3);
      }
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
  std::printf("  whole items' medians (us): wait for Q %.2f (max %.2f), first S %.2f, the blocks "
              "after it %.2f, epilogue and next work %.2f\n",
              median(q_waits),
              q_waits.empty() ? 0.0 : *std::max_element(q_waits.begin(), q_waits.end()),
              median(first_s), median(blocks), median(tails));
  report_cycles(trace, ctas);
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

// Eight launches of tiling F (FArgs: its masked twin, which launch() names but these problems
// never take) on (batch, seq, D) problems; 0, or 1 or 2 after one line on stderr.
template <class F, class FArgs>
int trace_launches(int64_t batch, int64_t seq, int64_t D, bool causal, bool split, int sms) {
  const int64_t elements = batch * seq * D;
  fk::AttentionProblem p{batch, seq, seq, D, 1.f / std::sqrt(static_cast<float>(D)), causal};
  __nv_bfloat16* qkvo[4];
  for (int i = 0; i < 4; ++i) {
    CHECK_CUDA(cudaMalloc(&qkvo[i], elements * sizeof(__nv_bfloat16)));
    fill_kernel<<<264, 256>>>(qkvo[i], elements, 0x9e3779b9u * (i + 1));
  }
  CHECK_CUDA(cudaGetLastError());
  float* lse = nullptr;
  CHECK_CUDA(cudaMalloc(&lse, batch * seq * sizeof(float)));
  fk::SplitWorkspace workspace = ws::split_workspace<F>(p);
  if (split && workspace.counts > 0) {
    CHECK_CUDA(cudaMalloc(&workspace.partial, workspace.floats * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&workspace.arrivals, workspace.counts * sizeof(unsigned)));
  } else {
    workspace = fk::SplitWorkspace{};
  }
  const int64_t items = batch * ((seq + F::kBlockM - 1) / F::kBlockM);
  const int ctas = static_cast<int>(std::min<int64_t>(sms, items));
  // Rounds per CTA: whole items, one split round and the one that finds no work left.
  const int64_t rounds = (items + ctas - 1) / ctas + 2;
  if (ctas > FWD_TRACE_CTAS || rounds > FWD_TRACE_ROUNDS) {
    std::fprintf(stderr, "fwd_sm90_trace: %d CTAs of %lld rounds, the trace holds %d of %d\n",
                 ctas, static_cast<long long>(rounds), FWD_TRACE_CTAS, FWD_TRACE_ROUNDS);
    return 2;
  }
  std::printf("B x H %lld, S %lld, D %lld%s, %d-row items of %d-key blocks, %d SMs; split "
              "workspace: %s\n",
              static_cast<long long>(batch), static_cast<long long>(seq),
              static_cast<long long>(D), causal ? " causal" : "", F::kBlockM, F::kBlockN, sms,
              workspace.counts > 0 ? "given" : split ? "none needed" : "withheld");
  std::vector<FwdTraceEntry> trace(FWD_TRACE_CTAS * FWD_TRACE_ROUNDS);
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  constexpr int kLaunches = 8;
  for (int launch = 0; launch < kLaunches; ++launch) {
    if (workspace.arrivals != nullptr) {
      CHECK_CUDA(cudaMemset(workspace.arrivals, 0, workspace.counts * sizeof(unsigned)));
    }
    std::fill(trace.begin(), trace.end(), FwdTraceEntry{});
    CHECK_CUDA(cudaMemcpyToSymbol(fwd_trace, trace.data(), trace.size() * sizeof(FwdTraceEntry)));
    CHECK_CUDA(cudaEventRecord(start));
    if (!ws::launch<__nv_bfloat16, F, FArgs>(qkvo[0], qkvo[1], qkvo[2], qkvo[3], lse, p, nullptr,
                                              workspace)) {
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

}  // namespace

int main(int argc, char** argv) {
  int64_t batch = 64, seq = 2048, split = 1, D = 64, causal = 0;
  if (argc > 6 || (argc > 1 && !parse_count(argv[1], 1, 4096, batch)) ||
      (argc > 2 && !parse_count(argv[2], 1, 1 << 17, seq)) ||
      (argc > 3 && !parse_count(argv[3], 0, 1, split)) ||
      (argc > 4 && !parse_count(argv[4], 64, 128, D)) || (D != 64 && D != 128) ||
      (argc > 5 && !parse_count(argv[5], 0, 1, causal))) {
    std::fprintf(stderr, "usage: fwd_sm90_trace [B x H, 1-4096] [S, 1-131072] [split, 0 or 1] "
                         "[D, 64 or 128] [causal, 0 or 1]\n");
    return 2;
  }
  if (!device_ready(false)) {
    return 2;
  }
  int device = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (D == 64 && ws::d64_stages_o(causal != 0, seq)) {
    return trace_launches<ws::Tile64Staged, ws::Tile64Args>(batch, seq, D, false, split, sms);
  }
  if (D == 64) {
    return trace_launches<ws::Tile64, ws::Tile64Args>(batch, seq, D, causal, split, sms);
  }
  return causal ? trace_launches<ws::Tile128, ws::Tile128Args>(batch, seq, D, true, split, sms)
                : trace_launches<ws::Tile128Wide, ws::Tile128Args>(batch, seq, D, false, split,
                                                                   sms);
}
