// CUDA FFI handlers of lerp: the forward (array or scalar weight) and one target per gradient.
// Each runs an elementwise functor from lerp.h: 16-byte vector loads when no operand is
// broadcast, otherwise one broadcast-indexed element per thread.
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "jax_kernels/broadcast.h"
#include "common/launch.h"
#include "common/status.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/lerp.h"

namespace jax_kernels {
namespace {

constexpr int kThreads = 256;

template <class T, int kOperands>
struct Operands {
  const T* data[kOperands];
};

template <class T, int V>
struct alignas(sizeof(T) * V) Vector {
  T v[V];
};

template <class T, class OutT>
__device__ __forceinline__ OutT store_value(acc_t<T> value) {
  if constexpr (std::is_same_v<OutT, T>) {
    return from_acc<T>(value);
  } else {
    return value;
  }
}

template <class Functor, class A, int kOperands, size_t... I>
__device__ __forceinline__ A apply(const Functor& f, const A (&values)[kOperands],
                                   std::index_sequence<I...>) {
  return f(values[I]...);
}

// No broadcasting: V elements per thread, 16-byte loads of every operand. Launched with a full
// grid (one vector per thread); the loop only guards the 2^31-block limit.
template <class T, class OutT, int kOperands, class Functor>
__global__ void elementwise_contiguous_kernel(Functor f, Operands<T, kOperands> in, OutT* out,
                                              int64_t n) {
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  const int64_t vectors = n / V;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += stride) {
    Vector<T, V> loaded[kOperands];
#pragma unroll
    for (int k = 0; k < kOperands; ++k)
      loaded[k] = reinterpret_cast<const Vector<T, V>*>(in.data[k])[i];
    Vector<OutT, V> result;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      A values[kOperands];
#pragma unroll
      for (int k = 0; k < kOperands; ++k) values[k] = to_acc(loaded[k].v[j]);
      result.v[j] = store_value<T, OutT>(apply(f, values, std::make_index_sequence<kOperands>{}));
    }
    reinterpret_cast<Vector<OutT, V>*>(out)[i] = result;
  }
  // The tail (fewer than V elements) goes to the first threads.
  const int64_t tail = vectors * V + int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (tail < n) {
    A values[kOperands];
#pragma unroll
    for (int k = 0; k < kOperands; ++k) values[k] = to_acc(in.data[k][tail]);
    out[tail] = store_value<T, OutT>(apply(f, values, std::make_index_sequence<kOperands>{}));
  }
}

template <class T, class OutT, int kOperands, class Functor>
__global__ void elementwise_broadcast_kernel(Functor f, Operands<T, kOperands> in, OutT* out,
                                             BroadcastGeometry<kOperands> g) {
  using A = acc_t<T>;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < g.count; i += stride) {
    A values[kOperands];
#pragma unroll
    for (int k = 0; k < kOperands; ++k) values[k] = to_acc(in.data[k][g.offset(k, i)]);
    out[i] = store_value<T, OutT>(apply(f, values, std::make_index_sequence<kOperands>{}));
  }
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <class T, class OutT, int kOperands, class Functor>
ffi::Error elementwise(cudaStream_t stream, const char* op, const Functor& functor,
                       const ffi::AnyBuffer* const (&operands)[kOperands],
                       ffi::Result<ffi::AnyBuffer>& out) {
  const auto out_dims = out->dimensions();
  const int64_t* operand_dims[kOperands];
  Operands<T, kOperands> in;
  constexpr int V = 16 / sizeof(T);
  bool vectorizable = aligned(out->untyped_data(), sizeof(OutT) * V);
  for (int k = 0; k < kOperands; ++k) {
    if (operands[k]->dimensions().size() != out_dims.size())
      return ffi::Error::InvalidArgument(std::string(op) + ": operand rank differs from the output's");
    operand_dims[k] = operands[k]->dimensions().begin();
    in.data[k] = static_cast<const T*>(operands[k]->untyped_data());
    vectorizable = vectorizable && aligned(in.data[k], 16);
  }
  BroadcastGeometry<kOperands> g;
  const std::string problem =
      make_broadcast_geometry(out_dims.begin(), int(out_dims.size()), operand_dims, &g);
  if (!problem.empty()) return ffi::Error::InvalidArgument(std::string(op) + ": " + problem);
  if (g.count == 0) return ffi::Error::Success();
  OutT* result = static_cast<OutT*>(out->untyped_data());
  if (g.contiguous) {
    const int64_t items = vectorizable ? std::max<int64_t>(g.count / V, 1) : g.count;
    if (vectorizable) {
      elementwise_contiguous_kernel<T, OutT, kOperands>
          <<<full_grid_blocks(items, kThreads), kThreads, 0, stream>>>(functor, in, result, g.count);
    } else {
      g.rank = 1;  // plain indexing: one dim, unit strides
      g.dims[0] = g.count;
      for (int k = 0; k < kOperands; ++k) g.strides[k][0] = 1;
      elementwise_broadcast_kernel<T, OutT, kOperands>
          <<<grid_blocks(items, kThreads), kThreads, 0, stream>>>(functor, in, result, g);
    }
  } else {
    elementwise_broadcast_kernel<T, OutT, kOperands>
        <<<grid_blocks(g.count, kThreads), kThreads, 0, stream>>>(functor, in, result, g);
  }
  return launch_status(op);
}

