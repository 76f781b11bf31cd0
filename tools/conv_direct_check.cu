// Standalone GPU check of the direct conv2d kernels (cpp/cuda/conv/direct.h: the stencils of the
// forward and dgrad, the weight-gradient reductions), independent of the FFI handlers and of jax:
// correctness of the forward, dgrad and wgrad against a float64 reference over many geometries and
// every dtype, bitwise determinism of the wgrad, and CUDA-event timings of the depthwise 7x7
// benchmark case. A CMake target that links the kernels (built on request):
//   cmake --build <build dir> --target conv_direct_check && <build dir>/conv_direct_check
//   ./conv_direct_check [bench|profile]   (bench: the timings only; profile: each benchmark pass
//                                          once, for ncu)
// Exit status 0 when every check passes.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "conv/direct.h"
#include "conv_reference.cuh"
#include "jax_kernels/conv.h"

using namespace jax_kernels;

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e = (x);                                                                \
    if (e != cudaSuccess) {                                                             \
      printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));           \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

template <class T>
void forward(cudaStream_t stream, const T* x, const T* w, T* y, const ConvProblem& p) {
  ffi::Error e = run_stencil<T>(stream, "fwd", x, w, nullptr, y, forward_grid(p));
  if (e.failure()) printf("forward failed\n");
}

template <class T>
void dgrad(cudaStream_t stream, const T* dy, const T* w, T* dx, const ConvProblem& p) {
  ffi::Error e = run_stencil<T>(stream, "dgrad", dy, w, nullptr, dx, backward_data_grid(p));
  if (e.failure()) printf("dgrad failed\n");
}

template <class T>
void wgrad(cudaStream_t stream, const T* dy, const T* x, T* dw, const ConvProblem& p, void* scratch,
           int64_t bytes) {
  ffi::Error e = run_wgrad<T>(stream, dy, x, dw, p, scratch, bytes);
  if (e.failure()) printf("wgrad failed\n");
}

// ---- data ---------------------------------------------------------------------------------------

