// grid_sample math (torch.nn.functional.grid_sample semantics), host and device, used by the CPU
// and the CUDA kernels alike: coordinate unnormalization, border clipping and reflection with
// their derivatives, the taps (cell, weight, weight slope) of nearest / linear / cubic sampling
// along one axis and their product over 2 or 3 axes, the directional first and second derivatives
// of the tap weights along grid directions (the forward-mode and second-order passes), the problem
// geometry, and the batch maps through which vmap folds its axes into the kernels' batch.
//
// Layouts: the input (and d_input) is [N, C, (D,) H, W] and the output (and dout) [N, C, (Do,) Ho,
// Wo] channels-first (NCHW, torch's), or [N, (D,) H, W, C] and [N, (Do,) Ho, Wo, C] channels-last
// (NHWC); the grid is the same in both. The kernels take the layout as a template parameter
// and address one batch row through RowLayout; the math below does not depend on it.
//
// Conventions: axis 0 is x (input width W), axis 1 is y (H), axis 2 is z (D); the grid holds
// (x, y[, z]) per output point. All arithmetic is in the accumulation type A (float for the
// half types). A tap is one input cell that an output point reads; its weight multiplies the
// cell's value and its slope along axis a is d weight / d grid coordinate a; its curvature along
// axis a is d^2 weight / d grid coordinate a^2 (non-zero for cubic sampling only: the linear and
// nearest weights and the padding maps are piecewise linear).
#pragma once

#include <float.h>
#include <math.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>

#include "jax_kernels/ffi_util.h"
#include "jax_kernels/scalar.h"

// Unrolls a loop with a compile-time trip count under nvcc (host compilers unroll on their own
// and would warn about the pragma).
#if defined(__CUDACC__)
#define JK_UNROLL _Pragma("unroll")
#else
#define JK_UNROLL
#endif

