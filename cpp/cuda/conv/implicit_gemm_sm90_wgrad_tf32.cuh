// Hopper TF32 weight gradient: a kernel of ours (no CUTLASS collective) built from cute's WGMMA
// and TMA atoms, over copies of dy and x with the batch innermost.
//
// Why: TF32 WGMMA takes only K-major operands, and wgrad's reduction runs over pixels, so both
// operands must be pixel-contiguous in shared memory. CUTLASS's sm_90 wgrad reads NHWC, where
// both are channel-contiguous: it takes half types only (implicit_gemm_sm90_wgrad.cuh). NCHW
// planes are pixel-contiguous, but a TMA tiled load must start its innermost dimension on a
// 16-byte boundary (an unaligned start is an illegal instruction, measured on H100), and each
// tap shifts x along W, the innermost dimension, by s*dil_w - pad_w: any shift but multiples of
// 4 floats is refused. So the operands are copied with the batch innermost, dy as [K][P][Q][Nb]
// and x as [C][H][W][Nb] (Nb = N rounded up to 4: 16-byte rows, zeros past N), and the shifts
// of every tap fall on H and W, outer dimensions, where any start is allowed, negative ones
// included. Each k tile is 32 positions: kBoxN images (32 or 16 run; 8 builds) x kBoxQ =
// 32 / kBoxN pixels along Q of one output row p:
//   A = dy,  dims (Nb, K, Q, P), box (kBoxN images, 64 filters, kBoxQ pixels, 1) at
//            (n0, k0, q0, p);
//   B = x,   dims (Nb, C, W, H), per tap (r, s) of the CTA and pixel j of the kBoxQ, a box
//            (kBoxN, 64 channels, 1, 1) at (n0, c0, (q0 + j)*stride_w + s*dil_w - pad_w,
//            p*stride_h + r*dil_h - pad_h), or, for one pixel at unit dilation, one box
//            (kBoxN, 64, kTaps, 1) at (n0, c0, q0*stride_w + s0 - pad_w, p*stride_h + r*dil_h -
//            pad_h) for the CTA's taps s0.. together.
// A box row is kBoxN images, 4 * kBoxN bytes: the span of the swizzle used (128, 64 or 32 bytes),
// so each box lands as [pixel][64 filters or channels][kBoxN images], the K-major swizzled
// layout WGMMA reads. Rows of 32 images (128 bytes) run fastest: the TMA moves a box row at a
// time, and 8-image rows took 76.9 us against 56.6 for the 3x3 64->64 N32 56^2 problem. A
// sliding window that loads each x box once per output row instead of once per tap (half the
// bytes, three 64-wide WGMMAs a tile) measured 3-34% slower (docs/performance-log.md, run 24).
// What a box reaches outside the tensor (padding, tails of P and the batch) is read as zeros,
// and a pixel past Q (its dy is zeros) reads x at column -1, zeros too: padding and tails cost
// no code, and every product the kernel stores is one the convolution defines (zeros for every
// other), so non-finite inputs propagate as the definition says. Any stride, padding and
// dilation.
//
// GEMM view: M = K filters (64 a tile), N = 64 channels x kTaps taps (r, s..s+kTaps-1) of one
// filter row, reduction over N*P*Q positions in k tiles of 32. The reduction is split in fixed
// slices (blockIdx.z), each writing its own float32 partial (channels and filters at the
// planner's pitches) in [K,R,S,C] order, the order of the Sm80 kernel's partials, or for
// channels-last weights in HWIO's [R,S,C,K], so that their sum is a streaming one, as the half
// types' Hopper wgrad has it: implicit_gemm.cu reduces them in a fixed order (no atomics; the
// result depends on the problem and the split, never on the schedule).
//
// Warp-specialized: one producer thread (TMA) and one consumer warpgroup (WGMMA, then the
// partial's store from the registers), a pipeline of kStages stages on mbarriers.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/atom/mma_traits_sm90_gmma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cuda_host_adapter.hpp"

