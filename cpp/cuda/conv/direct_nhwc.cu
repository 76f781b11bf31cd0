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
//   weights in registers; in half types with one filter per channel, for a block of 4 x 4
//   outputs of two channels (4-byte channel pairs: 128 bytes per warp load).
// - Wgrad: the N*P*Q reduction is cut into slices fixed by the shapes (never by the device); a
//   thread sums one weight element over one slice into the scratch buffer, and a second kernel
//   adds the slices in order. Depthwise rows (unit column stride and dilation) cut the N*P output
//   rows instead, and a thread sums a whole row of taps of one filter from register windows of
//   dy and x; in half types with one filter per channel, unit strides and square 3x3/5x5/7x7
//   taps, a thread takes a channel pair and 4 output columns and walks the input rows once,
//   every tap's products from a register window of dy rows (wgrad_pairs_nhwc_kernel). The slices
//   are added in a fixed order (slice_sum.cuh). No atomics: bitwise reproducible on every
//   GPU.
// The bias gradient of both layouts is in bias_gradient.cu.
// Indices are 64-bit throughout (grid-stride loops over int64 counts).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/launch.h"
#include "common/scratch.h"
#include "common/status.h"
#include "conv/direct.h"
#include "conv/slice_sum.cuh"
#include "conv/tile_staging.cuh"
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

// Channel pairs (float16/bfloat16 depthwise blocks with one filter per channel and an even channel
// count): a thread computes the same block as depthwise_block_nhwc_kernel, kBlockRows x
// kPairColumns outputs, for two adjacent channels, and loads each source position and weight as
// one 4-byte pair: a warp reads 128 contiguous bytes per load instead of 64, and half the loads.
// The columns' bounds are tested once (a mask) and a row's pairs are reached by pointer steps,
// the next source row's pairs loaded before the current row's products. The sums are the block
// kernel's, in its order, so both give the same bits (but for the payload of NaNs: the pair is
// rounded by one cvt.rn.*x2, round_pair).
constexpr int kPairColumns = 4;
constexpr int kPairThreads = 128;

template <class T>
__device__ __forceinline__ void unpack_pair(uint32_t u, float& lo, float& hi) {
  lo = to_acc(T{uint16_t(u & 0xffffu)});
  hi = to_acc(T{uint16_t(u >> 16)});
}

template <class T>
__device__ __forceinline__ uint32_t load_pair(const T* p) {
  return __ldg(reinterpret_cast<const unsigned int*>(p));
}

// Pairs apply to depthwise blocks of half types with one filter per channel, an even number of
// channels, channels innermost and each channel pair's weights adjacent (HWIO: every pair is
// 4-byte aligned).
template <class T>
bool depthwise_pairs(const NhwcStencil& s) {
  return is_half_type<T>() && depthwise_block_taps(s) != 0 && s.in_per_group == 1 &&
         s.out_per_group == 1 && s.groups % 2 == 0 && s.source_at.b == 1 && s.out_at.b == 1 &&
         s.weights.group == 1 && s.weights.origin % 2 == 0;
}

