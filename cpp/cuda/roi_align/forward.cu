// The CUDA forward of roi_align (the math is in roi_align.h; channel slabs and the staging
// transpose in channel_slabs.cuh). The input is staged as NHWC, the boxes are sorted by image and
// center row (CUB), then one block per (slab, box, tile of bins) in that order, so the blocks in
// flight read a few image rows of the staged input (kept in L2). The block finds the candidate
// samples of its bin rows and columns once; a group per bin sums the bin's samples in
// for_each_bin_sample's order; the block stages its outputs in shared memory and writes them as
// contiguous runs. Scratch (the staged input, the sort) comes from XLA as an extra result sized
// by the host query "roi_align_forward_scratch".
//
// The handler takes the forward by image regions instead (forward_regions.h) for float32
// channels-last calls with a fixed sampling grid, where the scratch holds its plan.
//
// Channels last (jk_roi_align_nhwc_fwd, the same kernel instantiated for RoiAlignNHWC): the input
// is read in place (no staging: the scratch holds the sort only, host query
// "roi_align_nhwc_forward_scratch") and each lane stores its channels of a bin straight to the
// [K, PH, PW, C] output, a group's stores covering consecutive channels.
#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/knobs.h"
#include "common/launch.h"
#include "common/radix_sort.cuh"
#include "common/scratch.h"
#include "common/status.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/roi_align.h"
#include "roi_align/channel_slabs.cuh"
#include "roi_align/forward_regions.h"

JK_ROI_ALIGN_REGISTER_ATTRS();

