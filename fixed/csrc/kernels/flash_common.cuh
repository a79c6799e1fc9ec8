// What the tensor-core kernels (flash_forward.cuh, flash_backward.cuh) share: inline PTX for
// mma.sync m16n8k16, ldmatrix, cp.async and reductions; the XOR-swizzled shared-memory tile
// layout; the tile loader; and the host-side checks that decide whether a tensor-core kernel can
// take a case. The fragment layouts every mma.sync kernel here relies on are spelled out below.
//
// --------------------------------------------------------------- fragments (PTX ISA 9.7.14)
// lane = 0..31, g = lane >> 2 (groupID), t = lane & 3 (threadID_in_group).
// mma.m16n8k16 .row.col, f16/bf16 operands, f32 accumulators:
//   A 16x16 (row = M, col = K), 4 b32 registers of 2 elements (low half = lower column):
//     a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]
//     a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//   B 16x8 (row = K, col = N), 2 b32 registers:
//     b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//   C/D 16x8 f32, 4 registers:
//     c[0], c[1] = C[g][2t, 2t+1]          c[2], c[3] = C[g+8][2t, 2t+1]
// ldmatrix.m8n8.x4.b16: lanes 8i..8i+7 give the 8 row addresses (16 bytes each) of matrix i,
// and register i of every lane receives from matrix i:
//   plain:  M_i[g][2t, 2t+1]       (row g, two adjacent columns)
//   .trans: M_i[2t][g], M_i[2t+1][g] (two adjacent rows, column g)
// Hence, with Q, K, V row-major in shared memory (rows = tokens, columns = head dim d):
// - Q as A (m-tile rows r0.., k-step d0..): lane gives row r0 + (lane & 15), column
//   d0 + 8 (lane >> 4); matrices (rows 0-7, d 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15)
//   are exactly a[0..3].
// - K as B of S = Q K^T (B[k = d][n = key] = K[key][d], so K row-major is B "col"): lane gives
//   key n0 + (lane & 7) + 8 (lane >> 4), column d0 + 8 ((lane >> 3) & 1); registers 0, 1 are
//   b[0], b[1] of keys n0..n0+7 and registers 2, 3 those of keys n0+8..n0+15.
// - V as B of O = P V (B[k = key][n = d] = V[key][d]: two adjacent keys per register, so
//   .trans): lane gives key k0 + (lane & 15), column d0 + 8 (lane >> 4); registers 0, 1 are
//   b[0], b[1] of columns d0..d0+7 and registers 2, 3 those of columns d0+8..d0+15.
// - P as A of O = P V: the C fragments of S for keys 16kk..16kk+7 (n-tile 2kk) and
//   16kk+8..16kk+15 (n-tile 2kk+1) are, packed in pairs, exactly a[0..3]:
//     a[0] = S[2kk][c0, c1]   a[1] = S[2kk][c2, c3]   a[2] = S[2kk+1][c0, c1]
//     a[3] = S[2kk+1][c2, c3]
// - Row statistics: row g (and g+8) of an m-tile lives in the 4 lanes of a quad (same g), so
//   row max and row sum reduce with __shfl_xor_sync over 1 and 2; the row sum is kept per lane
//   and reduced once at the end (it is linear, and every lane of a quad rescales by the same
//   factor).
//
// No torch includes: nvcc compile-checks it without a GPU (kata/toolchain/builders.py).
#ifndef FIXED_FLASH_COMMON_CUH_
#define FIXED_FLASH_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_problem.cuh"  // AttentionProblem, ceil_div, min64, detail::grid_for, ...

namespace fixed_attention {
namespace kernels {
namespace flash {

// ------------------------------------------------------------------------ PTX wrappers
// Inline PTX needs sm_80 (bf16 mma, cp.async); the kernel body compiles only there.

__device__ __forceinline__ uint32_t smem_addr(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Two consecutive floats from shared memory (8-byte aligned): a lane's lse or delta pair (the
// backward), a pair of mask entries (the warp-specialized forward).
__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t address) {
  float2 value;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
               : "=f"(value.x), "=f"(value.y)
               : "r"(address));
  return value;
}

// 16 bytes global -> shared, bypassing L1 (.cg), asynchronous (cp.async groups below).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
#endif
}

// The same, reading only the first `bytes` (0 to 16) and zeroing the rest: a tile's edge. With
// 0 nothing is read, but `src` must still be a global address.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t dst, const void* src, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
#endif
}
// 4 bytes, `bytes` (0 or 4) of them read (.ca: .cg takes 16-byte copies only).
__device__ __forceinline__ void cp_async_4_zfill(uint32_t dst, const void* src, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ float ld_shared_f32(uint32_t address) {
  float value;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(value) : "r"(address));
  return value;
}
__device__ __forceinline__ void st_shared_b32(uint32_t address, uint32_t bits) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(address), "r"(bits) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_b32(uint32_t address) {
  uint32_t bits;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(bits) : "r"(address) : "memory");
  return bits;
}

