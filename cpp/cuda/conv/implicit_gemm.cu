// Tensor-core conv2d path (interface in implicit_gemm.h): plans each problem onto CUTLASS kernels
// (implicit_gemm_<math>.cu) and runs the layout kernels around them.
//
// Two routes:
// - GEMM: 1x1 kernels with stride 1, no padding, one group, and channel and pixel counts that are
//   multiples of the 128-bit access: batched GEMMs straight on the NCHW data, no layout change.
//   fprop and dgrad are one GEMM per image; wgrad writes one float32 partial per image and a
//   fixed-order reduction sums them.
// - NHWC: every other problem taken. The operands are copied to NHWC in the scratch buffer
//   (channels zero-padded to the access width so any channel count works, groups one after
//   another), CUTLASS implicit GEMM runs once per group, and the result goes back: fprop and dgrad
//   through an NHWC -> NCHW transpose, wgrad through a fixed-order reduction of its split-K
//   partials straight into KCRS. Unit-stride dgrad is an fprop on flipped, transposed weights;
//   strided dgrad has its own CUTLASS kernel.
// - im2col: dense problems with few input channels (3-channel stems), where the implicit GEMM
//   would fill most of its K tile with zeros: the columns [N*P*Q][R*S*C padded] are written to
//   the scratch and a 1x1 problem runs over them; dgrad gathers its columns back per input
//   element (col2im, fixed tap order), wgrad reduces [K][R*S*C] partials into the weights.
// Channels-last problems (ConvProblem::layout NHWC, HWIO weights) take the NHWC route with no
// activation copies where CUTLASS can read them in place: x / dy read and y / dx written where
// they are, only the weights transformed (HWIO to KRSC, or its flipped transpose for dgrad) and
// wgrad's split-K partials reduced into HWIO. That needs one group and channel and filter counts
// that are multiples of the 128-bit access; other channels-last problems are repacked (padded
// channels, groups apart) the way NCHW ones are transposed.
// On a Hopper GPU (compute capability 9.0) the forward and unit-stride dgrad kernels are
// CUTLASS 3.x sm_90a kernels (implicit_gemm_sm90.cuh), and so is the half types' wgrad, split by
// a kernel of ours (implicit_gemm_sm90_wgrad.cuh; channels-last partials in HWIO order, summed
// by launch_wgrad_sum). TF32 wgrad of one group, filters over one tap, 16 or more channels and
// filters and batches of 16 or more runs another kernel of ours
// (implicit_gemm_sm90_wgrad_tf32.cuh) on copies of dy and x with the batch innermost
// (plan_batch_inner_wgrad); a strided dgrad of one group at unit dilation runs as one Hopper
// fprop per stride phase (dgrad_phases.cuh, plan_phase_dgrad). Everywhere else, and for other
// TF32 wgrads, other strided dgrads and float32x3, the Sm80 ones (implicit_gemm_kernels.cuh). The Hopper fprop writes NCHW outputs
// (one group, unpadded channels) from its epilogue, with no transpose after it. A Hopper fprop
// of 1x1 taps, unit stride and no padding with a packed NHWC output (channels-last 1x1
// forwards and unit-stride dgrads, the im2col route's problem over its columns) runs as one
// persistent GEMM over the pixels instead (implicit_gemm_sm90_pointwise.cuh; run_hopper), and
// a channels-last 1x1 wgrad of that kind as one batched over equal slices of the pixels
// (implicit_gemm_sm90_pointwise_wgrad.cuh; plan_pointwise_wgrad) where the Sm80 kernel would.
// Every pass is bitwise reproducible: no atomics anywhere, split-K partials go to separate
// buffers and are summed in a fixed order.
//
// Declined (the direct kernels run them): float64, depthwise and small groups (fewer than 16
// channels or filters per group, or more than 16 groups), strided dgrad with dilation, unit-stride
// dgrad with padding wider than the filter, filters over 32 taps a side, tensors past CUTLASS's
// 32-bit indexing (2 GiB per tensor: its int strides and GEMM extents such as N*P*Q), GEMM
// dimensions past 2^30, and scratch sizes past int64.
#include "conv/implicit_gemm.h"

#if defined(JAX_KERNELS_HAVE_CUTLASS)

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "conv/dgrad_phases.cuh"
#include "conv/implicit_gemm_kernels.h"
#include "conv/slice_sum.cuh"
#include "conv/tiling.h"
#include "common/grid_stride.cuh"
#include "common/knobs.h"
#include "common/launch.h"
#include "common/scratch.h"
#include "common/side_streams.h"
#include "common/status.h"

