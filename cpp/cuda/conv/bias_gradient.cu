// The bias gradient of conv2d on CUDA, both layouts: db[b, k] = the sum of dy[b, ..., k, ...] over
// the images and output positions, in a fixed order (bitwise reproducible, no atomics).
//
// The reduction of each filter is cut into chunks of a length fixed by the shape alone (not by
// the device): blocks sum one chunk each, in a fixed order within the block, into float partials
// [chunk][b * K + k] in scratch from XLA; a second kernel adds each filter's chunks in chunk
// order. A problem of one chunk per filter (or a call without scratch: programs serialized before
// the scratch result existed) is summed by the first kernel alone, straight into db.
//
// Inside a chunk the elements are taken in granules of 8 (8 consecutive positions of a plane
// channels first, 8 consecutive filters of a row channels last): a thread sums its granules'
// elements in order, with 16-byte loads where the granules are aligned and element loads
// otherwise: the same elements in the same order either way, so the bits do not depend on the
// alignment. Each thread adds its terms in blocks of kBiasBlockTerms (direct.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/launch.h"
#include "common/status.h"
#include "conv/direct.h"
#include "conv/tile_staging.cuh"
#include "jax_kernels/conv.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/scalar.h"

namespace jax_kernels {
namespace {

constexpr int kBiasThreads = 256;
static_assert(kBiasThreads <= kMaxThreads, "block_sum holds kMaxThreads / 32 warp sums");
constexpr int kGranule = 8;
// Granules a thread takes per chunk (independent loads in flight), and the most chunks a filter's
// reduction is cut into (the second kernel's work per filter).
constexpr int64_t kGranulesPerThread = 4;
constexpr int64_t kMaxChunks = 4096;

// How a problem is cut (from its shape alone). Channels first: a filter's terms are the N * plane
// positions of its N planes; a chunk is `chunk` consecutive ones (a multiple of a whole block's
// granules). Channels last: a filter's terms are `rows` rows of K; threads take granules of 8
// filters, `lanes` per row (a power of two up to a block), `row_groups` rows side by side; a
// block covers `k_tiles`' share of the filters over `chunk` rows.
struct BiasPlan {
  bool last = false;
  int64_t batch = 0, K = 0, terms = 0;  // terms per filter: N * plane (NCHW) or rows (NHWC)
  int64_t plane = 0;
  int64_t chunk = 0, chunks = 0;
  int lanes = 0, row_groups = 0;
  int64_t k_tiles = 1;
  int64_t tiles = 0;          // of a batch row's filters: K channels first, k_tiles channels last
  int64_t blocks = 0;         // of the first kernel: batch * tiles * chunks
  int64_t scratch_bytes = 0;  // float partials when chunks > 1
};

BiasPlan plan_bias(bool last, int64_t batch, int64_t N, int64_t K, int64_t plane, int acc_bytes) {
  BiasPlan b;
  b.last = last, b.batch = batch, b.K = K, b.plane = plane;
  b.terms = N * plane;
  if (batch == 0 || K == 0 || b.terms == 0) return b;
  int64_t unit;  // terms a block takes per step
  if (last) {
    const int64_t granules = ceil_div(K, kGranule);
    b.lanes = 1;
    while (b.lanes < kBiasThreads && b.lanes < granules) b.lanes *= 2;
    b.row_groups = kBiasThreads / b.lanes;
    b.k_tiles = ceil_div(granules, b.lanes);
    unit = b.row_groups;
  } else {
    unit = int64_t(kBiasThreads) * kGranule;
  }
  b.tiles = last ? b.k_tiles : K;
  b.chunk = std::max(unit * kGranulesPerThread, round_up(ceil_div(b.terms, kMaxChunks), unit));
  b.chunks = ceil_div(b.terms, b.chunk);
  b.blocks = batch * b.tiles * b.chunks;
  b.scratch_bytes = b.chunks > 1 ? b.chunks * batch * K * acc_bytes : 0;
  return b;
}

// The terms of one thread, added in blocks of kBiasBlockTerms.
template <class A, int kValues>
struct BlockedSums {
  A sum[kValues] = {}, part[kValues] = {};
  int64_t terms = 0;
  __device__ __forceinline__ void flush() {
#pragma unroll
    for (int i = 0; i < kValues; ++i) sum[i] += part[i], part[i] = A(0);
    terms = 0;
  }
  __device__ __forceinline__ void counted(int64_t n) {
    terms += n;
    if (terms >= kBiasBlockTerms) flush();
  }
};

template <class T>
__device__ __forceinline__ void load_granule(const T* at, bool vector, acc_t<T> (&v)[kGranule]) {
  if (vector) {
    constexpr int kPerLoad = 16 / sizeof(T);
#pragma unroll
    for (int l = 0; l < kGranule / kPerLoad; ++l) {
      const uint4 raw = *reinterpret_cast<const uint4*>(at + l * kPerLoad);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kPerLoad; ++i) v[l * kPerLoad + i] = to_acc(e[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kGranule; ++i) v[i] = to_acc(at[i]);
  }
}

// Channels first: block (item, chunk) sums positions [chunk * plan.chunk, ...) of filter item's
// N planes; granule g of the chunk goes to thread g % kBiasThreads.
template <class T>
__global__ void __launch_bounds__(kBiasThreads)
    bias_nchw_kernel(const T* __restrict__ dy, T* __restrict__ db, acc_t<T>* __restrict__ partial,
                     BiasPlan plan) {
  using A = acc_t<T>;
  const int64_t K = plan.K, plane = plan.plane, items = plan.batch * K;
  const bool vector_planes = plane % kGranule == 0 && reinterpret_cast<uintptr_t>(dy) % 16 == 0;
  for (int64_t block = blockIdx.x; block < plan.blocks; block += gridDim.x) {
    const int64_t item = block / plan.chunks, chunk = block % plan.chunks;
    const int64_t b = item / K, k = item % K;
    const int64_t begin = chunk * plan.chunk, end = std::min(begin + plan.chunk, plan.terms);
    const int64_t N = plan.terms / plane;
    BlockedSums<A, 1> sums;
#pragma unroll 4
    for (int64_t f = begin + int64_t(threadIdx.x) * kGranule; f < end;
         f += int64_t(kBiasThreads) * kGranule) {
      A v[kGranule];
      const int64_t n = f / plane, i = f - n * plane;
      if (vector_planes && f + kGranule <= end) {
        load_granule(dy + ((b * N + n) * K + k) * plane + i, true, v);
        A g = A(0);
#pragma unroll
        for (int e = 0; e < kGranule; ++e) g += v[e];
        sums.part[0] += g;
      } else {
        // Element by element, across plane ends: the same terms in the same order.
        A g = A(0);
        int64_t nn = n, ii = i;
        for (int e = 0; e < kGranule && f + e < end; ++e) {
          g += to_acc(dy[((b * N + nn) * K + k) * plane + ii]);
          if (++ii == plane) ii = 0, ++nn;
        }
        sums.part[0] += g;
      }
      sums.counted(kGranule);
    }
    sums.flush();
    __shared__ A block_total[1];
    block_sum(sums.sum, block_total);  // tile_staging.cuh: fixed order (warps, then in order)
    const A total = block_total[0];
    if (threadIdx.x == 0) {
      if (plan.chunks == 1) db[item] = from_acc<T>(total);
      else partial[chunk * items + item] = total;
    }
  }
}

// Channels last: block (b, k tile, chunk); thread (row group, lane) sums the granule of filters
// k0 = 8 * (tile * lanes + lane) over rows chunk_begin + row group, + row_groups, ...; then the
// row groups are added in order.
template <class T>
__global__ void __launch_bounds__(kBiasThreads)
    bias_nhwc_kernel(const T* __restrict__ dy, T* __restrict__ db, acc_t<T>* __restrict__ partial,
                     BiasPlan plan) {
  using A = acc_t<T>;
  __shared__ A shared[kBiasThreads][kGranule + 1];
  const int64_t K = plan.K, rows = plan.terms, items = plan.batch * K;
  const int lane = int(threadIdx.x) % plan.lanes, group = int(threadIdx.x) / plan.lanes;
  const bool vector_rows = K % kGranule == 0 && reinterpret_cast<uintptr_t>(dy) % 16 == 0;
  for (int64_t block = blockIdx.x; block < plan.blocks; block += gridDim.x) {
    const int64_t chunk = block % plan.chunks, rest = block / plan.chunks;
    const int64_t tile = rest % plan.k_tiles, b = rest / plan.k_tiles;
    const int64_t k0 = (tile * plan.lanes + lane) * kGranule;
    const int64_t begin = chunk * plan.chunk, end = std::min(begin + plan.chunk, rows);
    BlockedSums<A, kGranule> sums;
    if (k0 < K) {
      const T* in = dy + b * rows * K + k0;
#pragma unroll 4
      for (int64_t row = begin + group; row < end; row += plan.row_groups) {
        A v[kGranule];
        if (vector_rows) {
          load_granule(in + row * K, true, v);
        } else {
#pragma unroll
          for (int e = 0; e < kGranule; ++e) v[e] = k0 + e < K ? to_acc(in[row * K + e]) : A(0);
        }
#pragma unroll
        for (int e = 0; e < kGranule; ++e) sums.part[e] += v[e];
        sums.counted(1);
      }
    }
    sums.flush();
#pragma unroll
    for (int e = 0; e < kGranule; ++e) shared[threadIdx.x][e] = sums.sum[e];
    __syncthreads();
    // Thread t < lanes * 8 adds filter k0' = tile's 8 * lanes filters' t-th over the row groups.
    for (int t = int(threadIdx.x); t < plan.lanes * kGranule; t += kBiasThreads) {
      const int l = t / kGranule, e = t % kGranule;
      const int64_t k = (tile * plan.lanes + l) * kGranule + e;
      if (k >= K) continue;
      A total = shared[l][e];
      for (int g = 1; g < plan.row_groups; ++g) total += shared[g * plan.lanes + l][e];
      if (plan.chunks == 1) db[b * K + k] = from_acc<T>(total);
      else partial[chunk * items + b * K + k] = total;
    }
    __syncthreads();
  }
}

// db[item] = the partials of item's chunks added in chunk order: a warp per item, lane l taking
// chunks l, l + 32, ... (blocked), then a fixed shuffle tree.
template <class T>
__global__ void __launch_bounds__(kBiasThreads)
    bias_finish_kernel(const acc_t<T>* __restrict__ partial, T* __restrict__ db, int64_t items,
                       int64_t chunks) {
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (kBiasThreads / 32);
  for (int64_t item = int64_t(blockIdx.x) * (kBiasThreads / 32) + threadIdx.x / 32; item < items;
       item += warps) {
    BlockedSums<A, 1> sums;
#pragma unroll 8
    for (int64_t c = lane; c < chunks; c += 32) {
      sums.part[0] += partial[c * items + item];
      sums.counted(1);
    }
    sums.flush();
    A v = sums.sum[0];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    if (lane == 0) db[item] = from_acc<T>(v);
  }
}

}  // namespace

int64_t bias_gradient_scratch_bytes(ConvLayout layout, ConvDtype dtype, int64_t batch, int64_t N,
                                    int64_t K, int64_t plane) {
  if (batch < 0 || N < 0 || K < 0 || plane < 0) return -1;
  const int64_t terms = checked_product({N, plane});
  const int64_t items = checked_product({batch, K});
  if (terms < 0 || items < 0) return kSizeOverflow;
  const BiasPlan plan = plan_bias(layout == ConvLayout::kNHWC, batch, N, K, plane,
                                  dtype == ConvDtype::kFloat64 ? 8 : 4);
  const int64_t bytes = plan.chunks > 1
                            ? checked_product({plan.chunks, items, dtype == ConvDtype::kFloat64 ? 8 : 4})
                            : 0;
  return bytes < 0 ? kSizeOverflow : bytes;
}

template <class T>
ffi::Error run_bias_gradient(cudaStream_t stream, ConvLayout layout, const T* dy, T* db,
                             int64_t batch, int64_t N, int64_t K, int64_t plane, void* scratch,
                             int64_t scratch_bytes) {
  using A = acc_t<T>;
  const bool last = layout == ConvLayout::kNHWC;
  BiasPlan plan = plan_bias(last, batch, N, K, plane, int(sizeof(A)));
  if (batch * K == 0) return ffi::Error::Success();
  if (plan.blocks == 0)  // no images or no output pixels: every sum is empty
    return cuda_status("conv2d bias gradient",
                       cudaMemsetAsync(db, 0, size_t(batch * K) * sizeof(T), stream));
  if (plan.chunks > 1 && (scratch == nullptr || scratch_bytes < plan.scratch_bytes)) {
    // No scratch (a program serialized before the bias gradient took some): one chunk per filter.
    plan.chunk = plan.terms, plan.chunks = 1, plan.blocks = batch * plan.tiles;
  }
  A* partial = static_cast<A*>(scratch);
  const unsigned blocks = unsigned(std::min<int64_t>(plan.blocks, int64_t(1) << 30));
  if (last)
    bias_nhwc_kernel<T><<<blocks, kBiasThreads, 0, stream>>>(dy, db, partial, plan);
  else
    bias_nchw_kernel<T><<<blocks, kBiasThreads, 0, stream>>>(dy, db, partial, plan);
  if (ffi::Error e = launch_status("conv2d bias gradient"); e.failure()) return e;
  if (plan.chunks == 1) return ffi::Error::Success();
  const int64_t items = batch * K;
  bias_finish_kernel<T><<<grid_blocks(items * 32, kBiasThreads), kBiasThreads, 0, stream>>>(
      partial, db, items, plan.chunks);
  return launch_status("conv2d bias gradient (chunks)");
}

#define JK_BIAS_GRADIENT(T)                                                                      \
  template ffi::Error run_bias_gradient<T>(cudaStream_t, ConvLayout, const T*, T*, int64_t,     \
                                           int64_t, int64_t, int64_t, void*, int64_t);
JK_BIAS_GRADIENT(float16)
JK_BIAS_GRADIENT(bfloat16)
JK_BIAS_GRADIENT(float)
JK_BIAS_GRADIENT(double)
#undef JK_BIAS_GRADIENT

}  // namespace jax_kernels
