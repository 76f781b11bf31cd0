// Hopper kernels of the tensor-core convolution path: CUTLASS 3.x implicit GEMM with TMA im2col
// loads and warpgroup MMA (WGMMA), warp-specialized (a producer warp issues the TMA loads, a
// consumer warpgroup the MMAs; CUTLASS 4.2 offers conv no persistent schedule). Included by one
// implicit_gemm_sm90_<math>.cu per math mode; those files are compiled for sm_90a only (WGMMA and
// the im2col TMA are sm_90a features), in their own object library (cpp/CMakeLists.txt).
//
// Kernels (interface in implicit_gemm_kernels.h, NhwcConv with sm90 set):
// - fprop: a = x [N,H,W,C], b = w [K,R,S,C], bias [K] or null added in the epilogue (a per-column
//   broadcast of the GEMM), d = y [N,P,Q,K] (packed, or at NhwcConv's d_stride_* between
//   pixels), or y [N,K,P,Q] where NhwcConv::d_nchw is set (the epilogue of
//   implicit_gemm_sm90_nchw_epilogue.cuh). Unit-stride dgrad runs as an fprop on flipped,
//   transposed weights (implicit_gemm.cu prepares them), as on the Sm80 path; strided dgrad as
//   one such fprop per stride phase, each writing its pixels of dx (dgrad_phases.cuh).
// Every output tile is computed by one CTA over the whole reduction (no split-K): the result does
// not depend on the SM count or the schedule.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

#include "conv/implicit_gemm_kernels.h"
#include "conv/implicit_gemm_sm90_common.cuh"
#include "conv/implicit_gemm_sm90_nchw_epilogue.cuh"
#include "conv/tiling.h"
#include "common/status.h"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
// The collective headers use KernelHardwareInfo without including it.
#include "cutlass/kernel_hardware_info.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/conv/convnd_problem_shape.hpp"
#include "cutlass/conv/convolution.h"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/conv/dispatch_policy.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"

