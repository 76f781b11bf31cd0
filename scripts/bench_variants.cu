// Standalone micro-benchmark of kernel variants for the memory-bound ops (lerp, repeat), to
// choose the launch shape on the GPU before wiring it into the library. Not part of the build:
//   nvcc -O3 -arch=sm_90 -o /tmp/bv scripts/bench_variants.cu && /tmp/bv
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } \
  } while (0)

__device__ __forceinline__ float lerp1(float a, float b, float w) {
  float d = b - a;
  return (w < 0.5f && w > -0.5f) ? a + w * d : b - d * (1.f - w);
}
__device__ __forceinline__ float4 lerp4(float4 a, float4 b, float w) {
  return make_float4(lerp1(a.x, b.x, w), lerp1(a.y, b.y, w), lerp1(a.z, b.z, w), lerp1(a.w, b.w, w));
}

// L1: grid-stride, capped grid, one vector per iteration (the library's first version).
__global__ void lerp_gridstride(const float4* a, const float4* b, float4* o, long n, float w) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
    o[i] = lerp4(a[i], b[i], w);
}
// L2: one vector per thread, full grid.
__global__ void lerp_flat(const float4* a, const float4* b, float4* o, long n, float w) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) o[i] = lerp4(a[i], b[i], w);
}
// L3: U vectors per thread, loads first, full grid; block-contiguous chunks.
template <int U, bool kStreaming>
__global__ void lerp_unrolled(const float4* a, const float4* b, float4* o, long n, float w) {
  long base = blockIdx.x * (long)blockDim.x * U + threadIdx.x;
  float4 va[U], vb[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    long i = base + u * (long)blockDim.x;
    if (i < n) {
      if (kStreaming) { va[u] = __ldcs(a + i); vb[u] = __ldcs(b + i); }
      else { va[u] = a[i]; vb[u] = b[i]; }
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    long i = base + u * (long)blockDim.x;
    if (i < n) {
      if (kStreaming) __stcs(o + i, lerp4(va[u], vb[u], w));
      else o[i] = lerp4(va[u], vb[u], w);
    }
  }
}
// L4: grid-stride with U vectors per iteration, grid = SMs * k.
template <int U>
__global__ void lerp_gridstride_unrolled(const float4* a, const float4* b, float4* o, long n, float w) {
  const long stride = (long)gridDim.x * blockDim.x * U;
  for (long base = blockIdx.x * (long)blockDim.x * U + threadIdx.x; base < n; base += stride) {
    float4 va[U], vb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      long i = base + u * (long)blockDim.x;
      if (i < n) { va[u] = a[i]; vb[u] = b[i]; }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      long i = base + u * (long)blockDim.x;
      if (i < n) o[i] = lerp4(va[u], vb[u], w);
    }
  }
}

// Repeat (rows of x_row chunks, out_row = x_row * reps_col, rows = x_rows * reps_row).
// R1: library's first version: one row per block row, shared row offset, two barriers.
__global__ void repeat_rows_v1(const uint4* x, uint4* o, long x_rows, long x_row, long reps_row, long reps_col) {
  __shared__ long off;
  long out_row = x_row * reps_col, rows = x_rows * reps_row;
  long j = blockIdx.x * (long)blockDim.x + threadIdx.x;
  long col = j % x_row;
  for (long r = blockIdx.y; r < rows; r += gridDim.y) {
    if (threadIdx.x == 0) off = (r % x_rows) * x_row;
    __syncthreads();
    if (j < out_row) o[r * out_row + j] = x[off + col];
    __syncthreads();
  }
}
// R2: each block owns whole rows; threads stride the row; no barriers; 32-bit modulo.
template <bool kStreaming>
__global__ void repeat_rows_v2(const uint4* x, uint4* o, long x_rows, long x_row, long reps_row, long reps_col, long rows_per_block) {
  long out_row = x_row * reps_col, rows = x_rows * reps_row;
  long r0 = blockIdx.x * rows_per_block;
  long r1 = min(rows, r0 + rows_per_block);
  for (long r = r0; r < r1; ++r) {
    const uint4* src = x + (r % x_rows) * x_row;
    uint4* dst = o + r * out_row;
#pragma unroll 4
    for (unsigned j = threadIdx.x; j < (unsigned)out_row; j += blockDim.x) {
      uint4 v = src[j % (unsigned)x_row];
      if (kStreaming) __stcs(dst + j, v); else dst[j] = v;
    }
  }
}
// R3: flat, U chunks per thread, 32-bit index math.
template <int U>
__global__ void repeat_flat_v3(const uint4* x, uint4* o, long x_rows, long x_row, long reps_row, long reps_col) {
  unsigned out_row = x_row * reps_col;
  unsigned long total = (unsigned long)x_rows * reps_row * out_row;
  unsigned long base = blockIdx.x * (unsigned long)blockDim.x * U + threadIdx.x;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    unsigned long i = base + u * (unsigned long)blockDim.x;
    if (i < total) {
      unsigned r = i / out_row, j = i - r * out_row;
      o[i] = x[(r % (unsigned)x_rows) * x_row + j % (unsigned)x_row];
    }
  }
}
// R4: 2-D tile: block (x_row chunk tile, row): one tile of x loaded to registers, written reps_col times.
__global__ void repeat_tile_v4(const uint4* x, uint4* o, long x_rows, long x_row, long reps_row, long reps_col) {
  long out_row = x_row * reps_col, rows = x_rows * reps_row;
  long j = blockIdx.x * (long)blockDim.x + threadIdx.x;  // column within x's row
  if (j >= x_row) return;
  for (long r = blockIdx.y; r < rows; r += gridDim.y) {
    uint4 v = x[(r % x_rows) * x_row + j];
    uint4* dst = o + r * out_row + j;
    for (long c = 0; c < reps_col; ++c) dst[c * x_row] = v;
  }
}

