// CPU FFI handlers of roi_align's directional passes (forward-mode and second-order derivatives
// in the box coordinates), from the functions of roi_align.h that the CUDA kernels run:
//   jk_roi_align_fwd_directional: input, boxes, u[, v] -> d/de out(boxes + e u) (and d/de of
//     that along v);
//   jk_roi_align_bwd_input_directional: dout, boxes, u[, v] -> its transpose in the input;
//   jk_roi_align_bwd_boxes_directional: dout, input, boxes, u -> d/de d_boxes(boxes + e u).
// The forward and the box pass sum each bin's samples in the order of the plain passes. The input
// pass is the plain pass's row-list gather with a pair of weights per entry: every input cell
// adds its terms with boxes in index order, then row bins, then column bins, as on CUDA. Every
// pass is deterministic whatever the thread count. As in roi_align.cc, each handler is a template
// on the layout, registered for NCHW and for NHWC (jk_roi_align_nhwc_*_directional).
#include <algorithm>
#include <cstdint>
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

template <class Layout, class T>
void forward_directional_typed(const RoiAlignProblem& p, const T* input, const T* boxes,
                               const T* u, const T* v, T* out) {
  using A = acc_t<T>;
  const int64_t chunks = channel_chunks(p), bins = p.bins(), plane = p.H * p.W;
  const int64_t binned = Layout::binned_channel_stride(p), bin_stride = Layout::bin_stride(p);
  parallel_for(p.K * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t k = task / chunks, c_begin = (task % chunks) * kChannels;
      const int64_t channels = std::min<int64_t>(kChannels, p.C - c_begin);
      const RoiBox<A> box = roi_box(boxes, k, p);
      const RoiDirectional<A> d = roi_directional(u, v, k);
      const T* planes = box.image >= 0
                            ? input + box.image * p.C * plane + c_begin * Layout::channel_stride(p)
                            : input;
      T* o = out + k * p.C * bins + c_begin * binned;
      for (int64_t bin = 0; bin < bins; ++bin) {
        A acc[kChannels] = {};
        if (box.image >= 0)
          accumulate_bin_directional<kChannels, Layout>(box, d, bin, planes, channels, p, acc);
        for (int64_t c = 0; c < channels; ++c)
          o[c * binned + bin * bin_stride] = from_acc<T>(acc[c] / box.count);
      }
    }
  });
}

// The directional input-gradient weights of one box, roi_align_gather.h's BoxWeights with a pair
// of weights per entry: its (row, bin row, row pair) entries in ascending row and bin, and per
// column of its column span the (column bin, column pair) entries in ascending bin.
template <class T>
BoxWeights<DirectionalPair<acc_t<T>>> directional_box_weights(const T* boxes, const T* u,
                                                              const T* v, int64_t k,
                                                              const RoiAlignProblem& p) {
  using A = acc_t<T>;
  const RoiBox<A> box = roi_box_with_spans(boxes, k, p);
  DirectionalTerms<A> row_terms, column_terms;
  directional_terms(roi_directional(u, v, k), &row_terms, &column_terms);
  BoxWeights<DirectionalPair<A>> weights;
  weights.column_begin.assign(1, 0);
  if (box.image < 0) return weights;
  weights.image = box.image;
  weights.column_first = box.x.span_first;
  for (int64_t w = box.x.span_first; w <= box.x.span_last; ++w) {
    for_each_directional_index_bin(box.x, column_terms, w, p.W,
                                   [&](int64_t bin, DirectionalPair<A> pair) {
                                     weights.columns.push_back({bin, pair});
                                   });
    weights.column_begin.push_back(int64_t(weights.columns.size()));
  }
  if (weights.column_count() <= 0) return weights;
  for (int64_t h = box.y.span_first; h <= box.y.span_last; ++h)
    for_each_directional_index_bin(box.y, row_terms, h, p.H,
                                   [&](int64_t bin, DirectionalPair<A> pair) {
                                     weights.rows.push_back(
                                         {h, bin * p.PW, directional_row_pair(box, pair)});
                                   });
  return weights;
}

