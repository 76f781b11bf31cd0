// CUDA FFI handlers of grid_sample's directional passes (forward mode and second order): the
// forward and the d_input backward with tap weights replaced by their first or second
// directional derivatives along grid directions u[, v], and the derivative of the d_grid
// backward along u. The math is PointTapDerivatives in grid_sample.h, shared with the CPU.
//
// Forward and d_grid: one thread per output point computes its derivative taps once, in
// registers, and loops over channels (the forward splits channels into slices when there are few
// points, like the base forward; d_grid keeps one thread per point, so its channel sum has one
// fixed order). d_input is always the deterministic sorted scatter of the base pass (common.cuh)
// with entries built from the directional weights, in scratch sized by the same host query.
// Nearest sampling's weights are piecewise constant: every directional result is zero.
// Each handler is instantiated for both layouts (jk_grid_sample_*_directional, channels-first;
// jk_grid_sample_nhwc_*_directional, channels-last: the forward then puts a warp along the
// channels of a point, like the base forward, and the sorted scatter gathers along C).
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/grid_stride.cuh"
#include "common/launch.h"
#include "common/radix_sort.cuh"
#include "common/scratch.h"
#include "common/status.h"
#include "grid_sample/common.cuh"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/grid_sample.h"

namespace jax_kernels {
namespace {

using namespace grid_sample_cuda;

// The grid coordinates and the directions of point p of output batch row m, and the point's
// order-kOrder derivative taps.
template <int kOrder, class A, class Index, int kDims, class T, class Taps>
__device__ __forceinline__ void directional_taps(const T* __restrict__ grid,
                                                 const T* __restrict__ u,
                                                 const T* __restrict__ v,
                                                 const GridSampleCall& call,
                                                 const GridSampleDirections& dirs, Index m,
                                                 Index p, Taps* taps) {
  const GridSampleGeometry& g = call.geometry;
  const Index points = Index(g.points);
  A coord[kDims], along_u[kDims], along_v[kDims] = {};
  load_coordinates<A, Index, kDims>(grid, Index(call.grid_map(m)), p, points, coord);
  load_coordinates<A, Index, kDims>(u, Index(dirs.map[0](m)), p, points, along_u);
  if constexpr (kOrder == 2)
    load_coordinates<A, Index, kDims>(v, Index(dirs.map[1](m)), p, points, along_v);
  taps->template compute<kOrder>(g, coord, along_u, along_v);
}

// ---- forward --------------------------------------------------------------------------------

template <class T, class Index, GridSampleMode kMode, int kDims, int kOrder,
          GridSampleLayout kLayout>
__global__ void __launch_bounds__(kThreads)
    forward_directional_kernel(const T* __restrict__ input, const T* __restrict__ grid,
                               const T* __restrict__ u, const T* __restrict__ v,
                               T* __restrict__ out, GridSampleCall call,
                               GridSampleDirections dirs) {
  using A = acc_t<T>;
  using Taps = PointTapDerivatives<A, Index, kMode, kDims>;
  using L = Lanes<kLayout>;
  const GridSampleGeometry& g = call.geometry;
  const Index points = Index(g.points), channels = Index(g.channels), cells = Index(g.cells);
  const RowLayout<kLayout, Index> in_row{channels, cells}, out_row{channels, points};
  const Index total = Index(g.batch) * points;
  const GridStride<Index> loop(total, L::points(), L::point());
  for (Index q = loop.first; q < total; q = loop.next(q)) {
    const Index m = q / points;
    const Index p = q - m * points;
    Taps taps;
    directional_taps<kOrder, A, Index, kDims>(grid, u, v, call, dirs, m, p, &taps);
    const T* in = input + Index(call.input_map(m)) * channels * cells;
    T* o = out + m * channels * points + out_row.at(0, p);
    for (Index c = L::slice(); c < channels; c += L::slices()) {
      const T* plane = in + c * in_row.channel_stride();
      A sum = A(0);
      JK_UNROLL
      for (int t = 0; t < Taps::kCount; ++t)
        sum += taps.weight[t] * tap_value<A>(plane, taps, t, in_row.position_stride());
      o[c * out_row.channel_stride()] = from_acc<T>(sum);
    }
  }
}

// ---- backward d_grid --------------------------------------------------------------------------

// One thread per point in both layouts (channels-last reads are then strided by C per thread).
template <class T, class Index, GridSampleMode kMode, int kDims, GridSampleLayout kLayout>
__global__ void __launch_bounds__(kThreads)
    backward_grid_directional_kernel(const T* __restrict__ dout, const T* __restrict__ input,
                                     const T* __restrict__ grid, const T* __restrict__ u,
                                     T* __restrict__ d_grid, GridSampleCall call,
                                     GridSampleDirections dirs) {
  using A = acc_t<T>;
  using Taps = PointTapDerivatives<A, Index, kMode, kDims>;
  const GridSampleGeometry& g = call.geometry;
  const Index points = Index(g.points), channels = Index(g.channels), cells = Index(g.cells);
  const Index total = Index(g.batch) * points;
  const GridStride<Index> loop(total, blockDim.x, threadIdx.x);
  for (Index q = loop.first; q < total; q = loop.next(q)) {
    const Index m = q / points;
    const Index p = q - m * points;
    A coord[kDims], along_u[kDims];
    load_coordinates<A, Index, kDims>(grid, Index(call.grid_map(m)), p, points, coord);
    load_coordinates<A, Index, kDims>(u, Index(dirs.map[0](m)), p, points, along_u);
    Taps taps;
    taps.compute_hessian_along(g, coord, along_u);
    const RowLayout<kLayout, Index> in_row{channels, cells}, out_row{channels, points};
    const T* in = input + Index(call.input_map(m)) * channels * cells;
    const T* d = dout + Index(call.dout_map(m)) * channels * points + out_row.at(0, p);
    A sums[kDims] = {};
    for (Index c = 0; c < channels; ++c) {
      const T* plane = in + c * in_row.channel_stride();
      A along[kDims] = {};
      JK_UNROLL
      for (int t = 0; t < Taps::kCount; ++t) {
        const A value = tap_value<A>(plane, taps, t, in_row.position_stride());
        JK_UNROLL
        for (int a = 0; a < kDims; ++a) along[a] += value * taps.along[a][t];
      }
      const A gout = to_acc(d[c * out_row.channel_stride()]);
      JK_UNROLL
      for (int a = 0; a < kDims; ++a) sums[a] += gout * along[a];
    }
    JK_UNROLL
    for (int a = 0; a < kDims; ++a) d_grid[q * kDims + a] = from_acc<T>(sums[a]);
  }
}

// ---- backward d_input: the sorted scatter of the directional weights ---------------------------

template <class T, class Key, class Index, GridSampleMode kMode, int kDims, int kOrder>
__global__ void __launch_bounds__(kThreads)
    build_directional_entries_kernel(const T* __restrict__ grid, const T* __restrict__ u,
                                     const T* __restrict__ v, Key* __restrict__ keys,
                                     Key* __restrict__ values, acc_t<T>* __restrict__ weights,
                                     GridSampleCall call, GridSampleDirections dirs,
                                     Key sentinel) {
  using A = acc_t<T>;
  using Taps = PointTapDerivatives<A, Index, kMode, kDims>;
  const GridSampleGeometry& g = call.geometry;
  const Index points = Index(g.points), cells = Index(g.cells);
  const Index total = Index(g.batch) * points;
  const GridStride<Index> loop(total, blockDim.x, threadIdx.x);
  for (Index q = loop.first; q < total; q = loop.next(q)) {
    const Index m = q / points;
    const Index p = q - m * points;
    Taps taps;
    directional_taps<kOrder, A, Index, kDims>(grid, u, v, call, dirs, m, p, &taps);
    JK_UNROLL
    for (int t = 0; t < Taps::kCount; ++t) {
      const Index e = Index(t) * total + q;
      keys[e] = taps.valid[t] ? Key(m * cells + taps.offset[t]) : sentinel;
      values[e] = Key(e);
      weights[e] = taps.weight[t];
    }
  }
}

template <class T, class Key, class Index, GridSampleMode kMode, int kDims, int kOrder,
          GridSampleLayout kLayout>
ffi::Error backward_input_directional_sorted(cudaStream_t stream, const char* op,
                                             const GridSampleCall& call,
                                             const GridSampleDirections& dirs,
                                             const SortedLayout& l, const T* dout, const T* grid,
                                             const T* u, const T* v, T* d_input, char* scratch) {
  const int64_t total_points = call.geometry.batch * call.geometry.points;
  return sorted_scatter<T, Key, Index, kLayout>(
      stream, op, call, l, dout, d_input, scratch,
      [&](Key* keys, Key* values, acc_t<T>* weights) {
        build_directional_entries_kernel<T, Key, Index, kMode, kDims, kOrder>
            <<<grid_blocks(total_points, kThreads), kThreads, 0, stream>>>(
                grid, u, v, keys, values, weights, call, dirs, Key(l.sentinel));
      });
}

// ---- dispatch -------------------------------------------------------------------------------

// Calls f(std::integral_constant<int, directions>{}) for 1 or 2 directions.
template <class F>
void dispatch_directions(int count, F&& f) {
  if (count == 1) {
    f(std::integral_constant<int, 1>{});
  } else {
    f(std::integral_constant<int, 2>{});
  }
}

ffi::Error zero_result(const char* op, ffi::Result<ffi::AnyBuffer>& result, cudaStream_t stream) {
  return cuda_status(op, cudaMemsetAsync(result->untyped_data(), 0, result->size_bytes(), stream));
}

template <GridSampleLayout kLayout>
ffi::Error grid_sample_forward_directional(cudaStream_t stream, ffi::AnyBuffer input,
                                           ffi::AnyBuffer grid, ffi::RemainingArgs directions,
                                           ffi::Result<ffi::AnyBuffer> out,
                                           GridSampleAttrs attrs) {
  const char* op = "grid_sample forward directional";
  GridSampleCall call;
  GridSampleDirections dirs;
  DirectionOperands data;
  if (auto error = decode_grid_sample_directional_call(op, GridSamplePass::kForwardDirectional, kLayout,
                                                       {&input, &grid}, directions, *out, attrs,
                                                       &call, &dirs, &data);
      error.failure())
    return error;
  const GridSampleGeometry& g = call.geometry;
  if (g.batch * g.channels * g.points == 0) return ffi::Error::Success();
  if (call.mode == GridSampleMode::kNearest) return zero_result(op, out, stream);
  const bool narrow = fits_32_bits(
      call, {int64_t(input.element_count()), int64_t(grid.element_count()), data.elements});
  const PointLaunch launch = launch_over_points(g.batch * g.points, g.channels, kLayout);
  return dispatch_float(input.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_differentiable_sampler(call.mode, g.dims, [&](auto mode_c, auto dims_c) {
      dispatch_directions(dirs.count, [&](auto order_c) {
        with_index(narrow, [&](auto index) {
          forward_directional_kernel<T, decltype(index), decltype(mode_c)::value,
                                     decltype(dims_c)::value, decltype(order_c)::value, kLayout>
              <<<launch.grid, launch.block, 0, stream>>>(
                  static_cast<const T*>(input.untyped_data()),
                  static_cast<const T*>(grid.untyped_data()),
                  static_cast<const T*>(data.data[0]), static_cast<const T*>(data.data[1]),
                  static_cast<T*>(out->untyped_data()), call, dirs);
        });
      });
    });
    return launch_status(op);
  });
}

template <GridSampleLayout kLayout>
ffi::Error grid_sample_backward_grid_directional(cudaStream_t stream, ffi::AnyBuffer dout,
                                                 ffi::AnyBuffer input, ffi::AnyBuffer grid,
                                                 ffi::RemainingArgs directions,
                                                 ffi::Result<ffi::AnyBuffer> d_grid,
                                                 GridSampleAttrs attrs) {
  const char* op = "grid_sample backward d_grid directional";
  GridSampleCall call;
  GridSampleDirections dirs;
  DirectionOperands data;
  if (auto error = decode_grid_sample_directional_call(
          op, GridSamplePass::kBackwardGridDirectional, kLayout, {&dout, &input, &grid}, directions,
          *d_grid, attrs, &call, &dirs, &data);
      error.failure())
    return error;
  const GridSampleGeometry& g = call.geometry;
  if (g.batch * g.points == 0) return ffi::Error::Success();
  if (g.channels == 0 || call.mode == GridSampleMode::kNearest)
    return zero_result(op, d_grid, stream);
  const bool narrow =
      fits_32_bits(call, {int64_t(dout.element_count()), int64_t(input.element_count()),
                          int64_t(grid.element_count()), data.elements});
  const int64_t total_points = g.batch * g.points;
  return dispatch_float(dout.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_differentiable_sampler(call.mode, g.dims, [&](auto mode_c, auto dims_c) {
      with_index(narrow, [&](auto index) {
        backward_grid_directional_kernel<T, decltype(index), decltype(mode_c)::value,
                                         decltype(dims_c)::value, kLayout>
            <<<grid_blocks(total_points, kThreads), kThreads, 0, stream>>>(
                static_cast<const T*>(dout.untyped_data()),
                static_cast<const T*>(input.untyped_data()),
                static_cast<const T*>(grid.untyped_data()), static_cast<const T*>(data.data[0]),
                static_cast<T*>(d_grid->untyped_data()), call, dirs);
      });
    });
    return launch_status(op);
  });
}

