// The CUDA backward of roi_align: the box gradient and the input gradient (the math is in
// roi_align.h; channel slabs and the staging transpose in channel_slabs.cuh).
//
// Box gradient: one block per box; thread j takes the items (bin, 16 channels) j, j + 256, ...
// and reduces over the block in a fixed order, so it is deterministic without atomics.
//
// Input gradient, deterministic (default): an ordered gather instead of a scatter, from the
// per-bin weights of roi_align.h (for_each_index_bin).
//   1. Two warps per box write its (input row, bin row, row weight) entries, keyed by
//      image * H + row, and per column of its column span the (column bin, weight) pairs.
//   2. A stable radix sort (CUB) groups the row entries by input row, boxes in index order within
//      a row; a binary search per row gives each row's segment.
//   3. One block per (slab, input row, run of 16 columns) stages the row's entries with their
//      terms at the run's cells in shared memory; per cell, a group scans the entries a lane per
//      entry and adds the hits' input_gradient_term in entry order, then column-bin order.
// Every sum has an order that depends only on the data, so d_input is bitwise reproducible.
// Scratch (staged output gradient, entries, keys, values, offsets, CUB temp storage) comes from
// XLA as an extra result sized by the host query "roi_align_backward_input_scratch".
//
// Input gradient, deterministic=False (float32/float64 only): per (box, bin, 16 channels), the
// samples' weight * dout added with atomicAdd.
//
// Channels last (jk_roi_align_nhwc_bwd_*: every kernel and handler is a template on the layout,
// roi_align.h's RoiAlignNCHW / RoiAlignNHWC): the gather reads the output gradient in place (it
// is already [K, bins, C]: no staging, host query "roi_align_nhwc_backward_input_scratch") and
// each lane stores its channels of a cell straight to the [N, H, W, C] input gradient; the same
// terms are added in the same order, so both layouts give the same bits.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/launch.h"
#include "common/radix_sort.cuh"
#include "common/scratch.h"
#include "common/status.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/roi_align.h"
#include "roi_align/channel_slabs.cuh"

JK_ROI_ALIGN_REGISTER_ATTRS();