// R5: tile v4 with streaming stores and several rows per block.
__global__ void repeat_tile_v5(const uint4* x, uint4* o, long x_rows, long x_row, long reps_row, long reps_col, long rows_per_block) {
  long out_row = x_row * reps_col, rows = x_rows * reps_row;
  long j = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (j >= x_row) return;
  long r0 = blockIdx.y * rows_per_block, r1 = min(rows, r0 + rows_per_block);
  for (long r = r0; r < r1; ++r) {
    uint4 v = x[(r % x_rows) * x_row + j];
    uint4* dst = o + r * out_row + j;
    for (long c = 0; c < reps_col; ++c) __stcs(dst + c * x_row, v);
  }
}
// W: write-only kernel (what stores alone achieve).
__global__ void write_only(uint4* o, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) __stcs(o + i, make_uint4(i, 1, 2, 3));
}
template <int U>
__global__ void write_only_u(uint4* o, long n) {
  long base = blockIdx.x * (long)blockDim.x * U + threadIdx.x;
#pragma unroll
  for (int u = 0; u < U; ++u) { long i = base + u * (long)blockDim.x; if (i < n) __stcs(o + i, make_uint4(i, 1, 2, 3)); }
}
// R6: flat, streaming stores, U chunks per thread, 32-bit index math.
template <int U>
__global__ void repeat_flat_v6(const uint4* x, uint4* o, long x_rows, long x_row, long reps_row, long reps_col) {
  unsigned out_row = x_row * reps_col;
  unsigned long total = (unsigned long)x_rows * reps_row * out_row;
  unsigned long base = blockIdx.x * (unsigned long)blockDim.x * U + threadIdx.x;
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    unsigned long i = base + u * (unsigned long)blockDim.x;
    if (i < total) { unsigned r = i / out_row, j = i - r * out_row; v[u] = x[(r % (unsigned)x_rows) * x_row + j % (unsigned)x_row]; }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) { unsigned long i = base + u * (unsigned long)blockDim.x; if (i < total) __stcs(o + i, v[u]); }
}

// R8: bulk copies (sm_90 TMA engine): a block loads a tile of one x row into shared memory and
// issues one cp.async.bulk shared->global per column copy of the output row.
__global__ void repeat_bulk_v8(const uint4* x, uint4* o, long x_rows, long x_row, long reps_row, long reps_col, long rows_per_block) {
  extern __shared__ __align__(128) uint4 tile[];
  long out_row = x_row * reps_col, rows = x_rows * reps_row;
  long r0 = blockIdx.x * rows_per_block, r1 = min(rows, r0 + rows_per_block);
  for (long r = r0; r < r1; ++r) {
    const uint4* src = x + (r % x_rows) * x_row;
    for (long j = threadIdx.x; j < x_row; j += blockDim.x) tile[j] = src[j];
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (threadIdx.x < reps_col) {
      uint4* dst = o + r * out_row + threadIdx.x * x_row;
      unsigned smem = (unsigned)__cvta_generic_to_shared(tile);
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst), "r"(smem), "r"((unsigned)(x_row * 16)) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
    __syncthreads();
  }
}
// R9: like R8, but a block holds one x row and writes all reps_row * reps_col copies of it
// (x read exactly once).
__global__ void repeat_bulk_v9(const uint4* x, uint4* o, long x_rows, long x_row, long reps_row, long reps_col) {
  extern __shared__ __align__(128) uint4 tile[];
  long out_row = x_row * reps_col;
  long xr = blockIdx.x;
  const uint4* src = x + xr * x_row;
  for (long j = threadIdx.x; j < x_row; j += blockDim.x) tile[j] = src[j];
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x < reps_col * reps_row) {
    long k = threadIdx.x / reps_col, c = threadIdx.x % reps_col;
    uint4* dst = o + (k * x_rows + xr) * out_row + c * x_row;
    unsigned smem = (unsigned)__cvta_generic_to_shared(tile);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst), "r"(smem), "r"((unsigned)(x_row * 16)) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  }
}

