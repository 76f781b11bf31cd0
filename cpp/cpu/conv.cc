// CPU FFI handlers of conv2d: forward, backward data (dgrad), backward weight (wgrad) and the
// bias gradient.
//
// Forward and dgrad are the same stencil pass (conv.h's StencilAxis): the dgrad is the stencil
// of dy upsampled by the stride, with flipped taps. Its outputs are split into stride phases,
// each reading only the live taps, so no time goes into the upsampled zeros. Per (image, group,
// band of output rows) the source planes are copied once into a zero-padded buffer of the
// accumulation type whose columns are split into `stride` phases: every tap then reads a
// contiguous run of columns, and the loops need no bounds checks. Pointwise passes (1x1 taps,
// unit stride, no padding) skip the band copies: the same sums run on NCHW planes
// (run_pointwise) or as a GEMM over channels-last pixels (run_pointwise_pixels), in place for
// the accumulation type, a tile or run of pixels widened at a time for half types. The wgrad
// reduces over fixed slices of images into partial sums (outer products of dy's transposed
// position chunks by x per tap where the filters fill whole register blocks, else dot products
// along the flat rows), then adds the slices in order, so results never depend on the thread
// count; a channels-last 1x1 wgrad (and most NCHW ones in float32 / float64) is a GEMM over
// the pixels (run_weight_gradient_pixels), in fixed slices of pixels added in order, in place
// for the accumulation type, a chunk of pixels widened at a time for half types, dy's chunk
// transposed for NCHW. The inner loops live in conv_loops.inc, compiled for several
// instruction sets and chosen once at run time.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#endif

#include "jax_kernels/conv.h"
#include "jax_kernels/cpu_parallel.h"
#include "jax_kernels/ffi_util.h"

namespace jax_kernels {
namespace {

// ---- What the instruction-set specific loops receive (see conv_loops.inc) ---------------------

template <class A>
struct StencilTile {
  const A* source;            // zero-padded source planes [channels][rows][row_pitch]
  int64_t channels;           // source channels of the group (the reduction)
  int64_t channel_pitch;      // elements between source planes
  int64_t row_pitch;          // elements between source rows
  int64_t row_step;           // source rows between consecutive output rows
  int row_taps, col_taps;     // live taps of the phase
  const int64_t* row_offset;  // per live row tap: the buffer row read by output row 0
  const int64_t* col_offset;  // per live column tap: the element read by output column 0
  bool sliding;               // row_step 1 and consecutive row offsets: rows share loads
  const int64_t* tap_offset;  // flat tiles (row_step 1): per live (row tap, col tap), the
                              // element read by flat output position 0 (see stencil_flat)
  int64_t channel_chunk;      // flat tiles: source channels summed per sweep over the tiles
  const A* weights;           // per block of output channels (see channel_block()):
                              // [source channel][row tap][col tap][output channel of the block]
  int64_t weight_stride;      // elements per output channel in `weights`
};

template <class A>
struct StencilOutput {
  A* out;                 // output channel 0, row 0, column 0 of the phase within the band
  int64_t channel_pitch;  // elements between output channels
  int64_t row_pitch;      // elements between consecutive rows of the phase
  int64_t col_step;       // elements between consecutive columns of the phase
  int64_t channels, rows, cols;
  const A* bias;          // [channels] or nullptr
};

// The weight gradient's flat rows (conv.cc's run_weight_gradient): column j of the block (an
// (input channel, tap) pair) reads x at column_offset[j] + i where dy is at i, for i in
// [0, positions) of every image.
template <class A>
struct WeightGradientBlock {
  const A* x;                    // staged input planes [image][channel][phase][row][pitch]
  int64_t x_image_pitch;
  int64_t columns;               // (channel, tap) columns of the block
  const int64_t* column_offset;  // per column: the element read by flat position 0
  const A* dy;                   // staged output-gradient planes [image][filter][row][pitch]
  int64_t dy_image_pitch, dy_channel_pitch;
  int64_t images, positions;     // images, and flat positions per image (whole vectors)
};

// Channels-last pointwise (conv.cc's run_pointwise_pixels): pixel p's output channel k is
// out[p * out_step + k] = bias[k] + sum over i of x[p * x_step + i] * weights' (i, k), for p in
// [0, pixels), k in [0, filters), i in [0, channels) in order.
template <class A>
struct PixelBlock {
  const A* x;
  int64_t x_step, channels;
  const A* weights;  // per block of pixel_filter_block filters: [channel][filter of the block],
                     // zero past the last filter
  const A* bias;     // [filters] or nullptr
  A* out;
  int64_t out_step, filters, pixels;
};

// The 1x1 weight gradient over pixels (conv.cc's run_weight_gradient_pixels) over a run of
// pixels: partial[c * partial_pitch + k] = (first ? 0 : partial[...]) + sum over p in [0,
// pixels), in order, of x[p * x_step + c * x_channel_step] * dy[p * dy_step + k]; partial_pitch
// a whole number of pixel_filter_block filters.
template <class A>
struct PixelGradient {
  const A* x;
  int64_t x_step, channels;
  int64_t x_channel_step;  // elements between x's channels: 1 channels last, H*W for NCHW
  const A* dy;
  int64_t dy_step, filters, pixels;
  A* partial;
  int64_t partial_pitch;
  bool first;
  // x's pixels in runs of `run` (0: one run), x_step apart within a run and run_skip elements
  // further from a run's last pixel to the next run's first; the first pixel is run_first into
  // its run. (dy's rows of Q positions over x's rows of a wider pitch.)
  int64_t run, run_skip, run_first;
};

// The outer-product weight gradient of bfloat16 passes over pairs of pixels (conv_loops.inc's
// pixel_gradient_pairs): partial[c * partial_pitch + k] = (first ? 0 : partial[...]) + the sum
// over pairs m of dy's pair m of filter k (dy[m * dy_step + k]: pixels 2m and 2m + 1, bfloat16
// bits, low half first) dotted with x's pair of channel c (the two bfloat16 elements at x + c *
// x_channel_step + the pair's place). x's pixels run as PixelGradient's, in pairs: runs of even
// length, even run_first; filters a whole number of kPixelVectors vectors.
struct PixelGradientPairs {
  const uint16_t* x;
  int64_t x_channel_step, channels;
  const uint32_t* dy;
  int64_t dy_step, filters, pairs;
  float* partial;
  int64_t partial_pitch;
  bool first;
  int64_t run, run_skip, run_first;
};

template <class A>
struct CpuLoops {
  const char* name;   // the instruction set ("baseline", "avx2", "avx512")
  int lanes;          // vector lanes of A
  int channel_block;  // output channels per register block of the stencil (then 4, then 1)
  void (*copy_padded_rows)(const A* source, int64_t source_pitch, int64_t rows, int64_t offset,
                           int64_t count, int64_t width, A* out);
  void (*stencil_phase)(const StencilTile<A>&, const StencilOutput<A>&);
  // The same pass over flat tiles: output positions j = row * row_pitch + column of the phase
  // taken in runs of consecutive j across rows (row_step 1; see conv_loops.inc).
  void (*stencil_flat)(const StencilTile<A>&, const StencilOutput<A>&, A* partial);
  // 16-bit floats <-> A, n contiguous elements (float only; nullptr for double): widen converts
  // float16 / bfloat16 bits exactly, narrow rounds to nearest even as scalar.h's from_acc.
  void (*widen_f16)(const uint16_t* in, A* out, int64_t n);
  void (*widen_bf16)(const uint16_t* in, A* out, int64_t n);
  void (*narrow_f16)(const A* in, uint16_t* out, int64_t n);
  void (*narrow_bf16)(const A* in, uint16_t* out, int64_t n);
  void (*weight_gradient)(const WeightGradientBlock<A>&, int64_t filters, A* partial,
                          int64_t partial_stride);
  int wgrad_columns;  // (channel, tap) columns of weight_gradient's main register block
  // out[c * out_pitch + u] = in[u * in_stride + c] for c, u < lanes (a tile transposed in
  // registers: channels-last pixels into channel planes).
  void (*transpose_tile)(const A* in, int64_t in_stride, A* out, int64_t out_pitch);
  // The flat tiles' blocks for one tap over `tiles` tiles of positions read and written in
  // place (conv.cc's run_pointwise).
  void (*pointwise)(const StencilTile<A>&, const StencilOutput<A>&, int64_t tiles);
  int pointwise_width;  // positions per tile of `pointwise`
  void (*pointwise_pixels)(const PixelBlock<A>&);
  int pixel_filter_block;  // filters per packed weight block of `pointwise_pixels`
  void (*pixel_gradient)(const PixelGradient<A>&);
  // out[i] = in[2 * i], i < n: a stride-2 phase of a row, in the set's vectors.
  void (*every_other)(const A* in, A* out, int64_t n);
  // bfloat16 passes on AVX512_BF16 (float only, else nullptr; see conv_loops.inc): two
  // channels' bfloat16 bits as one row of pairs, and stencil_flat over planes of such rows.
  void (*pair_row)(const uint16_t* even, const uint16_t* odd, int64_t stride, uint32_t* out,
                   int64_t n);
  void (*stencil_flat_pairs)(const StencilTile<A>&, const StencilOutput<A>&, A* partial);
  void (*pixel_gradient_pairs)(const PixelGradientPairs&);
};

namespace portable {
#define JK_CONV_F16C 0
#define JK_CONV_ISA_NAME "baseline"
#define JK_CONV_VECTOR_BYTES 16
#define JK_CONV_REGISTERS 16
#include "conv_loops.inc"
#undef JK_CONV_VECTOR_BYTES
#undef JK_CONV_REGISTERS
#undef JK_CONV_F16C
#undef JK_CONV_ISA_NAME
}  // namespace portable

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define JK_CONV_X86_DISPATCH 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define JK_CONV_F16C 1
#define JK_CONV_ISA_NAME "avx2"
#define JK_CONV_VECTOR_BYTES 32
#define JK_CONV_REGISTERS 16
#include "conv_loops.inc"
#undef JK_CONV_VECTOR_BYTES
#undef JK_CONV_REGISTERS
#undef JK_CONV_F16C
#undef JK_CONV_ISA_NAME
}  // namespace avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c")
namespace avx512 {
#define JK_CONV_F16C 1
#define JK_CONV_ISA_NAME "avx512"
#define JK_CONV_VECTOR_BYTES 64
#define JK_CONV_REGISTERS 32
#include "conv_loops.inc"
#undef JK_CONV_VECTOR_BYTES
#undef JK_CONV_REGISTERS
#undef JK_CONV_F16C
#undef JK_CONV_ISA_NAME
}  // namespace avx512
#pragma GCC pop_options
// The same with the AVX512_BF16 dot products, for bfloat16 passes' flat tiles.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,avx2,fma,f16c")
namespace avx512bf16 {
#define JK_CONV_F16C 1
#define JK_CONV_BF16_PAIRS 1
#define JK_CONV_ISA_NAME "avx512bf16"
#define JK_CONV_VECTOR_BYTES 64
#define JK_CONV_REGISTERS 32
#include "conv_loops.inc"
#undef JK_CONV_VECTOR_BYTES
#undef JK_CONV_REGISTERS
#undef JK_CONV_F16C
#undef JK_CONV_BF16_PAIRS
#undef JK_CONV_ISA_NAME
}  // namespace avx512bf16
#pragma GCC pop_options
#endif

// The widest instruction set the CPU has, or a narrower one named by JAX_KERNELS_CPU_ISA
// ("baseline", "avx2", "avx512": AVX-512 without its bfloat16 dot products; read once): the
// tests run the baseline loops on machines with AVX2.
template <class A>
CpuLoops<A> select_loops() {
  const char* env = std::getenv("JAX_KERNELS_CPU_ISA");
  const std::string wanted = env ? env : "";
  if (wanted == "baseline") {
    if constexpr (std::is_same_v<A, float>) {
      return portable::loops_float();
    } else {
      return portable::loops_double();
    }
  }
#if defined(JK_CONV_X86_DISPATCH)
  __builtin_cpu_init();
  if (wanted != "avx2" && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq")) {
    if (wanted != "avx512" && __builtin_cpu_supports("avx512bf16")) {
      if constexpr (std::is_same_v<A, float>) return avx512bf16::loops_float();
      if constexpr (std::is_same_v<A, double>) return avx512bf16::loops_double();
    }
    if constexpr (std::is_same_v<A, float>) return avx512::loops_float();
    if constexpr (std::is_same_v<A, double>) return avx512::loops_double();
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    if constexpr (std::is_same_v<A, float>) return avx2::loops_float();
    if constexpr (std::is_same_v<A, double>) return avx2::loops_double();
  }
#endif
  if constexpr (std::is_same_v<A, float>) {
    return portable::loops_float();
  } else {
    return portable::loops_double();
  }
}

template <class A>
const CpuLoops<A>& loops() {
  static const CpuLoops<A> selected = select_loops<A>();
  return selected;
}

// ---- Buffers ------------------------------------------------------------------------------------

// A thread's scratch buffer of at least n elements, uninitialized, kept for the thread's next
// call when it is at most 4 MiB (allocating, zeroing and faulting in fresh pages on every call
// cost up to a tenth of a convolution's time); larger ones are the caller's own. Each `slot`
// is one buffer: a call uses distinct slots for the buffers it holds at once. The buffer
// starts on a 64-byte boundary (a cache line): the loops' vectors then split no line where
// their offsets are whole vectors.
template <class A>
class ThreadScratch {
 public:
  ThreadScratch(int slot, int64_t n) {
    thread_local std::vector<A> kept[5];
    constexpr size_t kLine = 64 / sizeof(A);
    const size_t count = size_t(std::max<int64_t>(n, 1)) + kLine;
    A* base;
    if (count * sizeof(A) <= (size_t(4) << 20)) {
      if (kept[slot].size() < count) kept[slot].resize(count);
      base = kept[slot].data();
    } else {
      own_.resize(count);
      base = own_.data();
    }
    data_ = base + (kLine - reinterpret_cast<uintptr_t>(base) / sizeof(A) % kLine) % kLine;
  }
  A* data() { return data_; }

