// Hopper (sm_90a) pointwise GEMM of the tensor-core conv2d path: the channels-last forward of a
// 1x1 convolution with stride 1 and no padding, and the unit-stride dgrad of one (an fprop over
// dy on the transposed weights), are one GEMM over the pixels,
//   d [N*H*W][K] = a [N*H*W][C] * b [K][C]^T (+ bias [K] per column),
// on the very operands the implicit-GEMM conv kernel (implicit_gemm_sm90.cuh) gets for them.
// It runs CUTLASS 3.x's persistent warp-specialized GEMM: one producer warp issues the TMA loads,
// consumer warpgroups the WGMMAs, and a CTA stays resident over several output tiles, so that the
// next tile's loads overlap this tile's epilogue. CUTLASS 4.2 runs conv on the non-persistent
// schedule only; with a short reduction (C = 64: one k-block a tile) each tile's loads, MMA and
// store then run back to back, which is what kept the channels-last 1x1 convolutions at 2-3x the
// copy floor (docs/performance.md, run 27).
//
// Every output tile is one CTA's whole reduction in a fixed k order (no split-K, no stream-K):
// the result does not depend on the SM count, the grid or the tile order, and it is the same sum
// as the conv kernel's over the same tile K extent.
//
// Its own translation units (implicit_gemm_sm90_pointwise_<math>.cu): the 3.x GEMM adapter pulls in
// CUTLASS 2.x's GemmUniversal, beside which the conv kernels' specializations are ambiguous.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

#include "common/knobs.h"
#include "common/status.h"
#include "conv/implicit_gemm_kernels.h"
#include "conv/implicit_gemm_sm90_common.cuh"
#include "conv/tiling.h"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace jax_kernels {
namespace implicit_gemm {
namespace sm90 {

using namespace cute;

// The tile table. K extent 128 bytes of elements (64 half, 32 float), as the conv kernel's; N
// extent 64 filters (narrow: at most 64 output channels) or 128 (wide). Two shapes of CTA:
// - 128 pixels on the pingpong schedule: each of the two consumer warpgroups takes its own tile,
//   so that one's epilogue runs beside the other's MMAs, while the producer warp loads ahead for
//   both. Measured against the cooperative schedule on 128 pixels (both warpgroups on one tile)
//   on the sweep's channels-last 1x1 and stem rows (H200, 2026-11-28, run 28, 10 calls in one
//   jit, each schedule in its own process): 0.89-1.04x its time.
// - "Tall": 256 pixels on the cooperative schedule (each warpgroup 128 of them), for half types
//   with a reduction of at most kTallMaxChannels: twice the bytes per tile, so half the tiles'
//   fixed costs (their scheduling, pipeline and epilogue setup), which weigh most where a tile's
//   reduction is one or two k-blocks. Measured against the pingpong tile (H200, 2026-11-28, run
//   29, bf16 NHWC N32 56^2, 10 calls in one jit, each in its own process): 0.88-0.92x the time
//   with reductions of 64 or 96 channels (1x1 64->256 and 96->384 forwards, 256->64 dgrad),
//   0.95x on 384->96's dgrad, 0.92-1.00x over 256 channels, 1.01-1.05x over 384 (so not
//   there). Float32 (TF32) rows are level with cuDNN on the pingpong tile and were not measured
//   tall. Only where the tall tiles fill the SMs' waves as well (tall_fills_waves).
// The result is the same either way: every output tile is one CTA's whole reduction in k order,
// whatever its rows (tested against the conv kernel's bits). The pipeline gets the stages left
// beside the epilogue's staging.
template <Math M, int kTileM, int kTileN_, bool kCooperative = false>
struct PointwiseGemm {
  using E = typename Element<M>::type;
  static constexpr int kTileK = 128 / int(sizeof(E));
  static constexpr int kTileN = kTileN_;
  using TileShape = Shape<Int<kTileM>, Int<kTileN>, Int<kTileK>>;
  using ClusterShape = Shape<_1, _1, _1>;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<E>::value;
  using LayoutA = cutlass::layout::RowMajor;     // a [pixels][C]
  using LayoutB = cutlass::layout::ColumnMajor;  // b [K][C]: K x C with C contiguous
  using LayoutD = cutlass::layout::RowMajor;     // d [pixels][K]
  using EpilogueSchedule =
      std::conditional_t<kCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative,
                         cutlass::epilogue::TmaWarpSpecialized>;
  using MainloopSchedule =
      std::conditional_t<kCooperative, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                         cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  // D = acc + bias[k] (the bias pointer may be null: then nothing is added), no source tensor:
  // the conv kernel's epilogue operation.
  using Fusion = cutlass::epilogue::fusion::LinCombPerColBias<E, float, E, E, float>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, void, LayoutD, kAlignment, E, LayoutD, kAlignment, EpilogueSchedule,
      Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, E, LayoutA, kAlignment, E, LayoutB,
      kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <Math M, TileClass kClass>
using PointwiseConfig = PointwiseGemm<M, 128, kClass == TileClass::kWide ? 128 : 64>;
template <Math M, TileClass kClass>
using PointwiseTallConfig = PointwiseGemm<M, 256, kClass == TileClass::kWide ? 128 : 64, true>;
constexpr int kTallMaxChannels = 256;

// The problems the GEMM takes: an fprop of 1x1 taps, unit stride, no padding (so the output
// pixels are the input pixels), packed NHWC output, no split; channel and filter counts on the
// 128-bit access (the TMA boxes) and 16-byte aligned pointers. The planner bounds every tensor
// by 2 GiB, so N*H*W is an int.
inline bool pointwise_shape(const NhwcConv& c) {
  return c.kernel == NhwcKernel::kFprop && c.split_k == 1 && c.R == 1 && c.S == 1 &&
         c.stride_h == 1 && c.stride_w == 1 && c.pad_h == 0 && c.pad_w == 0 && c.P == c.H &&
         c.Q == c.W && !c.d_nchw && c.d_stride_q == 0 &&
         int64_t(c.N) * c.H * c.W <= int64_t(INT32_MAX);
}

template <class Config>
typename Config::Device::Arguments pointwise_arguments(const NhwcConv& c) {
  using E = typename Config::E;
  using Kernel = typename Config::Kernel;
  const int m = int(int64_t(c.N) * c.H * c.W), n = c.K, k = c.C;
  typename Config::Device::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {m, n, k, 1};
  args.mainloop.ptr_A = static_cast<const E*>(c.a);
  args.mainloop.dA = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(m, k, 1));
  args.mainloop.ptr_B = static_cast<const E*>(c.b);
  args.mainloop.dB = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(n, k, 1));
  const auto stride_d =
      cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(m, n, 1));
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = stride_d;
  args.epilogue.ptr_D = static_cast<E*>(c.d);
  args.epilogue.dD = stride_d;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.thread.bias_ptr = static_cast<const E*>(c.c);
  args.hw_info.sm_count = sm_count();
  return args;
}

