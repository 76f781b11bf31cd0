// GPU self-check of the tensor-core conv2d path (cpp/cuda/conv/implicit_gemm*.cu), independent of the FFI
// handlers and of jax: for a set of problems it runs every pass through implicit_gemm_conv2d() and
// compares with a direct float64 reference computed on the GPU from the same (rounded) inputs,
// checks that outputs are bitwise identical across runs with different scratch garbage, that the
// expected problems are declined, and times the benchmark shapes.
//
// What it prints, per problem, pass and math mode:
//   ok   <problem> <pass> <mode> scratch <MiB>  max rel err <e> (tol <t>)      (or FAIL ...)
// and with timing (the default), once at the start, the floor for memory-bound kernels:
//   copy 1 GiB device-to-device: <ms> ms = <GB/s> GB/s read+write (median of 11)
// then for each benchmark shape, pass and mode, the whole pass and its steps (implicit_gemm.h's
// implicit_gemm_steps: the same launches as implicit_gemm_conv2d, restricted to one step):
//   time   <label> <ms> ms (median of 11 x 20 back-to-back)                       whole pass
//   layout <label> in  <ms> ms warm, <ms> ms cold L2 (<what>): <MB> MB = <x> x copy time
//   layout <label> out <ms> ms warm, <ms> ms cold L2 (<what>): <MB> MB = <x> x copy time
//   layout <label> cutlass <ms> ms; layout in+out <ms> ms = <%> of the pass (steps sum <ms> ms)
// "in" is the launch before the CUTLASS kernels (NCHW -> NHWC transposes of x or dy, weight
// transform), "out" the one after (NHWC -> NCHW transpose of y or dx, wgrad reduction of the
// split-K or per-image partials); a step the pass does not have prints "none" (the 1x1 GEMM route
// runs on NCHW as is). "warm" is the median of 11 x 20 back-to-back launches of the step alone, so
// its operands may stay in L2 between launches (a lower bound of its cost inside the pass);
// "cold L2" the median of 11 single launches each after reading a buffer of 4x the L2 size (an
// upper bound). MB are the bytes the step's kernel reads plus writes (implicit_gemm_layout_info),
// "copy time" those bytes at the measured copy bandwidth, the floor for that much data movement;
// the % uses the warm times.
//
// Build and run (GPU machine, from the repository root):
//   tools/build_inplace.sh && cmake --build build/inplace --target implicit_gemm_check &&
//   build/inplace/implicit_gemm_check            # add --no-timing to skip the benchmark shapes
// Exit status 0 when every check passes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "conv/implicit_gemm.h"
#include "conv_reference.cuh"
#include "jax_kernels/conv.h"
#include "jax_kernels/scalar.h"

using namespace jax_kernels;

namespace {

#define CHECK_CUDA(call)                                                              \
  do {                                                                                \
    cudaError_t error_ = (call);                                                      \
    if (error_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(error_)); \
      std::exit(2);                                                                   \
    }                                                                                 \
  } while (0)

ConvProblem make_problem(int64_t N, int64_t C, int64_t H, int64_t W, int64_t K, int64_t R,
                         int64_t S, int64_t stride = 1, int64_t pad = 0, int64_t dilation = 1,
                         int64_t groups = 1, int64_t extra_bottom_right_pad = 0) {
  ConvProblem p{};
  p.N = N, p.C = C, p.H = H, p.W = W, p.K = K, p.R = R, p.S = S;
  p.stride_h = p.stride_w = stride;
  p.pad_top = p.pad_left = pad;
  p.dilation_h = p.dilation_w = dilation;
  p.groups = groups;
  p.P = (H + 2 * pad + extra_bottom_right_pad - dilation * (R - 1) - 1) / stride + 1;
  p.Q = (W + 2 * pad + extra_bottom_right_pad - dilation * (S - 1) - 1) / stride + 1;
  return p;
}

// ---- host data ---------------------------------------------------------------------------------

int64_t element_bytes(ConvDtype d) { return d == ConvDtype::kFloat32 ? 4 : 2; }

