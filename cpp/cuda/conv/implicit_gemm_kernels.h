// Internal interface between the tensor-core dispatcher (implicit_gemm.cu: planning, layout
// kernels) and the CUTLASS instantiations (implicit_gemm_<math>.cu, one file per math mode so that
// they compile in parallel). Only plain C++ types cross it; CUTLASS types stay inside
// implicit_gemm_kernels.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_kernels/ffi_util.h"

namespace jax_kernels {
namespace implicit_gemm {

// Element type and tensor-core instruction: half types multiply on f16/bf16 tensor cores, float32
// on TF32 (kTF32) or on three TF32 products that recover float32 accuracy (kFloat32x3, CUTLASS's
// OpMultiplyAddFastF32: a = big + small, a*b ~ big*big + big*small + small*big). All accumulate in
// float32.
enum class Math { kFloat16, kBFloat16, kTF32, kFloat32x3 };

// Tile class of a kernel: narrow when the GEMM dimension that runs over output channels (filters
// for fprop and wgrad, input channels for dgrad) is at most 64, wide otherwise.
enum class TileClass { kNarrow, kWide };

// Implicit-GEMM convolution on NHWC tensors (CUTLASS 2.x, Sm80 tensor ops, optimized iterators).
enum class NhwcKernel {
  kFprop,         // a = x [N,H,W,C], b = w [K,R,S,C], c = bias [K] or null, d = y [N,P,Q,K]
  kStridedDgrad,  // a = dy [N,P,Q,K], b = w [K,R,S,C], d = dx [N,H,W,C]
  kWgrad,         // a = dy [N,P,Q,K], b = x [N,H,W,C], d = float32 partials [split_k][wgrad order]
};

// The order of each wgrad partial's elements: the Sm80 kernel writes [K,R,S,C] (CUTLASS's filter
// layout); the Hopper kernel may also write HWIO's [R,S,C,K], for channels-last weights, so that
// their reduction is a streaming sum.
enum class WgradOrder { kKRSC, kRSCK };

struct NhwcConv {
  NhwcKernel kernel;
  TileClass tile;
  int N, H, W, C, K, R, S, P, Q;
  int pad_h, pad_w, stride_h, stride_w, dilation_h, dilation_w;
  int split_k;  // wgrad: slices of N*P*Q, each writing its own partial sum (no atomics); else 1
  WgradOrder wgrad_order = WgradOrder::kKRSC;  // kWgrad on Hopper only: any; else kKRSC
  // kFprop, and kWgrad in half types: run the Hopper kernel (implicit_gemm_sm90.cuh) instead of
  // the Sm80 one. The planner sets it where the device is compute capability 9.0 and the kernel
  // takes the problem (for kWgrad with a split of its own, at most the planned one).
  bool sm90 = false;
  // kFprop on Hopper (sm90): d is written NCHW, [N][K][P][Q], by the kernel's epilogue (no NHWC
  // output and no transpose). The planner sets it for NCHW problems of one group whose output
  // channels need no padding.
  bool d_nchw = false;
  // kFprop on Hopper (sm90) with an NHWC output: d's strides in elements between output columns,
  // rows and images, where they are not the packed (K, Q*K, P*Q*K) (0: packed). The strided
  // dgrad's stride phases (dgrad_phases.cuh) write their pixels of dx this way.
  int64_t d_stride_q = 0, d_stride_p = 0, d_stride_n = 0;
  const void* a;
  const void* b;
  const void* c;
  void* d;
};

// Batched GEMM on NCHW data, for 1x1 / stride 1 / no padding convolutions (no layout change):
// for each image n, D[n] (M x N) = A[n] (M x K) * B[n] (K x N), all matrices with unit stride in
// the dimension named below and leading dimensions lda / ldb / ldd.
enum class GemmKernel {
  kFprop,  // A = w [K_out x C] row-major (batch stride 0), B = x[n] [C x HW] row-major, D = y[n];
           // c = bias expanded to [K_out x HW] (batch stride 0) or null
  kDgrad,  // A = w^T [C x K_out] column-major (batch stride 0), B = dy[n] [K_out x HW] row-major,
           // D = dx[n]
  kWgrad,  // A = dy[n] [K_out x HW] row-major, B = x[n]^T [HW x C] column-major, D = float32
           // partial dw[n] [K_out x C]
};

struct BatchedGemm {
  GemmKernel kernel;
  TileClass tile;
  int M, N, K;
  int64_t lda, ldb, ldd;
  int batch_count;
  int64_t batch_stride_a, batch_stride_b, batch_stride_d;
  const void* a;
  const void* b;
  const void* c;
  void* d;
};

// Host-only (never touches the device, so the scratch query works without a GPU): whether the
// kernel of this math mode takes the problem. Pointers may be null here.
template <Math M>
bool can_implement(const NhwcConv& conv);
template <Math M>
bool can_implement(const BatchedGemm& gemm);

// Output tiles of the kernel that runs the problem (blocks per split-K slice, or per image),
// from its tile shape: the planner sizes splits with it. Host-only.
template <Math M>
int64_t output_tiles(const NhwcConv& conv);
template <Math M>
int64_t output_tiles(const BatchedGemm& gemm);

// Launches on the stream; re-checks can_implement (with the real pointers) first.
template <Math M>
ffi::Error run(const NhwcConv& conv, cudaStream_t stream);
template <Math M>
ffi::Error run(const BatchedGemm& gemm, cudaStream_t stream);

// The slices that splitting k_tiles `split` ways makes when each slice but the last takes
// ceil(k_tiles / split) tiles: `split` itself, or fewer where the last ones would be empty. The
// Hopper wgrads' planners split this way, and their kernels check it (every slice non-empty).
inline int64_t nonempty_split(int64_t k_tiles, int64_t split) {
  const int64_t per = (k_tiles + split - 1) / split;
  return (k_tiles + per - 1) / per;
}

// The Hopper kernels (CUTLASS 3.x implicit GEMM: TMA im2col loads, WGMMA; compiled for sm_90a in
// implicit_gemm_sm90_<math>.cu, when the build targets sm_90): kFprop for float16, bfloat16 and
// TF32 (not kFloat32x3), kWgrad for float16 and bfloat16 (implicit_gemm_sm90_wgrad.cuh; TF32's
// is BatchInnerWgrad's kernel, below).
// Host-only can_implement, as above; run re-checks it with the pointers. sm90_wgrad_tiles: the
// Hopper wgrad kernel's tiling of the problem (its tile class), for the planner's split.
struct Sm90WgradTiles {
  int64_t output = 0;     // output tiles: the kernel's blocks per slice (0 for TF32: none here)
  int64_t reduction = 0;  // k tiles of the N*P*Q reduction, which the slices share out
};
// The Hopper TF32 wgrad (implicit_gemm_sm90_wgrad_tf32.cuh, one group, any stride, filters of
// more than one tap): reads copies of dy and x with the batch innermost, padded with zero images
// to Nb (a multiple of 4): of NCHW tensors [K][P][Q][Nb] and [C][H][W][Nb], of NHWC ones
// [P][Q][K][Nb] and [H][W][C][Nb]. It writes float32 partials slice_elements apart, each
// [k_pitch][R][S][c_pitch] (WgradOrder::kKRSC), or [R][S][c_pitch][k_pitch] (kRSCK) for
// channels-last weights. Its tiling is host arithmetic, here, so that the
// planner sizes the scratch the same way on every device and build: 64 filters x 3 taps of one
// filter row x 64 channels a CTA (one CTA per SM: registers and shared memory bound it), box
// rows of 32 images, or 16 for batches under 32 (the planner takes batches of 16 and more).
struct BatchInnerWgrad {
  int N, Nb, C, H, W, K, R, S, P, Q;
  int stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
  bool channels_last;
  WgradOrder order;
  int64_t c_pitch, k_pitch, slice_elements;
  int split;
  const void* dy;
  const void* x;
  void* partials;
};
constexpr int kBatchInnerTaps = 3;
inline int batch_inner_box(const BatchInnerWgrad& w) { return w.N >= 32 ? 32 : 16; }
inline int64_t batch_inner_output_tiles(const BatchInnerWgrad& w) {
  return (int64_t(w.K) + 63) / 64 * ((int64_t(w.C) + 63) / 64) * w.R *
         ((w.S + kBatchInnerTaps - 1) / kBatchInnerTaps);
}
inline int64_t batch_inner_k_tiles(const BatchInnerWgrad& w) {
  const int64_t box = batch_inner_box(w), pixels = 32 / box;
  return int64_t(w.P) * ((w.N + box - 1) / box) * ((w.Q + pixels - 1) / pixels);
}
ffi::Error sm90_tf32_wgrad_run(const BatchInnerWgrad& wgrad, cudaStream_t stream);

template <Math M>
bool sm90_can_implement(const NhwcConv& conv);
template <Math M>
ffi::Error sm90_run(const NhwcConv& conv, cudaStream_t stream);
template <Math M>
Sm90WgradTiles sm90_wgrad_tiles(const NhwcConv& conv);

// The Hopper pointwise GEMM (implicit_gemm_sm90_pointwise.cuh; float16, bfloat16, TF32): an
// fprop of 1x1 taps, unit stride and no padding with a packed NHWC output, as one persistent
// GEMM over the pixels. It takes a subset of what sm90_can_implement takes, so the planner plans
// the conv kernel and the dispatcher runs this one instead where it takes the problem.
// can_implement as above; run re-checks it with the pointers.
template <Math M>
bool sm90_pointwise_can_implement(const NhwcConv& conv);
template <Math M>
ffi::Error sm90_pointwise_run(const NhwcConv& conv, cudaStream_t stream);

// The Hopper pointwise weight gradient (implicit_gemm_sm90_pointwise_wgrad.cuh; float16, bfloat16,
// TF32): a kWgrad of 1x1 taps, unit stride and no padding on channels-last tensors read in place,
// as one persistent GEMM batched over `split_k` equal slices of the pixels (which the split must
// divide), each writing a float32 partial in HWIO order (wgrad_order kRSCK). Its tiling is host
// arithmetic, here, so that the planner's split is the same on every device and build: the GEMM's
// rows (128 a tile) are the larger of the filters and the channels, its columns the other, 64 a
// tile where they are at most 64, 96 where 96 divides them and 128 does not (ConvNeXt's 96,
// 192, 384... channels: no empty columns), else 128.
struct PointwiseWgradTiling {
  bool channels_as_rows = false;  // rows are the channels (more channels than filters)
  int64_t rows = 0, cols = 0;     // the GEMM's extents
  int tile_cols = 64;             // 64, 96 or 128 columns a tile
  int64_t tiles = 0;              // output tiles of one slice
};
inline PointwiseWgradTiling pointwise_wgrad_tiling(int64_t K, int64_t C) {
  PointwiseWgradTiling t;
  t.channels_as_rows = C > K;
  t.rows = t.channels_as_rows ? C : K, t.cols = t.channels_as_rows ? K : C;
  t.tile_cols = t.cols <= 64 ? 64 : t.cols % 96 == 0 && t.cols % 128 != 0 ? 96 : 128;
  t.tiles = (t.rows + 127) / 128 * ((t.cols + t.tile_cols - 1) / t.tile_cols);
  return t;
}
template <Math M>
bool sm90_pointwise_wgrad_can_implement(const NhwcConv& conv);
template <Math M>
ffi::Error sm90_pointwise_wgrad_run(const NhwcConv& conv, cudaStream_t stream);

}  // namespace implicit_gemm
}  // namespace jax_kernels
