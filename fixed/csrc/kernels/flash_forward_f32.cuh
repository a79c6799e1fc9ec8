// The forward for float32 on tensor cores: flash_forward_cta.cuh's algorithm (FlashAttention-2)
// with both products in 3xTF32 on mma.sync m16n8k8 (sm_80 and later), head dims 64 and 128,
// Ev = E; GQA, an additive mask and dropout as the half-precision kernels take them (ScoreArgs).
// The launcher at the bottom declines the rest (other head dims, which the glue pads to 64 or
// 128; inputs not 16-byte aligned, no sm_80+ image), launching nothing; the glue then runs the
// generic kernel (attention_kernels.cuh).
//
// ------------------------------------------------------------------------------ 3xTF32
// TF32 keeps float32's exponent and 10 of its 23 mantissa bits. Each float32 operand x is split
// into hi = tf32(x) (rounded to nearest) and lo = tf32(x - hi), the next 11 bits (x - hi is exact);
// a product a b is taken as a_lo b_hi + a_hi b_lo + a_hi b_hi, three mma's accumulated in
// float32. The dropped a_lo b_lo is below 2^-21 of a b: float32's semantics to about its own
// rounding, never TF32's 10 bits. One thing more keeps it there: the tensor cores add into an
// accumulator with truncation, not rounding, so a sum over thousands of keys in one accumulator
// drifts (measured on an H100: relative error 2.9e-5 at S = 4096, growing with S). O's
// accumulators therefore take one key block's P V at a time, added to O by FFMA (rounded) with
// the softmax's rescale. SDPA's default takes float32 to the same arithmetic (its
// memory-efficient kernel, cutlass's OpMultiplyAddFastF32), so float32 stays float32 here and
// runs on tensor cores.
//
// ---------------------------------------------------------------------------- fragments
// mma.m16n8k8 .row.col, tf32 operands, f32 accumulators (PTX ISA 9.7.14), lane = 4 g + t:
//   A 16x8: a[0] = A[g][t]  a[1] = A[g+8][t]  a[2] = A[g][t+4]  a[3] = A[g+8][t+4]
//   B 8x8:  b[0] = B[t][g]  b[1] = B[t+4][g]
//   C 16x8: c[0], c[1] = C[g][2t, 2t+1]  c[2], c[3] = C[g+8][2t, 2t+1] (as m16n8k16's)
// A k-step may take its 8 k indices in any order, as long as A and B agree. Both products take
// k = t as index 2t of the step and k = t + 4 as 2t + 1:
// - S = Q K^T (k: the head dim): a lane reads dims 2t, 2t + 1 of a Q row and of a K row, one
//   8-byte load each.
// - O += P V (k: the keys): a[0], a[2] = P[g][2t, 2t+1] are c[0], c[1] of S's fragment, so P goes
//   from S's accumulators to the A operand as it is, no shuffle; b = V[2t][g], V[2t + 1][g].
//
// ------------------------------------------------------------------------- tiling, memory
// A CTA of kWarps warps owns kBlockM = 16 kWarps query rows of one batch item, 16 per warp (one
// m-tile); it loops over key blocks of kBlockN keys, one softmax step each, as
// flash_forward_cta.cuh does (the online softmax, causal and tail masking, the work order).
// Shared memory, float32 rows padded so that every fragment read is free of bank conflicts:
//   Q, K rows of E + 8 floats (8 mod 32 words apart): a half-warp's 8-byte reads of rows g, dims
//   2t, 2t + 1 cover the 32 banks once.
//   V rows of E + 4 floats (4 mod 32): a warp's 4-byte reads of keys 2t (or 2t + 1), dim g, hit
//   banks 8t + g: 32 distinct.
// Q, then K and V double-buffered by cp.async (one barrier per key block, as flash_forward_cta):
//   E = 64, 4 warps (64 rows: 64 row blocks fill an H100 at the kata's (8, 1024, 64)), key
//   blocks of 64: 18 + 2 x (18 + 17) = 88 KB, two CTAs per SM; Q's fragments split once per
//   work item and held (64 registers); every warp splits the K and V fragments it reads.
//   E = 128, 8 warps (128 rows), key blocks of 32: 68 + 2 x 2 x (17 + 16.5) = 202 KB, one CTA
//   per SM. Each thread splits the K and V chunks it copied into hi (in place) and lo tiles
//   before the block's barrier, so that the 8 warps read split fragments instead of each
//   splitting all of them (perf/NOTES.md v38); Q is read and split at every k-step (held, it
//   would take 128 registers).
// O goes to global memory from the accumulators (8-byte stores: each quad writes 32 contiguous
// bytes of a row).
#ifndef FIXED_FLASH_FORWARD_F32_CUH_
#define FIXED_FLASH_FORWARD_F32_CUH_

