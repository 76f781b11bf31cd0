// The roi_align forward by image regions (forward_regions.cu), which forward.cu's handler takes
// where region_plan() finds the call eligible and the scratch holds the plan.
//
// Why: with many boxes over an image, the gather over boxes (forward.cu's kernel) reads each
// input cell once per box whose samples touch it (about 8 times on a detector's FPN level), and
// its time is that tap traffic through L2. Here the output bins are bucketed by the 12 x 12-cell
// tile of the input that holds their center; a block per (tile, group of channel slabs) stages
// the tile and a halo of 3 cells, one slab of channels at a time, in shared memory, and computes
// every bin of the tile from there: each cell crosses L2 about once per tile that stages it.
// Samples whose taps lie outside the staged region (bins larger than the halo) read the input in
// place, and a tile with fewer taps than staged cells reads everything in place. Every bin adds
// the same terms in the same order as the gather over boxes: the two give the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_kernels/roi_align.h"

namespace jax_kernels {

constexpr int kRegionTile = 12;     // bins are bucketed by the tile of 12 x 12 cells of their center
constexpr int kRegionHalo = 3;      // cells staged around a tile on each side
constexpr int kRegionMaxGrid = 8;   // the fixed sampling ratios the region forward takes

// The plan of a call and its scratch (byte offsets from the aligned base). Not eligible:
// float64, adaptive or large sampling grids, an empty problem, or extents past the 32-bit
// counters and the 16-bit bin ranges of the entries.
struct RegionPlan {
  bool eligible = false;
  int64_t tiles_y = 0, tiles_x = 0, tiles = 0;  // tiles per image column and row, in all
  int64_t max_entries = 0;  // bound on the (box, tile) entries: a box's bins in one tile
  int64_t counts = 0, starts = 0, fill = 0, entries = 0, total = 0;
};

// The same plan at trace time (the scratch query) and run time (the handler).
RegionPlan region_plan(int64_t N, int64_t C, int64_t H, int64_t W, int64_t K, int64_t PH,
                       int64_t PW, int64_t sampling_ratio, int64_t element_bytes);

// Enqueues the region forward on `stream`: T is float, float16 or bfloat16, `base` the aligned
// scratch of at least plan.total bytes. Returns the launch status.
template <class Layout, class T>
cudaError_t roi_align_forward_regions(const T* input, const T* boxes, T* out,
                                      const RoiAlignProblem& p, const RegionPlan& plan, char* base,
                                      cudaStream_t stream);

}  // namespace jax_kernels
