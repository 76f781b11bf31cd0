// Standalone GPU timing of the grid_sample forward kernel (cpp/cuda/grid_sample.cu) on the
// DESIGN.md section 8 cases, with CUDA events and no JAX dispatch, over launch shapes (channel
// slices per point). Correctness is the test suite's job; this only checks that every launch
// shape writes the same output as the default one. Not part of the build:
//   nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icpp/include -Icpp/cuda \
//        -isystem $(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") \
//        -o grid_sample_check scripts/grid_sample_check.cu
//   ./grid_sample_check [profile]   (profile: each case once with the default shape, for ncu)
#include "grid_sample.cu"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>


#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

namespace jax_kernels {
namespace check {

// The rotated, slightly zoomed grid with jitter of jax_kernels.bench._smooth_grid.
std::vector<float> smooth_grid(int n, int ho, int wo) {
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> jitter(-0.01f, 0.01f), turn(-0.3f, 0.3f), scale(0.9f, 1.1f);
  std::vector<float> grid(size_t(n) * ho * wo * 2);
  for (int b = 0; b < n; ++b) {
    const float angle = turn(rng), zoom = scale(rng);
    for (int i = 0; i < ho; ++i)
      for (int j = 0; j < wo; ++j) {
        const float y = -1 + 2.f * i / (ho - 1), x = -1 + 2.f * j / (wo - 1);
        float* at = &grid[((size_t(b) * ho + i) * wo + j) * 2];
        at[0] = zoom * (std::cos(angle) * x - std::sin(angle) * y) + jitter(rng);
        at[1] = zoom * (std::sin(angle) * x + std::cos(angle) * y) + jitter(rng);
      }
  }
  return grid;
}

template <class F>
float median_ms(F&& launch, int reps = 20, int rounds = 15) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 5; ++i) launch();
  CHECK(cudaDeviceSynchronize());
  std::vector<float> samples;
  for (int r = 0; r < rounds; ++r) {
    CHECK(cudaEventRecord(start));
    for (int i = 0; i < reps; ++i) launch();
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    samples.push_back(ms / reps);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

float copy_bandwidth_gbs() {
  const size_t bytes = size_t(1) << 30;
  void *a, *b;
  CHECK(cudaMalloc(&a, bytes));
  CHECK(cudaMalloc(&b, bytes));
  CHECK(cudaMemset(a, 1, bytes));
  const float ms = median_ms([&] { CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, 5, 7);
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  return 2.0f * bytes / (ms * 1e-3f) / 1e9f;
}

// The two backward passes of the same case (dout = the forward's output): d_grid over
// occupancy bounds, the deterministic d_input whole, over the gather's occupancy bound.
void backward(const GridSampleCall& forward_call, const float* in, const float* grid,
              const float* dout, int n, int c, int h, int w, bool profile, float bandwidth) {
  using Index = int32_t;
  constexpr GridSampleMode kMode = GridSampleMode::kBilinear;
  const size_t elements = size_t(n) * c * h * w, grid_elements = size_t(n) * h * w * 2;
  const double tensor_ms = elements * 4 / (bandwidth * 1e9) * 1e3;
  const double grid_ms = grid_elements * 4 / (bandwidth * 1e9) * 1e3;
  GridSampleCall call = forward_call;  // same geometry; dout is batched like the output
  call.dout_map = BatchMap{};
  const GridSampleGeometry& g = call.geometry;
  const PointLaunch launch = launch_over_points(g.batch * g.points, g.channels);
  float *d_grid, *d_input;
  CHECK(cudaMalloc(&d_grid, grid_elements * 4));
  CHECK(cudaMalloc(&d_input, elements * 4));
  const SortedLayout layout = sorted_layout(g.batch, g.points, 4, g.cells, 4);
  char* scratch;
  CHECK(cudaMalloc(&scratch, layout.total));
  auto d_input_with = [&](auto gather_blocks) {
    constexpr int kGather = decltype(gather_blocks)::value;
    const ffi::Error e = backward_input_sorted<float, uint32_t, Index, kMode, 2, kGather>(
        0, call, layout, dout, grid, d_input, scratch);
    if (e.failure()) {
      std::printf("d_input failed\n");
      std::exit(1);
    }
  };
  if (profile) {
    backward_grid_kernel<float, Index, kMode, 2><<<launch.grid, launch.block, 0, 0>>>(
        dout, in, grid, d_grid, call);
    d_input_with(std::integral_constant<int, 1>{});
    CHECK(cudaDeviceSynchronize());
  } else {
    // d_grid reads dout and input, writes the grid-sized result.
    const double grid_floor = 2 * tensor_ms + 2 * grid_ms;
    std::vector<float> first(grid_elements), again(grid_elements);
    auto d_grid_variant = [&](auto kernel, const char* name) {
      kernel<<<launch.grid, launch.block, 0, 0>>>(dout, in, grid, d_grid, call);
      CHECK(cudaGetLastError());
      CHECK(cudaMemcpy(again.data(), d_grid, grid_elements * 4, cudaMemcpyDeviceToHost));
      const float t = median_ms([&] {
        kernel<<<launch.grid, launch.block, 0, 0>>>(dout, in, grid, d_grid, call);
        CHECK(cudaGetLastError());
      });
      std::printf("  d_grid, %-22s %.4f ms (%.2fx floor)%s\n", name, t, t / grid_floor,
                  std::memcmp(first.data(), again.data(), grid_elements * 4) == 0
                      ? ""
                      : "  OUTPUT DIFFERS");
    };
    backward_grid_kernel<float, Index, kMode, 2><<<launch.grid, launch.block, 0, 0>>>(
        dout, in, grid, d_grid, call);
    CHECK(cudaMemcpy(first.data(), d_grid, grid_elements * 4, cudaMemcpyDeviceToHost));
    d_grid_variant(backward_grid_kernel<float, Index, kMode, 2>, "default:");
    d_grid_variant(backward_grid_kernel<float, Index, kMode, 2, 1>, "compiler's choice:");
    d_grid_variant(backward_grid_kernel<float, Index, kMode, 2, 6>, "6 blocks/SM:");
    d_grid_variant(backward_grid_kernel<float, Index, kMode, 2, 8>, "8 blocks/SM:");
    // d_input reads dout and the grid, writes the input-sized result.
    const double input_floor = 2 * tensor_ms + grid_ms;
    std::vector<float> d_first(elements), d_again(elements);
    d_input_with(std::integral_constant<int, 1>{});
    CHECK(cudaMemcpy(d_first.data(), d_input, elements * 4, cudaMemcpyDeviceToHost));
    auto d_input_variant = [&](auto gather_blocks, const char* name) {
      d_input_with(gather_blocks);
      CHECK(cudaMemcpy(d_again.data(), d_input, elements * 4, cudaMemcpyDeviceToHost));
      const float t = median_ms([&] { d_input_with(gather_blocks); });
      std::printf("  d_input, gather %-15s %.4f ms (%.2fx floor)%s\n", name, t, t / input_floor,
                  std::memcmp(d_first.data(), d_again.data(), elements * 4) == 0
                      ? ""
                      : "  OUTPUT DIFFERS");
    };
    d_input_variant(std::integral_constant<int, 1>{}, "default:");
    d_input_variant(std::integral_constant<int, 6>{}, "6 blocks/SM:");
    d_input_variant(std::integral_constant<int, 8>{}, "8 blocks/SM:");
  }
  CHECK(cudaFree(d_grid));
  CHECK(cudaFree(d_input));
  CHECK(cudaFree(scratch));
}

void run_case(int n, int c, int h, int w, bool profile, float bandwidth) {
  const int64_t in_dims[4] = {n, c, h, w}, grid_dims[4] = {n, h, w, 2}, out_dims[4] = {n, c, h, w};
  const DimsView operands[2] = {{in_dims, 4}, {grid_dims, 4}};
  const int64_t maps[4] = {1, 1, 1, 1};
  GridSampleCall call;
  const std::string problem =
      make_grid_sample_call(GridSamplePass::kForward, operands, 2, DimsView{out_dims, 4},
                            int64_t(GridSampleMode::kBilinear), int64_t(GridSamplePadding::kZeros),
                            false, maps, 4, &call);
  if (!problem.empty()) {
    std::printf("bad case: %s\n", problem.c_str());
    std::exit(1);
  }
  const size_t elements = size_t(n) * c * h * w;
  std::vector<float> host_in(elements);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> uniform(-1, 1);
  for (float& v : host_in) v = uniform(rng);
  const std::vector<float> host_grid = smooth_grid(n, h, w);
  float *in, *grid, *out, *reference;
  CHECK(cudaMalloc(&in, elements * 4));
  CHECK(cudaMalloc(&grid, host_grid.size() * 4));
  CHECK(cudaMalloc(&out, elements * 4));
  CHECK(cudaMalloc(&reference, elements * 4));
  CHECK(cudaMemcpy(in, host_in.data(), elements * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(grid, host_grid.data(), host_grid.size() * 4, cudaMemcpyHostToDevice));

  const int64_t points = int64_t(n) * h * w;
  const double floor_ms = (2.0 * elements * 4 + host_grid.size() * 4) / (bandwidth * 1e9) * 1e3;
  const PointLaunch chosen = launch_over_points(points, c);
  auto launch_with = [&](PointLaunch l, float* result) {
    forward_kernel<float, int32_t, GridSampleMode::kBilinear, 2>
        <<<l.grid, l.block, 0, 0>>>(in, grid, result, call);
    CHECK(cudaGetLastError());
  };
  launch_with(chosen, reference);
  CHECK(cudaDeviceSynchronize());
  if (profile) {
    backward(call, in, grid, reference, n, c, h, w, profile, bandwidth);
    return;
  }
  std::printf("grid_sample fwd N%d C%d %dx%d f32 bilinear zeros: floor %.4f ms, default slices %u\n",
              n, c, h, w, floor_ms, chosen.block.y);
  for (int slices : {1, 2, 4, 8}) {
    const int per_block = kThreads / slices;
    const PointLaunch l{dim3(grid_blocks(points, per_block)), dim3(per_block, slices)};
    CHECK(cudaMemset(out, 0xff, elements * 4));
    launch_with(l, out);
    std::vector<float> a(elements), b(elements);
    CHECK(cudaMemcpy(a.data(), out, elements * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(b.data(), reference, elements * 4, cudaMemcpyDeviceToHost));
    const bool same = std::memcmp(a.data(), b.data(), elements * 4) == 0;
    const float ms = median_ms([&] { launch_with(l, out); });
    std::printf("  slices %d: %.4f ms (%.2fx floor)%s\n", slices, ms, ms / floor_ms,
                same ? "" : "  OUTPUT DIFFERS");
    auto variant = [&](auto kernel, const char* name) {
      CHECK(cudaMemset(out, 0xff, elements * 4));
      kernel<<<l.grid, l.block, 0, 0>>>(in, grid, out, call);
      CHECK(cudaGetLastError());
      CHECK(cudaMemcpy(a.data(), out, elements * 4, cudaMemcpyDeviceToHost));
      const bool same = std::memcmp(a.data(), b.data(), elements * 4) == 0;
      const float t = median_ms([&] {
        kernel<<<l.grid, l.block, 0, 0>>>(in, grid, out, call);
        CHECK(cudaGetLastError());
      });
      std::printf("  slices %d, %-22s %.4f ms (%.2fx floor)%s\n", slices, name, t, t / floor_ms,
                  same ? "" : "  OUTPUT DIFFERS");
    };
    using Index = int32_t;
    constexpr GridSampleMode kMode = GridSampleMode::kBilinear;
    variant(forward_kernel<float, Index, kMode, 2, 1, 2>, "unroll 2:");
    variant(forward_kernel<float, Index, kMode, 2, 1, 4>, "unroll 4:");
    variant(forward_kernel<float, Index, kMode, 2, 1, 8>, "unroll 8:");
    variant(forward_kernel<float, Index, kMode, 2, 8, 2>, "8 blocks/SM, unroll 2:");
    variant(forward_kernel<float, Index, kMode, 2, 8, 4>, "8 blocks/SM, unroll 4:");
    variant(forward_kernel<float, Index, kMode, 2, 8, 8>, "8 blocks/SM, unroll 8:");
  }
  backward(call, in, grid, out, n, c, h, w, profile, bandwidth);
  CHECK(cudaFree(in));
  CHECK(cudaFree(grid));
  CHECK(cudaFree(out));
  CHECK(cudaFree(reference));
}

}  // namespace check
}  // namespace jax_kernels

using namespace jax_kernels::check;

int main(int argc, char** argv) {
  const bool profile = argc > 1 && std::strcmp(argv[1], "profile") == 0;
  const float bandwidth = profile ? 3000.f : copy_bandwidth_gbs();
  if (!profile) std::printf("copy bandwidth %.0f GB/s (read + write)\n", bandwidth);
  run_case(32, 64, 64, 64, profile, bandwidth);
  run_case(8, 256, 128, 128, profile, bandwidth);
  return 0;
}
