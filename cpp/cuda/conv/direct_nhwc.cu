// The direct conv2d kernels of the channels-last layout (NHWC activations, HWIO weights; the
// jk_conv2d_nhwc_* targets), for the problems the tensor-core path declines (float64, grouped
// and depthwise convolutions, channel counts off the 128-bit access, geometries CUTLASS does not
// take). Interface in direct.h.
//
// Channels are the innermost axis of every tensor, so consecutive threads take consecutive
// output channels: a tap's channels are read in one coalesced go, and so are the HWIO weights
// (filters innermost).
// - Forward and dgrad: a thread per 4 consecutive output columns of a channel, the stencil of
//   conv.h (StencilAxis, StencilWeights over the HWIO strides), summed over (input channel, row
//   tap, column tap) in that order; without divisions in the tap loops where nothing is
//   upsampled (the forward and unit-stride dgrad). Depthwise rows of unit column stride load
//   each input row segment once into registers for 8 outputs and every column tap; with unit
//   row stride and 3x3, 5x5 or 7x7 taps, for a block of 4 x 8 outputs and every tap, the
//   weights in registers.
// - Wgrad: the N*P*Q reduction is cut into slices fixed by the shapes (never by the device); a
//   thread sums one weight element over one slice into the scratch buffer, and a second kernel
//   adds the slices in order. Depthwise rows (unit column stride and dilation) cut the N*P output
//   rows instead, and a thread sums a whole row of taps of one filter from register windows of
//   dy and x. No atomics: bitwise reproducible on every GPU.
// The bias gradient of both layouts is in bias_gradient.cu.
// Indices are 64-bit throughout (grid-stride loops over int64 counts).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/launch.h"
#include "common/scratch.h"
#include "common/status.h"
#include "conv/direct.h"
#include "jax_kernels/conv.h"

