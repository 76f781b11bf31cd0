// CPU FFI handlers of grid_sample's directional passes: the forward and the d_input backward
// with tap weights replaced by their first or second directional derivatives along grid
// directions u[, v], and the derivative of the d_grid backward along u (the math, shared with
// CUDA, is PointTapDerivatives in grid_sample.h). They serve forward mode and second order.
// Each is instantiated for both layouts (jk_grid_sample_*_directional, channels-first, and
// jk_grid_sample_nhwc_*_directional, channels-last).
//
// Like the base passes (grid_sample.cc), points are processed in tiles whose taps are computed
// once and reused for every channel; d_input gives each (batch row, channel range) to one thread,
// which adds contributions in point order: deterministic and independent of the thread count.
// Nearest sampling's weights are piecewise constant: every directional result is zero.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "jax_kernels/cpu_parallel.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/grid_sample.h"
#include "grid_sample_cpu.h"

namespace jax_kernels {
namespace {

constexpr int64_t kTile = 64;  // output points per tile

int64_t tiles_per_row(const GridSampleGeometry& g) {
  return grid_sample_cpu::tiles_per_row<kTile>(g);
}
int64_t tile_grain(const GridSampleGeometry& g, int taps) {
  return grid_sample_cpu::tile_grain<kTile>(g, taps);
}

// Row `map(m)`, point p of a grid-shaped array [S, points, dims], in the accumulation type.
template <class A, int kDims, class T>
void load_point(const T* data, BatchMap map, int64_t m, int64_t points, int64_t p,
                A (&out)[kDims]) {
  const T* at = data + (map(m) * points + p) * kDims;
  for (int d = 0; d < kDims; ++d) out[d] = to_acc(at[d]);
}

// The order-kOrder directional taps of points [p0, p0 + count) of batch row m.
template <int kOrder, class T, class Taps, int kDims>
void directional_taps(const GridSampleCall& call, const GridSampleDirections& dirs,
                      const T* grid, const T* const (&direction)[2], int64_t m, int64_t p0,
                      int64_t count, Taps* taps) {
  using A = acc_t<T>;
  const GridSampleGeometry& g = call.geometry;
  for (int64_t p = 0; p < count; ++p) {
    A coord[kDims], u[kDims], v[kDims] = {};
    load_point(grid, call.grid_map, m, g.points, p0 + p, coord);
    load_point(direction[0], dirs.map[0], m, g.points, p0 + p, u);
    if constexpr (kOrder == 2) load_point(direction[1], dirs.map[1], m, g.points, p0 + p, v);
    taps[p].template compute<kOrder>(g, coord, u, v);
  }
}

template <class T, GridSampleMode kMode, int kDims, int kOrder, GridSampleLayout kLayout>
void forward_directional(const GridSampleCall& call, const GridSampleDirections& dirs,
                         const T* input, const T* grid, const T* const (&direction)[2], T* out) {
  using A = acc_t<T>;
  using Taps = PointTapDerivatives<A, int64_t, kMode, kDims>;
  const GridSampleGeometry& g = call.geometry;
  const RowLayout<kLayout, int64_t> in_row{g.channels, g.cells}, out_row{g.channels, g.points};
  const int64_t stride = in_row.position_stride();
  const int64_t tiles = tiles_per_row(g);
  parallel_for(g.batch * tiles, tile_grain(g, Taps::kCount), [&](int64_t begin, int64_t end) {
    std::vector<Taps> taps(kTile);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m = item / tiles;
      const int64_t p0 = (item % tiles) * kTile;
      const int64_t count = std::min(kTile, g.points - p0);
      directional_taps<kOrder, T, Taps, kDims>(call, dirs, grid, direction, m, p0, count,
                                               taps.data());
      const T* in = input + call.input_map(m) * g.channels * g.cells;
      T* o = out + m * g.channels * g.points;
      for (int64_t c = 0; c < g.channels; ++c) {
        const T* plane = in + c * in_row.channel_stride();
        for (int64_t p = 0; p < count; ++p) {
          const Taps& tp = taps[p];
          A sum = A(0);
          for (int t = 0; t < Taps::kCount; ++t)
            if (tp.valid[t]) sum += tp.weight[t] * to_acc(plane[tp.offset[t] * stride]);
          o[out_row.at(c, p0 + p)] = from_acc<T>(sum);
        }
      }
    }
  });
}

template <class T, GridSampleMode kMode, int kDims, int kOrder, GridSampleLayout kLayout>
void backward_input_directional(const GridSampleCall& call, const GridSampleDirections& dirs,
                                const T* dout, const T* grid, const T* const (&direction)[2],
                                T* d_input) {
  using A = acc_t<T>;
  using Taps = PointTapDerivatives<A, int64_t, kMode, kDims>;
  const GridSampleGeometry& g = call.geometry;
  const RowLayout<kLayout, int64_t> out_row{g.channels, g.points};
  const int64_t tiles = tiles_per_row(g);
  grid_sample_cpu::scatter_by_plane_groups<kLayout>(g, d_input, [&](int64_t m, int64_t c0,
                                                                    int64_t c1, A* acc,
                                                                    auto local) {
    std::vector<Taps> taps(kTile);
    const T* d = dout + call.dout_map(m) * g.channels * g.points;
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t p0 = tile * kTile;
      const int64_t count = std::min(kTile, g.points - p0);
      directional_taps<kOrder, T, Taps, kDims>(call, dirs, grid, direction, m, p0, count,
                                               taps.data());
      for (int64_t c = c0; c < c1; ++c) {
        A* plane = acc + (c - c0) * local.channel_stride();
        const int64_t stride = local.position_stride();
        for (int64_t p = 0; p < count; ++p) {
          const Taps& tp = taps[p];
          const A gout = to_acc(d[out_row.at(c, p0 + p)]);
          for (int t = 0; t < Taps::kCount; ++t)
            if (tp.valid[t]) plane[tp.offset[t] * stride] += tp.weight[t] * gout;
        }
      }
    }
  });
}