 private:
  std::vector<A> own_;
  A* data_;
};


// dst[0, n) = to_acc(src[j * stride]), through the instruction set's conversions where the
// elements are contiguous 16-bit floats.
template <class T, class A>
void widen_row(const CpuLoops<A>& isa, const T* src, int64_t stride, A* dst, int64_t n) {
  if constexpr (std::is_same_v<A, float> &&
                (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>)) {
    if (stride == 1) {
      const auto bits = reinterpret_cast<const uint16_t*>(src);
      return std::is_same_v<T, float16> ? isa.widen_f16(bits, dst, n)
                                        : isa.widen_bf16(bits, dst, n);
    }
  }
  // Stride 2 (a strided wgrad's x phases, the strided forward's column phases) as a constant:
  // the compiler vectorizes it (loads and shuffles), where the scalar loop took 5-8% of the
  // 3x3/2 wgrad's samples; 3x3/2 64->128 N8 56^2 float32 wgrad 3.29-3.38 -> 2.94-2.99 ms on a
  // 2-core EPYC VM (alternating processes). Without conversion, in the instruction set's
  // vectors (this file's own code is built for the baseline set: 4-float shuffles).
  if constexpr (std::is_same_v<T, A>) {
    if (stride == 2) return isa.every_other(src, dst, n);
  }
  if (stride == 2) {
    for (int64_t j = 0; j < n; ++j) dst[j] = to_acc(src[2 * j]);
    return;
  }
  for (int64_t j = 0; j < n; ++j) dst[j] = to_acc(src[j * stride]);
}

// dst[p * channels + c] = to_acc(src[p * step + c]) for `count` pixels of `channels` each (one
// widen_row where the pixels are back to back).
template <class T, class A>
void widen_pixels(const CpuLoops<A>& isa, const T* src, int64_t step, int64_t channels,
                  int64_t count, A* dst) {
  if (step == channels) return widen_row(isa, src, 1, dst, count * channels);
  for (int64_t p = 0; p < count; ++p)
    widen_row(isa, src + p * step, 1, dst + p * channels, channels);
}

// dst[0, n) = from_acc<T>(src[0, n)), likewise.
template <class T, class A>
void narrow_row(const CpuLoops<A>& isa, const A* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<A, float> &&
                (std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>)) {
    const auto bits = reinterpret_cast<uint16_t*>(dst);
    return std::is_same_v<T, float16> ? isa.narrow_f16(src, bits, n)
                                      : isa.narrow_bf16(src, bits, n);
  }
  for (int64_t j = 0; j < n; ++j) dst[j] = from_acc<T>(src[j]);
}


// Channels-last pixels into channel planes: out[c * out_pitch + u] = in[u * in_stride + c] for
// c < channels, u < count; whole lanes x lanes tiles transposed in registers (half types
// widened first, lanes pixels by up to 128 channels at a time: one element at a time, the
// staging took a fifth of a channels-last bfloat16 3x3 wgrad), the edges one element at a time.
// Also any [rows][columns] transpose of 4-byte elements carried as float (bfloat16 pairs): the
// copies move bits, they compute nothing.
template <class T, class A>
void transpose_channels(const CpuLoops<A>& isa, const T* in, int64_t in_stride, int64_t count,
                        int64_t channels, A* out, int64_t out_pitch) {
  const int64_t L = isa.lanes;
  const int64_t whole_u = count / L * L, whole_c = channels / L * L;
  if constexpr (std::is_same_v<T, A>) {
    for (int64_t u = 0; u < whole_u; u += L)
      for (int64_t c = 0; c < whole_c; c += L)
        isa.transpose_tile(in + u * in_stride + c, in_stride, out + c * out_pitch + u,
                           out_pitch);
  } else {
    constexpr int64_t kChunk = 128;  // channels widened at a time
    A widened[16 * kChunk];          // lanes (at most 16) pixels x kChunk channels
    for (int64_t u = 0; u < whole_u; u += L)
      for (int64_t c0 = 0; c0 < whole_c; c0 += kChunk) {
        const int64_t n = std::min(kChunk, whole_c - c0);
        for (int64_t v = 0; v < L; ++v)
          widen_row(isa, in + (u + v) * in_stride + c0, 1, widened + v * n, n);
        for (int64_t c = 0; c < n; c += L)
          isa.transpose_tile(widened + c, n, out + (c0 + c) * out_pitch + u, out_pitch);
      }
  }
  // The rest: channels past the whole tiles for every pixel, pixels past them for the others.
  for (int64_t c = 0; c < channels; ++c) {
    A* row = out + c * out_pitch;
    for (int64_t u = c < whole_c ? whole_u : 0; u < count; ++u)
      row[u] = to_acc(in[u * in_stride + c]);
  }
}

int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Source rows [row_begin, row_begin + rows) of a plane (zeros outside the source), each into
// `phases` runs of `phase_len` elements, `phase_pitch` apart: padded column j (source column
// col_begin + j) goes to run j % phases, place j / phases. Row t's runs start at out_row(t).
// Source element (y, x) is plane[y * row_stride + x * col_stride] (col_stride 1: NCHW planes;
// the channel count: a channel of NHWC). Each run is one widen_row at stride phases *
// col_stride (vectorized for 2: isa.every_other).
// The split forward stages its (row phase, column phase) planes through it, runs in place: each
// element written once (it staged each row in a buffer and copied the runs from there, a second
// pass over every staged element). 3x3/2 64->128 N8 56^2 float32 forward on a 2-core EPYC VM,
// alternating processes: NCHW 2.54-2.85 -> 2.46-2.58 ms in a first run of seven, level in a
// second of five (2.46-2.59 against 2.43-2.58, with isa.every_other); NHWC 3.03-3.39 ->
// 2.89-3.07 and 2.89-2.97 -> 2.76-2.87; a 3x3/3 17->24 N3 29^2 0.052-0.061 -> 0.042-0.051. The
// same bits.
// The runs of fill_split_rows: f(t, phase, lo, hi, at) for each row t and phase, rows outer (a
// row's phases read the same source elements), where places [lo, hi) of the run take the source
// elements from plane element `at` on, phases * col_stride apart, and the other places are
// zeros. A phase's bounds are the same for every row inside the source: worked out once per
// call for up to 8 phases (per row, their divisions took 5% of a bfloat16 3x3 forward and 9%
// of a strided one).
template <class F>
void split_runs(int64_t row_stride, int64_t col_stride, int64_t source_rows,
                int64_t source_cols, int64_t row_begin, int64_t rows, int64_t col_begin,
                int64_t phases, int64_t phase_len, F&& f) {
  const int64_t width = phases * phase_len;
  const int64_t inside_begin = std::clamp<int64_t>(-col_begin, 0, width);
  const int64_t inside_end = std::clamp<int64_t>(source_cols - col_begin, inside_begin, width);
  // Places whose column place * phases + phase lies in [inside_begin, inside_end).
  const auto bounds = [&](int64_t phase, int64_t* lo, int64_t* hi) {
    *lo = std::min(ceil_div(std::max<int64_t>(inside_begin - phase, 0), phases), phase_len);
    *hi = std::clamp<int64_t>(ceil_div(std::max<int64_t>(inside_end - phase, 0), phases), *lo,
                              phase_len);
  };
  constexpr int64_t kKept = 8;
  int64_t kept_lo[kKept], kept_hi[kKept];
  for (int64_t phase = 0; phase < std::min(phases, kKept); ++phase)
    bounds(phase, &kept_lo[phase], &kept_hi[phase]);
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t row = row_begin + t;
    const bool inside = row >= 0 && row < source_rows;
    for (int64_t phase = 0; phase < phases; ++phase) {
      int64_t lo = phase_len, hi = phase_len;
      if (inside && phase < kKept) {
        lo = kept_lo[phase], hi = kept_hi[phase];
      } else if (inside) {
        bounds(phase, &lo, &hi);
      }
      f(t, phase, lo, hi, inside ? row * row_stride + (col_begin + lo * phases + phase) * col_stride
                                 : int64_t(0));
    }
  }
}

template <class T, class A, class Out>
void fill_split_rows(const CpuLoops<A>& isa, const T* plane, int64_t row_stride,
                     int64_t col_stride, int64_t source_rows, int64_t source_cols,
                     int64_t row_begin, int64_t rows, int64_t col_begin, int64_t phases,
                     int64_t phase_len, int64_t phase_pitch, Out&& out_row) {
  split_runs(row_stride, col_stride, source_rows, source_cols, row_begin, rows, col_begin,
             phases, phase_len, [&](int64_t t, int64_t phase, int64_t lo, int64_t hi, int64_t at) {
    A* run = out_row(t) + phase * phase_pitch;
    std::fill(run, run + lo, A(0));
    if (hi > lo) widen_row(isa, plane + at, phases * col_stride, run + lo, hi - lo);
    std::fill(run + hi, run + phase_len, A(0));
  });
}

// fill_split_rows for two channels' planes at once (even, and odd or none: zeros), as runs of
// bfloat16 pairs, the low half even's (conv_loops.inc's stencil_flat_pairs).
template <class Out>
void fill_split_pair_rows(const CpuLoops<float>& isa, const bfloat16* even, const bfloat16* odd,
                          int64_t row_stride, int64_t col_stride, int64_t source_rows,
                          int64_t source_cols, int64_t row_begin, int64_t rows, int64_t col_begin,
                          int64_t phases, int64_t phase_len, int64_t phase_pitch, Out&& out_row) {
  const auto bits = [](const bfloat16* p) { return reinterpret_cast<const uint16_t*>(p); };
  split_runs(row_stride, col_stride, source_rows, source_cols, row_begin, rows, col_begin,
             phases, phase_len, [&](int64_t t, int64_t phase, int64_t lo, int64_t hi, int64_t at) {
    uint32_t* run = out_row(t) + phase * phase_pitch;
    std::fill(run, run + lo, 0u);
    if (hi > lo)
      isa.pair_row(bits(even + at), odd ? bits(odd + at) : nullptr, phases * col_stride,
                   run + lo, hi - lo);
    std::fill(run + hi, run + phase_len, 0u);
  });
}

// Copies source rows [row_begin, row_begin + rows) of a plane into `out` as padded rows of
// `phases * phase_len` elements, each row's phases in adjacent runs (fill_split_rows). Everything
// outside the source reads as zero.
template <class T, class A>
void fill_padded_rows(const CpuLoops<A>& isa, const T* plane, int64_t row_stride,
                      int64_t col_stride, int64_t source_rows, int64_t source_cols,
                      int64_t row_begin, int64_t rows, int64_t col_begin, int64_t phases,
                      int64_t phase_len, A* out) {
  const int64_t width = phases * phase_len;
  // Rows above and below the source are zeros.
  const int64_t first = std::clamp<int64_t>(-row_begin, 0, rows);
  const int64_t last = std::clamp<int64_t>(source_rows - row_begin, first, rows);
  std::fill(out, out + first * width, A(0));
  std::fill(out + last * width, out + rows * width, A(0));
  if constexpr (std::is_same_v<T, A>) {
    if (phases == 1 && col_stride == 1) {
      const int64_t inside_begin = std::clamp<int64_t>(-col_begin, 0, width);
      const int64_t inside_end = std::clamp<int64_t>(source_cols - col_begin, inside_begin, width);
      isa.copy_padded_rows(plane + (row_begin + first) * row_stride + col_begin + inside_begin,
                           row_stride, last - first, inside_begin, inside_end - inside_begin,
                           width, out + first * width);
      return;
    }
  }
  fill_split_rows(isa, plane, row_stride, col_stride, source_rows, source_cols,
                  row_begin + first, last - first, col_begin, phases, phase_len, phase_len,
                  [&](int64_t t) { return out + (first + t) * width; });
}

// ---- Forward and backward data: one stencil pass ------------------------------------------------

// The size of the next block of output channels when `remaining` are left: the stencil loops
// take them `wide` at a time, then 4, then 1.
int64_t channel_block(int64_t remaining, int64_t wide) {
  return remaining >= wide ? wide : remaining >= 4 ? 4 : 1;
}

