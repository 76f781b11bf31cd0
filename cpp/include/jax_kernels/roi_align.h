// roi_align math (torchvision.ops.roi_align semantics), host and device: the static problem, the
// geometry of one box (bin sizes, sample grid, sample positions), the bilinear weights of one
// sample along one axis, the derivatives of sample positions with respect to the box
// coordinates, the search for the samples that can reach a range of input rows or columns, and
// the per-bin weights of one input row or column that the input gradient is built from.
//
// A box's samples are separable: sample (ty, tx) sits at (y(ty), x(tx)), where
// ty = ph * grid_h + iy indexes the samples of all bins along y, and the bilinear weight of input
// cell (h, w) is the product of a row weight and a column weight. Every function works in the
// accumulation type A.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "jax_kernels/ffi_util.h"
#include "jax_kernels/scalar.h"

// Unrolls the fixed-length channel loops in device code (the host compiler chooses for itself).
#if defined(__CUDA_ARCH__)
#define ROI_ALIGN_UNROLL _Pragma("unroll")
#else
#define ROI_ALIGN_UNROLL
#endif

namespace jax_kernels {

// Upper bound of the adaptive sample grid (sampling_ratio <= 0) per axis and bin: only boxes larger
// than 2^20 output bins' worth of pixels reach it. Whatever the grid, only the samples that can lie
// inside the input are visited (see RoiAxis::candidates), so a box costs at most about
// (2 H + 3 PH + 9) x (2 W + 3 PW + 9) samples.
constexpr int64_t kRoiAlignMaxAdaptiveGrid = int64_t(1) << 20;

// Upper bound of a fixed sample grid (sampling_ratio > 0) per axis and bin. A fixed grid costs
// PH x PW x sampling_ratio^2 samples per box and channel wherever the box lies, so the bound is
// what keeps the cost of an option number in proportion to the tensors (4096 samples per bin at
// most, about what an adaptive grid spends on bins of 64 x 64 pixels).
constexpr int64_t kRoiAlignMaxFixedGrid = 64;

// How boxes map to images. Unbatched, box k reads image `batch_index` (an integer in [0, images)).
// Each vmap that the Python folds into the input's N axis adds a term: box k then reads image
//   batch_index + sum over terms of ((k / divisor) % modulus) * stride,
// where divisor is the box count and stride the image count before that fold, and modulus the
// mapped axis size; folds of the boxes alone leave the terms as they are.
constexpr int kRoiAlignMaxBatchTerms = 8;

struct RoiAlignBatching {
  int64_t images = 0;
  int terms = 0;
  int64_t divisor[kRoiAlignMaxBatchTerms] = {};
  int64_t modulus[kRoiAlignMaxBatchTerms] = {};
  int64_t stride[kRoiAlignMaxBatchTerms] = {};

  JK_HD int64_t image_offset(int64_t k) const {
    int64_t offset = 0;
    for (int i = 0; i < terms; ++i) offset += ((k / divisor[i]) % modulus[i]) * stride[i];
    return offset;
  }
};

struct RoiAlignProblem {
  int64_t N, C, H, W;  // input [N, C, H, W]
  int64_t K;           // boxes [K, 5]
  int64_t PH, PW;      // output [K, C, PH, PW]
  double spatial_scale;
  int64_t sampling_ratio;  // > 0: fixed grid per bin; <= 0: adaptive ceil(roi size / bins)
  bool aligned;
  RoiAlignBatching batching;

  JK_HD int64_t bins() const { return PH * PW; }
};

// The memory layouts of a call (data_format): where an element lies in the image-side tensors
// (the input and its gradient, [N, C, H, W] or [N, H, W, C]) and the bin-side tensors (the
// output and its gradient, [K, C, PH, PW] or [K, PH, PW, C]). Element (channel c, cell
// o = h * W + w) of an image lies c * channel_stride + o * cell_stride elements past the image's
// first element, element (channel c, bin b) of a box c * binned_channel_stride + b * bin_stride
// past the box's; images are C * H * W and boxes C * PH * PW elements apart in both layouts.
// The handlers and kernels are templates on the layout, so that the math below is written once;
// the strides of NCHW's cells and bins are the constant 1.
struct RoiAlignNCHW {
  static constexpr bool kChannelsLast = false;
  JK_HD static int64_t channel_stride(const RoiAlignProblem& p) { return p.H * p.W; }
  JK_HD static constexpr int64_t cell_stride(const RoiAlignProblem&) { return 1; }
  JK_HD static int64_t binned_channel_stride(const RoiAlignProblem& p) { return p.bins(); }
  JK_HD static constexpr int64_t bin_stride(const RoiAlignProblem&) { return 1; }
};

struct RoiAlignNHWC {
  static constexpr bool kChannelsLast = true;
  JK_HD static constexpr int64_t channel_stride(const RoiAlignProblem&) { return 1; }
  JK_HD static int64_t cell_stride(const RoiAlignProblem& p) { return p.C; }
  JK_HD static constexpr int64_t binned_channel_stride(const RoiAlignProblem&) { return 1; }
  JK_HD static int64_t bin_stride(const RoiAlignProblem& p) { return p.C; }
};

// The bilinear footprint of one sample along one axis: indices low/high (equal at the far edge)
// with weights w_low/w_high, and slope = d w_high / d position (1 inside, 0 where the position is
// clamped to the first or last index, where the value does not move with the position).
template <class A>
struct AxisSample {
  int64_t low, high;
  A w_low, w_high;
  A slope;
  bool valid;  // torchvision drops samples outside [-1, size]; NaN positions are outside too

