// The CTA of flash_forward.cuh's mma.sync forward: its tiling, shared memory and pipeline, the
// Tiling of each head dim, and flash_forward_cta, the body that flash_forward.cuh's kernel runs
// (and flash_forward_sm90.cuh's, in images without wgmma). What the launchers cover, the kernel
// and the launchers are in flash_forward.cuh.
//
// The function is the forward of attention_kernels.cuh: per batch item, query row i, visible
// key j (all keys, or j <= i when causal, top-left aligned):
//   o_i = sum_j softmax_j(scale q_i.k_j) v_j      lse_i = log sum_j exp(scale q_i.k_j)
// out (B, L, E) in the input dtype, lse (B, L) float32 (natural log).
//
// ---------------------------------------------------------------------------------- tiling
// A CTA is kWarps warps and owns kBlockM = 32 kWarps query rows of one batch item; warp w owns rows
// [32 w, 32 w + 32): two m-tiles of 16 rows (kMTiles = 2). kWarps = 4 (128 rows, FlashAttention-2's
// tile on H100) for D = 64 and causal D = 128; 8 (256 rows) for non-causal D = 128, where the 8
// warps share one copy of each K and V block: half the L2 reads and shared-memory fills per FLOP,
// 2% faster at S = 4096 (perf/NOTES.md, v10; causal, the larger diagonal blocks and fewer work
// items made it 3% slower). Either way 8 warps per SM. With 32 rows a warp uses every K and V
// fragment it reads from shared memory for two mma's, half the shared-memory traffic per FLOP of 16
// rows per warp (see perf/NOTES.md). The CTA loops over key blocks of kBlockN keys in shared memory
// (128 for D = 64, 64 for D = 128; one barrier each), in softmax steps of kSubN = 64 keys: two
// steps per block at D = 64, with the warp's Q fragments held in registers (32 of them, which the
// smaller step frees); one step per block at D = 128, Q read from shared memory at every k-step
// (held, it would take 64 registers more than there are). ptxas spills 0 (D = 64) and 80 (D = 128)
// bytes; the D = 128 step still measured 9% faster than half-size steps without spills
// (perf/NOTES.md, v5), and the D = 64 layout 2% faster than one 128-key step (v9):
//   S  = Q K^T          (kMTiles x kSubN/8 fp32 accumulator fragments per lane)
//   online softmax on S in registers: the row max m of the raw scores, P = 2^(s c - m c) with
//   c = |scale| log2(e), one FFMA and one ex2 per score (a negative scale negates Q in shared
//   memory first, so that the max of raw scores is the max of scaled ones)
//   P  = bf16/fp16(S)   reused in registers as the A operand, no shared-memory round trip
//   O += P V            (kMTiles x D/8 fp32 accumulator fragments per lane)
// O is rescaled only when some row of the warp has a new max (a warp vote): exact, since the
// factor is then 1 for every row, and most late steps skip those 2 kMTiles D / 8 multiplies.
// At the end O /= rowsum, lse = max + log(rowsum); O goes out through shared memory with
// 16-byte stores.
// Causal: key blocks wholly after the CTA's last row are never loaded, steps past it never
// computed; only steps that cross the diagonal (or the end of the keys) are masked, element by
// element. Work items (batch item, row block) go out in blockIdx order, and the block scheduler
// starts them about in that order. Causal row blocks differ in cost (row block m sees m + 1 key
// blocks), so where it pays (flash_common.cuh, longest_first_pays) they go longest first over
// the whole grid: every batch item's last row block, then every item's second-to-last, and so
// on, so that the last wave holds the shortest items (8-11% faster at S = 4096, perf/NOTES.md
// v6). Otherwise, and without causal masking (all items cost the same), batch-major, heaviest
// row block first: one batch item's row blocks run together and share its K and V in L2.
//
// Fragments: the layouts of mma.m16n8k16 and ldmatrix this kernel relies on are spelled out in
// flash_common.cuh's header comment.
//
// ----------------------------------------------------------------------- shared memory
// Tiles are row-major, D bf16/fp16 per row (128 or 256 bytes), in 16-byte chunks: chunk c of
// row r is stored at chunk position c ^ (r & 7) of that row (XOR swizzle, a permutation of
// each aligned group of 8 chunks). Every access is by 16-byte chunks or within one:
// - ldmatrix: the 8 lanes of one matrix give 8 consecutive rows (r & 7 = 0..7) at one logical
//   chunk, hence 8 distinct physical chunks of one 128-byte span: all 32 banks, no conflict.
// - cp.async and the output read-back: 8 consecutive lanes handle chunks 0..7 (or 8..15) of
//   one row: a permutation of 8 chunks, no conflict.
// - output staging (4-byte stores of C fragments): rows g = 0..7 at chunk j go to 8 distinct
//   chunks, t picks the word: 32 distinct banks.
// Shared memory per CTA: Q [kBlockM][D] + 2 x (K [kBlockN][D] + V [kBlockN][D]) (opt-in above
// 48 KB): D = 64: 16 + 2 x 32 = 80 KB; D = 128: 32 + 2 x 32 = 96 KB (4 warps, two CTAs per SM)
// or 64 + 2 x 32 = 128 KB (8 warps, one CTA per SM); D = 256 (4 warps of 16 rows, key blocks of
// 32): 32 + 2 x 32 = 96 KB.
//
// ---------------------------------------------------------------------------- pipeline
// cp.async.cg 16-byte copies (L2 only, no L1 allocation). Rows past the last row of Q, K or V
// get 16-byte zero stores instead: tails compute on zeros (masked scores, zero V rows, so
// P * V adds nothing and never NaN) and nothing past a tensor's end is read.
// K and V are double-buffered: the prologue loads Q and block 0; iteration j waits for its own
// copies (cp.async.wait_group 0), one __syncthreads makes block j visible to all warps AND
// proves that every warp is done with block j-1, whose buffer then receives block j+1's copies,
// in flight while block j is computed. One barrier per key block. The epilogue stages O in the
// warp's own rows of the Q tile (__syncwarp only); a barrier ends each work item.
//
// Registers (nvcc 13.0, sm_90): 255 per thread for all, with 80 (D = 128) and 0 (D = 64) bytes
// of spill; __launch_bounds__(32 kWarps, 8 / kWarps): 8 warps per SM.
// Sizes: int64_t for lengths and global offsets; work items loop over gridDim.x only.
#ifndef FIXED_FLASH_FORWARD_CTA_CUH_
#define FIXED_FLASH_FORWARD_CTA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_problem.cuh"  // AttentionProblem, ceil_div, min64, detail::grid_for, ...
#include "flash_common.cuh"       // PTX wrappers, swizzled tiles, load_tile

