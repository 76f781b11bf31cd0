// Strided dgrad as unit-stride convolutions, one per stride phase (the Hopper route of
// implicit_gemm.cu; the Sm80 path has a strided-dgrad kernel of its own, and CUTLASS 3.x's sm_90a
// dgrad takes unit strides only).
//
// With stride (sh, sw), padding (pt, pl) and unit dilation, the forward reads x row
// h = p*sh + r - pt at output row p and tap r. So the dx rows h = a + sh*m of one phase
// a in [0, sh) receive only the taps r = r0 + sh*j with r0 = (a + pt) mod sh, each from
// dy row p = m + ca - j with ca = (a + pt) div sh:
//   dx[a + sh*m] = sum_j dy[m + ca - j] w[r0 + sh*j],
// a unit-stride correlation of dy with the phase's taps flipped, t = taps - 1 - j, at top
// padding taps - 1 - ca. The columns split the same way, so phase (a, b) is a stride-1 fprop
// over dy with a filter of taps_h x taps_w taps (the flipped transpose of the weights' taps in
// that phase: [C][taps_h][taps_w][K]) whose output is the phase's pixels of dx: the Hopper fprop
// writes them through output strides (sw*C, sh*W*C, H*W*C) from dx + (a*W + b)*C. Every tap
// belongs to exactly one phase, so the phases' filters together are the weights' size, and every
// product formed is one the convolution defines (no zero taps, unlike the Sm80 kernel's).
//
// A phase whose rows or columns get no tap (stride past the filter, e.g. 1x1/2) has dx zeros:
// zero_kernel writes them, beside the phases (on a stream of its own: implicit_gemm.cu's
// run_phases), so that its stores overlap their reductions. (Run alone, such a kernel took as
// long as zeroing all of dx before the phases: 32.3 us against cudaMemsetAsync's 31.1 for
// float32 N32 256 channels 56^2 at 1x1/2, run 25. Beside the phase, that dgrad took 69.0 us a
// call in-jit, against 73.6 with the zeros after it on one stream, H200, run 26.)
// Not expressible this way (the planner then keeps the Sm80 kernel): a phase whose top padding
// would be negative (padding past the filter's reach), one whose unit-stride output would run
// past its dx rows (bottom padding wider than the top's), and more than kMaxPhases phases.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/grid_stride.cuh"
#include "common/status.h"
#include "conv/tiling.h"
#include "jax_kernels/conv.h"

