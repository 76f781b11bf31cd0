// CUDA FFI handlers of conv2d. The forward, dgrad and wgrad targets hand their problem to the
// tensor-core path (conv_dense.cu) when it takes it, and otherwise run the direct kernels here,
// which are correct for every problem (any groups, stride, dilation, padding, dtype) and fast for
// depthwise and few-channels-per-group convolutions, where implicit GEMM idles the tensor cores:
//
// - Forward and dgrad are one stencil kernel (conv.h's StencilAxis: the dgrad is the stencil of
//   dy upsampled by the stride, with flipped taps). A block stages a halo tile of a source plane
//   in shared memory; each thread computes a vertical strip of outputs of one column, so each
//   shared load serves several output rows. Unit-stride 3x3, 5x5 and 7x7 taps unroll with the
//   weights in registers; other geometries take the same tile with run-time loops, or global
//   memory when their tile would not fit.
// - Wgrad: for each (filter, channel) pair and fixed slice of images, a block reduces dy x x over
//   the slice into R*S partial sums (registers, then a fixed shuffle tree) stored in the scratch
//   buffer; a second kernel adds the slices in order. No atomics: bitwise reproducible.
// - Bias gradient: one block per (batch, filter), a fixed-order reduction.
#include <algorithm>
#include <cstdint>
#include <string>

#include "conv_dense.h"
#include "jax_kernels/conv.h"
#include "jax_kernels/cuda_util.h"
#include "jax_kernels/ffi_util.h"

namespace jax_kernels {
namespace {

constexpr int kMaxThreads = 256;           // threads per block of every kernel here
// Dynamic shared memory per block: below the 48 KiB available without opting in, leaving room
// for block_sum's static buffer.
constexpr int kSharedBytes = 40 * 1024;
constexpr int kGenericRows = 4;            // output rows per thread off the unrolled paths
constexpr int kGenericTaps = 16;           // weight-gradient taps per block off the unrolled paths
constexpr int64_t kWgradBlocks = 1024;     // weight-gradient blocks aimed at (sets the slices)

int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// StencilAxis::sample, with the common upsample == 1 case free of divisions.
__device__ __forceinline__ int64_t sample_of(const StencilAxis& a, int64_t u) {
  if (a.upsample == 1) return (u >= 0 && u < a.source) ? u : -1;
  return a.sample(u);
}

// Stages rows x cols elements of a source plane into `tile` (row-major): tile element (a, c)
// is the upsampled source at (u0 + a, v0 + c), zero outside. Each thread issues kInFlight
// independent loads before storing any of them, so that loads overlap instead of each waiting
// for the one before.
template <class T, class A>
__device__ __forceinline__ void stage_tile(A* tile, const T* __restrict__ src,
                                           const StencilAxis& rows, const StencilAxis& cols,
                                           int64_t u0, int64_t v0, int tile_rows, int tile_cols,
                                           int tid, int threads) {
  constexpr int kInFlight = 8;
  const int size = tile_rows * tile_cols;
  // Walk the tile without divisions: each step moves `threads` elements.
  const int step_rows = threads / tile_cols, step_cols = threads % tile_cols;
  int a = tid / tile_cols, c = tid % tile_cols;
  for (int e0 = tid; e0 < size; e0 += kInFlight * threads) {
    A v[kInFlight];
#pragma unroll
    for (int k = 0; k < kInFlight; ++k) {
      const int64_t row = sample_of(rows, u0 + a), col = sample_of(cols, v0 + c);
      const bool inside = e0 + k * threads < size && row >= 0 && col >= 0;
      v[k] = inside ? to_acc(src[row * cols.source + col]) : A(0);
      a += step_rows;
      c += step_cols;
      if (c >= tile_cols) c -= tile_cols, ++a;
    }
#pragma unroll
    for (int k = 0; k < kInFlight; ++k)
      if (e0 + k * threads < size) tile[e0 + k * threads] = v[k];
  }
}

// Sums v[t] over the block's threads in a fixed order (a shuffle tree within each warp, then
// the warps in order) and stores sum t at out[t]. blockDim.x must be a multiple of 32.
template <class A, int kValues>
__device__ void block_sum(A (&v)[kValues], A* out) {
  __shared__ A per_warp[kMaxThreads / 32][kValues];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int t = 0; t < kValues; ++t) {
    A x = v[t];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_down_sync(0xffffffffu, x, offset);
    if (lane == 0) per_warp[warp][t] = x;
  }
  __syncthreads();
  for (int t = threadIdx.x; t < kValues; t += blockDim.x) {
    A sum = per_warp[0][t];
    for (int w = 1; w < warps; ++w) sum += per_warp[w][t];
    out[t] = sum;
  }
  __syncthreads();  // per_warp is reused by the next call
}

// ---- Forward and backward data: the stencil kernels ---------------------------------------------

// out[n, g*Og + o, y, x] = bias + sum_{i, r, s} w(g, o, i, r, s) * upsampled source[n, g*Ig + i]
// at (rows.position(y, r), cols.position(x, s)).
struct StencilGrid {
  StencilAxis rows, cols;
  StencilWeights weights;
  int64_t planes;  // N * out_channels
  int64_t out_channels, in_channels, in_per_group, out_per_group;
  int64_t tiles_x, tiles_y, blocks;
  int bx, by, bz;              // a tile: bx columns x by strips of rows; bz planes per block
  int src_rows, src_cols;      // the shared tile of one plane, in upsampled source positions
};

// A block covers bz planes x one tile of (by * kRows) x bx outputs; thread (tx, ty) of a plane
// computes rows ty * kRows .. + kRows - 1 of column tx. kTaps > 0: unit stride and dilation
// with kTaps x kTaps taps, unrolled with the weights in registers.
template <class T, int kTaps, int kRows>
__global__ void __launch_bounds__(kMaxThreads)
    stencil_kernel(const T* __restrict__ source, const T* __restrict__ weight,
                   const T* __restrict__ bias, T* __restrict__ out, const StencilGrid G) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char shared_memory[];
  const int plane_threads = G.bx * G.by;
  const int z = threadIdx.x / plane_threads;
  const int tid = threadIdx.x - z * plane_threads;
  const int tx = tid % G.bx, ty = tid / G.bx;
  const bool slot = z < G.bz;  // threads beyond bz planes only round the block up to whole warps
  const int tile_size = G.src_rows * G.src_cols;
  A* tile = reinterpret_cast<A*>(shared_memory) + (slot ? z : 0) * tile_size;
  const int64_t tiles = G.tiles_x * G.tiles_y;
  const int64_t source_plane = G.rows.source * G.cols.source;
  const int64_t out_plane = G.rows.out * G.cols.out;