namespace jax_kernels {

// The codes match torch's GridSamplerInterpolation / GridSamplerPadding enums.
enum class GridSampleMode : int64_t { kBilinear = 0, kNearest = 1, kBicubic = 2 };
enum class GridSamplePadding : int64_t { kZeros = 0, kBorder = 1, kReflection = 2 };
// Where the channel axis of the input, output and their gradients lies (one set of FFI targets
// per layout: jk_grid_sample_* and jk_grid_sample_nhwc_*).
enum class GridSampleLayout : int { kChannelsFirst, kChannelsLast };

// Where element (channel c, position s) of one batch row lies in an input-shaped array
// (positions: the input cells) or an output-shaped one (positions: the output points):
// channels-first [C, positions], channels-last [positions, C]. The strides are compile-time
// 1 where the layout makes them so.
template <GridSampleLayout kLayout, class Index>
struct RowLayout {
  Index channels;
  Index positions;
  JK_HD Index channel_stride() const {
    return kLayout == GridSampleLayout::kChannelsFirst ? positions : Index(1);
  }
  JK_HD Index position_stride() const {
    return kLayout == GridSampleLayout::kChannelsFirst ? Index(1) : channels;
  }
  JK_HD Index at(Index c, Index s) const { return c * channel_stride() + s * position_stride(); }
};

namespace grid_sample_math {

JK_HD float floor_of(float x) { return floorf(x); }
JK_HD double floor_of(double x) { return floor(x); }
// floor of a value known to lie well inside the int64 range. Host compilers without SSE4.1
// call libm for floor; a truncating conversion is one instruction.
template <class A>
JK_HD A floor_of_bounded(A x) {
#if defined(__CUDA_ARCH__)
  return floor_of(x);
#else
  const A truncated = A(int64_t(x));
  return truncated > x ? truncated - A(1) : truncated;
#endif
}
// Round half to even (torch's nearbyint under the default rounding mode).
JK_HD float round_even(float x) { return rintf(x); }
JK_HD double round_even(double x) { return rint(x); }
JK_HD float remainder_of(float x, float y) { return fmodf(x, y); }
JK_HD double remainder_of(double x, double y) { return fmod(x, y); }
JK_HD bool finite(float x) { return fabsf(x) <= FLT_MAX; }
JK_HD bool finite(double x) { return fabs(x) <= DBL_MAX; }

}  // namespace grid_sample_math

// d source coordinate / d grid coordinate of the unnormalization: with align_corners, -1 and 1
// are the centres of the corner cells; without, they are the outer edges of the image.
template <class A>
JK_HD A unnormalize_scale(int64_t size, bool align_corners) {
  return align_corners ? A(size - 1) / A(2) : A(size) / A(2);
}

// Along an axis of one cell with align_corners the scale is 0: every coordinate but NaN is
// position 0, ±Inf included (the limit of the finite ones; the formula would give Inf * 0 = NaN).
template <class A>
JK_HD A unnormalize(A coord, int64_t size, bool align_corners) {
  if (align_corners && size == 1) return coord == coord ? A(0) : coord;
  return align_corners ? (coord + A(1)) / A(2) * A(size - 1)
                       : ((coord + A(1)) * A(size) - A(1)) / A(2);
}

// Clamps x to [0, size - 1]. The slope is 0 at and beyond either border (torch counts the
// borders as outside for the gradient). NaN passes through unchanged.
template <class A>
JK_HD A clip_coordinate(A x, int64_t size, A* slope) {
  const A high = A(size - 1);
  if (x <= A(0)) {
    *slope = A(0);
    return A(0);
  }
  if (x >= high) {
    *slope = A(0);
    return high;
  }
  *slope = A(1);
  return x;
}

// Reflects x into [twice_low / 2, twice_high / 2] (bounds given doubled so that half-cell
// bounds stay integers); the slope is +1 or -1 by the parity of the reflections. The parity is
// that of the floored floating-point quotient, also where torch's cast of it to int overflows;
// ±Inf and NaN give NaN.
template <class A>
JK_HD A reflect_coordinate(A x, int64_t twice_low, int64_t twice_high, A* slope) {
  using namespace grid_sample_math;
  if (twice_low == twice_high) {
    *slope = A(0);
    return A(0);
  }
  const A low = A(twice_low) / A(2);
  const A span = A(twice_high - twice_low) / A(2);
  A distance = x - low;
  A sign = A(1);
  if (distance < A(0)) {
    sign = A(-1);
    distance = -distance;
  }
  const A extra = remainder_of(distance, span);
  const bool odd = remainder_of(floor_of(distance / span), A(2)) != A(0);
  *slope = odd ? -sign : sign;
  return odd ? span - extra + low : extra + low;
}

// The padding mode applied to a source coordinate x along an axis of `size` cells: border
// clips, reflection reflects about the edges (align_corners: the corner centres) and then
// clips. The slope factor is multiplied into *slope.
template <class A>
JK_HD A pad_coordinate(A x, int64_t size, GridSamplePadding padding, bool align_corners,
                       A* slope) {
  A factor = A(1);
  if (padding == GridSamplePadding::kBorder) {
    x = clip_coordinate(x, size, &factor);
    *slope *= factor;
  } else if (padding == GridSamplePadding::kReflection) {
    x = align_corners ? reflect_coordinate(x, 0, 2 * (size - 1), &factor)
                      : reflect_coordinate(x, -1, 2 * size - 1, &factor);
    *slope *= factor;
    x = clip_coordinate(x, size, &factor);
    *slope *= factor;
  }
  return x;
}

// Keys cubic convolution with A = -0.75 (torch's bicubic): the weights of the four taps at
// floor(x) - 1 .. floor(x) + 2 for t = x - floor(x), their derivatives d weight / d t and their
// second derivatives d^2 weight / d t^2.
template <class A>
JK_HD void cubic_weights(A t, A (&w)[4]) {
  const A a = A(-0.75);
  // The kernel at distance d: `inner` for |d| <= 1, `outer` for 1 < |d| < 2.
  const auto inner = [a](A d) { return ((a + A(2)) * d - (a + A(3))) * d * d + A(1); };
  const auto outer = [a](A d) { return ((a * d - A(5) * a) * d + A(8) * a) * d - A(4) * a; };
  w[0] = outer(t + A(1));
  w[1] = inner(t);
  w[2] = inner(A(1) - t);
  w[3] = outer(A(2) - t);
}

template <class A>
JK_HD void cubic_weight_derivatives(A t, A (&dw)[4]) {
  const A a = A(-0.75);
  const auto inner = [a](A d) { return (A(3) * (a + A(2)) * d - A(2) * (a + A(3))) * d; };
  const auto outer = [a](A d) { return (A(3) * a * d - A(10) * a) * d + A(8) * a; };
  dw[0] = outer(t + A(1));
  dw[1] = inner(t);
  dw[2] = -inner(A(1) - t);
  dw[3] = -outer(A(2) - t);
}

template <class A>
JK_HD void cubic_weight_second_derivatives(A t, A (&ddw)[4]) {
  const A a = A(-0.75);
  const auto inner = [a](A d) { return A(6) * (a + A(2)) * d - A(2) * (a + A(3)); };
  const auto outer = [a](A d) { return A(6) * a * d - A(10) * a; };
  ddw[0] = outer(t + A(1));
  ddw[1] = inner(t);
  ddw[2] = inner(A(1) - t);
  ddw[3] = outer(A(2) - t);
}

template <GridSampleMode kMode>
constexpr int taps_per_axis() {
  return kMode == GridSampleMode::kNearest ? 1 : kMode == GridSampleMode::kBilinear ? 2 : 4;
}

// The taps of one output point along one axis. Invalid taps (outside the input, or every tap
// of a point whose coordinate is NaN or cannot reach the input) have index 0 and finite weights
// and slopes: kernels skip them, never read through them.
template <class A, class Index, int K>
struct AxisTaps {
  Index index[K];
  bool valid[K];
  A weight[K];
  A slope[K];
  A curvature[K];  // filled only when asked for (the directional second derivatives)
};

// Nearest and linear sampling pad the unnormalized coordinate first, then pick cells.
// Cubic sampling picks four cells around the unpadded coordinate and pads each cell index.
// kCurvature: also fill the curvatures (scale^2 times the Keys kernel's second derivative for
// cubic sampling, 0 otherwise).
template <GridSampleMode kMode, class A, class Index, bool kCurvature = false>
JK_HD void axis_taps(A coord, int64_t size, GridSamplePadding padding, bool align_corners,
                     AxisTaps<A, Index, taps_per_axis<kMode>()>* taps) {
  using namespace grid_sample_math;
  constexpr int K = taps_per_axis<kMode>();
  const A extent = A(size);
  A scale = unnormalize_scale<A>(size, align_corners);
  if constexpr (kMode == GridSampleMode::kNearest) {
    const A x = round_even(pad_coordinate(unnormalize(coord, size, align_corners), size, padding,
                                          align_corners, &scale));
    taps->valid[0] = x >= A(0) && x < extent && coord == coord;  // NaN samples nothing
    taps->index[0] = taps->valid[0] ? Index(x) : Index(0);
    taps->weight[0] = A(1);
    taps->slope[0] = A(0);
    if constexpr (kCurvature) taps->curvature[0] = A(0);
  } else if constexpr (kMode == GridSampleMode::kBilinear) {
    A x = pad_coordinate(unnormalize(coord, size, align_corners), size, padding, align_corners,
                         &scale);
    // Outside [-1, size) no tap lies in the input; ±Inf lands here too, and NaN is sent here
    // whatever the padding. The stand-in keeps the weights finite, so that skipped taps cannot
    // turn a sum into NaN.
    if (!(x >= A(-1) && x < extent) || coord != coord) x = A(-2);
    const A x0 = floor_of_bounded(x);
    const A x1 = x0 + A(1);
    taps->weight[0] = x1 - x;
    taps->weight[1] = x - x0;
    taps->slope[0] = -scale;
    taps->slope[1] = scale;
    if constexpr (kCurvature) taps->curvature[0] = taps->curvature[1] = A(0);
    taps->valid[0] = x0 >= A(0) && x0 < extent;
    taps->valid[1] = x1 >= A(0) && x1 < extent;
    taps->index[0] = taps->valid[0] ? Index(x0) : Index(0);
    taps->index[1] = taps->valid[1] ? Index(x1) : Index(0);
  } else {
    A x = unnormalize(coord, size, align_corners);
    // NaN samples nothing; ±Inf with border padding is the edge cell (the limit of large
    // coordinates); ±Inf with other paddings samples nothing.
    bool reachable = finite(x);
    if (!reachable && padding == GridSamplePadding::kBorder && x == x) {
      x = x > A(0) ? extent + A(2) : A(-3);
      reachable = true;
    }
    if (!reachable) x = A(-5);
    const A x0 = floor_of(x);
    const A t = x - x0;
    cubic_weights(t, taps->weight);
    cubic_weight_derivatives(t, taps->slope);
    if constexpr (kCurvature) cubic_weight_second_derivatives(t, taps->curvature);
JK_UNROLL
    for (int i = 0; i < K; ++i) {
      taps->slope[i] *= scale;
      if constexpr (kCurvature) taps->curvature[i] *= scale * scale;
      A unused_slope = A(1);
      const A cell = pad_coordinate(x0 + A(i - 1), size, padding, align_corners, &unused_slope);
      taps->valid[i] = reachable && cell >= A(0) && cell < extent;
      taps->index[i] = taps->valid[i] ? Index(cell) : Index(0);
    }
  }
}

// What a kernel needs to know about the problem. The batch index m runs over the output's
// (possibly vmap-folded) batch; operands map it to their own batch through a BatchMap.
struct GridSampleGeometry {
  int dims = 2;              // spatial dimensions: 2 (4-D input) or 3 (5-D input)
  int64_t batch = 0;         // output batch M
  int64_t channels = 0;      // C
  int64_t size[3] = {1, 1, 1};  // input extent along x, y, z (W, H, D)
  int64_t cells = 0;         // D * H * W: input cells per channel
  int64_t points = 0;        // Do * Ho * Wo: output points per channel
  GridSamplePadding padding = GridSamplePadding::kZeros;
  bool align_corners = false;
};

// Which operand batch row feeds output batch m. vmap folds its axis into the leading (batch)
// axis; an operand that was not batched is reused across the new axis instead of copied. With
// m = ((o * repeat) + r) * chunk + k, the operand row is o * chunk + k: it holds `chunk` rows
// per block, each block reused `repeat` times. repeat == 1 is the identity.
struct BatchMap {
  int64_t repeat = 1;
  int64_t chunk = 1;

