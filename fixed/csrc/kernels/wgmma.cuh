// PTX wrappers for Hopper's warpgroup MMA (wgmma.mma_async, sm_90a only; PTX ISA 9.7.15), the
// shapes flash_forward_sm90.cuh and flash_backward_sm90.cuh use. The instructions exist only
// in images compiled for sm_90a: outside one (__CUDA_ARCH_FEAT_SM90_ALL undefined) every wrapper
// compiles to nothing, and the caller must not reach it (the kernel takes its mma.sync body
// there).
//
// A warpgroup is 4 consecutive warps (128 threads) and issues each wgmma together. The f32
// accumulator of an m64nNk16 is, per warp w of the group, the mma.sync C layout of rows
// 16 w .. 16 w + 15: d[4 j + e] = D[16 w + g + 8 (e >> 1)][8 j + 2 t + (e & 1)] (g = lane >> 2,
// t = lane & 3). An A operand from registers is, per warp, the mma.sync m16n8k16 A fragment.
//
// Operands in shared memory are named by a 64-bit matrix descriptor. Here every tile uses the
// 128-byte swizzle (CUTLASS's Swizzle<3,4,3>): rows of 64 two-byte elements (128 bytes), in
// atoms of 8 rows (1024 bytes, 1024-byte aligned) in which row r's 16-byte chunk c sits at
// chunk c ^ (r & 7).
//   K-major operand (the reduction dim contiguous: Q and K of S = Q K^T): start address of the
//     first row at the k-step's 16 elements (32 bytes further per k-step, within the atom);
//     stride byte offset (SBO) = 1024, the next 8 rows; the leading byte offset is unused.
//   MN-major operand (N contiguous: V of O = P V, [key][d]): 64-element runs of N, 8 keys per
//     atom; LBO = the distance between 64-wide runs of N, SBO = between 8-key atoms. An A
//     operand can be MN-major too (M contiguous, imm-trans-a = 1; 16-bit types only), with the
//     same descriptor: LBO between 64-wide runs of M (unused when M = 64), SBO between the
//     8-row atoms of k.
// The async proxy reads shared memory: writes by st.shared or cp.async need
// fence.proxy.async before the barrier that publishes them to the warpgroups.
#ifndef FIXED_WGMMA_CUH_
#define FIXED_WGMMA_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace fixed_attention {
namespace kernels {
namespace flash {

// Matrix descriptor: start address, LBO and SBO (bytes >> 4, 14 bits each) and the swizzle
// mode in bits 62-63 (1: 128-byte swizzle). Encoded once per tile for the many wgmmas that read
// it at fixed byte offsets (k-steps, 64-wide runs): at(offset) adds offset / 16 to the address
// field, one 32-bit add. Shared-memory addresses stay under 2^18, so the field never carries
// into LBO's. Encoding each wgmma's start address anew (mask, shift, or) cost about 12
// instructions per wgmma in the consumers' loops (nvcc 13.0, sm_90a; perf/NOTES.md, v37).
struct TileDescriptor {
  uint32_t low;   // start address >> 4 in bits 0-13, LBO >> 4 in bits 16-29
  uint32_t high;  // SBO >> 4 in bits 0-13 (32-45 of the descriptor), the swizzle in bits 30-31
  __device__ __forceinline__ TileDescriptor(uint32_t smem_address, uint32_t lbo, uint32_t sbo)
      : low(((smem_address & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16)),
        high(((sbo & 0x3FFFF) >> 4) | (1u << 30)) {}
  // The descriptor of the same tile `offset` bytes further (a multiple of 16).
  __device__ __forceinline__ uint64_t at(uint32_t offset) const {
    return (static_cast<uint64_t>(high) << 32) | (low + (offset >> 4));
  }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FIXED_WGMMA_ASM(...) asm volatile(__VA_ARGS__)
#else
#define FIXED_WGMMA_ASM(...) \
  do {                       \
  } while (0)
#endif

// Orders this thread's register accesses before the warpgroup's next wgmma (needed before the
// first one and whenever the accumulators or A registers were touched since).
__device__ __forceinline__ void wgmma_fence() {
  FIXED_WGMMA_ASM("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit_group() {
  FIXED_WGMMA_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
  FIXED_WGMMA_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Four 8 x 8 tiles of 16-bit values from registers to shared memory (an mma accumulator's
// layout: each thread's word holds two neighbours of one row): lane l gives the address of row
// l % 8 of tile l / 8, word i of every thread goes to tile i.
__device__ __forceinline__ void stmatrix_x4(uint32_t address, uint32_t w0, uint32_t w1,
                                            uint32_t w2, uint32_t w3) {
  FIXED_WGMMA_ASM("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                      address),
                  "r"(w0), "r"(w1), "r"(w2), "r"(w3)
                  : "memory");
}
// Makes this thread's generic-proxy shared-memory writes visible to the async proxy.
__device__ __forceinline__ void fence_proxy_async_shared() {
  FIXED_WGMMA_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Bulk reduction (the TMA unit, sm_90; used beside the wgmmas, so under the same guard): adds
// `bytes` of float32 at shared-memory `source` to global `destination` element by element,
// asynchronously, as one request instead of a red.global per pair and thread. Both addresses
// 16-byte aligned, bytes a multiple of 16. The issuing thread tracks it as a bulk group: commit,
// then wait_group_read before the source is rewritten, wait_group before the CTA exits.
__device__ __forceinline__ void bulk_reduce_add_f32(float* destination, uint32_t source,
                                                    uint32_t bytes) {
  FIXED_WGMMA_ASM(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
          destination),
      "r"(source), "r"(bytes)
      : "memory");
}
// Asks the TMA unit to bring `bytes` of global memory at `source` into L2 (no destination, no
// completion to wait for). `source` 16-byte aligned, bytes a multiple of 16.
__device__ __forceinline__ void bulk_prefetch_l2(const void* source, uint32_t bytes) {
  FIXED_WGMMA_ASM("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(source), "r"(bytes)
                  : "memory");
}
__device__ __forceinline__ void bulk_commit_group() {
  FIXED_WGMMA_ASM("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Until every committed bulk group has finished reading its shared-memory source.
__device__ __forceinline__ void bulk_wait_group_read_all() {
  FIXED_WGMMA_ASM("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
// Until every committed bulk group has completed (its global writes performed).
__device__ __forceinline__ void bulk_wait_group_all() {
  FIXED_WGMMA_ASM("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
// The compiler does not know that a wgmma writes its accumulators asynchronously: an empty asm
// that "modifies" them keeps their uses after the wait.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&registers)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    asm volatile("" : "+f"(registers[i])::"memory");
  }
}

// The compiler does not know that a wgmma issued earlier still reads its A registers: an empty
// asm that "modifies" them after the wait keeps them from being reused before it.
template <int N>
__device__ __forceinline__ void wgmma_fence_fragments(uint32_t (&registers)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      asm volatile("" : "+r"(registers[i][r])::"memory");
    }
  }
}

#define FIXED_WGMMA_D8(i)                                                                 \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define FIXED_WGMMA_D16 FIXED_WGMMA_D8(0), FIXED_WGMMA_D8(8)
#define FIXED_WGMMA_D32 \
  FIXED_WGMMA_D8(0), FIXED_WGMMA_D8(8), FIXED_WGMMA_D8(16), FIXED_WGMMA_D8(24)
#define FIXED_WGMMA_D64                                                             \
  FIXED_WGMMA_D8(0), FIXED_WGMMA_D8(8), FIXED_WGMMA_D8(16), FIXED_WGMMA_D8(24),     \
      FIXED_WGMMA_D8(32), FIXED_WGMMA_D8(40), FIXED_WGMMA_D8(48), FIXED_WGMMA_D8(56)
#define FIXED_WGMMA_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define FIXED_WGMMA_REGS32                                                               \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FIXED_WGMMA_REGS64                                                                   \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "     \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, " \
  "%37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, " \
  "%55, %56, %57, %58, %59, %60, %61, %62, %63}"

#define FIXED_WGMMA_D40 FIXED_WGMMA_D32, FIXED_WGMMA_D8(32)
#define FIXED_WGMMA_REGS40                                                               \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, " \
  "%36, %37, %38, %39}"
#define FIXED_WGMMA_D88                                                             \
  FIXED_WGMMA_D64, FIXED_WGMMA_D8(64), FIXED_WGMMA_D8(72), FIXED_WGMMA_D8(80)
#define FIXED_WGMMA_REGS88 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, " \
  "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, " \
  "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, " \
  "%70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, " \
  "%87}"

// D (64 x 32, f32) = A B (+ D when accumulate): A 64 x 16 and B 16 x 32 both K-major in shared
// memory (flash_backward_sm90_wide.cuh's S^T and dP^T over one warpgroup's 32 queries).
#define FIXED_WGMMA_M64N32K16_SS(TYPE)                                                      \
  FIXED_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                              \
                  "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " "           \
                  FIXED_WGMMA_REGS16 ", %16, %17, p, 1, 1, 0, 0;\n}\n"                      \
                  : FIXED_WGMMA_D16                                                         \
                  : "l"(desc_a), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)))
template <typename T>
__device__ __forceinline__ void wgmma_m64n32k16_ss(float (&d)[16], uint64_t desc_a,
                                                   uint64_t desc_b, bool accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    FIXED_WGMMA_M64N32K16_SS("bf16");
  } else {
    FIXED_WGMMA_M64N32K16_SS("f16");
  }
}

// D (64 x 64, f32) = A B (+ D when accumulate): A 64 x 16 and B 16 x 64 both K-major in shared
// memory.
#define FIXED_WGMMA_M64N64K16_SS(TYPE)                                                      \
  FIXED_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                              \
                  "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "           \
                  FIXED_WGMMA_REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"                      \
                  : FIXED_WGMMA_D32                                                         \
                  : "l"(desc_a), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)))
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a,
                                                   uint64_t desc_b, bool accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    FIXED_WGMMA_M64N64K16_SS("bf16");
  } else {
    FIXED_WGMMA_M64N64K16_SS("f16");
  }
}

// D (64 x 128, f32) = A B (+ D when accumulate): A 64 x 16 and B 16 x 128 both K-major in
// shared memory (flash_backward_sm90.cuh's S^T = K Q^T and dP^T = V dO^T over 128 queries).
#define FIXED_WGMMA_M64N128K16_SS(TYPE)                                                     \
  FIXED_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                              \
                  "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " "          \
                  FIXED_WGMMA_REGS64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"                     \
                  : FIXED_WGMMA_D64                                                         \
                  : "l"(desc_a), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)))
template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a,
                                                    uint64_t desc_b, bool accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    FIXED_WGMMA_M64N128K16_SS("bf16");
  } else {
    FIXED_WGMMA_M64N128K16_SS("f16");
  }
}