  for (int64_t b = blockIdx.x; b < G.blocks; b += gridDim.x) {
    const int64_t plane = (b / tiles) * G.bz + z;
    const bool live = slot && plane < G.planes;
    const int64_t t = b % tiles;
    const int64_t y0 = (t / G.tiles_x) * (int64_t(G.by) * kRows), x0 = (t % G.tiles_x) * G.bx;
    const int64_t n = plane / G.out_channels, oc = plane % G.out_channels;
    const int64_t g = oc / G.out_per_group, o = oc % G.out_per_group;
    const int64_t u0 = G.rows.position(y0, 0), v0 = G.cols.position(x0, 0);
    const A start = (live && bias != nullptr) ? to_acc(bias[oc]) : A(0);
    A acc[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j) acc[j] = start;

    for (int64_t i = 0; i < G.in_per_group; ++i) {
      __syncthreads();  // the previous tile has been consumed
      if (live)
        stage_tile(tile, source + (n * G.in_channels + g * G.in_per_group + i) * source_plane,
                   G.rows, G.cols, u0, v0, G.src_rows, G.src_cols, tid, plane_threads);
      __syncthreads();
      if (live) {
        const T* w = weight + G.weights.offset(g, o, i, 0, 0);
        if constexpr (kTaps > 0) {
          A wr[kTaps][kTaps];
#pragma unroll
          for (int r = 0; r < kTaps; ++r)
#pragma unroll
            for (int s = 0; s < kTaps; ++s)
              wr[r][s] = to_acc(w[r * G.weights.row + s * G.weights.col]);
          const A* column = tile + ty * kRows * G.src_cols + tx;
          // Tile row d is read by output row j through tap d - j.
#pragma unroll
          for (int d = 0; d < kRows + kTaps - 1; ++d)
#pragma unroll
            for (int s = 0; s < kTaps; ++s) {
              const A v = column[d * G.src_cols + s];
#pragma unroll
              for (int j = 0; j < kRows; ++j)
                if (d - j >= 0 && d - j < kTaps) acc[j] += wr[d - j][s] * v;
            }
        } else {
          const int R = int(G.rows.taps), S = int(G.cols.taps);
          for (int r = 0; r < R; ++r)
            for (int s = 0; s < S; ++s) {
              const A wv = to_acc(w[r * G.weights.row + s * G.weights.col]);
              const A* column = tile + int(r * G.rows.dilation) * G.src_cols +
                                int(tx * G.cols.stride + s * G.cols.dilation);
#pragma unroll
              for (int j = 0; j < kRows; ++j)
                acc[j] += wv * column[int((ty * kRows + j) * G.rows.stride) * G.src_cols];
            }
        }
      }
    }
    if (live) {
      const int64_t x = x0 + tx;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int64_t y = y0 + ty * kRows + j;
        if (y < G.rows.out && x < G.cols.out)
          out[plane * out_plane + y * G.cols.out + x] = from_acc<T>(acc[j]);
      }
    }
  }
}

// The same stencil for geometries whose tile would not fit in shared memory: one output per
// thread, reading global memory.
template <class T>
__global__ void __launch_bounds__(kMaxThreads)
    stencil_global_kernel(const T* __restrict__ source, const T* __restrict__ weight,
                          const T* __restrict__ bias, T* __restrict__ out, const StencilGrid G) {
  using A = acc_t<T>;
  const int64_t out_plane = G.rows.out * G.cols.out, source_plane = G.rows.source * G.cols.source;
  const int64_t count = G.planes * out_plane;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t plane = e / out_plane, y = e % out_plane / G.cols.out, x = e % G.cols.out;
    const int64_t n = plane / G.out_channels, oc = plane % G.out_channels;
    const int64_t g = oc / G.out_per_group, o = oc % G.out_per_group;
    A acc = bias != nullptr ? to_acc(bias[oc]) : A(0);
    for (int64_t i = 0; i < G.in_per_group; ++i) {
      const T* src = source + (n * G.in_channels + g * G.in_per_group + i) * source_plane;
      const T* w = weight + G.weights.offset(g, o, i, 0, 0);
      for (int64_t r = 0; r < G.rows.taps; ++r) {
        const int64_t row = sample_of(G.rows, G.rows.position(y, r));
        if (row < 0) continue;
        for (int64_t s = 0; s < G.cols.taps; ++s) {
          const int64_t col = sample_of(G.cols, G.cols.position(x, s));
          if (col >= 0)
            acc += to_acc(w[r * G.weights.row + s * G.weights.col]) *
                   to_acc(src[row * G.cols.source + col]);
        }
      }
    }
    out[e] = from_acc<T>(acc);
  }
}

