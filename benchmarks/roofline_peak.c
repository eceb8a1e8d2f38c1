/* The CPU's arithmetic peak per core for each matrix-product instruction it has, measured:
   a loop of independent multiply-adds on registers only (no memory traffic), enough
   accumulators to hide each instruction's latency. benchmarks/roofline.py compiles this
   file with the system's C compiler and times each loop; it is a benchmark's probe, not
   one of starqa's kernels. Each function runs `iters` rounds of ACC instructions and
   returns a value computed from every accumulator, so that nothing is optimised away.

   FLOPs per instruction (an int8 product-add counted as 2 operations, as FLOPs are):
     avx512_bf16  vdpbf16ps zmm     16 lanes x 2 bf16 pairs x 2 = 64
     avx512_fp32  vfmadd231ps zmm   16 lanes x 2              = 32
     avx2_fp32    vfmadd231ps ymm    8 lanes x 2              = 16
     avx512_vnni  vpdpbusd zmm      16 lanes x 4 int8 pairs x 2 = 128
     avx2_vnni    vpdpbusd ymm       8 lanes x 4 int8 pairs x 2 = 64 */

#include <immintrin.h>

#define ACC 16

#define RUN(type, zero, op, reduce)                                       \
    type acc[ACC];                                                        \
    for (int j = 0; j < ACC; j++) acc[j] = zero;                          \
    for (long i = 0; i < iters; i++) {                                    \
        _Pragma("GCC unroll 16")                                          \
        for (int j = 0; j < ACC; j++) acc[j] = op;                        \
    }                                                                     \
    double total = 0;                                                     \
    for (int j = 0; j < ACC; j++) total += reduce(acc[j]);                \
    return total;

__attribute__((target("avx512f,avx512bf16"))) double peak_avx512_bf16(long iters) {
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = a; /* bf16 1.0 */
    __asm__ volatile("" : "+v"(a), "+v"(b));
    RUN(__m512, _mm512_setzero_ps(), _mm512_dpbf16_ps(acc[j], a, b), _mm512_reduce_add_ps)
}

__attribute__((target("avx512f"))) double peak_avx512_fp32(long iters) {
    __m512 a = _mm512_set1_ps(1e-9f), b = a;
    __asm__ volatile("" : "+v"(a), "+v"(b));
    RUN(__m512, _mm512_setzero_ps(), _mm512_fmadd_ps(a, b, acc[j]), _mm512_reduce_add_ps)
}

__attribute__((target("avx2,fma"))) static double sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

__attribute__((target("avx2,fma"))) double peak_avx2_fp32(long iters) {
    __m256 a = _mm256_set1_ps(1e-9f), b = a;
    __asm__ volatile("" : "+v"(a), "+v"(b));
    RUN(__m256, _mm256_setzero_ps(), _mm256_fmadd_ps(a, b, acc[j]), sum8)
}

__attribute__((target("avx512f,avx512vnni"))) double peak_avx512_vnni(long iters) {
    __m512i a = _mm512_set1_epi8(1), b = a;
    __asm__ volatile("" : "+v"(a), "+v"(b));
    RUN(__m512i, _mm512_setzero_si512(), _mm512_dpbusd_epi32(acc[j], a, b),
        (double)_mm512_reduce_add_epi32)
}

__attribute__((target("avx2,avxvnni"))) static double sum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_hadd_epi32(s, s);
    return (double)_mm_cvtsi128_si32(_mm_hadd_epi32(s, s));
}

__attribute__((target("avx2,avxvnni"))) double peak_avx2_vnni(long iters) {
    __m256i a = _mm256_set1_epi8(1), b = a;
    __asm__ volatile("" : "+v"(a), "+v"(b));
    RUN(__m256i, _mm256_setzero_si256(), _mm256_dpbusd_avx_epi32(acc[j], a, b), sum8i)
}