template <class T, GridSampleMode kMode, int kDims, GridSampleLayout kLayout>
void backward_grid_directional(const GridSampleCall& call, const GridSampleDirections& dirs,
                               const T* dout, const T* input, const T* grid, const T* direction,
                               T* d_grid) {
  using A = acc_t<T>;
  using Taps = PointTapDerivatives<A, int64_t, kMode, kDims>;
  const GridSampleGeometry& g = call.geometry;
  const RowLayout<kLayout, int64_t> in_row{g.channels, g.cells}, out_row{g.channels, g.points};
  const int64_t stride = in_row.position_stride();
  const int64_t tiles = tiles_per_row(g);
  parallel_for(g.batch * tiles, tile_grain(g, Taps::kCount), [&](int64_t begin, int64_t end) {
    std::vector<Taps> taps(kTile);
    std::vector<A> sums(kTile * kDims);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m = item / tiles;
      const int64_t p0 = (item % tiles) * kTile;
      const int64_t count = std::min(kTile, g.points - p0);
      for (int64_t p = 0; p < count; ++p) {
        A coord[kDims], u[kDims];
        load_point(grid, call.grid_map, m, g.points, p0 + p, coord);
        load_point(direction, dirs.map[0], m, g.points, p0 + p, u);
        taps[p].compute_hessian_along(g, coord, u);
      }
      std::fill(sums.begin(), sums.end(), A(0));
      const T* in = input + call.input_map(m) * g.channels * g.cells;
      const T* d = dout + call.dout_map(m) * g.channels * g.points;
      for (int64_t c = 0; c < g.channels; ++c) {
        const T* plane = in + c * in_row.channel_stride();
        for (int64_t p = 0; p < count; ++p) {
          const Taps& tp = taps[p];
          A along[kDims] = {};
          for (int t = 0; t < Taps::kCount; ++t) {
            if (!tp.valid[t]) continue;
            const A value = to_acc(plane[tp.offset[t] * stride]);
            for (int a = 0; a < kDims; ++a) along[a] += value * tp.along[a][t];
          }
          const A gout = to_acc(d[out_row.at(c, p0 + p)]);
          for (int a = 0; a < kDims; ++a) sums[p * kDims + a] += gout * along[a];
        }
      }
      T* result = d_grid + (m * g.points + p0) * kDims;
      for (int64_t i = 0; i < count * kDims; ++i) result[i] = from_acc<T>(sums[i]);
    }
  });
}

// Calls f(std::integral_constant<int, directions>{}) for 1 or 2 directions.
template <class F>
void dispatch_directions(int count, F&& f) {
  if (count == 1) {
    f(std::integral_constant<int, 1>{});
  } else {
    f(std::integral_constant<int, 2>{});
  }
}

template <GridSampleLayout kLayout>
ffi::Error grid_sample_forward_directional(ffi::AnyBuffer input, ffi::AnyBuffer grid,
                                           ffi::RemainingArgs directions,
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
  if (call.mode == GridSampleMode::kNearest) {
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  return dispatch_float(input.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* const direction[2] = {static_cast<const T*>(data.data[0]),
                                   static_cast<const T*>(data.data[1])};
    dispatch_differentiable_sampler(call.mode, g.dims, [&](auto mode_c, auto dims_c) {
      dispatch_directions(dirs.count, [&](auto order_c) {
        forward_directional<T, decltype(mode_c)::value, decltype(dims_c)::value,
                            decltype(order_c)::value, kLayout>(
            call, dirs, static_cast<const T*>(input.untyped_data()),
            static_cast<const T*>(grid.untyped_data()), direction,
            static_cast<T*>(out->untyped_data()));
      });
    });
    return ffi::Error::Success();
  });
}

