// What both nanobind modules expose: registrations() -> {target name: capsule}; records() ->
// [(target, op, pass, backend, determinism)] for capabilities(); query(name, {argument: int})
// for the host functions registered with JK_REGISTER_QUERY and `size_overflow`, the result of
// one whose sizes no int64 describes (kSizeOverflow); and `enums`, the codes of the enum
// attributes the Python side passes ({enum: {name: code}}), so that they are written once, here
// and in the math headers.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>

#include "jax_kernels/conv.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/grid_sample.h"

namespace jax_kernels {

inline nanobind::dict enum_codes() {
  namespace nb = nanobind;
  nb::dict enums;
  using Codes = std::initializer_list<std::pair<const char*, int64_t>>;
  const auto table = [&](const char* name, Codes codes) {
    nb::dict entries;
    for (const auto& [key, code] : codes) entries[key] = code;
    enums[name] = entries;
  };
  table("GridSampleMode", {{"bilinear", int64_t(GridSampleMode::kBilinear)},
                           {"nearest", int64_t(GridSampleMode::kNearest)},
                           {"bicubic", int64_t(GridSampleMode::kBicubic)}});
  table("GridSamplePadding", {{"zeros", int64_t(GridSamplePadding::kZeros)},
                              {"border", int64_t(GridSamplePadding::kBorder)},
                              {"reflection", int64_t(GridSamplePadding::kReflection)}});
  table("ConvPass", {{"forward", int64_t(ConvPass::kForward)},
                     {"backward_data", int64_t(ConvPass::kBackwardData)},
                     {"backward_weight", int64_t(ConvPass::kBackwardWeight)}});
  table("ConvPrecision", {{"default", int64_t(ConvPrecision::kDefault)},
                          {"highest", int64_t(ConvPrecision::kHighest)}});
  table("ConvLayout", {{"NCHW", int64_t(ConvLayout::kNCHW)}, {"NHWC", int64_t(ConvLayout::kNHWC)}});
  table("ConvDtype", {{"float16", int64_t(ConvDtype::kFloat16)},
                      {"bfloat16", int64_t(ConvDtype::kBFloat16)},
                      {"float32", int64_t(ConvDtype::kFloat32)},
                      {"float64", int64_t(ConvDtype::kFloat64)}});
  return enums;
}

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
  m.def("query", [](const std::string& name, const std::map<std::string, int64_t>& arguments) {
    for (const auto& q : query_registry()) {
      if (name != q.name) continue;
      const QueryArgs args(arguments);
      const int64_t result = q.function(args);
      if (const std::string extra = args.unread(); !extra.empty())
        throw std::invalid_argument("query " + name + " takes no argument '" + extra + "'");
      return result;
    }
    throw std::invalid_argument("jax_kernels: no host query named " + name);
  });
  m.attr("size_overflow") = kSizeOverflow;
  m.attr("enums") = enum_codes();
}

}  // namespace jax_kernels