namespace fixed_attention {
namespace kernels {
namespace flash {

// kHeadDim: 64, 128 or 256 (E must equal it). kBlockN: keys per shared-memory block. kSubN:
// keys per softmax step. kMTiles: 16-row m-tiles per warp (2 is FlashAttention-2's tile; the
// code also takes 1). kQInRegisters: the warp's Q fragments are taken once per work item and held
// (kMTiles x kHeadDim / 4 registers) instead of loaded at every k-step. kWarps: 4 or 8 warps
// per CTA, sharing its K and V blocks.
template <int kHeadDim_, int kBlockN_, int kSubN_, int kMTiles_, bool kQInRegisters_, int kWarps_>
struct Tiling {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;  // keys per shared-memory block (one barrier each)
  static constexpr int kSubN = kSubN_;      // keys per softmax step (S registers: kSubN / 2)
  static constexpr int kSubBlocks = kBlockN / kSubN;
  static constexpr int kMTiles = kMTiles_;
  static constexpr bool kQInRegisters = kQInRegisters_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpRows = 16 * kMTiles;         // query rows per warp
  static constexpr int kBlockM = kWarps * kWarpRows;     // query rows per CTA
  static constexpr int kChunks = kHeadDim / 8;           // 16-byte chunks per row
  static constexpr int kKSteps = kHeadDim / 16;          // k-steps of S = Q K^T
  static constexpr int kNTiles = kSubN / 8;              // n-tiles of S (one step)
  static constexpr int kPSteps = kSubN / 16;             // k-steps of O += P V (one step)
  static constexpr int kDTiles = kHeadDim / 8;           // n-tiles of O
  static constexpr int kQElems = kBlockM * kHeadDim;     // elements of the Q tile
  static constexpr int kKVElems = kBlockN * kHeadDim;    // elements of one K or V buffer
  // Q + 2 buffers of K + 2 of V, 2 bytes per element.
  static constexpr std::size_t kSmemBytes = 2 * (kQElems + 4 * kKVElems);

  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256,
                "head dims 64, 128 and 256");
  static_assert(kSubN % 16 == 0 && kSubN >= 16 && kBlockN % kSubN == 0,
                "key blocks of whole softmax steps, steps of whole k-steps");
  static_assert(kMTiles == 1 || kMTiles == 2, "one or two m-tiles per warp");
  static_assert(kWarps == 4 || kWarps == 8, "8 warps per SM: two CTAs of 4 or one of 8");
  static_assert(kChunks >= 8, "the XOR swizzle permutes groups of 8 chunks");
  static_assert(kThreads % kChunks == 0 && 32 % kChunks == 0, "whole rows per copy pass");
  static_assert(kSmemBytes <= 227 * 1024, "over sm_90's 227 KB of shared memory per block");
};

// The variants the launchers use (see perf/NOTES.md, v5, v9 and v10, for the choice). At
// D = 128 the Q fragments would take 64 of the registers that O and S hold.
using Tiling64 = Tiling<64, 128, 64, 2, true, 4>;
using Tiling128 = Tiling<128, 64, 64, 2, false, 8>;        // non-causal
using Tiling128Causal = Tiling<128, 64, 64, 2, false, 4>;
// D = 256: O alone takes 128 registers at 16 rows per warp (FlashAttention-2's tile for 256 is
// 16 rows per warp too). Key blocks of 32 keep shared memory at 96 KB, under the 99 KB that
// sm_86 and sm_89 let one block opt into: every sm_80+ device runs it.
using Tiling256 = Tiling<256, 32, 32, 1, false, 4>;

// ------------------------------------------------------------------------------ kernel

// The whole CTA's work, every work item of the grid-stride loop. A device function so that the
// sm_90a kernel (flash_forward_sm90.cuh) can run it as its body in images without wgmma.
// kArgs: which of the mask and dropout it compiles (flash_common.cuh, ScoreArgs).
template <typename T, class F, int kArgs>
__device__ __forceinline__ void flash_forward_cta(const T* __restrict__ q,  // (B, L, D)
                                                  const T* __restrict__ k,  // (B, S, D)
                                                  const T* __restrict__ v,  // (B, S, D)
                                                  T* __restrict__ out,      // (B, L, D)
                                                  float* __restrict__ lse,  // (B, L)
                                                  const AttentionProblem p,
                                                  const bool longest_first) {
  constexpr int D = F::kHeadDim;
  constexpr int kMTiles = F::kMTiles, kNTiles = F::kNTiles, kDTiles = F::kDTiles;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;
  constexpr unsigned kFullMask = 0xffffffffu;
  extern __shared__ uint4 flash_smem[];  // 16-byte aligned
  const uint32_t q_tile = smem_addr(flash_smem);
  const uint32_t k_tiles = q_tile + F::kQElems * 2;       // 2 buffers of kKVElems
  const uint32_t v_tiles = k_tiles + 2 * F::kKVElems * 2;  // 2 buffers of kKVElems

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;  // fragment row (groupID)
  const int t = lane & 3;   // fragment column pair (threadID_in_group)
  const int warp_row0 = warp * F::kWarpRows;  // first row of this warp in the CTA's tile

  // Per-lane ldmatrix addresses, at chunk pair 0 (see the header comment). Every 8-lane group
  // gives 8 consecutive rows starting at a multiple of 8, so each row's swizzle key is
  // lane & 7, and logical chunk 2s + c sits at physical chunk (c ^ (lane & 7)) ^ 2s.
  const int x = lane & 7;
  // Q (A operand) and V (B operand, .trans): row lane & 15, chunk lane >> 4.
  const uint32_t qv_chunk = static_cast<uint32_t>((lane >> 4) ^ x);
  const uint32_t q_lane = q_tile + static_cast<uint32_t>((warp_row0 + (lane & 15)) * D * 2);
  const uint32_t v_lane = v_tiles + static_cast<uint32_t>((lane & 15) * D * 2);
  // K (B operand): row (lane & 7) + 8 (lane >> 4), chunk (lane >> 3) & 1.
  const uint32_t k_chunk = static_cast<uint32_t>(((lane >> 3) & 1) ^ x);
  const uint32_t k_lane = k_tiles + static_cast<uint32_t>((x + ((lane >> 4) << 3)) * D * 2);

  const int64_t L = p.len_q, S = p.len_kv;
  const int64_t row_blocks = ceil_div(L, F::kBlockM);
  // Scores stay unscaled: 2^(s c - m c) is one FFMA per score, with m the row max of the raw
  // scores. That needs c > 0: a negative scale negates Q instead (exact: a sign bit), and a zero
  // one becomes FLT_MIN (same probabilities, all 1; 0 would make masked scores -inf * 0 = NaN).
  const bool negate_q = p.scale < 0.f;
  const float scale_log2 = fmaxf(fabsf(p.scale) * kLog2e, FLT_MIN);
  // With a mask, scores are scaled when the mask is added (s c + mask log2(e), c exact, 0 for a
  // zero scale): the softmax's unit is then 1. Without one they stay raw, unit c. Dropout scales
  // the probabilities that go into P V, not the row sums (lse is the undropped softmax's).
  const bool has_mask = kArgs != kNoArgs && p.mask != nullptr;
  const bool has_dropout = kArgs == kMaskAndDropout && p.dropout_p > 0.f;
  const float unit = has_mask ? 1.f : scale_log2;
  const float mask_scale = fabsf(p.scale) * kLog2e;
  const float keep_scale = dropout_scale(p.dropout_p);
  const uint32_t keep_threshold = dropout::threshold(p.dropout_p);
  const int slot = 2 * (g & 1) + (t & 1);  // the lane's place among those sharing Philox blocks
  static_assert(kNTiles % 4 == 0, "dropout's Philox blocks span four n-tiles' keys");
  const bool mask_pairs = has_mask && mask_in_pairs(p);

  for (int64_t item = blockIdx.x; item < p.batch * row_blocks; item += gridDim.x) {
    const int64_t b = longest_first ? item % p.batch : item / row_blocks;
    const int64_t rank = longest_first ? item / p.batch : item % row_blocks;  // 0: the longest
    const int64_t m0 = (row_blocks - 1 - rank) * F::kBlockM;
    // This thread's rows of the mask (g and g + 8 of each m-tile), clamped inside it.
    const float* mask_row[kMTiles][2] = {};
    if (has_mask) {
      const float* const mask_b = mask_rows(p, b);
      for (int mi = 0; mi < kMTiles; ++mi) {
        for (int h = 0; h < 2; ++h) {
          mask_row[mi][h] =
              mask_b + min64(m0 + warp_row0 + 16 * mi + g + 8 * h, L - 1) * p.mask_stride_row;
        }
      }
    }
    // Batch item b's K and V (under GQA, its group's), as an offset: one register pair
    const int64_t kv_b = (b / p.kv_group) * S * D;
    // Keys this CTA's rows can see: causal rows m0..min(m0 + kBlockM, L) - 1 stop there.
    const int64_t key_end = p.causal ? min64(S, min64(m0 + F::kBlockM, L)) : S;
    // Fits an int: S keys of D 2-byte elements are in device memory, S / kBlockN < 2^31.
    const int n_blocks = static_cast<int>(ceil_div(key_end, F::kBlockN));
    const int n_steps = static_cast<int>(ceil_div(key_end, F::kSubN));  // softmax steps

    // Prologue: Q (group 0), K and V of block 0 into buffer 0 (group 1).
    load_tile<F, F::kBlockM>(q_tile, q + (b * L + m0) * D, L - m0, tid);
    cp_async_commit();
    load_tile<F, F::kBlockN>(k_tiles, k + kv_b, S, tid);
    load_tile<F, F::kBlockN>(v_tiles, v + kv_b, S, tid);
    cp_async_commit();

    // Once Q has landed (K and V still in flight): negate it if the scale is negative, and take
    // its A fragments for S = Q K^T if they are held.
    uint32_t q_frag[F::kQInRegisters ? kMTiles : 1][F::kQInRegisters ? F::kKSteps : 1][4];
    if (F::kQInRegisters || negate_q) {
      cp_async_wait<1>();
      __syncthreads();  // Q's rows came from every thread's copies
    }
    if (negate_q) {  // uniform; the warp's own rows: the only ones it reads, and stages O in
      uint4* const warp_q = flash_smem + warp_row0 * F::kChunks;
      for (int c = lane; c < F::kWarpRows * F::kChunks; c += 32) {
        uint4 bits = warp_q[c];
        bits.x ^= 0x80008000u;  // the sign bit of both 2-byte elements
        bits.y ^= 0x80008000u;
        bits.z ^= 0x80008000u;
        bits.w ^= 0x80008000u;
        warp_q[c] = bits;
      }
      __syncwarp();
    }
    if constexpr (F::kQInRegisters) {
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
        for (int ks = 0; ks < F::kKSteps; ++ks) {
          const uint32_t pair = static_cast<uint32_t>(2 * ks);
          ldmatrix_x4(q_frag[mi][ks], q_lane + mi * 16 * D * 2 + ((qv_chunk ^ pair) << 4));
        }
      }
    }

    float o[kMTiles][kDTiles][4];
    float row_max[kMTiles][2];  // of raw scores, per fragment row g (h = 0) and g + 8 (h = 1)
    float row_sum[kMTiles][2];  // this lane's partial sum; reduced over the quad at the end
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          o[mi][j][e] = 0.f;
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max[mi][h] = -INFINITY;
        row_sum[mi][h] = 0.f;
      }
    }