namespace jax_kernels {
namespace {

constexpr int kThreads = 256;

// Output columns per thread: the weights of a tap are loaded once for all of them.
constexpr int kColumns = 4;

// A thread computes kColumns consecutive output columns of one (n, y, channel). kUnit: both
// axes read the source unsampled (upsample 1: the forward, and the dgrad of unit stride), so a
// tap's sample is its position, with no division; otherwise StencilAxis::sample decides.
template <class T, bool kUnit>
__global__ void __launch_bounds__(kThreads)
    stencil_nhwc_kernel(const T* __restrict__ source, const T* __restrict__ weight,
                        const T* __restrict__ bias, T* __restrict__ out, NhwcStencil s) {
  using A = acc_t<T>;
  const int64_t channels = s.groups * s.out_per_group;
  const int64_t column_blocks = ceil_div(s.cols.out, kColumns);
  const int64_t total = s.N * s.rows.out * column_blocks * channels;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t oc = idx % channels;
    int64_t rest = idx / channels;
    const int64_t x0 = rest % column_blocks * kColumns;
    rest /= column_blocks;
    const int64_t y = rest % s.rows.out;
    const int64_t n = rest / s.rows.out;
    const int64_t g = oc / s.out_per_group, o = oc % s.out_per_group;
    const int columns = int(min(int64_t(kColumns), s.cols.out - x0));
    A sum[kColumns];
    const A start = bias != nullptr ? to_acc(bias[oc]) : A(0);
#pragma unroll
    for (int j = 0; j < kColumns; ++j) sum[j] = start;
    const T* src = source + s.source_at.at(n, g * s.in_per_group, 0, 0);
    for (int64_t i = 0; i < s.in_per_group; ++i)
      for (int64_t ty = 0; ty < s.rows.taps; ++ty) {
        const int64_t uy = s.rows.position(y, ty);
        const int64_t sy = kUnit ? (uy >= 0 && uy < s.rows.source ? uy : -1) : s.rows.sample(uy);
        if (sy < 0) continue;
        const T* src_row = src + s.source_at.at(0, i, sy, 0);
        for (int64_t tx = 0; tx < s.cols.taps; ++tx) {
          const A w = to_acc(weight[s.weights.offset(g, o, i, ty, tx)]);
#pragma unroll
          for (int j = 0; j < kColumns; ++j) {
            if (j >= columns) break;
            const int64_t ux = s.cols.position(x0 + j, tx);
            const int64_t sx =
                kUnit ? (ux >= 0 && ux < s.cols.source ? ux : -1) : s.cols.sample(ux);
            if (sx >= 0) sum[j] += w * to_acc(src_row[sx * s.source_at.d]);
          }
        }
      }
    T* dst = out + s.out_at.at(n, oc, y, x0);
#pragma unroll
    for (int j = 0; j < kColumns; ++j)
      if (j < columns) dst[j * s.out_at.d] = from_acc<T>(sum[j]);
  }
}

// Depthwise rows (one input channel per group, nothing upsampled, unit column stride and
// dilation, at most kMaxTaps column taps): a thread computes kRowColumns consecutive outputs of
// one (n, y, channel) and loads each input row segment they need once into registers (kRowColumns
// + taps - 1 values instead of kRowColumns * taps), padding included as zeros, as the NCHW tile
// kernels do. Sums over (row tap, column tap) in order.
constexpr int kRowColumns = 8;
constexpr int kMaxTaps = 9;

bool depthwise_rows(const NhwcStencil& s) {
  return s.in_per_group == 1 && s.rows.upsample == 1 && s.cols.upsample == 1 &&
         s.cols.stride == 1 && s.cols.dilation == 1 && s.cols.taps <= kMaxTaps;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    depthwise_rows_nhwc_kernel(const T* __restrict__ source, const T* __restrict__ weight,
                               const T* __restrict__ bias, T* __restrict__ out, NhwcStencil s) {
  using A = acc_t<T>;
  const int64_t channels = s.groups * s.out_per_group;
  const int64_t column_blocks = ceil_div(s.cols.out, kRowColumns);
  const int64_t total = s.N * s.rows.out * column_blocks * channels;
  const int taps = int(s.cols.taps);
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t oc = idx % channels;
    int64_t rest = idx / channels;
    const int64_t x0 = rest % column_blocks * kRowColumns;
    rest /= column_blocks;
    const int64_t y = rest % s.rows.out;
    const int64_t n = rest / s.rows.out;
    const int64_t g = oc / s.out_per_group, o = oc % s.out_per_group;
    A sum[kRowColumns];
    const A start = bias != nullptr ? to_acc(bias[oc]) : A(0);
#pragma unroll
    for (int j = 0; j < kRowColumns; ++j) sum[j] = start;
    const T* src = source + s.source_at.at(n, g, 0, 0);
    const int64_t first = s.cols.position(x0, 0);  // the segment's first source column
    for (int64_t ty = 0; ty < s.rows.taps; ++ty) {
      const int64_t sy = s.rows.position(y, ty);
      if (sy < 0 || sy >= s.rows.source) continue;
      const T* row = src + sy * s.source_at.c;
      A window[kRowColumns + kMaxTaps - 1];
#pragma unroll
      for (int k = 0; k < kRowColumns + kMaxTaps - 1; ++k) {
        const int64_t sx = first + k;
        window[k] = k < kRowColumns + taps - 1 && sx >= 0 && sx < s.cols.source
                        ? to_acc(row[sx * s.source_at.d])
                        : A(0);
      }
#pragma unroll
      for (int tx = 0; tx < kMaxTaps; ++tx) {
        if (tx >= taps) break;
        const A w = to_acc(weight[s.weights.offset(g, o, 0, ty, tx)]);
#pragma unroll
        for (int j = 0; j < kRowColumns; ++j) sum[j] += w * window[j + tx];
      }
    }
    const int columns = int(min(int64_t(kRowColumns), s.cols.out - x0));
    T* dst = out + s.out_at.at(n, oc, y, x0);
#pragma unroll
    for (int j = 0; j < kRowColumns; ++j)
      if (j < columns) dst[j * s.out_at.d] = from_acc<T>(sum[j]);
  }
}

// Depthwise blocks: depthwise rows with unit row stride and dilation too, and kTaps x kTaps taps
// (3, 5 or 7; not float64, whose registers would spill). A thread computes kBlockRows x
// kRowColumns outputs of one (n, channel) with the channel's weights in registers, and loads each
// input row segment once for every output row of the block that reads it: kBlockRows + kTaps - 1
// segments instead of kBlockRows * kTaps. The sums are the rows kernel's, in its order (row tap,
// then column tap), so both give the same bits.
constexpr int kBlockRows = 4;

int depthwise_block_taps(const NhwcStencil& s) {
  const bool square = s.rows.taps == s.cols.taps;
  return depthwise_rows(s) && s.rows.stride == 1 && s.rows.dilation == 1 && square &&
                 (s.cols.taps == 3 || s.cols.taps == 5 || s.cols.taps == 7)
             ? int(s.cols.taps)
             : 0;
}

template <class T, int kTaps>
__global__ void __launch_bounds__(kThreads)
    depthwise_block_nhwc_kernel(const T* __restrict__ source, const T* __restrict__ weight,
                                const T* __restrict__ bias, T* __restrict__ out, NhwcStencil s) {
  using A = acc_t<T>;
  const int64_t channels = s.groups * s.out_per_group;
  const int64_t column_blocks = ceil_div(s.cols.out, kRowColumns);
  const int64_t row_blocks = ceil_div(s.rows.out, kBlockRows);
  const int64_t total = s.N * row_blocks * column_blocks * channels;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t oc = idx % channels;
    int64_t rest = idx / channels;
    const int64_t x0 = rest % column_blocks * kRowColumns;
    rest /= column_blocks;
    const int64_t y0 = rest % row_blocks * kBlockRows;
    const int64_t n = rest / row_blocks;
    const int64_t g = oc / s.out_per_group, o = oc % s.out_per_group;
    A w[kTaps][kTaps];
#pragma unroll
    for (int r = 0; r < kTaps; ++r)
#pragma unroll
      for (int t = 0; t < kTaps; ++t) w[r][t] = to_acc(weight[s.weights.offset(g, o, 0, r, t)]);
    A sum[kBlockRows][kRowColumns];
    const A start = bias != nullptr ? to_acc(bias[oc]) : A(0);
#pragma unroll
    for (int j = 0; j < kBlockRows; ++j)
#pragma unroll
      for (int x = 0; x < kRowColumns; ++x) sum[j][x] = start;
    const T* src = source + s.source_at.at(n, g, 0, 0);
    const int64_t first_row = s.rows.position(y0, 0), first_col = s.cols.position(x0, 0);
#pragma unroll
    for (int u = 0; u < kBlockRows + kTaps - 1; ++u) {
      const int64_t sy = first_row + u;
      if (sy < 0 || sy >= s.rows.source) continue;
      const T* row = src + sy * s.source_at.c;
      A window[kRowColumns + kTaps - 1];
#pragma unroll
      for (int k = 0; k < kRowColumns + kTaps - 1; ++k) {
        const int64_t sx = first_col + k;
        window[k] = sx >= 0 && sx < s.cols.source ? to_acc(row[sx * s.source_at.d]) : A(0);
      }
#pragma unroll
      for (int j = 0; j < kBlockRows; ++j) {
        const int r = u - j;  // output row y0 + j reads this segment at row tap r
        if (r < 0 || r >= kTaps) continue;
#pragma unroll
        for (int t = 0; t < kTaps; ++t)
#pragma unroll
          for (int x = 0; x < kRowColumns; ++x) sum[j][x] += w[r][t] * window[x + t];
      }
    }
    const int columns = int(min(int64_t(kRowColumns), s.cols.out - x0));
#pragma unroll
    for (int j = 0; j < kBlockRows; ++j) {
      if (y0 + j >= s.rows.out) break;
      T* dst = out + s.out_at.at(n, oc, y0 + j, x0);
#pragma unroll
      for (int x = 0; x < kRowColumns; ++x)
        if (x < columns) dst[x * s.out_at.d] = from_acc<T>(sum[j][x]);
    }
  }
}

