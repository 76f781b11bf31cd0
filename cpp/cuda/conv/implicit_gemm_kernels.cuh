// The CUTLASS kernels of the tensor-core convolution path and their tile table. Included by one
// implicit_gemm_<math>.cu per math mode, which instantiates everything below for that mode only.
//
// Kernels: implicit-GEMM fprop, strided dgrad and wgrad on NHWC tensors (CUTLASS 2.x conv API,
// optimized iterators), and batched GEMMs for 1x1 convolutions on NCHW data, all Sm80 tensor-op
// multistage kernels (they run on sm_80 and sm_90). Unit-stride dgrad runs as an fprop on flipped
// weights (implicit_gemm.cu prepares them), so no unit-stride dgrad kernel is instantiated.
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>

#include "conv/implicit_gemm_kernels.h"
#include "common/launch.h"
#include "common/status.h"
// CUTLASS's device-level conv header relies on the kernel headers being included first.
#include "cutlass/cutlass.h"
#include "cutlass/conv/kernel/default_conv2d_dgrad.h"
#include "cutlass/conv/kernel/default_conv2d_fprop.h"
#include "cutlass/conv/kernel/default_conv2d_wgrad.h"
#include "cutlass/conv/device/implicit_gemm_convolution.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm_batched.h"

namespace jax_kernels {
namespace implicit_gemm {
namespace detail {

using cutlass::gemm::GemmShape;

template <Math M>
struct MathConfig;

template <>
struct MathConfig<Math::kFloat16> {
  using Element = cutlass::half_t;
  using Instruction = GemmShape<16, 8, 16>;
  using Operator = cutlass::arch::OpMultiplyAdd;
};

template <>
struct MathConfig<Math::kBFloat16> {
  using Element = cutlass::bfloat16_t;
  using Instruction = GemmShape<16, 8, 16>;
  using Operator = cutlass::arch::OpMultiplyAdd;
};

template <>
struct MathConfig<Math::kTF32> {
  using Element = float;
  using Instruction = GemmShape<16, 8, 8>;
  using Operator = cutlass::arch::OpMultiplyAdd;
};

template <>
struct MathConfig<Math::kFloat32x3> {
  using Element = float;
  using Instruction = GemmShape<16, 8, 8>;
  using Operator = cutlass::arch::OpMultiplyAddFastF32;
};

// 128-bit global accesses: 8 half or 4 float elements (channel counts are padded to this).
template <Math M>
constexpr int kAlignment = 128 / cutlass::sizeof_bits<typename MathConfig<M>::Element>::value;

// The K extent of every tile is 128 bytes of elements (64 half, 32 float): each k-step reads
// whole 128-byte lines per row.
template <Math M>
constexpr int kTileK = 128 / int(sizeof(typename MathConfig<M>::Element));

struct TileShape {
  int block_m, block_n, warp_m, warp_n, stages;
};

// The tile table, by (math, kernel, tile class). Why these:
// - fprop narrow (N = filters <= 64, e.g. 3x3 64->64): 128x64 covers all filters in one tile;
//   3 stages (72 KiB of shared memory for half) leave room for 3 blocks per SM to hide latency.
// - fprop wide: 128x128 for twice the reuse per loaded byte when there are enough filters.
// - strided dgrad: one tile, 128x64 (N = input channels).
// - wgrad (M = filters, N = R*S*C, K = N*P*Q split into parallel slices): 64x128 narrow, so that
//   64 filters fill the tile; 128x128 wide.
// float32 modes use the narrow tiles only (TF32 math is half as fast; fewer instantiations), and
// 3xTF32, which holds two TF32 fragments per operand, uses 32x32 warp tiles (8 warps) so that it
// does not spill. Everything else has four warps per block.
constexpr TileShape nhwc_tile(Math math, NhwcKernel kernel, TileClass tile_class) {
  const bool half = math == Math::kFloat16 || math == Math::kBFloat16;
  const bool wide = half && tile_class == TileClass::kWide;
  const bool split_f32 = math == Math::kFloat32x3;
  switch (kernel) {
    case NhwcKernel::kFprop:
      return wide        ? TileShape{128, 128, 64, 64, 3}
             : split_f32 ? TileShape{128, 64, 32, 32, 3}
                         : TileShape{128, 64, 64, 32, 3};
    case NhwcKernel::kStridedDgrad:
      return split_f32 ? TileShape{128, 64, 32, 32, 3} : TileShape{128, 64, 64, 32, 3};
    case NhwcKernel::kWgrad:
    default:
      return wide        ? TileShape{128, 128, 64, 64, 3}
             : split_f32 ? TileShape{64, 128, 32, 32, 3}
                         : TileShape{64, 128, 32, 64, 3};
  }
}

// Batched GEMMs of the 1x1 route:
// - fprop / dgrad (M = output channels of the pass, N = pixels, memory bound: the pixels stream
//   through once): 64x128 narrow, 128x128 wide (half only).
// - wgrad: 64x64 so that a batch of images yields enough blocks (one partial each); they run
//   about one per SM over a long K loop, so 6 stages keep loads in flight.
constexpr TileShape gemm_tile(Math math, GemmKernel kernel, TileClass tile_class) {
  const bool half = math == Math::kFloat16 || math == Math::kBFloat16;
  if (kernel == GemmKernel::kWgrad) return TileShape{64, 64, 32, 32, 6};
  return half && tile_class == TileClass::kWide ? TileShape{128, 128, 64, 64, 3}
                                                : TileShape{64, 128, 32, 64, 3};
}

template <Math M, class Shape>
struct Tile {
  static constexpr TileShape kShape = Shape::value;
  using Block = GemmShape<kShape.block_m, kShape.block_n, kTileK<M>>;
  using Warp = GemmShape<kShape.warp_m, kShape.warp_n, kTileK<M>>;
  static constexpr int kStages = kShape.stages;
};

template <Math M, NhwcKernel kKernel, TileClass kClass>
struct NhwcTileShape {
  static constexpr TileShape value = nhwc_tile(M, kKernel, kClass);
};

template <Math M, GemmKernel kKernel, TileClass kClass>
struct GemmTileShape {
  static constexpr TileShape value = gemm_tile(M, kKernel, kClass);
};

using Nhwc = cutlass::layout::TensorNHWC;

template <class ElementOut>
using Epilogue =
    cutlass::epilogue::thread::LinearCombination<ElementOut, 128 / cutlass::sizeof_bits<ElementOut>::value,
                                                 float, float>;

template <Math M, NhwcKernel kKernel, class T>
struct NhwcKernelFor;

template <Math M, class T>
struct NhwcKernelFor<M, NhwcKernel::kFprop, T> {
  using C = MathConfig<M>;
  using E = typename C::Element;
  using type = typename cutlass::conv::kernel::DefaultConv2dFprop<
      E, Nhwc, E, Nhwc, E, Nhwc, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      typename T::Block, typename T::Warp, typename C::Instruction,
      Epilogue<E>, cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, T::kStages,
      typename C::Operator, cutlass::conv::IteratorAlgorithm::kOptimized,
      cutlass::conv::StrideSupport::kUnity, kAlignment<M>, kAlignment<M>>::Kernel;
};

template <Math M, class T>
struct NhwcKernelFor<M, NhwcKernel::kStridedDgrad, T> {
  using C = MathConfig<M>;
  using E = typename C::Element;
  using type = typename cutlass::conv::kernel::DefaultConv2dDgrad<
      E, Nhwc, E, Nhwc, E, Nhwc, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      typename T::Block, typename T::Warp, typename C::Instruction,
      Epilogue<E>, cutlass::conv::threadblock::StridedDgradIdentityThreadblockSwizzle<1>,
      T::kStages, typename C::Operator, cutlass::conv::IteratorAlgorithm::kOptimized,
      cutlass::conv::StrideSupport::kStrided, kAlignment<M>, kAlignment<M>>::Kernel;
};

template <Math M, class T>
struct NhwcKernelFor<M, NhwcKernel::kWgrad, T> {
  using C = MathConfig<M>;
  using E = typename C::Element;
  using type = typename cutlass::conv::kernel::DefaultConv2dWgrad<
      E, Nhwc, E, Nhwc, float, Nhwc, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      typename T::Block, typename T::Warp, typename C::Instruction,
      Epilogue<float>, cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, T::kStages,
      typename C::Operator, cutlass::conv::IteratorAlgorithm::kOptimized,
      cutlass::conv::StrideSupport::kStrided, kAlignment<M>, kAlignment<M>>::Kernel;
};

template <Math M, GemmKernel kKernel, class T>
struct GemmFor {
  using C = MathConfig<M>;
  using E = typename C::Element;
  using RowMajor = cutlass::layout::RowMajor;
  using ColumnMajor = cutlass::layout::ColumnMajor;
  using LayoutA = std::conditional_t<kKernel == GemmKernel::kDgrad, ColumnMajor, RowMajor>;
  using LayoutB = std::conditional_t<kKernel == GemmKernel::kWgrad, ColumnMajor, RowMajor>;
  using ElementD = std::conditional_t<kKernel == GemmKernel::kWgrad, float, E>;
  using type = cutlass::gemm::device::GemmBatched<
      E, LayoutA, E, LayoutB, ElementD, RowMajor, float, cutlass::arch::OpClassTensorOp,
      cutlass::arch::Sm80, typename T::Block, typename T::Warp,
      typename C::Instruction, Epilogue<ElementD>,
      cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle, T::kStages,
      kAlignment<M>, kAlignment<M>, typename C::Operator>;
};

inline cutlass::conv::Conv2dProblemSize problem_size(const NhwcConv& c) {
  return cutlass::conv::Conv2dProblemSize(
      c.N, c.H, c.W, c.C, c.K, c.R, c.S, c.P, c.Q, c.pad_h, c.pad_w, c.stride_h, c.stride_w,
      c.dilation_h, c.dilation_w, cutlass::conv::Mode::kCrossCorrelation, c.split_k);
}

template <class Kernel>
typename Kernel::Arguments nhwc_arguments(const NhwcConv& c) {
  using ElementA = typename Kernel::ElementA;
  using ElementB = typename Kernel::ElementB;
  using ElementC = typename Kernel::ElementC;
  const cutlass::conv::Conv2dProblemSize size = problem_size(c);
  const cutlass::conv::Operator op = Kernel::kConvolutionalOperator;
  const auto extent_a = cutlass::conv::implicit_gemm_tensor_a_extent(op, size);
  const auto extent_b = cutlass::conv::implicit_gemm_tensor_b_extent(op, size);
  const auto extent_c = cutlass::conv::implicit_gemm_tensor_c_extent(op, size);
  auto* d = static_cast<ElementC*>(c.d);
  // The bias enters as the epilogue's source tensor with all strides zero: every output pixel
  // reads the same K values.
  const bool has_bias = c.c != nullptr;
  cutlass::TensorRef<ElementC, Nhwc> source =
      has_bias ? cutlass::TensorRef<ElementC, Nhwc>(
                     const_cast<ElementC*>(static_cast<const ElementC*>(c.c)), Nhwc::Stride(0))
               : cutlass::TensorRef<ElementC, Nhwc>(d, Nhwc::packed(extent_c));
  return typename Kernel::Arguments(
      size,
      {const_cast<ElementA*>(static_cast<const ElementA*>(c.a)), Nhwc::packed(extent_a)},
      {const_cast<ElementB*>(static_cast<const ElementB*>(c.b)), Nhwc::packed(extent_b)}, source,
      {d, Nhwc::packed(extent_c)}, {1.0f, has_bias ? 1.0f : 0.0f},
      c.split_k > 1 ? cutlass::conv::SplitKMode::kParallel : cutlass::conv::SplitKMode::kSerial);
}

template <Math M, NhwcKernel kKernel, TileClass kClass>
using NhwcKernelType =
    typename NhwcKernelFor<M, kKernel, Tile<M, NhwcTileShape<M, kKernel, kClass>>>::type;

template <class Kernel>
bool nhwc_can_implement(const NhwcConv& c) {
  using Device = cutlass::conv::device::ImplicitGemmConvolution<Kernel>;
  return Device::can_implement(nhwc_arguments<Kernel>(c)) == cutlass::Status::kSuccess;
}

// Launches a CUTLASS kernel (conv or GEMM: both are cutlass::Kernel<K> over K::Params) with the
// shared memory its tiles need.
template <class Kernel>
ffi::Error launch(const typename Kernel::Params& params, dim3 grid, cudaStream_t stream) {
  constexpr int kSharedBytes = int(sizeof(typename Kernel::SharedStorage));
  if constexpr (kSharedBytes >= (48 << 10)) {
    const cudaError_t error = cudaFuncSetAttribute(
        cutlass::Kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
    if (error != cudaSuccess)
      return ffi::Error::Internal(std::string("conv2d: cudaFuncSetAttribute: ") +
                                  cudaGetErrorString(error));
  }
  cutlass::Kernel<Kernel><<<grid, Kernel::kThreadCount, kSharedBytes, stream>>>(params);
  return launch_status("conv2d (CUTLASS)");
}

// Builds the kernel parameters directly rather than through the device-level class: its
// initialize() would memset the whole parallel split-K output, which every slice overwrites.
inline std::string describe(const NhwcConv& c) {
  const char* kernel = c.kernel == NhwcKernel::kFprop          ? "fprop"
                       : c.kernel == NhwcKernel::kStridedDgrad ? "strided dgrad"
                                                               : "wgrad";
  char text[320];
  std::snprintf(text, sizeof text,
                "CUTLASS %s kernel rejects N=%d H=%d W=%d C=%d K=%d R=%d S=%d P=%d Q=%d pad=(%d,%d) "
                "stride=(%d,%d) dilation=(%d,%d) split_k=%d (can_implement failed)",
                kernel, c.N, c.H, c.W, c.C, c.K, c.R, c.S, c.P, c.Q, c.pad_h, c.pad_w, c.stride_h,
                c.stride_w, c.dilation_h, c.dilation_w, c.split_k);
  return text;
}

inline std::string describe(const BatchedGemm& g) {
  char text[256];
  std::snprintf(text, sizeof text,
                "CUTLASS batched GEMM rejects M=%d N=%d K=%d lda=%lld ldb=%lld ldd=%lld batch=%d "
                "(alignment of pointers or leading dimensions)",
                g.M, g.N, g.K, static_cast<long long>(g.lda), static_cast<long long>(g.ldb),
                static_cast<long long>(g.ldd), g.batch_count);
  return text;
}

template <class Kernel>
ffi::Error nhwc_run(const NhwcConv& c, cudaStream_t stream) {
  if (!nhwc_can_implement<Kernel>(c)) return ffi::Error::Internal("conv2d: " + describe(c));
  const typename Kernel::Params params(nhwc_arguments<Kernel>(c), nullptr);
  typename Kernel::ThreadblockSwizzle swizzle;
  return launch<Kernel>(params, swizzle.get_grid_shape(params.grid_tiled_shape), stream);
}

template <class Gemm>
typename Gemm::Arguments gemm_arguments(const BatchedGemm& g) {
  using ElementA = typename Gemm::ElementA;
  using ElementB = typename Gemm::ElementB;
  using ElementC = typename Gemm::ElementC;
  auto* d = static_cast<ElementC*>(g.d);
  // The bias is an [M x N] matrix shared by every image (batch stride 0).
  const bool has_bias = g.c != nullptr;
  const auto* source = has_bias ? static_cast<const ElementC*>(g.c) : d;
  return typename Gemm::Arguments(
      {g.M, g.N, g.K}, {static_cast<const ElementA*>(g.a), typename Gemm::LayoutA(g.lda)},
      g.batch_stride_a, {static_cast<const ElementB*>(g.b), typename Gemm::LayoutB(g.ldb)},
      g.batch_stride_b, {source, typename Gemm::LayoutC(g.ldd)}, has_bias ? 0 : g.batch_stride_d,
      {d, typename Gemm::LayoutC(g.ldd)}, g.batch_stride_d, {1.0f, has_bias ? 1.0f : 0.0f},
      g.batch_count);
}

template <Math M, GemmKernel kKernel, TileClass kClass>
using GemmType = typename GemmFor<M, kKernel, Tile<M, GemmTileShape<M, kKernel, kClass>>>::type;

template <class Gemm>
bool gemm_can_implement(const BatchedGemm& g) {
  // The batch is the grid's z extent (below 2^16). GemmBatched::can_implement checks the
  // alignment of pointers and leading dimensions; batch strides must keep it.
  if (g.batch_count < 1 || g.batch_count >= (1 << 16)) return false;
  if (g.M < 1 || g.N < 1 || g.K < 1) return false;
  if ((g.N + Gemm::ThreadblockShape::kN - 1) / Gemm::ThreadblockShape::kN > 65535) return false;
  constexpr int kAlign = Gemm::kAlignmentA;
  if (g.batch_stride_a % kAlign || g.batch_stride_b % kAlign || g.batch_stride_d % kAlign)
    return false;
  return Gemm::can_implement(gemm_arguments<Gemm>(g)) == cutlass::Status::kSuccess;
}

template <class Gemm>
ffi::Error gemm_run(const BatchedGemm& g, cudaStream_t stream) {
  if (!gemm_can_implement<Gemm>(g)) return ffi::Error::Internal("conv2d: " + describe(g));
  using Kernel = typename Gemm::GemmKernel;
  using Block = typename Gemm::ThreadblockShape;
  const typename Gemm::Arguments a = gemm_arguments<Gemm>(g);
  typename Gemm::ThreadblockSwizzle swizzle;
  const cutlass::gemm::GemmCoord tiles =
      swizzle.get_tiled_shape(a.problem_size, {Block::kM, Block::kN, Block::kK}, a.batch_count);
  const typename Kernel::Params params(a.problem_size, tiles, a.ref_A.non_const_ref(), a.stride_A,
                                       a.ref_B.non_const_ref(), a.stride_B,
                                       a.ref_C.non_const_ref(), a.stride_C, a.ref_D, a.stride_D,
                                       a.epilogue, a.batch_count);
  return launch<Kernel>(params, swizzle.get_grid_shape(tiles), stream);
}

// Calls f(TypeTag<Kernel>{}) with the kernel type of (kernel, tile class).
template <Math M, class F>
auto with_nhwc_kernel(const NhwcConv& c, F&& f) {
  const bool wide = c.tile == TileClass::kWide;
  switch (c.kernel) {
    case NhwcKernel::kFprop:
      return wide ? f(TypeTag<NhwcKernelType<M, NhwcKernel::kFprop, TileClass::kWide>>{})
                  : f(TypeTag<NhwcKernelType<M, NhwcKernel::kFprop, TileClass::kNarrow>>{});
    case NhwcKernel::kStridedDgrad:
      return f(TypeTag<NhwcKernelType<M, NhwcKernel::kStridedDgrad, TileClass::kNarrow>>{});
    case NhwcKernel::kWgrad:
    default:
      return wide ? f(TypeTag<NhwcKernelType<M, NhwcKernel::kWgrad, TileClass::kWide>>{})
                  : f(TypeTag<NhwcKernelType<M, NhwcKernel::kWgrad, TileClass::kNarrow>>{});
  }
}

template <Math M, class F>
auto with_gemm(const BatchedGemm& g, F&& f) {
  const bool wide = g.tile == TileClass::kWide;
  switch (g.kernel) {
    case GemmKernel::kFprop:
      return wide ? f(TypeTag<GemmType<M, GemmKernel::kFprop, TileClass::kWide>>{})
                  : f(TypeTag<GemmType<M, GemmKernel::kFprop, TileClass::kNarrow>>{});
    case GemmKernel::kDgrad:
      return wide ? f(TypeTag<GemmType<M, GemmKernel::kDgrad, TileClass::kWide>>{})
                  : f(TypeTag<GemmType<M, GemmKernel::kDgrad, TileClass::kNarrow>>{});
    case GemmKernel::kWgrad:
    default:
      return f(TypeTag<GemmType<M, GemmKernel::kWgrad, TileClass::kNarrow>>{});
  }
}

}  // namespace detail

template <Math M>
bool can_implement(const NhwcConv& conv) {
  return detail::with_nhwc_kernel<M>(conv, [&](auto kernel) {
    return detail::nhwc_can_implement<typename decltype(kernel)::type>(conv);
  });
}

template <Math M>
int64_t output_tiles(const NhwcConv& conv) {
  return detail::with_nhwc_kernel<M>(conv, [&](auto kernel) {
    using Kernel = typename decltype(kernel)::type;
    using Block = typename Kernel::ThreadblockShape;
    const cutlass::gemm::GemmCoord gemm = cutlass::conv::implicit_gemm_problem_size(
        Kernel::kConvolutionalOperator, detail::problem_size(conv));
    return int64_t((gemm.m() + Block::kM - 1) / Block::kM) * ((gemm.n() + Block::kN - 1) / Block::kN);
  });
}

template <Math M>
int64_t output_tiles(const BatchedGemm& gemm) {
  return detail::with_gemm<M>(gemm, [&](auto kernel) {
    using Block = typename decltype(kernel)::type::ThreadblockShape;
    return int64_t((gemm.M + Block::kM - 1) / Block::kM) * ((gemm.N + Block::kN - 1) / Block::kN);
  });
}

template <Math M>
ffi::Error run(const NhwcConv& conv, cudaStream_t stream) {
  return detail::with_nhwc_kernel<M>(conv, [&](auto kernel) {
    return detail::nhwc_run<typename decltype(kernel)::type>(conv, stream);
  });
}

template <Math M>
bool can_implement(const BatchedGemm& gemm) {
  return detail::with_gemm<M>(gemm, [&](auto kernel) {
    return detail::gemm_can_implement<typename decltype(kernel)::type>(gemm);
  });
}

template <Math M>
ffi::Error run(const BatchedGemm& gemm, cudaStream_t stream) {
  return detail::with_gemm<M>(gemm, [&](auto kernel) {
    return detail::gemm_run<typename decltype(kernel)::type>(gemm, stream);
  });
}

// Instantiates the entry points for one math mode (in its own translation unit).
#define JK_IMPLICIT_GEMM_INSTANTIATE(math)                                                    \
  template bool can_implement<math>(const NhwcConv&);                                      \
  template int64_t output_tiles<math>(const NhwcConv&);                                    \
  template int64_t output_tiles<math>(const BatchedGemm&);                                 \
  template ffi::Error run<math>(const NhwcConv&, cudaStream_t);                            \
  template bool can_implement<math>(const BatchedGemm&);                                   \
  template ffi::Error run<math>(const BatchedGemm&, cudaStream_t)

}  // namespace implicit_gemm
}  // namespace jax_kernels