uint64_t rng_state = 0x9E3779B97F4A7C15ull;
double uniform() {  // [-1, 1), xorshift: reproducible on every platform
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return double(rng_state >> 11) / double(1ull << 52) - 1.0;
}

// A device tensor in the test dtype plus its exact float64 values.
struct Tensor {
  int64_t count = 0;
  void* data = nullptr;        // test dtype
  double* exact = nullptr;     // the same values in float64
  std::vector<double> host;
};

void upload(Tensor* t, ConvDtype dtype) {
  const int64_t eb = element_bytes(dtype);
  std::vector<uint8_t> bytes(t->count * eb);
  for (int64_t i = 0; i < t->count; ++i) {
    double v = uniform();
    if (dtype == ConvDtype::kFloat32) {
      const float f = float(v);
      std::memcpy(&bytes[i * 4], &f, 4);
      v = f;
    } else if (dtype == ConvDtype::kBFloat16) {
      const bfloat16 h = to_bfloat16(float(v));
      std::memcpy(&bytes[i * 2], &h.bits, 2);
      v = to_float(h);
    } else {
      const float16 h = to_float16(float(v));
      std::memcpy(&bytes[i * 2], &h.bits, 2);
      v = to_float(h);
    }
    t->host[i] = v;
  }
  CHECK_CUDA(cudaMemcpy(t->data, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(t->exact, t->host.data(), t->count * 8, cudaMemcpyHostToDevice));
}

Tensor make_tensor(int64_t count, ConvDtype dtype, bool fill) {
  Tensor t;
  t.count = count;
  t.host.resize(count);
  CHECK_CUDA(cudaMalloc(&t.data, count * element_bytes(dtype)));
  CHECK_CUDA(cudaMalloc(&t.exact, count * 8));
  if (fill) upload(&t, dtype);
  return t;
}

void release(Tensor& t) {
  cudaFree(t.data);
  cudaFree(t.exact);
}

std::vector<double> download(const void* data, int64_t count, ConvDtype dtype) {
  const int64_t eb = element_bytes(dtype);
  std::vector<uint8_t> bytes(count * eb);
  CHECK_CUDA(cudaMemcpy(bytes.data(), data, bytes.size(), cudaMemcpyDeviceToHost));
  std::vector<double> out(count);
  for (int64_t i = 0; i < count; ++i) {
    if (dtype == ConvDtype::kFloat32) {
      float f;
      std::memcpy(&f, &bytes[i * 4], 4);
      out[i] = f;
    } else {
      uint16_t bits;
      std::memcpy(&bits, &bytes[i * 2], 2);
      out[i] = dtype == ConvDtype::kBFloat16 ? to_float(bfloat16{bits}) : to_float(float16{bits});
    }
  }
  return out;
}

// Largest error relative to the largest reference magnitude: inputs are exact in both, so this
// measures the rounding of the products (TF32), of the accumulation and of the output.
double tolerance(ConvDtype dtype, ConvPrecision precision) {
  switch (dtype) {
    case ConvDtype::kBFloat16: return 1e-2;
    case ConvDtype::kFloat16: return 2e-3;
    default: return precision == ConvPrecision::kHighest ? 2e-5 : 5e-3;
  }
}

const char* dtype_label(ConvDtype d, ConvPrecision p) {
  switch (d) {
    case ConvDtype::kFloat16: return "f16";
    case ConvDtype::kBFloat16: return "bf16";
    case ConvDtype::kFloat32: return p == ConvPrecision::kHighest ? "f32-highest" : "f32-tf32";
    default: return "f64";
  }
}

const char* pass_label(ConvPass pass) {
  return pass == ConvPass::kForward ? "fwd" : pass == ConvPass::kBackwardData ? "dgrad" : "wgrad";
}

// Passes the tensor-core path is expected to take, as bits (1 << int(ConvPass)).
constexpr unsigned kAllPasses = 7, kNoPasses = 0;
constexpr unsigned kForwardAndWgrad = 5;

struct Case {
  std::string name;
  ConvProblem problem;
  bool bias;
  unsigned taken_passes;
  bool time_it;
};

int failures = 0;

// ---- timing -----------------------------------------------------------------------------------

// Reads a buffer larger than L2 so that the next kernel starts with its operands in DRAM only
// (reads leave no dirty lines whose write-back would land in the timed kernel).
__global__ void flush_l2_kernel(const int4* data, int64_t count, int* sink) {
  int acc = 0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int4 v = data[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x7FEDCBA9) *sink = acc;  // never true in practice; keeps the loads
}

struct TimingSetup {
  double copy_bytes_per_ms = 0.0;  // read + write bytes of a device-to-device copy per ms
  int4* flush = nullptr;
  int64_t flush_count = 0;
  int* sink = nullptr;
  int flush_blocks = 0;
};
TimingSetup timing_setup;

constexpr int kRepeats = 11;
constexpr int kBackToBack = 20;

// Median over kRepeats of the time of one launch(): warm, kBackToBack launches between two events;
// cold, a single launch after the L2 flush.
template <class F>
float median_ms(cudaStream_t stream, F&& launch, bool cold) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> samples;
  for (int rep = 0; rep < kRepeats; ++rep) {
    if (cold)
      flush_l2_kernel<<<timing_setup.flush_blocks, 256, 0, stream>>>(
          timing_setup.flush, timing_setup.flush_count, timing_setup.sink);
    const int launches = cold ? 1 : kBackToBack;
    CHECK_CUDA(cudaEventRecord(start, stream));
    for (int i = 0; i < launches; ++i) launch();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    samples.push_back(ms / launches);
  }
  CHECK_CUDA(cudaGetLastError());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(samples.begin(), samples.end());
  return samples[kRepeats / 2];
}

