// SDPA's arguments in the warp-specialized Hopper forward (flash_forward_sm90_ws_cta.cuh): the
// additive mask, which the producer loads by TMA beside K and V, and dropout's keep bits, which
// the consumers draw while their products run. The arithmetic is flash_forward_sm90.cuh's: the
// same mask entry per score, added as fmaf(s, |scale| log2 e, entry log2 e); the same Philox
// bits (flash_common.cuh's dropout_keep_bits).
//
// The mask in shared memory: per key block, kBlockN / 32 boxes of kBlockM rows x 32 keys (128
// bytes a row, 16 KB a box, each 1024-byte aligned), written by TMA with the 128-byte swizzle
// (16-byte chunk c of row r at chunk c ^ (r & 7)); a mask in the inputs' 16-bit dtype (the
// tiling's MaskEntry) in boxes of 64 keys, half the boxes (mask_pair). Blocks whose entries are
// all 0 (the map of hidden tiles says so: most of a mask made from bools) are neither loaded nor
// read: their scores are only scaled. A lane reads its two keys of a row as one 8-byte load;
// the 8 rows x 4 lanes of a warp's load then cover all 32 banks twice, the fewest wavefronts
// for 256 bytes. A mask broadcast over rows (key padding: (B, 1, 1, S)) is loaded as
// boxes of one row, which every row reads.
//
// Why TMA and not the wgmma kernel's per-thread loads: a float mask costs 4 bytes per score, and
// at D = 64 the tensor cores finish a score in about the time HBM delivers 1 byte of it; bulk
// asynchronous copies keep the mask's latency off the consumers and their registers free.
//
// No torch includes: CI compile-checks this header for sm_90a and sm_90 without a GPU.
#ifndef FIXED_FLASH_FORWARD_SM90_WS_ARGS_CUH_
#define FIXED_FLASH_FORWARD_SM90_WS_ARGS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "attention_problem.cuh"  // AttentionProblem
#include "flash_common.cuh"       // dropout_keep_bits, ld_shared_f32x2, ...
#include "sm90_pipeline.cuh"      // TMA