template <class T, int kTaps>
__global__ void __launch_bounds__(kPairThreads)
    depthwise_pairs_nhwc_kernel(const T* __restrict__ source, const T* __restrict__ weight,
                                const T* __restrict__ bias, T* __restrict__ out, NhwcStencil s) {
  constexpr int kSpan = kPairColumns + kTaps - 1;
  constexpr int kSourceRows = kBlockRows + kTaps - 1;
  const int64_t pairs = s.groups / 2;
  const int64_t column_blocks = ceil_div(s.cols.out, kPairColumns);
  const int64_t row_blocks = ceil_div(s.rows.out, kBlockRows);
  const int64_t total = s.N * row_blocks * column_blocks * pairs;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c0 = idx % pairs * 2;
    int64_t rest = idx / pairs;
    const int64_t x0 = rest % column_blocks * kPairColumns;
    rest /= column_blocks;
    const int64_t y0 = rest % row_blocks * kBlockRows;
    const int64_t n = rest / row_blocks;
    float w[kTaps][kTaps][2];
    const T* w_row = weight + s.weights.offset(c0, 0, 0, 0, 0);
#pragma unroll
    for (int r = 0; r < kTaps; ++r, w_row += s.weights.row) {
      const T* w_tap = w_row;
#pragma unroll
      for (int t = 0; t < kTaps; ++t, w_tap += s.weights.col)
        unpack_pair<T>(load_pair(w_tap), w[r][t][0], w[r][t][1]);
    }
    float sum[kBlockRows][kPairColumns][2];
    const float start0 = bias != nullptr ? to_acc(bias[c0]) : 0.f;
    const float start1 = bias != nullptr ? to_acc(bias[c0 + 1]) : 0.f;
#pragma unroll
    for (int j = 0; j < kBlockRows; ++j)
#pragma unroll
      for (int x = 0; x < kPairColumns; ++x) sum[j][x][0] = start0, sum[j][x][1] = start1;
    const int64_t first_row = s.rows.position(y0, 0), first_col = s.cols.position(x0, 0);
    uint32_t columns_in = 0;  // bit k: source column first_col + k lies inside
#pragma unroll
    for (int k = 0; k < kSpan; ++k)
      columns_in |= uint32_t(first_col + k >= 0 && first_col + k < s.cols.source) << k;
    const T* segment = source + s.source_at.at(n, c0, 0, 0) + first_col * s.source_at.d;
    // The pairs of source row u of the block (zeros outside the source).
    const auto load_row = [&](int u, uint32_t(&raw)[kSpan]) {
      const int64_t sy = first_row + u;
      const bool live = sy >= 0 && sy < s.rows.source;
      const T* at = segment + sy * s.source_at.c;
#pragma unroll
      for (int k = 0; k < kSpan; ++k, at += s.source_at.d)
        raw[k] = live && (columns_in >> k & 1u) ? load_pair(at) : 0u;
    };
    uint32_t next[kSpan];
    load_row(0, next);
#pragma unroll
    for (int u = 0; u < kSourceRows; ++u) {
      float window[kSpan][2];
#pragma unroll
      for (int k = 0; k < kSpan; ++k) unpack_pair<T>(next[k], window[k][0], window[k][1]);
      if (u + 1 < kSourceRows) load_row(u + 1, next);
      const int64_t sy = first_row + u;
      if (sy < 0 || sy >= s.rows.source) continue;  // as the block kernel: no products
#pragma unroll
      for (int j = 0; j < kBlockRows; ++j) {
        const int r = u - j;  // output row y0 + j reads this row at row tap r
        if (r < 0 || r >= kTaps) continue;
#pragma unroll
        for (int t = 0; t < kTaps; ++t)
#pragma unroll
          for (int x = 0; x < kPairColumns; ++x) {
            sum[j][x][0] += w[r][t][0] * window[x + t][0];
            sum[j][x][1] += w[r][t][1] * window[x + t][1];
          }
      }
    }
    const int columns = int(min(int64_t(kPairColumns), s.cols.out - x0));
#pragma unroll
    for (int j = 0; j < kBlockRows; ++j) {
      if (y0 + j >= s.rows.out) break;
      T* dst = out + s.out_at.at(n, c0, y0 + j, x0);
#pragma unroll
      for (int x = 0; x < kPairColumns; ++x)
        if (x < columns)
          *reinterpret_cast<uint32_t*>(dst + x * s.out_at.d) =
              round_pair<T>(sum[j][x][0], sum[j][x][1]);
    }
  }
}

template <class T, int kTaps>
void launch_depthwise_pairs(cudaStream_t stream, const T* source, const T* weight, const T* bias,
                            T* out, const NhwcStencil& s) {
  const int64_t items = s.N * ceil_div(s.rows.out, kBlockRows) *
                        ceil_div(s.cols.out, kPairColumns) * (s.groups / 2);
  depthwise_pairs_nhwc_kernel<T, kTaps>
      <<<grid_blocks(items, kPairThreads), kPairThreads, 0, stream>>>(source, weight, bias, out, s);
}

// Depthwise rows of the wgrad (one input channel per group, unit column stride and dilation, at
// most kMaxTaps column taps): see wgrad_rows_nhwc_kernel.
bool depthwise_rows_wgrad(const ConvProblem& p) {
  return p.channels_per_group() == 1 && p.stride_w == 1 && p.dilation_w == 1 &&
         p.S <= kMaxTaps;
}

// Channel-pair wgrad: depthwise convolutions of half types with one filter per channel, an even
// channel count, unit strides and dilations and kTaps x kTaps taps (3, 5, 7). A block is 32
// lanes of channel pairs (consecutive pairs: a warp's loads are 128 contiguous bytes) x
// kPairWarps warps, each a chunk of kPairColumns output columns; it walks the rows of its slice
// (images [n0, n1), output rows [y0, y1), kPairWarps chunks) input row by input row. At input row
// iy, the thread holds the dy rows iy + pad - r of its chunk for every row tap r (a window of
// kTaps rows, zeros outside the slice) and the x row segment they meet, and adds all kTaps x
// kTaps x kPairColumns products per channel: 2 * kTaps^2 * kPairColumns products per
// kPairColumns + kTaps - 1 + kPairColumns 4-byte loads, the next row's loads issued before the
// products, the columns' bounds tested once (masks). The block then adds its warps' sums in warp
// order (shared memory) and writes one partial per weight element and slice; slice_sum.cuh
// adds the slices in order. Each weight's terms: images, then rows, then columns, in order.
constexpr int kPairWarps = 4;
constexpr int kPairSliceRows = 8;           // rows cut only down to this many per slice
constexpr int64_t kPairTargetBlocks = 512;  // row slices are cut until this many blocks

