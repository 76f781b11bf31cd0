// Hopper (sm_90a) pointwise weight gradient of the tensor-core conv2d path: the channels-last
// wgrad of a 1x1 convolution with stride 1 and no padding is a GEMM whose reduction runs over the
// pixels,
//   dw [C][K] = sum over pixels p of x [p][C] (outer) dy [p][K],
// split into `slices` equal runs of pixels (NhwcConv::split_k), each one batch of CUTLASS 3.x's
// persistent warp-specialized GEMM writing its own float32 partial [C][K] (HWIO order,
// WgradOrder::kRSCK). implicit_gemm.cu adds the slices in a fixed order (launch_wgrad_sum), as it
// does every split wgrad's partials: no atomics, and the result depends on the problem and the
// split (planned from the shape alone), never on the SM count, grid or tile order.
//
// The GEMM's rows are the larger of the filters and channels (pointwise_wgrad_tiling), so that
// 128-row tiles are full: rows = filters reads A = dy and B = x and writes D column-major; rows =
// channels reads A = x, B = dy and writes D row-major; either way D is [C][K] with the filters
// contiguous. Both operands are MN-major (the pixels, the reduction, are the outer dimension of
// both). Half types multiply them from shared memory as WGMMA takes 16-bit MN-major operands;
// TF32 WGMMA takes K-major operands only, so CUTLASS's collective builder picks its register-A
// mainloop with B transposed in shared memory by the consumer warps (both on its public
// interface). A slice's pixels need not fill whole k-blocks: the TMA reads what lies past a
// slice's end in its own (pixel) dimension as zeros, never the next slice's pixels.
//
// Why: the wgrad's reduction is long (N*H*W = 100352 pixels at N32 56^2) and its output small
// (64 x 256 filters: 2 tiles), so the conv kernels split it; for float32 the Sm80 kernel ran
// it at 0.42-0.87x of cuDNN's time (docs/performance.md, run 27), the Hopper TF32 wgrad needs
// batch-innermost copies that cost more than they save at one tap, and the Hopper half wgrad
// takes channels in 64s only. Here the operands are read in place by TMA, once. Measured in run
// 30 (H200, N32, 10 calls in one jit): float32 64->256 at 56^2 0.076 -> 0.053 ms, 1024->256 at
// 14^2 0.078 -> 0.036, 96->384 and 384->96 at 56^2 0.107 -> 0.087; bfloat16 96->384 0.076 ->
// 0.034. In TF32 the shared-memory pipe bounds it (ncu, 64->256: 75% busy with the transposes,
// DRAM 56% of its peak), in bfloat16 DRAM (71%).
//
// Its own translation units (implicit_gemm_sm90_pointwise_wgrad_<math>.cu), for the reason the
// forward pointwise GEMM has them (implicit_gemm_sm90_pointwise.cuh).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