  // Weight of input index i (the two terms coincide at the clamped far edge, where w_high is 0).
  JK_HD A weight_of(int64_t i) const {
    return (i == low ? w_low : A(0)) + (i == high ? w_high : A(0));
  }
};

template <class A>
JK_HD AxisSample<A> axis_sample(A position, int64_t size) {
  AxisSample<A> s{0, 0, A(0), A(0), A(0), false};
  // Written as "inside" so that NaN fails it.
  if (!(position >= A(-1) && position <= A(size))) return s;
  s.valid = true;
  A p = position;
  s.slope = A(1);
  if (p <= A(0)) {
    p = A(0);
    s.slope = A(0);
  }
  s.low = int64_t(p);
  if (s.low >= size - 1) {
    s.low = s.high = size - 1;
    p = A(s.low);
    s.slope = A(0);
  } else {
    s.high = s.low + 1;
  }
  s.w_high = p - A(s.low);
  s.w_low = A(1) - s.w_high;
  return s;
}

// One axis of a box: `bins` bins of size `bin` from `start`, `grid` samples per bin.
template <class A>
struct RoiAxis {
  A start;
  A bin;
  int64_t grid;  // 0: no samples (adaptive grid of an empty or NaN box)
  int64_t bins;
  A scale;            // spatial_scale: d start / d first coordinate
  bool size_clamped;  // aligned=False and the size was raised to 1: it no longer follows the box
  // For candidates(): whether start and bin are finite (else every position is NaN or infinite),
  // grid / bin (0 when bin is 0: every sample sits at start), and the rounding margin of the
  // positions (at most one pixel).
  bool finite;
  double inverse_step, margin;
  // Input indices that samples can give weight to; the whole axis unless narrow_span() ran.
  int64_t span_first, span_last;

  JK_HD int64_t samples() const { return bins * grid; }

  // Position of sample t = b * grid + sub, in torchvision's order of operations.
  JK_HD A position(int64_t t) const {
    const int64_t b = t / grid;
    return position_in_bin(b, t - b * grid);
  }
  JK_HD A position_in_bin(int64_t b, int64_t sub) const {
    return start + A(b) * bin + A(float(sub) + 0.5f) * bin / A(grid);
  }

  // Fraction of the box from its first edge to sample t: position = start + size * fraction.
  JK_HD A fraction(int64_t t) const {
    const int64_t b = t / grid;
    const int64_t sub = t - b * grid;
    return (A(b) + (A(sub) + A(0.5)) / A(grid)) / A(bins);
  }
  // d position / d first coordinate (x1 or y1) and d position / d second coordinate (x2 or y2),
  // with the grid held fixed.
  JK_HD A d_first(int64_t t) const { return size_clamped ? scale : scale * (A(1) - fraction(t)); }
  JK_HD A d_second(int64_t t) const { return size_clamped ? A(0) : scale * fraction(t); }

