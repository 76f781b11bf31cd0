// The nanobind module jax_kernels._cuda: every CUDA FFI target as a capsule, plus their records
// for capabilities(). The kernels live in cuda/*.cu and register themselves at load time.
#include "jax_kernels/module_util.h"

NB_MODULE(_cuda, m) {
  m.doc() = "jax_kernels CUDA FFI targets";
  jax_kernels::define_registry_functions(m);
}
