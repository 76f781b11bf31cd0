// CPU FFI handlers of lerp: the forward (array or scalar weight) and one target per gradient.
// Each computes an elementwise functor from lerp.h over broadcast operands.
#include <cstdint>
#include <string>
#include <type_traits>

#include "jax_kernels/broadcast.h"
#include "jax_kernels/cpu_parallel.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/lerp.h"

namespace jax_kernels {
namespace {

constexpr int64_t kGrain = 1 << 15;

// out[i] = functor(operands[k][broadcast index]...) for every output element; operands and the
// output share the element type T, except that a gradient that is summed afterwards over
// broadcast axes may be written in the accumulation type (OutT = acc_t<T>).
template <class T, class OutT, int kOperands, class Functor>
ffi::Error elementwise(const char* op, const Functor& functor,
                       const ffi::AnyBuffer* const (&operands)[kOperands],
                       ffi::Result<ffi::AnyBuffer>& out) {
  using A = acc_t<T>;
  const auto out_dims = out->dimensions();
  const int64_t* operand_dims[kOperands];
  for (int k = 0; k < kOperands; ++k) {
    if (operands[k]->dimensions().size() != out_dims.size())
      return ffi::Error::InvalidArgument(std::string(op) + ": operand rank differs from the output's");
    operand_dims[k] = operands[k]->dimensions().begin();
  }
  BroadcastGeometry<kOperands> g;
  const std::string problem =
      make_broadcast_geometry(out_dims.begin(), int(out_dims.size()), operand_dims, &g);
  if (!problem.empty()) return ffi::Error::InvalidArgument(std::string(op) + ": " + problem);

  const T* data[kOperands];
  for (int k = 0; k < kOperands; ++k) data[k] = static_cast<const T*>(operands[k]->untyped_data());
  OutT* result = static_cast<OutT*>(out->untyped_data());

  parallel_for(g.count, kGrain, [&](int64_t begin, int64_t end) {
    // Local restrict pointers: the compiler can then vectorize the contiguous loops.
    const T* __restrict d0 = data[0];
    const T* __restrict d1 = data[kOperands > 1 ? 1 : 0];
    const T* __restrict d2 = data[kOperands > 2 ? 2 : 0];
    OutT* __restrict r = result;
    auto value = [&](int64_t i0, int64_t i1, int64_t i2) -> A {
      if constexpr (kOperands == 1) return functor(to_acc(d0[i0]));
      if constexpr (kOperands == 2) return functor(to_acc(d0[i0]), to_acc(d1[i1]));
      if constexpr (kOperands == 3) return functor(to_acc(d0[i0]), to_acc(d1[i1]), to_acc(d2[i2]));
    };
    auto store = [&](int64_t i, A v) {
      if constexpr (std::is_same_v<OutT, T>) {
        r[i] = from_acc<T>(v);
      } else {
        r[i] = v;
      }
    };
    if (g.contiguous) {
      for (int64_t i = begin; i < end; ++i) store(i, value(i, i, i));
    } else {
      for (int64_t i = begin; i < end; ++i)
        store(i, value(g.offset(0, i), kOperands > 1 ? g.offset(1, i) : 0,
                       kOperands > 2 ? g.offset(2, i) : 0));
    }
  });
  return ffi::Error::Success();
}

// Dispatches on the operands' element type and on the output type (same, or float32 for the
// half types' gradients that are reduced afterwards).
template <int kOperands, class Functor>
ffi::Error dispatch(const char* op, const Functor& functor,
                    const ffi::AnyBuffer* const (&operands)[kOperands],
                    ffi::Result<ffi::AnyBuffer>& out) {
  const ffi::DataType in_type = operands[0]->element_type();
  for (int k = 1; k < kOperands; ++k)
    if (operands[k]->element_type() != in_type)
      return ffi::Error::InvalidArgument(std::string(op) + ": operands differ in element type");
  return dispatch_float(in_type, op, [&](auto tag) -> ffi::Error {
    using T = typename decltype(tag)::type;
    if (out->element_type() == in_type) return elementwise<T, T>(op, functor, operands, out);
    if constexpr (!std::is_same_v<acc_t<T>, T>) {
      if (out->element_type() == ffi::DataType::F32)
        return elementwise<T, acc_t<T>>(op, functor, operands, out);
    }
    return ffi::Error::InvalidArgument(std::string(op) + ": unexpected output element type");
  });
}

ffi::Error lerp_forward(ffi::AnyBuffer start, ffi::AnyBuffer end, ffi::AnyBuffer weight,
                        ffi::Result<ffi::AnyBuffer> out) {
  return dispatch("lerp", LerpForward{}, {&start, &end, &weight}, out);
}

ffi::Error lerp_scalar_forward(ffi::AnyBuffer start, ffi::AnyBuffer end, double weight,
                               ffi::Result<ffi::AnyBuffer> out) {
  return dispatch("lerp", LerpScalarForward{weight}, {&start, &end}, out);
}

ffi::Error lerp_backward_start(ffi::AnyBuffer dout, ffi::AnyBuffer weight,
                               ffi::Result<ffi::AnyBuffer> d_start) {
  return dispatch("lerp backward", LerpGradStart{}, {&dout, &weight}, d_start);
}

ffi::Error lerp_scalar_backward_start(ffi::AnyBuffer dout, double weight,
                                      ffi::Result<ffi::AnyBuffer> d_start) {
  return dispatch("lerp backward", LerpScalarGradStart{weight}, {&dout}, d_start);
}

ffi::Error lerp_backward_end(ffi::AnyBuffer dout, ffi::AnyBuffer weight,
                             ffi::Result<ffi::AnyBuffer> d_end) {
  return dispatch("lerp backward", LerpGradEnd{}, {&dout, &weight}, d_end);
}

ffi::Error lerp_scalar_backward_end(ffi::AnyBuffer dout, double weight,
                                    ffi::Result<ffi::AnyBuffer> d_end) {
  return dispatch("lerp backward", LerpScalarGradEnd{weight}, {&dout}, d_end);
}

ffi::Error lerp_backward_weight(ffi::AnyBuffer dout, ffi::AnyBuffer start, ffi::AnyBuffer end,
                                ffi::Result<ffi::AnyBuffer> d_weight) {
  return dispatch("lerp backward", LerpGradWeight{}, {&dout, &start, &end}, d_weight);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LerpForwardCpu, lerp_forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(LerpScalarForwardCpu, lerp_scalar_forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<double>("weight")
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(LerpBackwardStartCpu, lerp_backward_start,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(LerpScalarBackwardStartCpu, lerp_scalar_backward_start,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<double>("weight")
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(LerpBackwardEndCpu, lerp_backward_end,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(LerpScalarBackwardEndCpu, lerp_scalar_backward_end,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<double>("weight")
                                  .Ret<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(LerpBackwardWeightCpu, lerp_backward_weight,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

JK_REGISTER_TARGET("jk_lerp_fwd", LerpForwardCpu, "lerp", "forward", "cpu elementwise", "bitwise");
JK_REGISTER_TARGET("jk_lerp_scalar_fwd", LerpScalarForwardCpu, "lerp", "forward (scalar weight)",
                   "cpu elementwise", "bitwise");
JK_REGISTER_TARGET("jk_lerp_bwd_input", LerpBackwardStartCpu, "lerp", "backward d_input",
                   "cpu elementwise", "bitwise");
JK_REGISTER_TARGET("jk_lerp_scalar_bwd_input", LerpScalarBackwardStartCpu, "lerp",
                   "backward d_input (scalar weight)", "cpu elementwise", "bitwise");
JK_REGISTER_TARGET("jk_lerp_bwd_end", LerpBackwardEndCpu, "lerp", "backward d_end",
                   "cpu elementwise", "bitwise");
JK_REGISTER_TARGET("jk_lerp_scalar_bwd_end", LerpScalarBackwardEndCpu, "lerp",
                   "backward d_end (scalar weight)", "cpu elementwise", "bitwise");
JK_REGISTER_TARGET("jk_lerp_bwd_weight", LerpBackwardWeightCpu, "lerp", "backward d_weight",
                   "cpu elementwise", "bitwise");

}  // namespace jax_kernels
