// The CUDA directional passes of roi_align (forward-mode and second-order derivatives in the box
// coordinates; the math is in roi_align.h, shared with cpp/cpu/roi_align_directional.cc). None
// takes scratch memory, none uses atomics: every pass is bitwise reproducible.
//
// Forward directional: one thread per (box, 16 channels, bin), summing the bin's samples in
// for_each_bin_sample's order, as the plain forward's CPU loop.
//
// Box gradient along u: one block per box, thread j taking the items (bin, 16 channels)
// j, j + 256, ..., reduced over the block in a fixed tree, as the plain box gradient.
//
// Input gradient directional: an owner per input cell. A block item is (image, tile of 8 x 32
// cells, 16 channels), one thread per cell, its accumulators in registers. The block scans the
// boxes in index order 256 at a time, keeps (in order) those whose samples can reach the tile
// (an O(1) test per box), and each thread adds the kept boxes' terms at its cell, row bins then
// column bins in ascending order, the CPU pass's order. The scan costs K cheap tests per item;
// the terms cost what the boxes' footprints hold.
//
// Every kernel and handler is a template on the layout (roi_align.h's RoiAlignNCHW and
// RoiAlignNHWC), registered as jk_roi_align_*_directional and jk_roi_align_nhwc_*_directional:
// channels last, a thread's 16 channels are consecutive in memory (read and written in place),
// and the terms are added in the same order as for NCHW.
#include <algorithm>
#include <cstdint>

#include "common/launch.h"
#include "common/status.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/roi_align.h"

JK_ROI_ALIGN_REGISTER_ATTRS();

namespace jax_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kChannels = 16;  // channels per thread
constexpr int kTileRows = 8, kTileColumns = 32;  // input-gradient tile: one cell per thread
static_assert(kTileRows * kTileColumns == kThreads, "one thread per tile cell");

int64_t channel_chunks(const RoiAlignProblem& p) { return (p.C + kChannels - 1) / kChannels; }

// ---- forward directional -----------------------------------------------------------------------

template <class Layout, class T>
__global__ void __launch_bounds__(kThreads)
    roi_align_forward_directional_kernel(const T* __restrict__ input, const T* __restrict__ boxes,
                                         const T* __restrict__ u, const T* __restrict__ v,
                                         T* __restrict__ out, RoiAlignProblem p, int64_t chunks) {
  using A = acc_t<T>;
  const int64_t bins = p.bins(), plane = p.H * p.W, items = p.K * chunks * bins;
  const int64_t binned = Layout::binned_channel_stride(p);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += stride) {
    const int64_t bin = i % bins, rest = i / bins;
    const int64_t k = rest / chunks, c_begin = (rest % chunks) * kChannels;
    const int64_t channels = min(int64_t(kChannels), p.C - c_begin);
    const RoiBox<A> box = roi_box(boxes, k, p);
    A acc[kChannels];
#pragma unroll
    for (int c = 0; c < kChannels; ++c) acc[c] = A(0);
    if (box.image >= 0)
      accumulate_bin_directional<kChannels, Layout>(
          box, roi_directional(u, v, k), bin,
          input + box.image * p.C * plane + c_begin * Layout::channel_stride(p), channels, p, acc);
    T* o = out + k * p.C * bins + c_begin * binned + bin * Layout::bin_stride(p);
#pragma unroll
    for (int c = 0; c < kChannels; ++c)
      if (c < channels) o[c * binned] = from_acc<T>(acc[c] / box.count);
  }
}

// ---- box gradient along u ----------------------------------------------------------------------

