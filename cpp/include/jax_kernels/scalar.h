// Scalar types shared by the CPU and CUDA kernels: the JK_HD qualifier, 16-bit float storage types
// with round-to-nearest-even conversions, and the accumulation type of each element type
// (float for the half types, the type itself otherwise).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define JK_HD __host__ __device__ __forceinline__
#else
#define JK_HD inline
#endif

namespace jax_kernels {

// IEEE binary16 and bfloat16, stored as raw bits. Kernels never compute in them: they load
// through to_acc() into float and store through from_acc().
struct float16 {
  uint16_t bits;
};
struct bfloat16 {
  uint16_t bits;
};

JK_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

JK_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

JK_HD float to_float(bfloat16 h) { return bits_to_float(uint32_t(h.bits) << 16); }

JK_HD bfloat16 to_bfloat16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bfloat16{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return bfloat16{uint16_t(u >> 16)};
}

JK_HD float to_float(float16 h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h.bits));
#else
  const uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
  const uint32_t exponent = (h.bits >> 10) & 0x1fu;
  uint32_t mantissa = h.bits & 0x3ffu;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf/NaN
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_to_float(sign);
  // Subnormal: renormalize.
  int e = -1;
  do {
    ++e;
    mantissa <<= 1;
  } while ((mantissa & 0x400u) == 0);
  return bits_to_float(sign | uint32_t(112 - e) << 23 | ((mantissa & 0x3ffu) << 13));
#endif
}

JK_HD float16 to_float16(float f) {
#if defined(__CUDA_ARCH__)
  return float16{__half_as_ushort(__float2half_rn(f))};
#else
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return float16{uint16_t(sign | 0x7e00u)};        // NaN
  if (abs >= 0x477ff000u) return float16{uint16_t(sign | 0x7c00u)};       // rounds to inf
  if (abs < 0x38800000u) {                                                // subnormal or zero
    if (abs < 0x33000000u) return float16{sign};                          // below half the
                                                                          // smallest subnormal
    const uint32_t exponent = abs >> 23;
    const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exponent;  // 14..24
    uint32_t half_mantissa = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half_mantissa & 1u))) ++half_mantissa;
    return float16{uint16_t(sign | half_mantissa)};
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u) - (uint32_t(112) << 23);
  return float16{uint16_t(sign | (rounded >> 13))};
#endif
}

// Accumulation type: half types compute in float.
template <class T>
struct Accumulator {
  using type = T;
};
template <>
struct Accumulator<float16> {
  using type = float;
};
template <>
struct Accumulator<bfloat16> {
  using type = float;
};
template <class T>
using acc_t = typename Accumulator<T>::type;

template <class T>
JK_HD acc_t<T> to_acc(T x) {
  if constexpr (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>) {
    return to_float(x);
  } else {
    return x;
  }
}

template <class T>
JK_HD T from_acc(acc_t<T> x) {
  if constexpr (std::is_same_v<T, float16>) {
    return to_float16(x);
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    return to_bfloat16(x);
  } else {
    return x;
  }
}

template <class T>
constexpr const char* dtype_name() {
  if constexpr (std::is_same_v<T, float16>) return "float16";
  if constexpr (std::is_same_v<T, bfloat16>) return "bfloat16";
  if constexpr (std::is_same_v<T, float>) return "float32";
  if constexpr (std::is_same_v<T, double>) return "float64";
  return "?";
}

}  // namespace jax_kernels