// The copy bandwidth (1 GiB device to device, read + write counted) and the L2 flush buffer.
void set_up_timing(const cudaDeviceProp& prop) {
  const int64_t copy_bytes = int64_t(1) << 30;
  void *src = nullptr, *dst = nullptr;
  CHECK_CUDA(cudaMalloc(&src, copy_bytes));
  CHECK_CUDA(cudaMalloc(&dst, copy_bytes));
  CHECK_CUDA(cudaMemset(src, 0x3C, copy_bytes));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  auto copy = [&]() {
    CHECK_CUDA(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, stream));
  };
  copy();  // warm-up
  float ms = 0;
  {
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    std::vector<float> samples;
    for (int rep = 0; rep < kRepeats; ++rep) {
      CHECK_CUDA(cudaEventRecord(start, stream));
      copy();
      CHECK_CUDA(cudaEventRecord(stop, stream));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float t = 0;
      CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
      samples.push_back(t);
    }
    std::sort(samples.begin(), samples.end());
    ms = samples[kRepeats / 2];
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  timing_setup.copy_bytes_per_ms = 2.0 * double(copy_bytes) / ms;
  std::printf("copy 1 GiB device-to-device: %.4f ms = %.0f GB/s read+write (median of %d)\n", ms,
              timing_setup.copy_bytes_per_ms / 1e6, kRepeats);
  cudaStreamDestroy(stream);
  cudaFree(src);
  cudaFree(dst);

  const int64_t flush_bytes = std::max<int64_t>(4 * int64_t(prop.l2CacheSize), 64 << 20);
  timing_setup.flush_count = flush_bytes / int64_t(sizeof(int4));
  CHECK_CUDA(cudaMalloc(&timing_setup.flush, flush_bytes));
  CHECK_CUDA(cudaMemset(timing_setup.flush, 0x11, flush_bytes));
  CHECK_CUDA(cudaMalloc(&timing_setup.sink, sizeof(int)));
  timing_setup.flush_blocks = 4 * prop.multiProcessorCount;
}

void fail(const std::string& what) {
  std::printf("  FAIL %s\n", what.c_str());
  ++failures;
}

