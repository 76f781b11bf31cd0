// The CUDA FFI handlers of conv2d and the choice of algorithm per pass, for both layouts (the
// jk_conv2d_* targets, NCHW, and jk_conv2d_nhwc_*, channels last). The forward, dgrad and wgrad
// hand their problem to the tensor-core implicit GEMM (implicit_gemm.h, CUTLASS) when it takes
// it, and otherwise run the direct kernels of the layout (direct.h), which take every problem;
// the bias gradient is always a direct reduction. The choice depends on the problem's shape, dtype and
// precision only (never on the device), and the host query "conv2d_scratch" makes it at trace
// time with the same function (plan_conv) to size the scratch buffer.
#include <algorithm>
#include <cstdint>
#include <string>

#include "common/status.h"
#include "conv/direct.h"
#include "conv/implicit_gemm.h"
#include "jax_kernels/conv.h"
#include "jax_kernels/ffi_util.h"

namespace jax_kernels {
namespace {

ConvDtype conv_dtype(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F16: return ConvDtype::kFloat16;
    case ffi::DataType::BF16: return ConvDtype::kBFloat16;
    case ffi::DataType::F32: return ConvDtype::kFloat32;
    default: return ConvDtype::kFloat64;
  }
}

bool empty_problem(const ConvProblem& p) {
  return p.N == 0 || p.C == 0 || p.K == 0 || p.H == 0 || p.W == 0 || p.P == 0 || p.Q == 0;
}

// Which path runs a pass and the scratch bytes its handler must receive: the tensor-core path's
// when it takes the problem, else the direct kernels' (partial sums of the wgrad); -1 when they
// cannot be represented.
struct ConvPlan {
  bool implicit_gemm;
  int64_t scratch_bytes;
};

int64_t direct_scratch_bytes(const ConvQuery& q);

ConvPlan plan_conv(const ConvQuery& q) {
  if (!empty_problem(q.problem)) {
    const int64_t bytes = implicit_gemm_scratch_bytes(q);
    // Channels last, the tensor-core path uses the tensors in place, and a misaligned one sends
    // the pass to the direct kernels at run time: the scratch covers both.
    if (bytes >= 0) {
      if (q.problem.layout != ConvLayout::kNHWC) return {true, bytes};
      const int64_t direct = direct_scratch_bytes(q);
      return {true, direct < 0 ? -1 : std::max(bytes, direct)};
    }
  }
  return {false, direct_scratch_bytes(q)};
}

// The direct kernels' scratch: the partial sums of the wgrad.
int64_t direct_scratch_bytes(const ConvQuery& q) {
  if (q.pass != ConvPass::kBackwardWeight) return 0;
  if (q.problem.layout == ConvLayout::kNHWC) {
    switch (q.dtype) {
      case ConvDtype::kFloat16: return wgrad_nhwc_scratch_bytes<float16>(q.problem);
      case ConvDtype::kBFloat16: return wgrad_nhwc_scratch_bytes<bfloat16>(q.problem);
      case ConvDtype::kFloat32: return wgrad_nhwc_scratch_bytes<float>(q.problem);
      default: return wgrad_nhwc_scratch_bytes<double>(q.problem);
    }
  }
  switch (q.dtype) {
    case ConvDtype::kFloat16: return wgrad_scratch_bytes<float16>(q.problem);
    case ConvDtype::kBFloat16: return wgrad_scratch_bytes<bfloat16>(q.problem);
    case ConvDtype::kFloat32: return wgrad_scratch_bytes<float>(q.problem);
    default: return wgrad_scratch_bytes<double>(q.problem);
  }
}

// Host query "conv2d_scratch": the scratch bytes of a pass's handler. Arguments: `pass`
// (ConvPass), `dtype` (ConvDtype), `layout` (ConvLayout: which targets), the targets' attributes (ConvAttrs: stride_h, stride_w,
// pad_top, pad_left, dilation_h, dilation_w, groups, precision) and the extents N, C, H, W, K,
// R, S, P, Q; -1 for a malformed problem, kSizeOverflow when the scratch bytes cannot be
// represented.
int64_t conv2d_scratch_query(const QueryArgs& a) {
  const ConvProblem p{a["N"],        a["C"],        a["H"],          a["W"],
                      a["K"],        a["R"],        a["S"],          a["P"],
                      a["Q"],        a["stride_h"], a["stride_w"],   a["pad_top"],
                      a["pad_left"], a["dilation_h"], a["dilation_w"], a["groups"],
                      ConvLayout(a["layout"])};
  if (p.layout != ConvLayout::kNCHW && p.layout != ConvLayout::kNHWC) return -1;
  const ConvQuery query{ConvPass(a["pass"]), ConvDtype(a["dtype"]), ConvPrecision(a["precision"]),
                        p};
  if (conv_problem_error(p) != nullptr) return -1;
  const int64_t bytes = plan_conv(query).scratch_bytes;
  return bytes < 0 ? kSizeOverflow : bytes;
}

ConvQuery make_query(ConvPass pass, ffi::DataType type, const ConvAttrs& a, const ConvProblem& p) {
  return ConvQuery{pass, conv_dtype(type), ConvPrecision(a.precision), p};
}

// Runs the tensor-core path when it takes the problem; `*handled` tells whether it did.
ffi::Error try_implicit_gemm(cudaStream_t stream, const ConvQuery& q, const void* a,
                             const void* b, const void* bias, void* out,
                             ffi::Result<ffi::AnyBuffer>& scratch, bool* handled) {
  const ConvPlan plan = plan_conv(q);
  // Channels last, CUTLASS reads the tensors in place with 128-bit accesses.
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool in_place_ok = q.problem.layout != ConvLayout::kNHWC ||
                           (aligned(a) && aligned(b) && aligned(out) && aligned(bias));
  *handled = plan.implicit_gemm && in_place_ok;
  if (!*handled) return ffi::Error::Success();
  if (plan.scratch_bytes < 0 || int64_t(scratch->size_bytes()) < plan.scratch_bytes)
    return ffi::Error::InvalidArgument("conv2d: scratch buffer too small for the tensor-core path");
  return implicit_gemm_conv2d(stream, q, a, b, bias, out, scratch->untyped_data(),
                              int64_t(scratch->size_bytes()));
}

template <ConvLayout L>
ffi::Error conv2d_forward(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                          ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> scratch, ConvAttrs a) {
  ConvProblem p{};
  if (auto error = conv2d_problem("conv2d", a, x, w, *y, &p, L); error.failure()) return error;
  if (auto error = conv2d_bias_check(bias, x, p.K); error.failure()) return error;
  if (y->element_count() == 0) return ffi::Error::Success();
  const void* bias_data = bias.element_count() > 0 ? bias.untyped_data() : nullptr;
  bool done = false;
  if (auto error = try_implicit_gemm(stream, make_query(ConvPass::kForward, x.element_type(), a, p),
                                     x.untyped_data(), w.untyped_data(), bias_data,
                                     y->untyped_data(), scratch, &done);
      error.failure() || done)
    return error;
  return dispatch_float(x.element_type(), "conv2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* source = static_cast<const T*>(x.untyped_data());
    const T* weight = static_cast<const T*>(w.untyped_data());
    T* out = static_cast<T*>(y->untyped_data());
    if constexpr (L == ConvLayout::kNHWC)
      return run_stencil_nhwc<T>(stream, "conv2d", source, weight,
                                 static_cast<const T*>(bias_data), out, forward_nhwc(p));
    else
      return run_stencil<T>(stream, "conv2d", source, weight, static_cast<const T*>(bias_data),
                            out, forward_grid(p));
  });
}

