// The generic backward kernels of the fixed_attention operators and their launchers: delta, dK
// and dV, dQ (attention_kernels.cuh's header comment gives the function and the tiling).
//
// No torch includes, so CI compile-checks this header on a machine without a GPU:
//   nvcc -arch=sm_90 -x cu -c fixed/csrc/kernels/attention_backward_kernels.cuh -o /dev/null
#ifndef FIXED_ATTENTION_BACKWARD_KERNELS_CUH_
#define FIXED_ATTENTION_BACKWARD_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_kernels.cuh"  // Tiling, device helpers, head_dim_bucket

namespace fixed_attention {
namespace kernels {

// ------------------------------------------------------------------------------ backward

// D_i = dO_i . O_i, one warp per row of the flattened (B * L, Ev) matrices. O is the output
// the forward returned (dropped), which is what makes dS = P (Z dP - D) the softmax's gradient.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    attention_backward_delta_kernel(const scalar_t* __restrict__ dout,  // (B * L, Ev)
                                    const scalar_t* __restrict__ out,   // (B * L, Ev)
                                    float* __restrict__ delta,          // (B * L)
                                    const int64_t rows, const int64_t head_dim) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t row = first; row < rows; row += stride) {  // the same row for the whole warp
    float acc = 0.f;
    for (int64_t col = lane; col < head_dim; col += kWarpSize) {
      acc = fmaf(to_float(dout[row * head_dim + col]), to_float(out[row * head_dim + col]), acc);
    }
    acc = warp_sum(acc);
    if (lane == 0) {
      delta[row] = acc;
    }
  }
}