namespace jax_kernels {
namespace {

using implicit_gemm::BatchInnerWgrad;
using implicit_gemm::BatchedGemm;
using implicit_gemm::GemmKernel;
using implicit_gemm::Math;
using implicit_gemm::NhwcConv;
using implicit_gemm::NhwcKernel;
using implicit_gemm::TileClass;
using implicit_gemm::WgradOrder;

// SM count the split heuristics aim at (H100/H200). Fixed rather than queried: the scratch size
// depends on the split and is computed at trace time, possibly without a GPU.
constexpr int64_t kNominalSms = 132;
constexpr int64_t kMaxSplitK = 64;
constexpr int64_t kMinKIterationsPerSlice = 16;
// The batched GEMM's wgrad (one partial per image and tile) takes problems of at least this
// many blocks, a quarter of the nominal SMs' worth; below, the split-K conv kernel.
constexpr int64_t kMinGemmWgradBlocks = 32;
constexpr int64_t kMaxGroups = 16;
constexpr int64_t kMinChannelsPerGroup = 16;

// Calls f(std::integral_constant<Math, M>{}) for the math mode: the CUTLASS entry points are
// templates instantiated once per mode (implicit_gemm_<math>.cu).
template <class F>
auto with_math(Math math, F&& f) {
  switch (math) {
    case Math::kFloat16: return f(std::integral_constant<Math, Math::kFloat16>{});
    case Math::kBFloat16: return f(std::integral_constant<Math, Math::kBFloat16>{});
    case Math::kTF32: return f(std::integral_constant<Math, Math::kTF32>{});
    case Math::kFloat32x3:
    default: return f(std::integral_constant<Math, Math::kFloat32x3>{});
  }
}

// Whether the Hopper kernels (implicit_gemm_sm90.cuh) may run: built (the sm_90a object
// library), the current device has compute capability 9.0 (sm_90a code runs there only), and
// not turned off with JAX_KERNELS_CONV_SM90=0 (kept for A/B measurements against the Sm80
// kernels). The scratch layout does not depend on it.
bool hopper_kernels() {
#if defined(JAX_KERNELS_HAVE_SM90_CONV)
  if (knob_off("JAX_KERNELS_CONV_SM90")) return false;
  static const bool hopper = [] {
    int device = 0, major = 0, minor = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return major == 9 && minor == 0;
  }();
  return hopper;
#else
  return false;
#endif
}

bool sm90_math(Math math) { return math != Math::kFloat32x3; }

template <class Problem>
bool can_implement(Math math, const Problem& problem) {
  return with_math(math, [&](auto m) { return implicit_gemm::can_implement<m()>(problem); });
}

#if defined(JAX_KERNELS_HAVE_SM90_CONV)
bool can_implement(Math math, const NhwcConv& conv) {
  if (!conv.sm90) return with_math(math, [&](auto m) { return implicit_gemm::can_implement<m()>(conv); });
  switch (math) {
    case Math::kFloat16: return implicit_gemm::sm90_can_implement<Math::kFloat16>(conv);
    case Math::kBFloat16: return implicit_gemm::sm90_can_implement<Math::kBFloat16>(conv);
    case Math::kTF32: return implicit_gemm::sm90_can_implement<Math::kTF32>(conv);
    default: return false;
  }
}

// A planned Hopper fprop that is a pointwise GEMM (1x1, unit stride, no padding, packed NHWC
// output) runs on the persistent GEMM (implicit_gemm_sm90_pointwise.cuh) unless
// JAX_KERNELS_CONV_POINTWISE=0 (kept for A/B measurements); everything else on the conv kernels.
template <Math M>
ffi::Error run_hopper(const NhwcConv& conv, cudaStream_t stream) {
  if (conv.kernel == NhwcKernel::kFprop && conv.R == 1 && conv.S == 1 &&
      !knob_off("JAX_KERNELS_CONV_POINTWISE") &&
      implicit_gemm::sm90_pointwise_can_implement<M>(conv))
    return implicit_gemm::sm90_pointwise_run<M>(conv, stream);
  return implicit_gemm::sm90_run<M>(conv, stream);
}

ffi::Error run(Math math, const NhwcConv& conv, cudaStream_t stream) {
  if (!conv.sm90) return with_math(math, [&](auto m) { return implicit_gemm::run<m()>(conv, stream); });
  switch (math) {
    case Math::kFloat16: return run_hopper<Math::kFloat16>(conv, stream);
    case Math::kBFloat16: return run_hopper<Math::kBFloat16>(conv, stream);
    case Math::kTF32: return run_hopper<Math::kTF32>(conv, stream);
    default: return ffi::Error::Internal("conv2d: no Hopper kernel for float32x3");
  }
}

// The Hopper pointwise wgrad GEMM (plan_pointwise_wgrad) in the math mode, where it has one.
bool pointwise_wgrad_can_implement(Math math, const NhwcConv& conv) {
  switch (math) {
    case Math::kFloat16: return implicit_gemm::sm90_pointwise_wgrad_can_implement<Math::kFloat16>(conv);
    case Math::kBFloat16: return implicit_gemm::sm90_pointwise_wgrad_can_implement<Math::kBFloat16>(conv);
    case Math::kTF32: return implicit_gemm::sm90_pointwise_wgrad_can_implement<Math::kTF32>(conv);
    default: return false;
  }
}

ffi::Error pointwise_wgrad_run(Math math, const NhwcConv& conv, cudaStream_t stream) {
  switch (math) {
    case Math::kFloat16: return implicit_gemm::sm90_pointwise_wgrad_run<Math::kFloat16>(conv, stream);
    case Math::kBFloat16: return implicit_gemm::sm90_pointwise_wgrad_run<Math::kBFloat16>(conv, stream);
    case Math::kTF32: return implicit_gemm::sm90_pointwise_wgrad_run<Math::kTF32>(conv, stream);
    default: return ffi::Error::Internal("conv2d: no Hopper kernel for float32x3");
  }
}
#endif

template <class Problem>
int64_t output_tiles(Math math, const Problem& problem) {
  return with_math(math, [&](auto m) { return implicit_gemm::output_tiles<m()>(problem); });
}

template <class Problem>
ffi::Error run(Math math, const Problem& problem, cudaStream_t stream) {
  return with_math(math, [&](auto m) { return implicit_gemm::run<m()>(problem, stream); });
}

// ---- Planning (host only, identical at trace time and at run time) ----------------------------

enum class Route { kDecline, kGemm, kNhwc, kIm2col };

struct Plan {
  Route route = Route::kDecline;
  Math math = Math::kBFloat16;
  int64_t element_bytes = 2;
  int64_t alignment = 8;  // elements per 128-bit access
  // NHWC route: channels and filters per group, valid and padded to the access width.
  int64_t groups = 1, Cg = 0, Kg = 0, Cgp = 0, Kgp = 0;
  bool dgrad_as_fprop = false;
  // NHWC route on channels-last tensors read and written where they are (one group, channel and
  // filter counts multiples of the access width); other channels-last problems are repacked.
  bool in_place = false;
  // kIm2col: the columns R*S*C padded to the access width (conv is then a 1x1 problem over them),
  // and whether the NHWC output (fwd) or output gradient (dgrad, wgrad) is used in place.
  int64_t columns = 0, columns_padded = 0;
  bool y_in_place = false;
  // kIm2col on NCHW through the batched GEMM (plan->gemm): the columns channel-major,
  // [N][padded][P*Q], so that y, dy and dx are read and written as NCHW is, with no transposes.
  bool channel_major = false;
  NhwcConv conv{};  // one group's problem; pointers are set at run time
  BatchedGemm gemm{};  // GEMM route; pointers are set at run time
  // kNhwc wgrad in TF32 of one group, filters of more than one tap, 16 or more channels and
  // filters and batches of 16 or more (plan_batch_inner_wgrad): on Hopper the TF32 wgrad over
  // batch-innermost copies (implicit_gemm_sm90_wgrad_tf32.cuh) runs instead of the Sm80 kernel,
  // in the same scratch regions, which the plan sizes for both on every device.
  bool batch_inner = false;
  BatchInnerWgrad batch_inner_wgrad{};  // pointers are set at run time
  // kNhwc strided dgrad of one group at unit dilation (plan_phase_dgrad): on Hopper one sm_90a
  // fprop per stride phase (dgrad_phases.cuh) runs instead of the Sm80 strided-dgrad kernel, in
  // the same scratch regions (the phases' filters together are the weights' size).
  bool phase_dgrad = false;
  dgrad_phases::Phases phases{};
  // kNhwc wgrad of 1x1 taps, unit stride and no padding read in place (plan_pointwise_wgrad): on
  // Hopper the pointwise wgrad GEMM (implicit_gemm_sm90_pointwise_wgrad.cuh) runs over this many
  // equal slices of the pixels instead of the split-K conv kernels, in the same scratch regions,
  // which the plan sizes for both on every device. 0: not taken.
  int64_t pointwise_wgrad_slices = 0;
  // A strided 1x1 forward or wgrad (plan_sampled): the rest of the plan is that of the unit-stride
  // problem over x's sampled pixels (sampled_query), which a gather writes to the scratch at this
  // offset first. -1: none.
  int64_t sampled_offset = -1;
  // Scratch regions (byte offsets from the 256-byte aligned base) and the bytes to ask for.
  int64_t offset[4] = {0, 0, 0, 0};
  int64_t bytes = -1;
};

// Lays out regions of the given (checked) sizes one after another (common/scratch.h); false
// when the total cannot be represented.
bool lay_out_scratch(Plan* plan, std::initializer_list<int64_t> region_bytes) {
  ScratchLayout layout;
  int index = 0;
  for (int64_t size : region_bytes) plan->offset[index++] = layout.take(size);
  plan->bytes = layout.total();
  return plan->bytes >= 0;
}

bool math_of(const ConvQuery& query, Math* math) {
  switch (query.dtype) {
    case ConvDtype::kFloat16: *math = Math::kFloat16; return true;
    case ConvDtype::kBFloat16: *math = Math::kBFloat16; return true;
    case ConvDtype::kFloat32:
      *math = query.precision == ConvPrecision::kHighest ? Math::kFloat32x3 : Math::kTF32;
      return true;
    default: return false;  // float64: the direct kernels are exact and fast enough
  }
}

bool fits_int(std::initializer_list<int64_t> values) {
  for (int64_t v : values)
    if (v < 0 || v > INT_MAX) return false;
  return true;
}

// The batched GEMM forms a dimension plus a tile, and (K + tile - 1) / tile, in int: dimensions
// up to 2^30 leave room for that.
bool gemm_dimensions_fit(std::initializer_list<int64_t> dimensions) {
  for (int64_t d : dimensions)
    if (d < 0 || d > (int64_t(1) << 30)) return false;
  return true;
}

// CUTLASS's conv kernels index each tensor in int: TensorNHWC keeps int strides (H*W*C) and
// forms n * stride in int, and the GEMM extents (N*P*Q, N*H*W, C*R*S, K*R*S) are products of int
// extents; its can_implement refuses tensors of 2 GiB or more, which keeps all of them below
// 2^31. Checked here on the (checked) byte sizes, before any of those products is formed.
bool cutlass_tensors_fit(std::initializer_list<int64_t> tensor_bytes) {
  for (int64_t b : tensor_bytes)
    if (b < 0 || b >= (int64_t(1) << 31)) return false;
  return true;
}

// The batched GEMM of a 1x1 convolution on NCHW tensors, one image a batch: C input rows
// (channels, or im2col's padded columns) and `pixels` columns per image. Forward y[n] = w * x[n];
// dgrad dx[n] = w^T * dy[n]; wgrad one float32 partial per image, dy[n] * x[n]^T.
BatchedGemm nchw_gemm(ConvPass pass, int64_t N, int64_t K, int64_t C, int64_t pixels) {
  BatchedGemm g{};
  g.batch_count = int(N);
  switch (pass) {
    case ConvPass::kForward:
      g.kernel = GemmKernel::kFprop;
      g.tile = K <= 64 ? TileClass::kNarrow : TileClass::kWide;
      g.M = int(K), g.N = int(pixels), g.K = int(C);
      g.lda = C, g.ldb = pixels, g.ldd = pixels;
      g.batch_stride_a = 0, g.batch_stride_b = C * pixels, g.batch_stride_d = K * pixels;
      break;
    case ConvPass::kBackwardData:
      g.kernel = GemmKernel::kDgrad;
      g.tile = C <= 64 ? TileClass::kNarrow : TileClass::kWide;
      g.M = int(C), g.N = int(pixels), g.K = int(K);
      g.lda = C, g.ldb = pixels, g.ldd = pixels;
      g.batch_stride_a = 0, g.batch_stride_b = K * pixels, g.batch_stride_d = C * pixels;
      break;
    case ConvPass::kBackwardWeight:
    default:
      g.kernel = GemmKernel::kWgrad;
      g.tile = TileClass::kNarrow;
      g.M = int(K), g.N = int(C), g.K = int(pixels);
      g.lda = pixels, g.ldb = pixels, g.ldd = C;
      g.batch_stride_a = K * pixels, g.batch_stride_b = C * pixels, g.batch_stride_d = K * C;
      break;
  }
  return g;
}

bool plan_gemm(const ConvQuery& query, Plan* plan) {
  const ConvProblem& p = query.problem;
  if (p.groups != 1 || p.R != 1 || p.S != 1 || p.stride_h != 1 || p.stride_w != 1 ||
      p.pad_top != 0 || p.pad_left != 0 || p.P != p.H || p.Q != p.W)
    return false;
  const int64_t pixels = p.H * p.W;
  const int64_t a = plan->alignment;
  if (p.C % a || p.K % a || pixels % a) return false;
  // The batch is the grid's z extent (below 2^16).
  if (p.N >= (1 << 16) || !gemm_dimensions_fit({p.K, p.C, pixels})) return false;
  const int64_t eb = plan->element_bytes;
  BatchedGemm& g = plan->gemm;
  g = nchw_gemm(query.pass, p.N, p.K, p.C, pixels);
  switch (query.pass) {
    case ConvPass::kForward:
      // The bias broadcast to [K x pixels].
      if (!lay_out_scratch(plan, {checked_product({p.K, pixels, eb})})) return false;
      break;
    case ConvPass::kBackwardData:
      if (!lay_out_scratch(plan, {})) return false;
      break;
    case ConvPass::kBackwardWeight: {
      // One float32 partial per image, summed in image order. With few images there are few
      // blocks and a batched launch cannot split the pixel reduction: the NHWC route (split-K
      // in one launch) is then faster, below a quarter of the SMs' worth of blocks. (At half,
      // 64 <-> 128 channels over 32 images of 64x64, the GEMM's 64 blocks beat the NHWC route,
      // whose transposes of dy and x move 100 MB: fwd + both gradients 0.194 -> 0.094 ms and
      // 0.148 -> 0.082 on the H100.) It also needs less scratch when the partials would
      // outweigh copies of dy and x (large filters over few pixels).
      if (p.N * output_tiles(plan->math, g) < kMinGemmWgradBlocks) return false;
      const int64_t partial_bytes = checked_product({p.N, p.K, p.C, 4});
      const int64_t copy_bytes = checked_product({p.N, pixels, p.K + p.C, eb});
      if (partial_bytes < 0 || (copy_bytes >= 0 && partial_bytes > copy_bytes)) return false;
      if (!lay_out_scratch(plan, {partial_bytes})) return false;
      break;
    }
  }
  if (!can_implement(plan->math, g)) return false;
  plan->route = Route::kGemm;
  return true;
}

// The pointwise wgrad GEMM's slices of the pixels (plan->pointwise_wgrad_slices): a channels-last
// wgrad of 1x1 taps at unit stride without padding, read in place, in a math mode the Hopper
// kernels have; in TF32 only where its column tiles are full (measured in run 30, H200, N32:
// 96 columns on a 128-wide tile, 96->384 and 384->96 at 56^2, took 1.03-1.10x the Sm80
// kernel's time, on the 96-wide tile 0.81-0.82x; full tiles 0.45-0.69x, or the same at
// 256->64). Equal slices (the GEMM's batches): the most that divide the pixels, at most one wave
// of output tiles over the nominal SMs, kMaxSplitK, and slices of kMinKIterationsPerSlice
// k-blocks or more. 0 (not taken: the split-K conv kernels run it) where that leaves fewer than
// half the slices those bounds allow. Host-only and independent of the device, like the rest of
// the plan (half types take it where the Hopper half wgrad does not: run_nhwc_route).
int64_t plan_pointwise_wgrad(const ConvProblem& p, const Plan& plan) {
  if (!plan.in_place || !sm90_math(plan.math) || p.R != 1 || p.S != 1 || p.stride_h != 1 ||
      p.stride_w != 1 || p.pad_top != 0 || p.pad_left != 0 || p.P != p.H || p.Q != p.W)
    return 0;
  const int64_t pixels = p.N * p.H * p.W;
  if (pixels <= 0 || pixels > INT_MAX) return 0;
  const implicit_gemm::PointwiseWgradTiling t = implicit_gemm::pointwise_wgrad_tiling(p.K, p.C);
  if (plan.math == Math::kTF32 && t.cols % t.tile_cols != 0) return 0;
  const int64_t k_block = 128 / plan.element_bytes;
  const int64_t bound =
      std::min({std::max<int64_t>(1, kNominalSms / t.tiles), kMaxSplitK,
                std::max<int64_t>(1, pixels / (kMinKIterationsPerSlice * k_block))});
  int64_t slices = 1;
  for (int64_t d = 2; d <= bound; ++d)
    if (pixels % d == 0) slices = d;
  return 2 * slices < bound ? 0 : slices;
}

// wgrad's split-K: slices of the N*P*Q reduction (`positions`) so that about two blocks per SM
// run, each slice long enough to amortize its partial write. The tile's K extent is 128 bytes
// of elements.
int wgrad_split(Math math, const NhwcConv& c, int64_t positions, int64_t element_bytes) {
  const int64_t tiles = output_tiles(math, c);
  const int64_t k_iterations = ceil_div(positions, 128 / element_bytes);
  int64_t split = std::min(kMaxSplitK, ceil_div(2 * kNominalSms, tiles));
  return int(std::max<int64_t>(1, std::min(split, k_iterations / kMinKIterationsPerSlice)));
}

#if defined(JAX_KERNELS_HAVE_SM90_CONV)
implicit_gemm::Sm90WgradTiles sm90_wgrad_tiles(Math math, const NhwcConv& c) {
  return with_math(math, [&](auto m) {
    if constexpr (m() == Math::kFloat32x3)
      return implicit_gemm::Sm90WgradTiles{};  // float32x3 has no sm90 kernels
    else
      return implicit_gemm::sm90_wgrad_tiles<m()>(c);
  });
}

// The Hopper wgrad kernel's split (implicit_gemm_sm90_wgrad.cuh): one wave of two blocks per
// nominal SM (a second, partial wave would double the time), slices of at least
// kMinKIterationsPerSlice / 2 k tiles, and never more than the planned split, which sized the
// scratch before the kernel family was known. Every slice non-empty: ceil(k_tiles / per).
// 0 where the kernel has no tiling for the problem (TF32).
int sm90_wgrad_split(Math math, const NhwcConv& c) {
  const implicit_gemm::Sm90WgradTiles tiles = sm90_wgrad_tiles(math, c);
  if (tiles.output <= 0) return 0;
  const int64_t k_tiles = tiles.reduction;
  int64_t split = std::min<int64_t>({c.split_k, 2 * kNominalSms / tiles.output,
                                     k_tiles / (kMinKIterationsPerSlice / 2)});
  split = std::max<int64_t>(split, 1);
  return int(implicit_gemm::nonempty_split(k_tiles, split));
}

// The Hopper wgrad plan: the wide tile (128 filters) where it fills a wave at its split, else
// the narrow one (64) if that launches more blocks (e.g. 1x1 64->256 at 56^2: 2 wide tiles x 64
// slices, 128 blocks, against 4 x 64). False where the kernel does not take the problem.
bool plan_sm90_wgrad(Math math, NhwcConv* c) {
  NhwcConv best = *c;
  best.sm90 = true;
  best.split_k = sm90_wgrad_split(math, best);
  if (best.tile == TileClass::kWide) {
    NhwcConv narrow = *c;
    narrow.sm90 = true, narrow.tile = TileClass::kNarrow;
    narrow.split_k = sm90_wgrad_split(math, narrow);
    const int64_t wide_blocks = sm90_wgrad_tiles(math, best).output * best.split_k;
    const int64_t narrow_blocks = sm90_wgrad_tiles(math, narrow).output * narrow.split_k;
    if (wide_blocks < 2 * kNominalSms && narrow_blocks > wide_blocks &&
        can_implement(math, narrow))
      best = narrow;
  }
  if (best.split_k < 1 || !can_implement(math, best)) return false;
  *c = best;
  return true;
}
#endif

// Whether the Hopper TF32 wgrad over batch-innermost copies takes the problem, and its plan:
// device-independent (the scratch is sized from it everywhere), run only on Hopper. 1x1 filters
// stay on the Sm80 kernel: their copies cost more than the kernel saves (measured: 1x1 64->256
// at 56^2, NHWC, 159 us against 72), and so do channels-last filters of under 9 taps, which the
// Sm80 kernel reads in place (2x2/2 96->192 at 56^2, NHWC: 90.3 us, 47.0 of them copies,
// against 72.3; 3x3 and 7x7 ones gain 1.3-2.3x). So do fewer than 16 channels or filters (the
// 64-wide tiles would be mostly zeros: the 3-channel stems). One wave of its CTAs (one per
// nominal SM), slices of at least kMinKIterationsPerSlice k tiles, every slice non-empty.
bool plan_batch_inner_wgrad(const ConvQuery& query, const Plan& plan, BatchInnerWgrad* w) {
  const ConvProblem& p = query.problem;
  const bool channels_last = p.layout == ConvLayout::kNHWC;
  if (plan.math != Math::kTF32 || p.groups != 1 || p.N < 16 || p.R * p.S == 1 ||
      (channels_last && p.R * p.S < 9) || p.C < 16 || p.K < 16)
    return false;
  // Every box coordinate the kernel forms in int (q*stride_w + s*dil_w - pad_w and the like)
  // well inside int32: the strides, the extents times them, the taps' reach and the padding
  // each under 2^28.
  const int64_t limit = int64_t(1) << 28;
  if (p.stride_h >= limit || p.stride_w >= limit) return false;
  for (int64_t v : {p.P * p.stride_h, p.Q * p.stride_w, (p.R - 1) * p.dilation_h,
                    (p.S - 1) * p.dilation_w, p.pad_top, p.pad_left})
    if (v >= limit) return false;
  const int64_t Nb = round_up(p.N, 4);
  // The copies' elements and the k tiles in int (the kernel's indices).
  const int64_t x_copy = checked_product({Nb, p.C, p.H, p.W});
  const int64_t dy_copy = checked_product({Nb, p.K, p.P, p.Q});
  if (x_copy < 0 || dy_copy < 0 || x_copy > INT_MAX || dy_copy > INT_MAX) return false;
  *w = BatchInnerWgrad{};
  w->N = int(p.N), w->Nb = int(Nb), w->C = int(p.C), w->H = int(p.H), w->W = int(p.W);
  w->K = int(p.K), w->R = int(p.R), w->S = int(p.S), w->P = int(p.P), w->Q = int(p.Q);
  w->pad_h = int(p.pad_top), w->pad_w = int(p.pad_left);
  w->stride_h = int(p.stride_h), w->stride_w = int(p.stride_w);
  w->dilation_h = int(p.dilation_h), w->dilation_w = int(p.dilation_w);
  w->channels_last = channels_last;
  // HWIO partials for HWIO weights: their sum is then a streaming one (launch_wgrad_sum), where
  // KRSC ones go through the transposing reduction (41.6 of 105 us at 3x3 512->512, 7^2, NHWC).
  w->order = w->channels_last ? WgradOrder::kRSCK : WgradOrder::kKRSC;
  w->c_pitch = plan.Cgp, w->k_pitch = plan.Kgp;
  w->slice_elements = plan.Kgp * p.R * p.S * plan.Cgp;
  const int64_t tiles = implicit_gemm::batch_inner_output_tiles(*w);
  const int64_t k_tiles = implicit_gemm::batch_inner_k_tiles(*w);
  if (tiles / ceil_div(p.K, 64) > 65535) return false;  // the grid's y extent (channels x taps)
  int64_t split =
      std::min({kMaxSplitK, ceil_div(kNominalSms, tiles), k_tiles / kMinKIterationsPerSlice});
  split = std::max<int64_t>(split, 1);
  w->split = int(implicit_gemm::nonempty_split(k_tiles, split));
  return true;
}

#if defined(JAX_KERNELS_HAVE_SM90_CONV)
// The Hopper conv fprop's tile (implicit_gemm_sm90.cuh): the wide one (one CTA per SM) unless
// twice its tiles fit one wave of the nominal SMs; then the narrow one, twice the CTAs with half
// the work each. Measured (run 31, H200, N32 NHWC, in-jit): 0.94-0.98x the time on 3x3 512->512
// at 7^2 (52 wide tiles), 1.11-1.34x on 3x3 256->256 at 14^2 (98) and 1.03-1.31x on 3x3/2
// 128->128 at 56^2 (196), where it is not taken. JAX_KERNELS_CONV_SM90_FILL=0 keeps the wide
// tile (A/B measurements). The pointwise GEMM (1x1 taps) chooses its own tiles.
void sm90_fprop_tile(NhwcConv* c) {
  if (c->tile != TileClass::kWide || (c->R == 1 && c->S == 1) ||
      knob_off("JAX_KERNELS_CONV_SM90_FILL"))
    return;
  const int64_t wide = ceil_div(int64_t(c->N) * c->P * c->Q, 128) * ceil_div(int64_t(c->K), 128);
  if (2 * wide <= kNominalSms) c->tile = TileClass::kNarrow;
}

// Stride phase f of a strided dgrad as the Hopper fprop sees it: over dy ([N][P][Q][Kgp]) with
// the phase's filters, writing its pixels of dx ([N][H][W][Cgp]) at the strides between them.
NhwcConv phase_conv(const ConvProblem& p, const Plan& plan, const dgrad_phases::Phase& f) {
  NhwcConv c{};
  c.kernel = NhwcKernel::kFprop;
  const int64_t filters = f.cols * plan.Cgp;  // merged column phases: adjacent channels
  c.tile = filters <= 64 ? TileClass::kNarrow : TileClass::kWide;
  c.N = int(p.N), c.H = int(p.P), c.W = int(p.Q), c.C = int(plan.Kgp), c.K = int(filters);
  c.R = f.taps_h, c.S = f.taps_w, c.P = f.P, c.Q = f.Q;
  c.pad_h = f.pad_h, c.pad_w = f.pad_w;
  c.stride_h = c.stride_w = c.dilation_h = c.dilation_w = 1;
  c.split_k = 1;
  c.sm90 = true;
  c.d_stride_q = p.stride_w * plan.Cgp;
  c.d_stride_p = p.stride_h * p.W * plan.Cgp;
  c.d_stride_n = p.H * p.W * plan.Cgp;
  return c;
}
#endif

// Whether the Hopper kernels may run the strided dgrad planned in *plan (the Sm80 kernel's
// plan) as stride phases (dgrad_phases.cuh): one group, a math mode they have, phases the
// decomposition expresses, and every phase's fprop one the kernel takes. Host-only, and
// independent of the device (run_nhwc_route asks hopper_kernels()), like the scratch.
bool plan_phase_dgrad(const ConvQuery& query, Plan* plan) {
#if defined(JAX_KERNELS_HAVE_SM90_CONV)
  const ConvProblem& p = query.problem;
  if (p.groups != 1 || !sm90_math(plan->math)) return false;
  // Adjacent column phases of equal taps run as one fprop (fewer launches, less device time; the
  // same bits) unless JAX_KERNELS_PHASE_MERGE=0, kept for A/B measurements like
  // JAX_KERNELS_CONV_SM90. The phases' filters take the same scratch either way.
  if (!dgrad_phases::plan(p, plan->Kgp, plan->Cgp, &plan->phases,
                          !knob_off("JAX_KERNELS_PHASE_MERGE")))
    return false;
  for (int i = 0; i < plan->phases.count; ++i)
    if (!can_implement(plan->math, phase_conv(p, *plan, plan->phases.phase[i]))) return false;
  return true;
#else
  (void)query, (void)plan;
  return false;
#endif
}

// The kernel family for the planned problem: on Hopper the sm_90a kernels (fprop, also
// unit-stride dgrad's; wgrad in half types, with its own tile and split) where they take the
// problem, else the Sm80 one; false if neither does.
bool choose_kernel(Math math, NhwcConv* c) {
#if defined(JAX_KERNELS_HAVE_SM90_CONV)
  if (c->kernel == NhwcKernel::kFprop && hopper_kernels() && sm90_math(math)) {
    c->sm90 = true;
    const TileClass tile = c->tile;
    sm90_fprop_tile(c);
    if (!can_implement(math, *c)) c->sm90 = false, c->tile = tile;
  }
  if (c->kernel == NhwcKernel::kWgrad && hopper_kernels() &&
      (math == Math::kFloat16 || math == Math::kBFloat16))
    plan_sm90_wgrad(math, c);
#endif
  return can_implement(math, *c);
}

bool plan_nhwc(const ConvQuery& query, Plan* plan) {
  const ConvProblem& p = query.problem;
  const int64_t a = plan->alignment, eb = plan->element_bytes;
  const int64_t G = p.groups;
  const int64_t Cg = p.C / G, Kg = p.K / G, Cgp = round_up(Cg, a), Kgp = round_up(Kg, a);
  plan->groups = G, plan->Cg = Cg, plan->Kg = Kg, plan->Cgp = Cgp, plan->Kgp = Kgp;
  if (!fits_int({Cgp, Kgp})) return false;
  // Channels last: CUTLASS reads and writes the tensors in place (no activation regions) when
  // they have one group and aligned channel counts; otherwise they are repacked (padded, groups
  // apart) like the NCHW tensors are transposed.
  const bool in_place = p.layout == ConvLayout::kNHWC && G == 1 && Cgp == Cg && Kgp == Kg;
  plan->in_place = in_place;
  // One group's tensors as CUTLASS sees them (wgrad writes float32 partial filters).
  const int64_t x_group = checked_product({p.N, p.H, p.W, Cgp, eb});
  const int64_t y_group = checked_product({p.N, p.P, p.Q, Kgp, eb});
  const int64_t w_elements = checked_product({Kgp, p.R, p.S, Cgp});
  const int64_t w_group = checked_mul(w_elements, eb);
  const int64_t filter_out =
      checked_mul(w_elements, query.pass == ConvPass::kBackwardWeight ? 4 : eb);
  if (!cutlass_tensors_fit({x_group, y_group, w_group, filter_out})) return false;
  const int64_t x_bytes = in_place ? 0 : G * x_group;
  const int64_t y_bytes = in_place ? 0 : G * y_group;
  const int64_t w_bytes = G * w_group;

  NhwcConv& c = plan->conv;
  c = NhwcConv{};
  c.N = int(p.N), c.H = int(p.H), c.W = int(p.W), c.C = int(Cgp), c.K = int(Kgp);
  c.R = int(p.R), c.S = int(p.S), c.P = int(p.P), c.Q = int(p.Q);
  c.pad_h = int(p.pad_top), c.pad_w = int(p.pad_left);
  c.stride_h = int(p.stride_h), c.stride_w = int(p.stride_w);
  c.dilation_h = int(p.dilation_h), c.dilation_w = int(p.dilation_w);
  c.split_k = 1;
  switch (query.pass) {
    case ConvPass::kForward:
      c.kernel = NhwcKernel::kFprop;
      c.tile = Kgp <= 64 ? TileClass::kNarrow : TileClass::kWide;
      if (!lay_out_scratch(plan, {x_bytes, w_bytes, G * Kgp * eb, y_bytes})) return false;
      break;
    case ConvPass::kBackwardData: {
      // dx = conv(dy, w flipped and transposed) with padding d*(R-1) - pad: an fprop over dy.
      const int64_t pad_h = p.dilation_h * (p.R - 1) - p.pad_top;
      const int64_t pad_w = p.dilation_w * (p.S - 1) - p.pad_left;
      const bool unit_stride = p.stride_h == 1 && p.stride_w == 1;
      if (unit_stride && pad_h >= 0 && pad_w >= 0) {
        plan->dgrad_as_fprop = true;
        c.kernel = NhwcKernel::kFprop;
        c.tile = Cgp <= 64 ? TileClass::kNarrow : TileClass::kWide;
        c.H = int(p.P), c.W = int(p.Q), c.P = int(p.H), c.Q = int(p.W);
        c.C = int(Kgp), c.K = int(Cgp);
        c.pad_h = int(pad_h), c.pad_w = int(pad_w);
      } else if (!unit_stride && p.dilation_h == 1 && p.dilation_w == 1) {
        c.kernel = NhwcKernel::kStridedDgrad;
        c.tile = TileClass::kNarrow;
      } else {
        return false;
      }
      if (!lay_out_scratch(plan, {y_bytes, w_bytes, x_bytes})) return false;
      break;
    }
    case ConvPass::kBackwardWeight: {
      c.kernel = NhwcKernel::kWgrad;
      c.tile = Kgp <= 64 ? TileClass::kNarrow : TileClass::kWide;
      c.split_k = wgrad_split(plan->math, c, p.N * p.P * p.Q, eb);
      int64_t dy_region = y_bytes, x_region = x_bytes, slices = c.split_k;
      plan->batch_inner = plan_batch_inner_wgrad(query, *plan, &plan->batch_inner_wgrad);
      if (plan->batch_inner) {  // room for the batch-innermost copies and their split too
        const BatchInnerWgrad& w = plan->batch_inner_wgrad;
        dy_region = std::max(dy_region, checked_product({w.Nb, p.K, p.P, p.Q, 4}));
        x_region = std::max(x_region, checked_product({w.Nb, p.C, p.H, p.W, 4}));
        slices = std::max<int64_t>(slices, w.split);
      }
      plan->pointwise_wgrad_slices = plan_pointwise_wgrad(p, *plan);
      slices = std::max(slices, plan->pointwise_wgrad_slices);
      if (!lay_out_scratch(plan,
                           {dy_region, x_region, checked_product({G, slices, w_elements, 4})}))
        return false;
      break;
    }
  }
  if (!choose_kernel(plan->math, &c)) return false;
  if (c.kernel == NhwcKernel::kStridedDgrad) plan->phase_dgrad = plan_phase_dgrad(query, plan);
  // NCHW outputs of the Hopper fprop (the forward's y, unit-stride dgrad's dx) are written by its
  // epilogue where they go: no transpose after it. One group, and output channels that need no
  // padding (the GEMM's columns are then the tensor's channels). The scratch keeps the NHWC
  // output's region: its size must not depend on the device (a program lowered on a Hopper GPU
  // may run on another, whose plan writes NHWC and transposes).
  if (c.sm90 && c.kernel == NhwcKernel::kFprop && p.layout == ConvLayout::kNCHW && G == 1 &&
      (query.pass == ConvPass::kForward ? Kgp == Kg : Cgp == Cg)) {
    c.d_nchw = true;
    if (!can_implement(plan->math, c)) c.d_nchw = false;
  }
  // The Hopper wgrad writes channels-last partials in HWIO order: their reduction is then a
  // streaming sum (launch_wgrad_sum). OIHW partials would be written one scattered float per
  // lane by its epilogue (measured slower than the transposing reduction of [K,R,S,C] ones).
  if (c.sm90 && c.kernel == NhwcKernel::kWgrad && p.layout == ConvLayout::kNHWC)
    c.wgrad_order = WgradOrder::kRSCK;
  plan->route = Route::kNhwc;
  return true;
}

// The im2col route on NCHW tensors through the batched GEMM of the 1x1 route (plan_gemm), over
// channel-major columns cols[n] = [padded][P*Q]: forward y[n] = w [K x padded] * cols[n], dgrad
// dcols[n] = w^T * dy[n], wgrad one float32 partial w-gradient per image, dy[n] * cols[n]^T.
// Needs the filters and output pixels on the access width (the GEMM reads and writes y, dy in
// place) and, for wgrad, enough images' worth of blocks.
bool plan_im2col_gemm(const ConvQuery& query, Plan* plan) {
  const ConvProblem& p = query.problem;
  const int64_t a = plan->alignment, eb = plan->element_bytes;
  const int64_t Cp = plan->columns_padded, pixels = p.P * p.Q;
  if (p.K % a || pixels % a || p.N >= (1 << 16) || !gemm_dimensions_fit({p.K, Cp, pixels}))
    return false;
  const int64_t cols_bytes = checked_product({p.N, Cp, pixels, eb});
  const int64_t w_bytes = checked_product({p.K, Cp, eb});
  BatchedGemm& g = plan->gemm;
  g = nchw_gemm(query.pass, p.N, p.K, Cp, pixels);
  switch (query.pass) {
    case ConvPass::kForward:
      if (!lay_out_scratch(plan, {cols_bytes, w_bytes, checked_product({p.K, pixels, eb})}))
        return false;
      break;
    case ConvPass::kBackwardData:
      if (!lay_out_scratch(plan, {w_bytes, cols_bytes})) return false;
      break;
    case ConvPass::kBackwardWeight:
    default:
      if (p.N * output_tiles(plan->math, g) < kMinGemmWgradBlocks) return false;
      if (!lay_out_scratch(plan, {cols_bytes, checked_product({p.N, p.K, Cp, 4})})) return false;
      break;
  }
  if (!can_implement(plan->math, g)) return false;
  plan->channel_major = true;
  plan->route = Route::kIm2col;
  return true;
}

// Few input channels (3-channel stems: C padded to the access width is a fraction of the
// kernels' 128-byte K tile, which the implicit GEMM would fill with zeros tap by tap): an explicit
// im2col into [N*P*Q][R*S*C padded] in the scratch, then a 1x1 problem on the tensor cores; dgrad
// sums its [N*P*Q][R*S*C] result back over the taps (a gather per input element, no atomics).
// Taken for one group, more than one tap, C * 8 <= the K tile (the implicit GEMM would waste 7/8
// of it or more), and columns no larger than four times input plus output.
bool plan_im2col(const ConvQuery& query, Plan* plan) {
  const ConvProblem& p = query.problem;
  const int64_t a = plan->alignment, eb = plan->element_bytes;
  if (p.groups != 1 || p.R * p.S < 2 || p.C * 8 > 128 / eb) return false;
  const int64_t columns = p.R * p.S * p.C, Cp = round_up(columns, a), Kp = round_up(p.K, a);
  const int64_t rows = p.N * p.P * p.Q;
  const int64_t x_bytes = checked_product({p.N, p.H, p.W, p.C, eb});
  const int64_t y_bytes = checked_product({rows, p.K, eb});
  const int64_t cols_bytes = checked_product({rows, Cp, eb});
  const int64_t y_padded = checked_product({rows, Kp, eb});
  const int64_t w_bytes = checked_product({Kp, Cp, eb});
  if (!fits_int({Cp, Kp}) || !cutlass_tensors_fit({x_bytes, y_bytes, cols_bytes, y_padded, w_bytes}))
    return false;
  if (cols_bytes > 4 * (x_bytes + y_bytes)) return false;
  plan->groups = 1, plan->Cg = p.C, plan->Kg = p.K, plan->Cgp = Cp, plan->Kgp = Kp;
  plan->columns = columns, plan->columns_padded = Cp;
  if (p.layout == ConvLayout::kNCHW && plan_im2col_gemm(query, plan)) return true;
  plan->y_in_place = p.layout == ConvLayout::kNHWC && Kp == p.K;
  const int64_t y_region = plan->y_in_place ? 0 : y_padded;
  NhwcConv& c = plan->conv;
  c = NhwcConv{};
  c.N = int(p.N), c.H = c.P = int(p.P), c.W = c.Q = int(p.Q), c.C = int(Cp), c.K = int(Kp);
  c.R = c.S = 1, c.stride_h = c.stride_w = c.dilation_h = c.dilation_w = 1;
  c.split_k = 1;
  switch (query.pass) {
    case ConvPass::kForward:
      c.kernel = NhwcKernel::kFprop;
      c.tile = Kp <= 64 ? TileClass::kNarrow : TileClass::kWide;
      if (!lay_out_scratch(plan, {cols_bytes, w_bytes, Kp * eb, y_region})) return false;
      break;
    case ConvPass::kBackwardData:
      // dcolumns [rows][Cp] = dy [rows][Kp] x w^T: an fprop with Cp filters of Kp channels.
      plan->dgrad_as_fprop = true;
      c.kernel = NhwcKernel::kFprop;
      c.C = int(Kp), c.K = int(Cp);
      c.tile = Cp <= 64 ? TileClass::kNarrow : TileClass::kWide;
      if (!lay_out_scratch(plan, {y_region, w_bytes, cols_bytes})) return false;
      break;
    case ConvPass::kBackwardWeight: {
      c.kernel = NhwcKernel::kWgrad;
      c.tile = Kp <= 64 ? TileClass::kNarrow : TileClass::kWide;
      c.split_k = wgrad_split(plan->math, c, rows, eb);
      if (!lay_out_scratch(plan, {y_region, cols_bytes, checked_product({c.split_k, Kp, Cp, 4})}))
        return false;
      break;
    }
  }
  if (!choose_kernel(plan->math, &c)) return false;
  plan->route = Route::kIm2col;
  return true;
}

// A 1x1 convolution with a stride reads only the pixels (p * stride - pad, q * stride - pad): its
// forward and wgrad are those of the unit-stride 1x1 convolution over those pixels, a tensor of
// x's layout with P x Q pixels (zero where the padding is sampled). Its gradient dx is zero off
// them, which a gather does not give: dgrad keeps its stride phases.
ConvQuery sampled_query(const ConvQuery& query) {
  ConvQuery sub = query;
  ConvProblem& p = sub.problem;
  p.H = p.P, p.W = p.Q;
  p.stride_h = p.stride_w = p.dilation_h = p.dilation_w = 1;
  p.pad_top = p.pad_left = 0;
  return sub;
}

Plan make_plan(const ConvQuery& query);

// The unit-stride plan over the sampled pixels (sampled_query) for a strided 1x1 forward or wgrad
// where taken (below), with room after its regions for the sampled x; false where not, or where
// no route takes the unit-stride problem. Measured against the strided kernels (run 31, H200, N32
// 1x1/2 256->512 at 56^2, in-jit): TF32 wgrad 0.50x the time NCHW (the batched GEMM), 0.57x
// channels last (the pointwise wgrad GEMM); TF32 NCHW forward 0.85x.
// JAX_KERNELS_CONV_SAMPLED=0 keeps the strided kernels, for A/B measurements; as it sets the
// scratch's size, it must be the same when a program is traced and when it runs (set it before
// the process starts).
bool plan_sampled(const ConvQuery& query, Plan* plan) {
  const ConvProblem& p = query.problem;
  if (p.R != 1 || p.S != 1 || (p.stride_h == 1 && p.stride_w == 1) ||
      query.pass == ConvPass::kBackwardData || knob_off("JAX_KERNELS_CONV_SAMPLED"))
    return false;
  // Taken where it measured faster: TF32 wgrads, whose strided problem has no Hopper kernel, and
  // TF32 NCHW forwards, whose strided route transposes the whole of x. The half types' Hopper
  // kernels read the strided pixels themselves, faster than a gather and the unit-stride route
  // (1.02-1.36x the time on their wgrads and NCHW forward), and the TF32 channels-last forward
  // was level.
  if (plan->math != Math::kTF32 ||
      (query.pass == ConvPass::kForward && p.layout == ConvLayout::kNHWC))
    return false;
  const Plan inner = make_plan(sampled_query(query));
  if (inner.route == Route::kDecline) return false;
  const int64_t sampled_bytes = checked_product({p.N, p.C, p.P, p.Q, inner.element_bytes});
  ScratchLayout layout;
  layout.take(inner.bytes);  // a multiple of kScratchAlign: past the inner regions
  *plan = inner;
  plan->sampled_offset = layout.take(sampled_bytes);
  plan->bytes = layout.total();
  return plan->bytes >= 0 && plan->sampled_offset >= 0;
}

Plan make_plan(const ConvQuery& query) {
  Plan plan;
  const ConvProblem& p = query.problem;
  if (!math_of(query, &plan.math)) return plan;
  if (p.N < 1 || p.C < 1 || p.H < 1 || p.W < 1 || p.K < 1 || p.R < 1 || p.S < 1 || p.P < 1 ||
      p.Q < 1 || p.stride_h < 1 || p.stride_w < 1 || p.dilation_h < 1 || p.dilation_w < 1 ||
      p.pad_top < 0 || p.pad_left < 0 || p.groups < 1 || p.C % p.groups || p.K % p.groups)
    return plan;
  // CUTLASS describes problems in int; the extents come from real arrays, so their products fit
  // int64.
  if (!fits_int({p.N, p.C, p.H, p.W, p.K, p.R, p.S, p.P, p.Q, p.stride_h, p.stride_w, p.pad_top,
                 p.pad_left, p.dilation_h, p.dilation_w, p.groups}))
    return plan;
  if (p.groups > 1 && (p.groups > kMaxGroups || p.C / p.groups < kMinChannelsPerGroup ||
                       p.K / p.groups < kMinChannelsPerGroup))
    return plan;
  const bool half = plan.math == Math::kFloat16 || plan.math == Math::kBFloat16;
  plan.element_bytes = half ? 2 : 4;
  plan.alignment = 16 / plan.element_bytes;
  Plan sampled = plan;
  if (plan_sampled(query, &sampled)) return sampled;
  Plan gemm = plan;
  if (p.layout == ConvLayout::kNCHW && plan_gemm(query, &gemm)) return gemm;
  Plan im2col = plan;
  if (plan_im2col(query, &im2col)) return im2col;
  Plan nhwc = plan;
  if (plan_nhwc(query, &nhwc)) return nhwc;
  return Plan{};
}

// ---- Layout kernels ---------------------------------------------------------------------------
// They move raw element bits (uint16_t or uint32_t): transposes do not care about the dtype.

constexpr int kTile = 64;
constexpr int kLayoutThreads = 256;

template <class Bits>
struct alignas(4 * sizeof(Bits)) Vec4 {
  Bits v[4];
};

// A batch of 2-D transposes with zero padding: for slice (n, g),
//   out[j][i] = i < rows && j < cols ? in[i][j] : 0   for i < out_cols, j < out_rows,
// with in = in_base + n * in_stride_n + g * in_stride_g (row stride in_ld) and out likewise.
// NCHW -> NHWC: i = channel (padded), j = pixel; NHWC -> NCHW: i = pixel, j = channel;
// HWIO weights -> KRSC: i = (tap, channel), j = filter (padded).
template <class Bits>
struct TransposeJob {
  const Bits* in;
  Bits* out;
  int64_t rows, cols, out_cols, out_rows;
  int64_t in_ld, out_ld;
  int64_t slices, groups;  // slices are (n, g), g fastest
  int64_t in_stride_n, in_stride_g, out_stride_n, out_stride_g;
  int64_t tiles_i, tiles_j;
  int64_t block_begin;
  // Set by launch_layout from the strides and pointers: 4-element (vector) and 16-byte (wide)
  // accesses are aligned on that side.
  bool vector_in, vector_out, wide_in, wide_out;
  // > 1: output rows come in runs of flip_period written in reverse order (row j goes to
  // j - j % p + p - 1 - j % p): the taps of flipped KCRS weights.
  int64_t flip_period;
};

// KCRS weights to the layout the CUTLASS kernel reads, padded with zero filters and channels:
// fprop and strided dgrad read [G][Kgp][R][S][Cgp]; dgrad as fprop reads the flipped transpose
// [G][Cgp][R][S][Kgp] with tap (r, s) = (R-1-r, S-1-s). The padded bias [G][Kgp] comes along.
template <class Bits>
struct WeightJob {
  const Bits* w;
  Bits* out;
  const Bits* bias;
  Bits* bias_out;
  int64_t Kg, Cg, R, S, Kgp, Cgp;
  bool flip;
  bool hwio;  // the weights are HWIO [R][S][Cg][G*Kg] (channels last), else KCRS
  int64_t groups;
  // im2col route: R = S = 1 and channel c is column (r * S + s) * C + tap's channel of the
  // weights' own taps flat_R x flat_S over flat_C channels (0: off).
  int64_t flat_R, flat_S, flat_C;
  int64_t weight_count, bias_count;
  int64_t block_begin, blocks;  // blocks == 0: no weight job in this launch
  bool small_indices;           // every index fits in 31 bits (set by launch_layout)
  int64_t segment;              // elements per warp of an output row (set by launch_layout)
  // Set by launch_layout: every output row reads a contiguous source row (stride 1, not the
  // im2col route's unflipped split), both row extents (valid and padded) are whole 16-byte
  // chunks, and w and out are 16-byte aligned, so the gather can move 16 bytes a lane.
  bool vector_rows;
};

// Along an output row (but the im2col route's unflipped one, whose columns split into (tap,
// channel)), the source index steps by this stride.
template <class Bits>
__host__ __device__ __forceinline__ int64_t weight_row_stride(const WeightJob<Bits>& job) {
  const bool flat = job.flat_C > 0;
  const int64_t channels = flat ? job.flat_C : job.Cg;
  const int64_t taps = flat ? job.flat_R * job.flat_S : job.R * job.S;
  return job.flip ? (job.hwio ? 1 : channels * taps) : (job.hwio ? job.groups * job.Kg : taps);
}

// Channels-last activations that CUTLASS cannot read in place (a channel count off the access
// width, or several groups) move between [rows][G * channels] (rows = N * pixels) and the
// kernels' [G][rows][padded]: pad copies in with zeros past `channels`, unpad copies back.
template <class Bits>
struct RepackJob {
  const Bits* in;
  Bits* out;
  int64_t rows, groups, channels, padded;
  bool pad;
  int64_t block_begin, blocks;
  bool small_indices;  // every index fits in 31 bits (set by launch_layout)
};

template <class Bits>
struct LayoutJobs {
  TransposeJob<Bits> transpose[3];  // up to two activations' and the weights'
  int transpose_count;
  RepackJob<Bits> repack[2];
  int repack_count;
  WeightJob<Bits> weights;
};

// The output row that tile row j goes to (flipped KCRS writes each run of taps reversed).
template <class Bits>
__device__ __forceinline__ int64_t transposed_row(const TransposeJob<Bits>& job, int64_t j) {
  if (job.flip_period <= 1) return j;
  const uint32_t p = uint32_t(job.flip_period), in_run = uint32_t(j) % p;  // j < 2^31
  return j - in_run + (p - 1 - in_run);
}

// A tile's operands (its slice's) and its first row i0 and column j0 in them.
template <class Bits>
struct TilePlace {
  const Bits* in;
  Bits* out;
  int64_t i0, j0;
};

// Tile q of the job (q < 2^31: a launch has fewer blocks), in 32-bit arithmetic (a 64-bit
// division costs several times more, and every thread does these).
template <class Bits>
__device__ __forceinline__ TilePlace<Bits> tile_at(const TransposeJob<Bits>& job, uint32_t q) {
  const uint32_t ti = q % uint32_t(job.tiles_i);
  q /= uint32_t(job.tiles_i);
  const uint32_t tj = q % uint32_t(job.tiles_j), slice = q / uint32_t(job.tiles_j);
  const int64_t n = slice / uint32_t(job.groups), g = slice % uint32_t(job.groups);
  return {job.in + n * job.in_stride_n + g * job.in_stride_g,
          job.out + n * job.out_stride_n + g * job.out_stride_g, int64_t(ti) * kTile,
          int64_t(tj) * kTile};
}

// Four-byte elements, and two-byte ones on rows off 4 elements: 4-element accesses, the tile
// padded by a column against bank conflicts. Each thread loads 4 vectors (rows t / 16 + 16k),
// stages them, and stores 4 (columns).
template <class Bits>
struct QuadTile {
  using Shared = Bits[kTile][kTile + 1];
  Vec4<Bits> v[4];

