// The stable radix sort of (key, value) pairs that the deterministic scatters use to group their
// entries by destination (CUB's DeviceRadixSort, which ships with the CUDA toolkit), in scratch
// memory sized at trace time by a bound that needs no device.
#pragma once

#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "common/scratch.h"
#include "common/status.h"

namespace jax_kernels {

// Bits that hold every key in [0, max_key] (at least 1).
inline int key_bits(uint64_t max_key) {
  int bits = 1;
  while (bits < 64 && (max_key >> bits) != 0) ++bits;
  return bits;
}

// An upper bound of the temporary storage of cub::DeviceRadixSort::SortPairs with DoubleBuffers
// over `end_bit` key bits (the onesweep algorithm, which CUB uses for 32- and 64-bit keys from
// sm_60 on): per-pass digit counts per portion of up to 2^27 items, look-back state per tile and
// counters. The bound assumes tiles of at least 512 items, at most 256 digits and at least 4 bits
// per pass, all well below what CUB's policies use. It lets the trace-time query run on a machine
// without a GPU; radix_sort_pairs checks it against CUB's own figure before sorting.
inline int64_t radix_sort_temp_bound(int64_t items, int end_bit) {
  const int64_t portion = int64_t{1} << 27;
  const int64_t portions = (items + portion - 1) / portion;
  const int64_t passes = (end_bit + 3) / 4;
  const int64_t tiles = (std::min<int64_t>(items, int64_t{1} << 28) + 511) / 512;
  return round_up(portions * passes * 256 * 8, kScratchAlign) +
         round_up(tiles * 256 * 4, kScratchAlign) + round_up(portions * passes * 4, kScratchAlign) +
         8 * kScratchAlign;
}

// Sorts `count` pairs by the low `end_bit` bits of their keys, stably, on the stream, in `temp`
// (temp_bytes of radix_sort_temp_bound(count, end_bit)); the result is in keys.Current() and
// values.Current(). Keys and values are 32- or 64-bit unsigned or signed integers. CUB counts
// the items of 32-bit keys in int (its 32-bit offsets are faster): a count past that is refused,
// never truncated (the callers take 64-bit keys for such counts).
template <class Key, class Value>
ffi::Error radix_sort_pairs(const char* op, cub::DoubleBuffer<Key>& keys,
                            cub::DoubleBuffer<Value>& values, int64_t count, int end_bit,
                            void* temp, int64_t temp_bytes, cudaStream_t stream) {
  using Items = std::conditional_t<sizeof(Key) == 4, int, int64_t>;
  if (count < 0 || count > int64_t(std::numeric_limits<Items>::max()))
    return ffi::Error::Internal(std::string(op) + ": " + std::to_string(count) +
                                " sort items do not fit CUB's item count");
  size_t needed = 0;
  if (auto error = cuda_status(op, cub::DeviceRadixSort::SortPairs(
                                       nullptr, needed, keys, values, Items(count), 0, end_bit,
                                       stream));
      error.failure())
    return error;
  if (int64_t(needed) > temp_bytes)
    return ffi::Error::Internal(std::string(op) + ": CUB needs " + std::to_string(needed) +
                                " bytes of sort scratch, above the bound of " +
                                std::to_string(temp_bytes) +
                                " (radix_sort_temp_bound is out of date)");
  size_t available = size_t(temp_bytes);
  return cuda_status(op, cub::DeviceRadixSort::SortPairs(temp, available, keys, values,
                                                         Items(count), 0, end_bit, stream));
}

}  // namespace jax_kernels
