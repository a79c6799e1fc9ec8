// The forward for Hopper (compute capability 9.0), bf16/fp16, head dims 64, 128 and 256: the
// algorithm of flash_forward.cuh (same online softmax on raw scores, same masks, same work
// order, the same output bits in every case the kernels were compared on) with both matrix
// products on warpgroup MMA (wgmma.mma_async, sm_90a; wrappers and operand layouts in
// wgmma.cuh). A wgmma reads its B operand, and here also A of S = Q K^T, straight from shared
// memory, without the ldmatrix round trips through registers that mma.sync needs: at S = 4096
// on an H200, 1.4x the mma.sync kernel at D = 128 and 1.06x at D = 64 (perf/NOTES.md, v11).
//
// The launcher takes bf16/fp16 on a device of compute capability 9.0 and declines everything
// else (the caller then tries flash_forward.cuh). Every problem goes to the warp-specialized
// kernel of flash_forward_sm90_ws.cuh first (TMA producer, ping-pong; 1.1-1.2x this one; head
// dims up to 256 read as they are), this kernel taking what it declines at head dim 64, 128 or
// 256 (flash_common.cuh's takes_tensor_cores: GQA, a mask and dropout included; key blocks a
// mask hides entirely are skipped): a mask TMA cannot read, an image without sm_90a; the glue
// pads other head dims to one of those. At 256 O is 128 registers per thread, one CTA per SM,
// and P V two m64n128k16 products per k-step. The wgmma body exists only in an sm_90a image
// (fixed/_build.py compiles sm_90a wherever the arch list has 9.0). In any other image the
// kernel runs flash_forward.cuh's mma.sync body with a tiling of the same CTA shape: slower,
// never wrong.
//
// No torch includes: CI compile-checks this header for sm_90a and sm_90 without a GPU.
//
// ---------------------------------------------------------------------------------- tiling
// A CTA is 2 warpgroups (8 warps, 256 threads) and owns kBlockM = 128 query rows of one batch
// item: warpgroup wg rows [64 wg, 64 wg + 64), its warp w rows 16 w .. 16 w + 15 of those. Key
// blocks of kBlockN = 64 keys, double-buffered by cp.async exactly as in flash_forward.cuh (one
// barrier per block). Per key block and warpgroup:
//   S (64 x 64, 32 f32 per thread) = Q K^T: D / 16 wgmma m64n64k16, Q and K from shared memory
//   online softmax in registers, P = 2^(s c - m c), as flash_forward.cuh
//   O (64 x D, D / 2 f32 per thread) += P V: 4 wgmma m64nDk16, P from registers (the S
//     accumulator packed in pairs is the A fragment), V from shared memory
// Each product is waited for before its result is used: no overlap of softmax and MMA across
// warpgroups (FlashAttention-3's ping-pong) and no producer warp or TMA; the warp-specialized
// kernel (flash_forward_sm90_ws.cuh) has those. Two
// CTAs per SM (D = 128: 97 KB of shared memory, 128 registers;
// D = 64: 49 KB, 100 registers). Shared memory, 128-byte swizzle (wgmma.cuh), each tile stored
// as D / 64 [rows][64] halves of the head dim: at D = 128 Q 32 KB, K and V 2 x 16 KB each; 1 KB
// more to align the base to 1024 bytes.
#ifndef FIXED_FLASH_FORWARD_SM90_CUH_
#define FIXED_FLASH_FORWARD_SM90_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstddef>
#include <cstdint>

#include "attention_problem.cuh"  // AttentionProblem, ceil_div, min64, detail::grid_for, ...
#include "flash_common.cuh"       // cp.async, exp2, pack2, longest_first_pays, ...
#include "flash_forward.cuh"      // flash_forward_cta: the body of images without wgmma
#include "flash_forward_sm90_ws.cuh"  // the warp-specialized kernel, tried first
#include "wgmma.cuh"              // wgmma.mma_async and descriptors