template <class T, int kTaps>
void launch_depthwise_block(cudaStream_t stream, const T* source, const T* weight,
                            const T* bias, T* out, const NhwcStencil& s) {
  const int64_t items = s.N * ceil_div(s.rows.out, kBlockRows) *
                        ceil_div(s.cols.out, kRowColumns) * s.groups * s.out_per_group;
  depthwise_block_nhwc_kernel<T, kTaps><<<grid_blocks(items, kThreads), kThreads, 0, stream>>>(
      source, weight, bias, out, s);
}

// Depthwise rows of the wgrad (one input channel per group, unit column stride and dilation, at
// most kMaxTaps column taps): see wgrad_rows_nhwc_kernel.
bool depthwise_rows_wgrad(const ConvProblem& p) {
  return p.channels_per_group() == 1 && p.stride_w == 1 && p.dilation_w == 1 &&
         p.S <= kMaxTaps;
}

// The slices of the wgrad reduction, fixed by the shapes (never by the device). The general
// kernel cuts the N*P*Q output positions (`positions`) into slices of at least 64, about 2^20
// threads in all; the depthwise rows kernel cuts the N*P output rows into slices of at least 2
// rows, about 2^18 threads (a thread per (slice, tap row, filter)). Both keep at most 2^24
// partial sums (bounds the scratch): partial[slice][e], e the HWIO weight element. weights or
// positions is -1 (and slices 0) when it cannot be represented (only the scratch query sees such
// a problem).
struct WgradSlices {
  int64_t weights, positions, per_slice, slices;
  bool rows;  // the depthwise rows kernel: positions are output rows (n, y)
};

