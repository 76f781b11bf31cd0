// The ordered sum of a split weight gradient's slices, shared by every deterministic wgrad of the
// conv family (the direct kernels' NCHW and channels-last partials, and the Hopper kernel's
// HWIO-ordered ones): out = the sum over slices of partial[slice], each element's slices added in
// an order fixed by the item and slice counts alone (never by the device, the grid or the
// schedule), with no atomics.
//
// A block's warps take `runs` fixed runs of slices, run v = slices [v * per_run, (v + 1) *
// per_run), for 32 items (kWidth contiguous elements each) per warp group; the runs' sums are
// then added in run order (shared memory). Runs (below) split a small output's long sums across
// warps; a large output or few slices take one run, one thread per item. `Map` places an item:
// map(item) gives its first element's offset within a slice of the partials and in the output.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/launch.h"
#include "jax_kernels/scalar.h"

namespace jax_kernels {
namespace slice_sum {

constexpr int kWarps = 8;

struct Place {
  int64_t src, dst;  // an item's first element: in a slice of the partials, in the output
};

// Items that are kWidth consecutive elements of both a slice and the output (the same order).
template <int kWidth>
struct Contiguous {
  __device__ __forceinline__ Place operator()(int64_t item) const {
    return {item * kWidth, item * kWidth};
  }
};

// The runs of a launch over `items` items and `slices` slices: as many (a power of two, up to
// kWarps) as bring the threads to about kTargetThreads, with at least kMinPerRun slices per run
// (a thread keeps several loads in flight; one slice per run measured up to 3x slower than
// one thread per item). The rule reads the shapes only, never the device: the order is fixed.
struct Runs {
  int runs;         // a power of two, 1..kWarps
  int64_t per_run;  // slices per run (the last may have fewer, or none)
};

constexpr int64_t kTargetThreads = int64_t(1) << 17;
constexpr int64_t kMinPerRun = 4;

inline Runs runs_for(int64_t items, int64_t slices) {
  int runs = 1;
  while (runs < kWarps && items * runs < kTargetThreads && slices >= 2 * runs * kMinPerRun)
    runs *= 2;
  return {runs, std::max<int64_t>(1, (slices + runs - 1) / runs)};
}

template <class T, class A, int kWidth, class Map>
__global__ void __launch_bounds__(kWarps * 32)
    slice_sum_kernel(const A* __restrict__ partial, T* __restrict__ out, int64_t items,
                     int64_t slices, int64_t slice_stride, Runs r, Map map) {
  __shared__ A sums[kWarps][32][kWidth];
  const int lane = int(threadIdx.x % 32), warp = int(threadIdx.x / 32);
  const int run = warp % r.runs, group = warp / r.runs, groups = kWarps / r.runs;
  const int64_t first = run * r.per_run, last = std::min(first + r.per_run, slices);
  const int64_t per_block = int64_t(groups) * 32;
  for (int64_t base = int64_t(blockIdx.x) * per_block; base < items;
       base += int64_t(gridDim.x) * per_block) {
    const int64_t item = base + group * 32 + lane;
    const Place at = item < items ? map(item) : Place{0, 0};
    A sum[kWidth] = {};
    if (item < items) {
      const A* p = partial + first * slice_stride + at.src;
#pragma unroll 4
      for (int64_t slice = first; slice < last; ++slice, p += slice_stride) {
        if constexpr (kWidth == 4) {
          const float4 v = *reinterpret_cast<const float4*>(p);
          sum[0] += v.x, sum[1] += v.y, sum[2] += v.z, sum[3] += v.w;
        } else {
#pragma unroll
          for (int e = 0; e < kWidth; ++e) sum[e] += p[e];
        }
      }
    }
    if (r.runs > 1) {
#pragma unroll
      for (int e = 0; e < kWidth; ++e) sums[warp][lane][e] = sum[e];
      __syncthreads();
      if (run == 0) {
        for (int v = 1; v < r.runs && v * r.per_run < slices; ++v)
#pragma unroll
          for (int e = 0; e < kWidth; ++e) sum[e] += sums[warp + v][lane][e];
      }
      __syncthreads();
    }
    if (run == 0 && item < items) {
      T* o = out + at.dst;
#pragma unroll
      for (int e = 0; e < kWidth; ++e) o[e] = from_acc<T>(sum[e]);
    }
  }
}

// out = the ordered sum of `slices` slices `slice_stride` elements apart, over `items` items of
// kWidth elements placed by `map`. kWidth 4 reads float4: float partials, every source offset and
// the slice stride multiples of 4, the partials 16-byte aligned (the caller's to check).
template <int kWidth, class T, class A, class Map = Contiguous<kWidth>>
void launch(cudaStream_t stream, const A* partial, T* out, int64_t items, int64_t slices,
            int64_t slice_stride, Map map = {}) {
  static_assert(kWidth == 1 || std::is_same_v<A, float>, "float4 loads read float partials");
  if (items <= 0) return;
  const Runs r = runs_for(items, slices);
  const int64_t per_block = int64_t(kWarps / r.runs) * 32;
  const unsigned blocks = grid_blocks((items + per_block - 1) / per_block, 1);
  slice_sum_kernel<T, A, kWidth, Map>
      <<<blocks, kWarps * 32, 0, stream>>>(partial, out, items, slices, slice_stride, r, map);
}

// out[e] = the ordered sum of partial[slice * count + e] over `slices` slices (0: zeros); float4
// loads where the partials are float, 16-byte aligned, and count is a multiple of 4.
template <class T, class A>
void launch_contiguous(cudaStream_t stream, const A* partial, T* out, int64_t count,
                       int64_t slices) {
  if constexpr (std::is_same_v<A, float>) {
    if (count % 4 == 0 && reinterpret_cast<uintptr_t>(partial) % 16 == 0)
      return launch<4>(stream, partial, out, count / 4, slices, count);
  }
  launch<1>(stream, partial, out, count, slices, count);
}

}  // namespace slice_sum
}  // namespace jax_kernels
