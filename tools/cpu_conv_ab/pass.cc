// One build of the CPU conv2d kernels for cpu_conv_ab.sh: includes a copy of cpp/cpu/conv.cc
// (CONV_SRC) and exports two timing entry points, named by PREFIX, that run the weight-gradient
// or forward pass on random f32 NCHW tensors, `reps` times after one warm-up call, and return
// the mean ms per call (the result is copied to `out` for the comparison of the two builds).
#include CONV_SRC

#include <chrono>
#include <cstdint>
#include <vector>

#define JK_AB_CAT2(a, b) a##b
#define JK_AB_CAT(a, b) JK_AB_CAT2(a, b)

namespace {

jax_kernels::ConvProblem problem(const int64_t* shape) {
  // shape: N, C, H (= W), K, R (= S), stride, padding
  jax_kernels::ConvProblem p{};
  p.N = shape[0], p.C = shape[1], p.H = p.W = shape[2], p.K = shape[3], p.R = p.S = shape[4];
  p.stride_h = p.stride_w = shape[5], p.pad_top = p.pad_left = shape[6];
  p.P = p.Q = (p.H + 2 * shape[6] - p.R) / shape[5] + 1;
  p.dilation_h = p.dilation_w = 1, p.groups = 1;
  return p;
}

void fill(std::vector<float>& v, uint32_t seed) {
  for (float& e : v) {
    seed = seed * 1664525u + 1013904223u;
    e = float(seed >> 8) / 16777216.0f - 0.5f;
  }
}

template <class F>
double time_ms(F&& f, int reps) {
  f();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
         reps;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) double JK_AB_CAT(PREFIX, _wgrad)(
    const int64_t* shape, int reps, float* out, int64_t out_size) {
  using namespace jax_kernels;
  const ConvProblem p = problem(shape);
  std::vector<float> x(p.N * p.C * p.H * p.W), dy(p.N * p.K * p.P * p.Q), dw(p.K * p.C * p.R * p.S);
  fill(x, 1), fill(dy, 2);
  const double ms = time_ms([&] { run_weight_gradient<float>(dy.data(), x.data(), dw.data(), p); },
                            reps);
  std::copy(dw.begin(), dw.begin() + std::min<int64_t>(out_size, int64_t(dw.size())), out);
  return ms;
}

extern "C" __attribute__((visibility("default"))) double JK_AB_CAT(PREFIX, _fwd)(
    const int64_t* shape, int reps, float* out, int64_t out_size) {
  using namespace jax_kernels;
  const ConvProblem p = problem(shape);
  std::vector<float> x(p.N * p.C * p.H * p.W), w(p.K * p.C * p.R * p.S), y(p.N * p.K * p.P * p.Q);
  fill(x, 1), fill(w, 2);
  const StencilPass<float> pass{x.data(), w.data(), nullptr, y.data(), p.N, p.groups,
                                p.channels_per_group(), p.filters_per_group(), forward_rows(p),
                                forward_cols(p), forward_weights(p), p.input_strides(),
                                p.output_strides()};
  const double ms = time_ms([&] { run_stencil_pass(pass); }, reps);
  std::copy(y.begin(), y.begin() + std::min<int64_t>(out_size, int64_t(y.size())), out);
  return ms;
}