template <class Config>
bool pointwise_checked_arguments(const NhwcConv& c, typename Config::Device::Arguments* args) {
  if (!pointwise_shape(c)) return false;
  if (c.C % Config::kAlignment || c.K % Config::kAlignment) return false;
  for (const void* p : {c.a, c.b, c.c, static_cast<const void*>(c.d)})
    if (!aligned_to(p, 16)) return false;
  *args = pointwise_arguments<Config>(c);
  if (Config::Device::can_implement(*args) != cutlass::Status::kSuccess) return false;
  return Config::Device::get_workspace_size(*args) == 0;
}

inline std::string describe_pointwise(const NhwcConv& c, const char* what) {
  char text[200];
  std::snprintf(text, sizeof text, "conv2d: CUTLASS sm90 pointwise GEMM %s for M=%lld N=%d K=%d",
                what, static_cast<long long>(int64_t(c.N) * c.H * c.W), c.K, c.C);
  return text;
}

template <class Config>
ffi::Error pointwise_launch(const NhwcConv& c, cudaStream_t stream) {
  typename Config::Device::Arguments args;
  if (!pointwise_checked_arguments<Config>(c, &args))
    return ffi::Error::Internal(describe_pointwise(c, "rejects"));
  return run_adapter<typename Config::Device>(
      args, stream, [&](const char* what) { return describe_pointwise(c, what); },
      "conv2d (CUTLASS sm90 pointwise GEMM)");
}

// Whether tall tiles fill the SMs as well as the pingpong ones: a pingpong CTA's two warpgroups
// take turns on its tiles, so a CTA's time goes as the 128-pixel tiles it gets, a tall CTA's as
// twice the 256-pixel ones. Tall where its busiest CTA has no more rows than the pingpong one's
// (equal on the sweep's 56^2 rows); e.g. 1x1 1024->256's dgrad at N32 14^2 (6272 pixels, 1024
// filters: 200 tall tiles, 392 pingpong ones on 132 SMs) keeps pingpong, 3 tiles a CTA against
// 2 tall ones of twice the rows. The SM count picks a tile, never a result (same bits).
inline bool tall_fills_waves(const NhwcConv& c, TileClass tile) {
  const int64_t pixels = int64_t(c.N) * c.H * c.W, sms = sm_count();
  const int64_t columns = ceil_div(int64_t(c.K), tile == TileClass::kWide ? 128 : 64);
  const int64_t tall = ceil_div(pixels, 256) * columns, pingpong = ceil_div(pixels, 128) * columns;
  return 2 * ceil_div(tall, sms) <= ceil_div(pingpong, sms);
}

template <Math M, class F>
auto with_pointwise(const NhwcConv& c, F&& f) {
  if constexpr (M != Math::kTF32) {
    // JAX_KERNELS_CONV_POINTWISE_TALL=0 keeps the 128-pixel tile (for A/B measurements).
    if (c.C <= kTallMaxChannels && tall_fills_waves(c, c.tile) &&
        !knob_off("JAX_KERNELS_CONV_POINTWISE_TALL"))
      return c.tile == TileClass::kWide
                 ? f(TypeTag<PointwiseTallConfig<M, TileClass::kWide>>{})
                 : f(TypeTag<PointwiseTallConfig<M, TileClass::kNarrow>>{});
  }
  return c.tile == TileClass::kWide ? f(TypeTag<PointwiseConfig<M, TileClass::kWide>>{})
                                    : f(TypeTag<PointwiseConfig<M, TileClass::kNarrow>>{});
}

}  // namespace sm90

template <Math M>
bool sm90_pointwise_can_implement(const NhwcConv& conv) {
  return sm90::with_pointwise<M>(conv, [&](auto config) {
    typename decltype(config)::type::Device::Arguments args;
    return sm90::pointwise_checked_arguments<typename decltype(config)::type>(conv, &args);
  });
}

template <Math M>
ffi::Error sm90_pointwise_run(const NhwcConv& conv, cudaStream_t stream) {
  return sm90::with_pointwise<M>(conv, [&](auto config) {
    return sm90::pointwise_launch<typename decltype(config)::type>(conv, stream);
  });
}

#define JK_IMPLICIT_GEMM_SM90_POINTWISE_INSTANTIATE(math)              \
  template bool sm90_pointwise_can_implement<math>(const NhwcConv&); \
  template ffi::Error sm90_pointwise_run<math>(const NhwcConv&, cudaStream_t)

}  // namespace implicit_gemm
}  // namespace jax_kernels
