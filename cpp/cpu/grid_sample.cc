// CPU FFI handlers of grid_sample: the forward, the backward for d_input and the backward for
// d_grid (torch.nn.functional.grid_sample semantics; the math is in grid_sample.h), each
// instantiated for both layouts: the jk_grid_sample_* targets (channels-first, NCHW) and the
// jk_grid_sample_nhwc_* targets (channels-last), which read and write NHWC in place.
//
// Output points are processed in tiles: the taps of a tile (cell offsets, weights, slopes) are
// computed once and reused for every channel, so the inner loops run along contiguous rows of
// the output or of dout. The d_input backward gives each (batch row, channel range) to one
// thread, which adds the contributions of all points in point order: like every pass here it
// is deterministic and independent of the thread count.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "jax_kernels/cpu_parallel.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/grid_sample.h"
#include "grid_sample_cpu.h"

namespace jax_kernels {
namespace {

constexpr int64_t kTile = 128;  // output points per tile

// The taps of one tile of points, structure-of-arrays so that the channel loops stream.
template <class A, GridSampleMode kMode, int kDims>
struct TileTaps {
  using Taps = PointTaps<A, int64_t, kMode, kDims>;
  static constexpr int kCount = Taps::kCount;
  int64_t offset[kCount][kTile];
  bool valid[kCount][kTile];
  A weight[kCount][kTile];
  A slope[kDims][kCount][kTile];
  bool all_valid;  // every tap of the tile lies inside the input (the common interior case)

  // Taps of `count` points whose coordinates start at `grid`.
  template <bool kSlopes, class T>
  void compute(const GridSampleGeometry& g, const T* grid, int64_t count) {
    all_valid = true;
    for (int64_t p = 0; p < count; ++p) {
      A coord[kDims];
      for (int d = 0; d < kDims; ++d) coord[d] = to_acc(grid[p * kDims + d]);
      Taps taps;
      taps.template compute<kSlopes>(g, coord);
      for (int t = 0; t < kCount; ++t) {
        offset[t][p] = taps.offset[t];
        valid[t][p] = taps.valid[t];
        all_valid = all_valid && taps.valid[t];
        weight[t][p] = taps.weight[t];
        if constexpr (kSlopes)
          for (int d = 0; d < kDims; ++d) slope[d][t][p] = taps.slope[d][t];
      }
    }
  }

