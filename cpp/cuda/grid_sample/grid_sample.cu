// CUDA FFI handlers of grid_sample: the forward, the backward for d_input and the backward for
// d_grid (torch.nn.functional.grid_sample semantics; the math is in grid_sample.h), each
// instantiated for both layouts: jk_grid_sample_* (channels-first, NCHW) and
// jk_grid_sample_nhwc_* (channels-last, read and written in place).
//
// Forward and d_grid: one thread per output point computes its taps once, in registers, and
// loops over channels (split into a few channel slices per point when there are too few points
// to fill the GPU; d_grid adds the slices in a fixed order through shared memory). Channels-last,
// the slices are up to a warp of consecutive channels of one point (common.cuh: Lanes), which
// compute the same taps and read each tap's channels in one coalesced load. (The forward's
// kernel is in common.cuh; the NCHW forward that CUDA programs lower to now picks its route on the
// device: forward_copy.cu.)
//
// d_input, deterministic (the default, and always for the half types): the scatter becomes a
// gather. Every (point, tap) pair is an entry keyed by the input cell it touches; a stable
// radix sort (CUB) groups the entries by cell, once per call and independent of the channel
// count; then one thread per (cell, group of channels) adds its entries' weight * dout in
// sorted order. Stable sort + fixed entry order = fixed summation order: bitwise reproducible,
// with no floating-point atomics. Bilinear sampling sorts its points instead, by the corner of
// their taps (common.cuh: corner_scatter), each with its tap weights: same terms, same order, a
// quarter of the entries. Keys, values, weights, segment bounds and CUB's
// temporary storage live in a scratch buffer that XLA provides, sized at trace time by the host
// query "grid_sample_bwd_input_scratch" (defined here). The sorted scatter, the launch shapes and
// the loads are shared with the directional passes (common.cuh, directional.cu).
//
// d_input with deterministic=False (float32/float64): atomicAdd of each tap's contribution.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

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

// ---- backward d_grid ------------------------------------------------------------------------

// Likewise the d_grid pass of the same instances at 6 blocks per SM (40 registers): 10-11%
// faster on the H100 than the compiler's 64 registers, and than 8 blocks, where it spills.
template <class T, class Index, GridSampleMode kMode, int kDims, GridSampleLayout kLayout,
          int kMinBlocks = kLayout == GridSampleLayout::kChannelsFirst &&
                                   small_point_state<T, Index, kMode, kDims>()
                               ? 6
                               : 1>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    backward_grid_kernel(const T* __restrict__ dout, const T* __restrict__ input,
                         const T* __restrict__ grid, T* __restrict__ d_grid, GridSampleCall call) {
  using A = acc_t<T>;
  using Taps = PointTaps<A, Index, kMode, kDims>;
  using L = Lanes<kLayout>;
  __shared__ A partial[kThreads * kDims];  // [slice][point in block][axis]
  const GridSampleGeometry& g = call.geometry;
  const Index points = Index(g.points), channels = Index(g.channels), cells = Index(g.cells);
  const RowLayout<kLayout, Index> in_row{channels, cells}, out_row{channels, points};
  const Index total = Index(g.batch) * points;
  const Index per_block = L::points();
  const unsigned slices = L::slices(), slice = L::slice(), lane = L::point();
  // Block-uniform loop: every thread reaches the barriers.
  const GridStride<Index> blocks(total, unsigned(per_block), 0);
  for (Index base = blocks.first; base < total; base = blocks.next(base)) {
    const bool active = Index(lane) < total - base;
    const Index q = active ? base + Index(lane) : base;
    A sums[kDims] = {};
    if (active) {
      const Index m = q / points;
      const Index p = q - m * points;
      A coord[kDims];
      load_coordinates<A, Index, kDims>(grid, Index(call.grid_map(m)), p, points, coord);
      Taps taps;
      taps.template compute<true>(g, coord);
      const T* in = input + Index(call.input_map(m)) * channels * cells;
      const T* d = dout + Index(call.dout_map(m)) * channels * points + out_row.at(0, p);
#pragma unroll 2
      for (Index c = slice; c < channels; c += slices) {
        const T* plane = in + c * in_row.channel_stride();
        A along[kDims] = {};
        JK_UNROLL
        for (int t = 0; t < Taps::kCount; ++t) {
          const A v = tap_value<A>(plane, taps, t, in_row.position_stride());
          JK_UNROLL
          for (int a = 0; a < kDims; ++a) along[a] += v * taps.slope[a][t];
        }
        const A gout = to_acc(d[c * out_row.channel_stride()]);
        JK_UNROLL
        for (int a = 0; a < kDims; ++a) sums[a] += gout * along[a];
      }
    }
    if (slices == 1) {
      if (active)
        for (int a = 0; a < kDims; ++a) d_grid[q * kDims + a] = from_acc<T>(sums[a]);
      continue;
    }
    for (int a = 0; a < kDims; ++a)
      partial[(slice * unsigned(per_block) + lane) * kDims + a] = sums[a];
    __syncthreads();
    if (slice == 0 && active) {
      for (int a = 0; a < kDims; ++a) {
        A sum = partial[lane * kDims + a];
        for (unsigned s = 1; s < slices; ++s)
          sum += partial[(s * unsigned(per_block) + lane) * kDims + a];
        d_grid[q * kDims + a] = from_acc<T>(sum);
      }
    }
    __syncthreads();
  }
}