namespace fixed_attention {
namespace kernels {
namespace flash {
namespace sm90_ws {

// Rows of the mask's boxes: a mask with a row stride has kBlockM, one broadcast over rows 1.
template <class F>
__host__ __device__ __forceinline__ uint32_t mask_box_rows(const AttentionProblem& p) {
  return p.mask_stride_row != 0 ? F::kBlockM : 1;
}

// The bytes of one key block's mask, which the producer announces on its "full" barrier.
template <class F>
__device__ __forceinline__ uint32_t mask_block_bytes(const AttentionProblem& p) {
  return mask_box_rows<F>(p) * 128u * F::kMaskBoxes;
}

#if FIXED_HAS_TENSOR_MAPS
// The producer's loads of the mask of rows [m0, m0 + kBlockM) x keys [key0, key0 + kBlockN) of
// batch item b into `tile`. The map's dimensions are (key, row, head, outer), a broadcast one
// of size 1 (sm90_pipeline.cuh's encode_mask_map), read at 0.
template <class F>
__device__ __forceinline__ void load_mask_block(const CUtensorMap* map, uint32_t tile,
                                                const AttentionProblem& p, int64_t b, int64_t m0,
                                                int key0, uint32_t barrier) {
  const int row = p.mask_stride_row != 0 ? static_cast<int>(m0) : 0;
  const int head = p.mask_stride_head != 0 ? static_cast<int>(b % p.heads) : 0;
  const int outer = p.mask_stride_outer != 0 ? static_cast<int>(b / p.heads) : 0;
#pragma unroll
  for (int box = 0; box < F::kMaskBoxes; ++box) {
    tma_load_4d(tile + box * F::kMaskBoxBytes, map, key0 + F::kMaskKeysPerBox * box, row, head,
                outer, barrier);
  }
}
#endif  // FIXED_HAS_TENSOR_MAPS

// A lane's two entries (keys 8 j + 2 t, + 1) of row `line` of a key block's mask boxes. Float32:
// 4 keys a chunk, the pair 8 bytes at 8 (t & 1) of chunk 2 (j % 4) + (t >> 1) of box j / 4. 16-bit
// (F::MaskEntry, the inputs' dtype): 8 keys a chunk, the pair 4 bytes at 4 t of chunk j % 8 of
// box j / 8; a warp's load (8 rows, 4 lanes each) then covers all 32 banks once.
template <class F>
__device__ __forceinline__ float2 mask_pair(uint32_t tile, int line, int t, int j) {
  using Entry = typename F::MaskEntry;
  if constexpr (sizeof(Entry) == 2) {
    const uint32_t chunk = static_cast<uint32_t>((j % 8) ^ (line & 7));
    const uint32_t at = tile + static_cast<uint32_t>(line) * 128u + (j / 8) * F::kMaskBoxBytes +
                        (chunk << 4) + 4 * t;
    const uint32_t bits = __float_as_uint(ld_shared_f32(at));
    if constexpr (std::is_same_v<Entry, __half>) {
      return __half22float2(*reinterpret_cast<const __half2*>(&bits));
    } else {
      return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xFFFF0000u));
    }
  } else {
    const uint32_t chunk = static_cast<uint32_t>((2 * (j % 4) + (t >> 1)) ^ (line & 7));
    const uint32_t at = tile + static_cast<uint32_t>(line) * 128u + (t & 1) * 8;
    return ld_shared_f32x2(at + (j / 4) * F::kMaskBoxBytes + (chunk << 4));
  }
}

// Scores of rows `first_row` (g) and + 8 of the item's tile, raw, to scaled scores plus the mask
// in log2 units (flash_forward_sm90.cuh's pairs path), -inf for rows past L. Keys past S read
// the zeros TMA filled in; the caller's tail mask hides them.
template <class F>
__device__ __forceinline__ void add_mask_tile(float (&s)[F::kNTiles * 4], uint32_t tile,
                                              int first_row, int t, bool rows_vary,
                                              int64_t rows_left, float mask_scale) {
  constexpr float kLog2e = 1.4426950408889634f;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = first_row + 8 * h;
    const int line = rows_vary ? row : 0;
    const bool row_inside = row < rows_left;
#pragma unroll
    for (int j = 0; j < F::kNTiles; ++j) {
      const float2 entry = mask_pair<F>(tile, line, t, j);
      float& s0 = s[4 * j + 2 * h];
      float& s1 = s[4 * j + 2 * h + 1];
      s0 = row_inside ? fmaf(s0, mask_scale, entry.x * kLog2e) : -INFINITY;
      s1 = row_inside ? fmaf(s1, mask_scale, entry.y * kLog2e) : -INFINITY;
    }
  }
}

// The same for a block whose mask entries are all 0 (zero_block): the scaled scores, none read.
template <class F>
__device__ __forceinline__ void scale_unmasked(float (&s)[F::kNTiles * 4], int first_row,
                                               int64_t rows_left, float mask_scale) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const bool row_inside = first_row + 8 * h < rows_left;
#pragma unroll
    for (int j = 0; j < F::kNTiles; ++j) {
      float& s0 = s[4 * j + 2 * h];
      float& s1 = s[4 * j + 2 * h + 1];
      s0 = row_inside ? s0 * mask_scale : -INFINITY;  // fmaf(s, c, 0): the same bits
      s1 = row_inside ? s1 * mask_scale : -INFINITY;
    }
  }
}

// Dropout's keep bits of a key block for rows `row` (g) and + 8 (flash_forward_sm90.cuh):
// kept[h][jq] bit 2 jj + c is key 8 (4 jq + jj) + 2 t + c of row + 8 h. All 32 lanes call it.
template <class F>
__device__ __forceinline__ void draw_keep_bits(uint32_t (&kept)[2][F::kNTiles / 4],
                                               const AttentionProblem& p,
                                               uint32_t keep_threshold, int64_t b, int64_t row,
                                               int64_t n0, int g, int t) {
  const int slot = 2 * (g & 1) + (t & 1);  // the lane's place among those sharing Philox blocks
  // The Philox counter of (row, the first keys): 8 rows further is 4 block rows, 32 keys 8 blocks.
  const uint64_t counter =
      dropout::block_counter(b, row, n0 + 8 * slot + 2 * t, p.len_q, p.len_kv);
  const uint64_t rows8 = 4 * dropout::block_cols(p.len_kv);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int jq = 0; jq < F::kNTiles / 4; ++jq) {
      kept[h][jq] = dropout_keep_bits_at<DropoutPair::kAlongKeys>(
          p, keep_threshold, counter + h * rows8 + 8 * jq, slot);
    }
  }
}

}  // namespace sm90_ws
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_FORWARD_SM90_WS_ARGS_CUH_
