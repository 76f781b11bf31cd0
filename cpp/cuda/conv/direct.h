// The direct conv2d kernels' interface: to the FFI handlers (handlers.cu), to the standalone
// check (tools/conv_direct_check.cu) and between their files. They are correct for every problem
// (any groups, stride, dilation, padding, dtype) and fast for depthwise and few-channels-per-group
// convolutions, where implicit GEMM idles the tensor cores:
//
// - Forward and dgrad are one stencil (conv.h's StencilAxis: the dgrad is the stencil of dy
//   upsampled by the stride, with flipped taps), run by run_stencil (stencil.cu): a block stages
//   halo tiles of a few source planes in shared memory. Unit-stride 3x3, 5x5 and 7x7 taps (the
//   depthwise convolutions of real networks) take one of two unrolled kernels:
//   * float32/float64, the strip kernel: each thread computes a register block of 7 or 8 rows x
//     4 columns with the weights in registers, reading each tile row once as 16-byte vectors and
//     reusing it for every tap and output that needs it.
//   * float16/bfloat16, the tensor-core kernel: a row of taps is a banded (Toeplitz) 16x8 matrix,
//     so 16 output rows x 8 columns are kTaps mma.sync m16n8k16 (f32 accumulation) of 16x16 tiles
//     of the source read with ldmatrix. The products of half-type inputs are exact in float32.
//     Planes of at most kHalfStripsAt outputs (tiling.h) take the strip kernel instead, its
//     tiles in the half type, widened to float as they are read.
//   With one source plane per output plane and vector-aligned rows, both run as persistent,
//   cp.async-pipelined kernels (stencil_pipelined.cu) with the same sums in the same order.
//   Other geometries take the same tiles with run-time loops, or global memory when their tile
//   would not fit.
// - Wgrad (weight_gradient.cu): for each (filter, channel) pair and fixed slice of images, a
//   block reduces dy x x over the slice into R*S partial sums stored in the scratch buffer; a
//   second kernel adds the slices in order. No atomics: bitwise reproducible. Unit-stride
//   3x3/5x5/7x7 taps use the strip kernel's register blocks (float32/float64, and half types on
//   planes of at most kHalfStripsAt outputs) or tensor cores (half types: taps x taps = sums
//   over rows and columns of dy x shifted rows of x, an m16n8k16 product per 16 columns).
// - Bias gradient (weight_gradient.cu): one block per (batch, filter), a fixed-order reduction.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "conv/tiling.h"
#include "jax_kernels/conv.h"
#include "jax_kernels/ffi_util.h"

namespace jax_kernels {

// The bias gradients (weight_gradient.cu, direct_nhwc.cu) sum each thread's terms in blocks of
// this many, then add the blocks: one float32 accumulator over 2^26 terms (a 2^31-row dy) lost
// whole units; blocks keep the error near (block + blocks) ulps. Up to one block per thread the
// result is the plain running sum, bit for bit.
constexpr int64_t kBiasBlockTerms = 4096;

// out[n, g*Og + o, y, x] = bias + sum_{i, r, s} w(g, o, i, r, s) * upsampled source[n, g*Ig + i]
// at (rows.position(y, r), cols.position(x, s)).
struct StencilGrid {
  StencilAxis rows, cols;
  StencilWeights weights;
  int64_t planes;  // N * out_channels
  int64_t out_channels, in_channels, in_per_group, out_per_group;
  int64_t tiles_x, tiles_y, blocks;
  int bx, by, bz;              // a tile: bx threads x by strips of rows; bz planes per block
  int src_rows, src_cols;      // the shared tile of one plane, in upsampled source positions
  int pitch, tile_stride;      // elements between tile rows, and between the planes' tiles
  int mt, nt, warps_per_plane;  // tensor-core kernel: a tile of mt x nt 16x8 outputs per plane
  int x_base;                  // first output column of the column tiles (in (-16, 0])
  bool vector_source;          // stage_tile_vectors applies (tile origins are vector-aligned)
  bool vector_out;             // output vectors (of 4; pairs for mma) are aligned
  bool vector_out16;           // output rows start on 16 bytes (staged mma stencil epilogue)

