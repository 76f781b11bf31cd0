// What the grid_sample passes (grid_sample.cu, forward_copy.cu) and its directional passes
// (directional.cu) share on CUDA: launch shapes over output points and the threads' roles in them
// per layout (Lanes), coordinate and tap loads, the choice of index width, the in-place forward
// kernel (with the route flag of forward_copy.cu), and the deterministic sorted scatter of d_input:
// every (point, tap) entry keyed by the input cell it touches, a stable radix sort (CUB) that
// groups the entries by cell once per call, then one thread per (cell, group of channels) that adds
// weight * dout in sorted order (channels-last: one thread per (cell, channel), consecutive threads
// on consecutive channels); for bilinear first-order passes, the same with the points sorted by the
// corner of their taps (corner_scatter). Its arrays live in XLA-provided scratch laid out by
// SortedLayout (the host query "grid_sample_bwd_input_scratch" sizes it at trace time, for both
// passes).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "common/grid_stride.cuh"
#include "common/launch.h"
#include "common/radix_sort.cuh"
#include "common/scratch.h"
#include "common/status.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/grid_sample.h"

namespace jax_kernels {
namespace grid_sample_cuda {

constexpr int kThreads = 256;
constexpr int kMaxSlices = 8;

// ---- launch shapes ----------------------------------------------------------------------------

// Blocks of kThreads = (points per block) x (channel slices); a slice takes channels s,
// s + slices, ... Channels-first: more slices when the points alone would leave most of the
// GPU's thread slots empty, as long as each slice keeps at least 16 channels to amortize the
// taps it recomputes. Channels-last: a slice per channel up to a warp (the smallest power of two
// >= C, at most 32), so that a warp reads a tap's channels in one coalesced go.
struct PointLaunch {
  dim3 grid;
  dim3 block;
};

constexpr int kMaxChannelsLastSlices = 32;

inline PointLaunch launch_over_points(int64_t points, int64_t channels,
                                      GridSampleLayout layout = GridSampleLayout::kChannelsFirst) {
  int slices = 1;
  if (layout == GridSampleLayout::kChannelsLast) {
    while (slices < kMaxChannelsLastSlices && slices < channels) slices *= 2;
    const int per_block = kThreads / slices;
    return PointLaunch{dim3(grid_blocks(points, per_block)), dim3(slices, per_block)};
  }
  // The channel slices of a point are added in a fixed order (d_grid): their count must not
  // follow the device's multiprocessor count.
  const int64_t resident = int64_t(kReductionMultiprocessors) * 2048;
  while (slices < kMaxSlices && points * slices < resident && channels >= 32 * slices) slices *= 2;
  const int per_block = kThreads / slices;
  return PointLaunch{dim3(grid_blocks(points, per_block)), dim3(per_block, slices)};
}

// The roles of a point kernel's threads (launched by launch_over_points): which of its block's
// points a thread serves, and its channel slice. Channels-first, threadIdx.x runs along the
// points (a warp's loads and stores of one channel coalesce in NCHW); channels-last along the
// slices (a warp's are one point's consecutive channels in NHWC).
template <GridSampleLayout kLayout>
struct Lanes {
  static constexpr bool kLast = kLayout == GridSampleLayout::kChannelsLast;
  __device__ __forceinline__ static unsigned point() { return kLast ? threadIdx.y : threadIdx.x; }
  __device__ __forceinline__ static unsigned points() { return kLast ? blockDim.y : blockDim.x; }
  __device__ __forceinline__ static unsigned slice() { return kLast ? threadIdx.x : threadIdx.y; }
  __device__ __forceinline__ static unsigned slices() { return kLast ? blockDim.x : blockDim.y; }
};

template <class A, class Index, int kDims, class T>
__device__ __forceinline__ void load_coordinates(const T* __restrict__ grid, Index row, Index p,
                                                 Index points, A (&coord)[kDims]) {
  const T* at = grid + (row * points + p) * kDims;
  JK_UNROLL
  for (int d = 0; d < kDims; ++d) coord[d] = to_acc(at[d]);
}

// A skipped tap never reads memory and counts as zero. The plane's cells lie `stride` elements
// apart (1 channels-first, C channels-last).
template <class A, class T, class Taps, class Index>
__device__ __forceinline__ A tap_value(const T* __restrict__ plane, const Taps& taps, int t,
                                       Index stride) {
  return taps.valid[t] ? to_acc(plane[taps.offset[t] * stride]) : A(0);
}

// ---- backward d_input, deterministic: sort entries by cell, then gather -------------------------

// Where the sorted path keeps its arrays in the scratch buffer (offsets from its aligned base).
// Entries are (tap, point) pairs, tap-major: entry e = t * total_points + q. Keys are cells
// m * cells + offset, or the sentinel batch * cells for a tap outside the input. Narrow problems
// use 32-bit keys and indices. total is -1 when the sizes cannot be represented.
struct SortedLayout {
  bool narrow = true;
  int64_t entries = 0;
  int64_t sentinel = 0;
  int end_bit = 0;
  int64_t keys[2], values[2], weights, sorted_weights, starts, ends, sort_temp, sort_temp_bytes;
  int64_t total = 0;  // bytes to ask for
};

// The scratch of a sort of `entries` entries with keys below `sentinel` (the sentinel itself sorts
// last), with `weight_bytes` of weights per entry before and after the sort.
inline SortedLayout lay_out_sort(int64_t entries, int64_t sentinel, int weight_bytes) {
  SortedLayout l;
  l.entries = entries;
  l.sentinel = sentinel;
  if (l.entries < 0 || l.sentinel < 0) {
    l.total = -1;
    return l;
  }
  l.narrow = l.entries < (int64_t{1} << 31) && l.sentinel < (int64_t{1} << 31);
  const int64_t key_bytes = l.narrow ? 4 : 8;
  l.end_bit = key_bits(uint64_t(l.sentinel));
  const int64_t key_array = checked_mul(l.entries, key_bytes);
  const int64_t weight_array = checked_mul(l.entries, weight_bytes);
  const int64_t bounds_array = checked_mul(l.sentinel, key_bytes);
  ScratchLayout layout;
  l.keys[0] = layout.take(key_array);
  l.keys[1] = layout.take(key_array);
  l.values[0] = layout.take(key_array);
  l.values[1] = layout.take(key_array);
  l.weights = layout.take(weight_array);
  l.sorted_weights = layout.take(weight_array);
  l.starts = layout.take(bounds_array);
  l.ends = layout.take(bounds_array);
  l.sort_temp_bytes = radix_sort_temp_bound(l.entries, l.end_bit);
  l.sort_temp = layout.take(l.sort_temp_bytes);
  l.total = layout.total();
  return l;
}

// The (point, tap) entries' sort (sorted_scatter).
inline SortedLayout sorted_layout(int64_t batch, int64_t points, int64_t taps, int64_t cells,
                                  int acc_bytes) {
  return lay_out_sort(checked_product({batch, points, taps}), checked_product({batch, cells}),
                      acc_bytes);
}

// The bilinear points' sort by corner (corner_scatter): one entry per point, keyed by its
// corner in the extended grid of prod(size + 1) cells per batch row, with the point's `taps`
// (2^dims) tap weights of acc_bytes each.
inline SortedLayout corner_layout(int64_t batch, int64_t points, int64_t extended_cells,
                                  int64_t taps, int acc_bytes) {
  return lay_out_sort(checked_product({batch, points}), checked_product({batch, extended_cells}),
                      int(taps) * acc_bytes);
}

// Cells per batch row of the extended grid: prod over the axes of (size + 1).
inline int64_t extended_cells(const GridSampleGeometry& g) {
  int64_t cells = 1;
  for (int d = 0; d < g.dims; ++d) cells = checked_mul(cells, checked_add(g.size[d], 1));
  return cells;
}

// Taps per point of a sampling mode: nearest 1, bilinear 4 (2-D) or 8 (3-D), bicubic 16.
inline int taps_per_point(GridSampleMode mode, int64_t dims) {
  if (mode == GridSampleMode::kNearest) return 1;
  if (mode == GridSampleMode::kBilinear) return dims == 2 ? 4 : 8;
  return 16;
}

// Marks the segment [start, end) of each cell in the sorted keys, and lays out the entries'
// points (within their batch row) and weights in sorted order for the gather. Cells without
// entries keep start = end = 0.
template <class A, class Key>
__global__ void __launch_bounds__(kThreads)
    segment_kernel(const Key* __restrict__ keys, const Key* __restrict__ values,
                   const A* __restrict__ weights, Key* __restrict__ starts, Key* __restrict__ ends,
                   Key* __restrict__ sorted_points, A* __restrict__ sorted_weights, Key entries,
                   Key total_points, Key points, Key sentinel) {
  const GridStride<Key> loop(entries, blockDim.x, threadIdx.x);
  for (Key i = loop.first; i < entries; i = loop.next(i)) {
    const Key key = keys[i];
    if (key == sentinel) continue;  // out-of-input taps sort last
    if (i == 0 || keys[i - 1] != key) starts[key] = i;
    if (i + 1 == entries || keys[i + 1] != key) ends[key] = i + 1;
    const Key e = values[i];
    sorted_points[i] = e % total_points % points;
    sorted_weights[i] = weights[e];
  }
}

// One thread per (cell, group of kGroup channels): walks the cell's entries in sorted order.
template <class T, class Key, class Index, int kGroup, int kMinBlocks = 1>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    gather_kernel(const T* __restrict__ dout, const Key* __restrict__ starts,
                  const Key* __restrict__ ends, const Key* __restrict__ sorted_points,
                  const acc_t<T>* __restrict__ sorted_weights, T* __restrict__ d_input,
                  GridSampleCall call) {
  using A = acc_t<T>;
  const GridSampleGeometry& g = call.geometry;
  const Index points = Index(g.points), channels = Index(g.channels), cells = Index(g.cells);
  const Index total = Index(g.batch) * cells;
  const Index group_step = Index(gridDim.y) * kGroup;
  const GridStride<Index> loop(total, blockDim.x, threadIdx.x);
  for (Index k = loop.first; k < total; k = loop.next(k)) {
    const Index m = k / cells;
    const Index cell = k - m * cells;
    const Index begin = Index(starts[k]);
    const Index end = Index(ends[k]);
    const T* d = dout + Index(call.dout_map(m)) * channels * points;
    T* result = d_input + m * channels * cells + cell;
    for (Index c0 = Index(blockIdx.y) * kGroup; c0 < channels;
         c0 = next_index(c0, group_step, channels)) {
      A sum[kGroup] = {};
      for (Index i = begin; i < end; ++i) {
        const T* row = d + c0 * points + Index(sorted_points[i]);
        const A w = sorted_weights[i];
        JK_UNROLL
        for (int j = 0; j < kGroup; ++j)
          if (c0 + j < channels) sum[j] += w * to_acc(row[j * points]);
      }
      JK_UNROLL
      for (int j = 0; j < kGroup; ++j)
        if (c0 + j < channels) result[(c0 + j) * cells] = from_acc<T>(sum[j]);
    }
  }
}

// Channels-last: one thread per (cell, group of kGroup channels), groups fastest. With one
// channel per thread the threads of a warp share a cell's entries and read consecutive channels
// of each entry's dout point; with a few channels (kGroup covering them all) one thread walks
// a cell's entries once and reads the point's channels together.
template <class T, class Key, class Index, int kGroup>
__global__ void __launch_bounds__(kThreads)
    gather_channels_last_kernel(const T* __restrict__ dout, const Key* __restrict__ starts,
                                const Key* __restrict__ ends, const Key* __restrict__ sorted_points,
                                const acc_t<T>* __restrict__ sorted_weights,
                                T* __restrict__ d_input, GridSampleCall call) {
  using A = acc_t<T>;
  const GridSampleGeometry& g = call.geometry;
  const Index points = Index(g.points), channels = Index(g.channels), cells = Index(g.cells);
  const Index groups = (channels + kGroup - 1) / kGroup;
  const Index total = Index(g.batch) * cells * groups;
  const GridStride<Index> loop(total, blockDim.x, threadIdx.x);
  for (Index k = loop.first; k < total; k = loop.next(k)) {
    const Index cell = k / groups;  // m * cells + offset
    const Index c0 = (k - cell * groups) * kGroup;
    const Index m = cell / cells;
    const Index begin = Index(starts[cell]);
    const Index end = Index(ends[cell]);
    const T* d = dout + Index(call.dout_map(m)) * channels * points + c0;
    A sum[kGroup] = {};
    for (Index i = begin; i < end; ++i) {
      const A w = sorted_weights[i];
      const T* row = d + Index(sorted_points[i]) * channels;
      JK_UNROLL
      for (int j = 0; j < kGroup; ++j)
        if (c0 + j < channels) sum[j] += w * to_acc(row[j]);
    }
    T* result = d_input + cell * channels + c0;
    JK_UNROLL
    for (int j = 0; j < kGroup; ++j)
      if (c0 + j < channels) result[j] = from_acc<T>(sum[j]);
  }
}

// Channels per thread of the channels-last gathers: all of them up to 4, else one.
template <class F>
void with_channels_last_group(int64_t channels, F&& f) {
  if (channels <= 4) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

// The arrays of a sort laid out by SortedLayout in the scratch, with weights of type W.
template <class Key, class W>
struct SortArrays {
  Key* keys[2];
  Key* values[2];
  W* weights;
  W* sorted_weights;
  Key* starts;
  Key* ends;

  SortArrays(const SortedLayout& l, char* scratch)
      : keys{reinterpret_cast<Key*>(scratch + l.keys[0]),
             reinterpret_cast<Key*>(scratch + l.keys[1])},
        values{reinterpret_cast<Key*>(scratch + l.values[0]),
               reinterpret_cast<Key*>(scratch + l.values[1])},
        weights(reinterpret_cast<W*>(scratch + l.weights)),
        sorted_weights(reinterpret_cast<W*>(scratch + l.sorted_weights)),
        starts(reinterpret_cast<Key*>(scratch + l.starts)),
        ends(reinterpret_cast<Key*>(scratch + l.ends)) {}
};

// Sorts the written entries (keys[0], values[0]) stably by key, into `keys` / `values` (their
// Current() then holds the sorted pairs), and zeroes every key's segment bounds.
template <class Key, class W>
ffi::Error sort_entries(cudaStream_t stream, const char* op, const SortedLayout& l, char* scratch,
                        const SortArrays<Key, W>& a, cub::DoubleBuffer<Key>* keys,
                        cub::DoubleBuffer<Key>* values) {
  *keys = cub::DoubleBuffer<Key>(a.keys[0], a.keys[1]);
  *values = cub::DoubleBuffer<Key>(a.values[0], a.values[1]);
  if (auto error = radix_sort_pairs(op, *keys, *values, l.entries, l.end_bit,
                                    scratch + l.sort_temp, l.sort_temp_bytes, stream);
      error.failure())
    return error;
  const size_t bounds_bytes = size_t(l.sentinel) * sizeof(Key);
  Key* const bounds[2] = {a.starts, a.ends};
  for (Key* b : bounds)
    if (auto error = cuda_status(op, cudaMemsetAsync(b, 0, bounds_bytes, stream));
        error.failure())
      return error;
  return ffi::Error::Success();
}

// The sorted (deterministic) d_input path, with keys and indices of type Key / Index: queues
// build_entries(keys, values, weights), which must launch the kernel that writes every entry
// e = t * total_points + q (key: the cell m * cells + offset of tap t of point q, or
// l.sentinel for a tap outside the input; value: e; weight: the tap's weight), then sorts the
// entries stably by key, marks each cell's segment and adds weight * dout per (cell, channel)
// in sorted order. `op` names the pass in errors; kLayout is d_input's and dout's layout.
template <class T, class Key, class Index, GridSampleLayout kLayout, int kGatherMinBlocks = 1,
          class BuildEntries>
ffi::Error sorted_scatter(cudaStream_t stream, const char* op, const GridSampleCall& call,
                          const SortedLayout& l, const T* dout, T* d_input, char* scratch,
                          BuildEntries&& build_entries) {
  using A = acc_t<T>;
  const GridSampleGeometry& g = call.geometry;
  const SortArrays<Key, A> a(l, scratch);
  const int64_t total_points = g.batch * g.points;

  build_entries(a.keys[0], a.values[0], a.weights);
  if (auto error = launch_status(op); error.failure()) return error;
  cub::DoubleBuffer<Key> keys, values;
  if (auto error = sort_entries(stream, op, l, scratch, a, &keys, &values); error.failure())
    return error;
  Key* sorted_points = values.Alternate();
  segment_kernel<A, Key><<<grid_blocks(l.entries, kThreads), kThreads, 0, stream>>>(
      keys.Current(), values.Current(), a.weights, a.starts, a.ends, sorted_points,
      a.sorted_weights, Key(l.entries), Key(total_points), Key(g.points), Key(l.sentinel));
  if (auto error = launch_status(op); error.failure()) return error;
  const Key* starts = a.starts;
  const Key* ends = a.ends;
  const A* sorted_weights = a.sorted_weights;

  const int64_t cells = g.batch * g.cells;
  if constexpr (kLayout == GridSampleLayout::kChannelsLast) {
    with_channels_last_group(g.channels, [&](auto group) {
      constexpr int G = decltype(group)::value;
      const int64_t groups = (g.channels + G - 1) / G;
      gather_channels_last_kernel<T, Key, Index, G>
          <<<grid_blocks(cells * groups, kThreads), kThreads, 0, stream>>>(
              dout, starts, ends, sorted_points, sorted_weights, d_input, call);
    });
  } else {
    const auto gather = [&](auto group) {
      constexpr int G = decltype(group)::value;
      const int64_t groups = (g.channels + G - 1) / G;
      const unsigned blocks = grid_blocks(cells, kThreads);
      const dim3 launch(blocks, unsigned(std::min<int64_t>(groups, 65535)));
      gather_kernel<T, Key, Index, G, kGatherMinBlocks><<<launch, kThreads, 0, stream>>>(
          dout, starts, ends, sorted_points, sorted_weights, d_input, call);
    };
    if (g.channels >= 8) {
      gather(std::integral_constant<int, 8>{});
    } else if (g.channels >= 4) {
      gather(std::integral_constant<int, 4>{});
    } else {
      gather(std::integral_constant<int, 1>{});
    }
  }
  return launch_status(op);
}

// ---- backward d_input, deterministic, bilinear: sort points by corner, then gather -----------

// A bilinear point's taps are the cells corner + (i, j[, k]), i, j, k in {0, 1}, where the corner
// is the floor of its coordinates (tap t = (k * 2 + j) * 2 + i, as in PointTaps), and a tap is
// valid where its cell lies in the input. Along each axis the corner lies in [-1, size - 1] for
// any point with a valid tap, so in the extended grid of (size + 1) cells per axis, corner + 1
// indexes it. Sorting the points (stably, by corner) groups them; cell c then receives tap t from
// the points at corner c - (i, j[, k]), every one of whose tap t is valid. The gather walks t in
// order and each corner's points in point order: the same terms in the same order as
// sorted_scatter's tap-major entries (the weights are PointTaps', computed once per point), with
// a quarter (3-D: an eighth) of the entries to sort and one permutation of 2^dims weights per
// point instead of one random read per entry.

// A point's tap weights, stored together (16-byte loads where they are that large).
template <class A, int kTaps>
struct alignas(sizeof(A) * kTaps >= 16 ? 16 : sizeof(A) * kTaps) TapWeights {
  A w[kTaps];
};

// A bilinear point's corner along axis d, plus one (in [0, size]), or -1 when neither of its
// taps on that axis is valid.
template <class A, class Index>
__device__ __forceinline__ int64_t bilinear_axis_corner(const GridSampleGeometry& g, int d,
                                                        A coord) {
  AxisTaps<A, Index, 2> axis;
  axis_taps<GridSampleMode::kBilinear, A, Index>(coord, g.size[d], g.padding, g.align_corners,
                                                  &axis);
  if (!axis.valid[0] && !axis.valid[1]) return -1;
  // valid[0]: corner = index[0] in [0, size); else only tap 1, at cell 0: corner = -1.
  return axis.valid[0] ? int64_t(axis.index[0]) + 1 : 0;
}

// The extended-grid corner of a bilinear point (2- or 3-D): (corner + 1) along each axis, flat
// (x fastest), or -1 when no tap of the point is valid.
template <class A, class Index, int kDims>
__device__ __forceinline__ int64_t bilinear_corner(const GridSampleGeometry& g,
                                                   const A (&coord)[kDims]) {
  int64_t corner = 0;
  JK_UNROLL
  for (int d = kDims - 1; d >= 0; --d) {
    const int64_t shifted = bilinear_axis_corner<A, Index>(g, d, coord[d]);
    if (shifted < 0) return -1;
    corner = corner * (g.size[d] + 1) + shifted;
  }
  return corner;
}

// Point q = m * points + p: key = its batch row's extended cell m * extended + corner (sentinel
// for a point without valid taps), value = q, and its tap weights (PointTaps') at q.
template <class T, class Key, class Index, int kDims>
__global__ void __launch_bounds__(kThreads)
    corner_keys_kernel(const T* __restrict__ grid, Key* __restrict__ keys,
                       Key* __restrict__ values, TapWeights<acc_t<T>, 1 << kDims>* __restrict__ weights,
                       GridSampleCall call, Key extended, Key sentinel) {
  using A = acc_t<T>;
  using Taps = PointTaps<A, Index, GridSampleMode::kBilinear, kDims>;
  const GridSampleGeometry& g = call.geometry;
  const Index points = Index(g.points);
  const Index total = Index(g.batch) * points;
  const GridStride<Index> loop(total, blockDim.x, threadIdx.x);
  for (Index q = loop.first; q < total; q = loop.next(q)) {
    const Index m = q / points;
    const Index p = q - m * points;
    A coord[kDims];
    load_coordinates<A, Index, kDims>(grid, Index(call.grid_map(m)), p, points, coord);
    const int64_t corner = bilinear_corner<A, Index, kDims>(g, coord);
    keys[q] = corner < 0 ? sentinel : Key(m) * extended + Key(corner);
    values[q] = Key(q);
    Taps taps;
    taps.template compute<false>(g, coord);
    TapWeights<A, Taps::kCount> w;
    JK_UNROLL
    for (int t = 0; t < Taps::kCount; ++t) w.w[t] = taps.weight[t];
    weights[q] = w;
  }
}

// Over the sorted entries: marks the segment [start, end) of each key (keys without entries
// keep start = end = 0; the sentinel's is not marked) and lays the points' weights out in sorted
// order.
template <class A, int kTaps, class Key>
__global__ void __launch_bounds__(kThreads)
    corner_segments_kernel(const Key* __restrict__ keys, const Key* __restrict__ values,
                           const TapWeights<A, kTaps>* __restrict__ weights,
                           Key* __restrict__ starts, Key* __restrict__ ends,
                           TapWeights<A, kTaps>* __restrict__ sorted_weights, Key entries,
                           Key sentinel) {
  const GridStride<Key> loop(entries, blockDim.x, threadIdx.x);
  for (Key i = loop.first; i < entries; i = loop.next(i)) {
    const Key key = keys[i];
    if (key == sentinel) continue;  // points without valid taps sort last
    if (i == 0 || keys[i - 1] != key) starts[key] = i;
    if (i + 1 == entries || keys[i + 1] != key) ends[key] = i + 1;
    sorted_weights[i] = weights[values[i]];
  }
}

// The cells' view of the extended grid: cell (x, y[, z]) of batch row m receives tap
// t = (k * 2 + j) * 2 + i from extended corner (x + 1 - i, y + 1 - j[, z + 1 - k]). The
// segments of its 2^dims corners, loaded together.
template <class Key, class Index, int kDims>
struct CornerSegments {
  static constexpr int kTaps = 1 << kDims;
  Index begin[kTaps], end[kTaps];

  __device__ __forceinline__ CornerSegments(const GridSampleGeometry& g, Key extended, Index m,
                                            Index cell, const Key* __restrict__ starts,
                                            const Key* __restrict__ ends) {
    const Key step_y = Key(g.size[0] + 1);
    const Key step_z = step_y * Key(g.size[1] + 1);
    const Index width = Index(g.size[0]), height = Index(g.size[1]);
    const Index x = cell % width;
    const Index rows = cell / width;  // z * H + y
    const Index y = kDims == 3 ? rows % height : rows;
    const Index z = kDims == 3 ? rows / height : Index(0);
    const Key base = Key(m) * extended + Key(x + 1) + Key(y + 1) * step_y +
                     (kDims == 3 ? Key(z + 1) * step_z : Key(0));
    JK_UNROLL
    for (int t = 0; t < kTaps; ++t) {
      // never below m * extended: each axis' coordinate + 1 - (0 or 1) >= 0
      const Key corner = base - Key(t & 1) - Key((t >> 1) & 1) * step_y -
                         Key((t >> 2) & 1) * step_z;
      begin[t] = Index(starts[corner]);
      end[t] = Index(ends[corner]);
    }
  }
};

// Channels-first: one thread per (cell, group of kGroup channels).
template <class T, class Key, class Index, int kDims, int kGroup>
__global__ void __launch_bounds__(kThreads)
    corner_gather_kernel(const T* __restrict__ dout, const Key* __restrict__ starts,
                         const Key* __restrict__ ends, const Key* __restrict__ sorted_points,
                         const TapWeights<acc_t<T>, 1 << kDims>* __restrict__ sorted_weights,
                         T* __restrict__ d_input, GridSampleCall call, Key extended) {
  using A = acc_t<T>;
  constexpr int kTaps = 1 << kDims;
  const GridSampleGeometry& g = call.geometry;
  const Index points = Index(g.points), channels = Index(g.channels), cells = Index(g.cells);
  const Index total = Index(g.batch) * cells;
  const Index group_step = Index(gridDim.y) * kGroup;
  const GridStride<Index> loop(total, blockDim.x, threadIdx.x);
  for (Index k = loop.first; k < total; k = loop.next(k)) {
    const Index m = k / cells;
    const Index cell = k - m * cells;
    const CornerSegments<Key, Index, kDims> segments(g, extended, m, cell, starts, ends);
    const Index row_base = m * points;  // sorted_points holds q = m * points + p
    const T* d = dout + Index(call.dout_map(m)) * channels * points;
    T* result = d_input + m * channels * cells + cell;
    for (Index c0 = Index(blockIdx.y) * kGroup; c0 < channels;
         c0 = next_index(c0, group_step, channels)) {
      A sum[kGroup] = {};
      JK_UNROLL
      for (int t = 0; t < kTaps; ++t) {
        for (Index i = segments.begin[t]; i < segments.end[t]; ++i) {
          const A w = sorted_weights[i].w[t];
          const T* row = d + c0 * points + (Index(sorted_points[i]) - row_base);
          JK_UNROLL
          for (int j = 0; j < kGroup; ++j)
            if (c0 + j < channels) sum[j] += w * to_acc(row[j * points]);
        }
      }
      JK_UNROLL
      for (int j = 0; j < kGroup; ++j)
        if (c0 + j < channels) result[(c0 + j) * cells] = from_acc<T>(sum[j]);
    }
  }
}

// Channels-last: one thread per (cell, group of kGroup channels), groups fastest (as
// gather_channels_last_kernel).
template <class T, class Key, class Index, int kDims, int kGroup>
__global__ void __launch_bounds__(kThreads)
    corner_gather_channels_last_kernel(const T* __restrict__ dout, const Key* __restrict__ starts,
                                       const Key* __restrict__ ends,
                                       const Key* __restrict__ sorted_points,
                                       const TapWeights<acc_t<T>, 1 << kDims>* __restrict__
                                           sorted_weights,
                                       T* __restrict__ d_input, GridSampleCall call,
                                       Key extended) {
  using A = acc_t<T>;
  constexpr int kTaps = 1 << kDims;
  const GridSampleGeometry& g = call.geometry;
  const Index points = Index(g.points), channels = Index(g.channels), cells = Index(g.cells);
  const Index groups = (channels + kGroup - 1) / kGroup;
  const Index total = Index(g.batch) * cells * groups;
  const GridStride<Index> loop(total, blockDim.x, threadIdx.x);
  for (Index k = loop.first; k < total; k = loop.next(k)) {
    const Index flat_cell = k / groups;  // m * cells + cell
    const Index c0 = (k - flat_cell * groups) * kGroup;
    const Index m = flat_cell / cells;
    const CornerSegments<Key, Index, kDims> segments(g, extended, m, flat_cell - m * cells,
                                                     starts, ends);
    const Index row_base = m * points;
    const T* d = dout + Index(call.dout_map(m)) * channels * points + c0;
    A sum[kGroup] = {};
    JK_UNROLL
    for (int t = 0; t < kTaps; ++t)
      for (Index i = segments.begin[t]; i < segments.end[t]; ++i) {
        const A w = sorted_weights[i].w[t];
        const T* row = d + (Index(sorted_points[i]) - row_base) * channels;
        JK_UNROLL
        for (int j = 0; j < kGroup; ++j)
          if (c0 + j < channels) sum[j] += w * to_acc(row[j]);
      }
    T* result = d_input + flat_cell * channels + c0;
    JK_UNROLL
    for (int j = 0; j < kGroup; ++j)
      if (c0 + j < channels) result[j] = from_acc<T>(sum[j]);
  }
}

// The bilinear d_input through the corner sort (layout from corner_layout): keys, values and
// weights, the stable sort, the segments' bounds and sorted weights, the gather. Bitwise equal
// to sorted_scatter on the same problem.
template <class T, class Key, class Index, int kDims, GridSampleLayout kLayout>
ffi::Error corner_scatter(cudaStream_t stream, const char* op, const GridSampleCall& call,
                          const SortedLayout& l, const T* dout, const T* grid, T* d_input,
                          char* scratch) {
  using W = TapWeights<acc_t<T>, 1 << kDims>;
  const GridSampleGeometry& g = call.geometry;
  const int64_t extended = extended_cells(g);
  const SortArrays<Key, W> a(l, scratch);

  corner_keys_kernel<T, Key, Index, kDims>
      <<<grid_blocks(l.entries, kThreads), kThreads, 0, stream>>>(
          grid, a.keys[0], a.values[0], a.weights, call, Key(extended), Key(l.sentinel));
  if (auto error = launch_status(op); error.failure()) return error;
  cub::DoubleBuffer<Key> keys, values;
  if (auto error = sort_entries(stream, op, l, scratch, a, &keys, &values); error.failure())
    return error;
  corner_segments_kernel<acc_t<T>, 1 << kDims, Key>
      <<<grid_blocks(l.entries, kThreads), kThreads, 0, stream>>>(
          keys.Current(), values.Current(), a.weights, a.starts, a.ends, a.sorted_weights,
          Key(l.entries), Key(l.sentinel));
  if (auto error = launch_status(op); error.failure()) return error;
  const Key* starts = a.starts;
  const Key* ends = a.ends;
  const W* sorted_weights = a.sorted_weights;

  const Key* sorted_points = values.Current();
  const int64_t cells = g.batch * g.cells;
  if constexpr (kLayout == GridSampleLayout::kChannelsLast) {
    with_channels_last_group(g.channels, [&](auto group) {
      constexpr int G = decltype(group)::value;
      const int64_t groups = (g.channels + G - 1) / G;
      corner_gather_channels_last_kernel<T, Key, Index, kDims, G>
          <<<grid_blocks(cells * groups, kThreads), kThreads, 0, stream>>>(
              dout, starts, ends, sorted_points, sorted_weights, d_input, call, Key(extended));
    });
  } else {
    const auto gather = [&](auto group) {
      constexpr int G = decltype(group)::value;
      const int64_t groups = (g.channels + G - 1) / G;
      const dim3 launch(grid_blocks(cells, kThreads),
                        unsigned(std::min<int64_t>(groups, 65535)));
      corner_gather_kernel<T, Key, Index, kDims, G><<<launch, kThreads, 0, stream>>>(
          dout, starts, ends, sorted_points, sorted_weights, d_input, call, Key(extended));
    };
    // As sorted_scatter's gather: 8 channels per thread, 4 below 8 channels, 1 below 3.
    if (g.channels >= 8) {
      gather(std::integral_constant<int, 8>{});
    } else if (g.channels >= 3) {
      gather(std::integral_constant<int, 4>{});
    } else {
      gather(std::integral_constant<int, 1>{});
    }
  }
  return launch_status(op);
}

// ---- forward --------------------------------------------------------------------------------

// The routes of the channels-first forward (forward_copy.cu): in place with every warp slot
// filled (smooth grids), in place with more loads in flight per thread (scattered points), or
// over a channels-last copy. Where a call may take several, a survey of its grid writes the
// route to a flag in its scratch, and the kernels of the routes not taken return at once.
constexpr int kDirectRoute = 0;
constexpr int kScatteredRoute = 1;
constexpr int kCopyRoute = 2;

// Occupancy of the forward: the 2-D bilinear and nearest forward in 4-byte arithmetic with
// 32-bit indices fits in 32 registers (no spills) with two channels in flight, so it asks for 8
// blocks (every warp slot) per SM. It is latency-bound: on smooth grids that measured 14%
// faster on the H100 than the compiler's 40 registers (6 blocks) with four channels in flight;
// on scattered points 4 blocks with four channels in flight take 16-30% less time (run 13), and
// the scattered route (forward_copy.cu) launches that shape. The other instances, and every
// channels-last one, keep the compiler's choice.
template <class T, class Index, GridSampleMode kMode, int kDims>
constexpr bool small_point_state() {
  return sizeof(acc_t<T>) == 4 && sizeof(Index) == 4 && kDims == 2 &&
         kMode != GridSampleMode::kBicubic;
}

template <class T, class Index, GridSampleMode kMode, int kDims, bool kScattered = false>
constexpr int forward_min_blocks() {
  return small_point_state<T, Index, kMode, kDims>() ? (kScattered ? 4 : 8) : 1;
}

template <class T, class Index, GridSampleMode kMode, int kDims, GridSampleLayout kLayout,
          int kMinBlocks = kLayout == GridSampleLayout::kChannelsFirst
                               ? forward_min_blocks<T, Index, kMode, kDims>()
                               : 1,
          int kUnroll = kMinBlocks == 8 ? 2 : 4>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    forward_kernel(const T* __restrict__ input, const T* __restrict__ grid, T* __restrict__ out,
                   GridSampleCall call, const int* __restrict__ route = nullptr,
                   int take = kDirectRoute) {
  using A = acc_t<T>;
  using Taps = PointTaps<A, Index, kMode, kDims>;
  using L = Lanes<kLayout>;
  if (route != nullptr && *route != take) return;
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
    const T* in = input + Index(call.input_map(m)) * channels * cells;
    T* o = out + m * channels * points + out_row.at(0, p);
#pragma unroll(kUnroll)
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

// Launches the forward of `call` in place (every output point, every channel). With a route
// flag, its kernel runs only where the flag holds `take`; kScatteredRoute launches the shape
// with more loads in flight (where the instance has one; the same sums in the same order).
template <GridSampleLayout kLayout, class T>
void launch_forward(cudaStream_t stream, const GridSampleCall& call, bool narrow, const T* input,
                    const T* grid, T* out, const int* route = nullptr,
                    int take = kDirectRoute) {
  const GridSampleGeometry& g = call.geometry;
  const PointLaunch launch = launch_over_points(g.batch * g.points, g.channels, kLayout);
  dispatch_grid_sampler(call.mode, g.dims, [&](auto mode_c, auto dims_c) {
    with_index(narrow, [&](auto index) {
      using Index = decltype(index);
      constexpr GridSampleMode kMode = decltype(mode_c)::value;
      constexpr int kDims = decltype(dims_c)::value;
      if constexpr (kLayout == GridSampleLayout::kChannelsFirst) {
        if (take == kScatteredRoute) {
          constexpr int kBlocks = forward_min_blocks<T, Index, kMode, kDims, true>();
          forward_kernel<T, Index, kMode, kDims, kLayout, kBlocks, 4>
              <<<launch.grid, launch.block, 0, stream>>>(input, grid, out, call, route, take);
          return;
        }
      }
      forward_kernel<T, Index, kMode, kDims, kLayout>
          <<<launch.grid, launch.block, 0, stream>>>(input, grid, out, call, route, take);
    });
  });
}

// ---- index width ----------------------------------------------------------------------------

// Whether every index the kernels form fits in 32 bits for these operand batch sizes: the
// extents and offsets below 2^31, and so the channel loops' indices, which step at most
// kMaxChannelsLastSlices past the channel count (the loops over points and cells cannot
// overflow: GridStride and next_index stop at their end).
inline bool fits_32_bits(const GridSampleCall& call, std::initializer_list<int64_t> operand_elements) {
  const GridSampleGeometry& g = call.geometry;
  const int64_t limit = (int64_t{1} << 31) - kMaxChannelsLastSlices;
  bool fits = true;
  for (int64_t e : {checked_product({g.batch, g.channels, g.cells}),
                    checked_product({g.batch, g.channels, g.points}),
                    checked_product({g.batch, g.points, 3})})
    fits = fits && e >= 0 && e < limit;
  for (int64_t e : operand_elements) fits = fits && e < limit;
  return fits;
}

}  // namespace grid_sample_cuda
}  // namespace jax_kernels