namespace jax_kernels {
namespace {

constexpr int kChannels = 16;  // channels per thread of the box gradient and the atomic path
constexpr int64_t kGatherTileBytes = 48 << 10;  // shared memory of a gather block

// ---- atomic input gradient and box gradient -----------------------------------------------------

// Work item i of a (box, channel chunk, bin) grid, bins fastest so that a warp's accesses for one
// channel are close together.
struct BinItem {
  int64_t k, c_begin, bin;
};

__device__ __forceinline__ BinItem bin_item(int64_t i, int64_t bins, int64_t chunks) {
  const int64_t bin = i % bins;
  const int64_t rest = i / bins;
  return BinItem{rest / chunks, (rest % chunks) * kChannels, bin};
}

template <class Layout, class T>
__global__ void __launch_bounds__(kThreads)
    roi_align_backward_input_atomic_kernel(const T* __restrict__ dout, const T* __restrict__ boxes,
                                           T* __restrict__ d_input, RoiAlignProblem p,
                                           int64_t chunks) {
  using A = acc_t<T>;
  const int64_t bins = p.bins(), plane = p.H * p.W, items = p.K * chunks * bins;
  const int64_t binned = Layout::binned_channel_stride(p);
  const int64_t channel_stride = Layout::channel_stride(p);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += stride) {
    const BinItem item = bin_item(i, bins, chunks);
    const int64_t channels = min(int64_t(kChannels), p.C - item.c_begin);
    const RoiBox<A> box = roi_box(boxes, item.k, p);
    if (box.image < 0) continue;
    A grad[kChannels];
    const T* g =
        dout + item.k * p.C * bins + item.c_begin * binned + item.bin * Layout::bin_stride(p);
#pragma unroll
    for (int c = 0; c < kChannels; ++c)
      grad[c] = c < channels ? to_acc(g[c * binned]) / box.count : A(0);
    T* planes = d_input + box.image * p.C * plane + item.c_begin * channel_stride;
    for_each_bin_sample(box, item.bin, p, [&](int64_t, const AxisSample<A>& sy, int64_t,
                                              const AxisSample<A>& sx) {
      const BilinearTaps<A> t = bilinear_taps(sy, sx, p.W, Layout::cell_stride(p));
#pragma unroll
      for (int c = 0; c < kChannels; ++c) {
        if (c < channels) {
          T* v = planes + c * channel_stride;
          atomicAdd(v + t.o1, t.w1 * grad[c]);
          atomicAdd(v + t.o2, t.w2 * grad[c]);
          atomicAdd(v + t.o3, t.w3 * grad[c]);
          atomicAdd(v + t.o4, t.w4 * grad[c]);
        }
      }
    });
  }
}

// One block per box. Thread j takes the items (bin, channel chunk) j, j + kThreads, ... in order;
// the four coordinate sums are kept in double and reduced over the block in a fixed tree.
template <class Layout, class T>
__global__ void __launch_bounds__(kThreads)
    roi_align_backward_boxes_kernel(const T* __restrict__ dout, const T* __restrict__ input,
                                    const T* __restrict__ boxes, T* __restrict__ d_boxes,
                                    RoiAlignProblem p, int64_t chunks) {
  using A = acc_t<T>;
  __shared__ double partial[4][kThreads];
  const int64_t bins = p.bins(), plane = p.H * p.W;
  for (int64_t k = blockIdx.x; k < p.K; k += gridDim.x) {
    const RoiBox<A> box = roi_box(boxes, k, p);
    double d[4] = {0, 0, 0, 0};  // x1, y1, x2, y2
    if (box.image >= 0) {
      for (int64_t j = threadIdx.x; j < bins * chunks; j += kThreads) {
        const int64_t bin = j % bins, c_begin = (j / bins) * kChannels;
        accumulate_box_gradient<kChannels, Layout>(
            box, bin, dout + k * p.C * bins + c_begin * Layout::binned_channel_stride(p),
            input + box.image * p.C * plane + c_begin * Layout::channel_stride(p),
            min(int64_t(kChannels), p.C - c_begin), p, d);
      }
    }
    for (int q = 0; q < 4; ++q) partial[q][threadIdx.x] = d[q];
    __syncthreads();
    for (int offset = kThreads / 2; offset > 0; offset /= 2) {
      if (threadIdx.x < offset)
        for (int q = 0; q < 4; ++q) partial[q][threadIdx.x] += partial[q][threadIdx.x + offset];
      __syncthreads();
    }
    if (threadIdx.x < 5) {
      const double value = threadIdx.x == 0 ? 0.0 : partial[threadIdx.x - 1][0] / double(box.count);
      d_boxes[5 * k + threadIdx.x] = from_acc<T>(A(value));
    }
    __syncthreads();  // partial is rewritten for the next box
  }
}

// ---- deterministic input gradient --------------------------------------------------------------

// One (input row, box, bin row) of the gather, with its box's column span.
template <class A>
struct RowEntry {
  int32_t box;
  int32_t bin_row;  // ph * PW
  int32_t column_first;
  int32_t column_count;
  A weight;  // input_gradient_row_weight
};

// One (column, column bin) of a box; a box's entries lie column by column.
template <class A>
struct ColumnEntry {
  int32_t bin;
  A weight;
};

// (index, bin) pairs with a nonzero weight along an axis of `bins` bins and `extent` indices, per
// box, at most: each valid sample weights at most two indices. A fixed grid has bins * ratio
// samples; an adaptive one (ratio <= 0) has one per bin when bins are under a pixel, else samples
// at most a pixel apart, of which at most 2 * extent + 11 are candidates (RoiAxis::candidates
// widens [-1, extent] by up to a pixel a side and adds 5). -1 when that cannot be represented.
int64_t axis_pair_capacity(int64_t bins, int64_t extent, int64_t sampling_ratio) {
  const auto smaller = [](int64_t a, int64_t b) {  // of two checked sizes; -1 is the larger
    return a < 0 ? b : b < 0 ? a : std::min(a, b);
  };
  const int64_t adaptive = checked_add(checked_mul(2, extent), 13);
  const int64_t samples = sampling_ratio > 0 ? checked_mul(bins, sampling_ratio)
                          : adaptive < 0     ? -1
                                             : std::max(bins, adaptive);
  return smaller(checked_mul(bins, extent), checked_mul(2, samples));
}

// Where each piece of the deterministic backward lives in the scratch buffer.
struct GatherLayout {
  int64_t row_capacity = 0, column_capacity = 0;  // entries per box
  int64_t entries = 0;                            // K * row_capacity
  int64_t dout = 0, keys_in = 0, keys_out = 0, values_in = 0, values_out = 0, rows = 0,
          sorted_rows = 0, column_offsets = 0, columns = 0, row_offsets = 0, sort_temp = 0,
          sort_temp_bytes = 0, total = 0;
  int end_bit = 0;
};

// The layout of a problem with `element_bytes`-byte elements, with room for the output gradient
// staged channel-minor when `staged` (NCHW calls); false if its indices do not fit the 32-bit
// entries and sort. total is -1 when the bytes cannot be represented (sizes in checked
// arithmetic: the query may describe a problem no memory holds).
bool gather_layout(int64_t N, int64_t C, int64_t H, int64_t W, int64_t K, int64_t PH, int64_t PW,
                   int64_t sampling_ratio, int64_t element_bytes, bool staged, GatherLayout* s) {
  constexpr int64_t kLimit = int64_t(1) << 31;
  s->row_capacity = axis_pair_capacity(PH, H, sampling_ratio);
  s->column_capacity = axis_pair_capacity(PW, W, sampling_ratio);
  s->entries = checked_mul(K, s->row_capacity);
  const int64_t rows = checked_mul(N, H), bins = checked_product({K, PH, PW});
  if (s->entries < 0 || s->entries >= kLimit || rows < 0 || rows >= (int64_t(1) << 32) - 1 ||
      bins < 0 || bins >= kLimit || W >= kLimit || s->column_capacity < 0 ||
      s->column_capacity >= kLimit)
    return false;
  const bool wide = element_bytes == 8;  // float64: double weights
  const int64_t row_bytes = wide ? sizeof(RowEntry<double>) : sizeof(RowEntry<float>);
  const int64_t column_bytes = wide ? sizeof(ColumnEntry<double>) : sizeof(ColumnEntry<float>);
  ScratchLayout layout;
  s->dout = layout.take(staged ? checked_product({bins, C, element_bytes}) : 0);
  s->keys_in = layout.take(s->entries * 4);
  s->keys_out = layout.take(s->entries * 4);
  s->values_in = layout.take(s->entries * 4);
  s->values_out = layout.take(s->entries * 4);
  s->rows = layout.take(s->entries * row_bytes);
  s->sorted_rows = layout.take(s->entries * row_bytes);
  s->column_offsets = layout.take(checked_product({K, W + 1, 4}));
  s->columns = layout.take(checked_product({K, s->column_capacity, column_bytes}));
  s->row_offsets = layout.take((rows + 1) * 4);
  s->end_bit = key_bits(uint64_t(rows));  // keys in [0, N * H], N * H for no row
  s->sort_temp_bytes = radix_sort_temp_bound(s->entries, s->end_bit);
  s->sort_temp = layout.take(s->sort_temp_bytes);
  s->total = layout.total();
  return true;
}

// The d_input pass takes the atomic path: deterministic=False for float32/float64 (the half
// types have no fast atomics and always take the sorted, ordered gather).
bool atomic_backward_input(bool deterministic, int64_t element_bytes) {
  return !deterministic && element_bytes >= 4;
}

// Host queries "roi_align_backward_input_scratch" and "roi_align_nhwc_backward_input_scratch":
// the scratch bytes of the d_input pass, -1 if its indices do not fit the 32-bit sort,
// kSizeOverflow if its bytes cannot be represented.
// Arguments: the folded call's N, C, H, W, `boxes` (K), pooled_height, pooled_width,
// sampling_ratio, element_bytes and deterministic.
template <class Layout>
int64_t backward_input_scratch_query(const QueryArgs& a) {
  const int64_t N = a["N"], C = a["C"], H = a["H"], W = a["W"], K = a["boxes"];
  const int64_t PH = a["pooled_height"], PW = a["pooled_width"], ratio = a["sampling_ratio"];
  const int64_t element_bytes = a["element_bytes"];
  if (atomic_backward_input(a["deterministic"] != 0, element_bytes)) return 0;
  GatherLayout s;
  if (!gather_layout(N, C, H, W, K, PH, PW, ratio, element_bytes, !Layout::kChannelsLast, &s))
    return -1;
  return s.total < 0 ? kSizeOverflow : s.total;
}

__device__ __forceinline__ int64_t warp_exclusive_sum(int64_t value, int64_t* total) {
  const int lane = threadIdx.x % 32;
  int64_t sum = value;
  for (int d = 1; d < 32; d *= 2) {
    const int64_t other = __shfl_up_sync(0xffffffffu, sum, d);
    if (lane >= d) sum += other;
  }
  *total = __shfl_sync(0xffffffffu, sum, 31);
  return sum - value;
}

// Two warps per box: one writes its column offsets and column entries, the other its row entries
// (key image * H + row, value = entry index) in ascending row and bin, and the sentinel key N * H
// in the unused slots. Entries past a capacity are dropped (the capacities bound them).
template <class T>
__global__ void __launch_bounds__(kThreads)
    roi_align_tables_kernel(const T* __restrict__ boxes, RoiAlignProblem p, GatherLayout layout,
                            uint32_t* __restrict__ keys, uint32_t* __restrict__ values,
                            RowEntry<acc_t<T>>* __restrict__ rows,
                            uint32_t* __restrict__ column_offsets,
                            ColumnEntry<acc_t<T>>* __restrict__ columns) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  const int64_t row_capacity = layout.row_capacity, column_capacity = layout.column_capacity;
  const uint32_t sentinel = uint32_t(p.N * p.H);
  for (int64_t w = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32; w < 2 * p.K; w += warps) {
    const int64_t k = w / 2;
    const RoiBox<A> box = roi_box_with_spans(boxes, k, p);
    const int64_t column_first = box.x.span_first;
    const int64_t column_count =
        box.image >= 0 ? max(int64_t(0), box.x.span_last - box.x.span_first + 1) : 0;
    int64_t written = 0;
    if (w % 2 == 0) {
      uint32_t* offsets = column_offsets + k * (p.W + 1);
      ColumnEntry<A>* box_columns = columns + k * column_capacity;
      for (int64_t j0 = 0; j0 < column_count; j0 += 32) {
        const int64_t j = j0 + lane;
        int64_t count = 0;
        if (j < column_count)
          for_each_index_bin(box.x, column_first + j, p.W, [&](int64_t, A) { ++count; });
        int64_t sum;
        int64_t i = written + warp_exclusive_sum(count, &sum);
        if (j < column_count) {
          offsets[j] = uint32_t(min(i, column_capacity));
          for_each_index_bin(box.x, column_first + j, p.W, [&](int64_t bin, A weight) {
            if (i < column_capacity) box_columns[i] = ColumnEntry<A>{int32_t(bin), weight};
            ++i;
          });
        }
        written += sum;
      }
      if (lane == 0) offsets[column_count] = uint32_t(min(written, column_capacity));
      continue;
    }
    const int64_t row_first = box.y.span_first;
    const int64_t row_count =
        column_count > 0 ? max(int64_t(0), box.y.span_last - box.y.span_first + 1) : 0;
    for (int64_t r0 = 0; r0 < row_count; r0 += 32) {
      const int64_t row = row_first + r0 + lane;
      int64_t count = 0;
      if (r0 + lane < row_count)
        for_each_index_bin(box.y, row, p.H, [&](int64_t, A) { ++count; });
      int64_t sum;
      int64_t i = written + warp_exclusive_sum(count, &sum);
      if (r0 + lane < row_count) {
        for_each_index_bin(box.y, row, p.H, [&](int64_t bin, A weight) {
          if (i < row_capacity) {
            const int64_t e = k * row_capacity + i;
            keys[e] = uint32_t(box.image * p.H + row);
            values[e] = uint32_t(e);
            rows[e] = RowEntry<A>{int32_t(k), int32_t(bin * p.PW), int32_t(column_first),
                                  int32_t(column_count), input_gradient_row_weight(box, weight)};
          }
          ++i;
        });
      }
      written += sum;
    }
    for (int64_t i = min(written, row_capacity) + lane; i < row_capacity; i += 32) {
      const int64_t e = k * row_capacity + i;
      keys[e] = sentinel;
      values[e] = uint32_t(e);
    }
  }
}

