// The conv2d weight gradient of the direct path (conv/direct.h): partial sums per fixed slice of
// images for each (filter, channel) pair, then the slices added in order (no atomics: bitwise
// reproducible). Unit-stride 3x3/5x5/7x7 taps take the strip kernel (float32/float64,
// cp.async-pipelined when x's rows are whole vectors; half types on small planes, tiling.h's
// half_strips) or the tensor-core kernel (half types); other geometries a generic kernel. The
// bias gradient is in bias_gradient.cu.
#include <algorithm>
#include <cstdint>

#include "common/launch.h"
#include "common/status.h"
#include "conv/direct.h"
#include "conv/slice_sum.cuh"
#include "conv/tile_staging.cuh"

namespace jax_kernels {
namespace {

// ---- Backward weight: partial sums per slice of images, then the slices in order ---------------

// The weight gradient's kernel and slices of images. Fixed by the problem's shape and dtype
// (never by the device), so that the sums are the same run to run
// (JAX_KERNELS_CONV_HALF_STRIPS_AT, an A/B switch, moves half-type planes between the strip and
// tensor-core kernels).
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
  WgradPlan plan{};
  const int64_t pairs = checked_mul(p.K, p.channels_per_group());
  if (p.N == 0 || pairs <= 0) return plan;
  plan.bz = 1;
  plan.taps = unrolled_taps(forward_rows(p), forward_cols(p));
  // The unrolled kernels index rows, columns and tiles in int.
  const bool small = int32_extents({p.P, p.Q, p.H, p.W, p.pad_top, p.pad_left});
  if (plan.taps > 0 && small && is_half_type<T>() && !half_strips(p.P, p.Q)) {
    plan.kernel = WgradKernel::kMma;
    const int64_t tiles_y = ceil_div(p.P, 64);
    plan.tile_rows = int(ceil_div(p.P, tiles_y));
    // 16, 32 or 64 columns: column steps of 16 that divide the kernel's 4 warps.
    const int64_t col_steps = ceil_div(p.Q, 16);
    plan.tile_cols = int(16 * (col_steps >= 3 ? 4 : col_steps));
    plan.tile.tiles_y = tiles_y;
    plan.tile.tiles_x = ceil_div(p.Q, plan.tile_cols);
  } else if (plan.taps > 0 && small) {
    // Half types stage x element by element (their 16-byte vectors of 8 could overrun the
    // pitch, which is planned in vectors of 4).
    constexpr int kVector = 16 / int(sizeof(T));
    plan.x_base = !is_half_type<T>() && p.W % kVector == 0
                      ? aligned_column_base(p.pad_left, kVector) : 0;
    plan.rows = strip_rows(p.P, p.Q);
    plan.tile = choose_tile(p.P, p.Q - plan.x_base, plan.rows, kStripCols, kMaxThreads);
    plan.strip = strip_tile(plan.tile.bx, plan.tile.by, plan.rows, plan.taps);
    const int64_t tile_bytes = int64_t(plan.strip.stride) * int64_t(sizeof(T));
    if (tile_bytes <= kSharedBytes) {
      plan.kernel = WgradKernel::kStrips;
      plan.bz = int(std::clamp<int64_t>(kMaxThreads / (plan.tile.bx * plan.tile.by), 1,
                                        std::min<int64_t>(p.N, kSharedBytes / tile_bytes)));
    }
  }
  if (plan.kernel != WgradKernel::kGeneric &&
      !int32_extents({plan.tile.tiles_x * plan.tile.tiles_y})) {
    plan.kernel = WgradKernel::kGeneric;
    plan.bz = 1;
  }
  const int64_t blocks = plan.kernel == WgradKernel::kMma      ? kWgradMmaBlocks
                        : plan.kernel == WgradKernel::kStrips ? kWgradStripBlocks
                                                              : kWgradBlocks;
  const int64_t wanted = std::clamp<int64_t>(ceil_div(blocks, pairs), 1, p.N);
  // A block takes no more images at once than its slice holds: on small planes the shared
  // memory admits more (21 float32 tiles of 14x14, 32 half-type ones), which rounded the slices
  // up to fewer, larger blocks (two slices of 21 images for C384 N32 instead of four of 8).
  plan.bz = int(std::min<int64_t>(plan.bz, ceil_div(p.N, wanted)));
  plan.images = round_up(ceil_div(p.N, wanted), plan.bz);
  plan.slices = ceil_div(p.N, plan.images);
  return plan;
}

}  // namespace

template <class T>
int64_t wgrad_scratch_bytes(const ConvProblem& p) {
  const int64_t slice_bytes =
      checked_product({p.K, p.channels_per_group(), p.R, p.S, int64_t(sizeof(acc_t<T>))});
  return slice_bytes < 0 ? -1 : checked_mul(plan_wgrad<T>(p).slices, slice_bytes);
}

template int64_t wgrad_scratch_bytes<float16>(const ConvProblem&);
template int64_t wgrad_scratch_bytes<bfloat16>(const ConvProblem&);
template int64_t wgrad_scratch_bytes<float>(const ConvProblem&);
template int64_t wgrad_scratch_bytes<double>(const ConvProblem&);