// The live taps of one phase of an axis, and the source offsets they read for output 0.
struct PhaseTaps {
  std::vector<int64_t> tap, offset;
};

std::vector<PhaseTaps> phase_taps(const StencilAxis& axis) {
  std::vector<PhaseTaps> phases(axis.upsample);
  for (int64_t phase = 0; phase < axis.upsample; ++phase)
    for (int64_t t = 0; t < axis.taps; ++t) {
      int64_t offset;
      if (axis.phase_offset(phase, t, &offset)) {
        phases[phase].tap.push_back(t);
        phases[phase].offset.push_back(offset);
      }
    }
  return phases;
}

// out[n, g*Og + o, y, x] = bias + sum_{i, ty, tx} w(g, o, i, ty, tx) * upsampled source[n, g*Ig +
// i] at (rows.position(y, ty), cols.position(x, tx)).
template <class T>
struct StencilPass {
  const T* source;
  const T* weights;
  const T* bias;  // [groups * Og] or nullptr
  T* out;
  int64_t N, groups, in_per_group, out_per_group;
  StencilAxis rows, cols;
  StencilWeights weight_map;
  TensorStrides source_at, out_at;  // (n, channel, row, column) of the source and the output
};

// ---- Geometries whose padding, dilation or stride dwarf the tensors -----------------------------
// The buffered paths size their row buffers by the padded span of the taps and their phase
// tables by the stride, so memory and time would grow with those numbers instead of with the
// tensors (a 4x4 image with padding 3000 and stride 1000 took 2 GB). Where the buffers would be
// far larger than the tensors, the passes below run instead: per output element, the live taps
// only, bounds checked, no buffer; time proportional to outputs x taps x channels.

// a * b and a + b saturated at 2^62 (the estimates below must not overflow).
constexpr int64_t kHuge = int64_t(1) << 62;
int64_t sat_mul(int64_t a, int64_t b) {
  if (a <= 0 || b <= 0) return 0;
  return a > kHuge / b ? kHuge : a * b;
}
int64_t sat_add(int64_t a, int64_t b) { return a > kHuge - b ? kHuge : a + b; }

// Whether buffers of `buffer` elements (and tables of `tables` entries) are out of proportion
// with tensors of `tensors` elements.
bool out_of_proportion(int64_t buffer, int64_t tables, int64_t tensors) {
  const int64_t bound = sat_add(sat_mul(16, tensors), int64_t(1) << 20);
  return buffer > bound || tables > bound;
}

template <class T>
bool stencil_out_of_proportion(const StencilPass<T>& s, int64_t lanes) {
  const StencilAxis &r = s.rows, &c = s.cols;
  // Upper bounds of what run_stencil_pass allocates per thread: the padded rows of a band of 8
  // (phase) rows for every input channel, and the (row phase x column phase) tables.
  const auto span = [](const StencilAxis& a) {
    return sat_add(sat_mul(a.taps - 1, a.dilation) / a.upsample, 2);
  };
  const int64_t rows = sat_add(sat_mul(8, r.stride), span(r));
  const int64_t phase_cols = ceil_div(c.out, c.upsample);
  const int64_t pitch = sat_mul(c.stride, sat_add(sat_add(round_up(phase_cols, 2 * lanes),
                                                          span(c) / c.stride), 1));
  const int64_t buffer = sat_mul(sat_mul(std::max<int64_t>(s.in_per_group, 1), rows), pitch);
  const int64_t tables = sat_mul(r.upsample, c.upsample);
  const int64_t tensors = sat_add(sat_mul(std::max<int64_t>(s.in_per_group, 1),
                                          sat_mul(r.source, c.source)),
                                  sat_mul(std::max<int64_t>(s.out_per_group, 1),
                                          sat_mul(r.out, c.out)));
  return out_of_proportion(buffer, tables, tensors);
}

// The stencil pass element by element (see above): out[n, g*Og + o, y, x] = bias + sum over
// input channels i and live taps of w * source, in a fixed order.
template <class T>
void run_stencil_direct(const StencilPass<T>& s) {
  using A = acc_t<T>;
  const int64_t Ig = s.in_per_group, Og = s.out_per_group;
  const int64_t out_rows = s.rows.out, out_cols = s.cols.out, out_plane = out_rows * out_cols;
  const TensorStrides& src = s.source_at;
  const int64_t work = std::max<int64_t>(1, out_plane * Ig * s.rows.taps * s.cols.taps);
  parallel_for(s.N * s.groups * Og, std::max<int64_t>(1, (int64_t(1) << 16) / work),
               [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / (s.groups * Og), g = item / Og % s.groups, o = item % Og;
      const T* source = s.source + src.at(n, g * Ig, 0, 0);
      T* out = s.out + s.out_at.at(n, g * Og + o, 0, 0);
      const A bias = s.bias ? to_acc(s.bias[g * Og + o]) : A(0);
      for (int64_t y = 0; y < out_rows; ++y)
        for (int64_t x = 0; x < out_cols; ++x) {
          A sum = bias;
          for (int64_t i = 0; i < Ig; ++i)
            for (int64_t ty = 0; ty < s.rows.taps; ++ty) {
              const int64_t sy = s.rows.sample(s.rows.position(y, ty));
              if (sy < 0) continue;
              for (int64_t tx = 0; tx < s.cols.taps; ++tx) {
                const int64_t sx = s.cols.sample(s.cols.position(x, tx));
                if (sx < 0) continue;
                sum += to_acc(s.weights[s.weight_map.offset(g, o, i, ty, tx)]) *
                       to_acc(source[src.at(0, i, sy, sx)]);
              }
            }
          out[s.out_at.at(0, 0, y, x)] = from_acc<T>(sum);
        }
    }
  });
}

// Whether an axis of a pass is pointwise: one tap at unit stride with no padding, so every
// output reads the source position it is at.
inline bool pointwise_axis(const StencilAxis& a) {
  return a.taps == 1 && a.stride == 1 && a.upsample == 1 && a.pad == 0 && a.out == a.source;
}

// The bias in the accumulation type ([groups * out_per_group]), or empty where there is none.
template <class T>
std::vector<acc_t<T>> acc_bias(const StencilPass<T>& s) {
  std::vector<acc_t<T>> bias;
  if (s.bias) {
    bias.resize(s.groups * s.out_per_group);
    for (size_t k = 0; k < bias.size(); ++k) bias[k] = to_acc(s.bias[k]);
  }
  return bias;
}

// Whether the pass is pointwise on planes (both axes pointwise), source and output planes of
// unit column stride with their rows back to back.
template <class T>
bool pointwise_planes(const StencilPass<T>& s) {
  return pointwise_axis(s.rows) && pointwise_axis(s.cols) && s.source_at.d == 1 &&
         s.source_at.c == s.cols.source && s.out_at.d == 1 && s.out_at.c == s.cols.out;
}

// The pointwise pass (pointwise_planes): per (image, group), the output channels over runs of
// whole tiles of positions (conv_loops.inc's pointwise: the flat tiles' sum for one tap, the
// same bits where those ran, 4 or more output channels per group). Planes of the accumulation
// type are read and written in place, but for the last positions of a plane short of a tile,
// which are staged, zero-padded, into a tile of their own. Half types' planes are staged a tile
// at a time, widened, and the results narrowed back (the same conversions as the stencil's
// staging). `packed` and `bias` as run_stencil_pass prepares them.
template <class T, class A>
void run_pointwise(const StencilPass<T>& s, const CpuLoops<A>& isa, const A* packed,
                   int64_t group_weights, const A* bias) {
  constexpr bool kInPlace = std::is_same_v<T, A>;
  constexpr int64_t kTilesPerItem = 4;
  const int64_t Ig = s.in_per_group, Og = s.out_per_group, width = isa.pointwise_width;
  const int64_t positions = s.rows.out * s.cols.out;
  const int64_t full = positions / width, rest = positions - full * width;
  const int64_t runs = ceil_div(full, kTilesPerItem) + (rest > 0 ? 1 : 0);
  const int64_t tap_offset = 0;
  parallel_for(s.N * s.groups * runs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / (s.groups * runs), g = item / runs % s.groups;
      const int64_t first = item % runs * kTilesPerItem;
      const T* source = s.source + s.source_at.at(n, g * Ig, 0, 0);
      T* out = s.out + s.out_at.at(n, g * Og, 0, 0);
      StencilTile<A> t{};
      t.channels = Ig, t.row_taps = t.col_taps = 1, t.tap_offset = &tap_offset;
      t.weights = packed + g * group_weights, t.weight_stride = Ig;
      StencilOutput<A> o{};
      o.channels = Og, o.bias = bias ? bias + g * Og : nullptr;
      if constexpr (kInPlace) {
        if (first < full) {
          t.source = source + first * width, t.channel_pitch = s.source_at.b;
          o.out = out + first * width, o.channel_pitch = s.out_at.b;
          isa.pointwise(t, o, std::min(kTilesPerItem, full - first));
          continue;
        }
      }
      // Staged tiles: this item's whole tiles (half types), or the last positions.
      ThreadScratch<A> staged(0, Ig * width), results(1, Og * width);
      t.source = staged.data(), t.channel_pitch = width;
      o.out = results.data(), o.channel_pitch = width;
      const int64_t begin_tile = std::min(first, full);  // the last item: tile `full`
      const int64_t end_tile = first < full ? std::min(first + kTilesPerItem, full) : full + 1;
      for (int64_t tile = begin_tile; tile < end_tile; ++tile) {
        const int64_t j0 = tile * width, count = tile < full ? width : rest;
        for (int64_t i = 0; i < Ig; ++i) {
          A* row = staged.data() + i * width;
          const T* in = source + i * s.source_at.b + j0;
          if constexpr (kInPlace) {
            isa.copy_padded_rows(in, 0, 1, 0, count, width, row);
          } else {
            widen_row(isa, in, 1, row, count);
            std::fill(row + count, row + width, A(0));
          }
        }
        isa.pointwise(t, o, 1);
        for (int64_t k = 0; k < Og; ++k) {
          const A* r = results.data() + k * width;
          if constexpr (kInPlace) {
            std::copy(r, r + count, out + k * s.out_at.b + j0);
          } else {
            narrow_row(isa, r, out + k * s.out_at.b + j0, count);
          }
        }
      }
    }
  });
}

// Whether the pass is pointwise on channels-last pixels (both axes pointwise), source and
// output channels contiguous within a pixel and pixels evenly spaced across
// rows and images (so pixel p of the whole batch is at p times the pixel stride).
template <class T>
bool pointwise_pixels(const StencilPass<T>& s) {
  const auto even = [&](const TensorStrides& t) {
    return t.b == 1 && t.c == s.cols.out * t.d && t.a == s.rows.out * t.c;
  };
  return pointwise_axis(s.rows) && pointwise_axis(s.cols) && even(s.source_at) &&
         even(s.out_at);
}

// The channels-last pointwise pass (pointwise_pixels): per group, a GEMM of the batch's pixels
// by the group's weights (conv_loops.inc's pointwise_pixels: register blocks of pixels x
// filters, weights packed per block of filters). Each output sums the bias, then its channels
// in order, in the accumulation type, as the flat tiles do (the same bits as the stencil pass).
// The accumulation type's pixels are read and written in place; half types' are widened per
// item into a scratch run of pixels, and the results narrowed back. Items are runs of pixels of
// one group, each computed the same way on any thread.
template <class T>
void run_pointwise_pixels(const StencilPass<T>& s) {
  using A = acc_t<T>;
  constexpr bool kInPlace = std::is_same_v<T, A>;
  constexpr int64_t kPixelsPerItem = 48;
  const CpuLoops<A>& isa = loops<A>();
  const int64_t Ig = s.in_per_group, Og = s.out_per_group, kb = isa.pixel_filter_block;
  const int64_t blocks = ceil_div(Og, kb), group_weights = blocks * Ig * kb;
  std::vector<A> packed(s.groups * group_weights, A(0));
  for (int64_t g = 0; g < s.groups; ++g)
    for (int64_t i = 0; i < Ig; ++i)
      for (int64_t o = 0; o < Og; ++o)
        packed[g * group_weights + (o / kb * Ig + i) * kb + o % kb] =
            to_acc(s.weights[s.weight_map.offset(g, o, i, 0, 0)]);
  const std::vector<A> bias = acc_bias(s);
  const int64_t pixels = s.N * s.rows.out * s.cols.out;
  const int64_t runs = ceil_div(pixels, kPixelsPerItem);
  const int64_t in_step = s.source_at.d, out_step = s.out_at.d;
  parallel_for(s.groups * runs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / runs, p0 = item % runs * kPixelsPerItem;
      const int64_t count = std::min(kPixelsPerItem, pixels - p0);
      const T* x = s.source + p0 * in_step + g * Ig;
      T* out = s.out + p0 * out_step + g * Og;
      PixelBlock<A> b{};
      b.channels = Ig, b.filters = Og, b.pixels = count;
      b.weights = packed.data() + g * group_weights;
      b.bias = s.bias ? bias.data() + g * Og : nullptr;
      if constexpr (kInPlace) {
        b.x = x, b.x_step = in_step, b.out = out, b.out_step = out_step;
        isa.pointwise_pixels(b);
      } else {
        ThreadScratch<A> staged(0, count * Ig), results(1, count * Og);
        widen_pixels(isa, x, in_step, Ig, count, staged.data());
        b.x = staged.data(), b.x_step = Ig, b.out = results.data(), b.out_step = Og;
        isa.pointwise_pixels(b);
        if (out_step == Og) {
          narrow_row(isa, results.data(), out, count * Og);
        } else {
          for (int64_t p = 0; p < count; ++p)
            narrow_row(isa, results.data() + p * Og, out + p * out_step, Og);
        }
      }
    }
  });
}

