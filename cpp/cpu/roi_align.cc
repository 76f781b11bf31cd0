// CPU FFI handlers of roi_align: the forward, the input gradient and the box gradient, built from
// the functions of roi_align.h that the CUDA kernels run, so the CPU tests exercise the GPU's
// formulas. The forward and the box gradient sum each bin's samples in the CUDA kernels' order;
// the forward packs chunks of channels of the input a band of rows at a time and runs
// instruction-set specific loops on them (roi_align_loops.inc, see "The forward" below).
// The input gradient is the CUDA gather (per input row, the (box, bin row) entries touching it
// in box order; per entry, the column bins of its box) with its loops reordered: every cell
// receives the same terms in the same order. Every pass is deterministic whatever the thread
// count. Each handler is a template on the layout (roi_align.h's RoiAlignNCHW, RoiAlignNHWC),
// registered once per layout: jk_roi_align_* and jk_roi_align_nhwc_* (channels last, read and
// written in place; the same terms in the same order, so the two agree bitwise).
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "jax_kernels/cpu_parallel.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/roi_align.h"
#include "roi_align_gather.h"

JK_ROI_ALIGN_REGISTER_ATTRS();

namespace jax_kernels {
namespace {

using roi_align_cpu::BoxWeights;
using roi_align_cpu::channel_chunks;
using roi_align_cpu::kChannels;

// ---- The forward ------------------------------------------------------------------------------
// Each box's valid samples along y and along x (roi_align.h's AxisSample of every valid
// candidate, per bin in ascending order) are computed once per call. Then per chunk of channels
// and image, the rectangle that the image's boxes read is packed, a band of rows at a time, into
// a buffer of the accumulation type (a cell of kRoiChunkBytes per input cell: one channel per
// lane, lanes past C zero) small enough to stay in the core's L2 cache, and every box adds the
// samples of its rows in the band to its bins' sums (roi_align_loops.inc). The boxes of the FPN
// case read each input cell about 7 times over, in no spatial order: read from a packed chunk of
// the whole image they waited on the L3 cache most of the time. The loops are the same for both
// layouts, so NCHW and NHWC give the same bits.
//
// Computed from the input in place by accumulate_bin instead, with the same terms in the same
// order: a box whose sample rows do not run down the image (a reversed box with aligned=True,
// or positions that rounding leaves out of order), and every box of an image whose rectangle
// holds more cells than its boxes read taps (a few small boxes on a large image) or whose band
// of two rows would pass kRoiMaxBandBytes.

constexpr int kRoiChunkBytes = 64;                       // one cache line per cell
constexpr int64_t kRoiBandBytes = int64_t(256) << 10;    // a band's cells: half the L2 of Zen 3
constexpr int64_t kRoiMaxBandBytes = int64_t(64) << 20;  // past this, in place
constexpr int64_t kRoiSumsBytes = int64_t(4) << 20;      // bins' sums of a group of boxes

// What the instruction-set specific loops receive (see roi_align_loops.inc).
template <class A>
struct RoiPackedImage {
  const A* cells;     // [rows][cols] cells of kRoiChunkBytes, 64-byte aligned
  int64_t top, left;  // input row and column of the first cell
  int64_t cols;       // cells per row
};

template <class A>
struct RoiBoxSamples {
  const AxisSample<A>* y;  // y[y_begin[ph] .. y_begin[ph + 1]): bin row ph's valid samples
  const int64_t* y_begin;
  const AxisSample<A>* x;  // and per bin column along x
  const int64_t* x_begin;
};

template <class A>
struct RoiLoops {
  void (*sample_band)(const RoiPackedImage<A>& band, const RoiBoxSamples<A>& box, int64_t PH,
                      int64_t PW, int64_t row_end, int64_t* row, int64_t* bin_row, A* sums);
  void (*divide)(const A* sums, int64_t cells, A count, A* out);
};

namespace portable {
#define JK_ROI_VECTOR_BYTES 16
#include "roi_align_loops.inc"
#undef JK_ROI_VECTOR_BYTES
}  // namespace portable

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JK_ROI_ALIGN_X86_DISPATCH 1
#pragma GCC push_options
#pragma GCC target("avx2")  // without "fma": see roi_align_loops.inc
namespace avx2 {
#define JK_ROI_VECTOR_BYTES 32
#include "roi_align_loops.inc"
#undef JK_ROI_VECTOR_BYTES
}  // namespace avx2
#pragma GCC pop_options
#endif

template <class A>
RoiLoops<A> select_roi_loops() {
#if defined(JK_ROI_ALIGN_X86_DISPATCH)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) {
    if constexpr (std::is_same_v<A, float>) return avx2::roi_loops_float();
    if constexpr (std::is_same_v<A, double>) return avx2::roi_loops_double();
  }
#endif
  if constexpr (std::is_same_v<A, float>) {
    return portable::roi_loops_float();
  } else {
    return portable::roi_loops_double();
  }
}

template <class A>
const RoiLoops<A>& roi_loops() {
  static const RoiLoops<A> selected = select_roi_loops<A>();
  return selected;
}

// The samples of every box.
template <class A>
struct ForwardSamples {
  int64_t PH, PW;
  std::vector<RoiBox<A>> boxes;
  std::vector<int64_t> begin;  // per box: PH + 1 offsets into samples (y), then PW + 1 (x)
  std::vector<AxisSample<A>> samples;
  // Per box: the input rows and columns that its samples read (none: taps == 0), how many taps
  // they read per channel, and whether its rows run down the image (their low rows ascend).
  struct Extent {
    int64_t top = 0, bottom = -1, left = 0, right = -1;
    double taps = 0;
    bool rows_ascend = true;
  };
  std::vector<Extent> extents;

