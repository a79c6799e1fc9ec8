// Dropout's keep mask, the same bits on the CPU and on CUDA: a counter-based generator
// (Philox4x32-10, Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) keyed by
// a seed torch's default generator draws, counted by the element's position. The forward and the
// backward regenerate the same mask from (seed, position): nothing is stored.
//
// Plain C++ (host) and CUDA (device): no torch includes, so the CPU kernels and the CUDA kernels
// include the same file.
#ifndef FIXED_ATTENTION_PHILOX_H_
#define FIXED_ATTENTION_PHILOX_H_

#include <cstdint>

#if defined(__CUDACC__)
#define FIXED_ATTENTION_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FIXED_ATTENTION_HOST_DEVICE inline
#endif

namespace fixed_attention {
namespace dropout {

FIXED_ATTENTION_HOST_DEVICE uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* high) {
  const uint64_t product = static_cast<uint64_t>(a) * b;
  *high = static_cast<uint32_t>(product >> 32);
  return static_cast<uint32_t>(product);
}

// The first of Philox4x32-10's four outputs for counter (c0, c1, 0, 0) and key (k0, k1).
FIXED_ATTENTION_HOST_DEVICE uint32_t philox_first(uint32_t c0, uint32_t c1, uint32_t k0,
                                                  uint32_t k1) {
  uint32_t c2 = 0, c3 = 0;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo(0xD2511F53u, c0, &hi0);
    const uint32_t lo1 = mulhilo(0xCD9E8D57u, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// Uniform in [0, 1) with 24 random bits (exact in float and double) for element `position`.
FIXED_ATTENTION_HOST_DEVICE float uniform(uint64_t seed, uint64_t position) {
  const uint32_t bits =
      philox_first(static_cast<uint32_t>(position), static_cast<uint32_t>(position >> 32),
                   static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

// Element (b, i, j) of a (batch, L, S) problem: b the flattened leading index of the output, i
// the query row, j the key. Kept when uniform >= p; a kept probability is scaled by 1 / (1 - p).
FIXED_ATTENTION_HOST_DEVICE bool keep(uint64_t seed, float p, int64_t b, int64_t i, int64_t j,
                                      int64_t len_q, int64_t len_kv) {
  const uint64_t position = (static_cast<uint64_t>(b) * static_cast<uint64_t>(len_q) +
                             static_cast<uint64_t>(i)) *
                                static_cast<uint64_t>(len_kv) +
                            static_cast<uint64_t>(j);
  return uniform(seed, position) >= p;
}

}  // namespace dropout
}  // namespace fixed_attention

#endif  // FIXED_ATTENTION_PHILOX_H_
