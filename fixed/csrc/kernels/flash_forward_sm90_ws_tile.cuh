// The warp-specialized Hopper forward's tilings (`Tile`: rows, key block, stages, consumers,
// registers, shared memory) and the mbarriers' places after its buffers (`Barriers`); the CTA
// that runs them is flash_forward_sm90_ws_cta.cuh, the tilings the operator uses are named in
// flash_forward_sm90_ws.cuh.
//
// No torch includes: CI compile-checks this header for sm_90a and sm_90 without a GPU.
#ifndef FIXED_FLASH_FORWARD_SM90_WS_TILE_CUH_
#define FIXED_FLASH_FORWARD_SM90_WS_TILE_CUH_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace fixed_attention {
namespace kernels {
namespace flash {
namespace sm90_ws {

// kMaskStages: buffers of mask tiles (0: a tiling for problems without a mask or dropout).
// kConsumers: consumer warpgroups of 64 rows each, 2 or 3 (FlashAttention-3's 192-row tiles at
// D = 64). kPingPong: the consumers take turns issuing their products, in rotation where there
// are three (flash_forward_sm90_ws_cta.cuh). MaskEntry: float, or the inputs' 16-bit dtype
// (mask_in_input_dtype; WithMaskEntry).
// kValueDim: V's and O's columns, kHeadDim or a narrower 64 (Ev <= 64 under E <= 128).
// kStagesO: O leaves through shared memory and TMA stores (below); by default with two
// consumers in ping-pong.
template <int kHeadDim_, int kBlockN_, int kStages_, bool kPingPong_, int kMaskStages_ = 0,
          int kConsumers_ = 2, typename MaskEntry_ = float, int kValueDim_ = kHeadDim_,
          bool kStagesO_ = kConsumers_ == 2 && kPingPong_>
struct Tile {
  using MaskEntry = MaskEntry_;
  template <typename Entry>
  using WithMaskEntry = Tile<kHeadDim_, kBlockN_, kStages_, kPingPong_, kMaskStages_,
                             kConsumers_, Entry, kValueDim_, kStagesO_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kValueDim = kValueDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kPingPong = kPingPong_;
  static constexpr int kMaskStages = kMaskStages_;
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kBlockM = 64 * kConsumers;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kConsumerWarps = 4 * kConsumers;
  static constexpr int kNTiles = kBlockN / 8;   // 8-key column tiles of S per warp
  static constexpr int kDTiles = kValueDim / 8;  // 8-wide column tiles of O per warp
  static constexpr uint32_t kRowBytes = 128;    // one 64-element half row
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * 2;
  static constexpr uint32_t kKBytes = kBlockN * kHeadDim * 2;
  static constexpr uint32_t kVBytes = kBlockN * kValueDim * 2;
  // The mask (flash_forward_sm90_ws_args.cuh): per key block kMaskBoxes boxes of kBlockM rows x
  // 128 bytes (32 float32 keys, 64 16-bit ones).
  static constexpr int kMaskKeysPerBox = 128 / static_cast<int>(sizeof(MaskEntry));
  static constexpr int kMaskBoxes = kBlockN / kMaskKeysPerBox;
  static constexpr uint32_t kMaskBoxBytes = kBlockM * 128;
  static constexpr uint32_t kMaskBytes = kMaskBoxes * kMaskBoxBytes;
  static constexpr uint32_t kBarrierBytes = 8 * (3 + 4 * kStages + 2 * kMaskStages);
  static constexpr std::size_t kSmemBytes = 1024 + kQBytes + kStages * (kKBytes + kVBytes) +
                                            kMaskStages * kMaskBytes + kBarrierBytes;
  // The last round's split along the keys (flash_forward_sm90_ws_schedule.cuh) is compiled into
  // the 192-row tiles alone: their 5.3-round problems gain from it; the 128-row tiles ran 2-3%
  // slower with its code and no measured shape of theirs gained (perf/NOTES.md, v35).
  static constexpr bool kSplitsTail = kConsumers == 3;
  // O leaves through a buffer of the item's last key block and TMA (flash_forward_sm90_ws_
  // epilogue.cuh's stage_rows) where kStagesO_ asks for it: the last consumer's warps through
  // V's, the others' through their rows of K's. The turns make it safe (the CTA says how).
  static constexpr bool kStagesO = kStagesO_;
  static_assert(!kStagesO ||
                    (kPingPong && (kConsumers - 1) * 64 * kValueDim <= kBlockN * kHeadDim),
                "staged O needs turns, and K's buffer must hold the rows of all but one consumer");
  static_assert(kBlockN >= 64, "a warpgroup's O (64 rows) fits a V buffer");
  // The registers at launch (__launch_bounds__(kThreads, 1)), less the producer's 24 per thread
  // (32 with three consumers, whose split would spill at 24), shared by the consumers in
  // multiples of 8, at most 240: 240 for two consumer warpgroups, 160 for three.
  static constexpr uint32_t kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static constexpr uint32_t kProducerRegisters = kConsumers == 3 ? 32 : 24;
  static constexpr uint32_t kSpare =
      (kThreads * kLaunchRegisters - 128 * kProducerRegisters) / (128 * kConsumers);
  static constexpr uint32_t kConsumerRegisters = kSpare / 8 * 8 > 240 ? 240 : kSpare / 8 * 8;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256,
                "one, two or four 64-element parts per row");
  static_assert(kValueDim == kHeadDim || kValueDim == 64, "V: kHeadDim or 64 columns");
  static_assert(kBlockN == 64 || kBlockN == 80 || kBlockN == 128 || kBlockN == 176,
                "S by wgmma n64, n80, n128 or n176");
  static_assert(kBlockN % 64 == 0 || kMaskStages == 0, "the mask's boxes: 64-key blocks");
  static_assert(128 * kProducerRegisters + 128 * kConsumers * kConsumerRegisters <=
                kThreads * kLaunchRegisters);
  static_assert(kConsumers == 2 || kConsumers == 3, "rows: 128 or 192 (TMA boxes <= 256)");
    static_assert(kSmemBytes <= 227 * 1024, "an H100's shared memory per block");
};

// The mbarriers, after the tiles: Q full and empty, K full, K empty, V full, V empty per
// stage, mask full, mask empty per mask stage; then a word for a split part's arrival.
template <class F>
struct Barriers {
  static constexpr uint32_t kS = F::kStages, kM = F::kMaskStages;
  uint32_t base;
  __device__ __forceinline__ uint32_t at(uint32_t i) const { return base + 8 * i; }
  __device__ __forceinline__ uint32_t q_full() const { return at(0); }
  __device__ __forceinline__ uint32_t q_empty() const { return at(1); }
  __device__ __forceinline__ uint32_t k_full(uint32_t st) const { return at(2 + st); }
  __device__ __forceinline__ uint32_t k_empty(uint32_t st) const { return at(2 + kS + st); }
  __device__ __forceinline__ uint32_t v_full(uint32_t st) const { return at(2 + 2 * kS + st); }
  __device__ __forceinline__ uint32_t v_empty(uint32_t st) const { return at(2 + 3 * kS + st); }
  __device__ __forceinline__ uint32_t mask_full(uint32_t st) const { return at(2 + 4 * kS + st); }
  __device__ __forceinline__ uint32_t mask_empty(uint32_t st) const {
    return at(2 + 4 * kS + kM + st);
  }
  __device__ __forceinline__ uint32_t split_flag() const { return at(2 + 4 * kS + 2 * kM); }
};

}  // namespace sm90_ws
}  // namespace flash
}  // namespace kernels
}  // namespace fixed_attention

#endif  // FIXED_FLASH_FORWARD_SM90_WS_TILE_CUH_
