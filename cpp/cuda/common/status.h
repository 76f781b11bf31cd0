// The status of CUDA work queued by an FFI handler, as an ffi::Error naming the op: after kernel
// launches (cudaGetLastError) and of a runtime or CUB call's return value. Never synchronizes.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "jax_kernels/ffi_util.h"

namespace jax_kernels {

// The launch status of the kernels just queued on the stream.
inline ffi::Error launch_status(const char* op) {
  const cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) + ": CUDA error: " + cudaGetErrorString(error));
}

// The error of a CUDA runtime or CUB call that returned `status` (CUB may fail without setting
// CUDA's last error, so the status itself is what counts).
inline ffi::Error cuda_status(const char* op, cudaError_t status) {
  if (status == cudaSuccess) return ffi::Error::Success();
  cudaGetLastError();  // clear it, if it was set
  return ffi::Error::Internal(std::string(op) + ": CUDA error: " + cudaGetErrorString(status));
}

}  // namespace jax_kernels