struct PairWgrad {
  int64_t pairs, pair_groups, chunk_groups;
  int64_t row_slices, rows_per_slice, image_groups, images_per_slice;
  int64_t blocks;  // slices * pair_groups
};

template <class T>
bool pair_wgrad_applies(const ConvProblem& p) {
  return is_half_type<T>() && p.channels_per_group() == 1 && p.filters_per_group() == 1 &&
         p.K % 2 == 0 && p.stride_h == 1 && p.stride_w == 1 && p.dilation_h == 1 &&
         p.dilation_w == 1 && p.R == p.S && (p.R == 3 || p.R == 5 || p.R == 7) &&
         p.layout == ConvLayout::kNHWC;
}

// The slices: images x row slices x column chunk groups, fixed by the shapes. Row slices are cut
// until kPairTargetBlocks blocks (down to kPairSliceRows rows); images are folded into slices
// when the partials would pass 2^24 floats (a block then walks several images).
PairWgrad pair_wgrad_plan(const ConvProblem& p, int64_t weights) {
  PairWgrad w{};
  w.pairs = p.K / 2;
  w.pair_groups = ceil_div(w.pairs, 32);
  w.chunk_groups = ceil_div(p.Q, int64_t(kPairColumns * kPairWarps));
  const int64_t base = p.N * w.pair_groups * w.chunk_groups;
  w.row_slices = std::min(std::max<int64_t>(1, ceil_div(kPairTargetBlocks, base)),
                          std::max<int64_t>(1, p.P / kPairSliceRows));
  w.rows_per_slice = ceil_div(p.P, w.row_slices);
  w.row_slices = ceil_div(p.P, w.rows_per_slice);
  const int64_t per_image = w.row_slices * w.chunk_groups;
  const int64_t groups =
      std::max<int64_t>(1, ((int64_t(1) << 24) / std::max<int64_t>(1, weights)) / per_image);
  w.images_per_slice = ceil_div(p.N, std::min(p.N, groups));
  w.image_groups = ceil_div(p.N, w.images_per_slice);
  w.blocks = w.image_groups * per_image * w.pair_groups;
  return w;
}

