// Integer index arithmetic shared by every backend (host and device): floor division and modulo,
// ceiling division and rounding up to a multiple, for a positive divisor.
#pragma once

#include <cstdint>

#include "jax_kernels/scalar.h"

namespace jax_kernels {

// Floor division and modulo for a positive divisor (C++ `/` and `%` truncate toward zero).
JK_HD int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}
JK_HD int64_t floor_mod(int64_t a, int64_t b) { return a - floor_div(a, b) * b; }
JK_HD int64_t ceil_div(int64_t a, int64_t b) { return -floor_div(-a, b); }
// The least multiple of b that is >= a.
JK_HD int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

}  // namespace jax_kernels