// offsets[r] = first sorted entry with key >= r, for r in [0, N * H].
__global__ void __launch_bounds__(kThreads)
    roi_align_row_offsets_kernel(const uint32_t* __restrict__ keys, int64_t entries, int64_t rows,
                                 uint32_t* __restrict__ offsets) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r <= rows; r += stride) {
    int64_t lo = 0, hi = entries;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (int64_t(keys[mid]) < r) lo = mid + 1; else hi = mid;
    }
    offsets[r] = uint32_t(lo);
  }
}

// The row entries in sorted order (sentinel slots are never read).
template <class A>
__global__ void __launch_bounds__(kThreads)
    roi_align_sort_rows_kernel(const uint32_t* __restrict__ keys,
                               const uint32_t* __restrict__ values,
                               const RowEntry<A>* __restrict__ rows,
                               RowEntry<A>* __restrict__ sorted, int64_t entries,
                               uint32_t sentinel) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < entries; i += stride)
    if (keys[i] != sentinel) sorted[i] = rows[values[i]];
}

constexpr int kGatherChunk = 32;  // row entries a gather block stages at a time
constexpr int kMaxCellsPerGroup = 2;

// One staged entry's term at one cell of the block's run: the output-gradient row
// (box * bins + bin) of its first column bin, its number of column bins there (0 when its box
// misses the cell) and the first one's weight (input_gradient_weight).
template <class A>
struct CellTerm {
  int32_t bin_index;
  int32_t count;
  A weight;
};