// The scratch result exists for the CUDA sorted path; on the CPU it is empty.
template <GridSampleLayout kLayout>
ffi::Error grid_sample_backward_input_directional(ffi::AnyBuffer dout, ffi::AnyBuffer grid,
                                                  ffi::RemainingArgs directions,
                                                  ffi::Result<ffi::AnyBuffer> d_input,
                                                  ffi::Result<ffi::AnyBuffer> /*scratch*/,
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
  if (call.mode == GridSampleMode::kNearest) {
    std::memset(d_input->untyped_data(), 0, d_input->size_bytes());
    return ffi::Error::Success();
  }
  return dispatch_float(dout.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* const direction[2] = {static_cast<const T*>(data.data[0]),
                                   static_cast<const T*>(data.data[1])};
    dispatch_differentiable_sampler(call.mode, g.dims, [&](auto mode_c, auto dims_c) {
      dispatch_directions(dirs.count, [&](auto order_c) {
        backward_input_directional<T, decltype(mode_c)::value, decltype(dims_c)::value,
                                   decltype(order_c)::value, kLayout>(
            call, dirs, static_cast<const T*>(dout.untyped_data()),
            static_cast<const T*>(grid.untyped_data()), direction,
            static_cast<T*>(d_input->untyped_data()));
      });
    });
    return ffi::Error::Success();
  });
}

template <GridSampleLayout kLayout>
ffi::Error grid_sample_backward_grid_directional(ffi::AnyBuffer dout, ffi::AnyBuffer input,
                                                 ffi::AnyBuffer grid,
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
  if (call.mode == GridSampleMode::kNearest) {
    std::memset(d_grid->untyped_data(), 0, d_grid->size_bytes());
    return ffi::Error::Success();
  }
  return dispatch_float(dout.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_differentiable_sampler(call.mode, g.dims, [&](auto mode_c, auto dims_c) {
      backward_grid_directional<T, decltype(mode_c)::value, decltype(dims_c)::value, kLayout>(
          call, dirs, static_cast<const T*>(dout.untyped_data()),
          static_cast<const T*>(input.untyped_data()), static_cast<const T*>(grid.untyped_data()),
          static_cast<const T*>(data.data[0]), static_cast<T*>(d_grid->untyped_data()));
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jax_kernels

JK_GRID_SAMPLE_REGISTER_ATTRS();

namespace jax_kernels {

// The three handlers of one layout, as symbols <Prefix>ForwardDirectionalCpu,
// <Prefix>BackwardInputDirectionalCpu and <Prefix>BackwardGridDirectionalCpu.
#define JK_GRID_SAMPLE_DIRECTIONAL_CPU_HANDLERS(Prefix, kLayout)                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Prefix##ForwardDirectionalCpu,                   \
                                grid_sample_forward_directional<kLayout>,        \
                                ffi::Ffi::Bind()                                  \
                                    .Arg<ffi::AnyBuffer>()                        \
                                    .Arg<ffi::AnyBuffer>()                        \
                                    .RemainingArgs()                              \
                                    .Ret<ffi::AnyBuffer>()                        \
                                    .Attrs<GridSampleAttrs>());                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Prefix##BackwardInputDirectionalCpu,             \
                                grid_sample_backward_input_directional<kLayout>, \
                                ffi::Ffi::Bind()                                  \
                                    .Arg<ffi::AnyBuffer>()                        \
                                    .Arg<ffi::AnyBuffer>()                        \
                                    .RemainingArgs()                              \
                                    .Ret<ffi::AnyBuffer>()                        \
                                    .Ret<ffi::AnyBuffer>()                        \
                                    .Attrs<GridSampleAttrs>());                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Prefix##BackwardGridDirectionalCpu,              \
                                grid_sample_backward_grid_directional<kLayout>,  \
                                ffi::Ffi::Bind()                                  \
                                    .Arg<ffi::AnyBuffer>()                        \
                                    .Arg<ffi::AnyBuffer>()                        \
                                    .Arg<ffi::AnyBuffer>()                        \
                                    .RemainingArgs()                              \
                                    .Ret<ffi::AnyBuffer>()                        \
                                    .Attrs<GridSampleAttrs>())

JK_GRID_SAMPLE_DIRECTIONAL_CPU_HANDLERS(GridSample, GridSampleLayout::kChannelsFirst);
JK_GRID_SAMPLE_DIRECTIONAL_CPU_HANDLERS(GridSampleNhwc, GridSampleLayout::kChannelsLast);

JK_REGISTER_TARGET("jk_grid_sample_fwd_directional", GridSampleForwardDirectionalCpu,
                   "grid_sample", "forward directional", "cpu tiled gather", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_bwd_input_directional", GridSampleBackwardInputDirectionalCpu,
                   "grid_sample", "backward d_input directional",
                   "cpu ordered scatter per channel range", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_bwd_grid_directional", GridSampleBackwardGridDirectionalCpu,
                   "grid_sample", "backward d_grid directional", "cpu tiled gather", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_nhwc_fwd_directional", GridSampleNhwcForwardDirectionalCpu,
                   "grid_sample", "forward directional", "cpu tiled gather, NHWC", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_nhwc_bwd_input_directional",
                   GridSampleNhwcBackwardInputDirectionalCpu, "grid_sample",
                   "backward d_input directional", "cpu ordered scatter per channel range, NHWC",
                   "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_nhwc_bwd_grid_directional",
                   GridSampleNhwcBackwardGridDirectionalCpu, "grid_sample",
                   "backward d_grid directional", "cpu tiled gather, NHWC", "bitwise");

}  // namespace jax_kernels
