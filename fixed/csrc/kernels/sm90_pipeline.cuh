// PTX wrappers for a warp-specialized Hopper kernel (sm_90a; PTX ISA 9.7.13, 9.7.9.25, 9.7.19):
// mbarriers, TMA tile loads, register reallocation between warpgroups (setmaxnreg) and named
// barriers; and, on the host, the TMA descriptors (tensor maps) of a (items, rows, head_dim)
// tensor and of an additive mask. flash_forward_sm90_ws.cuh is the kernel that uses them.
//
// An mbarrier is 8 bytes of shared memory that counts arrivals and, for TMA, bytes: a phase
// completes when its expected arrivals have arrived and its expected transaction bytes have
// landed, and the barrier moves to the next phase. A waiter names the parity of the phase it
// waits for: try_wait.parity(P) is true once the phase of parity P has completed. A producer
// waiting on an "empty" barrier for parity (round & 1) ^ 1 passes at once in round 0 (the phase
// "before" the first counts as completed), which is how a ring of stages starts out free.
//
// Outside an sm_90a image every device wrapper compiles to nothing, as wgmma.cuh's do: the
// kernel must not run there (its launcher checks the image).
//
// No torch includes: CI compile-checks this header for sm_90a and sm_90 without a GPU.
#ifndef FIXED_SM90_PIPELINE_CUH_
#define FIXED_SM90_PIPELINE_CUH_

#include <cuda.h>  // CUtensorMap and its enums; the encoder comes through the runtime, not libcuda
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

// Tensor maps came with CUDA 12; with an older toolkit the kernel's launcher declines.
#if defined(CUDA_VERSION) && CUDA_VERSION >= 12000
#define FIXED_HAS_TENSOR_MAPS 1
#else
#define FIXED_HAS_TENSOR_MAPS 0
#endif

namespace fixed_attention {
namespace kernels {
namespace flash {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FIXED_SM90A_ASM(...) asm volatile(__VA_ARGS__)
#else
#define FIXED_SM90A_ASM(...) \
  do {                       \
  } while (0)
#endif

// ------------------------------------------------------------------------------ mbarriers
__device__ __forceinline__ void mbarrier_init(uint32_t barrier, uint32_t arrivals) {
  FIXED_SM90A_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(arrivals)
                  : "memory");
}
// Makes initialized barriers visible to the other threads and to the TMA unit (then a
// __syncthreads before their first use).
__device__ __forceinline__ void fence_mbarrier_init() {
  FIXED_SM90A_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival, and `bytes` more expected in this phase (the TMA loads that follow complete them).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t barrier, uint32_t bytes) {
  FIXED_SM90A_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier),
                  "r"(bytes)
                  : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t barrier) {
  FIXED_SM90A_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(barrier) : "memory");
}
__device__ __forceinline__ bool mbarrier_try_wait(uint32_t barrier, uint32_t parity) {
  uint32_t done = 1;
  FIXED_SM90A_ASM(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(barrier), "r"(parity)
      : "memory");
  return done != 0;
}
// Until the phase of parity `parity` has completed. try_wait suspends the thread for a while in
// hardware before it answers no, so the loop does not spin hot.
__device__ __forceinline__ void mbarrier_wait(uint32_t barrier, uint32_t parity) {
  while (!mbarrier_try_wait(barrier, parity)) {
  }
}