// 16 zero bytes to shared memory (the rows of a tile past the end of its matrix).
__device__ __forceinline__ void st_shared_zero_16(uint32_t dst) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0u) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#endif
}

// c += a b for one 16x8x16 tile; T selects the operand type (bf16 or f16).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, __half>, "bf16 or f16 operands");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

// Two floats rounded to nearest-even into one b32 register: lo in bits 0-15 (the lower column
// or row of a fragment pair), hi in bits 16-31.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);  // .x = lo, .y = hi
    std::memcpy(&bits, &pair, sizeof(bits));
  } else {
    const __half2 pair = __floats2half2_rn(lo, hi);  // .x = lo, .y = hi
    std::memcpy(&bits, &pair, sizeof(bits));
  }
  return bits;
}

// 2^x, MUFU.EX2 (ftz; 2^-inf = +0, which masked scores rely on).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ------------------------------------------------------------------------ tile helpers

// Byte offset of element (row, 8 * chunk) of a swizzled [rows][kHeadDim] tile.
template <int kHeadDim>
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
  return static_cast<uint32_t>((row * kHeadDim + ((chunk ^ (row & 7)) << 3)) * 2);
}

// Rows [0, kRows) of a (rows, kHeadDim) row-major global matrix starting at `src` into a
// swizzled shared tile at `dst`: 16-byte cp.async for rows < valid_rows, 16-byte zero stores
// for the rest (never read: no access past the end of a tensor). Thread `tid` handles chunk
// tid % kChunks of rows tid / kChunks + pass * kRowsPerPass. Where kRowsPerPass is a multiple
// of 8 the row's swizzle key (row & 7) is the same for every pass and offsets are immediates;
// otherwise (4 warps at D = 256: 4 rows per pass) each pass computes its row's.
template <class F, int kRows, typename T>
__device__ __forceinline__ void load_tile(uint32_t dst, const T* src, int64_t valid_rows,
                                          int tid) {
  constexpr int kRowsPerPass = F::kThreads / F::kChunks;
  static_assert(kRows % kRowsPerPass == 0, "whole passes");
  const int chunk = tid % F::kChunks;
  const int first_row = tid / F::kChunks;
  // Valid rows of this tile, 0..kRows (an int from here on).
  const int valid = static_cast<int>(valid_rows < 0 ? 0 : valid_rows < kRows ? valid_rows : kRows);
  const T* const thread_src = src + first_row * F::kHeadDim + chunk * 8;
  const uint32_t thread_dst = dst + swizzled<F::kHeadDim>(first_row, chunk);
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const uint32_t to =
        kRowsPerPass % 8 == 0
            ? thread_dst + pass * kRowsPerPass * F::kHeadDim * 2
            : dst + swizzled<F::kHeadDim>(pass * kRowsPerPass + first_row, chunk);
    if (pass * kRowsPerPass + first_row < valid) {
      cp_async_16(to, thread_src + pass * kRowsPerPass * F::kHeadDim);
    } else {
      st_shared_zero_16(to);
    }
  }
}

// Adds (a, b) to the two consecutive floats at `address` in global memory, atomically per
// element (relaxed, gpu scope); nothing is returned, so the SM does not wait for it. sm_90 has
// a vector form: one request for both elements.
__device__ __forceinline__ void red_add_f32x2(float* address, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(address), "f"(a), "f"(b)
               : "memory");
#elif defined(__CUDA_ARCH__)
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(address), "f"(a) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(address + 1), "f"(b) : "memory");
#endif
}

