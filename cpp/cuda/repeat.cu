// CUDA FFI handlers of repeat. The forward moves 16-byte chunks where x's rows allow it, one
// output row per block row so that each thread does a single modulo; the backward gives each x
// element one thread (or a warp, or a block, when x is small and the copies many) that sums its
// copies in a fixed order and tree.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "common/launch.h"
#include "common/status.h"
#include "jax_kernels/ffi_util.h"
#include "jax_kernels/repeat.h"

namespace jax_kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kBulkMinRowBytes = 512;   // shorter rows make bulk copies too small to pay
constexpr int64_t kBulkTileBytes = 32768;   // shared memory per block (under the 48 KB default)

// Rows of at least one block: each block writes `rows_per_block` whole output rows, its threads
// striding along a row; the x offset of a row is computed once per row and thread. Streaming
// stores (the output is not read back soon) leave L2 to x, which every row re-reads.
template <class Chunk>
__global__ void repeat_rows_kernel(const Chunk* __restrict__ x, Chunk* __restrict__ out,
                                   RepeatGeometry g, int64_t rows, int64_t rows_per_block) {
  const int last = g.rank - 1;
  const int64_t x_row = g.size[last];
  const int64_t out_row = x_row * g.repeats[last];
  const int64_t first = int64_t(blockIdx.x) * rows_per_block;
  const int64_t end = first + rows_per_block < rows ? first + rows_per_block : rows;
  for (int64_t row = first; row < end; ++row) {
    const Chunk* src = x + g.x_offset(row * out_row);
    Chunk* dst = out + row * out_row;
    // 32-bit column arithmetic where j + blockDim.x cannot wrap past 2^32.
    if (out_row <= 0xffffffff - int64_t(blockDim.x)) {
      const uint32_t n = uint32_t(out_row), m = uint32_t(x_row);
#pragma unroll 4
      for (uint32_t j = threadIdx.x; j < n; j += blockDim.x) __stcs(dst + j, src[j % m]);
    } else {
      for (int64_t j = threadIdx.x; j < out_row; j += blockDim.x) __stcs(dst + j, src[j % x_row]);
    }
  }
}

// Hopper and newer, rows of whole 16-byte chunks: each block loads one tile of one x row into
// shared memory once and hands every copy of it to the bulk-copy engine (cp.async.bulk
// shared -> global), so x is read exactly once and the stores run at the write bandwidth
// (0.99x the copy floor for 2048x2048 by (4, 4) in scripts/bench_variants.cu, against 1.13x
// for the row kernel). grid = (x rows, tiles per row, slices of the copies).
__global__ void repeat_bulk_kernel(const unsigned char* __restrict__ x, unsigned char* __restrict__ out,
                                   RepeatGeometry g, int64_t width, int64_t tile_bytes,
                                   int64_t copies_per_block) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint4 tile[];
  const int last = g.rank - 1;
  const int64_t row_bytes = g.size[last] * width;
  const int64_t x_row = blockIdx.x;
  const int64_t start = int64_t(blockIdx.y) * tile_bytes;
  const int64_t bytes = row_bytes - start < tile_bytes ? row_bytes - start : tile_bytes;
  const uint4* src = reinterpret_cast<const uint4*>(x + x_row * row_bytes + start);
  for (int64_t j = threadIdx.x; j < bytes / 16; j += blockDim.x) tile[j] = src[j];
  // Make the ordinary shared-memory stores visible to the bulk-copy engine before it reads.
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int64_t base = g.element_offset(x_row * g.size[last]) * width + start;
  const int64_t first = int64_t(blockIdx.z) * copies_per_block;
  const int64_t end = first + copies_per_block < g.copies ? first + copies_per_block : g.copies;
  const unsigned shared = unsigned(__cvta_generic_to_shared(tile));
  for (int64_t c = first + threadIdx.x; c < end; c += blockDim.x) {
    unsigned char* dst = out + base + g.copy_offset(c) * width;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 :: "l"(dst), "r"(shared), "r"(unsigned(bytes)) : "memory");
  }
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  // The tile must outlive the engine's reads of it.
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
}

bool has_bulk_copy() {
  static std::atomic<int> major[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) return false;
  int m = major[device].load(std::memory_order_relaxed);
  if (m == 0) {
    if (cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
    major[device].store(m, std::memory_order_relaxed);
  }
  return m >= 9;
}

// Short rows: one output chunk per thread with the full index map.
template <class Chunk>
__global__ void repeat_flat_kernel(const Chunk* __restrict__ x, Chunk* __restrict__ out,
                                   RepeatGeometry g) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < g.out_count; i += stride)
    out[i] = x[g.x_offset(i)];
}

