// Host-side geometry shared by the direct conv2d kernels (stencil.cu, stencil_pipelined.cu,
// weight_gradient.cu): their fixed launch constants and the tile planning of the unrolled
// kernels. The constants are the measured choices on the H100 (docs/performance-log.md); none of
// them is a build option, because the weight-gradient ones fix the order of its sums, hence its
// bits.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "common/knobs.h"
#include "jax_kernels/conv.h"
#include "jax_kernels/scalar.h"

namespace jax_kernels {

constexpr int kMaxThreads = 256;           // threads per block of every kernel here
// Dynamic shared memory per block: below the 48 KiB available without opting in, leaving room
// for block_sum's static buffer.
constexpr int kSharedBytes = 40 * 1024;
constexpr int kGenericRows = 4;            // output rows per thread off the unrolled paths
constexpr int kGenericTaps = 16;           // weight-gradient taps per block off the unrolled paths
constexpr int64_t kWgradBlocks = 1024;     // weight-gradient blocks aimed at (sets the slices)
// Strip weight-gradient blocks aimed at: 1536 = 4 slices of 8 images for C384 N32, 5.8 items
// per resident block of an H100 (2 x 132), where 1024 gave 3 slices and 4.4 (a quarter-full
// last round).
constexpr int64_t kWgradStripBlocks = 1536;
constexpr int kStripCols = 4;              // output columns per thread of the strip kernels
constexpr int kMmaUnits = 8;               // 16x8 output tiles per warp of the tensor-core stencil
constexpr int kMmaThreads = 128;           // threads per block of the tensor-core kernels
// Tensor-core weight-gradient items aimed at: 4096 (11 slices of 3 images for C384 N32)
// measured as fast as 2048 and faster than 3072.
constexpr int64_t kWgradMmaBlocks = 4096;
constexpr int kWgradMmaBlocksPerSm = 6;    // resident blocks/SM of the tensor-core wgrad
constexpr int kMmaPipeBlocks = 4;          // resident blocks/SM, pipelined mma stencil
// The pipelined tensor-core stencil issues kMmaChains units' mma chains alternately
// (independent accumulators); 2 measured best on the H100 of 1, 2 and 4. Any choice gives the
// same bits.
constexpr int kMmaChains = 2;
static_assert(kMmaUnits % kMmaChains == 0, "chains must divide the units");

template <class T>
constexpr bool is_half_type() {
  return std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>;
}

// Half-type stencils and weight gradients of unrolled taps over planes of at most this many
// output positions run the strip kernels (half-type tiles widened to float as they are read,
// float weights and sums) instead of the tensor-core ones, whose 16-row tiles leave most of each
// mma idle on small planes (a 7x7 plane fills 49 of a 16x8 tile's 128 outputs) and whose tiles
// are staged element by element there (rows not whole 16-byte vectors). Measured on the H200 (run
// 34, docs/performance.md). JAX_KERNELS_CONV_HALF_STRIPS_AT sets the bound for A/B runs (1: the
// tensor-core kernels for every plane of more than one position); it changes the bits of the
// planes it moves (their sums run in another order).
constexpr int kHalfStripsAt = 28 * 28;

inline bool half_strips(int64_t rows, int64_t cols) {
  return rows * cols <= knob_count("JAX_KERNELS_CONV_HALF_STRIPS_AT", kHalfStripsAt);
}

// Resident blocks per multiprocessor the strip kernels are compiled for: 2 allows 128 registers
// per thread, which their float32 register blocks need without spilling (float64 takes twice).
template <class T>
constexpr int strip_blocks_per_sm() {
  return sizeof(T) == 8 ? 1 : 2;
}

// The first output column of a stencil whose column tiles start at multiples of `vector` source
// columns: with source column x - pad read at output x, the columns start at x ≡ pad (mod
// vector), the first of them in (-vector, 0].
inline int aligned_column_base(int64_t pad, int vector) {
  const int shift = int(floor_mod(pad, vector));
  return shift == 0 ? 0 : shift - vector;
}

// Tile columns a strip thread reads per tile row: its 4 outputs plus the taps' reach, rounded up
// to whole 16-byte vectors of float.
constexpr int strip_span(int taps) { return (kStripCols + taps - 1 + 3) / 4 * 4; }

// Tile sizes of a stencil or weight-gradient pass: bx threads of `cols_per_thread` columns (at
// most 64 columns, balanced over the column tiles) x by strips of `rows_per_thread` rows, at most
// kMaxThreads threads.
struct TileShape {
  int bx, by;
  int64_t tiles_x, tiles_y;
};

inline TileShape choose_tile(int64_t out_rows, int64_t out_cols, int rows_per_thread,
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
inline int unrolled_taps(const StencilAxis& rows, const StencilAxis& cols) {
  if (rows.stride != 1 || cols.stride != 1 || rows.dilation != 1 || cols.dilation != 1) return 0;
  if (rows.taps != cols.taps || (rows.taps != 3 && rows.taps != 5 && rows.taps != 7)) return 0;
  return int(rows.taps);
}

// Of the strip heights 7 and 8, the one that computes fewer rows beyond the output, 7 on a tie
// (7 fits the 56/28/14/7 planes of ImageNet networks, 8 the powers of two).
inline int strip_rows(int64_t out_rows, int64_t out_cols) {
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

inline StripTile strip_tile(int bx, int by, int rows, int taps) {
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

// Whether extents (and paddings) may be indexed in int by the unrolled kernels, which also form
// sums of a few of them: a block index plus the grid (at most 2^30 blocks), a tile origin plus a
// tile, a source position (origin minus padding) plus a tile row. Each below 2^29 keeps every
// such sum below 2^31.
inline bool int32_extents(std::initializer_list<int64_t> extents) {
  for (int64_t e : extents)
    if (e >= (int64_t(1) << 29)) return false;
  return true;
}

inline bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace jax_kernels