WgradSlices wgrad_slices(const ConvProblem& p) {
  WgradSlices w{};
  w.weights = checked_product({p.K, p.channels_per_group(), p.R, p.S});
  w.rows = depthwise_rows_wgrad(p);
  w.positions = w.rows ? checked_mul(p.N, p.P) : checked_product({p.N, p.P, p.Q});
  if (w.weights <= 0 || w.positions <= 0 || p.Q <= 0) return w;
  const int64_t threads_per_slice = w.rows ? p.R * p.K : w.weights;
  int64_t slices = std::max<int64_t>(1, (int64_t(1) << (w.rows ? 18 : 20)) / threads_per_slice);
  slices = std::min(slices, std::max<int64_t>(1, ceil_div(w.positions, w.rows ? 2 : 64)));
  slices = std::min(slices, std::max<int64_t>(1, (int64_t(1) << 24) / w.weights));
  w.per_slice = ceil_div(w.positions, slices);
  w.slices = ceil_div(w.positions, w.per_slice);
  return w;
}

// partial[slice][e] for weight element e = ((r * S + s) * Cg + c) * K + k (filters innermost).
template <class T>
__global__ void __launch_bounds__(kThreads)
    wgrad_nhwc_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                              acc_t<T>* __restrict__ partial, ConvProblem p, WgradSlices w) {
  using A = acc_t<T>;
  const TensorStrides xs = p.input_strides(), ys = p.output_strides();
  const int64_t Cg = p.channels_per_group(), Kg = p.filters_per_group();
  const int64_t total = w.slices * w.weights;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = idx % w.weights, slice = idx / w.weights;
    const int64_t k = e % p.K;
    int64_t rest = e / p.K;
    const int64_t c = rest % Cg;
    rest /= Cg;
    const int64_t s = rest % p.S, r = rest / p.S;
    const int64_t channel = (k / Kg) * Cg + c;
    const int64_t first = slice * w.per_slice;
    const int64_t last = std::min(first + w.per_slice, w.positions);
    A sum = A(0);
    // Walk the positions (n, row, q) of the slice with counters (no division per position).
    int64_t q = first % p.Q, row = first / p.Q % p.P, n = first / (p.P * p.Q);
    const T* dy_k = dy + k * ys.b;
    const T* x_c = x + channel * xs.b;
    for (int64_t pos = first; pos < last; ++pos) {
      const int64_t iy = p.input_row(row, r), ix = p.input_col(q, s);
      if (iy >= 0 && iy < p.H && ix >= 0 && ix < p.W)
        sum += to_acc(dy_k[n * ys.a + row * ys.c + q * ys.d]) *
               to_acc(x_c[n * xs.a + iy * xs.c + ix * xs.d]);
      if (++q == p.Q) {
        q = 0;
        if (++row == p.P) row = 0, ++n;
      }
    }
    partial[idx] = sum;
  }
}

// Thread (slice, r, k) sums row r of filter k's taps, dw[r, s, 0, k] for every s, over the
// output rows (n, y) of its slice: for kWgradColumns consecutive outputs at a time it loads their
// dy values and the input row segment they meet (kWgradColumns + S - 1 values, zeros outside)
// once into registers and adds every column tap's products (S * kWgradColumns products for
// 2 * kWgradColumns + S - 1 loads). Consecutive threads take consecutive
// filters, so every load of a warp is one run of channels. Sums over the slice's rows, then
// column blocks, then columns, in order.
constexpr int kWgradColumns = 16;

