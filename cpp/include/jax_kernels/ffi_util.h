// Host-side helpers for the FFI handlers of both backends: dtype dispatch on an AnyBuffer's
// element type, shape helpers, and the target registry that the nanobind modules expose.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "jax_kernels/scalar.h"
#include "xla/ffi/api/ffi.h"

namespace jax_kernels {

namespace ffi = xla::ffi;

template <class T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with T the C++ type of `dtype`; any other dtype is an InvalidArgument
// error naming the op (the Python wrappers reject such dtypes at trace time already).
template <class F>
ffi::Error dispatch_float(ffi::DataType dtype, const char* op, F&& f) {
  switch (dtype) {
    case ffi::DataType::F16:
      return f(TypeTag<float16>{});
    case ffi::DataType::BF16:
      return f(TypeTag<bfloat16>{});
    case ffi::DataType::F32:
      return f(TypeTag<float>{});
    case ffi::DataType::F64:
      return f(TypeTag<double>{});
    default:
      return ffi::Error::InvalidArgument(std::string(op) +
                                         ": unsupported element type (expected float16, "
                                         "bfloat16, float32 or float64)");
  }
}

// One record per registered FFI target: the handler plus what capabilities() reports of it.
struct TargetRecord {
  const char* target;      // FFI target name, identical on every platform
  XLA_FFI_Handler* handler;
  const char* op;          // public op name
  const char* pass;        // "forward", "backward d_input", ...
  const char* backend;     // short description of the implementation
  const char* determinism; // "bitwise" or a note on when it is not
};

// The targets of this native module (each .so has its own copy: symbols are hidden).
inline std::vector<TargetRecord>& target_registry() {
  static std::vector<TargetRecord> registry;
  return registry;
}

struct TargetRegistrar {
  explicit TargetRegistrar(const TargetRecord& record) { target_registry().push_back(record); }
};

// The arguments of a host query, by name: Python calls query(name, {argument: int}), so no side
// depends on an argument order. Reading a name that was not passed throws std::invalid_argument
// (a Python ValueError); so does passing a name the query never reads (checked after it ran: a
// query reads all its arguments before it may return early).
class QueryArgs {
 public:
  explicit QueryArgs(const std::map<std::string, int64_t>& values) : values_(values) {}
  int64_t operator[](const std::string& name) const {
    const auto it = values_.find(name);
    if (it == values_.end()) throw std::invalid_argument("missing query argument '" + name + "'");
    read_.insert(name);
    return it->second;
  }
  // The first argument that was passed but never read, or "" if none.
  std::string unread() const {
    for (const auto& [name, value] : values_)
      if (read_.count(name) == 0) return name;
    return "";
  }

 private:
  const std::map<std::string, int64_t>& values_;
  mutable std::set<std::string> read_;
};

// A host function the Python side may call at trace time, e.g. the scratch bytes a CUDA pass
// needs for a given problem (scratch comes from XLA as an extra result, never cudaMalloc).
struct QueryRecord {
  const char* name;
  int64_t (*function)(const QueryArgs& arguments);
};

// What a host query returns for a problem whose size no int64 describes (a shape traced with
// jax.eval_shape or jax.export needs no memory): the Python side raises a ValueError naming the
// op. Exported to Python as `size_overflow` (module_util.h); -1 stays a query's own refusal.
constexpr int64_t kSizeOverflow = -2;

inline std::vector<QueryRecord>& query_registry() {
  static std::vector<QueryRecord> registry;
  return registry;
}

struct QueryRegistrar {
  explicit QueryRegistrar(const QueryRecord& record) { query_registry().push_back(record); }
};

#define JK_CONCAT_INNER(a, b) a##b
#define JK_CONCAT(a, b) JK_CONCAT_INNER(a, b)
// Registers a handler symbol (from XLA_FFI_DEFINE_HANDLER_SYMBOL) under a target name.
#define JK_REGISTER_TARGET(target, handler, op, pass, backend, determinism)    \
  static ::jax_kernels::TargetRegistrar JK_CONCAT(jk_registrar_, __LINE__)( \
      ::jax_kernels::TargetRecord{target, handler, op, pass, backend, determinism})

// Registers `int64_t function(const QueryArgs&)` as query `name` of this module.
#define JK_REGISTER_QUERY(name, function)                                    \
  static ::jax_kernels::QueryRegistrar JK_CONCAT(jk_query_registrar_, __LINE__)( \
      ::jax_kernels::QueryRecord{name, function})

}  // namespace jax_kernels
