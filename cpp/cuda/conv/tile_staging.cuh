// Device helpers of the direct conv2d kernels: staging source tiles in shared memory (plain
// loads, 16-byte vectors, cp.async), the 4-wide register loads and stores of the strip kernels,
// the m16n8k16 tensor-core step of the half-type kernels, and the fixed-order block reduction.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "conv/tiling.h"
#include "jax_kernels/conv.h"
#include "jax_kernels/scalar.h"

namespace jax_kernels {

// StencilAxis::sample, with the common upsample == 1 case free of divisions.
__device__ __forceinline__ int64_t sample_of(const StencilAxis& a, int64_t u) {
  if (a.upsample == 1) return (u >= 0 && u < a.source) ? u : -1;
  return a.sample(u);
}

// Stages one tile of a source plane into shared memory with threads tid of `threads`: element
// (a, c) of `tile` (row pitch `pitch`) is the upsampled source at (u0 + a, v0 + c), zero
// outside, stored as S (the element type itself, or the accumulation type). The threads split
// the columns (consecutive threads, consecutive columns: the loads coalesce and the stores hit
// distinct banks) and walk rows, so the column tests are done once per thread; up to kInFlight
// loads per thread are issued before any of their stores, so that a tile arrives in one memory
// round trip where it can. Tile origins and extents fit in 32 bits (the planners check:
// stencil.cu's positions_fit_32_bits, plan_wgrad's int32_extents).
template <int kInFlight, class S, class T>
__device__ __forceinline__ void stage_tile(S* tile, const T* __restrict__ source,
                                           const StencilAxis& rows, const StencilAxis& cols,
                                           int64_t u0, int64_t v0, int tile_rows, int tile_cols,
                                           int pitch, int tid, int threads) {
  const int col_threads = std::min(threads, tile_cols), row_threads = threads / col_threads;
  if (tid >= col_threads * row_threads) return;
  const int first_row = tid / col_threads;
  const int height = int(rows.source), first_u = int(u0);
  const auto stage = [&](auto rows_upsampled) {
    // Upsampled rows (a strided dgrad) take one row at a time: the sample test divides.
    constexpr int kBatch = decltype(rows_upsampled)::value ? 1 : kInFlight;
    for (int c = tid % col_threads; c < tile_cols; c += col_threads) {
      const int64_t col = sample_of(cols, v0 + c);
      const T* src = source + col;
      S* dst = tile + c;
      for (int a0 = first_row; a0 < tile_rows; a0 += kBatch * row_threads) {
        T v[kBatch];
#pragma unroll
        for (int f = 0; f < kBatch; ++f) {
          const int a = a0 + f * row_threads, u = first_u + a;
          int64_t row;
          if constexpr (decltype(rows_upsampled)::value)
            row = rows.sample(u);
          else
            row = unsigned(u) < unsigned(height) ? u : -1;
          v[f] = (a < tile_rows && row >= 0 && col >= 0) ? src[row * cols.source] : T{};
        }
#pragma unroll
        for (int f = 0; f < kBatch; ++f) {
          const int a = a0 + f * row_threads;
          if (a < tile_rows) {
            if constexpr (std::is_same_v<S, T>)
              dst[a * pitch] = v[f];
            else
              dst[a * pitch] = to_acc(v[f]);
          }
        }
      }
    }
  };
  if (rows.upsample == 1)
    stage(std::false_type{});
  else
    stage(std::true_type{});
}

// stage_tile for a source that is not upsampled, whose rows are whole 16-byte vectors (width a
// multiple of the vector, 16-byte aligned planes), with v0 a multiple of the vector, stored as T:
// one 16-byte load and store per vector (up to the tile columns rounded up to a vector, within
// the pitch).
template <int kInFlight, class T>
__device__ __forceinline__ void stage_tile_vectors(T* tile, const T* __restrict__ source,
                                                   int64_t height, int64_t width, int64_t u0,
                                                   int64_t v0, int tile_rows, int tile_cols,
                                                   int pitch, int tid, int threads) {
  constexpr int kVector = 16 / int(sizeof(T));
  const int vectors = (tile_cols + kVector - 1) / kVector;
  const int col_threads = std::min(threads, vectors), row_threads = threads / col_threads;
  if (tid >= col_threads * row_threads) return;
  const int first_row = tid / col_threads, first_u = int(u0);
  for (int j = tid % col_threads; j < vectors; j += col_threads) {
    const int64_t col = v0 + j * kVector;
    const bool inside = col >= 0 && col < width;  // whole vectors are inside or outside
    const T* src = source + col;
    T* dst = tile + j * kVector;
    for (int a0 = first_row; a0 < tile_rows; a0 += kInFlight * row_threads) {
      uint4 v[kInFlight];
#pragma unroll
      for (int f = 0; f < kInFlight; ++f) {
        const int a = a0 + f * row_threads, u = first_u + a;
        v[f] = (a < tile_rows && unsigned(u) < unsigned(height) && inside)
                   ? *reinterpret_cast<const uint4*>(src + int64_t(u) * width)
                   : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int f = 0; f < kInFlight; ++f) {
        const int a = a0 + f * row_threads;
        if (a < tile_rows) *reinterpret_cast<uint4*>(dst + a * pitch) = v[f];
      }
    }
  }
}

// Splits the block's threads into `parts` equal groups (any rest idles) and has group z call
// stage(z, its thread index, its thread count): the tiles of several planes are staged in
// parallel, each thread's loads all for one plane.
template <class F>
__device__ __forceinline__ void split_block(int parts, const F& stage) {
  const int threads = int(blockDim.x) / parts, part = int(threadIdx.x) / threads;
  if (part < parts) stage(part, int(threadIdx.x) - part * threads, threads);
}

// Loads row[x .. x + 3] into v (zeros outside [0, width)), as one vector when `vector` (row + x
// aligned to 4 elements) and all four are inside. T is float or double.
template <class T>
__device__ __forceinline__ void load_four(const T* row, int x, int64_t width, bool vector,
                                          T (&v)[4]) {
  if (vector && x >= 0 && x + 4 <= width) {
    if constexpr (std::is_same_v<T, float>) {
      const float4 q = *reinterpret_cast<const float4*>(row + x);
      v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
      const double2 q0 = reinterpret_cast<const double2*>(row + x)[0];
      const double2 q1 = reinterpret_cast<const double2*>(row + x)[1];
      v[0] = q0.x, v[1] = q0.y, v[2] = q1.x, v[3] = q1.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = (x + i >= 0 && x + i < width) ? row[x + i] : T(0);
  }
}

// Stores v at row[x .. x + 3] where inside [0, width), as one vector when `vector` and all four
// are inside. T is float or double.
template <class T>
__device__ __forceinline__ void store_four(T* row, int x, int64_t width, bool vector,
                                           const T (&v)[4]) {
  if (vector && x >= 0 && x + 4 <= width) {
    if constexpr (std::is_same_v<T, float>) {
      *reinterpret_cast<float4*>(row + x) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
      reinterpret_cast<double2*>(row + x)[0] = make_double2(v[0], v[1]);
      reinterpret_cast<double2*>(row + x)[1] = make_double2(v[2], v[3]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (x + i >= 0 && x + i < width) row[x + i] = v[i];
  }
}

// Reads kSpan consecutive tile elements (16-byte aligned) as 16-byte vectors. A is float or
// double.
template <int kSpan, class A>
__device__ __forceinline__ void load_span(const A* p, A (&v)[kSpan]) {
  if constexpr (std::is_same_v<A, float>) {
#pragma unroll
    for (int q = 0; q < kSpan / 4; ++q) {
      const float4 w = reinterpret_cast<const float4*>(p)[q];
      v[4 * q] = w.x, v[4 * q + 1] = w.y, v[4 * q + 2] = w.z, v[4 * q + 3] = w.w;
    }
  } else {
#pragma unroll
    for (int q = 0; q < kSpan / 2; ++q) {
      const double2 w = reinterpret_cast<const double2*>(p)[q];
      v[2 * q] = w.x, v[2 * q + 1] = w.y;
    }
  }
}

// The raw bits of a half-type pair, `lo` in the low 16 bits (the layout of mma fragments).
template <class T>
__device__ __forceinline__ uint32_t pack_pair(T lo, T hi) {
  return uint32_t(lo.bits) | (uint32_t(hi.bits) << 16);
}

// Two floats rounded to a half type and packed, `lo` in the low 16 bits: one cvt.rn.*x2
// instruction. The same bits as from_acc (round to nearest even) but for the payload of NaNs.
template <class T>
__device__ __forceinline__ uint32_t round_pair(float lo, float hi) {
  static_assert(std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>, "half types");
  uint32_t r;
  if constexpr (std::is_same_v<T, bfloat16>)
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// load_four of a half type widened to float: one 8-byte load when `vector` (row + x aligned to
// 4 elements) and all four are inside, zeros outside [0, width).
template <class T, std::enable_if_t<is_half_type<T>(), int> = 0>
__device__ __forceinline__ void load_four(const T* row, int x, int64_t width, bool vector,
                                          float (&v)[4]) {
  if (vector && x >= 0 && x + 4 <= width) {
    const uint2 q = *reinterpret_cast<const uint2*>(row + x);
    v[0] = to_acc(T{uint16_t(q.x)}), v[1] = to_acc(T{uint16_t(q.x >> 16)});
    v[2] = to_acc(T{uint16_t(q.y)}), v[3] = to_acc(T{uint16_t(q.y >> 16)});
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = (x + i >= 0 && x + i < width) ? to_acc(row[x + i]) : 0.f;
  }
}

// load_span of a half-type tile widened to float: kSpan / 4 8-byte reads (p 8-byte aligned).
template <int kSpan, class T, std::enable_if_t<is_half_type<T>(), int> = 0>
__device__ __forceinline__ void load_span(const T* p, float (&v)[kSpan]) {
#pragma unroll
  for (int q = 0; q < kSpan / 4; ++q) {
    const uint2 w = reinterpret_cast<const uint2*>(p)[q];
    v[4 * q] = to_acc(T{uint16_t(w.x)}), v[4 * q + 1] = to_acc(T{uint16_t(w.x >> 16)});
    v[4 * q + 2] = to_acc(T{uint16_t(w.y)}), v[4 * q + 3] = to_acc(T{uint16_t(w.y >> 16)});
  }
}

// store_four of float sums rounded to a half type (from_acc): one 8-byte store when `vector`
// and all four are inside.
template <class T, std::enable_if_t<is_half_type<T>(), int> = 0>
__device__ __forceinline__ void store_four(T* row, int x, int64_t width, bool vector,
                                           const float (&v)[4]) {
  if (vector && x >= 0 && x + 4 <= width) {
    *reinterpret_cast<uint2*>(row + x) =
        make_uint2(pack_pair(from_acc<T>(v[0]), from_acc<T>(v[1])),
                   pack_pair(from_acc<T>(v[2]), from_acc<T>(v[3])));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (x + i >= 0 && x + i < width) row[x + i] = from_acc<T>(v[i]);
  }
}

// D += A * B for one m16n8k16 tile: A 16x16 (row-major fragment, 4 registers), B 16x8
// (column-major fragment, 2 registers), float32 accumulation.
template <class T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Loads a 16x16 A fragment of 16-bit elements from shared memory: lane l passes the address of
// row (l & 7) + 8 * ((l >> 3) & 1), column 8 * (l >> 4) of the tile (16-byte aligned rows).
__device__ __forceinline__ void load_fragment(uint32_t (&a)[4], const void* row) {
  const unsigned address = unsigned(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(address)
               : "memory");
}

// Sums v[t] over the block's threads in a fixed order (a shuffle tree within each warp, then
// the warps in order) and stores sum t at out[t]. blockDim.x must be a multiple of 32.
template <class A, int kValues>
__device__ void block_sum(A (&v)[kValues], A* out) {
  __shared__ A per_warp[kMaxThreads / 32][kValues];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int t = 0; t < kValues; ++t) {
    A x = v[t];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_down_sync(0xffffffffu, x, offset);
    if (lane == 0) per_warp[warp][t] = x;
  }
  __syncthreads();
  for (int t = threadIdx.x; t < kValues; t += blockDim.x) {
    A sum = per_warp[0][t];
    for (int w = 1; w < warps; ++w) sum += per_warp[w][t];
    out[t] = sum;
  }
  __syncthreads();  // per_warp is reused by the next call
}


// ---- cp.async: tiles copied into shared memory behind the arithmetic ----------------------------
// (the pipelined kernels: a block copies the tiles of its next item into the second of two
// shared buffers, zero-filled outside the source, while it computes the current one)


__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool inside) {
  const unsigned address = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(src),
               "r"(inside ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_one() {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

// A thread's share of staging tiles of tile_rows x `vectors` 16-byte vectors with cp.async
// (stage_tile_vectors' split: consecutive threads take consecutive vectors of a row, then rows).
struct AsyncStager {
  int part;                   // the tile this thread stages (>= the tiles: none)
  int first_row, row_step;    // rows first_row, + row_step, ...
  int first_vec, vec_step;    // vectors first_vec, + vec_step, ...
};

// The share of thread tid of `threads` staging one tile: part 0, or 1 if it idles.
__device__ __forceinline__ AsyncStager stager_of(int tid, int threads, int vectors) {
  AsyncStager st;
  const int col_threads = min(threads, vectors), row_threads = threads / col_threads;
  st.part = tid < col_threads * row_threads ? 0 : 1;
  st.first_row = tid / col_threads;
  st.first_vec = tid - st.first_row * col_threads;
  st.row_step = row_threads;
  st.vec_step = col_threads;
  return st;
}

// This thread's share of staging `parts` tiles at once (split_block's split, then stager_of),
// fixed for a whole persistent kernel.
__device__ __forceinline__ AsyncStager make_stager(int parts, int vectors) {
  const int threads = int(blockDim.x) / parts, part = int(threadIdx.x) / threads;
  AsyncStager st = stager_of(int(threadIdx.x) - part * threads, threads, vectors);
  st.part = st.part == 0 ? part : parts;
  return st;
}

// This thread's cp.async copies of one tile: element (a, c) of `tile` (row pitch `pitch`) is the
// source at (u0 + a, v0 + c), zero outside (whole vectors are inside or outside); queued, not
// waited for.
template <class T>
__device__ __forceinline__ void stage_async(const AsyncStager& st, T* tile,
                                            const T* __restrict__ source, int height, int width,
                                            int u0, int v0, int tile_rows, int vectors,
                                            int pitch) {
  constexpr int kVector = 16 / int(sizeof(T));
  for (int j = st.first_vec; j < vectors; j += st.vec_step) {
    const int col = v0 + j * kVector;
    const bool inside = col >= 0 && col < width;
    const T* src = source + (inside ? col : 0);
    T* dst = tile + j * kVector;
    for (int a = st.first_row; a < tile_rows; a += st.row_step) {
      const int u = u0 + a;
      const bool in = inside && unsigned(u) < unsigned(height);
      cp_async_16(dst + a * pitch, in ? src + int64_t(u) * width : source, in);
    }
  }
}

// stage_tile_vectors with cp.async, by thread tid of `threads`.
template <class T>
__device__ __forceinline__ void stage_tile_async(T* tile, const T* __restrict__ source,
                                                 int height, int width, int u0, int v0,
                                                 int tile_rows, int tile_cols, int pitch, int tid,
                                                 int threads) {
  constexpr int kVector = 16 / int(sizeof(T));
  const int vectors = (tile_cols + kVector - 1) / kVector;
  const AsyncStager st = stager_of(tid, threads, vectors);
  if (st.part == 0) stage_async(st, tile, source, height, width, u0, v0, tile_rows, vectors, pitch);
}

}  // namespace jax_kernels
