// The pipelined depthwise stencils of the conv2d forward and dgrad: with one source plane per
// output plane (in_per_group == 1) and vector-aligned source rows, persistent blocks walk their
// work items b = blockIdx.x, + gridDim.x, ... and copy the tiles of item b + gridDim.x into the
// second of two shared buffers (cp.async, zero-filled outside the source) while they compute
// item b: the copies' round trip overlaps the arithmetic instead of serializing with it. The
// arithmetic and its order are those of stencil.cu's strip and tensor-core kernels (same bits).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/launch.h"
#include "conv/direct.h"
#include "conv/tile_staging.cuh"

namespace jax_kernels {
namespace {

// Where item b of a stencil grid lies: its first plane and the origin of its output tile.
struct StencilItem {
  int first_plane, y0, x0;
};

__device__ __forceinline__ StencilItem stencil_item(const StencilGrid& G, int b, int tile_h,
                                                    int tile_w) {
  const int tiles_per_plane = int(G.tiles_x * G.tiles_y);
  StencilItem it;
  if (tiles_per_plane == 1) {  // whole planes (the common case): no divisions
    it.first_plane = b * G.bz;
    it.y0 = 0;
    it.x0 = G.x_base;
  } else {
    const int tile = b % tiles_per_plane;
    it.first_plane = (b / tiles_per_plane) * G.bz;
    it.y0 = (tile / int(G.tiles_x)) * tile_h;
    it.x0 = G.x_base + (tile % int(G.tiles_x)) * tile_w;
  }
  return it;
}

// Queues this thread's share of the source tiles of item `it` into `buffer` (bz tiles of
// tile_stride elements).
template <class T>
__device__ __forceinline__ void stage_item_async(const StencilGrid& G, const AsyncStager& st,
                                                 const T* __restrict__ source,
                                                 const StencilItem& it, T* buffer) {
  const int plane = it.first_plane + st.part;
  if (st.part >= G.bz || plane >= G.planes) return;
  // Depthwise (one source plane per output plane, as many): the source plane is the plane.
  const bool same = G.in_channels == G.out_channels && G.out_per_group == 1;
  const int64_t source_plane = same ? int64_t(plane) : G.source_plane(plane, 0);
  constexpr int kVector = 16 / int(sizeof(T));
  stage_async(st, buffer + st.part * G.tile_stride,
              source + source_plane * (G.rows.source * G.cols.source), int(G.rows.source),
              int(G.cols.source), int(G.rows.position(it.y0, 0)), int(G.cols.position(it.x0, 0)),
              G.src_rows, (G.src_cols + kVector - 1) / kVector, G.pitch);
}

// Loads the kTaps x kTaps weights of a stencil plane from w (the plane's tap (0, 0)), with
// immediate offsets in the depthwise layouts (forward: row kTaps, col 1; dgrad: flipped).
template <int kTaps, class T, class F>
__device__ __forceinline__ void for_each_tap(const StencilWeights& W, const T* w, const F& f) {
  const auto run = [&](auto sign) {
#pragma unroll
    for (int r = 0; r < kTaps; ++r)
#pragma unroll
      for (int t = 0; t < kTaps; ++t) {
        if constexpr (decltype(sign)::value == 0)
          f(r, t, w[r * W.row + t * W.col]);
        else
          f(r, t, w[decltype(sign)::value * (r * kTaps + t)]);
      }
  };
  if (W.col == 1 && W.row == kTaps)
    run(std::integral_constant<int, 1>{});
  else if (W.col == -1 && W.row == -kTaps)
    run(std::integral_constant<int, -1>{});
  else
    run(std::integral_constant<int, 0>{});
}

// stencil_strip_kernel for in_per_group == 1 and G.vector_source, pipelined.
template <class T, int kTaps, int kRows>
__global__ void __launch_bounds__(kMaxThreads, strip_blocks_per_sm<T>())
    stencil_strip_pipe_kernel(const T* __restrict__ source, const T* __restrict__ weight,
                              const T* __restrict__ bias, T* __restrict__ out, const StencilGrid G) {
  constexpr int kSpan = strip_span(kTaps);
  extern __shared__ __align__(16) unsigned char shared_memory[];
  T* const tiles = reinterpret_cast<T*>(shared_memory);
  const int buffer = G.bz * G.tile_stride;
  const int plane_threads = G.bx * G.by;
  const int z = threadIdx.x / plane_threads;
  const int t = threadIdx.x - z * plane_threads;
  const int tx = t % G.bx, ty = t / G.bx;
  const bool slot = z < G.bz;
  const T* const strip =
      tiles + (slot ? z : 0) * G.tile_stride + ty * kRows * G.pitch + tx * kStripCols;
  const int64_t out_plane = G.rows.out * G.cols.out;
  const int tile_h = G.by * kRows, tile_w = G.bx * kStripCols;
  const AsyncStager st = make_stager(G.bz, (G.src_cols + 16 / int(sizeof(T)) - 1) / (16 / int(sizeof(T))));

  int b = blockIdx.x;
  StencilItem it = stencil_item(G, b, tile_h, tile_w);
  if (b < G.blocks) stage_item_async(G, st, source, it, tiles);
  cp_async_commit();
  for (int k = 0; b < G.blocks; b += gridDim.x, k ^= 1) {
    const int nb = b + gridDim.x;
    const StencilItem next = stencil_item(G, nb, tile_h, tile_w);
    if (nb < G.blocks) stage_item_async(G, st, source, next, tiles + (k ^ 1) * buffer);
    cp_async_commit();
    const int plane = it.first_plane + z;
    const bool live = slot && plane < G.planes;
    const int oc = plane % int(G.out_channels);
    const int g = oc / int(G.out_per_group), o = oc % int(G.out_per_group);
    const T start = (live && bias != nullptr) ? bias[oc] : T(0);
    T acc[kRows][kStripCols];
#pragma unroll
    for (int j = 0; j < kRows; ++j)
#pragma unroll
      for (int c = 0; c < kStripCols; ++c) acc[j][c] = start;
    T wr[kTaps][kTaps];
    if (live)
      for_each_tap<kTaps>(G.weights, weight + G.weights.offset(g, o, 0, 0, 0),
                          [&](int r, int s, T v) { wr[r][s] = v; });
    cp_async_wait_one();  // this thread's copies of item b have landed
    __syncthreads();      // and everyone's
    if (live) {
      const T* my_strip = strip + k * buffer;
#pragma unroll
      for (int d = 0; d < kRows + kTaps - 1; ++d) {
        T v[kSpan];
        load_span(my_strip + d * G.pitch, v);
#pragma unroll
        for (int r = 0; r < kTaps; ++r) {
          const int j = d - r;
          if (j < 0 || j >= kRows) continue;
#pragma unroll
          for (int s = 0; s < kTaps; ++s)
#pragma unroll
            for (int c = 0; c < kStripCols; ++c) acc[j][c] += wr[r][s] * v[c + s];
        }
      }
      const int x = it.x0 + tx * kStripCols;
      T* dst = out + plane * out_plane;
      // Columns all inside but not a vector (the tiles start one column early): plain stores.
      const bool interior = !G.vector_out && x >= 0 && x + kStripCols <= G.cols.out;
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const int y = it.y0 + ty * kRows + j;
        if (y >= G.rows.out) continue;
        T* row = dst + int64_t(y) * G.cols.out;
        if (interior) {
#pragma unroll
          for (int c = 0; c < kStripCols; ++c) row[x + c] = acc[j][c];
        } else {
          store_four(row, x, G.cols.out, G.vector_out, acc[j]);
        }
      }
    }
    __syncthreads();  // buffer k has been consumed: the next iteration refills it
    it = next;
  }
}

// Elements between the rows of stencil_mma_pipe_kernel's output staging tile: the tile's
// 8 * nt columns start d = x_base mod 8 columns in (so that output columns 8j fall on 16-byte
// vectors), rounded up to whole vectors with pitch / 8 odd (8 rows of 16 bytes hit 8 different
// groups of 4 banks).
__host__ __device__ constexpr int mma_stage_pitch(int nt) {
  return (8 * nt + 8) % 16 == 0 ? 8 * nt + 16 : 8 * nt + 8;
}

// stencil_mma_kernel for in_per_group == 1 and G.vector_source, pipelined (cp.async double
// buffer, persistent blocks). The same units, each the same chain of kTaps mma (hence the same
// bits), but:
// - kChains units of a warp at a time, their chains issued alternately (independent
//   accumulators): the dependent-mma latency is paid once per kChains units;
// - the accumulators go (packed) to a staging tile in shared memory instead of global memory;
//   after the block's barrier, the plane's threads write the tile out as 16-byte vectors of
//   whole output rows (element by element where a vector straddles the tile's edge or the rows
//   are not 16-byte aligned). That barrier also ends every read of the item's source buffer, so
//   the next item's prefetch may overwrite it: still two barriers per item.
template <class T, int kTaps, int kChains>
__global__ void __launch_bounds__(kMmaThreads, kMmaPipeBlocks)
    stencil_mma_pipe_kernel(const T* __restrict__ source, const T* __restrict__ weight,
                             const T* __restrict__ bias, T* __restrict__ out,
                             const StencilGrid G) {
  extern __shared__ __align__(16) unsigned char shared_memory[];
  T* const tiles = reinterpret_cast<T*>(shared_memory);
  const int buffer = G.bz * G.tile_stride;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const int z = warp / G.warps_per_plane, wp = warp - z * G.warps_per_plane;
  const bool slot = z < G.bz;
  const T* const lane_row = tiles + (slot ? z : 0) * G.tile_stride +
                            ((lane & 7) + 8 * ((lane >> 3) & 1)) * G.pitch + 8 * (lane >> 4);
  const int64_t out_plane = G.rows.out * G.cols.out;
  const int tile_h = 16 * G.mt, tile_w = 8 * G.nt;
  const AsyncStager st = make_stager(G.bz, (G.src_cols + 7) / 8);
  // The output staging tile of the thread's plane (after the two source buffers) and the lane's
  // place in a unit: output (g + 8h, 2q + e) of unit (mi, ni) at row 16 mi + g + 8h, column
  // d + 8 ni + 2q + e.
  const int spitch = mma_stage_pitch(G.nt);
  const int d = G.x_base & 7;  // x_base in (-8, 0]
  T* const stage = tiles + 2 * buffer + (slot ? z : 0) * tile_h * spitch;
  T* const lane_stage = stage + g * spitch + 2 * q + d;
  const int wrap_staged = 16 * spitch - 8 * G.nt;
  // Output tile u = wp + k * warps_per_plane is (u / nt, u % nt), walked without divisions
  // (warps_per_plane <= nt: one wrap at most), with the offsets of its source window (in the
  // item's buffer) and of its staging.
  const int wrap_window = 16 * G.pitch - 8 * G.nt;
  const auto next_unit = [&](int& mi, int& ni, int& window, int& staged) {
    ni += G.warps_per_plane;
    window += 8 * G.warps_per_plane;
    staged += 8 * G.warps_per_plane;
    if (ni >= G.nt) {
      ni -= G.nt;
      ++mi;
      window += wrap_window;
      staged += wrap_staged;
    }
  };
  const int first_mi = wp / G.nt, first_ni = wp % G.nt;
  const int first_window = 16 * first_mi * G.pitch + 8 * first_ni;
  const int first_staged = 16 * first_mi * spitch + 8 * first_ni;
  // The thread's share of writing the staging tile out: vectors (8 columns) first_vec,
  // + vec_step, ... of rows first_row, + row_step, ... (fixed for the kernel).
  const int plane_threads = 32 * G.warps_per_plane;
  const int ptid = int(threadIdx.x) - z * plane_threads;
  const int vecs = G.nt + 1;
  const int vec_step = min(plane_threads, vecs), row_step = plane_threads / vec_step;
  const int first_row = ptid / vec_step;
  const int first_vec = ptid < vec_step * row_step ? ptid - first_row * vec_step : vecs;
  // The lane's B-fragment taps (see stencil_mma_kernel): tap column s[e] of each tap row.
  int tap[4];
  bool in_taps[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    tap[e] = 2 * q + 8 * (e >> 1) + (e & 1) - g;
    in_taps[e] = tap[e] >= 0 && tap[e] < kTaps;
  }
  // The depthwise layouts: weight (r, s) at w + sign * (r * kTaps + s); 0: general strides.
  const int sign = (G.weights.col == 1 && G.weights.row == kTaps)     ? 1
                   : (G.weights.col == -1 && G.weights.row == -kTaps) ? -1
                                                                      : 0;

  // The lane's B-fragment weights of item `item` (zeros outside the taps, or where the thread's
  // plane is past the last).
  const auto fetch_weights = [&](const StencilItem& item, T (&raw)[kTaps][4]) {
    const int plane = item.first_plane + z;
    const bool live = slot && plane < G.planes;
    const int oc = plane % int(G.out_channels);
    const int grp = oc / int(G.out_per_group), o = oc % int(G.out_per_group);
    const T* w = weight + (live ? G.weights.offset(grp, o, 0, 0, 0) : 0);
    const auto load = [&](auto fixed) {
      constexpr int kSign = decltype(fixed)::value;
      const T* base[4];
#pragma unroll
      for (int e = 0; e < 4; ++e)
        base[e] = w + (kSign != 0 ? kSign * tap[e] : tap[e] * int(G.weights.col));
#pragma unroll
      for (int r = 0; r < kTaps; ++r)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          raw[r][e] = live && in_taps[e]
                          ? base[e][kSign != 0 ? kSign * r * kTaps : r * int(G.weights.row)]
                          : T{};
    };
    if (sign == 1)
      load(std::integral_constant<int, 1>{});
    else if (sign == -1)
      load(std::integral_constant<int, -1>{});
    else
      load(std::integral_constant<int, 0>{});
  };
  // The next item's weights are loaded after the current item's mma, so that their latency
  // overlaps its barrier and write-out instead of stalling the item's start.
  T wraw[kTaps][4];

  int b = blockIdx.x;
  StencilItem it = stencil_item(G, b, tile_h, tile_w);
  fetch_weights(it, wraw);
  if (b < G.blocks) stage_item_async(G, st, source, it, tiles);
  cp_async_commit();
  for (int kb = 0; b < G.blocks; b += gridDim.x, kb ^= 1) {
    const int nb = b + gridDim.x;
    const StencilItem next = stencil_item(G, nb, tile_h, tile_w);
    if (nb < G.blocks) stage_item_async(G, st, source, next, tiles + (kb ^ 1) * buffer);
    cp_async_commit();
    const int plane = it.first_plane + z;
    const bool live = slot && plane < G.planes;
    const int oc = plane % int(G.out_channels);
    const float start = (live && bias != nullptr) ? to_acc(bias[oc]) : 0.f;
    uint32_t bfrag[kTaps][2];
#pragma unroll
    for (int r = 0; r < kTaps; ++r) {
      bfrag[r][0] = pack_pair(wraw[r][0], wraw[r][1]);
      bfrag[r][1] = pack_pair(wraw[r][2], wraw[r][3]);
    }
    cp_async_wait_one();
    __syncthreads();  // the item's source tiles are in; the previous item's staging is written out
    if (live) {
      const T* const my_row = lane_row + kb * buffer;
      int mi = first_mi, ni = first_ni, wnext = first_window, snext = first_staged;
#pragma unroll
      for (int k = 0; k < kMmaUnits; k += kChains) {
        if (mi >= G.mt) break;
        // The chains' units; a unit past the tile repeats the first one's window (its result
        // is not stored), so that the chains stay branch-free.
        int window[kChains], staged[kChains];
        bool valid[kChains];
#pragma unroll
        for (int c = 0; c < kChains; ++c) {
          valid[c] = mi < G.mt;
          window[c] = (c == 0 || valid[c]) ? wnext : window[0];
          staged[c] = snext;
          next_unit(mi, ni, wnext, snext);
        }
        float acc[kChains][4];
#pragma unroll
        for (int c = 0; c < kChains; ++c)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[c][e] = start;
#pragma unroll
        for (int r = 0; r < kTaps; ++r) {
          uint32_t a[kChains][4];
#pragma unroll
          for (int c = 0; c < kChains; ++c) load_fragment(a[c], my_row + window[c] + r * G.pitch);
#pragma unroll
          for (int c = 0; c < kChains; ++c) mma_16x8x16<T>(acc[c], a[c], bfrag[r]);
        }
        // The lane holds outputs (g, 2q + e) in acc[c][e] and (g + 8, 2q + e) in acc[c][2 + e].
#pragma unroll
        for (int c = 0; c < kChains; ++c) {
          if (c > 0 && !valid[c]) continue;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t pair = round_pair<T>(acc[c][2 * h], acc[c][2 * h + 1]);
            T* const s = lane_stage + staged[c] + 8 * h * spitch;
            if (d & 1) {
              s[0] = T{uint16_t(pair & 0xffffu)};
              s[1] = T{uint16_t(pair >> 16)};
            } else {
              *reinterpret_cast<uint32_t*>(s) = pair;
            }
          }
        }
      }
    }
    if (nb < G.blocks) fetch_weights(next, wraw);
    __syncthreads();  // the staging tiles are complete, and every read of buffer kb is done
    if (live) {
      // Staging column j of the tile is output column xs + j (xs a multiple of 8); the item's
      // outputs are columns [c0, c1) of rows y0 .. y0 + rows - 1.
      const int xs = it.x0 - d;
      const int rows = min(tile_h, int(G.rows.out) - it.y0);
      const int c0 = max(it.x0, 0), c1 = min(it.x0 + tile_w, int(G.cols.out));
      T* const dst_plane = out + plane * out_plane + int64_t(it.y0) * G.cols.out;
      for (int j = first_vec; j < vecs; j += vec_step) {
        const int c = xs + 8 * j;
        if (c + 8 <= c0 || c >= c1) continue;
        const bool whole = G.vector_out16 && c >= c0 && c + 8 <= c1;
        const T* src = stage + first_row * spitch + 8 * j;
        T* dst = dst_plane + int64_t(first_row) * G.cols.out + c;
        for (int a = first_row; a < rows; a += row_step) {
          const uint4 v = *reinterpret_cast<const uint4*>(src);
          if (whole) {
            *reinterpret_cast<uint4*>(dst) = v;
          } else {
            const uint32_t word[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int e = 0; e < 8; ++e)
              if (c + e >= c0 && c + e < c1)
                dst[e] = T{uint16_t(word[e >> 1] >> (16 * (e & 1)))};
          }
          src += row_step * spitch;
          dst += int64_t(row_step) * G.cols.out;
        }
      }
    }
    it = next;
  }
}