template <class T>
void run_stencil_pass(const StencilPass<T>& s) {
  using A = acc_t<T>;
  constexpr int64_t kSlidingRows = 8;  // conv_loops.inc's largest row block: buffers hold whole
                                       // blocks
  const CpuLoops<A>& isa = loops<A>();
  if (stencil_out_of_proportion(s, isa.lanes)) return run_stencil_direct(s);
  if (pointwise_pixels(s)) return run_pointwise_pixels(s);
  const int64_t Ig = s.in_per_group, Og = s.out_per_group;
  const std::vector<PhaseTaps> row_phases = phase_taps(s.rows), col_phases = phase_taps(s.cols);
  const int64_t up_y = s.rows.upsample, up_x = s.cols.upsample;

  // Every tap is live in exactly one phase, so these bounds exist.
  int64_t row_min = INT64_MAX, row_max = INT64_MIN, col_min = INT64_MAX, col_max = INT64_MIN;
  int64_t phase_rows = 0, phase_cols = 0;
  for (int64_t py = 0; py < up_y; ++py) {
    for (int64_t off : row_phases[py].offset) {
      row_min = std::min(row_min, off);
      row_max = std::max(row_max, off);
    }
    phase_rows = std::max(phase_rows, s.rows.phase_outputs(py));
  }
  for (int64_t px = 0; px < up_x; ++px) {
    for (int64_t off : col_phases[px].offset) {
      col_min = std::min(col_min, off);
      col_max = std::max(col_max, off);
    }
    phase_cols = std::max(phase_cols, s.cols.phase_outputs(px));
  }

  // Buffer columns: source column oo * stride + offset, split into `stride` phases.
  const int64_t cs = s.cols.stride, rs = s.rows.stride;
  // Dense problems run on flat tiles (conv_loops.inc's stencil_flat), whose rows need no
  // rounding up: only the taps' span. Where output rows read consecutive buffer rows (stride 1:
  // the forward's and every dgrad phase), the buffer is the one above; a strided forward
  // ("split") splits its rows into stride phases as well, each (row phase, column phase) its own
  // plane of rows of phase_len, so that output (row, column) reads at every tap the element
  // row * phase_len + column + the tap's offset.
  const bool split = up_x == 1 && up_y == 1 && (cs > 1 || rs > 1) && Og >= 4;
  const bool flat = (cs == 1 && rs == 1 && Og >= 4) || split;
  // Unit-stride flat rows share their zero columns: a row's last `shared` columns (zeros right
  // of the source) are dropped, so its taps read past it into the next row's first ones (zeros
  // left of the source; after the last row of the last channel, zeros written per item). Fewer
  // flat positions per row, the same sums: 3x3 64->64 N8 28^2 float32 (pitch 29, not 30)
  // forward 1.09-1.11 -> 1.04-1.05 ms, dgrad 0.93-0.94x, channels-last forward 0.94-0.96x on a
  // 2-core EPYC VM (alternating processes), the same bits.
  int64_t shared = 0;
  if (flat && !split && up_x == 1) {
    const int64_t left = std::max<int64_t>(0, -col_min);
    const int64_t right = std::max<int64_t>(0, phase_cols - 1 + col_max - (s.cols.source - 1));
    shared = std::min(left, right);
  }
  const int64_t phase_len = flat ? phase_cols + (col_max - col_min) / cs - shared
                                 : round_up(phase_cols, 2 * isa.lanes) + (col_max - col_min) / cs + 1;
  const int64_t row_pitch = cs * phase_len;
  // Flat tiles read up to this many elements past the last position of a plane.
  const int64_t slack = flat ? 4 * 64 : 0;
  // Source channels per sweep of the flat tiles: a tile's source rows (row taps + 1 rows of a
  // tile and the taps' span, per channel) in about 16 KiB.
  const int64_t channel_chunk = std::max<int64_t>(
      1, (int64_t(16) << 10) /
             ((s.rows.taps + 1) * (3 * isa.lanes + (col_max - col_min) + 16) * int64_t(sizeof(A))));
  std::vector<std::vector<int64_t>> col_offsets(up_x), row_offsets(up_y);
  for (int64_t px = 0; px < up_x; ++px)
    for (int64_t off : col_phases[px].offset)
      col_offsets[px].push_back(((off - col_min) % cs) * phase_len + (off - col_min) / cs);
  std::vector<char> sliding(up_y);
  for (int64_t py = 0; py < up_y; ++py) {
    const std::vector<int64_t>& off = row_phases[py].offset;
    bool consecutive = rs == 1;
    for (size_t j = 0; j < off.size(); ++j) {
      row_offsets[py].push_back(off[j] - row_min);
      if (j > 0 && off[j] != off[j - 1] + 1) consecutive = false;
    }
    sliding[py] = consecutive;
  }
  std::vector<std::vector<int64_t>> tap_offsets(up_y * up_x);
  for (int64_t py = 0; py < up_y; ++py)
    for (int64_t px = 0; px < up_x; ++px)
      for (int64_t r : row_offsets[py])
        for (int64_t c : col_offsets[px]) tap_offsets[py * up_x + px].push_back(r * row_pitch + c);

  // The weights of each (group, row phase, column phase), per block of output channels:
  // [i][live row tap][live col tap][output channel of the block].
  std::vector<int64_t> phase_base(up_y * up_x + 1, 0);
  for (int64_t py = 0; py < up_y; ++py)
    for (int64_t px = 0; px < up_x; ++px)
      phase_base[py * up_x + px + 1] = phase_base[py * up_x + px] +
          Og * Ig * int64_t(row_phases[py].tap.size() * col_phases[px].tap.size());
  const int64_t group_weights = phase_base.back();
  std::vector<A> packed(s.groups * group_weights);
  // Packed per (group, row phase, column phase, block of output channels), in parallel: a
  // block of `block` channels starting at o0 begins o0 * Ig * taps into its phase.
  std::vector<int64_t> block_start;
  for (int64_t o0 = 0; o0 < Og; o0 += channel_block(Og - o0, isa.channel_block))
    block_start.push_back(o0);
  const int64_t blocks = int64_t(block_start.size()), phases = up_y * up_x;
  parallel_for(s.groups * phases * blocks,
               std::max<int64_t>(1, 4096 / std::max<int64_t>(group_weights / std::max<int64_t>(
                                                                 phases * blocks, 1), 1)),
               [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / (phases * blocks), phase = item / blocks % phases;
      const int64_t py = phase / up_x, px = phase % up_x, o0 = block_start[item % blocks];
      const int64_t block = channel_block(Og - o0, isa.channel_block);
      const std::vector<int64_t>& ty = row_phases[py].tap;
      const std::vector<int64_t>& tx = col_phases[px].tap;
      A* w = packed.data() + g * group_weights + phase_base[phase] +
             o0 * Ig * int64_t(ty.size() * tx.size());
      for (int64_t i = 0; i < Ig; ++i)
        for (int64_t r : ty)
          for (int64_t c : tx)
            for (int64_t o = o0; o < o0 + block; ++o)
              *w++ = to_acc(s.weights[s.weight_map.offset(g, o, i, r, c)]);
    }
  });
  const std::vector<A> bias = acc_bias(s);
  if (pointwise_planes(s)) {
    run_pointwise(s, isa, packed.data(), group_weights, s.bias ? bias.data() : nullptr);
    return;
  }
  // bfloat16 flat tiles on AVX512_BF16 (conv_loops.inc's stencil_flat_pairs): the source
  // staged as planes of channel pairs (fill_split_pair_rows; an odd channel count pairs the
  // last with zeros), the weights likewise, [block][pair][tap][channel of the block], from the
  // packed float32 ones (exact: they were bfloat16). The decision depends on neither the layout
  // nor the threads.
  const bool pairs = std::is_same_v<T, bfloat16> && flat && isa.stencil_flat_pairs != nullptr &&
                     isa.pair_row != nullptr;
  const int64_t Ip = ceil_div(Ig, 2);
  std::vector<int64_t> pair_base(up_y * up_x + 1, 0);
  std::vector<uint32_t> packed_pairs;
  if (pairs) {
    for (int64_t phase = 0; phase < up_y * up_x; ++phase)
      pair_base[phase + 1] = pair_base[phase] + (phase_base[phase + 1] - phase_base[phase]) /
                                                    std::max<int64_t>(Ig, 1) * Ip;
    packed_pairs.resize(s.groups * pair_base.back());
    const auto bits = [](A v) {
      uint32_t u;
      std::memcpy(&u, &v, 4);
      return u;
    };
    // Per (group, phase, block of output channels), in parallel, as the float32 packing above.
    parallel_for(s.groups * phases * blocks, 16, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t g = item / (phases * blocks), phase = item / blocks % phases;
        const int64_t o0 = block_start[item % blocks];
        const int64_t block = channel_block(Og - o0, isa.channel_block);
        const int64_t taps =
            (phase_base[phase + 1] - phase_base[phase]) / std::max<int64_t>(Og * Ig, 1);
        const A* from = packed.data() + g * group_weights + phase_base[phase] + o0 * Ig * taps;
        uint32_t* to =
            packed_pairs.data() + g * pair_base.back() + pair_base[phase] + o0 * Ip * taps;
        for (int64_t ip = 0; ip < Ip; ++ip)
          for (int64_t tap = 0; tap < taps; ++tap)
            for (int64_t kk = 0; kk < block; ++kk) {
              const uint32_t even = bits(from[((2 * ip) * taps + tap) * block + kk]) >> 16;
              const uint32_t odd =
                  2 * ip + 1 < Ig ? bits(from[((2 * ip + 1) * taps + tap) * block + kk]) & 0xffff0000u
                                  : 0u;
              *to++ = even | odd;
            }
      }
    });
  }

  // Bands of phase rows: about 512 KiB of source each (1 MiB for flat tiles), and enough of
  // them for the threads. A band's flat positions end anywhere in a tile, so fewer, larger bands
  // compute fewer dropped positions: 3x3/2 64->128 N8 56^2 (source rows of pitch 58, 64
  // channels: 0.97 MB for all 28 output rows) runs one band instead of two of 14 rows. With the
  // narrowed last tile (conv_loops.inc's stencil_flat) its float32 forward went from 2.31-2.56 to
  // 2.21-2.41 ms on a 2-core EPYC VM (alternating processes, the same bits).
  const auto band_source_rows = [&](int64_t band) {
    return (round_up(band, kSlidingRows) - 1) * rs + row_max - row_min + 1;
  };
  int64_t band = std::max<int64_t>(phase_rows, 1);
  const int64_t budget = (int64_t(1) << (flat ? 20 : 19)) / int64_t(sizeof(A));
  while (band > kSlidingRows && Ig * band_source_rows(band) * row_pitch > budget)
    band = ceil_div(band, 2);
  // (flat tiles waste less of the rows in larger bands: fewer items suffice for them).
  while (band > kSlidingRows && s.N * s.groups * ceil_div(phase_rows, band) < (flat ? 8 : 16))
    band = ceil_div(band, 2);
  const int64_t bands = ceil_div(phase_rows, band);
  // Split buffers: per channel, rs x cs planes of split_rows rows of phase_len.
  const int64_t split_rows = ceil_div(band_source_rows(band), rs);
  const int64_t split_plane = rs * cs * split_rows * phase_len;
  if (split) {
    tap_offsets[0].clear();
    for (int64_t r : row_offsets[0])
      for (int64_t c : col_offsets[0])  // c = column phase * phase_len + column in the phase
        tap_offsets[0].push_back((((r % rs) * cs + c / phase_len) * split_rows + r / rs) *
                                     phase_len + c % phase_len);
  }
  const int64_t out_rows = s.rows.out, out_cols = s.cols.out;
  const int64_t out_plane = out_rows * out_cols;
  // Half types compute in A, then convert; so does channels-last output, whose scattered
  // stores the copy out makes once per element.
  const TensorStrides &src = s.source_at, &dst = s.out_at;
  const bool staged_out = !std::is_same_v<T, A> || dst.d != 1;

  // Where buffer row t starts in a channel's buffer: split, row phase t % rs, row t / rs of it
  // (column phases adjacent); else rows at row_pitch.
  std::vector<int64_t> row_at(band_source_rows(band));
  for (int64_t t = 0; t < int64_t(row_at.size()); ++t)
    row_at[t] = split ? ((t % rs) * cs * split_rows + t / rs) * phase_len : t * row_pitch;
  const int64_t items = s.N * s.groups * bands;
  const int64_t work = std::max<int64_t>(1, Og * Ig * band * out_cols * s.rows.taps * s.cols.taps);
  // Items go to whichever thread is free: each is computed the same way on any thread.
  parallel_for_dynamic(items, std::max<int64_t>(1, (int64_t(1) << 16) / work),
                       [&](int64_t begin, int64_t end) {
    const int64_t buffer_rows = band_source_rows(band);
    // Every element read is written first, except what flat tiles and partial blocks read past
    // the last rows, which only feeds outputs that are dropped.
    ThreadScratch<A> buffer(0, pairs ? 0 : std::max<int64_t>(Ig, 1) *
                                   (split ? split_plane : buffer_rows * row_pitch) + slack + shared);
    ThreadScratch<A> staged(1, staged_out ? Og * band * up_y * out_cols : 0);
    ThreadScratch<A> partial(2, flat ? Og * 64 : 0);  // a flat tile's sums, [Og][tile]
    ThreadScratch<A> pixel_major(4, staged_out && dst.d != 1 ? 64 * Og : 0);  // (below)
    ThreadScratch<A> paired(3, pairs ? Ip * (split ? split_plane : buffer_rows * row_pitch) +
                                           slack + shared
                                     : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / (s.groups * bands);
      const int64_t g = item / bands % s.groups;
      const int64_t b0 = item % bands * band;
      const int64_t b1 = std::min(b0 + band, phase_rows);
      const int64_t rows = band_source_rows(b1 - b0);
      // The next channel's band rows of an NCHW plane (one contiguous run from source row r0)
      // are prefetched while this one is staged: a strided forward reads a source four times
      // its output, whose loads stalled the staging (15% of the 3x3/2 forward's samples). 3x3/2
      // 64->128 N8 56^2 float32 on a 2-core EPYC VM: 3.25-3.35 -> 2.89-2.95 ms (alternating
      // processes); the unit-stride 3x3, whose source stays in cache, level.
      const int64_t r0 = std::clamp<int64_t>(b0 * rs + row_min, 0, s.rows.source);
      const int64_t r1 = std::clamp<int64_t>(b0 * rs + row_min + rows, r0, s.rows.source);
      const int64_t prefetch_bytes =
          src.d == 1 && r1 > r0 ? ((r1 - r0 - 1) * src.c + s.cols.source) * int64_t(sizeof(T)) : 0;
      uint32_t* pair_planes = reinterpret_cast<uint32_t*>(paired.data());
      if constexpr (std::is_same_v<T, bfloat16>) {
        if (pairs) {
          const int64_t plane = split ? split_plane : rows * row_pitch;
          // Channels last (a pixel's channels adjacent, an even pixel stride, the group's first
          // channel at an even element: pairs on 4-byte boundaries): 16 pairs at a time, tiles
          // of 16 places x 16 pairs transposed in registers (a pair is one 4-byte element),
          // where pair_row reads one 4-byte element per pixel and pair.
          int64_t transposed = 0;
          if (src.b == 1 && src.d % 2 == 0 && src.at(n, g * Ig, 0, 0) % 2 == 0) {
            const int64_t L = isa.lanes, step = cs * src.d / 2;  // 4-byte elements per place
            const int64_t phase_pitch = split ? split_rows * phase_len : phase_len;
            transposed = Ig / 2 / L * L;
            for (int64_t ip0 = 0; ip0 < transposed; ip0 += L) {
              const T* base = s.source + src.at(n, g * Ig + 2 * ip0, 0, 0);
              split_runs(src.c, src.d, s.rows.source, s.cols.source, b0 * rs + row_min, rows,
                         col_min, cs, phase_len,
                         [&](int64_t t, int64_t phase, int64_t lo, int64_t hi, int64_t at) {
                uint32_t* run = pair_planes + ip0 * plane + row_at[t] + phase * phase_pitch;
                for (int64_t j = 0; j < L; ++j) {
                  std::fill(run + j * plane, run + j * plane + lo, 0u);
                  std::fill(run + j * plane + hi, run + j * plane + phase_len, 0u);
                }
                transpose_channels(isa, reinterpret_cast<const A*>(base + at), step, hi - lo, L,
                                   reinterpret_cast<A*>(run + lo), plane);
              });
            }
          }
          for (int64_t ip = transposed; ip < Ip; ++ip) {
            const T* even = s.source + src.at(n, g * Ig + 2 * ip, 0, 0);
            const T* odd = 2 * ip + 1 < Ig ? s.source + src.at(n, g * Ig + 2 * ip + 1, 0, 0)
                                           : nullptr;
            // Rows as fill_padded_rows' (one phase) or the split forward's (below).
            fill_split_pair_rows(isa, even, odd, src.c, src.d, s.rows.source, s.cols.source,
                                 b0 * rs + row_min, rows, col_min, cs, phase_len,
                                 split ? split_rows * phase_len : phase_len,
                                 [&](int64_t t) { return pair_planes + ip * plane + row_at[t]; });
          }
          std::fill_n(pair_planes + Ip * plane, shared, 0u);  // (shared above)
        }
      }
      for (int64_t i = 0; i < Ig && !pairs; ++i) {
        const T* plane = s.source + src.at(n, g * Ig + i, 0, 0);
        if (i + 1 < Ig) {
          const char* next =
              reinterpret_cast<const char*>(s.source + src.at(n, g * Ig + i + 1, r0, 0));
          for (int64_t b = 0; b < prefetch_bytes; b += 64) __builtin_prefetch(next + b);
        }
        if (!split) {
          fill_padded_rows(isa, plane, src.c, src.d, s.rows.source, s.cols.source,
                           b0 * rs + row_min, rows, col_min, cs, phase_len,
                           buffer.data() + i * rows * row_pitch);
          continue;
        }
        fill_split_rows(isa, plane, src.c, src.d, s.rows.source, s.cols.source,
                        b0 * rs + row_min, rows, col_min, cs, phase_len, split_rows * phase_len,
                        [&](int64_t t) { return buffer.data() + i * split_plane + row_at[t]; });
      }
      if (!pairs) std::fill_n(buffer.data() + Ig * rows * row_pitch, shared, A(0));  // (shared above)
      T* out_group = s.out + dst.at(n, g * Og, 0, 0);
      for (int64_t py = 0; py < up_y; ++py) {
        const int64_t rows_in_band = std::min(b1, s.rows.phase_outputs(py)) - b0;
        if (rows_in_band <= 0) continue;
        for (int64_t px = 0; px < up_x; ++px) {
          const int64_t cols = s.cols.phase_outputs(px);
          if (cols <= 0) continue;
          StencilTile<A> tile;
          tile.source = buffer.data();
          tile.channels = Ig;
          tile.channel_pitch = split ? split_plane : rows * row_pitch;
          tile.row_pitch = split ? phase_len : row_pitch;
          tile.row_step = rs;
          tile.row_taps = int(row_offsets[py].size());
          tile.col_taps = int(col_offsets[px].size());
          tile.row_offset = row_offsets[py].data();
          tile.col_offset = col_offsets[px].data();
          tile.sliding = sliding[py];
          tile.tap_offset = tap_offsets[py * up_x + px].data();
          tile.channel_chunk = channel_chunk;
          tile.weights = packed.data() + g * group_weights + phase_base[py * up_x + px];
          tile.weight_stride = Ig * tile.row_taps * tile.col_taps;
          StencilOutput<A> out;
          if (staged_out) {
            out.out = staged.data() + py * out_cols + px;
            out.channel_pitch = band * up_y * out_cols;
          } else if constexpr (std::is_same_v<T, A>) {
            out.out = out_group + (b0 * up_y + py) * out_cols + px;
            out.channel_pitch = out_plane;
          }
          out.row_pitch = up_y * out_cols;
          out.col_step = up_x;
          out.channels = Og;
          out.rows = rows_in_band;
          out.cols = cols;
          out.bias = s.bias ? bias.data() + g * Og : nullptr;
          if (pairs) {
            tile.source = reinterpret_cast<const A*>(pair_planes);
            tile.channels = Ip;
            tile.weights = reinterpret_cast<const A*>(packed_pairs.data() + g * pair_base.back() +
                                                      pair_base[py * up_x + px]);
            tile.weight_stride = Ip * tile.row_taps * tile.col_taps;
            isa.stencil_flat_pairs(tile, out, partial.data());
          } else if (flat) {
            isa.stencil_flat(tile, out, partial.data());
          } else {
            isa.stencil_phase(tile, out);
          }
        }
      }
      if (staged_out) {
        const int64_t first = b0 * up_y, last = std::min(b1 * up_y, out_rows);
        if (dst.d == 1 && dst.c == out_cols) {  // a channel's rows back to back: one run
          for (int64_t o = 0; o < Og; ++o)
            narrow_row(isa, staged.data() + o * band * up_y * out_cols,
                       out_group + o * dst.b + first * dst.c, (last - first) * out_cols);
        } else if (dst.d == 1) {
          for (int64_t o = 0; o < Og; ++o)
            for (int64_t y = first; y < last; ++y) {
              const A* in = staged.data() + (o * band * up_y + (y - first)) * out_cols;
              T* row = out_group + o * dst.b + y * dst.c;
              narrow_row(isa, in, row, out_cols);
            }
        } else {  // channels last: channels innermost in the output
          // Per run of up to 64 pixels of a row, their channels transposed to pixel-major in
          // registers (16 x 16 tiles), then each pixel's channels converted as one run (an
          // element at a time, this took a tenth of a bfloat16 3x3 forward).
          const int64_t channel_pitch = band * up_y * out_cols;
          A* by_pixel = pixel_major.data();
          for (int64_t y = first; y < last; ++y)
            for (int64_t x0 = 0; x0 < out_cols; x0 += 64) {
              const int64_t count = std::min<int64_t>(64, out_cols - x0);
              const A* in = staged.data() + (y - first) * out_cols + x0;
              transpose_channels(isa, in, channel_pitch, Og, count, by_pixel, Og);
              for (int64_t u = 0; u < count; ++u) {
                T* pixel = out_group + y * dst.c + (x0 + u) * dst.d;
                if (dst.b == 1) {
                  narrow_row(isa, by_pixel + u * Og, pixel, Og);
                } else {
                  for (int64_t o = 0; o < Og; ++o) pixel[o * dst.b] = from_acc<T>(by_pixel[u * Og + o]);
                }
              }
            }
        }
      }
    }
  });
}

