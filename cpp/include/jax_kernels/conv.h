// conv2d geometry shared by every backend and pass (torch.nn.functional.conv2d semantics), host
// and device. Two layouts (ConvLayout): NCHW input, KCRS weight with C/groups input channels per
// filter and NKPQ output (torch); or channels-last NHWC input, HWIO weight [R, S, C/groups, K]
// and NPQK output (lax.conv with ("NHWC", "HWIO", "NHWC"), Flax). The problem is described by
// logical extents either way; TensorStrides maps logical indices to elements.
//
// The problem description is the interface between the handlers of both backends (cpu/conv.cc,
// cuda/conv/handlers.cu), the direct kernels and the tensor-core path (cuda/conv/implicit_gemm.h);
// the FFI attributes at the end are the targets' attributes, shared by both backends.
#pragma once

#include <cstdint>
#include <string>

#include "jax_kernels/ffi_util.h"
#include "jax_kernels/index_math.h"
#include "jax_kernels/scalar.h"

namespace jax_kernels {

// The layout of a pass's tensors; each layout has its own FFI targets (jk_conv2d_* and
// jk_conv2d_nhwc_*), so the attributes stay the same.
enum class ConvLayout : int64_t { kNCHW = 0, kNHWC = 1 };

// Element strides of a 4-D tensor indexed logically: (n, c, y, x) for activations, (k, c, r, s)
// for weights.
struct TensorStrides {
  int64_t a, b, c, d;
  JK_HD int64_t at(int64_t i, int64_t j, int64_t k, int64_t l) const {
    return i * a + j * b + k * c + l * d;
  }
};

// Activation [N, C, H, W] (NCHW) or [N, H, W, C] (NHWC), indexed (n, c, y, x).
JK_HD TensorStrides activation_strides(ConvLayout layout, int64_t C, int64_t H, int64_t W) {
  if (layout == ConvLayout::kNHWC) return {H * W * C, 1, W * C, C};
  return {C * H * W, H * W, W, 1};
}

// Weight [K, Cg, R, S] (KCRS) or [R, S, Cg, K] (HWIO), indexed (k, c, r, s).
JK_HD TensorStrides weight_strides(ConvLayout layout, int64_t K, int64_t Cg, int64_t R,
                                   int64_t S) {
  if (layout == ConvLayout::kNHWC) return {1, K, S * Cg * K, Cg * K};
  return {Cg * R * S, R * S, S, 1};
}

struct ConvProblem {
  int64_t N, C, H, W;  // input
  int64_t K, R, S;     // weight: [K, C / groups, R, S]
  int64_t P, Q;        // output spatial extent
  int64_t stride_h, stride_w;
  int64_t pad_top, pad_left;  // bottom/right padding is implied by P and Q
  int64_t dilation_h, dilation_w;
  int64_t groups;
  ConvLayout layout = ConvLayout::kNCHW;

