// Strided loops whose index never passes their end, so that a 32-bit index is safe for any end
// up to 2^31 - 1. A plain `for (i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)`
// in int32 overflows when i + stride passes 2^31 - 1, i.e. whenever n lies within one grid of
// 2^31 (the grid_sample backward's illegal address with N*H*W just under 2^31, issue 14), and
// its first index can pass it too; here both are formed in 64 bits and clamped to the end.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_kernels {

// i + step for i < end, or end when that would pass end (it might not be representable).
template <class Index>
__device__ __forceinline__ Index next_index(Index i, Index step, Index end) {
  return end - i > step ? i + step : end;
}

// A grid-stride loop over [0, end) with `per_block` items per block, this thread taking item
// `lane` of each of its blocks (lane 0 for a loop over block bases):
//   const GridStride<Index> loop(end, per_block, lane);
//   for (Index i = loop.first; i < end; i = loop.next(i)) ...
template <class Index>
struct GridStride {
  Index first, step, end;

  __device__ __forceinline__ GridStride(Index end, unsigned per_block, unsigned lane)
      : end(end) {
    const uint64_t at = uint64_t(blockIdx.x) * per_block + lane;
    const uint64_t grid = uint64_t(gridDim.x) * per_block;
    first = at < uint64_t(end) ? Index(at) : end;
    step = grid < uint64_t(end) ? Index(grid) : end;
  }

  __device__ __forceinline__ Index next(Index i) const { return next_index(i, step, end); }
};

// Calls f(int32_t{}) where `narrow` (every index of the launch below 2^31, so GridStride may run
// in 32 bits) or f(int64_t{}): the kernel's index type, chosen once per launch.
template <class F>
void with_index(bool narrow, F&& f) {
  if (narrow) {
    f(int32_t{});
  } else {
    f(int64_t{});
  }
}

}  // namespace jax_kernels