    for (int block = 0; block < n_blocks; ++block) {
      const uint32_t buf = static_cast<uint32_t>(block & 1) * F::kKVElems * 2;
      cp_async_wait<0>();  // this thread's copies of block `block` (and Q) have landed
      __syncthreads();     // everyone's have; and every warp is done with block - 1
      if (block + 1 < n_blocks) {
        const int64_t next = static_cast<int64_t>(block + 1) * F::kBlockN;
        const uint32_t other = F::kKVElems * 2 - buf;
        load_tile<F, F::kBlockN>(k_tiles + other, k + kv_b + next * D, S - next, tid);
        load_tile<F, F::kBlockN>(v_tiles + other, v + kv_b + next * D, S - next, tid);
      }
      cp_async_commit();  // possibly empty: keeps the group count uniform

      // Unrolled: at D = 64 (two steps per block) 10% faster than a loop (perf/NOTES.md, v9).
#pragma unroll
      for (int sub = 0; sub < F::kSubBlocks; ++sub) {
        if (block * F::kSubBlocks + sub >= n_steps) {
          break;  // uniform: the rest of this block is past S or after every row (causal)
        }
        const int64_t n0 = static_cast<int64_t>(block) * F::kBlockN + sub * F::kSubN;
        const uint32_t k_sub = k_lane + buf + sub * F::kSubN * D * 2;
        const uint32_t v_sub = v_lane + buf + sub * F::kSubN * D * 2;

        // S = Q K^T: s[mi][j] is the 16x8 tile of rows warp_row0 + 16 mi, keys n0 + 8 j.
        float s[kMTiles][kNTiles][4];
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
          for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              s[mi][j][e] = 0.f;
            }
          }
        }