template <class T>
struct Buffer {
  T* device = nullptr;
  int64_t count = 0;
  explicit Buffer(int64_t n) : count(n) { CHECK(cudaMalloc(&device, std::max<int64_t>(n, 1) * sizeof(T))); }
  ~Buffer() { cudaFree(device); }
  void random(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    std::vector<T> h(count);
    for (auto& v : h) v = from_acc<T>(acc_t<T>(u(rng)));
    CHECK(cudaMemcpy(device, h.data(), count * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<double> host() const {
    std::vector<T> h(count);
    CHECK(cudaMemcpy(h.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost));
    std::vector<double> d(count);
    for (int64_t i = 0; i < count; ++i) d[i] = double(to_acc(h[i]));
    return d;
  }
  std::vector<unsigned char> bytes() const {
    std::vector<unsigned char> b(count * sizeof(T));
    CHECK(cudaMemcpy(b.data(), device, b.size(), cudaMemcpyDeviceToHost));
    return b;
  }
};

std::vector<double> host_doubles(const double* d, int64_t n) {
  std::vector<double> h(n);
  CHECK(cudaMemcpy(h.data(), d, n * sizeof(double), cudaMemcpyDeviceToHost));
  return h;
}

// max |got - want| / max |want|.
double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  double err = 0, scale = 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!(std::abs(got[i] - want[i]) <= err)) err = std::abs(got[i] - want[i]);  // NaN sticks
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / scale;
}

template <class T>
double tolerance() {
  if (std::is_same_v<T, double>) return 1e-12;
  if (std::is_same_v<T, float>) return 2e-6;
  return 1e-2;
}

ConvProblem problem(int64_t N, int64_t C, int64_t H, int64_t W, int64_t K, int64_t R, int64_t S,
                    int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                    int64_t dil_h, int64_t dil_w, int64_t groups) {
  ConvProblem p{N, C, H, W, K, R, S, 0, 0, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups};
  p.P = conv_output_extent(H, R, stride_h, pad_h, pad_h, dil_h);
  p.Q = conv_output_extent(W, S, stride_w, pad_w, pad_w, dil_w);
  return p;
}

int failures = 0;

template <class T>
void check(const char* name, const ConvProblem& p, cudaStream_t stream) {
  const int64_t Cg = p.channels_per_group();
  Buffer<T> x(p.N * p.C * p.H * p.W), w(p.K * Cg * p.R * p.S), dy(p.N * p.K * p.P * p.Q);
  Buffer<T> y(dy.count), dx(x.count), dw(w.count);
  x.random(1);
  w.random(2);
  dy.random(3);
  double* ref;
  const int64_t most = std::max({x.count, w.count, dy.count});
  CHECK(cudaMalloc(&ref, most * sizeof(double)));
  const int64_t scratch_bytes = std::max<int64_t>(wgrad_scratch_bytes<T>(p), 1);
  void* scratch;
  CHECK(cudaMalloc(&scratch, scratch_bytes));
  double errors[3];
  forward(stream, x.device, w.device, y.device, p);
  conv_reference::forward<<<1024, 256, 0, stream>>>(x.device, w.device,
                                                    static_cast<const T*>(nullptr), ref, p);
  CHECK(cudaStreamSynchronize(stream));
  errors[0] = relative_error(y.host(), host_doubles(ref, y.count));
  dgrad(stream, dy.device, w.device, dx.device, p);
  conv_reference::dgrad<<<1024, 256, 0, stream>>>(dy.device, w.device, ref, p);
  CHECK(cudaStreamSynchronize(stream));
  errors[1] = relative_error(dx.host(), host_doubles(ref, dx.count));
  wgrad(stream, dy.device, x.device, dw.device, p, scratch, scratch_bytes);
  conv_reference::wgrad<<<1024, 128, 0, stream>>>(dy.device, x.device, ref, p);
  CHECK(cudaStreamSynchronize(stream));
  errors[2] = relative_error(dw.host(), host_doubles(ref, dw.count));
  // Bitwise reproducibility of the wgrad.
  const auto first = dw.bytes();
  bool same = true;
  for (int i = 0; i < 3; ++i) {
    wgrad(stream, dy.device, x.device, dw.device, p, scratch, scratch_bytes);
    same = same && dw.bytes() == first;
  }
  CHECK(cudaGetLastError());
  const double tol = tolerance<T>();
  const bool ok = errors[0] <= tol && errors[1] <= tol && errors[2] <= tol && same;
  failures += !ok;
  printf("%-4s %-9s N%ld C%ld %ldx%ld K%ld %ldx%ld s%ld,%ld p%ld,%ld d%ld,%ld g%ld: fwd %.1e dgrad %.1e "
         "wgrad %.1e %s%s\n",
         ok ? "ok" : "FAIL", dtype_name<T>(), p.N, p.C, p.H, p.W, p.K, p.R, p.S, p.stride_h,
         p.stride_w, p.pad_top, p.pad_left, p.dilation_h, p.dilation_w, p.groups, errors[0],
         errors[1], errors[2], same ? "" : "NOT REPRODUCIBLE ", name);
  cudaFree(ref);
  cudaFree(scratch);
}

template <class F>
double time_ms(cudaStream_t stream, F&& launch) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> samples;
  for (int round = 0; round < 15; ++round) {
    CHECK(cudaEventRecord(a, stream));
    for (int i = 0; i < 20; ++i) launch();
    CHECK(cudaEventRecord(b, stream));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    samples.push_back(ms / 20);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

template <class T>
void benchmark(cudaStream_t stream, bool profile, double bandwidth) {
  const ConvProblem p = problem(32, 384, 56, 56, 384, 7, 7, 1, 1, 3, 3, 1, 1, 384);
  Buffer<T> x(p.N * p.C * p.H * p.W), w(p.K * p.R * p.S), dy(p.N * p.K * p.P * p.Q);
  Buffer<T> y(dy.count), dx(x.count), dw(w.count);
  x.random(4);
  w.random(5);
  dy.random(6);
  const int64_t scratch_bytes = wgrad_scratch_bytes<T>(p);
  void* scratch;
  CHECK(cudaMalloc(&scratch, scratch_bytes));
  auto f = [&] { forward(stream, x.device, w.device, y.device, p); };
  auto d = [&] { dgrad(stream, dy.device, w.device, dx.device, p); };
  auto g = [&] { wgrad(stream, dy.device, x.device, dw.device, p, scratch, scratch_bytes); };
  if (profile) {
    f();
    d();
    g();
    CHECK(cudaStreamSynchronize(stream));
  } else {
    const double floor_ms = double(x.count + dy.count) * sizeof(T) / bandwidth * 1e3;
    const double tf = time_ms(stream, f), td = time_ms(stream, d), tg = time_ms(stream, g);
    printf("depthwise 7x7 C384 N32 56x56 %-8s fwd %.4f ms (%.2fx floor)  dgrad %.4f (%.2fx)  "
           "wgrad %.4f (%.2fx)  floor %.4f\n",
           dtype_name<T>(), tf, tf / floor_ms, td, td / floor_ms, tg, tg / floor_ms, floor_ms);
  }
  CHECK(cudaGetLastError());
  cudaFree(scratch);
}

int main(int argc, char** argv) {
  const bool profile = argc > 1 && std::strcmp(argv[1], "profile") == 0;
  const bool timings_only = argc > 1 && std::strcmp(argv[1], "bench") == 0;
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  if (profile) {
    benchmark<float>(stream, true, 1);
    benchmark<bfloat16>(stream, true, 1);
    return 0;
  }
  // Copy bandwidth (read + write), as the bench's floor.
  const int64_t n = int64_t(1) << 28;
  float *a, *b;
  CHECK(cudaMalloc(&a, n * 4));
  CHECK(cudaMalloc(&b, n * 4));
  CHECK(cudaMemset(a, 0, n * 4));
  const double copy_ms =
      time_ms(stream, [&] { CHECK(cudaMemcpyAsync(b, a, n * 4, cudaMemcpyDeviceToDevice, stream)); });
  const double bandwidth = 2.0 * n * 4 / (copy_ms * 1e-3);
  printf("copy bandwidth %.0f GB/s\n", bandwidth / 1e9);
  cudaFree(a);
  cudaFree(b);
  benchmark<float>(stream, false, bandwidth);
  benchmark<bfloat16>(stream, false, bandwidth);
  benchmark<float16>(stream, false, bandwidth);
  if (timings_only) return 0;

  // (N, C, H, W, K, R, S, stride, pad, dilation, groups)
  const ConvProblem problems[] = {
      problem(2, 6, 12, 12, 6, 7, 7, 1, 1, 3, 3, 1, 1, 6),
      problem(2, 6, 14, 14, 6, 7, 7, 1, 1, 3, 3, 1, 1, 6),
      problem(2, 4, 16, 16, 4, 3, 3, 1, 1, 1, 1, 1, 1, 4),
      problem(1, 4, 9, 20, 4, 5, 5, 1, 1, 2, 2, 1, 1, 4),
      problem(2, 3, 10, 11, 6, 3, 3, 1, 1, 1, 1, 1, 1, 3),
      problem(2, 4, 12, 13, 12, 5, 5, 2, 2, 2, 2, 1, 1, 4),
      problem(2, 4, 17, 9, 4, 5, 5, 2, 1, 2, 0, 1, 1, 4),
      problem(2, 6, 10, 10, 6, 3, 3, 1, 1, 0, 0, 1, 1, 2),
      problem(2, 3, 7, 9, 4, 3, 3, 1, 1, 0, 0, 1, 1, 1),
      problem(1, 2, 70, 70, 2, 3, 3, 1, 1, 1, 1, 30, 30, 2),
      problem(3, 5, 56, 56, 5, 7, 7, 1, 1, 3, 3, 1, 1, 5),
      problem(3, 5, 28, 28, 10, 7, 7, 1, 1, 3, 3, 1, 1, 5),
      problem(4, 8, 14, 14, 8, 7, 7, 1, 1, 3, 3, 1, 1, 8),
      problem(5, 7, 7, 7, 7, 7, 7, 1, 1, 3, 3, 1, 1, 7),
      problem(2, 3, 64, 64, 3, 5, 5, 1, 1, 2, 2, 1, 1, 3),
      problem(2, 3, 100, 100, 3, 7, 7, 1, 1, 3, 3, 1, 1, 3),
      problem(1, 2, 130, 131, 2, 3, 3, 1, 1, 1, 1, 1, 1, 2),
      problem(2, 4, 33, 30, 4, 7, 7, 1, 1, 2, 4, 1, 1, 4),
      problem(2, 4, 20, 21, 4, 5, 5, 1, 1, 0, 0, 1, 1, 4),
      problem(2, 2, 9, 9, 2, 7, 7, 1, 1, 6, 6, 1, 1, 2),
      problem(1, 1, 300, 257, 1, 3, 3, 1, 1, 1, 1, 1, 1, 1),
      problem(40, 3, 8, 8, 3, 3, 3, 1, 1, 1, 1, 1, 1, 3),
      problem(2, 4, 24, 24, 4, 3, 3, 2, 2, 1, 1, 1, 1, 4),
      problem(2, 3, 64, 72, 3, 7, 7, 1, 1, 3, 3, 1, 1, 3),
      problem(1, 2, 70, 136, 2, 5, 5, 1, 1, 2, 2, 1, 1, 2),
      problem(2, 4, 32, 40, 8, 3, 3, 1, 1, 0, 1, 1, 1, 4),
      // Pipelined (source rows of whole 16-byte vectors) with output rows that are not: the
      // forward (rows of 58) and the dgrad (rows of 66) write some vectors element by element.
      problem(2, 3, 20, 64, 3, 7, 7, 1, 1, 0, 0, 1, 1, 3),
      problem(2, 3, 20, 66, 3, 3, 3, 1, 1, 0, 0, 1, 1, 3),
  };
  for (const ConvProblem& p : problems) {
    check<float>("", p, stream);
    check<bfloat16>("", p, stream);
    check<float16>("", p, stream);
    check<double>("", p, stream);
  }
  const ConvProblem bench = problem(32, 384, 56, 56, 384, 7, 7, 1, 1, 3, 3, 1, 1, 384);
  check<float>("(benchmark)", bench, stream);
  check<bfloat16>("(benchmark)", bench, stream);
  printf("%d failures\n", failures);
  return failures != 0;
}