#include "common/status.h"
#include "conv/implicit_gemm_kernels.h"
#include "conv/implicit_gemm_sm90_common.cuh"
#include "conv/tiling.h"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace jax_kernels {
namespace implicit_gemm {
namespace sm90 {

using namespace cute;

// 128 rows (filters or channels) x 64, 96 or 128 columns a tile, k-blocks of 128 bytes of
// elements, the cooperative schedule (two consumer warpgroups of 64 rows each on one tile).
template <Math M, bool kChannelsAsRows, int kTileN>
struct PointwiseWgradGemm {
  using E = typename Element<M>::type;
  static constexpr int kTileK = 128 / int(sizeof(E));
  using TileShape = Shape<_128, Int<kTileN>, Int<kTileK>>;
  using ClusterShape = Shape<_1, _1, _1>;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<E>::value;
  static constexpr int kAlignmentD = 4;                 // float32 partials, 128-bit stores
  using LayoutA = cutlass::layout::ColumnMajor;         // rows contiguous, pixels outer
  using LayoutB = cutlass::layout::RowMajor;            // columns contiguous, pixels outer
  using LayoutD = std::conditional_t<kChannelsAsRows, cutlass::layout::RowMajor,
                                     cutlass::layout::ColumnMajor>;  // [C][K] either way
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, kAlignmentD,
      float, LayoutD, kAlignmentD, cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, E, LayoutA, kAlignment, E, LayoutB,
      kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The problems it takes: a wgrad of 1x1 taps, unit stride, no padding (the output pixels are the
// input pixels), split into slices that divide the pixels, channel and filter counts on the
// 128-bit access and 16-byte aligned pointers. The planner bounds every tensor by 2 GiB, so
// N*H*W is an int.
inline bool pointwise_wgrad_shape(const NhwcConv& c) {
  const int64_t pixels = int64_t(c.N) * c.H * c.W;
  return c.kernel == NhwcKernel::kWgrad && c.wgrad_order == WgradOrder::kRSCK && c.R == 1 &&
         c.S == 1 && c.stride_h == 1 && c.stride_w == 1 && c.pad_h == 0 && c.pad_w == 0 &&
         c.P == c.H && c.Q == c.W && pixels <= int64_t(INT32_MAX) && c.split_k >= 1 &&
         pixels % c.split_k == 0;
}

template <class Config, bool kChannelsAsRows>
typename Config::Device::Arguments pointwise_wgrad_arguments(const NhwcConv& c) {
  using E = typename Config::E;
  using Kernel = typename Config::Kernel;
  const int slices = c.split_k;
  const int slice = int(int64_t(c.N) * c.H * c.W / slices);
  const int rows = kChannelsAsRows ? c.C : c.K, cols = kChannelsAsRows ? c.K : c.C;
  typename Config::Device::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kBatched;
  args.problem_shape = {rows, cols, slice, slices};
  args.mainloop.ptr_A = static_cast<const E*>(kChannelsAsRows ? c.b : c.a);
  args.mainloop.dA = cutlass::make_cute_packed_stride(typename Kernel::StrideA{},
                                                      make_shape(rows, slice, slices));
  args.mainloop.ptr_B = static_cast<const E*>(kChannelsAsRows ? c.a : c.b);
  args.mainloop.dB = cutlass::make_cute_packed_stride(typename Kernel::StrideB{},
                                                      make_shape(cols, slice, slices));
  const auto stride_d =
      cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(rows, cols, slices));
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = stride_d;
  args.epilogue.ptr_D = static_cast<float*>(c.d);
  args.epilogue.dD = stride_d;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.hw_info.sm_count = sm_count();
  return args;
}

template <class Config, bool kChannelsAsRows>
bool pointwise_wgrad_checked_arguments(const NhwcConv& c,
                                       typename Config::Device::Arguments* args) {
  if (!pointwise_wgrad_shape(c)) return false;
  if (c.C % Config::kAlignment || c.K % Config::kAlignment) return false;
  for (const void* p : {c.a, c.b, static_cast<const void*>(c.d)})
    if (!aligned_to(p, 16)) return false;
  *args = pointwise_wgrad_arguments<Config, kChannelsAsRows>(c);
  if (Config::Device::can_implement(*args) != cutlass::Status::kSuccess) return false;
  return Config::Device::get_workspace_size(*args) == 0;
}

inline std::string describe_pointwise_wgrad(const NhwcConv& c, const char* what) {
  char text[200];
  std::snprintf(text, sizeof text,
                "conv2d: CUTLASS sm90 pointwise wgrad GEMM %s for %lld pixels in %d slices, "
                "K=%d C=%d",
                what, static_cast<long long>(int64_t(c.N) * c.H * c.W), c.split_k, c.K, c.C);
  return text;
}

// Calls f(TypeTag<Config>{}, std::bool_constant<kChannelsAsRows>{}) for the problem's tiling.
template <Math M, bool kChannelsAsRows, class F>
auto with_pointwise_wgrad_columns(int tile_cols, F&& f) {
  using Rows = std::bool_constant<kChannelsAsRows>;
  if (tile_cols == 64) return f(TypeTag<PointwiseWgradGemm<M, kChannelsAsRows, 64>>{}, Rows{});
  if (tile_cols == 96) return f(TypeTag<PointwiseWgradGemm<M, kChannelsAsRows, 96>>{}, Rows{});
  return f(TypeTag<PointwiseWgradGemm<M, kChannelsAsRows, 128>>{}, Rows{});
}

template <Math M, class F>
auto with_pointwise_wgrad(const NhwcConv& c, F&& f) {
  const PointwiseWgradTiling t = pointwise_wgrad_tiling(c.K, c.C);
  return t.channels_as_rows ? with_pointwise_wgrad_columns<M, true>(t.tile_cols, f)
                            : with_pointwise_wgrad_columns<M, false>(t.tile_cols, f);
}

}  // namespace sm90

template <Math M>
bool sm90_pointwise_wgrad_can_implement(const NhwcConv& conv) {
  return sm90::with_pointwise_wgrad<M>(conv, [&](auto config, auto rows) {
    using Config = typename decltype(config)::type;
    typename Config::Device::Arguments args;
    return sm90::pointwise_wgrad_checked_arguments<Config, decltype(rows)::value>(conv, &args);
  });
}

template <Math M>
ffi::Error sm90_pointwise_wgrad_run(const NhwcConv& conv, cudaStream_t stream) {
  return sm90::with_pointwise_wgrad<M>(conv, [&](auto config, auto rows) {
    using Config = typename decltype(config)::type;
    typename Config::Device::Arguments args;
    if (!sm90::pointwise_wgrad_checked_arguments<Config, decltype(rows)::value>(conv, &args))
      return ffi::Error::Internal(sm90::describe_pointwise_wgrad(conv, "rejects"));
    return sm90::run_adapter<typename Config::Device>(
        args, stream, [&](const char* what) { return sm90::describe_pointwise_wgrad(conv, what); },
        "conv2d (CUTLASS sm90 pointwise wgrad GEMM)");
  });
}

#define JK_IMPLICIT_GEMM_SM90_POINTWISE_WGRAD_INSTANTIATE(math)              \
  template bool sm90_pointwise_wgrad_can_implement<math>(const NhwcConv&); \
  template ffi::Error sm90_pointwise_wgrad_run<math>(const NhwcConv&, cudaStream_t)

}  // namespace implicit_gemm
}  // namespace jax_kernels
