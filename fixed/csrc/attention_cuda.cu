// CUDA kernels of the fixed_attention operators: the torch side only. Every entry runs the same
// sequence, the lessons of the unsafe wrapper in order:
//   check the inputs -> guard the inputs' device -> take the current stream -> allocate outputs
//   on the device -> return early without a launch when empty -> launch -> check the launch.
// The kernels and their launchers are in kernels/ (its README says which file holds what):
// attention_kernels.cuh (generic) and, for half and bfloat16 on tensor cores,
// flash_forward.cuh and flash_backward.cuh (mma.sync, sm_80 and later) and
// flash_forward_sm90.cuh and flash_backward_sm90.cuh (wgmma, Hopper; the latter's
// launch_flash_backward tries the wgmma backward, then flash_backward.cuh's); no torch includes
// there, so nvcc can compile-check them without a GPU. Half and bfloat16 run on the tensor-core
// kernels with every SDPA argument (a mask, dropout, grouped-query heads), and so do other head
// dims and Ev != E up to 128: as they are on Hopper (both passes, multiples of 8), padded
// elsewhere (padded_head_dim); and so do head dims up to 256 (as they are on Hopper, both
// passes; padded to 256 elsewhere). float32 runs on tensor cores
// too, in 3xTF32 (float32's accuracy): the forward and backward at head dims 64 and 128
// (flash_forward_f32.cuh, flash_backward_f32.cuh), other head dims up to 128 padded; wider
// heads run generic.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraphsUtils.cuh>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/attention_backward_kernels.cuh"
#include "kernels/attention_kernels.cuh"
#include "checks.h"
#include "kernels/flash_backward_sm90.cuh"
#include "kernels/flash_forward.cuh"
#include "kernels/flash_forward_sm90.cuh"
#include "kernels/mask_tiles.cuh"