// ---- backward d_input with atomics ----------------------------------------------------------

template <class T, class Index, GridSampleMode kMode, int kDims, GridSampleLayout kLayout>
__global__ void __launch_bounds__(kThreads)
    backward_input_atomic_kernel(const T* __restrict__ dout, const T* __restrict__ grid,
                                 T* __restrict__ d_input, GridSampleCall call) {
  using A = acc_t<T>;
  static_assert(std::is_same_v<A, T>, "atomics only for float32 and float64");
  using Taps = PointTaps<A, Index, kMode, kDims>;
  using L = Lanes<kLayout>;
  const GridSampleGeometry& g = call.geometry;
  const Index points = Index(g.points), channels = Index(g.channels), cells = Index(g.cells);
  const RowLayout<kLayout, Index> in_row{channels, cells}, out_row{channels, points};
  const Index total = Index(g.batch) * points;
  const GridStride<Index> loop(total, L::points(), L::point());
  for (Index q = loop.first; q < total; q = loop.next(q)) {
    const Index m = q / points;
    const Index p = q - m * points;
    A coord[kDims];
    load_coordinates<A, Index, kDims>(grid, Index(call.grid_map(m)), p, points, coord);
    Taps taps;
    taps.template compute<false>(g, coord);
    const T* d = dout + Index(call.dout_map(m)) * channels * points + out_row.at(0, p);
    T* result = d_input + m * channels * cells;
    for (Index c = L::slice(); c < channels; c += L::slices()) {
      const A gout = d[c * out_row.channel_stride()];
      T* plane = result + c * in_row.channel_stride();
      JK_UNROLL
      for (int t = 0; t < Taps::kCount; ++t)
        if (taps.valid[t])
          atomicAdd(plane + taps.offset[t] * in_row.position_stride(), taps.weight[t] * gout);
    }
  }
}

// ---- backward d_input, deterministic: sort entries by cell, then gather -------------------------

// Host query "grid_sample_bwd_input_scratch": the scratch bytes of the d_input pass. Arguments:
// `batch` (output batch rows), `points` per row, `cells` per input plane, `extended_cells`
// (the product over the input's spatial axes of size + 1), `dims` (2 or 3), `mode`
// (GridSampleMode), `element_bytes`, `deterministic` and `directional` (the directional d_input
// pass of directional.cu, always on the sorted path). The half types and deterministic=True take
// a sorted path: bilinear first-order passes the corner sort (corner_layout), the others the
// (point, tap) entries' sort (sorted_layout); the atomic path needs none. kSizeOverflow when the
// size cannot be represented.
int64_t backward_input_scratch_query(const QueryArgs& a) {
  const int64_t batch = a["batch"], points = a["points"], cells = a["cells"];
  const int64_t extended = a["extended_cells"];
  const GridSampleMode mode = GridSampleMode(a["mode"]);
  const int64_t taps = taps_per_point(mode, a["dims"]);
  const int64_t element_bytes = a["element_bytes"];
  const bool deterministic = a["deterministic"] != 0;
  const bool directional = a["directional"] != 0;
  if (!(deterministic || directional || element_bytes == 2)) return 0;
  if (batch == 0 || points == 0 || cells == 0) return 0;
  const int64_t total =
      mode == GridSampleMode::kBilinear && !directional
          ? corner_layout(batch, points, extended, taps, element_bytes == 8 ? 8 : 4).total
          : sorted_layout(batch, points, taps, cells, element_bytes == 8 ? 8 : 4).total;
  return total < 0 ? kSizeOverflow : total;
}