  JK_HD int64_t operator()(int64_t m) const {
    if (repeat == 1) return m;
    return (m / (repeat * chunk)) * chunk + m % chunk;
  }
};

// The product of the per-axis taps of one output point: tap t = (k * K + j) * K + i reads cell
// (z_k, y_j, x_i), i.e. offset (z_k * H + y_j) * W + x_i within a channel plane. The order is
// torch's (north-west, north-east, south-west, south-east, then the far plane).
template <class A, class Index, GridSampleMode kMode, int kDims>
struct PointTaps {
  static constexpr int kPerAxis = taps_per_axis<kMode>();
  static constexpr int kCount = kDims == 2 ? kPerAxis * kPerAxis : kPerAxis * kPerAxis * kPerAxis;
  Index offset[kCount];
  bool valid[kCount];
  A weight[kCount];
  A slope[kDims][kCount];  // filled only when asked for (the grid gradient)

  template <bool kSlopes>
  JK_HD void compute(const GridSampleGeometry& g, const A (&coord)[kDims]) {
    constexpr int K = kPerAxis;
    AxisTaps<A, Index, K> axis[kDims];
JK_UNROLL
    for (int d = 0; d < kDims; ++d)
      axis_taps<kMode, A, Index>(coord[d], g.size[d], g.padding, g.align_corners, &axis[d]);
    const Index width = Index(g.size[0]);
    const Index height = Index(g.size[1]);
JK_UNROLL
    for (int t = 0; t < kCount; ++t) {
      const int i = t % K;
      const int j = (t / K) % K;
      Index row = axis[1].index[j];
      bool ok = axis[0].valid[i] && axis[1].valid[j];
      A wy = axis[1].weight[j];
      A wz = A(1);
      int k = 0;
      if constexpr (kDims == 3) {
        k = t / (K * K);
        row += axis[2].index[k] * height;
        ok = ok && axis[2].valid[k];
        wz = axis[2].weight[k];
      }
      offset[t] = row * width + axis[0].index[i];
      valid[t] = ok;
      const A wx = axis[0].weight[i];
      weight[t] = wx * wy * wz;
      if constexpr (kSlopes) {
        slope[0][t] = axis[0].slope[i] * wy * wz;
        slope[1][t] = wx * axis[1].slope[j] * wz;
        if constexpr (kDims == 3) slope[2][t] = wx * wy * axis[2].slope[k];
      }
    }
  }
};

// Directional derivatives of one tap's weight W = prod_d w_d(g_d), from the per-axis weights w,
// slopes s and curvatures c at the tap's cells: the first derivative along u,
// sum_a dW/dg_a u_a, and the Hessian applied to u along axis a, sum_b d^2W/(dg_a dg_b) u_b. The
// Hessian's mixed terms (a != b) are s_a s_b times the other axes' weights, its diagonal terms
// c_a times the other axes' weights.
template <class A, int kDims>
JK_HD A tap_first_derivative(const A (&w)[kDims], const A (&s)[kDims], const A (&u)[kDims]) {
  A sum = A(0);
JK_UNROLL
  for (int a = 0; a < kDims; ++a) {
    A term = s[a] * u[a];
JK_UNROLL
    for (int d = 0; d < kDims; ++d)
      if (d != a) term *= w[d];
    sum += term;
  }
  return sum;
}

template <class A, int kDims>
JK_HD A tap_hessian_along(const A (&w)[kDims], const A (&s)[kDims], const A (&c)[kDims],
                          const A (&u)[kDims], int a) {
  A sum = A(0);
JK_UNROLL
  for (int b = 0; b < kDims; ++b) {
    A term = b == a ? c[a] * u[a] : s[a] * s[b] * u[b];
JK_UNROLL
    for (int d = 0; d < kDims; ++d)
      if (d != a && d != b) term *= w[d];
    sum += term;
  }
  return sum;
}

// The taps of one output point (cells as in PointTaps) with directional derivatives of their
// weights along grid directions u and v (rows of arrays shaped like the grid, at this point):
//   compute<1>: weight[t] = sum_a dW_t/dg_a u_a
//   compute<2>: weight[t] = sum_{a,b} d^2W_t/(dg_a dg_b) u_a v_b
//   compute_hessian_along: along[a][t] = sum_b d^2W_t/(dg_a dg_b) u_b
// Nearest sampling's weights are constant: every derivative is 0.
template <class A, class Index, GridSampleMode kMode, int kDims>
struct PointTapDerivatives {
  static constexpr int kPerAxis = taps_per_axis<kMode>();
  static constexpr int kCount = kDims == 2 ? kPerAxis * kPerAxis : kPerAxis * kPerAxis * kPerAxis;
  using Axis = AxisTaps<A, Index, kPerAxis>;
  Index offset[kCount];
  bool valid[kCount];
  A weight[kCount];        // compute<k>
  A along[kDims][kCount];  // compute_hessian_along