template <typename scalar_t, int kHeadDim, bool kPlain>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    attention_backward_dkdv_kernel(const scalar_t* __restrict__ dout,  // (B, L, Ev)
                                   const scalar_t* __restrict__ q,     // (B, L, E)
                                   const scalar_t* __restrict__ k,     // (B / kv_group, S, E)
                                   const scalar_t* __restrict__ v,     // (B / kv_group, S, Ev)
                                   const float* __restrict__ lse,      // (B, L)
                                   const float* __restrict__ delta,    // (B, L)
                                   scalar_t* __restrict__ dk,          // (B / kv_group, S, E)
                                   scalar_t* __restrict__ dv,          // (B / kv_group, S, Ev)
                                   const AttentionProblem p) {
  using T = Tiling<kHeadDim>;
  constexpr int kRows = T::kRows, kCols = T::kCols;
  extern __shared__ float shared_tiles[];
  float* q_tile = shared_tiles;                        // [32][kPadded]
  float* do_tile = shared_tiles + kTile * T::kPadded;  // [32][kPadded]

  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t L = p.len_q, S = p.len_kv, E = p.head_dim, Ev = kPlain ? E : value_dim(p);
  const int64_t key_blocks = ceil_div(S, T::kBlockRows);
  const float keep_scale = kPlain ? 1.f : dropout_scale(p.dropout_p);  // Z of a kept one
  const int64_t kv_group = kPlain ? 1 : p.kv_group;

  for (int64_t item = blockIdx.x; item < (p.batch / kv_group) * key_blocks; item += gridDim.x) {
    const int64_t kv = item / key_blocks;  // the K/V item
    const int64_t block_key0 = (item % key_blocks) * T::kBlockRows;
    const int64_t key0 = block_key0 + warp * kRows;

    float k_reg[kRows][kCols];
    float v_reg[kRows][kCols];
    float dk_acc[kRows][kCols];
    float dv_acc[kRows][kCols];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      load_row(k_reg[r], k + kv * S * E, key0 + r, S, E, lane);
      load_row(v_reg[r], v + kv * S * Ev, key0 + r, S, Ev, lane);
#pragma unroll
      for (int t = 0; t < kCols; ++t) {
        dk_acc[r][t] = 0.f;
        dv_acc[r][t] = 0.f;
      }
    }

    // Under causal, query rows before the block's first key see none of its keys.
    const int64_t rows_begin = p.causal ? (block_key0 / kTile) * kTile : 0;
    // The batch items that read this K/V item (kv_item(b) == kv): each dK and dV element sums
    // over all of them in one thread, in a fixed order.
    for (int64_t b = kv * kv_group; b < (kv + 1) * kv_group; ++b) {
      const scalar_t* q_b = q + b * L * E;
      const scalar_t* do_b = dout + b * L * Ev;
      const float* lse_b = lse + b * L;
      const float* delta_b = delta + b * L;
      const void* mask_b = mask_slice<kPlain>(p, b);
      for (int64_t row_tile = rows_begin; row_tile < L; row_tile += kTile) {
        __syncthreads();  // every warp is done with the previous tiles
        load_tile<kHeadDim, T::kPadded>(q_tile, q_b, row_tile, L, E);
        load_tile<kHeadDim, T::kPadded>(do_tile, do_b, row_tile, L, Ev);
        const int64_t row = row_tile + lane;  // this lane's query row
        const bool row_valid = row < L;
        const float row_lse = row_valid ? lse_b[row] : 0.f;
        const float row_delta = row_valid ? delta_b[row] : 0.f;
        __syncthreads();

        // s = q_row . k_key and dp = dO_row . v_key for each of the warp's keys.
        float s[kRows];
        float dp[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          s[r] = 0.f;
          dp[r] = 0.f;
        }
#pragma unroll
        for (int t = 0; t < kCols; ++t) {
#pragma unroll 4
          for (int src = 0; src < kWarpSize; ++src) {
            const int col = t * kWarpSize + src;
            const float qx = q_tile[lane * T::kPadded + col];
            const float dox = do_tile[lane * T::kPadded + col];
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
              s[r] = fmaf(qx, __shfl_sync(kFullMask, k_reg[r][t], src), s[r]);
              dp[r] = fmaf(dox, __shfl_sync(kFullMask, v_reg[r][t], src), dp[r]);
            }
          }
        }
        // s becomes P Z (dV's weight), dp becomes dS.
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const int64_t key = key0 + r;
          const float prob =
              probability(attention_score<scalar_t>(p, mask_b, s[r], row, key), row_lse);
          const float z = dropped<kPlain>(p, b, row, key) ? 0.f : keep_scale;
          s[r] = prob * z;
          dp[r] = prob * (z * dp[r] - row_delta);
        }

        // dV += (P Z)^T dO, dK += dS^T Q: row i's values broadcast from lane i, lanes on
        // columns.
#pragma unroll 4
        for (int i = 0; i < kTile; ++i) {
          float p_i[kRows];
          float ds_i[kRows];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            p_i[r] = __shfl_sync(kFullMask, s[r], i);
            ds_i[r] = __shfl_sync(kFullMask, dp[r], i);
          }
#pragma unroll
          for (int t = 0; t < kCols; ++t) {
            const int col = t * kWarpSize + lane;
            const float dox = do_tile[i * T::kPadded + col];
            const float qx = q_tile[i * T::kPadded + col];
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
              dv_acc[r][t] = fmaf(p_i[r], dox, dv_acc[r][t]);
              dk_acc[r][t] = fmaf(ds_i[r], qx, dk_acc[r][t]);
            }
          }
        }
      }
    }

#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t key = key0 + r;
      if (key >= S) {
        continue;
      }
#pragma unroll
      for (int t = 0; t < kCols; ++t) {
        const int64_t col = t * kWarpSize + lane;
        if (col < E) {
          store(dk + (kv * S + key) * E + col, dk_acc[r][t] * p.scale);
        }
        if (col < Ev) {
          store(dv + (kv * S + key) * Ev + col, dv_acc[r][t]);
        }
      }
    }
  }
}

