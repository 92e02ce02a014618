// The machine's read bandwidth, the bound of plain decoding (every weight is read once a token): sums an array
// of MiB mebibytes (the first argument, 2048 unless given) with all threads (OMP_NUM_THREADS), best of 5
// timings (each of enough passes to read 2 GiB). Build and run: scripts/read-bandwidth.sh [MiB]. A small array
// stays in the last-level cache, as a small model's weights do between tokens (SmolLM2's 98 MB on a CPU with
// more L3 than that): `read-bandwidth.sh 96` is the bound of such a model's step.
//
// Each thread sums into four independent vector accumulators and reduces them once at its end. A loop that
// reduced every 64-byte vector to a scalar (about a dozen instructions, four of them shuffles) read 21.8-23.9
// GB/s on a 2-core Xeon (AVX-512, 2026-12-05) where four accumulators read 27.5-29.6: with more instructions a line
// the core keeps fewer loads in flight, and a server core's bandwidth is bound by how many it keeps. Each line
// is also asked for 16 KiB ahead (`prefetcht0`), which raised both readings there (3 interleaved runs): from
// memory 29.8-30.0 GB/s against 29.0-29.6 without, from L3 (a 96 MiB array) 55.8-58.1 against 49.5-53.6.
//
// The array lies on 2 MiB pages where Linux grants them, as probespec's packed weights do (src/kernels/pages.rs):
// on 4 KiB pages every 4 KiB read is a TLB miss. On a 2-core EPYC Zen 4 (2026-12-05, 6 alternated runs) this loop
// read 57.8-61.2 GB/s on 2 MiB pages against 46.7-51.9 on 4 KiB ones, in a quiet hour; in a busy one the two met.
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <omp.h>
#include <immintrin.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

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

#define AHEAD (16384 / 8)

int main(int argc, char **argv) {
  size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 2048;
  if (mib == 0) {
    fprintf(stderr, "read-bandwidth: the size is a number of MiB above 0, not '%s'\n", argv[1]);
    return 2;
  }
  size_t n = mib << 20, words = n / 8;
  size_t repeats = mib >= 2048 ? 1 : 2048 / mib;
  // Room past the end for the prefetches' addresses (prefetching them is harmless, computing them is not).
  size_t huge = 2 << 20, bytes = (n + 8 * AHEAD + huge - 1) / huge * huge;
  uint64_t *a = aligned_alloc(huge, bytes);
  if (!a) {
    fprintf(stderr, "read-bandwidth: could not allocate %zu MiB\n", mib);
    return 1;
  }
#ifdef MADV_HUGEPAGE
  madvise(a, bytes, MADV_HUGEPAGE);  // refused where huge pages are off: then small pages, as before
#endif
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
      for (size_t r = 0; r < repeats; r++) {
#pragma omp for nowait
      for (size_t i = 0; i < words; i += 4 * LANES) {
        for (size_t line = 0; line < 4 * LANES; line += 8)
          _mm_prefetch((const char *)(a + i + AHEAD + line), _MM_HINT_T0);
        acc0 = ADD(acc0, LOAD(a + i));
        acc1 = ADD(acc1, LOAD(a + i + LANES));
        acc2 = ADD(acc2, LOAD(a + i + 2 * LANES));
        acc3 = ADD(acc3, LOAD(a + i + 3 * LANES));
      }
      }
      s += reduce(ADD(ADD(acc0, acc1), ADD(acc2, acc3)));
    }
    t = (omp_get_wtime() - t) / repeats;
    total += s;
    double gbs = n / t / 1e9;
    if (gbs > best) best = gbs;
  }
  printf("read bandwidth, %d threads: %.1f GB/s (%zu MiB, best of 5; checksum %llu)\n", omp_get_max_threads(),
         best, mib, (unsigned long long)(total & 0xff));
}