  __device__ __forceinline__ void load(const TransposeJob<Bits>& job, const TilePlace<Bits>& at) {
    const int t = threadIdx.x, lane4 = 4 * (t % 16);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t i = at.i0 + t / 16 + 16 * k, j = at.j0 + lane4;
      v[k] = {};
      if (i >= job.rows) continue;
      const Bits* row = at.in + i * job.in_ld;
      if (job.vector_in && j + 3 < job.cols) {
        v[k] = *reinterpret_cast<const Vec4<Bits>*>(row + j);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (j + e < job.cols) v[k].v[e] = row[j + e];
      }
    }
  }
  __device__ __forceinline__ void stage(Shared& tile) const {
    const int t = threadIdx.x, lane4 = 4 * (t % 16);
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int e = 0; e < 4; ++e) tile[t / 16 + 16 * k][lane4 + e] = v[k].v[e];
  }
  __device__ __forceinline__ static void store(const TransposeJob<Bits>& job,
                                               const TilePlace<Bits>& at, const Shared& tile) {
    const int t = threadIdx.x, lane4 = 4 * (t % 16);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int jl = t / 16 + 16 * k;
      const int64_t j = at.j0 + jl, i = at.i0 + lane4;
      if (j >= job.out_rows) continue;
      Vec4<Bits> w;
#pragma unroll
      for (int e = 0; e < 4; ++e) w.v[e] = tile[lane4 + e][jl];
      Bits* row = at.out + transposed_row(job, j) * job.out_ld;
      if (job.vector_out && i + 3 < job.out_cols) {
        *reinterpret_cast<Vec4<Bits>*>(row + i) = w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (i + e < job.out_cols) row[i + e] = w.v[e];
      }
    }
  }
};