__global__ void fill_random(float* p, long n, unsigned seed) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = (h & 0xffffff) / float(1 << 24) - 0.5f;
  }
}

template <class F>
float time_ms(F launch, int reps = 20, int rounds = 15) {
  cudaEvent_t s, e;
  cudaEventCreate(&s); cudaEventCreate(&e);
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> t;
  for (int r = 0; r < rounds; ++r) {
    cudaEventRecord(s);
    for (int i = 0; i < reps; ++i) launch();
    cudaEventRecord(e);
    cudaEventSynchronize(e);
    float ms; cudaEventElapsedTime(&ms, s, e);
    t.push_back(ms / reps);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const long n = 1L << 26;  // floats
  float *a, *b, *o;
  CHECK(cudaMalloc(&a, n * 4)); CHECK(cudaMalloc(&b, n * 4)); CHECK(cudaMalloc(&o, n * 4));
  fill_random<<<1024, 256>>>(a, n, 1); fill_random<<<1024, 256>>>(b, n, 2);
  CHECK(cudaDeviceSynchronize());
  float copy = time_ms([&] { cudaMemcpyAsync(o, a, n * 4, cudaMemcpyDeviceToDevice); });
  double bw = 2.0 * n * 4 / (copy * 1e-3);
  printf("copy 256MB: %.4f ms -> %.0f GB/s (read+write)\n", copy, bw / 1e9);
  float memset_ms = time_ms([&] { cudaMemsetAsync(o, 1, n * 4); });
  printf("memset 256MB: %.4f ms -> %.0f GB/s (write)\n", memset_ms, n * 4 / (memset_ms * 1e-3) / 1e9);
  const double lerp_floor = 3.0 * n * 4 / bw * 1e3;
  long nv = n / 4;
  auto report = [&](const char* name, float ms, double floor) { printf("  %-44s %.4f ms  %.3fx floor\n", name, ms, ms / floor); };
  printf("lerp 64M f32 scalar weight, floor %.4f ms\n", lerp_floor);
  const float4 *A = (const float4*)a, *B = (const float4*)b; float4* O = (float4*)o;
  for (int k : {4, 8, 16, 32})
    { char nm[64]; snprintf(nm, 64, "gridstride cap %d/SM", k); report(nm, time_ms([&] { lerp_gridstride<<<sms * k, 256>>>(A, B, O, nv, 0.3f); }), lerp_floor); }
  report("flat 1 vec/thread", time_ms([&] { lerp_flat<<<(nv + 255) / 256, 256>>>(A, B, O, nv, 0.3f); }), lerp_floor);
  report("unrolled 2", time_ms([&] { lerp_unrolled<2, false><<<(nv + 511) / 512, 256>>>(A, B, O, nv, 0.3f); }), lerp_floor);
  report("unrolled 4", time_ms([&] { lerp_unrolled<4, false><<<(nv + 1023) / 1024, 256>>>(A, B, O, nv, 0.3f); }), lerp_floor);
  report("unrolled 2 streaming", time_ms([&] { lerp_unrolled<2, true><<<(nv + 511) / 512, 256>>>(A, B, O, nv, 0.3f); }), lerp_floor);
  report("unrolled 4 streaming", time_ms([&] { lerp_unrolled<4, true><<<(nv + 1023) / 1024, 256>>>(A, B, O, nv, 0.3f); }), lerp_floor);
  report("unrolled 4 x 128 threads", time_ms([&] { lerp_unrolled<4, false><<<(nv + 511) / 512, 128>>>(A, B, O, nv, 0.3f); }), lerp_floor);
  for (int k : {8, 16, 32})
    { char nm[64]; snprintf(nm, 64, "gridstride unrolled 2, %d/SM", k); report(nm, time_ms([&] { lerp_gridstride_unrolled<2><<<sms * k, 256>>>(A, B, O, nv, 0.3f); }), lerp_floor); }

  // repeat 2048x2048 f32 by (4,4): x_row = 512 chunks, 2048 x rows.
  const long x_rows = 2048, x_row = 512, rr = 4, rc = 4;
  const double rep_floor = (double(n) * 4 + 2048.0 * 2048 * 4) / bw * 1e3;
  printf("repeat 2048x2048 by (4,4) f32, floor %.4f ms\n", rep_floor);
  const uint4* X = (const uint4*)a; uint4* RO = (uint4*)o;
  long rows = x_rows * rr, out_row = x_row * rc;
  report("rows v1 (library first version)", time_ms([&] { repeat_rows_v1<<<dim3((out_row + 255) / 256, std::min(rows, 65535L)), 256>>>(X, RO, x_rows, x_row, rr, rc); }), rep_floor);
  for (long rpb : {1, 2, 4, 8})
    { char nm[64]; snprintf(nm, 64, "rows v2, %ld rows/block", rpb); report(nm, time_ms([&] { repeat_rows_v2<false><<<(rows + rpb - 1) / rpb, 256>>>(X, RO, x_rows, x_row, rr, rc, rpb); }), rep_floor); }
  report("rows v2 streaming, 2 rows/block", time_ms([&] { repeat_rows_v2<true><<<(rows + 1) / 2, 256>>>(X, RO, x_rows, x_row, rr, rc, 2); }), rep_floor);
  report("rows v2 512 thr, 1 row/block", time_ms([&] { repeat_rows_v2<false><<<rows, 512>>>(X, RO, x_rows, x_row, rr, rc, 1); }), rep_floor);
  report("flat v3 U=1", time_ms([&] { repeat_flat_v3<1><<<(nv + 255) / 256, 256>>>(X, RO, x_rows, x_row, rr, rc); }), rep_floor);
  report("flat v3 U=4", time_ms([&] { repeat_flat_v3<4><<<(nv + 1023) / 1024, 256>>>(X, RO, x_rows, x_row, rr, rc); }), rep_floor);
  report("tile v4", time_ms([&] { repeat_tile_v4<<<dim3((x_row + 255) / 256, std::min(rows, 65535L)), 256>>>(X, RO, x_rows, x_row, rr, rc); }), rep_floor);
  for (long rpb : {1, 4, 16})
    { char nm[64]; snprintf(nm, 64, "tile v5 streaming, %ld rows/block", rpb); report(nm, time_ms([&] { repeat_tile_v5<<<dim3((x_row + 255) / 256, (rows + rpb - 1) / rpb), 256>>>(X, RO, x_rows, x_row, rr, rc, rpb); }), rep_floor); }
  for (long rpb : {4, 8, 16})
    { char nm[64]; snprintf(nm, 64, "rows v2 streaming, %ld rows/block", rpb); report(nm, time_ms([&] { repeat_rows_v2<true><<<(rows + rpb - 1) / rpb, 256>>>(X, RO, x_rows, x_row, rr, rc, rpb); }), rep_floor); }
  report("flat v6 streaming U=1", time_ms([&] { repeat_flat_v6<1><<<(nv + 255) / 256, 256>>>(X, RO, x_rows, x_row, rr, rc); }), rep_floor);
  report("flat v6 streaming U=4", time_ms([&] { repeat_flat_v6<4><<<(nv + 1023) / 1024, 256>>>(X, RO, x_rows, x_row, rr, rc); }), rep_floor);
  for (long rpb : {1, 4, 16})
    { char nm[64]; snprintf(nm, 64, "bulk v8, %ld rows/block", rpb); report(nm, time_ms([&] { repeat_bulk_v8<<<(rows + rpb - 1) / rpb, 128, x_row * 16>>>(X, RO, x_rows, x_row, rr, rc, rpb); }), rep_floor); }
  report("bulk v9, x row once, 16 copies", time_ms([&] { repeat_bulk_v9<<<x_rows, 128, x_row * 16>>>(X, RO, x_rows, x_row, rr, rc); }), rep_floor);
  {  // check v8/v9 results against v2
    std::vector<unsigned> ref(n), got(n);
    repeat_rows_v2<false><<<rows, 256>>>(X, RO, x_rows, x_row, rr, rc, 1);
    cudaMemcpy(ref.data(), o, n * 4, cudaMemcpyDeviceToHost);
    cudaMemset(o, 0, n * 4);
    repeat_bulk_v8<<<rows / 4, 128, x_row * 16>>>(X, RO, x_rows, x_row, rr, rc, 4);
    cudaMemcpy(got.data(), o, n * 4, cudaMemcpyDeviceToHost);
    printf("  bulk v8 %s\n", ref == got ? "matches" : "MISMATCH");
    cudaMemset(o, 0, n * 4);
    repeat_bulk_v9<<<x_rows, 128, x_row * 16>>>(X, RO, x_rows, x_row, rr, rc);
    cudaMemcpy(got.data(), o, n * 4, cudaMemcpyDeviceToHost);
    printf("  bulk v9 %s\n", ref == got ? "matches" : "MISMATCH");
  }
  report("write-only 256MB (stcs)", time_ms([&] { write_only<<<(nv + 255) / 256, 256>>>(RO, nv); }), rep_floor);
  report("write-only 256MB U=4 (stcs)", time_ms([&] { write_only_u<4><<<(nv + 1023) / 1024, 256>>>(RO, nv); }), rep_floor);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  return 0;
}