  // The samples t in [t_begin, t_end) whose position can lie in [lo, hi], as [*first, *last): the
  // affine sample map inverted in double precision, widened by the rounding margin and one sample
  // on each side. A superset: callers test each candidate. The count is at most about
  // (hi - lo + 2) / |bin / grid| + 3, which keeps every loop over candidates short whatever the
  // box: adaptive grids have a spacing of at least 1/2 pixel.
  JK_HD void candidates(A lo, A hi, int64_t t_begin, int64_t t_end, int64_t* first,
                        int64_t* last) const {
    *first = *last = t_begin;
    if (grid <= 0 || t_begin >= t_end || !finite) return;
    const double s = double(start);
    const double lo_d = double(lo) - margin, hi_d = double(hi) + margin;
    double u_min, u_max;
    if (inverse_step == 0.0) {
      if (!(s >= lo_d && s <= hi_d)) return;
      u_min = double(t_begin);
      u_max = double(t_end);
    } else {
      const double u0 = (lo_d - s) * inverse_step - 0.5, u1 = (hi_d - s) * inverse_step - 0.5;
      u_min = std::floor(u0 < u1 ? u0 : u1) - 1.0;
      u_max = std::ceil(u0 < u1 ? u1 : u0) + 2.0;  // exclusive
    }
    u_min = u_min > double(t_begin) ? u_min : double(t_begin);
    u_max = u_max < double(t_end) ? u_max : double(t_end);
    if (!(u_min < u_max)) return;
    *first = int64_t(u_min);
    *last = int64_t(u_max);
  }
};

template <class A>
struct RoiBox {
  int64_t image;  // input image of the box, -1 when the batch index is not an integer in range
  RoiAxis<A> y, x;
  A count;  // samples per bin, at least 1: the output is their sum over count
};

// Image read by box k whose batch-index column holds `batch`: torchvision's int(batch), the
// value truncated toward zero (0.7 -> 0, -0.5 -> 0), if that lies in [0, batching.images) and the
// image exists; else -1 (NaN and infinities too).
template <class A>
JK_HD int64_t roi_image(A batch, int64_t k, const RoiAlignProblem& p) {
  if (p.H <= 0 || p.W <= 0) return -1;  // nothing to sample
  if (!(batch > A(-1) && batch < A(p.batching.images))) return -1;
  const int64_t index = int64_t(batch);  // truncation toward zero, in range by the test above
  const int64_t image = index + p.batching.image_offset(k);
  return image < p.N ? image : -1;
}

template <class A>
JK_HD RoiAxis<A> roi_axis(A first, A second, int64_t bins, int64_t extent,
                          const RoiAlignProblem& p) {
  RoiAxis<A> axis;
  axis.scale = A(p.spatial_scale);
  axis.bins = bins;
  // torchvision subtracts the half-pixel offset from both ends and takes their difference.
  const A offset = p.aligned ? A(0.5) : A(0);
  axis.start = first * axis.scale - offset;
  A size = (second * axis.scale - offset) - axis.start;
  axis.size_clamped = !p.aligned && size < A(1);  // NaN stays NaN: the box then samples nothing
  if (axis.size_clamped) size = A(1);
  axis.bin = size / A(bins);
  if (p.sampling_ratio > 0) {
    axis.grid = p.sampling_ratio;
  } else {
    const A grid = std::ceil(size / A(bins));
    axis.grid = grid >= A(1) ? (grid < A(kRoiAlignMaxAdaptiveGrid) ? int64_t(grid)
                                                                    : kRoiAlignMaxAdaptiveGrid)
                             : 0;
  }
  const double s = double(axis.start), b = double(axis.bin);
  axis.finite = std::isfinite(s) && std::isfinite(b);
  axis.inverse_step = axis.finite && b != 0.0 ? double(axis.grid) / b : 0.0;
  const double margin = 16.0 * double(std::numeric_limits<A>::epsilon()) *
                        (std::fabs(s) + std::fabs(b) * double(bins + 1));
  axis.margin = margin < 1.0 ? margin : 1.0;
  axis.span_first = 0;
  axis.span_last = extent - 1;
  return axis;
}

// Geometry of box k from its row (batch_index, x1, y1, x2, y2).
template <class T>
JK_HD RoiBox<acc_t<T>> roi_box(const T* boxes, int64_t k, const RoiAlignProblem& p) {
  using A = acc_t<T>;
  const T* row = boxes + 5 * k;
  RoiBox<A> box;
  box.image = roi_image(to_acc(row[0]), k, p);
  box.x = roi_axis(to_acc(row[1]), to_acc(row[3]), p.PW, p.W, p);
  box.y = roi_axis(to_acc(row[2]), to_acc(row[4]), p.PH, p.H, p);
  const int64_t count = box.y.grid * box.x.grid;
  box.count = A(count > 0 ? count : 1);
  return box;
}

// Candidate samples of bin `b` along `axis` that can lie inside an input extent of `size`.
template <class A>
JK_HD void bin_candidates(const RoiAxis<A>& axis, int64_t b, int64_t size, int64_t* first,
                          int64_t* last) {
  axis.candidates(A(-1), A(size), b * axis.grid, (b + 1) * axis.grid, first, last);
}

// Candidate samples (over all bins) that can touch input index i along `axis`: a sample touches i
// only if its position lies in [i - 1, i + 1] (clamping maps [-1, 0] to 0 and [size - 1, size]
// to size - 1, both inside that interval).
template <class A>
JK_HD void index_candidates(const RoiAxis<A>& axis, int64_t i, int64_t* first, int64_t* last) {
  axis.candidates(A(i - 1), A(i + 1), 0, axis.samples(), first, last);
}

// Narrows axis.span_first/span_last to the indices that valid samples can give weight to:
// positions grow (or fall) with the sample index, so the first and the last valid candidates bound
// them, widened by one index against rounding. An axis without valid samples gets an empty span.
template <class A>
JK_HD void narrow_span(RoiAxis<A>& axis, int64_t extent) {
  int64_t t0, t1;
  axis.candidates(A(-1), A(extent), 0, axis.samples(), &t0, &t1);
  int64_t first = extent, last = -1;
  for (int64_t t = t0; t < t1; ++t) {
    const AxisSample<A> s = axis_sample(axis.position(t), extent);
    if (!s.valid) continue;
    first = s.low < first ? s.low : first;
    last = s.high > last ? s.high : last;
    break;
  }
  for (int64_t t = t1 - 1; t >= t0; --t) {
    const AxisSample<A> s = axis_sample(axis.position(t), extent);
    if (!s.valid) continue;
    first = s.low < first ? s.low : first;
    last = s.high > last ? s.high : last;
    break;
  }
  axis.span_first = first > 0 ? first - 1 : 0;
  axis.span_last = last < extent - 1 ? last + 1 : extent - 1;
  if (last < 0) axis.span_first = extent, axis.span_last = -1;
}

// The geometry of box k for the input gradient's gather: spans narrowed to the rows and columns
// that its samples touch.
template <class T>
JK_HD RoiBox<acc_t<T>> roi_box_with_spans(const T* boxes, int64_t k, const RoiAlignProblem& p) {
  RoiBox<acc_t<T>> box = roi_box(boxes, k, p);
  narrow_span(box.y, p.H);
  narrow_span(box.x, p.W);
  return box;
}

// ---- sample loops shared by every pass on both backends -----------------------------------------

// The candidate samples of bin `bin` (= ph * PW + pw): rows [ty0, ty1) and columns [tx0, tx1)
// of the box's sample grid (global indices: ty = ph * grid_h + iy).
struct BinCandidates {
  int64_t ph, pw, ty0, ty1, tx0, tx1;
};

template <class A>
JK_HD BinCandidates bin_sample_candidates(const RoiBox<A>& box, int64_t bin,
                                          const RoiAlignProblem& p) {
  BinCandidates c;
  c.ph = bin / p.PW;
  c.pw = bin - c.ph * p.PW;
  bin_candidates(box.y, c.ph, p.H, &c.ty0, &c.ty1);
  bin_candidates(box.x, c.pw, p.W, &c.tx0, &c.tx1);
  return c;
}

// Calls f(ty, sy, tx, sx) for every valid sample among the candidates c of a bin, rows outer and
// columns inner, each in ascending order.
template <class A, class F>
JK_HD void for_each_bin_sample(const RoiBox<A>& box, const BinCandidates& c,
                               const RoiAlignProblem& p, F&& f) {
  for (int64_t ty = c.ty0; ty < c.ty1; ++ty) {
    const AxisSample<A> sy =
        axis_sample(box.y.position_in_bin(c.ph, ty - c.ph * box.y.grid), p.H);
    if (!sy.valid) continue;
    for (int64_t tx = c.tx0; tx < c.tx1; ++tx) {
      const AxisSample<A> sx =
          axis_sample(box.x.position_in_bin(c.pw, tx - c.pw * box.x.grid), p.W);
      if (sx.valid) f(ty, sy, tx, sx);
    }
  }
}

// The same for bin `bin` (= ph * PW + pw).
template <class A, class F>
JK_HD void for_each_bin_sample(const RoiBox<A>& box, int64_t bin, const RoiAlignProblem& p, F&& f) {
  for_each_bin_sample(box, bin_sample_candidates(box, bin, p), p, f);
}

// Calls f(t, weight) for every sample t along `axis` that gives input index i a nonzero weight,
// in ascending t.
template <class A, class F>
JK_HD void for_each_index_sample(const RoiAxis<A>& axis, int64_t i, int64_t extent, F&& f) {
  if (i < axis.span_first || i > axis.span_last) return;
  int64_t t0, t1;
  index_candidates(axis, i, &t0, &t1);
  for (int64_t t = t0; t < t1; ++t) {
    const AxisSample<A> s = axis_sample(axis.position(t), extent);
    const A weight = s.valid ? s.weight_of(i) : A(0);
    if (weight != A(0)) f(t, weight);
  }
}

// Calls f(bin, weight) for every bin of `axis` whose valid samples give input index i a nonzero
// weight, in ascending bin order; weight is the sum of those samples' weights at i, added in
// ascending sample order. The input gradient of cell (h, w) from one box is the sum over its
// (row bin, row weight) pairs at h and (column bin, column weight) pairs at w of
// input_gradient_term(dout[box, c, row bin * PW + column bin], input_gradient_weight(
// input_gradient_row_weight(box, row weight), column weight)).
template <class A, class F>
JK_HD void for_each_index_bin(const RoiAxis<A>& axis, int64_t i, int64_t extent, F&& f) {
  int64_t bin = -1;
  A weight = A(0);
  for_each_index_sample(axis, i, extent, [&](int64_t t, A w) {
    const int64_t b = t / axis.grid;
    if (b != bin) {
      if (bin >= 0) f(bin, weight);
      bin = b;
      weight = A(0);
    }
    weight += w;
  });
  if (bin >= 0) f(bin, weight);
}

// The weight of one term of an input-gradient cell: its row bin weight over the box's sample
// count, times its column bin weight.
template <class A>
JK_HD A input_gradient_row_weight(const RoiBox<A>& box, A row_bin_weight) {
  return row_bin_weight / box.count;
}
template <class A>
JK_HD A input_gradient_weight(A row_weight, A column_weight) {
  return row_weight * column_weight;
}

// One term of an input-gradient cell: the output gradient of a bin times its weight. Both backends
// add these terms per cell with boxes in index order, then row bins, then column bins in
// ascending order.
template <class T, class A>
JK_HD A input_gradient_term(T dout, A weight) {
  return to_acc(dout) * weight;
}

// The bilinear weights of a sample from its footprints along y and x: torchvision's
// w1 = hy hx, w2 = hy lx, w3 = ly hx, w4 = ly lx.
template <class A>
struct BilinearWeights {
  A w1, w2, w3, w4;
};

template <class A>
JK_HD BilinearWeights<A> bilinear_weights(const AxisSample<A>& sy, const AxisSample<A>& sx) {
  return BilinearWeights<A>{sy.w_low * sx.w_low, sy.w_low * sx.w_high, sy.w_high * sx.w_low,
                            sy.w_high * sx.w_high};
}

// The four taps of a sample in a channel plane with the weights of bilinear_weights; the offsets
// count cells (h * W + w) times `cell_stride` (the layout's: a "plane" is then channel c's first
// element, and plane[offset] the tap in that channel). value() adds the four products in the
// order of every pass and backend (the CPU forward's vector loops, cpu/roi_align_loops.inc, too).
template <class A>
struct BilinearTaps {
  int64_t o1, o2, o3, o4;
  A w1, w2, w3, w4;

