// The CPU's float32 multiply-add throughput: 12 independent AVX-512 FMA chains per thread (enough
// to cover the FMA latency on two pipes), OpenMP threads, best of five. The peak that the CPU
// conv2d figures of docs/performance.md are set against.
//   gcc -O2 -mavx512f -fopenmp tools/cpu_fma_peak.c -o /tmp/cpu_fma_peak
//   OMP_NUM_THREADS=2 OMP_PROC_BIND=true /tmp/cpu_fma_peak
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>

int main(void) {
  const long iterations = 200000000;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const double start = omp_get_wtime();
    float sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
      __m512 chain[12];
      const __m512 b = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
      for (int i = 0; i < 12; ++i) chain[i] = _mm512_set1_ps((float)i);
      for (long i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; ++j) chain[j] = _mm512_fmadd_ps(chain[j], b, c);
      }
      for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(chain[i]);
    }
    const double seconds = omp_get_wtime() - start;
    const double rate = (double)iterations * 12 * 16 * omp_get_max_threads() / seconds;
    if (rate > best) best = rate;
    printf("round %d: %.1f G multiply-adds/s (%d threads; %g)\n", rep, rate / 1e9,
           omp_get_max_threads(), sink);
  }
  printf("best %.1f G float32 multiply-adds/s\n", best / 1e9);
  return 0;
}
