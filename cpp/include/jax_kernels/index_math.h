// Integer index arithmetic shared by every backend (host and device): floor division and modulo,
// ceiling division and rounding up to a multiple, for a positive divisor; and (host only) sizes
// in checked 64-bit arithmetic, for byte counts computed from extents that may be absurd (a
// shape traced with jax.eval_shape or jax.export needs no memory).
#pragma once

#include <cstdint>
#include <initializer_list>

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

// Sizes: non-negative, or -1 for one that int64 cannot represent. Every operation below
// returns -1 when an operand is -1 (or negative) or its result would pass int64, so a chain of
// them yields -1 as soon as any step does.
inline int64_t checked_mul(int64_t a, int64_t b) {
  int64_t product;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &product)) return -1;
  return product;
}
inline int64_t checked_add(int64_t a, int64_t b) {
  int64_t sum;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &sum)) return -1;
  return sum;
}
inline int64_t checked_product(std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (int64_t f : factors) product = checked_mul(product, f);
  return product;
}
// The least multiple of b (positive) that is >= a.
inline int64_t checked_round_up(int64_t a, int64_t b) {
  return a < 0 ? -1 : checked_mul(ceil_div(a, b), b);
}

}  // namespace jax_kernels