template <class Layout, class T>
__global__ void __launch_bounds__(kThreads)
    roi_align_backward_boxes_directional_kernel(const T* __restrict__ dout,
                                                const T* __restrict__ input,
                                                const T* __restrict__ boxes,
                                                const T* __restrict__ u, T* __restrict__ d_boxes,
                                                RoiAlignProblem p, int64_t chunks) {
  using A = acc_t<T>;
  __shared__ double partial[4][kThreads];
  const int64_t bins = p.bins(), plane = p.H * p.W;
  for (int64_t k = blockIdx.x; k < p.K; k += gridDim.x) {
    const RoiBox<A> box = roi_box(boxes, k, p);
    const RoiDirection<A> direction = roi_direction(u, k);
    double d[4] = {0, 0, 0, 0};  // x1, y1, x2, y2
    if (box.image >= 0) {
      for (int64_t j = threadIdx.x; j < bins * chunks; j += kThreads) {
        const int64_t bin = j % bins, c_begin = (j / bins) * kChannels;
        accumulate_box_hessian<kChannels, Layout>(
            box, direction, bin, dout + k * p.C * bins + c_begin * Layout::binned_channel_stride(p),
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

// ---- input gradient directional ------------------------------------------------------------------

// Whether box k can give weight to a cell of image n, rows [h0, h1], columns [w0, w1]: a
// superset test (RoiAxis::candidates), false for boxes without an image or with non-finite
// geometry.
template <class T>
__device__ bool box_reaches_tile(const T* boxes, int64_t k, const RoiAlignProblem& p, int64_t n,
                                 int64_t h0, int64_t h1, int64_t w0, int64_t w1) {
  using A = acc_t<T>;
  const RoiBox<A> box = roi_box(boxes, k, p);
  if (box.image != n) return false;
  int64_t t0, t1;
  box.y.candidates(A(h0 - 1), A(h1 + 1), 0, box.y.samples(), &t0, &t1);
  if (t0 >= t1) return false;
  box.x.candidates(A(w0 - 1), A(w1 + 1), 0, box.x.samples(), &t0, &t1);
  return t0 < t1;
}

template <class Layout, class T>
__global__ void __launch_bounds__(kThreads)
    roi_align_backward_input_directional_kernel(const T* __restrict__ dout,
                                                const T* __restrict__ boxes,
                                                const T* __restrict__ u, const T* __restrict__ v,
                                                T* __restrict__ d_input, RoiAlignProblem p,
                                                int64_t row_tiles, int64_t column_tiles,
                                                int64_t chunks) {
  using A = acc_t<T>;
  __shared__ int64_t kept[kThreads];
  __shared__ int warp_counts[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t bins = p.bins(), plane = p.H * p.W;
  const int64_t binned = Layout::binned_channel_stride(p), bin_stride = Layout::bin_stride(p);
  const int64_t channel_stride = Layout::channel_stride(p);
  const int64_t items = p.N * row_tiles * column_tiles * chunks;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t chunk = item % chunks, rest = item / chunks;
    const int64_t tile_w = rest % column_tiles, rest2 = rest / column_tiles;
    const int64_t tile_h = rest2 % row_tiles, n = rest2 / row_tiles;
    const int64_t h0 = tile_h * kTileRows, w0 = tile_w * kTileColumns;
    const int64_t h1 = min(h0 + kTileRows, p.H) - 1, w1 = min(w0 + kTileColumns, p.W) - 1;
    const int64_t h = h0 + threadIdx.x / kTileColumns, w = w0 + threadIdx.x % kTileColumns;
    const bool inside = h <= h1 && w <= w1;
    const int64_t c_begin = chunk * kChannels;
    const int64_t channels = min(int64_t(kChannels), p.C - c_begin);
    A acc[kChannels];
#pragma unroll
    for (int c = 0; c < kChannels; ++c) acc[c] = A(0);
    for (int64_t base = 0; base < p.K; base += kThreads) {
      // Keep, in index order, the boxes of this batch that can reach the tile.
      const int64_t k = base + threadIdx.x;
      const bool hit = k < p.K && box_reaches_tile(boxes, k, p, n, h0, h1, w0, w1);
      const unsigned hits = __ballot_sync(0xffffffffu, hit);
      if (lane == 0) warp_counts[warp] = __popc(hits);
      __syncthreads();
      int offset = 0, count = 0;
      for (int i = 0; i < kThreads / 32; ++i) {
        offset += i < warp ? warp_counts[i] : 0;
        count += warp_counts[i];
      }
      if (hit) kept[offset + __popc(hits & ((1u << lane) - 1u))] = k;
      __syncthreads();
      if (inside) {
        for (int i = 0; i < count; ++i) {
          const int64_t kk = kept[i];
          const RoiBox<A> box = roi_box(boxes, kk, p);
          DirectionalTerms<A> row_terms, column_terms;
          directional_terms(roi_directional(u, v, kk), &row_terms, &column_terms);
          const T* g = dout + kk * p.C * bins + c_begin * binned;
          for_each_directional_index_bin(
              box.y, row_terms, h, p.H, [&](int64_t row_bin, DirectionalPair<A> row_pair) {
                const DirectionalPair<A> row = directional_row_pair(box, row_pair);
                const T* g_row = g + row_bin * p.PW * bin_stride;
                for_each_directional_index_bin(
                    box.x, column_terms, w, p.W,
                    [&](int64_t column_bin, DirectionalPair<A> column) {
                      const A weight = directional_weight(row, column);
#pragma unroll
                      for (int c = 0; c < kChannels; ++c)
                        if (c < channels)
                          acc[c] += input_gradient_term(
                              g_row[c * binned + column_bin * bin_stride], weight);
                    });
              });
        }
      }
      __syncthreads();  // kept and warp_counts are rewritten for the next batch
    }
    if (inside) {
      T* out = d_input + n * p.C * plane + c_begin * channel_stride +
               (h * p.W + w) * Layout::cell_stride(p);
#pragma unroll
      for (int c = 0; c < kChannels; ++c)
        if (c < channels) out[c * channel_stride] = from_acc<T>(acc[c]);
    }
  }
}

// ---- handlers ----------------------------------------------------------------------------------

template <class Layout>
ffi::Error roi_align_forward_directional(cudaStream_t stream, ffi::AnyBuffer input,
                                         ffi::AnyBuffer boxes, ffi::AnyBuffer u,
                                         ffi::RemainingArgs rest, RoiAlignAttrs attrs,
                                         ffi::Result<ffi::AnyBuffer> out) {
  const char* op = "roi_align forward directional";
  RoiAlignProblem p;
  if (auto err = roi_align_problem<Layout>(op, attrs, input, boxes, *out, &p); err.failure())
    return err;
  const void* v = nullptr;
  if (auto err = roi_align_directions(op, boxes, u, rest, &v); err.failure()) return err;
  const int64_t items = p.K * channel_chunks(p) * p.bins();
  if (items == 0) return ffi::Error::Success();
  return dispatch_float(input.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    roi_align_forward_directional_kernel<Layout, T>
        <<<grid_blocks(items, kThreads), kThreads, 0, stream>>>(
        static_cast<const T*>(input.untyped_data()), static_cast<const T*>(boxes.untyped_data()),
        static_cast<const T*>(u.untyped_data()), static_cast<const T*>(v),
        static_cast<T*>(out->untyped_data()), p, channel_chunks(p));
    return launch_status(op);
  });
}

template <class Layout>
ffi::Error roi_align_backward_input_directional(cudaStream_t stream, ffi::AnyBuffer dout,
                                                ffi::AnyBuffer boxes, ffi::AnyBuffer u,
                                                ffi::RemainingArgs rest, RoiAlignAttrs attrs,
                                                ffi::Result<ffi::AnyBuffer> d_input) {
  const char* op = "roi_align backward d_input directional";
  RoiAlignProblem p;
  if (auto err = roi_align_problem<Layout>(op, attrs, *d_input, boxes, dout, &p); err.failure())
    return err;
  const void* v = nullptr;
  if (auto err = roi_align_directions(op, boxes, u, rest, &v); err.failure()) return err;
  if (d_input->size_bytes() == 0) return ffi::Error::Success();
  const int64_t row_tiles = (p.H + kTileRows - 1) / kTileRows;
  const int64_t column_tiles = (p.W + kTileColumns - 1) / kTileColumns;
  const int64_t items = p.N * row_tiles * column_tiles * channel_chunks(p);
  return dispatch_float(dout.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    roi_align_backward_input_directional_kernel<Layout, T>
        <<<grid_blocks(items * kThreads, kThreads), kThreads, 0, stream>>>(
            static_cast<const T*>(dout.untyped_data()),
            static_cast<const T*>(boxes.untyped_data()), static_cast<const T*>(u.untyped_data()),
            static_cast<const T*>(v), static_cast<T*>(d_input->untyped_data()), p, row_tiles,
            column_tiles, channel_chunks(p));
    return launch_status(op);
  });
}

template <class Layout>
ffi::Error roi_align_backward_boxes_directional(cudaStream_t stream, ffi::AnyBuffer dout,
                                                ffi::AnyBuffer input, ffi::AnyBuffer boxes,
                                                ffi::AnyBuffer u, RoiAlignAttrs attrs,
                                                ffi::Result<ffi::AnyBuffer> d_boxes) {
  const char* op = "roi_align backward d_boxes directional";
  RoiAlignProblem p;
  if (auto err = roi_align_problem<Layout>(op, attrs, input, boxes, dout, &p); err.failure())
    return err;
  if (auto err = roi_align_hessian_operands(op, boxes, u, *d_boxes); err.failure()) return err;
  if (p.K == 0) return ffi::Error::Success();
  return dispatch_float(input.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const unsigned blocks = unsigned(std::min<int64_t>(p.K, int64_t(1) << 30));
    roi_align_backward_boxes_directional_kernel<Layout, T><<<blocks, kThreads, 0, stream>>>(
        static_cast<const T*>(dout.untyped_data()), static_cast<const T*>(input.untyped_data()),
        static_cast<const T*>(boxes.untyped_data()), static_cast<const T*>(u.untyped_data()),
        static_cast<T*>(d_boxes->untyped_data()), p, channel_chunks(p));
    return launch_status(op);
  });
}

using Stream = ffi::PlatformStream<cudaStream_t>;

}  // namespace

// The handler symbols of one layout (Suffix: Cuda for NCHW, NhwcCuda for NHWC).
#define JK_ROI_ALIGN_DIRECTIONAL_CUDA_HANDLERS(Suffix, Layout)                                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignForwardDirectional##Suffix,                            \
                                roi_align_forward_directional<Layout>,                         \
                                ffi::Ffi::Bind()                                               \
                                    .Ctx<Stream>()                                             \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .RemainingArgs()                                           \
                                    .Attrs<RoiAlignAttrs>()                                    \
                                    .Ret<ffi::AnyBuffer>(),                                    \
                                {ffi::Traits::kCmdBufferCompatible});                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignBackwardInputDirectional##Suffix,                      \
                                roi_align_backward_input_directional<Layout>,                  \
                                ffi::Ffi::Bind()                                               \
                                    .Ctx<Stream>()                                             \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .RemainingArgs()                                           \
                                    .Attrs<RoiAlignAttrs>()                                    \
                                    .Ret<ffi::AnyBuffer>(),                                    \
                                {ffi::Traits::kCmdBufferCompatible});                          \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignBackwardBoxesDirectional##Suffix,                      \
                                roi_align_backward_boxes_directional<Layout>,                  \
                                ffi::Ffi::Bind()                                               \
                                    .Ctx<Stream>()                                             \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Arg<ffi::AnyBuffer>()                                     \
                                    .Attrs<RoiAlignAttrs>()                                    \
                                    .Ret<ffi::AnyBuffer>(),                                    \
                                {ffi::Traits::kCmdBufferCompatible})