namespace jax_kernels {
namespace implicit_gemm {
namespace sm90 {

using namespace cute;

// The tile table. GEMM view of fprop: M = N*P*Q output pixels, N = K filters, K = C*R*S. The
// K extent of a tile is 128 bytes of elements (64 half, 32 float): one TMA box row per channel
// run. narrow (filters <= 64): 128x64, so that 64 filters fill the tile; wide: 128x128. CUTLASS
// runs conv on the non-persistent warp-specialized schedule only (one producer warp, one
// consumer warpgroup per CTA; a CTA's epilogue does not overlap its next tile's loads), and a
// conv's reduction is short (C*R*S = 576 for 3x3x64: 9 k-tiles): so the pipeline gets as many
// stages as leave room for two CTAs per SM, one CTA's loads overlapping the other's epilogue,
// rather than all of shared memory for one: so the narrow tile. The wide tile runs one CTA per SM
// with 6 stages, which took 10-23% less time than two of 3 (run 25, alone, N32: TF32 3x3/2
// 128->128 56^2 54.0 -> 41.8 us, 3x3 256->256 14^2 32.7 -> 28.3; bf16 23.2 -> 20.3, 18.9 ->
// 17.0). kNchw: y is written NCHW by our epilogue (implicit_gemm_sm90_nchw_epilogue.cuh)
// instead of CUTLASS's TMA one.
template <Math M, TileClass kClass, bool kNchw = false>
struct FpropConfig {
  using E = typename Element<M>::type;
  static constexpr int kTileK = 128 / int(sizeof(E));
  static constexpr int kTileN = kClass == TileClass::kWide ? 128 : 64;
  using TileShape = Shape<_128, Int<kTileN>, Shape<Int<kTileK>>>;  // K nested: (C, S, R) runs
  using ClusterShape = Shape<_1, _1, _1>;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<E>::value;
  static constexpr cutlass::conv::Operator kOp = cutlass::conv::Operator::kFprop;
  using Layout = cutlass::layout::TensorNHWC;
  // D = acc + bias[k] (the bias pointer may be null: then nothing is added), no source tensor.
  using Fusion = cutlass::epilogue::fusion::LinCombPerColBias<E, float, E, E, float>;
  using NhwcEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, Layout, kAlignment, E,
      Layout, kAlignment, cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
  using Epilogue = std::conditional_t<kNchw, NchwEpilogueCollective<E, 128, kTileN>, NhwcEpilogue>;
  static constexpr bool kChannelsFirst = kNchw;
  // Narrow: half of an SM's 228 KiB, less the 1 KiB the driver reserves per CTA and 1 KiB of
  // slack for the pipeline barriers and the kernel's own shared storage. Wide: 6 stages of 32
  // KiB, one CTA per SM (the measured count, above). The epilogue's storage
  // (the TMA epilogue's staging, or the NCHW epilogue's tile) takes none of it: the kernel makes
  // mainloop and epilogue storage one union, as its epilogue runs after the last MMA.
  // (Subtracting it, as before run 22, left TF32 3 stages (narrow) and 2 (wide), not 4 and 3;
  // the half types' counts are the same either way. Two CTAs per SM either way: registers.)
  static constexpr int kStageBytes = (128 + kTileN) * kTileK * int(sizeof(E));
  static constexpr int kStages =
      kClass == TileClass::kWide ? 6 : (228 * 1024 / 2 - 2048) / kStageBytes;
  static_assert(kStages >= 2, "at least a double-buffered pipeline");
  static_assert(kStages * kStageBytes <= 227 * 1024 - 2048, "the stages fit one CTA per SM");
  static_assert(sizeof(typename Epilogue::SharedStorage) <= kStages * kStageBytes,
                "the epilogue's storage fits in the stages' storage");
  using Mainloop = typename cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, kOp, E, Layout, kAlignment, E, Layout,
      kAlignment, float, TileShape, ClusterShape,
      cutlass::conv::collective::StageCount<kStages>,
      cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;
  using ProblemShape =
      cutlass::conv::ConvProblemShape<kOp, Mainloop::DispatchPolicy::NumSpatialDimensions>;
  using Kernel = cutlass::conv::kernel::ConvUniversal<ProblemShape, Mainloop, Epilogue>;
  using Device = cutlass::conv::device::ConvUniversalAdapter<Kernel>;
};

// The bottom (right) padding CUTLASS needs to form the output extent P (Q) from H (W), which it
// computes itself: the least that reaches the last output row, zero where rows of the input go
// unread (e.g. a 1x1 stride-2 conv over an even extent). -1 where no padding gives P.
// In 64 bits: the planner bounds each extent by INT_MAX, not their sums; the im2col TMA takes
// paddings up to 256 anyway (can_implement).
inline int upper_padding(int64_t in, int64_t out, int64_t taps, int64_t pad, int64_t stride,
                         int64_t dilation) {
  const int64_t needed = std::max<int64_t>((out - 1) * stride + (taps - 1) * dilation + 1 - in - pad, 0);
  const int64_t span = in + pad + needed - (taps - 1) * dilation - 1;
  if (span < 0 || needed > (1 << 16)) return -1;
  return span / stride + 1 == out ? int(needed) : -1;
}

// The problem of either kernel (fprop, wgrad: Config::ProblemShape carries the operator).
template <class Config>
typename Config::ProblemShape conv_problem(const NhwcConv& c) {
  const int pad_bottom = upper_padding(c.H, c.P, c.R, c.pad_h, c.stride_h, c.dilation_h);
  const int pad_right = upper_padding(c.W, c.Q, c.S, c.pad_w, c.stride_w, c.dilation_w);
  return typename Config::ProblemShape(
      cutlass::conv::Mode::kCrossCorrelation, {c.N, c.H, c.W, c.C}, {c.K, c.R, c.S, c.C},
      {c.pad_h, c.pad_w}, {pad_bottom, pad_right}, {c.stride_h, c.stride_w},
      {c.dilation_h, c.dilation_w}, 1);
}

template <class Config>
typename Config::Device::Arguments fprop_arguments(const NhwcConv& c) {
  using E = typename Config::E;
  using Kernel = typename Config::Kernel;
  const typename Config::ProblemShape problem = conv_problem<Config>(c);
  typename Kernel::StrideD stride_d{};
  typename Config::Device::Arguments args;
  if constexpr (Config::kChannelsFirst) {  // y [N][K][P*Q]
    const int64_t plane = int64_t(c.P) * c.Q;
    cute::get<0, 1>(stride_d) = int64_t(c.K) * plane;
    cute::get<1>(stride_d) = plane;
    args = {problem,
            {static_cast<const E*>(c.a), static_cast<const E*>(c.b)},
            {static_cast<const E*>(c.c), static_cast<E*>(c.d), stride_d}};
  } else {
    // The output's strides (Q, P, N) from the problem's packed NPQK strides, as CUTLASS's own
    // examples set them.
    cute::for_each(cute::make_seq<cute::rank<0>(typename Kernel::StrideD{})>{}, [&](auto i) {
      cute::get<0, i>(stride_d) = problem.stride_C[Config::ProblemShape::RankT - 2 - i];
    });
    if (c.d_stride_q != 0) {  // a strided output (a strided dgrad's phase of dx)
      cute::get<0, 0>(stride_d) = c.d_stride_q;
      cute::get<0, 1>(stride_d) = c.d_stride_p;
      cute::get<0, 2>(stride_d) = c.d_stride_n;
    }
    args = {problem,
            {static_cast<const E*>(c.a), static_cast<const E*>(c.b)},
            {{}, nullptr, stride_d, static_cast<E*>(c.d), stride_d}};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.thread.bias_ptr = static_cast<const E*>(c.c);
  }
  args.hw_info.sm_count = sm_count();
  return args;
}

// Problems the kernels take, besides CUTLASS's own can_implement: 16-byte aligned pointers
// (TMA), no problem past int extents (checked by the planner), and padding the im2col TMA can
// express (its corner offsets; can_implement checks them).
inline bool pointers_and_padding_fit(const NhwcConv& c) {
  for (const void* p : {c.a, c.b, c.c, static_cast<const void*>(c.d)})
    if (!aligned_to(p, 16)) return false;
  return upper_padding(c.H, c.P, c.R, c.pad_h, c.stride_h, c.dilation_h) >= 0 &&
         upper_padding(c.W, c.Q, c.S, c.pad_w, c.stride_w, c.dilation_w) >= 0;
}

// The kernel's arguments for c into *args, or false where it does not take c.
template <class Config>
bool fprop_checked_arguments(const NhwcConv& c, typename Config::Device::Arguments* args) {
  if (c.kernel != NhwcKernel::kFprop || c.split_k != 1) return false;
  if (c.d_nchw && c.d_stride_q != 0) return false;  // strides are for NHWC outputs
  if (c.C % Config::kAlignment || c.K % Config::kAlignment) return false;
  if (!pointers_and_padding_fit(c)) return false;
  *args = fprop_arguments<Config>(c);
  if (Config::Device::can_implement(*args) != cutlass::Status::kSuccess) return false;
  return Config::Device::get_workspace_size(*args) == 0;
}

template <class Config>
bool fprop_can_implement(const NhwcConv& c) {
  typename Config::Device::Arguments args;
  return fprop_checked_arguments<Config>(c, &args);
}

inline std::string describe(const NhwcConv& c, const char* what) {
  char text[320];
  std::snprintf(text, sizeof text,
                "conv2d: CUTLASS sm90 %s %s for N=%d H=%d W=%d C=%d K=%d R=%d S=%d P=%d Q=%d "
                "pad=(%d,%d) stride=(%d,%d) dilation=(%d,%d) split=%d",
                c.kernel == NhwcKernel::kWgrad ? "wgrad" : "fprop", what, c.N, c.H, c.W, c.C, c.K,
                c.R, c.S, c.P, c.Q, c.pad_h, c.pad_w, c.stride_h, c.stride_w, c.dilation_h,
                c.dilation_w, c.split_k);
  return text;
}

template <class Config>
ffi::Error fprop_run(const NhwcConv& c, cudaStream_t stream) {
  typename Config::Device::Arguments args;
  if (!fprop_checked_arguments<Config>(c, &args))
    return ffi::Error::Internal(describe(c, "rejects"));
  return run_adapter<typename Config::Device>(
      args, stream, [&](const char* what) { return describe(c, what); }, "conv2d (CUTLASS sm90)");
}

template <Math M, class F>
auto with_fprop(const NhwcConv& c, F&& f) {
  if (c.d_nchw)
    return c.tile == TileClass::kWide ? f(TypeTag<FpropConfig<M, TileClass::kWide, true>>{})
                                      : f(TypeTag<FpropConfig<M, TileClass::kNarrow, true>>{});
  return c.tile == TileClass::kWide ? f(TypeTag<FpropConfig<M, TileClass::kWide>>{})
                                    : f(TypeTag<FpropConfig<M, TileClass::kNarrow>>{});
}

}  // namespace sm90
}  // namespace implicit_gemm
}  // namespace jax_kernels