namespace {

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

// Unit stride and dilation, kTaps x kTaps taps: float32/float64, and half types on small
// planes (x tiles of the half type, widened as they are read; dy blocks and sums in float).
// Block (slice, pair); thread (z, tx, ty) holds the kTaps^2 sums of the dy register block at
// rows ty * kRows .. + kRows - 1, columns 4 tx .. 4 tx + 3 of every tile of images first + z,
// first + z + bz, ... of the slice; the block's threads stage the bz x tiles (with their halos)
// in shared memory together.
template <class T, int kTaps, int kRows>
__global__ void __launch_bounds__(kMaxThreads, strip_blocks_per_sm<T>())
    wgrad_strip_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                       acc_t<T>* __restrict__ partial, const WgradGrid G) {
  using A = acc_t<T>;
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
    A acc[kTaps * kTaps];
#pragma unroll
    for (int e = 0; e < kTaps * kTaps; ++e) acc[e] = A(0);
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
        A d[kRows][kStripCols];
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
            A v[kSpan];
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

template <class T, int kTaps, int kRows>
void launch_wgrad_strips(cudaStream_t stream, const T* dy, const T* x, acc_t<T>* partial,
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
      persistent_blocks(kernel, strip_blocks_per_sm<T>(), G.slices * G.pairs, shared);
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
  const unsigned blocks = persistent_blocks(kernel, std::max(per_sm, 1), G.slices * G.pairs, shared);
  kernel<<<blocks, kMmaThreads, shared, stream>>>(dy, x, partial, G);
}


}  // namespace

template <class T>
ffi::Error run_wgrad(cudaStream_t stream, const T* dy, const T* x, T* dw, const ConvProblem& p,
                     void* scratch, int64_t scratch_bytes) {
  using A = acc_t<T>;
  const char* op = "conv2d wgrad";
  const int64_t count = p.K * p.channels_per_group() * p.R * p.S;
  if (count == 0) return ffi::Error::Success();
  const int64_t needed = wgrad_scratch_bytes<T>(p);
  if (needed < 0 || scratch_bytes < needed)
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
    // No images: the slice sum writes zeros.
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
    G.bx = plan.tile.bx;
    G.by = plan.tile.by;
    G.bz = plan.bz;
    G.src_rows = plan.strip.rows;
    G.src_cols = plan.strip.cols;
    G.pitch = plan.strip.pitch;
    G.tile_stride = plan.strip.stride;
    G.x_base = plan.x_base;
    // Half types stage x element by element (plan_wgrad), so never pipelined.
    G.vector_x = !is_half_type<T>() && p.W % (16 / int64_t(sizeof(T))) == 0 && aligned_to(x, 16);
    G.vector_dy = G.x_base % 4 == 0 && p.Q % 4 == 0 && aligned_to(dy, 4 * sizeof(T));
    if (G.vector_x) {
      if constexpr (!is_half_type<T>()) {
        if (plan.rows == 7) {
          if (taps == 3) launch_wgrad_strips_pipe<T, 3, 7>(stream, dy, x, partial, G);
          if (taps == 5) launch_wgrad_strips_pipe<T, 5, 7>(stream, dy, x, partial, G);
          if (taps == 7) launch_wgrad_strips_pipe<T, 7, 7>(stream, dy, x, partial, G);
        } else {
          if (taps == 3) launch_wgrad_strips_pipe<T, 3, 8>(stream, dy, x, partial, G);
          if (taps == 5) launch_wgrad_strips_pipe<T, 5, 8>(stream, dy, x, partial, G);
          if (taps == 7) launch_wgrad_strips_pipe<T, 7, 8>(stream, dy, x, partial, G);
        }
      }
    } else if (plan.rows == 7) {
      if (taps == 3) launch_wgrad_strips<T, 3, 7>(stream, dy, x, partial, G);
      if (taps == 5) launch_wgrad_strips<T, 5, 7>(stream, dy, x, partial, G);
      if (taps == 7) launch_wgrad_strips<T, 7, 7>(stream, dy, x, partial, G);
    } else {
      if (taps == 3) launch_wgrad_strips<T, 3, 8>(stream, dy, x, partial, G);
      if (taps == 5) launch_wgrad_strips<T, 5, 8>(stream, dy, x, partial, G);
      if (taps == 7) launch_wgrad_strips<T, 7, 8>(stream, dy, x, partial, G);
    }
  } else {
    G.tap_chunks = ceil_div(p.R * p.S, kGenericTaps);
    const int64_t wanted = G.slices * G.pairs * G.tap_chunks;
    const unsigned blocks = unsigned(std::min<int64_t>(wanted, int64_t(1) << 30));
    wgrad_partial_generic_kernel<T><<<blocks, kMaxThreads, 0, stream>>>(dy, x, partial, G);
  }
  slice_sum::launch_contiguous(stream, partial, dw, count, G.slices);
  return launch_status(op);
}

template ffi::Error run_wgrad<float16>(cudaStream_t, const float16*, const float16*, float16*, const ConvProblem&,
                                    void*, int64_t);
template ffi::Error run_wgrad<bfloat16>(cudaStream_t, const bfloat16*, const bfloat16*, bfloat16*, const ConvProblem&,
                                    void*, int64_t);
template ffi::Error run_wgrad<float>(cudaStream_t, const float*, const float*, float*, const ConvProblem&,
                                    void*, int64_t);
template ffi::Error run_wgrad<double>(cudaStream_t, const double*, const double*, double*, const ConvProblem&,
                                    void*, int64_t);

}  // namespace jax_kernels
