// The Hopper fprop's epilogue for NCHW outputs (implicit_gemm_sm90.cuh, FpropConfig with
// kNchw): the tile's accumulators, bias added, go through shared memory to y[n][k][p][q], so that
// NCHW forwards and unit-stride dgrads need no transpose after the GEMM.
//
// CUTLASS's own epilogues cannot write this layout: the TMA store of a conv output walks pixels
// through an im2col descriptor that needs channels innermost, and an M-major (pixel-innermost) D
// over the hierarchical (Q, P, N) mode makes a TMA box of run-time size, which cute does not
// build. Stores straight from the registers (measured first, run 22) write, per warp
// instruction, 4 filters' runs of 8 pixels, half of a 32-byte sector each: the bf16 3x3 64->64
// N32 56^2 kernel took 43.7 us against 26.8 with the TMA epilogue. Here the consumer warpgroup
// writes its accumulators to a [filter][pixel] tile in shared memory (the kernel gives mainloop
// and epilogue storage one union: the tile costs no pipeline stage), then stores runs of
// consecutive pixels of one filter: 16-byte vectors where the plane P*Q is a multiple of 16 bytes,
// 8-byte ones (half types) where it is of 8, single elements otherwise, whole sectors a warp.
//
// The GEMM's M index is the linearized output pixel m = (n * P + p) * Q + q (the conv kernel
// hands the epilogue that flat extent at run time), so m's plane offset is m mod P*Q and its
// image m / (P*Q): one FastDivmod per thread and run.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/fast_math.h"

namespace jax_kernels {
namespace implicit_gemm {
namespace sm90 {

// A vector of kBytes bytes (16, 8, 4 or 2).
template <int kBytes>
using Word = std::conditional_t<
    kBytes == 16, uint4,
    std::conditional_t<kBytes == 8, uint2, std::conditional_t<kBytes == 4, uint32_t, uint16_t>>>;

template <class E, int kTileM, int kTileN>
class NchwEpilogue {
 public:
  using ElementC = void;  // no source tensor
  using ElementD = E;
  // ((plane offset, image), filter, batch): only the image and filter strides are read.
  using StrideC = cute::Stride<cute::Stride<cute::_1, int64_t>, int64_t, cute::_0>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  using ThreadEpilogueOp = void;
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  static constexpr int kThreads = 128;  // the consumer warpgroup
  static_assert(kTileM == kThreads, "one output pixel of the tile per consumer thread");
  // Rows of the [filter][pixel] tile are padded by 16 bytes: the accumulator writes (8 pixels x
  // 4 filters a warp) then fall on distinct banks.
  static constexpr int kPitch = kTileM + 16 / int(sizeof(E));
  struct SharedStorage {
    alignas(128) E tile[kTileN * kPitch];
  };
  using TensorStorage = SharedStorage;