// Two-byte elements: 16-byte accesses (8 elements) on both sides. The tile is held as 32-bit
// words, each a pair of adjacent columns, 32 words a row, and row il's words rotated by
// 4 * (il / 8) so that neither side conflicts on the banks: a quarter warp stores one row's 32
// words; on the way out, thread (a, c) reads word c of rows 8a .. 8a+7 (bank c + 4a, all 32
// distinct in a warp) and so holds columns 2c and 2c + 1 of 8 rows: two output rows' 16 bytes.
struct PairTile {
  using Shared = uint32_t[kTile][kTile / 2];
  uint4 v[2];

  __device__ __forceinline__ void load(const TransposeJob<uint16_t>& job,
                                       const TilePlace<uint16_t>& at) {
    const int t = threadIdx.x, c8 = 8 * (t % 8);  // 8 threads cover a 64-element row
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int64_t i = at.i0 + t / 8 + 32 * k, j = at.j0 + c8;
      v[k] = make_uint4(0, 0, 0, 0);
      if (i >= job.rows) continue;
      const uint16_t* row = at.in + i * job.in_ld;
      if (job.wide_in && j + 7 < job.cols) {
        v[k] = *reinterpret_cast<const uint4*>(row + j);
      } else if (job.vector_in && j + 7 < job.cols) {
        const uint2 lo = *reinterpret_cast<const uint2*>(row + j);
        const uint2 hi = *reinterpret_cast<const uint2*>(row + j + 4);
        v[k] = make_uint4(lo.x, lo.y, hi.x, hi.y);
      } else {
        uint16_t e8[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) e8[e] = j + e < job.cols ? row[j + e] : uint16_t(0);
        v[k] = make_uint4(e8[0] | uint32_t(e8[1]) << 16, e8[2] | uint32_t(e8[3]) << 16,
                          e8[4] | uint32_t(e8[5]) << 16, e8[6] | uint32_t(e8[7]) << 16);
      }
    }
  }
  __device__ __forceinline__ void stage(Shared& words) const {
    const int t = threadIdx.x, c8 = 8 * (t % 8);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int il = t / 8 + 32 * k;
      *reinterpret_cast<uint4*>(&words[il][(c8 / 2 + 4 * (il / 8)) % 32]) = v[k];
    }
  }
  __device__ __forceinline__ static void store(const TransposeJob<uint16_t>& job,
                                               const TilePlace<uint16_t>& at,
                                               const Shared& words) {
    const int t = threadIdx.x, a = t % 8, c = t / 8;  // rows 8a .. 8a+7, word column c
    uint32_t w[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) w[e] = words[8 * a + e][(c + 4 * a) % 32];
    const int64_t i = at.i0 + 8 * a;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t j = at.j0 + 2 * c + h;
      if (j >= job.out_rows) continue;
      // Output row j holds the low (h = 0) or high halves of the 8 words.
      const uint32_t sel = h == 0 ? 0x5410 : 0x7632;
      const uint4 o = make_uint4(__byte_perm(w[0], w[1], sel), __byte_perm(w[2], w[3], sel),
                                 __byte_perm(w[4], w[5], sel), __byte_perm(w[6], w[7], sel));
      uint16_t* row = at.out + transposed_row(job, j) * job.out_ld;
      if (job.wide_out && i + 7 < job.out_cols) {
        *reinterpret_cast<uint4*>(row + i) = o;
      } else if (job.vector_out && i + 7 < job.out_cols) {
        *reinterpret_cast<uint2*>(row + i) = make_uint2(o.x, o.y);
        *reinterpret_cast<uint2*>(row + i + 4) = make_uint2(o.z, o.w);
      } else {
        const uint32_t packed[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (i + e < job.out_cols) row[i + e] = uint16_t(packed[e / 2] >> (16 * (e % 2)));
      }
    }
  }
};

// Tile `block` of the job: loads into registers, staged in shared memory, stored transposed.
// Two-byte elements take PairTile where both sides' rows allow at least 4-element accesses (on
// rows off that, e.g. 7x7 = 49 pixels, it measured slower than QuadTile).
template <class Tile, class Bits, class Shared>
__device__ __forceinline__ void transpose_one(const TransposeJob<Bits>& job, int64_t block,
                                              Shared& shared) {
  const TilePlace<Bits> at = tile_at(job, uint32_t(block));
  Tile tile;
  tile.load(job, at);
  tile.stage(shared);
  __syncthreads();
  Tile::store(job, at, shared);
}

template <class Bits>
__device__ __forceinline__ void transpose_tile(const TransposeJob<Bits>& job, int64_t block,
                                               Bits (&tile)[kTile][kTile + 1]) {
  if constexpr (sizeof(Bits) == 2) {
    if (job.vector_in && job.vector_out) {
      transpose_one<PairTile>(job, block, *reinterpret_cast<PairTile::Shared*>(&tile[0][0]));
      return;
    }
  }
  transpose_one<QuadTile<Bits>>(job, block, tile);
}

// One warp per segment of `segment` elements (32, 64 or 128, chosen by launch_layout so that
// small filters still spread over many warps) of an output row [g][outer][r][s] (outer = k, or
// c when flipped), its lanes along the row's `inner` elements (c, or k when flipped): the
// row's indices are worked out once per segment, and each element is a multiply-add away, but
// for the im2col route's unflipped columns, which split into (tap, channel) one by one. The
// padded bias [G][Kgp] is copied one thread per element after. Index is uint32_t where every
// index of the job fits (almost always): a 64-bit division costs several times a 32-bit one.
constexpr int kSegment = 128;  // the longest segment

template <class Index, class Bits>
__device__ void transform_weights_indexed(const WeightJob<Bits>& job, int64_t block) {
  const Index Kg = Index(job.Kg), Cg = Index(job.Cg), R = Index(job.R), S = Index(job.S);
  const Index Kgp = Index(job.Kgp), Cgp = Index(job.Cgp), groups = Index(job.groups);
  const bool flip = job.flip, hwio = job.hwio, flat = job.flat_C > 0;
  const Index inner_size = flip ? Kgp : Cgp, outer_size = flip ? Cgp : Kgp;
  const Index inner_valid = flip ? Kg : Cg, outer_valid = flip ? Cg : Kg;
  const Index channels = flat ? Index(job.flat_C) : Cg;
  const Index taps = flat ? Index(job.flat_R * job.flat_S) : R * S;
  // The source index of filter k, channel c (c a column (tap, channel) on the im2col route).
  auto source = [&](Index k, Index c, Index tap) {
    Index channel = c;
    if (flat) channel = c % channels, tap = c / channels;
    return hwio ? (tap * channels + channel) * groups * Kg + k
                : (k * channels + channel) * taps + tap;
  };
  const Index stride = Index(weight_row_stride(job));
  constexpr Index kVector = 16 / sizeof(Bits);
  const Index segment = Index(job.segment);
  const Index segments = (inner_size + segment - 1) / segment;
  const Index units = Index(job.weight_count) / inner_size * segments;
  const Index lane = threadIdx.x % 32, warps = Index(job.blocks) * (kLayoutThreads / 32);
  for (Index unit = Index(block) * (kLayoutThreads / 32) + threadIdx.x / 32; unit < units;
       unit += warps) {
    const Index row = unit / segments, begin = unit % segments * segment;
    const Index end = min(inner_size, begin + segment);
    Index rest = row;
    const Index s = rest % S;
    rest /= S;
    const Index r = rest % R;
    rest /= R;
    const Index outer = rest % outer_size;
    const Index g = rest / outer_size;
    const Index tap = flip ? (R - 1 - r) * S + (S - 1 - s) : r * S + s;
    Bits* out = job.out + row * inner_size;
    // Filters of group g: k counts from g * Kg in the source (HWIO's last axis, KCRS's first).
    const Index k0 = g * Kg;
    if (outer >= outer_valid) {
      for (Index i = begin + lane; i < end; i += 32) out[i] = Bits(0);
    } else if (flip || !flat) {
      const Index base = flip ? source(k0, outer, tap) : source(k0 + outer, 0, tap);
      if (job.vector_rows && base % kVector == 0) {
        // A contiguous source row (HWIO flipped: the filters of one (tap, channel)): 16 bytes a
        // lane. Chunks are all valid or all padding, as both extents are whole chunks. (base is
        // a multiple of kVector in every case vector_rows admits; the check costs nothing.)
        for (Index i = begin + lane * kVector; i < end; i += 32 * kVector)
          *reinterpret_cast<uint4*>(out + i) =
              i < inner_valid ? *reinterpret_cast<const uint4*>(job.w + base + i)
                              : make_uint4(0, 0, 0, 0);
      } else {
        for (Index i = begin + lane; i < end; i += 32)
          out[i] = i < inner_valid ? job.w[base + i * stride] : Bits(0);
      }
    } else {
      for (Index i = begin + lane; i < end; i += 32)
        out[i] = i < inner_valid ? job.w[source(k0 + outer, i, tap)] : Bits(0);
    }
  }
  const Index bias_count = Index(job.bias_count), threads = Index(job.blocks) * kLayoutThreads;
  for (Index j = Index(block) * kLayoutThreads + threadIdx.x; j < bias_count; j += threads) {
    const Index k = j % Kgp, g = j / Kgp;
    job.bias_out[j] = k < Kg ? job.bias[g * Kg + k] : Bits(0);
  }
}

template <class Bits>
__device__ void transform_weights(const WeightJob<Bits>& job, int64_t block) {
  if (job.small_indices)
    transform_weights_indexed<uint32_t>(job, block);
  else
    transform_weights_indexed<int64_t>(job, block);
}

template <class Index, class Bits>
__device__ void repack_indexed(const RepackJob<Bits>& job, int64_t block) {
  const Index rows = Index(job.rows), groups = Index(job.groups);
  const Index channels = Index(job.channels), padded = Index(job.padded);
  const Index per_group = rows * padded, total = groups * per_group;
  const Index stride = Index(job.blocks) * kLayoutThreads;
  for (Index idx = Index(block) * kLayoutThreads + threadIdx.x; idx < total; idx += stride) {
    const Index g = idx / per_group, rest = idx % per_group;
    const Index row = rest / padded, c = rest % padded;
    const Index packed = (row * groups + g) * channels + c;
    if (job.pad)
      job.out[idx] = c < channels ? job.in[packed] : Bits(0);
    else if (c < channels)
      job.out[packed] = job.in[idx];
  }
}

template <class Bits>
__device__ void repack(const RepackJob<Bits>& job, int64_t block) {
  if (job.small_indices)
    repack_indexed<uint32_t>(job, block);
  else
    repack_indexed<int64_t>(job, block);
}

// Six blocks per SM (at most 40 registers a thread): latency, not bandwidth, limits the
// transposes, and 6 resident blocks against 4 took the half-type NCHW layout passes 8-12% faster
// on the H100 (bf16 3x3 64->64 N32 56^2: 23.6 -> 21.8 us forward; four-byte elements unchanged).
template <class Bits>
__global__ void __launch_bounds__(kLayoutThreads, 6) layout_kernel(LayoutJobs<Bits> jobs) {
  // 16-byte aligned: PairTile stores 16 bytes at a time into it.
  __shared__ __align__(16) Bits tile[kTile][kTile + 1];
  const int64_t block = blockIdx.x;
  if (jobs.repack_count > 1 && block >= jobs.repack[1].block_begin) {
    repack(jobs.repack[1], block - jobs.repack[1].block_begin);
  } else if (jobs.repack_count > 0 && block >= jobs.repack[0].block_begin) {
    repack(jobs.repack[0], block - jobs.repack[0].block_begin);
  } else if (jobs.weights.blocks > 0 && block >= jobs.weights.block_begin) {
    transform_weights(jobs.weights, block - jobs.weights.block_begin);
  } else {
    int t = jobs.transpose_count > 0 ? jobs.transpose_count - 1 : 0;
    while (t > 0 && block < jobs.transpose[t].block_begin) --t;
    transpose_tile(jobs.transpose[t], block - jobs.transpose[t].block_begin, tile);
  }
}