// Always the sorted (deterministic) path; `deterministic` is ignored.
template <GridSampleLayout kLayout>
ffi::Error grid_sample_backward_input_directional(cudaStream_t stream, ffi::AnyBuffer dout,
                                                  ffi::AnyBuffer grid,
                                                  ffi::RemainingArgs directions,
                                                  ffi::Result<ffi::AnyBuffer> d_input,
                                                  ffi::Result<ffi::AnyBuffer> scratch,
                                                  GridSampleAttrs attrs) {
  const char* op = "grid_sample backward d_input directional";
  GridSampleCall call;
  GridSampleDirections dirs;
  DirectionOperands data;
  if (auto error = decode_grid_sample_directional_call(
          op, GridSamplePass::kBackwardInputDirectional, kLayout, {&dout, &grid}, directions, *d_input,
          attrs, &call, &dirs, &data);
      error.failure())
    return error;
  const GridSampleGeometry& g = call.geometry;
  if (g.batch * g.channels == 0) return ffi::Error::Success();
  // No point touches the input, or no weight depends on the grid.
  if (g.points == 0 || call.mode == GridSampleMode::kNearest)
    return zero_result(op, d_input, stream);
  const bool narrow_index = fits_32_bits(
      call, {int64_t(dout.element_count()), int64_t(grid.element_count()), data.elements});
  return dispatch_float(dout.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const int taps = taps_per_point(call.mode, g.dims);
    const SortedLayout layout = sorted_layout(g.batch, g.points, taps, g.cells, int(sizeof(A)));
    if (layout.total < 0 || int64_t(scratch->size_bytes()) < layout.total)
      return ffi::Error::InvalidArgument(std::string(op) + ": scratch of " +
                                         std::to_string(scratch->size_bytes()) + " bytes, need " +
                                         std::to_string(layout.total));
    char* aligned = aligned_scratch(scratch->untyped_data());
    const T* dout_data = static_cast<const T*>(dout.untyped_data());
    const T* grid_data = static_cast<const T*>(grid.untyped_data());
    const T* u = static_cast<const T*>(data.data[0]);
    const T* v = static_cast<const T*>(data.data[1]);
    T* result_data = static_cast<T*>(d_input->untyped_data());
    ffi::Error result = ffi::Error::Success();
    dispatch_differentiable_sampler(call.mode, g.dims, [&](auto mode_c, auto dims_c) {
      constexpr GridSampleMode kMode = decltype(mode_c)::value;
      constexpr int kDims = decltype(dims_c)::value;
      dispatch_directions(dirs.count, [&](auto order_c) {
        constexpr int kOrder = decltype(order_c)::value;
        if (layout.narrow && narrow_index) {
          result = backward_input_directional_sorted<T, uint32_t, int32_t, kMode, kDims, kOrder,
                                                     kLayout>(
              stream, op, call, dirs, layout, dout_data, grid_data, u, v, result_data, aligned);
        } else if (layout.narrow) {
          result = backward_input_directional_sorted<T, uint32_t, int64_t, kMode, kDims, kOrder,
                                                     kLayout>(
              stream, op, call, dirs, layout, dout_data, grid_data, u, v, result_data, aligned);
        } else {
          result = backward_input_directional_sorted<T, uint64_t, int64_t, kMode, kDims, kOrder,
                                                     kLayout>(
              stream, op, call, dirs, layout, dout_data, grid_data, u, v, result_data, aligned);
        }
      });
    });
    return result;
  });
}

