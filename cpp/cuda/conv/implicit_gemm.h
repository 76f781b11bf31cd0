// Interface of the tensor-core convolution path (CUTLASS implicit GEMM, implicit_gemm.cu) to the
// conv2d FFI handlers (handlers.cu). Tensors are NCHW / KCRS / NKPQ in device memory; any layout
// change happens inside, in the scratch buffer that XLA provides.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jax_kernels/conv.h"
#include "jax_kernels/ffi_util.h"

namespace jax_kernels {

// The scratch bytes the tensor-core path needs for this problem, or -1 if it does not take it.
int64_t implicit_gemm_scratch_bytes(const ConvQuery& query);

// Runs one pass on the stream, never synchronizing or allocating. Operands by pass:
//   kForward:        a = input x [N,C,H,W],  b = weight w [K,C/g,R,S], out = y [N,K,P,Q];
//                    bias is [K] or nullptr (added in the epilogue)
//   kBackwardData:   a = dy [N,K,P,Q],       b = weight w,             out = dx [N,C,H,W]
//   kBackwardWeight: a = dy [N,K,P,Q],       b = input x,              out = dw [K,C/g,R,S]
// Must only be called when implicit_gemm_scratch_bytes(query) >= 0, with that much scratch.
ffi::Error implicit_gemm_conv2d(cudaStream_t stream, const ConvQuery& query, const void* a,
                                const void* b, const void* bias, void* out, void* scratch,
                                int64_t scratch_bytes);

// ---- Measurement hooks (tools/implicit_gemm_check.cu; the FFI handlers do not use them) --------
// A pass is three steps, launched in this order by implicit_gemm_conv2d:
//   layout in:  NHWC route: the input (fprop) or dy (dgrad) transposed to NHWC together with the
//               weight transform, or dy and x transposed (wgrad), one launch; GEMM route: the bias
//               broadcast (fprop with bias), else nothing;
//   CUTLASS:    the implicit GEMM (one launch per group) or the batched GEMM;
//   layout out: NHWC route: the NHWC -> NCHW transpose of y or dx, or the wgrad split-K
//               reduction into KCRS; GEMM route: the wgrad per-image reduction, else nothing.
enum ImplicitGemmStep : unsigned {
  kImplicitGemmLayoutIn = 1,
  kImplicitGemmCutlass = 2,
  kImplicitGemmLayoutOut = 4,
  kImplicitGemmAllSteps = 7,
};

// implicit_gemm_conv2d restricted to the steps in the mask: the same plan, scratch regions and
// launches as implicit_gemm_conv2d makes for those steps, the others skipped. The output is only right with all
// steps; the steps alone are for timing (a step reads what the previous one left in the scratch).
ffi::Error implicit_gemm_steps(cudaStream_t stream, const ConvQuery& query, const void* a,
                               const void* b, const void* bias, void* out, void* scratch,
                               int64_t scratch_bytes, unsigned steps);

// What the layout steps of a pass do, from its plan (false if the path declines the problem).
struct ImplicitGemmLayoutInfo {
  bool nhwc_route = false;  // false: the GEMM route (1x1, stride 1, NCHW used as is)
  bool sm90 = false;        // the CUTLASS step runs the Hopper (sm_90a) kernel
  int in_launches = 0, out_launches = 0;  // kernel launches of each layout step
  // Bytes the layout kernels of each step read plus write (each element once, zero padding
  // included where it is written), to compare with a device-to-device copy of as many bytes.
  int64_t in_bytes = 0, out_bytes = 0;
  char in_what[64] = "", out_what[64] = "";  // e.g. "x to NHWC + weights", "y to NCHW"
};
bool implicit_gemm_layout_info(const ConvQuery& query, bool with_bias,
                               ImplicitGemmLayoutInfo* info);

}  // namespace jax_kernels