  RoiBoxSamples<A> view(int64_t k) const {
    const int64_t* b = begin.data() + k * (PH + PW + 2);
    return RoiBoxSamples<A>{samples.data(), b, samples.data(), b + PH + 1};
  }
};

// Appends the valid samples of every bin of `axis` (bin_sample_candidates' candidates in
// ascending order, as for_each_bin_sample visits them) at samples[*count], records the bins'
// offsets in begin[0..bins], and widens [*first, *last] to the indices they read.
template <class A>
void append_axis_samples(const RoiAxis<A>& axis, int64_t extent, AxisSample<A>* samples,
                         int64_t* count, int64_t* begin, int64_t* first, int64_t* last) {
  for (int64_t b = 0; b < axis.bins; ++b) {
    begin[b] = *count;
    int64_t t0, t1;
    bin_candidates(axis, b, extent, &t0, &t1);
    for (int64_t t = t0; t < t1; ++t) {
      const AxisSample<A> s = axis_sample(axis.position_in_bin(b, t - b * axis.grid), extent);
      if (!s.valid) continue;
      samples[(*count)++] = s;
      *first = std::min(*first, s.low);
      *last = std::max(*last, s.high);
    }
  }
  begin[axis.bins] = *count;
}

template <class T>
ForwardSamples<acc_t<T>> forward_samples(const RoiAlignProblem& p, const T* boxes) {
  using A = acc_t<T>;
  using Extent = typename ForwardSamples<A>::Extent;
  ForwardSamples<A> f;
  f.PH = p.PH;
  f.PW = p.PW;
  f.boxes.resize(p.K);
  f.extents.resize(p.K);
  f.begin.resize(p.K * (p.PH + p.PW + 2));
  // Room for every candidate; the valid ones fill it from the front.
  std::vector<int64_t> first(p.K + 1, 0);
  parallel_for(p.K, 64, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const RoiBox<A> box = f.boxes[k] = roi_box(boxes, k, p);
      int64_t room = 0, t0, t1;
      if (box.image >= 0) {
        for (int64_t b = 0; b < p.PH; ++b) {
          bin_candidates(box.y, b, p.H, &t0, &t1);
          room += t1 - t0;
        }
        for (int64_t b = 0; b < p.PW; ++b) {
          bin_candidates(box.x, b, p.W, &t0, &t1);
          room += t1 - t0;
        }
      }
      first[k + 1] = room;
    }
  });
  for (int64_t k = 0; k < p.K; ++k) first[k + 1] += first[k];
  f.samples.resize(first[p.K]);
  parallel_for(p.K, 64, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const RoiBox<A>& box = f.boxes[k];
      int64_t* b = f.begin.data() + k * (p.PH + p.PW + 2);
      int64_t count = first[k];
      Extent e;
      e.top = p.H, e.left = p.W;
      if (box.image >= 0) {
        append_axis_samples(box.y, p.H, f.samples.data(), &count, b, &e.top, &e.bottom);
        const int64_t rows_end = count;
        for (int64_t t = first[k] + 1; t < rows_end; ++t)
          if (f.samples[t].low < f.samples[t - 1].low) e.rows_ascend = false;
        append_axis_samples(box.x, p.W, f.samples.data(), &count, b + p.PH + 1, &e.left,
                            &e.right);
        e.taps = 4.0 * double(rows_end - first[k]) * double(count - rows_end);
      } else {
        std::fill(b, b + p.PH + p.PW + 2, count);
      }
      if (e.taps == 0) e = Extent{};
      f.extents[k] = e;
    }
  });
  return f;
}

