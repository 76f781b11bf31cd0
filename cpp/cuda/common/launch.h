// Host-side CUDA helpers for the FFI handlers: error reporting after a launch and launch sizing
// from the current device's multiprocessor count.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "jax_kernels/ffi_util.h"

namespace jax_kernels {

// The launch status of the kernels just queued on the stream (never synchronizes).
inline ffi::Error launch_status(const char* op) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) + ": CUDA error: " + cudaGetErrorString(error));
}

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

}  // namespace jax_kernels