using Stream = ffi::PlatformStream<cudaStream_t>;

}  // namespace
}  // namespace jax_kernels

JK_GRID_SAMPLE_REGISTER_ATTRS();

namespace jax_kernels {

// The three handlers of one layout, as symbols <Prefix>ForwardDirectionalCuda,
// <Prefix>BackwardInputDirectionalCuda and <Prefix>BackwardGridDirectionalCuda.
#define JK_GRID_SAMPLE_DIRECTIONAL_CUDA_HANDLERS(Prefix, kLayout)                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Prefix##ForwardDirectionalCuda,                  \
                                grid_sample_forward_directional<kLayout>,        \
                                ffi::Ffi::Bind()                                  \
                                    .Ctx<Stream>()                                \
                                    .Arg<ffi::AnyBuffer>()                        \
                                    .Arg<ffi::AnyBuffer>()                        \
                                    .RemainingArgs()                              \
                                    .Ret<ffi::AnyBuffer>()                        \
                                    .Attrs<GridSampleAttrs>(),                    \
                                {ffi::Traits::kCmdBufferCompatible});             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Prefix##BackwardInputDirectionalCuda,            \
                                grid_sample_backward_input_directional<kLayout>, \
                                ffi::Ffi::Bind()                                  \
                                    .Ctx<Stream>()                                \
                                    .Arg<ffi::AnyBuffer>()                        \
                                    .Arg<ffi::AnyBuffer>()                        \
                                    .RemainingArgs()                              \
                                    .Ret<ffi::AnyBuffer>()                        \
                                    .Ret<ffi::AnyBuffer>()                        \
                                    .Attrs<GridSampleAttrs>(),                    \
                                {ffi::Traits::kCmdBufferCompatible});             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Prefix##BackwardGridDirectionalCuda,             \
                                grid_sample_backward_grid_directional<kLayout>,  \
                                ffi::Ffi::Bind()                                  \
                                    .Ctx<Stream>()                                \
                                    .Arg<ffi::AnyBuffer>()                        \
                                    .Arg<ffi::AnyBuffer>()                        \
                                    .Arg<ffi::AnyBuffer>()                        \
                                    .RemainingArgs()                              \
                                    .Ret<ffi::AnyBuffer>()                        \
                                    .Attrs<GridSampleAttrs>(),                    \
                                {ffi::Traits::kCmdBufferCompatible})