namespace jax_kernels {
namespace {

constexpr int64_t kForwardTileBytes = 24 << 10;  // shared memory of a forward block's outputs

// ---- forward -----------------------------------------------------------------------------------

// A forward block item covers a tile of at most kMaxTileBins of the box's bins: whole bin rows
// when a row fits, else part of one row.
constexpr int64_t kMaxTileBins = 256;

// The candidate samples [first, last) of one bin row or column.
struct CandidateRange {
  int64_t first, last;
};

struct ForwardLaunch {
  ChannelSlabs slabs;
  int64_t row_tiles;   // tiles per bin row: 1 when a tile holds whole rows
  int64_t tile_rows;   // bin rows per tile (1 when row_tiles > 1)
  int64_t tile_cols;   // bins per tile along a row (PW when row_tiles == 1)
  int64_t tiles;       // tiles per box
  int64_t tile_stride;  // shared-memory row of a channel's outputs
  int64_t ranges_at, shared_bytes;  // shared memory: outputs, then candidate ranges
};

template <class T, class Layout>
ForwardLaunch forward_launch(const RoiAlignProblem& p) {
  ForwardLaunch l;
  l.slabs = channel_slabs(p.C, slab_channels<T>());
  const int64_t most = std::min<int64_t>(
      kMaxTileBins, std::max<int64_t>(1, kForwardTileBytes / (l.slabs.slab * int64_t(sizeof(T)))));
  if (p.PW <= most) {  // tiles of even numbers of whole rows
    l.row_tiles = 1;
    l.tiles = (p.PH + most / p.PW - 1) / (most / p.PW);
    l.tile_rows = (p.PH + l.tiles - 1) / l.tiles;
    l.tile_cols = p.PW;
  } else {
    l.row_tiles = (p.PW + most - 1) / most;
    l.tile_rows = 1;
    l.tile_cols = (p.PW + l.row_tiles - 1) / l.row_tiles;
    l.tiles = p.PH * l.row_tiles;
  }
  l.tile_stride = (l.tile_rows * l.tile_cols) | 1;  // odd: a group's lanes store to distinct banks
  // Channels last stores from registers: no output tile in shared memory.
  l.ranges_at = Layout::kChannelsLast
                    ? 0
                    : round_up(l.slabs.slab * l.tile_stride * int64_t(sizeof(T)), kSharedAlign);
  l.shared_bytes = l.ranges_at + (l.tile_rows + l.tile_cols) * int64_t(sizeof(CandidateRange));
  return l;
}

// Block item i = (slab, box in sorted order, tile of bins), slabs slowest, so that the blocks in
// flight read a slab of the staged input around a few image rows. The block first finds the
// candidate samples of the tile's bin rows and columns; then a group takes one bin at a time and
// sums its samples in for_each_bin_sample's order, its lanes loading the slab's channels of each
// tap. `nhwc` is the staged input (NCHW) or the input itself (NHWC).
template <class Layout, class T, int kPerLane, int kVec, class Index>
__global__ void __launch_bounds__(kThreads, 2)
    roi_align_forward_kernel(const T* __restrict__ nhwc, const T* __restrict__ boxes,
                             const uint32_t* __restrict__ order, T* __restrict__ out,
                             RoiAlignProblem p, ForwardLaunch l) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* tile = reinterpret_cast<T*>(shared_bytes);
  CandidateRange* ranges = reinterpret_cast<CandidateRange*>(shared_bytes + l.ranges_at);
  const int lanes = l.slabs.lanes;
  const int lane = threadIdx.x % lanes, group = threadIdx.x / lanes, groups = blockDim.x / lanes;
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t bins = p.bins(), items = l.slabs.slabs * p.K * l.tiles;
  const Index W = Index(p.W), C = Index(p.C);
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t tile_index = item % l.tiles, rest = item / l.tiles;
    const int64_t k = order[rest % p.K], c0 = (rest / p.K) * l.slabs.slab;
    const int channels = int(min(l.slabs.slab, p.C - c0));
    int64_t ph0 = tile_index * l.tile_rows, pw0 = 0;
    if (l.row_tiles > 1) {
      ph0 = tile_index / l.row_tiles;
      pw0 = (tile_index - ph0 * l.row_tiles) * l.tile_cols;
    }
    const int rows = int(min(l.tile_rows, p.PH - ph0)), cols = int(min(l.tile_cols, p.PW - pw0));
    const RoiBox<A> box = roi_box(boxes, k, p);
    for (int i = threadIdx.x; i < rows + cols; i += blockDim.x) {
      CandidateRange& range = ranges[i];
      if (i < rows)
        bin_candidates(box.y, ph0 + i, p.H, &range.first, &range.last);
      else
        bin_candidates(box.x, pw0 + i - rows, p.W, &range.first, &range.last);
    }
    __syncthreads();
    const T* image = nhwc + max(box.image, int64_t(0)) * p.H * p.W * p.C + c0;
    for (int b = group; b < rows * cols; b += groups) {
      A acc[kPerLane];
#pragma unroll
      for (int u = 0; u < kPerLane; ++u) acc[u] = A(0);
      const int r = b / cols, c = b - r * cols;
      const BinCandidates candidates{ph0 + r, pw0 + c, ranges[r].first, ranges[r].last,
                                     ranges[rows + c].first, ranges[rows + c].last};
      if (box.image >= 0)
        for_each_bin_sample(box, candidates, p, [&](int64_t, const AxisSample<A>& sy, int64_t,
                                                    const AxisSample<A>& sx) {
          const BilinearTaps<A> taps = bilinear_taps(sy, sx, p.W);
          const Index low = Index(sy.low) * W, high = Index(sy.high) * W;
          T values[4][kPerLane];
          load_slab<T, kPerLane, kVec>(image + (low + Index(sx.low)) * C, lanes, lane, channels,
                                       values[0]);
          load_slab<T, kPerLane, kVec>(image + (low + Index(sx.high)) * C, lanes, lane, channels,
                                       values[1]);
          load_slab<T, kPerLane, kVec>(image + (high + Index(sx.low)) * C, lanes, lane, channels,
                                       values[2]);
          load_slab<T, kPerLane, kVec>(image + (high + Index(sx.high)) * C, lanes, lane,
                                       channels, values[3]);
#pragma unroll
          for (int u = 0; u < kPerLane; ++u)
            acc[u] += bilinear_sum(taps.w1, to_acc(values[0][u]), taps.w2, to_acc(values[1][u]),
                                   taps.w3, to_acc(values[2][u]), taps.w4, to_acc(values[3][u]));
        });
      if constexpr (Layout::kChannelsLast) {
        T* o = out + (k * bins + (ph0 + r) * p.PW + pw0 + c) * p.C + c0;
#pragma unroll
        for (int u = 0; u < kPerLane; ++u) {
          const int channel = slab_channel<kVec>(u, lanes, lane);
          if (channel < channels) o[channel] = from_acc<T>(acc[u] / box.count);
        }
      } else {
#pragma unroll
        for (int u = 0; u < kPerLane; ++u) {
          const int channel = slab_channel<kVec>(u, lanes, lane);
          if (channel < channels)
            tile[channel * l.tile_stride + b] = from_acc<T>(acc[u] / box.count);
        }
      }
    }
    __syncthreads();  // the ranges (and the tile) are rewritten for the next item
    if constexpr (!Layout::kChannelsLast) {
      // The tile's bins are consecutive: whole rows, or part of one row.
      T* o = out + (k * p.C + c0) * bins + ph0 * p.PW + pw0;
      for (int channel = warp; channel < channels; channel += warps)
        for (int b = threadIdx.x % 32; b < rows * cols; b += 32)
          o[channel * bins + b] = tile[channel * l.tile_stride + b];
      __syncthreads();
    }
  }
}

