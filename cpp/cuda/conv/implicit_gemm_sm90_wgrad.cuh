// Hopper weight gradient of the tensor-core convolution path: CUTLASS 3.x's sm_90a wgrad mainloop
// (dy through a tiled TMA, x through the im2col TMA, WGMMA) under a kernel of our own that splits
// the N*P*Q reduction into fixed slices, one per blockIdx.z, each writing its own float32 partial
// filter gradient ([K,R,S,C], or [R,S,C,K] for channels-last weights: NhwcConv::wgrad_order).
// implicit_gemm.cu reduces the slices in a fixed order, as it does the Sm80 kernel's parallel
// split-K partials: no atomics, and the result depends on the problem and the split only, never
// on the SM count or the schedule.
//
// Why a kernel of our own: CUTLASS 4.2's sm_90 conv kernel runs every output tile over the whole
// reduction, and a wgrad's output is small (64 filters x 3x3x64 taps is 9 tiles of 64x64) while
// its reduction is long (N*P*Q = 100352 positions at N32 56^2): unsplit, 9 CTAs would run on 132
// SMs. Only the reduction range (a slice of k tiles) and the output pointer (a slice of the
// partials) differ from CUTLASS's non-persistent warp-specialized GEMM kernel; the collectives
// (mainloop, epilogue) are CUTLASS's, used through their public interface.
//
// Half types only: wgrad reads both operands MN-major (dy's filters and x's channels are the
// contiguous dimensions), which WGMMA takes for 16-bit types but not for TF32; float32 wgrad runs
// implicit_gemm_sm90_wgrad_tf32.cuh's kernel on batch-innermost copies where the planner takes
// it, else the Sm80 kernel. Included by implicit_gemm_sm90.cuh.
#pragma once

#include <cstdint>

#include "cutlass/device_kernel.h"
#include "cutlass/epilogue/collective/default_epilogue.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"

namespace jax_kernels {
namespace implicit_gemm {
namespace sm90 {

// The kernel: CUTLASS's conv GEMM kernel type (shared storage, arguments, collectives), with an
// entry point that takes k tiles [z * per, min((z + 1) * per, total)) and writes its partial at
// d + z * slice_elements.
template <class Base>
struct SplitWgradKernel : Base {
  using typename Base::CollectiveEpilogue;
  using typename Base::CollectiveMainloop;
  using typename Base::SharedStorage;
  using typename Base::TiledMma;
  using typename Base::TileShape;
  using typename Base::ClusterShape;
  static_assert(cute::size(ClusterShape{}) == 1, "one CTA per cluster: no multicast, no cluster sync");

  struct Params {
    typename Base::Params base;
    int k_tiles_per_slice;
    int64_t slice_elements;  // of the float32 partials: K*R*S*C
  };

  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
    using namespace cute;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem_buf);
    const int thread_idx = int(threadIdx.x);
    const int warp_group = thread_idx / cutlass::NumThreadsPerWarpGroup;
    const int warp_group_thread = thread_idx % cutlass::NumThreadsPerWarpGroup;
    const int warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
    const bool producer = warp_group == 0;  // warp 0 of it loads; its other warps idle
    const bool loader = producer && warp_in_group == 0;

    if (thread_idx == 0) CollectiveMainloop::prefetch_tma_descriptors(params.base.mainloop);

    using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
    typename MainloopPipeline::Params pipe_params;
    if (loader) pipe_params.role = MainloopPipeline::ThreadCategory::Producer;
    if (!producer) pipe_params.role = MainloopPipeline::ThreadCategory::Consumer;
    pipe_params.is_leader = warp_group_thread == 0;
    pipe_params.num_consumers = cutlass::NumThreadsPerWarpGroup;
    pipe_params.transaction_bytes = params.base.mainloop.tma_transaction_bytes;
    MainloopPipeline pipeline(storage.pipelines.mainloop, pipe_params, ClusterShape{});

    // The epilogue collective (CUTLASS's direct-store default epilogue behind its warp-specialized
    // adapter) loads no source tensor, so its load pipeline is never waited on; it is built as
    // the kernel builds it so that the collective's interface is used as intended.
    using EpiLoadPipeline = typename CollectiveEpilogue::LoadPipeline;
    typename EpiLoadPipeline::Params epi_load_params;
    if (loader) epi_load_params.role = EpiLoadPipeline::ThreadCategory::Producer;
    if (!producer) epi_load_params.role = EpiLoadPipeline::ThreadCategory::Consumer;
    epi_load_params.dst_blockid = 0;
    epi_load_params.producer_arv_count = cutlass::NumThreadsPerWarp;
    epi_load_params.consumer_arv_count = cutlass::NumThreadsPerWarpGroup;
    EpiLoadPipeline epi_load_pipeline(storage.pipelines.epi_load, epi_load_params);
    using EpiStorePipeline = typename CollectiveEpilogue::StorePipeline;
    typename EpiStorePipeline::Params epi_store_params;
    epi_store_params.always_wait = true;
    EpiStorePipeline epi_store_pipeline(epi_store_params);

