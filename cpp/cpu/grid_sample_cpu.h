// CPU pieces shared by grid_sample.cc and grid_sample_directional.cc: tiles of output points and
// the work split of the deterministic d_input scatters.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "jax_kernels/cpu_parallel.h"
#include "jax_kernels/grid_sample.h"

namespace jax_kernels {
namespace grid_sample_cpu {

// Tiles of kTile output points per batch row, and the grain (in tiles) below which threading
// does not pay.
template <int64_t kTile>
int64_t tiles_per_row(const GridSampleGeometry& g) {
  return (g.points + kTile - 1) / kTile;
}
template <int64_t kTile>
int64_t tile_grain(const GridSampleGeometry& g, int taps) {
  const int64_t work_per_tile = kTile * std::max<int64_t>(g.channels, 1) * taps;
  return std::max<int64_t>(1, (int64_t{1} << 16) / work_per_tile);
}

// The d_input scatters: each work item is one batch row m and a channel range [c0, c1) (enough
// items to keep every thread busy), whose planes body(m, c0, c1, acc, local) adds into acc
// (zeroed; float accumulators for the half types, then rounded into d_input), addressing channel
// c0 + c, cell s at acc[local.at(c, s)]. One thread owns each item, so the result is
// deterministic and independent of the thread count. acc is d_input itself where the group's
// elements are contiguous there in the accumulation type (channels-first, or channels-last with
// every channel in one group), else a buffer copied into d_input afterwards.
template <GridSampleLayout kLayout, class T, class Body>
void scatter_by_plane_groups(const GridSampleGeometry& g, T* d_input, Body&& body) {
  using A = acc_t<T>;
  constexpr bool kFirst = kLayout == GridSampleLayout::kChannelsFirst;
  const int64_t batch = std::max<int64_t>(g.batch, 1);
  const int64_t groups = std::clamp<int64_t>((2 * parallel_threads() + batch - 1) / batch, 1,
                                             std::max<int64_t>(g.channels, 1));
  parallel_for(g.batch * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> widened;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m = item / groups;
      const int64_t group = item % groups;
      const int64_t c0 = g.channels * group / groups;
      const int64_t c1 = g.channels * (group + 1) / groups;
      const int64_t width = c1 - c0;
      const int64_t planes_size = width * g.cells;
      T* row = d_input + m * g.channels * g.cells;
      A* acc = nullptr;
      if constexpr (std::is_same_v<A, T>) {
        if (kFirst || width == g.channels) acc = row + (kFirst ? c0 * g.cells : 0);
      }
      const bool in_place = acc != nullptr;
      if (!in_place) {
        widened.resize(planes_size);
        acc = widened.data();
      }
      std::fill(acc, acc + planes_size, A(0));
      body(m, c0, c1, acc, RowLayout<kLayout, int64_t>{width, g.cells});
      if (in_place) continue;
      if constexpr (kFirst) {
        for (int64_t i = 0; i < planes_size; ++i) row[c0 * g.cells + i] = from_acc<T>(acc[i]);
      } else {
        for (int64_t s = 0; s < g.cells; ++s)
          for (int64_t c = 0; c < width; ++c)
            row[s * g.channels + c0 + c] = from_acc<T>(acc[s * width + c]);
      }
    }
  });
}

}  // namespace grid_sample_cpu
}  // namespace jax_kernels
