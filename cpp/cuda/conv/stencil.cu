// The direct stencil kernels of the conv2d forward and dgrad (conv/direct.h says which runs when):
// the strip kernel (float32/float64, and half types on small planes) and the tensor-core kernel
// (float16/bfloat16) for unit-stride 3x3/5x5/7x7 taps, the generic shared-tile kernel and the
// global-memory kernel for any other geometry, their tile planning, and run_stencil, which
// picks among them and the pipelined kernels of stencil_pipelined.cu.
#include <algorithm>
#include <cstdint>

#include "common/launch.h"
#include "common/status.h"
#include "conv/direct.h"
#include "conv/tile_staging.cuh"

namespace jax_kernels {
namespace {

// The strip kernel (unit stride and dilation, kTaps x kTaps taps; upsampling allowed): float32
// and float64, and half types on small planes (tiling.h's half_strips; tiles of the half type,
// widened to float as they are read, weights and sums in float). A block covers bz planes x one
// tile of (by * kRows) x (bx * 4) outputs; thread (tx, ty) of a plane computes rows
// ty * kRows .. + kRows - 1 of columns 4 tx .. 4 tx + 3 with the weights in registers. The
// block's threads stage all bz tiles together; column tiles start at x_base so that their
// source columns start on a 16-byte vector.
template <class T, int kTaps, int kRows>
__global__ void __launch_bounds__(kMaxThreads, strip_blocks_per_sm<T>())
    stencil_strip_kernel(const T* __restrict__ source, const T* __restrict__ weight,
                         const T* __restrict__ bias, T* __restrict__ out, const StencilGrid G) {
  using A = acc_t<T>;
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
    const A start = (live && bias != nullptr) ? to_acc(bias[oc]) : A(0);
    A acc[kRows][kStripCols];
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
        A wr[kTaps][kTaps];
#pragma unroll
        for (int r = 0; r < kTaps; ++r)
#pragma unroll
          for (int s = 0; s < kTaps; ++s)
            wr[r][s] = to_acc(w[r * G.weights.row + s * G.weights.col]);
        // Tile row d is read by output row j through tap row d - j.
#pragma unroll
        for (int d = 0; d < kRows + kTaps - 1; ++d) {
          A v[kSpan];
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

// stage_tile (every tile kernel) forms source positions in int: an output index times the
// stride plus a tap's reach, minus the padding, plus a row of the tile. Otherwise the
// global-memory kernel runs the problem.
bool positions_fit_32_bits(const StencilGrid& G) {
  const auto reach = [](const StencilAxis& a) {
    return checked_add(checked_mul(a.out, a.stride), checked_mul(a.taps, a.dilation));
  };
  const int64_t rows = reach(G.rows), cols = reach(G.cols);
  return rows >= 0 && cols >= 0 &&
         int32_extents({rows, cols, G.rows.source, G.cols.source, G.rows.pad, -G.rows.pad,
                        G.cols.pad, -G.cols.pad});
}

// The unrolled kernels also index planes, blocks and channels in 32 bits.
bool fits_32_bits(const StencilGrid& G) {
  return positions_fit_32_bits(G) &&
         int32_extents({G.planes, G.blocks, G.out_channels, G.in_channels});
}

// Whether a stencil's source rows are whole 16-byte vectors of T (stage_tile_vectors applies
// when the source is also aligned).
template <class T>
bool vector_rows(const StencilGrid& G) {
  return G.rows.upsample == 1 && G.cols.upsample == 1 &&
         G.cols.source % (16 / int64_t(sizeof(T))) == 0;
}

// Fills G's tile for the strip kernel; false when no tile fits in shared memory. Half types
// stage element by element (x_base 0): their 16-byte vectors of 8 could overrun the pitch, which
// is planned in vectors of 4.
template <class T>
bool plan_stencil_strips(StencilGrid& G, const T* source, const T* out, int taps, int rows) {
  const bool vectors = !is_half_type<T>() && vector_rows<T>(G);
  G.x_base = vectors ? aligned_column_base(G.cols.pad, 16 / int(sizeof(T))) : 0;
  G.vector_source = vectors && aligned_to(source, 16);
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

}  // namespace

template <class T>
ffi::Error run_stencil(cudaStream_t stream, const char* op, const T* source, const T* weight,
                       const T* bias, T* out, StencilGrid G) {
  using A = acc_t<T>;
  if (G.planes * G.rows.out * G.cols.out == 0) return ffi::Error::Success();
  const int taps = unrolled_taps(G.rows, G.cols);
  const auto launch_strips = [&](int rows) {
    if (rows == 7) {
      if (taps == 3) launch_stencil_strips<T, 3, 7>(stream, source, weight, bias, out, G);
      if (taps == 5) launch_stencil_strips<T, 5, 7>(stream, source, weight, bias, out, G);
      if (taps == 7) launch_stencil_strips<T, 7, 7>(stream, source, weight, bias, out, G);
    } else {
      if (taps == 3) launch_stencil_strips<T, 3, 8>(stream, source, weight, bias, out, G);
      if (taps == 5) launch_stencil_strips<T, 5, 8>(stream, source, weight, bias, out, G);
      if (taps == 7) launch_stencil_strips<T, 7, 8>(stream, source, weight, bias, out, G);
    }
  };
  if constexpr (is_half_type<T>()) {
    const int rows = taps > 0 ? strip_rows(G.rows.out, G.cols.out) : 0;
    if (taps > 0 && half_strips(G.rows.out, G.cols.out) &&
        plan_stencil_strips(G, source, out, taps, rows)) {
      launch_strips(rows);
      return launch_status(op);
    }
    if (taps > 0 && plan_stencil_mma(G, source, out, taps)) {
      if (pipelined(G)) {
        launch_stencil_pipelined(stream, source, weight, bias, out, G, taps, 0);
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
        launch_stencil_pipelined(stream, source, weight, bias, out, G, taps, rows);
        return launch_status(op);
      }
      launch_strips(rows);
      return launch_status(op);
    }
  }
  // Shrink the strips per tile until the shared tile fits.
  const bool tiles_apply = positions_fit_32_bits(G);
  for (int max_by = kMaxThreads; max_by >= 1 && tiles_apply; max_by /= 2) {
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

template ffi::Error run_stencil<float16>(cudaStream_t, const char*, const float16*, const float16*,
                                      const float16*, float16*, StencilGrid);
template ffi::Error run_stencil<bfloat16>(cudaStream_t, const char*, const bfloat16*, const bfloat16*,
                                      const bfloat16*, bfloat16*, StencilGrid);
template ffi::Error run_stencil<float>(cudaStream_t, const char*, const float*, const float*,
                                      const float*, float*, StencilGrid);
template ffi::Error run_stencil<double>(cudaStream_t, const char*, const double*, const double*,
                                      const double*, double*, StencilGrid);

}  // namespace jax_kernels
