// What the roi_align forward (forward.cu) and its deterministic input gradient (backward.cu)
// share on CUDA. Channel slabs: both read channels through groups of lanes (32, fewer when
// C < 32) that take a slab of up to 256 channels (1 KB per cell), each lane a few channels (float4
// loads for float32 when C % 4 == 0). A group computes the geometry of a bin, or the entries of a
// cell, once for the whole slab, and every load of the group reads consecutive channels. Both
// passes first stage the data they read channel-minor in scratch memory that XLA provides (the
// input as NHWC, the output gradient as [K, bins, C]) with the tiled batched transpose below.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace jax_kernels {

constexpr int kThreads = 256;           // threads per block of every roi_align kernel
constexpr int kMaxPerLane = 8;
// Channels of a slab: 1 KB of each cell (256 float32 channels, 128 float64, at most 256), so that
// the sample geometry of a bin (forward) or the entry scan of a cell (gather) is shared by that
// many channels.
constexpr int64_t kSlabBytes = 1024;
template <class T>
constexpr int64_t slab_channels() {
  return std::min<int64_t>(kMaxPerLane * 32, kSlabBytes / int64_t(sizeof(T)));
}
constexpr int64_t kSharedAlign = 256;  // alignment of the regions of a block's shared memory

// ---- channel slabs ---------------------------------------------------------------------------

struct ChannelSlabs {
  int lanes;     // lanes per channel group: 32, or the smallest power of two >= C below that
  int per_lane;  // channels per lane: 1, 2, 4 or 8
  int64_t slab;  // channels per slab: lanes * per_lane
  int64_t slabs;
};

// Slabs of about `target` channels (at least a group's lanes, at most kMaxPerLane per lane).
inline ChannelSlabs channel_slabs(int64_t C, int64_t target) {
  ChannelSlabs s;
  s.lanes = 32;
  while (s.lanes > 1 && s.lanes / 2 >= C) s.lanes /= 2;
  const int64_t wanted = std::min(std::max<int64_t>(target, s.lanes), std::max<int64_t>(C, 1));
  s.per_lane = 1;
  while (s.per_lane < kMaxPerLane && s.lanes * s.per_lane < wanted) s.per_lane *= 2;
  s.slab = int64_t(s.lanes) * s.per_lane;
  s.slabs = (C + s.slab - 1) / s.slab;
  return s;
}

// A lane loads kVec consecutive channels at a time (float4 for float32 when C % 4 == 0, else 1):
// value u of a lane is channel slab_channel(u) of the slab.
template <int kVec>
__device__ __forceinline__ int slab_channel(int u, int lanes, int lane) {
  return (u / kVec) * lanes * kVec + lane * kVec + u % kVec;
}