// ------------------------------------------------------------------ the SDPA arguments
// Each tensor-core kernel has three instantiations (its kArgs): kNoArgs for problems without a
// mask or dropout (GQA included), which compiles none of what follows; kMaskOnly, which adds the
// additive mask's entry to each score; kMaskAndDropout, which also draws dropout's keep mask per
// score element. Both read what the generic kernels read (attention_kernels.cuh): the same mask
// entry, the same Philox bits (philox.h). Dropout's Philox rounds take registers that a mask
// alone does not need (ptxas spilled more with both in one instantiation).
enum ScoreArgs : int { kNoArgs = 0, kMaskOnly = 1, kMaskAndDropout = 2 };

// The instantiation a problem needs, of `none`, `mask` and `all` (one kernel's three).
template <typename Kernel>
Kernel* for_score_args(const AttentionProblem& p, Kernel* none, Kernel* mask, Kernel* all) {
  return p.dropout_p > 0.f ? all : p.mask != nullptr ? mask : none;
}

// The side of the square tiles of AttentionProblem::hidden_tiles: a divisor of every
// tensor-core kernel's blocks of rows and keys.
constexpr int kHiddenTile = 64;
// The kinds of tile in that map (also the bits of *any_hidden).
constexpr uint8_t kHiddenTileHidden = 1;  // every entry -inf
constexpr uint8_t kHiddenTileZero = 2;    // every entry 0

// Whether the kernel should look blocks up in the map at all: one load per CTA, so that a mask
// that hides no tile (most float masks) costs no lookup per block.
__device__ __forceinline__ bool skips_hidden_blocks(const AttentionProblem& p) {
  return p.hidden_tiles != nullptr && (*p.any_hidden & kHiddenTileHidden) != 0;
}
// The same for blocks of zero tiles, whose mask entries the kernels need not read.
__device__ __forceinline__ bool skips_zero_blocks(const AttentionProblem& p) {
  return p.hidden_tiles != nullptr && (*p.any_hidden & kHiddenTileZero) != 0;
}

// Whether the mask hides every score of rows [row0, row0 + rows) x keys [key0, key0 + keys) of
// batch item b (row0 and key0 multiples of kHiddenTile; the ranges end at L and S): a block the
// kernels can skip, as its probabilities are all 0. Only where skips_hidden_blocks. Uniform
// when its arguments are.
__device__ __forceinline__ bool block_of_tiles(const AttentionProblem& p, int64_t b,
                                               int64_t row0, int rows, int64_t key0, int keys,
                                               uint8_t kind) {
  const uint8_t* const tiles = p.hidden_tiles + (b / p.heads) * p.hidden_stride_outer +
                               (b % p.heads) * p.hidden_stride_head;
  const int64_t row_end = min64(row0 + rows, p.len_q), key_end = min64(key0 + keys, p.len_kv);
  for (int64_t r = row0; r < row_end; r += kHiddenTile) {
    for (int64_t k = key0; k < key_end; k += kHiddenTile) {
      const int64_t tile =
          (r / kHiddenTile) * p.hidden_stride_row + (k / kHiddenTile) * p.hidden_stride_col;
      if (tiles[tile] != kind) {
        return false;
      }
    }
  }
  return true;
}
__device__ __forceinline__ bool hidden_block(const AttentionProblem& p, int64_t b, int64_t row0,
                                             int rows, int64_t key0, int keys) {
  return block_of_tiles(p, b, row0, rows, key0, keys, kHiddenTileHidden);
}
// Whether every entry of the mask in that block is 0 (its scores are the unmasked ones). Only
// where skips_zero_blocks.
__device__ __forceinline__ bool zero_block(const AttentionProblem& p, int64_t b, int64_t row0,
                                           int rows, int64_t key0, int keys) {
  return block_of_tiles(p, b, row0, rows, key0, keys, kHiddenTileZero);
}

// Batch item b's (L, S) slice of the additive mask as float32 (strides may be 0), or null: the
// per-thread forward kernels' (they decline a 16-bit mask; the backwards read either form
// through mask_slice_of and mask_value, attention_problem.cuh).
__device__ __forceinline__ const float* mask_rows(const AttentionProblem& p, int64_t b) {
  return mask_slice_of<float>(p, b);
}

// Element e of n-tile j of a thread's score fragments: float[n][4] (mma.sync) or float[4 n]
// (wgmma).
template <int N>
__device__ __forceinline__ float& element(float (&s)[N][4], int j, int e) {
  return s[j][e];
}
template <int N>
__device__ __forceinline__ float& element(float (&s)[N], int j, int e) {
  return s[4 * j + e];
}

