// Broadcast geometry of elementwise ops (lerp and its gradients), host and device.
//
// Every operand arrives with the output's rank, each dimension either equal to the output's or 1
// (the Python wrapper and ffi_call's "expand_dims" batching both produce that form). On the host
// the dimensions are collapsed: neighbouring dimensions merge wherever every operand is either
// contiguous across them or broadcast across both, so the common cases become rank 1 (same
// shapes) or rank 2 (a row or column broadcast), and the device computes one division per
// collapsed dimension at most.
#pragma once

#include <cstdint>
#include <string>

#include "jax_kernels/scalar.h"

namespace jax_kernels {

constexpr int kMaxBroadcastRank = 16;

template <int kOperands>
struct BroadcastGeometry {
  int rank = 0;                                   // collapsed rank (0 for a scalar output)
  int64_t dims[kMaxBroadcastRank] = {};           // collapsed output dims
  int64_t strides[kOperands][kMaxBroadcastRank] = {};  // element strides, 0 where broadcast
  int64_t count = 1;                              // output element count
  bool contiguous = true;  // every operand has the output's shape (no broadcasting at all)

  // Element offset of operand `k` for output element `linear` (row-major).
  JK_HD int64_t offset(int k, int64_t linear) const {
    int64_t off = 0;
    for (int d = rank - 1; d >= 0; --d) {
      const int64_t extent = dims[d];
      const int64_t q = linear / extent;
      off += (linear - q * extent) * strides[k][d];
      linear = q;
    }
    return off;
  }
};

// Builds the collapsed geometry. `operand_dims[k]` points at operand k's dims (length
// `out_rank`). Returns an empty string on success, else a message describing what is wrong.
template <int kOperands>
std::string make_broadcast_geometry(const int64_t* out_dims, int out_rank,
                                    const int64_t* const* operand_dims,
                                    BroadcastGeometry<kOperands>* geometry) {
  BroadcastGeometry<kOperands> g;
  // broadcast[k][d]: operand k is broadcast along output dim d.
  int64_t dims[64];
  bool broadcast[kOperands][64];
  int rank = 0;
  if (out_rank > 64) return "rank above 64";
  for (int k = 0; k < kOperands; ++k)
    for (int d = 0; d < out_rank; ++d)
      if (operand_dims[k][d] != out_dims[d] && operand_dims[k][d] != 1)
        return "operand dimension does not broadcast";
  for (int d = 0; d < out_rank; ++d) {
    g.count *= out_dims[d];
    if (out_dims[d] == 1) continue;  // size-1 output dims carry no index
    dims[rank] = out_dims[d];
    for (int k = 0; k < kOperands; ++k) {
      broadcast[k][rank] = operand_dims[k][d] == 1;
      if (broadcast[k][rank]) g.contiguous = false;
    }
    ++rank;
  }
  // Merge neighbours that share every operand's broadcast pattern.
  int merged = 0;
  for (int d = 0; d < rank; ++d) {
    bool same = merged > 0;
    for (int k = 0; same && k < kOperands; ++k) same = broadcast[k][merged - 1] == broadcast[k][d];
    if (same) {
      dims[merged - 1] *= dims[d];
    } else {
      dims[merged] = dims[d];
      for (int k = 0; k < kOperands; ++k) broadcast[k][merged] = broadcast[k][d];
      ++merged;
    }
  }
  if (merged > kMaxBroadcastRank) return "broadcast pattern needs more than 16 collapsed dimensions";
  g.rank = merged;
  for (int d = 0; d < merged; ++d) g.dims[d] = dims[d];
  for (int k = 0; k < kOperands; ++k) {
    int64_t stride = 1;
    for (int d = merged - 1; d >= 0; --d) {
      g.strides[k][d] = broadcast[k][d] ? 0 : stride;
      if (!broadcast[k][d]) stride *= dims[d];
    }
  }
  *geometry = g;
  return "";
}

}  // namespace jax_kernels