template <typename scalar_t, int kHeadDim, bool kPlain>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    attention_backward_dq_kernel(const scalar_t* __restrict__ dout,  // (B, L, Ev)
                                 const scalar_t* __restrict__ q,     // (B, L, E)
                                 const scalar_t* __restrict__ k,     // (B / kv_group, S, E)
                                 const scalar_t* __restrict__ v,     // (B / kv_group, S, Ev)
                                 const float* __restrict__ lse,      // (B, L)
                                 const float* __restrict__ delta,    // (B, L)
                                 scalar_t* __restrict__ dq,          // (B, L, E)
                                 const AttentionProblem p) {
  using T = Tiling<kHeadDim>;
  constexpr int kRows = T::kRows, kCols = T::kCols;
  extern __shared__ float shared_tiles[];
  float* k_tile = shared_tiles;                       // [32][kPadded]
  float* v_tile = shared_tiles + kTile * T::kPadded;  // [32][kPadded]

  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t L = p.len_q, S = p.len_kv, E = p.head_dim, Ev = kPlain ? E : value_dim(p);
  const int64_t row_blocks = ceil_div(L, T::kBlockRows);
  const float keep_scale = kPlain ? 1.f : dropout_scale(p.dropout_p);  // Z of a kept one

  for (int64_t item = blockIdx.x; item < p.batch * row_blocks; item += gridDim.x) {
    const int64_t b = item / row_blocks;
    const int64_t block_row0 = (item % row_blocks) * T::kBlockRows;
    const int64_t row0 = block_row0 + warp * kRows;
    const scalar_t* k_b = k + kv_item<kPlain>(p, b) * S * E;
    const scalar_t* v_b = v + kv_item<kPlain>(p, b) * S * Ev;
    const void* mask_b = mask_slice<kPlain>(p, b);

    float q_reg[kRows][kCols];
    float do_reg[kRows][kCols];
    float dq_acc[kRows][kCols];
    float row_lse[kRows];
    float row_delta[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = row0 + r;
      load_row(q_reg[r], q + b * L * E, row, L, E, lane);
      load_row(do_reg[r], dout + b * L * Ev, row, L, Ev, lane);
#pragma unroll
      for (int t = 0; t < kCols; ++t) {
        dq_acc[r][t] = 0.f;
      }
      row_lse[r] = row < L ? lse[b * L + row] : 0.f;
      row_delta[r] = row < L ? delta[b * L + row] : 0.f;
    }

    const int64_t keys = key_end(p, block_row0, T::kBlockRows);
    for (int64_t key0 = 0; key0 < keys; key0 += kTile) {
      __syncthreads();  // every warp is done with the previous tiles
      load_tile<kHeadDim, T::kPadded>(k_tile, k_b, key0, S, E);
      load_tile<kHeadDim, T::kPadded>(v_tile, v_b, key0, S, Ev);
      __syncthreads();

      // s = q_row . k_key and dp = dO_row . v_key: this lane's key, each of the warp's rows.
      float s[kRows];
      float dp[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        s[r] = 0.f;
        dp[r] = 0.f;
      }
#pragma unroll
      for (int t = 0; t < kCols; ++t) {
#pragma unroll 4
        for (int src = 0; src < kWarpSize; ++src) {
          const int col = t * kWarpSize + src;
          const float kx = k_tile[lane * T::kPadded + col];
          const float vx = v_tile[lane * T::kPadded + col];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            s[r] = fmaf(__shfl_sync(kFullMask, q_reg[r][t], src), kx, s[r]);
            dp[r] = fmaf(__shfl_sync(kFullMask, do_reg[r][t], src), vx, dp[r]);
          }
        }
      }
      // dp becomes dS.
      const int64_t key = key0 + lane;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = row0 + r;
        const float score = attention_score<scalar_t>(p, mask_b, s[r], row, key);
        const float prob = probability(score, row_lse[r]);
        const float z = dropped<kPlain>(p, b, row, key) ? 0.f : keep_scale;
        dp[r] = prob * (z * dp[r] - row_delta[r]);
      }

      // dQ += dS K: key j's dS broadcast from lane j, lanes on columns.
#pragma unroll 4
      for (int j = 0; j < kTile; ++j) {
        float ds_j[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          ds_j[r] = __shfl_sync(kFullMask, dp[r], j);
        }
#pragma unroll
        for (int t = 0; t < kCols; ++t) {
          const float kx = k_tile[j * T::kPadded + t * kWarpSize + lane];
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            dq_acc[r][t] = fmaf(ds_j[r], kx, dq_acc[r][t]);
          }
        }
      }
    }

