// The machine's read bandwidth, the bound of plain decoding (every weight is read once a token): sums a 2 GiB
// array with all threads (OMP_NUM_THREADS), best of 5 passes. Build and run: scripts/read-bandwidth.sh
//
// Each thread sums into four independent vector accumulators and reduces them once at its end. A loop that
// reduced every 64-byte vector to a scalar (about a dozen instructions, four of them shuffles) read 21.8-23.0
// GB/s on a 2-core Xeon (AVX-512, 2026-12-05) where this loop reads 28.7-29.4: with more instructions per line
// the core keeps fewer loads in flight, and a server core's bandwidth is bound by how many it keeps.
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <omp.h>
#include <immintrin.h>

#ifdef __AVX512F__
typedef __m512i vec;
#define LANES 8
#define ZERO() _mm512_setzero_si512()
#define ADD(a, b) _mm512_add_epi64(a, b)
#define LOAD(p) _mm512_load_si512((const void *)(p))
static uint64_t reduce(vec v) { return (uint64_t)_mm512_reduce_add_epi64(v); }
#else
typedef __m256i vec;
#define LANES 4
#define ZERO() _mm256_setzero_si256()
#define ADD(a, b) _mm256_add_epi64(a, b)
#define LOAD(p) _mm256_load_si256((const void *)(p))
static uint64_t reduce(vec v) {
  return (uint64_t)_mm256_extract_epi64(v, 0) + (uint64_t)_mm256_extract_epi64(v, 1) +
         (uint64_t)_mm256_extract_epi64(v, 2) + (uint64_t)_mm256_extract_epi64(v, 3);
}
#endif

int main() {
  size_t n = (size_t)2 << 30;
  size_t words = n / 8;
  uint64_t *a = aligned_alloc(64, n);
#pragma omp parallel for
  for (size_t i = 0; i < words; i++) a[i] = i;
  double best = 0;
  uint64_t total = 0;
  for (int pass = 0; pass < 5; pass++) {
    double t = omp_get_wtime();
    uint64_t s = 0;
#pragma omp parallel reduction(+ : s)
    {
      vec acc0 = ZERO(), acc1 = ZERO(), acc2 = ZERO(), acc3 = ZERO();
#pragma omp for
      for (size_t i = 0; i < words; i += 4 * LANES) {
        acc0 = ADD(acc0, LOAD(a + i));
        acc1 = ADD(acc1, LOAD(a + i + LANES));
        acc2 = ADD(acc2, LOAD(a + i + 2 * LANES));
        acc3 = ADD(acc3, LOAD(a + i + 3 * LANES));
      }
      s += reduce(ADD(ADD(acc0, acc1), ADD(acc2, acc3)));
    }
    t = omp_get_wtime() - t;
    total += s;
    double gbs = n / t / 1e9;
    if (gbs > best) best = gbs;
  }
  printf("read bandwidth, %d threads: %.1f GB/s (best of 5; checksum %llu)\n", omp_get_max_threads(), best,
         (unsigned long long)(total & 0xff));
}