#include <cuda_runtime.h>

#include <cfloat>
#include <cstddef>
#include <cstdint>

#include "attention_problem.cuh"  // AttentionProblem, ceil_div, min64, detail::grid_for, ...
#include "flash_common.cuh"       // cp.async, ScoreArgs, the mask and dropout helpers

namespace fixed_attention {
namespace kernels {
namespace flash {

template <int kHeadDim_, int kBlockN_, int kWarps_, bool kQInRegisters_, bool kSplitKV_>
struct F32Tiling {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;  // keys per block: one barrier, one softmax step
  static constexpr bool kQInRegisters = kQInRegisters_;
  static constexpr bool kSplitKV = kSplitKV_;  // K and V split once per block, in shared memory
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kCtasPerSm = kSplitKV ? 1 : 2;
  static constexpr int kBlockM = 16 * kWarps;       // query rows per CTA
  static constexpr int kKStride = kHeadDim + 8;     // floats per Q or K row in shared memory
  static constexpr int kVStride = kHeadDim + 4;     // floats per V row
  static constexpr int kKSteps = kHeadDim / 8;      // k-steps of S = Q K^T
  static constexpr int kNTiles = kBlockN / 8;       // n-tiles of S; k-steps of O += P V
  static constexpr int kDTiles = kHeadDim / 8;      // n-tiles of O
  static constexpr int kQFloats = kBlockM * kKStride;
  static constexpr int kKFloats = kBlockN * kKStride;
  static constexpr int kVFloats = kBlockN * kVStride;
  static constexpr int kKVParts = kSplitKV ? 2 : 1;  // per buffer: K or V (hi), and their lo
  static constexpr std::size_t kSmemBytes =
      4 * (kQFloats + 2 * kKVParts * (kKFloats + kVFloats));

  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64 and 128");
  static_assert(kNTiles % 4 == 0, "dropout's Philox blocks span four n-tiles' keys");
  static_assert(kKStride % 32 == 8 && kVStride % 32 == 4, "conflict-free fragment reads");
  static_assert(kCtasPerSm * kSmemBytes <= 227 * 1024, "kCtasPerSm CTAs per SM");
};

using F32Tiling64 = F32Tiling<64, 64, 4, true, false>;
using F32Tiling128 = F32Tiling<128, 32, 8, false, true>;

// ------------------------------------------------------------------------- device helpers

// x as hi = tf32(x) and lo = tf32(x - hi), each a TF32 bit pattern (low 13 bits zero).
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(hi) : "f"(x));
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(lo) : "f"(x - __uint_as_float(hi)));
#endif
}

__device__ __forceinline__ void mma_1688_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                              uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// A split operand: the hi and lo parts of a fragment.
template <int N>
struct SplitFragment {
  uint32_t hi[N];
  uint32_t lo[N];
};

// c += a b in 3xTF32, the small terms first (see the header comment).
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const SplitFragment<4>& a,
                                           const SplitFragment<2>& b) {
  mma_1688_tf32(c, a.lo, b.hi[0], b.hi[1]);
  mma_1688_tf32(c, a.hi, b.lo[0], b.lo[1]);
  mma_1688_tf32(c, a.hi, b.hi[0], b.hi[1]);
}

// The A fragment of Q for one k-step: rows g and g + 8 at the lane's address (row g, dims 2t,
// 2t + 1 of the step), negated when the scale is negative (exact: a sign bit).
template <class F>
__device__ __forceinline__ SplitFragment<4> q_fragment(uint32_t address, bool negate) {
  const float2 top = ld_shared_f32x2(address);
  const float2 bottom = ld_shared_f32x2(address + 8 * F::kKStride * 4);
  const float x[4] = {top.x, bottom.x, top.y, bottom.y};
  SplitFragment<4> a;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    split_tf32(negate ? -x[r] : x[r], a.hi[r], a.lo[r]);
  }
  return a;
}