  // The value tap t of point p reads from a channel plane whose cells lie `stride` elements
  // apart. A skipped tap reads cell 0 (always in bounds: skipped taps have offset 0) and counts
  // as zero, whatever that cell holds.
  template <bool kChecked, class T>
  A value(const T* plane, int t, int64_t p, int64_t stride) const {
    const A v = to_acc(plane[offset[t][p] * stride]);
    if constexpr (kChecked) return valid[t][p] ? v : A(0);
    return v;
  }
};

int64_t tiles_per_row(const GridSampleGeometry& g) {
  return grid_sample_cpu::tiles_per_row<kTile>(g);
}
int64_t tile_grain(const GridSampleGeometry& g, int taps) {
  return grid_sample_cpu::tile_grain<kTile>(g, taps);
}

// Calls body(c, std::integral_constant<int, B>) for channel blocks [c, c + B) covering
// [0, channels): blocks of 4 share each tap's offset and weight loads, then single channels.
template <class Body>
void for_channel_blocks(int64_t channels, Body&& body) {
  int64_t c = 0;
  for (; c + 4 <= channels; c += 4) body(c, std::integral_constant<int, 4>{});
  for (; c < channels; ++c) body(c, std::integral_constant<int, 1>{});
}

// Calls body(std::bool_constant<checked>) with checked false when no tap needs a bounds check.
template <class Body>
void with_checks(bool all_valid, Body&& body) {
  if (all_valid) {
    body(std::false_type{});
  } else {
    body(std::true_type{});
  }
}

template <class T, GridSampleMode kMode, int kDims, GridSampleLayout kLayout>
void forward(const GridSampleCall& call, const T* input, const T* grid, T* out) {
  using A = acc_t<T>;
  using Tile = TileTaps<A, kMode, kDims>;
  const GridSampleGeometry& g = call.geometry;
  const RowLayout<kLayout, int64_t> in_row{g.channels, g.cells}, out_row{g.channels, g.points};
  const int64_t tiles = tiles_per_row(g);
  parallel_for(g.batch * tiles, tile_grain(g, Tile::kCount), [&](int64_t begin, int64_t end) {
    auto taps = std::make_unique<Tile>();
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m = item / tiles;
      const int64_t p0 = (item % tiles) * kTile;
      const int64_t count = std::min(kTile, g.points - p0);
      taps->template compute<false>(g, grid + (call.grid_map(m) * g.points + p0) * kDims, count);
      const T* in = input + call.input_map(m) * g.channels * g.cells;
      T* o = out + m * g.channels * g.points;
      with_checks(taps->all_valid, [&](auto checked) {
        constexpr bool kChecked = decltype(checked)::value;
        for_channel_blocks(g.channels, [&](int64_t c, auto block) {
          constexpr int B = decltype(block)::value;
          for (int64_t p = 0; p < count; ++p) {
            A sum[B] = {};
            for (int t = 0; t < Tile::kCount; ++t) {
              const A w = taps->weight[t][p];
              for (int b = 0; b < B; ++b)
                sum[b] += w * taps->template value<kChecked>(in + (c + b) * in_row.channel_stride(),
                                                             t, p, in_row.position_stride());
            }
            for (int b = 0; b < B; ++b) o[out_row.at(c + b, p0 + p)] = from_acc<T>(sum[b]);
          }
        });
      });
    }
  });
}

template <class T, GridSampleMode kMode, int kDims, GridSampleLayout kLayout>
void backward_grid(const GridSampleCall& call, const T* dout, const T* input, const T* grid,
                   T* d_grid) {
  using A = acc_t<T>;
  using Tile = TileTaps<A, kMode, kDims>;
  const GridSampleGeometry& g = call.geometry;
  const RowLayout<kLayout, int64_t> in_row{g.channels, g.cells}, out_row{g.channels, g.points};
  const int64_t tiles = tiles_per_row(g);
  parallel_for(g.batch * tiles, tile_grain(g, Tile::kCount), [&](int64_t begin, int64_t end) {
    auto taps = std::make_unique<Tile>();
    std::vector<A> sums(kDims * kTile);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m = item / tiles;
      const int64_t p0 = (item % tiles) * kTile;
      const int64_t count = std::min(kTile, g.points - p0);
      taps->template compute<true>(g, grid + (call.grid_map(m) * g.points + p0) * kDims, count);
      std::fill(sums.begin(), sums.end(), A(0));
      const T* in = input + call.input_map(m) * g.channels * g.cells;
      const T* d = dout + call.dout_map(m) * g.channels * g.points;
      with_checks(taps->all_valid, [&](auto checked) {
        constexpr bool kChecked = decltype(checked)::value;
        for_channel_blocks(g.channels, [&](int64_t c, auto block) {
          constexpr int B = decltype(block)::value;
          for (int64_t p = 0; p < count; ++p) {
            A along[B][kDims] = {};
            for (int t = 0; t < Tile::kCount; ++t) {
              for (int b = 0; b < B; ++b) {
                const A v = taps->template value<kChecked>(
                    in + (c + b) * in_row.channel_stride(), t, p, in_row.position_stride());
                for (int a = 0; a < kDims; ++a) along[b][a] += v * taps->slope[a][t][p];
              }
            }
            // Channels are added in order, as the block-free loop would.
            for (int b = 0; b < B; ++b) {
              const A gout = to_acc(d[out_row.at(c + b, p0 + p)]);
              for (int a = 0; a < kDims; ++a) sums[a * kTile + p] += gout * along[b][a];
            }
          }
        });
      });
      T* result = d_grid + (m * g.points + p0) * kDims;
      for (int64_t p = 0; p < count; ++p)
        for (int a = 0; a < kDims; ++a) result[p * kDims + a] = from_acc<T>(sums[a * kTile + p]);
    }
  });
}

