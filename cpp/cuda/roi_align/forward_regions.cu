// The roi_align forward by image regions (what and why: forward_regions.h).
//
// Four launches after a memset: a count of the (box, tile) entries per tile, one block's scan of
// the counts, the entries written to their tile's range, and the region kernel. An entry is a
// box's bins whose centers lie in one tile: a rectangle of bin rows and columns (bin centers move
// monotonically with the bin index, NaN for all bins or for none, so the bins of a tile are runs
// in both directions and a box has at most min(PH, tile rows) x min(PW, tile columns) entries,
// the scratch's bound); a box without an image is one entry in tile 0 (zeros). The region kernel
// is correct for any bin in any tile, only slower where the taps lie outside the staged region.
// Bins do not depend on the order of the entries (atomics order them), so the bits do not either.
//
// The region kernel's block takes one tile and a group of channel slabs (8 bytes of channels per
// lane: 64 channels of float32, 128 of a half type). Per chunk of the tile's bins (at most
// kChunkBins, and at most kChunkSamples samples) its threads first write one record per valid
// sample (in for_each_bin_sample's order: rows outer, columns inner): the four bilinear weights
// and the shared-memory offsets of the four taps, or, where a tap lies outside the staged region,
// the cell of the low taps. Then per slab the block stages the region (rows and columns
// [tile - 3, tile + 15) inside the image), and each warp sums its bins' records, a lane's 8 bytes
// of channels at a time, with bilinear_sum (the gather's order of operations).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/knobs.h"
#include "common/launch.h"
#include "common/scratch.h"
#include "jax_kernels/index_math.h"
#include "jax_kernels/roi_align.h"
#include "roi_align/channel_slabs.cuh"
#include "roi_align/forward_regions.h"