// Rows [0, kRows) of a (rows, E) float32 matrix into shared memory at `dst`, kStride floats per
// row, by 16-byte cp.async; rows at or past valid_rows get zeros (tails compute on zeros, as in
// flash_forward_cta.cuh, and nothing past the matrix is read).
template <class F, int kRows, int kStride>
__device__ __forceinline__ void load_rows(uint32_t dst, const float* src, int64_t valid_rows,
                                          int tid) {
  constexpr int kChunks = F::kHeadDim / 4;  // 16-byte chunks per row
  static_assert((kRows * kChunks) % F::kThreads == 0, "whole passes");
#pragma unroll
  for (int pass = 0; pass < kRows * kChunks / F::kThreads; ++pass) {
    const int c = tid + pass * F::kThreads;
    const int row = c / kChunks;
    const int chunk = c % kChunks;
    const uint32_t at = dst + static_cast<uint32_t>((row * kStride + 4 * chunk) * 4);
    if (row < valid_rows) {
      cp_async_16(at, src + static_cast<int64_t>(row) * F::kHeadDim + 4 * chunk);
    } else {
      st_shared_zero_16(at);
    }
  }
}

// Splits the kRows rows at `tile` (kStride floats apart) into TF32 hi parts, in place, and lo
// parts kLoFloats further, each thread the 16-byte chunks load_rows gave it: its own cp.async
// copies (waited for), so no barrier is needed first. The tile's readers need one after.
template <class F, int kRows, int kStride, int kLoFloats>
__device__ __forceinline__ void split_rows_in_place(float* tile, int tid) {
  constexpr int kChunks = F::kHeadDim / 4;
#pragma unroll
  for (int pass = 0; pass < kRows * kChunks / F::kThreads; ++pass) {
    const int c = tid + pass * F::kThreads;
    float* const hi = tile + (c / kChunks) * kStride + 4 * (c % kChunks);
    const float4 x = *reinterpret_cast<const float4*>(hi);
    uint4 h, l;
    split_tf32(x.x, h.x, l.x);
    split_tf32(x.y, h.y, l.y);
    split_tf32(x.z, h.z, l.z);
    split_tf32(x.w, h.w, l.w);
    *reinterpret_cast<uint4*>(hi) = h;
    *reinterpret_cast<uint4*>(hi + kLoFloats) = l;
  }
}

// ------------------------------------------------------------------------------ kernel