// D (64 x 80, f32) = A B (+ D when accumulate): A 64 x 16 and B 16 x 80 both K-major in shared
// memory (the forward's S = Q K^T over 80-key blocks at head dim 256, FlashAttention-3's).
#define FIXED_WGMMA_M64N80K16_SS(TYPE)                                                      \
  FIXED_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"                              \
                  "wgmma.mma_async.sync.aligned.m64n80k16.f32." TYPE "." TYPE " "           \
                  FIXED_WGMMA_REGS40 ", %40, %41, p, 1, 1, 0, 0;\n}\n"                     \
                  : FIXED_WGMMA_D40                                                         \
                  : "l"(desc_a), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)))
template <typename T>
__device__ __forceinline__ void wgmma_m64n80k16_ss(float (&d)[40], uint64_t desc_a,
                                                   uint64_t desc_b, bool accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    FIXED_WGMMA_M64N80K16_SS("bf16");
  } else {
    FIXED_WGMMA_M64N80K16_SS("f16");
  }
}

// D (64 x 176, f32) = A B (+ D when accumulate): A 64 x 16 and B 16 x 176 both K-major in
// shared memory (the forward's S = Q K^T over 176-key blocks at head dim 128, FlashAttention-3's).
#define FIXED_WGMMA_M64N176K16_SS(TYPE)                                                     \
  FIXED_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"                              \
                  "wgmma.mma_async.sync.aligned.m64n176k16.f32." TYPE "." TYPE " "          \
                  FIXED_WGMMA_REGS88 ", %88, %89, p, 1, 1, 0, 0;\n}\n"                     \
                  : FIXED_WGMMA_D88                                                         \
                  : "l"(desc_a), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)))
