// CPU threading for the kernels: a static partition of [0, n) over OpenMP threads. Every index
// is handled by exactly one thread with a fixed amount of work, so results never depend on the
// thread count or on scheduling.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace jax_kernels {

// Calls body(begin, end) on disjoint chunks covering [0, n). Runs serially when the work is
// below `grain` items, where thread start-up would cost more than it saves.
template <class Body>
void parallel_for(int64_t n, int64_t grain, Body&& body) {
  if (n <= 0) return;
#if defined(_OPENMP)
  const int64_t max_threads = omp_get_max_threads();
  const int64_t threads = std::min<int64_t>(max_threads, std::max<int64_t>(1, n / std::max<int64_t>(grain, 1)));
  if (threads > 1) {
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
      const int64_t t = omp_get_thread_num();
      const int64_t nt = omp_get_num_threads();
      const int64_t begin = n * t / nt;
      const int64_t end = n * (t + 1) / nt;
      if (begin < end) body(begin, end);
    }
    return;
  }
#endif
  body(int64_t{0}, n);
}

}  // namespace jax_kernels
