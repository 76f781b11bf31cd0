// CUDA FFI handlers of roi_align.
//
// Forward and box gradient: one thread per (box, bin, channel chunk) computes the bin's samples
// once and reuses them over its channels; the box gradient reduces per box in a fixed order (one
// block per box), so both are deterministic without atomics.
//
// Input gradient, deterministic (default): an ordered gather instead of a scatter.
//   1. One warp per box lists, in ascending order, the input rows its samples touch (at most
//      min(H, 2 * PH * sampling_ratio) rows; H for the adaptive grid) as (key = image * H + row,
//      value = box) and stores the box geometry.
//   2. A stable radix sort (CUB) groups the entries by row, boxes in index order within a row,
//      and a binary search per row gives each row's segment.
//   3. One thread per (input cell, 32 channels) walks its row's boxes in order and, per box,
//      the few samples that reach its row and column, summing weight * dout in a fixed order.
// Every sum has an order that depends only on the data, so d_input is bitwise reproducible.
// Scratch (geometry, keys, values, row offsets, CUB temp storage) comes from XLA as an extra
// result sized by the host query "roi_align_backward_input_scratch".
//
// Input gradient, deterministic=False (float32/float64 only): the forward's threads scatter
// weight * dout with atomicAdd.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "jax_kernels/cuda_util.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/roi_align.h"

JK_ROI_ALIGN_REGISTER_ATTRS();

namespace jax_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kChannels = 16;  // channels per thread: the sample geometry is reused over them
// The gather's per-(cell, box) sample search is paid once per chunk: a larger chunk there.
constexpr int kGatherChannels = 32;

// ---- forward and atomic input gradient ----------------------------------------------------------

// Work item i of a (box, channel chunk, bin) grid, bins fastest so that a warp's output stores
// for one channel are contiguous.
struct BinItem {
  int64_t k, c_begin, bin;
};