// ---- Backward weight ----------------------------------------------------------------------------

// One stride phase (a, b) of a block of `channels` input planes, staged for the weight gradient:
// channel c's phase at out + c * out_channel_pitch, `rows` rows at `pitch`, element (t, u) =
// x[c][t * stride_h + a - pad_top][u * stride_w + b - pad_left] (zero outside x), then zeros up
// to `size`. `planes` is the block's first channel at (0, 0); channels-last blocks (unit channel
// stride) go through transpose_channels, a row of pixels at a time, the others plane by plane.
template <class T, class A>
void fill_phase(const CpuLoops<A>& isa, const T* planes, const TensorStrides& xs,
                bool channels_last, int64_t channels, const ConvProblem& p, int64_t a, int64_t b,
                int64_t rows, int64_t pitch, int64_t size, A* out, int64_t out_channel_pitch) {
  // The rows and columns of the phase that fall inside x: [t0, t1) and [u0, u1).
  const int64_t t0 = std::clamp<int64_t>(ceil_div(p.pad_top - a, p.stride_h), 0, rows);
  const int64_t t1 = std::clamp<int64_t>(ceil_div(p.H + p.pad_top - a, p.stride_h), t0, rows);
  const int64_t u0 = std::clamp<int64_t>(ceil_div(p.pad_left - b, p.stride_w), 0, pitch);
  const int64_t u1 = std::clamp<int64_t>(ceil_div(p.W + p.pad_left - b, p.stride_w), u0, pitch);
  const bool inside = t1 > t0 && u1 > u0;
  // The phase's rows and columns as a plane of their own (every stride-th row and column).
  const auto first = [&](int64_t c) {
    return planes + c * xs.b + (t0 * p.stride_h + a - p.pad_top) * xs.c +
           (u0 * p.stride_w + b - p.pad_left) * xs.d;
  };
  for (int64_t c = 0; c < channels; ++c) {
    A* phase = out + c * out_channel_pitch;
    if (!inside) {
      std::fill(phase, phase + size, A(0));
      continue;
    }
    if (!channels_last) {
      fill_padded_rows(isa, first(c), p.stride_h * xs.c, p.stride_w * xs.d, t1 - t0, u1 - u0,
                       -t0, rows, -u0, 1, pitch, phase);
    } else {  // zeros around the rows and columns transposed below
      std::fill(phase, phase + t0 * pitch, A(0));
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(phase + t * pitch, phase + t * pitch + u0, A(0));
        std::fill(phase + t * pitch + u1, phase + (t + 1) * pitch, A(0));
      }
      std::fill(phase + t1 * pitch, phase + rows * pitch, A(0));
    }
    std::fill(phase + rows * pitch, phase + size, A(0));
  }
  if (channels_last && inside)
    for (int64_t t = t0; t < t1; ++t)
      transpose_channels(isa, first(0) + (t - t0) * p.stride_h * xs.c, p.stride_w * xs.d, u1 - u0,
                         channels, out + t * pitch + u0, out_channel_pitch);
}