  template <int kOrder>
  JK_HD void compute(const GridSampleGeometry& g, const A (&coord)[kDims], const A (&u)[kDims],
                     const A (&v)[kDims]) {
    static_assert(kOrder == 1 || kOrder == 2, "first or second directional derivative");
    Axis axis[kDims];
    locate<kOrder == 2>(g, coord, axis);
JK_UNROLL
    for (int t = 0; t < kCount; ++t) {
      A w[kDims], s[kDims], c[kDims];
      factors<kOrder == 2>(axis, t, w, s, c);
      if constexpr (kOrder == 1) {
        weight[t] = tap_first_derivative(w, s, u);
      } else {
        A sum = A(0);
JK_UNROLL
        for (int a = 0; a < kDims; ++a) sum += v[a] * tap_hessian_along(w, s, c, u, a);
        weight[t] = sum;
      }
    }
  }

  JK_HD void compute_hessian_along(const GridSampleGeometry& g, const A (&coord)[kDims],
                                   const A (&u)[kDims]) {
    Axis axis[kDims];
    locate<true>(g, coord, axis);
JK_UNROLL
    for (int t = 0; t < kCount; ++t) {
      A w[kDims], s[kDims], c[kDims];
      factors<true>(axis, t, w, s, c);
JK_UNROLL
      for (int a = 0; a < kDims; ++a) along[a][t] = tap_hessian_along(w, s, c, u, a);
    }
  }