template <class T, GridSampleMode kMode, int kDims, GridSampleLayout kLayout>
void backward_input(const GridSampleCall& call, const T* dout, const T* grid, T* d_input) {
  using A = acc_t<T>;
  using Tile = TileTaps<A, kMode, kDims>;
  const GridSampleGeometry& g = call.geometry;
  const RowLayout<kLayout, int64_t> out_row{g.channels, g.points};
  const int64_t tiles = tiles_per_row(g);
  grid_sample_cpu::scatter_by_plane_groups<kLayout>(g, d_input, [&](int64_t m, int64_t c0,
                                                                    int64_t c1, A* acc,
                                                                    auto local) {
    auto taps = std::make_unique<Tile>();
    const T* d = dout + call.dout_map(m) * g.channels * g.points;
    const T* grid_row = grid + call.grid_map(m) * g.points * kDims;
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t p0 = tile * kTile;
      const int64_t count = std::min(kTile, g.points - p0);
      taps->template compute<false>(g, grid_row + p0 * kDims, count);
      with_checks(taps->all_valid, [&](auto checked) {
        for_channel_blocks(c1 - c0, [&](int64_t c, auto block) {
          constexpr int B = decltype(block)::value;
          for (int64_t p = 0; p < count; ++p) {
            A gout[B];
            for (int b = 0; b < B; ++b) gout[b] = to_acc(d[out_row.at(c0 + c + b, p0 + p)]);
            for (int t = 0; t < Tile::kCount; ++t) {
              if (decltype(checked)::value && !taps->valid[t][p]) continue;
              const int64_t offset = taps->offset[t][p];
              const A w = taps->weight[t][p];
              for (int b = 0; b < B; ++b) acc[local.at(c + b, offset)] += w * gout[b];
            }
          }
        });
      });
    }
  });
}


template <GridSampleLayout kLayout>
ffi::Error grid_sample_forward(ffi::AnyBuffer input, ffi::AnyBuffer grid,
                               ffi::Result<ffi::AnyBuffer> out, GridSampleAttrs attrs) {
  const char* op = "grid_sample";
  GridSampleCall call;
  if (auto error = decode_grid_sample_call(op, GridSamplePass::kForward, kLayout, {&input, &grid},
                                          *out, attrs, &call);
      error.failure())
    return error;
  const GridSampleGeometry& g = call.geometry;
  if (g.batch * g.channels * g.points == 0) return ffi::Error::Success();
  return dispatch_float(input.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_grid_sampler(call.mode, g.dims, [&](auto mode_c, auto dims_c) {
      forward<T, decltype(mode_c)::value, decltype(dims_c)::value, kLayout>(
          call, static_cast<const T*>(input.untyped_data()),
          static_cast<const T*>(grid.untyped_data()), static_cast<T*>(out->untyped_data()));
    });
    return ffi::Error::Success();
  });
}

// jk_grid_sample_fwd_adaptive: on CUDA the forward that may sample a channels-last copy of its
// input, in its scratch (forward_copy.cu). The Python side emits it for CUDA only; the CPU
// registers it too (every target exists on every platform), ignores the scratch and samples in
// place.
ffi::Error grid_sample_forward_adaptive(ffi::AnyBuffer input, ffi::AnyBuffer grid,
                                        ffi::Result<ffi::AnyBuffer> out,
                                        ffi::Result<ffi::AnyBuffer>, GridSampleAttrs attrs) {
  return grid_sample_forward<GridSampleLayout::kChannelsFirst>(input, grid, out, attrs);
}

// The scratch result exists for the CUDA deterministic path; on the CPU it is empty.
template <GridSampleLayout kLayout>
ffi::Error grid_sample_backward_input(ffi::AnyBuffer dout, ffi::AnyBuffer grid,
                                      ffi::Result<ffi::AnyBuffer> d_input,
                                      ffi::Result<ffi::AnyBuffer> /*scratch*/,
                                      GridSampleAttrs attrs) {
  const char* op = "grid_sample backward d_input";
  GridSampleCall call;
  if (auto error = decode_grid_sample_call(op, GridSamplePass::kBackwardInput, kLayout, {&dout, &grid},
                                          *d_input, attrs, &call);
      error.failure())
    return error;
  const GridSampleGeometry& g = call.geometry;
  if (g.batch * g.channels == 0) return ffi::Error::Success();
  return dispatch_float(dout.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_grid_sampler(call.mode, g.dims, [&](auto mode_c, auto dims_c) {
      backward_input<T, decltype(mode_c)::value, decltype(dims_c)::value, kLayout>(
          call, static_cast<const T*>(dout.untyped_data()),
          static_cast<const T*>(grid.untyped_data()), static_cast<T*>(d_input->untyped_data()));
    });
    return ffi::Error::Success();
  });
}