namespace jax_kernels {
namespace {

constexpr int kRegionSide = kRegionTile + 2 * kRegionHalo;  // staged cells per side
constexpr int kRegionCells = kRegionSide * kRegionSide;
constexpr int kPitch = 33;           // 8-byte units per staged cell: 256 bytes, one to skew banks
constexpr int kChunkSamples = 768;   // sample records of a chunk of bins
constexpr int kChunkBins = 192;      // bins of a chunk: one thread writes each bin's records
constexpr uint32_t kOutside = 0xffff0000u;  // a record whose taps are read in place

struct RegionLaunch {
  int64_t tiles, tiles_y, tiles_x;
  int slabs, slabs_per_block, groups;
  int grid2;       // samples per bin (sampling_ratio^2)
  int chunk_bins;  // bins per chunk of records
  bool vector;     // C a multiple of a lane's channels: 8-byte loads of channels-last cells
};

template <class T>
constexpr int lane_channels() {
  return 8 / int(sizeof(T));
}

// Shared memory of the region kernel: the region, the records (offsets, weights), the bins'
// heads, the entries of a batch and their running sums.
constexpr int kRecordsAt = kRegionCells * kPitch * 8;
constexpr int kWeightsAt = kRecordsAt + kChunkSamples * 8;
constexpr int kHeadsAt = kWeightsAt + kChunkSamples * 16;
constexpr int kEntriesAt = kHeadsAt + kChunkBins * 16;
constexpr int kPrefixAt = kEntriesAt + kThreads * 16;
constexpr int kRegionShared = kPrefixAt + kThreads * 4;
static_assert(2 * (kRegionShared + 1024) <= 228 * 1024, "two region blocks per multiprocessor");

template <class T>
RegionLaunch region_launch(const RoiAlignProblem& p, const RegionPlan& plan) {
  RegionLaunch l;
  l.tiles = plan.tiles;
  l.tiles_y = plan.tiles_y;
  l.tiles_x = plan.tiles_x;
  l.slabs = int(ceil_div(p.C, 32 * lane_channels<T>()));
  // Enough blocks for about four waves of two blocks per multiprocessor, where the tiles alone
  // are fewer: the groups of slabs repeat the records, not the staging.
  const int64_t target = int64_t(8) * multiprocessor_count();
  const int64_t groups = std::clamp<int64_t>(ceil_div(target, l.tiles), 1, l.slabs);
  l.slabs_per_block = knob_count("JAX_KERNELS_ROI_ALIGN_SLABS_PER_BLOCK",
                                 int(ceil_div(l.slabs, groups)));
  l.slabs_per_block = std::min(l.slabs_per_block, l.slabs);
  l.groups = int(ceil_div(l.slabs, l.slabs_per_block));
  l.grid2 = int(p.sampling_ratio * p.sampling_ratio);
  l.chunk_bins = std::min(kChunkBins, kChunkSamples / l.grid2);
  l.vector = p.C % lane_channels<T>() == 0;
  return l;
}

// The tile (along one axis) of the center of bin i: the cell under the center, clamped to the
// image (NaN to cell 0), over kRegionTile. Monotone in i (NaN for all or for none).
template <class A>
__device__ __forceinline__ int tile_of(const RoiAxis<A>& axis, int i, int extent) {
  const A center = axis.start + (A(i) + A(0.5)) * axis.bin;
  int cell = 0;
  if (center >= A(extent - 1))
    cell = extent - 1;
  else if (center > A(0))
    cell = int(center);
  return cell / kRegionTile;
}

// The entries, by one thread per bin (k, ph, pw): a bin that starts a run of bin rows and a run
// of bin columns with the same tile calls f(tile, ph, ph1, pw, pw1) for its entry, the bins
// [ph, ph1) x [pw, pw1) of box k in that tile of the box's image. A box without an image is one
// entry of all its bins in tile 0 (they are zeros).
template <class T, class F>
__device__ __forceinline__ void for_each_entry(const T* __restrict__ boxes,
                                               const RoiAlignProblem& p, const RegionLaunch& l,
                                               F&& f) {
  const int64_t bins = p.bins(), stride = int64_t(gridDim.x) * blockDim.x;
  const int PH = int(p.PH), PW = int(p.PW), H = int(p.H), W = int(p.W);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.K * bins; i += stride) {
    const int64_t k = i / bins;
    const int b = int(i - k * bins), ph = b / PW, pw = b - ph * PW;
    const auto box = roi_box(boxes, k, p);
    if (box.image < 0) {
      if (b == 0) f(k, int64_t(0), 0, PH, 0, PW);
      continue;
    }
    const int ty = tile_of(box.y, ph, H), tx = tile_of(box.x, pw, W);
    if ((ph > 0 && tile_of(box.y, ph - 1, H) == ty) || (pw > 0 && tile_of(box.x, pw - 1, W) == tx))
      continue;
    int ph1 = ph + 1, pw1 = pw + 1;
    while (ph1 < PH && tile_of(box.y, ph1, H) == ty) ++ph1;
    while (pw1 < PW && tile_of(box.x, pw1, W) == tx) ++pw1;
    f(k, (box.image * l.tiles_y + ty) * l.tiles_x + tx, ph, ph1, pw, pw1);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    roi_align_region_count_kernel(const T* __restrict__ boxes, RoiAlignProblem p,
                                  RegionLaunch l, uint32_t* __restrict__ counts) {
  for_each_entry(boxes, p, l, [&](int64_t, int64_t tile, int, int, int, int) {
    atomicAdd(counts + tile, 1u);
  });
}

// starts[t] = the sum of counts[0 .. t) for t in [0, tiles], by one block of 1024 threads (each
// a run of tiles); fill[t] = 0.
__global__ void __launch_bounds__(1024)
    roi_align_region_scan_kernel(const uint32_t* __restrict__ counts, uint32_t* __restrict__ starts,
                                 uint32_t* __restrict__ fill, int64_t tiles) {
  __shared__ uint32_t sums[1024];
  const int64_t per = ceil_div(tiles, 1024);
  const int64_t first = std::min<int64_t>(int64_t(threadIdx.x) * per, tiles);
  const int64_t last = std::min<int64_t>(first + per, tiles);
  uint32_t sum = 0;
  for (int64_t t = first; t < last; ++t) sum += counts[t];
  sums[threadIdx.x] = sum;
  __syncthreads();
  for (int offset = 1; offset < 1024; offset <<= 1) {
    const uint32_t add = threadIdx.x >= offset ? sums[threadIdx.x - offset] : 0u;
    __syncthreads();
    sums[threadIdx.x] += add;
    __syncthreads();
  }
  uint32_t run = threadIdx.x > 0 ? sums[threadIdx.x - 1] : 0u;
  for (int64_t t = first; t < last; ++t) {
    starts[t] = run;
    run += counts[t];
    fill[t] = 0;
  }
  if (threadIdx.x == 1023) starts[tiles] = sums[1023];
}

// Entry (k, ph0 | ph1 << 16, pw0 | pw1 << 16, 0) at the next place of its tile's range.
template <class T>
__global__ void __launch_bounds__(kThreads)
    roi_align_region_fill_kernel(const T* __restrict__ boxes, RoiAlignProblem p, RegionLaunch l,
                                 const uint32_t* __restrict__ starts, uint32_t* __restrict__ fill,
                                 uint4* __restrict__ entries, int64_t max_entries) {
  for_each_entry(boxes, p, l, [&](int64_t k, int64_t tile, int ph0, int ph1, int pw0, int pw1) {
    const uint32_t slot = starts[tile] + atomicAdd(fill + tile, 1u);
    if (slot < starts[tile + 1] && slot < max_entries)  // always: counted, and within the bound
      entries[slot] = make_uint4(uint32_t(k), uint32_t(ph0) | (uint32_t(ph1) << 16),
                                 uint32_t(pw0) | (uint32_t(pw1) << 16), 0u);
  });
}

// Copies of `bytes` (4 or 8) bytes into shared memory behind the arithmetic (cp.async), and the
// wait for all of this thread's copies.
template <int kBytes>
__device__ __forceinline__ void copy_async(void* dst, const void* src) {
  const unsigned address = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(address), "l"(src),
               "n"(kBytes)
               : "memory");
}
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Inclusive sum of v over the block's threads (kThreads); `warp_sums` holds kThreads / 32.
__device__ __forceinline__ int block_inclusive_sum(int v, int* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, v, offset);
    if (lane >= offset) v += n;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  for (int w = 0; w < warp; ++w) v += warp_sums[w];
  __syncthreads();
  return v;
}

// A lane's channels [c, c + kPer) of one cell of an image (channel c counted from the slab's
// first, whose address is `at`: NHWC, the cell's; NCHW, the plane's), zeros past `channels`, as
// the 8 bytes of a staged word pair. `vector`: one 8-byte load where all are inside.
template <class Layout, class T>
__device__ __forceinline__ uint2 load_lane(const T* __restrict__ at, int64_t cell, int c,
                                           int channels, int64_t C, int64_t plane, bool vector) {
  constexpr int kPer = lane_channels<T>();
  if (Layout::kChannelsLast && vector && c + kPer <= channels)
    return *reinterpret_cast<const uint2*>(at + cell * C + c);
  T v[kPer];
#pragma unroll
  for (int q = 0; q < kPer; ++q)
    v[q] = c + q < channels ? (Layout::kChannelsLast ? at[cell * C + c + q]
                                                     : at[(c + q) * plane + cell])
                            : T{};
  uint2 word;
  static_assert(sizeof(v) == sizeof(word));
  memcpy(&word, v, sizeof(word));
  return word;
}

// The kPer channels of a staged word pair, widened.
template <class T>
__device__ __forceinline__ void unpack(uint2 word, float (&v)[lane_channels<T>()]) {
  if constexpr (sizeof(T) == 4) {
    v[0] = __uint_as_float(word.x);
    v[1] = __uint_as_float(word.y);
  } else {
    v[0] = to_acc(T{uint16_t(word.x)});
    v[1] = to_acc(T{uint16_t(word.x >> 16)});
    v[2] = to_acc(T{uint16_t(word.y)});
    v[3] = to_acc(T{uint16_t(word.y >> 16)});
  }
}

template <class Layout, class T>
__global__ void __launch_bounds__(kThreads, 2)
    roi_align_region_kernel(const T* __restrict__ input, const T* __restrict__ boxes,
                            const uint32_t* __restrict__ starts,
                            const uint4* __restrict__ entries, T* __restrict__ out,
                            RoiAlignProblem p, RegionLaunch l) {
  constexpr int kPer = lane_channels<T>(), kSlab = 32 * kPer, kWarps = kThreads / 32;
  extern __shared__ __align__(16) unsigned char shared[];
  uint2* region = reinterpret_cast<uint2*>(shared);
  uint2* offsets = reinterpret_cast<uint2*>(shared + kRecordsAt);
  float4* weights = reinterpret_cast<float4*>(shared + kWeightsAt);
  int4* heads = reinterpret_cast<int4*>(shared + kHeadsAt);
  uint4* batch = reinterpret_cast<uint4*>(shared + kEntriesAt);
  int* prefix = reinterpret_cast<int*>(shared + kPrefixAt);
  __shared__ int warp_sums[kWarps];

  // Tiles fastest: the blocks in flight stage neighbouring regions of the same slabs.
  const int64_t tile = int64_t(blockIdx.x) % l.tiles, group = int64_t(blockIdx.x) / l.tiles;
  const uint32_t begin = starts[tile], end = starts[tile + 1];
  if (begin >= end) return;
  const int64_t per_image = l.tiles_y * l.tiles_x, image = tile / per_image;
  const int64_t ty = (tile - image * per_image) / l.tiles_x;
  const int64_t tx = tile - image * per_image - ty * l.tiles_x;
  const int r0 = int(ty) * kRegionTile - kRegionHalo, c0 = int(tx) * kRegionTile - kRegionHalo;
  // The staged cells: the region's inside the image.
  const int rows = min(r0 + kRegionSide, int(p.H)) - max(r0, 0);
  const int cols = min(c0 + kRegionSide, int(p.W)) - max(c0, 0);
  const int slab_first = int(group) * l.slabs_per_block;
  const int slab_last = min(slab_first + l.slabs_per_block, l.slabs);
  const int64_t plane = p.H * p.W, bins = p.bins();
  const T* image_in = input + image * p.C * plane;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  for (uint32_t e0 = begin; e0 < end; e0 += kThreads) {
    const int count = int(min(uint32_t(kThreads), end - e0));
    int size = 0;
    if (int(threadIdx.x) < count) {
      const uint4 e = entries[e0 + threadIdx.x];
      batch[threadIdx.x] = e;
      size = int((e.y >> 16) - (e.y & 0xffffu)) * int((e.z >> 16) - (e.z & 0xffffu));
    }
    const int inclusive = block_inclusive_sum(size, warp_sums);
    if (int(threadIdx.x) < count) prefix[threadIdx.x] = inclusive;
    __syncthreads();
    const int total = prefix[count - 1];
    for (int b0 = 0; b0 < total; b0 += l.chunk_bins) {
      const int chunk = min(l.chunk_bins, total - b0);
      // Stage where the chunk's taps outnumber the cells staged.
      const bool staged = 4 * chunk * l.grid2 >= rows * cols;
      if (int(threadIdx.x) < chunk) {
        const int q = b0 + int(threadIdx.x);
        int lo = 0, hi = count - 1;  // the first entry whose inclusive sum passes q
        while (lo < hi) {
          const int mid = (lo + hi) / 2;
          if (prefix[mid] > q)
            hi = mid;
          else
            lo = mid + 1;
        }
        const uint4 e = batch[lo];
        const int local = q - (lo > 0 ? prefix[lo - 1] : 0);
        const int pw0 = int(e.z & 0xffffu), width = int(e.z >> 16) - pw0;
        const int ph = int(e.y & 0xffffu) + local / width, pw = pw0 + local % width;
        const int64_t k = e.x;
        const RoiBox<float> box = roi_box(boxes, k, p);
        const int first = int(threadIdx.x) * l.grid2;
        int n = 0;
        if (box.image >= 0) {  // then box.image == image (for_each_entry)
          for (int iy = 0; iy < int(box.y.grid); ++iy) {
            const AxisSample<float> sy = axis_sample(box.y.position_in_bin(ph, iy), p.H);
            if (!sy.valid) continue;
            for (int ix = 0; ix < int(box.x.grid); ++ix) {
              const AxisSample<float> sx = axis_sample(box.x.position_in_bin(pw, ix), p.W);
              if (!sx.valid) continue;
              const BilinearWeights<float> w = bilinear_weights(sy, sx);
              const int row = int(sy.low) - r0, col = int(sx.low) - c0;
              const int dy = int(sy.high - sy.low), dx = int(sx.high - sx.low);
              uint2 o;
              if (staged && row >= 0 && row + dy < kRegionSide && col >= 0 &&
                  col + dx < kRegionSide) {
                const uint32_t t = uint32_t(row * kRegionSide + col) * kPitch;
                const uint32_t right = dx * kPitch, down = dy * kRegionSide * kPitch;
                o = make_uint2(t | ((t + right) << 16), (t + down) | ((t + down + right) << 16));
              } else {
                o = make_uint2(kOutside | uint32_t(dy) | uint32_t(dx << 1),
                               uint32_t(sy.low * p.W + sx.low));
              }
              offsets[first + n] = o;
              weights[first + n] = make_float4(w.w1, w.w2, w.w3, w.w4);
              ++n;
            }
          }
        }
        heads[threadIdx.x] =
            make_int4(int(k * bins + ph * p.PW + pw), first, n, __float_as_int(box.count));
      }
      __syncthreads();
      for (int slab = slab_first; slab < slab_last; ++slab) {
        const int ch0 = slab * kSlab, channels = int(min(int64_t(kSlab), p.C - ch0));
        const T* slab_in = image_in + (Layout::kChannelsLast ? int64_t(ch0) : ch0 * plane);
        if (staged) {
          if constexpr (Layout::kChannelsLast) {
            // A warp stages a cell at a time, its lanes 8 bytes each: 256 contiguous bytes,
            // copied behind the arithmetic where the lane's channels are whole.
            const int c = lane * kPer;
            const bool whole = l.vector && c + kPer <= channels;
            for (int cell0 = warp; cell0 < kRegionCells; cell0 += 4 * kWarps) {
              uint2 v[4];
#pragma unroll
              for (int f = 0; f < 4; ++f) {
                const int cell = cell0 + f * kWarps;
                const int row = r0 + cell / kRegionSide, col = c0 + cell % kRegionSide;
                const bool inside = cell < kRegionCells && unsigned(row) < unsigned(p.H) &&
                                    unsigned(col) < unsigned(p.W);
                const int64_t at = int64_t(row) * p.W + col;
                if (inside && whole)
                  copy_async<8>(region + cell * kPitch + lane, slab_in + at * p.C + c);
                else if (inside)
                  v[f] = load_lane<Layout, T>(slab_in, at, c, channels, p.C, plane, l.vector);
              }
#pragma unroll
              for (int f = 0; f < 4; ++f) {
                const int cell = cell0 + f * kWarps;
                const int row = r0 + cell / kRegionSide, col = c0 + cell % kRegionSide;
                if (!whole && cell < kRegionCells && unsigned(row) < unsigned(p.H) &&
                    unsigned(col) < unsigned(p.W))
                  region[cell * kPitch + lane] = v[f];
              }
            }
          } else {
            // Thread i stages channel i / cells of cell i % cells: a warp reads row runs. Float32
            // elements are copied behind the arithmetic; channels past the slab's are zeros.
            T* elements = reinterpret_cast<T*>(region);
            constexpr int kElements = kSlab * kRegionCells, kBatch = sizeof(T) == 4 ? 1 : 8;
            for (int i0 = threadIdx.x; i0 < kElements; i0 += kBatch * kThreads) {
              T v[kBatch];
#pragma unroll
              for (int f = 0; f < kBatch; ++f) {
                const int i = i0 + f * kThreads, c = i / kRegionCells, cell = i % kRegionCells;
                const int row = r0 + cell / kRegionSide, col = c0 + cell % kRegionSide;
                const bool inside = i < kElements && c < channels &&
                                    unsigned(row) < unsigned(p.H) && unsigned(col) < unsigned(p.W);
                const T* src = slab_in + c * plane + int64_t(row) * p.W + col;
                T* dst = elements + cell * kPitch * kPer + c;
                if constexpr (sizeof(T) == 4) {
                  if (inside)
                    copy_async<4>(dst, src);
                  else if (i < kElements && c >= channels)
                    *dst = T{};
                } else {
                  v[f] = inside ? *src : T{};
                }
              }
              if constexpr (sizeof(T) != 4) {
#pragma unroll
                for (int f = 0; f < kBatch; ++f) {
                  const int i = i0 + f * kThreads, c = i / kRegionCells, cell = i % kRegionCells;
                  if (i < kElements) elements[cell * kPitch * kPer + c] = v[f];
                }
              }
            }
          }
          copy_async_wait();
          __syncthreads();
        }
        for (int j = warp; j < chunk; j += kWarps) {
          const int4 h = heads[j];
          float acc[kPer];
#pragma unroll
          for (int q = 0; q < kPer; ++q) acc[q] = 0.f;
          for (int r = h.y; r < h.y + h.z; ++r) {
            const uint2 o = offsets[r];
            const float4 w = weights[r];
            float v[4][kPer];
            if ((o.x & kOutside) != kOutside) {
              unpack<T>(region[(o.x & 0xffffu) + lane], v[0]);
              unpack<T>(region[(o.x >> 16) + lane], v[1]);
              unpack<T>(region[(o.y & 0xffffu) + lane], v[2]);
              unpack<T>(region[(o.y >> 16) + lane], v[3]);
            } else {
              const int dy = o.x & 1, dx = (o.x >> 1) & 1;
              const int64_t low = o.y, high = low + dy * p.W;
              const int c = lane * kPer;
              unpack<T>(load_lane<Layout, T>(slab_in, low, c, channels, p.C, plane, l.vector), v[0]);
              unpack<T>(load_lane<Layout, T>(slab_in, low + dx, c, channels, p.C, plane, l.vector),
                        v[1]);
              unpack<T>(load_lane<Layout, T>(slab_in, high, c, channels, p.C, plane, l.vector), v[2]);
              unpack<T>(load_lane<Layout, T>(slab_in, high + dx, c, channels, p.C, plane, l.vector),
                        v[3]);
            }
#pragma unroll
            for (int q = 0; q < kPer; ++q)
              acc[q] += bilinear_sum(w.x, v[0][q], w.y, v[1][q], w.z, v[2][q], w.w, v[3][q]);
          }
          const float divisor = __int_as_float(h.w);
          const int64_t bin = h.x, k = bin / bins, b = bin - k * bins;
#pragma unroll
          for (int q = 0; q < kPer; ++q) {
            const int c = lane * kPer + q;
            if (c < channels) {
              const T value = from_acc<T>(acc[q] / divisor);
              if constexpr (Layout::kChannelsLast)
                out[bin * p.C + ch0 + c] = value;
              else
                out[(k * p.C + ch0 + c) * bins + b] = value;
            }
          }
        }
        __syncthreads();  // the region and the records are rewritten next
      }
    }
    __syncthreads();  // the batch of entries and its sums are rewritten next
  }
}

}  // namespace