namespace fixed_attention {
namespace kernels {
namespace flash {
namespace sm90 {

// The CTA's shape for head dim 64, 128 or 256.
template <int kHeadDim_>
struct Tile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // 2 warpgroups x 64 rows
  static constexpr int kBlockN = 64;
  static constexpr int kThreads = 256;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  static constexpr int kNTiles = kBlockN / 8;   // 8-key column tiles of S per warp
  static constexpr int kDTiles = kHeadDim / 8;  // 8-wide column tiles of O per warp
  static constexpr uint32_t kRowBytes = 128;    // one 64-element half row
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * 2;   // 32 KB at D = 128
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * 2;  // 16 KB per K or V buffer
  // The mma.sync body of other images: 8 warps of one 16-row m-tile, the same 128-row CTA.
  using Fallback = Tiling<kHeadDim, 64, 64, 1, false, 8>;
  static constexpr std::size_t kWgmmaSmemBytes = kQBytes + 4 * kKVBytes + 1024;
  static constexpr std::size_t kSmemBytes = kWgmmaSmemBytes > Fallback::kSmemBytes
                                                ? kWgmmaSmemBytes
                                                : Fallback::kSmemBytes;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256,
                "one, two or four 64-element parts per row");
  static_assert(Fallback::kBlockM == kBlockM && Fallback::kThreads == kThreads);
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of kRows rows stored as
// [D / 64][kRows][64] (64-element halves of the head dim) with the 128-byte swizzle.
template <int kRows>
__device__ __forceinline__ uint32_t sw128_offset(int row, int chunk) {
  constexpr uint32_t kRowBytes = 128;
  return static_cast<uint32_t>((chunk >> 3) * kRows * kRowBytes + row * kRowBytes +
                               (((chunk & 7) ^ (row & 7)) << 4));
}

// Copies rows [0, valid_rows) of a (rows, D) tile, zeros the rest (tails compute on zeros and
// read nothing past a tensor's end, as in flash_forward.cuh). `columns` (a multiple of 8, at most
// D): the source's row length, whose chunks fill the tile's first columns, zeros the rest (a head
// dim read as it is).
template <class F, int kRows, typename T>
__device__ __forceinline__ void load_tile_sw128(uint32_t tile, const T* src, int64_t valid_rows,
                                                int tid, int columns = F::kHeadDim) {
  constexpr int kChunks = F::kChunks;
  constexpr int kRowsPerPass = F::kThreads / kChunks;
  const int chunk = tid % kChunks;
  const int valid = static_cast<int>(valid_rows < kRows ? valid_rows : kRows);
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const int row = pass * kRowsPerPass + tid / kChunks;
    const uint32_t to = tile + sw128_offset<kRows>(row, chunk);
    if (row < valid && chunk * 8 < columns) {
      cp_async_16(to, src + static_cast<int64_t>(row) * columns + chunk * 8);
    } else {
      st_shared_zero_16(to);
    }
  }
}

// The wgmma body: every work item of the grid-stride loop (sm_90a images only). kArgs: the
// instantiation that reads the mask and draws dropout, as flash_forward_cta's.
template <typename T, class F, int kArgs>
__device__ __forceinline__ void wgmma_forward_cta(const T* __restrict__ q, const T* __restrict__ k,
                                                  const T* __restrict__ v, T* __restrict__ out,
                                                  float* __restrict__ lse,
                                                  const AttentionProblem p,
                                                  const bool longest_first) {
  constexpr int D = F::kHeadDim, kBlockM = F::kBlockM, kBlockN = F::kBlockN;
  constexpr int kNTiles = F::kNTiles, kDTiles = F::kDTiles, kThreads = F::kThreads;
  constexpr int kChunks = F::kChunks;
  constexpr uint32_t kRowBytes = F::kRowBytes, kKVBytes = F::kKVBytes;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr float kLn2 = 0.6931471805599453f;
  constexpr unsigned kFullMask = 0xffffffffu;
  extern __shared__ uint4 sm90_smem[];
  unsigned char* const smem_bytes = reinterpret_cast<unsigned char*>(sm90_smem);
  const uint32_t smem_base = smem_addr(sm90_smem);
  const uint32_t q_tile = (smem_base + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
  const uint32_t k_tiles = q_tile + F::kQBytes;     // 2 buffers of kKVBytes
  const uint32_t v_tiles = k_tiles + 2 * kKVBytes;  // 2 buffers of kKVBytes

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  // Read from lane 0: the compiler then knows it is the same across the warp, and keeps the
  // descriptor arithmetic that depends on it in uniform registers (CUTLASS does the same): 1-3%
  // faster at both head dims, and D = 128's 4-byte spill is gone (perf/NOTES.md, v15).
  const int warpgroup = __shfl_sync(0xffffffffu, warp >> 2, 0);
  const int g = lane >> 2;  // fragment row (groupID)
  const int t = lane & 3;   // fragment column pair (threadID_in_group)
  const int warp_row0 = warpgroup * 64 + (warp & 3) * 16;  // this warp's first row in the CTA
  // This warpgroup's 64 Q rows: 8 swizzle atoms, in each half of the head dim.
  const uint32_t q_rows = q_tile + static_cast<uint32_t>(warpgroup * 64) * kRowBytes;

  const int64_t L = p.len_q, S = p.len_kv;
  const int64_t row_blocks = ceil_div(L, kBlockM);
  // As flash_forward.cuh: raw scores, c = |scale| log2(e) > 0, a negative scale negates Q.
  const bool negate_q = p.scale < 0.f;
  const float scale_log2 = fmaxf(fabsf(p.scale) * kLog2e, FLT_MIN);
  // The mask and dropout as in flash_forward_cta: masked scores are scaled (unit 1).
  const bool has_mask = kArgs != kNoArgs && p.mask != nullptr;
  const bool has_dropout = kArgs == kMaskAndDropout && p.dropout_p > 0.f;
  const float unit = has_mask ? 1.f : scale_log2;
  const float mask_scale = fabsf(p.scale) * kLog2e;
  const float keep_scale = dropout_scale(p.dropout_p);
  const uint32_t keep_threshold = dropout::threshold(p.dropout_p);
  const int slot = 2 * (g & 1) + (t & 1);  // the lane's place among those sharing Philox blocks
  static_assert(kNTiles % 4 == 0, "dropout's Philox blocks span four n-tiles' keys");
  const bool mask_pairs = has_mask && mask_in_pairs(p);
  const bool skips = kArgs != kNoArgs && skips_hidden_blocks(p);

  for (int64_t item = blockIdx.x; item < p.batch * row_blocks; item += gridDim.x) {
    const int64_t b = longest_first ? item % p.batch : item / row_blocks;
    const int64_t rank = longest_first ? item / p.batch : item % row_blocks;  // 0: the longest
    const int64_t m0 = (row_blocks - 1 - rank) * kBlockM;
    // This thread's two rows of the mask (g and g + 8 of the warp), clamped inside it.
    const float* mask_row[2] = {nullptr, nullptr};
    if (has_mask) {
      const float* const mask_b = mask_rows(p, b);
      for (int h = 0; h < 2; ++h) {
        mask_row[h] = mask_b + min64(m0 + warp_row0 + g + 8 * h, L - 1) * p.mask_stride_row;
      }
    }
    const int64_t kv_b = (b / p.kv_group) * S * D;  // under GQA, its group's K and V
    const int64_t key_end = p.causal ? min64(S, min64(m0 + kBlockM, L)) : S;
    const int n_blocks = static_cast<int>(ceil_div(key_end, kBlockN));
    // The next key block after `block` that the mask does not hide entirely (n_blocks: none);
    // without a map of hidden tiles, block + 1.
    const auto next_visible = [&](int block) {
      do {
        ++block;
      } while (skips && block < n_blocks &&
               hidden_block(p, b, m0, kBlockM, static_cast<int64_t>(block) * kBlockN, kBlockN));
      return block;
    };
    int block = next_visible(-1);

    load_tile_sw128<F, kBlockM>(q_tile, q + (b * L + m0) * D, L - m0, tid);
    cp_async_commit();
    const int64_t first_key = static_cast<int64_t>(block) * kBlockN;
    load_tile_sw128<F, kBlockN>(k_tiles, k + kv_b + first_key * D, S - first_key, tid);
    load_tile_sw128<F, kBlockN>(v_tiles, v + kv_b + first_key * D, S - first_key, tid);
    cp_async_commit();
    if (negate_q) {  // uniform; each thread flips the chunks of Q it copied itself
      cp_async_wait<1>();
      const int chunk = tid % kChunks;
      for (int row = tid / kChunks; row < kBlockM; row += kThreads / kChunks) {
        uint4* const at = reinterpret_cast<uint4*>(smem_bytes + (q_tile - smem_base) +
                                                   sw128_offset<kBlockM>(row, chunk));
        uint4 bits = *at;
        bits.x ^= 0x80008000u;  // the sign bit of both 2-byte elements
        bits.y ^= 0x80008000u;
        bits.z ^= 0x80008000u;
        bits.w ^= 0x80008000u;
        *at = bits;
      }
    }

    float o[kDTiles * 4];
#pragma unroll
    for (int i = 0; i < kDTiles * 4; ++i) {
      o[i] = 0.f;
    }
    sm90_ws::Rows rows{m0, warp_row0, g, t, {-INFINITY, -INFINITY}, {0.f, 0.f}};

    for (int it = 0; block < n_blocks; ++it) {
      const uint32_t buffer = static_cast<uint32_t>(it & 1) * kKVBytes;
      cp_async_wait<0>();
      fence_proxy_async_shared();  // this thread's copies (and Q's sign flips) to wgmma
      __syncthreads();  // block visible to all warps; every warp done with the other buffer
      const int following = next_visible(block);
      if (following < n_blocks) {
        const int64_t next = static_cast<int64_t>(following) * kBlockN;
        const uint32_t other = kKVBytes - buffer;
        load_tile_sw128<F, kBlockN>(k_tiles + other, k + kv_b + next * D, S - next, tid);
        load_tile_sw128<F, kBlockN>(v_tiles + other, v + kv_b + next * D, S - next, tid);
      }
      cp_async_commit();
      const int64_t n0 = static_cast<int64_t>(block) * kBlockN;

      // S = Q K^T. k-step ks covers head dims 16 ks .. 16 ks + 15: half ks / 4 of the tile, 32
      // bytes into each 128-byte row.
      float s[kNTiles * 4];
      wgmma_fence();
      const TileDescriptor q_desc(q_rows, 16, 1024), k_desc(k_tiles + buffer, 16, 1024);
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        const uint32_t half = static_cast<uint32_t>(ks >> 2);
        const uint32_t step = static_cast<uint32_t>(ks & 3) * 32;
        wgmma_m64n64k16_ss<T>(s, q_desc.at(half * kBlockM * kRowBytes + step),
                              k_desc.at(half * kBlockN * kRowBytes + step), ks > 0);
      }
      wgmma_commit_group();
      // Dropout's keep bits for this block, drawn while the product runs (the Philox rounds
      // are otherwise a serial chain the softmax waits on): kept[h][jq] bit 2 jj + c is key
      // 8 (4 jq + jj) + 2 t + c of row g + 8 h.
      uint32_t kept[2][kNTiles / 4];
      if (has_dropout) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int jq = 0; jq < kNTiles / 4; ++jq) {
            kept[h][jq] = dropout_keep_bits<DropoutPair::kAlongKeys>(
                p, keep_threshold, b, m0 + warp_row0 + g + 8 * h,
                n0 + 8 * (4 * jq + slot) + 2 * t, slot);
          }
        }
      }
      // A mask's entries for this block, read in pairs while the product runs: their latency is
      // what a mask costs (ncu: long-scoreboard stalls).
      const bool pairs = mask_pairs && n0 + kBlockN <= S;  // uniform
      float2 entries[kArgs == kNoArgs ? 1 : 2][kNTiles];
      if (pairs) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float2* const at = reinterpret_cast<const float2*>(mask_row[h] + n0 + 2 * t);
#pragma unroll
          for (int j = 0; j < kNTiles; ++j) {
            entries[h][j] = __ldg(at + 4 * j);
          }
        }
      }
      wgmma_wait_group<0>();
      wgmma_fence_operands(s);
      if (pairs) {  // scaled scores plus the mask, in log2 units; -inf for rows past L
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const bool row_inside = m0 + warp_row0 + g + 8 * h < L;
#pragma unroll
          for (int j = 0; j < kNTiles; ++j) {
            float& s0 = s[4 * j + 2 * h];
            float& s1 = s[4 * j + 2 * h + 1];
            s0 = row_inside ? fmaf(s0, mask_scale, entries[h][j].x * kLog2e) : -INFINITY;
            s1 = row_inside ? fmaf(s1, mask_scale, entries[h][j].y * kLog2e) : -INFINITY;
          }
        }
      } else if (has_mask) {  // a tail block, or a mask read element by element
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          add_mask_row<kNTiles>(s, 2 * h, mask_row[h], p, n0 + 2 * t, S - n0 - 2 * t,
                                m0 + warp_row0 + g + 8 * h < L, false, mask_scale);
        }
      }
      // Masks where the block crosses the end of the keys or (causal) the diagonal, then the
      // online softmax on raw scores (flash_forward.cuh's): the warp-specialized kernel's step.
      float rescale[2];
      const bool grew = sm90_ws::softmax_step<F>(s, rows, rescale, block, p, unit, kept,
                                                 has_dropout, keep_scale);
      if (__any_sync(kFullMask, grew)) {  // exact: the factor is 1 for rows that did not grow
#pragma unroll
        for (int j = 0; j < kDTiles; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            o[4 * j + e] *= rescale[e >> 1];
          }
        }
      }

      // O += P V. P's A fragment for keys 16 kk .. 16 kk + 15 is S's n-tiles 2 kk and 2 kk + 1
      // packed in pairs. V is MN-major: LBO = the distance between the halves of the head dim
      // (unused at D = 64), SBO = between 8-key atoms; 16 keys further per k-step.
      uint32_t p_frag[kBlockN / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          p_frag[kk][r] = pack2<T>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
        }
      }
      wgmma_fence();
      const TileDescriptor v_desc(v_tiles + buffer, kBlockN * kRowBytes, 1024);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const uint64_t desc_v = v_desc.at(kk * 16 * kRowBytes);
        if constexpr (D == 256) {  // two products of 128 columns: V's parts 0-1, then 2-3
          const uint64_t desc_v_upper = v_desc.at(2 * kBlockN * kRowBytes + kk * 16 * kRowBytes);
          wgmma_m64n256k16_rs<T>(o, p_frag[kk], desc_v, desc_v_upper);
        } else if constexpr (D == 128) {
          wgmma_m64n128k16_rs<T>(o, p_frag[kk], desc_v);
        } else {
          wgmma_m64n64k16_rs<T>(o, p_frag[kk], desc_v);
        }
      }
      wgmma_commit_group();
      wgmma_wait_group<0>();  // before the next barrier lets this V buffer be refilled
      wgmma_fence_operands(o);
      block = following;
    }
    cp_async_wait<0>();  // the last, empty group

    // O / rowsum straight to global memory (each warp writes whole rows), lse.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = rows.row_sum[h];
      sum += __shfl_xor_sync(kFullMask, sum, 1);
      sum += __shfl_xor_sync(kFullMask, sum, 2);
      const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
      const int64_t row = m0 + warp_row0 + g + 8 * h;
      if (row < L) {
        T* const out_row = out + (b * L + row) * D;
#pragma unroll
        for (int j = 0; j < kDTiles; ++j) {
          *reinterpret_cast<uint32_t*>(out_row + 8 * j + 2 * t) =
              pack2<T>(o[4 * j + 2 * h] * inv_sum, o[4 * j + 2 * h + 1] * inv_sum);
        }
        if (t == 0) {
          lse[b * L + row] = sum > 0.f ? rows.row_max[h] * unit * kLn2 + logf(sum) : -INFINITY;
        }
      }
    }
    __syncthreads();  // the next work item's copies overwrite the tiles
  }
}

