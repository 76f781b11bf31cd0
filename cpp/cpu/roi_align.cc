// CPU FFI handlers of roi_align: the forward, the input gradient and the box gradient, built from
// the functions of roi_align.h that the CUDA kernels run, so the CPU tests exercise the GPU's
// formulas. The forward and the box gradient sum each bin's samples in the CUDA kernels' order.
// The input gradient is the CUDA gather (per input row, the (box, bin row) entries touching it
// in box order; per entry, the column bins of its box) with its loops reordered: every cell
// receives the same terms in the same order. Every pass is deterministic whatever the thread
// count. Each handler is a template on the layout (roi_align.h's RoiAlignNCHW, RoiAlignNHWC),
// registered once per layout: jk_roi_align_* and jk_roi_align_nhwc_* (channels last, read and
// written in place; the same terms in the same order, so the two agree bitwise).
#include <algorithm>
#include <cstdint>
#include <string>
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
void forward_typed(const RoiAlignProblem& p, const T* input, const T* boxes, T* out) {
  using A = acc_t<T>;
  const int64_t chunks = channel_chunks(p), bins = p.bins(), plane = p.H * p.W;
  const int64_t binned = Layout::binned_channel_stride(p), bin_stride = Layout::bin_stride(p);
  parallel_for(p.K * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t k = task / chunks, c_begin = (task % chunks) * kChannels;
      const int64_t channels = std::min<int64_t>(kChannels, p.C - c_begin);
      const RoiBox<A> box = roi_box(boxes, k, p);
      const T* planes = box.image >= 0
                            ? input + box.image * p.C * plane + c_begin * Layout::channel_stride(p)
                            : input;
      T* o = out + k * p.C * bins + c_begin * binned;
      for (int64_t bin = 0; bin < bins; ++bin) {
        A acc[kChannels] = {};
        if (box.image >= 0) accumulate_bin<kChannels, Layout>(box, bin, planes, channels, p, acc);
        for (int64_t c = 0; c < channels; ++c)
          o[c * binned + bin * bin_stride] = from_acc<T>(acc[c] / box.count);
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
                   "cpu per-bin samples reused over channels", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_bwd_input", RoiAlignBackwardInputCpu, "roi_align",
                   "backward d_input", "cpu row-list gather (boxes in order)", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_bwd_boxes", RoiAlignBackwardBoxesCpu, "roi_align",
                   "backward d_boxes", "cpu per-box reduction (float64)", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_nhwc_fwd", RoiAlignForwardNhwcCpu, "roi_align", "forward (NHWC)",
                   "cpu per-bin samples reused over channels", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_nhwc_bwd_input", RoiAlignBackwardInputNhwcCpu, "roi_align",
                   "backward d_input (NHWC)", "cpu row-list gather (boxes in order)", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_nhwc_bwd_boxes", RoiAlignBackwardBoxesNhwcCpu, "roi_align",
                   "backward d_boxes (NHWC)", "cpu per-box reduction (float64)", "bitwise");

}  // namespace jax_kernels
