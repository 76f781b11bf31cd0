// CPU pieces shared by roi_align.cc and roi_align_directional.cc: the channel chunks, the
// input-gradient weights of one box, and the row-list gather of the input gradient (the CUDA
// path's gather with its loops reordered for the CPU).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "jax_kernels/cpu_parallel.h"
#include "jax_kernels/roi_align.h"

namespace jax_kernels {
namespace roi_align_cpu {

constexpr int kChannels = 16;

inline int64_t channel_chunks(const RoiAlignProblem& p) {
  return (p.C + kChannels - 1) / kChannels;
}

// The input-gradient weights of one box: its (row, bin row, row weight) entries in ascending row
// and bin, and per column of its column span the (column bin, weight) pairs in ascending bin. W
// is the accumulation type (the plain pass) or a DirectionalPair (the directional pass).
template <class W>
struct BoxWeights {
  struct Row {
    int64_t row, bin_row;  // bin_row = ph * PW
    W weight;
  };
  struct Column {
    int64_t bin;
    W weight;
  };
  int64_t image = -1;  // no entries unless the box reads an image
  std::vector<Row> rows;
  int64_t column_first = 0;
  std::vector<int64_t> column_begin;  // column_count + 1 offsets into columns
  std::vector<Column> columns;

  int64_t column_count() const { return int64_t(column_begin.size()) - 1; }
};

// d_input from the boxes' weights: per input row and channel chunk, the row's entries (boxes in
// index order, then bin rows), per entry the columns of its box, per column its column bins;
// cell weight = combine(row entry's weight, column's weight). Every input cell receives its terms
// in the order of the CUDA gather, whatever the thread count and the layout (roi_align.h's
// RoiAlignNCHW or RoiAlignNHWC: dout is read and d_input written in place).
template <class Layout, class T, class W, class Combine>
void gather_input_gradient(const RoiAlignProblem& p, const T* dout,
                           const std::vector<BoxWeights<W>>& weights, T* d_input,
                           Combine&& combine) {
  using A = acc_t<T>;
  // Per input row (image * H + h), its (box, index into the box's rows) entries in box order.
  const int64_t rows = p.N * p.H;
  std::vector<int64_t> row_begin(rows + 1, 0);
  for (int64_t k = 0; k < p.K; ++k)
    for (const auto& row : weights[k].rows) ++row_begin[weights[k].image * p.H + row.row + 1];
  for (int64_t r = 0; r < rows; ++r) row_begin[r + 1] += row_begin[r];
  std::vector<std::pair<int64_t, int64_t>> entries(row_begin.back());
  std::vector<int64_t> next(row_begin.begin(), row_begin.end() - 1);
  for (int64_t k = 0; k < p.K; ++k)
    for (int64_t i = 0; i < int64_t(weights[k].rows.size()); ++i)
      entries[next[weights[k].image * p.H + weights[k].rows[i].row]++] = {k, i};

  const int64_t chunks = channel_chunks(p), bins = p.bins(), plane = p.H * p.W;
  const int64_t binned = Layout::binned_channel_stride(p), bin_stride = Layout::bin_stride(p);
  const int64_t channel_stride = Layout::channel_stride(p), cell_stride = Layout::cell_stride(p);
  parallel_for(rows * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<A> acc(p.W * kChannels);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / chunks, c_begin = (task % chunks) * kChannels;
      const int64_t n = row / p.H, h = row % p.H;
      const int64_t channels = std::min<int64_t>(kChannels, p.C - c_begin);
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t e = row_begin[row]; e < row_begin[row + 1]; ++e) {
        const auto [k, i] = entries[e];
        const BoxWeights<W>& box = weights[k];
        const auto& entry = box.rows[i];
        const T* g = dout + k * p.C * bins + c_begin * binned + entry.bin_row * bin_stride;
        for (int64_t j = 0; j < box.column_count(); ++j) {
          A* cell = acc.data() + (box.column_first + j) * kChannels;
          for (int64_t q = box.column_begin[j]; q < box.column_begin[j + 1]; ++q) {
            const auto& column = box.columns[q];
            const A weight = combine(entry.weight, column.weight);
            for (int64_t c = 0; c < channels; ++c)
              cell[c] += input_gradient_term(g[c * binned + column.bin * bin_stride], weight);
          }
        }
      }
      T* out = d_input + n * p.C * plane + c_begin * channel_stride + h * p.W * cell_stride;
      for (int64_t w = 0; w < p.W; ++w)
        for (int64_t c = 0; c < channels; ++c)
          out[c * channel_stride + w * cell_stride] = from_acc<T>(acc[w * kChannels + c]);
    }
  });
}

}  // namespace roi_align_cpu
}  // namespace jax_kernels