namespace jax_kernels {
namespace implicit_gemm {
namespace sm90 {

// What the kernel reads: problem, tiling and the two tensor maps (built on the host).
struct Tf32WgradParams {
  cute::TmaDescriptor dy;  // 64-byte aligned (the type is), as TMA requires
  cute::TmaDescriptor x;
  cute::TmaDescriptor x_taps;  // x in boxes of kTaps pixels along W: a tap group's in one load
  float* partials;         // [split][k_pitch][R][S][c_pitch], or [split][R][S][c_pitch][k_pitch]
  int64_t slice_elements;  // k_pitch*R*S*c_pitch (k_pitch >= K, c_pitch >= C)
  int64_t c_pitch, k_pitch;
  bool rsck;               // the second order (channels-last weights: a streaming sum)
  int K, C, R, S, Q;
  int stride_h, stride_w, pad_h, pad_w, dil_h, dil_w;
  int n_blocks, q_blocks;  // k tiles per output row: n_blocks x q_blocks (kBoxN x kBoxQ each)
  int c_tiles;  // blockIdx.y = (s_group * R + r) * c_tiles + c_tile
  int k_tiles, k_tiles_per_slice;  // P * q_blocks * n_blocks, and per blockIdx.z
};

template <int kTaps_, int kStages_, int kBoxN_>
struct Tf32WgradConfig {
  static constexpr int kTaps = kTaps_;
  static constexpr int kStages = kStages_;
  static constexpr int kTileM = 64;             // filters
  static constexpr int kTileC = 64;             // channels of one tap
  static constexpr int kTileN = kTileC * kTaps;
  static constexpr int kBoxN = kBoxN_;          // images a box row: 8, 16 or 32 (32 to 128 bytes)
  static constexpr int kBoxQ = 32 / kBoxN;      // pixels along Q a k tile
  static constexpr int kTileK = kBoxN * kBoxQ;  // 32 positions
  static_assert(kBoxN == 8 || kBoxN == 16 || kBoxN == 32, "a box row is one swizzle span");
  // The K-major swizzle whose span is a box row.
  using Atom = std::conditional_t<kBoxN == 8, cute::GMMA::Layout_K_SW32_Atom<cute::tfloat32_t>,
               std::conditional_t<kBoxN == 16, cute::GMMA::Layout_K_SW64_Atom<cute::tfloat32_t>,
                                  cute::GMMA::Layout_K_SW128_Atom<cute::tfloat32_t>>>;
  static constexpr int kThreads = 256;          // producer warpgroup + consumer warpgroup
  using T = cute::tfloat32_t;
  static constexpr int kABytes = kTileM * kTileK * 4;
  static constexpr int kBBytes = kTileC * kTileK * 4;  // one tap
  using SmemLayoutA = decltype(cute::tile_to_shape(
      Atom{},
      cute::Shape<cute::Int<kTileM>, cute::Int<kTileK>, cute::Int<kStages>>{}));
  using SmemLayoutB = decltype(cute::tile_to_shape(
      Atom{},
      cute::Shape<cute::Int<kTileN>, cute::Int<kTileK>, cute::Int<kStages>>{}));
  using TiledMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<
          T, T, float, cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::Int<kTileK>>,
          cute::GMMA::Major::K, cute::GMMA::Major::K>()));
  struct alignas(1024) Storage {
    T a[kStages * kTileM * kTileK];
    T b[kStages * kTileN * kTileK];
    alignas(8) uint64_t full[kStages];
    alignas(8) uint64_t empty[kStages];
  };
  static constexpr int kSmemBytes = int(sizeof(Storage)) + 1024;  // + room to align the base
  static_assert(kSmemBytes <= 227 * 1024, "one CTA's shared memory at most");
};

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1)
    tf32_wgrad_kernel(const __grid_constant__ Tf32WgradParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace cute;
  using Storage = typename Config::Storage;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  constexpr int kStages = Config::kStages;
  constexpr int kTaps = Config::kTaps;

  extern __shared__ char smem_raw[];
  Storage& smem = *reinterpret_cast<Storage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  const int thread = int(threadIdx.x);
  const int m0 = int(blockIdx.x) * Config::kTileM;
  const int c_tile = int(blockIdx.y) % p.c_tiles;
  const int rest = int(blockIdx.y) / p.c_tiles;
  const int r = rest % p.R;
  const int s0 = (rest / p.R) * kTaps;
  const int c0 = c_tile * Config::kTileC;
  const int taps = min(kTaps, p.S - s0);
  const int begin = int(blockIdx.z) * p.k_tiles_per_slice;
  const int count = min(p.k_tiles_per_slice, p.k_tiles - begin);  // >= 1 (the planner's split)

  if (thread == 0) {
    for (int i = 0; i < kStages; ++i) {
      FullBarrier::init(&smem.full[i], 1);
      EmptyBarrier::init(&smem.empty[i], 128);  // every consumer thread arrives
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (thread < 128) {  // producer warpgroup: one thread issues the loads, the others are done
    if (thread == 0) {
      cute::prefetch_tma_descriptor(&p.dy);
      cute::prefetch_tma_descriptor(&p.x);
      // A k tile of one pixel at unit dilation: the group's taps read kTaps adjacent columns,
      // one box (the kernel alone: 15-19% less time than a box per tap on the 28^2, 14^2 and
      // 7^2 problems of 128 channels and more; in the product 3x3 512->512 7^2 NHWC went from
      // 69.1 to 61.1 us, the others moved within the noise). Past a short group (taps < kTaps)
      // the box's last columns feed accumulators that are never stored.
      const bool one_box = Config::kBoxQ == 1 && p.dil_w == 1;
      const uint32_t bytes =
          uint32_t(Config::kABytes + (one_box ? kTaps : taps) * Config::kBBytes);
      constexpr uint64_t kHint = uint64_t(TMA::CacheHintSm90::EVICT_NORMAL);  // a valid policy
      const int per_row = p.n_blocks * p.q_blocks;
      int row = begin / per_row, nq = begin % per_row;
      for (int i = 0; i < count; ++i) {
        const int stage = i % kStages;
        const uint32_t phase = uint32_t(i / kStages) & 1u;
        EmptyBarrier::wait(&smem.empty[stage], phase ^ 1u);  // a fresh barrier passes phase 1
        FullBarrier::arrive_and_expect_tx(&smem.full[stage], bytes);
        const int n0 = (nq % p.n_blocks) * Config::kBoxN;
        const int q0 = (nq / p.n_blocks) * Config::kBoxQ;
        SM90_TMA_LOAD_4D::copy(&p.dy, &smem.full[stage], kHint,
                               smem.a + stage * Config::kTileM * Config::kTileK, n0, m0, q0, row);
        // Stage layout of B: [pixel j][tap t][64 channels][kBoxN images] (SmemLayoutB's
        // K-atoms outer), one box per pixel and tap, or per pixel. A pixel past Q (whose dy is
        // zeros) reads column -1, zeros too: each product formed is one the convolution
        // defines, so a non-finite x there cannot reach the sums.
        auto* b = smem.b + stage * Config::kTileN * Config::kTileK;
        const int h = row * p.stride_h + r * p.dil_h - p.pad_h;
        if (one_box) {
          SM90_TMA_LOAD_4D::copy(&p.x_taps, &smem.full[stage], kHint, b, n0, c0,
                                 q0 * p.stride_w + s0 - p.pad_w, h);
        } else {
          for (int j = 0; j < Config::kBoxQ; ++j)
            for (int t = 0; t < taps; ++t)
              SM90_TMA_LOAD_4D::copy(
                  &p.x, &smem.full[stage], kHint,
                  b + (j * Config::kTileN + t * Config::kTileC) * Config::kBoxN, n0, c0,
                  q0 + j < p.Q ? (q0 + j) * p.stride_w + (s0 + t) * p.dil_w - p.pad_w : -1, h);
        }
        if (++nq == per_row) nq = 0, ++row;
      }
    }
    return;
  }

  // Consumer warpgroup.
  const int consumer = thread - 128;
  Tensor sA = make_tensor(make_smem_ptr(smem.a), typename Config::SmemLayoutA{});  // (M,K,PIPE)
  Tensor sB = make_tensor(make_smem_ptr(smem.b), typename Config::SmemLayoutB{});  // (N,K,PIPE)
  typename Config::TiledMma mma;
  ThrMMA thr = mma.get_thread_slice(consumer);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // descriptors (MMA,MMA_M,MMA_K,PIPE)
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, Shape<Int<Config::kTileM>, Int<Config::kTileN>>{});
  clear(acc);

  int previous = 0;
  for (int i = 0; i < count; ++i) {
    const int stage = i % kStages;
    FullBarrier::wait(&smem.full[stage], uint32_t(i / kStages) & 1u);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    gemm(mma, tCrA(_, _, _, stage), tCrB(_, _, _, stage), acc);
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // the previous stage's MMAs are done: release it
    warpgroup_fence_operand(acc);
    if (i > 0) EmptyBarrier::arrive(&smem.empty[previous]);
    previous = stage;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);

  // The partial from the registers: [K][R][S][C] (pairs of channels adjacent), or [R][S][C][K]
  // (8 filters of a warp's store adjacent).
  Tensor coord =
      thr.partition_C(make_identity_tensor(Shape<Int<Config::kTileM>, Int<Config::kTileN>>{}));
  float* out = p.partials + int64_t(blockIdx.z) * p.slice_elements;
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    const int m = m0 + get<0>(coord(e));
    const int n = get<1>(coord(e));
    const int t = n / Config::kTileC;
    const int c = c0 + n % Config::kTileC;
    if (m < p.K && c < p.C && t < taps)
      out[p.rsck ? ((int64_t(r) * p.S + s0 + t) * p.c_pitch + c) * p.k_pitch + m
                 : ((int64_t(m) * p.R + r) * p.S + (s0 + t)) * p.c_pitch + c] = acc(e);
  }
#else
  (void)p;
#endif
}

