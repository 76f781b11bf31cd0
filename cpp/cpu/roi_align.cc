// CPU FFI handlers of roi_align: the forward, the input gradient and the box gradient. Each first
// lists, per box and axis, the valid samples of every bin (independent of C), then runs over
// channels. The input gradient gives each thread whole channels and adds the boxes in order, so
// every pass is deterministic whatever the thread count.
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

// The valid samples of one axis of a box, bin by bin: entries [begin[b], begin[b + 1]) are bin b's.
template <class A>
struct AxisSamples {
  std::vector<int64_t> index;  // sample index t along the axis (for the position derivatives)
  std::vector<AxisSample<A>> sample;
  std::vector<int64_t> begin;

  void build(const RoiAxis<A>& axis, int64_t size) {
    index.clear();
    sample.clear();
    begin.assign(axis.bins + 1, 0);
    for (int64_t b = 0; b < axis.bins; ++b) {
      begin[b] = int64_t(index.size());
      int64_t first, last;
      bin_candidates(axis, b, size, &first, &last);
      for (int64_t t = first; t < last; ++t) {
        const AxisSample<A> s = axis_sample(axis.position(t), size);
        if (!s.valid) continue;
        index.push_back(t);
        sample.push_back(s);
      }
    }
    begin[axis.bins] = int64_t(index.size());
  }
};

template <class A>
struct BoxSamples {
  RoiBox<A> box;
  AxisSamples<A> y, x;
};

// Geometry and samples of every box (boxes whose batch index is invalid keep empty lists).
template <class T>
std::vector<BoxSamples<acc_t<T>>> all_box_samples(const T* boxes, const RoiAlignProblem& p) {
  std::vector<BoxSamples<acc_t<T>>> all(p.K);
  parallel_for(p.K, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      BoxSamples<acc_t<T>>& s = all[k];
      s.box = roi_box(boxes, k, p);
      if (s.box.image < 0) continue;
      s.y.build(s.box.y, p.H);
      s.x.build(s.box.x, p.W);
    }
  });
  return all;
}

// Bilinear value of sample (sy, sx) in one channel plane, with torchvision's weights
// w1 = hy hx, w2 = hy lx, w3 = ly hx, w4 = ly lx.
template <class T, class A>
A bilinear(const T* plane, int64_t W, const AxisSample<A>& sy, const AxisSample<A>& sx) {
  const T* row_low = plane + sy.low * W;
  const T* row_high = plane + sy.high * W;
  return sy.w_low * sx.w_low * to_acc(row_low[sx.low]) + sy.w_low * sx.w_high * to_acc(row_low[sx.high]) +
         sy.w_high * sx.w_low * to_acc(row_high[sx.low]) +
         sy.w_high * sx.w_high * to_acc(row_high[sx.high]);
}

constexpr int64_t kChannelChunk = 32;

template <class T>
void forward_typed(const RoiAlignProblem& p, const T* input, const T* boxes, T* out) {
  using A = acc_t<T>;
  const auto samples = all_box_samples(boxes, p);
  const int64_t chunks = (p.C + kChannelChunk - 1) / kChannelChunk;
  const int64_t plane_size = p.H * p.W;
  parallel_for(p.K * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t k = task / chunks;
      const int64_t c_begin = (task % chunks) * kChannelChunk;
      const int64_t c_end = std::min(p.C, c_begin + kChannelChunk);
      const BoxSamples<A>& s = samples[k];
      for (int64_t c = c_begin; c < c_end; ++c) {
        T* o = out + (k * p.C + c) * p.bins();
        if (s.box.image < 0) {
          std::fill(o, o + p.bins(), from_acc<T>(A(0)));
          continue;
        }
        const T* plane = input + (s.box.image * p.C + c) * plane_size;
        for (int64_t ph = 0; ph < p.PH; ++ph) {
          for (int64_t pw = 0; pw < p.PW; ++pw) {
            A sum = A(0);
            for (int64_t i = s.y.begin[ph]; i < s.y.begin[ph + 1]; ++i)
              for (int64_t j = s.x.begin[pw]; j < s.x.begin[pw + 1]; ++j)
                sum += bilinear(plane, p.W, s.y.sample[i], s.x.sample[j]);
            o[ph * p.PW + pw] = from_acc<T>(sum / s.box.count);
          }
        }
      }
    }
  });
}

