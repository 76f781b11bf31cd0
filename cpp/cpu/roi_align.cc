// CPU FFI handlers of roi_align: the forward, the input gradient and the box gradient, built from
// the functions of roi_align.h that the CUDA kernels run, so the CPU tests exercise the GPU's
// formulas. The forward and the box gradient take the same (box, bin, channel chunk) items as the
// CUDA kernels. The input gradient is the CUDA gather (per input row, the boxes touching it in
// index order; per box, its samples reaching the cell) with the sample searches hoisted out of
// the cell loop: every cell receives the same terms in the same order. Every pass is deterministic
// whatever the thread count.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "jax_kernels/cpu_parallel.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/roi_align.h"

JK_ROI_ALIGN_REGISTER_ATTRS();

namespace jax_kernels {
namespace {

constexpr int kChannels = 16;

int64_t channel_chunks(const RoiAlignProblem& p) { return (p.C + kChannels - 1) / kChannels; }

template <class T>
void forward_typed(const RoiAlignProblem& p, const T* input, const T* boxes, T* out) {
  using A = acc_t<T>;
  const int64_t chunks = channel_chunks(p), bins = p.bins(), plane = p.H * p.W;
  parallel_for(p.K * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t k = task / chunks, c_begin = (task % chunks) * kChannels;
      const int64_t channels = std::min<int64_t>(kChannels, p.C - c_begin);
      const RoiBox<A> box = roi_box(boxes, k, p);
      const T* planes = box.image >= 0 ? input + (box.image * p.C + c_begin) * plane : input;
      T* o = out + (k * p.C + c_begin) * bins;
      for (int64_t bin = 0; bin < bins; ++bin) {
        A acc[kChannels] = {};
        if (box.image >= 0) accumulate_bin<kChannels>(box, bin, planes, channels, p, acc);
        for (int64_t c = 0; c < channels; ++c) o[c * bins + bin] = from_acc<T>(acc[c] / box.count);
      }
    }
  });
}

// Per input row (image * H + h), the boxes whose samples touch it, in index order.
struct RowLists {
  std::vector<int64_t> begin;  // N * H + 1 offsets into boxes
  std::vector<int64_t> boxes;
};

template <class A>
RowLists row_lists(const std::vector<RoiBox<A>>& geometry, const RoiAlignProblem& p) {
  std::vector<std::vector<int64_t>> touched(p.K);
  parallel_for(p.K, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const RoiBox<A>& box = geometry[k];
      if (box.image < 0) continue;
      for (int64_t h = box.y.span_first; h <= box.y.span_last; ++h)
        if (touches(box.y, h, p.H)) touched[k].push_back(box.image * p.H + h);
    }
  });
  RowLists lists;
  lists.begin.assign(p.N * p.H + 1, 0);
  for (const auto& rows : touched)
    for (int64_t row : rows) ++lists.begin[row + 1];
  for (int64_t r = 0; r < p.N * p.H; ++r) lists.begin[r + 1] += lists.begin[r];
  lists.boxes.resize(lists.begin.back());
  std::vector<int64_t> next(lists.begin.begin(), lists.begin.end() - 1);
  for (int64_t k = 0; k < p.K; ++k)
    for (int64_t row : touched[k]) lists.boxes[next[row]++] = k;
  return lists;
}

// The column samples of each box, column by column: (column, bin column, weight), in the order
// for_each_cell_sample visits them.
template <class A>
struct ColumnSamples {
  struct Entry {
    int64_t w, bin_column;
    A weight;
  };
  std::vector<int64_t> begin;  // K + 1 offsets into entries
  std::vector<Entry> entries;
};

template <class A>
ColumnSamples<A> column_samples(const std::vector<RoiBox<A>>& geometry, const RoiAlignProblem& p) {
  std::vector<std::vector<typename ColumnSamples<A>::Entry>> per_box(p.K);
  parallel_for(p.K, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const RoiAxis<A>& x = geometry[k].x;
      if (geometry[k].image < 0) continue;
      for (int64_t w = x.span_first; w <= x.span_last; ++w)
        for_each_index_sample(x, w, p.W, [&](int64_t tx, A wx) {
          per_box[k].push_back({w, tx / x.grid, wx});
        });
    }
  });
  ColumnSamples<A> columns;
  columns.begin.assign(p.K + 1, 0);
  for (int64_t k = 0; k < p.K; ++k)
    columns.begin[k + 1] = columns.begin[k] + int64_t(per_box[k].size());
  columns.entries.reserve(columns.begin.back());
  for (const auto& entries : per_box)
    columns.entries.insert(columns.entries.end(), entries.begin(), entries.end());
  return columns;
}