// The input gradient: the plain pass's row-list gather (roi_align_gather.h) with a pair of
// weights per entry.
template <class Layout, class T>
void backward_input_directional_typed(const RoiAlignProblem& p, const T* dout, const T* boxes,
                                      const T* u, const T* v, T* d_input) {
  using A = acc_t<T>;
  std::vector<BoxWeights<DirectionalPair<A>>> weights(p.K);
  parallel_for(p.K, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) weights[k] = directional_box_weights(boxes, u, v, k, p);
  });
  roi_align_cpu::gather_input_gradient<Layout>(
      p, dout, weights, d_input,
      [](const DirectionalPair<A>& row, const DirectionalPair<A>& column) {
        return directional_weight(row, column);
      });
}

template <class Layout, class T>
void backward_boxes_directional_typed(const RoiAlignProblem& p, const T* dout, const T* input,
                                      const T* boxes, const T* u, T* d_boxes) {
  using A = acc_t<T>;
  const int64_t chunks = channel_chunks(p), bins = p.bins(), plane = p.H * p.W;
  parallel_for(p.K, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const RoiBox<A> box = roi_box(boxes, k, p);
      const RoiDirection<A> direction = roi_direction(u, k);
      double d[4] = {0, 0, 0, 0};  // x1, y1, x2, y2
      if (box.image >= 0) {
        for (int64_t item = 0; item < bins * chunks; ++item) {
          const int64_t bin = item % bins, c_begin = (item / bins) * kChannels;
          accumulate_box_hessian<kChannels, Layout>(
              box, direction, bin,
              dout + k * p.C * bins + c_begin * Layout::binned_channel_stride(p),
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
ffi::Error roi_align_forward_directional(ffi::AnyBuffer input, ffi::AnyBuffer boxes,
                                         ffi::AnyBuffer u, ffi::RemainingArgs rest,
                                         RoiAlignAttrs attrs, ffi::Result<ffi::AnyBuffer> out) {
  const char* op = "roi_align forward directional";
  RoiAlignProblem p;
  if (auto err = roi_align_problem<Layout>(op, attrs, input, boxes, *out, &p); err.failure())
    return err;
  const void* v = nullptr;
  if (auto err = roi_align_directions(op, boxes, u, rest, &v); err.failure()) return err;
  if (p.K * p.C == 0) return ffi::Error::Success();
  return dispatch_float(input.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    forward_directional_typed<Layout>(p, static_cast<const T*>(input.untyped_data()),
                                      static_cast<const T*>(boxes.untyped_data()),
                                      static_cast<const T*>(u.untyped_data()),
                                      static_cast<const T*>(v),
                                      static_cast<T*>(out->untyped_data()));
    return ffi::Error::Success();
  });
}

template <class Layout>
ffi::Error roi_align_backward_input_directional(ffi::AnyBuffer dout, ffi::AnyBuffer boxes,
                                                ffi::AnyBuffer u, ffi::RemainingArgs rest,
                                                RoiAlignAttrs attrs,
                                                ffi::Result<ffi::AnyBuffer> d_input) {
  const char* op = "roi_align backward d_input directional";
  RoiAlignProblem p;
  if (auto err = roi_align_problem<Layout>(op, attrs, *d_input, boxes, dout, &p); err.failure())
    return err;
  const void* v = nullptr;
  if (auto err = roi_align_directions(op, boxes, u, rest, &v); err.failure()) return err;
  if (p.N * p.C * p.H * p.W == 0) return ffi::Error::Success();
  return dispatch_float(dout.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    backward_input_directional_typed<Layout>(p, static_cast<const T*>(dout.untyped_data()),
                                             static_cast<const T*>(boxes.untyped_data()),
                                             static_cast<const T*>(u.untyped_data()),
                                             static_cast<const T*>(v),
                                             static_cast<T*>(d_input->untyped_data()));
    return ffi::Error::Success();
  });
}

template <class Layout>
ffi::Error roi_align_backward_boxes_directional(ffi::AnyBuffer dout, ffi::AnyBuffer input,
                                                ffi::AnyBuffer boxes, ffi::AnyBuffer u,
                                                RoiAlignAttrs attrs,
                                                ffi::Result<ffi::AnyBuffer> d_boxes) {
  const char* op = "roi_align backward d_boxes directional";
  RoiAlignProblem p;
  if (auto err = roi_align_problem<Layout>(op, attrs, input, boxes, dout, &p); err.failure())
    return err;
  if (auto err = roi_align_hessian_operands(op, boxes, u, *d_boxes); err.failure()) return err;
  if (p.K == 0) return ffi::Error::Success();
  return dispatch_float(input.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    backward_boxes_directional_typed<Layout>(p, static_cast<const T*>(dout.untyped_data()),
                                             static_cast<const T*>(input.untyped_data()),
                                             static_cast<const T*>(boxes.untyped_data()),
                                             static_cast<const T*>(u.untyped_data()),
                                             static_cast<T*>(d_boxes->untyped_data()));
    return ffi::Error::Success();
  });
}

}  // namespace

// The handler symbols of one layout (Suffix: Cpu for NCHW, NhwcCpu for NHWC).
#define JK_ROI_ALIGN_DIRECTIONAL_CPU_HANDLERS(Suffix, Layout)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignForwardDirectional##Suffix,                            \
                                roi_align_forward_directional<Layout>,                         \
                                ffi::Ffi::Bind()                                               \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .RemainingArgs()                                           \
                                    .Attrs<RoiAlignAttrs>()                                    \
                                    .Ret<ffi::AnyBuffer>());                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignBackwardInputDirectional##Suffix,                      \
                                roi_align_backward_input_directional<Layout>,                  \
                                ffi::Ffi::Bind()                                               \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .RemainingArgs()                                           \
                                    .Attrs<RoiAlignAttrs>()                                    \
                                    .Ret<ffi::AnyBuffer>());                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignBackwardBoxesDirectional##Suffix,                      \
                                roi_align_backward_boxes_directional<Layout>,                  \
                                ffi::Ffi::Bind()                                               \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Attrs<RoiAlignAttrs>()                                    \
                                    .Ret<ffi::AnyBuffer>())