// Whether the mask's rows can be read as aligned pairs of floats: keys contiguous, every row
// start 8-byte aligned (uniform over the grid).
__device__ __forceinline__ bool mask_in_pairs(const AttentionProblem& p) {
  return p.mask_stride_col == 1 &&
         ((p.mask_stride_row | p.mask_stride_head | p.mask_stride_outer) & 1) == 0 &&
         (reinterpret_cast<std::uintptr_t>(p.mask) & 7) == 0;
}

// Row `first / 2` of a thread's score fragments (elements first, first + 1 of each n-tile j:
// keys key0 + 8 j, + 1) becomes scale_log2 s + mask log2(e), or -inf past the keys (keys_left
// of them from key0 on) or for a row past L. `row` points at the row's mask entries (clamped
// inside the mask). `pairs` (uniform): mask_in_pairs and no key of the block past S; then both
// keys of a pair come from one 8-byte load at an immediate offset, no multiply, no test.
template <int kNTiles, typename Fragments>
__device__ __forceinline__ void add_mask_row(Fragments& s, int first, const float* row,
                                             const AttentionProblem& p, int64_t key0,
                                             int64_t keys_left, bool row_inside, bool pairs,
                                             float scale_log2) {
  constexpr float kLog2e = 1.4426950408889634f;
  if (pairs) {
    const float2* const at = reinterpret_cast<const float2*>(row + key0);
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      const float2 entry = __ldg(at + 4 * j);
      float& s0 = element(s, j, first);
      float& s1 = element(s, j, first + 1);
      s0 = row_inside ? fmaf(s0, scale_log2, entry.x * kLog2e) : -INFINITY;
      s1 = row_inside ? fmaf(s1, scale_log2, entry.y * kLog2e) : -INFINITY;
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      float& score = element(s, j, first + c);
      const int64_t col = 8 * j + c;
      score = row_inside && col < keys_left
                  ? fmaf(score, scale_log2, __ldg(row + (key0 + col) * p.mask_stride_col) * kLog2e)
                  : -INFINITY;
    }
  }
}