struct GatherLaunch {
  ChannelSlabs slabs;
  int64_t tile_cells;   // columns per block
  int64_t row_tiles;    // blocks per input row and slab
  int64_t tile_stride;  // shared-memory row of a channel's cells
  int64_t column_capacity;
  int cells_per_group;
  int64_t entries_at, terms_at, shared_bytes;  // shared memory: tile, entries, terms
};

template <class T, class Layout>
GatherLaunch gather_launch(const RoiAlignProblem& p, int64_t column_capacity) {
  using A = acc_t<T>;
  GatherLaunch l;
  l.slabs = channel_slabs(p.C, slab_channels<T>());
  const int groups = kThreads / l.slabs.lanes;
  l.tile_cells = std::max(kMaxCellsPerGroup * groups, 16);
  for (;;) {
    l.tile_stride = l.tile_cells + 1;
    // Channels last stores from registers: no output tile in shared memory.
    l.entries_at = Layout::kChannelsLast
                       ? 0
                       : round_up(l.slabs.slab * l.tile_stride * int64_t(sizeof(T)), kSharedAlign);
    l.terms_at = l.entries_at + kGatherChunk * int64_t(sizeof(RowEntry<A>));
    l.shared_bytes = l.terms_at + kGatherChunk * l.tile_cells * int64_t(sizeof(CellTerm<A>));
    if (l.shared_bytes <= kGatherTileBytes || l.tile_cells == 1) break;
    l.tile_cells /= 2;
  }
  l.cells_per_group = int((l.tile_cells + groups - 1) / groups);
  l.row_tiles = (p.W + l.tile_cells - 1) / l.tile_cells;
  l.column_capacity = column_capacity;
  return l;
}