template <class T, int kTaps>
__global__ void __launch_bounds__(kPairWarps * 32)
    wgrad_pairs_nhwc_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                            float* __restrict__ partial, ConvProblem p, PairWgrad w) {
  constexpr int kSpan = kPairColumns + kTaps - 1;
  __shared__ float staged[kPairWarps][kTaps][64];
  const int lane = int(threadIdx.x % 32), warp = int(threadIdx.x / 32);
  const TensorStrides xs = p.input_strides(), ys = p.output_strides();
  const int64_t weights = p.R * p.S * p.K;
  for (int64_t b = blockIdx.x; b < w.blocks; b += gridDim.x) {  // uniform over the block
    const int64_t pair_group = b % w.pair_groups;
    const int64_t slice = b / w.pair_groups;
    const int64_t chunk_group = slice % w.chunk_groups;
    const int64_t row_slice = slice / w.chunk_groups % w.row_slices;
    const int64_t image_group = slice / (w.chunk_groups * w.row_slices);
    const int64_t pair = pair_group * 32 + lane;
    const bool live = pair < w.pairs;
    const int64_t c0 = 2 * pair;
    const int64_t q0 = (chunk_group * kPairWarps + warp) * kPairColumns;
    const int64_t y0 = row_slice * w.rows_per_slice;
    const int64_t y1 = std::min(y0 + w.rows_per_slice, p.P);
    const int64_t n0 = image_group * w.images_per_slice;
    const int64_t n1 = std::min(n0 + w.images_per_slice, p.N);
    // Bit k: x column q0 - pad_left + k (dy column q0 + k) lies inside, for a live lane.
    uint32_t x_cols = 0, dy_cols = 0;
#pragma unroll
    for (int k = 0; k < kSpan; ++k) {
      const int64_t ix = p.input_col(q0, 0) + k;
      x_cols |= uint32_t(live && ix >= 0 && ix < p.W) << k;
    }
#pragma unroll
    for (int k = 0; k < kPairColumns; ++k) dy_cols |= uint32_t(live && q0 + k < p.Q) << k;
    float acc[kTaps][kTaps][2];
#pragma unroll
    for (int r = 0; r < kTaps; ++r)
#pragma unroll
      for (int s = 0; s < kTaps; ++s) acc[r][s][0] = acc[r][s][1] = 0.f;
    const int64_t steps = (y1 - y0) + kTaps - 1;  // input rows y0 - pad .. y1 - 1 - pad + R - 1
    for (int64_t n = n0; n < n1; ++n) {
      const T* x_segment = x + n * xs.a + c0 + p.input_col(q0, 0) * xs.d;
      const T* dy_segment = dy + n * ys.a + c0 + q0 * ys.d;
      // The pairs of step i: x row y0 - pad + i and dy row y0 + i, zeros outside the tensors
      // and the slice.
      const auto load_step = [&](int64_t i, uint32_t(&raw_x)[kSpan],
                                 uint32_t(&raw_dy)[kPairColumns]) {
        const int64_t iy = p.input_row(y0 + i, 0), y = y0 + i;
        const bool x_live = iy >= 0 && iy < p.H, dy_live = y < y1;
        const T* at = x_segment + iy * xs.c;
#pragma unroll
        for (int k = 0; k < kSpan; ++k, at += xs.d)
          raw_x[k] = x_live && (x_cols >> k & 1u) ? load_pair(at) : 0u;
        at = dy_segment + y * ys.c;
#pragma unroll
        for (int k = 0; k < kPairColumns; ++k, at += ys.d)
          raw_dy[k] = dy_live && (dy_cols >> k & 1u) ? load_pair(at) : 0u;
      };
      float window[kTaps][kPairColumns][2];  // slot i % kTaps: dy row y0 + i
#pragma unroll
      for (int r = 0; r < kTaps; ++r)
#pragma unroll
        for (int k = 0; k < kPairColumns; ++k) window[r][k][0] = window[r][k][1] = 0.f;
      uint32_t raw_x[kSpan], raw_dy[kPairColumns];
      load_step(0, raw_x, raw_dy);
      for (int64_t step = 0; step < steps; step += kTaps) {
#pragma unroll
        for (int phase = 0; phase < kTaps; ++phase) {
          const int64_t i = step + phase;
          if (i >= steps) break;
          float xv[kSpan][2];
#pragma unroll
          for (int k = 0; k < kSpan; ++k) unpack_pair<T>(raw_x[k], xv[k][0], xv[k][1]);
#pragma unroll
          for (int k = 0; k < kPairColumns; ++k)
            unpack_pair<T>(raw_dy[k], window[phase][k][0], window[phase][k][1]);
          if (i + 1 < steps) load_step(i + 1, raw_x, raw_dy);
          // Row tap r pairs this x row with dy row y0 + i - r, in slot (phase - r) mod kTaps.
#pragma unroll
          for (int r = 0; r < kTaps; ++r) {
            const int slot = (phase - r + kTaps) % kTaps;
#pragma unroll
            for (int s = 0; s < kTaps; ++s)
#pragma unroll
              for (int k = 0; k < kPairColumns; ++k) {
                acc[r][s][0] += window[slot][k][0] * xv[k + s][0];
                acc[r][s][1] += window[slot][k][1] * xv[k + s][1];
              }
          }
        }
      }
    }
    // Add the warps' sums in warp order, one row tap at a time; write partial[slice][e], e =
    // (r * S + s) * K + k (HWIO).
    float* out = partial + slice * weights + pair_group * 64;
    const int64_t channels = std::min<int64_t>(64, p.K - pair_group * 64);
#pragma unroll
    for (int r = 0; r < kTaps; ++r) {
#pragma unroll
      for (int s = 0; s < kTaps; ++s) {
        staged[warp][s][2 * lane] = acc[r][s][0];
        staged[warp][s][2 * lane + 1] = acc[r][s][1];
      }
      __syncthreads();
      for (int item = int(threadIdx.x); item < kTaps * 64; item += kPairWarps * 32) {
        const int s = item / 64, c = item % 64;
        if (c >= channels) continue;
        float sum = staged[0][s][c];
#pragma unroll
        for (int v = 1; v < kPairWarps; ++v) sum += staged[v][s][c];
        out[(r * kTaps + s) * p.K + c] = sum;
      }
      __syncthreads();
    }
  }
}