// Dropout's keep bits of a thread's elements in four 2 x 4 Philox blocks (philox.h): bit 2 k + c
// for its element c (0 the first) of block k. Each block's eight elements lie in a group of four
// lanes, two in each, and the group's blocks are the same four: lane `slot` (0..3) of the group
// draws block `slot` (row, key: any element of it), compares its eight uniforms, and the group
// swaps the resulting bytes by three shuffles. One Philox call per eight elements. All 32 lanes
// call it together.
//   kAlongKeys (the forward's fragments: keys key, key + 1 of a row): the group is lanes
//   l, l ^ 1, l ^ 4, l ^ 5 (t & 1, g & 1); slot = 2 (g & 1) + (t & 1), and the lane's elements
//   (rows 2r + (g & 1), keys 4c + 2 (t & 1), + 1) are bits 2 slot, 2 slot + 1 of each block's byte.
//   kAlongRows (the backward's: queries row, row + 1 of a key): lanes l, l ^ 4, l ^ 8, l ^ 12
//   (g & 3); slot = g & 3 = key & 3, and the lane's elements are bits slot, slot + 4.
// A block's byte: bit e for the element at row 2r + (e >> 2), key 4c + (e & 3), which is half
// e & 1 of word e >> 1. Comparing before the shuffles, not after, and one byte permute by slot
// in place of selects on both sides: 216 instructions fewer in the D = 64 wgmma backward's
// dropout instance, which draws at 8 places (perf/NOTES.md, v37).
enum class DropoutPair { kAlongKeys, kAlongRows };
// `counter`: dropout::block_counter of the lane's block (b, row, key): callers that draw many
// blocks step it (philox.h) instead of recomputing its 64-bit products (about 38 of a call's 130
// instructions, sm_90a; perf/NOTES.md, v26).
template <DropoutPair kPair>
__device__ __forceinline__ uint32_t dropout_keep_bits_at(const AttentionProblem& p,
                                                         uint32_t keep_threshold,
                                                         uint64_t counter, int slot) {
  constexpr bool kKeys = kPair == DropoutPair::kAlongKeys;
  const dropout::Words drawn = dropout::counter_words(p.dropout_seed, counter);
  // A half u is kept (u >= T) exactly when u 2^16 + anything below 2^16 exceeds T 2^16 - 1: the
  // high half compared as the whole word, the low one shifted up, both against one limit (before:
  // a mask for the low half, a shift for the high one; with T kept for the low half beside the
  // limit, the forward's dropout instances spilled more, ptxas; perf/NOTES.md v46). T >= 1
  // (callers draw only for p > 0); at T = 2^16 the limit wraps to 0xFFFFFFFF: none kept, as
  // u >= 2^16 would.
  const uint32_t limit = (keep_threshold << 16) - 1u;
  uint32_t own = 0;  // the drawn block's byte
#pragma unroll
  for (int word = 0; word < 4; ++word) {
    own |= (drawn.w[word] << 16 > limit ? 1u : 0u) << (2 * word);
    own |= (drawn.w[word] > limit ? 1u : 0u) << (2 * word + 1);
  }
  // Byte d of {pair01, pair23} (permute indices 0, 1, 4, 5) is block slot ^ d's, from the lane
  // d slots away; the selector puts block k's in byte k: index(k ^ slot) = index(k) ^
  // index(slot), index(d) = (d & 1) | ((d & 2) << 1), a linear map of d's bits.
  constexpr int kLaneOf[4] = {0, kKeys ? 1 : 4, kKeys ? 4 : 8, kKeys ? 5 : 12};
  const uint32_t pair01 = __byte_perm(own, __shfl_xor_sync(0xffffffffu, own, kLaneOf[1]), 0x40u);
  const uint32_t pair23 = __byte_perm(__shfl_xor_sync(0xffffffffu, own, kLaneOf[2]),
                                      __shfl_xor_sync(0xffffffffu, own, kLaneOf[3]), 0x40u);
  const uint32_t index_of_slot = static_cast<uint32_t>((slot & 1) | ((slot & 2) << 1));
  const uint32_t blocks = __byte_perm(pair01, pair23, 0x5410u ^ (index_of_slot * 0x1111u));
  // The lane's two bits of each byte to bits 8 k + c, then to 2 k + c.
  uint32_t mine;
  if constexpr (kKeys) {
    mine = (blocks >> (2 * slot)) & 0x03030303u;
  } else {
    mine = (blocks >> slot) & 0x11111111u;
    mine = (mine | (mine >> 3)) & 0x03030303u;
  }
  mine |= mine >> 6;
  return (mine | (mine >> 12)) & 0xFFu;
}
// The same, the counter computed from any element (row, key) of the lane's block.
template <DropoutPair kPair>
__device__ __forceinline__ uint32_t dropout_keep_bits(const AttentionProblem& p,
                                                      uint32_t keep_threshold, int64_t b,
                                                      int64_t row, int64_t key, int slot) {
  return dropout_keep_bits_at<kPair>(
      p, keep_threshold, dropout::block_counter(b, row, key, p.len_q, p.len_kv), slot);
}

// Bit `index` of dropout's keep bits as Z: keep_scale = 1 / (1 - p) when kept, 0 when dropped.
__device__ __forceinline__ float dropout_factor(uint32_t kept, int index, float keep_scale) {
  return (kept >> index) & 1u ? keep_scale : 0.f;
}

// dropout_keep_bits as factors: z[k] = Z of the thread's two elements of block k (first in .x).
template <DropoutPair kPair>
__device__ __forceinline__ void dropout_factors(const AttentionProblem& p, float keep_scale,
                                                uint32_t keep_threshold, int64_t b, int64_t row,
                                                int64_t key, int slot, float2 (&z)[4]) {
  const uint32_t kept = dropout_keep_bits<kPair>(p, keep_threshold, b, row, key, slot);
#pragma unroll
  for (int block = 0; block < 4; ++block) {
    z[block] = make_float2(dropout_factor(kept, 2 * block, keep_scale),
                           dropout_factor(kept, 2 * block + 1, keep_scale));
  }
}