// The forward's scratch: the NHWC staging of the input (when `staged`: NCHW calls), then the sort
// of the boxes by image and center row (keys, values, CUB temp storage).
struct ForwardLayout {
  int64_t nhwc = 0, keys_in = 0, keys_out = 0, values_in = 0, values_out = 0, sort_temp = 0,
          sort_temp_bytes = 0, total = 0;
  int end_bit = 0;
};

// false if the box sort's keys do not fit 32 bits; total is -1 when the bytes cannot be
// represented.
bool forward_layout(int64_t N, int64_t C, int64_t H, int64_t W, int64_t K, int64_t element_bytes,
                    bool staged, ForwardLayout* s) {
  const int64_t rows = checked_mul(N, H);
  if (K >= (int64_t(1) << 31) || rows < 0 || rows >= (int64_t(1) << 32) - 1) return false;
  ScratchLayout layout;
  s->nhwc = layout.take(staged ? checked_product({N, C, H, W, element_bytes}) : 0);
  s->keys_in = layout.take(K * 4);
  s->keys_out = layout.take(K * 4);
  s->values_in = layout.take(K * 4);
  s->values_out = layout.take(K * 4);
  s->end_bit = key_bits(uint64_t(rows));  // keys in [0, N * H]
  s->sort_temp_bytes = radix_sort_temp_bound(K, s->end_bit);
  s->sort_temp = layout.take(s->sort_temp_bytes);
  s->total = layout.total();
  return true;
}

// Sort key of each box: image * H + the row of its center (clamped), N * H without an image.
template <class T>
__global__ void __launch_bounds__(kThreads)
    roi_align_box_keys_kernel(const T* __restrict__ boxes, RoiAlignProblem p,
                              uint32_t* __restrict__ keys, uint32_t* __restrict__ values) {
  using A = acc_t<T>;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < p.K; k += stride) {
    const RoiBox<A> box = roi_box(boxes, k, p);
    const A center = box.y.start + A(0.5) * box.y.bin * A(p.PH);
    int64_t row = 0;
    if (center >= A(p.H - 1)) row = p.H - 1;
    else if (center > A(0)) row = int64_t(center);
    keys[k] = uint32_t(box.image >= 0 ? box.image * p.H + row : p.N * p.H);
    values[k] = uint32_t(k);
  }
}