template <int kOperands, class Functor>
ffi::Error dispatch(cudaStream_t stream, const char* op, const Functor& functor,
                    const ffi::AnyBuffer* const (&operands)[kOperands],
                    ffi::Result<ffi::AnyBuffer>& out) {
  const ffi::DataType in_type = operands[0]->element_type();
  for (int k = 1; k < kOperands; ++k)
    if (operands[k]->element_type() != in_type)
      return ffi::Error::InvalidArgument(std::string(op) + ": operands differ in element type");
  return dispatch_float(in_type, op, [&](auto tag) -> ffi::Error {
    using T = typename decltype(tag)::type;
    if (out->element_type() == in_type)
      return elementwise<T, T>(stream, op, functor, operands, out);
    if constexpr (!std::is_same_v<acc_t<T>, T>) {
      if (out->element_type() == ffi::DataType::F32)
        return elementwise<T, acc_t<T>>(stream, op, functor, operands, out);
    }
    return ffi::Error::InvalidArgument(std::string(op) + ": unexpected output element type");
  });
}

ffi::Error lerp_forward(cudaStream_t stream, ffi::AnyBuffer start, ffi::AnyBuffer end,
                        ffi::AnyBuffer weight, ffi::Result<ffi::AnyBuffer> out) {
  return dispatch(stream, "lerp", LerpForward{}, {&start, &end, &weight}, out);
}

ffi::Error lerp_scalar_forward(cudaStream_t stream, ffi::AnyBuffer start, ffi::AnyBuffer end,
                               double weight, ffi::Result<ffi::AnyBuffer> out) {
  return dispatch(stream, "lerp", LerpScalarForward{weight}, {&start, &end}, out);
}

ffi::Error lerp_backward_start(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer weight,
                               ffi::Result<ffi::AnyBuffer> d_start) {
  return dispatch(stream, "lerp backward", LerpGradStart{}, {&dout, &weight}, d_start);
}

ffi::Error lerp_scalar_backward_start(cudaStream_t stream, ffi::AnyBuffer dout, double weight,
                                      ffi::Result<ffi::AnyBuffer> d_start) {
  return dispatch(stream, "lerp backward", LerpScalarGradStart{weight}, {&dout}, d_start);
}

ffi::Error lerp_backward_end(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer weight,
                             ffi::Result<ffi::AnyBuffer> d_end) {
  return dispatch(stream, "lerp backward", LerpGradEnd{}, {&dout, &weight}, d_end);
}

ffi::Error lerp_scalar_backward_end(cudaStream_t stream, ffi::AnyBuffer dout, double weight,
                                    ffi::Result<ffi::AnyBuffer> d_end) {
  return dispatch(stream, "lerp backward", LerpScalarGradEnd{weight}, {&dout}, d_end);
}

ffi::Error lerp_backward_weight(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer start,
                                ffi::AnyBuffer end, ffi::Result<ffi::AnyBuffer> d_weight) {
  return dispatch(stream, "lerp backward", LerpGradWeight{}, {&dout, &start, &end}, d_weight);
}

using Stream = ffi::PlatformStream<cudaStream_t>;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LerpForwardCuda, lerp_forward,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LerpScalarForwardCuda, lerp_scalar_forward,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<double>("weight")
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LerpBackwardStartCuda, lerp_backward_start,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LerpScalarBackwardStartCuda, lerp_scalar_backward_start,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<double>("weight")
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LerpBackwardEndCuda, lerp_backward_end,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LerpScalarBackwardEndCuda, lerp_scalar_backward_end,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<double>("weight")
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LerpBackwardWeightCuda, lerp_backward_weight,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

JK_REGISTER_TARGET("jk_lerp_fwd", LerpForwardCuda, "lerp", "forward", "cuda elementwise",
                   "bitwise");
JK_REGISTER_TARGET("jk_lerp_scalar_fwd", LerpScalarForwardCuda, "lerp", "forward (scalar weight)",
                   "cuda elementwise", "bitwise");
JK_REGISTER_TARGET("jk_lerp_bwd_input", LerpBackwardStartCuda, "lerp", "backward d_input",
                   "cuda elementwise", "bitwise");
JK_REGISTER_TARGET("jk_lerp_scalar_bwd_input", LerpScalarBackwardStartCuda, "lerp",
                   "backward d_input (scalar weight)", "cuda elementwise", "bitwise");
JK_REGISTER_TARGET("jk_lerp_bwd_end", LerpBackwardEndCuda, "lerp", "backward d_end",
                   "cuda elementwise", "bitwise");
JK_REGISTER_TARGET("jk_lerp_scalar_bwd_end", LerpScalarBackwardEndCuda, "lerp",
                   "backward d_end (scalar weight)", "cuda elementwise", "bitwise");
JK_REGISTER_TARGET("jk_lerp_bwd_weight", LerpBackwardWeightCuda, "lerp", "backward d_weight",
                   "cuda elementwise", "bitwise");

}  // namespace jax_kernels