  JK_HD int64_t channels_per_group() const { return C / groups; }
  JK_HD int64_t filters_per_group() const { return K / groups; }
  // Input row/column read by output row p (column q) at filter tap r (s); may lie outside.
  JK_HD int64_t input_row(int64_t p, int64_t r) const { return p * stride_h - pad_top + r * dilation_h; }
  JK_HD int64_t input_col(int64_t q, int64_t s) const { return q * stride_w - pad_left + s * dilation_w; }
  JK_HD TensorStrides input_strides() const { return activation_strides(layout, C, H, W); }
  JK_HD TensorStrides output_strides() const { return activation_strides(layout, K, P, Q); }
  JK_HD TensorStrides filter_strides() const {
    return weight_strides(layout, K, channels_per_group(), R, S);
  }
};

enum class ConvPass : int64_t { kForward = 0, kBackwardData = 1, kBackwardWeight = 2 };

// Float32 math on tensor cores: TF32 by default (as lax.conv and cuDNN through torch), full
// float32 with precision="highest". Half types always accumulate in float32; float64 is exact.
enum class ConvPrecision : int64_t { kDefault = 0, kHighest = 1 };

// Element type codes of the scratch query (Python passes them by name, module_util.h).
enum class ConvDtype : int64_t { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat64 = 3 };

// A pass of a problem as the CUDA paths plan it (host query "conv2d_scratch" and the handlers).
struct ConvQuery {
  ConvPass pass;
  ConvDtype dtype;
  ConvPrecision precision;
  ConvProblem problem;
};

// ---- Index maps shared by the CPU and CUDA kernels (not part of the interface above) ---------

// Output extent along one axis: floor((in + pads - dilation * (taps - 1) - 1) / stride) + 1.
JK_HD int64_t conv_output_extent(int64_t in, int64_t taps, int64_t stride, int64_t pad_before,
                                 int64_t pad_after, int64_t dilation) {
  return floor_div(in + pad_before + pad_after - dilation * (taps - 1) - 1, stride) + 1;
}

// One spatial axis of a pass written as a stencil: output o and tap t read position
// u = o * stride + t * dilation - pad of the source upsampled by `upsample` (zeros between
// samples), i.e. the sample u / upsample where u is a multiple of `upsample`.
//
// The forward pass is the stencil of x with upsample 1. The backward-data pass is the stencil of
// dy with stride 1, upsample = the forward stride, the taps flipped (stencil tap t is forward
// tap taps - 1 - t) and pad = (taps - 1) * dilation - forward pad: then output h and tap t read
// dy[p] exactly where the forward pass has p * stride - pad + (taps - 1 - t) * dilation == h.
struct StencilAxis {
  int64_t out;     // output extent
  int64_t source;  // source extent in samples
  int64_t taps, stride, dilation, pad, upsample;

  JK_HD int64_t position(int64_t o, int64_t t) const { return o * stride + t * dilation - pad; }

  // The source sample at upsampled position u, or -1 where the upsampled source is zero.
  JK_HD int64_t sample(int64_t u) const {
    if (u < 0 || u % upsample != 0) return -1;
    const int64_t i = u / upsample;
    return i < source ? i : -1;
  }

  // Outputs o = oo * upsample + phase read, at tap t, sample oo * stride + *offset (which may lie
  // outside the source) if the function returns true, and only zeros of the upsampled source if
  // it returns false. With upsample 1 there is one phase and every tap is live.
  JK_HD bool phase_offset(int64_t phase, int64_t t, int64_t* offset) const {
    const int64_t u = position(phase, t);
    if (floor_mod(u, upsample) != 0) return false;
    *offset = floor_div(u, upsample);
    return true;
  }

  // The number of outputs o = oo * upsample + phase inside [0, out).
  JK_HD int64_t phase_outputs(int64_t phase) const { return ceil_div(out - phase, upsample); }
};

JK_HD StencilAxis forward_rows(const ConvProblem& p) {
  return {p.P, p.H, p.R, p.stride_h, p.dilation_h, p.pad_top, 1};
}
JK_HD StencilAxis forward_cols(const ConvProblem& p) {
  return {p.Q, p.W, p.S, p.stride_w, p.dilation_w, p.pad_left, 1};
}
JK_HD StencilAxis backward_data_rows(const ConvProblem& p) {
  return {p.H, p.P, p.R, 1, p.dilation_h, (p.R - 1) * p.dilation_h - p.pad_top, p.stride_h};
}
JK_HD StencilAxis backward_data_cols(const ConvProblem& p) {
  return {p.W, p.Q, p.S, 1, p.dilation_w, (p.S - 1) * p.dilation_w - p.pad_left, p.stride_w};
}

// Weight element of a stencil pass, as strides from the element of (output channel 0, input
// channel 0, tap 0, tap 0) within a group, in units of elements (negative for flipped taps).
// Forward: output channel k, input channel c of the weight. Backward data: output channel c,
// input channel k, flipped taps. Either weight layout (weight_strides).
struct StencilWeights {
  int64_t origin;  // offset of (0, 0, 0, 0) in the first group
  int64_t group, out_channel, in_channel, row, col;