JK_ROI_ALIGN_DIRECTIONAL_CPU_HANDLERS(Cpu, RoiAlignNCHW);
JK_ROI_ALIGN_DIRECTIONAL_CPU_HANDLERS(NhwcCpu, RoiAlignNHWC);

JK_REGISTER_TARGET("jk_roi_align_fwd_directional", RoiAlignForwardDirectionalCpu, "roi_align",
                   "forward directional", "cpu per-bin samples reused over channels", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_bwd_input_directional", RoiAlignBackwardInputDirectionalCpu,
                   "roi_align", "backward d_input directional",
                   "cpu row-list gather (boxes in order)", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_bwd_boxes_directional", RoiAlignBackwardBoxesDirectionalCpu,
                   "roi_align", "backward d_boxes directional", "cpu per-box reduction (float64)",
                   "bitwise");
JK_REGISTER_TARGET("jk_roi_align_nhwc_fwd_directional", RoiAlignForwardDirectionalNhwcCpu,
                   "roi_align", "forward directional (NHWC)",
                   "cpu per-bin samples reused over channels", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_nhwc_bwd_input_directional",
                   RoiAlignBackwardInputDirectionalNhwcCpu, "roi_align",
                   "backward d_input directional (NHWC)", "cpu row-list gather (boxes in order)",
                   "bitwise");
JK_REGISTER_TARGET("jk_roi_align_nhwc_bwd_boxes_directional",
                   RoiAlignBackwardBoxesDirectionalNhwcCpu, "roi_align",
                   "backward d_boxes directional (NHWC)", "cpu per-box reduction (float64)",
                   "bitwise");

}  // namespace jax_kernels