template <ConvLayout L>
ffi::Error conv2d_backward_input(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer w,
                                 ffi::Result<ffi::AnyBuffer> dx,
                                 ffi::Result<ffi::AnyBuffer> scratch, ConvAttrs a) {
  ConvProblem p{};
  if (auto error = conv2d_problem("conv2d dgrad", a, *dx, w, dy, &p, L); error.failure())
    return error;
  if (dx->element_count() == 0) return ffi::Error::Success();
  bool done = false;
  if (auto error =
          try_implicit_gemm(stream, make_query(ConvPass::kBackwardData, dy.element_type(), a, p),
                            dy.untyped_data(), w.untyped_data(), nullptr, dx->untyped_data(),
                            scratch, &done);
      error.failure() || done)
    return error;
  return dispatch_float(dy.element_type(), "conv2d dgrad", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* source = static_cast<const T*>(dy.untyped_data());
    const T* weight = static_cast<const T*>(w.untyped_data());
    T* out = static_cast<T*>(dx->untyped_data());
    if constexpr (L == ConvLayout::kNHWC)
      return run_stencil_nhwc<T>(stream, "conv2d dgrad", source, weight, nullptr, out,
                                 backward_data_nhwc(p));
    else
      return run_stencil<T>(stream, "conv2d dgrad", source, weight, nullptr, out,
                            backward_data_grid(p));
  });
}

