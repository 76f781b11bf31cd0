// float64 reference kernels of conv2d's forward, dgrad and wgrad for the standalone GPU checks
// (tools/implicit_gemm_check.cu, tools/conv_direct_check.cu): one output element per loop turn of
// a grid-stride loop, its sum in float64 over the direct definition (inputs of any dtype, read
// through to_acc). Independent of the kernels under test: no tiles, no index maps but
// ConvProblem's input_row / input_col.
#pragma once

#include <cstdint>

#include "jax_kernels/conv.h"
#include "jax_kernels/scalar.h"

namespace conv_reference {

using jax_kernels::ConvProblem;

template <class T>
__device__ double exact(T v) {
  return double(jax_kernels::to_acc(v));
}

// y[n][k][p][q] = bias[k] + sum_{c, r, s} w[k][c][r][s] * x[n][g * Cg + c][row(p, r)][col(q, s)].
template <class T>
__global__ void forward(const T* x, const T* w, const T* bias, double* y, ConvProblem p) {
  const int64_t count = p.N * p.K * p.P * p.Q;
  const int64_t Cg = p.channels_per_group(), Kg = p.filters_per_group();
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < count;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t q = e % p.Q, pp = e / p.Q % p.P, k = e / (p.Q * p.P) % p.K,
                  n = e / (p.Q * p.P * p.K);
    const int64_t g = k / Kg;
    double sum = bias != nullptr ? exact(bias[k]) : 0.0;
    for (int64_t c = 0; c < Cg; ++c)
      for (int64_t r = 0; r < p.R; ++r) {
        const int64_t h = p.input_row(pp, r);
        if (h < 0 || h >= p.H) continue;
        for (int64_t s = 0; s < p.S; ++s) {
          const int64_t wi = p.input_col(q, s);
          if (wi < 0 || wi >= p.W) continue;
          sum += exact(x[((n * p.C + g * Cg + c) * p.H + h) * p.W + wi]) *
                 exact(w[((k * Cg + c) * p.R + r) * p.S + s]);
        }
      }
    y[e] = sum;
  }
}

// dx[n][c][h][w]: every (k, r, s) of c's group whose output position reads (h, w).
template <class T>
__global__ void dgrad(const T* dy, const T* w, double* dx, ConvProblem p) {
  const int64_t count = p.N * p.C * p.H * p.W;
  const int64_t Cg = p.channels_per_group(), Kg = p.filters_per_group();
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < count;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t wi = e % p.W, h = e / p.W % p.H, c = e / (p.W * p.H) % p.C,
                  n = e / (p.W * p.H * p.C);
    const int64_t g = c / Cg;
    double sum = 0.0;
    for (int64_t k = g * Kg; k < (g + 1) * Kg; ++k)
      for (int64_t r = 0; r < p.R; ++r) {
        const int64_t ph = h + p.pad_top - r * p.dilation_h;
        if (ph < 0 || ph % p.stride_h || ph / p.stride_h >= p.P) continue;
        for (int64_t s = 0; s < p.S; ++s) {
          const int64_t qw = wi + p.pad_left - s * p.dilation_w;
          if (qw < 0 || qw % p.stride_w || qw / p.stride_w >= p.Q) continue;
          sum += exact(dy[((n * p.K + k) * p.P + ph / p.stride_h) * p.Q + qw / p.stride_w]) *
                 exact(w[((k * Cg + (c - g * Cg)) * p.R + r) * p.S + s]);
        }
      }
    dx[e] = sum;
  }
}

// dw[k][c][r][s] = sum_{n, p, q} dy[n][k][p][q] * x[n][g * Cg + c][row(p, r)][col(q, s)].
template <class T>
__global__ void wgrad(const T* dy, const T* x, double* dw, ConvProblem p) {
  const int64_t Cg = p.channels_per_group(), Kg = p.filters_per_group();
  const int64_t count = p.K * Cg * p.R * p.S;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < count;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = e % p.S, r = e / p.S % p.R, c = e / (p.S * p.R) % Cg,
                  k = e / (p.S * p.R * Cg);
    const int64_t channel = (k / Kg) * Cg + c;
    double sum = 0.0;
    for (int64_t n = 0; n < p.N; ++n)
      for (int64_t pp = 0; pp < p.P; ++pp) {
        const int64_t h = p.input_row(pp, r);
        if (h < 0 || h >= p.H) continue;
        for (int64_t q = 0; q < p.Q; ++q) {
          const int64_t wi = p.input_col(q, s);
          if (wi < 0 || wi >= p.W) continue;
          sum += exact(dy[((n * p.K + k) * p.P + pp) * p.Q + q]) *
                 exact(x[((n * p.C + channel) * p.H + h) * p.W + wi]);
        }
      }
    dw[e] = sum;
  }
}

}  // namespace conv_reference
