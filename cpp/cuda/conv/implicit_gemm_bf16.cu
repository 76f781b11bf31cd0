// CUTLASS kernels of the tensor-core conv2d path for bfloat16 (f32 accumulate); the kernels and the
// tile table are in implicit_gemm_kernels.cuh. Without CUTLASS headers this file compiles to
// nothing.
#if defined(JAX_KERNELS_HAVE_CUTLASS)
#include "conv/implicit_gemm_kernels.cuh"

namespace jax_kernels {
namespace implicit_gemm {
JK_IMPLICIT_GEMM_INSTANTIATE(Math::kBFloat16);
}  // namespace implicit_gemm
}  // namespace jax_kernels
#endif
