// The channels-first grid_sample forward that picks its route on the device
// (jk_grid_sample_fwd_adaptive; the plain jk_grid_sample_fwd of grid_sample.cu, which programs
// serialized before this pass existed name, always samples in place).
//
// In place, a channels-first tap of one channel is one element of a 32-byte sector. Where the
// points of a warp sample close together (smooth grids) the warp's taps share sectors and the
// in-place kernel wants every warp slot filled (8 blocks of 32 registers per SM). Where
// neighbouring points sample far apart (random coordinates) every tap row of every channel is a
// sector of its own: the in-place kernel then wants loads in flight (4 blocks, four channels in
// flight: the scattered route), and with many channels a channels-last copy of the input pays,
// where a warp reads a tap's channels in one coalesced load (the copy route):
//   1. copy the input channels last into the scratch (a tiled transpose, 32 channels x 64 cells
//      through shared memory);
//   2. sample the copy: a block takes 32 consecutive output points, computes their taps once into
//      shared memory, then for each slab of 128 channels a warp takes four of the points, lane l
//      channels l, l + 32, ... (every tap load independent of the others, a warp's load 32
//      consecutive channels); the sums go to a shared tile, from which every warp stores runs of
//      consecutive points of one channel (the output stays channels first).
// The host does not see the grid, so the copy kernel surveys it first: every block takes the
// same kSurveyPairs pairs of neighbouring points, spread evenly over the output, and counts the
// pairs whose bilinear corners lie more than kFarCells apart (|dx| + |dy|). More than half: the
// copy where there are at least kCopyMinChannels channels, else the scattered route; else in
// place (where the copy may be taken, the scattered route is not launched). Block 0 writes the route to a flag at the front of the scratch, and the kernels
// of the routes not taken read it and return at once. Every block reaches the same count from
// the same pairs, so the blocks agree without talking to each other.
//
// Every route computes each output as the same sum of the same products in the same order: the
// same bits, whichever the survey picks.
//
// Taken for 2-D sampling of float32, bfloat16 and float16 inputs of at least kSurveyMinMiB, with
// 32-bit indices (the host query "grid_sample_fwd_scratch" sizes the scratch: the flag, and the
// copy where it may be taken; 0 bytes, and the plain target, otherwise).
// JAX_KERNELS_GRID_SAMPLE_COPY=0 turns the survey off, =1 takes the copy for every 2-D float32
// / half type problem on every grid without a survey (tests and sanitizer runs of small shapes),
// =2 likewise the scattered route. These set the scratch's size, so set them before tracing.
// JAX_KERNELS_GRID_SAMPLE_SCATTERED_AT and _COPY_AT set the survey's thresholds (far pairs of
// kSurveyPairs), _COPY_CHANNELS the copy's least channel count, _SURVEY_MIB the least input.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/grid_stride.cuh"
#include "common/knobs.h"
#include "common/launch.h"
#include "common/scratch.h"
#include "common/status.h"
#include "grid_sample/common.cuh"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/grid_sample.h"