// The weight gradient element by element (see run_stencil_direct): dw[g*Kg + k, c, r, s] = sum
// over images and output positions of dy * x at the tap, in a fixed order.
template <class T>
void run_weight_gradient_direct(const T* dy, const T* x, T* dw, const ConvProblem& p) {
  using A = acc_t<T>;
  const int64_t Kg = p.filters_per_group(), Cg = p.channels_per_group();
  const TensorStrides xs = p.input_strides(), ys = p.output_strides(), ws = p.filter_strides();
  const int64_t work = std::max<int64_t>(1, p.N * p.P * p.Q);
  parallel_for(p.K * Cg * p.R * p.S, std::max<int64_t>(1, (int64_t(1) << 16) / work),
               [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item % p.S, r = item / p.S % p.R, c = item / (p.R * p.S) % Cg;
      const int64_t k = item / (Cg * p.R * p.S), g = k / Kg;
      A sum = A(0);
      for (int64_t n = 0; n < p.N; ++n) {
        const T* dy_plane = dy + ys.at(n, k, 0, 0);
        const T* x_plane = x + xs.at(n, g * Cg + c, 0, 0);
        for (int64_t y = 0; y < p.P; ++y) {
          const int64_t iy = y * p.stride_h + r * p.dilation_h - p.pad_top;
          if (iy < 0 || iy >= p.H) continue;
          for (int64_t q = 0; q < p.Q; ++q) {
            const int64_t ix = q * p.stride_w + s * p.dilation_w - p.pad_left;
            if (ix < 0 || ix >= p.W) continue;
            sum += to_acc(dy_plane[ys.at(0, 0, y, q)]) * to_acc(x_plane[xs.at(0, 0, iy, ix)]);
          }
        }
      }
      dw[ws.at(k, c, r, s)] = from_acc<T>(sum);
    }
  });
}

// The 1x1 weight gradient at unit stride without padding (every output pixel reads the input
// pixel it is at), channels last in every dtype and NCHW in float32 / float64: per group a GEMM
// of x's pixels by dy's, dw[c][k] = sum over pixels of x[p][c] * dy[p][k]. Channels last, both
// are read in place in float32 / float64, and in half types widened to float a chunk of pixels
// at a time. NCHW, x is read in place (its channels a plane apart, broadcast one element at a
// time) and a chunk of dy's pixels (never across an image) is transposed to pixel-major rows,
// where pixel_weight_gradient says (docs/performance.md has the figures). The batch's pixels go
// in slices of at most kSlicePixels (a count the shape fixes), each slice's sums in pixel order
// in a partial of the accumulation type of its own, then the slices are added in order: the
// thread count never changes a result, and both layouts give the same bits.
constexpr int64_t kPixelChunk = 128;  // pixels staged (or read) in cache at a time

template <class T>
bool pixel_weight_gradient(const ConvProblem& p) {
  using A = acc_t<T>;
  if (p.R != 1 || p.S != 1 || p.stride_h != 1 || p.stride_w != 1 || p.pad_top != 0 ||
      p.pad_left != 0 || p.P != p.H || p.Q != p.W)
    return false;
  if (p.layout == ConvLayout::kNHWC) return true;
  // NCHW where it was measured faster than the planes' dot products: whole register blocks of
  // filters (a group of 32 filters, half a block, took 4x the time: each pixel's filters are
  // copied to a zero-padded row) and a chunk of x no larger than 256 KiB (read once per block of
  // filters; 1024 channels at 14^2 took 1.07-1.13x the time).
  return std::is_same_v<T, A> && p.filters_per_group() % loops<A>().pixel_filter_block == 0 &&
         p.channels_per_group() * kPixelChunk * int64_t(sizeof(A)) <= (int64_t(256) << 10);
}

template <class T>
void run_weight_gradient_pixels(const T* dy, const T* x, T* dw, const ConvProblem& p) {
  using A = acc_t<T>;
  constexpr bool kInPlace = std::is_same_v<T, A>;
  constexpr int64_t kSlicePixels = 2048;
  const CpuLoops<A>& isa = loops<A>();
  const bool nchw = p.layout == ConvLayout::kNCHW;  // float32 / float64 only
  const int64_t Og = p.filters_per_group(), Ig = p.channels_per_group(), G = p.groups;
  const int64_t plane = p.H * p.W, pixels = p.N * plane;
  const int64_t slices = std::max<int64_t>(1, ceil_div(pixels, kSlicePixels));
  const int64_t per_slice = ceil_div(std::max<int64_t>(pixels, 1), slices);
  const int64_t pitch = round_up(std::max<int64_t>(Og, 1), isa.pixel_filter_block);
  const int64_t slice_elements = Ig * pitch;
  std::vector<A> partial(G * slices * slice_elements);
  parallel_for(G * slices, 1, [&](int64_t begin, int64_t end) {
    // Half types: a chunk's pixels of the group, widened; NCHW: a chunk of dy's pixels.
    ThreadScratch<A> x_chunk(0, kInPlace ? 0 : kPixelChunk * Ig);
    ThreadScratch<A> dy_chunk(1, kInPlace && !nchw ? 0 : kPixelChunk * Og);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / slices, s = item % slices;
      const int64_t p0 = std::min(pixels, s * per_slice), p1 = std::min(pixels, p0 + per_slice);
      PixelGradient<A> b{};
      b.channels = Ig, b.filters = Og;
      b.partial = partial.data() + item * slice_elements, b.partial_pitch = pitch;
      b.first = true;  // (an empty slice leaves its partial as constructed: zeros)
      for (int64_t c0 = p0; c0 < p1; c0 += b.pixels) {  // a chunk of pixels stays in cache
        b.pixels = std::min(kPixelChunk, p1 - c0);
        b.x_channel_step = 1;
        const T* xs = x + c0 * p.C + g * Ig;
        const T* dys = dy + c0 * p.K + g * Og;
        if constexpr (kInPlace) {
          if (nchw) {
            const int64_t n = c0 / plane, i = c0 % plane;
            b.pixels = std::min(b.pixels, plane - i);  // one image's pixels
            b.x = x + (n * p.C + g * Ig) * plane + i, b.x_step = 1, b.x_channel_step = plane;
            transpose_channels(isa, dy + (n * p.K + g * Og) * plane + i, plane, Og, b.pixels,
                               dy_chunk.data(), Og);
            b.dy = dy_chunk.data(), b.dy_step = Og;
          } else {
            b.x = xs, b.x_step = p.C, b.dy = dys, b.dy_step = p.K;
          }
        } else {  // half types: channels last only (pixel_weight_gradient)
          widen_pixels(isa, xs, p.C, Ig, b.pixels, x_chunk.data());
          widen_pixels(isa, dys, p.K, Og, b.pixels, dy_chunk.data());
          b.x = x_chunk.data(), b.x_step = Ig, b.dy = dy_chunk.data(), b.dy_step = Og;
        }
        isa.pixel_gradient(b);
        b.first = false;
      }
    }
  });
  // dw: HWIO [1][1][Ig][K], dw[c * K + g * Og + o], or KCRS [K][Ig][1][1], dw[(g * Og + o) * Ig
  // + c]; the slices added in order.
  parallel_for(G * Ig, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t g = row / Ig, c = row % Ig;
      for (int64_t o = 0; o < Og; ++o) {
        A sum = partial[(g * slices) * slice_elements + c * pitch + o];
        for (int64_t s = 1; s < slices; ++s)
          sum += partial[(g * slices + s) * slice_elements + c * pitch + o];
        dw[nchw ? (g * Og + o) * Ig + c : c * p.K + g * Og + o] = from_acc<T>(sum);
      }
    }
  });
}