// Channels [c_begin, c_begin + channels) of rows [top, top + rows) x columns [left, left + cols)
// of an image (`image`: its first element), cell-major: cell (h, w) at
// cells[((h - top) * cols + w - left) * lanes], lanes past `channels` zero.
template <class Layout, class T, class A>
void pack_rows(const RoiAlignProblem& p, const T* image, int64_t c_begin, int64_t channels,
               int64_t top, int64_t rows, int64_t left, int64_t cols, A* cells) {
  constexpr int64_t lanes = kRoiChunkBytes / sizeof(A);
  const int64_t channel_stride = Layout::channel_stride(p), cell_stride = Layout::cell_stride(p);
  for (int64_t r = 0; r < rows; ++r) {
    A* out = cells + r * cols * lanes;
    const T* in = image + c_begin * channel_stride + ((top + r) * p.W + left) * cell_stride;
    if (channels < lanes) std::fill(out, out + cols * lanes, A(0));
    int64_t w0 = 0;
    if constexpr (Layout::kChannelsLast) {
      // A cell's channels lie in one line, cells a whole pixel of channels apart: ask for the
      // lines of the cells ahead, which the hardware prefetchers do not guess.
      constexpr int64_t kAhead = 8;
      for (; w0 < cols; ++w0) {
        if (w0 + kAhead < cols) __builtin_prefetch(in + (w0 + kAhead) * cell_stride);
        for (int64_t c = 0; c < channels; ++c)
          out[w0 * lanes + c] = to_acc(in[w0 * cell_stride + c]);
      }
    } else if (channels == lanes) {
      // Transposed through a tile of `lanes` planes x kBlock columns: contiguous reads from each
      // plane, contiguous writes of each cell.
      constexpr int64_t kBlock = 8;
      for (; w0 + kBlock <= cols; w0 += kBlock) {
        A tile[lanes][kBlock];
        for (int64_t c = 0; c < lanes; ++c)
          for (int64_t j = 0; j < kBlock; ++j) tile[c][j] = to_acc(in[c * channel_stride + w0 + j]);
        for (int64_t j = 0; j < kBlock; ++j)
          for (int64_t c = 0; c < lanes; ++c) out[(w0 + j) * lanes + c] = tile[c][j];
      }
    }
    if constexpr (!Layout::kChannelsLast) {
      for (int64_t c = 0; c < channels; ++c)
        for (int64_t w = w0; w < cols; ++w) out[w * lanes + c] = to_acc(in[c * channel_stride + w]);
    }
  }
}