 private:
  // The per-axis taps, and every tap's cell offset and validity.
  template <bool kCurvature>
  JK_HD void locate(const GridSampleGeometry& g, const A (&coord)[kDims], Axis (&axis)[kDims]) {
    constexpr int K = kPerAxis;
JK_UNROLL
    for (int d = 0; d < kDims; ++d)
      axis_taps<kMode, A, Index, kCurvature>(coord[d], g.size[d], g.padding, g.align_corners,
                                             &axis[d]);
    const Index width = Index(g.size[0]);
    const Index height = Index(g.size[1]);
JK_UNROLL
    for (int t = 0; t < kCount; ++t) {
      const int i = t % K;
      const int j = (t / K) % K;
      Index row = axis[1].index[j];
      bool ok = axis[0].valid[i] && axis[1].valid[j];
      if constexpr (kDims == 3) {
        const int k = t / (K * K);
        row += axis[2].index[k] * height;
        ok = ok && axis[2].valid[k];
      }
      offset[t] = row * width + axis[0].index[i];
      valid[t] = ok;
    }
  }

  // Tap t's weight, slope and curvature (0 unless kCurvature) along each axis.
  template <bool kCurvature>
  JK_HD static void factors(const Axis (&axis)[kDims], int t, A (&w)[kDims], A (&s)[kDims],
                            A (&c)[kDims]) {
    int rest = t;
JK_UNROLL
    for (int d = 0; d < kDims; ++d) {
      const int i = rest % kPerAxis;
      rest /= kPerAxis;
      w[d] = axis[d].weight[i];
      s[d] = axis[d].slope[i];
      if constexpr (kCurvature) {
        c[d] = axis[d].curvature[i];
      } else {
        c[d] = A(0);
      }
    }
  }
};

// The axis of the channels in an input- or output-shaped array of `rank` dimensions, and the
// first of its spatial axes.
inline int channel_axis(GridSampleLayout layout, int rank) {
  return layout == GridSampleLayout::kChannelsFirst ? 1 : rank - 1;
}
inline int first_spatial_axis(GridSampleLayout layout) {
  return layout == GridSampleLayout::kChannelsFirst ? 2 : 1;
}

// Fills the geometry from the cells' shape `sampled` ([S, C, (D,) H, W] or, channels-last,
// [S, (D,) H, W, C]: the input or the d_input result), the grid's shape
// [S_g, (Do,) Ho, Wo, dims] and the output batch M.
inline std::string make_grid_sample_geometry(GridSampleLayout layout, const int64_t* sampled,
                                             int sampled_rank, const int64_t* grid, int grid_rank,
                                             int64_t batch, GridSamplePadding padding,
                                             bool align_corners, GridSampleGeometry* geometry) {
  GridSampleGeometry g;
  if (sampled_rank != 4 && sampled_rank != 5) return "input must be 4-D or 5-D";
  g.dims = sampled_rank - 2;
  if (grid_rank != sampled_rank) return "grid rank differs from the input's";
  if (grid[grid_rank - 1] != g.dims) return "grid's last dimension must equal the spatial rank";
  if (batch < 0) return "result has no batch dimension";
  if (padding != GridSamplePadding::kZeros && padding != GridSamplePadding::kBorder &&
      padding != GridSamplePadding::kReflection)
    return "unknown padding mode";
  g.batch = batch;
  g.channels = sampled[channel_axis(layout, sampled_rank)];
  g.cells = 1;
  g.points = 1;
  const int last_spatial = first_spatial_axis(layout) + g.dims - 1;
  for (int d = 0; d < g.dims; ++d) {
    g.size[d] = sampled[last_spatial - d];
    if (g.size[d] <= 0) return "input has an empty spatial dimension";
    g.cells *= g.size[d];
    g.points *= grid[grid_rank - 2 - d];
  }
  g.padding = padding;
  g.align_corners = align_corners;
  *geometry = g;
  return "";
}

// Whether an operand with `rows` batch rows fits `map` for output batch `batch`.
inline bool batch_map_fits(const BatchMap& map, int64_t rows, int64_t batch) {
  if (map.repeat < 1 || map.chunk < 1 || rows % map.chunk != 0) return false;
  return (rows / map.chunk) * map.repeat * map.chunk == batch;
}

// The passes, one FFI target per pass and layout. Operands, in order, and result (shown
// channels-first; channels-last moves C of input, out, dout and d_input to the end):
//   kForward:       input [S, C, (D,) H, W], grid [S_g, (Do,) Ho, Wo, dims]
//                   -> out [M, C, (Do,) Ho, Wo]
//   kBackwardInput: dout [S_d, C, (Do,) Ho, Wo], grid -> d_input [M, C, (D,) H, W]
//   kBackwardGrid:  dout, input, grid -> d_grid [M, (Do,) Ho, Wo, dims]
// The directional passes take the operands of their base pass followed by grid directions
// (each [S_u, (Do,) Ho, Wo, dims], the grid's per-row shape) and replace every tap weight W by
// a directional derivative of it (PointTapDerivatives):
//   kForwardDirectional:       input, grid, u[, v] -> out; weights dW.u (or d^2W[u, v])
//   kBackwardInputDirectional: dout, grid, u[, v] -> d_input; the same weights, transposed
//   kBackwardGridDirectional:  dout, input, grid, u -> d_grid; d_grid[a] weights d^2W[a, u]
// Each operand's batch S maps onto the output batch M through its BatchMap (attribute
// `batch_maps`: repeat, chunk per operand, in operand order, directions included).
enum class GridSamplePass {
  kForward,
  kBackwardInput,
  kBackwardGrid,
  kForwardDirectional,
  kBackwardInputDirectional,
  kBackwardGridDirectional,
};

constexpr bool is_directional(GridSamplePass pass) {
  return pass == GridSamplePass::kForwardDirectional ||
         pass == GridSamplePass::kBackwardInputDirectional ||
         pass == GridSamplePass::kBackwardGridDirectional;
}

// The pass whose operands (and result) a directional pass extends; a base pass itself.
constexpr GridSamplePass base_pass(GridSamplePass pass) {
  switch (pass) {
    case GridSamplePass::kForwardDirectional:
      return GridSamplePass::kForward;
    case GridSamplePass::kBackwardInputDirectional:
      return GridSamplePass::kBackwardInput;
    case GridSamplePass::kBackwardGridDirectional:
      return GridSamplePass::kBackwardGrid;
    default:
      return pass;
  }
}

// Operands of a pass before its directions, and the directions it takes at most.
constexpr int base_operand_count(GridSamplePass pass) {
  return base_pass(pass) == GridSamplePass::kBackwardGrid ? 3 : 2;
}
constexpr int max_directions(GridSamplePass pass) {
  return !is_directional(pass) ? 0 : pass == GridSamplePass::kBackwardGridDirectional ? 1 : 2;
}
constexpr int kMaxGridSampleOperands = 4;

struct GridSampleCall {
  GridSampleGeometry geometry;
  GridSampleMode mode = GridSampleMode::kBilinear;
  BatchMap input_map, grid_map, dout_map;  // those of the pass's operands
};

// The grid directions of a directional pass: how many (1 or 2) and their batch maps.
struct GridSampleDirections {
  int count = 0;
  BatchMap map[2];
};

struct DimsView {
  const int64_t* data;
  int rank;
  int64_t operator[](int i) const { return data[i]; }
};

// Validates the operands, result and attributes of a call in `layout` and decodes them. Returns
// "" on success, else what is wrong. `directions` receives the directions of a directional pass
// (it must be given for those, and is left alone for the others).
inline std::string make_grid_sample_call(GridSamplePass pass, GridSampleLayout layout,
                                         const DimsView* operands,
                                         int operand_count, DimsView result, int64_t mode,
                                         int64_t padding, bool align_corners,
                                         const int64_t* batch_maps, int64_t batch_map_count,
                                         GridSampleCall* call,
                                         GridSampleDirections* directions = nullptr) {
  const int base_count = base_operand_count(pass);
  const int direction_count = operand_count - base_count;
  if (!is_directional(pass)) {
    if (operand_count != base_count) return "wrong operand count";
  } else {
    if (directions == nullptr) return "directional pass decoded without its directions";
    if (direction_count < 1 || direction_count > max_directions(pass))
      return max_directions(pass) == 1
                 ? "expected one direction operand (u) after dout, input and grid, got " +
                       std::to_string(direction_count)
                 : "expected one or two direction operands (u[, v]) after the pass's operands, "
                   "got " +
                       std::to_string(direction_count);
  }
  if (batch_map_count != 2 * operand_count)
    return "batch_maps must hold (repeat, chunk) per operand";
  const GridSamplePass base = base_pass(pass);
  GridSampleCall c;
  if (mode != int64_t(GridSampleMode::kBilinear) && mode != int64_t(GridSampleMode::kNearest) &&
      mode != int64_t(GridSampleMode::kBicubic))
    return "unknown interpolation mode";
  c.mode = GridSampleMode(mode);
  const DimsView grid = operands[base_count - 1];
  const DimsView* dout = base == GridSamplePass::kForward ? nullptr : &operands[0];
  // The cells' shape: the input, or the d_input result.
  const DimsView sampled = base == GridSamplePass::kForward         ? operands[0]
                           : base == GridSamplePass::kBackwardInput ? result
                                                                     : operands[1];
  const int64_t batch = result.rank > 0 ? result[0] : -1;
  const std::string problem =
      make_grid_sample_geometry(layout, sampled.data, sampled.rank, grid.data, grid.rank, batch,
                                GridSamplePadding(padding), align_corners, &c.geometry);
  if (!problem.empty()) return problem;
  const GridSampleGeometry& g = c.geometry;
  if (c.mode == GridSampleMode::kBicubic && g.dims != 2) return "bicubic needs a 4-D input";
  // Output points' shape [Ho, Wo] (or [Do, Ho, Wo]) as in the grid.
  const auto same_points = [&](const DimsView& v, int first) {
    for (int d = 0; d < g.dims; ++d)
      if (v[first + d] != grid[1 + d]) return false;
    return true;
  };
  const int rank = g.dims + 2;
  const int channel = channel_axis(layout, rank), spatial = first_spatial_axis(layout);
  if (result.rank != rank) return "result rank is wrong";
  if (base == GridSamplePass::kForward &&
      (result[channel] != g.channels || !same_points(result, spatial)))
    return "output shape does not match input and grid";
  if (base == GridSamplePass::kBackwardGrid &&
      (!same_points(result, 1) || result[rank - 1] != g.dims))
    return "d_grid shape does not match the grid";
  if (dout != nullptr &&
      (dout->rank != rank || (*dout)[channel] != g.channels || !same_points(*dout, spatial)))
    return "dout shape does not match input and grid";
  for (int k = base_count; k < operand_count; ++k)
    if (operands[k].rank != rank || !same_points(operands[k], 1) ||
        operands[k][rank - 1] != g.dims)
      return "direction shape does not match the grid's (per batch row)";
  BatchMap maps[kMaxGridSampleOperands];
  for (int k = 0; k < operand_count; ++k) {
    maps[k] = BatchMap{batch_maps[2 * k], batch_maps[2 * k + 1]};
    if (!batch_map_fits(maps[k], operands[k][0], batch))
      return "batch_maps do not fit the operands' batch dimensions";
  }
  switch (base) {
    case GridSamplePass::kForward:
      c.input_map = maps[0];
      c.grid_map = maps[1];
      break;
    case GridSamplePass::kBackwardInput:
      c.dout_map = maps[0];
      c.grid_map = maps[1];
      break;
    default:
      c.dout_map = maps[0];
      c.input_map = maps[1];
      c.grid_map = maps[2];
      break;
  }
  if (is_directional(pass)) {
    GridSampleDirections d;
    d.count = direction_count;
    for (int k = 0; k < direction_count; ++k) d.map[k] = maps[base_count + k];
    *directions = d;
  }
  *call = c;
  return "";
}

// ---- host side: decoding an FFI call and choosing a kernel instantiation ----------------------

// Every grid_sample target takes these attributes (decoded with .Attrs<GridSampleAttrs>()).
// `deterministic` chooses between the CUDA d_input paths; the other passes have one path (the
// directional d_input pass is always deterministic and ignores it).
struct GridSampleAttrs {
  int64_t mode;     // GridSampleMode
  int64_t padding;  // GridSamplePadding
  bool align_corners;
  ffi::Span<const int64_t> batch_maps;  // (repeat, chunk) per operand, in operand order
  bool deterministic;
};

// Decodes and validates a call of `pass` in `layout` on `count` operands; every operand and the
// result share one element type. `directions` as in make_grid_sample_call.
inline ffi::Error decode_grid_sample_call(const char* op, GridSamplePass pass,
                                          GridSampleLayout layout,
                                          const ffi::AnyBuffer* const* operands, int count,
                                          const ffi::AnyBuffer& result,
                                          const GridSampleAttrs& attrs, GridSampleCall* call,
                                          GridSampleDirections* directions = nullptr) {
  const auto dims_of = [](const ffi::AnyBuffer& buffer) {
    return DimsView{buffer.dimensions().begin(), int(buffer.dimensions().size())};
  };
  if (count > kMaxGridSampleOperands)
    return ffi::Error::InvalidArgument(std::string(op) + ": too many operands");
  DimsView dims[kMaxGridSampleOperands];
  for (int k = 0; k < count; ++k) {
    if (operands[k]->element_type() != result.element_type())
      return ffi::Error::InvalidArgument(std::string(op) +
                                         ": operands and result differ in element type");
    dims[k] = dims_of(*operands[k]);
  }
  const std::string problem =
      make_grid_sample_call(pass, layout, dims, count, dims_of(result), attrs.mode, attrs.padding,
                            attrs.align_corners, attrs.batch_maps.begin(),
                            int64_t(attrs.batch_maps.size()), call, directions);
  if (!problem.empty()) return ffi::Error::InvalidArgument(std::string(op) + ": " + problem);
  return ffi::Error::Success();
}

inline ffi::Error decode_grid_sample_call(const char* op, GridSamplePass pass,
                                          GridSampleLayout layout,
                                          std::initializer_list<const ffi::AnyBuffer*> operands,
                                          const ffi::AnyBuffer& result,
                                          const GridSampleAttrs& attrs, GridSampleCall* call) {
  return decode_grid_sample_call(op, pass, layout, operands.begin(), int(operands.size()), result, attrs,
                                 call);
}

// The data of a directional call's direction operands (u, then v; null where absent) and the
// most elements any of them has (for the choice of index width).
struct DirectionOperands {
  const void* data[2] = {nullptr, nullptr};
  int64_t elements = 0;
};

// Decodes and validates a call of directional `pass`: its base pass's operands, then the
// directions, which the handler binds as remaining arguments.
inline ffi::Error decode_grid_sample_directional_call(
    const char* op, GridSamplePass pass, GridSampleLayout layout,
    std::initializer_list<const ffi::AnyBuffer*> base,
    const ffi::RemainingArgs& rest, const ffi::AnyBuffer& result, const GridSampleAttrs& attrs,
    GridSampleCall* call, GridSampleDirections* directions, DirectionOperands* data) {
  const int count = int(base.size()) + int(rest.size());
  if (int(rest.size()) > max_directions(pass) || count > kMaxGridSampleOperands)
    return ffi::Error::InvalidArgument(std::string(op) + ": expected at most " +
                                       std::to_string(max_directions(pass)) +
                                       " direction operands, got " +
                                       std::to_string(rest.size()));
  std::optional<ffi::AnyBuffer> buffers[kMaxGridSampleOperands];
  const ffi::AnyBuffer* operands[kMaxGridSampleOperands];
  int k = 0;
  for (const ffi::AnyBuffer* operand : base) operands[k++] = operand;
  for (size_t i = 0; i < rest.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> buffer = rest.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value())
      return ffi::Error::InvalidArgument(std::string(op) + ": direction operand " +
                                         std::to_string(i) + " is not a buffer");
    buffers[i].emplace(*buffer);
    operands[k++] = &*buffers[i];
  }
  if (auto error = decode_grid_sample_call(op, pass, layout, operands, count, result, attrs, call,
                                           directions);
      error.failure())
    return error;
  DirectionOperands d;
  for (int i = 0; i < directions->count; ++i) {
    d.data[i] = buffers[i]->untyped_data();
    d.elements = std::max<int64_t>(d.elements, int64_t(buffers[i]->element_count()));
  }
  *data = d;
  return ffi::Error::Success();
}

