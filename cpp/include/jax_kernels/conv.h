// conv2d geometry shared by every backend and pass (torch.nn.functional.conv2d semantics, NCHW
// input, KCRS weight with C/groups input channels per filter, NKPQ output), host and device.
//
// The problem description and the host-query argument layout are the interface between the
// direct kernels (cpu/conv.cc, cuda/conv.cu) and the tensor-core path (cuda/conv_dense.cu).
#pragma once

#include <cstdint>
#include <vector>

#include "jax_kernels/scalar.h"

namespace jax_kernels {

struct ConvProblem {
  int64_t N, C, H, W;  // input
  int64_t K, R, S;     // weight: [K, C / groups, R, S]
  int64_t P, Q;        // output spatial extent
  int64_t stride_h, stride_w;
  int64_t pad_top, pad_left;  // bottom/right padding is implied by P and Q
  int64_t dilation_h, dilation_w;
  int64_t groups;

  JK_HD int64_t channels_per_group() const { return C / groups; }
  JK_HD int64_t filters_per_group() const { return K / groups; }
  // Input row/column read by output row p (column q) at filter tap r (s); may lie outside.
  JK_HD int64_t input_row(int64_t p, int64_t r) const { return p * stride_h - pad_top + r * dilation_h; }
  JK_HD int64_t input_col(int64_t q, int64_t s) const { return q * stride_w - pad_left + s * dilation_w; }
};

enum class ConvPass : int64_t { kForward = 0, kBackwardData = 1, kBackwardWeight = 2 };

// Float32 math on tensor cores: TF32 by default (as lax.conv and cuDNN through torch), full
// float32 with precision="highest". Half types always accumulate in float32; float64 is exact.
enum class ConvPrecision : int64_t { kDefault = 0, kHighest = 1 };

// Element type codes used in host queries (Python maps dtypes to these).
enum class ConvDtype : int64_t { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2, kFloat64 = 3 };

// Host query "conv2d_dense_scratch" takes these int64 arguments, in this order:
//   pass, dtype, precision, N, C, H, W, K, R, S, P, Q, stride_h, stride_w, pad_top, pad_left,
//   dilation_h, dilation_w, groups
// and returns the scratch bytes the tensor-core path needs, or -1 if it does not take the
// problem (the direct kernels then run, with no scratch).
struct ConvQuery {
  ConvPass pass;
  ConvDtype dtype;
  ConvPrecision precision;
  ConvProblem problem;
};

inline bool parse_conv_query(const std::vector<int64_t>& a, ConvQuery* q) {
  if (a.size() != 19) return false;
  q->pass = ConvPass(a[0]);
  q->dtype = ConvDtype(a[1]);
  q->precision = ConvPrecision(a[2]);
  q->problem = ConvProblem{a[3],  a[4],  a[5],  a[6],  a[7],  a[8],  a[9],  a[10], a[11], a[12],
                           a[13], a[14], a[15], a[16], a[17], a[18]};
  return true;
}

}  // namespace jax_kernels