template <class F, int kArgs>
__global__ void __launch_bounds__(F::kThreads, F::kCtasPerSm)
    flash_forward_f32_kernel(const float* __restrict__ q,  // (B, L, E)
                             const float* __restrict__ k,  // (B / kv_group, S, E)
                             const float* __restrict__ v,  // (B / kv_group, S, E)
                             float* __restrict__ out,      // (B, L, E)
                             float* __restrict__ lse,      // (B, L)
                             const AttentionProblem p,
                             const bool longest_first) {  // causal work order
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int D = F::kHeadDim;
  constexpr int kNTiles = F::kNTiles, kDTiles = F::kDTiles, kKSteps = F::kKSteps;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;
  constexpr unsigned kFullMask = 0xffffffffu;
  extern __shared__ uint4 flash_f32_smem[];  // 16-byte aligned
  // Q; 2 buffers of K (and K lo); 2 of V (and V lo).
  constexpr uint32_t kKBuffer = F::kKVParts * F::kKFloats * 4;
  constexpr uint32_t kVBuffer = F::kKVParts * F::kVFloats * 4;
  const uint32_t q_tile = smem_addr(flash_f32_smem);
  const uint32_t k_tiles = q_tile + F::kQFloats * 4;
  const uint32_t v_tiles = k_tiles + 2 * kKBuffer;

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int warp_row0 = (tid >> 5) * 16;  // the warp's first row in the CTA's tile
  // The lane's fragment addresses at k-step 0, n-tile 0 (see the header comment).
  const uint32_t q_lane =
      q_tile + static_cast<uint32_t>(((warp_row0 + g) * F::kKStride + 2 * t) * 4);
  const uint32_t k_lane = k_tiles + static_cast<uint32_t>((g * F::kKStride + 2 * t) * 4);
  const uint32_t v_lane = v_tiles + static_cast<uint32_t>((2 * t * F::kVStride + g) * 4);

  const int64_t L = p.len_q, S = p.len_kv;
  const int64_t row_blocks = ceil_div(L, F::kBlockM);
  // As flash_forward_cta: raw scores, 2^(s c - m c) with c = |scale| log2(e) > 0 (Q negated for
  // a negative scale, FLT_MIN for a zero one); with a mask, scores scaled when it is added.
  const bool negate_q = p.scale < 0.f;
  const float scale_log2 = fmaxf(fabsf(p.scale) * kLog2e, FLT_MIN);
  const bool has_mask = kArgs != kNoArgs && p.mask != nullptr;
  const bool has_dropout = kArgs == kMaskAndDropout && p.dropout_p > 0.f;
  const float unit = has_mask ? 1.f : scale_log2;
  const float mask_scale = fabsf(p.scale) * kLog2e;
  const float keep_scale = dropout_scale(p.dropout_p);
  const uint32_t keep_threshold = dropout::threshold(p.dropout_p);
  const int slot = 2 * (g & 1) + (t & 1);  // the lane's place among those sharing Philox blocks
  const bool mask_pairs = has_mask && mask_in_pairs(p);

  for (int64_t item = blockIdx.x; item < p.batch * row_blocks; item += gridDim.x) {
    const int64_t b = longest_first ? item % p.batch : item / row_blocks;
    const int64_t rank = longest_first ? item / p.batch : item % row_blocks;  // 0: the longest
    const int64_t m0 = (row_blocks - 1 - rank) * F::kBlockM;
    const float* mask_row[2] = {};  // rows g and g + 8 of the mask, clamped inside it
    if (has_mask) {
      const float* const mask_b = mask_rows(p, b);
      for (int h = 0; h < 2; ++h) {
        mask_row[h] = mask_b + min64(m0 + warp_row0 + g + 8 * h, L - 1) * p.mask_stride_row;
      }
    }
    const int64_t kv_b = (b / p.kv_group) * S * D;  // under GQA, the group's K and V
    const int64_t key_end = p.causal ? min64(S, min64(m0 + F::kBlockM, L)) : S;
    const int n_blocks = static_cast<int>(ceil_div(key_end, F::kBlockN));

    // Prologue: Q (group 0), K and V of block 0 into buffer 0 (group 1).
    load_rows<F, F::kBlockM, F::kKStride>(q_tile, q + (b * L + m0) * D, L - m0, tid);
    cp_async_commit();
    load_rows<F, F::kBlockN, F::kKStride>(k_tiles, k + kv_b, S, tid);
    load_rows<F, F::kBlockN, F::kVStride>(v_tiles, v + kv_b, S, tid);
    cp_async_commit();

    SplitFragment<4> q_held[F::kQInRegisters ? kKSteps : 1];
    if constexpr (F::kQInRegisters) {
      cp_async_wait<1>();
      __syncthreads();  // Q's rows came from every thread's copies
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        q_held[ks] = q_fragment<F>(q_lane + ks * 8 * 4, negate_q);
      }
    }

    float o[kDTiles][4] = {};
    float row_max[2] = {-INFINITY, -INFINITY};  // of raw scores, rows g (h = 0) and g + 8
    float row_sum[2] = {0.f, 0.f};              // this lane's part; summed over the quad at the end

    for (int block = 0; block < n_blocks; ++block) {
      const int parity = block & 1;
      cp_async_wait<0>();  // this thread's copies of block `block` (and Q) have landed
      if constexpr (F::kSplitKV) {
        float* const smem = reinterpret_cast<float*>(flash_f32_smem);
        split_rows_in_place<F, F::kBlockN, F::kKStride, F::kKFloats>(
            smem + (k_tiles + parity * kKBuffer - q_tile) / 4, tid);
        split_rows_in_place<F, F::kBlockN, F::kVStride, F::kVFloats>(
            smem + (v_tiles + parity * kVBuffer - q_tile) / 4, tid);
      }
      __syncthreads();  // everyone's copies have landed (and are split); every warp is done
                        // with block - 1
      if (block + 1 < n_blocks) {
        const int64_t next = static_cast<int64_t>(block + 1) * F::kBlockN;
        load_rows<F, F::kBlockN, F::kKStride>(k_tiles + (1 - parity) * kKBuffer,
                                              k + kv_b + next * D, S - next, tid);
        load_rows<F, F::kBlockN, F::kVStride>(v_tiles + (1 - parity) * kVBuffer,
                                              v + kv_b + next * D, S - next, tid);
      }
      cp_async_commit();  // possibly empty: keeps the group count uniform
      const int64_t n0 = static_cast<int64_t>(block) * F::kBlockN;
      const uint32_t k_block = k_lane + parity * kKBuffer;
      const uint32_t v_block = v_lane + parity * kVBuffer;

      // S = Q K^T: s[j] is the 16x8 tile of the warp's rows, keys n0 + 8 j.
      float s[kNTiles][4] = {};
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {  // dims 8 ks .. 8 ks + 7
        SplitFragment<4> a;
        if constexpr (F::kQInRegisters) {
          a = q_held[ks];
        } else {
          a = q_fragment<F>(q_lane + ks * 8 * 4, negate_q);
        }
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
          const uint32_t at = k_block + (j * 8 * F::kKStride + ks * 8) * 4;
          const float2 key = ld_shared_f32x2(at);
          SplitFragment<2> bk;
          if constexpr (F::kSplitKV) {
            const float2 key_lo = ld_shared_f32x2(at + F::kKFloats * 4);
            bk = {{__float_as_uint(key.x), __float_as_uint(key.y)},
                  {__float_as_uint(key_lo.x), __float_as_uint(key_lo.y)}};
          } else {
            split_tf32(key.x, bk.hi[0], bk.lo[0]);
            split_tf32(key.y, bk.hi[1], bk.lo[1]);
          }
          mma_3xtf32(s[j], a, bk);
        }
      }

      if (has_mask) {  // uniform: every block adds the mask's entries (rows past L: -inf)
        const bool pairs = mask_pairs && n0 + F::kBlockN <= S;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          add_mask_row<kNTiles>(s, 2 * h, mask_row[h], p, n0 + 2 * t, S - n0 - 2 * t,
                                m0 + warp_row0 + g + 8 * h < L, pairs, mask_scale);
        }
      }
      // Mask keys past S, and (causal) keys after the row.
      const bool tail = n0 + F::kBlockN > S;
      const bool diagonal = p.causal && n0 + F::kBlockN - 1 > m0;
      if (tail || diagonal) {  // uniform over the CTA
        // Key n0 + c is visible to warp-local row r iff c < key_limit and c <= diag + r.
        const int key_limit = static_cast<int>(min64(S - n0, F::kBlockN));
        int64_t diag64 = p.causal ? m0 + warp_row0 - n0 : F::kBlockN;
        diag64 = diag64 > F::kBlockN ? F::kBlockN : diag64;
        diag64 = diag64 < -F::kBlockM ? -F::kBlockM : diag64;
        const int diag = static_cast<int>(diag64);
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = g + 8 * (e >> 1);
            const int col = 8 * j + 2 * t + (e & 1);
            if (col >= key_limit || col > diag + row) {
              s[j][e] = -INFINITY;
            }
          }
        }
      }

      // Online softmax, as flash_forward_cta: new row max (quad reduction), P = 2^(s c - m c) in
      // place, the running sum rescaled by 2^(m_old c - m c).
      float rescale[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = row_max[h];
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
          mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
        }
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
        const float base = mx == -INFINITY ? 0.f : mx * unit;  // nothing visible yet: 0, not NaN
        const bool same = mx == row_max[h];
        rescale[h] = same ? 1.f : exp2_approx(fmaf(row_max[h], unit, -base));
        row_max[h] = mx;
        const int64_t row = m0 + warp_row0 + g + 8 * h;  // for dropout's bits
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < kNTiles; j += 4) {  // n-tiles j .. j + 3: one Philox block each
          float prob[4][2];
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              prob[jj][c] = exp2_approx(fmaf(s[j + jj][2 * h + c], unit, -base));
              sum += prob[jj][c];
            }
          }
          float2 z[4] = {};
          if (has_dropout) {
            dropout_factors<DropoutPair::kAlongKeys>(p, keep_scale, keep_threshold, b, row,
                                                     n0 + 8 * (j + slot) + 2 * t, slot, z);
          }
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            s[j + jj][2 * h] = has_dropout ? prob[jj][0] * z[jj].x : prob[jj][0];
            s[j + jj][2 * h + 1] = has_dropout ? prob[jj][1] * z[jj].y : prob[jj][1];
          }
        }
        row_sum[h] = row_sum[h] * rescale[h] + sum;
      }
      // O = O rescale + P V, P V of this block in accumulators of its own (see the header
      // comment): S's fragment of n-tile kk is the A operand of k-step kk as it is.
      float pv[kDTiles][4] = {};