  struct Arguments {
    const E* bias = nullptr;  // [K] or null
    E* d = nullptr;
    StrideD stride{};  // image stride K*P*Q, filter stride P*Q
  };
  struct Params {
    const E* bias;
    E* d;
    int64_t image_stride, filter_stride;
    cutlass::FastDivmod plane;  // m -> (image, offset in the P*Q plane)
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(const ProblemShape& shape, const Arguments& args, void*) {
    // The host's shape: ((Q, P, N), K, (C, S, R), 1); the plane is M without its batch extent.
    const auto m = cute::get<0>(shape);
    constexpr int kRank = decltype(cute::rank(m))::value;
    const int plane = int(cute::size(m)) / int(cute::get<kRank - 1>(m));
    return {args.bias, args.d, cute::get<0, 1>(args.stride), cute::get<1>(args.stride),
            cutlass::FastDivmod(plane)};
  }
  template <class ProblemShape>
  static size_t get_workspace_size(const ProblemShape&, const Arguments&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(const ProblemShape&, const Arguments&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  // Any problem the mainloop takes. The planner asks before the pointers are known; the run
  // checks that d is 16-byte aligned (pointers_and_padding_fit), which the vector stores need.
  template <class ProblemShape>
  static bool can_implement(const ProblemShape&, const Arguments&) {
    return true;
  }

  CUTLASS_HOST_DEVICE
  NchwEpilogue(const Params& params, const SharedStorage& = SharedStorage()) : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL shape, BlockShapeMNK block_shape,
                                 BlockCoordMNKL block_coord,
                                 const cute::Tensor<FrgEngine, FrgLayout>& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread, char* smem) {
    using namespace cute;
    static_assert(size(TiledMma{}) == kThreads);
    // The device's shape is the linearized one: M = N*P*Q, N = K.
    const int M = int(size(get<0>(shape))), K = int(size(get<1>(shape)));
    const int m0 = int(get<0>(block_coord)) * kTileM, k0 = int(get<1>(block_coord)) * kTileN;
    E* tile = reinterpret_cast<SharedStorage*>(smem)->tile;
    const Tensor coords =
        local_tile(make_identity_tensor(make_shape(M, K)), take<0, 2>(block_shape),
                   make_coord(get<0>(block_coord), get<1>(block_coord)));  // (m, k) of the tile
    const Tensor mine = tiled_mma.get_thread_slice(thread).partition_C(coords);
    CUTE_STATIC_ASSERT_V(size(mine) == size(accumulators));
    // The tile shares its storage with the mainloop's stages: every warp's MMAs are done
    // reading them before any warp writes.
    cutlass::arch::NamedBarrier::sync(
        kThreads, int(cutlass::arch::ReservedNamedBarriers::EpilogueBarrier));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accumulators); ++i) {
      const int m = get<0>(mine(i)), k = get<1>(mine(i));
      float v = float(accumulators(i));
      if (params_.bias != nullptr && k < K) v += float(params_.bias[k]);
      tile[(k - k0) * kPitch + (m - m0)] = E(v);
    }
    cutlass::arch::NamedBarrier::sync(
        kThreads, int(cutlass::arch::ReservedNamedBarriers::EpilogueBarrier));
    const int64_t plane = params_.filter_stride;
    if (plane % (16 / int(sizeof(E))) == 0) {
      store<16 / int(sizeof(E))>(tile, thread, m0, k0, M, K);
    } else if (sizeof(E) == 2 && plane % 4 == 0) {
      store<4>(tile, thread, m0, k0, M, K);
    } else {
      store<1>(tile, thread, m0, k0, M, K);
    }
  }

 private:
  // Runs of V pixels of one filter from the tile to y: thread t takes run t mod (kTileM / V) of
  // every (kThreads * V / kTileM)-th filter. A run never crosses an image (the plane is a multiple
  // of V and so is m0), and its address is a multiple of V elements (d is 16-byte aligned).
  template <int V>
  CUTLASS_DEVICE void store(const E* tile, int thread, int m0, int k0, int M, int K) const {
    using W = Word<V * int(sizeof(E))>;
    constexpr int kRuns = kTileM / V, kStep = kThreads / kRuns;
    const int run = thread % kRuns;
    const int m = m0 + run * V;
    if (m >= M) return;
    int image, offset;
    params_.plane(image, offset, m);
    E* out = params_.d + image * params_.image_stride + offset;
    const int filters = min(kTileN, K - k0);
    for (int k = thread / kRuns; k < filters; k += kStep)
      *reinterpret_cast<W*>(out + (k0 + k) * params_.filter_stride) =
          *reinterpret_cast<const W*>(tile + k * kPitch + run * V);
  }

  Params params_;
};

// The epilogue as the warp-specialized conv kernel takes it (no loads, no TMA store).
template <class E, int kTileM, int kTileN>
using NchwEpilogueCollective =
    cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
        NchwEpilogue<E, kTileM, kTileN>>;

}  // namespace sm90
}  // namespace implicit_gemm
}  // namespace jax_kernels