RegionPlan region_plan(int64_t N, int64_t C, int64_t H, int64_t W, int64_t K, int64_t PH,
                       int64_t PW, int64_t sampling_ratio, int64_t element_bytes) {
  RegionPlan plan;
  constexpr int64_t k31 = int64_t(1) << 31;
  if (element_bytes != 2 && element_bytes != 4) return plan;
  if (sampling_ratio < 1 || sampling_ratio > kRegionMaxGrid) return plan;
  if (N < 1 || C < 1 || H < 1 || W < 1 || K < 1 || PH < 1 || PW < 1) return plan;
  if (PH >= (1 << 16) || PW >= (1 << 16) || C >= k31 || H >= k31 || W >= k31 ||
      checked_mul(H, W) >= k31)
    return plan;
  const int64_t all_bins = checked_product({K, PH, PW});
  if (all_bins < 0 || all_bins >= k31) return plan;
  plan.tiles_y = ceil_div(H, kRegionTile);
  plan.tiles_x = ceil_div(W, kRegionTile);
  plan.tiles = checked_product({N, plan.tiles_y, plan.tiles_x});
  const int64_t slabs = ceil_div(C, 256 / element_bytes);
  const int64_t blocks = checked_mul(plan.tiles, slabs);
  if (plan.tiles < 0 || blocks < 0 || blocks >= k31) return plan;
  plan.max_entries =
      checked_product({K, std::min(PH, plan.tiles_y), std::min(PW, plan.tiles_x)});
  if (plan.max_entries < 0 || plan.max_entries >= k31) return plan;
  ScratchLayout layout;
  plan.counts = layout.take(plan.tiles * 4);
  plan.starts = layout.take((plan.tiles + 1) * 4);
  plan.fill = layout.take(plan.tiles * 4);
  plan.entries = layout.take(plan.max_entries * 16);
  plan.total = layout.total();
  plan.eligible = plan.total >= 0;
  return plan;
}