  template <class T>
  JK_HD A value(const T* plane) const {
    return w1 * to_acc(plane[o1]) + w2 * to_acc(plane[o2]) + w3 * to_acc(plane[o3]) +
           w4 * to_acc(plane[o4]);
  }
};

template <class A>
JK_HD BilinearTaps<A> bilinear_taps(const AxisSample<A>& sy, const AxisSample<A>& sx, int64_t W,
                                    int64_t cell_stride = 1) {
  const int64_t low = sy.low * W, high = sy.high * W;
  const BilinearWeights<A> w = bilinear_weights(sy, sx);
  return BilinearTaps<A>{(low + sx.low) * cell_stride,  (low + sx.high) * cell_stride,
                         (high + sx.low) * cell_stride, (high + sx.high) * cell_stride,
                         w.w1, w.w2, w.w3, w.w4};
}

// d value / d y and d value / d x of a sample in a channel plane, without the clamping slopes
// (sy.slope, sx.slope), which callers apply once after summing over channels.
template <class T, class A>
JK_HD void value_gradient(const BilinearTaps<A>& t, const AxisSample<A>& sy,
                          const AxisSample<A>& sx, const T* plane, A* along_y, A* along_x) {
  const A v1 = to_acc(plane[t.o1]), v2 = to_acc(plane[t.o2]);
  const A v3 = to_acc(plane[t.o3]), v4 = to_acc(plane[t.o4]);
  *along_y = sx.w_low * (v3 - v1) + sx.w_high * (v4 - v2);
  *along_x = sy.w_low * (v2 - v1) + sy.w_high * (v4 - v3);
}

// ---- one work item of each pass, the same on both backends -------------------------------------
// kChannels is the channel chunk of an item: the sample geometry is computed once per item and
// reused over `channels` (<= kChannels) consecutive channels. Layout (RoiAlignNCHW or
// RoiAlignNHWC) places the channels: `planes` points at the item's first channel of the box's
// image, `box_dout` at the item's first channel of the box's output gradient.

// Forward: acc[c] += sum over the valid samples of bin `bin` of the bilinear value in channel c
// of the item (the caller divides by box.count).
template <int kChannels, class Layout, class T, class A>
JK_HD void accumulate_bin(const RoiBox<A>& box, int64_t bin, const T* planes, int64_t channels,
                          const RoiAlignProblem& p, A (&acc)[kChannels]) {
  const int64_t plane = Layout::channel_stride(p);
  for_each_bin_sample(box, bin, p, [&](int64_t, const AxisSample<A>& sy, int64_t,
                                       const AxisSample<A>& sx) {
    const BilinearTaps<A> taps = bilinear_taps(sy, sx, p.W, Layout::cell_stride(p));
ROI_ALIGN_UNROLL
    for (int c = 0; c < kChannels; ++c)
      if (c < channels) acc[c] += taps.value(planes + c * plane);
  });
}

// Box gradient: d[0..3] += d (sum over the channels of dout * output) / d (x1, y1, x2, y2), before
// the division by box.count, for bin `bin`; box_dout points at the item's first channel of
// dout[box] and planes at its first channel of the box's image.
template <int kChannels, class Layout, class T, class A>
JK_HD void accumulate_box_gradient(const RoiBox<A>& box, int64_t bin, const T* box_dout,
                                   const T* planes, int64_t channels, const RoiAlignProblem& p,
                                   double (&d)[4]) {
  const int64_t binned = Layout::binned_channel_stride(p), plane = Layout::channel_stride(p);
  const T* bin_dout = box_dout + bin * Layout::bin_stride(p);
  A grad[kChannels];
ROI_ALIGN_UNROLL
  for (int c = 0; c < kChannels; ++c)
    grad[c] = c < channels ? to_acc(bin_dout[c * binned]) : A(0);
  for_each_bin_sample(box, bin, p, [&](int64_t ty, const AxisSample<A>& sy, int64_t tx,
                                       const AxisSample<A>& sx) {
    const BilinearTaps<A> taps = bilinear_taps(sy, sx, p.W, Layout::cell_stride(p));
    A along_y = A(0), along_x = A(0);
ROI_ALIGN_UNROLL
    for (int c = 0; c < kChannels; ++c) {
      if (c < channels) {
        A dy, dx;
        value_gradient(taps, sy, sx, planes + c * plane, &dy, &dx);
        along_y += grad[c] * dy;
        along_x += grad[c] * dx;
      }
    }
    const double gy = double(sy.slope * along_y), gx = double(sx.slope * along_x);
    d[0] += gx * double(box.x.d_first(tx));
    d[1] += gy * double(box.y.d_first(ty));
    d[2] += gx * double(box.x.d_second(tx));
    d[3] += gy * double(box.y.d_second(ty));
  });
}

// ---- directional derivatives in the box coordinates ---------------------------------------------
// The directional passes differentiate the output along directions u (and v) of the box
// coordinates, rows shaped like the boxes' (batch_index, x1, y1, x2, y2) with the batch index
// ignored, under the box gradient's conventions: the sample grid held fixed, and a size clamped
// to 1 (aligned=False) not moving with the coordinates (RoiAxis::d_first / d_second). A sample at
// (y, x) then moves by dy = dy/dy1 u_y1 + dy/dy2 u_y2 and dx = dx/dx1 u_x1 + dx/dx2 u_x2, and its
// bilinear weight W = wy(y) wx(x), piecewise linear per axis with slopes +-AxisSample::slope,
// has the directional derivatives
//   order 1: wy' dy(u) wx + wy wx' dx(u)
//   order 2: wy' wx' (dy(u) dx(v) + dx(u) dy(v))   (wy'' = wx'' = 0 between the kinks).

// The coordinates of a direction row (x1, y1, x2, y2); its batch-index column is ignored.
template <class A>
struct RoiDirection {
  A x1, y1, x2, y2;
};

template <class T>
JK_HD RoiDirection<acc_t<T>> roi_direction(const T* rows, int64_t k) {
  const T* row = rows + 5 * k;
  return RoiDirection<acc_t<T>>{to_acc(row[1]), to_acc(row[2]), to_acc(row[3]), to_acc(row[4])};
}

// How far sample t of `axis` moves when its first coordinate moves by `first` and its second by
// `second` (grid held fixed).
template <class A>
JK_HD A axis_motion(const RoiAxis<A>& axis, int64_t t, A first, A second) {
  return axis.d_first(t) * first + axis.d_second(t) * second;
}

// The directions of one box in a directional pass: u alone (order 1) or u and v (order 2).
template <class A>
struct RoiDirectional {
  bool second_order;
  RoiDirection<A> u, v;  // v is unused (zero) at order 1