namespace jax_kernels {
namespace {

using namespace grid_sample_cuda;

constexpr int kSurveyPairs = 64;       // pairs of neighbouring points a survey looks at
constexpr int64_t kFarCells = 8;       // |dx| + |dy| between corners: a float32 sector's worth
constexpr int kScatteredFarPairs = kSurveyPairs / 2;  // more far pairs: scattered
constexpr int kCopyFarPairs = kScatteredFarPairs;   // more: the copy, where it may be taken
constexpr int64_t kCopyMinChannels = 32;
constexpr int kSurveyMinMiB = 32;  // inputs from 32 MiB: below, the survey's ~5-10 us cost
                                   // more than the routes save (runs 32-33)
constexpr int kTileChannels = 32;  // the transpose's tile: 32 channels x 64 cells
constexpr int kTileCells = 64;
constexpr int kTilePoints = 32;  // the sampler's tile: 32 points x a slab of 32, 64 or 128 channels

// Of the survey's pairs of neighbouring points (q, q + 1), spread evenly over the output, those
// whose bilinear corners lie more than kFarCells apart (|dx| + |dy|; pairs across a batch row,
// or with a point outside the input, count as near). Every thread of the block must call it (it
// ends in a barrier); threads past kSurveyPairs look at no pair.
template <class T>
__device__ int far_pairs(const T* __restrict__ grid, const GridSampleCall& call) {
  using A = acc_t<T>;
  const GridSampleGeometry& g = call.geometry;
  const int64_t total = g.batch * g.points;
  bool far = false;
  if (threadIdx.x < kSurveyPairs) {
    const int64_t q = int64_t(threadIdx.x) * total / kSurveyPairs;
    if (q + 1 < total && (q + 1) % g.points != 0) {
      const int32_t points = int32_t(g.points);  // the survey runs with 32-bit indices only
      const int32_t m = int32_t(q / points);
      const int32_t p = int32_t(q) - m * points;
      const int32_t row = int32_t(call.grid_map(m));
      A here[2], next[2];
      load_coordinates<A, int32_t, 2>(grid, row, p, points, here);
      load_coordinates<A, int32_t, 2>(grid, row, p + 1, points, next);
      int64_t distance = 0;
      bool inside = true;
      JK_UNROLL
      for (int d = 0; d < 2; ++d) {
        const int64_t a = bilinear_axis_corner<A, int32_t>(g, d, here[d]);
        const int64_t b = bilinear_axis_corner<A, int32_t>(g, d, next[d]);
        inside = inside && a >= 0 && b >= 0;
        distance += b > a ? b - a : a - b;
      }
      far = inside && distance > kFarCells;
    }
  }
  return __syncthreads_count(far);
}

// Surveys the grid and writes the route: kDirectRoute where at most `scattered_at` pairs lie
// far apart, the copy where more than `copy_at` do and `copy` is given, else kScatteredRoute
// (scattered_at < 0: no survey, the copy where given). On the copy route it then transposes
// input [rows][C][cells] to copy [rows][cells][C], a tile of kTileChannels channels x
// kTileCells cells at a time (each thread eight loads in flight, then eight stores; a warp reads
// 32 consecutive cells of a channel and writes 32 consecutive channels of a cell). Every block
// reaches the same count from the same pairs.
template <class T, class Index>
__global__ void __launch_bounds__(kThreads)
    survey_and_copy_kernel(const T* __restrict__ input, const T* __restrict__ grid,
                           T* __restrict__ copy, int* __restrict__ route, GridSampleCall call,
                           Index rows, int scattered_at, int copy_at) {
  const int far = scattered_at < 0 ? kSurveyPairs : far_pairs(grid, call);
  const int taken = far <= scattered_at                      ? kDirectRoute
                    : copy != nullptr && (scattered_at < 0 || far > copy_at) ? kCopyRoute
                                                                              : kScatteredRoute;
  if (blockIdx.x == 0 && threadIdx.x == 0) *route = taken;
  if (taken != kCopyRoute) return;
  __shared__ T tile[kTileChannels][kTileCells + 1];
  const Index channels = Index(call.geometry.channels), cells = Index(call.geometry.cells);
  const Index channel_tiles = (channels + kTileChannels - 1) / kTileChannels;
  const Index cell_tiles = (cells + kTileCells - 1) / kTileCells;
  const Index per_row = channel_tiles * cell_tiles;
  const Index tiles = rows * per_row;
  const unsigned x = threadIdx.x % 32, y = threadIdx.x / 32;
  constexpr unsigned kRowsPerPass = kThreads / 32;
  const GridStride<Index> loop(tiles, 1, 0);
  for (Index t = loop.first; t < tiles; t = loop.next(t)) {
    const Index b = t / per_row;
    const Index r = t - b * per_row;
    const Index c0 = (r / cell_tiles) * kTileChannels;
    const Index s0 = (r - (r / cell_tiles) * cell_tiles) * kTileCells;
    const T* from = input + b * channels * cells;
    T* to = copy + b * cells * channels;
    JK_UNROLL
    for (unsigned i = 0; i < kTileChannels; i += kRowsPerPass) {
      JK_UNROLL
      for (unsigned h = 0; h < kTileCells; h += 32) {
        const Index c = c0 + Index(i + y), s = s0 + Index(h + x);
        if (c < channels && s < cells) tile[i + y][h + x] = from[c * cells + s];
      }
    }
    __syncthreads();
    JK_UNROLL
    for (unsigned i = 0; i < kTileCells; i += kRowsPerPass) {
      const Index s = s0 + Index(i + y), c = c0 + Index(x);
      if (c < channels && s < cells) to[s * channels + c] = tile[x][i + y];
    }
    __syncthreads();
  }
}

// Samples the channels-last copy [rows][cells][C] at every output point, writing out
// [M][C][points], kTilePoints consecutive points at a time:
//   1. the tile's first kTilePoints threads each compute one point's taps into shared memory
//      (offsets in the copy, -1 for a tap outside, and weights);
//   2. for each slab of 32 kGroups channels, warp w takes the tile's points w, w + 8, ..., lane l
//      channels l, l + 32, ... of the slab: every load of the slab's taps is independent of the
//      others (a warp's load is 32 consecutive channels of one tap), and the sums go to a shared
//      tile;
//   3. every warp stores runs of consecutive points of one channel from the shared tile.
// kGroups (1, 2 or 4) is the slab's groups of 32 channels; each thread keeps 16 loads in flight
// (bilinear: 4 points of one group, 2 points of two, or 1 point of four; bicubic, 16 taps of one).
template <class T, class Index, GridSampleMode kMode, int kGroups>
__global__ void __launch_bounds__(kThreads)
    copy_forward_kernel(const T* __restrict__ copy, const T* __restrict__ grid,
                        T* __restrict__ out, GridSampleCall call, const int* __restrict__ route) {
  using A = acc_t<T>;
  using Taps = PointTaps<A, Index, kMode, 2>;
  constexpr int kTaps = Taps::kCount;
  constexpr unsigned kWarps = kThreads / 32, kPerWarp = kTilePoints / kWarps;
  constexpr unsigned kSlab = 32 * kGroups, kPerLane = kGroups;
  constexpr unsigned kPointsInFlight =
      kPerLane * kTaps >= 16 ? 1 : std::min(kPerWarp, 16 / (kPerLane * kTaps));  // of a warp's
  static_assert(kPerWarp % kPointsInFlight == 0, "a warp's points in whole steps");
  if (*route != kCopyRoute) return;
  __shared__ A tile[kSlab][kTilePoints + 1];
  __shared__ Index tap_at[kTaps][kTilePoints];
  __shared__ A tap_weight[kTaps][kTilePoints];
  __shared__ Index row_at[kTilePoints], out_at[kTilePoints];  // row_at -1: past the output
  const GridSampleGeometry& g = call.geometry;
  const Index points = Index(g.points), channels = Index(g.channels), cells = Index(g.cells);
  const Index total = Index(g.batch) * points;
  const Index tiles = (total + kTilePoints - 1) / kTilePoints;
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const GridStride<Index> loop(tiles, 1, 0);
  for (Index t = loop.first; t < tiles; t = loop.next(t)) {
    const Index q0 = t * kTilePoints;
    if (threadIdx.x < unsigned(kTilePoints)) {
      const Index q = q0 + Index(threadIdx.x);
      Index at = -1;
      Taps taps;
      if (q < total) {
        const Index m = q / points;
        const Index p = q - m * points;
        A coord[2];
        load_coordinates<A, Index, 2>(grid, Index(call.grid_map(m)), p, points, coord);
        taps.template compute<false>(g, coord);
        at = Index(call.input_map(m)) * cells * channels;
        out_at[threadIdx.x] = m * channels * points + p;
      }
      JK_UNROLL
      for (int j = 0; j < kTaps; ++j) {
        // A tap outside keeps its weight: weight * 0 is NaN where the weight is, as in place.
        const bool inside = q < total;
        tap_at[j][threadIdx.x] = inside && taps.valid[j] ? taps.offset[j] * channels : Index(-1);
        tap_weight[j][threadIdx.x] = inside ? taps.weight[j] : A(0);
      }
      row_at[threadIdx.x] = at;
    }
    __syncthreads();
    for (Index c0 = 0; c0 < channels; c0 += kSlab) {
      const unsigned count = unsigned(min(Index(kSlab), channels - c0));  // the slab's channels
      // Every load is issued before the first sum: a tap outside the input, a point past the
      // output or a lane past the slab reads an element inside the copy instead, which the sum
      // or the store leaves out.
      JK_UNROLL
      for (unsigned i0 = 0; i0 < kPerWarp; i0 += kPointsInFlight) {
        A value[kPointsInFlight][kPerLane][kTaps];
        JK_UNROLL
        for (unsigned i = 0; i < kPointsInFlight; ++i) {
          const unsigned point = warp + (i0 + i) * kWarps;
          const T* row = copy + max(row_at[point], Index(0)) + c0;
          JK_UNROLL
          for (unsigned k = 0; k < kPerLane; ++k) {
            const unsigned slot = min(lane + 32 * k, count - 1);
            JK_UNROLL
            for (int j = 0; j < kTaps; ++j)
              value[i][k][j] = to_acc(row[max(tap_at[j][point], Index(0)) + Index(slot)]);
          }
        }
        JK_UNROLL
        for (unsigned i = 0; i < kPointsInFlight; ++i) {
          const unsigned point = warp + (i0 + i) * kWarps;
          JK_UNROLL
          for (unsigned k = 0; k < kPerLane; ++k) {
            A sum = A(0);
            JK_UNROLL
            for (int j = 0; j < kTaps; ++j)
              sum += tap_weight[j][point] * (tap_at[j][point] >= 0 ? value[i][k][j] : A(0));
            tile[lane + 32 * k][point] = sum;
          }
        }
      }
      __syncthreads();
      constexpr unsigned kSlabItems = unsigned(kSlab) * kTilePoints;
      for (unsigned i = threadIdx.x; i < kSlabItems; i += kThreads) {
        const unsigned slot = i / kTilePoints, point = i % kTilePoints;
        if (slot < count && row_at[point] >= 0)
          out[out_at[point] + (c0 + Index(slot)) * points] = from_acc<T>(tile[slot][point]);
      }
      __syncthreads();
    }
  }
}

// JAX_KERNELS_GRID_SAMPLE_COPY: 0 never survey nor copy, 1 copy always (where the kernels can),
// 2 the scattered in-place route always, else survey.
enum class CopySwitch { kOff, kAlways, kScattered, kSurvey };

CopySwitch copy_switch() {
  if (knob_off("JAX_KERNELS_GRID_SAMPLE_COPY")) return CopySwitch::kOff;
  const char* value = std::getenv("JAX_KERNELS_GRID_SAMPLE_COPY");
  if (value != nullptr && std::strcmp(value, "1") == 0) return CopySwitch::kAlways;
  if (value != nullptr && std::strcmp(value, "2") == 0) return CopySwitch::kScattered;
  return CopySwitch::kSurvey;
}

// What a problem may take beside the in-place route: 2-D sampling of 2- or 4-byte elements,
// large enough for the survey to pay; the copy with at least kCopyMinChannels channels
// (JAX_KERNELS_GRID_SAMPLE_COPY_CHANNELS sets that count). kAlways and kScattered force a route
// on every such problem.
struct Routes {
  bool survey = false, copy = false;
};

Routes routes(CopySwitch choice, int64_t dims, int64_t channels, int64_t element_bytes,
              int64_t input_elements) {
  Routes r;
  if (choice == CopySwitch::kOff || dims != 2 || !(element_bytes == 2 || element_bytes == 4) ||
      input_elements < 0)
    return r;
  if (choice == CopySwitch::kAlways || choice == CopySwitch::kScattered) {
    r.copy = choice == CopySwitch::kAlways;
    r.survey = !r.copy;  // the flag, without a survey
    return r;
  }
  const int64_t least_mib = knob_count("JAX_KERNELS_GRID_SAMPLE_SURVEY_MIB", kSurveyMinMiB);
  r.survey = input_elements * element_bytes >= (least_mib << 20);
  r.copy = r.survey &&
           channels >= knob_count("JAX_KERNELS_GRID_SAMPLE_COPY_CHANNELS", kCopyMinChannels);
  return r;
}

// The scratch: the route flag, then the channels-last copy where the copy may be taken.
struct CopyLayout {
  int64_t flag = 0, copy = 0, total = 0;
};

CopyLayout copy_layout(const Routes& r, int64_t input_elements, int64_t element_bytes) {
  CopyLayout l;
  if (!r.survey && !r.copy) return l;
  ScratchLayout layout;
  l.flag = layout.take(int64_t(sizeof(int)));
  l.copy = r.copy ? layout.take(checked_mul(input_elements, element_bytes)) : l.flag;
  l.total = layout.total();
  return l;
}

// Host query "grid_sample_fwd_scratch": the scratch bytes of jk_grid_sample_fwd_adaptive.
// Arguments: `input_elements` (the whole input's), `channels`, `dims`, `element_bytes`. 0 where
// the call can only sample in place; kSizeOverflow when the size cannot be represented.
int64_t forward_scratch_query(const QueryArgs& a) {
  const int64_t elements = a["input_elements"], element_bytes = a["element_bytes"];
  const Routes r = routes(copy_switch(), a["dims"], a["channels"], element_bytes, elements);
  const int64_t total = copy_layout(r, elements, element_bytes).total;
  return total < 0 ? kSizeOverflow : total;
}

ffi::Error grid_sample_forward_adaptive(cudaStream_t stream, ffi::AnyBuffer input,
                                        ffi::AnyBuffer grid, ffi::Result<ffi::AnyBuffer> out,
                                        ffi::Result<ffi::AnyBuffer> scratch,
                                        GridSampleAttrs attrs) {
  const char* op = "grid_sample";
  constexpr GridSampleLayout kLayout = GridSampleLayout::kChannelsFirst;
  GridSampleCall call;
  if (auto error = decode_grid_sample_call(op, GridSamplePass::kForward, kLayout, {&input, &grid},
                                          *out, attrs, &call);
      error.failure())
    return error;
  const GridSampleGeometry& g = call.geometry;
  if (g.batch * g.channels * g.points == 0) return ffi::Error::Success();
  const int64_t elements = int64_t(input.element_count());
  const int64_t element_bytes = int64_t(ffi::ByteWidth(input.element_type()));
  const bool narrow = fits_32_bits(call, {elements, int64_t(grid.element_count())});
  const CopySwitch choice = copy_switch();
  const Routes r = routes(choice, g.dims, g.channels, element_bytes, elements);
  const CopyLayout layout = copy_layout(r, elements, element_bytes);
  // The scratch is what the query asked for at trace time; a call without it samples in place.
  const bool adaptive = narrow && g.cells > 0 && (r.survey || r.copy) && layout.total > 0 &&
                        int64_t(scratch->size_bytes()) >= layout.total;
  // The survey's thresholds (far pairs of kSurveyPairs); -1 takes the copy (scattered route)
  // without a survey.
  const bool forced = choice == CopySwitch::kAlways || choice == CopySwitch::kScattered;
  const int scattered_at =
      forced ? -1 : knob_count("JAX_KERNELS_GRID_SAMPLE_SCATTERED_AT", kScatteredFarPairs);
  const int copy_at = knob_count("JAX_KERNELS_GRID_SAMPLE_COPY_AT", kCopyFarPairs);
  return dispatch_float(input.element_type(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* in = static_cast<const T*>(input.untyped_data());
    const T* coords = static_cast<const T*>(grid.untyped_data());
    T* result = static_cast<T*>(out->untyped_data());
    if constexpr (sizeof(T) <= 4) {
      if (adaptive) {
        char* base = aligned_scratch(scratch->untyped_data());
        int* route = reinterpret_cast<int*>(base + layout.flag);
        T* copied = r.copy ? reinterpret_cast<T*>(base + layout.copy) : nullptr;
        const int32_t rows = int32_t(elements / (g.channels * g.cells));
        const int64_t tiles = r.copy ? rows * ((g.channels + kTileChannels - 1) / kTileChannels) *
                                           ((g.cells + kTileCells - 1) / kTileCells)
                                     : 1;
        survey_and_copy_kernel<T, int32_t><<<grid_blocks(tiles, 1, 8), kThreads, 0, stream>>>(
            in, coords, copied, route, call, rows, scattered_at, copy_at);
        if (!forced)
          launch_forward<kLayout>(stream, call, narrow, in, coords, result, route, kDirectRoute);
        if (!r.copy || (!forced && copy_at > scattered_at))
          launch_forward<kLayout>(stream, call, narrow, in, coords, result, route,
                                  kScatteredRoute);
        if (r.copy) {
          const int64_t tiles_out = (g.batch * g.points + kTilePoints - 1) / kTilePoints;
          // The slab's groups of 32 channels: no more than the channels need (a lane past them
          // would load for nothing); bicubic's 16 taps take one group.
          const int groups = call.mode == GridSampleMode::kBicubic || g.channels <= 32 ? 1
                             : g.channels <= 64                                      ? 2
                                                                                     : 4;
          dispatch_grid_sampler(call.mode, 2, [&](auto mode_c, auto) {
            constexpr GridSampleMode kMode = decltype(mode_c)::value;
            const dim3 blocks(grid_blocks(tiles_out, 1, 8));
            if (kMode == GridSampleMode::kBicubic || groups == 1)
              copy_forward_kernel<T, int32_t, kMode, 1>
                  <<<blocks, kThreads, 0, stream>>>(copied, coords, result, call, route);
            else if constexpr (kMode != GridSampleMode::kBicubic) {
              if (groups == 2)
                copy_forward_kernel<T, int32_t, kMode, 2>
                    <<<blocks, kThreads, 0, stream>>>(copied, coords, result, call, route);
              else
                copy_forward_kernel<T, int32_t, kMode, 4>
                    <<<blocks, kThreads, 0, stream>>>(copied, coords, result, call, route);
            }
          });
        }
        return launch_status(op);
      }
    }
    launch_forward<kLayout>(stream, call, narrow, in, coords, result);
    return launch_status(op);
  });
}

using Stream = ffi::PlatformStream<cudaStream_t>;

}  // namespace
}  // namespace jax_kernels

JK_GRID_SAMPLE_REGISTER_ATTRS();

namespace jax_kernels {

XLA_FFI_DEFINE_HANDLER_SYMBOL(GridSampleForwardAdaptiveCuda, grid_sample_forward_adaptive,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attrs<GridSampleAttrs>(),
                              {ffi::Traits::kCmdBufferCompatible});

JK_REGISTER_TARGET("jk_grid_sample_fwd_adaptive", GridSampleForwardAdaptiveCuda, "grid_sample",
                   "forward",
                   "cuda gather, taps in registers; on far-apart points (surveyed on the device) "
                   "a channels-last copy of the input, a warp along C",
                   "bitwise");

JK_REGISTER_QUERY("grid_sample_fwd_scratch", forward_scratch_query);

}  // namespace jax_kernels