// The row-list gather of the CUDA path with its loops reordered for the CPU: per input row and
// channel chunk, the boxes of the row in order, per box its row samples, per row sample its column
// samples. Every input cell receives the terms of accumulate_cell_gradient in the same order.
template <class T>
void backward_input_typed(const RoiAlignProblem& p, const T* dout, const T* boxes, T* d_input) {
  using A = acc_t<T>;
  std::vector<RoiBox<A>> geometry(p.K);
  parallel_for(p.K, 64, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) geometry[k] = roi_box_with_spans(boxes, k, p);
  });
  const RowLists rows = row_lists(geometry, p);
  const ColumnSamples<A> columns = column_samples(geometry, p);
  const int64_t chunks = channel_chunks(p), bins = p.bins(), plane = p.H * p.W;
  parallel_for(p.N * p.H * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> acc(p.W * kChannels);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / chunks, c_begin = (task % chunks) * kChannels;
      const int64_t n = row / p.H, h = row % p.H;
      const int64_t channels = std::min<int64_t>(kChannels, p.C - c_begin);
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t e = rows.begin[row]; e < rows.begin[row + 1]; ++e) {
        const int64_t k = rows.boxes[e];
        const RoiBox<A>& box = geometry[k];
        const T* g = dout + (k * p.C + c_begin) * bins;
        for_each_index_sample(box.y, h, p.H, [&](int64_t ty, A wy) {
          const T* g_row = g + (ty / box.y.grid) * p.PW;
          for (int64_t i = columns.begin[k]; i < columns.begin[k + 1]; ++i) {
            const auto& column = columns.entries[i];
            const A weight = wy * column.weight;
            A* cell = acc.data() + column.w * kChannels;
            for (int64_t c = 0; c < channels; ++c)
              cell[c] += to_acc(g_row[c * bins + column.bin_column]) * weight / box.count;
          }
        });
      }
      T* out = d_input + (n * p.C + c_begin) * plane + h * p.W;
      for (int64_t w = 0; w < p.W; ++w)
        for (int64_t c = 0; c < channels; ++c)
          out[c * plane + w] = from_acc<T>(acc[w * kChannels + c]);
    }
  });
}

template <class T>
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
          accumulate_box_gradient<kChannels>(box, bin, dout + (k * p.C + c_begin) * bins,
                                             input + (box.image * p.C + c_begin) * plane,
                                             std::min<int64_t>(kChannels, p.C - c_begin), p, d);
        }
      }
      T* result = d_boxes + 5 * k;
      result[0] = from_acc<T>(A(0));
      for (int q = 0; q < 4; ++q) result[q + 1] = from_acc<T>(A(d[q] / double(box.count)));
    }
  });
}

ffi::Error roi_align_forward(ffi::AnyBuffer input, ffi::AnyBuffer boxes, RoiAlignAttrs attrs,
                             ffi::Result<ffi::AnyBuffer> out) {
  RoiAlignProblem p;
  if (auto err = roi_align_problem("roi_align", attrs, input, boxes, *out, &p); err.failure())
    return err;
  if (p.K * p.C == 0) return ffi::Error::Success();
  return dispatch_float(input.element_type(), "roi_align", [&](auto tag) {
    using T = typename decltype(tag)::type;
    forward_typed(p, static_cast<const T*>(input.untyped_data()),
                  static_cast<const T*>(boxes.untyped_data()),
                  static_cast<T*>(out->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error roi_align_backward_input(ffi::AnyBuffer dout, ffi::AnyBuffer boxes, RoiAlignAttrs attrs,
                                    ffi::Result<ffi::AnyBuffer> d_input) {
  RoiAlignProblem p;
  if (auto err = roi_align_problem("roi_align backward", attrs, *d_input, boxes, dout, &p);
      err.failure())
    return err;
  if (p.N * p.C * p.H * p.W == 0) return ffi::Error::Success();
  return dispatch_float(dout.element_type(), "roi_align backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    backward_input_typed(p, static_cast<const T*>(dout.untyped_data()),
                         static_cast<const T*>(boxes.untyped_data()),
                         static_cast<T*>(d_input->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error roi_align_backward_boxes(ffi::AnyBuffer dout, ffi::AnyBuffer input, ffi::AnyBuffer boxes,
                                    RoiAlignAttrs attrs, ffi::Result<ffi::AnyBuffer> d_boxes) {
  RoiAlignProblem p;
  if (auto err = roi_align_problem("roi_align backward", attrs, input, boxes, dout, &p);
      err.failure())
    return err;
  if (p.K == 0) return ffi::Error::Success();
  return dispatch_float(input.element_type(), "roi_align backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    backward_boxes_typed(p, static_cast<const T*>(dout.untyped_data()),
                         static_cast<const T*>(input.untyped_data()),
                         static_cast<const T*>(boxes.untyped_data()),
                         static_cast<T*>(d_boxes->untyped_data()));
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignForwardCpu, roi_align_forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attrs<RoiAlignAttrs>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignBackwardInputCpu, roi_align_backward_input,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attrs<RoiAlignAttrs>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignBackwardBoxesCpu, roi_align_backward_boxes,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attrs<RoiAlignAttrs>()
                                  .Ret<ffi::AnyBuffer>());

JK_REGISTER_TARGET("jk_roi_align_fwd", RoiAlignForwardCpu, "roi_align", "forward",
                   "cpu per-bin samples reused over channels", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_bwd_input", RoiAlignBackwardInputCpu, "roi_align",
                   "backward d_input", "cpu row-list gather (boxes in order)", "bitwise");
// The CUDA atomic path's name, for the same targets on every platform: the CPU has no atomics.
JK_REGISTER_TARGET("jk_roi_align_bwd_input_atomic", RoiAlignBackwardInputCpu, "roi_align",
                   "backward d_input (deterministic=False)", "cpu row-list gather (boxes in order)",
                   "bitwise");
JK_REGISTER_TARGET("jk_roi_align_bwd_boxes", RoiAlignBackwardBoxesCpu, "roi_align",
                   "backward d_boxes", "cpu per-box reduction (float64)", "bitwise");

}  // namespace jax_kernels