template <class T, int kTaps, int kRows>
void launch_stencil_strips_pipe(cudaStream_t stream, const T* source, const T* weight,
                                const T* bias, T* out, const StencilGrid& G) {
  const int threads = int(round_up(int64_t(G.bx) * G.by * G.bz, 32));
  const size_t shared = 2 * size_t(G.bz) * size_t(G.tile_stride) * sizeof(T);
  const auto kernel = stencil_strip_pipe_kernel<T, kTaps, kRows>;
  const unsigned blocks = persistent_blocks(kernel, strip_blocks_per_sm<T>(), G.blocks, shared);
  kernel<<<blocks, threads, shared, stream>>>(source, weight, bias, out, G);
}

template <class T, int kTaps>
void launch_stencil_mma_pipe(cudaStream_t stream, const T* source, const T* weight, const T* bias,
                             T* out, const StencilGrid& G) {
  const int threads = 32 * G.warps_per_plane * G.bz;
  // Two source buffers, then the output staging tiles.
  const size_t shared = (2 * size_t(G.bz) * size_t(G.tile_stride) +
                         size_t(G.bz) * size_t(16 * G.mt) * size_t(mma_stage_pitch(G.nt))) *
                        sizeof(T);
  const auto kernel = stencil_mma_pipe_kernel<T, kTaps, kMmaChains>;
  const unsigned blocks = persistent_blocks(kernel, kMmaPipeBlocks, G.blocks, shared);
  kernel<<<blocks, threads, shared, stream>>>(source, weight, bias, out, G);
}

}  // namespace