// Adds to acc the terms of column `cell` of the block's run from the staged entries [0, count):
// the lanes of the group test an entry each, then the group walks the hits in entry order, two
// at a time (both loads issued before the first is added). `slab` points at channel c0 of the
// staged output gradient; a box with more than one column bin at the cell (rare) reads the
// further ones from the column table.
template <class T, int kPerLane, int kVec, class Index>
__device__ __forceinline__ void gather_cell(const T* __restrict__ slab,
                                            const RowEntry<acc_t<T>>* staged,
                                            const CellTerm<acc_t<T>>* terms,
                                            const uint32_t* __restrict__ column_offsets,
                                            const ColumnEntry<acc_t<T>>* __restrict__ columns,
                                            const RoiAlignProblem& p, const GatherLaunch& l,
                                            int count, int64_t column, int cell, int channels,
                                            int lane, int group_base, unsigned group_mask,
                                            acc_t<T> (&acc)[kPerLane]) {
  using A = acc_t<T>;
  const int lanes = l.slabs.lanes;
  const Index C = Index(p.C);
  auto add = [&](const T (&values)[kPerLane], A weight) {
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) acc[u] += input_gradient_term(values[u], weight);
  };
  auto add_further_bins = [&](int e, int32_t bin_count) {
    const RowEntry<A>& entry = staged[e];
    const uint32_t q0 =
        column_offsets[int64_t(entry.box) * (p.W + 1) + column - entry.column_first];
    for (uint32_t q = q0 + 1; q < q0 + uint32_t(bin_count); ++q) {
      const ColumnEntry<A> bin = columns[entry.box * l.column_capacity + q];
      T values[kPerLane];
      load_slab<T, kPerLane, kVec>(
          slab + (Index(entry.box) * Index(p.bins()) + Index(entry.bin_row + bin.bin)) * C, lanes,
          lane, channels, values);
      add(values, input_gradient_weight(entry.weight, bin.weight));
    }
  };
  for (int first = 0; first < count; first += lanes) {
    const bool hit = first + lane < count && terms[(first + lane) * l.tile_cells + cell].count > 0;
    unsigned hits = (__ballot_sync(group_mask, hit) & group_mask) >> group_base;
    while (hits != 0) {
      const int e0 = first + __ffs(hits) - 1;
      hits &= hits - 1;
      const bool pair = hits != 0;
      const int e1 = pair ? first + __ffs(hits) - 1 : e0;
      hits &= hits - 1;
      const CellTerm<A> t0 = terms[e0 * l.tile_cells + cell], t1 = terms[e1 * l.tile_cells + cell];
      T v0[kPerLane], v1[kPerLane];
      load_slab<T, kPerLane, kVec>(slab + Index(t0.bin_index) * C, lanes, lane, channels, v0);
      if (pair)
        load_slab<T, kPerLane, kVec>(slab + Index(t1.bin_index) * C, lanes, lane, channels, v1);
      add(v0, t0.weight);
      if (t0.count > 1) add_further_bins(e0, t0.count);
      if (pair) {
        add(v1, t1.weight);
        if (t1.count > 1) add_further_bins(e1, t1.count);
      }
    }
  }
}