  JK_HD A dy_u(const RoiBox<A>& box, int64_t ty) const { return axis_motion(box.y, ty, u.y1, u.y2); }
  JK_HD A dx_u(const RoiBox<A>& box, int64_t tx) const { return axis_motion(box.x, tx, u.x1, u.x2); }
  JK_HD A dy_v(const RoiBox<A>& box, int64_t ty) const { return axis_motion(box.y, ty, v.y1, v.y2); }
  JK_HD A dx_v(const RoiBox<A>& box, int64_t tx) const { return axis_motion(box.x, tx, v.x1, v.x2); }
};

// The directions of box k: rows of u, and of v when `v` is not null (order 2).
template <class T>
JK_HD RoiDirectional<acc_t<T>> roi_directional(const T* u, const T* v, int64_t k) {
  using A = acc_t<T>;
  RoiDirectional<A> d;
  d.second_order = v != nullptr;
  d.u = roi_direction(u, k);
  d.v = v != nullptr ? roi_direction(v, k) : RoiDirection<A>{A(0), A(0), A(0), A(0)};
  return d;
}

// The directional weights of the four taps of sample (ty, tx), in bilinear_taps' order
// (w1 = (low y, low x), w2 = (low y, high x), w3 = (high y, low x), w4 = (high y, high x)); the
// low index's weight has slope -slope, the high index's +slope.
template <class A>
JK_HD BilinearTaps<A> directional_taps(const RoiBox<A>& box, const RoiDirectional<A>& d,
                                       int64_t ty, const AxisSample<A>& sy, int64_t tx,
                                       const AxisSample<A>& sx, int64_t W, int64_t cell_stride) {
  BilinearTaps<A> t = bilinear_taps(sy, sx, W, cell_stride);
  if (d.second_order) {
    const A mixed = sy.slope * sx.slope *
                    (d.dy_u(box, ty) * d.dx_v(box, tx) + d.dx_u(box, tx) * d.dy_v(box, ty));
    t.w1 = mixed;
    t.w2 = -mixed;
    t.w3 = -mixed;
    t.w4 = mixed;
  } else {
    const A my = sy.slope * d.dy_u(box, ty), mx = sx.slope * d.dx_u(box, tx);
    t.w1 = -my * sx.w_low - sy.w_low * mx;
    t.w2 = -my * sx.w_high + sy.w_low * mx;
    t.w3 = my * sx.w_low - sy.w_high * mx;
    t.w4 = my * sx.w_high + sy.w_high * mx;
  }
  return t;
}

// Forward directional: acc[c] += sum over the valid samples of bin `bin` of the directional
// value in channel c of the item (the caller divides by box.count), in accumulate_bin's order.
template <int kChannels, class Layout, class T, class A>
JK_HD void accumulate_bin_directional(const RoiBox<A>& box, const RoiDirectional<A>& d,
                                      int64_t bin, const T* planes, int64_t channels,
                                      const RoiAlignProblem& p, A (&acc)[kChannels]) {
  const int64_t plane = Layout::channel_stride(p);
  for_each_bin_sample(box, bin, p, [&](int64_t ty, const AxisSample<A>& sy, int64_t tx,
                                       const AxisSample<A>& sx) {
    const BilinearTaps<A> taps =
        directional_taps(box, d, ty, sy, tx, sx, p.W, Layout::cell_stride(p));
ROI_ALIGN_UNROLL
    for (int c = 0; c < kChannels; ++c)
      if (c < channels) acc[c] += taps.value(planes + c * plane);
  });
}

// Box gradient along u (the Hessian of sum(dout * output) in the box coordinates applied to u):
// d[0..3] += its (x1, y1, x2, y2) terms of bin `bin`, before the division by box.count. Between
// the kinks only the mixed second derivative of a bilinear weight survives, so per sample
// d/d(x1) = h dy(u) dx/dx1, d/d(y1) = h dx(u) dy/dy1, d/d(x2) = h dy(u) dx/dx2,
// d/d(y2) = h dx(u) dy/dy2 with h = wy' wx' (v1 - v2 - v3 + v4) summed with dout over channels.
template <int kChannels, class Layout, class T, class A>
JK_HD void accumulate_box_hessian(const RoiBox<A>& box, const RoiDirection<A>& u, int64_t bin,
                                  const T* box_dout, const T* planes, int64_t channels,
                                  const RoiAlignProblem& p, double (&d)[4]) {
  const int64_t binned = Layout::binned_channel_stride(p), plane = Layout::channel_stride(p);
  const T* bin_dout = box_dout + bin * Layout::bin_stride(p);
  A grad[kChannels];
ROI_ALIGN_UNROLL
  for (int c = 0; c < kChannels; ++c)
    grad[c] = c < channels ? to_acc(bin_dout[c * binned]) : A(0);
  for_each_bin_sample(box, bin, p, [&](int64_t ty, const AxisSample<A>& sy, int64_t tx,
                                       const AxisSample<A>& sx) {
    const BilinearTaps<A> taps = bilinear_taps(sy, sx, p.W, Layout::cell_stride(p));
    A mixed = A(0);
ROI_ALIGN_UNROLL
    for (int c = 0; c < kChannels; ++c) {
      if (c < channels) {
        const T* v = planes + c * plane;
        mixed += grad[c] * ((to_acc(v[taps.o1]) - to_acc(v[taps.o2])) -
                            (to_acc(v[taps.o3]) - to_acc(v[taps.o4])));
      }
    }
    const double h = double(sy.slope * sx.slope * mixed);
    const double dy = double(axis_motion(box.y, ty, u.y1, u.y2));
    const double dx = double(axis_motion(box.x, tx, u.x1, u.x2));
    d[0] += h * dy * double(box.x.d_first(tx));
    d[1] += h * dx * double(box.y.d_first(ty));
    d[2] += h * dy * double(box.x.d_second(tx));
    d[3] += h * dx * double(box.y.d_second(ty));
  });
}

// The input-gradient side. The directional weight of input cell (h, w) from a sample is a sum of
// two separable products, (row term p)(column term p) + (row term q)(column term q):
//   order 1: rows (wy' dy(u), wy),       columns (wx, wx' dx(u));
//   order 2: rows (wy' dy(v), wy' dy(u)), columns (wx' dx(u), wx' dx(v)).
// Each term is the weight w of the index or its slope w' times the axis motion of a direction
// (first, second): DirectionalTerm says which.
template <class A>
struct DirectionalTerm {
  bool slope;       // w' * motion, else w
  A first, second;  // the direction's coordinates along this axis (when slope)
};

// The two terms (p, q) of an axis.
template <class A>
struct DirectionalTerms {
  DirectionalTerm<A> p, q;
};

// The row (y) and column (x) terms of a box's directions.
template <class A>
JK_HD void directional_terms(const RoiDirectional<A>& d, DirectionalTerms<A>* rows,
                             DirectionalTerms<A>* columns) {
  if (d.second_order) {
    *rows = {{true, d.v.y1, d.v.y2}, {true, d.u.y1, d.u.y2}};
    *columns = {{true, d.u.x1, d.u.x2}, {true, d.v.x1, d.v.x2}};
  } else {
    *rows = {{true, d.u.y1, d.u.y2}, {false, A(0), A(0)}};
    *columns = {{false, A(0), A(0)}, {true, d.u.x1, d.u.x2}};
  }
}

// A pair of per-bin weights (p, q) of one input index.
template <class A>
struct DirectionalPair {
  A p, q;
};

// Calls f(bin, pair) for every bin of `axis` with a valid sample whose bilinear footprint
// includes input index i, in ascending bin order; pair sums the samples' terms at i in
// ascending sample order. Unlike for_each_index_bin, a sample whose weight at i is 0 but whose
// slope is not (a position exactly on i - 1 or i + 1) counts.
template <class A, class F>
JK_HD void for_each_directional_index_bin(const RoiAxis<A>& axis, const DirectionalTerms<A>& terms,
                                          int64_t i, int64_t extent, F&& f) {
  if (i < axis.span_first || i > axis.span_last) return;
  int64_t t0, t1;
  index_candidates(axis, i, &t0, &t1);
  int64_t bin = -1;
  DirectionalPair<A> pair{A(0), A(0)};
  for (int64_t t = t0; t < t1; ++t) {
    const AxisSample<A> s = axis_sample(axis.position(t), extent);
    if (!s.valid || (i != s.low && i != s.high)) continue;
    const A weight = s.weight_of(i);
    // d weight_of(i) / d position: +slope at high, -slope at low (0 where they coincide).
    const A slope = (i == s.high ? s.slope : A(0)) - (i == s.low ? s.slope : A(0));
    const A p = terms.p.slope ? slope * axis_motion(axis, t, terms.p.first, terms.p.second)
                              : weight;
    const A q = terms.q.slope ? slope * axis_motion(axis, t, terms.q.first, terms.q.second)
                              : weight;
    const int64_t b = t / axis.grid;
    if (b != bin) {
      if (bin >= 0) f(bin, pair);
      bin = b;
      pair = DirectionalPair<A>{A(0), A(0)};
    }
    pair.p += p;
    pair.q += q;
  }
  if (bin >= 0) f(bin, pair);
}

// The row pair of an input-gradient term, over the box's sample count (as
// input_gradient_row_weight), and the weight of a (row pair, column pair) term.
template <class A>
JK_HD DirectionalPair<A> directional_row_pair(const RoiBox<A>& box, DirectionalPair<A> row) {
  return DirectionalPair<A>{row.p / box.count, row.q / box.count};
}
template <class A>
JK_HD A directional_weight(DirectionalPair<A> row, DirectionalPair<A> column) {
  return row.p * column.p + row.q * column.q;
}

// ---- FFI attributes, shared by the CPU and CUDA handlers (host only) ----------------------------

// Every roi_align target takes these attributes (decoded with .Attrs<RoiAlignAttrs>()).
struct RoiAlignAttrs {
  int64_t pooled_height;
  int64_t pooled_width;
  double spatial_scale;
  int64_t sampling_ratio;
  bool aligned;
  int64_t batch_images;
  ffi::Span<const int64_t> batch_terms;  // (divisor, modulus, stride) per term, flattened
  // Chooses between the CUDA d_input paths (false: atomics for float32/float64); the other
  // passes have one path.
  bool deterministic;
};

// The problem of a call, or an InvalidArgument error naming `op`: `input` is the input or its
// gradient [N, C, H, W], `binned` the output or its gradient [K, C, PH, PW] (with Layout
// RoiAlignNHWC: [N, H, W, C] and [K, PH, PW, C]), all of one element type (the Python wrapper
// checks all of it at trace time already).
template <class Layout>
ffi::Error roi_align_problem(const char* op, const RoiAlignAttrs& attrs,
                             const ffi::AnyBuffer& input, const ffi::AnyBuffer& boxes,
                             const ffi::AnyBuffer& binned, RoiAlignProblem* problem) {
  auto invalid = [op](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
  };
  constexpr bool last = Layout::kChannelsLast;
  const auto in = input.dimensions(), rois = boxes.dimensions(), out = binned.dimensions();
  if (in.size() != 4 || rois.size() != 2 || rois[1] != 5 || out.size() != 4)
    return invalid(last ? "expected input [N, H, W, C], boxes [K, 5] and output [K, PH, PW, C]"
                        : "expected input [N, C, H, W], boxes [K, 5] and output [K, C, PH, PW]");
  // The extents in NCHW order: (N, C, H, W) and (K, C, PH, PW).
  const int64_t N = in[0], C = in[last ? 3 : 1], H = in[last ? 1 : 2], W = in[last ? 2 : 3];
  const int64_t out_c = out[last ? 3 : 1], out_h = out[last ? 1 : 2], out_w = out[last ? 2 : 3];
  if (out[0] != rois[0] || out_c != C || out_h != attrs.pooled_height ||
      out_w != attrs.pooled_width || attrs.pooled_height < 1 || attrs.pooled_width < 1)
    return invalid(last ? "output (or its gradient) is not [K, PH, PW, C]"
                        : "output (or its gradient) is not [K, C, PH, PW]");
  if (input.element_type() != boxes.element_type() || binned.element_type() != boxes.element_type())
    return invalid("operands differ in element type");
  if (attrs.sampling_ratio > kRoiAlignMaxFixedGrid) return invalid("sampling_ratio above 64");
  RoiAlignBatching batching;
  batching.images = attrs.batch_images;
  const int64_t values = int64_t(attrs.batch_terms.size());
  if (values % 3 != 0 || values / 3 > kRoiAlignMaxBatchTerms) return invalid("invalid batch terms");
  batching.terms = int(values / 3);
  for (int i = 0; i < batching.terms; ++i) {
    batching.divisor[i] = attrs.batch_terms[3 * i];
    batching.modulus[i] = attrs.batch_terms[3 * i + 1];
    batching.stride[i] = attrs.batch_terms[3 * i + 2];
    if (batching.divisor[i] < 1 || batching.modulus[i] < 1 || batching.stride[i] < 0)
      return invalid("invalid batch terms");
  }
  *problem = RoiAlignProblem{N, C, H, W, rois[0], attrs.pooled_height,
                             attrs.pooled_width, attrs.spatial_scale, attrs.sampling_ratio,
                             attrs.aligned, batching};
  return ffi::Error::Success();
}

// The directions of a directional pass: `u` and the optional `rest` (none: order 1; one
// operand, v: order 2), each shaped and typed like the boxes. *v is null at order 1. An
// InvalidArgument error naming `op` otherwise.
inline ffi::Error roi_align_directions(const char* op, const ffi::AnyBuffer& boxes,
                                       const ffi::AnyBuffer& u, const ffi::RemainingArgs& rest,
                                       const void** v) {
  auto invalid = [op](const std::string& what) {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
  };
  auto like_boxes = [&](const ffi::AnyBuffer& d) {
    const auto a = d.dimensions(), b = boxes.dimensions();
    return a.size() == 2 && b.size() == 2 && a[0] == b[0] && a[1] == b[1] &&
           d.element_type() == boxes.element_type();
  };
  if (!like_boxes(u)) return invalid("expected direction u of the boxes' shape [K, 5] and type");
  *v = nullptr;
  if (rest.size() > 1) return invalid("expected at most one second direction v");
  if (rest.size() == 1) {
    const auto second = rest.get<ffi::AnyBuffer>(0);
    if (!second.has_value() || !like_boxes(second.value()))
      return invalid("expected direction v of the boxes' shape [K, 5] and type");
    *v = second.value().untyped_data();
  }
  return ffi::Error::Success();
}

// The direction u and the result of the directional box pass, both shaped and typed like the
// boxes [K, 5]; an InvalidArgument error naming `op` otherwise.
inline ffi::Error roi_align_hessian_operands(const char* op, const ffi::AnyBuffer& boxes,
                                             const ffi::AnyBuffer& u,
                                             const ffi::AnyBuffer& d_boxes) {
  const auto b = boxes.dimensions(), u_dims = u.dimensions(), d = d_boxes.dimensions();
  if (u_dims.size() != 2 || u_dims[0] != b[0] || u_dims[1] != b[1] ||
      u.element_type() != boxes.element_type())
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": expected direction u of the boxes' shape [K, 5] and type");
  if (d.size() != 2 || d[0] != b[0] || d[1] != b[1] ||
      d_boxes.element_type() != boxes.element_type())
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": expected a result of the boxes' shape [K, 5] and type");
  return ffi::Error::Success();
}

}  // namespace jax_kernels

// Registers the decoding of RoiAlignAttrs for `.Attrs<RoiAlignAttrs>()` (once per source file, at
// global scope).
#define JK_ROI_ALIGN_REGISTER_ATTRS()                                                      \
  XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(                                                   \
      ::jax_kernels::RoiAlignAttrs, ::xla::ffi::StructMember<int64_t>("pooled_height"),    \
      ::xla::ffi::StructMember<int64_t>("pooled_width"),                                   \
      ::xla::ffi::StructMember<double>("spatial_scale"),                                   \
      ::xla::ffi::StructMember<int64_t>("sampling_ratio"),                                 \
      ::xla::ffi::StructMember<bool>("aligned"),                                           \
      ::xla::ffi::StructMember<int64_t>("batch_images"),                                   \
      ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("batch_terms"),             \
      ::xla::ffi::StructMember<bool>("deterministic"))
