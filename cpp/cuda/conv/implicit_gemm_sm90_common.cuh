// What the Hopper (sm_90a) CUTLASS 3.x kernels of the tensor-core conv2d path share: their
// element types, the SM count their arguments carry and the launch of a device adapter.
// Included by the implicit-GEMM conv kernels (implicit_gemm_sm90.cuh) and by the pointwise GEMM
// (implicit_gemm_sm90_pointwise.cuh), which build in separate translation units (see the latter).
#pragma once

#include <cuda_runtime.h>

#include "common/status.h"
#include "conv/implicit_gemm_kernels.h"

#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"

namespace jax_kernels {
namespace implicit_gemm {
namespace sm90 {

template <Math M>
struct Element;
template <>
struct Element<Math::kFloat16> {
  using type = cutlass::half_t;
};
template <>
struct Element<Math::kBFloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct Element<Math::kTF32> {
  using type = float;  // read as float, multiplied as TF32 by the collective builders
};

// The SM count the kernel arguments carry (hardware info), queried once per process for the
// current device rather than by CUTLASS at every call. It sets the persistent GEMM's grid; it
// never changes a result (every output tile is one CTA's whole reduction).
inline int sm_count() {
  static const int count = [] {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      cudaGetLastError();
      return 0;  // CUTLASS then queries it itself
    }
    return sms;
  }();
  return count;
}

// Runs a CUTLASS 3.x device adapter (the conv kernels' ConvUniversalAdapter, the pointwise
// GEMM's GemmUniversalAdapter) on arguments its caller checked, none needing a workspace:
// initialize builds the TMA descriptors on the host and sets the kernel's shared memory size, so
// nothing touches the stream before run. `describe(what)` names the problem in an error.
template <class Device, class Describe>
ffi::Error run_adapter(const typename Device::Arguments& args, cudaStream_t stream,
                       Describe&& describe, const char* kernel_name) {
  Device op;
  if (op.initialize(args, nullptr, stream) != cutlass::Status::kSuccess)
    return ffi::Error::Internal(describe("initialize failed"));
  if (op.run(stream) != cutlass::Status::kSuccess)
    return ffi::Error::Internal(describe("launch failed"));
  return launch_status(kernel_name);
}

}  // namespace sm90
}  // namespace implicit_gemm
}  // namespace jax_kernels