// Tile sizes of a stencil or weight-gradient pass: bx columns (at most 64, balanced over the
// column tiles) x by strips of `rows_per_thread` rows, at most kMaxThreads threads.
struct TileShape {
  int bx, by;
  int64_t tiles_x, tiles_y;
};

TileShape choose_tile(int64_t out_rows, int64_t out_cols, int rows_per_thread, int max_by) {
  TileShape t;
  t.tiles_x = ceil_div(std::max<int64_t>(out_cols, 1), 64);
  t.bx = int(ceil_div(std::max<int64_t>(out_cols, 1), t.tiles_x));
  const int64_t strips = ceil_div(std::max<int64_t>(out_rows, 1), rows_per_thread);
  const int64_t by_max = std::max<int64_t>(1, std::min<int64_t>(max_by, kMaxThreads / t.bx));
  t.tiles_y = ceil_div(strips, by_max);
  t.by = int(ceil_div(strips, t.tiles_y));
  return t;
}

// Unit stride and dilation (upsampling allowed) with square 3x3, 5x5 or 7x7 taps: the unrolled
// kernels' geometry.
int unrolled_taps(const StencilAxis& rows, const StencilAxis& cols) {
  if (rows.stride != 1 || cols.stride != 1 || rows.dilation != 1 || cols.dilation != 1) return 0;
  if (rows.taps != cols.taps || (rows.taps != 3 && rows.taps != 5 && rows.taps != 7)) return 0;
  return int(rows.taps);
}

// Of the strip heights 7 and 8, the one that computes fewer rows beyond the output (7 fits the
// 56/28/14/7 planes of ImageNet networks, 8 the powers of two).
int strip_rows(int64_t out_rows, int64_t out_cols) {
  const auto computed = [&](int rows) {
    const TileShape t = choose_tile(out_rows, out_cols, rows, kMaxThreads);
    return t.tiles_y * t.by * rows;
  };
  return computed(7) < computed(8) ? 7 : 8;
}

template <class T, int kTaps, int kRows>
void launch_stencil_kernel(cudaStream_t stream, const T* source, const T* weight, const T* bias,
                           T* out, const StencilGrid& G, size_t shared) {
  const int threads = int(round_up(int64_t(G.bx) * G.by * G.bz, 32));
  const unsigned blocks = unsigned(std::min<int64_t>(G.blocks, int64_t(1) << 30));
  stencil_kernel<T, kTaps, kRows>
      <<<blocks, threads, shared, stream>>>(source, weight, bias, out, G);
}

template <class T>
ffi::Error run_stencil(cudaStream_t stream, const char* op, const T* source, const T* weight,
                       const T* bias, T* out, StencilGrid G) {
  using A = acc_t<T>;
  if (G.planes * G.rows.out * G.cols.out == 0) return ffi::Error::Success();
  const int taps = unrolled_taps(G.rows, G.cols);
  const int rows = taps > 0 ? strip_rows(G.rows.out, G.cols.out) : kGenericRows;
  // Shrink the strips per tile until the shared tile fits.
  for (int max_by = kMaxThreads; max_by >= 1; max_by /= 2) {
    const TileShape t = choose_tile(G.rows.out, G.cols.out, rows, max_by);
    G.bx = t.bx;
    G.by = t.by;
    G.tiles_x = t.tiles_x;
    G.tiles_y = t.tiles_y;
    const int64_t src_rows =
        (int64_t(t.by) * rows - 1) * G.rows.stride + (G.rows.taps - 1) * G.rows.dilation + 1;
    const int64_t src_cols =
        (int64_t(t.bx) - 1) * G.cols.stride + (G.cols.taps - 1) * G.cols.dilation + 1;
    const int64_t tile_bytes = src_rows * src_cols * int64_t(sizeof(A));
    if (tile_bytes > kSharedBytes) continue;
    G.src_rows = int(src_rows);
    G.src_cols = int(src_cols);
    // Small tiles: several planes per block, so that blocks have at least 128 threads.
    G.bz = int(std::clamp<int64_t>(128 / (int64_t(t.bx) * t.by), 1,
                                   std::min<int64_t>(G.planes, kSharedBytes / tile_bytes)));
    G.blocks = ceil_div(G.planes, G.bz) * G.tiles_x * G.tiles_y;
    const size_t shared = size_t(G.bz) * size_t(tile_bytes);
    if (taps == 0) {
      launch_stencil_kernel<T, 0, kGenericRows>(stream, source, weight, bias, out, G, shared);
    } else if (rows == 7) {
      if (taps == 3) launch_stencil_kernel<T, 3, 7>(stream, source, weight, bias, out, G, shared);
      if (taps == 5) launch_stencil_kernel<T, 5, 7>(stream, source, weight, bias, out, G, shared);
      if (taps == 7) launch_stencil_kernel<T, 7, 7>(stream, source, weight, bias, out, G, shared);
    } else {
      if (taps == 3) launch_stencil_kernel<T, 3, 8>(stream, source, weight, bias, out, G, shared);
      if (taps == 5) launch_stencil_kernel<T, 5, 8>(stream, source, weight, bias, out, G, shared);
      if (taps == 7) launch_stencil_kernel<T, 7, 8>(stream, source, weight, bias, out, G, shared);
    }
    return launch_status(op);
  }
  const unsigned blocks = grid_blocks(G.planes * G.rows.out * G.cols.out, kMaxThreads);
  stencil_global_kernel<T><<<blocks, kMaxThreads, 0, stream>>>(source, weight, bias, out, G);
  return launch_status(op);
}

