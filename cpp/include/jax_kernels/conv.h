// conv2d geometry shared by every backend and pass (torch.nn.functional.conv2d semantics, NCHW
// input, KCRS weight with C/groups input channels per filter, NKPQ output), host and device.
//
// The problem description and the host-query argument layout are the interface between the
// direct kernels (cpu/conv.cc, cuda/conv.cu) and the tensor-core path (cuda/conv_dense.cu).
#pragma once

#include <cstdint>
#include <vector>

#include "jax_kernels/scalar.h"

namespace jax_kernels {

struct ConvProblem {
  int64_t N, C, H, W;  // input
  int64_t K, R, S;     // weight: [K, C / groups, R, S]
  int64_t P, Q;        // output spatial extent
  int64_t stride_h, stride_w;
  int64_t pad_top, pad_left;  // bottom/right padding is implied by P and Q
  int64_t dilation_h, dilation_w;
  int64_t groups;

  JK_HD int64_t channels_per_group() const { return C / groups; }
  JK_HD int64_t filters_per_group() const { return K / groups; }
  // Input row/column read by output row p (column q) at filter tap r (s); may lie outside.
  JK_HD int64_t input_row(int64_t p, int64_t r) const { return p * stride_h - pad_top + r * dilation_h; }
  JK_HD int64_t input_col(int64_t q, int64_t s) const { return q * stride_w - pad_left + s * dilation_w; }
};

enum class ConvPass : int64_t { kForward = 0, kBackwardData = 1, kBackwardWeight = 2 };

// Float32 math on tensor cores: TF32 by default (as lax.conv and cuDNN through torch), full
// float32 with precision="highest". Half types always accumulate in float32; float64 is exact.
enum class ConvPrecision : int64_t { kDefault = 0, kHighest = 1 };

// Element type codes used in host queries (Python maps dtypes to these).
enum class ConvDtype : int64_t { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat64 = 3 };

// Host query "conv2d_dense_scratch" takes these int64 arguments, in this order:
//   pass, dtype, precision, N, C, H, W, K, R, S, P, Q, stride_h, stride_w, pad_top, pad_left,
//   dilation_h, dilation_w, groups
// and returns the scratch bytes the tensor-core path needs, or -1 if it does not take the
// problem (the direct kernels then run, with no scratch).
struct ConvQuery {
  ConvPass pass;
  ConvDtype dtype;
  ConvPrecision precision;
  ConvProblem problem;
};

inline bool parse_conv_query(const std::vector<int64_t>& a, ConvQuery* q) {
  if (a.size() != 19) return false;
  q->pass = ConvPass(a[0]);
  q->dtype = ConvDtype(a[1]);
  q->precision = ConvPrecision(a[2]);
  q->problem = ConvProblem{a[3],  a[4],  a[5],  a[6],  a[7],  a[8],  a[9],  a[10], a[11], a[12],
                           a[13], a[14], a[15], a[16], a[17], a[18]};
  return true;
}

// ---- Index maps shared by the CPU and CUDA kernels (not part of the interface above) ---------

// Floor division and modulo for a positive divisor (C++ `/` and `%` truncate toward zero).
JK_HD int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}
JK_HD int64_t floor_mod(int64_t a, int64_t b) { return a - floor_div(a, b) * b; }
JK_HD int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }

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
// Forward: output channel k, input channel c of w[K, C/g, R, S]. Backward data: output channel
// c, input channel k, flipped taps.
struct StencilWeights {
  int64_t origin;  // offset of (0, 0, 0, 0) in the first group
  int64_t group, out_channel, in_channel, row, col;

  JK_HD int64_t offset(int64_t g, int64_t o, int64_t i, int64_t r, int64_t s) const {
    return origin + g * group + o * out_channel + i * in_channel + r * row + s * col;
  }
};

JK_HD StencilWeights forward_weights(const ConvProblem& p) {
  const int64_t cg = p.channels_per_group();
  return {0, p.filters_per_group() * cg * p.R * p.S, cg * p.R * p.S, p.R * p.S, p.S, 1};
}
JK_HD StencilWeights backward_data_weights(const ConvProblem& p) {
  const int64_t cg = p.channels_per_group();
  return {(p.R - 1) * p.S + (p.S - 1), p.filters_per_group() * cg * p.R * p.S, p.R * p.S,
          cg * p.R * p.S, -p.S, -1};
}

// A convolution problem from the dims of its three tensors: `in` [N, C, H, W], `weight`
// [K, C / groups, R, S] and `out` [N, K, P, Q], and the attributes of a pass.
inline ConvProblem make_conv_problem(const int64_t* in, const int64_t* weight, const int64_t* out,
                                     int64_t stride_h, int64_t stride_w, int64_t pad_top,
                                     int64_t pad_left, int64_t dilation_h, int64_t dilation_w,
                                     int64_t groups) {
  return ConvProblem{in[0],      in[1],      in[2],    in[3],    weight[0],  weight[2],
                     weight[3],  out[2],     out[3],   stride_h, stride_w,   pad_top,
                     pad_left,   dilation_h, dilation_w, groups};
}

// nullptr if the tensors of a pass agree with each other and the attributes are valid, else
// what is wrong. The kernels bounds-check every read, so any consistent problem is safe.
inline const char* conv_problem_error(const int64_t* in, const int64_t* weight, const int64_t* out,
                                      const ConvProblem& p) {
  if (p.groups <= 0 || p.stride_h <= 0 || p.stride_w <= 0 || p.dilation_h <= 0 ||
      p.dilation_w <= 0)
    return "groups, strides and dilations must be positive";
  if (p.pad_top < 0 || p.pad_left < 0) return "padding must be non-negative";
  if (p.K % p.groups != 0 || weight[1] * p.groups != p.C)
    return "weight shape does not match the input channels and groups";
  if (out[0] != in[0] || out[1] != weight[0]) return "output shape does not match the operands";
  for (int d = 0; d < 4; ++d)
    if (in[d] < 0 || weight[d] < 0 || out[d] < 0) return "negative extent";
  if (weight[2] == 0 || weight[3] == 0) return "kernel extents must be positive";
  return nullptr;
}

}  // namespace jax_kernels