// NCHW [N][G*channels][pixels] -> [G][N][pixels][channels_padded].
template <class Bits>
TransposeJob<Bits> to_nhwc(const void* in, void* out, int64_t N, int64_t G, int64_t channels,
                           int64_t pixels, int64_t channels_padded) {
  TransposeJob<Bits> job{};
  job.in = static_cast<const Bits*>(in);
  job.out = static_cast<Bits*>(out);
  job.rows = channels, job.cols = job.out_rows = pixels, job.out_cols = channels_padded;
  job.in_ld = pixels, job.out_ld = channels_padded;
  job.slices = N * G, job.groups = G;
  job.in_stride_n = G * channels * pixels, job.in_stride_g = channels * pixels;
  job.out_stride_n = pixels * channels_padded, job.out_stride_g = N * pixels * channels_padded;
  job.tiles_i = ceil_div(channels_padded, kTile), job.tiles_j = ceil_div(pixels, kTile);
  return job;
}

// [G][N][pixels][channels_padded] -> NCHW [N][G*channels][pixels].
template <class Bits>
TransposeJob<Bits> to_nchw(const void* in, void* out, int64_t N, int64_t G, int64_t pixels,
                           int64_t channels, int64_t channels_padded) {
  TransposeJob<Bits> job{};
  job.in = static_cast<const Bits*>(in);
  job.out = static_cast<Bits*>(out);
  job.rows = pixels, job.cols = job.out_rows = channels, job.out_cols = pixels;
  job.in_ld = channels_padded, job.out_ld = pixels;
  job.slices = N * G, job.groups = G;
  job.in_stride_n = pixels * channels_padded, job.in_stride_g = N * pixels * channels_padded;
  job.out_stride_n = G * channels * pixels, job.out_stride_g = channels * pixels;
  job.tiles_i = ceil_div(pixels, kTile), job.tiles_j = ceil_div(channels, kTile);
  return job;
}

template <class Bits>
RepackJob<Bits> repack_job(const void* in, void* out, int64_t rows, int64_t G, int64_t channels,
                           int64_t padded, bool pad) {
  RepackJob<Bits> job{};
  job.in = static_cast<const Bits*>(in);
  job.out = static_cast<Bits*>(out);
  job.rows = rows, job.groups = G, job.channels = channels, job.padded = padded, job.pad = pad;
  return job;
}

// Weights whose row gather (transform_weights) would read far-apart elements go through the
// tiled transpose instead (on success the weight job keeps only the bias):
// - HWIO read in KRSC order (the forward's and the strided dgrad's, unflipped): the gather's
//   lanes would read them G * Kg elements apart. Slice (tap, g) is the transpose of [Cg][Kg]
//   into [Kgp][Cgp] rows R * S * Cgp apart; one group with unpadded channels (or the im2col
//   route's single tap) is a single transpose of [R*S*Cg][Kg].
// - KCRS flipped (dgrad as fprop, [G][Cgp][R][S][Kgp]): the gather's lanes would read them
//   Cg * R * S apart. Group g is the transpose of [Kg][Cg*R*S] into [Cg*R*S][Kgp], each
//   channel's R * S rows written in reverse order for the flip.
//   (Not with padded channels: their rows would be left unwritten.)
// Both only for large filters (2^17 weights and more, 3x3 128->128 up): a transpose of a few
// tiles runs on a few SMs and takes longer than the row gather below (measured on the H100).
// Unflipped KCRS weights are [R*S][Cg] transposes per filter, too narrow for the tiles.
template <class Bits>
bool weights_transpose(WeightJob<Bits>* weights, TransposeJob<Bits>* job) {
  WeightJob<Bits>& w = *weights;
  if (w.weight_count < (int64_t(1) << 17) || (!w.hwio && w.flat_C > 0)) return false;
  const int64_t taps = w.R * w.S;
  *job = TransposeJob<Bits>{};
  job->in = w.w;
  job->out = w.out;
  job->slices = job->groups = 1;
  if (w.hwio && !w.flip) {
    job->cols = w.Kg, job->out_rows = w.Kgp;
    if (w.groups == 1 && (w.Cgp == w.Cg || taps == 1)) {
      job->rows = taps * w.Cg, job->out_cols = job->out_ld = taps * w.Cgp;
    } else {
      job->rows = w.Cg, job->out_cols = w.Cgp, job->out_ld = taps * w.Cgp;
      job->slices = taps * w.groups, job->groups = w.groups;
      job->in_stride_n = w.Cg * w.groups * w.Kg, job->in_stride_g = w.Kg;
      job->out_stride_n = w.Cgp, job->out_stride_g = w.Kgp * taps * w.Cgp;
    }
    job->in_ld = w.groups * w.Kg;
  } else if (!w.hwio && w.flip && w.Cgp == w.Cg && w.Cg * taps < (int64_t(1) << 31)) {
    job->rows = w.Kg, job->cols = job->out_rows = w.Cg * taps, job->out_cols = w.Kgp;
    job->in_ld = w.Cg * taps, job->out_ld = w.Kgp;
    job->flip_period = taps;
    job->slices = w.groups;
    job->in_stride_n = w.Kg * w.Cg * taps, job->out_stride_n = w.Cgp * taps * w.Kgp;
  } else {
    return false;
  }
  job->tiles_i = ceil_div(job->out_cols, kTile), job->tiles_j = ceil_div(job->out_rows, kTile);
  w.weight_count = 0;
  return true;
}

// One launch for up to two transposes or repacks and the weight transform (all independent; the
// weights' own transpose, if any, after the others). Repacks come after the weights; both loop
// over their elements with a bounded grid.
template <class Bits>
ffi::Error launch_layout(cudaStream_t stream, std::initializer_list<TransposeJob<Bits>> transposes,
                         const WeightJob<Bits>* weights = nullptr,
                         std::initializer_list<RepackJob<Bits>> repacks = {}) {
  LayoutJobs<Bits> jobs{};
  int64_t blocks = 0;
  auto add_transpose = [&](const TransposeJob<Bits>& job) {
    TransposeJob<Bits>& slot = jobs.transpose[jobs.transpose_count++];
    slot = job;
    // Accesses of `width` elements need every row start (and slice start) that aligned.
    auto fits = [](const Bits* base, int64_t ld, int64_t stride_n, int64_t stride_g, int width) {
      return ld % width == 0 && stride_n % width == 0 && stride_g % width == 0 &&
             aligned_to(base, width * int64_t(sizeof(Bits)));
    };
    slot.vector_in = fits(job.in, job.in_ld, job.in_stride_n, job.in_stride_g, 4);
    slot.vector_out = fits(job.out, job.out_ld, job.out_stride_n, job.out_stride_g, 4);
    constexpr int kWide = 16 / sizeof(Bits);
    slot.wide_in = fits(job.in, job.in_ld, job.in_stride_n, job.in_stride_g, kWide);
    slot.wide_out = fits(job.out, job.out_ld, job.out_stride_n, job.out_stride_g, kWide);
    slot.block_begin = blocks;
    blocks += job.tiles_i * job.tiles_j * job.slices;
  };
  for (const TransposeJob<Bits>& job : transposes) add_transpose(job);
  if (weights != nullptr) {
    jobs.weights = *weights;
    TransposeJob<Bits> tiled;
    if (weights_transpose(&jobs.weights, &tiled)) add_transpose(tiled);
    jobs.weights.block_begin = blocks;
    const int64_t count = jobs.weights.weight_count + jobs.weights.bias_count;
    const int64_t inner = jobs.weights.flip ? jobs.weights.Kgp : jobs.weights.Cgp;
    // Segments of 128 elements, halved (down to one per lane) while there would be fewer than
    // kSpreadWarps of them: a small filter's rows would otherwise sit on a few SMs.
    constexpr int64_t kSpreadWarps = 2048;
    const int64_t rows = jobs.weights.weight_count / inner;
    int64_t segment = kSegment;
    while (segment > 32 && rows * ceil_div(inner, segment) < kSpreadWarps) segment /= 2;
    jobs.weights.segment = segment;
    {
      const WeightJob<Bits>& w = jobs.weights;
      constexpr int64_t kVector = 16 / sizeof(Bits);
      const int64_t inner_valid = w.flip ? w.Kg : w.Cg;
      jobs.weights.vector_rows = (w.flip || w.flat_C == 0) && weight_row_stride(w) == 1 &&
                                 inner_valid % kVector == 0 && inner % kVector == 0 &&
                                 aligned_to(w.w, 16) && aligned_to(w.out, 16);
    }
    const int64_t units = rows * ceil_div(inner, segment);
    jobs.weights.blocks = std::min<int64_t>(
        1024, std::max(ceil_div(units, kLayoutThreads / 32),
                       ceil_div(jobs.weights.bias_count, kLayoutThreads)));
    // The grid stride loops' indices stay below count + blocks * threads (units are no more
    // than weights); the source weights (and bias) are no larger than their padded copies.
    jobs.weights.small_indices = count + 1024 * kLayoutThreads < (int64_t(1) << 31);
    blocks += jobs.weights.blocks;
  }
  for (const RepackJob<Bits>& job : repacks) {
    RepackJob<Bits>& slot = jobs.repack[jobs.repack_count++];
    slot = job;
    slot.block_begin = blocks;
    const int64_t total = job.groups * job.rows * job.padded;
    slot.blocks = std::min<int64_t>(int64_t(1) << 16,
                                    std::max<int64_t>(1, ceil_div(total, kLayoutThreads)));
    // Every index of a repack is below total (and one grid stride past it still fits).
    slot.small_indices = total + slot.blocks * kLayoutThreads < (int64_t(1) << 31);
    blocks += slot.blocks;
  }
  if (blocks == 0) return ffi::Error::Success();
  if (blocks > INT_MAX) return ffi::Error::InvalidArgument("conv2d: tensor too large to transpose");
  layout_kernel<Bits><<<unsigned(blocks), kLayoutThreads, 0, stream>>>(jobs);
  return launch_status("conv2d (layout)");
}

// dw[g*Kg + k][c][r][s] = sum over slices of partials[g][slice][k][r][s][c] (float32, Cgp a
// multiple of 4 and every stride too, so 16-byte loads). A block covers 32 groups of 4 channels
// (lanes) with its 8 warps taking slices w, w+8, ...: enough loads in flight to stream the
// partials, and the per-warp sums are added in warp order, so the result is reproducible.
struct WgradReduction {
  int64_t Kg, Cg, R, S, Cgp;
  bool hwio;       // dw is HWIO [R][S][Cg][G*Kg] (channels last), else KCRS
  int64_t groups;
  int64_t quads;  // G * Kg * R * S * ceil(Cg / 4)
  int64_t slices, slice_stride, group_stride;
  // im2col route: R = S = 1 and channel c is column (r * S + s) * flat_C + channel of the
  // weights' own flat_R x flat_S taps (0: off).
  int64_t flat_R, flat_S, flat_C;
};

constexpr int kReduceWarps = kLayoutThreads / 32;