template <typename T>
__device__ __forceinline__ void wgmma_m64n176k16_ss(float (&d)[88], uint64_t desc_a,
                                                    uint64_t desc_b, bool accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    FIXED_WGMMA_M64N176K16_SS("bf16");
  } else {
    FIXED_WGMMA_M64N176K16_SS("f16");
  }
}

// D (64 x 64, f32) = A B (+ D when accumulate): A 64 x 16 and B 16 x 64 both MN-major in shared
// memory (imm-trans-a = imm-trans-b = 1: A's 64 rows contiguous for each k, B's 64 columns
// contiguous for each k). flash_backward_sm90.cuh's dQ = dS K: A = dS read from the stored
// dS^T ([key][query]), B = K ([key][d]).
#define FIXED_WGMMA_M64N64K16_SS_MN(TYPE)                                                   \
  FIXED_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                              \
                  "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "           \
                  FIXED_WGMMA_REGS32 ", %32, %33, p, 1, 1, 1, 1;\n}\n"                      \
                  : FIXED_WGMMA_D32                                                         \
                  : "l"(desc_a), "l"(desc_b), "r"(static_cast<uint32_t>(accumulate)))
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16_ss_mn(float (&d)[32], uint64_t desc_a,
                                                      uint64_t desc_b, bool accumulate) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    FIXED_WGMMA_M64N64K16_SS_MN("bf16");
  } else {
    FIXED_WGMMA_M64N64K16_SS_MN("f16");
  }
}