    // The pipelines' barriers are initialized by the constructors above: visible to all warps
    // before any of them arrives.
    __syncthreads();

    auto problem = append<4>(params.base.problem_shape, Int<1>{});
    CollectiveMainloop mainloop;
    auto load_inputs = mainloop.load_init(problem, params.base.mainloop);
    auto gA = get<0>(load_inputs);  // (BLK_M, BLK_K, m, k)
    auto gB = get<1>(load_inputs);  // (BLK_N, BLK_K, n, k)
    auto m_coord = idx2crd(int(blockIdx.x), shape<2>(gA));
    auto n_coord = idx2crd(int(blockIdx.y), shape<2>(gB));
    auto block = make_coord(m_coord, n_coord, _, Int<0>{});
    const int total = int(size<3>(gA));
    const int begin = int(blockIdx.z) * params.k_tiles_per_slice;
    const int left = total - begin;  // >= 1: the planner leaves no slice empty
    const int count = params.k_tiles_per_slice < left ? params.k_tiles_per_slice : left;
    auto k_shape = shape<3>(gA);

    if (producer) {
      if (loader) {
        auto state = cutlass::make_producer_start_state<MainloopPipeline>();
        auto k_iter = make_coord_iterator(idx2crd(begin, k_shape), k_shape);
        mainloop.load(params.base.mainloop, pipeline, state, load_inputs, block, k_iter, count,
                      cutlass::canonical_lane_idx(), 0, storage.tensors.mainloop);
        state.advance(count);
        mainloop.load_tail(pipeline, state);
      }
      return;
    }

    TiledMma tiled_mma;
    Tensor accumulators = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
    typename CollectiveMainloop::PipelineState consume_state;
    mainloop.mma(pipeline, consume_state, accumulators, count, warp_group_thread,
                 storage.tensors.mainloop, params.base.mainloop);
    mainloop.mma_tail(pipeline, consume_state, count);