template <class T, int kTaps>
void launch_wgrad_pairs(cudaStream_t stream, const T* dy, const T* x, float* partial,
                        const ConvProblem& p, const PairWgrad& w) {
  const unsigned blocks = unsigned(std::min<int64_t>(w.blocks, 0x7fffffff));
  wgrad_pairs_nhwc_kernel<T, kTaps><<<blocks, kPairWarps * 32, 0, stream>>>(dy, x, partial, p, w);
}

// The slices of the wgrad reduction, fixed by the shapes (never by the device). The general
// kernel cuts the N*P*Q output positions (`positions`) into slices of at least 64, about 2^20
// threads in all; the depthwise rows kernel cuts the N*P output rows into slices of at least 2
// rows, about 2^18 threads (a thread per (slice, tap row, filter)); the channel-pair kernel as
// pair_wgrad_plan says. All keep at most 2^24 partial sums (bounds the scratch) where the weights
// allow: partial[slice][e], e the HWIO weight element (dw's own order). weights or
// positions is -1 (and slices 0) when it cannot be represented (only the scratch query sees such
// a problem).
struct WgradSlices {
  int64_t weights, positions, per_slice, slices;
  bool rows;   // the depthwise rows kernel: positions are output rows (n, y)
  bool pairs;  // the channel-pair kernel: slices as `pair` says
  PairWgrad pair;
};

template <class T>
WgradSlices wgrad_slices(const ConvProblem& p) {
  WgradSlices w{};
  w.weights = checked_product({p.K, p.channels_per_group(), p.R, p.S});
  if (w.weights > 0 && p.N > 0 && p.P > 0 && p.Q > 0 && pair_wgrad_applies<T>(p)) {
    w.pairs = true;
    w.pair = pair_wgrad_plan(p, w.weights);
    w.positions = p.N * p.P;
    w.slices = w.pair.blocks / w.pair.pair_groups;
    return w;
  }
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
  if constexpr (is_half_type<T>()) {
    if (depthwise_pairs<T>(s)) {
      switch (depthwise_block_taps(s)) {
        case 3: launch_depthwise_pairs<T, 3>(stream, source, weight, bias, out, s); return launch_status(op);
        case 5: launch_depthwise_pairs<T, 5>(stream, source, weight, bias, out, s); return launch_status(op);
        default: launch_depthwise_pairs<T, 7>(stream, source, weight, bias, out, s); return launch_status(op);
      }
    }
  }
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
  const WgradSlices w = wgrad_slices<T>(p);
  if (w.weights < 0 || w.positions < 0) return -1;
  ScratchLayout layout;
  layout.take(checked_product({w.slices, w.weights, int64_t(sizeof(acc_t<T>))}));
  return layout.total();
}

template <class T>
ffi::Error run_wgrad_nhwc(cudaStream_t stream, const T* dy, const T* x, T* dw,
                          const ConvProblem& p, void* scratch, int64_t scratch_bytes) {
  const WgradSlices w = wgrad_slices<T>(p);
  if (w.weights == 0) return ffi::Error::Success();
  if (w.slices == 0) {  // no output positions: dw is zero (reads no partials)
    slice_sum::launch_contiguous(stream, static_cast<const acc_t<T>*>(nullptr), dw, w.weights, 0);
    return launch_status("conv2d wgrad");
  }
  const int64_t needed = wgrad_nhwc_scratch_bytes<T>(p);
  if (needed < 0 || scratch_bytes < needed || scratch == nullptr)
    return ffi::Error::InvalidArgument("conv2d wgrad: scratch buffer too small");
  auto* partial = reinterpret_cast<acc_t<T>*>(aligned_scratch(scratch));
  if (w.pairs) {
    if constexpr (is_half_type<T>()) {
      switch (p.R) {
        case 3: launch_wgrad_pairs<T, 3>(stream, dy, x, partial, p, w.pair); break;
        case 5: launch_wgrad_pairs<T, 5>(stream, dy, x, partial, p, w.pair); break;
        default: launch_wgrad_pairs<T, 7>(stream, dy, x, partial, p, w.pair); break;
      }
    }
  } else if (w.rows) {
    wgrad_rows_nhwc_kernel<T><<<grid_blocks(w.slices * p.R * p.K, kThreads), kThreads, 0,
                                stream>>>(dy, x, partial, p, w);
  } else {
    wgrad_nhwc_partial_kernel<T><<<grid_blocks(w.slices * w.weights, kThreads), kThreads, 0,
                                   stream>>>(dy, x, partial, p, w);
  }
  if (ffi::Error e = launch_status("conv2d wgrad"); e.failure()) return e;
  slice_sum::launch_contiguous(stream, partial, dw, w.weights, w.slices);
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