template <class Layout, class T>
cudaError_t roi_align_forward_regions(const T* input, const T* boxes, T* out,
                                      const RoiAlignProblem& p, const RegionPlan& plan, char* base,
                                      cudaStream_t stream) {
  uint32_t* counts = reinterpret_cast<uint32_t*>(base + plan.counts);
  uint32_t* starts = reinterpret_cast<uint32_t*>(base + plan.starts);
  uint32_t* fill = reinterpret_cast<uint32_t*>(base + plan.fill);
  uint4* entries = reinterpret_cast<uint4*>(base + plan.entries);
  const RegionLaunch l = region_launch<T>(p, plan);
  if (cudaError_t e = cudaMemsetAsync(counts, 0, size_t(plan.tiles) * 4, stream); e != cudaSuccess)
    return e;
  const unsigned bin_blocks = grid_blocks(p.K * p.bins(), kThreads);
  roi_align_region_count_kernel<T><<<bin_blocks, kThreads, 0, stream>>>(boxes, p, l, counts);
  roi_align_region_scan_kernel<<<1, 1024, 0, stream>>>(counts, starts, fill, plan.tiles);
  roi_align_region_fill_kernel<T><<<bin_blocks, kThreads, 0, stream>>>(boxes, p, l, starts, fill,
                                                                        entries, plan.max_entries);
  const auto kernel = roi_align_region_kernel<Layout, T>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRegionShared);
  kernel<<<unsigned(l.tiles * l.groups), kThreads, size_t(kRegionShared), stream>>>(
      input, boxes, starts, entries, out, p, l);
  return cudaGetLastError();
}

#define JK_REGION_FORWARD(Layout, T)                                                         \
  template cudaError_t roi_align_forward_regions<Layout, T>(                                 \
      const T*, const T*, T*, const RoiAlignProblem&, const RegionPlan&, char*, cudaStream_t);
JK_REGION_FORWARD(RoiAlignNCHW, float)
JK_REGION_FORWARD(RoiAlignNCHW, float16)
JK_REGION_FORWARD(RoiAlignNCHW, bfloat16)
JK_REGION_FORWARD(RoiAlignNHWC, float)
JK_REGION_FORWARD(RoiAlignNHWC, float16)
JK_REGION_FORWARD(RoiAlignNHWC, bfloat16)
#undef JK_REGION_FORWARD

}  // namespace jax_kernels