// d_input: each thread owns a range of channels and accumulates, per channel, every image plane
// in the accumulation type, adding the boxes in index order.
template <class T>
void backward_input_typed(const RoiAlignProblem& p, const T* dout, const T* boxes, T* d_input) {
  using A = acc_t<T>;
  const auto samples = all_box_samples(boxes, p);
  const int64_t plane_size = p.H * p.W;
  parallel_for(p.C, 1, [&](int64_t c_begin, int64_t c_end) {
    std::vector<A> acc(p.N * plane_size);
    for (int64_t c = c_begin; c < c_end; ++c) {
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t k = 0; k < p.K; ++k) {
        const BoxSamples<A>& s = samples[k];
        if (s.box.image < 0) continue;
        A* plane = acc.data() + s.box.image * plane_size;
        const T* g = dout + (k * p.C + c) * p.bins();
        for (int64_t ph = 0; ph < p.PH; ++ph) {
          for (int64_t pw = 0; pw < p.PW; ++pw) {
            const A grad = to_acc(g[ph * p.PW + pw]);
            for (int64_t i = s.y.begin[ph]; i < s.y.begin[ph + 1]; ++i) {
              const AxisSample<A>& sy = s.y.sample[i];
              for (int64_t j = s.x.begin[pw]; j < s.x.begin[pw + 1]; ++j) {
                const AxisSample<A>& sx = s.x.sample[j];
                plane[sy.low * p.W + sx.low] += grad * (sy.w_low * sx.w_low) / s.box.count;
                plane[sy.low * p.W + sx.high] += grad * (sy.w_low * sx.w_high) / s.box.count;
                plane[sy.high * p.W + sx.low] += grad * (sy.w_high * sx.w_low) / s.box.count;
                plane[sy.high * p.W + sx.high] += grad * (sy.w_high * sx.w_high) / s.box.count;
              }
            }
          }
        }
      }
      for (int64_t n = 0; n < p.N; ++n) {
        T* dst = d_input + (n * p.C + c) * plane_size;
        const A* src = acc.data() + n * plane_size;
        for (int64_t i = 0; i < plane_size; ++i) dst[i] = from_acc<T>(src[i]);
      }
    }
  });
}

// d_boxes: per box, the output gradient times d value / d position is summed per sample row
// (over channels, bins and sample columns) and per sample column, in double, then weighted by
// d position / d coordinate.
template <class T>
void backward_boxes_typed(const RoiAlignProblem& p, const T* dout, const T* input, const T* boxes,
                          T* d_boxes) {
  using A = acc_t<T>;
  const int64_t plane_size = p.H * p.W;
  parallel_for(p.K, 1, [&](int64_t begin, int64_t end) {
    BoxSamples<A> s;
    std::vector<double> grad_y, grad_x;
    for (int64_t k = begin; k < end; ++k) {
      T* result = d_boxes + 5 * k;
      std::fill(result, result + 5, from_acc<T>(A(0)));
      s.box = roi_box(boxes, k, p);
      if (s.box.image < 0) continue;
      s.y.build(s.box.y, p.H);
      s.x.build(s.box.x, p.W);
      grad_y.assign(s.y.index.size(), 0.0);
      grad_x.assign(s.x.index.size(), 0.0);
      for (int64_t c = 0; c < p.C; ++c) {
        const T* plane = input + (s.box.image * p.C + c) * plane_size;
        const T* g = dout + (k * p.C + c) * p.bins();
        for (int64_t ph = 0; ph < p.PH; ++ph) {
          for (int64_t pw = 0; pw < p.PW; ++pw) {
            const A grad = to_acc(g[ph * p.PW + pw]);
            for (int64_t i = s.y.begin[ph]; i < s.y.begin[ph + 1]; ++i) {
              const AxisSample<A>& sy = s.y.sample[i];
              const T* row_low = plane + sy.low * p.W;
              const T* row_high = plane + sy.high * p.W;
              for (int64_t j = s.x.begin[pw]; j < s.x.begin[pw + 1]; ++j) {
                const AxisSample<A>& sx = s.x.sample[j];
                const A v1 = to_acc(row_low[sx.low]), v2 = to_acc(row_low[sx.high]);
                const A v3 = to_acc(row_high[sx.low]), v4 = to_acc(row_high[sx.high]);
                grad_y[i] += grad * sy.slope * (sx.w_low * (v3 - v1) + sx.w_high * (v4 - v2));
                grad_x[j] += grad * sx.slope * (sy.w_low * (v2 - v1) + sy.w_high * (v4 - v3));
              }
            }
          }
        }
      }
      double d_x1 = 0, d_y1 = 0, d_x2 = 0, d_y2 = 0;
      for (size_t i = 0; i < grad_y.size(); ++i) {
        d_y1 += grad_y[i] * double(s.box.y.d_first(s.y.index[i]));
        d_y2 += grad_y[i] * double(s.box.y.d_second(s.y.index[i]));
      }
      for (size_t j = 0; j < grad_x.size(); ++j) {
        d_x1 += grad_x[j] * double(s.box.x.d_first(s.x.index[j]));
        d_x2 += grad_x[j] * double(s.box.x.d_second(s.x.index[j]));
      }
      const double count = double(s.box.count);
      result[1] = from_acc<T>(A(d_x1 / count));
      result[2] = from_acc<T>(A(d_y1 / count));
      result[3] = from_acc<T>(A(d_x2 / count));
      result[4] = from_acc<T>(A(d_y2 / count));
    }
  });
}

