// repeat geometry (torch.Tensor.repeat), host and device.
//
// out[o] = x[o mod x.shape] with x left-padded by size-1 axes to len(repeats). On the host the
// problem is collapsed into at most kMaxRepeatRank dimensions, each a pair (size s, repeats r)
// with output extent s * r: neighbours merge when the right one is not repeated (r == 1) or the
// left one has size 1, so (2048, 2048) by (4, 4) stays two dimensions and any batch axes added by
// vmap (repeat 1) fold into their neighbour.
#pragma once

#include <cstdint>
#include <string>

#include "jax_kernels/scalar.h"

namespace jax_kernels {

constexpr int kMaxRepeatRank = 16;

struct RepeatGeometry {
  int rank = 0;
  int64_t size[kMaxRepeatRank] = {};     // s: x's extent along the collapsed dim
  int64_t repeats[kMaxRepeatRank] = {};  // r: copies along it; the output extent is s * r
  int64_t x_count = 1;                   // elements of x
  int64_t out_count = 1;                 // elements of the output
  int64_t copies = 1;                    // product of the repeats

  // Offset into x of output element `linear`.
  JK_HD int64_t x_offset(int64_t linear) const {
    int64_t off = 0, stride = 1;
    for (int d = rank - 1; d >= 0; --d) {
      const int64_t extent = size[d] * repeats[d];
      const int64_t q = linear / extent;
      const int64_t o = linear - q * extent;
      off += (o % size[d]) * stride;
      stride *= size[d];
      linear = q;
    }
    return off;
  }

  // The output offset of copy number `copy` (row-major over the repeats) of x element
  // `x_linear` is copy_offset(copy) + element_offset(x_linear): the map is separable, so a
  // kernel can tabulate the copy offsets once and decompose each element's index once.
  JK_HD int64_t element_offset(int64_t x_linear) const {
    int64_t off = 0, stride = 1;
    for (int d = rank - 1; d >= 0; --d) {
      const int64_t q = x_linear / size[d];
      off += (x_linear - q * size[d]) * stride;
      stride *= size[d] * repeats[d];
      x_linear = q;
    }
    return off;
  }

  JK_HD int64_t copy_offset(int64_t copy) const {
    int64_t off = 0, stride = 1;
    for (int d = rank - 1; d >= 0; --d) {
      const int64_t q = copy / repeats[d];
      off += (copy - q * repeats[d]) * size[d] * stride;
      stride *= size[d] * repeats[d];
      copy = q;
    }
    return off;
  }
};

// Builds the geometry from the buffers' dims and the `repeats` attribute. Leading output dims
// beyond len(repeats) are batch dims added by vmap (repeat 1). Returns "" on success.
inline std::string make_repeat_geometry(const int64_t* x_dims, int x_rank, const int64_t* out_dims,
                                        int out_rank, const int64_t* repeats, int n_repeats,
                                        RepeatGeometry* geometry) {
  const int batch = out_rank - n_repeats;
  const int pad = n_repeats - (x_rank - batch);
  if (batch < 0 || pad < 0) return "ranks of input, output and repeats do not agree";
  RepeatGeometry g;
  int64_t s_cur = 1, r_cur = 1;
  bool open = false;
  for (int d = 0; d < out_rank; ++d) {
    const int64_t r = d < batch ? 1 : repeats[d - batch];
    const int64_t s = d < batch + pad && d >= batch ? 1 : x_dims[d < batch ? d : d - pad];
    if (r < 0 || out_dims[d] != s * r) return "output shape is not input shape times repeats";
    g.x_count *= s;
    g.out_count *= s * r;
    g.copies *= r;
    if (!open) {
      s_cur = s;
      r_cur = r;
      open = true;
    } else if (r == 1) {
      s_cur *= s;
    } else if (s_cur == 1) {
      s_cur = s;
      r_cur *= r;
    } else {
      if (g.rank == kMaxRepeatRank) return "more than 16 collapsed repeat dimensions";
      g.size[g.rank] = s_cur;
      g.repeats[g.rank] = r_cur;
      ++g.rank;
      s_cur = s;
      r_cur = r;
    }
  }
  if (!open) {  // a 0-d x with no repeats: one element
    s_cur = 1;
    r_cur = 1;
  }
  {
    if (g.rank == kMaxRepeatRank) return "more than 16 collapsed repeat dimensions";
    g.size[g.rank] = s_cur;
    g.repeats[g.rank] = r_cur;
    ++g.rank;
  }
  *geometry = g;
  return "";
}

}  // namespace jax_kernels