// ---- Backward weight: partial sums per slice of images, then the slices in order ---------------

// Images per slice: fixed by the problem's shape (never by the device), so that the sums are
// the same run to run.
struct WgradSlices {
  int64_t count, images;
};

WgradSlices wgrad_slices(const ConvProblem& p) {
  const int64_t pairs = p.K * p.channels_per_group();
  if (p.N == 0 || pairs == 0) return {0, 0};
  const int64_t wanted = std::clamp<int64_t>(ceil_div(kWgradBlocks, pairs), 1, p.N);
  const int64_t images = ceil_div(p.N, wanted);
  return {ceil_div(p.N, images), images};
}

template <class A>
int64_t wgrad_scratch_bytes(const ConvProblem& p) {
  return wgrad_slices(p).count * p.K * p.channels_per_group() * p.R * p.S * int64_t(sizeof(A));
}

struct WgradGrid {
  ConvProblem p;
  int64_t pairs;               // K * C/g (filter, channel) pairs, pair = k * C/g + c
  int64_t slices, images;      // slices of `images` images
  int64_t tiles_x, tiles_y;
  int bx, by;                  // a dy tile: bx columns x by strips of rows
  int src_rows, src_cols;      // the shared tile of x
  int64_t tap_chunks;          // generic kernel: blocks per (pair, slice), kGenericTaps taps each
};

// Unit stride and dilation, kTaps x kTaps taps. Block (slice, pair); thread (tx, ty) of a dy
// tile holds the kTaps^2 sums of column tx, rows ty * kRows .. + kRows - 1, over every tile of
// every image of the slice; the x tile (with its halo) is staged in shared memory.
template <class T, int kTaps, int kRows>
__global__ void __launch_bounds__(kMaxThreads)
    wgrad_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                         acc_t<T>* __restrict__ partial, const WgradGrid G) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char shared_memory[];
  A* tile = reinterpret_cast<A*>(shared_memory);
  const ConvProblem& p = G.p;
  const int plane_threads = G.bx * G.by;
  const int tid = threadIdx.x;
  const bool thread_live = tid < plane_threads;
  const int tx = tid % G.bx, ty = tid / G.bx;
  const int64_t Kg = p.filters_per_group(), Cg = p.channels_per_group();
  // The x tile in the stencil form of the forward pass (unit stride here).
  const StencilAxis rows = forward_rows(p), cols = forward_cols(p);

  for (int64_t b = blockIdx.x; b < G.slices * G.pairs; b += gridDim.x) {
    const int64_t slice = b / G.pairs, pair = b % G.pairs;
    const int64_t k = pair / Cg, c = pair % Cg;
    const int64_t channel = (k / Kg) * Cg + c;
    A acc[kTaps * kTaps];
#pragma unroll
    for (int t = 0; t < kTaps * kTaps; ++t) acc[t] = A(0);
    const int64_t first = slice * G.images, last = std::min(p.N, first + G.images);
    for (int64_t n = first; n < last; ++n) {
      const T* x_plane = x + (n * p.C + channel) * p.H * p.W;
      const T* dy_plane = dy + (n * p.K + k) * p.P * p.Q;
      for (int64_t t = 0; t < G.tiles_x * G.tiles_y; ++t) {
        const int64_t y0 = (t / G.tiles_x) * (int64_t(G.by) * kRows), x0 = (t % G.tiles_x) * G.bx;
        __syncthreads();  // the previous tile has been consumed
        if (thread_live)
          stage_tile(tile, x_plane, rows, cols, rows.position(y0, 0), cols.position(x0, 0),
                     G.src_rows, G.src_cols, tid, plane_threads);
        __syncthreads();
        if (thread_live) {
          const int64_t q = x0 + tx;
          A d[kRows];
#pragma unroll
          for (int j = 0; j < kRows; ++j) {
            const int64_t row = y0 + ty * kRows + j;
            d[j] = (row < p.P && q < p.Q) ? to_acc(dy_plane[row * p.Q + q]) : A(0);
          }
          const A* column = tile + ty * kRows * G.src_cols + tx;
          // Tile row dd is read by output row j through tap row dd - j.
#pragma unroll
          for (int dd = 0; dd < kRows + kTaps - 1; ++dd)
#pragma unroll
            for (int s = 0; s < kTaps; ++s) {
              const A v = column[dd * G.src_cols + s];
#pragma unroll
              for (int j = 0; j < kRows; ++j)
                if (dd - j >= 0 && dd - j < kTaps) acc[(dd - j) * kTaps + s] += d[j] * v;
            }
        }
      }
    }
    block_sum(acc, partial + b * (kTaps * kTaps));
  }
}

