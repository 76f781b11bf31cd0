// What both nanobind modules expose: registrations() -> {target name: capsule} and records()
// -> [(target, op, pass, backend, determinism)] for capabilities().
#pragma once

#include <nanobind/nanobind.h>

#include "jax_kernels/ffi_util.h"

namespace jax_kernels {

inline void define_registry_functions(nanobind::module_& m) {
  namespace nb = nanobind;
  m.def("registrations", []() {
    nb::dict targets;
    for (const auto& record : target_registry())
      targets[record.target] = nb::capsule(reinterpret_cast<void*>(record.handler));
    return targets;
  });
  m.def("records", []() {
    nb::list rows;
    for (const auto& r : target_registry())
      rows.append(nb::make_tuple(r.target, r.op, r.pass, r.backend, r.determinism));
    return rows;
  });
}

}  // namespace jax_kernels
