// What perf/bwd_sm90_check.cu and perf/fwd_sm90_check.cu share: the CUDA error check, the image
// probe, bf16/fp16 conversions, a host thread pool for the float64 references, device copies,
// the device-side input fill, the checks' case list and the command line (--no-timing,
// --timing-only, --seq N, --mma-sync-body), and the device test; with perf/fwd_sm90_trace.cu
// and perf/fwd_sm90_tilings.cu, the fill, the error check, an integer argument's parse and a
// median. Host code and two small kernels; included by each program, which is one translation
// unit.
#ifndef FIXED_PERF_SM90_CHECK_COMMON_CUH_
#define FIXED_PERF_SM90_CHECK_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#define CHECK_CUDA(call)                                                               \
  do {                                                                                 \
    const cudaError_t status_ = (call);                                                \
    if (status_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,               \
                   cudaGetErrorString(status_));                                       \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

// Whether the image of this program that runs here was compiled for sm_90a (the wgmma body);
// the kernels checked are compiled in the same image.
__global__ void image_probe(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

template <typename T>
float to_f(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    return __half2float(x);
  }
}
template <typename T>
T from_f(float x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return __float2half_rn(x);
  }
}
template <typename T>
const char* type_name() {
  return std::is_same_v<T, __nv_bfloat16> ? "bf16" : "fp16";
}

// Runs body(i) for i in [0, n) on all host threads.
template <class Body>
void parallel_for(int64_t n, Body body) {
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w) {
    pool.emplace_back([&, w] {
      for (int64_t i = w; i < n; i += threads) {
        body(i);
      }
    });
  }
  for (auto& thread : pool) {
    thread.join();
  }
}

// An integer argument in [low, high] into value; false if the text is not one.
inline bool parse_count(const char* text, int64_t low, int64_t high, int64_t& value) {
  char* end = nullptr;
  const long long parsed = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || parsed < low || parsed > high) {
    return false;
  }
  value = parsed;
  return true;
}

// The middle value (the upper one of an even count); 0 for none.
inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values.empty() ? 0.0 : values[values.size() / 2];
}

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* device = nullptr;
  CHECK_CUDA(cudaMalloc(&device, host.size() * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return device;
}

template <typename T>
std::vector<T> download(const T* device, size_t n) {
  std::vector<T> host(n);
  CHECK_CUDA(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

struct Case {
  int64_t len_q, len_kv;
  double scale_factor;  // the scale is scale_factor / sqrt(D)
};

// Pseudo-random values in [-1, 1) from the element index (not zeros, no host round trip).
template <typename T>
__global__ void fill_kernel(T* x, int64_t n, uint32_t salt) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ salt;
    h ^= h >> 16;
    h *= 2246822519u;
    h ^= h >> 13;
    const float value = static_cast<float>(h & 0xFFFFFF) / 8388608.f - 1.f;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      x[i] = __float2bfloat16_rn(value);
    } else {
      x[i] = __float2half_rn(value);
    }
  }
}

// The six shapes every check program runs, at both dtypes, head dims and causal settings.
constexpr Case kCheckShapes[] = {{128, 128, 1.0}, {1000, 1000, 1.0}, {300, 700, 1.0},
                                 {700, 300, 1.0}, {257, 513, -0.7},  {200, 200, 0.0}};

struct CheckOptions {
  bool checks = true, timing = true, mma_sync_body = false;
  int64_t length = 4096;  // L = S of the timings
};

// The command line; false (after the usage line) if it is not understood.
inline bool parse_options(int argc, char** argv, CheckOptions& options) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-timing") == 0) {
      options.timing = false;
    } else if (std::strcmp(argv[i], "--timing-only") == 0) {
      options.checks = false;
    } else if (std::strcmp(argv[i], "--mma-sync-body") == 0) {
      options.mma_sync_body = true;
    } else if (std::strcmp(argv[i], "--seq") == 0 && i + 1 < argc &&
               (options.length = std::atoll(argv[i + 1])) >= 128 && options.length <= 32768) {
      ++i;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--no-timing | --timing-only] [--seq N (128-32768)] "
                   "[--mma-sync-body]\n",
                   argv[0]);
      return false;
    }
  }
  return true;
}

// Prints the device and image; true on compute capability 9.0 with the sm_90a image, or with
// mma_sync_body an image without it (then the Hopper kernels run their mma.sync bodies).
inline bool device_ready(bool mma_sync_body) {
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  int* probe = nullptr;
  int sm90a = 0;
  CHECK_CUDA(cudaMalloc(&probe, sizeof(int)));
  image_probe<<<1, 1>>>(probe);
  CHECK_CUDA(cudaMemcpy(&sm90a, probe, sizeof(int), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaFree(probe));
  std::printf("device: %s (compute capability %d.%d); image: %s\n", prop.name, prop.major,
              prop.minor, sm90a ? "sm_90a (wgmma body)" : "not sm_90a (mma.sync body)");
  if (prop.major != 9 || prop.minor != 0 || (sm90a != 0) == mma_sync_body) {
    std::printf("needs compute capability 9.0 and the sm_90a image (see the build command), or "
                "with --mma-sync-body an image without it\n");
    return false;
  }
  return true;
}

#endif  // FIXED_PERF_SM90_CHECK_COMMON_CUH_
