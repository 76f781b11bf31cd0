// CUDA FFI handlers of conv2d. The forward, dgrad and wgrad targets hand their problem to the
// tensor-core path (conv_dense.cu) when it takes it, and otherwise run the direct kernels here,
// which are correct for every problem (any groups, stride, dilation, padding, dtype) and fast for
// depthwise and few-channels-per-group convolutions, where implicit GEMM idles the tensor cores:
//
// - Forward and dgrad are one stencil (conv.h's StencilAxis: the dgrad is the stencil of dy
//   upsampled by the stride, with flipped taps). A block stages halo tiles of a few source planes
//   in shared memory. Unit-stride 3x3, 5x5 and 7x7 taps (the depthwise convolutions of real
//   networks) take one of two unrolled kernels:
//   * float32/float64, the strip kernel: each thread computes a register block of 7 or 8 rows x
//     4 columns with the weights in registers, reading each tile row once as 16-byte vectors and
//     reusing it for every tap and output that needs it.
//   * float16/bfloat16, the tensor-core kernel: a row of taps is a banded (Toeplitz) 16x8 matrix,
//     so 16 output rows x 8 columns are kTaps mma.sync m16n8k16 (f32 accumulation) of 16x16 tiles
//     of the source read with ldmatrix. The products of half-type inputs are exact in float32.
//   Other geometries take the same tiles with run-time loops, or global memory when their tile
//   would not fit.
// - Wgrad: for each (filter, channel) pair and fixed slice of images, a block reduces dy x x over
//   the slice into R*S partial sums stored in the scratch buffer; a second kernel adds the slices
//   in order. No atomics: bitwise reproducible. Unit-stride 3x3/5x5/7x7 taps use the strip
//   kernel's register blocks (float32/float64) or tensor cores (half types: taps x taps = sums
//   over rows and columns of dy x shifted rows of x, an m16n8k16 product per 16 columns).
// - Bias gradient: one block per (batch, filter), a fixed-order reduction.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>

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
#ifndef JK_WGRAD_STRIP_BLOCKS
#define JK_WGRAD_STRIP_BLOCKS 1536
#endif
// Strip weight-gradient blocks aimed at: 1536 = 4 slices of 8 images for C384 N32, 5.8 items
// per resident block of an H100 (2 x 132), where 1024 gave 3 slices and 4.4 (a quarter-full
// last round).
constexpr int64_t kWgradStripBlocks = JK_WGRAD_STRIP_BLOCKS;
constexpr int kStripCols = 4;              // output columns per thread of the strip kernels
constexpr int kMmaUnits = 8;               // 16x8 output tiles per warp of the tensor-core stencil
constexpr int kMmaThreads = 128;           // threads per block of the tensor-core kernels
#ifndef JK_WGRAD_MMA_ITEMS
#define JK_WGRAD_MMA_ITEMS 4096
#endif
constexpr int64_t kWgradMmaBlocks = JK_WGRAD_MMA_ITEMS;  // tensor-core wgrad items aimed at
constexpr int kWgradMmaBlocksPerSm = 6;    // resident blocks/SM of the tensor-core wgrad
#ifndef JK_MMA_PIPE_BLOCKS
#define JK_MMA_PIPE_BLOCKS 4
#endif
constexpr int kMmaPipeBlocks = JK_MMA_PIPE_BLOCKS;  // resident blocks/SM, pipelined mma stencil
// The pipelined tensor-core stencil issues JK_DW_MMA_CHAINS (1, 2 or 4) units' mma chains
// alternately; 2 measured best on the H100 (docs/performance.md, run 5). Any choice gives the
// same bits.
#ifndef JK_DW_MMA_CHAINS
#define JK_DW_MMA_CHAINS 2
#endif
constexpr int kMmaChains = JK_DW_MMA_CHAINS;  // independent accumulator chains issued alternately
static_assert(kMmaChains >= 1 && kMmaUnits % kMmaChains == 0, "chains must divide the units");

int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

template <class T>
constexpr bool is_half_type() {
  return std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>;
}

// Resident blocks per multiprocessor the strip kernels are compiled for: 2 allows 128 registers
// per thread, which their float32 register blocks need without spilling (float64 takes twice).
template <class T>
constexpr int strip_blocks_per_sm() {
  return sizeof(T) == 8 ? 1 : 2;
}

// StencilAxis::sample, with the common upsample == 1 case free of divisions.
__device__ __forceinline__ int64_t sample_of(const StencilAxis& a, int64_t u) {
  if (a.upsample == 1) return (u >= 0 && u < a.source) ? u : -1;
  return a.sample(u);
}

// Stages one tile of a source plane into shared memory with threads tid of `threads`: element
// (a, c) of `tile` (row pitch `pitch`) is the upsampled source at (u0 + a, v0 + c), zero
// outside, stored as S (the element type itself, or the accumulation type). The threads split
// the columns (consecutive threads, consecutive columns: the loads coalesce and the stores hit
// distinct banks) and walk rows, so the column tests are done once per thread; up to kInFlight
// loads per thread are issued before any of their stores, so that a tile arrives in one memory
// round trip where it can. Tile origins and extents fit in 32 bits.
template <int kInFlight, class S, class T>
__device__ __forceinline__ void stage_tile(S* tile, const T* __restrict__ source,
                                           const StencilAxis& rows, const StencilAxis& cols,
                                           int64_t u0, int64_t v0, int tile_rows, int tile_cols,
                                           int pitch, int tid, int threads) {
  const int col_threads = std::min(threads, tile_cols), row_threads = threads / col_threads;
  if (tid >= col_threads * row_threads) return;
  const int first_row = tid / col_threads;
  const int height = int(rows.source), first_u = int(u0);
  const auto stage = [&](auto rows_upsampled) {
    // Upsampled rows (a strided dgrad) take one row at a time: the sample test divides.
    constexpr int kBatch = decltype(rows_upsampled)::value ? 1 : kInFlight;
    for (int c = tid % col_threads; c < tile_cols; c += col_threads) {
      const int64_t col = sample_of(cols, v0 + c);
      const T* src = source + col;
      S* dst = tile + c;
      for (int a0 = first_row; a0 < tile_rows; a0 += kBatch * row_threads) {
        T v[kBatch];
#pragma unroll
        for (int f = 0; f < kBatch; ++f) {
          const int a = a0 + f * row_threads, u = first_u + a;
          int64_t row;
          if constexpr (decltype(rows_upsampled)::value)
            row = rows.sample(u);
          else
            row = unsigned(u) < unsigned(height) ? u : -1;
          v[f] = (a < tile_rows && row >= 0 && col >= 0) ? src[row * cols.source] : T{};
        }
#pragma unroll
        for (int f = 0; f < kBatch; ++f) {
          const int a = a0 + f * row_threads;
          if (a < tile_rows) {
            if constexpr (std::is_same_v<S, T>)
              dst[a * pitch] = v[f];
            else
              dst[a * pitch] = to_acc(v[f]);
          }
        }
      }
    }
  };
  if (rows.upsample == 1)
    stage(std::false_type{});
  else
    stage(std::true_type{});
}

// stage_tile for a source that is not upsampled, whose rows are whole 16-byte vectors (width a
// multiple of the vector, 16-byte aligned planes), with v0 a multiple of the vector, stored as T:
// one 16-byte load and store per vector (up to the tile columns rounded up to a vector, within
// the pitch).
template <int kInFlight, class T>
__device__ __forceinline__ void stage_tile_vectors(T* tile, const T* __restrict__ source,
                                                   int64_t height, int64_t width, int64_t u0,
                                                   int64_t v0, int tile_rows, int tile_cols,
                                                   int pitch, int tid, int threads) {
  constexpr int kVector = 16 / int(sizeof(T));
  const int vectors = (tile_cols + kVector - 1) / kVector;
  const int col_threads = std::min(threads, vectors), row_threads = threads / col_threads;
  if (tid >= col_threads * row_threads) return;
  const int first_row = tid / col_threads, first_u = int(u0);
  for (int j = tid % col_threads; j < vectors; j += col_threads) {
    const int64_t col = v0 + j * kVector;
    const bool inside = col >= 0 && col < width;  // whole vectors are inside or outside
    const T* src = source + col;
    T* dst = tile + j * kVector;
    for (int a0 = first_row; a0 < tile_rows; a0 += kInFlight * row_threads) {
      uint4 v[kInFlight];
#pragma unroll
      for (int f = 0; f < kInFlight; ++f) {
        const int a = a0 + f * row_threads, u = first_u + a;
        v[f] = (a < tile_rows && unsigned(u) < unsigned(height) && inside)
                   ? *reinterpret_cast<const uint4*>(src + int64_t(u) * width)
                   : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int f = 0; f < kInFlight; ++f) {
        const int a = a0 + f * row_threads;
        if (a < tile_rows) *reinterpret_cast<uint4*>(dst + a * pitch) = v[f];
      }
    }
  }
}

// Splits the block's threads into `parts` equal groups (any rest idles) and has group z call
// stage(z, its thread index, its thread count): the tiles of several planes are staged in
// parallel, each thread's loads all for one plane.
template <class F>
__device__ __forceinline__ void split_block(int parts, const F& stage) {
  const int threads = int(blockDim.x) / parts, part = int(threadIdx.x) / threads;
  if (part < parts) stage(part, int(threadIdx.x) - part * threads, threads);
}

// The first output column of a stencil whose column tiles start at multiples of `vector` source
// columns: with source column x - pad read at output x, the columns start at x ≡ pad (mod
// vector), the first of them in (-vector, 0].
int aligned_column_base(int64_t pad, int vector) {
  const int shift = int(floor_mod(pad, vector));
  return shift == 0 ? 0 : shift - vector;
}