// Two CTAs per SM cap a thread at 128 registers, which the plain kernel fits (127) up to
// D = 128; with a mask or dropout ptxas then spilled 120-250 bytes, so those instantiations run
// one CTA per SM with up to 255 registers, as D = 256 does (O alone is 128 registers, and its
// 193 KB of shared memory leave room for one CTA anyway).
template <typename T, class F, int kArgs>
__global__ void __launch_bounds__(F::kThreads, kArgs == kNoArgs && F::kHeadDim <= 128 ? 2 : 1)
    flash_forward_sm90_kernel(const T* __restrict__ q,  // (B, L, D)
                              const T* __restrict__ k,  // (B, S, D)
                              const T* __restrict__ v,  // (B, S, D)
                              T* __restrict__ out,      // (B, L, D)
                              float* __restrict__ lse,  // (B, L)
                              const AttentionProblem p,
                              const bool longest_first) {  // causal work order
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  wgmma_forward_cta<T, F, kArgs>(q, k, v, out, lse, p, longest_first);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  flash_forward_cta<T, typename F::Fallback, kArgs>(q, k, v, out, lse, p, longest_first);
#endif
}

// Compute capability 9.0, the only one with wgmma. Any error answers no (the mma.sync kernel
// is as correct) and is cleared, not left for the caller's launch check.
inline bool current_device_is_sm90() {
  return detail::current_device_attribute(cudaDevAttrComputeCapabilityMajor) == 9 &&
         detail::current_device_attribute(cudaDevAttrComputeCapabilityMinor) == 0;
}