// Times the steps of one pass apart (implicit_gemm_steps) and prints the "layout" lines described
// at the top. The scratch holds what the whole pass left there, so every step reads real data.
void time_steps(const char* label, const ConvQuery& query, cudaStream_t stream, const void* a,
                const void* b, const void* bias, void* out, void* scratch, int64_t scratch_bytes,
                float pass_ms) {
  ImplicitGemmLayoutInfo info;
  if (!implicit_gemm_layout_info(query, bias != nullptr, &info)) {
    fail(std::string(label) + ": no layout info");
    return;
  }
  auto step_launch = [&](unsigned steps) {
    return [=]() {
      implicit_gemm_steps(stream, query, a, b, bias, out, scratch, scratch_bytes, steps);
    };
  };
  for (unsigned steps : {unsigned(kImplicitGemmLayoutIn), unsigned(kImplicitGemmCutlass),
                         unsigned(kImplicitGemmLayoutOut)}) {
    const ffi::Error error =
        implicit_gemm_steps(stream, query, a, b, bias, out, scratch, scratch_bytes, steps);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    if (error.failure()) {
      fail(std::string(label) + ": step " + std::to_string(steps) + ": " + error.message());
      return;
    }
  }
  float layout_ms = 0.0f;
  auto layout_line = [&](const char* which, unsigned step, int launches, int64_t bytes,
                         const char* what) {
    if (launches == 0) {
      std::printf("  layout %s %-3s none (%s)\n", label, which,
                  info.nhwc_route ? "NHWC route" : "GEMM route on NCHW as is, or im2col route");
      return;
    }
    const float warm = median_ms(stream, step_launch(step), false);
    const float cold = median_ms(stream, step_launch(step), true);
    layout_ms += warm;
    const double copy_ms = double(bytes) / timing_setup.copy_bytes_per_ms;
    std::printf("  layout %s %-3s %.4f ms warm, %.4f ms cold L2 (%s): %.2f MB = %.2f x copy time\n",
                label, which, warm, cold, what, bytes / 1e6, warm / copy_ms);
  };
  layout_line("in", kImplicitGemmLayoutIn, info.in_launches, info.in_bytes, info.in_what);
  layout_line("out", kImplicitGemmLayoutOut, info.out_launches, info.out_bytes, info.out_what);
  const float cutlass_ms = median_ms(stream, step_launch(kImplicitGemmCutlass), false);
  std::printf(
      "  layout %s cutlass (%s) %.4f ms; layout in+out %.4f ms = %.1f%% of the pass (steps sum "
      "%.4f ms)\n",
      label, info.sm90 ? "sm90" : "sm80", cutlass_ms, layout_ms, 100.0 * layout_ms / pass_ms, layout_ms + cutlass_ms);
}