#include "conv/implicit_gemm_sm90_wgrad.cuh"
#include "conv/implicit_gemm_sm90_wgrad_tf32.cuh"

namespace jax_kernels {
namespace implicit_gemm {

template <Math M>
bool sm90_can_implement(const NhwcConv& conv) {
  if (conv.kernel == NhwcKernel::kWgrad) {
    if constexpr (M == Math::kTF32) {
      return false;
    } else {
      return sm90::with_wgrad<M>(conv, [&](auto config) {
        return sm90::wgrad_can_implement<typename decltype(config)::type>(conv);
      });
    }
  }
  return sm90::with_fprop<M>(conv, [&](auto config) {
    return sm90::fprop_can_implement<typename decltype(config)::type>(conv);
  });
}

template <Math M>
ffi::Error sm90_run(const NhwcConv& conv, cudaStream_t stream) {
  if (conv.kernel == NhwcKernel::kWgrad) {
    if constexpr (M == Math::kTF32) {
      return ffi::Error::Internal("conv2d: no Hopper wgrad kernel for TF32");
    } else {
      return sm90::with_wgrad<M>(conv, [&](auto config) {
        return sm90::wgrad_run<typename decltype(config)::type>(conv, stream);
      });
    }
  }
  return sm90::with_fprop<M>(conv, [&](auto config) {
    return sm90::fprop_run<typename decltype(config)::type>(conv, stream);
  });
}

template <Math M>
Sm90WgradTiles sm90_wgrad_tiles(const NhwcConv& conv) {
  if constexpr (M == Math::kTF32) {
    return {};
  } else {
    return sm90::with_wgrad<M>(conv, [&](auto config) {
      using Config = typename decltype(config)::type;
      return Sm90WgradTiles{sm90::wgrad_output_tiles<Config>(conv),
                            sm90::wgrad_k_tiles<Config>(conv)};
    });
  }
}

namespace sm90 {

template <class Config>
ffi::Error tf32_wgrad_launch(const BatchInnerWgrad& w, cudaStream_t stream) {
  Tf32WgradParams p{};
  if (!encode_tf32_wgrad_maps<Config>(&p, w.dy, w.x, w.channels_last, w.Nb, w.C, w.H, w.W, w.K,
                                      w.P, w.Q))
    return ffi::Error::Internal("conv2d: the TF32 wgrad's tensor maps could not be built");
  p.partials = static_cast<float*>(w.partials);
  p.slice_elements = w.slice_elements, p.c_pitch = w.c_pitch, p.k_pitch = w.k_pitch;
  p.rsck = w.order == WgradOrder::kRSCK;
  p.K = w.K, p.C = w.C, p.R = w.R, p.S = w.S, p.Q = w.Q;
  p.stride_h = w.stride_h, p.stride_w = w.stride_w;
  p.pad_h = w.pad_h, p.pad_w = w.pad_w, p.dil_h = w.dilation_h, p.dil_w = w.dilation_w;
  p.n_blocks = (w.N + Config::kBoxN - 1) / Config::kBoxN;
  p.q_blocks = (w.Q + Config::kBoxQ - 1) / Config::kBoxQ;
  p.c_tiles = (w.C + Config::kTileC - 1) / Config::kTileC;
  p.k_tiles = int(batch_inner_k_tiles(w));
  p.k_tiles_per_slice = int((p.k_tiles + w.split - 1) / w.split);
  // Every slice non-empty (the planner's split is one).
  if (nonempty_split(p.k_tiles, w.split) != w.split)
    return ffi::Error::Internal("conv2d: the TF32 wgrad's split leaves a slice empty");
  const int64_t m_tiles = (w.K + Config::kTileM - 1) / Config::kTileM;
  const dim3 grid(unsigned(m_tiles), unsigned(batch_inner_output_tiles(w) / m_tiles),
                  unsigned(w.split));
  // Every call, as CUTLASS's adapter does: the attribute is cheap to set and holds for the
  // current device.
  if (cudaFuncSetAttribute(tf32_wgrad_kernel<Config>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           Config::kSmemBytes) != cudaSuccess) {
    cudaGetLastError();
    return ffi::Error::Internal("conv2d: the TF32 wgrad could not set its shared memory size");
  }
  tf32_wgrad_kernel<Config><<<grid, Config::kThreads, Config::kSmemBytes, stream>>>(p);
  return launch_status("conv2d (sm90 TF32 wgrad)");
}

}  // namespace sm90

#define JK_IMPLICIT_GEMM_SM90_INSTANTIATE(math)              \
  template bool sm90_can_implement<math>(const NhwcConv&); \
  template ffi::Error sm90_run<math>(const NhwcConv&, cudaStream_t); \
  template Sm90WgradTiles sm90_wgrad_tiles<math>(const NhwcConv&)

}  // namespace implicit_gemm
}  // namespace jax_kernels