template <typename T, class F>
bool launch(const T* q, const T* k, const T* v, T* out, float* lse, const AttentionProblem& p,
            cudaStream_t stream) {
  auto* kernel = for_score_args(p, flash_forward_sm90_kernel<T, F, kNoArgs>,
                                flash_forward_sm90_kernel<T, F, kMaskOnly>,
                                flash_forward_sm90_kernel<T, F, kMaskAndDropout>);
  if (!detail::has_tensor_core_image(kernel)) {
    return false;
  }
  const int64_t work = p.batch * ceil_div(p.len_q, F::kBlockM);
  if (work <= 0) {
    return true;  // empty: nothing to launch
  }
  kernels::detail::allow_shared_memory(kernel, F::kSmemBytes);
  const bool longest_first =
      p.causal && detail::longest_first_pays(p.batch, p.len_kv, p.head_dim);
  kernel<<<kernels::detail::grid_for(work), F::kThreads, F::kSmemBytes, stream>>>(
      q, k, v, out, lse, p, longest_first);
  return true;
}

// The warp-specialized kernel's tilings for the problem's E and Ev, as a call of
// visit(TileChoice<F, FArgs>{}): F without a mask or dropout, FArgs with them.
template <class F, class FArgs>
struct TileChoice {
  using Tile = F;
  using TileArgs = FArgs;
};
template <class Visit>
auto with_ws_tiles(const AttentionProblem& p, const Visit& visit) {
  namespace ws = sm90_ws;
  const int64_t widest = p.head_dim > value_dim(p) ? p.head_dim : value_dim(p);
  const bool d64_staged = ws::d64_stages_o(p.causal, p.len_kv);
  const bool d128_long = ws::d128_long_keys(p.len_kv);
  return widest <= 64 && d64_staged ? visit(TileChoice<ws::Tile64Staged, ws::Tile64Args>{})
         : widest <= 64             ? visit(TileChoice<ws::Tile64, ws::Tile64Args>{})
         : widest <= 128 && value_dim(p) <= 64 && !p.causal
             ? visit(TileChoice<ws::Tile128Ev64Wide, ws::Tile128Args>{})
         : widest <= 128 && value_dim(p) <= 64
             ? visit(TileChoice<ws::Tile128Ev64, ws::Tile128Args>{})
         : widest <= 128 && !p.causal && d128_long
             ? visit(TileChoice<ws::Tile128Three, ws::Tile128Args>{})
         : widest <= 128 && (!p.causal || d128_long)
             ? visit(TileChoice<ws::Tile128Wide, ws::Tile128Args>{})
         : widest <= 128 ? visit(TileChoice<ws::Tile128, ws::Tile128Args>{})
                         : visit(TileChoice<ws::Tile256, ws::Tile256Args>{});
}