template <class T>
__global__ void __launch_bounds__(kThreads)
    wgrad_rows_nhwc_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                           acc_t<T>* __restrict__ partial, ConvProblem p, WgradSlices w) {
  using A = acc_t<T>;
  const TensorStrides xs = p.input_strides(), ys = p.output_strides();
  const int64_t Kg = p.filters_per_group();
  const int taps = int(p.S);
  const int64_t total = w.slices * p.R * p.K;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k = idx % p.K;
    const int64_t r = idx / p.K % p.R;
    const int64_t slice = idx / (p.K * p.R);
    const int64_t first = slice * w.per_slice;
    const int64_t last = std::min(first + w.per_slice, w.positions);
    A sum[kMaxTaps];
#pragma unroll
    for (int t = 0; t < kMaxTaps; ++t) sum[t] = A(0);
    const T* dy_k = dy + k * ys.b;
    const T* x_g = x + (k / Kg) * xs.b;
    for (int64_t row = first; row < last; ++row) {
      const int64_t n = row / p.P, y = row % p.P;
      const int64_t iy = p.input_row(y, r);
      if (iy < 0 || iy >= p.H) continue;
      const T* dy_row = dy_k + n * ys.a + y * ys.c;
      const T* x_row = x_g + n * xs.a + iy * xs.c;
      for (int64_t q0 = 0; q0 < p.Q; q0 += kWgradColumns) {
        A grad[kWgradColumns];
#pragma unroll
        for (int j = 0; j < kWgradColumns; ++j)
          grad[j] = q0 + j < p.Q ? to_acc(dy_row[(q0 + j) * ys.d]) : A(0);
        const int64_t ix0 = p.input_col(q0, 0);  // the segment's first input column
        A window[kWgradColumns + kMaxTaps - 1];
#pragma unroll
        for (int j = 0; j < kWgradColumns + kMaxTaps - 1; ++j) {
          const int64_t ix = ix0 + j;
          window[j] = j < kWgradColumns + taps - 1 && ix >= 0 && ix < p.W
                          ? to_acc(x_row[ix * xs.d])
                          : A(0);
        }
#pragma unroll
        for (int t = 0; t < kMaxTaps; ++t) {
          if (t >= taps) break;
#pragma unroll
          for (int j = 0; j < kWgradColumns; ++j) sum[t] += grad[j] * window[j + t];
        }
      }
    }
    // HWIO element (r, t, 0, k): ((r * S + t) * Cg + 0) * K + k with Cg = 1.
    acc_t<T>* out = partial + slice * w.weights + r * p.S * p.K + k;
#pragma unroll
    for (int t = 0; t < kMaxTaps; ++t)
      if (t < taps) out[t * p.K] = sum[t];
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    wgrad_nhwc_reduce_kernel(const acc_t<T>* __restrict__ partial, T* __restrict__ dw,
                             ConvProblem p, WgradSlices w) {
  using A = acc_t<T>;
  const TensorStrides ws = p.filter_strides();
  const int64_t Cg = p.channels_per_group();
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < w.weights;
       e += int64_t(gridDim.x) * blockDim.x) {
    A sum = w.slices > 0 ? partial[e] : A(0);
    for (int64_t slice = 1; slice < w.slices; ++slice) sum += partial[slice * w.weights + e];
    const int64_t k = e % p.K;
    int64_t rest = e / p.K;
    const int64_t c = rest % Cg;
    rest /= Cg;
    const int64_t s = rest % p.S, r = rest / p.S;
    dw[ws.at(k, c, r, s)] = from_acc<T>(sum);
  }
}

}  // namespace

NhwcStencil forward_nhwc(const ConvProblem& p) {
  NhwcStencil s{};
  s.rows = forward_rows(p);
  s.cols = forward_cols(p);
  s.weights = forward_weights(p);
  s.source_at = p.input_strides();
  s.out_at = p.output_strides();
  s.N = p.N;
  s.groups = p.groups;
  s.in_per_group = p.channels_per_group();
  s.out_per_group = p.filters_per_group();
  return s;
}

NhwcStencil backward_data_nhwc(const ConvProblem& p) {
  NhwcStencil s{};
  s.rows = backward_data_rows(p);
  s.cols = backward_data_cols(p);
  s.weights = backward_data_weights(p);
  s.source_at = p.output_strides();
  s.out_at = p.input_strides();
  s.N = p.N;
  s.groups = p.groups;
  s.in_per_group = p.filters_per_group();
  s.out_per_group = p.channels_per_group();
  return s;
}