__device__ __forceinline__ BinItem bin_item(int64_t i, int64_t bins, int64_t chunks) {
  const int64_t bin = i % bins;
  const int64_t rest = i / bins;
  return BinItem{rest / chunks, (rest % chunks) * kChannels, bin};
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    roi_align_forward_kernel(const T* __restrict__ input, const T* __restrict__ boxes,
                             T* __restrict__ out, RoiAlignProblem p, int64_t chunks) {
  using A = acc_t<T>;
  const int64_t bins = p.bins(), plane = p.H * p.W, items = p.K * chunks * bins;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += stride) {
    const BinItem item = bin_item(i, bins, chunks);
    const int64_t channels = min(int64_t(kChannels), p.C - item.c_begin);
    const RoiBox<A> box = roi_box(boxes, item.k, p);
    A acc[kChannels];
#pragma unroll
    for (int c = 0; c < kChannels; ++c) acc[c] = A(0);
    if (box.image >= 0)
      accumulate_bin<kChannels>(box, item.bin, input + (box.image * p.C + item.c_begin) * plane,
                                channels, p, acc);
    T* o = out + (item.k * p.C + item.c_begin) * bins + item.bin;
#pragma unroll
    for (int c = 0; c < kChannels; ++c)
      if (c < channels) o[c * bins] = from_acc<T>(acc[c] / box.count);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    roi_align_backward_input_atomic_kernel(const T* __restrict__ dout, const T* __restrict__ boxes,
                                           T* __restrict__ d_input, RoiAlignProblem p,
                                           int64_t chunks) {
  using A = acc_t<T>;
  const int64_t bins = p.bins(), plane = p.H * p.W, items = p.K * chunks * bins;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += stride) {
    const BinItem item = bin_item(i, bins, chunks);
    const int64_t channels = min(int64_t(kChannels), p.C - item.c_begin);
    const RoiBox<A> box = roi_box(boxes, item.k, p);
    if (box.image < 0) continue;
    A grad[kChannels];
    const T* g = dout + (item.k * p.C + item.c_begin) * bins + item.bin;
#pragma unroll
    for (int c = 0; c < kChannels; ++c)
      grad[c] = c < channels ? to_acc(g[c * bins]) / box.count : A(0);
    T* planes = d_input + (box.image * p.C + item.c_begin) * plane;
    for_each_bin_sample(box, item.bin, p, [&](int64_t, const AxisSample<A>& sy, int64_t,
                                              const AxisSample<A>& sx) {
      const BilinearTaps<A> t = bilinear_taps(sy, sx, p.W);
#pragma unroll
      for (int c = 0; c < kChannels; ++c) {
        if (c < channels) {
          T* v = planes + c * plane;
          atomicAdd(v + t.o1, t.w1 * grad[c]);
          atomicAdd(v + t.o2, t.w2 * grad[c]);
          atomicAdd(v + t.o3, t.w3 * grad[c]);
          atomicAdd(v + t.o4, t.w4 * grad[c]);
        }
      }
    });
  }
}

// ---- box gradient ------------------------------------------------------------------------------

// One block per box. Thread j takes the items (bin, channel chunk) j, j + kThreads, ... in order;
// the four coordinate sums are kept in double and reduced over the block in a fixed tree.
template <class T>
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
        accumulate_box_gradient<kChannels>(box, bin, dout + (k * p.C + c_begin) * bins,
                                           input + (box.image * p.C + c_begin) * plane,
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

// Row entries per box: every row its samples can touch, at most.
int64_t row_capacity(int64_t H, int64_t PH, int64_t sampling_ratio) {
  return sampling_ratio > 0 ? std::min(H, 2 * PH * sampling_ratio) : H;
}

// An upper bound of the temporary storage of CUB's onesweep radix sort of `items` 32-bit keys
// with 32-bit values over at most 32 bits, computed without a device (the handler checks it
// against CUB's own figure): per portion of up to 2^28 items, 4 passes of 256-bin histograms
// (8-byte offsets) and counters; lookback state of 256 counters per tile of at least 1024 items
// (CUB's tiles have 384 x 17 or more); 256-byte alignment of each of its 5 allocations.
int64_t cub_sort_bytes_bound(int64_t items) {
  const int64_t portions = items / (int64_t(1) << 27) + 1;
  return portions * (4 * 256 * 8 + 4 * 4) + (items / 1024 + 1) * 256 * 4 + 6 * 256;
}

constexpr int64_t kAlign = 256;

int64_t aligned_size(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Where each piece of the deterministic backward lives in the scratch buffer.
struct ScratchLayout {
  int64_t entries = 0;  // K * row capacity
  int64_t geometry = 0, keys_in = 0, keys_out = 0, values_in = 0, values_out = 0, offsets = 0,
          cub = 0, cub_bytes = 0, total = 0;
};

// The layout for N images of H rows, K boxes, PH bins and `sampling_ratio`; false if the entry
// count or the row keys do not fit the 32-bit sort.
bool scratch_layout(int64_t N, int64_t H, int64_t K, int64_t PH, int64_t sampling_ratio,
                    ScratchLayout* s) {
  const int64_t cap = row_capacity(H, PH, sampling_ratio);
  s->entries = K * cap;
  if (s->entries >= (int64_t(1) << 31) || N * H >= (int64_t(1) << 32) - 1) return false;
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t offset = at;
    at += aligned_size(bytes);
    return offset;
  };
  s->geometry = take(K * int64_t(sizeof(RoiBox<double>)));
  s->keys_in = take(s->entries * 4);
  s->keys_out = take(s->entries * 4);
  s->values_in = take(s->entries * 4);
  s->values_out = take(s->entries * 4);
  s->offsets = take((N * H + 1) * 4);
  s->cub_bytes = aligned_size(cub_sort_bytes_bound(s->entries));
  s->cub = take(s->cub_bytes);
  s->total = at;
  return true;
}

// Host query: arguments (N, H, K, PH, sampling_ratio) of the folded call; -1 if unsupported.
int64_t backward_input_scratch_query(const std::vector<int64_t>& arguments) {
  if (arguments.size() != 5) return -1;
  ScratchLayout s;
  if (!scratch_layout(arguments[0], arguments[1], arguments[2], arguments[3], arguments[4], &s))
    return -1;
  return s.total;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    roi_align_rows_kernel(const T* __restrict__ boxes, RoiAlignProblem p, int64_t cap,
                          RoiBox<acc_t<T>>* __restrict__ geometry, uint32_t* __restrict__ keys,
                          uint32_t* __restrict__ values) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  const uint32_t sentinel = uint32_t(p.N * p.H);
  for (int64_t k = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32; k < p.K; k += warps) {
    const RoiBox<A> box = roi_box_with_spans(boxes, k, p);
    if (lane == 0) geometry[k] = box;
    int64_t count = 0;
    if (box.image >= 0) {
      for (int64_t h0 = box.y.span_first; h0 <= box.y.span_last; h0 += 32) {
        const int64_t h = h0 + lane;
        const bool touched = h <= box.y.span_last && touches(box.y, h, p.H);
        const unsigned mask = __ballot_sync(0xffffffffu, touched);
        const int64_t i = count + __popc(mask & ((1u << lane) - 1u));
        if (touched && i < cap) {
          keys[k * cap + i] = uint32_t(box.image * p.H + h);
          values[k * cap + i] = uint32_t(k);
        }
        count += __popc(mask);
      }
    }
    for (int64_t i = count + lane; i < cap; i += 32) {
      keys[k * cap + i] = sentinel;
      values[k * cap + i] = uint32_t(k);
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

template <class T>
__global__ void __launch_bounds__(kThreads)
    roi_align_gather_kernel(const T* __restrict__ dout,
                            const RoiBox<acc_t<T>>* __restrict__ geometry,
                            const uint32_t* __restrict__ boxes_by_row,
                            const uint32_t* __restrict__ offsets, T* __restrict__ d_input,
                            RoiAlignProblem p, int64_t chunks) {
  using A = acc_t<T>;
  const int64_t bins = p.bins(), plane = p.H * p.W, items = p.N * chunks * plane;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < items; i += stride) {
    const int64_t cell = i % plane, rest = i / plane;
    const int64_t n = rest / chunks, c_begin = (rest % chunks) * kGatherChannels;
    const int64_t h = cell / p.W, w = cell % p.W;
    const int64_t channels = min(int64_t(kGatherChannels), p.C - c_begin);
    A acc[kGatherChannels];
#pragma unroll
    for (int c = 0; c < kGatherChannels; ++c) acc[c] = A(0);
    const int64_t row = n * p.H + h;
    for (uint32_t e = offsets[row]; e < offsets[row + 1]; ++e) {
      const int64_t k = boxes_by_row[e];
      const T* box_dout = dout + (k * p.C + c_begin) * bins;
      accumulate_cell_gradient<kGatherChannels>(geometry[k], h, w, box_dout, channels, p, acc);
    }
    T* out = d_input + (n * p.C + c_begin) * plane + cell;
#pragma unroll
    for (int c = 0; c < kGatherChannels; ++c)
      if (c < channels) out[c * plane] = from_acc<T>(acc[c]);
  }
}

// ---- handlers ----------------------------------------------------------------------------------

ffi::Error cub_error(cudaError_t status) {
  return ffi::Error::Internal(std::string("roi_align backward: CUB radix sort failed: ") +
                              cudaGetErrorString(status));
}

int64_t channel_chunks(const RoiAlignProblem& p) { return (p.C + kChannels - 1) / kChannels; }

ffi::Error roi_align_forward(cudaStream_t stream, ffi::AnyBuffer input, ffi::AnyBuffer boxes,
                             RoiAlignAttrs attrs, ffi::Result<ffi::AnyBuffer> out) {
  RoiAlignProblem p;
  if (auto err = roi_align_problem("roi_align", attrs, input, boxes, *out, &p); err.failure())
    return err;
  const int64_t items = p.K * channel_chunks(p) * p.bins();
  if (items == 0) return ffi::Error::Success();
  return dispatch_float(input.element_type(), "roi_align", [&](auto tag) {
    using T = typename decltype(tag)::type;
    roi_align_forward_kernel<T><<<grid_blocks(items, kThreads), kThreads, 0, stream>>>(
        static_cast<const T*>(input.untyped_data()), static_cast<const T*>(boxes.untyped_data()),
        static_cast<T*>(out->untyped_data()), p, channel_chunks(p));
    return launch_status("roi_align");
  });
}

ffi::Error roi_align_backward_boxes(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer input,
                                    ffi::AnyBuffer boxes, RoiAlignAttrs attrs,
                                    ffi::Result<ffi::AnyBuffer> d_boxes) {
  RoiAlignProblem p;
  if (auto err = roi_align_problem("roi_align backward", attrs, input, boxes, dout, &p);
      err.failure())
    return err;
  if (p.K == 0) return ffi::Error::Success();
  return dispatch_float(input.element_type(), "roi_align backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const unsigned blocks = unsigned(std::min<int64_t>(p.K, int64_t(1) << 30));
    roi_align_backward_boxes_kernel<T><<<blocks, kThreads, 0, stream>>>(
        static_cast<const T*>(dout.untyped_data()), static_cast<const T*>(input.untyped_data()),
        static_cast<const T*>(boxes.untyped_data()), static_cast<T*>(d_boxes->untyped_data()), p,
        channel_chunks(p));
    return launch_status("roi_align backward");
  });
}

ffi::Error roi_align_backward_input_atomic(cudaStream_t stream, ffi::AnyBuffer dout,
                                           ffi::AnyBuffer boxes, RoiAlignAttrs attrs,
                                           ffi::Result<ffi::AnyBuffer> d_input) {
  RoiAlignProblem p;
  if (auto err = roi_align_problem("roi_align backward", attrs, *d_input, boxes, dout, &p);
      err.failure())
    return err;
  if (d_input->size_bytes() == 0) return ffi::Error::Success();
  if (cudaMemsetAsync(d_input->untyped_data(), 0, d_input->size_bytes(), stream) != cudaSuccess)
    return launch_status("roi_align backward");
  const int64_t items = p.K * channel_chunks(p) * p.bins();
  if (items == 0) return ffi::Error::Success();
  return dispatch_float(dout.element_type(), "roi_align backward", [&](auto tag) -> ffi::Error {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
      roi_align_backward_input_atomic_kernel<T>
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

ffi::Error roi_align_backward_input(cudaStream_t stream, ffi::AnyBuffer dout, ffi::AnyBuffer boxes,
                                    RoiAlignAttrs attrs, ffi::Result<ffi::AnyBuffer> d_input,
                                    ffi::Result<ffi::AnyBuffer> scratch) {
  RoiAlignProblem p;
  if (auto err = roi_align_problem("roi_align backward", attrs, *d_input, boxes, dout, &p);
      err.failure())
    return err;
  if (d_input->size_bytes() == 0) return ffi::Error::Success();
  if (p.K == 0) {
    if (cudaMemsetAsync(d_input->untyped_data(), 0, d_input->size_bytes(), stream) != cudaSuccess)
      return launch_status("roi_align backward");
    return ffi::Error::Success();
  }
  ScratchLayout layout;
  if (!scratch_layout(p.N, p.H, p.K, p.PH, p.sampling_ratio, &layout))
    return ffi::Error::InvalidArgument("roi_align backward: too many row entries for the sort");
  if (int64_t(scratch->size_bytes()) < layout.total)
    return ffi::Error::InvalidArgument(
        "roi_align backward: scratch buffer smaller than the query's size");
  char* base = static_cast<char*>(scratch->untyped_data());
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(base + layout.keys_in);
  uint32_t* keys_out = reinterpret_cast<uint32_t*>(base + layout.keys_out);
  uint32_t* values_in = reinterpret_cast<uint32_t*>(base + layout.values_in);
  uint32_t* values_out = reinterpret_cast<uint32_t*>(base + layout.values_out);
  uint32_t* offsets = reinterpret_cast<uint32_t*>(base + layout.offsets);
  const int64_t rows = p.N * p.H;
  int end_bit = 1;
  while (end_bit < 32 && (int64_t(1) << end_bit) <= rows) ++end_bit;  // the sentinel `rows` fits

  return dispatch_float(dout.element_type(), "roi_align backward", [&](auto tag) -> ffi::Error {
    using T = typename decltype(tag)::type;
    using A = acc_t<T>;
    auto* geometry = reinterpret_cast<RoiBox<A>*>(base + layout.geometry);
    const int64_t cap = row_capacity(p.H, p.PH, p.sampling_ratio);
    roi_align_rows_kernel<T><<<grid_blocks(p.K * 32, kThreads), kThreads, 0, stream>>>(
        static_cast<const T*>(boxes.untyped_data()), p, cap, geometry, keys_in, values_in);
    if (auto err = launch_status("roi_align backward"); err.failure()) return err;

    cub::DoubleBuffer<uint32_t> keys(keys_in, keys_out), values(values_in, values_out);
    size_t cub_bytes = 0;
    cudaError_t status = cub::DeviceRadixSort::SortPairs(nullptr, cub_bytes, keys, values,
                                                         int(layout.entries), 0, end_bit, stream);
    if (status != cudaSuccess) return cub_error(status);
    if (int64_t(cub_bytes) > layout.cub_bytes)
      return ffi::Error::Internal("roi_align backward: CUB needs " + std::to_string(cub_bytes) +
                                  " bytes of sort scratch, above the bound of " +
                                  std::to_string(layout.cub_bytes));
    status = cub::DeviceRadixSort::SortPairs(base + layout.cub, cub_bytes, keys, values,
                                             int(layout.entries), 0, end_bit, stream);
    if (status != cudaSuccess) return cub_error(status);

    roi_align_row_offsets_kernel<<<grid_blocks(rows + 1, kThreads), kThreads, 0, stream>>>(
        keys.Current(), layout.entries, rows, offsets);
    if (auto err = launch_status("roi_align backward"); err.failure()) return err;

    const int64_t chunks = (p.C + kGatherChannels - 1) / kGatherChannels;
    const int64_t items = p.N * chunks * p.H * p.W;
    roi_align_gather_kernel<T><<<grid_blocks(items, kThreads), kThreads, 0, stream>>>(
        static_cast<const T*>(dout.untyped_data()), geometry, values.Current(), offsets,
        static_cast<T*>(d_input->untyped_data()), p, chunks);
    return launch_status("roi_align backward");
  });
}

using Stream = ffi::PlatformStream<cudaStream_t>;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignForwardCuda, roi_align_forward,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attrs<RoiAlignAttrs>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignBackwardInputCuda, roi_align_backward_input,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attrs<RoiAlignAttrs>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignBackwardInputAtomicCuda, roi_align_backward_input_atomic,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attrs<RoiAlignAttrs>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RoiAlignBackwardBoxesCuda, roi_align_backward_boxes,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attrs<RoiAlignAttrs>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

JK_REGISTER_TARGET("jk_roi_align_fwd", RoiAlignForwardCuda, "roi_align", "forward",
                   "cuda per-bin samples reused over channels", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_bwd_input", RoiAlignBackwardInputCuda, "roi_align",
                   "backward d_input", "cuda row sort (CUB) + ordered gather", "bitwise");
JK_REGISTER_TARGET("jk_roi_align_bwd_input_atomic", RoiAlignBackwardInputAtomicCuda, "roi_align",
                   "backward d_input (deterministic=False)", "cuda atomicAdd (float32/float64)",
                   "not bitwise (atomics)");
JK_REGISTER_TARGET("jk_roi_align_bwd_boxes", RoiAlignBackwardBoxesCuda, "roi_align",
                   "backward d_boxes", "cuda per-box block reduction (float64)", "bitwise");
JK_REGISTER_QUERY("roi_align_backward_input_scratch", backward_input_scratch_query);

}  // namespace jax_kernels