#if FIXED_HAS_TENSOR_MAPS
// ------------------------------------------------------------------------------------ TMA
// Loads the box at element coordinates (c0, c1, c2) of `map` into shared memory at `destination`
// and counts its bytes on `barrier`. Coordinates past the tensor's end read zeros.
__device__ __forceinline__ void tma_load_3d(uint32_t destination, const CUtensorMap* map, int c0,
                                            int c1, int c2, uint32_t barrier) {
  FIXED_SM90A_ASM(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(destination),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(barrier)
      : "memory");
}
// The same for a rank-4 map (the mask's: key, row, head, outer).
__device__ __forceinline__ void tma_load_4d(uint32_t destination, const CUtensorMap* map, int c0,
                                            int c1, int c2, int c3, uint32_t barrier) {
  FIXED_SM90A_ASM(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(destination),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(barrier)
      : "memory");
}
// Copies `bytes` (a multiple of 16) from global memory at `source` to shared memory at
// `destination` (both 16-byte aligned) and counts them on `barrier`: a 1-D bulk copy, no map.
__device__ __forceinline__ void bulk_load(uint32_t destination, const void* source,
                                          uint32_t bytes, uint32_t barrier) {
  FIXED_SM90A_ASM(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1], %2, [%3];\n" ::"r"(destination),
      "l"(reinterpret_cast<uint64_t>(source)), "r"(bytes), "r"(barrier)
      : "memory");
}
// Stores the box at element coordinates (c0, c1, c2) of `map` from shared memory at `source`,
// asynchronously, as a bulk group of the issuing thread (wgmma.cuh's bulk_commit_group, then
// bulk_wait_group_read_all before `source` is rewritten). Rows past the tensor's end are not
// written.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t source, int c0,
                                             int c1, int c2) {
  FIXED_SM90A_ASM(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(source), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  FIXED_SM90A_ASM("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map))
                  : "memory");
}
#endif  // FIXED_HAS_TENSOR_MAPS

// ------------------------------------------------------- registers and named barriers
// Every thread of a warpgroup executes these together. dec gives registers back to the SM's
// pool, inc waits until the pool holds enough: the CTA's total must fit its allocation at launch
// (threads x the kernel's register count).
template <uint32_t kRegisters>
__device__ __forceinline__ void setmaxnreg_dec() {
  FIXED_SM90A_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <uint32_t kRegisters>
__device__ __forceinline__ void setmaxnreg_inc() {
  FIXED_SM90A_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
// Named barrier `id` (1-15; 0 is __syncthreads's) of `threads` threads, a multiple of 32: sync
// waits for them all, arrive counts this warp and goes on.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  FIXED_SM90A_ASM("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  FIXED_SM90A_ASM("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

#undef FIXED_SM90A_ASM

#if FIXED_HAS_TENSOR_MAPS
// ------------------------------------------------------------------------ host: tensor maps
// The driver's cuTensorMapEncodeTiled, found through the runtime (so that nothing links against
// libcuda); null where the driver or the toolkit has none.
using EncodeTiled = decltype(&cuTensorMapEncodeTiled);
inline EncodeTiled tensor_map_encoder() {
  static const EncodeTiled encoder = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t status = cudaGetDriverEntryPointByVersion(
        "cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t status =
        cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &function, cudaEnableDefault, &found);
#endif
    if (status != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();  // answered by a null encoder: the caller takes another kernel
      return static_cast<EncodeTiled>(nullptr);
    }
    return reinterpret_cast<EncodeTiled>(function);
  }();
  return encoder;
}

// The map of a contiguous 2-byte tensor of shape (items, rows, head_dim) read in boxes of
// `box_rows` rows x 64 elements (128 bytes: one half of a 128-wide head dim), stored in shared
// memory with the 128-byte swizzle (wgmma.cuh's layout). Rows, items and columns past the end
// read zeros (a head dim of 80 fills the second half's last 48). head_dim a multiple of 8.
// False, with `map` unusable, if the encoder is missing or refuses (alignment, sizes).
template <typename T>
bool encode_rows_map(CUtensorMap* map, const T* base, int64_t items, int64_t rows,
                     int64_t head_dim, uint32_t box_rows) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>);
  const EncodeTiled encode = tensor_map_encoder();
  if (encode == nullptr) {
    return false;
  }
  const cuuint64_t sizes[3] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(rows),
                               static_cast<cuuint64_t>(items)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_dim) * sizeof(T),  // bytes
                                 static_cast<cuuint64_t>(rows * head_dim) * sizeof(T)};
  const cuuint32_t box[3] = {64, box_rows, 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUtensorMapDataType type = std::is_same_v<T, __nv_bfloat16>
                                       ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(map, type, 3, const_cast<T*>(base), sizes, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The map of an additive mask of Entry (float, or a 16-bit half / bfloat16) read in boxes of
// `box_rows` rows x 128 bytes (32 or 64 keys, stored with the 128-byte swizzle), rank 4: (key,
// row, head, outer), `sizes` and `strides` in elements in that order. A stride of 0 (a broadcast
// dimension) becomes a dimension of size 1, read at coordinate 0. Keys and rows past the end
// read zeros. False where TMA cannot read the mask (keys not contiguous, a base or stride not a
// multiple of 16 bytes) or the encoder refuses.
template <typename Entry>
bool encode_mask_map(CUtensorMap* map, const Entry* base, const int64_t (&sizes)[4],
                     const int64_t (&strides)[4], uint32_t box_rows) {
  const EncodeTiled encode = tensor_map_encoder();
  if (encode == nullptr || strides[0] != 1 || reinterpret_cast<std::uintptr_t>(base) % 16 != 0) {
    return false;
  }
  cuuint64_t dims[4];
  cuuint64_t byte_strides[3];
  uint64_t extent = static_cast<uint64_t>(sizes[0]) * sizeof(Entry);  // of dims below
  dims[0] = static_cast<cuuint64_t>(sizes[0]);
  for (int d = 1; d < 4; ++d) {
    if (strides[d] < 0 || (strides[d] * sizeof(Entry)) % 16 != 0) {
      return false;
    }
    const bool broadcast = strides[d] == 0;
    dims[d] = broadcast ? 1 : static_cast<cuuint64_t>(sizes[d]);
    // A broadcast dimension is read at 0 only; its stride just has to be a valid one.
    extent = (extent + 15) / 16 * 16;
    byte_strides[d - 1] = broadcast ? extent : static_cast<cuuint64_t>(strides[d]) * sizeof(Entry);
    extent = byte_strides[d - 1] * dims[d];
  }
  const cuuint32_t box[4] = {128 / sizeof(Entry), box_rows, 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  if constexpr (std::is_same_v<Entry, __half>) {
    type = CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  } else if constexpr (std::is_same_v<Entry, __nv_bfloat16>) {
    type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  }
  return encode(map, type, 4, const_cast<Entry*>(base), dims, byte_strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

#endif  // FIXED_HAS_TENSOR_MAPS

}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_SM90_PIPELINE_CUH_