// Host queries "roi_align_forward_scratch" and "roi_align_nhwc_forward_scratch": the bytes of
// the forward's scratch (room for either route: the gather over boxes, and the region forward
// where the call is eligible), -1 if neither route takes the call (the box sort's keys do not
// fit 32 bits), kSizeOverflow if the bytes cannot be represented. Arguments: N, C, H, W,
// `boxes` (K), pooled_height, pooled_width, sampling_ratio and element_bytes.
template <class Layout>
int64_t forward_scratch_query(const QueryArgs& a) {
  const int64_t N = a["N"], C = a["C"], H = a["H"], W = a["W"], K = a["boxes"];
  const int64_t bytes = a["element_bytes"];
  const RegionPlan regions =
      region_plan(N, C, H, W, K, a["pooled_height"], a["pooled_width"], a["sampling_ratio"], bytes);
  ForwardLayout s;
  const bool gather = forward_layout(N, C, H, W, K, bytes, !Layout::kChannelsLast, &s);
  if (!gather && !regions.eligible) return -1;
  if (gather && s.total < 0) return kSizeOverflow;
  return regions.eligible ? std::max(regions.total, gather ? s.total : 0) : s.total;
}

// ---- handler -----------------------------------------------------------------------------------

template <class Layout>
ffi::Error roi_align_forward(cudaStream_t stream, ffi::AnyBuffer input, ffi::AnyBuffer boxes,
                             RoiAlignAttrs attrs, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::AnyBuffer> scratch) {
  const char* op = "roi_align";
  RoiAlignProblem p;
  if (auto err = roi_align_problem<Layout>(op, attrs, input, boxes, *out, &p); err.failure())
    return err;
  if (p.K * p.C * p.bins() == 0) return ffi::Error::Success();
  const int64_t element_bytes = int64_t(ffi::ByteWidth(input.element_type()));
  // The region forward where the call is eligible, the scratch holds its plan (a program
  // exported before it existed asked for the gather's scratch only) and it was measured against
  // the gather over boxes: float32 channels last (run 35: level on the FPN 7x7 case, 1.28x on
  // 14x14; NCHW, staged in the kernel, lost to the gather's transpose, and the half types were
  // not timed). JAX_KERNELS_ROI_ALIGN_REGIONS=0 keeps every call on the gather, =all takes every
  // eligible call to the regions (the same bits either way).
  const RegionPlan regions = region_plan(p.N, p.C, p.H, p.W, p.K, p.PH, p.PW, p.sampling_ratio,
                                         element_bytes);
  bool wanted = Layout::kChannelsLast && input.element_type() == ffi::DataType::F32;
  if (knob_off("JAX_KERNELS_ROI_ALIGN_REGIONS")) wanted = false;
  if (knob_is("JAX_KERNELS_ROI_ALIGN_REGIONS", "all")) wanted = true;
  if (regions.eligible && wanted && int64_t(scratch->size_bytes()) >= regions.total) {
    char* base = aligned_scratch(scratch->untyped_data());
    return dispatch_float(input.element_type(), op, [&](auto tag) -> ffi::Error {
      using T = typename decltype(tag)::type;
      if constexpr (std::is_same_v<T, double>) {
        return ffi::Error::Internal("roi_align: no region forward for float64");
      } else {
        return cuda_status(op, roi_align_forward_regions<Layout, T>(
                                   static_cast<const T*>(input.untyped_data()),
                                   static_cast<const T*>(boxes.untyped_data()),
                                   static_cast<T*>(out->untyped_data()), p, regions, base, stream));
      }
    });
  }
  ForwardLayout layout;
  if (!forward_layout(p.N, p.C, p.H, p.W, p.K, element_bytes, !Layout::kChannelsLast, &layout))
    return ffi::Error::InvalidArgument("roi_align: too many boxes or rows for the box sort");
  if (layout.total < 0 || int64_t(scratch->size_bytes()) < layout.total)
    return ffi::Error::InvalidArgument("roi_align: scratch buffer smaller than the query's size");
  char* base = aligned_scratch(scratch->untyped_data());
  return dispatch_float(input.element_type(), op, [&](auto tag) -> ffi::Error {
    using T = typename decltype(tag)::type;
    const T* box_data = static_cast<const T*>(boxes.untyped_data());
    const T* nhwc = static_cast<const T*>(input.untyped_data());
    if constexpr (!Layout::kChannelsLast) {
      T* staged = reinterpret_cast<T*>(base + layout.nhwc);
      transpose(nhwc, staged, p.N, p.C, p.H * p.W, stream);
      nhwc = staged;
    }
    uint32_t* keys_in = reinterpret_cast<uint32_t*>(base + layout.keys_in);
    uint32_t* values_in = reinterpret_cast<uint32_t*>(base + layout.values_in);
    roi_align_box_keys_kernel<T><<<grid_blocks(p.K, kThreads), kThreads, 0, stream>>>(
        box_data, p, keys_in, values_in);
    cub::DoubleBuffer<uint32_t> keys(keys_in, reinterpret_cast<uint32_t*>(base + layout.keys_out));
    cub::DoubleBuffer<uint32_t> order(values_in,
                                      reinterpret_cast<uint32_t*>(base + layout.values_out));
    if (auto err = radix_sort_pairs(op, keys, order, p.K, layout.end_bit, base + layout.sort_temp,
                                    layout.sort_temp_bytes, stream);
        err.failure())
      return err;
    const ForwardLaunch l = forward_launch<T, Layout>(p);
    const int64_t items = l.slabs.slabs * p.K * l.tiles;
    const size_t shared = size_t(l.shared_bytes);
    const bool narrow = p.H * p.W * p.C < (int64_t(1) << 31);
    with_slab_kernel<T>(l.slabs, p.C % 4 == 0, narrow, [&](auto per_lane, auto vec, auto index) {
      roi_align_forward_kernel<Layout, T, decltype(per_lane)::value, decltype(vec)::value,
                               decltype(index)>
          <<<grid_blocks(items * kThreads, kThreads), kThreads, shared, stream>>>(
              nhwc, box_data, order.Current(), static_cast<T*>(out->untyped_data()), p, l);
    });
    return launch_status(op);
  });
}

