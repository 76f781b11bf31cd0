// lerp math (torch.lerp), host and device: the forward formula and the three partial derivatives.
// Every function works in the accumulation type (float for the half types).
#pragma once

#include "jax_kernels/scalar.h"

namespace jax_kernels {

// torch's two-sided formula: start + w * (end - start) for |w| < 0.5, else
// end - (end - start) * (1 - w). It gives lerp(a, b, 0) == a and lerp(a, b, 1) == b exactly.
template <class A>
JK_HD A lerp_value(A start, A end, A weight) {
  // Both sides computed and selected (no branch): vectorizes on the CPU, diverges nowhere on
  // the GPU, and a random weight costs no mispredictions.
  const A diff = end - start;
  const A from_start = start + weight * diff;
  const A from_end = end - diff * (A(1) - weight);
  const bool small = (weight < A(0.5)) & (weight > A(-0.5));
  return small ? from_start : from_end;
}

// Each gradient functor maps (dout, operands...) to the gradient element.
struct LerpForward {
  template <class A>
  JK_HD A operator()(A start, A end, A weight) const {
    return lerp_value(start, end, weight);
  }
};

// lerp with a Python-scalar weight (kept in double, cast to the accumulation type like torch).
struct LerpScalarForward {
  double weight;
  template <class A>
  JK_HD A operator()(A start, A end) const {
    return lerp_value(start, end, A(weight));
  }
};

// d lerp / d start = 1 - w
struct LerpGradStart {
  template <class A>
  JK_HD A operator()(A dout, A weight) const {
    return dout * (A(1) - weight);
  }
};
struct LerpScalarGradStart {
  double weight;
  template <class A>
  JK_HD A operator()(A dout) const {
    return dout * (A(1) - A(weight));
  }
};

// d lerp / d end = w
struct LerpGradEnd {
  template <class A>
  JK_HD A operator()(A dout, A weight) const {
    return dout * weight;
  }
};
struct LerpScalarGradEnd {
  double weight;
  template <class A>
  JK_HD A operator()(A dout) const {
    return dout * A(weight);
  }
};

// d lerp / d weight = end - start
struct LerpGradWeight {
  template <class A>
  JK_HD A operator()(A dout, A start, A end) const {
    return dout * (end - start);
  }
};

}  // namespace jax_kernels