// Calls f(std::integral_constant<GridSampleMode, mode>{}, std::integral_constant<int, dims>{})
// for the sampler of a decoded call (bicubic exists in 2-D only).
template <class F>
void dispatch_grid_sampler(GridSampleMode mode, int dims, F&& f) {
  using M = GridSampleMode;
  using Bilinear = std::integral_constant<M, M::kBilinear>;
  using Nearest = std::integral_constant<M, M::kNearest>;
  using Bicubic = std::integral_constant<M, M::kBicubic>;
  using Two = std::integral_constant<int, 2>;
  using Three = std::integral_constant<int, 3>;
  if (mode == M::kBilinear && dims == 2) f(Bilinear{}, Two{});
  if (mode == M::kBilinear && dims == 3) f(Bilinear{}, Three{});
  if (mode == M::kNearest && dims == 2) f(Nearest{}, Two{});
  if (mode == M::kNearest && dims == 3) f(Nearest{}, Three{});
  if (mode == M::kBicubic && dims == 2) f(Bicubic{}, Two{});
}

// dispatch_grid_sampler without nearest sampling, whose weights have no derivatives (the
// directional passes write zeros for it without instantiating a kernel).
template <class F>
void dispatch_differentiable_sampler(GridSampleMode mode, int dims, F&& f) {
  dispatch_grid_sampler(mode, dims, [&](auto mode_c, auto dims_c) {
    if constexpr (decltype(mode_c)::value != GridSampleMode::kNearest) f(mode_c, dims_c);
  });
}

}  // namespace jax_kernels

// Registers the decoding of GridSampleAttrs for `.Attrs<GridSampleAttrs>()` (once per source
// file, at global scope).
#define JK_GRID_SAMPLE_REGISTER_ATTRS()                                                      \
  XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(                                                     \
      ::jax_kernels::GridSampleAttrs, ::xla::ffi::StructMember<int64_t>("mode"),             \
      ::xla::ffi::StructMember<int64_t>("padding"),                                          \
      ::xla::ffi::StructMember<bool>("align_corners"),                                       \
      ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("batch_maps"),               \
      ::xla::ffi::StructMember<bool>("deterministic"))