  // Source plane (n, g * in_per_group + i) of output plane (n, g * out_per_group + o); 32-bit
  // (the unrolled kernels run with fewer than 2^31 planes).
  __device__ int64_t source_plane(int plane, int i) const {
    const int n = plane / int(out_channels), oc = plane % int(out_channels);
    return int64_t(n) * in_channels + (oc / int(out_per_group)) * in_per_group + i;
  }
};

// The stencil of the forward (y from x) and of the dgrad (dx from dy with the flipped filter):
// what it reads and writes; run_stencil fills in the launch shape.
inline StencilGrid forward_grid(const ConvProblem& p) {
  StencilGrid G{};
  G.rows = forward_rows(p);
  G.cols = forward_cols(p);
  G.weights = forward_weights(p);
  G.planes = p.N * p.K;
  G.out_channels = p.K;
  G.in_channels = p.C;
  G.in_per_group = p.channels_per_group();
  G.out_per_group = p.filters_per_group();
  return G;
}

inline StencilGrid backward_data_grid(const ConvProblem& p) {
  StencilGrid G{};
  G.rows = backward_data_rows(p);
  G.cols = backward_data_cols(p);
  G.weights = backward_data_weights(p);
  G.planes = p.N * p.C;
  G.out_channels = p.C;
  G.in_channels = p.K;
  G.in_per_group = p.filters_per_group();
  G.out_per_group = p.channels_per_group();
  return G;
}

// out = the stencil G of source (plus bias per output channel when not null), every dtype.
template <class T>
ffi::Error run_stencil(cudaStream_t stream, const char* op, const T* source, const T* weight,
                       const T* bias, T* out, StencilGrid G);

// The pipelined kernels apply: one source plane per output plane, staged as whole vectors.
inline bool pipelined(const StencilGrid& G) { return G.in_per_group == 1 && G.vector_source; }

// Launches the pipelined stencil kernel of G (planned by run_stencil for the unrolled kernels,
// pipelined(G) true): the tensor-core one for half types, else the strip kernel of `rows` rows.
template <class T>
void launch_stencil_pipelined(cudaStream_t stream, const T* source, const T* weight,
                              const T* bias, T* out, const StencilGrid& G, int taps, int rows);

// The scratch bytes of run_wgrad: the partial sums of each slice of images.
template <class T>
int64_t wgrad_scratch_bytes(const ConvProblem& p);

// dw [K, C/g, R, S] from dy [N, K, P, Q] and x [N, C, H, W], with scratch of at least
// wgrad_scratch_bytes<T>(p) bytes.
template <class T>
ffi::Error run_wgrad(cudaStream_t stream, const T* dy, const T* x, T* dw, const ConvProblem& p,
                     void* scratch, int64_t scratch_bytes);

// ---- Channels last (direct_nhwc.cu): NHWC activations, HWIO weights ---------------------------

// out[n, y, x, g*Og + o] = bias + sum_{i, r, s} w(g, o, i, r, s) * upsampled source at (n, rows
// position, cols position, g*Ig + i); source and output indexed (n, channel, row, column).
struct NhwcStencil {
  StencilAxis rows, cols;
  StencilWeights weights;
  TensorStrides source_at, out_at;
  int64_t N, groups, in_per_group, out_per_group;
};

NhwcStencil forward_nhwc(const ConvProblem& p);
NhwcStencil backward_data_nhwc(const ConvProblem& p);

template <class T>
ffi::Error run_stencil_nhwc(cudaStream_t stream, const char* op, const T* source, const T* weight,
                            const T* bias, T* out, const NhwcStencil& s);

// The scratch bytes of run_wgrad_nhwc: the partial sums of each slice of output positions.
template <class T>
int64_t wgrad_nhwc_scratch_bytes(const ConvProblem& p);

// dw [R, S, C/g, K] from dy [N, P, Q, K] and x [N, H, W, C].
template <class T>
ffi::Error run_wgrad_nhwc(cudaStream_t stream, const T* dy, const T* x, T* dw,
                          const ConvProblem& p, void* scratch, int64_t scratch_bytes);

// ---- Bias gradient (bias_gradient.cu), both layouts --------------------------------------------

// The scratch bytes of run_bias_gradient (float partials of the chunks; 0 for one chunk per
// filter), -1 for negative extents, kSizeOverflow past int64.
int64_t bias_gradient_scratch_bytes(ConvLayout layout, ConvDtype dtype, int64_t batch, int64_t N,
                                    int64_t K, int64_t plane);

// db [B, K] from dy [B, N, K, plane] (NCHW) or [B, N * plane, K] (NHWC); B = 1 unbatched. With
// less scratch than bias_gradient_scratch_bytes (or none), the same sums in one pass per filter.
template <class T>
ffi::Error run_bias_gradient(cudaStream_t stream, ConvLayout layout, const T* dy, T* db,
                             int64_t batch, int64_t N, int64_t K, int64_t plane, void* scratch,
                             int64_t scratch_bytes);

}  // namespace jax_kernels