template <class T>
void run_weight_gradient(const T* dy, const T* x, T* dw, const ConvProblem& p) {
  using A = acc_t<T>;
  const CpuLoops<A>& isa = loops<A>();
  const int64_t Kg = p.filters_per_group(), Cg = p.channels_per_group(), RS = p.R * p.S;
  const int64_t weights = p.K * Cg * RS;
  if (weights == 0) return;
  if (pixel_weight_gradient<T>(p)) return run_weight_gradient_pixels(dy, x, dw, p);
  const int64_t L = isa.lanes;
  // Output (p, q) reads, at tap (r, s), x row p * stride_h + a - pad_top and column
  // q * stride_w + b - pad_left (a = r * dilation_h, b = s * dilation_w). Each input plane is
  // staged as stride phases: phase (a % stride_h, b % stride_w) holds rows t and columns u,
  // x[t * stride_h + a % stride_h - pad_top][u * stride_w + b % stride_w - pad_left], at
  // `pitch` per row, so that the tap reads its phase's element (p + a / stride_h) * pitch +
  // q + b / stride_w. With dy's rows at the same pitch (zeros past Q), that is the flat
  // position j = p * pitch + q plus a constant: each image runs as one flat row of P * pitch
  // positions, rounded up to whole vectors (zeros in dy), with no per-row setup and no row
  // rounded up to whole vectors. Only the phases some tap reads are staged: in order of first
  // use (at most R and S of them, whatever the stride), each tap's slot among them.
  const auto phases_of = [](int64_t taps, int64_t dilation, int64_t stride,
                            std::vector<int64_t>* used, std::vector<int64_t>* slot) {
    for (int64_t t = 0; t < taps; ++t) {
      const int64_t phase = t * dilation % stride;
      const auto it = std::find(used->begin(), used->end(), phase);
      slot->push_back(it - used->begin());
      if (it == used->end()) used->push_back(phase);
    }
  };
  std::vector<int64_t> row_phase, col_phase, row_slot, col_slot;
  phases_of(p.R, p.dilation_h, p.stride_h, &row_phase, &row_slot);
  phases_of(p.S, p.dilation_w, p.stride_w, &col_phase, &col_slot);
  const int64_t row_phases = int64_t(row_phase.size()), col_phases = int64_t(col_phase.size());
  const int64_t reach_rows = (p.R - 1) * p.dilation_h / p.stride_h;
  const int64_t reach_cols = (p.S - 1) * p.dilation_w / p.stride_w;
  {
    // What run_weight_gradient stages per thread (one image's planes, at least) against the
    // planes of the tensors.
    const int64_t staged = sat_mul(
        row_phases * col_phases,
        sat_mul(sat_add(sat_add(p.P, reach_rows), 2), sat_add(sat_add(p.Q, reach_cols), L)));
    if (out_of_proportion(staged, 0, sat_add(sat_mul(p.H, p.W), sat_mul(p.P, p.Q))))
      return run_weight_gradient_direct(dy, x, dw, p);
  }
  const TensorStrides xs = p.input_strides(), ys = p.output_strides(), ws = p.filter_strides();
  const int64_t pitch = p.Q + reach_cols, phase_rows = p.P + reach_rows;
  const int64_t dy_plane = round_up(p.P * pitch, L);
  // A phase ends in zeros up to the last element a tap reads (and a whole vector).
  const int64_t phase_size = round_up(dy_plane + reach_rows * pitch + reach_cols, L);
  const int64_t x_plane = row_phases * col_phases * phase_size;
  // Images are reduced in slices fixed by the shapes (never by the thread count), then the
  // slices are added in order. A slice spans at least 4096 output positions, so that the
  // vector lanes' final sums cost little, and the images are shared out evenly (slice i takes
  // [i * N / slices, (i + 1) * N / slices)): slices of 5 and 3 images would leave one of two
  // threads idle for a quarter of the pass.
  const int64_t wanted = std::max<int64_t>(1, ceil_div(4096, std::max<int64_t>(dy_plane, 1)));
  int64_t per_slice = std::clamp<int64_t>(wanted, 1, std::max<int64_t>(p.N, 1));
  const int64_t max_slices = std::max<int64_t>(1, (int64_t(1) << 24) / weights);  // bounds memory
  per_slice = std::max(per_slice, ceil_div(p.N, max_slices));
  const int64_t slices = std::max<int64_t>(1, ceil_div(p.N, per_slice));
  per_slice = std::max<int64_t>(1, ceil_div(p.N, slices));  // the largest slice's images
  std::vector<A> partial(slices * weights, A(0));

  // Input channels staged together: as many as about 1 MiB of planes holds, down to blocks
  // enough for two work items a thread. Each filter block's dy serves a channel block's columns
  // from L2, and every channel block reads the whole of dy again, from memory where it is
  // large: blocks of 6 channels (for 16 work items) took 1x1 64->256 N4 56^2 1.35x the time.
  // Only the work split depends on the thread count, not a sum. A block's (channel, tap)
  // columns are a multiple of the register block's where the channels allow, so that no
  // column block computes sums it drops.
  const int64_t channel_blocks =
      std::clamp<int64_t>(ceil_div(2 * parallel_threads(), slices * p.groups), 1, Cg);
  int64_t channel_block = std::clamp<int64_t>(
      std::min((int64_t(1) << 20) / int64_t(sizeof(A)) / std::max<int64_t>(per_slice * x_plane, 1),
               ceil_div(Cg, channel_blocks)),
      1, Cg);
  const int64_t column_unit = isa.wgrad_columns / std::gcd<int64_t>(RS, isa.wgrad_columns);
  if (channel_block > column_unit) channel_block -= channel_block % column_unit;
  const int64_t blocks = ceil_div(Cg, channel_block);
  std::vector<int64_t> column_offset(channel_block * RS);
  for (int64_t c = 0; c < channel_block; ++c)
    for (int64_t r = 0; r < p.R; ++r)
      for (int64_t s = 0; s < p.S; ++s) {
        const int64_t phase = row_slot[r] * col_phases + col_slot[s];
        column_offset[(c * p.R + r) * p.S + s] = c * x_plane + phase * phase_size +
                                                 r * p.dilation_h / p.stride_h * pitch +
                                                 s * p.dilation_w / p.stride_w;
      }

  // 1x1 taps at unit stride without padding, planes of whole vectors, NCHW in the accumulation
  // type: the tensors' own planes are the staged ones (same layout, no zeros anywhere), so the
  // block reads x and dy in place.
  const bool in_place = std::is_same_v<T, A> && p.layout == ConvLayout::kNCHW && RS == 1 &&
                        p.stride_h == 1 && p.stride_w == 1 && p.pad_top == 0 &&
                        p.pad_left == 0 && p.P == p.H && p.Q == p.W && xs.b == x_plane &&
                        ys.b == dy_plane;
  // Channels-last tensors are staged through tiles transposed in registers (a strided copy per
  // plane took 23% of the 1x1 wgrad's samples): dy's planes, and x's phases at any stride.
  const bool channels_last = p.layout == ConvLayout::kNHWC;
  // A block's sums as outer products (pixel_gradient, the pixel GEMM's loop) where the group's
  // filters fill whole register blocks: per chunk of kPixelChunk flat positions of an image,
  // dy's filters transposed to pixel-major rows, then per tap a GEMM of those rows by the
  // block's channels at that tap, each x element broadcast; its [channel, tap][filter] sums
  // land in the partial at the end. A vector of filters per load and one broadcast per channel
  // and position, where the dot products (isa.weight_gradient) load a vector of x per column
  // and reduce their lanes at the end: 0.71-1.00x their time on this session's 2-core EPYC VM
  // (float32 NCHW 3x3/2 128->128 N8 28^2 1.97-2.00 -> 1.63-1.68 ms, 2x2/2 96->192 0.71x, 3x3
  // 256->256 14^2 0.91x; channels last 3x3/2 0.75-0.80x; docs/performance.md). Other filter
  // counts keep the dot products (a partial register block copies every position's filters).
  const bool outer = Kg % isa.pixel_filter_block == 0;
  // bfloat16 outer products on AVX512_BF16 over pairs of pixels (pixel_gradient_pairs): x's
  // staged planes narrowed back to bfloat16 (exact). Only with rows of even length (no pair
  // straddles two rows). The decision depends on neither the layout nor the threads.
  // dy's pairs come straight from the tensor (its rows back to back: pixel i of an image is
  // dy's element i * ys.d): channels first, a 16 x 16 tile of filters x pairs of pixels
  // transposed in registers (a pair of bfloat16 is one 4-byte element), channels last each pair
  // of pixels' filters interleaved (pair_row).
  const bool dy_compact = p.layout == ConvLayout::kNHWC ? ys.c == p.Q * ys.d
                                                         : ys.d == 1 && ys.c == p.Q;
  const bool pair_pixels = std::is_same_v<T, bfloat16> && outer && p.Q % 2 == 0 && dy_compact &&
                           isa.pixel_gradient_pairs != nullptr;
  // The outer products' dy, pixel-major ([image][position][filter], positions compact), staged
  // once per (slice, group) where dy's planes (NCHW) or pixels (channels last) are compact: every
  // channel block then reads its chunks in place. They were staged as planes and transposed
  // back per chunk for every channel block (channels last: transposed twice): 5.5% of the float32
  // 3x3/2 64->128 N8 56^2 wgrad's samples were those transposes, its four channel blocks each
  // transposing all of dy. The same elements in the same order: the same bits.
  const bool dy_pixel_major = outer && !pair_pixels && dy_compact && !in_place;
  // bfloat16 pairs over a 1x1 unit-stride NCHW x without padding, planes of whole vectors: x's
  // own planes are the staged ones (bfloat16 bits, the same layout), read in place. They were
  // widened to float32 and narrowed back (17% of the 1x1 256->64 N8 28^2 wgrad's samples).
  const bool pair_x_in_place = pair_pixels && p.layout == ConvLayout::kNCHW && RS == 1 &&
                               p.stride_h == 1 && p.stride_w == 1 && p.pad_top == 0 &&
                               p.pad_left == 0 && p.P == p.H && p.Q == p.W && xs.b == x_plane;
  const auto high_half = [](A v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return u >> 16;
  };
  auto sum_block = [&](const WeightGradientBlock<A>& blk, A* partial_block, A* scratch,
                       const uint16_t* x_pairs, const T* dy_tensor) {
    if (!outer) {
      isa.weight_gradient(blk, Kg, partial_block, Cg * RS);
      return;
    }
    // dy's positions are compact here (staged below pixel-major, dy_pixel_major, or as planes
    // in rows of Q: P * Q positions, no zeros past Q), so only the output's own positions are
    // summed: dy's position i is x's flat position i / Q * pitch + i % Q.
    const int64_t channels = blk.columns / RS;
    A* chunk = scratch;                    // [kPixelChunk][Kg]: dy's positions, pixel-major
    A* sums = scratch + kPixelChunk * Kg;  // [channels * RS][Kg]
    // [kPixelChunk / 2][Kg]: dy's pixels in pairs (pair_pixels)
    uint32_t* pair_chunk = reinterpret_cast<uint32_t*>(sums + channels * RS * Kg);
    PixelGradientPairs q{};
    q.channels = channels, q.filters = Kg, q.x_channel_step = x_plane;
    q.dy = pair_chunk, q.dy_step = Kg, q.partial_pitch = RS * Kg;
    q.run = p.Q, q.run_skip = pitch - p.Q;
    PixelGradient<A> b{};
    b.channels = channels, b.filters = Kg, b.x_step = 1, b.x_channel_step = x_plane;
    b.dy = chunk, b.dy_step = Kg, b.partial_pitch = RS * Kg;
    b.run = p.Q, b.run_skip = pitch - p.Q;
    const int64_t positions = p.P * p.Q;
    for (int64_t n = 0; n < blk.images; ++n)
      for (int64_t i0 = 0; i0 < positions; i0 += kPixelChunk) {
        b.pixels = std::min(kPixelChunk, positions - i0);
        b.run_first = i0 % p.Q;
        b.first = n == 0 && i0 == 0;
        if constexpr (std::is_same_v<A, float> && std::is_same_v<T, bfloat16>) {
          if (pair_pixels) {
          const int64_t pairs = b.pixels / 2;
          const T* d = dy_tensor + n * ys.a + i0 * ys.d;
          if (ys.d == 1) {  // filter k's pairs ys.b / 2 4-byte elements apart
            transpose_channels(isa, reinterpret_cast<const A*>(d), ys.b / 2, Kg, pairs,
                               reinterpret_cast<A*>(pair_chunk), Kg);
          } else {
            const auto bits = [](const T* v) { return reinterpret_cast<const uint16_t*>(v); };
            for (int64_t m = 0; m < pairs; ++m)
              isa.pair_row(bits(d + 2 * m * ys.d), bits(d + (2 * m + 1) * ys.d), 1,
                           pair_chunk + m * Kg, Kg);
          }
          q.pairs = pairs, q.run_first = b.run_first, q.first = b.first;
          for (int64_t t = 0; t < RS; ++t) {
            q.x = x_pairs + n * blk.x_image_pitch + blk.column_offset[t] + i0 / p.Q * pitch +
                  i0 % p.Q;
            q.partial = sums + t * Kg;
            isa.pixel_gradient_pairs(q);
          }
          continue;
          }
        }
        if (dy_pixel_major) {  // staged pixel-major: the chunk's rows in place
          b.dy = blk.dy + n * blk.dy_image_pitch + i0 * Kg;
        } else {
          transpose_channels(isa, blk.dy + n * blk.dy_image_pitch + i0, blk.dy_channel_pitch,
                             Kg, b.pixels, chunk, Kg);
          b.dy = chunk;
        }
        for (int64_t t = 0; t < RS; ++t) {
          b.x = blk.x + n * blk.x_image_pitch + blk.column_offset[t] + i0 / p.Q * pitch +
                i0 % p.Q;
          b.partial = sums + t * Kg;
          isa.pixel_gradient(b);
        }
      }
    // Column-major over sums (read in order), so that the partial's rows being written stay in
    // L1; filters outer read every sums row a cache line apart and took 3.4% of the float32
    // 3x3/2 64->128 N8 56^2 wgrad's samples (sums of 295 KiB swept once per filter).
    for (int64_t j = 0; j < channels * RS; ++j)
      for (int64_t k = 0; k < Kg; ++k) partial_block[k * Cg * RS + j] += sums[j * Kg + k];
  };
  const int64_t work = std::max<int64_t>(1, per_slice * Kg * channel_block * RS * p.P * p.Q);
  parallel_for(slices * p.groups * blocks, std::max<int64_t>(1, (int64_t(1) << 16) / work),
               [&](int64_t begin, int64_t end) {
    ThreadScratch<A> x_buffer(
        0, in_place || pair_x_in_place ? 0 : per_slice * channel_block * x_plane);
    ThreadScratch<A> dy_buffer(
        1, in_place || pair_pixels ? 0
                                   : per_slice * Kg * (dy_pixel_major ? p.P * p.Q : dy_plane));
    ThreadScratch<A> outer_buffer(
        2, outer ? kPixelChunk * Kg + channel_block * RS * Kg + (pair_pixels ? kPixelChunk / 2 * Kg : 0)
                 : 0);
    ThreadScratch<A> x_pair_buffer(
        3, pair_pixels && !pair_x_in_place ? per_slice * channel_block * x_plane / 2 + 1 : 0);
    uint16_t* x_pairs = reinterpret_cast<uint16_t*>(x_pair_buffer.data());
    int64_t staged = -1;  // the (slice, group) whose dy is in dy_buffer
    for (int64_t item = begin; item < end; ++item) {
      const int64_t slice = item / (p.groups * blocks), g = item / blocks % p.groups;
      const int64_t c0 = item % blocks * channel_block;
      const int64_t first = slice * p.N / slices, images = (slice + 1) * p.N / slices - first;
      const int64_t channels = std::min(channel_block, Cg - c0);
      WeightGradientBlock<A> block;
      block.columns = channels * RS;
      block.column_offset = column_offset.data();
      block.dy_channel_pitch = dy_plane;
      block.images = images;
      block.positions = dy_plane;
      A* partial_block = partial.data() + slice * weights + (g * Kg * Cg + c0) * RS;
      if constexpr (std::is_same_v<T, A>) {
        if (in_place) {
          block.x = x + xs.at(first, g * Cg + c0, 0, 0);
          block.x_image_pitch = xs.a;
          block.dy = dy + ys.at(first, g * Kg, 0, 0);
          block.dy_image_pitch = ys.a;
          sum_block(block, partial_block, outer_buffer.data(), nullptr, nullptr);
          continue;
        }
      }
      if (dy_pixel_major && staged != item / blocks) {
        staged = item / blocks;
        for (int64_t n = 0; n < images; ++n) {
          const T* d = dy + ys.at(first + n, g * Kg, 0, 0);
          A* out = dy_buffer.data() + n * p.P * p.Q * Kg;
          if (channels_last)
            widen_pixels(isa, d, ys.d, Kg, p.P * p.Q, out);
          else
            transpose_channels(isa, d, ys.b, Kg, p.P * p.Q, out, Kg);
        }
      }
      if (!pair_pixels && !dy_pixel_major && staged != item / blocks) {  // (pairs: in place)
        staged = item / blocks;
        // Rows at the pitch with zeros past Q, or compact for the outer products (sum_block;
        // dy's compact planes are staged pixel-major above instead).
        const int64_t dy_pitch = outer ? p.Q : pitch;
        for (int64_t n = 0; n < images; ++n)
          for (int64_t k = 0; k < Kg; ++k) {
            A* plane = dy_buffer.data() + (n * Kg + k) * dy_plane;
            for (int64_t row = 0; row < p.P; ++row) {
              A* out = plane + row * dy_pitch;
              if (!channels_last)
                widen_row(isa, dy + ys.at(first + n, g * Kg + k, row, 0), ys.d, out, p.Q);
              std::fill(out + p.Q, out + dy_pitch, A(0));  // zeros past Q
            }
            std::fill(plane + p.P * dy_pitch, plane + dy_plane, A(0));
          }
        if (channels_last)
          for (int64_t n = 0; n < images; ++n)
            for (int64_t row = 0; row < p.P; ++row)
              transpose_channels(isa, dy + ys.at(first + n, g * Kg, row, 0), ys.d, p.Q, Kg,
                                 dy_buffer.data() + n * Kg * dy_plane + row * dy_pitch, dy_plane);
      }
      block.x = x_buffer.data();
      block.x_image_pitch = channel_block * x_plane;
      block.dy = dy_buffer.data();
      block.dy_image_pitch = Kg * dy_plane;
      if (dy_pixel_major) block.dy_image_pitch = p.P * p.Q * Kg;
      const uint16_t* pairs_x = x_pairs;
      if (pair_x_in_place) {
        pairs_x = reinterpret_cast<const uint16_t*>(x + xs.at(first, g * Cg + c0, 0, 0));
        block.x_image_pitch = xs.a;
      } else {
        for (int64_t n = 0; n < images; ++n)
          for (int64_t i = 0; i < row_phases; ++i)
            for (int64_t j = 0; j < col_phases; ++j)
              fill_phase(isa, x + xs.at(first + n, g * Cg + c0, 0, 0), xs, channels_last,
                         channels, p, row_phase[i], col_phase[j], phase_rows, pitch, phase_size,
                         x_buffer.data() + n * channel_block * x_plane +
                             (i * col_phases + j) * phase_size,
                         x_plane);
        if (pair_pixels)
          for (int64_t j = 0; j < images * channel_block * x_plane; ++j)
            x_pairs[j] = uint16_t(high_half(x_buffer.data()[j]));
      }
      sum_block(block, partial_block, outer_buffer.data(), pairs_x,
                pair_pixels ? dy + ys.at(first, g * Kg, 0, 0) : nullptr);
    }
  });
  // The partials are [K][Cg][R][S]; dw is that (KCRS) or [R][S][Cg][K] (HWIO). One filter's
  // weights per item, in nested loops (no index divisions per weight).
  parallel_for(p.K, std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(Cg * RS, 1)),
               [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k)
      for (int64_t c = 0; c < Cg; ++c)
        for (int64_t r = 0; r < p.R; ++r)
          for (int64_t s = 0; s < p.S; ++s) {
            const int64_t i = ((k * Cg + c) * p.R + r) * p.S + s;
            A sum = partial[i];
            for (int64_t slice = 1; slice < slices; ++slice) sum += partial[slice * weights + i];
            dw[ws.at(k, c, r, s)] = from_acc<T>(sum);
          }
  });
}