#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = row0 + r;
      if (row >= L) {
        continue;
      }
#pragma unroll
      for (int t = 0; t < kCols; ++t) {
        const int64_t col = t * kWarpSize + lane;
        if (col < E) {
          store(dq + (b * L + row) * E + col, dq_acc[r][t] * p.scale);
        }
      }
    }
  }
}

// ------------------------------------------------------------------------ host launchers

namespace detail {

template <typename scalar_t, int kHeadDim>
void launch_dkdv(const scalar_t* dout, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                 const float* lse, const float* delta, scalar_t* dk, scalar_t* dv,
                 const AttentionProblem& p, cudaStream_t stream) {
  using T = Tiling<kHeadDim>;
  const int64_t work = (p.batch / p.kv_group) * ceil_div(p.len_kv, T::kBlockRows);
  if (work <= 0) {
    return;
  }
  auto* kernel = is_plain(p) ? attention_backward_dkdv_kernel<scalar_t, kHeadDim, true>
                             : attention_backward_dkdv_kernel<scalar_t, kHeadDim, false>;
  allow_shared_memory(kernel, T::kBackwardSmem);
  kernel<<<grid_for(work), kThreads, T::kBackwardSmem, stream>>>(dout, q, k, v, lse, delta, dk,
                                                                  dv, p);
}

template <typename scalar_t, int kHeadDim>
void launch_dq(const scalar_t* dout, const scalar_t* q, const scalar_t* k, const scalar_t* v,
               const float* lse, const float* delta, scalar_t* dq, const AttentionProblem& p,
               cudaStream_t stream) {
  using T = Tiling<kHeadDim>;
  const int64_t work = p.batch * ceil_div(p.len_q, T::kBlockRows);
  if (work <= 0) {
    return;
  }
  auto* kernel = is_plain(p) ? attention_backward_dq_kernel<scalar_t, kHeadDim, true>
                             : attention_backward_dq_kernel<scalar_t, kHeadDim, false>;
  allow_shared_memory(kernel, T::kBackwardSmem);
  kernel<<<grid_for(work), kThreads, T::kBackwardSmem, stream>>>(dout, q, k, v, lse, delta, dq,
                                                                  p);
}

template <typename scalar_t>
void backward_delta(const scalar_t* dout, const scalar_t* out, float* delta,
                    const AttentionProblem& p, cudaStream_t stream) {
  const int64_t rows = p.batch * p.len_q;
  if (rows <= 0) {
    return;
  }
  attention_backward_delta_kernel<scalar_t>
      <<<grid_for(ceil_div(rows, kWarps)), kThreads, 0, stream>>>(dout, out, delta, rows,
                                                                  value_dim(p));
}

template <typename scalar_t>
void backward_dkdv(const scalar_t* dout, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                   const float* lse, const float* delta, scalar_t* dk, scalar_t* dv,
                   const AttentionProblem& p, cudaStream_t stream) {
  switch (head_dim_bucket(p)) {
    case 32: return launch_dkdv<scalar_t, 32>(dout, q, k, v, lse, delta, dk, dv, p, stream);
    case 64: return launch_dkdv<scalar_t, 64>(dout, q, k, v, lse, delta, dk, dv, p, stream);
    case 128: return launch_dkdv<scalar_t, 128>(dout, q, k, v, lse, delta, dk, dv, p, stream);
    default: return launch_dkdv<scalar_t, 256>(dout, q, k, v, lse, delta, dk, dv, p, stream);
  }
}

template <typename scalar_t>
void backward_dq(const scalar_t* dout, const scalar_t* q, const scalar_t* k, const scalar_t* v,
                 const float* lse, const float* delta, scalar_t* dq, const AttentionProblem& p,
                 cudaStream_t stream) {
  switch (head_dim_bucket(p)) {
    case 32: return launch_dq<scalar_t, 32>(dout, q, k, v, lse, delta, dq, p, stream);
    case 64: return launch_dq<scalar_t, 64>(dout, q, k, v, lse, delta, dq, p, stream);
    case 128: return launch_dq<scalar_t, 128>(dout, q, k, v, lse, delta, dq, p, stream);
    default: return launch_dq<scalar_t, 256>(dout, q, k, v, lse, delta, dq, p, stream);
  }
}

}  // namespace detail