  JK_HD int64_t offset(int64_t g, int64_t o, int64_t i, int64_t r, int64_t s) const {
    return origin + g * group + o * out_channel + i * in_channel + r * row + s * col;
  }
};

JK_HD StencilWeights forward_weights(const ConvProblem& p) {
  const TensorStrides w = p.filter_strides();
  return {0, p.filters_per_group() * w.a, w.a, w.b, w.c, w.d};
}
JK_HD StencilWeights backward_data_weights(const ConvProblem& p) {
  const TensorStrides w = p.filter_strides();
  return {(p.R - 1) * w.c + (p.S - 1) * w.d, p.filters_per_group() * w.a, w.b, w.a, -w.c, -w.d};
}

// ---- FFI attributes and problem checks, shared by the CPU and CUDA handlers (host only) --------

// nullptr if a problem's attributes are valid (positive groups, strides and dilations,
// non-negative padding, channels and filters divisible by the groups), else what is wrong. The
// handlers check this and that the tensors agree (conv2d_problem); the scratch query checks this.
inline const char* conv_problem_error(const ConvProblem& p) {
  if (p.groups <= 0 || p.stride_h <= 0 || p.stride_w <= 0 || p.dilation_h <= 0 ||
      p.dilation_w <= 0)
    return "groups, strides and dilations must be positive";
  if (p.pad_top < 0 || p.pad_left < 0) return "padding must be non-negative";
  if (p.K % p.groups != 0 || p.C % p.groups != 0)
    return "weight shape does not match the input channels and groups";
  return nullptr;
}

// Every forward, dgrad and wgrad target takes these attributes (decoded with .Attrs<ConvAttrs>()).
// Bottom/right padding is implied by the output extent. `precision` (ConvPrecision) selects TF32
// on CUDA tensor cores only.
struct ConvAttrs {
  int64_t stride_h, stride_w, pad_top, pad_left, dilation_h, dilation_w, groups, precision;
};

// The problem of a pass from its tensors, `in` [N, C, H, W], `weight` [K, C/g, R, S] and `out`
// [N, K, P, Q] (NCHW; NHWC: [N, H, W, C], [R, S, C/g, K] and [N, P, Q, K]), each the tensor or
// its gradient, of one element type, or an InvalidArgument error naming `op`. The kernels
// bounds-check every read, so any consistent problem is safe.
inline ffi::Error conv2d_problem(const char* op, const ConvAttrs& a, const ffi::AnyBuffer& in,
                                 const ffi::AnyBuffer& weight, const ffi::AnyBuffer& out,
                                 ConvProblem* p, ConvLayout layout = ConvLayout::kNCHW) {
  const auto invalid = [op](const char* what) {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
  };
  if (in.dimensions().size() != 4 || weight.dimensions().size() != 4 ||
      out.dimensions().size() != 4)
    return invalid("expected 4-D operands");
  if (in.element_type() != weight.element_type() || in.element_type() != out.element_type())
    return invalid("operands differ in element type");
  const int64_t* i = in.dimensions().begin();
  const int64_t* w = weight.dimensions().begin();
  const int64_t* o = out.dimensions().begin();
  for (int d = 0; d < 4; ++d)
    if (i[d] < 0 || w[d] < 0 || o[d] < 0) return invalid("negative extent");
  // Logical extents: x (N, C, H, W), w (K, Cg, R, S), y (N, K, P, Q).
  const bool last = layout == ConvLayout::kNHWC;
  const int64_t x_[4] = {i[0], last ? i[3] : i[1], last ? i[1] : i[2], last ? i[2] : i[3]};
  const int64_t w_[4] = {last ? w[3] : w[0], last ? w[2] : w[1], last ? w[0] : w[2],
                         last ? w[1] : w[3]};
  const int64_t y_[4] = {o[0], last ? o[3] : o[1], last ? o[1] : o[2], last ? o[2] : o[3]};
  *p = ConvProblem{x_[0],      x_[1],      x_[2],        x_[3],         // N, C, H, W
                   w_[0],      w_[2],      w_[3],                       // K, R, S
                   y_[2],      y_[3],                                   // P, Q
                   a.stride_h, a.stride_w, a.pad_top,    a.pad_left,    a.dilation_h,
                   a.dilation_w, a.groups, layout};
  if (const char* problem = conv_problem_error(*p)) return invalid(problem);
  if (w_[1] * p->groups != p->C)
    return invalid("weight shape does not match the input channels and groups");
  if (y_[0] != x_[0] || y_[1] != w_[0]) return invalid("output shape does not match the operands");
  if (w_[2] == 0 || w_[3] == 0) return invalid("kernel extents must be positive");
  return ffi::Error::Success();
}

// The forward's bias: [K] or empty (no bias), of the input's element type.
inline ffi::Error conv2d_bias_check(const ffi::AnyBuffer& bias, const ffi::AnyBuffer& x,
                                    int64_t K) {
  const bool has_bias = bias.element_count() > 0;
  if (bias.dimensions().size() != 1 || (has_bias && int64_t(bias.element_count()) != K) ||
      (has_bias && bias.element_type() != x.element_type()))
    return ffi::Error::InvalidArgument("conv2d: bias must be [K] or empty, of the input's type");
  return ffi::Error::Success();
}

// The bias gradient's operands: dy [N, K, P, Q] -> db [K], or [B, N, K, P, Q] -> [B, K] (a
// vmapped batch); NHWC: dy [(B,) N, P, Q, K]. Sets the batch B (1 unbatched), N, K and the plane
// P * Q.
inline ffi::Error conv2d_bias_gradient_shape(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& db,
                                             int64_t* batch, int64_t* N, int64_t* K,
                                             int64_t* plane,
                                             ConvLayout layout = ConvLayout::kNCHW) {
  const auto d = dy.dimensions();
  const size_t rank = d.size();
  const bool last = layout == ConvLayout::kNHWC;
  const size_t k_axis = last ? rank - 1 : rank - 3;
  if ((rank != 4 && rank != 5) || db.dimensions().size() != rank - 3 ||
      db.dimensions().back() != d[k_axis] || (rank == 5 && db.dimensions()[0] != d[0]) ||
      db.element_type() != dy.element_type())
    return ffi::Error::InvalidArgument(
        last ? "conv2d bias gradient: expected dy [(B,) N, P, Q, K] and db [(B,) K]"
             : "conv2d bias gradient: expected dy [(B,) N, K, P, Q] and db [(B,) K]");
  *batch = rank == 5 ? d[0] : 1;
  *N = d[rank - 4];
  *K = d[k_axis];
  *plane = last ? d[rank - 3] * d[rank - 2] : d[rank - 2] * d[rank - 1];
  return ffi::Error::Success();
}

}  // namespace jax_kernels

// Registers the decoding of ConvAttrs for `.Attrs<ConvAttrs>()` (once per source file, at
// global scope).
#define JK_CONV2D_REGISTER_ATTRS()                                                              \
  XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(                                                        \
      ::jax_kernels::ConvAttrs, ::xla::ffi::StructMember<int64_t>("stride_h"),                  \
      ::xla::ffi::StructMember<int64_t>("stride_w"), ::xla::ffi::StructMember<int64_t>("pad_top"), \
      ::xla::ffi::StructMember<int64_t>("pad_left"),                                            \
      ::xla::ffi::StructMember<int64_t>("dilation_h"),                                          \
      ::xla::ffi::StructMember<int64_t>("dilation_w"),                                          \
      ::xla::ffi::StructMember<int64_t>("groups"), ::xla::ffi::StructMember<int64_t>("precision"))