template <class T>
ffi::Error run_stencil_nhwc(cudaStream_t stream, const char* op, const T* source, const T* weight,
                            const T* bias, T* out, const NhwcStencil& s) {
  if (s.N * s.rows.out * s.cols.out * s.groups * s.out_per_group == 0)
    return ffi::Error::Success();
  if constexpr (!std::is_same_v<T, double>) {
    switch (depthwise_block_taps(s)) {
      case 3: launch_depthwise_block<T, 3>(stream, source, weight, bias, out, s); return launch_status(op);
      case 5: launch_depthwise_block<T, 5>(stream, source, weight, bias, out, s); return launch_status(op);
      case 7: launch_depthwise_block<T, 7>(stream, source, weight, bias, out, s); return launch_status(op);
      default: break;
    }
  }
  if (depthwise_rows(s)) {
    const int64_t items =
        s.N * s.rows.out * ceil_div(s.cols.out, kRowColumns) * s.groups * s.out_per_group;
    depthwise_rows_nhwc_kernel<T><<<grid_blocks(items, kThreads), kThreads, 0, stream>>>(
        source, weight, bias, out, s);
    return launch_status(op);
  }
  const int64_t total =
      s.N * s.rows.out * ceil_div(s.cols.out, kColumns) * s.groups * s.out_per_group;
  const unsigned blocks = grid_blocks(total, kThreads);
  if (s.rows.upsample == 1 && s.cols.upsample == 1)
    stencil_nhwc_kernel<T, true><<<blocks, kThreads, 0, stream>>>(source, weight, bias, out, s);
  else
    stencil_nhwc_kernel<T, false><<<blocks, kThreads, 0, stream>>>(source, weight, bias, out, s);
  return launch_status(op);
}

template <class T>
int64_t wgrad_nhwc_scratch_bytes(const ConvProblem& p) {
  const WgradSlices w = wgrad_slices(p);
  if (w.weights < 0 || w.positions < 0) return -1;
  ScratchLayout layout;
  layout.take(checked_product({w.slices, w.weights, int64_t(sizeof(acc_t<T>))}));
  return layout.total();
}

template <class T>
ffi::Error run_wgrad_nhwc(cudaStream_t stream, const T* dy, const T* x, T* dw,
                          const ConvProblem& p, void* scratch, int64_t scratch_bytes) {
  const WgradSlices w = wgrad_slices(p);
  if (w.weights == 0) return ffi::Error::Success();
  if (w.slices == 0) {  // no output positions: dw is zero (reads no partials)
    wgrad_nhwc_reduce_kernel<T><<<grid_blocks(w.weights, kThreads), kThreads, 0, stream>>>(
        nullptr, dw, p, w);
    return launch_status("conv2d wgrad");
  }
  const int64_t needed = wgrad_nhwc_scratch_bytes<T>(p);
  if (needed < 0 || scratch_bytes < needed || scratch == nullptr)
    return ffi::Error::InvalidArgument("conv2d wgrad: scratch buffer too small");
  auto* partial = reinterpret_cast<acc_t<T>*>(aligned_scratch(scratch));
  if (w.rows)
    wgrad_rows_nhwc_kernel<T><<<grid_blocks(w.slices * p.R * p.K, kThreads), kThreads, 0,
                                stream>>>(dy, x, partial, p, w);
  else
    wgrad_nhwc_partial_kernel<T><<<grid_blocks(w.slices * w.weights, kThreads), kThreads, 0,
                                   stream>>>(dy, x, partial, p, w);
  if (ffi::Error e = launch_status("conv2d wgrad"); e.failure()) return e;
  wgrad_nhwc_reduce_kernel<T><<<grid_blocks(w.weights, kThreads), kThreads, 0, stream>>>(
      partial, dw, p, w);
  return launch_status("conv2d wgrad (reduction)");
}


#define JK_INSTANTIATE(T)                                                                       \
  template ffi::Error run_stencil_nhwc<T>(cudaStream_t, const char*, const T*, const T*,        \
                                          const T*, T*, const NhwcStencil&);                    \
  template int64_t wgrad_nhwc_scratch_bytes<T>(const ConvProblem&);                             \
  template ffi::Error run_wgrad_nhwc<T>(cudaStream_t, const T*, const T*, T*, const ConvProblem&, \
                                        void*, int64_t);
JK_INSTANTIATE(float16)
JK_INSTANTIATE(bfloat16)
JK_INSTANTIATE(float)
JK_INSTANTIATE(double)
#undef JK_INSTANTIATE

}  // namespace jax_kernels
