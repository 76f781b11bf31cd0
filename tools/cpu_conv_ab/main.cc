// cpu_conv_ab.sh's driver: loads the two builds (libold.so, libnew.so: pass.cc over two copies
// of cpp/cpu/conv.cc), calls them alternately, the order flipped every round, and prints the
// median ms per call of each, their ratio, the new build's GFLOP/s and the largest relative
// difference between their results (0 where the bits agree).
//
//   main PASS ROUNDS [NAME_FILTER]    PASS: wgrad or fwd, NCHW; wgrad-nhwc or fwd-nhwc, NHWC
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using Pass = double (*)(int, int, const int64_t*, int, float*, int64_t);

struct Shape {
  const char* name;
  int64_t dims[7];  // N, C, H (= W), K, R (= S), stride, padding
};

const Shape kShapes[] = {
    {"3x3 64->64 N8 28^2", {8, 64, 28, 64, 3, 1, 1}},
    {"1x1 256->64 N8 28^2", {8, 256, 28, 64, 1, 1, 0}},
    {"3x3/2 64->128 N8 56^2", {8, 64, 56, 128, 3, 2, 1}},
    {"1x1 64->256 N4 56^2", {4, 64, 56, 256, 1, 1, 0}},
    {"3x3 256->256 N8 14^2", {8, 256, 14, 256, 3, 1, 1}},
    {"7x7/2 3->64 N4 112^2", {4, 3, 112, 64, 7, 2, 3}},
};

Pass load(const char* library, const std::string& symbol) {
  void* handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    std::fprintf(stderr, "%s\n", dlerror());
    std::exit(1);
  }
  return reinterpret_cast<Pass>(dlsym(handle, symbol.c_str()));
}

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s wgrad|fwd[-nhwc] ROUNDS [NAME_FILTER]\n", argv[0]);
    return 2;
  }
  const std::string pass = argv[1];
  const int rounds = std::max(1, std::atoi(argv[2]));
  const int channels_last = pass.size() > 5 && pass.compare(pass.size() - 5, 5, "-nhwc") == 0;
  const std::string kind = channels_last ? pass.substr(0, pass.size() - 5) : pass;
  if (kind != "wgrad" && kind != "fwd") {
    std::fprintf(stderr, "pass: wgrad or fwd, optionally with -nhwc, not %s\n", pass.c_str());
    return 2;
  }
  const int forward = kind == "fwd";
  const Pass run[2] = {load("./libold.so", "old_pass"), load("./libnew.so", "new_pass")};
  for (const Shape& s : kShapes) {
    if (argc > 3 && std::strstr(s.name, argv[3]) == nullptr) continue;
    const int64_t* d = s.dims;
    const int64_t P = (d[2] + 2 * d[6] - d[4]) / d[5] + 1;
    const double flop = 2.0 * d[0] * d[1] * d[3] * d[4] * d[4] * P * P;
    const int reps = std::max(1, int(2e10 / flop));  // about 100-300 ms a round
    const int64_t size = 1 << 20;
    std::vector<float> result[2] = {std::vector<float>(size), std::vector<float>(size)};
    std::vector<double> ms[2];
    for (int r = 0; r < rounds; ++r)
      for (int i = 0; i < 2; ++i) {
        const int which = r % 2 ? 1 - i : i;
        ms[which].push_back(
            run[which](forward, channels_last, d, reps, result[which].data(), size));
      }
    double diff = 0;
    for (int64_t i = 0; i < size; ++i)
      diff = std::max(diff, std::fabs(double(result[0][i]) - result[1][i]) /
                                (1e-3 + std::fabs(double(result[0][i]))));
    for (auto& m : ms) std::sort(m.begin(), m.end());
    const double before = ms[0][rounds / 2], after = ms[1][rounds / 2];
    std::printf("%-24s %s old %8.3f new %8.3f ms  new/old %.3f  new %6.1f GFLOP/s  max rel diff %.1e\n",
                s.name, pass.c_str(), before, after, after / before, flop / after / 1e6, diff);
  }
}