void run_case(const Case& c, ConvPass pass, ConvDtype dtype, ConvPrecision precision,
              bool timing) {
  const ConvProblem& p = c.problem;
  const ConvQuery query{pass, dtype, precision, p};
  const int64_t scratch_bytes = implicit_gemm_scratch_bytes(query);
  char label[256];
  std::snprintf(label, sizeof label, "%-34s %-5s %-11s", c.name.c_str(), pass_label(pass),
                dtype_label(dtype, precision));
  const bool expect_taken = (c.taken_passes >> int(pass) & 1) && dtype != ConvDtype::kFloat64;
  if (!expect_taken) {
    if (scratch_bytes >= 0) fail(std::string(label) + ": expected to be declined");
    else std::printf("  ok   %s declined as expected\n", label);
    return;
  }
  if (scratch_bytes < 0) {
    fail(std::string(label) + ": declined");
    return;
  }

  const int64_t Cg = p.C / p.groups;
  const int64_t x_count = p.N * p.C * p.H * p.W, y_count = p.N * p.K * p.P * p.Q;
  const int64_t w_count = p.K * Cg * p.R * p.S;
  const bool with_bias = pass == ConvPass::kForward && c.bias;
  Tensor a = make_tensor(pass == ConvPass::kForward ? x_count : y_count, dtype, true);
  Tensor b = make_tensor(pass == ConvPass::kBackwardWeight ? x_count : w_count, dtype, true);
  Tensor bias = make_tensor(with_bias ? p.K : 0, dtype, with_bias);
  const int64_t out_count =
      pass == ConvPass::kForward ? y_count : pass == ConvPass::kBackwardData ? x_count : w_count;
  Tensor out = make_tensor(out_count, dtype, false);
  const int64_t eb = element_bytes(dtype);

  // The scratch base is deliberately off the allocation's alignment (XLA only promises element
  // alignment, the path must realign).
  char* scratch_alloc = nullptr;
  CHECK_CUDA(cudaMalloc(&scratch_alloc, scratch_bytes + 16));
  char* scratch = scratch_alloc + 16;
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));

  auto launch = [&]() {
    return implicit_gemm_conv2d(stream, query, a.data, b.data, with_bias ? bias.data : nullptr, out.data,
                        scratch, scratch_bytes);
  };
  std::vector<std::vector<uint8_t>> runs;
  for (int run = 0; run < 2; ++run) {
    // Unwritten outputs would show as NaN (0xFF bytes); stale scratch must not leak in.
    CHECK_CUDA(cudaMemset(out.data, 0xFF, out_count * eb));
    CHECK_CUDA(cudaMemset(scratch_alloc, run == 0 ? 0x7F : 0xA5, scratch_bytes + 16));
    const ffi::Error error = launch();
    CHECK_CUDA(cudaStreamSynchronize(stream));
    CHECK_CUDA(cudaGetLastError());
    if (error.failure()) {
      fail(std::string(label) + ": " + error.message());
      break;
    }
    runs.emplace_back(out_count * eb);
    CHECK_CUDA(cudaMemcpy(runs.back().data(), out.data, out_count * eb, cudaMemcpyDeviceToHost));
  }

  if (runs.size() == 2) {
    double* reference = nullptr;
    CHECK_CUDA(cudaMalloc(&reference, out_count * 8));
    const int threads = 128;
    const unsigned blocks = unsigned((out_count + threads - 1) / threads);
    if (pass == ConvPass::kForward)
      conv_reference::forward<<<blocks, threads>>>(a.exact, b.exact,
                                                   with_bias ? bias.exact : nullptr, reference, p);
    else if (pass == ConvPass::kBackwardData)
      conv_reference::dgrad<<<blocks, threads>>>(a.exact, b.exact, reference, p);
    else
      conv_reference::wgrad<<<blocks, threads>>>(a.exact, b.exact, reference, p);
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<double> expected(out_count);
    CHECK_CUDA(cudaMemcpy(expected.data(), reference, out_count * 8, cudaMemcpyDeviceToHost));
    cudaFree(reference);
    const std::vector<double> got = download(out.data, out_count, dtype);
    double max_ref = 0.0, max_err = 0.0;
    int64_t bad = 0;
    for (int64_t i = 0; i < out_count; ++i) {
      max_ref = std::max(max_ref, std::fabs(expected[i]));
      const double err = std::fabs(got[i] - expected[i]);
      if (!(err <= max_err)) max_err = std::isnan(err) ? INFINITY : err;
      if (std::isnan(got[i])) ++bad;
    }
    const double relative = max_err / std::max(max_ref, 1e-30);
    const bool bitwise = runs[0] == runs[1];
    const bool ok = bad == 0 && relative <= tolerance(dtype, precision) && bitwise;
    char line[512];
    std::snprintf(line, sizeof line, "%s scratch %8.2f MiB  max rel err %.2e (tol %.0e)%s%s",
                  label, scratch_bytes / 1048576.0, relative, tolerance(dtype, precision),
                  bitwise ? "" : "  NOT BITWISE REPRODUCIBLE",
                  bad ? "  NaN (unwritten) outputs" : "");
    if (ok) std::printf("  ok   %s\n", line);
    else fail(line);
  }

  if (timing && c.time_it && runs.size() == 2) {
    const float pass_ms = median_ms(stream, launch, false);
    std::printf("  time %s %.4f ms (median of %d x %d back-to-back)\n", label, pass_ms, kRepeats,
                kBackToBack);
    time_steps(label, query, stream, a.data, b.data, with_bias ? bias.data : nullptr, out.data,
               scratch, scratch_bytes, pass_ms);
  }

  cudaStreamDestroy(stream);
  cudaFree(scratch_alloc);
  release(a);
  release(b);
  release(bias);
  release(out);
}

}  // namespace