// Loads row[x .. x + 3] into v (zeros outside [0, width)), as one vector when `vector` (row + x
// aligned to 4 elements) and all four are inside. T is float or double.
template <class T>
__device__ __forceinline__ void load_four(const T* row, int x, int64_t width, bool vector,
                                          T (&v)[4]) {
  if (vector && x >= 0 && x + 4 <= width) {
    if constexpr (std::is_same_v<T, float>) {
      const float4 q = *reinterpret_cast<const float4*>(row + x);
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
      const double2 q0 = reinterpret_cast<const double2*>(row + x)[0];
      const double2 q1 = reinterpret_cast<const double2*>(row + x)[1];
      v[0] = q0.x, v[1] = q0.y, v[2] = q1.x, v[3] = q1.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = (x + i >= 0 && x + i < width) ? row[x + i] : T(0);
  }
}

// Stores v at row[x .. x + 3] where inside [0, width), as one vector when `vector` and all four
// are inside. T is float or double.
template <class T>
__device__ __forceinline__ void store_four(T* row, int x, int64_t width, bool vector,
                                           const T (&v)[4]) {
  if (vector && x >= 0 && x + 4 <= width) {
    if constexpr (std::is_same_v<T, float>) {
      *reinterpret_cast<float4*>(row + x) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
      reinterpret_cast<double2*>(row + x)[0] = make_double2(v[0], v[1]);
      reinterpret_cast<double2*>(row + x)[1] = make_double2(v[2], v[3]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (x + i >= 0 && x + i < width) row[x + i] = v[i];
  }
}

// Tile columns a strip thread reads per tile row: its 4 outputs plus the taps' reach, rounded up
// to whole 16-byte vectors of float.
constexpr int strip_span(int taps) { return (kStripCols + taps - 1 + 3) / 4 * 4; }

// Reads kSpan consecutive tile elements (16-byte aligned) as 16-byte vectors. A is float or
// double.
template <int kSpan, class A>
__device__ __forceinline__ void load_span(const A* p, A (&v)[kSpan]) {
  if constexpr (std::is_same_v<A, float>) {
#pragma unroll
    for (int q = 0; q < kSpan / 4; ++q) {
      const float4 w = reinterpret_cast<const float4*>(p)[q];
      v[4 * q] = w.x, v[4 * q + 1] = w.y, v[4 * q + 2] = w.z, v[4 * q + 3] = w.w;
    }
  } else {
#pragma unroll
    for (int q = 0; q < kSpan / 2; ++q) {
      const double2 w = reinterpret_cast<const double2*>(p)[q];
      v[2 * q] = w.x, v[2 * q + 1] = w.y;
    }
  }
}

// The raw bits of a half-type pair, `lo` in the low 16 bits (the layout of mma fragments).
template <class T>
__device__ __forceinline__ uint32_t pack_pair(T lo, T hi) {
  return uint32_t(lo.bits) | (uint32_t(hi.bits) << 16);
}

// D += A * B for one m16n8k16 tile: A 16x16 (row-major fragment, 4 registers), B 16x8
// (column-major fragment, 2 registers), float32 accumulation.
template <class T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Loads a 16x16 A fragment of 16-bit elements from shared memory: lane l passes the address of
// row (l & 7) + 8 * ((l >> 3) & 1), column 8 * (l >> 4) of the tile (16-byte aligned rows).
__device__ __forceinline__ void load_fragment(uint32_t (&a)[4], const void* row) {
  const unsigned address = unsigned(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(address)
               : "memory");
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
  int bx, by, bz;              // a tile: bx threads x by strips of rows; bz planes per block
  int src_rows, src_cols;      // the shared tile of one plane, in upsampled source positions
  int pitch, tile_stride;      // elements between tile rows, and between the planes' tiles
  int mt, nt, warps_per_plane;  // tensor-core kernel: a tile of mt x nt 16x8 outputs per plane
  int x_base;                  // first output column of the column tiles (in (-16, 0])
  bool vector_source;          // stage_tile_vectors applies (tile origins are vector-aligned)
  bool vector_out;             // output vectors (of 4; pairs for mma) are aligned
  bool vector_out16;           // output rows start on 16 bytes (staged mma stencil epilogue)

  // Source plane (n, g * in_per_group + i) of output plane (n, g * out_per_group + o); 32-bit
  // (the unrolled kernels run with fewer than 2^31 planes).
  __device__ int64_t source_plane(int plane, int i) const {
    const int n = plane / int(out_channels), oc = plane % int(out_channels);
    return int64_t(n) * in_channels + (oc / int(out_per_group)) * in_per_group + i;
  }
};

// The strip kernel (float32/float64; unit stride and dilation, kTaps x kTaps taps; upsampling
// allowed). A block covers bz planes x one tile of (by * kRows) x (bx * 4) outputs; thread
// (tx, ty) of a plane computes rows ty * kRows .. + kRows - 1 of columns 4 tx .. 4 tx + 3 with
// the weights in registers. The block's threads stage all bz tiles together; column tiles start
// at x_base so that their source columns start on a 16-byte vector.
template <class T, int kTaps, int kRows>
__global__ void __launch_bounds__(kMaxThreads, strip_blocks_per_sm<T>())
    stencil_strip_kernel(const T* __restrict__ source, const T* __restrict__ weight,
                         const T* __restrict__ bias, T* __restrict__ out, const StencilGrid G) {
  constexpr int kSpan = strip_span(kTaps);
  extern __shared__ __align__(16) unsigned char shared_memory[];
  T* const tiles = reinterpret_cast<T*>(shared_memory);
  const int plane_threads = G.bx * G.by;
  const int z = threadIdx.x / plane_threads;
  const int t = threadIdx.x - z * plane_threads;
  const int tx = t % G.bx, ty = t / G.bx;
  const bool slot = z < G.bz;  // threads beyond bz planes only round the block up to whole warps
  const T* const strip =
      tiles + (slot ? z : 0) * G.tile_stride + ty * kRows * G.pitch + tx * kStripCols;
  const int tiles_per_plane = int(G.tiles_x * G.tiles_y);
  const int64_t source_plane = G.rows.source * G.cols.source;
  const int64_t out_plane = G.rows.out * G.cols.out;

  for (int b = blockIdx.x; b < G.blocks; b += gridDim.x) {
    const int first_plane = (b / tiles_per_plane) * G.bz;
    const int plane = first_plane + z;
    const bool live = slot && plane < G.planes;
    const int tile = b % tiles_per_plane;
    const int y0 = (tile / int(G.tiles_x)) * (G.by * kRows);
    const int x0 = G.x_base + (tile % int(G.tiles_x)) * (G.bx * kStripCols);
    const int64_t u0 = G.rows.position(y0, 0), v0 = G.cols.position(x0, 0);
    const int oc = plane % int(G.out_channels);
    const int g = oc / int(G.out_per_group), o = oc % int(G.out_per_group);
    const T start = (live && bias != nullptr) ? bias[oc] : T(0);
    T acc[kRows][kStripCols];
#pragma unroll
    for (int j = 0; j < kRows; ++j)
#pragma unroll
      for (int c = 0; c < kStripCols; ++c) acc[j][c] = start;

    for (int i = 0; i < G.in_per_group; ++i) {
      __syncthreads();  // the previous tiles have been consumed
      split_block(std::min(G.bz, int(G.planes) - first_plane), [&](int zz, int tid, int threads) {
        const T* src = source + G.source_plane(first_plane + zz, i) * source_plane;
        T* tile_of = tiles + zz * G.tile_stride;
        if (G.vector_source)
          stage_tile_vectors<10>(tile_of, src, G.rows.source, G.cols.source, u0, v0, G.src_rows,
                                 G.src_cols, G.pitch, tid, threads);
        else
          stage_tile<24, T>(tile_of, src, G.rows, G.cols, u0, v0, G.src_rows, G.src_cols,
                            G.pitch, tid, threads);
      });
      __syncthreads();
      if (live) {
        const T* w = weight + G.weights.offset(g, o, i, 0, 0);
        T wr[kTaps][kTaps];
#pragma unroll
        for (int r = 0; r < kTaps; ++r)
#pragma unroll
          for (int s = 0; s < kTaps; ++s) wr[r][s] = w[r * G.weights.row + s * G.weights.col];
        // Tile row d is read by output row j through tap row d - j.
#pragma unroll
        for (int d = 0; d < kRows + kTaps - 1; ++d) {
          T v[kSpan];
          load_span(strip + d * G.pitch, v);
#pragma unroll
          for (int r = 0; r < kTaps; ++r) {
            const int j = d - r;
            if (j < 0 || j >= kRows) continue;
#pragma unroll
            for (int s = 0; s < kTaps; ++s)
#pragma unroll
              for (int c = 0; c < kStripCols; ++c) acc[j][c] += wr[r][s] * v[c + s];
          }
        }
      }
    }
    if (live) {
      const int x = x0 + tx * kStripCols;
      T* dst = out + plane * out_plane;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int y = y0 + ty * kRows + j;
        if (y < G.rows.out) store_four(dst + int64_t(y) * G.cols.out, x, G.cols.out, G.vector_out, acc[j]);
      }
    }
  }
}

// The tensor-core stencil (float16/bfloat16; unit stride and dilation, kTaps x kTaps taps,
// kTaps <= 9; upsampling allowed). With tile element A[m][k] = source at output row m + r,
// output column k of a 16 x 16 window, tap row r is B_r[k][n] = w[r][k - n] (zero outside the
// taps), and the 16 x 8 outputs of the window are sum_r A_r B_r: kTaps m16n8k16 products. A
// block covers bz planes x one tile of (16 * mt) x (8 * nt) outputs, staged raw in shared
// memory (column tiles start at x_base so that their windows start on 16-byte vectors of the
// source); warp wp of a plane owns its 16x8 outputs wp, wp + warps_per_plane, ...
template <class T, int kTaps>
__global__ void __launch_bounds__(kMmaThreads, 4)
    stencil_mma_kernel(const T* __restrict__ source, const T* __restrict__ weight,
                       const T* __restrict__ bias, T* __restrict__ out, const StencilGrid G) {
  extern __shared__ __align__(16) unsigned char shared_memory[];
  T* const tiles = reinterpret_cast<T*>(shared_memory);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;  // the fragment row group and column pair of the lane
  const int z = warp / G.warps_per_plane, wp = warp - z * G.warps_per_plane;
  const bool slot = z < G.bz;
  // Output tile u = wp + k * warps_per_plane is (u / nt, u % nt): walked without divisions.
  const auto next_unit = [&](int& mi, int& ni) {
    for (ni += G.warps_per_plane; ni >= G.nt; ni -= G.nt) ++mi;
  };
  const T* const lane_row = tiles + (slot ? z : 0) * G.tile_stride +
                            ((lane & 7) + 8 * ((lane >> 3) & 1)) * G.pitch + 8 * (lane >> 4);
  const int tiles_per_plane = int(G.tiles_x * G.tiles_y);
  const int64_t source_plane = G.rows.source * G.cols.source;
  const int64_t out_plane = G.rows.out * G.cols.out;

  for (int b = blockIdx.x; b < G.blocks; b += gridDim.x) {
    const int first_plane = (b / tiles_per_plane) * G.bz;
    const int plane = first_plane + z;
    const bool live = slot && plane < G.planes;
    const int tile = b % tiles_per_plane;
    const int y0 = (tile / int(G.tiles_x)) * 16 * G.mt;
    const int x0 = G.x_base + (tile % int(G.tiles_x)) * 8 * G.nt;
    const int64_t u0 = G.rows.position(y0, 0), v0 = G.cols.position(x0, 0);
    const int oc = plane % int(G.out_channels);
    const int grp = oc / int(G.out_per_group), o = oc % int(G.out_per_group);
    const float start = (live && bias != nullptr) ? to_acc(bias[oc]) : 0.f;
    float acc[kMmaUnits][4];
#pragma unroll
    for (int k = 0; k < kMmaUnits; ++k)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[k][e] = start;

    for (int i = 0; i < G.in_per_group; ++i) {
      __syncthreads();  // the previous tiles have been consumed
      split_block(std::min(G.bz, int(G.planes) - first_plane), [&](int zz, int tid, int threads) {
        const T* src = source + G.source_plane(first_plane + zz, i) * source_plane;
        T* tile_of = tiles + zz * G.tile_stride;
        if (G.vector_source)
          stage_tile_vectors<6>(tile_of, src, G.rows.source, G.cols.source, u0, v0, G.src_rows,
                                G.src_cols, G.pitch, tid, threads);
        else
          stage_tile<32, T>(tile_of, src, G.rows, G.cols, u0, v0, G.src_rows, G.src_cols,
                            G.pitch, tid, threads);
      });
      __syncthreads();
      if (!live) continue;
      // B_r fragments: the lane holds B_r[k][g] = w[r][k - g] for k = 2q, 2q + 1, 2q + 8 and
      // 2q + 9 (zero outside the taps).
      const T* w = weight + G.weights.offset(grp, o, i, 0, 0);
      int64_t tap[4];
      bool in_taps[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int s = 2 * q + 8 * (e >> 1) + (e & 1) - g;
        in_taps[e] = s >= 0 && s < kTaps;
        tap[e] = s * G.weights.col;
      }
      uint32_t bfrag[kTaps][2];
#pragma unroll
      for (int r = 0; r < kTaps; ++r) {
        const T* taps = w + r * G.weights.row;
        T b[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) b[e] = in_taps[e] ? taps[tap[e]] : T{};
        bfrag[r][0] = pack_pair(b[0], b[1]);
        bfrag[r][1] = pack_pair(b[2], b[3]);
      }
      int mi = wp / G.nt, ni = wp % G.nt;
#pragma unroll
      for (int k = 0; k < kMmaUnits; ++k, next_unit(mi, ni)) {
        if (mi >= G.mt) break;
        const T* window = lane_row + 16 * mi * G.pitch + 8 * ni;
#pragma unroll
        for (int r = 0; r < kTaps; ++r) {
          uint32_t a[4];
          load_fragment(a, window + r * G.pitch);
          mma_16x8x16<T>(acc[k], a, bfrag[r]);
        }
      }
    }
    if (live) {
      // The lane holds outputs (g, 2q + e) in acc[k][e] and (g + 8, 2q + e) in acc[k][2 + e].
      int mi = wp / G.nt, ni = wp % G.nt;
#pragma unroll
      for (int k = 0; k < kMmaUnits; ++k, next_unit(mi, ni)) {
        if (mi >= G.mt) break;
        const int x = x0 + 8 * ni + 2 * q;
        const bool lo_inside = x >= 0 && x < G.cols.out;
        const bool hi_inside = x + 1 >= 0 && x + 1 < G.cols.out;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int y = y0 + 16 * mi + g + 8 * h;
          if (y >= G.rows.out) continue;
          T* dst = out + plane * out_plane + int64_t(y) * G.cols.out + x;
          const T lo = from_acc<T>(acc[k][2 * h]), hi = from_acc<T>(acc[k][2 * h + 1]);
          if (G.vector_out && lo_inside && hi_inside) {
            *reinterpret_cast<uint32_t*>(dst) = pack_pair(lo, hi);
          } else {
            if (lo_inside) dst[0] = lo;
            if (hi_inside) dst[1] = hi;
          }
        }
      }
    }
  }
}

// ---- Depthwise fast path: persistent blocks with a two-stage cp.async pipeline ---------------
//
// With one source plane per output plane (in_per_group == 1) and vector-aligned source rows, a
// block walks its work items b = blockIdx.x, + gridDim.x, ... and copies the tiles of item
// b + gridDim.x into the second of two shared buffers (cp.async, zero-filled outside the source)
// while it computes item b: the copies' round trip overlaps the arithmetic instead of
// serializing with it. The arithmetic and its order are those of the kernels above.

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool inside) {
  const unsigned address = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(src),
               "r"(inside ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_one() {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

// stage_tile_vectors with cp.async: the vectors of the tile are queued, not waited for.
template <class T>
__device__ __forceinline__ void stage_tile_async(T* tile, const T* __restrict__ source,
                                                 int height, int width, int u0, int v0,
                                                 int tile_rows, int tile_cols, int pitch, int tid,
                                                 int threads) {
  constexpr int kVector = 16 / int(sizeof(T));
  const int vectors = (tile_cols + kVector - 1) / kVector;
  const int col_threads = min(threads, vectors), row_threads = threads / col_threads;
  if (tid >= col_threads * row_threads) return;
  const int first_row = tid / col_threads;
  for (int j = tid - first_row * col_threads; j < vectors; j += col_threads) {
    const int col = v0 + j * kVector;
    const bool inside = col >= 0 && col < width;  // whole vectors are inside or outside
    const T* src = source + (inside ? col : 0);
    T* dst = tile + j * kVector;
    for (int a = first_row; a < tile_rows; a += row_threads) {
      const int u = u0 + a;
      const bool in = inside && unsigned(u) < unsigned(height);
      cp_async_16(dst + a * pitch, in ? src + int64_t(u) * width : source, in);
    }
  }
}

// A thread's share of staging `parts` tiles of tile_rows x `vectors` 16-byte vectors at once
// (split_block's split, then stage_tile_vectors' columns x rows), fixed for the whole kernel.
struct AsyncStager {
  int part;                   // the tile this thread stages (>= parts: none)
  int first_row, row_step;    // rows first_row, + row_step, ...
  int first_vec, vec_step;    // vectors first_vec, + vec_step, ...
};

__device__ __forceinline__ AsyncStager make_stager(int parts, int vectors) {
  AsyncStager st;
  const int threads = int(blockDim.x) / parts;
  st.part = int(threadIdx.x) / threads;
  const int tid = int(threadIdx.x) - st.part * threads;
  const int col_threads = min(threads, vectors), row_threads = threads / col_threads;
  if (tid >= col_threads * row_threads) st.part = parts;  // idle
  st.first_row = tid / col_threads;
  st.first_vec = tid - st.first_row * col_threads;
  st.row_step = row_threads;
  st.vec_step = col_threads;
  return st;
}

// This thread's cp.async copies of one tile (see stage_tile_async).
template <class T>
__device__ __forceinline__ void stage_async(const AsyncStager& st, T* tile,
                                            const T* __restrict__ source, int height, int width,
                                            int u0, int v0, int tile_rows, int vectors,
                                            int pitch) {
  constexpr int kVector = 16 / int(sizeof(T));
  for (int j = st.first_vec; j < vectors; j += st.vec_step) {
    const int col = v0 + j * kVector;
    const bool inside = col >= 0 && col < width;
    const T* src = source + (inside ? col : 0);
    T* dst = tile + j * kVector;
    for (int a = st.first_row; a < tile_rows; a += st.row_step) {
      const int u = u0 + a;
      const bool in = inside && unsigned(u) < unsigned(height);
      cp_async_16(dst + a * pitch, in ? src + int64_t(u) * width : source, in);
    }
  }
}

// Where item b of a stencil grid lies: its first plane and the origin of its output tile.
struct StencilItem {
  int first_plane, y0, x0;
};

__device__ __forceinline__ StencilItem stencil_item(const StencilGrid& G, int b, int tile_h,
                                                    int tile_w) {
  const int tiles_per_plane = int(G.tiles_x * G.tiles_y);
  StencilItem it;
  if (tiles_per_plane == 1) {  // whole planes (the common case): no divisions
    it.first_plane = b * G.bz;
    it.y0 = 0;
    it.x0 = G.x_base;
  } else {
    const int tile = b % tiles_per_plane;
    it.first_plane = (b / tiles_per_plane) * G.bz;
    it.y0 = (tile / int(G.tiles_x)) * tile_h;
    it.x0 = G.x_base + (tile % int(G.tiles_x)) * tile_w;
  }
  return it;
}

// Queues this thread's share of the source tiles of item `it` into `buffer` (bz tiles of
// tile_stride elements).
template <class T>
__device__ __forceinline__ void stage_item_async(const StencilGrid& G, const AsyncStager& st,
                                                 const T* __restrict__ source,
                                                 const StencilItem& it, T* buffer) {
  const int plane = it.first_plane + st.part;
  if (st.part >= G.bz || plane >= G.planes) return;
  // Depthwise (one source plane per output plane, as many): the source plane is the plane.
  const bool same = G.in_channels == G.out_channels && G.out_per_group == 1;
  const int64_t source_plane = same ? int64_t(plane) : G.source_plane(plane, 0);
  constexpr int kVector = 16 / int(sizeof(T));
  stage_async(st, buffer + st.part * G.tile_stride,
              source + source_plane * (G.rows.source * G.cols.source), int(G.rows.source),
              int(G.cols.source), int(G.rows.position(it.y0, 0)), int(G.cols.position(it.x0, 0)),
              G.src_rows, (G.src_cols + kVector - 1) / kVector, G.pitch);
}

// Loads the kTaps x kTaps weights of a stencil plane from w (the plane's tap (0, 0)), with
// immediate offsets in the depthwise layouts (forward: row kTaps, col 1; dgrad: flipped).
template <int kTaps, class T, class F>
__device__ __forceinline__ void for_each_tap(const StencilWeights& W, const T* w, const F& f) {
  const auto run = [&](auto sign) {
#pragma unroll
    for (int r = 0; r < kTaps; ++r)
#pragma unroll
      for (int t = 0; t < kTaps; ++t) {
        if constexpr (decltype(sign)::value == 0)
          f(r, t, w[r * W.row + t * W.col]);
        else
          f(r, t, w[decltype(sign)::value * (r * kTaps + t)]);
      }
  };
  if (W.col == 1 && W.row == kTaps)
    run(std::integral_constant<int, 1>{});
  else if (W.col == -1 && W.row == -kTaps)
    run(std::integral_constant<int, -1>{});
  else
    run(std::integral_constant<int, 0>{});
}

// stencil_strip_kernel for in_per_group == 1 and G.vector_source, pipelined.
template <class T, int kTaps, int kRows>
__global__ void __launch_bounds__(kMaxThreads, strip_blocks_per_sm<T>())
    stencil_strip_pipe_kernel(const T* __restrict__ source, const T* __restrict__ weight,
                              const T* __restrict__ bias, T* __restrict__ out, const StencilGrid G) {
  constexpr int kSpan = strip_span(kTaps);
  extern __shared__ __align__(16) unsigned char shared_memory[];
  T* const tiles = reinterpret_cast<T*>(shared_memory);
  const int buffer = G.bz * G.tile_stride;
  const int plane_threads = G.bx * G.by;
  const int z = threadIdx.x / plane_threads;
  const int t = threadIdx.x - z * plane_threads;
  const int tx = t % G.bx, ty = t / G.bx;
  const bool slot = z < G.bz;
  const T* const strip =
      tiles + (slot ? z : 0) * G.tile_stride + ty * kRows * G.pitch + tx * kStripCols;
  const int64_t out_plane = G.rows.out * G.cols.out;
  const int tile_h = G.by * kRows, tile_w = G.bx * kStripCols;
  const AsyncStager st = make_stager(G.bz, (G.src_cols + 16 / int(sizeof(T)) - 1) / (16 / int(sizeof(T))));

  int b = blockIdx.x;
  StencilItem it = stencil_item(G, b, tile_h, tile_w);
  if (b < G.blocks) stage_item_async(G, st, source, it, tiles);
  cp_async_commit();
  for (int k = 0; b < G.blocks; b += gridDim.x, k ^= 1) {
    const int nb = b + gridDim.x;
    const StencilItem next = stencil_item(G, nb, tile_h, tile_w);
    if (nb < G.blocks) stage_item_async(G, st, source, next, tiles + (k ^ 1) * buffer);
    cp_async_commit();
    const int plane = it.first_plane + z;
    const bool live = slot && plane < G.planes;
    const int oc = plane % int(G.out_channels);
    const int g = oc / int(G.out_per_group), o = oc % int(G.out_per_group);
    const T start = (live && bias != nullptr) ? bias[oc] : T(0);
    T acc[kRows][kStripCols];
#pragma unroll
    for (int j = 0; j < kRows; ++j)
#pragma unroll
      for (int c = 0; c < kStripCols; ++c) acc[j][c] = start;
    T wr[kTaps][kTaps];
    if (live)
      for_each_tap<kTaps>(G.weights, weight + G.weights.offset(g, o, 0, 0, 0),
                          [&](int r, int s, T v) { wr[r][s] = v; });
    cp_async_wait_one();  // this thread's copies of item b have landed
    __syncthreads();      // and everyone's
    if (live) {
      const T* my_strip = strip + k * buffer;
#pragma unroll
      for (int d = 0; d < kRows + kTaps - 1; ++d) {
        T v[kSpan];
        load_span(my_strip + d * G.pitch, v);
#pragma unroll
        for (int r = 0; r < kTaps; ++r) {
          const int j = d - r;
          if (j < 0 || j >= kRows) continue;
#pragma unroll
          for (int s = 0; s < kTaps; ++s)
#pragma unroll
            for (int c = 0; c < kStripCols; ++c) acc[j][c] += wr[r][s] * v[c + s];
        }
      }
      const int x = it.x0 + tx * kStripCols;
      T* dst = out + plane * out_plane;
      // Columns all inside but not a vector (the tiles start one column early): plain stores.
      const bool interior = !G.vector_out && x >= 0 && x + kStripCols <= G.cols.out;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int y = it.y0 + ty * kRows + j;
        if (y >= G.rows.out) continue;
        T* row = dst + int64_t(y) * G.cols.out;
        if (interior) {
#pragma unroll
          for (int c = 0; c < kStripCols; ++c) row[x + c] = acc[j][c];
        } else {
          store_four(row, x, G.cols.out, G.vector_out, acc[j]);
        }
      }
    }
    __syncthreads();  // buffer k has been consumed: the next iteration refills it
    it = next;
  }
}

// Two adjacent outputs of a half type as one packed pair (round to nearest even; the same bits
// as from_acc except for the payload of NaNs).
template <class T>
__device__ __forceinline__ uint32_t pack_outputs(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<T, bfloat16>)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Elements between the rows of stencil_mma_pipe_kernel's output staging tile: the tile's
// 8 * nt columns start d = x_base mod 8 columns in (so that output columns 8j fall on 16-byte
// vectors), rounded up to whole vectors with pitch / 8 odd (8 rows of 16 bytes hit 8 different
// groups of 4 banks).
__host__ __device__ constexpr int mma_stage_pitch(int nt) {
  return (8 * nt + 8) % 16 == 0 ? 8 * nt + 16 : 8 * nt + 8;
}

// stencil_mma_kernel for in_per_group == 1 and G.vector_source, pipelined (cp.async double
// buffer, persistent blocks). The same units, each the same chain of kTaps mma (hence the same
// bits), but:
// - kChains units of a warp at a time, their chains issued alternately (independent
//   accumulators): the dependent-mma latency is paid once per kChains units;
// - the accumulators go (packed) to a staging tile in shared memory instead of global memory;
//   after the block's barrier, the plane's threads write the tile out as 16-byte vectors of
//   whole output rows (element by element where a vector straddles the tile's edge or the rows
//   are not 16-byte aligned). That barrier also ends every read of the item's source buffer, so
//   the next item's prefetch may overwrite it: still two barriers per item.
template <class T, int kTaps, int kChains>
__global__ void __launch_bounds__(kMmaThreads, kMmaPipeBlocks)
    stencil_mma_pipe_kernel(const T* __restrict__ source, const T* __restrict__ weight,
                             const T* __restrict__ bias, T* __restrict__ out,
                             const StencilGrid G) {
  extern __shared__ __align__(16) unsigned char shared_memory[];
  T* const tiles = reinterpret_cast<T*>(shared_memory);
  const int buffer = G.bz * G.tile_stride;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const int z = warp / G.warps_per_plane, wp = warp - z * G.warps_per_plane;
  const bool slot = z < G.bz;
  const T* const lane_row = tiles + (slot ? z : 0) * G.tile_stride +
                            ((lane & 7) + 8 * ((lane >> 3) & 1)) * G.pitch + 8 * (lane >> 4);
  const int64_t out_plane = G.rows.out * G.cols.out;
  const int tile_h = 16 * G.mt, tile_w = 8 * G.nt;
  const AsyncStager st = make_stager(G.bz, (G.src_cols + 7) / 8);
  // The output staging tile of the thread's plane (after the two source buffers) and the lane's
  // place in a unit: output (g + 8h, 2q + e) of unit (mi, ni) at row 16 mi + g + 8h, column
  // d + 8 ni + 2q + e.
  const int spitch = mma_stage_pitch(G.nt);
  const int d = G.x_base & 7;  // x_base in (-8, 0]
  T* const stage = tiles + 2 * buffer + (slot ? z : 0) * tile_h * spitch;
  T* const lane_stage = stage + g * spitch + 2 * q + d;
  const int wrap_staged = 16 * spitch - 8 * G.nt;
  // Output tile u = wp + k * warps_per_plane is (u / nt, u % nt), walked without divisions
  // (warps_per_plane <= nt: one wrap at most), with the offsets of its source window (in the
  // item's buffer) and of its staging.
  const int wrap_window = 16 * G.pitch - 8 * G.nt;
  const auto next_unit = [&](int& mi, int& ni, int& window, int& staged) {
    ni += G.warps_per_plane;
    window += 8 * G.warps_per_plane;
    staged += 8 * G.warps_per_plane;
    if (ni >= G.nt) {
      ni -= G.nt;
      ++mi;
      window += wrap_window;
      staged += wrap_staged;
    }
  };
  const int first_mi = wp / G.nt, first_ni = wp % G.nt;
  const int first_window = 16 * first_mi * G.pitch + 8 * first_ni;
  const int first_staged = 16 * first_mi * spitch + 8 * first_ni;
  // The thread's share of writing the staging tile out: vectors (8 columns) first_vec,
  // + vec_step, ... of rows first_row, + row_step, ... (fixed for the kernel).
  const int plane_threads = 32 * G.warps_per_plane;
  const int ptid = int(threadIdx.x) - z * plane_threads;
  const int vecs = G.nt + 1;
  const int vec_step = min(plane_threads, vecs), row_step = plane_threads / vec_step;
  const int first_row = ptid / vec_step;
  const int first_vec = ptid < vec_step * row_step ? ptid - first_row * vec_step : vecs;
  // The lane's B-fragment taps (see stencil_mma_kernel): tap column s[e] of each tap row.
  int tap[4];
  bool in_taps[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    tap[e] = 2 * q + 8 * (e >> 1) + (e & 1) - g;
    in_taps[e] = tap[e] >= 0 && tap[e] < kTaps;
  }
  // The depthwise layouts: weight (r, s) at w + sign * (r * kTaps + s); 0: general strides.
  const int sign = (G.weights.col == 1 && G.weights.row == kTaps)     ? 1
                   : (G.weights.col == -1 && G.weights.row == -kTaps) ? -1
                                                                      : 0;

  // The lane's B-fragment weights of item `item` (zeros outside the taps, or where the thread's
  // plane is past the last).
  const auto fetch_weights = [&](const StencilItem& item, T (&raw)[kTaps][4]) {
    const int plane = item.first_plane + z;
    const bool live = slot && plane < G.planes;
    const int oc = plane % int(G.out_channels);
    const int grp = oc / int(G.out_per_group), o = oc % int(G.out_per_group);
    const T* w = weight + (live ? G.weights.offset(grp, o, 0, 0, 0) : 0);
    const auto load = [&](auto fixed) {
      constexpr int kSign = decltype(fixed)::value;
      const T* base[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        base[e] = w + (kSign != 0 ? kSign * tap[e] : tap[e] * int(G.weights.col));
#pragma unroll
      for (int r = 0; r < kTaps; ++r)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          raw[r][e] = live && in_taps[e]
                          ? base[e][kSign != 0 ? kSign * r * kTaps : r * int(G.weights.row)]
                          : T{};
    };
    if (sign == 1)
      load(std::integral_constant<int, 1>{});
    else if (sign == -1)
      load(std::integral_constant<int, -1>{});
    else
      load(std::integral_constant<int, 0>{});
  };
  // The next item's weights are loaded after the current item's mma, so that their latency
  // overlaps its barrier and write-out instead of stalling the item's start.
  T wraw[kTaps][4];

  int b = blockIdx.x;
  StencilItem it = stencil_item(G, b, tile_h, tile_w);
  fetch_weights(it, wraw);
  if (b < G.blocks) stage_item_async(G, st, source, it, tiles);
  cp_async_commit();
  for (int kb = 0; b < G.blocks; b += gridDim.x, kb ^= 1) {
    const int nb = b + gridDim.x;
    const StencilItem next = stencil_item(G, nb, tile_h, tile_w);
    if (nb < G.blocks) stage_item_async(G, st, source, next, tiles + (kb ^ 1) * buffer);
    cp_async_commit();
    const int plane = it.first_plane + z;
    const bool live = slot && plane < G.planes;
    const int oc = plane % int(G.out_channels);
    const float start = (live && bias != nullptr) ? to_acc(bias[oc]) : 0.f;
    uint32_t bfrag[kTaps][2];
#pragma unroll
    for (int r = 0; r < kTaps; ++r) {
      bfrag[r][0] = pack_pair(wraw[r][0], wraw[r][1]);
      bfrag[r][1] = pack_pair(wraw[r][2], wraw[r][3]);
    }
    cp_async_wait_one();
    __syncthreads();  // the item's source tiles are in; the previous item's staging is written out
    if (live) {
      const T* const my_row = lane_row + kb * buffer;
      int mi = first_mi, ni = first_ni, wnext = first_window, snext = first_staged;
#pragma unroll
      for (int k = 0; k < kMmaUnits; k += kChains) {
        if (mi >= G.mt) break;
        // The chains' units; a unit past the tile repeats the first one's window (its result
        // is not stored), so that the chains stay branch-free.
        int window[kChains], staged[kChains];
        bool valid[kChains];
#pragma unroll
        for (int c = 0; c < kChains; ++c) {
          valid[c] = mi < G.mt;
          window[c] = (c == 0 || valid[c]) ? wnext : window[0];
          staged[c] = snext;
          next_unit(mi, ni, wnext, snext);
        }
        float acc[kChains][4];
#pragma unroll
        for (int c = 0; c < kChains; ++c)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[c][e] = start;
#pragma unroll
        for (int r = 0; r < kTaps; ++r) {
          uint32_t a[kChains][4];
#pragma unroll
          for (int c = 0; c < kChains; ++c) load_fragment(a[c], my_row + window[c] + r * G.pitch);
#pragma unroll
          for (int c = 0; c < kChains; ++c) mma_16x8x16<T>(acc[c], a[c], bfrag[r]);
        }
        // The lane holds outputs (g, 2q + e) in acc[c][e] and (g + 8, 2q + e) in acc[c][2 + e].
#pragma unroll
        for (int c = 0; c < kChains; ++c) {
          if (c > 0 && !valid[c]) continue;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t pair = pack_outputs<T>(acc[c][2 * h], acc[c][2 * h + 1]);
            T* const s = lane_stage + staged[c] + 8 * h * spitch;
            if (d & 1) {
              s[0] = T{uint16_t(pair & 0xffffu)};
              s[1] = T{uint16_t(pair >> 16)};
            } else {
              *reinterpret_cast<uint32_t*>(s) = pair;
            }
          }
        }
      }
    }
    if (nb < G.blocks) fetch_weights(next, wraw);
    __syncthreads();  // the staging tiles are complete, and every read of buffer kb is done
    if (live) {
      // Staging column j of the tile is output column xs + j (xs a multiple of 8); the item's
      // outputs are columns [c0, c1) of rows y0 .. y0 + rows - 1.
      const int xs = it.x0 - d;
      const int rows = min(tile_h, int(G.rows.out) - it.y0);
      const int c0 = max(it.x0, 0), c1 = min(it.x0 + tile_w, int(G.cols.out));
      T* const dst_plane = out + plane * out_plane + int64_t(it.y0) * G.cols.out;
      for (int j = first_vec; j < vecs; j += vec_step) {
        const int c = xs + 8 * j;
        if (c + 8 <= c0 || c >= c1) continue;
        const bool whole = G.vector_out16 && c >= c0 && c + 8 <= c1;
        const T* src = stage + first_row * spitch + 8 * j;
        T* dst = dst_plane + int64_t(first_row) * G.cols.out + c;
        for (int a = first_row; a < rows; a += row_step) {
          const uint4 v = *reinterpret_cast<const uint4*>(src);
          if (whole) {
            *reinterpret_cast<uint4*>(dst) = v;
          } else {
            const uint32_t word[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int e = 0; e < 8; ++e)
              if (c + e >= c0 && c + e < c1)
                dst[e] = T{uint16_t(word[e >> 1] >> (16 * (e & 1)))};
          }
          src += row_step * spitch;
          dst += int64_t(row_step) * G.cols.out;
        }
      }
    }
    it = next;
  }
}

// Any geometry: a block covers bz planes x one tile of (by * kRows) x bx outputs; thread
// (tx, ty) of a plane computes rows ty * kRows .. + kRows - 1 of column tx, with run-time loops
// over the taps.
template <class T, int kRows>
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
  A* const tiles = reinterpret_cast<A*>(shared_memory);
  const A* tile = tiles + (slot ? z : 0) * G.tile_stride;
  const int64_t tiles_per_plane = G.tiles_x * G.tiles_y;
  const int64_t source_plane = G.rows.source * G.cols.source;
  const int64_t out_plane = G.rows.out * G.cols.out;

  for (int64_t b = blockIdx.x; b < G.blocks; b += gridDim.x) {
    const int64_t first_plane = (b / tiles_per_plane) * G.bz;
    const int64_t plane = first_plane + z;
    const bool live = slot && plane < G.planes;
    const int64_t t = b % tiles_per_plane;
    const int64_t y0 = (t / G.tiles_x) * (int64_t(G.by) * kRows), x0 = (t % G.tiles_x) * G.bx;
    const int64_t oc = plane % G.out_channels;
    const int64_t g = oc / G.out_per_group, o = oc % G.out_per_group;
    const int64_t u0 = G.rows.position(y0, 0), v0 = G.cols.position(x0, 0);
    const A start = (live && bias != nullptr) ? to_acc(bias[oc]) : A(0);
    A acc[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j) acc[j] = start;

    for (int64_t i = 0; i < G.in_per_group; ++i) {
      __syncthreads();  // the previous tiles have been consumed
      split_block(int(std::min<int64_t>(G.bz, G.planes - first_plane)),
                  [&](int zz, int tid, int threads) {
                    const int64_t p = first_plane + zz, n = p / G.out_channels;
                    const int64_t channel =
                        n * G.in_channels + (p % G.out_channels / G.out_per_group) * G.in_per_group + i;
                    stage_tile<8, A>(tiles + zz * G.tile_stride, source + channel * source_plane,
                                     G.rows, G.cols, u0, v0, G.src_rows, G.src_cols, G.pitch, tid,
                                     threads);
                  });
      __syncthreads();
      if (live) {
        const T* w = weight + G.weights.offset(g, o, i, 0, 0);
        const int R = int(G.rows.taps), S = int(G.cols.taps);
        for (int r = 0; r < R; ++r)
          for (int s = 0; s < S; ++s) {
            const A wv = to_acc(w[r * G.weights.row + s * G.weights.col]);
            const A* column = tile + int(r * G.rows.dilation) * G.pitch +
                              int(tx * G.cols.stride + s * G.cols.dilation);
#pragma unroll
            for (int j = 0; j < kRows; ++j)
              acc[j] += wv * column[int((ty * kRows + j) * G.rows.stride) * G.pitch];
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

// Tile sizes of a stencil or weight-gradient pass: bx threads of `cols_per_thread` columns (at
// most 64 columns, balanced over the column tiles) x by strips of `rows_per_thread` rows, at most
// kMaxThreads threads.
struct TileShape {
  int bx, by;
  int64_t tiles_x, tiles_y;
};

TileShape choose_tile(int64_t out_rows, int64_t out_cols, int rows_per_thread,
                      int cols_per_thread, int max_by) {
  TileShape t;
  const int64_t thread_cols = ceil_div(std::max<int64_t>(out_cols, 1), cols_per_thread);
  t.tiles_x = ceil_div(thread_cols, 64 / cols_per_thread);
  t.bx = int(ceil_div(thread_cols, t.tiles_x));
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

// Of the strip heights 7 and 8, the one that computes fewer rows beyond the output, 7 on a tie
// (7 fits the 56/28/14/7 planes of ImageNet networks, 8 the powers of two).
int strip_rows(int64_t out_rows, int64_t out_cols) {
  const auto computed = [&](int rows) {
    const TileShape t = choose_tile(out_rows, out_cols, rows, kStripCols, kMaxThreads);
    return t.tiles_y * t.by * rows;
  };
  return computed(7) <= computed(8) ? 7 : 8;
}

// The shared tile of a strip kernel: its row pitch and the stride between tiles, in elements.
// Thread t = ty * bx + tx of a plane reads 16-byte vector ty * rows * pitch / 4 + tx (+ the same
// for all) of its tile; with rows * pitch / 4 = bx and stride / 4 = bx * by (mod 8), each group
// of 8 consecutive threads hits 8 different groups of 4 banks: the reads are conflict-free.
struct StripTile {
  int rows, cols, pitch, stride;
};

StripTile strip_tile(int bx, int by, int rows, int taps) {
  StripTile s;
  s.rows = by * rows + taps - 1;
  s.cols = bx * kStripCols + taps - 1;
  const int min_pitch = std::max(s.cols, (bx - 1) * kStripCols + strip_span(taps));
  const auto fit = [](int min_elements, int product, int target) {
    const int first = int(ceil_div(min_elements, 4));
    for (int p = first; p < first + 8; ++p)
      if ((product * p - target) % 8 == 0) return 4 * p;
    return 4 * first;
  };
  s.pitch = fit(min_pitch, rows, bx);
  s.stride = fit(s.rows * s.pitch, 1, bx * by);
  return s;
}

bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The unrolled kernels index planes and blocks in 32 bits.
bool fits_32_bits(const StencilGrid& G) {
  return G.planes < INT_MAX && G.blocks < INT_MAX && G.rows.out < INT_MAX &&
         G.cols.out < INT_MAX;
}

// Whether a stencil's source rows are whole 16-byte vectors of T (stage_tile_vectors applies
// when the source is also aligned).
template <class T>
bool vector_rows(const StencilGrid& G) {
  return G.rows.upsample == 1 && G.cols.upsample == 1 &&
         G.cols.source % (16 / int64_t(sizeof(T))) == 0;
}

// Fills G's tile for the strip kernel; false when no tile fits in shared memory.
template <class T>
bool plan_stencil_strips(StencilGrid& G, const T* source, const T* out, int taps, int rows) {
  G.x_base = vector_rows<T>(G) ? aligned_column_base(G.cols.pad, 16 / int(sizeof(T))) : 0;
  G.vector_source = vector_rows<T>(G) && aligned_to(source, 16);
  G.vector_out = G.x_base % 4 == 0 && G.cols.out % 4 == 0 && aligned_to(out, 4 * sizeof(T));
  for (int max_by = kMaxThreads; max_by >= 1; max_by /= 2) {
    const TileShape t = choose_tile(G.rows.out, G.cols.out - G.x_base, rows, kStripCols, max_by);
    const StripTile s = strip_tile(t.bx, t.by, rows, taps);
    const int64_t tile_bytes = int64_t(s.stride) * int64_t(sizeof(T));
    if (tile_bytes > kSharedBytes) continue;
    G.bx = t.bx;
    G.by = t.by;
    G.tiles_x = t.tiles_x;
    G.tiles_y = t.tiles_y;
    G.src_rows = s.rows;
    G.src_cols = s.cols;
    G.pitch = s.pitch;
    G.tile_stride = s.stride;
    // Several planes per block, up to kMaxThreads threads.
    G.bz = int(std::clamp<int64_t>(kMaxThreads / (t.bx * t.by), 1,
                                   std::min<int64_t>(G.planes, kSharedBytes / tile_bytes)));
    G.blocks = ceil_div(G.planes, G.bz) * G.tiles_x * G.tiles_y;
    return fits_32_bits(G);
  }
  return false;
}

// Fills G's tile for the tensor-core kernel: up to 64 x 64 outputs per plane (4 x 8 tiles of
// 16 x 8); false when it does not fit.
template <class T>
bool plan_stencil_mma(StencilGrid& G, const T* source, const T* out, int taps) {
  G.x_base = vector_rows<T>(G) ? aligned_column_base(G.cols.pad, 8) : 0;
  G.vector_source = vector_rows<T>(G) && aligned_to(source, 16);
  G.vector_out = G.x_base % 2 == 0 && G.cols.out % 2 == 0 && aligned_to(out, 2 * sizeof(T));
  G.vector_out16 = G.cols.out % (16 / int(sizeof(T))) == 0 && aligned_to(out, 16);
  const int64_t cols = G.cols.out - G.x_base;
  G.mt = int(std::min<int64_t>(ceil_div(G.rows.out, 16), 4));
  G.nt = int(std::min<int64_t>(ceil_div(cols, 8), 8));
  G.tiles_y = ceil_div(G.rows.out, 16 * G.mt);
  G.tiles_x = ceil_div(cols, 8 * G.nt);
  G.src_rows = 16 * G.mt + taps - 1;
  G.src_cols = 8 * G.nt + 8;  // a 16-column window starts at every 8th output column
  // Rows 16-byte aligned, and pitch / 8 odd: the 8 rows of each ldmatrix hit 8 different
  // groups of 4 banks.
  G.pitch = int(round_up(G.src_cols, 8));
  if (G.pitch % 16 == 0) G.pitch += 8;
  G.tile_stride = G.src_rows * G.pitch;
  G.warps_per_plane = int(ceil_div(G.mt * G.nt, kMmaUnits));
  const int64_t tile_bytes = int64_t(G.tile_stride) * int64_t(sizeof(T));
  G.bz = int(std::clamp<int64_t>(kMmaThreads / (32 * G.warps_per_plane), 1,
                                 std::min<int64_t>(G.planes, kSharedBytes / tile_bytes)));
  G.blocks = ceil_div(G.planes, G.bz) * G.tiles_x * G.tiles_y;
  return tile_bytes <= kSharedBytes && fits_32_bits(G);
}

template <class T, int kTaps, int kRows>
void launch_stencil_strips(cudaStream_t stream, const T* source, const T* weight, const T* bias,
                           T* out, const StencilGrid& G) {
  const int threads = int(round_up(int64_t(G.bx) * G.by * G.bz, 32));
  const unsigned blocks = unsigned(std::min<int64_t>(G.blocks, int64_t(1) << 30));
  const size_t shared = size_t(G.bz) * size_t(G.tile_stride) * sizeof(T);
  stencil_strip_kernel<T, kTaps, kRows>
      <<<blocks, threads, shared, stream>>>(source, weight, bias, out, G);
}

template <class T, int kTaps>
void launch_stencil_mma(cudaStream_t stream, const T* source, const T* weight, const T* bias,
                        T* out, const StencilGrid& G) {
  const int threads = 32 * G.warps_per_plane * G.bz;
  const unsigned blocks = unsigned(std::min<int64_t>(G.blocks, int64_t(1) << 30));
  const size_t shared = size_t(G.bz) * size_t(G.tile_stride) * sizeof(T);
  stencil_mma_kernel<T, kTaps><<<blocks, threads, shared, stream>>>(source, weight, bias, out, G);
}

// The pipelined kernels' launches: as many blocks as stay resident (persistent blocks), two
// shared buffers each.
template <class Kernel>
unsigned launch_pipelined(Kernel kernel, int blocks_per_sm, int64_t items, size_t shared) {
  // Always: with a kernel's static shared memory, even 48 KiB of dynamic memory needs opting in.
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  return unsigned(std::min<int64_t>(items, int64_t(multiprocessor_count()) * blocks_per_sm));
}

template <class T, int kTaps, int kRows>
void launch_stencil_strips_pipe(cudaStream_t stream, const T* source, const T* weight,
                                const T* bias, T* out, const StencilGrid& G) {
  const int threads = int(round_up(int64_t(G.bx) * G.by * G.bz, 32));
  const size_t shared = 2 * size_t(G.bz) * size_t(G.tile_stride) * sizeof(T);
  const auto kernel = stencil_strip_pipe_kernel<T, kTaps, kRows>;
  const unsigned blocks = launch_pipelined(kernel, strip_blocks_per_sm<T>(), G.blocks, shared);
  kernel<<<blocks, threads, shared, stream>>>(source, weight, bias, out, G);
}

template <class T, int kTaps>
void launch_stencil_mma_pipe(cudaStream_t stream, const T* source, const T* weight, const T* bias,
                             T* out, const StencilGrid& G) {
  const int threads = 32 * G.warps_per_plane * G.bz;
  // Two source buffers, then the output staging tiles.
  const size_t shared = (2 * size_t(G.bz) * size_t(G.tile_stride) +
                         size_t(G.bz) * size_t(16 * G.mt) * size_t(mma_stage_pitch(G.nt))) *
                        sizeof(T);
  const auto kernel = stencil_mma_pipe_kernel<T, kTaps, kMmaChains>;
  const unsigned blocks = launch_pipelined(kernel, kMmaPipeBlocks, G.blocks, shared);
  kernel<<<blocks, threads, shared, stream>>>(source, weight, bias, out, G);
}

// The stencil of the forward (y from x) and of the dgrad (dx from dy with the flipped filter):
// what it reads and writes; run_stencil fills in the launch shape.
StencilGrid forward_grid(const ConvProblem& p) {
  StencilGrid G{};
  G.rows = forward_rows(p);
  G.cols = forward_cols(p);
  G.weights = forward_weights(p);
  G.planes = p.N * p.K;
  G.out_channels = p.K;
  G.in_channels = p.C;
  G.in_per_group = p.channels_per_group();
  G.out_per_group = p.filters_per_group();
  return G;
}

StencilGrid backward_data_grid(const ConvProblem& p) {
  StencilGrid G{};
  G.rows = backward_data_rows(p);
  G.cols = backward_data_cols(p);
  G.weights = backward_data_weights(p);
  G.planes = p.N * p.C;
  G.out_channels = p.C;
  G.in_channels = p.K;
  G.in_per_group = p.filters_per_group();
  G.out_per_group = p.channels_per_group();
  return G;
}

// The pipelined kernels apply: one source plane per output plane, staged as whole vectors.
bool pipelined(const StencilGrid& G) {
#ifdef JK_DW_NO_PIPE
  return false;
#else
  return G.in_per_group == 1 && G.vector_source;
#endif
}

template <class T>
ffi::Error run_stencil(cudaStream_t stream, const char* op, const T* source, const T* weight,
                       const T* bias, T* out, StencilGrid G) {
  using A = acc_t<T>;
  if (G.planes * G.rows.out * G.cols.out == 0) return ffi::Error::Success();
  const int taps = unrolled_taps(G.rows, G.cols);
  if constexpr (is_half_type<T>()) {
    if (taps > 0 && plan_stencil_mma(G, source, out, taps)) {
      if (pipelined(G)) {
        if (taps == 3) launch_stencil_mma_pipe<T, 3>(stream, source, weight, bias, out, G);
        if (taps == 5) launch_stencil_mma_pipe<T, 5>(stream, source, weight, bias, out, G);
        if (taps == 7) launch_stencil_mma_pipe<T, 7>(stream, source, weight, bias, out, G);
        return launch_status(op);
      }
      if (taps == 3) launch_stencil_mma<T, 3>(stream, source, weight, bias, out, G);
      if (taps == 5) launch_stencil_mma<T, 5>(stream, source, weight, bias, out, G);
      if (taps == 7) launch_stencil_mma<T, 7>(stream, source, weight, bias, out, G);
      return launch_status(op);
    }
  } else {
    const int rows = taps > 0 ? strip_rows(G.rows.out, G.cols.out) : 0;
    if (taps > 0 && plan_stencil_strips(G, source, out, taps, rows)) {
      if (pipelined(G)) {
        if (rows == 7) {
          if (taps == 3) launch_stencil_strips_pipe<T, 3, 7>(stream, source, weight, bias, out, G);
          if (taps == 5) launch_stencil_strips_pipe<T, 5, 7>(stream, source, weight, bias, out, G);
          if (taps == 7) launch_stencil_strips_pipe<T, 7, 7>(stream, source, weight, bias, out, G);
        } else {
          if (taps == 3) launch_stencil_strips_pipe<T, 3, 8>(stream, source, weight, bias, out, G);
          if (taps == 5) launch_stencil_strips_pipe<T, 5, 8>(stream, source, weight, bias, out, G);
          if (taps == 7) launch_stencil_strips_pipe<T, 7, 8>(stream, source, weight, bias, out, G);
        }
        return launch_status(op);
      }
      if (rows == 7) {
        if (taps == 3) launch_stencil_strips<T, 3, 7>(stream, source, weight, bias, out, G);
        if (taps == 5) launch_stencil_strips<T, 5, 7>(stream, source, weight, bias, out, G);
        if (taps == 7) launch_stencil_strips<T, 7, 7>(stream, source, weight, bias, out, G);
      } else {
        if (taps == 3) launch_stencil_strips<T, 3, 8>(stream, source, weight, bias, out, G);
        if (taps == 5) launch_stencil_strips<T, 5, 8>(stream, source, weight, bias, out, G);
        if (taps == 7) launch_stencil_strips<T, 7, 8>(stream, source, weight, bias, out, G);
      }
      return launch_status(op);
    }
  }
  // Shrink the strips per tile until the shared tile fits.
  for (int max_by = kMaxThreads; max_by >= 1; max_by /= 2) {
    const TileShape t = choose_tile(G.rows.out, G.cols.out, kGenericRows, 1, max_by);
    const int64_t src_rows = (int64_t(t.by) * kGenericRows - 1) * G.rows.stride +
                             (G.rows.taps - 1) * G.rows.dilation + 1;
    const int64_t src_cols =
        (int64_t(t.bx) - 1) * G.cols.stride + (G.cols.taps - 1) * G.cols.dilation + 1;
    const int64_t tile_bytes = src_rows * src_cols * int64_t(sizeof(A));
    if (tile_bytes > kSharedBytes) continue;
    G.bx = t.bx;
    G.by = t.by;
    G.tiles_x = t.tiles_x;
    G.tiles_y = t.tiles_y;
    G.src_rows = int(src_rows);
    G.src_cols = int(src_cols);
    G.pitch = G.src_cols;
    G.tile_stride = G.src_rows * G.src_cols;
    // Small tiles: several planes per block, so that blocks have at least 128 threads.
    G.bz = int(std::clamp<int64_t>(128 / (int64_t(t.bx) * t.by), 1,
                                   std::min<int64_t>(G.planes, kSharedBytes / tile_bytes)));
    G.blocks = ceil_div(G.planes, G.bz) * G.tiles_x * G.tiles_y;
    const int threads = int(round_up(int64_t(G.bx) * G.by * G.bz, 32));
    const unsigned blocks = unsigned(std::min<int64_t>(G.blocks, int64_t(1) << 30));
    stencil_kernel<T, kGenericRows><<<blocks, threads, size_t(G.bz) * size_t(tile_bytes), stream>>>(
        source, weight, bias, out, G);
    return launch_status(op);
  }
  const unsigned blocks = grid_blocks(G.planes * G.rows.out * G.cols.out, kMaxThreads);
  stencil_global_kernel<T><<<blocks, kMaxThreads, 0, stream>>>(source, weight, bias, out, G);
  return launch_status(op);
}

// ---- Backward weight: partial sums per slice of images, then the slices in order ---------------

// The weight gradient's kernel and slices of images. Fixed by the problem's shape and dtype
// (never by the device), so that the sums are the same run to run.
enum class WgradKernel { kGeneric, kStrips, kMma };

struct WgradPlan {
  WgradKernel kernel;
  int taps, rows;          // unrolled taps; strip height of the strip kernel
  TileShape tile;          // strip kernel: its tile; tensor-core kernel: tiles_x/y only
  StripTile strip;
  int x_base;              // strip kernel: first column of the column tiles (see StencilGrid)
  int tile_rows, tile_cols;  // tensor-core kernel: dy tile of tile_rows x tile_cols (16 * k)
  int bz;                  // images of a slice that a block works on at once
  int64_t slices, images;  // slices of `images` images (a multiple of bz)
};

// One of the tensor-core weight gradient's two shared buffers: the x tile and the dy tile with
// taps - 1 zero rows above. Rows are 16-byte aligned with pitch / 8 odd (conflict-free ldmatrix).
struct WgradMmaTiles {
  int x_rows, x_cols, x_pitch, dy_rows, dy_pitch;
  int bytes(int element) const { return (x_rows * x_pitch + dy_rows * dy_pitch) * element; }
};

WgradMmaTiles wgrad_mma_tiles(int tile_rows, int tile_cols, int taps) {
  const auto pitch = [](int cols) {
    const int p = int(round_up(cols, 8));
    return p % 16 == 0 ? p + 8 : p;
  };
  // x columns from the vector below the tile's first source column: up to 7 before it, then the
  // last 16-column window's start + 15 + the last tap column, 7.
  const int x_cols = int(round_up(tile_cols + 14, 8));
  return {tile_rows + taps - 1, x_cols, pitch(x_cols), tile_rows + 2 * (taps - 1),
          pitch(tile_cols)};
}

template <class T>
WgradPlan plan_wgrad(const ConvProblem& p) {
  using A = acc_t<T>;
  WgradPlan plan{};
  const int64_t pairs = p.K * p.channels_per_group();
  if (p.N == 0 || pairs == 0) return plan;
  plan.bz = 1;
  plan.taps = unrolled_taps(forward_rows(p), forward_cols(p));
  const bool small = p.P < INT_MAX && p.Q < INT_MAX;
  if (plan.taps > 0 && small && is_half_type<T>()) {
    plan.kernel = WgradKernel::kMma;
    const int64_t tiles_y = ceil_div(p.P, 64);
    plan.tile_rows = int(ceil_div(p.P, tiles_y));
    // 16, 32 or 64 columns: column steps of 16 that divide the kernel's 4 warps.
    const int64_t col_steps = ceil_div(p.Q, 16);
    plan.tile_cols = int(16 * (col_steps >= 3 ? 4 : col_steps));
    plan.tile.tiles_y = tiles_y;
    plan.tile.tiles_x = ceil_div(p.Q, plan.tile_cols);
  } else if (plan.taps > 0 && small) {
    constexpr int kVector = 16 / int(sizeof(T));
    plan.x_base = p.W % kVector == 0 ? aligned_column_base(p.pad_left, kVector) : 0;
    plan.rows = strip_rows(p.P, p.Q);
    plan.tile = choose_tile(p.P, p.Q - plan.x_base, plan.rows, kStripCols, kMaxThreads);
    plan.strip = strip_tile(plan.tile.bx, plan.tile.by, plan.rows, plan.taps);
    const int64_t tile_bytes = int64_t(plan.strip.stride) * int64_t(sizeof(A));
    if (tile_bytes <= kSharedBytes) {
      plan.kernel = WgradKernel::kStrips;
      plan.bz = int(std::clamp<int64_t>(kMaxThreads / (plan.tile.bx * plan.tile.by), 1,
                                        std::min<int64_t>(p.N, kSharedBytes / tile_bytes)));
    }
  }
  const int64_t blocks = plan.kernel == WgradKernel::kMma      ? kWgradMmaBlocks
                        : plan.kernel == WgradKernel::kStrips ? kWgradStripBlocks
                                                              : kWgradBlocks;
  const int64_t wanted = std::clamp<int64_t>(ceil_div(blocks, pairs), 1, p.N);
  plan.images = round_up(ceil_div(p.N, wanted), plan.bz);
  plan.slices = ceil_div(p.N, plan.images);
  return plan;
}

template <class T>
int64_t wgrad_scratch_bytes(const ConvProblem& p) {
  return plan_wgrad<T>(p).slices * p.K * p.channels_per_group() * p.R * p.S *
         int64_t(sizeof(acc_t<T>));
}

struct WgradGrid {
  ConvProblem p;
  int64_t pairs;               // K * C/g (filter, channel) pairs, pair = k * C/g + c
  int64_t slices, images;      // slices of `images` images
  int64_t tiles_x, tiles_y;
  int bx, by, bz;              // strip kernel: bx threads x by strips of rows, bz images at once
  int src_rows, src_cols;      // strip kernel: the shared tile of x
  int pitch, tile_stride;      // strip kernel: elements between tile rows, and between tiles
  int x_base;                  // strip kernel: first column of the column tiles
  bool vector_x;               // stage_tile_vectors applies to x
  bool vector_dy;              // dy: strip kernel, vectors of 4 aligned; mma, vectors staged
  int tile_rows, tile_cols;    // tensor-core kernel: the dy tile
  WgradMmaTiles mma;           // tensor-core kernel: its shared tiles
  int64_t tap_chunks;          // generic kernel: blocks per (pair, slice), kGenericTaps taps each
};

// Unit stride and dilation, kTaps x kTaps taps, float32/float64. Block (slice, pair); thread
// (z, tx, ty) holds the kTaps^2 sums of the dy register block at rows ty * kRows .. + kRows - 1,
// columns 4 tx .. 4 tx + 3 of every tile of images first + z, first + z + bz, ... of the slice;
// the block's threads stage the bz x tiles (with their halos) in shared memory together.
template <class T, int kTaps, int kRows>
__global__ void __launch_bounds__(kMaxThreads, strip_blocks_per_sm<T>())
    wgrad_strip_kernel(const T* __restrict__ dy, const T* __restrict__ x, T* __restrict__ partial,
                       const WgradGrid G) {
  constexpr int kSpan = strip_span(kTaps);
  extern __shared__ __align__(16) unsigned char shared_memory[];
  T* const tiles = reinterpret_cast<T*>(shared_memory);
  const ConvProblem& p = G.p;
  const int plane_threads = G.bx * G.by;
  const int z = threadIdx.x / plane_threads;
  const int t = threadIdx.x - z * plane_threads;
  const int tx = t % G.bx, ty = t / G.bx;
  const bool slot = z < G.bz;  // threads beyond bz images only round the block up to whole warps
  const T* const strip =
      tiles + (slot ? z : 0) * G.tile_stride + ty * kRows * G.pitch + tx * kStripCols;
  const int64_t Kg = p.filters_per_group(), Cg = p.channels_per_group();
  // The x tile in the stencil form of the forward pass (unit stride here).
  const StencilAxis rows = forward_rows(p), cols = forward_cols(p);
  const int tiles_per_plane = int(G.tiles_x * G.tiles_y);

  for (int64_t b = blockIdx.x; b < G.slices * G.pairs; b += gridDim.x) {
    const int64_t slice = b / G.pairs, pair = b % G.pairs;
    const int64_t k = pair / Cg, c = pair % Cg;
    const int64_t channel = (k / Kg) * Cg + c;
    T acc[kTaps * kTaps];
#pragma unroll
    for (int e = 0; e < kTaps * kTaps; ++e) acc[e] = T(0);
    const int64_t first = slice * G.images, last = std::min(p.N, first + G.images);
    for (int64_t n0 = first; n0 < last; n0 += G.bz) {
      const int64_t n = n0 + z;
      const bool live = slot && n < last;
      for (int tile = 0; tile < tiles_per_plane; ++tile) {
        const int y0 = (tile / int(G.tiles_x)) * (G.by * kRows);
        const int x0 = G.x_base + (tile % int(G.tiles_x)) * (G.bx * kStripCols);
        // This thread's dy block, loaded before staging x so that the loads overlap.
        const int q = x0 + tx * kStripCols, y = y0 + ty * kRows;
        const T* dy_rows = dy + ((n * p.K + k) * p.P + y) * p.Q;
        T d[kRows][kStripCols];
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          const bool inside = live && y + j < p.P;
          load_four(dy_rows + j * p.Q, q, inside ? p.Q : 0, G.vector_dy, d[j]);
        }
        __syncthreads();  // the previous tiles have been consumed
        const int64_t u0 = rows.position(y0, 0), v0 = cols.position(x0, 0);
        split_block(int(std::min<int64_t>(G.bz, last - n0)), [&](int zz, int tid, int threads) {
          const T* x_plane = x + ((n0 + zz) * p.C + channel) * p.H * p.W;
          T* tile_of = tiles + zz * G.tile_stride;
          if (G.vector_x)
            stage_tile_vectors<9>(tile_of, x_plane, p.H, p.W, u0, v0, G.src_rows, G.src_cols,
                                  G.pitch, tid, threads);
          else
            stage_tile<24, T>(tile_of, x_plane, rows, cols, u0, v0, G.src_rows, G.src_cols,
                              G.pitch, tid, threads);
        });
        __syncthreads();
        if (live) {
          // Tile row dd is read by output row j through tap row dd - j.
#pragma unroll
          for (int dd = 0; dd < kRows + kTaps - 1; ++dd) {
            T v[kSpan];
            load_span(strip + dd * G.pitch, v);
#pragma unroll
            for (int r = 0; r < kTaps; ++r) {
              const int j = dd - r;
              if (j < 0 || j >= kRows) continue;
#pragma unroll
              for (int s = 0; s < kTaps; ++s)
#pragma unroll
                for (int cc = 0; cc < kStripCols; ++cc) acc[r * kTaps + s] += d[j][cc] * v[cc + s];
            }
          }
        }
      }
    }
    block_sum(acc, partial + b * (kTaps * kTaps));
  }
}

// wgrad_strip_kernel with its x tiles pipelined (vector_x): persistent blocks walk the steps
// (block item b, images n0 .. n0 + bz - 1, tile) of their items in the same order as
// wgrad_strip_kernel, copying the x tiles of the next step with cp.async into a second shared
// buffer while computing the current one. The sums and their order are wgrad_strip_kernel's.
template <class T, int kTaps, int kRows>
__global__ void __launch_bounds__(kMaxThreads, strip_blocks_per_sm<T>())
    wgrad_strip_pipe_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                            T* __restrict__ partial, const WgradGrid G) {
  constexpr int kSpan = strip_span(kTaps);
  extern __shared__ __align__(16) unsigned char shared_memory[];
  T* const tiles = reinterpret_cast<T*>(shared_memory);
  const int buffer = G.bz * G.tile_stride;
  const ConvProblem& p = G.p;
  const int plane_threads = G.bx * G.by;
  const int z = threadIdx.x / plane_threads;
  const int t = threadIdx.x - z * plane_threads;
  const int tx = t % G.bx, ty = t / G.bx;
  const bool slot = z < G.bz;
  const T* const strip =
      tiles + (slot ? z : 0) * G.tile_stride + ty * kRows * G.pitch + tx * kStripCols;
  const int64_t Kg = p.filters_per_group(), Cg = p.channels_per_group();
  const StencilAxis rows = forward_rows(p), cols = forward_cols(p);
  const int tiles_per_plane = int(G.tiles_x * G.tiles_y);
  const int64_t items = G.slices * G.pairs;

  // A step: block item b, its images from n0, output tile `tile`.
  struct Step {
    int64_t b, n0;
    int tile;
  };
  const auto first_image = [&](int64_t b) { return (b / G.pairs) * G.images; };
  const auto last_image = [&](int64_t b) { return std::min(p.N, first_image(b) + G.images); };
  const auto advance = [&](Step s) {
    if (++s.tile < tiles_per_plane) return s;
    s.tile = 0;
    s.n0 += G.bz;
    if (s.n0 < last_image(s.b)) return s;
    s.b += gridDim.x;
    if (s.b < items) s.n0 = first_image(s.b);
    return s;
  };
  const auto tile_origin = [&](int tile, int& y0, int& x0) {
    y0 = (tile / int(G.tiles_x)) * (G.by * kRows);
    x0 = G.x_base + (tile % int(G.tiles_x)) * (G.bx * kStripCols);
  };
  const auto stage = [&](const Step& s, T* buf) {
    const int64_t pair = s.b % G.pairs, k = pair / Cg, c = pair % Cg;
    const int64_t channel = (k / Kg) * Cg + c;
    int y0, x0;
    tile_origin(s.tile, y0, x0);
    const int u0 = int(rows.position(y0, 0)), v0 = int(cols.position(x0, 0));
    split_block(int(std::min<int64_t>(G.bz, last_image(s.b) - s.n0)),
                [&](int zz, int tid, int threads) {
                  const T* x_plane = x + ((s.n0 + zz) * p.C + channel) * p.H * p.W;
                  stage_tile_async(buf + zz * G.tile_stride, x_plane, int(p.H), int(p.W), u0, v0,
                                   G.src_rows, G.src_cols, G.pitch, tid, threads);
                });
  };

  Step cur{blockIdx.x, 0, 0};
  if (cur.b < items) {
    cur.n0 = first_image(cur.b);
    stage(cur, tiles);
  }
  cp_async_commit();
  T acc[kTaps * kTaps];
#pragma unroll
  for (int e = 0; e < kTaps * kTaps; ++e) acc[e] = T(0);
  for (int kb = 0; cur.b < items; kb ^= 1) {
    const Step next = advance(cur);
    if (next.b < items) stage(next, tiles + (kb ^ 1) * buffer);
    cp_async_commit();
    const int64_t k = (cur.b % G.pairs) / Cg;
    const int64_t n = cur.n0 + z;
    const bool live = slot && n < last_image(cur.b);
    int y0, x0;
    tile_origin(cur.tile, y0, x0);
    const int q = x0 + tx * kStripCols, y = y0 + ty * kRows;
    const T* dy_rows = dy + ((n * p.K + k) * p.P + y) * p.Q;
    T d[kRows][kStripCols];
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const bool inside = live && y + j < p.P;
      load_four(dy_rows + j * p.Q, q, inside ? p.Q : 0, G.vector_dy, d[j]);
    }
    cp_async_wait_one();
    __syncthreads();
    if (live) {
      const T* my_strip = strip + kb * buffer;
#pragma unroll
      for (int dd = 0; dd < kRows + kTaps - 1; ++dd) {
        T v[kSpan];
        load_span(my_strip + dd * G.pitch, v);
#pragma unroll
        for (int r = 0; r < kTaps; ++r) {
          const int j = dd - r;
          if (j < 0 || j >= kRows) continue;
#pragma unroll
          for (int s = 0; s < kTaps; ++s)
#pragma unroll
            for (int cc = 0; cc < kStripCols; ++cc) acc[r * kTaps + s] += d[j][cc] * v[cc + s];
        }
      }
    }
    if (next.b != cur.b) {  // the item's last step: its sums, in block_sum's fixed order
      block_sum(acc, partial + cur.b * (kTaps * kTaps));
#pragma unroll
      for (int e = 0; e < kTaps * kTaps; ++e) acc[e] = T(0);
    } else {
      __syncthreads();  // buffer kb has been consumed: the next step refills it
    }
    cur = next;
  }
}

// Unit stride and dilation, kTaps x kTaps taps, float16/bfloat16, on tensor cores. With v a row
// of the x tile, C[r][s] = sum_{v, x} dy[v - r][x] * x[v][x + s]: for each v and 16 columns
// x0 .. x0 + 15, A[m][k] = dy[v - m][x0 + k] (16 x 16, rows m >= kTaps unused) and
// B[k][n] = x[v][x0 + k + n] (16 x 8, columns n >= kTaps unused) make one m16n8k16 product.
// Persistent blocks walk the steps (item b = (slice, pair), image n of the slice, tile) of their
// items, copying the x and dy tiles of the next step into the second of two shared buffers
// (cp.async where rows are 16-byte vectors, else plain loads) while they compute the current one.
// Warp w takes the 16-column step w % col_steps of every (warps / col_steps)-th row from
// w / col_steps, its products taking four accumulator chains in turn; at an item's end the
// chains, then the warps, are added in a fixed order.
template <class T, int kTaps>
__global__ void __launch_bounds__(kMmaThreads, kWgradMmaBlocksPerSm)
    wgrad_mma_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                     float* __restrict__ partial, const WgradGrid G) {
  constexpr int kWarps = kMmaThreads / 32;
  extern __shared__ __align__(16) unsigned char shared_memory[];
  T* const tiles = reinterpret_cast<T*>(shared_memory);
  __shared__ float sums[kWarps][kTaps * kTaps];
  const WgradMmaTiles& M = G.mma;
  const int x_elements = M.x_rows * M.x_pitch, buffer = x_elements + M.dy_rows * M.dy_pitch;
  const ConvProblem& p = G.p;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const int col_steps = G.tile_cols / 16, row_step = kWarps / col_steps;  // col_steps | kWarps
  const int first_v = warp / col_steps, xs = warp - first_v * col_steps;
  // A: lane l addresses dy row v - m (m = its ldmatrix row), column 8 * (l >> 4); rows m past
  // the taps read row v (their products are never used). B: the lane holds
  // B[2q + e][g] = x[v][x0 + 2q + g + e] and B[2q + 8 + e][g] (plus the tile's column offset).
  const int m = (lane & 7) + 8 * ((lane >> 3) & 1);
  const int a_lane = x_elements + (kTaps - 1 - (m < kTaps ? m : 0) + first_v) * M.dy_pitch +
                     8 * (lane >> 4) + 16 * xs;
  const int b_lane = first_v * M.x_pitch + g + 2 * q + 16 * xs;
  const int64_t Kg = p.filters_per_group(), Cg = p.channels_per_group();
  const StencilAxis rows = forward_rows(p), cols = forward_cols(p);
  const int tiles_per_plane = int(G.tiles_x * G.tiles_y);
  const int64_t items = G.slices * G.pairs;

  struct Step {
    int64_t b, n;
    int tile;
  };
  const auto first_image = [&](int64_t b) { return (b / G.pairs) * G.images; };
  const auto advance = [&](Step s) {
    if (++s.tile < tiles_per_plane) return s;
    s.tile = 0;
    if (++s.n < std::min(p.N, first_image(s.b) + G.images)) return s;
    s.b += gridDim.x;
    if (s.b < items) s.n = first_image(s.b);
    return s;
  };
  // The tile's first dy row and column, rows, and the x columns staged before its first source
  // column (from the 16-byte vector at or before it).
  struct Tile {
    int y0, x0, rows, offset;
  };
  const auto tile_of = [&](int tile) {
    Tile t;
    t.y0 = (tile / int(G.tiles_x)) * G.tile_rows;
    t.x0 = (tile % int(G.tiles_x)) * G.tile_cols;
    t.rows = std::min<int>(G.tile_rows, int(p.P) - t.y0);
    t.offset = int(floor_mod(cols.position(t.x0, 0), 8));
    return t;
  };
  const auto stage = [&](const Step& s, T* x_tile) {
    const int64_t pair = s.b % G.pairs, k = pair / Cg, c = pair % Cg;
    const int64_t channel = (k / Kg) * Cg + c;
    const Tile t = tile_of(s.tile);
    const T* x_plane = x + (s.n * p.C + channel) * p.H * p.W;
    const T* dy_rows_of_tile = dy + ((s.n * p.K + k) * p.P + t.y0) * p.Q;
    const int64_t u0 = rows.position(t.y0, 0), v0 = cols.position(t.x0, 0) - t.offset;
    const int tid = int(threadIdx.x), threads = int(blockDim.x);
    T* const dy_tile = x_tile + x_elements;
    if (G.vector_x)
      stage_tile_async(x_tile, x_plane, int(p.H), int(p.W), int(u0), int(v0),
                       t.rows + kTaps - 1, M.x_cols, M.x_pitch, tid, threads);
    else
      stage_tile<8, T>(x_tile, x_plane, rows, cols, u0, v0, t.rows + kTaps - 1, M.x_cols,
                       M.x_pitch, tid, threads);
    // The tile's dy rows, with kTaps - 1 zero rows above and zeros past its last row (the
    // neighbouring tiles' rows are theirs to count).
    if (G.vector_dy) {
      stage_tile_async(dy_tile, dy_rows_of_tile, t.rows, int(p.Q), -(kTaps - 1), t.x0, M.dy_rows,
                       G.tile_cols, M.dy_pitch, tid, threads);
    } else {
      const StencilAxis dy_rows{t.rows, t.rows, 1, 1, 1, 0, 1};
      const StencilAxis dy_cols{p.Q, p.Q, 1, 1, 1, 0, 1};
      stage_tile<8, T>(dy_tile, dy_rows_of_tile, dy_rows, dy_cols, -(kTaps - 1), t.x0, M.dy_rows,
                       G.tile_cols, M.dy_pitch, tid, threads);
    }
  };
  const auto product = [&](float (&acc)[4], const T* a_row, const T* b_row) {
    uint32_t a[4], bfrag[2];
    load_fragment(a, a_row);
    bfrag[0] = pack_pair(b_row[0], b_row[1]);
    bfrag[1] = pack_pair(b_row[8], b_row[9]);
    mma_16x8x16<T>(acc, a, bfrag);
  };

  Step cur{blockIdx.x, 0, 0};
  if (cur.b < items) {
    cur.n = first_image(cur.b);
    stage(cur, tiles);
  }
  cp_async_commit();
  constexpr int kChains = 4;
  float acc[kChains][4] = {};
  for (int kb = 0; cur.b < items; kb ^= 1) {
    const Step next = advance(cur);
    if (next.b < items) stage(next, tiles + (kb ^ 1) * buffer);
    cp_async_commit();
    const Tile t = tile_of(cur.tile);
    const int steps = t.rows + kTaps - 1;  // x rows v of the tile
    const T* a_row = tiles + kb * buffer + a_lane;
    const T* b_row = tiles + kb * buffer + b_lane + t.offset;
    const int a_step = row_step * M.dy_pitch, b_step = row_step * M.x_pitch;
    cp_async_wait_one();
    __syncthreads();  // the step's tiles are in
    int v = first_v;
    for (; v + (kChains - 1) * row_step < steps; v += kChains * row_step) {
#pragma unroll
      for (int c = 0; c < kChains; ++c) product(acc[c], a_row + c * a_step, b_row + c * b_step);
      a_row += kChains * a_step;
      b_row += kChains * b_step;
    }
    for (; v < steps; v += row_step, a_row += a_step, b_row += b_step)
      product(acc[0], a_row, b_row);
    if (next.b != cur.b) {  // the item's last step: its sums
      // The lane holds C[g][2q + e] in acc[.][e] (acc[.][2], acc[.][3]: rows g + 8, unused).
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (g < kTaps && 2 * q + e < kTaps) {
          float sum = acc[0][e];
#pragma unroll
          for (int c = 1; c < kChains; ++c) sum += acc[c][e];
          sums[warp][g * kTaps + 2 * q + e] = sum;
        }
      __syncthreads();
      for (int i = threadIdx.x; i < kTaps * kTaps; i += blockDim.x) {
        float sum = sums[0][i];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) sum += sums[w][i];
        partial[cur.b * (kTaps * kTaps) + i] = sum;
      }
#pragma unroll
      for (int c = 0; c < kChains; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[c][e] = 0.f;
    }
    __syncthreads();  // buffer kb (and the sums) consumed: the next step refills them
    cur = next;
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
void launch_wgrad_strips(cudaStream_t stream, const T* dy, const T* x, T* partial,
                         const WgradGrid& G) {
  const int threads = int(round_up(int64_t(G.bx) * G.by * G.bz, 32));
  const unsigned blocks = unsigned(std::min<int64_t>(G.slices * G.pairs, int64_t(1) << 30));
  const size_t shared = size_t(G.bz) * size_t(G.tile_stride) * sizeof(T);
  wgrad_strip_kernel<T, kTaps, kRows><<<blocks, threads, shared, stream>>>(dy, x, partial, G);
}

template <class T, int kTaps, int kRows>
void launch_wgrad_strips_pipe(cudaStream_t stream, const T* dy, const T* x, T* partial,
                              const WgradGrid& G) {
  const int threads = int(round_up(int64_t(G.bx) * G.by * G.bz, 32));
  const size_t shared = 2 * size_t(G.bz) * size_t(G.tile_stride) * sizeof(T);
  const auto kernel = wgrad_strip_pipe_kernel<T, kTaps, kRows>;
  const unsigned blocks =
      launch_pipelined(kernel, strip_blocks_per_sm<T>(), G.slices * G.pairs, shared);
  kernel<<<blocks, threads, shared, stream>>>(dy, x, partial, G);
}

template <class T, int kTaps>
void launch_wgrad_mma(cudaStream_t stream, const T* dy, const T* x, float* partial,
                      const WgradGrid& G) {
  const size_t shared = 2 * size_t(G.mma.bytes(int(sizeof(T))));
  const auto kernel = wgrad_mma_kernel<T, kTaps>;
  // Persistent blocks: as many as are resident (fewer than kWgradMmaBlocksPerSm when the tiles
  // are large).
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kMmaThreads, shared);
  const unsigned blocks = launch_pipelined(kernel, std::max(per_sm, 1), G.slices * G.pairs, shared);
  kernel<<<blocks, kMmaThreads, shared, stream>>>(dy, x, partial, G);
}

template <class T>
ffi::Error run_wgrad(cudaStream_t stream, const T* dy, const T* x, T* dw, const ConvProblem& p,
                     void* scratch, int64_t scratch_bytes) {
  using A = acc_t<T>;
  const char* op = "conv2d wgrad";
  const int64_t count = p.K * p.channels_per_group() * p.R * p.S;
  if (count == 0) return ffi::Error::Success();
  if (scratch_bytes < wgrad_scratch_bytes<T>(p))
    return ffi::Error::InvalidArgument("conv2d wgrad: scratch buffer too small");
  A* partial = static_cast<A*>(scratch);
  const WgradPlan plan = plan_wgrad<T>(p);
  WgradGrid G{};
  G.p = p;
  G.pairs = p.K * p.channels_per_group();
  G.slices = plan.slices;
  G.images = plan.images;
  G.tiles_x = plan.tile.tiles_x;
  G.tiles_y = plan.tile.tiles_y;
  const int taps = plan.taps;
  if (G.slices == 0) {
    // No images: the finalize kernel writes zeros.
  } else if (plan.kernel == WgradKernel::kMma) {
    if constexpr (is_half_type<T>()) {
      G.tile_rows = plan.tile_rows;
      G.tile_cols = plan.tile_cols;
      G.mma = wgrad_mma_tiles(plan.tile_rows, plan.tile_cols, taps);
      G.vector_x = p.W % 8 == 0 && aligned_to(x, 16);
      G.vector_dy = p.Q % 8 == 0 && aligned_to(dy, 16);
      if (taps == 3) launch_wgrad_mma<T, 3>(stream, dy, x, partial, G);
      if (taps == 5) launch_wgrad_mma<T, 5>(stream, dy, x, partial, G);
      if (taps == 7) launch_wgrad_mma<T, 7>(stream, dy, x, partial, G);
    }
  } else if (plan.kernel == WgradKernel::kStrips) {
    if constexpr (!is_half_type<T>()) {
      G.bx = plan.tile.bx;
      G.by = plan.tile.by;
      G.bz = plan.bz;
      G.src_rows = plan.strip.rows;
      G.src_cols = plan.strip.cols;
      G.pitch = plan.strip.pitch;
      G.tile_stride = plan.strip.stride;
      G.x_base = plan.x_base;
      G.vector_x = p.W % (16 / int64_t(sizeof(T))) == 0 && aligned_to(x, 16);
      G.vector_dy = G.x_base % 4 == 0 && p.Q % 4 == 0 && aligned_to(dy, 4 * sizeof(T));
#ifndef JK_DW_NO_PIPE
      if (G.vector_x) {
        if (plan.rows == 7) {
          if (taps == 3) launch_wgrad_strips_pipe<T, 3, 7>(stream, dy, x, partial, G);
          if (taps == 5) launch_wgrad_strips_pipe<T, 5, 7>(stream, dy, x, partial, G);
          if (taps == 7) launch_wgrad_strips_pipe<T, 7, 7>(stream, dy, x, partial, G);
        } else {
          if (taps == 3) launch_wgrad_strips_pipe<T, 3, 8>(stream, dy, x, partial, G);
          if (taps == 5) launch_wgrad_strips_pipe<T, 5, 8>(stream, dy, x, partial, G);
          if (taps == 7) launch_wgrad_strips_pipe<T, 7, 8>(stream, dy, x, partial, G);
        }
      } else
#endif
      if (plan.rows == 7) {
        if (taps == 3) launch_wgrad_strips<T, 3, 7>(stream, dy, x, partial, G);
        if (taps == 5) launch_wgrad_strips<T, 5, 7>(stream, dy, x, partial, G);
        if (taps == 7) launch_wgrad_strips<T, 7, 7>(stream, dy, x, partial, G);
      } else {
        if (taps == 3) launch_wgrad_strips<T, 3, 8>(stream, dy, x, partial, G);
        if (taps == 5) launch_wgrad_strips<T, 5, 8>(stream, dy, x, partial, G);
        if (taps == 7) launch_wgrad_strips<T, 7, 8>(stream, dy, x, partial, G);
      }
    }
  } else {
    G.tap_chunks = ceil_div(p.R * p.S, kGenericTaps);
    const int64_t wanted = G.slices * G.pairs * G.tap_chunks;
    const unsigned blocks = unsigned(std::min<int64_t>(wanted, int64_t(1) << 30));
    wgrad_partial_generic_kernel<T><<<blocks, kMaxThreads, 0, stream>>>(dy, x, partial, G);
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
  switch (q.dtype) {
    case ConvDtype::kFloat16: return {false, wgrad_scratch_bytes<float16>(q.problem)};
    case ConvDtype::kBFloat16: return {false, wgrad_scratch_bytes<bfloat16>(q.problem)};
    case ConvDtype::kFloat32: return {false, wgrad_scratch_bytes<float>(q.problem)};
    default: return {false, wgrad_scratch_bytes<double>(q.problem)};
  }
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
    return run_stencil<T>(stream, "conv2d", static_cast<const T*>(x.untyped_data()),
                          static_cast<const T*>(w.untyped_data()), static_cast<const T*>(bias_data),
                          static_cast<T*>(y->untyped_data()), forward_grid(p));
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
    return run_stencil<T>(stream, "conv2d dgrad", static_cast<const T*>(dy.untyped_data()),
                          static_cast<const T*>(w.untyped_data()), nullptr,
                          static_cast<T*>(dx->untyped_data()), backward_data_grid(p));
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