// Block item t = (slab, input row, run of columns), slabs slowest. The block stages the row's
// entries kGatherChunk at a time with each entry's term at each cell of the run; group g keeps
// the accumulators of cells g * cells_per_group, ... and writes them to a shared tile that the
// block stores per channel (channels last: each lane stores its channels of its cells directly).
// `dout_t` is the output gradient as [K, bins, C]: staged (NCHW) or the operand itself (NHWC).
template <class Layout, class T, int kPerLane, int kVec, class Index>
__global__ void __launch_bounds__(kThreads, 3)
    roi_align_gather_kernel(const T* __restrict__ dout_t, const uint32_t* __restrict__ row_offsets,
                            const RowEntry<acc_t<T>>* __restrict__ entries,
                            const uint32_t* __restrict__ column_offsets,
                            const ColumnEntry<acc_t<T>>* __restrict__ columns,
                            T* __restrict__ d_input, RoiAlignProblem p, GatherLaunch l) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* tile = reinterpret_cast<T*>(shared_bytes);
  RowEntry<A>* staged = reinterpret_cast<RowEntry<A>*>(shared_bytes + l.entries_at);
  CellTerm<A>* terms = reinterpret_cast<CellTerm<A>*>(shared_bytes + l.terms_at);
  const int lanes = l.slabs.lanes;
  const int lane = threadIdx.x % lanes, group = threadIdx.x / lanes;
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int group_base = int(threadIdx.x % 32) - lane;
  const unsigned group_mask = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u) << group_base;
  const int64_t bins = p.bins(), plane = p.H * p.W, rows = p.N * p.H;
  const int64_t tiles = l.slabs.slabs * rows * l.row_tiles;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t rest = t / l.row_tiles, row = rest % rows;
    const int64_t c0 = (rest / rows) * l.slabs.slab, x0 = (t % l.row_tiles) * l.tile_cells;
    const int channels = int(min(l.slabs.slab, p.C - c0));
    const int cells = int(min(l.tile_cells, p.W - x0));
    const uint32_t e0 = row_offsets[row], e1 = row_offsets[row + 1];
    A acc[kMaxCellsPerGroup][kPerLane];
#pragma unroll
    for (int i = 0; i < kMaxCellsPerGroup; ++i)
#pragma unroll
      for (int u = 0; u < kPerLane; ++u) acc[i][u] = A(0);
    for (uint32_t chunk = e0; chunk < e1; chunk += kGatherChunk) {
      const int count = int(min(uint32_t(kGatherChunk), e1 - chunk));
      for (int i = threadIdx.x; i < count; i += blockDim.x) staged[i] = entries[chunk + i];
      __syncthreads();
      for (int e = warp; e < count; e += warps) {
        const RowEntry<A> entry = staged[e];
        for (int c = threadIdx.x % 32; c < cells; c += 32) {
          CellTerm<A> term{0, 0, A(0)};
          const int64_t j = x0 + c - entry.column_first;
          if (j >= 0 && j < entry.column_count) {
            const uint32_t* offsets = column_offsets + int64_t(entry.box) * (p.W + 1) + j;
            const uint32_t q0 = offsets[0], q1 = offsets[1];
            if (q0 < q1) {
              const ColumnEntry<A> bin = columns[entry.box * l.column_capacity + q0];
              term = CellTerm<A>{int32_t(entry.box * bins + entry.bin_row + bin.bin),
                                 int32_t(q1 - q0), input_gradient_weight(entry.weight, bin.weight)};
            }
          }
          terms[e * l.tile_cells + c] = term;
        }
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kMaxCellsPerGroup; ++i) {
        const int cell = group * l.cells_per_group + i;
        if (i < l.cells_per_group && cell < cells)
          gather_cell<T, kPerLane, kVec, Index>(dout_t + c0, staged, terms, column_offsets,
                                                columns, p, l, count, x0 + cell, cell, channels,
                                                lane, group_base, group_mask, acc[i]);
      }
      __syncthreads();  // the staged chunk is rewritten next
    }
    if constexpr (Layout::kChannelsLast) {
      // row = image * H + h: cell (row, x) of the [N, H, W, C] gradient starts at
      // (row * W + x) * C.
#pragma unroll
      for (int i = 0; i < kMaxCellsPerGroup; ++i) {
        const int cell = group * l.cells_per_group + i;
        if (i < l.cells_per_group && cell < cells) {
          T* out = d_input + (row * p.W + x0 + cell) * p.C + c0;
#pragma unroll
          for (int u = 0; u < kPerLane; ++u) {
            const int c = slab_channel<kVec>(u, lanes, lane);
            if (c < channels) out[c] = from_acc<T>(acc[i][u]);
          }
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kMaxCellsPerGroup; ++i) {
        const int cell = group * l.cells_per_group + i;
        if (i < l.cells_per_group && cell < cells)
#pragma unroll
          for (int u = 0; u < kPerLane; ++u) {
            const int c = slab_channel<kVec>(u, lanes, lane);
            if (c < channels) tile[c * l.tile_stride + cell] = from_acc<T>(acc[i][u]);
          }
      }
      __syncthreads();
      T* out = d_input + ((row / p.H) * p.C + c0) * plane + (row % p.H) * p.W + x0;
      for (int c = warp; c < channels; c += warps)
        for (int x = threadIdx.x % 32; x < cells; x += 32)
          out[c * plane + x] = tile[c * l.tile_stride + x];
      __syncthreads();  // the tile is rewritten for the next item
    }
  }
}

// ---- handlers ----------------------------------------------------------------------------------

int64_t channel_chunks(const RoiAlignProblem& p) { return (p.C + kChannels - 1) / kChannels; }

