// What both nanobind modules expose: registrations() -> {target name: capsule} and records()
// -> [(target, op, pass, backend, determinism)] for capabilities(), and query(name, args) for
// the host functions registered with JK_REGISTER_QUERY.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

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
  m.def("query", [](const std::string& name, const std::vector<int64_t>& arguments) -> int64_t {
    for (const auto& q : query_registry())
      if (name == q.name) return q.function(arguments);
    throw std::invalid_argument("jax_kernels: no host query named " + name);
  });
  m.def("query_names", []() {
    std::vector<std::string> names;
    for (const auto& q : query_registry()) names.emplace_back(q.name);
    return names;
  });
}

}  // namespace jax_kernels
