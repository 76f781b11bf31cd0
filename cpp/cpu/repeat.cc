// CPU FFI handlers of repeat: the forward copies x's rows into every tile; the backward sums,
// for each element of x, all its copies in the output gradient in a fixed order.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "jax_kernels/cpu_parallel.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/repeat.h"

namespace jax_kernels {
namespace {

ffi::Error geometry_of(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& out,
                       ffi::Span<const int64_t> repeats, RepeatGeometry* g) {
  const std::string problem = make_repeat_geometry(
      x.dimensions().begin(), int(x.dimensions().size()), out.dimensions().begin(),
      int(out.dimensions().size()), repeats.begin(), int(repeats.size()), g);
  if (!problem.empty()) return ffi::Error::InvalidArgument(std::string(op) + ": " + problem);
  return ffi::Error::Success();
}

ffi::Error repeat_forward(ffi::AnyBuffer x, ffi::Span<const int64_t> repeats,
                          ffi::Result<ffi::AnyBuffer> out) {
  RepeatGeometry g;
  if (auto err = geometry_of("repeat", x, *out, repeats, &g); err.failure()) return err;
  if (g.out_count == 0) return ffi::Error::Success();
  const size_t width = ffi::ByteWidth(x.element_type());
  const char* src = static_cast<const char*>(x.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  // Rows of the innermost collapsed dim: an output row is an x row written r_last times.
  const int last = g.rank - 1;
  const int64_t row = g.size[last];
  const int64_t out_row = row * g.repeats[last];
  const int64_t rows = g.out_count / out_row;
  parallel_for(rows, std::max<int64_t>(1, (1 << 16) / out_row), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const char* x_row = src + g.x_offset(i * out_row) * width;
      char* o = dst + i * out_row * width;
      for (int64_t c = 0; c < g.repeats[last]; ++c) std::memcpy(o + c * row * width, x_row, row * width);
    }
  });
  return ffi::Error::Success();
}

template <class T>
void repeat_backward_typed(const RepeatGeometry& g, const T* dout, T* dx) {
  using A = acc_t<T>;
  const int last = g.rank - 1;
  const int64_t row = g.size[last];
  const int64_t rows = g.x_count / row;
  parallel_for(rows, std::max<int64_t>(1, (1 << 14) / (row * g.copies)), [&](int64_t begin, int64_t end) {
    std::vector<A> acc(row);
    std::vector<int64_t> copy_offsets(g.copies);
    for (int64_t copy = 0; copy < g.copies; ++copy) copy_offsets[copy] = g.copy_offset(copy);
    for (int64_t i = begin; i < end; ++i) {
      std::fill(acc.begin(), acc.end(), A(0));
      // Copies along the innermost dim are contiguous rows too; visit them in copy order.
      const int64_t base = g.element_offset(i * row);
      for (int64_t copy = 0; copy < g.copies; ++copy) {
        const T* src = dout + base + copy_offsets[copy];
        for (int64_t j = 0; j < row; ++j) acc[j] += to_acc(src[j]);
      }
      for (int64_t j = 0; j < row; ++j) dx[i * row + j] = from_acc<T>(acc[j]);
    }
  });
}

ffi::Error repeat_backward(ffi::AnyBuffer dout, ffi::Span<const int64_t> repeats,
                           ffi::Result<ffi::AnyBuffer> dx) {
  RepeatGeometry g;
  if (auto err = geometry_of("repeat backward", *dx, dout, repeats, &g); err.failure()) return err;
  if (g.x_count == 0) return ffi::Error::Success();
  return dispatch_float(dout.element_type(), "repeat backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* result = static_cast<T*>(dx->untyped_data());
    if (g.copies == 0) {
      std::fill(result, result + g.x_count, from_acc<T>(acc_t<T>(0)));
    } else {
      repeat_backward_typed(g, static_cast<const T*>(dout.untyped_data()), result);
    }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RepeatForwardCpu, repeat_forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("repeats")
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(RepeatBackwardCpu, repeat_backward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("repeats")
                                  .Ret<ffi::AnyBuffer>());

JK_REGISTER_TARGET("jk_repeat_fwd", RepeatForwardCpu, "repeat", "forward", "cpu copy", "bitwise");
JK_REGISTER_TARGET("jk_repeat_bwd", RepeatBackwardCpu, "repeat", "backward d_input",
                   "cpu ordered sum", "bitwise");

}  // namespace jax_kernels
