// Hopper (sm_90a) pointwise weight gradient of the tensor-core conv2d path for float32, multiplied
// as TF32 (channels-last 1x1 convolutions; implicit_gemm_sm90_pointwise_wgrad.cuh). Compiled for
// sm_90a only (cpp/CMakeLists.txt); without CUTLASS headers this file compiles to nothing.
#if defined(JAX_KERNELS_HAVE_CUTLASS)
#include "conv/implicit_gemm_sm90_pointwise_wgrad.cuh"

namespace jax_kernels {
namespace implicit_gemm {
JK_IMPLICIT_GEMM_SM90_POINTWISE_WGRAD_INSTANTIATE(Math::kTF32);
}  // namespace implicit_gemm
}  // namespace jax_kernels
#endif
