// The machine's read bandwidth, the bound of plain decoding (every weight is read once a token): sums a 2 GiB
// array with all threads (OMP_NUM_THREADS), best of 5 passes. Build and run: scripts/read-bandwidth.sh
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <omp.h>
#include <immintrin.h>
int main(){
  size_t n = (size_t)2<<30; size_t words = n/8;
  uint64_t *a = aligned_alloc(64, n);
  #pragma omp parallel for
  for (size_t i=0;i<words;i++) a[i]=i;
  double best=0; uint64_t total=0;
  for (int pass=0; pass<5; pass++){
    double t=omp_get_wtime(); uint64_t s=0;
#ifdef __AVX512F__
    #pragma omp parallel for reduction(+:s)
    for (size_t i=0;i<words;i+=8){ __m512i v=_mm512_load_si512((void*)(a+i)); s+= _mm512_reduce_add_epi64(v);}
#else
    // AVX2: lines summed into a vector per thread, reduced once (the loop stays bound by memory).
    #pragma omp parallel reduction(+:s)
    {
      __m256i acc=_mm256_setzero_si256();
      #pragma omp for
      for (size_t i=0;i<words;i+=8)
        acc=_mm256_add_epi64(acc,_mm256_add_epi64(_mm256_load_si256((void*)(a+i)), _mm256_load_si256((void*)(a+i+4))));
      s+= (uint64_t)_mm256_extract_epi64(acc,0)+(uint64_t)_mm256_extract_epi64(acc,1)
        +(uint64_t)_mm256_extract_epi64(acc,2)+(uint64_t)_mm256_extract_epi64(acc,3);
    }
#endif
    t=omp_get_wtime()-t; total+=s; double gbs=n/t/1e9; if(gbs>best)best=gbs;
  }
  printf("read bandwidth, %d threads: %.1f GB/s (best of 5; checksum %llu)\n", omp_get_max_threads(), best, (unsigned long long)(total&0xff));
}