namespace fixed_attention {
namespace {

// at::Half and at::BFloat16 have the bit layout of CUDA's __half and __nv_bfloat16.
template <typename scalar_t>
struct CudaType {
  using type = scalar_t;
};
template <>
struct CudaType<at::Half> {
  using type = __half;
};
template <>
struct CudaType<at::BFloat16> {
  using type = __nv_bfloat16;
};

template <typename scalar_t>
const typename CudaType<scalar_t>::type* cuda_ptr(const at::Tensor& tensor) {
  return reinterpret_cast<const typename CudaType<scalar_t>::type*>(
      tensor.const_data_ptr<scalar_t>());
}

template <typename scalar_t>
typename CudaType<scalar_t>::type* cuda_mutable_ptr(at::Tensor& tensor) {
  return reinterpret_cast<typename CudaType<scalar_t>::type*>(tensor.mutable_data_ptr<scalar_t>());
}

// The dtypes the CUDA kernels have; check_attention_inputs already rejected the rest (float64
// on CUDA is a TypeError there), so the switch's default is unreachable.
#define FIXED_ATTENTION_DISPATCH_CUDA_TYPES(TYPE, NAME, ...)  \
  AT_DISPATCH_SWITCH(TYPE, NAME,                              \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// Which kHiddenTile x kHiddenTile tiles (rows x keys) of the additive mask are entirely -inf
// or entirely 0: a uint8 map, 1 where hidden, 2 where zero, for the tensor-core kernels to skip
// those blocks (a causal, sliding-window or padding mask hides many; their probabilities are all
// 0, so skipping changes nothing) and, on Hopper, the mask's loads in these (most of a mask made
// from bools: adding 0 changes nothing either). Of the mask's own elements (size 1 where it is
// broadcast, the map too).
struct HiddenTiles {
  at::Tensor any;    // int32 [1]: bit 0 when some tile is hidden, bit 1 when some is zero
  at::Tensor tiles;  // uint8 (outer or 1, heads or 1, row tiles or 1, key tiles or 1), 1 / 2
};

// The mask as the kernels take it: additive_mask's (batch / heads, heads, L, S) view, float32
// or (the backward's, AttentionProblem::mask_in_input_dtype) in the inputs' half or bfloat16,
// and its HiddenTiles where a tensor-core kernel may use them; none of either without a mask.
struct KernelMask {
  std::optional<at::Tensor> additive;
  std::optional<HiddenTiles> hidden;
};

// The map is made (kernels/mask_tiles.cuh) for half and bfloat16 inputs, only where the mask's
// own elements are at most an eighth of the scores, so that the pass costs little beside the
// attention kernels, by one launch on `stream` that also makes a bool, float16, bfloat16 or
// float64 mask additive float32 (a float32 one is read as it is). Otherwise additive_mask
// converts it with torch's ops and there is no map.
// Where `input_dtype` (the backward; the forward on Hopper), a bool mask or one in the inputs'
// dtype stays 16-bit: 0 / -inf and such entries are exact in it, and the kernels, which read
// the mask once per key block (backward) or query block (forward), move half the bytes. The
// keys must not be broadcast, and the kernels copy rows in 16-byte runs: a mask of that dtype
// whose rows are not 16-byte aligned is copied with its rows padded, as a bool one always is
// (kernels: mask_in_octets).
KernelMask kernel_mask(const std::optional<at::Tensor>& attn_mask, const at::Tensor& query,
                       const AttentionShape& shape, bool causal, bool input_dtype,
                       cudaStream_t stream) {
  if (!attn_mask.has_value()) {
    return {};
  }
  constexpr int64_t kTile = kernels::flash::kHiddenTile;
  const bool half = query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16;
  const at::ScalarType dtype = attn_mask->scalar_type();
  const bool readable = dtype == at::kBool || dtype == at::kHalf || dtype == at::kBFloat16 ||
                        dtype == at::kFloat || dtype == at::kDouble;
  if (!half || !readable || (shape.len_q <= kTile && shape.len_kv <= kTile)) {
    return {additive_mask(attn_mask, query, shape, causal, at::kFloat), std::nullopt};
  }
  const at::Tensor view = *checked_mask(attn_mask, query, shape, causal);  // its own dtype
  at::Tensor own = view;
  for (int64_t dim = 0; dim < 4; ++dim) {
    if (own.stride(dim) == 0 && own.size(dim) > 1) {
      own = own.narrow(dim, 0, 1);
    }
  }
  if (own.numel() == 0 || own.numel() * 8 > shape.batch * shape.len_q * shape.len_kv) {
    return {additive_mask(attn_mask, query, shape, causal, at::kFloat), std::nullopt};
  }
  const int64_t rows = own.size(2), keys = own.size(3);
  const bool narrow =
      input_dtype && (dtype == at::kBool || dtype == query.scalar_type()) && keys == shape.len_kv;
  const at::ScalarType kernel_dtype = narrow ? query.scalar_type() : at::kFloat;
  const auto octets = [](const at::Tensor& mask) {  // kernels::flash::mask_in_octets
    const auto address = reinterpret_cast<std::uintptr_t>(mask.const_data_ptr());
    return mask.stride(3) == 1 && mask.stride(0) % 8 == 0 && mask.stride(1) % 8 == 0 &&
           mask.stride(2) % 8 == 0 && address % 16 == 0;
  };
  const bool in_place = dtype == kernel_dtype && (!narrow || octets(view));
  const int64_t converted_row = narrow ? kernels::ceil_div(keys, 8) * 8 : keys;
  const int tile_rows = rows == 1 ? 1 : kTile, tile_keys = keys == 1 ? 1 : kTile;
  const int64_t row_tiles = kernels::ceil_div(rows, tile_rows);
  const int64_t key_tiles = kernels::ceil_div(keys, tile_keys);
  HiddenTiles hidden{at::zeros({1}, view.options().dtype(at::kInt)),
                     at::empty({own.size(0), own.size(1), row_tiles, key_tiles},
                               view.options().dtype(at::kByte))};
  const kernels::flash::MaskTiles geometry{own.stride(0), own.stride(1), own.stride(2),
                                           own.stride(3), own.size(1),   rows,
                                           keys,          tile_rows,     tile_keys,
                                           row_tiles,     key_tiles,     hidden.tiles.numel(),
                                           converted_row};
  // The entries in kernel_dtype, in the own sizes (rows converted_row apart), unless the mask
  // can be read as it is.
  std::optional<at::Tensor> converted;
  if (!in_place) {
    converted = at::empty({own.size(0), own.size(1), rows, converted_row},
                          view.options().dtype(kernel_dtype))
                    .narrow(3, 0, keys);
  }
  const auto launch = [&](const auto* entries, auto* target) {
    kernels::flash::launch_mask_tiles(entries, geometry, target,
                                      hidden.tiles.mutable_data_ptr<uint8_t>(),
                                      hidden.any.mutable_data_ptr<int>(), stream);
  };
  const void* const entries = own.const_data_ptr();
  void* const target = converted ? converted->mutable_data_ptr() : nullptr;
  if (kernel_dtype == at::kHalf) {  // from bool or half
    auto* const half_target = static_cast<__half*>(target);
    dtype == at::kBool ? launch(static_cast<const bool*>(entries), half_target)
                       : launch(static_cast<const __half*>(entries), half_target);
  } else if (kernel_dtype == at::kBFloat16) {  // from bool or bfloat16
    auto* const bf16_target = static_cast<__nv_bfloat16*>(target);
    dtype == at::kBool ? launch(static_cast<const bool*>(entries), bf16_target)
                       : launch(static_cast<const __nv_bfloat16*>(entries), bf16_target);
  } else {
    auto* const float_target = static_cast<float*>(target);
    switch (dtype) {
      case at::kBool: launch(static_cast<const bool*>(entries), float_target); break;
      case at::kHalf: launch(static_cast<const __half*>(entries), float_target); break;
      case at::kBFloat16: launch(static_cast<const __nv_bfloat16*>(entries), float_target); break;
      case at::kDouble: launch(static_cast<const double*>(entries), float_target); break;
      default: launch(static_cast<const float*>(entries), float_target); break;
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {converted ? converted->expand(view.sizes()) : view, hidden};
}

// mask: kernel_mask's (batch / heads, heads, L, S) view, or none; hidden: its
// HiddenTiles, or none. The caller keeps both alive until the kernels have been launched
// (they read them on the stream, in order).
kernels::AttentionProblem make_problem(const AttentionShape& shape, double scale, bool causal,
                                       const std::optional<at::Tensor>& mask,
                                       const std::optional<HiddenTiles>& hidden, double dropout_p,
                                       uint64_t dropout_seed) {
  kernels::AttentionProblem problem{shape.batch, shape.len_q, shape.len_kv, shape.head_dim,
                                    static_cast<float>(scale), causal};
  problem.head_dim_v = shape.head_dim_v;
  problem.heads = shape.heads;
  problem.kv_group = shape.kv_group;
  if (mask.has_value()) {
    // float32, or the inputs' dtype (kernel_mask makes no other).
    problem.mask = mask->const_data_ptr();
    problem.mask_in_input_dtype = mask->scalar_type() != at::kFloat;
    problem.mask_stride_outer = mask->stride(0);
    problem.mask_stride_head = mask->stride(1);
    problem.mask_stride_row = mask->stride(2);
    problem.mask_stride_col = mask->stride(3);
  }
  if (hidden.has_value()) {  // a dimension of size 1 is broadcast: stride 0
    const at::Tensor& tiles = hidden->tiles;
    const auto stride = [&](int64_t dim) { return tiles.size(dim) == 1 ? 0 : tiles.stride(dim); };
    problem.hidden_tiles = tiles.const_data_ptr<uint8_t>();
    problem.any_hidden = hidden->any.const_data_ptr<int>();
    problem.hidden_stride_outer = stride(0);
    problem.hidden_stride_head = stride(1);
    problem.hidden_stride_row = stride(2);
    problem.hidden_stride_col = stride(3);
  }
  problem.dropout_p = static_cast<float>(dropout_p);
  problem.dropout_seed = dropout_seed;
  return problem;
}

// The head dim at which a case runs on the tensor-core kernels when its own E and Ev are not a
// pair they take (Ev = E = 64, 128, and for half and bfloat16 256): the narrowest of those that
// holds both, Q, K and V padded with zero columns. Zero columns add nothing to Q K^T, and V's
// give output (and gradient) columns that are cut off: the same function, on tensor cores (a
// mask and dropout act on scores, which padding leaves as they are). 0 where the case runs as
// it is, or stays on the generic kernels anyway (float32 over 128).
int64_t padded_head_dim(const at::Tensor& query, const AttentionShape& shape) {
  const at::ScalarType dtype = query.scalar_type();
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  const bool tensor_cores = half || dtype == at::kFloat;
  const int64_t widest_kernel = half ? 256 : 128;
  const int64_t widest = std::max(shape.head_dim, shape.head_dim_v);
  if (!tensor_cores || widest > widest_kernel) {
    return 0;
  }
  const int64_t width = widest <= 64 ? 64 : widest <= 128 ? 128 : 256;
  return shape.head_dim == width && shape.head_dim_v == width ? 0 : width;
}

// `tensor` with zero columns appended up to `width` in its last dim: a new contiguous tensor, or
// `tensor` itself where it is that wide already (E = width, Ev narrower, or the reverse).
at::Tensor padded(const at::Tensor& tensor, int64_t width) {
  return tensor.size(-1) == width ? tensor
                                  : at::constant_pad_nd(tensor, {0, width - tensor.size(-1)}, 0);
}

// The first `columns` columns of a gradient computed at a padded width, into `gradient`; the
// wide one itself where nothing was padded (no copy).
at::Tensor cut_to(at::Tensor& gradient, const at::Tensor& wide, int64_t columns) {
  return wide.size(-1) == columns ? wide : gradient.copy_(wide.narrow(-1, 0, columns));
}

// The dropout seed is a host value baked into the launch: a captured CUDA graph would replay the
// same keep mask at every replay. Refused, as a RuntimeError, rather than silently repeated.
void check_dropout_not_captured(double dropout_p) {
  TORCH_CHECK(dropout_p == 0.0 ||
                  at::cuda::currentStreamCaptureStatus() == at::cuda::CaptureStatus::None,
              "fast_attention: dropout_p > 0 is not supported under CUDA graph capture (the "
              "seed would be frozen into the graph, the same keep mask at every replay); use "
              "dropout_p=0 in captured code");
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cuda(
    const at::Tensor& query,  // (..., L, E)
    const at::Tensor& key,    // (..., S, E); under enable_gqa (..., Hkv, S, E)
    const at::Tensor& value,  // (..., S, Ev); under enable_gqa (..., Hkv, S, Ev)
    double scale, bool causal,
    const std::optional<at::Tensor>& attn_mask,  // broadcastable to (..., L, S)
    bool enable_gqa, double dropout_p,
    const std::optional<at::Tensor>& dropout_seed) {  // 0-dim int64 CPU, with dropout
  // Dtype, devices (one device, float64 CPU-only), ranks, sizes, head dims, dropout_p and its
  // seed: typed errors naming the argument, before anything touches a device.
  const AttentionShape shape = check_attention_inputs(query, key, value, enable_gqa);
  check_cuda_head_dims(shape);
  const uint64_t seed = dropout_seed_of(dropout_p, dropout_seed);
  TORCH_INTERNAL_ASSERT(query.is_cuda());
  // Allocate, copy and launch on the inputs' device, not on whichever one is current.
  const c10::cuda::CUDAGuard device_guard(query.device());
  // The caller's stream on that device (torch.cuda.stream(s), CUDA-graph capture), never the
  // legacy default stream: ordered after whatever produced the inputs on it.
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  check_dropout_not_captured(dropout_p);
  // attn_mask is checked here, after the guard, because making it additive may allocate on its
  // device (a bool mask becomes a new tensor). Kept alive until after the launch. On Hopper in
  // the inputs' dtype where kernel_mask can (the warp-specialized kernel reads it; the others
  // decline it, and the launch below retries with a float32 one).
  KernelMask mask = kernel_mask(attn_mask, query, shape, causal,
                                /*input_dtype=*/kernels::flash::sm90::current_device_is_sm90(),
                                stream);

  // On the device, from the caching allocator (no host round trip, no sync); sizes only, so
  // both outputs are contiguous whatever the inputs' strides.
  std::vector<int64_t> output_sizes = query.sizes().vec();
  output_sizes.back() = shape.head_dim_v;
  at::Tensor output = at::empty(output_sizes, query.options());  // (..., L, Ev)
  at::Tensor logsumexp = at::empty(query.sizes().slice(0, query.dim() - 1),
                                   query.options().dtype(logsumexp_dtype(query.scalar_type())));
  if (shape.batch == 0 || shape.len_q == 0) {
    return {output, logsumexp};  // nothing to compute: no launch
  }
  if (shape.len_kv == 0) {  // as SDPA: nothing to attend to gives zeros
    output.zero_();
    logsumexp.fill_(-std::numeric_limits<double>::infinity());
    return {output, logsumexp};
  }
  // The kernels index contiguous (B, L, E) memory: one copy for views (transposed, sliced,
  // expanded); a no-op when the input is already contiguous. Under GQA, K and V keep their
  // fewer heads (B / kv_group items): the kernels index the shared one.
  const at::Tensor q = query.contiguous();  // (B, L, E)
  const at::Tensor k = key.contiguous();    // (B / kv_group, S, E)
  const at::Tensor v = value.contiguous();  // (B / kv_group, S, Ev)
  kernels::AttentionProblem problem =
      make_problem(shape, scale, causal, mask.additive, mask.hidden, dropout_p, seed);
  // Head dims the tensor-core kernels compute at a padded width: Hopper's takes them as they are
  // (multiples of 8); elsewhere (or where it declines) the problem is padded below, never given
  // to the generic one.
  const int64_t width = padded_head_dim(query, shape);

  // The Hopper forward splits a last round of work items that is at most half full along the
  // keys (flash_forward_sm90_ws_schedule.cuh): its float32 workspace and zeroed arrival counts
  // from the caching allocator, where it asks for them.
  kernels::SplitWorkspace split = kernels::flash_forward_sm90_split_workspace(problem);
  at::Tensor split_partial, split_counts;
  const bool half_precision =
      query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16;
  if (split.floats > 0 && half_precision) {
    split_partial = at::empty({split.floats}, query.options().dtype(at::kFloat));
    split_counts = at::zeros({split.counts}, query.options().dtype(at::kInt));
    split.partial = split_partial.mutable_data_ptr<float>();
    split.arrivals = reinterpret_cast<unsigned*>(split_counts.mutable_data_ptr<int>());
  } else {
    split = kernels::SplitWorkspace{};
  }

  bool launched = false;
  FIXED_ATTENTION_DISPATCH_CUDA_TYPES(query.scalar_type(), "attention_forward_cuda", [&] {
    // The fastest kernel that covers the case: Hopper's (compute capability 9.0), the mma.sync
    // one (half/bfloat16 at head dim 64, 128 or 256 with Ev = E; a mask, dropout and GQA included;
    // float32 there in 3xTF32), the generic one. Each launcher declines what it does not cover,
    // having launched nothing; either way at most one launch, checked below.
    const auto* q_ptr = cuda_ptr<scalar_t>(q);
    const auto* k_ptr = cuda_ptr<scalar_t>(k);
    const auto* v_ptr = cuda_ptr<scalar_t>(v);
    auto* out_ptr = cuda_mutable_ptr<scalar_t>(output);
    float* const lse_ptr = logsumexp.mutable_data_ptr<float>();
    const auto tensor_cores = [&] {
      return kernels::launch_flash_forward_sm90(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, problem,
                                                stream, split) ||
             kernels::launch_flash_forward(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, problem, stream);
    };
    launched = tensor_cores();
    if (!launched && problem.mask_in_input_dtype) {  // declined by the kernel that reads it
      mask = kernel_mask(attn_mask, query, shape, causal, /*input_dtype=*/false, stream);
      problem = make_problem(shape, scale, causal, mask.additive, mask.hidden, dropout_p, seed);
      launched = tensor_cores();
    }
    if (!launched && width == 0) {
      kernels::launch_attention_forward(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, problem, stream);
      launched = true;
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (!launched) {
    // The same problem at head dim `width` (the scale is the caller's, not 1/sqrt(width)), with
    // the same mask and dropout seed: the same keep mask, which depends on positions only.
    auto [wide_output, wide_logsumexp] =
        attention_forward_cuda(padded(query, width), padded(key, width), padded(value, width),
                               scale, causal, attn_mask, enable_gqa, dropout_p, dropout_seed);
    output.copy_(wide_output.narrow(-1, 0, shape.head_dim_v));
    return {output, wide_logsumexp};
  }
  return {output, logsumexp};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& grad_output,  // (..., L, Ev)
    const at::Tensor& query,        // (..., L, E)
    const at::Tensor& key,          // (..., S, E); under enable_gqa (..., Hkv, S, E)
    const at::Tensor& value,        // (..., S, Ev); under enable_gqa (..., Hkv, S, Ev)
    const at::Tensor& output,       // (..., L, Ev): the forward's, dropout applied
    const at::Tensor& logsumexp,    // (..., L), float32
    double scale, bool causal, const std::optional<at::Tensor>& attn_mask, bool enable_gqa,
    double dropout_p, const std::optional<at::Tensor>& dropout_seed) {
  const AttentionShape shape = check_attention_inputs(query, key, value, enable_gqa);
  check_cuda_head_dims(shape);
  check_backward_inputs(grad_output, query, value, output, logsumexp);
  const uint64_t seed = dropout_seed_of(dropout_p, dropout_seed);
  TORCH_INTERNAL_ASSERT(query.is_cuda());
  const c10::cuda::CUDAGuard device_guard(query.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  check_dropout_not_captured(dropout_p);
  const KernelMask mask =
      kernel_mask(attn_mask, query, shape, causal, /*input_dtype=*/true, stream);

  if (shape.batch == 0 || shape.len_q == 0 || shape.len_kv == 0) {
    // The output does not depend on any element: every gradient is zero. No kernel of ours.
    return {at::zeros(query.sizes(), query.options()), at::zeros(key.sizes(), key.options()),
            at::zeros(value.sizes(), value.options())};
  }
  // key's and value's shapes: under GQA each K/V head gets the sum over the query heads that
  // read it.
  at::Tensor grad_query = at::empty(query.sizes(), query.options());  // (..., L, E)
  at::Tensor grad_key = at::empty(key.sizes(), key.options());        // (..., S, E)
  at::Tensor grad_value = at::empty(value.sizes(), value.options());  // (..., S, Ev)
  // As the forward: head dims the tensor-core kernels compute at a padded width. Hopper's takes
  // them as they are (multiples of 8 up to 256); elsewhere (or where it declines) the problem is
  // padded below. Not in deterministic mode, whose generic kernels take any head dim as it is.
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  const int64_t width = deterministic ? 0 : padded_head_dim(query, shape);
  // One contiguous copy of each view, as in the forward.
  const at::Tensor dout = grad_output.contiguous();  // (B, L, Ev)
  const at::Tensor q = query.contiguous();           // (B, L, E)
  const at::Tensor k = key.contiguous();             // (B / kv_group, S, E)
  const at::Tensor v = value.contiguous();           // (B / kv_group, S, Ev)
  const at::Tensor out = output.contiguous();        // (B, L, Ev)
  const at::Tensor lse = logsumexp.contiguous();     // (B, L), float32
  const kernels::AttentionProblem problem =
      make_problem(shape, scale, causal, mask.additive, mask.hidden, dropout_p, seed);

  bool launched = false;
  FIXED_ATTENTION_DISPATCH_CUDA_TYPES(query.scalar_type(), "attention_backward_cuda", [&] {
    // The tensor-core backward where it covers the case (half/bfloat16 and float32); its float32
    // workspace comes from the caching allocator, on this device and stream. Its dQ sums by float
    // atomics, in no fixed order: under torch.use_deterministic_algorithms(True) the generic
    // kernels (one thread per element, GQA's dK and dV summed in a fixed order) answer instead.
    const kernels::BackwardWorkspace workspace =
        deterministic ? kernels::BackwardWorkspace{}
                      : kernels::flash_backward_workspace(cuda_ptr<scalar_t>(q), problem);
    if (workspace.rows > 0) {
      const at::TensorOptions f32 = query.options().dtype(at::kFloat);
      at::Tensor row_stats = at::empty({2, shape.batch, workspace.rows}, f32);  // lse, delta
      at::Tensor dq_accum = at::empty({shape.batch, workspace.rows, workspace.width}, f32);
      float* const lse_log2 = row_stats.mutable_data_ptr<float>();
      const auto launch = [&](const kernels::AttentionProblem& p, at::Tensor& dk,
                              at::Tensor& dv) {
        return kernels::launch_flash_backward(
            cuda_ptr<scalar_t>(dout), cuda_ptr<scalar_t>(q), cuda_ptr<scalar_t>(k),
            cuda_ptr<scalar_t>(v), cuda_ptr<scalar_t>(out), lse.const_data_ptr<float>(), lse_log2,
            lse_log2 + shape.batch * workspace.rows, dq_accum.mutable_data_ptr<float>(),
            cuda_mutable_ptr<scalar_t>(grad_query), cuda_mutable_ptr<scalar_t>(dk),
            cuda_mutable_ptr<scalar_t>(dv), p, stream);
      };
      // Under GQA each K/V head's dK and dV are the sums over its kv_group query heads. Asked
      // for them so (dkv_per_kv_item), Hopper's kernel sums them in registers where that pays;
      // otherwise the kernels write them per query head, (B, S, E), and each group is summed
      // after them, one reduction (as FlashAttention-2 does).
      kernels::AttentionProblem summed = problem;
      summed.dkv_per_kv_item = true;  // without GQA every kernel takes it
      if (launch(summed, grad_key, grad_value)) {
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        launched = true;
        return;
      }
      const int64_t group = shape.kv_group;
      if (group > 1) {
        at::Tensor dk_per_head =
            at::empty({shape.batch, shape.len_kv, shape.head_dim}, query.options());
        at::Tensor dv_per_head =
            at::empty({shape.batch, shape.len_kv, shape.head_dim_v}, query.options());
        if (launch(problem, dk_per_head, dv_per_head)) {
          C10_CUDA_KERNEL_LAUNCH_CHECK();
          const int64_t kv_items = shape.batch / group;  // the sums on the current stream
          at::Tensor dk = grad_key.view({kv_items, shape.len_kv, shape.head_dim});
          at::Tensor dv = grad_value.view({kv_items, shape.len_kv, shape.head_dim_v});
          at::sum_out(dk, dk_per_head.view({kv_items, group, shape.len_kv, shape.head_dim}), 1);
          at::sum_out(dv, dv_per_head.view({kv_items, group, shape.len_kv, shape.head_dim_v}),
                      1);
          launched = true;
          return;
        }
      }
    }
    if (width > 0) {
      return;  // padded below
    }
    launched = true;
  // D_i = rowsum(dO_i * O_i), written by the first kernel, read by the other two.
    at::Tensor delta =
        at::empty({shape.batch, shape.len_q}, query.options().dtype(at::kFloat));  // (B, L)
    kernels::launch_attention_backward_delta(cuda_ptr<scalar_t>(dout), cuda_ptr<scalar_t>(out),
                                             delta.mutable_data_ptr<float>(), problem, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    kernels::launch_attention_backward_dkdv(
        cuda_ptr<scalar_t>(dout), cuda_ptr<scalar_t>(q), cuda_ptr<scalar_t>(k),
        cuda_ptr<scalar_t>(v), lse.const_data_ptr<float>(), delta.const_data_ptr<float>(),
        cuda_mutable_ptr<scalar_t>(grad_key), cuda_mutable_ptr<scalar_t>(grad_value), problem,
        stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    kernels::launch_attention_backward_dq(
        cuda_ptr<scalar_t>(dout), cuda_ptr<scalar_t>(q), cuda_ptr<scalar_t>(k),
        cuda_ptr<scalar_t>(v), lse.const_data_ptr<float>(), delta.const_data_ptr<float>(),
        cuda_mutable_ptr<scalar_t>(grad_query), problem, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (!launched) {
    // The same problem at head dim `width`, as in the forward.
    auto [wide_dq, wide_dk, wide_dv] = attention_backward_cuda(
        padded(grad_output, width), padded(query, width), padded(key, width),
        padded(value, width), padded(output, width), logsumexp, scale, causal, attn_mask,
        enable_gqa, dropout_p, dropout_seed);
    return {cut_to(grad_query, wide_dq, shape.head_dim), cut_to(grad_key, wide_dk, shape.head_dim),
            cut_to(grad_value, wide_dv, shape.head_dim_v)};
  }
  return {grad_query, grad_key, grad_value};
}

}  // namespace

// The CUDA kernels; the CPU ones register under the CPU key in attention_cpu.cpp, meta and
// fake tensors get the Python fake kernels (fixed/ops.py).
TORCH_LIBRARY_IMPL(fixed_attention, CUDA, m) {
  m.impl("attention_forward", &attention_forward_cuda);
  m.impl("attention_backward", &attention_backward_cuda);
}

}  // namespace fixed_attention