// Any geometry: block (slice, pair, chunk of kGenericTaps taps); the threads stride over the
// slice's output positions, reading global memory.
template <class T>
__global__ void __launch_bounds__(kMaxThreads)
    wgrad_partial_generic_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                 acc_t<T>* __restrict__ partial, const WgradGrid G) {
  using A = acc_t<T>;
  const ConvProblem& p = G.p;
  const int64_t Kg = p.filters_per_group(), Cg = p.channels_per_group(), RS = p.R * p.S;
  const int64_t blocks = G.slices * G.pairs * G.tap_chunks;
  __shared__ A sums[kGenericTaps];
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t chunk = b % G.tap_chunks, slice_pair = b / G.tap_chunks;
    const int64_t slice = slice_pair / G.pairs, pair = slice_pair % G.pairs;
    const int64_t k = pair / Cg, c = pair % Cg;
    const int64_t channel = (k / Kg) * Cg + c;
    const int64_t tap0 = chunk * kGenericTaps;
    A acc[kGenericTaps];
#pragma unroll
    for (int t = 0; t < kGenericTaps; ++t) acc[t] = A(0);
    const int64_t first = slice * G.images, last = std::min(p.N, first + G.images);
    const int64_t count = (last - first) * p.P * p.Q;
    for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
      const int64_t n = first + e / (p.P * p.Q), pos = e % (p.P * p.Q);
      const int64_t oy = pos / p.Q, ox = pos % p.Q;
      const A d = to_acc(dy[((n * p.K + k) * p.P + oy) * p.Q + ox]);
      const T* x_plane = x + (n * p.C + channel) * p.H * p.W;
#pragma unroll
      for (int t = 0; t < kGenericTaps; ++t) {
        const int64_t tap = tap0 + t;
        if (tap < RS) {
          const int64_t row = p.input_row(oy, tap / p.S), col = p.input_col(ox, tap % p.S);
          if (row >= 0 && row < p.H && col >= 0 && col < p.W)
            acc[t] += d * to_acc(x_plane[row * p.W + col]);
        }
      }
    }
    block_sum(acc, sums);
    for (int t = threadIdx.x; t < kGenericTaps; t += blockDim.x)
      if (tap0 + t < RS) partial[slice_pair * RS + tap0 + t] = sums[t];
    __syncthreads();
  }
}

// dw[i] = the sum over slices of partial[slice][i], in slice order.
template <class T>
__global__ void wgrad_finalize_kernel(const acc_t<T>* __restrict__ partial, T* __restrict__ dw,
                                      int64_t slices, int64_t count) {
  using A = acc_t<T>;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    A sum = A(0);
    for (int64_t s = 0; s < slices; ++s) sum += partial[s * count + i];
    dw[i] = from_acc<T>(sum);
  }
}

template <class T, int kTaps, int kRows>
void launch_wgrad_partial(cudaStream_t stream, const T* dy, const T* x, acc_t<T>* partial,
                          const WgradGrid& G, size_t shared) {
  const int threads = int(round_up(int64_t(G.bx) * G.by, 32));
  const unsigned blocks = unsigned(std::min<int64_t>(G.slices * G.pairs, int64_t(1) << 30));
  wgrad_partial_kernel<T, kTaps, kRows><<<blocks, threads, shared, stream>>>(dy, x, partial, G);
}

template <class T>
ffi::Error run_wgrad(cudaStream_t stream, const T* dy, const T* x, T* dw, const ConvProblem& p,
                     void* scratch, int64_t scratch_bytes) {
  using A = acc_t<T>;
  const char* op = "conv2d wgrad";
  const int64_t count = p.K * p.channels_per_group() * p.R * p.S;
  if (count == 0) return ffi::Error::Success();
  if (scratch_bytes < wgrad_scratch_bytes<A>(p))
    return ffi::Error::InvalidArgument("conv2d wgrad: scratch buffer too small");
  A* partial = static_cast<A*>(scratch);
  WgradGrid G{};
  G.p = p;
  G.pairs = p.K * p.channels_per_group();
  const WgradSlices slices = wgrad_slices(p);
  G.slices = slices.count;
  G.images = slices.images;
  if (G.slices > 0) {
    const StencilAxis rows = forward_rows(p), cols = forward_cols(p);
    const int taps = unrolled_taps(rows, cols);
    bool launched = false;
    if (taps > 0) {
      const int strip = strip_rows(p.P, p.Q);
      const TileShape t = choose_tile(p.P, p.Q, strip, kMaxThreads);
      G.bx = t.bx;
      G.by = t.by;
      G.tiles_x = t.tiles_x;
      G.tiles_y = t.tiles_y;
      G.src_rows = t.by * strip + taps - 1;
      G.src_cols = t.bx + taps - 1;
      const size_t shared = size_t(G.src_rows) * G.src_cols * sizeof(A);
      if (shared <= size_t(kSharedBytes)) {
        launched = true;
        if (strip == 7) {
          if (taps == 3) launch_wgrad_partial<T, 3, 7>(stream, dy, x, partial, G, shared);
          if (taps == 5) launch_wgrad_partial<T, 5, 7>(stream, dy, x, partial, G, shared);
          if (taps == 7) launch_wgrad_partial<T, 7, 7>(stream, dy, x, partial, G, shared);
        } else {
          if (taps == 3) launch_wgrad_partial<T, 3, 8>(stream, dy, x, partial, G, shared);
          if (taps == 5) launch_wgrad_partial<T, 5, 8>(stream, dy, x, partial, G, shared);
          if (taps == 7) launch_wgrad_partial<T, 7, 8>(stream, dy, x, partial, G, shared);
        }
      }
    }
    if (!launched) {
      G.tap_chunks = ceil_div(p.R * p.S, kGenericTaps);
      const int64_t wanted = G.slices * G.pairs * G.tap_chunks;
      const unsigned blocks = unsigned(std::min<int64_t>(wanted, int64_t(1) << 30));
      wgrad_partial_generic_kernel<T><<<blocks, kMaxThreads, 0, stream>>>(dy, x, partial, G);
    }
  }
  wgrad_finalize_kernel<T><<<grid_blocks(count, kMaxThreads), kMaxThreads, 0, stream>>>(
      partial, dw, G.slices, count);
  return launch_status(op);
}