template <class T, class Key, class Index, GridSampleMode kMode, int kDims>
__global__ void __launch_bounds__(kThreads)
    build_entries_kernel(const T* __restrict__ grid, Key* __restrict__ keys,
                         Key* __restrict__ values, acc_t<T>* __restrict__ weights,
                         GridSampleCall call, Key sentinel) {
  using A = acc_t<T>;
  using Taps = PointTaps<A, Index, kMode, kDims>;
  const GridSampleGeometry& g = call.geometry;
  const Index points = Index(g.points), cells = Index(g.cells);
  const Index total = Index(g.batch) * points;
  const GridStride<Index> loop(total, blockDim.x, threadIdx.x);
  for (Index q = loop.first; q < total; q = loop.next(q)) {
    const Index m = q / points;
    const Index p = q - m * points;
    A coord[kDims];
    load_coordinates<A, Index, kDims>(grid, Index(call.grid_map(m)), p, points, coord);
    Taps taps;
    taps.template compute<false>(g, coord);
    JK_UNROLL
    for (int t = 0; t < Taps::kCount; ++t) {
      const Index e = Index(t) * total + q;
      keys[e] = taps.valid[t] ? Key(m * cells + taps.offset[t]) : sentinel;
      values[e] = Key(e);
      weights[e] = taps.weight[t];
    }
  }
}

// ---- dispatch -------------------------------------------------------------------------------

template <GridSampleLayout kLayout>
ffi::Error grid_sample_forward(cudaStream_t stream, ffi::AnyBuffer input, ffi::AnyBuffer grid,
                               ffi::Result<ffi::AnyBuffer> out, GridSampleAttrs attrs) {
  const char* op = "grid_sample";
  GridSampleCall call;
  if (auto error = decode_grid_sample_call(op, GridSamplePass::kForward, kLayout, {&input, &grid},
                                          *out, attrs, &call);
      error.failure())
    return error;
  const GridSampleGeometry& g = call.geometry;
  if (g.batch * g.channels * g.points == 0) return ffi::Error::Success();
  const bool narrow =
      fits_32_bits(call, {int64_t(input.element_count()), int64_t(grid.element_count())});
  return dispatch_float(input.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_forward<kLayout>(stream, call, narrow, static_cast<const T*>(input.untyped_data()),
                            static_cast<const T*>(grid.untyped_data()),
                            static_cast<T*>(out->untyped_data()));
    return launch_status(op);
  });
}

template <GridSampleLayout kLayout>
ffi::Error grid_sample_backward_grid(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer input,
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
  if (g.channels == 0)  // nothing to add: the gradient is zero
    return cuda_status(op,
                       cudaMemsetAsync(d_grid->untyped_data(), 0, d_grid->size_bytes(), stream));
  const bool narrow = fits_32_bits(call, {int64_t(dout.element_count()),
                                          int64_t(input.element_count()),
                                          int64_t(grid.element_count())});
  const PointLaunch launch = launch_over_points(g.batch * g.points, g.channels, kLayout);
  return dispatch_float(dout.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_grid_sampler(call.mode, g.dims, [&](auto mode_c, auto dims_c) {
      with_index(narrow, [&](auto index) {
        backward_grid_kernel<T, decltype(index), decltype(mode_c)::value, decltype(dims_c)::value,
                             kLayout>
            <<<launch.grid, launch.block, 0, stream>>>(
                static_cast<const T*>(dout.untyped_data()),
                static_cast<const T*>(input.untyped_data()),
                static_cast<const T*>(grid.untyped_data()),
                static_cast<T*>(d_grid->untyped_data()), call);
      });
    });
    return launch_status(op);
  });
}

// The sorted (deterministic) d_input path, with keys and indices of type Key / Index.
template <class T, class Key, class Index, GridSampleMode kMode, int kDims,
          GridSampleLayout kLayout, int kGatherMinBlocks = 1>
ffi::Error backward_input_sorted(cudaStream_t stream, const GridSampleCall& call,
                                 const SortedLayout& l, const T* dout, const T* grid, T* d_input,
                                 char* scratch) {
  const int64_t total_points = call.geometry.batch * call.geometry.points;
  return sorted_scatter<T, Key, Index, kLayout, kGatherMinBlocks>(
      stream, "grid_sample backward d_input", call, l, dout, d_input, scratch,
      [&](Key* keys, Key* values, acc_t<T>* weights) {
        build_entries_kernel<T, Key, Index, kMode, kDims>
            <<<grid_blocks(total_points, kThreads), kThreads, 0, stream>>>(
                grid, keys, values, weights, call, Key(l.sentinel));
      });
}