template <class T>
__global__ void __launch_bounds__(kLayoutThreads)
    wgrad_reduce_kernel(const float* partials, T* dw, WgradReduction r) {
  __shared__ float4 warp_sums[kReduceWarps][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t quad = int64_t(blockIdx.x) * 32 + lane;
  const int64_t quads_per_row = (r.Cg + 3) / 4;
  int64_t rest = quad;
  const int64_t c0 = rest % quads_per_row * 4;
  rest /= quads_per_row;
  const int64_t s = rest % r.S;
  rest /= r.S;
  const int64_t tap_r = rest % r.R;
  rest /= r.R;
  const int64_t k = rest % r.Kg, g = rest / r.Kg;
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (quad < r.quads) {
    const float* p = partials + g * r.group_stride + ((k * r.R + tap_r) * r.S + s) * r.Cgp + c0;
#pragma unroll 4
    for (int64_t slice = warp; slice < r.slices; slice += kReduceWarps) {
      const float4 v = *reinterpret_cast<const float4*>(p + slice * r.slice_stride);
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
  }
  warp_sums[warp][lane] = sum;
  __syncthreads();
  if (warp != 0 || quad >= r.quads) return;
  for (int w = 1; w < kReduceWarps; ++w) {
    const float4 v = warp_sums[w][lane];
    sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
  }
  const float values[4] = {sum.x, sum.y, sum.z, sum.w};
  if (r.flat_C > 0) {  // one group; columns back to the weights' taps and channels
    for (int e = 0; e < 4 && c0 + e < r.Cg; ++e) {
      const int64_t channel = (c0 + e) % r.flat_C, tap = (c0 + e) / r.flat_C;
      T* out = r.hwio ? dw + (tap * r.flat_C + channel) * r.Kg + k
                      : dw + (k * r.flat_C + channel) * r.flat_R * r.flat_S + tap;
      *out = from_acc<T>(values[e]);
    }
    return;
  }
  if (r.hwio) {
    T* out = dw + ((tap_r * r.S + s) * r.Cg + c0) * r.groups * r.Kg + g * r.Kg + k;
    for (int e = 0; e < 4 && c0 + e < r.Cg; ++e) out[e * r.groups * r.Kg] = from_acc<T>(values[e]);
    return;
  }
  T* out = dw + (((g * r.Kg + k) * r.Cg + c0) * r.R + tap_r) * r.S + s;
  for (int e = 0; e < 4 && c0 + e < r.Cg; ++e) out[e * r.R * r.S] = from_acc<T>(values[e]);
}

ffi::Error launch_wgrad_reduce(cudaStream_t stream, ConvDtype dtype, const float* partials,
                               void* dw, const WgradReduction& r) {
  const unsigned blocks = unsigned(ceil_div(r.quads, 32));
  switch (dtype) {
    case ConvDtype::kFloat16:
      wgrad_reduce_kernel<<<blocks, kLayoutThreads, 0, stream>>>(partials,
                                                                 static_cast<float16*>(dw), r);
      break;
    case ConvDtype::kBFloat16:
      wgrad_reduce_kernel<<<blocks, kLayoutThreads, 0, stream>>>(partials,
                                                                 static_cast<bfloat16*>(dw), r);
      break;
    default:
      wgrad_reduce_kernel<<<blocks, kLayoutThreads, 0, stream>>>(partials, static_cast<float*>(dw),
                                                                 r);
      break;
  }
  return launch_status("conv2d (wgrad reduction)");
}

// The Hopper kernel's partials in HWIO order (WgradOrder::kRSCK): per group and slice
// [R][S][Cgp][Kgp], each weight's filters contiguous as in dw [R][S][Cg][G*Kg]. An item is 4
// consecutive filters (Kg a multiple of 4; else one filter) of one (tap, channel, group); the
// slices are added in the fixed order of slice_sum.cuh, with 16-byte loads and 4-element
// stores, both coalesced.
struct OrderedReduction {
  int64_t Kg, Cg, R, S, Kgp, Cgp, groups;
  int64_t slices, slice_stride, group_stride;
};

// Where an item's filters are in a slice of the partials and in dw (its index math in Index).
template <class Index, int kWidth>
struct OrderedItems {
  OrderedReduction r;
  __device__ __forceinline__ slice_sum::Place operator()(int64_t item) const {
    const Index runs = Index(r.Kg / kWidth), i = Index(item);
    const Index k = i % runs * kWidth, rest = i / runs;
    const Index g = rest % Index(r.groups), rsc = rest / Index(r.groups);  // (tap_r*S + s)*Cg + c
    const Index c = rsc % Index(r.Cg), tap = rsc / Index(r.Cg);
    return {g * r.group_stride + (int64_t(tap) * r.Cgp + c) * r.Kgp + k,
            (int64_t(rsc) * r.groups + g) * r.Kg + k};
  }
};

template <class T>
void launch_wgrad_sum_typed(cudaStream_t stream, const float* partials, T* dw,
                            const OrderedReduction& r) {
  if (r.groups == 1 && r.Cgp == r.Cg && r.Kgp == r.Kg) {
    // One group, nothing padded: the partials are in dw's own order, a contiguous sum with no
    // index math (the general placement took 8.6 us against 5.8 for 3x3 512->512 at 7^2, bf16).
    slice_sum::launch_contiguous(stream, partials, dw, r.R * r.S * r.Cg * r.Kg, r.slices);
    return;
  }
  const bool quads = r.Kg % 4 == 0;  // Kgp and the slice and group strides then are too
  const int64_t items = r.R * r.S * r.Cg * r.groups * (quads ? r.Kg / 4 : r.Kg);
  with_index(items * (quads ? 4 : 1) <= INT32_MAX, [&](auto index) {
    using Index = decltype(index);
    if (quads)
      slice_sum::launch<4>(stream, partials, dw, items, r.slices, r.slice_stride,
                           OrderedItems<Index, 4>{r});
    else
      slice_sum::launch<1>(stream, partials, dw, items, r.slices, r.slice_stride,
                           OrderedItems<Index, 1>{r});
  });
}

ffi::Error launch_wgrad_sum(cudaStream_t stream, ConvDtype dtype, const float* partials, void* dw,
                            const OrderedReduction& r) {
  switch (dtype) {
    case ConvDtype::kFloat16:
      launch_wgrad_sum_typed(stream, partials, static_cast<float16*>(dw), r);
      break;
    case ConvDtype::kBFloat16:
      launch_wgrad_sum_typed(stream, partials, static_cast<bfloat16*>(dw), r);
      break;
    default:
      launch_wgrad_sum_typed(stream, partials, static_cast<float*>(dw), r);
      break;
  }
  return launch_status("conv2d (wgrad reduction)");
}

// ---- im2col route (plan_im2col) ------------------------------------------------------------------

// columns[(n, p, q)][(r * S + s) * C + c] = x at (n, c, input_row(p, r), input_col(q, s)), zero
// outside the input and past the R*S*C columns (up to the padded width); x NCHW or NHWC.
// Channel-major columns (plan.channel_major) hold the same values at [n][(r * S + s) * C + c][(p,
// q)]. One thread per (row, tap) copies the tap's C channels (tap R*S zero-fills the padding):
// index math once per C elements, unsigned 32-bit where the item count allows (Index: cheaper
// divisions than signed or 64-bit ones; GridStride's clamped steps). Pixel-major,
// the threads of a row are consecutive (its taps' channels lie side by side); channel-major,
// those of a tap (consecutive threads write consecutive pixels).
struct ColumnsLayout {
  int64_t padded, pixels;  // pixels = P * Q
  bool channel_major;
};

// Offset of element j (a column) of row (n, pixel); the kernels step from one channel of a tap
// to the next by 1 (pixel-major) or P*Q (channel-major).
template <bool kChannelMajor>
__device__ __forceinline__ int64_t column_at(const ColumnsLayout& cl, int64_t n, int64_t pixel,
                                             int64_t j) {
  return kChannelMajor ? (n * cl.padded + j) * cl.pixels + pixel
                       : (n * cl.pixels + pixel) * cl.padded + j;
}

// Calls f(Index{}, std::bool_constant<channel major>{}) for the im2col / col2im kernel of a
// launch over `items`: unsigned 32-bit indices (cheaper divisions) below 2^32 items, with
// GridStride's clamped steps, else 64-bit.
template <class F>
void with_columns_kernel(int64_t items, const ColumnsLayout& cl, F&& f) {
  auto layout = [&](auto index) {
    if (cl.channel_major) f(index, std::true_type{});
    else f(index, std::false_type{});
  };
  if (items <= int64_t(UINT32_MAX)) layout(uint32_t{});
  else layout(uint64_t{});
}

template <class Bits, class Index, bool kChannelMajor>
__global__ void __launch_bounds__(kLayoutThreads)
    im2col_kernel(const Bits* x, Bits* columns, ConvProblem p, ColumnsLayout cl, Index items) {
  const TensorStrides xs = p.input_strides();
  const Index taps = Index(p.R * p.S), S = Index(p.S), Q = Index(p.Q), pixels = Index(p.P * p.Q);
  const int C = int(p.C);
  const int64_t step = kChannelMajor ? cl.pixels : 1;
  const GridStride<Index> loop(items, blockDim.x, threadIdx.x);
  for (Index idx = loop.first; idx < items; idx = loop.next(idx)) {
    Index tap, n, pixel;
    if (kChannelMajor) {
      pixel = idx % pixels;
      const Index rest = idx / pixels;
      tap = rest % (taps + 1), n = rest / (taps + 1);
    } else {
      tap = idx % (taps + 1);
      const Index row = idx / (taps + 1);
      pixel = row % pixels, n = row / pixels;
    }
    if (tap == taps) {  // the padding columns of this row
      for (int64_t j = int64_t(taps) * C; j < cl.padded; ++j)
        columns[column_at<kChannelMajor>(cl, n, pixel, j)] = 0;
      continue;
    }
    Bits* out = columns + column_at<kChannelMajor>(cl, n, pixel, int64_t(tap) * C);
    const Index q = pixel % Q, pp = pixel / Q;
    const int64_t h = p.input_row(pp, tap / S), w = p.input_col(q, tap % S);
    const bool inside = h >= 0 && h < p.H && w >= 0 && w < p.W;
    const Bits* in = x + (inside ? xs.at(n, 0, h, w) : 0);
    for (int c = 0; c < C; ++c) out[c * step] = inside ? in[c * xs.b] : Bits(0);
  }
}

// dx at (n, c, h, w) = sum over the taps (r, s) that read it of dcolumns[(n, p, q)][(r * S + s)
// * C + c], in tap order: the transpose of im2col as a gather (no atomics, fixed order). One
// thread per input pixel sums its C channels (C <= 8 on this route) over the taps that reach it:
// with dilation 1 those are every stride-th tap from the first, found without a search.
template <class T, class Index, bool kChannelMajor>
__global__ void __launch_bounds__(kLayoutThreads)
    col2im_kernel(const T* dcolumns, T* dx, ConvProblem p, ColumnsLayout cl, Index pixels) {
  constexpr int kMaxC = 8;
  const TensorStrides xs = p.input_strides();
  const Index W = Index(p.W), H = Index(p.H);
  const int C = int(p.C);
  const int64_t step = kChannelMajor ? cl.pixels : 1;
  const GridStride<Index> loop(pixels, blockDim.x, threadIdx.x);
  for (Index idx = loop.first; idx < pixels; idx = loop.next(idx)) {
    const Index w = idx % W, nh = idx / W, h = nh % H, n = nh / H;
    acc_t<T> sum[kMaxC];
    for (int c = 0; c < kMaxC; ++c) sum[c] = 0;
    // Taps r with (h + pad - r * dilation) a multiple of the stride, 0 <= .. / stride < P.
    const int64_t u0 = int64_t(h) + p.pad_top, v0 = int64_t(w) + p.pad_left;
    const int64_t r_step = p.dilation_h == 1 ? p.stride_h : 1;
    const int64_t s_step = p.dilation_w == 1 ? p.stride_w : 1;
    const int64_t r_first = p.dilation_h == 1 ? u0 % p.stride_h : 0;
    const int64_t s_first = p.dilation_w == 1 ? v0 % p.stride_w : 0;
    for (int64_t r = r_first; r < p.R; r += r_step) {
      const int64_t u = u0 - r * p.dilation_h;
      if (u < 0) break;
      if (u % p.stride_h != 0 || u / p.stride_h >= p.P) continue;
      for (int64_t s = s_first; s < p.S; s += s_step) {
        const int64_t v = v0 - s * p.dilation_w;
        if (v < 0) break;
        if (v % p.stride_w != 0 || v / p.stride_w >= p.Q) continue;
        const T* in = dcolumns + column_at<kChannelMajor>(cl, n, u / p.stride_h * p.Q +
                                                          v / p.stride_w, (r * p.S + s) * C);
        for (int c = 0; c < C; ++c) sum[c] += to_acc(in[c * step]);
      }
    }
    for (int c = 0; c < C; ++c) dx[xs.at(n, c, h, w)] = from_acc<T>(sum[c]);
  }
}

template <class Bits>
ffi::Error launch_im2col(cudaStream_t stream, const ConvProblem& p, const void* x, void* columns,
                         const ColumnsLayout& cl) {
  const int64_t items = p.N * p.P * p.Q * (p.R * p.S + 1);
  const unsigned blocks = grid_blocks(items, kLayoutThreads);
  auto* in = static_cast<const Bits*>(x);
  auto* out = static_cast<Bits*>(columns);
  with_columns_kernel(items, cl, [&](auto index, auto channel_major) {
    using Index = decltype(index);
    im2col_kernel<Bits, Index, decltype(channel_major)::value>
        <<<blocks, kLayoutThreads, 0, stream>>>(in, out, p, cl, Index(items));
  });
  return launch_status("conv2d (im2col)");
}

template <class T>
void col2im(cudaStream_t stream, const ConvProblem& p, const void* dcolumns, void* dx,
            const ColumnsLayout& cl) {
  const int64_t pixels = p.N * p.H * p.W;
  const unsigned blocks = grid_blocks(pixels, kLayoutThreads);
  auto* in = static_cast<const T*>(dcolumns);
  auto* out = static_cast<T*>(dx);
  with_columns_kernel(pixels, cl, [&](auto index, auto channel_major) {
    using Index = decltype(index);
    col2im_kernel<T, Index, decltype(channel_major)::value>
        <<<blocks, kLayoutThreads, 0, stream>>>(in, out, p, cl, Index(pixels));
  });
}

ffi::Error launch_col2im(cudaStream_t stream, ConvDtype dtype, const ConvProblem& p,
                         const void* dcolumns, void* dx, const ColumnsLayout& cl) {
  switch (dtype) {
    case ConvDtype::kFloat16: col2im<float16>(stream, p, dcolumns, dx, cl); break;
    case ConvDtype::kBFloat16: col2im<bfloat16>(stream, p, dcolumns, dx, cl); break;
    default: col2im<float>(stream, p, dcolumns, dx, cl); break;
  }
  return launch_status("conv2d (col2im)");
}

// out[k][p] = bias[k]: the bias as a [K x pixels] matrix, the epilogue source of the 1x1 GEMM
// (shared by every image, so it stays in L2).
template <class Bits>
__global__ void __launch_bounds__(kLayoutThreads)
    broadcast_bias_kernel(const Bits* bias, Bits* out, int64_t pixels, int64_t count) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < count; idx += stride)
    out[idx] = bias[idx / pixels];
}

// The bias broadcast to the [K x pixels] matrix the batched GEMM's forward adds (its C operand).
template <class Bits>
ffi::Error launch_bias_matrix(cudaStream_t stream, const void* bias, void* matrix, int64_t K,
                              int64_t pixels) {
  broadcast_bias_kernel<Bits><<<grid_blocks(K * pixels, kLayoutThreads), kLayoutThreads, 0,
                                stream>>>(static_cast<const Bits*>(bias),
                                          static_cast<Bits*>(matrix), pixels, K * pixels);
  return launch_status("conv2d (bias)");
}

// ---- Sampled pixels (plan_sampled) ----------------------------------------------------------------

// out at (n, c, p, q) = x at (n, c, p * stride_h - pad_top, q * stride_w - pad_left), zero
// outside x, both in x's layout, in units V: 16-byte vectors of channels where channels-last
// pixels are whole vectors, else elements. Item idx is unit u of pixel (p, q) of plane i, a plane
// being an image (channels last, `units` per pixel) or one channel of an image (NCHW, one unit
// per pixel): consecutive threads read and write consecutive units, the reads `stride` pixels
// apart along a row.
struct SampleJob {
  int64_t planes, H, W, P, Q, units, stride_h, stride_w, pad_top, pad_left;
};

template <class V, class Index>
__global__ void __launch_bounds__(kLayoutThreads)
    sample_kernel(const V* x, V* out, SampleJob j, Index items) {
  const Index units = Index(j.units), Q = Index(j.Q), P = Index(j.P);
  const GridStride<Index> loop(items, blockDim.x, threadIdx.x);
  for (Index idx = loop.first; idx < items; idx = loop.next(idx)) {
    const Index u = idx % units, pixel = idx / units;
    const Index q = pixel % Q, rest = pixel / Q;
    const Index pp = rest % P, plane = rest / P;
    const int64_t h = int64_t(pp) * j.stride_h - j.pad_top;
    const int64_t w = int64_t(q) * j.stride_w - j.pad_left;
    V v{};
    if (h >= 0 && h < j.H && w >= 0 && w < j.W)
      v = x[((int64_t(plane) * j.H + h) * j.W + w) * j.units + int64_t(u)];
    out[idx] = v;
  }
}

template <class Bits>
ffi::Error launch_sample(cudaStream_t stream, const ConvProblem& p, const void* x, void* out) {
  const bool last = p.layout == ConvLayout::kNHWC;
  SampleJob j{};
  j.planes = last ? p.N : p.N * p.C;
  j.H = p.H, j.W = p.W, j.P = p.P, j.Q = p.Q;
  j.units = last ? p.C : 1;
  j.stride_h = p.stride_h, j.stride_w = p.stride_w, j.pad_top = p.pad_top, j.pad_left = p.pad_left;
  auto launch = [&](auto unit) {
    using V = decltype(unit);
    const int64_t items = j.planes * j.P * j.Q * j.units;
    const unsigned blocks = grid_blocks(items, kLayoutThreads);
    auto* in = static_cast<const V*>(x);
    auto* to = static_cast<V*>(out);
    if (items <= int64_t(UINT32_MAX))
      sample_kernel<V, uint32_t><<<blocks, kLayoutThreads, 0, stream>>>(in, to, j, uint32_t(items));
    else
      sample_kernel<V, uint64_t><<<blocks, kLayoutThreads, 0, stream>>>(in, to, j, uint64_t(items));
  };
  constexpr int64_t kPerVector = 16 / int64_t(sizeof(Bits));
  if (last && p.C % kPerVector == 0 && aligned_to(x, 16) && aligned_to(out, 16)) {
    j.units = p.C / kPerVector;
    launch(uint4{});
  } else {
    launch(Bits{});
  }
  return launch_status("conv2d (sampled pixels)");
}

char* region(char* base, const Plan& plan, int i) { return base + plan.offset[i]; }

// ---- Running the routes -----------------------------------------------------------------------

// Each route runs the steps of implicit_gemm.h's ImplicitGemmStep that are set in `steps` (all of them
// for implicit_gemm_conv2d), in order; a step left out is skipped and nothing else changes.
bool has(unsigned steps, ImplicitGemmStep step) { return (steps & step) != 0; }

template <class Bits>
ffi::Error run_gemm_route(cudaStream_t stream, const ConvQuery& query, const Plan& plan,
                          const void* a, const void* b, const void* bias, void* out, char* base,
                          unsigned steps) {
  const ConvProblem& p = query.problem;
  const int64_t pixels = p.H * p.W;
  BatchedGemm g = plan.gemm;
  switch (query.pass) {
    case ConvPass::kForward: {
      g.a = b, g.b = a, g.d = out;
      if (bias != nullptr) {
        Bits* matrix = reinterpret_cast<Bits*>(region(base, plan, 0));
        if (has(steps, kImplicitGemmLayoutIn))
          if (ffi::Error e = launch_bias_matrix<Bits>(stream, bias, matrix, p.K, pixels);
              e.failure())
            return e;
        g.c = matrix;
      }
      return has(steps, kImplicitGemmCutlass) ? run(plan.math, g, stream) : ffi::Error::Success();
    }
    case ConvPass::kBackwardData:
      g.a = b, g.b = a, g.d = out;
      return has(steps, kImplicitGemmCutlass) ? run(plan.math, g, stream) : ffi::Error::Success();
    case ConvPass::kBackwardWeight:
    default: {
      float* partials = reinterpret_cast<float*>(region(base, plan, 0));
      g.a = a, g.b = b, g.d = partials;
      if (has(steps, kImplicitGemmCutlass))
        if (ffi::Error e = run(plan.math, g, stream); e.failure()) return e;
      if (!has(steps, kImplicitGemmLayoutOut)) return ffi::Error::Success();
      WgradReduction r{};
      r.Kg = p.K, r.Cg = r.Cgp = p.C, r.R = r.S = 1;
      r.quads = p.K * ceil_div(p.C, 4);
      r.slices = p.N, r.slice_stride = p.K * p.C, r.group_stride = 0;
      return launch_wgrad_reduce(stream, query.dtype, partials, out, r);
    }
  }
}

#if defined(JAX_KERNELS_HAVE_SM90_CONV)
// A strided dgrad's stride phases on Hopper (plan.phase_dgrad), the steps run_nhwc_route's dgrad
// runs in place of the weight transform and the Sm80 kernel: the phases' filters from the
// weights w into `filters`; then one fprop per phase over the NHWC dy, each writing its pixels
// of the NHWC dx, and zeros to the pixels no tap reaches, spread over XLA's stream and side
// streams forked off it (common/side_streams.h): each launch's last wave leaves most
// multiprocessors idle, and the others fill them (H200, run 26: f32 3x3/2 128->128 NHWC in-jit
// 67.5 -> 50.0 us a call, bf16 47.1 -> 35.3; the zeros beside the 1x1/2 phase 73.6 -> 69.0).
template <class Bits>
ffi::Error launch_phase_filters(cudaStream_t stream, const ConvProblem& p, const Plan& plan,
                                const void* w, char* filters) {
  dgrad_phases::WeightsJob<Bits> job{};
  job.w = static_cast<const Bits*>(w), job.out = reinterpret_cast<Bits*>(filters);
  job.K = plan.Kg, job.C = plan.Cg, job.R = p.R, job.S = p.S, job.Kp = plan.Kgp, job.Cp = plan.Cgp;
  job.stride_h = int(p.stride_h), job.stride_w = int(p.stride_w);
  job.hwio = p.layout == ConvLayout::kNHWC, job.phases = plan.phases;
  return dgrad_phases::launch_weights(stream, job);
}

// The number of streams the phases are spread over (run_on_lanes): 4 unless
// JAX_KERNELS_PHASE_STREAMS says otherwise (1: in order on XLA's stream; kept for A/B
// measurements, read at every call). Any count gives the same bits: the phases write disjoint
// pixels.
int phase_lanes() {
  return knob_count("JAX_KERNELS_PHASE_STREAMS", 4);
}

ffi::Error run_phases(cudaStream_t stream, const ConvProblem& p, const Plan& plan,
                      const void* dy, const char* filters, char* dx) {
  const int64_t eb = plan.element_bytes, pixel_bytes = plan.Cgp * eb;
  // The pixels no tap reaches: zero_kernel, beside the phases (the last job), where it can write
  // dx; else one memset of all of dx before them.
  const bool zeros = plan.phases.zero_fill && dgrad_phases::zero_kernel_fits(dx, pixel_bytes);
  if (plan.phases.zero_fill && !zeros &&
      cudaMemsetAsync(dx, 0, size_t(p.N * p.H * p.W * pixel_bytes), stream) != cudaSuccess)
    return launch_status("conv2d (strided dgrad's zeroed phases)");
  // Launched largest first (most taps), so that the smaller ones fill its tail.
  int order[dgrad_phases::kMaxPhases];
  const int count = plan.phases.count;
  for (int i = 0; i < count; ++i) order[i] = i;
  const auto taps = [&](int i) {
    const dgrad_phases::Phase& f = plan.phases.phase[i];
    return f.taps_h * f.taps_w * f.cols;
  };
  std::stable_sort(order, order + count, [&](int i, int j) { return taps(i) > taps(j); });
  return run_on_lanes("conv2d (strided dgrad's phases)", stream, count + zeros, phase_lanes(),
                      [&](int i, cudaStream_t on) {
                        if (i == count)
                          return dgrad_phases::launch_zeros(
                              on, plan.phases, dx, p.N, p.H, p.W, pixel_bytes, int(p.stride_h),
                              int(p.stride_w), multiprocessor_count());
                        const dgrad_phases::Phase& f = plan.phases.phase[order[i]];
                        NhwcConv c = phase_conv(p, plan, f);
                        c.a = dy;
                        c.b = filters + f.w_offset * eb;
                        c.c = nullptr;
                        c.d = dx + (int64_t(f.a) * p.W + f.b) * plan.Cgp * eb;
                        return run(plan.math, c, on);
                      });
}
#endif

