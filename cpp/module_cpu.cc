// The nanobind module jax_kernels._cpu: every CPU FFI target as a capsule, plus their records
// for capabilities(), plus a stand-in handler for GPU placements when the CUDA module is absent.
#include "jax_kernels/module_util.h"

namespace jax_kernels {
namespace {

// Registered for platform CUDA under every target name when the package was built without the
// CUDA module, so that a computation placed on a GPU fails with instructions instead of XLA's
// "no registered implementation".
ffi::Error cuda_module_missing(ffi::RemainingArgs, ffi::RemainingRets, ffi::Dictionary) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "jax_kernels was built without CUDA support, so its ops cannot run on a GPU. "
                    "Reinstall it where the CUDA toolkit (nvcc) is on PATH, e.g. "
                    "pip install --force-reinstall --no-deps "
                    "--config-settings=cmake.define.JAX_KERNELS_CUDA=ON jax_kernels, "
                    "or place the computation on the CPU.");
}

}  // namespace
}  // namespace jax_kernels

XLA_FFI_DEFINE_HANDLER_SYMBOL(CudaModuleMissing, jax_kernels::cuda_module_missing,
                              xla::ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attrs());

NB_MODULE(_cpu, m) {
  m.doc() = "jax_kernels CPU FFI targets";
  jax_kernels::define_registry_functions(m);
  m.def("cuda_module_missing_handler",
        []() { return nanobind::capsule(reinterpret_cast<void*>(CudaModuleMissing)); });
}