template <class Layout, class T>
void forward_typed(const RoiAlignProblem& p, const T* input, const T* boxes, T* out) {
  using A = acc_t<T>;
  constexpr int64_t lanes = kRoiChunkBytes / sizeof(A);
  static_assert(lanes <= kChannels, "the in-place path takes a chunk per accumulate_bin");
  const ForwardSamples<A> f = forward_samples(p, boxes);
  const int64_t bins = p.bins(), plane = p.H * p.W;
  const int64_t binned = Layout::binned_channel_stride(p), bin_stride = Layout::bin_stride(p);

  // Per image: its boxes in index order, split into those the bands compute and the others,
  // and the rectangle that the former read.
  struct Image {
    std::vector<int64_t> banded, in_place;
    int64_t top, bottom, left, right;
    double taps = 0;
    int64_t band_rows = 0;  // 0: every box in place
  };
  std::vector<Image> images(p.N);
  for (Image& image : images) {
    image.top = p.H, image.bottom = -1;
    image.left = p.W, image.right = -1;
  }
  for (int64_t k = 0; k < p.K; ++k) {
    const int64_t n = f.boxes[k].image;
    if (n < 0) {  // no image: zeros, as accumulate_bin's empty sums
      std::fill(out + k * p.C * bins, out + (k + 1) * p.C * bins, from_acc<T>(A(0)));
      continue;
    }
    Image& image = images[n];
    const auto& e = f.extents[k];
    if (e.taps == 0 || !e.rows_ascend) {
      image.in_place.push_back(k);
      continue;
    }
    image.banded.push_back(k);
    image.top = std::min(image.top, e.top);
    image.bottom = std::max(image.bottom, e.bottom);
    image.left = std::min(image.left, e.left);
    image.right = std::max(image.right, e.right);
    image.taps += e.taps;
  }
  int64_t band_cells = 0;
  for (Image& image : images) {
    if (image.banded.empty()) continue;
    const int64_t cols = image.right - image.left + 1;
    const double cells = double(image.bottom - image.top + 1) * double(cols);
    if (cells <= image.taps && double(cols) * 2 * kRoiChunkBytes <= double(kRoiMaxBandBytes)) {
      // Rows [r, r + band_rows] are packed for the samples whose low row is in
      // [r, r + band_rows): their high row is the next at most.
      image.band_rows = std::max<int64_t>(1, kRoiBandBytes / (cols * kRoiChunkBytes) - 1);
      band_cells = std::max(band_cells, (image.band_rows + 1) * cols);
    } else {
      image.in_place.insert(image.in_place.end(), image.banded.begin(), image.banded.end());
      image.banded.clear();
    }
  }
  const int64_t group_boxes = std::max<int64_t>(1, kRoiSumsBytes / (bins * kRoiChunkBytes));

  // A task is a chunk of channels of an image, or a part of its boxes where there are fewer
  // chunks and images than threads (each part then packs the bands for itself).
  const RoiLoops<A>& loops = roi_loops<A>();
  const int64_t chunks = (p.C + lanes - 1) / lanes;
  if (chunks * p.N == 0) return;  // no image or no channel: the boxes' zeros are written above
  const int64_t parts = std::max<int64_t>(1, parallel_threads() / (chunks * p.N));
  parallel_for(chunks * p.N * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> buffer, sums, means;
    std::vector<int64_t> rows, bin_rows;
    A* cells = nullptr;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t part = task % parts, n = (task / parts) % p.N;
      const int64_t c_begin = (task / (parts * p.N)) * lanes;
      const int64_t channels = std::min<int64_t>(lanes, p.C - c_begin);
      const Image& image = images[n];
      const T* planes = input + n * p.C * plane;
      const T* chunk = planes + c_begin * Layout::channel_stride(p);
      // This part's share of a list of boxes.
      auto share = [&](const std::vector<int64_t>& list) {
        const int64_t size = int64_t(list.size());
        return std::make_pair(list.data() + size * part / parts,
                              list.data() + size * (part + 1) / parts);
      };
      const auto [in_place_first, in_place_last] = share(image.in_place);
      for (const int64_t* box = in_place_first; box != in_place_last; ++box) {
        const int64_t k = *box;
        T* o = out + k * p.C * bins + c_begin * binned;
        for (int64_t bin = 0; bin < bins; ++bin) {
          A acc[kChannels] = {};
          accumulate_bin<kChannels, Layout>(f.boxes[k], bin, chunk, channels, p, acc);
          for (int64_t c = 0; c < channels; ++c)
            o[c * binned + bin * bin_stride] = from_acc<T>(acc[c] / f.boxes[k].count);
        }
      }
      const auto [banded_first, banded_last] = share(image.banded);
      if (banded_first == banded_last) continue;
      if (!cells) {
        buffer.resize(band_cells * lanes + lanes);
        cells = reinterpret_cast<A*>((reinterpret_cast<uintptr_t>(buffer.data()) +
                                      kRoiChunkBytes - 1) & ~uintptr_t(kRoiChunkBytes - 1));
        means.resize(bins * lanes);
      }
      const int64_t cols = image.right - image.left + 1;
      for (const int64_t* group = banded_first; group < banded_last; group += group_boxes) {
        const int64_t count = std::min<int64_t>(group_boxes, banded_last - group);
        sums.assign(count * bins * lanes, A(0));
        rows.resize(count);
        bin_rows.assign(count, 0);
        for (int64_t i = 0; i < count; ++i) rows[i] = f.begin[group[i] * (p.PH + p.PW + 2)];
        for (int64_t top = image.top; top <= image.bottom; top += image.band_rows) {
          const int64_t row_end = top + image.band_rows;
          pack_rows<Layout>(p, planes, c_begin, channels, top,
                            std::min(row_end, image.bottom) - top + 1, image.left, cols, cells);
          const RoiPackedImage<A> band{cells, top, image.left, cols};
          for (int64_t i = 0; i < count; ++i) {
            const auto& e = f.extents[group[i]];
            if (e.top >= row_end || e.bottom < top) continue;
            loops.sample_band(band, f.view(group[i]), p.PH, p.PW, row_end, &rows[i],
                              &bin_rows[i], sums.data() + i * bins * lanes);
          }
        }
        for (int64_t i = 0; i < count; ++i) {
          const int64_t k = group[i];
          loops.divide(sums.data() + i * bins * lanes, bins, f.boxes[k].count, means.data());
          T* o = out + k * p.C * bins + c_begin * binned;
          for (int64_t bin = 0; bin < bins; ++bin)
            for (int64_t c = 0; c < channels; ++c)
              o[c * binned + bin * bin_stride] = from_acc<T>(means[bin * lanes + c]);
        }
      }
    }
  });
}