template <class Bits>
ffi::Error run_nhwc_route(cudaStream_t stream, const ConvQuery& query, const Plan& plan,
                          const void* a, const void* b, const void* bias, void* out, char* base,
                          unsigned steps) {
  const ConvProblem& p = query.problem;
  const int64_t G = plan.groups, Cg = plan.Cg, Kg = plan.Kg, Cgp = plan.Cgp, Kgp = plan.Kgp;
  const int64_t eb = plan.element_bytes;
  const int64_t input_pixels = p.H * p.W, output_pixels = p.P * p.Q;
  const int64_t x_group = p.N * input_pixels * Cgp * eb, y_group = p.N * output_pixels * Kgp * eb;
  const int64_t w_group = Kgp * p.R * p.S * Cgp * eb;
  NhwcConv c = plan.conv;
  // The NCHW epilogue stores 16-byte vectors: an output not aligned to them goes through the
  // NHWC region (which the scratch keeps) and the transpose.
  if (c.d_nchw && reinterpret_cast<uintptr_t>(out) % 16 != 0) c.d_nchw = false;

  // Channels last: the tensors are used in place where plan_nhwc allowed it, else repacked.
  const bool hwio = p.layout == ConvLayout::kNHWC, in_place = plan.in_place;
  WeightJob<Bits> weights{};
  weights.w = static_cast<const Bits*>(b);
  weights.Kg = Kg, weights.Cg = Cg, weights.R = p.R, weights.S = p.S;
  weights.Kgp = Kgp, weights.Cgp = Cgp;
  weights.hwio = hwio, weights.groups = G;
  const int64_t input_rows = p.N * input_pixels, output_rows = p.N * output_pixels;
  weights.weight_count = G * Kgp * p.R * p.S * Cgp;

  switch (query.pass) {
    case ConvPass::kForward: {
      char* x_nhwc = region(base, plan, 0);
      char* w_krsc = region(base, plan, 1);
      char* bias_padded = region(base, plan, 2);
      char* y_nhwc = region(base, plan, 3);
      weights.out = reinterpret_cast<Bits*>(w_krsc);
      if (bias != nullptr) {
        weights.bias = static_cast<const Bits*>(bias);
        weights.bias_out = reinterpret_cast<Bits*>(bias_padded);
        weights.bias_count = G * Kgp;
      }
      if (has(steps, kImplicitGemmLayoutIn)) {
        ffi::Error e =
            in_place ? launch_layout<Bits>(stream, {}, &weights)
            : hwio   ? launch_layout<Bits>(stream, {}, &weights,
                                           {repack_job<Bits>(a, x_nhwc, input_rows, G, Cg, Cgp, true)})
                     : launch_layout<Bits>(
                           stream, {to_nhwc<Bits>(a, x_nhwc, p.N, G, Cg, input_pixels, Cgp)},
                           &weights);
        if (e.failure()) return e;
      }
      for (int64_t g = 0; g < G && has(steps, kImplicitGemmCutlass); ++g) {
        c.a = in_place ? a : x_nhwc + g * x_group;
        c.b = w_krsc + g * w_group;
        c.c = bias != nullptr ? bias_padded + g * Kgp * eb : nullptr;
        c.d = in_place || c.d_nchw ? out : y_nhwc + g * y_group;
        if (ffi::Error e = run(plan.math, c, stream); e.failure()) return e;
      }
      if (in_place || c.d_nchw || !has(steps, kImplicitGemmLayoutOut))
        return ffi::Error::Success();
      if (hwio)
        return launch_layout<Bits>(stream, {}, nullptr,
                                   {repack_job<Bits>(y_nhwc, out, output_rows, G, Kg, Kgp, false)});
      return launch_layout<Bits>(stream,
                                 {to_nchw<Bits>(y_nhwc, out, p.N, G, output_pixels, Kg, Kgp)});
    }
    case ConvPass::kBackwardData: {
      char* dy_nhwc = region(base, plan, 0);
      char* w_t = region(base, plan, 1);
      char* dx_nhwc = region(base, plan, 2);
      weights.out = reinterpret_cast<Bits*>(w_t);
      weights.flip = plan.dgrad_as_fprop;
      // On Hopper a strided dgrad of one group may run by stride phase (plan.phase_dgrad): the
      // phases' filters replace the weight transform, their fprops the Sm80 kernel.
      bool phases = false;
#if defined(JAX_KERNELS_HAVE_SM90_CONV)
      phases = plan.phase_dgrad && hopper_kernels();
#endif
      const WeightJob<Bits>* transform = phases ? nullptr : &weights;
      if (has(steps, kImplicitGemmLayoutIn)) {
        ffi::Error e =
            in_place ? launch_layout<Bits>(stream, {}, transform)
            : hwio   ? launch_layout<Bits>(stream, {}, transform,
                                           {repack_job<Bits>(a, dy_nhwc, output_rows, G, Kg, Kgp, true)})
                     : launch_layout<Bits>(
                           stream, {to_nhwc<Bits>(a, dy_nhwc, p.N, G, Kg, output_pixels, Kgp)},
                           transform);
#if defined(JAX_KERNELS_HAVE_SM90_CONV)
        if (e.success() && phases) e = launch_phase_filters<Bits>(stream, p, plan, b, w_t);
#endif
        if (e.failure()) return e;
      }
#if defined(JAX_KERNELS_HAVE_SM90_CONV)
      if (phases && has(steps, kImplicitGemmCutlass))
        if (ffi::Error e = run_phases(stream, p, plan, in_place ? a : dy_nhwc, w_t,
                                      in_place ? static_cast<char*>(out) : dx_nhwc);
            e.failure())
          return e;
#endif
      for (int64_t g = 0; g < G && !phases && has(steps, kImplicitGemmCutlass); ++g) {
        c.a = in_place ? a : dy_nhwc + g * y_group;
        c.b = w_t + g * w_group;
        c.d = in_place || c.d_nchw ? out : dx_nhwc + g * x_group;
        if (ffi::Error e = run(plan.math, c, stream); e.failure()) return e;
      }
      if (in_place || c.d_nchw || !has(steps, kImplicitGemmLayoutOut))
        return ffi::Error::Success();
      if (hwio)
        return launch_layout<Bits>(stream, {}, nullptr,
                                   {repack_job<Bits>(dx_nhwc, out, input_rows, G, Cg, Cgp, false)});
      return launch_layout<Bits>(stream,
                                 {to_nchw<Bits>(dx_nhwc, out, p.N, G, input_pixels, Cg, Cgp)});
    }
    case ConvPass::kBackwardWeight:
    default: {
      char* dy_nhwc = region(base, plan, 0);
      char* x_nhwc = region(base, plan, 1);
      float* partials = reinterpret_cast<float*>(region(base, plan, 2));
      const int64_t partial_size = Kgp * p.R * p.S * Cgp;
      // The kernels' split and partials' order, which the reduction below follows.
      int64_t slices = c.split_k;
      WgradOrder order = c.wgrad_order;
      bool batch_inner = false, pointwise = false;
#if defined(JAX_KERNELS_HAVE_SM90_CONV)
      batch_inner = plan.batch_inner && hopper_kernels();
      if (batch_inner) {
        // The TF32 wgrad over batch-innermost copies (one group): each tensor, NCHW or NHWC, is
        // one [N][rest] matrix transposed to [rest][Nb] (zero images past N), one launch for
        // both.
        BatchInnerWgrad w = plan.batch_inner_wgrad;
        w.dy = dy_nhwc, w.x = x_nhwc, w.partials = partials;
        if (has(steps, kImplicitGemmLayoutIn)) {
          ffi::Error e = launch_layout<Bits>(
              stream, {to_nhwc<Bits>(a, dy_nhwc, 1, 1, p.N, p.K * output_pixels, w.Nb),
                       to_nhwc<Bits>(b, x_nhwc, 1, 1, p.N, p.C * input_pixels, w.Nb)});
          if (e.failure()) return e;
        }
        if (has(steps, kImplicitGemmCutlass)) {
          if (ffi::Error e = implicit_gemm::sm90_tf32_wgrad_run(w, stream); e.failure()) return e;
        }
        slices = w.split, order = w.order;
      }
      // A 1x1 channels-last wgrad on Hopper: the pointwise wgrad GEMM over equal slices of the
      // pixels (plan_pointwise_wgrad) in place of the Sm80 kernel (TF32, and half types whose
      // channels the Hopper half wgrad's 64-wide tiles do not divide: bf16 96->384 at N32 56^2
      // took 0.034 ms against 0.076, run 30), unless JAX_KERNELS_CONV_POINTWISE_WGRAD=0 (kept
      // for A/B measurements) or it refuses the pointers; its partials are in HWIO order.
      if (!batch_inner && plan.pointwise_wgrad_slices > 0 && !c.sm90 && hopper_kernels() &&
          !knob_off("JAX_KERNELS_CONV_POINTWISE_WGRAD")) {
        NhwcConv pw = c;
        pw.sm90 = true;
        pw.split_k = int(plan.pointwise_wgrad_slices);
        pw.wgrad_order = WgradOrder::kRSCK;
        pw.a = a, pw.b = b, pw.d = partials;
        if (pointwise_wgrad_can_implement(plan.math, pw)) {
          pointwise = true;
          if (has(steps, kImplicitGemmCutlass))
            if (ffi::Error e = pointwise_wgrad_run(plan.math, pw, stream); e.failure()) return e;
          slices = pw.split_k, order = WgradOrder::kRSCK;
        }
      }
#endif
      if (!batch_inner && !pointwise) {
        if (has(steps, kImplicitGemmLayoutIn) && !in_place) {
          ffi::Error e =
              hwio ? launch_layout<Bits>(
                         stream, {}, nullptr,
                         {repack_job<Bits>(a, dy_nhwc, output_rows, G, Kg, Kgp, true),
                          repack_job<Bits>(b, x_nhwc, input_rows, G, Cg, Cgp, true)})
                   : launch_layout<Bits>(
                         stream, {to_nhwc<Bits>(a, dy_nhwc, p.N, G, Kg, output_pixels, Kgp),
                                  to_nhwc<Bits>(b, x_nhwc, p.N, G, Cg, input_pixels, Cgp)});
          if (e.failure()) return e;
        }
        for (int64_t g = 0; g < G && has(steps, kImplicitGemmCutlass); ++g) {
          c.a = in_place ? a : dy_nhwc + g * y_group;
          c.b = in_place ? b : x_nhwc + g * x_group;
          c.d = partials + g * c.split_k * partial_size;
          if (ffi::Error e = run(plan.math, c, stream); e.failure()) return e;
        }
      }
      if (!has(steps, kImplicitGemmLayoutOut)) return ffi::Error::Success();
      if (order != WgradOrder::kKRSC) {
        OrderedReduction r{};
        r.Kg = Kg, r.Cg = Cg, r.R = p.R, r.S = p.S, r.Kgp = Kgp, r.Cgp = Cgp, r.groups = G;
        r.slices = slices, r.slice_stride = partial_size, r.group_stride = slices * partial_size;
        return launch_wgrad_sum(stream, query.dtype, partials, out, r);
      }
      WgradReduction r{};
      r.Kg = Kg, r.Cg = Cg, r.R = p.R, r.S = p.S, r.Cgp = Cgp;
      r.hwio = hwio, r.groups = G;
      r.quads = G * Kg * p.R * p.S * ceil_div(Cg, 4);
      r.slices = slices, r.slice_stride = partial_size, r.group_stride = slices * partial_size;
      return launch_wgrad_reduce(stream, query.dtype, partials, out, r);
    }
  }
}

// The im2col route's weights as the 1x1 problem's [Kp][Cp] (its columns in im2col order).
template <class Bits>
WeightJob<Bits> im2col_weights(const ConvProblem& p, const Plan& plan, const void* w) {
  WeightJob<Bits> weights{};
  weights.w = static_cast<const Bits*>(w);
  weights.Kg = p.K, weights.Cg = plan.columns, weights.R = weights.S = 1;
  weights.Kgp = plan.Kgp, weights.Cgp = plan.columns_padded;
  weights.hwio = p.layout == ConvLayout::kNHWC, weights.groups = 1;
  weights.flat_R = p.R, weights.flat_S = p.S, weights.flat_C = p.C;
  weights.weight_count = plan.Kgp * plan.columns_padded;
  return weights;
}

// The im2col route's wgrad reduction: `slices` float32 partials [K][Cp] (`slice_stride` apart)
// added in order into the weights' own taps.
WgradReduction im2col_reduction(const ConvProblem& p, const Plan& plan, int64_t slices,
                                int64_t slice_stride) {
  WgradReduction r{};
  r.Kg = p.K, r.Cg = plan.columns, r.R = r.S = 1, r.Cgp = plan.columns_padded;
  r.hwio = p.layout == ConvLayout::kNHWC, r.groups = 1;
  r.flat_R = p.R, r.flat_S = p.S, r.flat_C = p.C;
  r.quads = p.K * ceil_div(plan.columns, 4);
  r.slices = slices, r.slice_stride = slice_stride, r.group_stride = 0;
  return r;
}

// The im2col route through the batched GEMM on NCHW tensors (plan_im2col_gemm): channel-major
// columns in, y and dy read and written in place, dx back through col2im, dw through the
// per-image partials' reduction.
template <class Bits>
ffi::Error run_im2col_gemm_route(cudaStream_t stream, const ConvQuery& query, const Plan& plan,
                                 const void* a, const void* b, const void* bias, void* out,
                                 char* base, unsigned steps) {
  const ConvProblem& p = query.problem;
  const int64_t Cp = plan.columns_padded, pixels = p.P * p.Q;
  const ColumnsLayout cl{Cp, pixels, true};
  BatchedGemm g = plan.gemm;
  WeightJob<Bits> weights = im2col_weights<Bits>(p, plan, b);
  switch (query.pass) {
    case ConvPass::kForward: {
      char* columns = region(base, plan, 0);
      weights.out = reinterpret_cast<Bits*>(region(base, plan, 1));
      Bits* bias_matrix = reinterpret_cast<Bits*>(region(base, plan, 2));
      if (has(steps, kImplicitGemmLayoutIn)) {
        if (ffi::Error e = launch_layout<Bits>(stream, {}, &weights); e.failure()) return e;
        if (ffi::Error e = launch_im2col<Bits>(stream, p, a, columns, cl); e.failure()) return e;
        if (bias != nullptr)
          if (ffi::Error e = launch_bias_matrix<Bits>(stream, bias, bias_matrix, p.K, pixels);
              e.failure())
            return e;
      }
      g.a = weights.out, g.b = columns, g.d = out;
      g.c = bias != nullptr ? bias_matrix : nullptr;
      return has(steps, kImplicitGemmCutlass) ? run(plan.math, g, stream) : ffi::Error::Success();
    }
    case ConvPass::kBackwardData: {
      weights.out = reinterpret_cast<Bits*>(region(base, plan, 0));
      char* dcolumns = region(base, plan, 1);
      if (has(steps, kImplicitGemmLayoutIn))
        if (ffi::Error e = launch_layout<Bits>(stream, {}, &weights); e.failure()) return e;
      g.a = weights.out, g.b = a, g.d = dcolumns;
      if (has(steps, kImplicitGemmCutlass))
        if (ffi::Error e = run(plan.math, g, stream); e.failure()) return e;
      if (!has(steps, kImplicitGemmLayoutOut)) return ffi::Error::Success();
      return launch_col2im(stream, query.dtype, p, dcolumns, out, cl);
    }
    case ConvPass::kBackwardWeight:
    default: {
      char* columns = region(base, plan, 0);
      float* partials = reinterpret_cast<float*>(region(base, plan, 1));
      if (has(steps, kImplicitGemmLayoutIn))
        if (ffi::Error e = launch_im2col<Bits>(stream, p, b, columns, cl); e.failure()) return e;
      g.a = a, g.b = columns, g.d = partials;
      if (has(steps, kImplicitGemmCutlass))
        if (ffi::Error e = run(plan.math, g, stream); e.failure()) return e;
      if (!has(steps, kImplicitGemmLayoutOut)) return ffi::Error::Success();
      return launch_wgrad_reduce(stream, query.dtype, partials, out,
                                 im2col_reduction(p, plan, p.N, p.K * Cp));
    }
  }
}