namespace detail {

// The problems the tensor-core kernels take: Ev = E (the glue pads other head dims); GQA, a
// mask and dropout included. Under GQA batch item b reads K/V item b / kv_group (the generic
// kernels' kv_item), and the backward writes dK and dV per batch item, for the glue to sum over
// each group: never a repeated K or V.
__host__ __device__ __forceinline__ bool takes_tensor_cores(const AttentionProblem& p) {
  return value_dim(p) == p.head_dim;
}

// An attribute of the current device, 0 where it cannot be read: not the caller's error (every
// work order is as correct, and a launcher that needs the value declines without it).
inline int64_t current_device_attribute(cudaDeviceAttr attribute) {
  int device = 0;
  int value = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return value;
}

// The current device's L2 size in bytes and its number of SMs (0: unknown).
inline int64_t l2_bytes() { return current_device_attribute(cudaDevAttrL2CacheSize); }
inline int64_t multiprocessors() {
  return current_device_attribute(cudaDevAttrMultiProcessorCount);
}

// The order of causal work items (the kernels' longest_first argument). Batch-major lets the
// longest items of the last batch items start last and finish alone; longest first over the whole
// grid avoids that tail, but then every batch item's stream (K and V forward, Q and dO backward)
// is read at once, and L2 holds less of it. Measured on an H200 (perf/NOTES.md, v6): longest
// first was 2-11% faster while those streams together were about 2 L2 sizes or less (134 MB, 60
// MB of L2), and even or up to 6% slower from about 4 (268 MB). The threshold, 3, lies between:
// a rule fitted to one GPU. The streams: two 2-byte tensors of (batch, stream_rows, head_dim).
inline bool longest_first_pays(int64_t batch, int64_t stream_rows, int64_t head_dim) {
  const int64_t streamed_bytes = batch * stream_rows * head_dim * 2 * 2;
  return streamed_bytes <= 3 * l2_bytes();
}

// The same choice for the wgmma backwards (one work item per CTA, started in blockIdx order),
// measured on an H100 (perf/NOTES.md, v34; causal, the backward alone, 14 shapes). Longest
// first has the CTAs running at once take the first key blocks of every batch item, each
// streaming its item's Q and dO from the top; batch-major has them take most key blocks of a
// few items, which stream the same Q and dO. So longest first pays where every batch item's Q
// and dO fit in L2 together (D = 64 at (B x H, S) = (64, 2048): 1.03x batch-major's speed), or
// where the CTAs running at once hold 4 or more key blocks of each item, which then stream
// together (B x H of 16 and 32 at S = 4096 and 8192: 1.06-1.18x). Elsewhere batch-major: at
// B x H = 64, D = 128, 1.16x at S = 2048 and 1.35x at 4096 (where longest_first_pays chose
// longest first), 1.55-1.81x above; D = 64 even at 4096, 1.06x at 8192. One shape ran against
// the rule: D = 64 at (16, 16384), batch-major 1.05x.
inline bool wgmma_backward_longest_first_pays(int64_t batch, int64_t stream_rows,
                                              int64_t head_dim) {
  const int64_t streamed_bytes = batch * stream_rows * head_dim * 2 * 2;
  return streamed_bytes <= l2_bytes() || 4 * batch <= multiprocessors();
}

// Whether the kernels should take a masked problem's work items batch-minor (their
// longest_first order): where neighbouring batch items (B x H, head-minor) read the same mask
// (broadcast over heads, or over the batch with one head) and one (L, S) slice of it, in the
// form the kernels read, outgrows L2. The items running at once then share each mask tile
// through L2 instead of each streaming the mask from HBM.
// H100, (1, 1, S, S) masks, 16 heads (perf/NOTES.md, v24): at S = 8192 forward 1.00-1.20x as
// fast, forward+backward 1.01-1.11x; at 2048 (16 MB) a float mask at D = 128 3-5% slower.
inline bool mask_shared_by_neighbours(const AttentionProblem& p) {
  return p.mask != nullptr && p.batch > 1 &&
         (p.heads > 1 ? p.mask_stride_head : p.mask_stride_outer) == 0 &&
         p.len_q * p.len_kv * mask_entry_bytes(p) > l2_bytes();
}

inline bool aligned16(const void* pointer) {
  return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0;
}

// True when the image of `kernel` that runs on the current device was compiled for sm_80 or
// later. The kernel body exists only there (mma.sync with bf16, ldmatrix, cp.async): a build
// whose only image for this device is older PTX, JIT-compiled, would run an empty kernel.
template <typename Kernel>
bool has_tensor_core_image(Kernel* kernel) {
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    (void)cudaGetLastError();  // answered "no" here; not an error for the caller's check
    return false;
  }
  return attributes.ptxVersion >= 80;
}

}  // namespace detail
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_COMMON_CUH_