// ---- Bias gradient ------------------------------------------------------------------------------

// db[b, k] = the sum over n, p, q of dy[b, n, k, p, q]: one block per (b, k), each thread a
// fixed strided subset, then block_sum.
template <class T>
__global__ void __launch_bounds__(kMaxThreads)
    bias_gradient_kernel(const T* __restrict__ dy, T* __restrict__ db, int64_t outputs,
                         int64_t N, int64_t K, int64_t plane) {
  using A = acc_t<T>;
  __shared__ A total[1];
  for (int64_t item = blockIdx.x; item < outputs; item += gridDim.x) {
    const int64_t b = item / K, k = item % K;
    A sum[1] = {A(0)};
    for (int64_t n = 0; n < N; ++n) {
      const T* in = dy + ((b * N + n) * K + k) * plane;
      for (int64_t i = threadIdx.x; i < plane; i += blockDim.x) sum[0] += to_acc(in[i]);
    }
    block_sum(sum, total);
    if (threadIdx.x == 0) db[item] = from_acc<T>(total[0]);
    __syncthreads();
  }
}

// ---- Plans shared by the handlers and the scratch query ----------------------------------------

ConvDtype conv_dtype(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F16: return ConvDtype::kFloat16;
    case ffi::DataType::BF16: return ConvDtype::kBFloat16;
    case ffi::DataType::F32: return ConvDtype::kFloat32;
    default: return ConvDtype::kFloat64;
  }
}

bool empty_problem(const ConvProblem& p) {
  return p.N == 0 || p.C == 0 || p.K == 0 || p.H == 0 || p.W == 0 || p.P == 0 || p.Q == 0;
}

// Which path runs a pass and the scratch bytes its handler must receive: the tensor-core path's
// when it takes the problem, else the direct kernels' (partial sums of the wgrad).
struct ConvPlan {
  bool dense;
  int64_t scratch_bytes;
};

ConvPlan plan_conv(const ConvQuery& q) {
  if (!empty_problem(q.problem)) {
    const int64_t dense = conv2d_dense_scratch_bytes(q);
    if (dense >= 0) return {true, dense};
  }
  if (q.pass != ConvPass::kBackwardWeight) return {false, 0};
  return {false, q.dtype == ConvDtype::kFloat64 ? wgrad_scratch_bytes<double>(q.problem)
                                                : wgrad_scratch_bytes<float>(q.problem)};
}

// Host query "conv2d_scratch" (the arguments of conv.h's "conv2d_dense_scratch"): the scratch
// bytes of the pass's handler, or -1 for malformed arguments.
int64_t conv2d_scratch_query(const std::vector<int64_t>& arguments) {
  ConvQuery query;
  if (!parse_conv_query(arguments, &query)) return -1;
  const ConvProblem& p = query.problem;
  if (p.groups <= 0 || p.C % p.groups != 0 || p.K % p.groups != 0 || p.stride_h <= 0 ||
      p.stride_w <= 0 || p.dilation_h <= 0 || p.dilation_w <= 0)
    return -1;
  return plan_conv(query).scratch_bytes;
}

// ---- Handlers -----------------------------------------------------------------------------------

struct ConvAttributes {
  int64_t stride_h, stride_w, pad_top, pad_left, dilation_h, dilation_w, groups, precision;
};