template <class T>
void launch_stencil_pipelined(cudaStream_t stream, const T* source, const T* weight,
                              const T* bias, T* out, const StencilGrid& G, int taps, int rows) {
  if constexpr (is_half_type<T>()) {
    if (taps == 3) launch_stencil_mma_pipe<T, 3>(stream, source, weight, bias, out, G);
    if (taps == 5) launch_stencil_mma_pipe<T, 5>(stream, source, weight, bias, out, G);
    if (taps == 7) launch_stencil_mma_pipe<T, 7>(stream, source, weight, bias, out, G);
  } else if (rows == 7) {
    if (taps == 3) launch_stencil_strips_pipe<T, 3, 7>(stream, source, weight, bias, out, G);
    if (taps == 5) launch_stencil_strips_pipe<T, 5, 7>(stream, source, weight, bias, out, G);
    if (taps == 7) launch_stencil_strips_pipe<T, 7, 7>(stream, source, weight, bias, out, G);
  } else {
    if (taps == 3) launch_stencil_strips_pipe<T, 3, 8>(stream, source, weight, bias, out, G);
    if (taps == 5) launch_stencil_strips_pipe<T, 5, 8>(stream, source, weight, bias, out, G);
    if (taps == 7) launch_stencil_strips_pipe<T, 7, 8>(stream, source, weight, bias, out, G);
  }
}

template void launch_stencil_pipelined<float16>(cudaStream_t, const float16*, const float16*, const float16*, float16*,
                                              const StencilGrid&, int, int);
template void launch_stencil_pipelined<bfloat16>(cudaStream_t, const bfloat16*, const bfloat16*, const bfloat16*, bfloat16*,
                                              const StencilGrid&, int, int);
template void launch_stencil_pipelined<float>(cudaStream_t, const float*, const float*, const float*, float*,
                                              const StencilGrid&, int, int);
template void launch_stencil_pipelined<double>(cudaStream_t, const double*, const double*, const double*, double*,
                                              const StencilGrid&, int, int);

}  // namespace jax_kernels
