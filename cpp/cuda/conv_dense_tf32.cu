// CUTLASS kernels of the tensor-core conv2d path for float32 on TF32 tensor cores (precision default); the kernels and the
// tile table are in conv_dense_cutlass.cuh. Without CUTLASS headers this file compiles to nothing.
#if defined(JAX_KERNELS_HAVE_CUTLASS)
#include "conv_dense_cutlass.cuh"

namespace jax_kernels {
namespace conv_dense {
JK_CONV_DENSE_INSTANTIATE(Math::kTF32);
}  // namespace conv_dense
}  // namespace jax_kernels
#endif