template <class Layout>
ffi::Error roi_align_backward_boxes(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer input,
                                    ffi::AnyBuffer boxes, RoiAlignAttrs attrs,
                                    ffi::Result<ffi::AnyBuffer> d_boxes) {
  RoiAlignProblem p;
  if (auto err = roi_align_problem<Layout>("roi_align backward", attrs, input, boxes, dout, &p);
      err.failure())
    return err;
  if (p.K == 0) return ffi::Error::Success();
  return dispatch_float(input.element_type(), "roi_align backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const unsigned blocks = unsigned(std::min<int64_t>(p.K, int64_t(1) << 30));
    roi_align_backward_boxes_kernel<Layout, T><<<blocks, kThreads, 0, stream>>>(
        static_cast<const T*>(dout.untyped_data()), static_cast<const T*>(input.untyped_data()),
        static_cast<const T*>(boxes.untyped_data()), static_cast<T*>(d_boxes->untyped_data()), p,
        channel_chunks(p));
    return launch_status("roi_align backward");
  });
}

// d_input with deterministic=False, float32/float64: atomicAdd of each sample's contribution.
template <class Layout>
ffi::Error backward_input_atomic(cudaStream_t stream, const RoiAlignProblem& p,
                                 const ffi::AnyBuffer& dout, const ffi::AnyBuffer& boxes,
                                 ffi::Result<ffi::AnyBuffer>& d_input) {
  if (auto err = cuda_status("roi_align backward", cudaMemsetAsync(d_input->untyped_data(), 0,
                                                                   d_input->size_bytes(), stream));
      err.failure())
    return err;
  const int64_t items = p.K * channel_chunks(p) * p.bins();
  if (items == 0) return ffi::Error::Success();
  return dispatch_float(dout.element_type(), "roi_align backward", [&](auto tag) -> ffi::Error {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      roi_align_backward_input_atomic_kernel<Layout, T>
          <<<grid_blocks(items, kThreads), kThreads, 0, stream>>>(
              static_cast<const T*>(dout.untyped_data()),
              static_cast<const T*>(boxes.untyped_data()), static_cast<T*>(d_input->untyped_data()),
              p, channel_chunks(p));
      return launch_status("roi_align backward");
    } else {
      return ffi::Error::InvalidArgument(
          "roi_align backward: the atomic path takes float32 and float64 only");
    }
  });
}

template <class Layout>
ffi::Error roi_align_backward_input(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer boxes,
                                    RoiAlignAttrs attrs, ffi::Result<ffi::AnyBuffer> d_input,
                                    ffi::Result<ffi::AnyBuffer> scratch) {
  const char* op = "roi_align backward";
  RoiAlignProblem p;
  if (auto err = roi_align_problem<Layout>(op, attrs, *d_input, boxes, dout, &p); err.failure())
    return err;
  if (d_input->size_bytes() == 0) return ffi::Error::Success();
  if (atomic_backward_input(attrs.deterministic, int64_t(ffi::ByteWidth(dout.element_type()))))
    return backward_input_atomic<Layout>(stream, p, dout, boxes, d_input);
  if (p.K == 0)
    return cuda_status(op, cudaMemsetAsync(d_input->untyped_data(), 0, d_input->size_bytes(),
                                           stream));
  GatherLayout layout;
  if (!gather_layout(p.N, p.C, p.H, p.W, p.K, p.PH, p.PW, p.sampling_ratio,
                     int64_t(ffi::ByteWidth(dout.element_type())), !Layout::kChannelsLast,
                     &layout))
    return ffi::Error::InvalidArgument("roi_align backward: too many row entries for the sort");
  if (layout.total < 0 || int64_t(scratch->size_bytes()) < layout.total)
    return ffi::Error::InvalidArgument(
        "roi_align backward: scratch buffer smaller than the query's size");
  char* base = aligned_scratch(scratch->untyped_data());
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(base + layout.keys_in);
  uint32_t* keys_out = reinterpret_cast<uint32_t*>(base + layout.keys_out);
  uint32_t* values_in = reinterpret_cast<uint32_t*>(base + layout.values_in);
  uint32_t* values_out = reinterpret_cast<uint32_t*>(base + layout.values_out);
  uint32_t* column_offsets = reinterpret_cast<uint32_t*>(base + layout.column_offsets);
  uint32_t* row_offsets = reinterpret_cast<uint32_t*>(base + layout.row_offsets);
  const int64_t rows = p.N * p.H;  // also the sentinel key

  return dispatch_float(dout.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    const T* dout_t = static_cast<const T*>(dout.untyped_data());  // [K, bins, C] when NHWC
    auto* row_entries = reinterpret_cast<RowEntry<A>*>(base + layout.rows);
    auto* sorted_rows = reinterpret_cast<RowEntry<A>*>(base + layout.sorted_rows);
    auto* columns = reinterpret_cast<ColumnEntry<A>*>(base + layout.columns);
    if constexpr (!Layout::kChannelsLast) {
      T* staged = reinterpret_cast<T*>(base + layout.dout);
      transpose(dout_t, staged, p.K, p.C, p.bins(), stream);
      dout_t = staged;
    }
    roi_align_tables_kernel<T><<<grid_blocks(p.K * 64, kThreads), kThreads, 0, stream>>>(
        static_cast<const T*>(boxes.untyped_data()), p, layout, keys_in, values_in, row_entries,
        column_offsets, columns);
    if (auto err = launch_status(op); err.failure()) return err;

    cub::DoubleBuffer<uint32_t> keys(keys_in, keys_out), values(values_in, values_out);
    if (auto err = radix_sort_pairs(op, keys, values, layout.entries, layout.end_bit,
                                    base + layout.sort_temp, layout.sort_temp_bytes, stream);
        err.failure())
      return err;

    roi_align_row_offsets_kernel<<<grid_blocks(rows + 1, kThreads), kThreads, 0, stream>>>(
        keys.Current(), layout.entries, rows, row_offsets);
    roi_align_sort_rows_kernel<A><<<grid_blocks(layout.entries, kThreads), kThreads, 0, stream>>>(
        keys.Current(), values.Current(), row_entries, sorted_rows, layout.entries,
        uint32_t(rows));
    if (auto err = launch_status(op); err.failure()) return err;

    const GatherLaunch l = gather_launch<T, Layout>(p, layout.column_capacity);
    const int64_t tiles = l.slabs.slabs * rows * l.row_tiles;
    const bool narrow = p.K * p.bins() * p.C < (int64_t(1) << 31);
    with_slab_kernel<T>(l.slabs, p.C % 4 == 0, narrow, [&](auto per_lane, auto vec, auto index) {
      roi_align_gather_kernel<Layout, T, decltype(per_lane)::value, decltype(vec)::value,
                              decltype(index)>
          <<<grid_blocks(tiles * kThreads, kThreads), kThreads, size_t(l.shared_bytes), stream>>>(
              dout_t, row_offsets, sorted_rows, column_offsets, columns,
              static_cast<T*>(d_input->untyped_data()), p, l);
    });
    return launch_status(op);
  });
}