#pragma unroll
      for (int kk = 0; kk < kNTiles; ++kk) {  // keys n0 + 8 kk .. + 7
        SplitFragment<4> pa;
        split_tf32(s[kk][0], pa.hi[0], pa.lo[0]);  // row g, key 2t
        split_tf32(s[kk][2], pa.hi[1], pa.lo[1]);  // row g + 8, key 2t
        split_tf32(s[kk][1], pa.hi[2], pa.lo[2]);  // row g, key 2t + 1
        split_tf32(s[kk][3], pa.hi[3], pa.lo[3]);  // row g + 8, key 2t + 1
#pragma unroll
        for (int dj = 0; dj < kDTiles; ++dj) {  // dims 8 dj .. + 7
          const uint32_t at = v_block + (kk * 8 * F::kVStride + dj * 8) * 4;
          SplitFragment<2> bv;
          if constexpr (F::kSplitKV) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {  // keys 2t, 2t + 1
              bv.hi[r] = __float_as_uint(ld_shared_f32(at + r * F::kVStride * 4));
              bv.lo[r] = __float_as_uint(ld_shared_f32(at + (F::kVFloats + r * F::kVStride) * 4));
            }
          } else {
            split_tf32(ld_shared_f32(at), bv.hi[0], bv.lo[0]);                     // key 2t
            split_tf32(ld_shared_f32(at + F::kVStride * 4), bv.hi[1], bv.lo[1]);  // key 2t + 1
          }
          mma_3xtf32(pv[dj], pa, bv);
        }
      }
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          o[j][e] = fmaf(o[j][e], rescale[e >> 1], pv[j][e]);
        }
      }
    }

    // Epilogue: O / rowsum and lse, straight from the accumulators. Copies still in flight only
    // when no block ran (S == 0): drain them before the next item's loads.
    cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[h];
      sum += __shfl_xor_sync(kFullMask, sum, 1);
      sum += __shfl_xor_sync(kFullMask, sum, 2);
      // 0 only when no key is visible (S == 0 or a mask hiding every key): zeros, lse -inf.
      const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
      const int64_t row = m0 + warp_row0 + g + 8 * h;
      if (row < L) {
        float* const out_row = out + (b * L + row) * D + 2 * t;
#pragma unroll
        for (int j = 0; j < kDTiles; ++j) {
          *reinterpret_cast<float2*>(out_row + 8 * j) =
              make_float2(o[j][2 * h] * inv_sum, o[j][2 * h + 1] * inv_sum);
        }
        if (t == 0) {
          lse[b * L + row] = sum > 0.f ? row_max[h] * unit * kLn2 + logf(sum) : -INFINITY;
        }
      }
    }
    __syncthreads();  // the next work item's copies overwrite Q, K and V
  }