ffi::Error problem_of(const char* op, const RoiAlignAttrs& attrs, ffi::AnyBuffer::Dimensions input,
                      ffi::AnyBuffer::Dimensions boxes, RoiAlignProblem* p) {
  if (input.size() != 4 || boxes.size() != 2 || boxes[1] != 5)
    return ffi::Error::InvalidArgument(std::string(op) + ": expected input [N, C, H, W] and boxes [K, 5]");
  const std::string problem =
      make_roi_align_problem(attrs, input[0], input[1], input[2], input[3], boxes[0], p);
  if (!problem.empty()) return ffi::Error::InvalidArgument(std::string(op) + ": " + problem);
  return ffi::Error::Success();
}

// dout or the output: [K, C, PH, PW].
ffi::Error check_binned(const char* op, ffi::AnyBuffer::Dimensions dims, const RoiAlignProblem& p) {
  if (dims.size() != 4 || dims[0] != p.K || dims[1] != p.C || dims[2] != p.PH || dims[3] != p.PW)
    return ffi::Error::InvalidArgument(std::string(op) + ": output gradient is not [K, C, PH, PW]");
  return ffi::Error::Success();
}

ffi::Error check_same_type(const char* op, ffi::DataType a, ffi::DataType b) {
  if (a != b) return ffi::Error::InvalidArgument(std::string(op) + ": operands differ in element type");
  return ffi::Error::Success();
}

ffi::Error roi_align_forward(ffi::AnyBuffer input, ffi::AnyBuffer boxes, RoiAlignAttrs attrs,
                             ffi::Result<ffi::AnyBuffer> out) {
  RoiAlignProblem p;
  if (auto err = problem_of("roi_align", attrs, input.dimensions(), boxes.dimensions(), &p); err.failure())
    return err;
  if (auto err = check_same_type("roi_align", input.element_type(), boxes.element_type()); err.failure())
    return err;
  if (auto err = check_binned("roi_align", out->dimensions(), p); err.failure()) return err;
  if (p.K * p.C == 0) return ffi::Error::Success();
  return dispatch_float(input.element_type(), "roi_align", [&](auto tag) {
    using T = typename decltype(tag)::type;
    forward_typed(p, static_cast<const T*>(input.untyped_data()),
                  static_cast<const T*>(boxes.untyped_data()), static_cast<T*>(out->untyped_data()));
    return ffi::Error::Success();
  });
}

ffi::Error roi_align_backward_input(ffi::AnyBuffer dout, ffi::AnyBuffer boxes, RoiAlignAttrs attrs,
                                    ffi::Result<ffi::AnyBuffer> d_input) {
  RoiAlignProblem p;
  if (auto err = problem_of("roi_align backward", attrs, d_input->dimensions(), boxes.dimensions(), &p);
      err.failure())
    return err;
  if (auto err = check_same_type("roi_align backward", dout.element_type(), boxes.element_type());
      err.failure())
    return err;
  if (auto err = check_binned("roi_align backward", dout.dimensions(), p); err.failure()) return err;
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
  if (auto err = problem_of("roi_align backward", attrs, input.dimensions(), boxes.dimensions(), &p);
      err.failure())
    return err;
  if (auto err = check_same_type("roi_align backward", input.element_type(), boxes.element_type());
      err.failure())
    return err;
  if (auto err = check_binned("roi_align backward", dout.dimensions(), p); err.failure()) return err;
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
                   "cpu per-box sample lists", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_bwd_input", RoiAlignBackwardInputCpu, "roi_align",
                   "backward d_input", "cpu ordered sum (boxes in order)", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_bwd_boxes", RoiAlignBackwardBoxesCpu, "roi_align",
                   "backward d_boxes", "cpu per-box reduction (float64)", "bitwise");

}  // namespace jax_kernels