template <GridSampleLayout kLayout>
ffi::Error grid_sample_backward_input(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer grid,
                                      ffi::Result<ffi::AnyBuffer> d_input,
                                      ffi::Result<ffi::AnyBuffer> scratch, GridSampleAttrs attrs) {
  const char* op = "grid_sample backward d_input";
  GridSampleCall call;
  if (auto error = decode_grid_sample_call(op, GridSamplePass::kBackwardInput, kLayout, {&dout, &grid},
                                          *d_input, attrs, &call);
      error.failure())
    return error;
  const GridSampleGeometry& g = call.geometry;
  if (g.batch * g.channels == 0) return ffi::Error::Success();
  if (g.points == 0)  // no point touches the input
    return cuda_status(op,
                       cudaMemsetAsync(d_input->untyped_data(), 0, d_input->size_bytes(), stream));
  const bool narrow_index =
      fits_32_bits(call, {int64_t(dout.element_count()), int64_t(grid.element_count())});
  return dispatch_float(dout.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    ffi::Error result = ffi::Error::Success();
    if constexpr (std::is_same_v<A, T>) {
      if (!attrs.deterministic) {
        if (auto error = cuda_status(op, cudaMemsetAsync(d_input->untyped_data(), 0,
                                                         d_input->size_bytes(), stream));
            error.failure())
          return error;
        const PointLaunch launch = launch_over_points(g.batch * g.points, g.channels, kLayout);
        dispatch_grid_sampler(call.mode, g.dims, [&](auto mode_c, auto dims_c) {
          with_index(narrow_index, [&](auto index) {
            backward_input_atomic_kernel<T, decltype(index), decltype(mode_c)::value,
                                         decltype(dims_c)::value, kLayout>
                <<<launch.grid, launch.block, 0, stream>>>(
                    static_cast<const T*>(dout.untyped_data()),
                    static_cast<const T*>(grid.untyped_data()),
                    static_cast<T*>(d_input->untyped_data()), call);
          });
        });
        return launch_status(op);
      }
    }
    const int taps = taps_per_point(call.mode, g.dims);
    const SortedLayout layout = sorted_layout(g.batch, g.points, taps, g.cells, int(sizeof(A)));
    // Bilinear sampling sorts its points by corner where the scratch holds that layout (the
    // query asks for it); a program serialized before the corner sort existed brings the
    // entries' scratch, which may be smaller: it then takes the entries' sort (same bits).
    const SortedLayout corners =
        corner_layout(g.batch, g.points, extended_cells(g), taps, int(sizeof(A)));
    const bool by_corner = call.mode == GridSampleMode::kBilinear && corners.total >= 0 &&
                           int64_t(scratch->size_bytes()) >= corners.total;
    const SortedLayout& chosen = by_corner ? corners : layout;
    if (chosen.total < 0 || int64_t(scratch->size_bytes()) < chosen.total)
      return ffi::Error::InvalidArgument(std::string(op) + ": scratch of " +
                                         std::to_string(scratch->size_bytes()) + " bytes, need " +
                                         std::to_string(call.mode == GridSampleMode::kBilinear
                                                            ? corners.total
                                                            : layout.total));
    char* aligned = aligned_scratch(scratch->untyped_data());
    dispatch_grid_sampler(call.mode, g.dims, [&](auto mode_c, auto dims_c) {
      constexpr GridSampleMode kMode = decltype(mode_c)::value;
      constexpr int kDims = decltype(dims_c)::value;
      const T* dout_data = static_cast<const T*>(dout.untyped_data());
      const T* grid_data = static_cast<const T*>(grid.untyped_data());
      T* result_data = static_cast<T*>(d_input->untyped_data());
      const auto run = [&](auto key, auto index) {
        using Key = decltype(key);
        using Index = decltype(index);
        if constexpr (kMode == GridSampleMode::kBilinear) {
          if (by_corner)
            return corner_scatter<T, Key, Index, kDims, kLayout>(
                stream, op, call, chosen, dout_data, grid_data, result_data, aligned);
        }
        return backward_input_sorted<T, Key, Index, kMode, kDims, kLayout>(
            stream, call, chosen, dout_data, grid_data, result_data, aligned);
      };
      if (chosen.narrow && narrow_index) {
        result = run(uint32_t{}, int32_t{});
      } else if (chosen.narrow) {
        result = run(uint32_t{}, int64_t{});
      } else {
        result = run(uint64_t{}, int64_t{});
      }
    });
    return result;
  });
}

