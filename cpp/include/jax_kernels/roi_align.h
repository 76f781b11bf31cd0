// roi_align math (torchvision.ops.roi_align semantics), host and device: the static problem, the
// geometry of one box (bin sizes, sample grid, sample positions), the bilinear weights of one
// sample along one axis, the derivatives of sample positions with respect to the box
// coordinates, and the search for the samples that can reach a range of input rows or columns.
//
// A box's samples are separable: sample (ty, tx) sits at (y(ty), x(tx)), where ty = ph * grid_h + iy
// indexes the samples of all bins along y, and the bilinear weight of input cell (h, w) is the
// product of a row weight and a column weight. Every function works in the accumulation type A.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "jax_kernels/ffi_util.h"
#include "jax_kernels/scalar.h"

namespace jax_kernels {

// Upper bound of the adaptive sample grid (sampling_ratio <= 0) per axis and bin: only boxes larger
// than 2^20 output bins' worth of pixels reach it. Whatever the grid, only the samples that can lie
// inside the input are visited (see RoiAxis::candidates), so a box costs at most about
// (2 H + 2 PH + 9) x (2 W + 2 PW + 9) samples.
constexpr int64_t kRoiAlignMaxAdaptiveGrid = int64_t(1) << 20;

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
  A scale;             // spatial_scale: d start / d first coordinate
  bool size_clamped;   // aligned=False and the size was raised to 1: it no longer follows the box

  JK_HD int64_t samples() const { return bins * grid; }

  // Position of sample t = bin * grid + sub, in torchvision's order of operations.
  JK_HD A position(int64_t t) const {
    const int64_t b = t / grid;
    const int64_t sub = t - b * grid;
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
  // affine sample map inverted in double precision, widened by the rounding of the positions
  // (at most one pixel) and one sample on each side. A superset: callers test each candidate.
  // The count is at most about (hi - lo + 2) / |bin / grid| + 3, which keeps every loop over
  // candidates short whatever the box: adaptive grids have a spacing of at least 1/2 pixel.
  JK_HD void candidates(A lo, A hi, int64_t t_begin, int64_t t_end, int64_t* first,
                        int64_t* last) const {
    *first = *last = t_begin;
    if (grid <= 0 || t_begin >= t_end) return;
    const double s = double(start), b = double(bin);
    // A non-finite start or bin puts every position at infinity or NaN: none is valid.
    if (!(std::isfinite(s) && std::isfinite(b))) return;
    const double step = b / double(grid);
    double margin = 16.0 * double(std::numeric_limits<A>::epsilon()) *
                    (std::fabs(s) + std::fabs(b) * double(bins + 1));
    margin = margin < 1.0 ? margin : 1.0;
    const double lo_d = double(lo) - margin, hi_d = double(hi) + margin;
    double u_min, u_max;
    if (step == 0.0) {
      if (!(s >= lo_d && s <= hi_d)) return;
      u_min = double(t_begin);
      u_max = double(t_end);
    } else {
      const double u0 = (lo_d - s) / step - 0.5, u1 = (hi_d - s) / step - 0.5;
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

// Image read by box k whose batch-index column holds `batch`: -1 unless `batch` is an integer in
// [0, batching.images) and the image exists.
template <class A>
JK_HD int64_t roi_image(A batch, int64_t k, const RoiAlignProblem& p) {
  if (p.H <= 0 || p.W <= 0) return -1;  // nothing to sample
  if (!(batch >= A(0) && batch < A(p.batching.images))) return -1;
  const int64_t index = int64_t(batch);
  if (A(index) != batch) return -1;
  const int64_t image = index + p.batching.image_offset(k);
  return image < p.N ? image : -1;
}

template <class A>
JK_HD RoiAxis<A> roi_axis(A first, A second, int64_t bins, const RoiAlignProblem& p) {
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
  return axis;
}

// Geometry of box k from its row (batch_index, x1, y1, x2, y2).
template <class T>
JK_HD RoiBox<acc_t<T>> roi_box(const T* boxes, int64_t k, const RoiAlignProblem& p) {
  using A = acc_t<T>;
  const T* row = boxes + 5 * k;
  RoiBox<A> box;
  box.image = roi_image(to_acc(row[0]), k, p);
  box.x = roi_axis(to_acc(row[1]), to_acc(row[3]), p.PW, p);
  box.y = roi_axis(to_acc(row[2]), to_acc(row[4]), p.PH, p);
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
};

// The problem of an input [N, C, H, W] and K boxes under `attrs`, or a message saying what is
// inconsistent (the Python wrapper checks all of it at trace time already).
inline std::string make_roi_align_problem(const RoiAlignAttrs& attrs, int64_t N, int64_t C, int64_t H,
                                          int64_t W, int64_t K, RoiAlignProblem* problem) {
  if (attrs.pooled_height < 1 || attrs.pooled_width < 1) return "output size must be positive";
  if (attrs.sampling_ratio > kRoiAlignMaxAdaptiveGrid) return "sampling_ratio above 2^20";
  RoiAlignBatching batching;
  batching.images = attrs.batch_images;
  const int64_t values = int64_t(attrs.batch_terms.size());
  if (values % 3 != 0 || values / 3 > kRoiAlignMaxBatchTerms) return "invalid batch terms";
  batching.terms = int(values / 3);
  for (int i = 0; i < batching.terms; ++i) {
    batching.divisor[i] = attrs.batch_terms[3 * i];
    batching.modulus[i] = attrs.batch_terms[3 * i + 1];
    batching.stride[i] = attrs.batch_terms[3 * i + 2];
    if (batching.divisor[i] < 1 || batching.modulus[i] < 1 || batching.stride[i] < 0)
      return "invalid batch terms";
  }
  *problem = RoiAlignProblem{N, C, H, W, K, attrs.pooled_height, attrs.pooled_width,
                             attrs.spatial_scale, attrs.sampling_ratio, attrs.aligned, batching};
  return "";
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
      ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("batch_terms"))