JK_ROI_ALIGN_DIRECTIONAL_CUDA_HANDLERS(Cuda, RoiAlignNCHW);
JK_ROI_ALIGN_DIRECTIONAL_CUDA_HANDLERS(NhwcCuda, RoiAlignNHWC);

JK_REGISTER_TARGET("jk_roi_align_fwd_directional", RoiAlignForwardDirectionalCuda, "roi_align",
                   "forward directional", "cuda per-(box, bin, 16 channels) thread", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_bwd_input_directional", RoiAlignBackwardInputDirectionalCuda,
                   "roi_align", "backward d_input directional",
                   "cuda per-cell owner over boxes in order (tile box scan, no scratch)",
                   "bitwise");
JK_REGISTER_TARGET("jk_roi_align_bwd_boxes_directional", RoiAlignBackwardBoxesDirectionalCuda,
                   "roi_align", "backward d_boxes directional",
                   "cuda per-box block reduction (float64)", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_nhwc_fwd_directional", RoiAlignForwardDirectionalNhwcCuda,
                   "roi_align", "forward directional (NHWC)",
                   "cuda per-(box, bin, 16 channels) thread", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_nhwc_bwd_input_directional",
                   RoiAlignBackwardInputDirectionalNhwcCuda, "roi_align",
                   "backward d_input directional (NHWC)",
                   "cuda per-cell owner over boxes in order (tile box scan, no scratch)",
                   "bitwise");
JK_REGISTER_TARGET("jk_roi_align_nhwc_bwd_boxes_directional",
                   RoiAlignBackwardBoxesDirectionalNhwcCuda, "roi_align",
                   "backward d_boxes directional (NHWC)", "cuda per-box block reduction (float64)",
                   "bitwise");

}  // namespace jax_kernels
