// One build of the CPU conv2d kernels for cpu_conv_ab.sh: includes a copy of cpp/cpu/conv.cc
// (CONV_SRC) and exports one timing entry point, <PREFIX>_pass, that runs the weight-gradient or
// forward pass on random f32 tensors (NCHW, or NHWC with HWIO weights where channels_last),
// `reps` times after one warm-up call, and returns the mean ms per call (the result is copied
// to `out` for the comparison of the two builds).
#include CONV_SRC

#include <chrono>
#include <cstdint>
#include <vector>

#define JK_AB_CAT2(a, b) a##b
#define JK_AB_CAT(a, b) JK_AB_CAT2(a, b)

namespace {

jax_kernels::ConvProblem problem(const int64_t* shape, bool channels_last) {
  // shape: N, C, H (= W), K, R (= S), stride, padding
  jax_kernels::ConvProblem p{};
  p.N = shape[0], p.C = shape[1], p.H = p.W = shape[2], p.K = shape[3], p.R = p.S = shape[4];
  p.stride_h = p.stride_w = shape[5], p.pad_top = p.pad_left = shape[6];
  p.P = p.Q = (p.H + 2 * shape[6] - p.R) / shape[5] + 1;
  p.dilation_h = p.dilation_w = 1, p.groups = 1;
  p.layout = channels_last ? jax_kernels::ConvLayout::kNHWC : jax_kernels::ConvLayout::kNCHW;
  return p;
}

void fill(std::vector<float>& v, uint32_t seed) {
  for (float& e : v) {
    seed = seed * 1664525u + 1013904223u;
    e = float(seed >> 8) / 16777216.0f - 0.5f;
  }
}

// Random operands a and b of the given sizes; run(a, b, result) timed `reps` times after one
// warm-up call; the result's first out_size elements copied to `out`.
template <class Run>
double measure(int64_t a_size, int64_t b_size, int64_t result_size, int reps, float* out,
               int64_t out_size, Run&& run) {
  std::vector<float> a(a_size), b(b_size), result(result_size);
  fill(a, 1), fill(b, 2);
  run(a.data(), b.data(), result.data());
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) run(a.data(), b.data(), result.data());
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
      reps;
  std::copy(result.begin(), result.begin() + std::min(out_size, result_size), out);
  return ms;
}

}  // namespace

// forward != 0: the forward pass (x, w -> y); else the weight gradient (x, dy -> dw).
extern "C" __attribute__((visibility("default"))) double JK_AB_CAT(PREFIX, _pass)(
    int forward, int channels_last, const int64_t* shape, int reps, float* out, int64_t out_size) {
  using namespace jax_kernels;
  const ConvProblem p = problem(shape, channels_last != 0);
  const int64_t x_size = p.N * p.C * p.H * p.W, w_size = p.K * p.C * p.R * p.S;
  const int64_t y_size = p.N * p.K * p.P * p.Q;
  if (forward)
    return measure(x_size, w_size, y_size, reps, out, out_size,
                   [&](const float* x, const float* w, float* y) {
                     run_stencil_pass(StencilPass<float>{
                         x, w, nullptr, y, p.N, p.groups, p.channels_per_group(),
                         p.filters_per_group(), forward_rows(p), forward_cols(p),
                         forward_weights(p), p.input_strides(), p.output_strides()});
                   });
  return measure(x_size, y_size, w_size, reps, out, out_size,
                 [&](const float* x, const float* dy, float* dw) {
                   run_weight_gradient<float>(dy, x, dw, p);
                 });
}