// A 4-D tensor map of float32 read as TF32 (TMA rounds on the way in, as CUTLASS's TF32
// kernels have it): dims innermost first, their strides in elements (the first is 1), the box,
// the swizzle whose span is the box row, zeros outside.
inline bool encode_tf32_wgrad_box(cute::TmaDescriptor* map, const void* base,
                                  const uint64_t dims[4], const uint64_t strides[4],
                                  const uint32_t box[4]) {
  const uint64_t byte_strides[3] = {strides[1] * 4, strides[2] * 4, strides[3] * 4};
  const uint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapSwizzle swizzle = box[0] == 8    ? CU_TENSOR_MAP_SWIZZLE_32B
                                     : box[0] == 16 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                    : CU_TENSOR_MAP_SWIZZLE_128B;
  CUresult result = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      map, CU_TENSOR_MAP_DATA_TYPE_TFLOAT32, 4, const_cast<void*>(base), dims, byte_strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS;
}

// The two tensor maps over the batch-innermost copies, dy viewed (Nb, K, Q, P) and x (Nb, C,
// W, H): the copies of NCHW tensors are [K][P][Q][Nb] and [C][H][W][Nb], those of NHWC tensors
// [P][Q][K][Nb] and [H][W][C][Nb]. Nb is a multiple of 4 (16-byte rows).
template <class Config>
bool encode_tf32_wgrad_maps(Tf32WgradParams* p, const void* dy, const void* x, bool channels_last,
                            int64_t Nb, int64_t C, int64_t H, int64_t W, int64_t K, int64_t P,
                            int64_t Q) {
  const uint64_t dy_dims[4] = {uint64_t(Nb), uint64_t(K), uint64_t(Q), uint64_t(P)};
  const uint64_t x_dims[4] = {uint64_t(Nb), uint64_t(C), uint64_t(W), uint64_t(H)};
  uint64_t dy_strides[4] = {1, uint64_t(P * Q * Nb), uint64_t(Nb), uint64_t(Q * Nb)};
  uint64_t x_strides[4] = {1, uint64_t(H * W * Nb), uint64_t(Nb), uint64_t(W * Nb)};
  if (channels_last) {
    dy_strides[1] = uint64_t(Nb), dy_strides[2] = uint64_t(K * Nb);
    dy_strides[3] = uint64_t(Q * K * Nb);
    x_strides[1] = uint64_t(Nb), x_strides[2] = uint64_t(C * Nb);
    x_strides[3] = uint64_t(W * C * Nb);
  }
  const uint32_t dy_box[4] = {Config::kBoxN, Config::kTileM, Config::kBoxQ, 1};
  const uint32_t x_box[4] = {Config::kBoxN, Config::kTileC, 1, 1};
  const uint32_t x_taps_box[4] = {Config::kBoxN, Config::kTileC, Config::kTaps, 1};
  return encode_tf32_wgrad_box(&p->dy, dy, dy_dims, dy_strides, dy_box) &&
         encode_tf32_wgrad_box(&p->x, x, x_dims, x_strides, x_box) &&
         encode_tf32_wgrad_box(&p->x_taps, x, x_dims, x_strides, x_taps_box);
}

}  // namespace sm90
}  // namespace implicit_gemm
}  // namespace jax_kernels