// The workspace of the warp-specialized kernel's last-round split for this problem (sizes;
// zeros where it runs whole items, or does not run).
inline SplitWorkspace split_workspace(const AttentionProblem& p) {
  const int64_t widest = p.head_dim > value_dim(p) ? p.head_dim : value_dim(p);
  if (widest > 256 || !current_device_is_sm90()) {
    return {};
  }
  return with_ws_tiles(p, [&](auto choice) {
    return sm90_ws::split_workspace<typename decltype(choice)::Tile>(p);
  });
}

template <typename T>
bool forward(const T* q, const T* k, const T* v, T* out, float* lse, const AttentionProblem& p,
             cudaStream_t stream, const SplitWorkspace& workspace) {
  const int64_t widest = p.head_dim > value_dim(p) ? p.head_dim : value_dim(p);
  if (widest > 256 || !current_device_is_sm90()) {
    return false;
  }
  if (!detail::aligned16(q) || !detail::aligned16(k) || !detail::aligned16(v) ||
      !detail::aligned16(out)) {
    return false;  // 16-byte cp.async and TMA
  }
  // The warp-specialized kernel where it can run (sm_90a images, a mask TMA can read), at the
  // narrowest of 64, 128 and 256 that holds E and Ev; at 128, V's 64 columns alone where Ev fits.
  const bool warp_specialized = with_ws_tiles(p, [&](auto choice) {
    using Choice = decltype(choice);
    return sm90_ws::launch<T, typename Choice::Tile, typename Choice::TileArgs>(
        q, k, v, out, lse, p, stream, workspace);
  });
  if (warp_specialized) {
    return true;
  }
  if (p.mask_in_input_dtype) {
    return false;  // this kernel reads float32 masks: the glue makes one and tries again
  }
  if (!detail::takes_tensor_cores(p) ||
      (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)) {
    return false;  // the glue pads other head dims to one of those
  }
  return p.head_dim == 64    ? launch<T, Tile<64>>(q, k, v, out, lse, p, stream)
         : p.head_dim == 128 ? launch<T, Tile<128>>(q, k, v, out, lse, p, stream)
                             : launch<T, Tile<256>>(q, k, v, out, lse, p, stream);
}

}  // namespace sm90
}  // namespace flash

