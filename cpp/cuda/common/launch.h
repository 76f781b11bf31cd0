// Launch sizing for the CUDA kernels, from the current device's multiprocessor count: grid-stride
// grids, full grids, and persistent grids of as many blocks as stay resident.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace jax_kernels {

// The multiprocessor count that launch choices which fix an order of floating-point additions
// (how a reduction is split across threads) are made for, whatever the device: the H100's and
// H200's. Launch shapes that only spread independent items take multiprocessor_count() below;
// those that decide which partial sums exist take this constant, so that the bits of every
// deterministic pass are the same on every GPU model, not only run to run on one device.
constexpr int kReductionMultiprocessors = 132;

inline int multiprocessor_count() {
  static std::atomic<int> counts[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return 132;
  int count = counts[device].load(std::memory_order_relaxed);
  if (count == 0) {
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      count = 132;
    counts[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

// Blocks for a grid-stride loop over `items` with `threads` per block: enough to cover the items
// but no more than `blocks_per_sm` resident waves' worth.
inline unsigned grid_blocks(int64_t items, int threads, int blocks_per_sm = 16) {
  const int64_t needed = (items + threads - 1) / threads;
  const int64_t cap = int64_t(multiprocessor_count()) * blocks_per_sm;
  return unsigned(std::max<int64_t>(1, std::min(needed, cap)));
}

// Blocks for one item per thread with no grid-stride reuse: for streaming kernels, where a
// full grid measured faster on the H100 than a capped grid-stride loop.
inline unsigned full_grid_blocks(int64_t items, int threads) {
  const int64_t needed = (items + threads - 1) / threads;
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(needed, 0x7fffffff)));
}

// Blocks of a persistent kernel (each block walks items b, b + gridDim.x, ...): as many as stay
// resident, `blocks_per_sm` per multiprocessor, and no more than the items. Also lets `kernel`
// take `shared` bytes of dynamic shared memory: with a kernel's static shared memory, even
// 48 KiB of dynamic memory needs opting in.
template <class Kernel>
unsigned persistent_blocks(Kernel kernel, int blocks_per_sm, int64_t items, size_t shared) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  return unsigned(std::min<int64_t>(items, int64_t(multiprocessor_count()) * blocks_per_sm));
}

}  // namespace jax_kernels