template <class T>
BoxWeights<acc_t<T>> box_weights(const T* boxes, int64_t k, const RoiAlignProblem& p) {
  using A = acc_t<T>;
  const RoiBox<A> box = roi_box_with_spans(boxes, k, p);
  BoxWeights<A> weights;
  weights.column_begin.assign(1, 0);
  if (box.image < 0) return weights;
  weights.image = box.image;
  weights.column_first = box.x.span_first;
  for (int64_t w = box.x.span_first; w <= box.x.span_last; ++w) {
    for_each_index_bin(box.x, w, p.W, [&](int64_t bin, A weight) {
      weights.columns.push_back({bin, weight});
    });
    weights.column_begin.push_back(int64_t(weights.columns.size()));
  }
  if (weights.column_count() <= 0) return weights;
  for (int64_t h = box.y.span_first; h <= box.y.span_last; ++h)
    for_each_index_bin(box.y, h, p.H, [&](int64_t bin, A weight) {
      weights.rows.push_back({h, bin * p.PW, input_gradient_row_weight(box, weight)});
    });
  return weights;
}

// The input gradient: the CUDA path's gather with its loops reordered for the CPU
// (roi_align_gather.h); every input cell receives the same terms in the same order as on CUDA.
template <class Layout, class T>
void backward_input_typed(const RoiAlignProblem& p, const T* dout, const T* boxes, T* d_input) {
  using A = acc_t<T>;
  std::vector<BoxWeights<A>> weights(p.K);
  parallel_for(p.K, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) weights[k] = box_weights(boxes, k, p);
  });
  roi_align_cpu::gather_input_gradient<Layout>(p, dout, weights, d_input, [](A row, A column) {
    return input_gradient_weight(row, column);
  });
}

template <class Layout, class T>
void backward_boxes_typed(const RoiAlignProblem& p, const T* dout, const T* input, const T* boxes,
                          T* d_boxes) {
  using A = acc_t<T>;
  const int64_t chunks = channel_chunks(p), bins = p.bins(), plane = p.H * p.W;
  parallel_for(p.K, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const RoiBox<A> box = roi_box(boxes, k, p);
      double d[4] = {0, 0, 0, 0};  // x1, y1, x2, y2
      if (box.image >= 0) {
        for (int64_t item = 0; item < bins * chunks; ++item) {
          const int64_t bin = item % bins, c_begin = (item / bins) * kChannels;
          accumulate_box_gradient<kChannels, Layout>(
              box, bin, dout + k * p.C * bins + c_begin * Layout::binned_channel_stride(p),
              input + box.image * p.C * plane + c_begin * Layout::channel_stride(p),
              std::min<int64_t>(kChannels, p.C - c_begin), p, d);
        }
      }
      T* result = d_boxes + 5 * k;
      result[0] = from_acc<T>(A(0));
      for (int q = 0; q < 4; ++q) result[q + 1] = from_acc<T>(A(d[q] / double(box.count)));
    }
  });
}