ffi::Error read_problem(const char* op, const ffi::AnyBuffer& in, const ffi::AnyBuffer& weight,
                        const ffi::AnyBuffer& out, const ConvAttributes& a, ConvProblem* p) {
  if (in.dimensions().size() != 4 || weight.dimensions().size() != 4 ||
      out.dimensions().size() != 4)
    return ffi::Error::InvalidArgument(std::string(op) + ": expected 4-D operands");
  if (in.element_type() != weight.element_type() || in.element_type() != out.element_type())
    return ffi::Error::InvalidArgument(std::string(op) + ": operands differ in element type");
  const ffi::DataType type = in.element_type();
  if (type != ffi::DataType::F16 && type != ffi::DataType::BF16 && type != ffi::DataType::F32 &&
      type != ffi::DataType::F64)
    return ffi::Error::InvalidArgument(std::string(op) + ": unsupported element type");
  const int64_t* i = in.dimensions().begin();
  const int64_t* w = weight.dimensions().begin();
  const int64_t* o = out.dimensions().begin();
  *p = make_conv_problem(i, w, o, a.stride_h, a.stride_w, a.pad_top, a.pad_left, a.dilation_h,
                         a.dilation_w, a.groups);
  if (const char* problem = conv_problem_error(i, w, o, *p))
    return ffi::Error::InvalidArgument(std::string(op) + ": " + problem);
  return ffi::Error::Success();
}

ConvQuery make_query(ConvPass pass, ffi::DataType type, const ConvAttributes& a,
                     const ConvProblem& p) {
  return ConvQuery{pass, conv_dtype(type), ConvPrecision(a.precision), p};
}

// Runs the tensor-core path when it takes the problem; `*handled` tells whether it did.
ffi::Error try_dense(cudaStream_t stream, const ConvQuery& q, const void* a, const void* b,
                     const void* bias, void* out, ffi::Result<ffi::AnyBuffer>& scratch,
                     bool* handled) {
  const ConvPlan plan = plan_conv(q);
  *handled = plan.dense;
  if (!plan.dense) return ffi::Error::Success();
  if (int64_t(scratch->size_bytes()) < plan.scratch_bytes)
    return ffi::Error::InvalidArgument("conv2d: scratch buffer too small for the tensor-core path");
  return conv2d_dense(stream, q, a, b, bias, out, scratch->untyped_data(),
                      int64_t(scratch->size_bytes()));
}

ffi::Error conv2d_forward(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                          ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::AnyBuffer> scratch, int64_t stride_h, int64_t stride_w,
                          int64_t pad_top, int64_t pad_left, int64_t dilation_h,
                          int64_t dilation_w, int64_t groups, int64_t precision) {
  const ConvAttributes a{stride_h,   stride_w,   pad_top, pad_left,
                         dilation_h, dilation_w, groups,  precision};
  ConvProblem p;
  if (auto error = read_problem("conv2d", x, w, *y, a, &p); error.failure()) return error;
  const bool has_bias = bias.element_count() > 0;
  if (bias.dimensions().size() != 1 || (has_bias && int64_t(bias.element_count()) != p.K) ||
      (has_bias && bias.element_type() != x.element_type()))
    return ffi::Error::InvalidArgument("conv2d: bias must be [K] or empty, of the input's type");
  if (y->element_count() == 0) return ffi::Error::Success();
  const void* bias_data = has_bias ? bias.untyped_data() : nullptr;
  bool dense = false;
  if (auto error = try_dense(stream, make_query(ConvPass::kForward, x.element_type(), a, p),
                             x.untyped_data(), w.untyped_data(), bias_data, y->untyped_data(),
                             scratch, &dense);
      error.failure() || dense)
    return error;
  return dispatch_float(x.element_type(), "conv2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    StencilGrid G{};
    G.rows = forward_rows(p);
    G.cols = forward_cols(p);
    G.weights = forward_weights(p);
    G.planes = p.N * p.K;
    G.out_channels = p.K;
    G.in_channels = p.C;
    G.in_per_group = p.channels_per_group();
    G.out_per_group = p.filters_per_group();
    return run_stencil<T>(stream, "conv2d", static_cast<const T*>(x.untyped_data()),
                          static_cast<const T*>(w.untyped_data()), static_cast<const T*>(bias_data),
                          static_cast<T*>(y->untyped_data()), G);
  });
}

ffi::Error conv2d_backward_input(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer w,
                                 ffi::Result<ffi::AnyBuffer> dx,
                                 ffi::Result<ffi::AnyBuffer> scratch, int64_t stride_h,
                                 int64_t stride_w, int64_t pad_top, int64_t pad_left,
                                 int64_t dilation_h, int64_t dilation_w, int64_t groups,
                                 int64_t precision) {
  const ConvAttributes a{stride_h,   stride_w,   pad_top, pad_left,
                         dilation_h, dilation_w, groups,  precision};
  ConvProblem p;
  if (auto error = read_problem("conv2d dgrad", *dx, w, dy, a, &p); error.failure()) return error;
  if (dx->element_count() == 0) return ffi::Error::Success();
  bool dense = false;
  if (auto error = try_dense(stream, make_query(ConvPass::kBackwardData, dy.element_type(), a, p),
                             dy.untyped_data(), w.untyped_data(), nullptr, dx->untyped_data(),
                             scratch, &dense);
      error.failure() || dense)
    return error;
  return dispatch_float(dy.element_type(), "conv2d dgrad", [&](auto tag) {
    using T = typename decltype(tag)::type;
    StencilGrid G{};
    G.rows = backward_data_rows(p);
    G.cols = backward_data_cols(p);
    G.weights = backward_data_weights(p);
    G.planes = p.N * p.C;
    G.out_channels = p.C;
    G.in_channels = p.K;
    G.in_per_group = p.filters_per_group();
    G.out_per_group = p.channels_per_group();
    return run_stencil<T>(stream, "conv2d dgrad", static_cast<const T*>(dy.untyped_data()),
                          static_cast<const T*>(w.untyped_data()), nullptr,
                          static_cast<T*>(dx->untyped_data()), G);
  });
}