// The im2col route: columns in (im2col of x; dy to [rows][Kp] unless used in place), the 1x1
// problem on the tensor cores, then y out (unless in place), dx back through col2im, or dw
// through the split-K reduction (NCHW through the batched GEMM: run_im2col_gemm_route).
template <class Bits>
ffi::Error run_im2col_route(cudaStream_t stream, const ConvQuery& query, const Plan& plan,
                            const void* a, const void* b, const void* bias, void* out, char* base,
                            unsigned steps) {
  if (plan.channel_major)
    return run_im2col_gemm_route<Bits>(stream, query, plan, a, b, bias, out, base, steps);
  const ConvProblem& p = query.problem;
  const bool hwio = p.layout == ConvLayout::kNHWC;
  const int64_t Kp = plan.Kgp, Cp = plan.columns_padded, rows = p.N * p.P * p.Q;
  const ColumnsLayout cl{Cp, p.P * p.Q, false};
  NhwcConv c = plan.conv;
  WeightJob<Bits> weights = im2col_weights<Bits>(p, plan, b);
  // dy (dgrad, wgrad) as [rows][Kp]: in place when channels last and aligned, else copied.
  auto dy_rows = [&](char* region) -> ffi::Error {
    if (plan.y_in_place) return ffi::Error::Success();
    return hwio ? launch_layout<Bits>(stream, {}, nullptr,
                                      {repack_job<Bits>(a, region, rows, 1, p.K, Kp, true)})
                : launch_layout<Bits>(stream,
                                      {to_nhwc<Bits>(a, region, p.N, 1, p.K, p.P * p.Q, Kp)});
  };
  switch (query.pass) {
    case ConvPass::kForward: {
      char* columns = region(base, plan, 0);
      char* bias_padded = region(base, plan, 2);
      char* y_rows = plan.y_in_place ? static_cast<char*>(out) : region(base, plan, 3);
      weights.out = reinterpret_cast<Bits*>(region(base, plan, 1));
      if (bias != nullptr) {
        weights.bias = static_cast<const Bits*>(bias);
        weights.bias_out = reinterpret_cast<Bits*>(bias_padded);
        weights.bias_count = Kp;
      }
      if (has(steps, kImplicitGemmLayoutIn)) {
        if (ffi::Error e = launch_layout<Bits>(stream, {}, &weights); e.failure()) return e;
        if (ffi::Error e = launch_im2col<Bits>(stream, p, a, columns, cl); e.failure()) return e;
      }
      if (has(steps, kImplicitGemmCutlass)) {
        c.a = columns, c.b = weights.out, c.d = y_rows;
        c.c = bias != nullptr ? bias_padded : nullptr;
        if (ffi::Error e = run(plan.math, c, stream); e.failure()) return e;
      }
      if (plan.y_in_place || !has(steps, kImplicitGemmLayoutOut)) return ffi::Error::Success();
      return hwio ? launch_layout<Bits>(stream, {}, nullptr,
                                        {repack_job<Bits>(y_rows, out, rows, 1, p.K, Kp, false)})
                  : launch_layout<Bits>(stream,
                                        {to_nchw<Bits>(y_rows, out, p.N, 1, p.P * p.Q, p.K, Kp)});
    }
    case ConvPass::kBackwardData: {
      char* dy = plan.y_in_place ? const_cast<char*>(static_cast<const char*>(a))
                                 : region(base, plan, 0);
      char* dcolumns = region(base, plan, 2);
      weights.out = reinterpret_cast<Bits*>(region(base, plan, 1));
      weights.flip = true;  // [Cp][Kp]: the transpose (R = S = 1, nothing to flip)
      if (has(steps, kImplicitGemmLayoutIn)) {
        if (ffi::Error e = launch_layout<Bits>(stream, {}, &weights); e.failure()) return e;
        if (ffi::Error e = dy_rows(dy); e.failure()) return e;
      }
      if (has(steps, kImplicitGemmCutlass)) {
        c.a = dy, c.b = weights.out, c.d = dcolumns;
        if (ffi::Error e = run(plan.math, c, stream); e.failure()) return e;
      }
      if (!has(steps, kImplicitGemmLayoutOut)) return ffi::Error::Success();
      return launch_col2im(stream, query.dtype, p, dcolumns, out, cl);
    }
    case ConvPass::kBackwardWeight:
    default: {
      char* dy = plan.y_in_place ? const_cast<char*>(static_cast<const char*>(a))
                                 : region(base, plan, 0);
      char* columns = region(base, plan, 1);
      float* partials = reinterpret_cast<float*>(region(base, plan, 2));
      if (has(steps, kImplicitGemmLayoutIn)) {
        if (ffi::Error e = dy_rows(dy); e.failure()) return e;
        if (ffi::Error e = launch_im2col<Bits>(stream, p, b, columns, cl); e.failure()) return e;
      }
      if (has(steps, kImplicitGemmCutlass)) {
        c.a = dy, c.b = columns, c.d = partials;
        if (ffi::Error e = run(plan.math, c, stream); e.failure()) return e;
      }
      if (!has(steps, kImplicitGemmLayoutOut)) return ffi::Error::Success();
      return launch_wgrad_reduce(stream, query.dtype, partials, out,
                                 im2col_reduction(p, plan, c.split_k, Kp * Cp));
    }
  }
}

template <class Bits>
ffi::Error run_plan(cudaStream_t stream, const ConvQuery& query, const Plan& plan, const void* a,
                    const void* b, const void* bias, void* out, char* base, unsigned steps) {
  switch (plan.route) {
    case Route::kGemm: return run_gemm_route<Bits>(stream, query, plan, a, b, bias, out, base, steps);
    case Route::kIm2col:
      return run_im2col_route<Bits>(stream, query, plan, a, b, bias, out, base, steps);
    default: return run_nhwc_route<Bits>(stream, query, plan, a, b, bias, out, base, steps);
  }
}

}  // namespace

int64_t implicit_gemm_scratch_bytes(const ConvQuery& query) {
  const Plan plan = make_plan(query);
  return plan.route == Route::kDecline ? -1 : plan.bytes;
}

ffi::Error implicit_gemm_conv2d(cudaStream_t stream, const ConvQuery& query, const void* a,
                                const void* b, const void* bias, void* out, void* scratch,
                                int64_t scratch_bytes) {
  return implicit_gemm_steps(stream, query, a, b, bias, out, scratch, scratch_bytes,
                             kImplicitGemmAllSteps);
}

ffi::Error implicit_gemm_steps(cudaStream_t stream, const ConvQuery& query, const void* a,
                               const void* b, const void* bias, void* out, void* scratch,
                               int64_t scratch_bytes, unsigned steps) {
  const Plan plan = make_plan(query);
  if (plan.route == Route::kDecline)
    return ffi::Error::InvalidArgument(
        "conv2d: the tensor-core path does not take this problem (its scratch query declined it)");
  if (scratch_bytes < plan.bytes || (plan.bytes > 0 && scratch == nullptr))
    return ffi::Error::InvalidArgument("conv2d: tensor-core path got " +
                                       std::to_string(scratch_bytes) + " scratch bytes, needs " +
                                       std::to_string(plan.bytes));
  char* base = aligned_scratch(scratch);
  if (plan.sampled_offset >= 0) {
    // x's sampled pixels (x is a for the forward, b for wgrad), then the unit-stride plan over
    // them.
    char* sampled = base + plan.sampled_offset;
    const bool forward = query.pass == ConvPass::kForward;
    if (has(steps, kImplicitGemmLayoutIn)) {
      const void* x = forward ? a : b;
      ffi::Error e = plan.element_bytes == 2
                         ? launch_sample<uint16_t>(stream, query.problem, x, sampled)
                         : launch_sample<uint32_t>(stream, query.problem, x, sampled);
      if (e.failure()) return e;
    }
    const ConvQuery sub = sampled_query(query);
    if (forward) a = sampled;
    else b = sampled;
    if (plan.element_bytes == 2)
      return run_plan<uint16_t>(stream, sub, plan, a, b, bias, out, base, steps);
    return run_plan<uint32_t>(stream, sub, plan, a, b, bias, out, base, steps);
  }
  if (plan.element_bytes == 2)
    return run_plan<uint16_t>(stream, query, plan, a, b, bias, out, base, steps);
  return run_plan<uint32_t>(stream, query, plan, a, b, bias, out, base, steps);
}

namespace {

bool layout_info(const ConvQuery& query, const Plan& plan, bool with_bias,
                 ImplicitGemmLayoutInfo* info);

}  // namespace

bool implicit_gemm_layout_info(const ConvQuery& query, bool with_bias,
                               ImplicitGemmLayoutInfo* info) {
  const Plan plan = make_plan(query);
  if (plan.route == Route::kDecline) return false;
  if (plan.sampled_offset < 0) return layout_info(query, plan, with_bias, info);
  // The gather of x's sampled pixels, then the unit-stride plan's passes.
  if (!layout_info(sampled_query(query), plan, with_bias, info)) return false;
  const ConvProblem& p = query.problem;
  info->in_launches += 1;
  info->in_bytes += 2 * p.N * p.C * p.P * p.Q * plan.element_bytes;
  std::string what = "sampled pixels of x";
  if (info->in_what[0] != 0) what += std::string(" + ") + info->in_what;
  std::snprintf(info->in_what, sizeof info->in_what, "%s", what.c_str());
  return true;
}

namespace {

bool layout_info(const ConvQuery& query, const Plan& plan, bool with_bias,
                 ImplicitGemmLayoutInfo* info) {
  *info = ImplicitGemmLayoutInfo{};
  const ConvProblem& p = query.problem;
  const int64_t eb = plan.element_bytes;
  const int64_t x_count = p.N * p.C * p.H * p.W, y_count = p.N * p.K * p.P * p.Q;
  const int64_t w_count = p.K * (p.C / p.groups) * p.R * p.S;
  auto say = [](char (&what)[64], const std::string& text) {
    std::snprintf(what, sizeof what, "%s", text.c_str());
  };
  info->nhwc_route = plan.route == Route::kNhwc;
  info->sm90 = plan.route != Route::kGemm && !plan.channel_major && plan.conv.sm90;
  if (plan.route == Route::kIm2col && plan.channel_major) {  // NCHW through the batched GEMM
    const int64_t columns = p.N * p.P * p.Q * plan.columns_padded;
    const int64_t w_padded = p.K * plan.columns_padded;
    switch (query.pass) {
      case ConvPass::kForward:
        info->in_launches = with_bias ? 3 : 2;
        info->in_bytes = (x_count + columns + w_count + w_padded) * eb;
        if (with_bias) info->in_bytes += (p.K + p.K * p.P * p.Q) * eb;
        say(info->in_what, with_bias ? "weights + im2col of x + bias broadcast" : "weights + im2col of x");
        break;
      case ConvPass::kBackwardData:
        info->in_launches = info->out_launches = 1;
        info->in_bytes = (w_count + w_padded) * eb;
        info->out_bytes = (columns + x_count) * eb;
        say(info->in_what, "weights");
        say(info->out_what, "col2im of dcolumns");
        break;
      case ConvPass::kBackwardWeight:
      default:
        info->in_launches = info->out_launches = 1;
        info->in_bytes = (x_count + columns) * eb;
        info->out_bytes = p.N * p.K * plan.columns_padded * 4 + w_count * eb;
        say(info->in_what, "im2col of x");
        say(info->out_what, "reduction of " + std::to_string(p.N) + " per-image partials");
        break;
    }
    return true;
  }
  if (plan.route == Route::kIm2col) {  // columns in (and dy unless in place), y/dx/dw out
    const int64_t columns = p.N * p.P * p.Q * plan.columns_padded;
    const int64_t dy_copy = plan.y_in_place ? 0 : y_count + p.N * p.P * p.Q * plan.Kgp;
    info->in_launches = info->out_launches = 1;
    switch (query.pass) {
      case ConvPass::kForward:
        info->in_launches = 2;  // the weights, then im2col
        info->in_bytes = (x_count + columns + 2 * w_count) * eb;
        info->out_bytes = plan.y_in_place ? 0 : (y_count + p.N * p.P * p.Q * plan.Kgp) * eb;
        info->out_launches = plan.y_in_place ? 0 : 1;
        say(info->in_what, "im2col of x + weights");
        say(info->out_what, "y unpacked");
        break;
      case ConvPass::kBackwardData:
        info->in_bytes = (dy_copy + 2 * w_count) * eb;
        info->out_bytes = (columns + x_count) * eb;
        say(info->in_what, "dy rows + weights");
        say(info->out_what, "col2im of dcolumns");
        break;
      case ConvPass::kBackwardWeight:
      default:
        info->in_bytes = (dy_copy + x_count + columns) * eb;
        info->out_bytes = plan.conv.split_k * plan.Kgp * plan.columns_padded * 4 + w_count * eb;
        say(info->in_what, "dy rows + im2col of x");
        say(info->out_what, "reduction of split-K partials");
        break;
    }
    return true;
  }
  if (plan.route == Route::kGemm) {
    if (query.pass == ConvPass::kForward && with_bias) {
      info->in_launches = 1;
      info->in_bytes = p.K * eb + p.K * p.H * p.W * eb;
      say(info->in_what, "bias broadcast to [K x HW]");
    }
    if (query.pass == ConvPass::kBackwardWeight) {
      info->out_launches = 1;
      info->out_bytes = p.N * p.K * p.C * 4 + w_count * eb;
      say(info->out_what, "reduction of " + std::to_string(p.N) + " per-image partials");
    }
    return true;
  }
  // NHWC route: the transposes read the valid channels and write the padded ones; the weight
  // transform writes the padded [G][Kgp][R][S][Cgp] (or its flipped transpose).
  const int64_t G = plan.groups, Kgp = plan.Kgp, Cgp = plan.Cgp;
  if (plan.batch_inner && hopper_kernels()) {  // the Hopper TF32 wgrad's batch-innermost copies
    const BatchInnerWgrad& w = plan.batch_inner_wgrad;
    info->sm90 = true;
    info->in_launches = info->out_launches = 1;
    info->in_bytes = (x_count + y_count + w.Nb * (p.C * p.H * p.W + p.K * p.P * p.Q)) * eb;
    info->out_bytes = w.split * Kgp * p.R * p.S * Cgp * 4 + w_count * eb;
    say(info->in_what, "dy and x to batch innermost");
    say(info->out_what, "reduction of split-K partials");
    return true;
  }
  const bool phases = plan.phase_dgrad && hopper_kernels();  // dy and the filters apart
  if (phases) info->sm90 = true;
  if (plan.in_place) {  // channels last in place: the weights in, wgrad's reduction out
    info->in_launches = query.pass == ConvPass::kBackwardWeight ? 0 : 1;
    info->in_bytes = info->in_launches * 2 * w_count * eb;
    if (query.pass == ConvPass::kForward && with_bias) info->in_bytes += 2 * p.K * eb;
    say(info->in_what, !info->in_launches ? ""
                       : phases           ? "filters by stride phase (HWIO to the kernel's)"
                                          : "weights (HWIO to the kernel's)");
    if (query.pass == ConvPass::kBackwardWeight) {
      info->out_launches = 1;
      info->out_bytes = plan.conv.split_k * w_count * 4 + w_count * eb;
      say(info->out_what, "reduction of " + std::to_string(plan.conv.split_k) +
                              " split-K partials into HWIO");
    }
    return true;
  }
  const bool last = p.layout == ConvLayout::kNHWC;  // repacked channels last, else NCHW
  const int64_t x_nhwc = G * p.N * p.H * p.W * Cgp, y_nhwc = G * p.N * p.P * p.Q * Kgp;
  const int64_t w_padded = G * Kgp * p.R * p.S * Cgp;
  const int64_t weight_bytes = (w_count + w_padded) * eb;
  info->in_launches = info->out_launches = 1;
  const bool out_fused = plan.conv.d_nchw;  // the Hopper epilogue writes NCHW: no pass out
  if (out_fused) info->out_launches = 0;
  switch (query.pass) {
    case ConvPass::kForward:
      info->in_bytes = (x_count + x_nhwc) * eb + weight_bytes;
      if (with_bias) info->in_bytes += (p.K + G * Kgp) * eb;
      info->out_bytes = out_fused ? 0 : 2 * y_count * eb;
      say(info->in_what, std::string(last ? "x repacked" : "x to NHWC") +
                             (with_bias ? " + weights + bias" : " + weights"));
      say(info->out_what, out_fused ? "" : last ? "y unpacked" : "y to NCHW");
      break;
    case ConvPass::kBackwardData:
      info->in_bytes = (y_count + y_nhwc) * eb + weight_bytes;
      info->out_bytes = out_fused ? 0 : 2 * x_count * eb;
      if (phases) info->in_launches = 2;
      say(info->in_what,
          std::string(last ? "dy repacked" : "dy to NHWC") +
              (phases                ? " + filters by stride phase"
               : plan.dgrad_as_fprop ? " + weights flipped"
                                     : " + weights"));
      say(info->out_what, out_fused ? "" : last ? "dx unpacked" : "dx to NCHW");
      break;
    case ConvPass::kBackwardWeight:
    default: {
      info->in_bytes = (y_count + y_nhwc + x_count + x_nhwc) * eb;
      const int64_t split = plan.conv.split_k;
      info->out_bytes = G * split * plan.Kg * p.R * p.S * round_up(plan.Cg, 4) * 4 + w_count * eb;
      say(info->in_what, last ? "dy and x repacked" : "dy and x to NHWC");
      say(info->out_what, "reduction of " + std::to_string(split) + " split-K partials");
      break;
    }
  }
  return true;
}

}  // namespace

}  // namespace jax_kernels

#else  // no CUTLASS headers at build time: every problem goes to the direct kernels

namespace jax_kernels {

int64_t implicit_gemm_scratch_bytes(const ConvQuery&) { return -1; }

ffi::Error implicit_gemm_conv2d(cudaStream_t, const ConvQuery&, const void*, const void*,
                                const void*, void*, void*, int64_t) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "conv2d: built without CUTLASS, the tensor-core path is not available");
}

ffi::Error implicit_gemm_steps(cudaStream_t, const ConvQuery&, const void*, const void*,
                               const void*, void*, void*, int64_t, unsigned) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "conv2d: built without CUTLASS, the tensor-core path is not available");
}

bool implicit_gemm_layout_info(const ConvQuery&, bool, ImplicitGemmLayoutInfo*) { return false; }

}  // namespace jax_kernels

#endif