// backward, first: delta (B, L) float32 = rowsum(dout * out), a workspace for the two below.
inline void launch_attention_backward_delta(const float* dout, const float* out, float* delta,
                                            const AttentionProblem& p, cudaStream_t stream) {
  detail::backward_delta(dout, out, delta, p, stream);
}
inline void launch_attention_backward_delta(const __half* dout, const __half* out, float* delta,
                                            const AttentionProblem& p, cudaStream_t stream) {
  detail::backward_delta(dout, out, delta, p, stream);
}
inline void launch_attention_backward_delta(const __nv_bfloat16* dout, const __nv_bfloat16* out,
                                            float* delta, const AttentionProblem& p,
                                            cudaStream_t stream) {
  detail::backward_delta(dout, out, delta, p, stream);
}

// backward, then: dk (B / kv_group, S, E), dv (B / kv_group, S, Ev).
inline void launch_attention_backward_dkdv(const float* dout, const float* q, const float* k,
                                           const float* v, const float* lse, const float* delta,
                                           float* dk, float* dv, const AttentionProblem& p,
                                           cudaStream_t stream) {
  detail::backward_dkdv(dout, q, k, v, lse, delta, dk, dv, p, stream);
}
inline void launch_attention_backward_dkdv(const __half* dout, const __half* q, const __half* k,
                                           const __half* v, const float* lse, const float* delta,
                                           __half* dk, __half* dv, const AttentionProblem& p,
                                           cudaStream_t stream) {
  detail::backward_dkdv(dout, q, k, v, lse, delta, dk, dv, p, stream);
}
inline void launch_attention_backward_dkdv(const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                           const __nv_bfloat16* k, const __nv_bfloat16* v,
                                           const float* lse, const float* delta,
                                           __nv_bfloat16* dk, __nv_bfloat16* dv,
                                           const AttentionProblem& p, cudaStream_t stream) {
  detail::backward_dkdv(dout, q, k, v, lse, delta, dk, dv, p, stream);
}

// backward, and: dq (B, L, E).
inline void launch_attention_backward_dq(const float* dout, const float* q, const float* k,
                                         const float* v, const float* lse, const float* delta,
                                         float* dq, const AttentionProblem& p,
                                         cudaStream_t stream) {
  detail::backward_dq(dout, q, k, v, lse, delta, dq, p, stream);
}
inline void launch_attention_backward_dq(const __half* dout, const __half* q, const __half* k,
                                         const __half* v, const float* lse, const float* delta,
                                         __half* dq, const AttentionProblem& p,
                                         cudaStream_t stream) {
  detail::backward_dq(dout, q, k, v, lse, delta, dq, p, stream);
}
inline void launch_attention_backward_dq(const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                         const __nv_bfloat16* k, const __nv_bfloat16* v,
                                         const float* lse, const float* delta,
                                         __nv_bfloat16* dq, const AttentionProblem& p,
                                         cudaStream_t stream) {
  detail::backward_dq(dout, q, k, v, lse, delta, dq, p, stream);
}

}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_ATTENTION_BACKWARD_KERNELS_CUH_