ffi::Error conv2d_backward_weight(cudaStream_t stream, ffi::AnyBuffer dy, ffi::AnyBuffer x,
                                  ffi::Result<ffi::AnyBuffer> dw,
                                  ffi::Result<ffi::AnyBuffer> scratch, int64_t stride_h,
                                  int64_t stride_w, int64_t pad_top, int64_t pad_left,
                                  int64_t dilation_h, int64_t dilation_w, int64_t groups,
                                  int64_t precision) {
  const ConvAttributes a{stride_h,   stride_w,   pad_top, pad_left,
                         dilation_h, dilation_w, groups,  precision};
  ConvProblem p;
  if (auto error = read_problem("conv2d wgrad", x, *dw, dy, a, &p); error.failure()) return error;
  if (dw->element_count() == 0) return ffi::Error::Success();
  bool dense = false;
  if (auto error = try_dense(stream, make_query(ConvPass::kBackwardWeight, dy.element_type(), a, p),
                             dy.untyped_data(), x.untyped_data(), nullptr, dw->untyped_data(),
                             scratch, &dense);
      error.failure() || dense)
    return error;
  return dispatch_float(dy.element_type(), "conv2d wgrad", [&](auto tag) {
    using T = typename decltype(tag)::type;
    return run_wgrad<T>(stream, static_cast<const T*>(dy.untyped_data()),
                        static_cast<const T*>(x.untyped_data()),
                        static_cast<T*>(dw->untyped_data()), p, scratch->untyped_data(),
                        int64_t(scratch->size_bytes()));
  });
}

// dy [N, K, P, Q] -> db [K], or [B, N, K, P, Q] -> [B, K] (a vmapped batch).
ffi::Error conv2d_backward_bias(cudaStream_t stream, ffi::AnyBuffer dy,
                                ffi::Result<ffi::AnyBuffer> db) {
  const auto d = dy.dimensions();
  const size_t rank = d.size();
  if ((rank != 4 && rank != 5) || db->dimensions().size() != rank - 3 ||
      db->dimensions().back() != d[rank - 3] || (rank == 5 && db->dimensions()[0] != d[0]) ||
      db->element_type() != dy.element_type())
    return ffi::Error::InvalidArgument(
        "conv2d bias gradient: expected dy [(B,) N, K, P, Q] and db [(B,) K]");
  const int64_t outputs = int64_t(db->element_count());
  if (outputs == 0) return ffi::Error::Success();
  return dispatch_float(dy.element_type(), "conv2d bias gradient", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const unsigned blocks = unsigned(std::min<int64_t>(outputs, int64_t(1) << 30));
    bias_gradient_kernel<T><<<blocks, kMaxThreads, 0, stream>>>(
        static_cast<const T*>(dy.untyped_data()), static_cast<T*>(db->untyped_data()), outputs,
        d[rank - 4], d[rank - 3], d[rank - 2] * d[rank - 1]);
    return launch_status("conv2d bias gradient");
  });
}

using Stream = ffi::PlatformStream<cudaStream_t>;

}  // namespace

// The static attributes of the convolution targets, in the handlers' parameter order.
#define JK_CONV2D_ATTRIBUTES                                                             \
  .Attr<int64_t>("stride_h").Attr<int64_t>("stride_w").Attr<int64_t>("pad_top")        \
      .Attr<int64_t>("pad_left").Attr<int64_t>("dilation_h").Attr<int64_t>("dilation_w") \
      .Attr<int64_t>("groups").Attr<int64_t>("precision")

XLA_FFI_DEFINE_HANDLER_SYMBOL(Conv2dForwardCuda, conv2d_forward,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>() JK_CONV2D_ATTRIBUTES,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Conv2dBackwardInputCuda, conv2d_backward_input,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>() JK_CONV2D_ATTRIBUTES,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Conv2dBackwardWeightCuda, conv2d_backward_weight,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>() JK_CONV2D_ATTRIBUTES,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(Conv2dBackwardBiasCuda, conv2d_backward_bias,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

JK_REGISTER_TARGET("jk_conv2d_fwd", Conv2dForwardCuda, "conv2d", "forward",
                   "cuda tensor-core implicit GEMM where it applies, else direct stencil",
                   "bitwise");
JK_REGISTER_TARGET("jk_conv2d_bwd_input", Conv2dBackwardInputCuda, "conv2d", "backward d_input",
                   "cuda tensor-core implicit GEMM where it applies, else direct stencil",
                   "bitwise");
JK_REGISTER_TARGET("jk_conv2d_bwd_weight", Conv2dBackwardWeightCuda, "conv2d",
                   "backward d_weight",
                   "cuda tensor-core implicit GEMM where it applies, else two-pass reduction",
                   "bitwise");
JK_REGISTER_TARGET("jk_conv2d_bwd_bias", Conv2dBackwardBiasCuda, "conv2d", "backward d_bias",
                   "cuda ordered block reduction", "bitwise");
JK_REGISTER_QUERY("conv2d_scratch", conv2d_scratch_query);

}  // namespace jax_kernels