// D (64 x 128, f32) += A B: A 64 x 16 K-major and B 16 x 128 MN-major (imm-trans-b = 1), both
// in shared memory (flash_backward_sm90_wide.cuh's dV += P^T dO and dK += dS^T Q, where both
// warpgroups read the whole P^T and dS^T).
#define FIXED_WGMMA_M64N128K16_SS_BMN(TYPE)                                                 \
  FIXED_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                              \
                  "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " "          \
                  FIXED_WGMMA_REGS64 ", %64, %65, p, 1, 1, 0, 1;\n}\n"                     \
                  : FIXED_WGMMA_D64                                                         \
                  : "l"(desc_a), "l"(desc_b), "r"(1u))
template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16_ss_bmn(float (&d)[64], uint64_t desc_a,
                                                        uint64_t desc_b) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    FIXED_WGMMA_M64N128K16_SS_BMN("bf16");
  } else {
    FIXED_WGMMA_M64N128K16_SS_BMN("f16");
  }
}

// D (64 x 128, f32) += A B: A 64 x 16 from registers (the mma.sync A fragment per warp), B
// 16 x 128 MN-major in shared memory (the trailing 1: B transposed, N contiguous).
#define FIXED_WGMMA_M64N128K16_RS(TYPE)                                                      \
  FIXED_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                               \
                  "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " "           \
                  FIXED_WGMMA_REGS64 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"        \
                  : FIXED_WGMMA_D64                                                          \
                  : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1u))
template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4],
                                                    uint64_t desc_b) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    FIXED_WGMMA_M64N128K16_RS("bf16");
  } else {
    FIXED_WGMMA_M64N128K16_RS("f16");
  }
}