#pragma unroll
        for (int ks = 0; ks < F::kKSteps; ++ks) {  // d = 16 ks .. 16 ks + 15
          const uint32_t pair = static_cast<uint32_t>(2 * ks);
          uint32_t a[kMTiles][4];
#pragma unroll
          for (int mi = 0; mi < kMTiles; ++mi) {
            if constexpr (F::kQInRegisters) {
#pragma unroll
              for (int r = 0; r < 4; ++r) {
                a[mi][r] = q_frag[mi][ks][r];
              }
            } else {
              ldmatrix_x4(a[mi], q_lane + mi * 16 * D * 2 + ((qv_chunk ^ pair) << 4));
            }
          }
#pragma unroll
          for (int np = 0; np < kNTiles / 2; ++np) {  // keys n0 + 16 np .. + 15
            uint32_t bk[4];
            ldmatrix_x4(bk, k_sub + np * 16 * D * 2 + ((k_chunk ^ pair) << 4));
#pragma unroll
            for (int mi = 0; mi < kMTiles; ++mi) {
              mma_16816<T>(s[mi][2 * np], a[mi], bk[0], bk[1]);
              mma_16816<T>(s[mi][2 * np + 1], a[mi], bk[2], bk[3]);
            }
          }
        }

        if (has_mask) {  // uniform: every step adds the mask's entries (rows past L: -inf)
          const bool pairs = mask_pairs && n0 + F::kSubN <= S;
#pragma unroll
          for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              add_mask_row<kNTiles>(s[mi], 2 * h, mask_row[mi][h], p, n0 + 2 * t,
                                    S - n0 - 2 * t, m0 + warp_row0 + 16 * mi + g + 8 * h < L,
                                    pairs, mask_scale);
            }
          }
        }
        // Mask keys past S, and (causal) keys after the row.
        const bool tail = n0 + F::kSubN > S;
        const bool diagonal = p.causal && n0 + F::kSubN - 1 > m0;
        if (tail || diagonal) {  // uniform over the CTA
          // Key n0 + c is visible to warp-local row r iff c < key_limit and c <= diag + r.
          const int key_limit = static_cast<int>(min64(S - n0, F::kSubN));
          int64_t diag64 = p.causal ? m0 + warp_row0 - n0 : F::kSubN;
          diag64 = diag64 > F::kSubN ? F::kSubN : diag64;
          diag64 = diag64 < -F::kBlockM ? -F::kBlockM : diag64;
          const int diag = static_cast<int>(diag64);
#pragma unroll
          for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
            for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int row = 16 * mi + g + 8 * (e >> 1);  // warp-local
                const int col = 8 * j + 2 * t + (e & 1);    // key - n0
                if (col >= key_limit || col > diag + row) {
                  s[mi][j][e] = -INFINITY;
                }
              }
            }
          }
        }

        // Online softmax: new row max (quad reduction), P = 2^((s - max) c) in place, running
        // sum rescaled by 2^((old max - new max) c), c = |scale| log2(e).
        float rescale[kMTiles][2];
        bool grew = false;