    typename Base::EpilogueParams epi_params = params.base.epilogue;
    epi_params.ptr_D += int64_t(blockIdx.z) * params.slice_elements;
    CollectiveEpilogue epilogue(epi_params, storage.tensors.epilogue);
    typename CollectiveEpilogue::LoadPipelineState epi_load_state;
    auto epi_store_state = cutlass::make_producer_start_state<EpiStorePipeline>();
    auto [epi_load_next, epi_store_next] =
        epilogue.store(epi_load_pipeline, epi_load_state, epi_store_pipeline, epi_store_state,
                       problem, TileShape{}, block, accumulators, tiled_mma, warp_group_thread,
                       storage.tensors.epilogue);
    epilogue.store_tail(epi_load_pipeline, epi_load_next, epi_store_pipeline, epi_store_next);
#else
    (void)params, (void)smem_buf;
#endif
  }
};

// The tile table. GEMM view of wgrad: M = K filters, N = (C, S, R) taps, reduction over N*P*Q
// positions in tiles of 64. narrow (filters <= 64): 64x64; wide: 128x64. N is one tap's 64
// channels, so the kernel takes channel counts that are multiples of 64 (an N tile across two
// taps is not what the im2col TMA box expresses). The pipeline gets the stages that leave room
// for two CTAs per SM, as the fprop's does.
template <Math M, TileClass kClass>
struct WgradConfig {
  static_assert(M == Math::kFloat16 || M == Math::kBFloat16, "half types only (see above)");
  using E = typename Element<M>::type;
  static constexpr int kTileM = kClass == TileClass::kWide ? 128 : 64;
  static constexpr int kTileN = 64;
  static constexpr int kTileK = 64;
  using TileShape = Shape<Int<kTileM>, Shape<Int<kTileN>>, Shape<Int<kTileK>>>;
  using ClusterShape = Shape<_1, _1, _1>;
  static constexpr int kAlignment = 8;
  static constexpr cutlass::conv::Operator kOp = cutlass::conv::Operator::kWgrad;
  // The partials' strides over the (K, (C, S, R), L) modes, all at run time (WgradOrder): a
  // cute stride in place of CUTLASS's filter layout tag (whose channel stride is a static 1).
  using StrideD = Stride<int64_t, Stride<int64_t, int64_t, int64_t>, Int<0>>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, StrideD, 1, float,
      StrideD, 1, cutlass::epilogue::NoSmemWarpSpecialized>::CollectiveOp;
  static constexpr int kStageBytes = (kTileM + kTileN) * kTileK * int(sizeof(E));
  static constexpr int kStages =
      (228 * 1024 / 2 - 2048 - int(sizeof(typename Epilogue::SharedStorage))) / kStageBytes;
  static_assert(kStages >= 2, "two CTAs per SM need at least a double-buffered pipeline");
  using Mainloop = typename cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, kOp, E, cutlass::layout::TensorNHWC,
      kAlignment, E, cutlass::layout::TensorNHWC, kAlignment, float, TileShape, ClusterShape,
      cutlass::conv::collective::StageCount<kStages>,
      cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;
  using ProblemShape =
      cutlass::conv::ConvProblemShape<kOp, Mainloop::DispatchPolicy::NumSpatialDimensions>;
  using Base = cutlass::conv::kernel::ConvUniversal<ProblemShape, Mainloop, Epilogue>;
  using Kernel = SplitWgradKernel<Base>;
};

// a = dy [N,P,Q,K], b = x [N,H,W,C], d = the first slice of the float32 partials (c.wgrad_order).
template <class Config>
typename Config::Base::Arguments wgrad_arguments(const NhwcConv& c) {
  using E = typename Config::E;
  using Base = typename Config::Base;
  const typename Config::ProblemShape problem = conv_problem<Config>(c);
  // The partials' strides as the epilogue's (K, (C, S, R)) modes, in the order the planner
  // asked for: [K,R,S,C] or [R,S,C,K], packed.
  const int64_t K = c.K, C = c.C, S = c.S;
  int64_t k_stride = c.R * S * C, c_stride = 1, s_stride = C, r_stride = S * C;  // kKRSC
  if (c.wgrad_order == WgradOrder::kRSCK)
    k_stride = 1, c_stride = K, s_stride = C * K, r_stride = S * C * K;
  typename Base::StrideD stride_d{};
  cute::get<0>(stride_d) = k_stride;
  cute::get<1, 1>(stride_d) = s_stride;
  cute::get<1, 2>(stride_d) = r_stride;
  cute::get<1, 0>(stride_d) = c_stride;
  typename Base::Arguments args{
      problem,
      {static_cast<const E*>(c.a), static_cast<const E*>(c.b)},
      {{}, nullptr, stride_d, static_cast<float*>(c.d), stride_d}};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

template <class Config>
int64_t wgrad_k_tiles(const NhwcConv& c) {
  return (int64_t(c.N) * c.P * c.Q + Config::kTileK - 1) / Config::kTileK;
}

template <class Config>
int64_t wgrad_output_tiles(const NhwcConv& c) {
  return int64_t((c.K + Config::kTileM - 1) / Config::kTileM) * (int64_t(c.R) * c.S * c.C / Config::kTileN);
}

// The kernel's arguments for c into *args, or false where it does not take c.
template <class Config>
bool wgrad_checked_arguments(const NhwcConv& c, typename Config::Base::Arguments* args) {
  if (c.kernel != NhwcKernel::kWgrad || c.split_k < 1) return false;
  if (c.C % Config::kTileN || c.K % Config::kAlignment) return false;
  // Every slice non-empty (the planner's split is one).
  if (nonempty_split(wgrad_k_tiles<Config>(c), c.split_k) != c.split_k) return false;
  if (!pointers_and_padding_fit(c)) return false;  // c.c is null
  using Base = typename Config::Base;
  *args = wgrad_arguments<Config>(c);
  return Base::can_implement(*args) && Base::get_workspace_size(*args) == 0;
}

template <class Config>
bool wgrad_can_implement(const NhwcConv& c) {
  typename Config::Base::Arguments args;
  return wgrad_checked_arguments<Config>(c, &args);
}

template <class Config>
ffi::Error wgrad_run(const NhwcConv& c, cudaStream_t stream) {
  using Base = typename Config::Base;
  using Kernel = typename Config::Kernel;
  typename Base::Arguments args;
  if (!wgrad_checked_arguments<Config>(c, &args)) return ffi::Error::Internal(describe(c, "rejects"));
  typename Kernel::Params params;
  // Builds the TMA descriptors on the host (no workspace: checked above).
  params.base = Base::to_underlying_arguments(args, nullptr);
  const int64_t k_tiles = wgrad_k_tiles<Config>(c);
  params.k_tiles_per_slice = int((k_tiles + c.split_k - 1) / c.split_k);
  params.slice_elements = int64_t(c.K) * c.R * c.S * c.C;
  dim3 grid = Base::get_grid_shape(params.base);
  grid.z = unsigned(c.split_k);
  constexpr int smem = Base::SharedStorageSize;
  // Every call, as CUTLASS's adapter does: the attribute is cheap to set and holds for the
  // current device.
  if (cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    cudaGetLastError();
    return ffi::Error::Internal(describe(c, "could not set its shared memory size"));
  }
  cutlass::device_kernel<Kernel><<<grid, Base::get_block_shape(), smem, stream>>>(params);
  return launch_status("conv2d (CUTLASS sm90 wgrad)");
}

template <Math M, class F>
auto with_wgrad(const NhwcConv& c, F&& f) {
  return c.tile == TileClass::kWide ? f(TypeTag<WgradConfig<M, TileClass::kWide>>{})
                                    : f(TypeTag<WgradConfig<M, TileClass::kNarrow>>{});
}

}  // namespace sm90
}  // namespace implicit_gemm
}  // namespace jax_kernels
