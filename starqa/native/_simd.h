/* What starqa's CPU kernels (_attend.c, _topk_*.c, _int4.c, _rows.c) share: bf16
   conversions, SIMD dispatch (STARQA_SIMD's cap, the multi-versioned loops of
   SIMD_CLONED) and the AVX-512 and AVX2 pieces that widen bf16 and reduce 16 or 8 dot
   products at once. Internal to the library: the boundary is _kernels.h. */

#ifndef STARQA_SIMD_H
#define STARQA_SIMD_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One bf16 value (its 16 bits) as fp32, exactly. */
static inline float bf16_to_float(uint16_t half) {
    uint32_t bits = (uint32_t)half << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* fp32 → the bits of the nearest bf16 (ties to even), as torch rounds. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* exp_nonpositive's polynomial for 2^f, highest degree first, and log2(e) (the SIMD
   versions in _attend.c use them too). */
#define EXP2_C6 1.535336188319500e-4f
#define EXP2_C5 1.339887440266574e-3f
#define EXP2_C4 9.618437357674640e-3f
#define EXP2_C3 5.550332471162809e-2f
#define EXP2_C2 2.402264791363012e-1f
#define EXP2_C1 6.931472028550421e-1f
#define LOG2_E 1.44269504088896341f

/* exp(x) for x <= 0 (fp32 accuracy; 0 below -87, where fp32 would go subnormal). Written
   for vectorisation: a rounding by the 1.5 * 2^23 trick, a degree-6 polynomial for 2^f on
   [-0.5, 0.5] (Cephes' exp2f), and the exponent bits. */
static inline float exp_nonpositive(float x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    float t = (x < -87.0f ? -87.0f : x) * LOG2_E;
    float n = (t + magic) - magic;
    float f = t - n;
    float p = EXP2_C6;
    p = p * f + EXP2_C5;
    p = p * f + EXP2_C4;
    p = p * f + EXP2_C3;
    p = p * f + EXP2_C2;
    p = p * f + EXP2_C1;
    p = p * f + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return x < -87.0f ? 0.0f : p * scale.f;
}

/* The widest paths allowed: 2 AVX-512 (what the CPU has, the default), 1 AVX2, 0 none
   (portable C), from STARQA_SIMD=avx512|avx2|none. It caps the hand-written paths and the
   builds of SIMD_CLONED functions alike, so tests and benchmarks run every path on one CPU
   (starqa.native.kernels refuses other values before a kernel runs). */
static inline int simd_cap(void) {
    static int cap = -1;
    if (cap < 0) {
        const char *e = getenv("STARQA_SIMD");
        cap = !e || !*e || !strcmp(e, "avx512") ? 2 : !strcmp(e, "avx2") ? 1 : 0;
    }
    return cap;
}

/* Which builds of SIMD_CLONED functions have run in this process: bit l for level l
   (_simd.c; starqa_simd_paths reports it). Set once per build, read at each call. */
extern int simd_clones_taken;

static inline void simd_taken(int level) {
    if (!(__atomic_load_n(&simd_clones_taken, __ATOMIC_RELAXED) & (1 << level)))
        __atomic_fetch_or(&simd_clones_taken, 1 << level, __ATOMIC_RELAXED);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SIMD_CLONES_BUILT 1

/* The build of SIMD_CLONED functions this process runs: 2 x86-64-v4 (AVX-512), 1 x86-64-v3
   (AVX2), 0 the baseline; what the CPU has, capped by STARQA_SIMD. */
static inline int clone_level(void) {
    static int level = -1;
    if (level < 0) {
        __builtin_cpu_init();
        const int cpu = __builtin_cpu_supports("x86-64-v4")   ? 2
                        : __builtin_cpu_supports("x86-64-v3") ? 1
                                                              : 0;
        level = cpu < simd_cap() ? cpu : simd_cap();
    }
    return level;
}

/* SIMD_CLONED(linkage, type, name, (parameters), (arguments)) { body }: `name` built three
   times from one body, for x86-64-v4, x86-64-v3 and the baseline (what GCC's
   target_clones builds; the body is inlined into each, so each is vectorised for its
   target), and dispatched by `clone_level`, so STARQA_SIMD reaches the baseline too. */
#define SIMD_CLONED(linkage, type, name, params, args)                                     \
    static inline __attribute__((always_inline)) type name##_body params;                 \
    __attribute__((target("arch=x86-64-v4"))) static type name##_v4 params {              \
        return name##_body args;                                                           \
    }                                                                                      \
    __attribute__((target("arch=x86-64-v3"))) static type name##_v3 params {              \
        return name##_body args;                                                           \
    }                                                                                      \
    static type name##_v1 params { return name##_body args; }                              \
    linkage type name params {                                                             \
        const int level = clone_level();                                                   \
        simd_taken(level);                                                                 \
        return level == 2 ? name##_v4 args : level == 1 ? name##_v3 args : name##_v1 args; \
    }                                                                                      \
    static inline __attribute__((always_inline)) type name##_body params
