// Hopper (sm_90a) kernels of the tensor-core conv2d path for float32 (TF32): CUTLASS's fprop (the
// kernels and their tile table are in implicit_gemm_sm90.cuh) and our wgrad
// (implicit_gemm_sm90_wgrad_tf32.cuh). Compiled for sm_90a only (cpp/CMakeLists.txt); without
// CUTLASS headers this file compiles to nothing.
#if defined(JAX_KERNELS_HAVE_CUTLASS)
#include "conv/implicit_gemm_sm90.cuh"

namespace jax_kernels {
namespace implicit_gemm {
JK_IMPLICIT_GEMM_SM90_INSTANTIATE(Math::kTF32);

// The TF32 wgrad over batch-innermost copies, its box rows from the host tiling
// (implicit_gemm_kernels.h); 6 pipeline stages of 32 KB.
ffi::Error sm90_tf32_wgrad_run(const BatchInnerWgrad& w, cudaStream_t stream) {
  using sm90::Tf32WgradConfig;
  return batch_inner_box(w) == 32
             ? sm90::tf32_wgrad_launch<Tf32WgradConfig<kBatchInnerTaps, 6, 32>>(w, stream)
             : sm90::tf32_wgrad_launch<Tf32WgradConfig<kBatchInnerTaps, 6, 16>>(w, stream);
}
}  // namespace implicit_gemm
}  // namespace jax_kernels
#endif