int main(int argc, char** argv) {
  const bool timing = !(argc > 1 && std::string(argv[1]) == "--no-timing");
  int device = 0;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf("implicit_gemm_check on %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  if (timing) set_up_timing(prop);

  const std::vector<Case> cases = {
      // name, problem, bias, passes taken, time_it
      {"3x3 64->64 N2 16x16 (nhwc narrow)", make_problem(2, 64, 16, 16, 64, 3, 3, 1, 1), true,
       kAllPasses, false},
      {"1x1 256->64 N20 8x8 (gemm)", make_problem(20, 256, 8, 8, 64, 1, 1), true, kAllPasses,
       false},
      {"1x1 64->256 N2 8x8 (gemm wide)", make_problem(2, 64, 8, 8, 256, 1, 1), true, kAllPasses,
       false},
      {"1x1 64->128 s2 N2 14x14", make_problem(2, 64, 14, 14, 128, 1, 1, 2), false, kAllPasses,
       false},
      {"1x1 72->40 N3 7x7 (pixels % 8 != 0)", make_problem(3, 72, 7, 7, 40, 1, 1), true,
       kAllPasses, false},
      {"3x3 32->96 s2 p1 N2 15x15", make_problem(2, 32, 15, 15, 96, 3, 3, 2, 1), true, kAllPasses,
       false},
      {"3x3 128->256 N2 8x8 (wide)", make_problem(2, 128, 8, 8, 256, 3, 3, 1, 1), true, kAllPasses,
       false},
      {"7x7 3->17 s2 p3 N2 20x20 (odd ch)", make_problem(2, 3, 20, 20, 17, 7, 7, 2, 3), true,
       kAllPasses, false},
      {"3x3 64->96 g2 d2 p2 N2 12x12", make_problem(2, 64, 12, 12, 96, 3, 3, 1, 2, 2, 2), true,
       kAllPasses, false},
      {"4x4 24->40 same (asymmetric pad)", make_problem(2, 24, 10, 10, 40, 4, 4, 1, 1, 1, 1, 1),
       true, kAllPasses, false},
      {"3x3 64->64 N8 28x28 (many split-K)", make_problem(8, 64, 28, 28, 64, 3, 3, 1, 1), false,
       kAllPasses, false},
      {"1x3 16->16 N1 5x9", make_problem(1, 16, 5, 9, 16, 1, 3), false, kAllPasses, false},
      {"3x3 32->32 s2 d2 (dgrad declined)", make_problem(2, 32, 12, 12, 32, 3, 3, 2, 2, 2), false,
       kForwardAndWgrad, false},
      {"1x1 16->24 p1 (dgrad declined)", make_problem(2, 16, 6, 6, 24, 1, 1, 1, 1), false,
       kForwardAndWgrad, false},
      {"depthwise 3x3 C32 (declined)", make_problem(2, 32, 8, 8, 32, 3, 3, 1, 1, 1, 32), false,
       kNoPasses, false},
      // The benchmark shapes (also timed).
      {"bench 3x3 64->64 N32 56x56", make_problem(32, 64, 56, 56, 64, 3, 3, 1, 1), false,
       kAllPasses, true},
      {"bench 1x1 256->64 N32 56x56", make_problem(32, 256, 56, 56, 64, 1, 1), false, kAllPasses,
       true},
  };
  const ConvPass passes[] = {ConvPass::kForward, ConvPass::kBackwardData, ConvPass::kBackwardWeight};
  struct Mode {
    ConvDtype dtype;
    ConvPrecision precision;
  };
  const Mode modes[] = {{ConvDtype::kBFloat16, ConvPrecision::kDefault},
                        {ConvDtype::kFloat16, ConvPrecision::kDefault},
                        {ConvDtype::kFloat32, ConvPrecision::kDefault},
                        {ConvDtype::kFloat32, ConvPrecision::kHighest},
                        {ConvDtype::kFloat64, ConvPrecision::kDefault}};
  for (const Case& c : cases) {
    std::printf("%s\n", c.name.c_str());
    for (const Mode& m : modes)
      for (ConvPass pass : passes) run_case(c, pass, m.dtype, m.precision, timing);
  }
  std::printf(failures ? "%d FAILURES\n" : "all checks passed\n", failures);
  return failures ? 1 : 0;
}
