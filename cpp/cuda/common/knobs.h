// Environment switches of the CUDA kernels, kept for A/B measurements (docs/performance.md names
// each where it is used). Read at every call, so that one process can time both sides. No switch
// changes a result's bits unless its documentation says so.
#pragma once

#include <cstdlib>
#include <cstring>

namespace jax_kernels {

// Whether the switch `name` is set to "0" (off); anything else, or unset, leaves it on.
inline bool knob_off(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::strcmp(value, "0") == 0;
}

// Whether the switch `name` is set to `value`.
inline bool knob_is(const char* name, const char* value) {
  const char* set = std::getenv(name);
  return set != nullptr && std::strcmp(set, value) == 0;
}

// The count the variable `name` sets (a positive integer), or `fallback` where it is unset,
// empty or not a positive integer.
inline int knob_count(const char* name, int fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == 0) return fallback;
  char* end = nullptr;
  const long count = std::strtol(value, &end, 10);
  return (*end == 0 && count > 0 && count < (1 << 20)) ? int(count) : fallback;
}

}  // namespace jax_kernels