// The launchers the glue calls before launch_flash_forward, one overload per dtype, with its
// arguments and contract: true when the case is taken (one launch on `stream`, or none for
// empty work), false having launched nothing when it is not (float32, devices other than
// compute capability 9.0, misaligned inputs, head dims over 128; head dims other than 64 and
// 128 or Ev != E where the warp-specialized kernel declines them: not multiples of 8, an
// image without sm_90a).
inline bool launch_flash_forward_sm90(const float*, const float*, const float*, float*, float*,
                                      const AttentionProblem&, cudaStream_t,
                                      const SplitWorkspace& = {}) {
  return false;
}
inline bool launch_flash_forward_sm90(const __half* q, const __half* k, const __half* v,
                                      __half* out, float* lse, const AttentionProblem& p,
                                      cudaStream_t stream, const SplitWorkspace& workspace = {}) {
  return flash::sm90::forward(q, k, v, out, lse, p, stream, workspace);
}
inline bool launch_flash_forward_sm90(const __nv_bfloat16* q, const __nv_bfloat16* k,
                                      const __nv_bfloat16* v, __nv_bfloat16* out, float* lse,
                                      const AttentionProblem& p, cudaStream_t stream,
                                      const SplitWorkspace& workspace = {}) {
  return flash::sm90::forward(q, k, v, out, lse, p, stream, workspace);
}

// The workspace launch_flash_forward_sm90 splits its last round with (sizes; zeros: none): the
// glue allocates `floats` float32 entries and `counts` zeroed counts for a problem of half or
// bfloat16 inputs and passes them in (flash_forward_sm90_ws_schedule.cuh).
inline SplitWorkspace flash_forward_sm90_split_workspace(const AttentionProblem& p) {
  return flash::sm90::split_workspace(p);
}

}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_FORWARD_SM90_CUH_
