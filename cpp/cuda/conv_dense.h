// Interface of the tensor-core convolution path (CUTLASS implicit GEMM, conv_dense.cu) to the
// conv2d FFI handlers (conv.cu). Tensors are NCHW / KCRS / NKPQ in device memory; any layout
// change happens inside, in the scratch buffer that XLA provides.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_kernels/conv.h"
#include "jax_kernels/ffi_util.h"

namespace jax_kernels {

// The scratch bytes the tensor-core path needs for this problem, or -1 if it does not take it
// (also registered as host query "conv2d_dense_scratch", see conv.h).
int64_t conv2d_dense_scratch_bytes(const ConvQuery& query);

// Runs one pass on the stream, never synchronizing or allocating. Operands by pass:
//   kForward:        a = input x [N,C,H,W],  b = weight w [K,C/g,R,S], out = y [N,K,P,Q];
//                    bias is [K] or nullptr (added in the epilogue)
//   kBackwardData:   a = dy [N,K,P,Q],       b = weight w,             out = dx [N,C,H,W]
//   kBackwardWeight: a = dy [N,K,P,Q],       b = input x,              out = dw [K,C/g,R,S]
// Must only be called when conv2d_dense_scratch_bytes(query) >= 0, with that much scratch.
ffi::Error conv2d_dense(cudaStream_t stream, const ConvQuery& query, const void* a, const void* b,
                        const void* bias, void* out, void* scratch, int64_t scratch_bytes);

}  // namespace jax_kernels
