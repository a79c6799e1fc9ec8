// Dropout's keep mask, the same bits on the CPU and on CUDA: a counter-based generator
// (Philox4x32-7, Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) keyed by
// a seed torch's default generator draws, counted by the element's 2 x 4 block (block_words), a
// 16-bit uniform per element. The forward and the backward regenerate the same mask from (seed,
// position): nothing is stored.
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
#if defined(__CUDA_ARCH__)
  // The same product, as two halves that ptxas fuses into one IMAD.WIDE.U32. The 64-bit form
  // below compiled to IMAD.WIDE plus an add of zero to the high half (nvcc 13.0, sm_90a): six
  // instructions a round instead of four, the add on the rounds' dependent chain.
  *high = __umulhi(a, b);
  return a * b;
#else
  const uint64_t product = static_cast<uint64_t>(a) * b;
  *high = static_cast<uint32_t>(product >> 32);
  return static_cast<uint32_t>(product);
#endif
}

// Seven rounds, as FlashAttention-2's Philox (SDPA's flash backend) draws its dropout masks;
// Salmon et al. found Philox4x32-7 Crush-resistant (BigCrush passed) and chose 10 as a safety
// margin. The rounds are most of dropout's cost in the kernels (perf/NOTES.md, v29).
constexpr int kRounds = 7;

// Philox4x32-7's four outputs for counter (c0, c1, 0, 0) and key (k0, k1).
struct Words {
  uint32_t w[4];
};
FIXED_ATTENTION_HOST_DEVICE Words philox(uint32_t c0, uint32_t c1, uint32_t k0, uint32_t k1) {
  uint32_t c2 = 0, c3 = 0;
  for (int round = 0; round < kRounds; ++round) {
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
  return Words{{c0, c1, c2, c3}};
}

// One Philox call draws the eight elements of a 2 x 4 block of a (batch, L, S) problem: rows
// 2r, 2r + 1 and keys 4c .. 4c + 3 of batch item b (b the flattened leading index of the output),
// counted row-major over the blocks of every item: counter = (b ceil(L / 2) + r) ceil(S / 4) + c.
// Element (i, j) takes half j & 1 (the low 16 bits for an even key) of word
// 2 (i & 1) + ((j >> 1) & 1). A thread of the tensor-core kernels holds two elements of a block
// (two keys of a row in the forward, two rows of a key in the backward) and four lanes share it,
// so that one call serves eight elements (flash_common.cuh, dropout_keep_bits). Two 16-bit
// uniforms per word, not one 24-bit one: half the Philox rounds per element (perf/NOTES.md,
// v19). The key is the seed's two 32-bit halves.
// The counter of the block holding (i, j), and its words. Blocks (2 r, 4 c) further count
// r block_cols(len_kv) + c further, which lets a kernel step one counter from block to block.
FIXED_ATTENTION_HOST_DEVICE uint64_t block_cols(int64_t len_kv) {
  return (static_cast<uint64_t>(len_kv) + 3) / 4;
}
FIXED_ATTENTION_HOST_DEVICE uint64_t block_counter(int64_t b, int64_t i, int64_t j, int64_t len_q,
                                                   int64_t len_kv) {
  const uint64_t block_rows = (static_cast<uint64_t>(len_q) + 1) / 2;
  return (static_cast<uint64_t>(b) * block_rows + static_cast<uint64_t>(i) / 2) *
             block_cols(len_kv) +
         static_cast<uint64_t>(j) / 4;
}
FIXED_ATTENTION_HOST_DEVICE Words counter_words(uint64_t seed, uint64_t counter) {
  return philox(static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32),
                static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}
FIXED_ATTENTION_HOST_DEVICE Words block_words(uint64_t seed, int64_t b, int64_t i, int64_t j,
                                              int64_t len_q, int64_t len_kv) {
  return counter_words(seed, block_counter(b, i, j, len_q, len_kv));
}

// Half `high` of a word: a 16-bit uniform u, u / 2^16 in [0, 1).
FIXED_ATTENTION_HOST_DEVICE uint32_t half_of(uint32_t word, bool high) {
  return high ? word >> 16 : word & 0xFFFFu;
}

// Kept when u / 2^16 >= p, that is when u >= threshold(p) = ceil(p 2^16) (exact in float: a
// scaling by a power of two): one integer comparison per element. A kept probability is scaled
// by 1 / (1 - p).
FIXED_ATTENTION_HOST_DEVICE uint32_t threshold(float p) {
  const float scaled = p * 65536.0f;
  const uint32_t whole = static_cast<uint32_t>(scaled);
  return static_cast<float>(whole) < scaled ? whole + 1 : whole;
}
FIXED_ATTENTION_HOST_DEVICE bool kept(uint32_t uniform16, uint32_t threshold) {
  return uniform16 >= threshold;
}

// Whether element (b, i, j) is kept.
FIXED_ATTENTION_HOST_DEVICE bool keep(uint64_t seed, float p, int64_t b, int64_t i, int64_t j,
                                      int64_t len_q, int64_t len_kv) {
  const Words words = block_words(seed, b, i, j, len_q, len_kv);
  // Selects, not words.w[index]: a register array indexed at run time would go to local memory.
  const bool odd_key_pair = (j >> 1) & 1;
  const uint32_t word = (i & 1) ? (odd_key_pair ? words.w[3] : words.w[2])
                                : (odd_key_pair ? words.w[1] : words.w[0]);
  return kept(half_of(word, j & 1), threshold(p));
}

}  // namespace dropout
}  // namespace fixed_attention

#endif  // FIXED_ATTENTION_PHILOX_H_