#pragma unroll
        for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float mx = row_max[mi][h];
#pragma unroll
            for (int j = 0; j < kNTiles; ++j) {
              mx = fmaxf(mx, fmaxf(s[mi][j][2 * h], s[mi][j][2 * h + 1]));
            }
            mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
            // Nothing visible yet: subtract 0, so that 2^(-inf c - 0) = 0 rather than NaN.
            const float base = mx == -INFINITY ? 0.f : mx * unit;
            const bool same = mx == row_max[mi][h];
            grew = grew || !same;
            // Exactly 1 when the max stayed; 0 on the first block (old max -inf).
            rescale[mi][h] = same ? 1.f : exp2_approx(fmaf(row_max[mi][h], unit, -base));
            row_max[mi][h] = mx;
            const int64_t row = m0 + warp_row0 + 16 * mi + g + 8 * h;  // for dropout's bits
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < kNTiles; j += 4) {  // n-tiles j .. j + 3
              float prob[4][2];
#pragma unroll
              for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                  prob[jj][c] = exp2_approx(fmaf(s[mi][j + jj][2 * h + c], unit, -base));
                  sum += prob[jj][c];
                }
              }
              float2 z[4] = {};
              if (has_dropout) {  // keys 8 (j + jj) + 2 t, + 1 of this row: block jj
                dropout_factors<DropoutPair::kAlongKeys>(p, keep_scale, keep_threshold, b, row,
                                                         n0 + 8 * (j + slot) + 2 * t, slot, z);
              }