template <ConvLayout L>
ffi::Error conv2d_backward_weight(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                                  ffi::Result<ffi::AnyBuffer> dw,
                                  ffi::Result<ffi::AnyBuffer> scratch, ConvAttrs a) {
  ConvProblem p{};
  if (auto error = conv2d_problem("conv2d wgrad", a, x, *dw, dy, &p, L); error.failure())
    return error;
  if (dw->element_count() == 0) return ffi::Error::Success();
  bool done = false;
  if (auto error =
          try_implicit_gemm(stream, make_query(ConvPass::kBackwardWeight, dy.element_type(), a, p),
                            dy.untyped_data(), x.untyped_data(), nullptr, dw->untyped_data(),
                            scratch, &done);
      error.failure() || done)
    return error;
  return dispatch_float(dy.element_type(), "conv2d wgrad", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* dy_data = static_cast<const T*>(dy.untyped_data());
    const T* x_data = static_cast<const T*>(x.untyped_data());
    T* out = static_cast<T*>(dw->untyped_data());
    if constexpr (L == ConvLayout::kNHWC)
      return run_wgrad_nhwc<T>(stream, dy_data, x_data, out, p, scratch->untyped_data(),
                               int64_t(scratch->size_bytes()));
    else
      return run_wgrad<T>(stream, dy_data, x_data, out, p, scratch->untyped_data(),
                          int64_t(scratch->size_bytes()));
  });
}

// The bias gradient's scratch result is optional (ffi::RemainingRets): programs serialized before
// it existed call the target with db alone and get one pass per filter (deterministic too, but
// other bits than the chunked sums).
template <ConvLayout L>
ffi::Error conv2d_backward_bias(cudaStream_t stream, ffi::AnyBuffer dy,
                                ffi::Result<ffi::AnyBuffer> db, ffi::RemainingRets rest) {
  int64_t batch, N, K, plane;
  if (auto error = conv2d_bias_gradient_shape(dy, *db, &batch, &N, &K, &plane, L);
      error.failure())
    return error;
  if (rest.size() > 1)
    return ffi::Error::InvalidArgument("conv2d bias gradient: expected db and at most a scratch result");
  void* scratch = nullptr;
  int64_t scratch_bytes = 0;
  if (rest.size() == 1) {
    auto buffer = rest.get<ffi::AnyBuffer>(0);
    if (!buffer.has_value()) return buffer.error();
    scratch = (*buffer)->untyped_data();
    scratch_bytes = int64_t((*buffer)->size_bytes());
  }
  if (db->element_count() == 0) return ffi::Error::Success();
  return dispatch_float(dy.element_type(), "conv2d bias gradient", [&](auto tag) {
    using T = typename decltype(tag)::type;
    return run_bias_gradient<T>(stream, L, static_cast<const T*>(dy.untyped_data()),
                                static_cast<T*>(db->untyped_data()), batch, N, K, plane, scratch,
                                scratch_bytes);
  });
}

// Host query "conv2d_bias_scratch": the scratch bytes of the bias gradient of dy [(batch,) N, K,
// P, Q] (NCHW) or [(batch,) N, P, Q, K] (NHWC), plane = P * Q. Arguments: `layout`
// (ConvLayout), `dtype` (ConvDtype), batch, N, K, plane.
int64_t conv2d_bias_scratch_query(const QueryArgs& a) {
  const ConvLayout layout = ConvLayout(a["layout"]);
  const ConvDtype dtype = ConvDtype(a["dtype"]);
  const int64_t batch = a["batch"], N = a["N"], K = a["K"], plane = a["plane"];
  if (layout != ConvLayout::kNCHW && layout != ConvLayout::kNHWC) return -1;
  return bias_gradient_scratch_bytes(layout, dtype, batch, N, K, plane);
}

using Stream = ffi::PlatformStream<cudaStream_t>;

}  // namespace
}  // namespace jax_kernels

JK_CONV2D_REGISTER_ATTRS();