JK_GRID_SAMPLE_DIRECTIONAL_CUDA_HANDLERS(GridSample, GridSampleLayout::kChannelsFirst);
JK_GRID_SAMPLE_DIRECTIONAL_CUDA_HANDLERS(GridSampleNhwc, GridSampleLayout::kChannelsLast);

JK_REGISTER_TARGET("jk_grid_sample_fwd_directional", GridSampleForwardDirectionalCuda,
                   "grid_sample", "forward directional", "cuda gather, taps in registers",
                   "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_bwd_input_directional", GridSampleBackwardInputDirectionalCuda,
                   "grid_sample", "backward d_input directional",
                   "cuda radix sort by cell + ordered gather", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_bwd_grid_directional", GridSampleBackwardGridDirectionalCuda,
                   "grid_sample", "backward d_grid directional",
                   "cuda gather, one thread per point", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_nhwc_fwd_directional", GridSampleNhwcForwardDirectionalCuda,
                   "grid_sample", "forward directional",
                   "cuda gather, taps in registers, a warp along C (NHWC)", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_nhwc_bwd_input_directional",
                   GridSampleNhwcBackwardInputDirectionalCuda, "grid_sample",
                   "backward d_input directional",
                   "cuda radix sort by cell + ordered gather along C (NHWC)", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_nhwc_bwd_grid_directional",
                   GridSampleNhwcBackwardGridDirectionalCuda, "grid_sample",
                   "backward d_grid directional", "cuda gather, one thread per point (NHWC)",
                   "bitwise");

}  // namespace jax_kernels