template <GridSampleLayout kLayout>
ffi::Error grid_sample_backward_grid(ffi::AnyBuffer dout, ffi::AnyBuffer input,
                                     ffi::AnyBuffer grid, ffi::Result<ffi::AnyBuffer> d_grid,
                                     GridSampleAttrs attrs) {
  const char* op = "grid_sample backward d_grid";
  GridSampleCall call;
  if (auto error = decode_grid_sample_call(op, GridSamplePass::kBackwardGrid, kLayout,
                                          {&dout, &input, &grid}, *d_grid, attrs, &call);
      error.failure())
    return error;
  const GridSampleGeometry& g = call.geometry;
  if (g.batch * g.points == 0) return ffi::Error::Success();
  return dispatch_float(dout.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_grid_sampler(call.mode, g.dims, [&](auto mode_c, auto dims_c) {
      backward_grid<T, decltype(mode_c)::value, decltype(dims_c)::value, kLayout>(
          call, static_cast<const T*>(dout.untyped_data()),
          static_cast<const T*>(input.untyped_data()), static_cast<const T*>(grid.untyped_data()),
          static_cast<T*>(d_grid->untyped_data()));
    });
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jax_kernels

JK_GRID_SAMPLE_REGISTER_ATTRS();

namespace jax_kernels {

// The three handlers of one layout, as symbols <Prefix>ForwardCpu, <Prefix>BackwardInputCpu and
// <Prefix>BackwardGridCpu.
#define JK_GRID_SAMPLE_CPU_HANDLERS(Prefix, kLayout)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Prefix##ForwardCpu, grid_sample_forward<kLayout>,              \
                                ffi::Ffi::Bind()                                               \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Ret<ffi::AnyBuffer>()                                     \
                                    .Attrs<GridSampleAttrs>());                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Prefix##BackwardInputCpu, grid_sample_backward_input<kLayout>, \
                                ffi::Ffi::Bind()                                               \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Ret<ffi::AnyBuffer>()                                     \
                                    .Ret<ffi::AnyBuffer>()                                     \
                                    .Attrs<GridSampleAttrs>());                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Prefix##BackwardGridCpu, grid_sample_backward_grid<kLayout>,   \
                                ffi::Ffi::Bind()                                               \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Ret<ffi::AnyBuffer>()                                     \
                                    .Attrs<GridSampleAttrs>())

JK_GRID_SAMPLE_CPU_HANDLERS(GridSample, GridSampleLayout::kChannelsFirst);
JK_GRID_SAMPLE_CPU_HANDLERS(GridSampleNhwc, GridSampleLayout::kChannelsLast);

XLA_FFI_DEFINE_HANDLER_SYMBOL(GridSampleForwardAdaptiveCpu, grid_sample_forward_adaptive,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attrs<GridSampleAttrs>());

JK_REGISTER_TARGET("jk_grid_sample_fwd", GridSampleForwardCpu, "grid_sample", "forward",
                   "cpu tiled gather", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_fwd_adaptive", GridSampleForwardAdaptiveCpu, "grid_sample",
                   "forward", "cpu tiled gather (the scratch unused)", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_bwd_input", GridSampleBackwardInputCpu, "grid_sample",
                   "backward d_input", "cpu ordered scatter per channel range", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_bwd_grid", GridSampleBackwardGridCpu, "grid_sample",
                   "backward d_grid", "cpu tiled gather", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_nhwc_fwd", GridSampleNhwcForwardCpu, "grid_sample", "forward",
                   "cpu tiled gather, NHWC", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_nhwc_bwd_input", GridSampleNhwcBackwardInputCpu,
                   "grid_sample", "backward d_input",
                   "cpu ordered scatter per channel range, NHWC", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_nhwc_bwd_grid", GridSampleNhwcBackwardGridCpu, "grid_sample",
                   "backward d_grid", "cpu tiled gather, NHWC", "bitwise");

}  // namespace jax_kernels