#pragma unroll
              for (int jj = 0; jj < 4; ++jj) {
                s[mi][j + jj][2 * h] = has_dropout ? prob[jj][0] * z[jj].x : prob[jj][0];
                s[mi][j + jj][2 * h + 1] = has_dropout ? prob[jj][1] * z[jj].y : prob[jj][1];
              }
            }
            row_sum[mi][h] = row_sum[mi][h] * rescale[mi][h] + sum;
          }
        }
        // Rescale O only when some row of the warp has a new max (a warp-uniform branch; late
        // blocks rarely raise the max), skipping 2 kMTiles kDTiles multiplies by exactly 1.
        if (__any_sync(kFullMask, grew)) {
#pragma unroll
          for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
            for (int j = 0; j < kDTiles; ++j) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                o[mi][j][e] *= rescale[mi][e >> 1];
              }
            }
          }
        }

        // O += P V: P's C fragments become A fragments (16 keys per k-step), V by .trans.
#pragma unroll
        for (int kk = 0; kk < F::kPSteps; ++kk) {  // keys n0 + 16 kk .. + 15
          uint32_t pa[kMTiles][4];
#pragma unroll
          for (int mi = 0; mi < kMTiles; ++mi) {
            pa[mi][0] = pack2<T>(s[mi][2 * kk][0], s[mi][2 * kk][1]);
            pa[mi][1] = pack2<T>(s[mi][2 * kk][2], s[mi][2 * kk][3]);
            pa[mi][2] = pack2<T>(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
            pa[mi][3] = pack2<T>(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
          }
#pragma unroll
          for (int dp = 0; dp < kDTiles / 2; ++dp) {  // d = 16 dp .. + 15
            uint32_t bv[4];
            ldmatrix_x4_trans(bv, v_sub + kk * 16 * D * 2 +
                                      ((qv_chunk ^ static_cast<uint32_t>(2 * dp)) << 4));
#pragma unroll
            for (int mi = 0; mi < kMTiles; ++mi) {
              mma_16816<T>(o[mi][2 * dp], pa[mi], bv[0], bv[1]);
              mma_16816<T>(o[mi][2 * dp + 1], pa[mi], bv[2], bv[3]);
            }
          }
        }
      }
    }

    // Epilogue. Copies still in flight only when no block ran (S == 0): drain them before the
    // Q tile is reused for staging.
    cp_async_wait<0>();
    const int64_t warp_first_row = m0 + warp_row0;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float sum = row_sum[mi][h];
        sum += __shfl_xor_sync(kFullMask, sum, 1);
        sum += __shfl_xor_sync(kFullMask, sum, 2);
        // sum >= 1 whenever a key is visible (the max contributes 2^0); 0 only when S == 0 or
        // the mask hides every key: zeros and lse = -inf, as the generic kernels.
        const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
        for (int j = 0; j < kDTiles; ++j) {
          o[mi][j][2 * h] *= inv_sum;
          o[mi][j][2 * h + 1] *= inv_sum;
        }
        const int64_t row = warp_first_row + 16 * mi + g + 8 * h;
        if (t == 0 && row < L) {
          lse[b * L + row] = sum > 0.f ? row_max[mi][h] * unit * kLn2 + logf(sum) : -INFINITY;
        }
      }
    }

    // O through this warp's own rows of the Q tile (only this warp ever read them), then
    // 16-byte coalesced stores of whole rows.
    __syncwarp();  // every lane's last ldmatrix of Q is done
    unsigned char* const smem_bytes = reinterpret_cast<unsigned char*>(flash_smem);
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp_row0 + 16 * mi + g + 8 * h;  // row & 7 == g
#pragma unroll
        for (int j = 0; j < kDTiles; ++j) {
          const uint32_t offset = swizzled<D>(row, j) + 4 * t;  // columns 8 j + 2 t, + 1
          const uint32_t bits = pack2<T>(o[mi][j][2 * h], o[mi][j][2 * h + 1]);
          *reinterpret_cast<uint32_t*>(smem_bytes + offset) = bits;
        }
      }
    }
    __syncwarp();
    constexpr int kRowsPerStep = 32 / F::kChunks;  // rows one warp-wide step copies
    static_assert(32 % F::kChunks == 0 && F::kWarpRows % kRowsPerStep == 0, "whole rows");
#pragma unroll
    for (int step = 0; step < F::kWarpRows / kRowsPerStep; ++step) {
      const int local = step * kRowsPerStep + lane / F::kChunks;
      const int chunk = lane % F::kChunks;
      const int row = warp_row0 + local;
      const uint4 bits = *reinterpret_cast<const uint4*>(smem_bytes + swizzled<D>(row, chunk));
      const int64_t global_row = m0 + row;
      if (global_row < L) {
        *reinterpret_cast<uint4*>(out + (b * L + global_row) * D + chunk * 8) = bits;
      }
    }
    __syncthreads();  // the next work item's copies overwrite Q, K and V tiles
  }
}

}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_FORWARD_CTA_CUH_