template <class Chunk>
void launch_forward(cudaStream_t stream, const void* x, void* out, const RepeatGeometry& g) {
  const int last = g.rank - 1;
  const int64_t out_row = g.size[last] * g.repeats[last];
  const int64_t rows = g.out_count / out_row;
  if (out_row >= kThreads) {
    // About four blocks per multiprocessor's worth of rows each, at most 16 rows per block.
    const int64_t rows_per_block =
        std::max<int64_t>(1, std::min<int64_t>(16, rows / (int64_t(multiprocessor_count()) * 4)));
    const unsigned blocks = unsigned((rows + rows_per_block - 1) / rows_per_block);
    repeat_rows_kernel<Chunk><<<blocks, kThreads, 0, stream>>>(
        static_cast<const Chunk*>(x), static_cast<Chunk*>(out), g, rows, rows_per_block);
  } else {
    repeat_flat_kernel<Chunk><<<grid_blocks(g.out_count, kThreads), kThreads, 0, stream>>>(
        static_cast<const Chunk*>(x), static_cast<Chunk*>(out), g);
  }
}

ffi::Error repeat_forward(cudaStream_t stream, ffi::AnyBuffer x, ffi::Span<const int64_t> repeats,
                          ffi::Result<ffi::AnyBuffer> out) {
  RepeatGeometry g;
  const std::string problem = make_repeat_geometry(
      x.dimensions().begin(), int(x.dimensions().size()), out->dimensions().begin(),
      int(out->dimensions().size()), repeats.begin(), int(repeats.size()), &g);
  if (!problem.empty()) return ffi::Error::InvalidArgument("repeat: " + problem);
  if (g.out_count == 0) return ffi::Error::Success();
  // Move the widest chunk that divides x's innermost row and both base addresses: the index map
  // is then the same with sizes counted in chunks.
  const int64_t width = ffi::ByteWidth(x.element_type());
  const int64_t row_bytes = g.size[g.rank - 1] * width;
  if (row_bytes >= kBulkMinRowBytes && row_bytes % 16 == 0 && g.copies >= 2 && has_bulk_copy() &&
      (reinterpret_cast<uintptr_t>(x.untyped_data()) | reinterpret_cast<uintptr_t>(out->untyped_data())) % 16 == 0) {
    const int64_t rows = g.x_count / g.size[g.rank - 1];
    const int64_t tile_bytes = std::min<int64_t>(row_bytes, kBulkTileBytes);
    const int64_t tiles = (row_bytes + tile_bytes - 1) / tile_bytes;
    // Enough blocks to fill the machine: split the copies when x has few rows.
    const int64_t want = int64_t(multiprocessor_count()) * 8;
    const int64_t splits = std::min<int64_t>({g.copies, 65535, std::max<int64_t>(1, want / (rows * tiles))});
    const int64_t copies_per_block = (g.copies + splits - 1) / splits;
    if (rows <= 0x7fffffff && tiles <= 65535) {
      const dim3 grid(unsigned(rows), unsigned(tiles), unsigned((g.copies + copies_per_block - 1) / copies_per_block));
      repeat_bulk_kernel<<<grid, 128, size_t(tile_bytes), stream>>>(
          static_cast<const unsigned char*>(x.untyped_data()), static_cast<unsigned char*>(out->untyped_data()),
          g, width, tile_bytes, copies_per_block);
      return launch_status("repeat");
    }
  }
  const uintptr_t addresses =
      reinterpret_cast<uintptr_t>(x.untyped_data()) | reinterpret_cast<uintptr_t>(out->untyped_data());
  int64_t chunk = 16;
  while (chunk > width && (row_bytes % chunk != 0 || addresses % chunk != 0)) chunk /= 2;
  const int64_t scale = chunk / width;
  g.size[g.rank - 1] /= scale;
  g.x_count /= scale;
  g.out_count /= scale;
  switch (chunk) {
    case 16: launch_forward<uint4>(stream, x.untyped_data(), out->untyped_data(), g); break;
    case 8: launch_forward<uint2>(stream, x.untyped_data(), out->untyped_data(), g); break;
    case 4: launch_forward<uint32_t>(stream, x.untyped_data(), out->untyped_data(), g); break;
    case 2: launch_forward<uint16_t>(stream, x.untyped_data(), out->untyped_data(), g); break;
    case 1: launch_forward<uint8_t>(stream, x.untyped_data(), out->untyped_data(), g); break;
    default: return ffi::Error::InvalidArgument("repeat: unsupported element width");
  }
  return launch_status("repeat");
}

constexpr int64_t kCopyTable = 4096;  // copy offsets tabulated in shared memory up to this many