using Stream = ffi::PlatformStream<cudaStream_t>;

}  // namespace

// The handler symbols of one layout (Suffix: Cuda for NCHW, NhwcCuda for NHWC).
#define JK_ROI_ALIGN_BACKWARD_CUDA_HANDLERS(Suffix, Layout)                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignBackwardInput##Suffix, roi_align_backward_input<Layout>, \
                                ffi::Ffi::Bind()                                               \
                                    .Ctx<Stream>()                                             \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Attrs<RoiAlignAttrs>()                                    \
                                    .Ret<ffi::AnyBuffer>()                                     \
                                    .Ret<ffi::AnyBuffer>(),                                    \
                                {ffi::Traits::kCmdBufferCompatible});                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignBackwardBoxes##Suffix, roi_align_backward_boxes<Layout>, \
                                ffi::Ffi::Bind()                                               \
                                    .Ctx<Stream>()                                             \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Attrs<RoiAlignAttrs>()                                    \
                                    .Ret<ffi::AnyBuffer>(),                                    \
                                {ffi::Traits::kCmdBufferCompatible})

JK_ROI_ALIGN_BACKWARD_CUDA_HANDLERS(Cuda, RoiAlignNCHW);
JK_ROI_ALIGN_BACKWARD_CUDA_HANDLERS(NhwcCuda, RoiAlignNHWC);

JK_REGISTER_TARGET("jk_roi_align_bwd_input", RoiAlignBackwardInputCuda, "roi_align",
                   "backward d_input",
                   "cuda row-entry sort (CUB) + channel-slab ordered gather (atomics for "
                   "float32/float64 if deterministic=False)",
                   "bitwise (deterministic=True); atomics otherwise for float32/float64");
JK_REGISTER_TARGET("jk_roi_align_bwd_boxes", RoiAlignBackwardBoxesCuda, "roi_align",
                   "backward d_boxes", "cuda per-box block reduction (float64)", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_nhwc_bwd_input", RoiAlignBackwardInputNhwcCuda, "roi_align",
                   "backward d_input (NHWC)",
                   "cuda row-entry sort (CUB) + channel-slab ordered gather, in place (atomics "
                   "for float32/float64 if deterministic=False)",
                   "bitwise (deterministic=True); atomics otherwise for float32/float64");
JK_REGISTER_TARGET("jk_roi_align_nhwc_bwd_boxes", RoiAlignBackwardBoxesNhwcCuda, "roi_align",
                   "backward d_boxes (NHWC)", "cuda per-box block reduction (float64)", "bitwise");
JK_REGISTER_QUERY("roi_align_backward_input_scratch", backward_input_scratch_query<RoiAlignNCHW>);
JK_REGISTER_QUERY("roi_align_nhwc_backward_input_scratch",
                  backward_input_scratch_query<RoiAlignNHWC>);

}  // namespace jax_kernels