template <class Layout>
ffi::Error roi_align_forward(ffi::AnyBuffer input, ffi::AnyBuffer boxes, RoiAlignAttrs attrs,
                             ffi::Result<ffi::AnyBuffer> out) {
  RoiAlignProblem p;
  if (auto err = roi_align_problem<Layout>("roi_align", attrs, input, boxes, *out, &p);
      err.failure())
    return err;
  if (p.K * p.C == 0) return ffi::Error::Success();
  return dispatch_float(input.element_type(), "roi_align", [&](auto tag) {
    using T = typename decltype(tag)::type;
    forward_typed<Layout>(p, static_cast<const T*>(input.untyped_data()),
                  static_cast<const T*>(boxes.untyped_data()),
                  static_cast<T*>(out->untyped_data()));
    return ffi::Error::Success();
  });
}

template <class Layout>
ffi::Error roi_align_backward_input(ffi::AnyBuffer dout, ffi::AnyBuffer boxes, RoiAlignAttrs attrs,
                                    ffi::Result<ffi::AnyBuffer> d_input) {
  RoiAlignProblem p;
  if (auto err = roi_align_problem<Layout>("roi_align backward", attrs, *d_input, boxes, dout, &p);
      err.failure())
    return err;
  if (p.N * p.C * p.H * p.W == 0) return ffi::Error::Success();
  return dispatch_float(dout.element_type(), "roi_align backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    backward_input_typed<Layout>(p, static_cast<const T*>(dout.untyped_data()),
                                 static_cast<const T*>(boxes.untyped_data()),
                                 static_cast<T*>(d_input->untyped_data()));
    return ffi::Error::Success();
  });
}

template <class Layout>
ffi::Error roi_align_backward_boxes(ffi::AnyBuffer dout, ffi::AnyBuffer input, ffi::AnyBuffer boxes,
                                    RoiAlignAttrs attrs, ffi::Result<ffi::AnyBuffer> d_boxes) {
  RoiAlignProblem p;
  if (auto err = roi_align_problem<Layout>("roi_align backward", attrs, input, boxes, dout, &p);
      err.failure())
    return err;
  if (p.K == 0) return ffi::Error::Success();
  return dispatch_float(input.element_type(), "roi_align backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    backward_boxes_typed<Layout>(p, static_cast<const T*>(dout.untyped_data()),
                                 static_cast<const T*>(input.untyped_data()),
                                 static_cast<const T*>(boxes.untyped_data()),
                                 static_cast<T*>(d_boxes->untyped_data()));
    return ffi::Error::Success();
  });
}

}  // namespace

// The handler symbols of one layout (Suffix: Cpu for NCHW, NhwcCpu for NHWC).
#define JK_ROI_ALIGN_CPU_HANDLERS(Suffix, Layout)                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignForward##Suffix, roi_align_forward<Layout>,            \
                                ffi::Ffi::Bind()                                               \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Attrs<RoiAlignAttrs>()                                    \
                                    .Ret<ffi::AnyBuffer>());                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignBackwardInput##Suffix, roi_align_backward_input<Layout>, \
                                ffi::Ffi::Bind()                                               \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Attrs<RoiAlignAttrs>()                                    \
                                    .Ret<ffi::AnyBuffer>());                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignBackwardBoxes##Suffix, roi_align_backward_boxes<Layout>, \
                                ffi::Ffi::Bind()                                               \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Attrs<RoiAlignAttrs>()                                    \
                                    .Ret<ffi::AnyBuffer>())

JK_ROI_ALIGN_CPU_HANDLERS(Cpu, RoiAlignNCHW);
JK_ROI_ALIGN_CPU_HANDLERS(NhwcCpu, RoiAlignNHWC);

JK_REGISTER_TARGET("jk_roi_align_fwd", RoiAlignForwardCpu, "roi_align", "forward",
                   "cpu sample tables per box, channels packed in L2-sized bands", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_bwd_input", RoiAlignBackwardInputCpu, "roi_align",
                   "backward d_input", "cpu row-list gather (boxes in order)", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_bwd_boxes", RoiAlignBackwardBoxesCpu, "roi_align",
                   "backward d_boxes", "cpu per-box reduction (float64)", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_nhwc_fwd", RoiAlignForwardNhwcCpu, "roi_align", "forward (NHWC)",
                   "cpu sample tables per box, channels packed in L2-sized bands", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_nhwc_bwd_input", RoiAlignBackwardInputNhwcCpu, "roi_align",
                   "backward d_input (NHWC)", "cpu row-list gather (boxes in order)", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_nhwc_bwd_boxes", RoiAlignBackwardBoxesNhwcCpu, "roi_align",
                   "backward d_boxes (NHWC)", "cpu per-box reduction (float64)", "bitwise");

}  // namespace jax_kernels