namespace jax_kernels {

#define JK_CONV2D_CUDA_HANDLERS(SUFFIX, LAYOUT)                                               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Conv2dForwardCuda##SUFFIX, conv2d_forward<LAYOUT>,              \
                                ffi::Ffi::Bind()                                               \
                                    .Ctx<Stream>()                                             \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Ret<ffi::AnyBuffer>()                                     \
                                    .Ret<ffi::AnyBuffer>()                                     \
                                    .Attrs<ConvAttrs>(),                                       \
                                {ffi::Traits::kCmdBufferCompatible});                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Conv2dBackwardInputCuda##SUFFIX, conv2d_backward_input<LAYOUT>, \
                                ffi::Ffi::Bind()                                               \
                                    .Ctx<Stream>()                                             \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Ret<ffi::AnyBuffer>()                                     \
                                    .Ret<ffi::AnyBuffer>()                                     \
                                    .Attrs<ConvAttrs>(),                                       \
                                {ffi::Traits::kCmdBufferCompatible});                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Conv2dBackwardWeightCuda##SUFFIX,                               \
                                conv2d_backward_weight<LAYOUT>,                                \
                                ffi::Ffi::Bind()                                               \
                                    .Ctx<Stream>()                                             \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Ret<ffi::AnyBuffer>()                                     \
                                    .Ret<ffi::AnyBuffer>()                                     \
                                    .Attrs<ConvAttrs>(),                                       \
                                {ffi::Traits::kCmdBufferCompatible});                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Conv2dBackwardBiasCuda##SUFFIX, conv2d_backward_bias<LAYOUT>,   \
                                ffi::Ffi::Bind()                                               \
                                    .Ctx<Stream>()                                             \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Ret<ffi::AnyBuffer>()                                     \
                                    .RemainingRets(),                                          \
                                {ffi::Traits::kCmdBufferCompatible})

JK_CONV2D_CUDA_HANDLERS(Nchw, ConvLayout::kNCHW);
JK_CONV2D_CUDA_HANDLERS(Nhwc, ConvLayout::kNHWC);

JK_REGISTER_TARGET("jk_conv2d_fwd", Conv2dForwardCudaNchw, "conv2d", "forward",
                   "cuda tensor-core implicit GEMM where it applies, else direct stencil",
                   "bitwise");
JK_REGISTER_TARGET("jk_conv2d_bwd_input", Conv2dBackwardInputCudaNchw, "conv2d",
                   "backward d_input",
                   "cuda tensor-core implicit GEMM where it applies, else direct stencil",
                   "bitwise");
JK_REGISTER_TARGET("jk_conv2d_bwd_weight", Conv2dBackwardWeightCudaNchw, "conv2d",
                   "backward d_weight",
                   "cuda tensor-core implicit GEMM where it applies, else two-pass reduction",
                   "bitwise");
JK_REGISTER_TARGET("jk_conv2d_bwd_bias", Conv2dBackwardBiasCudaNchw, "conv2d", "backward d_bias",
                   "cuda fixed chunks, each a fixed-order block reduction, added in order",
                   "bitwise");
JK_REGISTER_TARGET("jk_conv2d_nhwc_fwd", Conv2dForwardCudaNhwc, "conv2d", "forward (NHWC)",
                   "cuda tensor-core implicit GEMM on the NHWC tensors where it applies, else "
                   "direct channels-last stencil",
                   "bitwise");
JK_REGISTER_TARGET("jk_conv2d_nhwc_bwd_input", Conv2dBackwardInputCudaNhwc, "conv2d",
                   "backward d_input (NHWC)",
                   "cuda tensor-core implicit GEMM on the NHWC tensors where it applies, else "
                   "direct channels-last stencil",
                   "bitwise");
JK_REGISTER_TARGET("jk_conv2d_nhwc_bwd_weight", Conv2dBackwardWeightCudaNhwc, "conv2d",
                   "backward d_weight (NHWC)",
                   "cuda tensor-core implicit GEMM on the NHWC tensors where it applies, else "
                   "two-pass reduction over fixed slices",
                   "bitwise");
JK_REGISTER_TARGET("jk_conv2d_nhwc_bwd_bias", Conv2dBackwardBiasCudaNhwc, "conv2d",
                   "backward d_bias (NHWC)",
                   "cuda fixed chunks, each a fixed-order block reduction, added in order",
                   "bitwise");
JK_REGISTER_QUERY("conv2d_scratch", conv2d_scratch_query);
JK_REGISTER_QUERY("conv2d_bias_scratch", conv2d_bias_scratch_query);

}  // namespace jax_kernels