#else
/* One build (the compiler's default target), reported as the baseline. */
#define SIMD_CLONES_BUILT 0
static inline int clone_level(void) { return 0; }
#define SIMD_CLONED(linkage, type, name, params, args) linkage type name params
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#define STARQA_X86 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))

/* 16 zmm partial sums (one per key) → one zmm of the 16 totals, in key order. */
AVX512 static inline __m512 sum16(const __m512 *x) {
    __m512 quad[4];
    for (int g = 0; g < 4; g++) { /* 4 keys → 4 lanes of 128 bits, each [k0 k1 k2 k3] */
        const __m512 *y = x + 4 * g;
        __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
        __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(y[2], y[3]), _mm512_unpackhi_ps(y[2], y[3]));
        quad[g] = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, 0x44), _mm512_shuffle_ps(t0, t1, 0xEE));
    }
    __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x44),
                               _mm512_shuffle_f32x4(quad[0], quad[1], 0xEE));
    __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x44),
                               _mm512_shuffle_f32x4(quad[2], quad[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88),
                         _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

/* 16 bf16 or fp32 elements → 16 fp32 lanes. */
AVX512 static inline __m512 load16(const char *src, int bf16) {
    if (!bf16) return _mm512_loadu_ps(src);
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

#define AVX2 __attribute__((target("avx2,fma")))

/* 8 ymm partial sums (one per key) → one ymm of the 8 totals, in key order. */
AVX2 static inline __m256 sum8(const __m256 *x) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The inner products of q [8 * nc] with the 8 fp32 rows keys[x * 8 * nc ..] (x < 8), in
   key order: each key's 8 lanes summed in a register, the 8 reduced together (`sum8`); q's
   pieces are read from L1 (16 ymm hold no more than the 8 sums). Exact attention's and
   top-k's AVX2 scoring (_attend.c, _topk_score.c). */
AVX2 static inline __m256 dots8(const float *q, const float *keys, int nc) {
    __m256 dots[8];
    const __m256 q0 = _mm256_loadu_ps(q);
    for (int x = 0; x < 8; x++) dots[x] = _mm256_mul_ps(q0, _mm256_load_ps(keys + x * nc * 8));
    for (int c = 1; c < nc; c++) {
        const __m256 qc = _mm256_loadu_ps(q + c * 8);
        for (int x = 0; x < 8; x++)
            dots[x] = _mm256_fmadd_ps(qc, _mm256_load_ps(keys + (x * nc + c) * 8), dots[x]);
    }
    return sum8(dots);
}

/* 8 bf16 or fp32 elements → 8 fp32 lanes. */
AVX2 static inline __m256 load8(const char *src, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)src);
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline int has_avx2(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = simd_cap() >= 1 && __builtin_cpu_supports("avx2") &&
                __builtin_cpu_supports("fma");
    }
    return known;
}

static inline int has_avx512(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = simd_cap() >= 2 && __builtin_cpu_supports("avx512f") &&
                __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    }
    return known;
}
#endif

#endif