// kLanes threads cooperate on one x element: lane l sums copies l, l + kLanes, ... in order, then
// the lanes combine in a fixed tree. The result depends only on the shapes, never on timing.
template <class T, int kLanes>
__global__ void repeat_backward_kernel(const T* __restrict__ dout, T* __restrict__ dx,
                                       RepeatGeometry g) {
  using A = acc_t<T>;
  static_assert(kThreads % kLanes == 0, "lanes must divide the block");
  extern __shared__ int64_t copy_offsets[];
  __shared__ A partial[kLanes == kThreads ? kThreads : 1];
  const bool tabulated = g.copies <= kCopyTable;
  if (tabulated) {
    for (int64_t c = threadIdx.x; c < g.copies; c += blockDim.x) copy_offsets[c] = g.copy_offset(c);
    __syncthreads();
  }
  const int lane = threadIdx.x % kLanes;
  const int64_t per_block = kThreads / kLanes;
  const int64_t stride = int64_t(gridDim.x) * per_block;
  for (int64_t e = int64_t(blockIdx.x) * per_block + threadIdx.x / kLanes; e < g.x_count;
       e += stride) {
    const int64_t base = g.element_offset(e);
    A sum = A(0);
    for (int64_t copy = lane; copy < g.copies; copy += kLanes)
      sum += to_acc(dout[base + (tabulated ? copy_offsets[copy] : g.copy_offset(copy))]);
    if constexpr (kLanes == 32) {
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
    } else if constexpr (kLanes == kThreads) {
      partial[threadIdx.x] = sum;
      __syncthreads();
      for (int offset = kThreads / 2; offset > 0; offset /= 2) {
        if (threadIdx.x < offset) partial[threadIdx.x] += partial[threadIdx.x + offset];
        __syncthreads();
      }
      sum = partial[0];
      __syncthreads();
    }
    if (lane == 0) dx[e] = from_acc<T>(sum);
  }
}

template <class T>
__global__ void fill_zero_kernel(T* __restrict__ dx, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dx[i] = from_acc<T>(acc_t<T>(0));
}

ffi::Error repeat_backward(cudaStream_t stream, ffi::AnyBuffer dout,
                           ffi::Span<const int64_t> repeats, ffi::Result<ffi::AnyBuffer> dx) {
  RepeatGeometry g;
  const std::string problem = make_repeat_geometry(
      dx->dimensions().begin(), int(dx->dimensions().size()), dout.dimensions().begin(),
      int(dout.dimensions().size()), repeats.begin(), int(repeats.size()), &g);
  if (!problem.empty()) return ffi::Error::InvalidArgument("repeat backward: " + problem);
  if (g.x_count == 0) return ffi::Error::Success();
  return dispatch_float(dout.element_type(), "repeat backward", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* in = static_cast<const T*>(dout.untyped_data());
    T* result = static_cast<T*>(dx->untyped_data());
    // The lanes per element decide how the copies are added: fixed, not the device's count.
    const int64_t sms = kReductionMultiprocessors;
    const size_t table_bytes = g.copies <= kCopyTable ? g.copies * sizeof(int64_t) : 0;
    if (g.copies == 0) {
      fill_zero_kernel<T><<<grid_blocks(g.x_count, kThreads), kThreads, 0, stream>>>(result, g.x_count);
    } else if (g.x_count >= sms * 512 || g.copies < 64) {
      repeat_backward_kernel<T, 1>
          <<<full_grid_blocks(g.x_count, kThreads), kThreads, table_bytes, stream>>>(in, result, g);
    } else if (g.x_count >= sms * 8) {
      repeat_backward_kernel<T, 32>
          <<<grid_blocks(g.x_count * 32, kThreads), kThreads, table_bytes, stream>>>(in, result, g);
    } else {
      repeat_backward_kernel<T, kThreads>
          <<<unsigned(std::min<int64_t>(g.x_count, 65535)), kThreads, table_bytes, stream>>>(in, result, g);
    }
    return launch_status("repeat backward");
  });
}

using Stream = ffi::PlatformStream<cudaStream_t>;

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RepeatForwardCuda, repeat_forward,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("repeats")
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(RepeatBackwardCuda, repeat_backward,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("repeats")
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

JK_REGISTER_TARGET("jk_repeat_fwd", RepeatForwardCuda, "repeat", "forward",
                   "cuda copy (bulk copies on sm_90+, else 16-byte chunks)",
                   "bitwise");
JK_REGISTER_TARGET("jk_repeat_bwd", RepeatBackwardCuda, "repeat", "backward d_input",
                   "cuda ordered sum", "bitwise");

}  // namespace jax_kernels