// The lane's kPerLane values of the slab whose first channel is at `at` (zero past `channels`).
template <class T, int kPerLane, int kVec>
__device__ __forceinline__ void load_slab(const T* __restrict__ at, int lanes, int lane,
                                          int channels, T (&values)[kPerLane]) {
  if constexpr (kVec == 4) {
#pragma unroll
    for (int g = 0; g < kPerLane / 4; ++g) {
      const int c = (g * lanes + lane) * 4;
      const float4 q = c < channels ? *reinterpret_cast<const float4*>(at + c)
                                    : make_float4(0.f, 0.f, 0.f, 0.f);
      values[4 * g] = q.x;
      values[4 * g + 1] = q.y;
      values[4 * g + 2] = q.z;
      values[4 * g + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) {
      const int c = u * lanes + lane;
      values[u] = c < channels ? at[c] : T{};
    }
  }
}

// The bilinear sum w1 v1 + w2 v2 + w3 v3 + w4 v4 of the CUDA forwards (BilinearTaps::value's
// order), with its contraction into fused multiply-adds written out: w2 v2 rounded, w1 v1 fused
// onto it, then w3 v3 and w4 v4. The gather over boxes and the region forward give the same bits
// whatever a compiler would fuse by itself.
template <class A>
__device__ __forceinline__ A bilinear_sum(A w1, A v1, A w2, A v2, A w3, A v3, A w4, A v4) {
  return fma(w4, v4, fma(w3, v3, fma(w1, v1, w2 * v2)));
}

// Calls f(per_lane, vec, index) with the compile-time shape of a slab kernel: channels per lane,
// channels per load (4 only for float32 with `vector`), and 32- or 64-bit offsets (`narrow`).
template <class T, class F>
void with_slab_kernel(const ChannelSlabs& slabs, bool vector, bool narrow, F&& f) {
  auto with_index = [&](auto per_lane, auto vec) {
    if (narrow)
      f(per_lane, vec, int32_t{});
    else
      f(per_lane, vec, int64_t{});
  };
  auto with_vec = [&](auto per_lane) {
    if constexpr (std::is_same_v<T, float> && decltype(per_lane)::value % 4 == 0) {
      if (vector) return with_index(per_lane, std::integral_constant<int, 4>{});
    }
    with_index(per_lane, std::integral_constant<int, 1>{});
  };
  switch (slabs.per_lane) {
    case 1:
      return with_vec(std::integral_constant<int, 1>{});
    case 2:
      return with_vec(std::integral_constant<int, 2>{});
    case 4:
      return with_vec(std::integral_constant<int, 4>{});
    default:
      return with_vec(std::integral_constant<int, kMaxPerLane>{});
  }
}

// ---- staging: batched transpose ---------------------------------------------------------------

// out[b][j][i] = in[b][i][j] for `batch` matrices of rows x cols, through 64 x 32 shared tiles
// (8 loads in flight per thread): blocks of 32 x 8 threads, blockIdx.x the column tile,
// blockIdx.y (strided) the (matrix, row tile).
template <class T, class Index>
__global__ void __launch_bounds__(kThreads)
    roi_align_transpose_kernel(const T* __restrict__ in, T* __restrict__ out, Index rows,
                               Index cols, Index row_tiles, Index row_tiles_total) {
  __shared__ T tile[64][33];
  const Index j0 = Index(blockIdx.x) * 32;
  for (Index y = blockIdx.y; y < row_tiles_total; y += gridDim.y) {
    const Index matrix = y / row_tiles, i0 = (y - matrix * row_tiles) * 64;
    const T* src = in + matrix * rows * cols;
    T* dst = out + matrix * rows * cols;
#pragma unroll
    for (int r = threadIdx.y; r < 64; r += 8) {
      const Index i = i0 + r, j = j0 + threadIdx.x;
      if (i < rows && j < cols) tile[r][threadIdx.x] = src[i * cols + j];
    }
    __syncthreads();
#pragma unroll
    for (int r = threadIdx.y; r < 32; r += 8) {
#pragma unroll
      for (int half = 0; half < 64; half += 32) {
        const Index j = j0 + r, i = i0 + half + threadIdx.x;
        if (i < rows && j < cols) dst[j * rows + i] = tile[half + threadIdx.x][r];
      }
    }
    __syncthreads();
  }
}

template <class T>
void transpose(const T* in, T* out, int64_t batch, int64_t rows, int64_t cols,
               cudaStream_t stream) {
  const int64_t row_tiles = (rows + 63) / 64, col_tiles = (cols + 31) / 32;
  if (batch * row_tiles * col_tiles == 0) return;
  const dim3 grid(unsigned(col_tiles), unsigned(std::min<int64_t>(batch * row_tiles, 65535)));
  // 32-bit indices when the elements and the tiles' row and column indices (up to the rounded
  // up extents) all stay below 2^31.
  constexpr int64_t kLimit = int64_t(1) << 31;
  if (batch * rows * cols < kLimit && row_tiles * 64 < kLimit && col_tiles * 32 < kLimit)
    roi_align_transpose_kernel<T, int32_t><<<grid, dim3(32, 8), 0, stream>>>(
        in, out, int32_t(rows), int32_t(cols), int32_t(row_tiles), int32_t(batch * row_tiles));
  else
    roi_align_transpose_kernel<T, int64_t><<<grid, dim3(32, 8), 0, stream>>>(
        in, out, rows, cols, row_tiles, batch * row_tiles);
}

}  // namespace jax_kernels