#endif
}

// ------------------------------------------------------------------------ host launcher

namespace detail {

// Launches, or returns false having launched nothing.
template <class F>
bool launch_f32(const float* q, const float* k, const float* v, float* out, float* lse,
                const AttentionProblem& p, cudaStream_t stream) {
  auto* kernel = for_score_args(p, flash_forward_f32_kernel<F, kNoArgs>,
                                flash_forward_f32_kernel<F, kMaskOnly>,
                                flash_forward_f32_kernel<F, kMaskAndDropout>);
  if (!has_tensor_core_image(kernel)) {
    return false;
  }
  const int64_t work = p.batch * ceil_div(p.len_q, F::kBlockM);
  if (work <= 0) {
    return true;  // empty: nothing to launch
  }
  kernels::detail::allow_shared_memory(kernel, F::kSmemBytes);
  // longest_first_pays counts 2-byte elements: float32's K and V are twice as wide.
  const bool longest_first = p.causal && longest_first_pays(p.batch, p.len_kv, 2 * p.head_dim);
  kernel<<<kernels::detail::grid_for(work), F::kThreads, F::kSmemBytes, stream>>>(
      q, k, v, out, lse, p, longest_first);
  return true;
}

inline bool forward_f32(const float* q, const float* k, const float* v, float* out, float* lse,
                        const AttentionProblem& p, cudaStream_t stream) {
  if (!takes_tensor_cores(p)) {
    return false;
  }
  // 16-byte cp.async; 8-byte stores of O.
  if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(out)) {
    return false;
  }
  switch (p.head_dim) {
    case 64: return launch_f32<F32Tiling64>(q, k, v, out, lse, p, stream);
    case 128: return launch_f32<F32Tiling128>(q, k, v, out, lse, p, stream);
    default: return false;
  }
}

}  // namespace detail
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_FORWARD_F32_CUH_