using Stream = ffi::PlatformStream<cudaStream_t>;

}  // namespace

// The handler symbol of one layout (Suffix: Cuda for NCHW, NhwcCuda for NHWC).
#define JK_ROI_ALIGN_FORWARD_CUDA_HANDLER(Suffix, Layout)                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignForward##Suffix, roi_align_forward<Layout>,            \
                                ffi::Ffi::Bind()                                               \
                                    .Ctx<Stream>()                                             \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Attrs<RoiAlignAttrs>()                                    \
                                    .Ret<ffi::AnyBuffer>()                                     \
                                    .Ret<ffi::AnyBuffer>(),                                    \
                                {ffi::Traits::kCmdBufferCompatible})

JK_ROI_ALIGN_FORWARD_CUDA_HANDLER(Cuda, RoiAlignNCHW);
JK_ROI_ALIGN_FORWARD_CUDA_HANDLER(NhwcCuda, RoiAlignNHWC);

JK_REGISTER_TARGET("jk_roi_align_fwd", RoiAlignForwardCuda, "roi_align", "forward",
                   "cuda NHWC staging + channel-slab gather", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_nhwc_fwd", RoiAlignForwardNhwcCuda, "roi_align", "forward (NHWC)",
                   "cuda channel-slab gather (in place); float32 with a fixed sampling ratio: "
                   "image regions staged in shared memory", "bitwise");
JK_REGISTER_QUERY("roi_align_forward_scratch", forward_scratch_query<RoiAlignNCHW>);
JK_REGISTER_QUERY("roi_align_nhwc_forward_scratch", forward_scratch_query<RoiAlignNHWC>);

}  // namespace jax_kernels