// D (64 x 256, f32) += A B as two m64n128k16 products (head dim 256): columns 0-127 of B at
// desc_lo, 128-255 at desc_hi; d's first 64 registers are the first product's accumulator
// fragment, its last 64 the second's (wgmma.cuh's layout: 4 registers per 8 columns).
template <typename T>
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[128], const uint32_t (&a)[4],
                                                    uint64_t desc_lo, uint64_t desc_hi) {
  wgmma_m64n128k16_rs<T>(*reinterpret_cast<float(*)[64]>(d), a, desc_lo);
  wgmma_m64n128k16_rs<T>(*reinterpret_cast<float(*)[64]>(d + 64), a, desc_hi);
}

// The same with B 16 x 64 (head dim 64).
#define FIXED_WGMMA_M64N64K16_RS(TYPE)                                                       \
  FIXED_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                               \
                  "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "            \
                  FIXED_WGMMA_REGS32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"        \
                  : FIXED_WGMMA_D32                                                          \
                  : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1u))
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4],
                                                   uint64_t desc_b) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    FIXED_WGMMA_M64N64K16_RS("bf16");
  } else {
    FIXED_WGMMA_M64N64K16_RS("f16");
  }
}

// D (64 x N, f32) = A B (+ D where `accumulate`) over one k-step, N 64 or 128, A and B K-major
// in shared memory (the backward's S^T and dP^T).
template <typename T, int N>
__device__ __forceinline__ void wgmma_m64k16_ss(float (&d)[N / 2], uint64_t desc_a,
                                                uint64_t desc_b, bool accumulate) {
  static_assert(N == 64 || N == 128);
  if constexpr (N == 128) {
    wgmma_m64n128k16_ss<T>(d, desc_a, desc_b, accumulate);
  } else {
    wgmma_m64n64k16_ss<T>(d, desc_a, desc_b, accumulate);
  }
}
// D (64 x N) += A B, N 64 or 128, A from registers, B MN-major (the backward's dV and dK).
template <typename T, int N>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&d)[N / 2], const uint32_t (&a)[4],
                                                uint64_t desc_b) {
  static_assert(N == 64 || N == 128);
  if constexpr (N == 128) {
    wgmma_m64n128k16_rs<T>(d, a, desc_b);
  } else {
    wgmma_m64n64k16_rs<T>(d, a, desc_b);
  }
}

#undef FIXED_WGMMA_M64N64K16_SS_MN
#undef FIXED_WGMMA_M64N32K16_SS
#undef FIXED_WGMMA_M64N128K16_SS_BMN
#undef FIXED_WGMMA_M64N128K16_SS
#undef FIXED_WGMMA_M64N64K16_RS
#undef FIXED_WGMMA_M64N128K16_RS
#undef FIXED_WGMMA_M64N64K16_SS
#undef FIXED_WGMMA_REGS64
#undef FIXED_WGMMA_REGS32
#undef FIXED_WGMMA_REGS16
#undef FIXED_WGMMA_D64
#undef FIXED_WGMMA_D32
#undef FIXED_WGMMA_D16
#undef FIXED_WGMMA_D8
#undef FIXED_WGMMA_ASM

// True when the image of `kernel` that the current device runs holds the sm_90a body: its static
// shared memory is 0 bytes there and 16 (a `__shared__ uint32_t [4]` marker that the kernel's other
// branch keeps) in every other image, a plain sm_90 or a JIT-compiled older PTX included. The host
// cannot tell sm_90 from sm_90a otherwise.
template <typename Kernel>
bool has_sm90a_image(Kernel* kernel) {
  cudaFuncAttributes attributes{};
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
    (void)cudaGetLastError();  // answered "no": the caller takes another kernel
    return false;
  }
  return attributes.binaryVersion == 90 && attributes.sharedSizeBytes == 0;
}

}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_WGMMA_CUH_