// ---- Bias gradient ------------------------------------------------------------------------------

// db[b, k] = sum over n, p, q of dy[b, n, k, p, q], in 16 interleaved partial sums.
template <class T>
void run_bias_gradient(const T* dy, T* db, int64_t batch, int64_t N, int64_t K, int64_t plane) {
  using A = acc_t<T>;
  constexpr int kLanes = 16;
  const int64_t work = std::max<int64_t>(1, N * plane);
  parallel_for(batch * K, std::max<int64_t>(1, (int64_t(1) << 15) / work),
               [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / K, k = item % K;
      A lanes[kLanes] = {};
      for (int64_t n = 0; n < N; ++n) {
        const T* in = dy + ((b * N + n) * K + k) * plane;
        int64_t i = 0;
        for (; i + kLanes <= plane; i += kLanes)
          for (int l = 0; l < kLanes; ++l) lanes[l] += to_acc(in[i + l]);
        for (int l = 0; i < plane; ++i, ++l) lanes[l] += to_acc(in[i]);
      }
      A sum = lanes[0];
      for (int l = 1; l < kLanes; ++l) sum += lanes[l];
      db[item] = from_acc<T>(sum);
    }
  });
}

// Channels last: db[b, k] = sum over rows (n, p, q) of dy[b, row, k], rows r = l mod 16 summed
// into partial l, then the 16 partials in order (as above, interleaved by row instead of by
// element), for blocks of 64 filters at a time.
template <class T>
void run_bias_gradient_channels_last(const T* dy, T* db, int64_t batch, int64_t rows,
                                     int64_t K) {
  using A = acc_t<T>;
  constexpr int kLanes = 16;
  constexpr int64_t kBlock = 64;
  const int64_t blocks = ceil_div(K, kBlock);
  parallel_for(batch * blocks, std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, rows * kBlock)),
               [&](int64_t begin, int64_t end) {
    std::vector<A> lanes(kLanes * kBlock);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / blocks, k0 = item % blocks * kBlock;
      const int64_t width = std::min(kBlock, K - k0);
      std::fill(lanes.begin(), lanes.end(), A(0));
      const T* in = dy + b * rows * K + k0;
      for (int64_t r = 0; r < rows; ++r) {
        A* lane = lanes.data() + (r % kLanes) * kBlock;
        const T* row = in + r * K;
        for (int64_t k = 0; k < width; ++k) lane[k] += to_acc(row[k]);
      }
      for (int64_t k = 0; k < width; ++k) {
        A sum = lanes[k];
        for (int l = 1; l < kLanes; ++l) sum += lanes[l * kBlock + k];
        db[b * K + k0 + k] = from_acc<T>(sum);
      }
    }
  });
}

// ---- Handlers -----------------------------------------------------------------------------------

// `precision` selects TF32 on CUDA tensor cores only: the CPU always computes in full precision.
// Each handler serves both layouts (the jk_conv2d_* and jk_conv2d_nhwc_* targets).
template <ConvLayout L>
ffi::Error conv2d_forward(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                          ffi::Result<ffi::AnyBuffer> y, ConvAttrs a) {
  ConvProblem p{};
  if (auto error = conv2d_problem("conv2d", a, x, w, *y, &p, L); error.failure()) return error;
  if (auto error = conv2d_bias_check(bias, x, p.K); error.failure()) return error;
  const bool has_bias = bias.element_count() > 0;
  if (y->element_count() == 0) return ffi::Error::Success();
  return dispatch_float(x.element_type(), "conv2d", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_stencil_pass(StencilPass<T>{
        static_cast<const T*>(x.untyped_data()), static_cast<const T*>(w.untyped_data()),
        has_bias ? static_cast<const T*>(bias.untyped_data()) : nullptr,
        static_cast<T*>(y->untyped_data()), p.N, p.groups, p.channels_per_group(),
        p.filters_per_group(), forward_rows(p), forward_cols(p), forward_weights(p),
        p.input_strides(), p.output_strides()});
    return ffi::Error::Success();
  });
}

template <ConvLayout L>
ffi::Error conv2d_backward_input(ffi::AnyBuffer dy, ffi::AnyBuffer w,
                                 ffi::Result<ffi::AnyBuffer> dx, ConvAttrs a) {
  ConvProblem p{};
  if (auto error = conv2d_problem("conv2d dgrad", a, *dx, w, dy, &p, L); error.failure())
    return error;
  if (dx->element_count() == 0) return ffi::Error::Success();
  return dispatch_float(dy.element_type(), "conv2d dgrad", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_stencil_pass(StencilPass<T>{
        static_cast<const T*>(dy.untyped_data()), static_cast<const T*>(w.untyped_data()), nullptr,
        static_cast<T*>(dx->untyped_data()), p.N, p.groups, p.filters_per_group(),
        p.channels_per_group(), backward_data_rows(p), backward_data_cols(p),
        backward_data_weights(p), p.output_strides(), p.input_strides()});
    return ffi::Error::Success();
  });
}

template <ConvLayout L>
ffi::Error conv2d_backward_weight(ffi::AnyBuffer dy, ffi::AnyBuffer x,
                                  ffi::Result<ffi::AnyBuffer> dw, ConvAttrs a) {
  ConvProblem p{};
  if (auto error = conv2d_problem("conv2d wgrad", a, x, *dw, dy, &p, L); error.failure())
    return error;
  if (dw->element_count() == 0) return ffi::Error::Success();
  return dispatch_float(dy.element_type(), "conv2d wgrad", [&](auto tag) {
    using T = typename decltype(tag)::type;
    run_weight_gradient(static_cast<const T*>(dy.untyped_data()),
                        static_cast<const T*>(x.untyped_data()),
                        static_cast<T*>(dw->untyped_data()), p);
    return ffi::Error::Success();
  });
}

// dy [N, K, P, Q] -> db [K], or [B, N, K, P, Q] -> [B, K] (a vmapped batch); channels last:
// dy [(B,) N, P, Q, K].
template <ConvLayout L>
ffi::Error conv2d_backward_bias(ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> db) {
  int64_t batch, N, K, plane;
  if (auto error = conv2d_bias_gradient_shape(dy, *db, &batch, &N, &K, &plane, L);
      error.failure())
    return error;
  if (db->element_count() == 0) return ffi::Error::Success();
  return dispatch_float(dy.element_type(), "conv2d bias gradient", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* in = static_cast<const T*>(dy.untyped_data());
    T* out = static_cast<T*>(db->untyped_data());
    if constexpr (L == ConvLayout::kNHWC)
      run_bias_gradient_channels_last(in, out, batch, N * plane, K);
    else
      run_bias_gradient(in, out, batch, N, K, plane);
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jax_kernels

JK_CONV2D_REGISTER_ATTRS();

namespace jax_kernels {

#define JK_CONV2D_CPU_HANDLERS(SUFFIX, LAYOUT)                                               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Conv2dForwardCpu##SUFFIX, conv2d_forward<LAYOUT>,              \
                                ffi::Ffi::Bind()                                              \
                                    .Arg<ffi::AnyBuffer>()                                    \
                                    .Arg<ffi::AnyBuffer>()                                    \
                                    .Arg<ffi::AnyBuffer>()                                    \
                                    .Ret<ffi::AnyBuffer>()                                    \
                                    .Attrs<ConvAttrs>());                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Conv2dBackwardInputCpu##SUFFIX, conv2d_backward_input<LAYOUT>, \
                                ffi::Ffi::Bind()                                              \
                                    .Arg<ffi::AnyBuffer>()                                    \
                                    .Arg<ffi::AnyBuffer>()                                    \
                                    .Ret<ffi::AnyBuffer>()                                    \
                                    .Attrs<ConvAttrs>());                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Conv2dBackwardWeightCpu##SUFFIX,                              \
                                conv2d_backward_weight<LAYOUT>,                               \
                                ffi::Ffi::Bind()                                              \
                                    .Arg<ffi::AnyBuffer>()                                    \
                                    .Arg<ffi::AnyBuffer>()                                    \
                                    .Ret<ffi::AnyBuffer>()                                    \
                                    .Attrs<ConvAttrs>());                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Conv2dBackwardBiasCpu##SUFFIX, conv2d_backward_bias<LAYOUT>,   \
                                ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>())

JK_CONV2D_CPU_HANDLERS(Nchw, ConvLayout::kNCHW);
JK_CONV2D_CPU_HANDLERS(Nhwc, ConvLayout::kNHWC);

JK_REGISTER_TARGET("jk_conv2d_fwd", Conv2dForwardCpuNchw, "conv2d", "forward",
                   "cpu direct stencil (vectorized, padded row buffers)", "bitwise");
JK_REGISTER_TARGET("jk_conv2d_bwd_input", Conv2dBackwardInputCpuNchw, "conv2d",
                   "backward d_input", "cpu direct stencil over stride phases", "bitwise");
JK_REGISTER_TARGET("jk_conv2d_bwd_weight", Conv2dBackwardWeightCpuNchw, "conv2d",
                   "backward d_weight", "cpu reduction over fixed image slices", "bitwise");
JK_REGISTER_TARGET("jk_conv2d_bwd_bias", Conv2dBackwardBiasCpuNchw, "conv2d", "backward d_bias",
                   "cpu ordered sum", "bitwise");
JK_REGISTER_TARGET("jk_conv2d_nhwc_fwd", Conv2dForwardCpuNhwc, "conv2d", "forward (NHWC)",
                   "cpu direct stencil, channels-last rows staged per band", "bitwise");
JK_REGISTER_TARGET("jk_conv2d_nhwc_bwd_input", Conv2dBackwardInputCpuNhwc, "conv2d",
                   "backward d_input (NHWC)", "cpu direct stencil over stride phases, channels-last",
                   "bitwise");
JK_REGISTER_TARGET("jk_conv2d_nhwc_bwd_weight", Conv2dBackwardWeightCpuNhwc, "conv2d",
                   "backward d_weight (NHWC)", "cpu reduction over fixed image slices, channels-last",
                   "bitwise");
JK_REGISTER_TARGET("jk_conv2d_nhwc_bwd_bias", Conv2dBackwardBiasCpuNhwc, "conv2d",
                   "backward d_bias (NHWC)", "cpu ordered sum over rows", "bitwise");

}  // namespace jax_kernels
