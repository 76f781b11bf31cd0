// Scratch memory of the CUDA handlers: XLA hands a handler an extra uint8 result of the size the
// op's host query computed at trace time (never cudaMalloc). Its regions are laid out once, by
// the same function at trace time and at run time, each at a multiple of kScratchAlign bytes from
// a base aligned inside the buffer (the buffer itself is only promised its element alignment, so
// the total includes that much slack). Sizes are checked (index_math.h): a region whose size is
// -1, or a total past int64, makes the total -1, which the host queries return and the handlers
// refuse.
#pragma once

#include <cstdint>

#include "jax_kernels/index_math.h"

namespace jax_kernels {

constexpr int64_t kScratchAlign = 256;

class ScratchLayout {
 public:
  // Reserves `bytes` (a checked size) and returns their offset from the aligned base.
  int64_t take(int64_t bytes) {
    const int64_t offset = end_;
    end_ = checked_add(end_, checked_round_up(bytes, kScratchAlign));
    return offset;
  }
  // The bytes to ask XLA for: the regions plus the slack to align the base; 0 when none, -1
  // when they cannot be represented.
  int64_t total() const { return end_ == 0 ? 0 : checked_add(end_, kScratchAlign); }

 private:
  int64_t end_ = 0;
};

// The aligned base of a scratch buffer laid out by ScratchLayout.
inline char* aligned_scratch(void* scratch) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(scratch);
  return reinterpret_cast<char*>(uintptr_t(round_up(int64_t(base), kScratchAlign)));
}

}  // namespace jax_kernels