namespace jax_kernels {
namespace dgrad_phases {

constexpr int kMaxPhases = 16;

// Phase (a, b) of a strided dgrad: its dx pixels (a + sh*m, b + sw*n), m < P, n < Q; its first
// tap (r0, s0) in the weights' own orientation and its tap counts; the top and left padding of
// its unit-stride fprop over dy; and where its filter starts among the phases' filters
// (elements).
// cols column phases b, b + 1, ..., b + cols - 1 of row a that have the same taps, padding and
// columns run as one fprop whose output channel j*Cp + c is channel c of column phase b + j:
// their pixels (a + sh*m, b + j + sw*n) are adjacent in an NHWC dx, so the fprop's output pixel
// n is cols*Cp contiguous channels, pixels sw*Cp apart (2x2/2: two launches of 2*C filters
// instead of four of C). Column b + j's first tap is first_s + j.
struct Phase {
  int a, b;
  int first_r, first_s;
  int taps_h, taps_w;
  int pad_h, pad_w;
  int P, Q;
  int cols;
  int64_t w_offset;
};

struct Phases {
  int count = 0;           // phases with dx pixels and taps, in phase[]
  bool zero_fill = false;  // some phase has dx pixels but no tap: zero_kernel writes them
  // Bit a (b): phase row a (column b) has dx rows (columns) but no tap. A dx pixel (h, w) is
  // zero where bit h mod sh of zero_rows or bit w mod sw of zero_cols is set.
  uint32_t zero_rows = 0, zero_cols = 0;
  Phase phase[kMaxPhases];
};

// One dimension's phase a: rows (0 if none), first tap, tap count and top padding; false where
// the top padding would be negative.
struct Axis {
  int64_t rows, first, taps, pad;
};
inline bool axis_phase(int64_t a, int64_t extent, int64_t taps, int64_t pad, int64_t stride,
                       Axis* out) {
  out->rows = a < extent ? (extent - a + stride - 1) / stride : 0;
  out->first = (a + pad) % stride;
  out->taps = out->first < taps ? (taps - out->first + stride - 1) / stride : 0;
  out->pad = out->taps - 1 - (a + pad) / stride;
  return out->taps == 0 || out->pad >= 0;
}

// The phases of p's dgrad (unit dilation, strides not both 1), filters [cols*Cgp][taps][Kgp]
// each (channels and filters padded as the kernels see them), adjacent column phases of equal
// taps merged where `merge`; false where the problem is not expressible this way (above). Host
// arithmetic only, identical at trace and run time.
inline bool plan(const ConvProblem& p, int64_t Kgp, int64_t Cgp, Phases* out, bool merge = true) {
  *out = Phases{};
  if (p.dilation_h != 1 || p.dilation_w != 1 || (p.stride_h == 1 && p.stride_w == 1) ||
      p.stride_h * p.stride_w > kMaxPhases)
    return false;
  int64_t offset = 0;
  for (int64_t a = 0; a < p.stride_h; ++a) {
    Axis rows;
    if (!axis_phase(a, p.H, p.R, p.pad_top, p.stride_h, &rows)) return false;
    for (int64_t b = 0; b < p.stride_w; ++b) {
      Axis cols;
      if (!axis_phase(b, p.W, p.S, p.pad_left, p.stride_w, &cols)) return false;
      if (rows.rows == 0 || cols.rows == 0) continue;  // no dx pixel in this phase
      if (rows.taps == 0 || cols.taps == 0) {
        out->zero_fill = true;
        if (rows.taps == 0) out->zero_rows |= uint32_t(1) << a;
        if (cols.taps == 0) out->zero_cols |= uint32_t(1) << b;
        continue;
      }
      // The fprop's output over all P dy rows, P + pad - taps + 1 (CUTLASS forms it from the
      // input, the padding and the taps), must not outnumber the phase's dx rows; a bottom
      // padding wider than the top's can make it (the kernel then pads the bottom up to them).
      if (p.P + rows.pad - rows.taps + 1 > rows.rows || p.Q + cols.pad - cols.taps + 1 > cols.rows)
        return false;
      if (merge && out->count > 0) {  // the column phase to the left, extended?
        Phase& left = out->phase[out->count - 1];
        if (left.a == int(a) && left.b + left.cols == int(b) && left.taps_w == int(cols.taps) &&
            left.pad_w == int(cols.pad) && left.Q == int(cols.rows) &&
            left.first_s + left.cols == int(cols.first)) {
          ++left.cols;
          offset += Cgp * rows.taps * cols.taps * Kgp;
          continue;
        }
      }
      Phase& f = out->phase[out->count++];
      f.a = int(a), f.b = int(b);
      f.first_r = int(rows.first), f.first_s = int(cols.first);
      f.taps_h = int(rows.taps), f.taps_w = int(cols.taps);
      f.pad_h = int(rows.pad), f.pad_w = int(cols.pad);
      f.P = int(rows.rows), f.Q = int(cols.rows);
      f.cols = 1;
      f.w_offset = offset;
      offset += Cgp * rows.taps * cols.taps * Kgp;
    }
  }
  return out->count > 0;
}

// The phases' filters from the weights (one group: KCRS [K][C][R][S], or HWIO [R][S][C][K] where
// hwio): out[w_offset + (((j * Cp + c) * taps_h + t) * taps_w + u) * Kp + k] =
// w[k][c][first_r + sh*(taps_h-1-t)][first_s + j + sw*(taps_w-1-u)] for merged column j < cols,
// zeros for padded channels (c >= C) and filters (k >= K). Bits: the element's raw bits.
template <class Bits>
struct WeightsJob {
  const Bits* w;
  Bits* out;
  int64_t K, C, R, S, Kp, Cp;
  int stride_h, stride_w;
  bool hwio;
  Phases phases;
};

template <class Bits, class Index>
__global__ void weights_kernel(const WeightsJob<Bits> job) {
  const Phase& f = job.phases.phase[blockIdx.y];
  const Index total = Index(f.cols * job.Cp * f.taps_h * f.taps_w * job.Kp);
  const GridStride<Index> loop(total, blockDim.x, threadIdx.x);
  for (Index i = loop.first; i < total; i = loop.next(i)) {
    const Index k = i % Index(job.Kp);
    Index rest = i / Index(job.Kp);
    const Index u = rest % f.taps_w;
    rest /= f.taps_w;
    const Index t = rest % f.taps_h, o = rest / f.taps_h;
    const Index j = o / Index(job.Cp), c = o % Index(job.Cp);
    Bits v = 0;
    if (k < job.K && c < job.C) {
      const int64_t r = f.first_r + int64_t(job.stride_h) * (f.taps_h - 1 - t);
      const int64_t s = f.first_s + j + int64_t(job.stride_w) * (f.taps_w - 1 - u);
      v = job.hwio ? job.w[((r * job.S + s) * job.C + c) * job.K + k]
                   : job.w[((int64_t(k) * job.C + c) * job.R + r) * job.S + s];
    }
    job.out[f.w_offset + i] = v;
  }
}

template <class Bits>
ffi::Error launch_weights(cudaStream_t stream, const WeightsJob<Bits>& job) {
  int64_t largest = 0;
  for (int i = 0; i < job.phases.count; ++i) {
    const Phase& f = job.phases.phase[i];
    largest = std::max(largest, f.cols * job.Cp * f.taps_h * f.taps_w * job.Kp);
  }
  constexpr int kThreads = 256;
  const dim3 grid(unsigned(std::min<int64_t>(1024, std::max<int64_t>(1, (largest + kThreads - 1) / kThreads))),
                  unsigned(job.phases.count));
  // The largest index formed is below largest + one grid stride.
  if (largest + int64_t(grid.x) * kThreads < (int64_t(1) << 31))
    weights_kernel<Bits, int32_t><<<grid, kThreads, 0, stream>>>(job);
  else
    weights_kernel<Bits, int64_t><<<grid, kThreads, 0, stream>>>(job);
  return launch_status("conv2d (strided dgrad's phase filters)");
}

// Zeros to the pixels of dx ([rows = N*H][W][units of 16 bytes]) that no tap reaches
// (Phases::zero_rows, zero_cols). A block's threads are (units, pixels of a row): x over a
// pixel's 16-byte units, y over the row's pixels; blocks stride over the rows. No division
// per element: one per row and one (a modulo by the stride) per pixel.
struct ZeroJob {
  uint4* dx;
  int64_t rows;
  int H, W, units;
  int stride_h, stride_w;
  uint32_t zero_rows, zero_cols;
};

static __global__ void zero_kernel(const ZeroJob job) {
  for (int64_t row = blockIdx.x; row < job.rows; row += gridDim.x) {
    const bool whole = (job.zero_rows >> (int(row % job.H) % job.stride_h)) & 1;
    uint4* out = job.dx + row * job.W * job.units;
    for (int w = threadIdx.y; w < job.W; w += blockDim.y) {
      if (!whole && !((job.zero_cols >> (w % job.stride_w)) & 1)) continue;
      for (int u = threadIdx.x; u < job.units; u += blockDim.x)
        out[int64_t(w) * job.units + u] = make_uint4(0, 0, 0, 0);
    }
  }
}

// Whether zero_kernel can write this dx: 16-byte aligned, pixels a whole number of 16 bytes.
inline bool zero_kernel_fits(const void* dx, int64_t pixel_bytes) {
  return aligned_to(dx, 16) && pixel_bytes % 16 == 0 && pixel_bytes > 0 &&
         pixel_bytes / 16 <= (int64_t(1) << 30);
}

inline ffi::Error launch_zeros(cudaStream_t stream, const Phases& phases, void* dx, int64_t N,
                               int64_t H, int64_t W, int64_t pixel_bytes, int stride_h,
                               int stride_w, int multiprocessors) {
  ZeroJob job{static_cast<uint4*>(dx), N * H, int(H), int(W), int(pixel_bytes / 16),
              stride_h, stride_w, phases.zero_rows, phases.zero_cols};
  int tx = 1;
  while (tx < job.units && tx < 32) tx *= 2;
  const dim3 block(unsigned(tx), unsigned(256 / tx));
  const int64_t blocks = std::min<int64_t>(job.rows, int64_t(multiprocessors) * 8);
  const unsigned grid = unsigned(std::max<int64_t>(1, blocks));
  zero_kernel<<<grid, block, 0, stream>>>(job);
  return launch_status("conv2d (strided dgrad's zeroed phases)");
}

}  // namespace dgrad_phases
}  // namespace jax_kernels