using Stream = ffi::PlatformStream<cudaStream_t>;

}  // namespace
}  // namespace jax_kernels

JK_GRID_SAMPLE_REGISTER_ATTRS();

namespace jax_kernels {

// The three handlers of one layout, as symbols <Prefix>ForwardCuda, <Prefix>BackwardInputCuda and
// <Prefix>BackwardGridCuda.
#define JK_GRID_SAMPLE_CUDA_HANDLERS(Prefix, kLayout)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Prefix##ForwardCuda, grid_sample_forward<kLayout>,              \
                                ffi::Ffi::Bind()                                                \
                                    .Ctx<Stream>()                                              \
                                    .Arg<ffi::AnyBuffer>()                                      \
                                    .Arg<ffi::AnyBuffer>()                                      \
                                    .Ret<ffi::AnyBuffer>()                                      \
                                    .Attrs<GridSampleAttrs>(),                                  \
                                {ffi::Traits::kCmdBufferCompatible});                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Prefix##BackwardInputCuda, grid_sample_backward_input<kLayout>, \
                                ffi::Ffi::Bind()                                                \
                                    .Ctx<Stream>()                                              \
                                    .Arg<ffi::AnyBuffer>()                                      \
                                    .Arg<ffi::AnyBuffer>()                                      \
                                    .Ret<ffi::AnyBuffer>()                                      \
                                    .Ret<ffi::AnyBuffer>()                                      \
                                    .Attrs<GridSampleAttrs>(),                                  \
                                {ffi::Traits::kCmdBufferCompatible});                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Prefix##BackwardGridCuda, grid_sample_backward_grid<kLayout>,   \
                                ffi::Ffi::Bind()                                                \
                                    .Ctx<Stream>()                                              \
                                    .Arg<ffi::AnyBuffer>()                                      \
                                    .Arg<ffi::AnyBuffer>()                                      \
                                    .Arg<ffi::AnyBuffer>()                                      \
                                    .Ret<ffi::AnyBuffer>()                                      \
                                    .Attrs<GridSampleAttrs>(),                                  \
                                {ffi::Traits::kCmdBufferCompatible})

JK_GRID_SAMPLE_CUDA_HANDLERS(GridSample, GridSampleLayout::kChannelsFirst);
JK_GRID_SAMPLE_CUDA_HANDLERS(GridSampleNhwc, GridSampleLayout::kChannelsLast);

JK_REGISTER_TARGET("jk_grid_sample_fwd", GridSampleForwardCuda, "grid_sample", "forward",
                   "cuda gather, taps in registers", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_bwd_input", GridSampleBackwardInputCuda, "grid_sample",
                   "backward d_input",
                   "cuda radix sort by cell + ordered gather (atomics if deterministic=False)",
                   "bitwise (deterministic=True); atomics otherwise for float32/float64");
JK_REGISTER_TARGET("jk_grid_sample_bwd_grid", GridSampleBackwardGridCuda, "grid_sample",
                   "backward d_grid", "cuda gather, fixed-order channel reduction", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_nhwc_fwd", GridSampleNhwcForwardCuda, "grid_sample", "forward",
                   "cuda gather, taps in registers, a warp along C (NHWC)", "bitwise");
JK_REGISTER_TARGET("jk_grid_sample_nhwc_bwd_input", GridSampleNhwcBackwardInputCuda,
                   "grid_sample", "backward d_input",
                   "cuda radix sort by cell + ordered gather along C (NHWC; atomics if "
                   "deterministic=False)",
                   "bitwise (deterministic=True); atomics otherwise for float32/float64");
JK_REGISTER_TARGET("jk_grid_sample_nhwc_bwd_grid", GridSampleNhwcBackwardGridCuda, "grid_sample",
                   "backward d_grid", "cuda gather along C, fixed-order channel reduction (NHWC)",
                   "bitwise");

JK_REGISTER_QUERY("grid_sample_bwd_input_scratch", backward_input_scratch_query);

}  // namespace jax_kernels
