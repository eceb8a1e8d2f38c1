/* The top-k kernel's softmax over a piece of a union (_topk.h): scores to weights, and the
   weighted sums of the union's value rows (bf16 or fp32) for the G rows of a position at
   once, with AVX-512 or AVX2 where D allows and portable C elsewhere. */

#include <math.h>
#include <stdint.h>

#include "_simd.h"
#include "_topk.h"

SIMD_CLONED(extern, float, topk_weigh, (float *s, int64_t m, float scale, float *top),
            (s, m, scale, top)) {
    float best = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : best)
    for (int64_t j = 0; j < m; j++) best = s[j] > best ? s[j] : best;
    for (int64_t j = 0; j < m; j++) {
        s[j] = exp_nonpositive((s[j] - best) * scale);
        total += s[j];
    }
    *top = best;
    return total;
}

/* o [D] += weight * v. */
SIMD_CLONED(static, void, accumulate, (float *o, const float *v, float weight, int64_t d),
            (o, v, weight, d)) {
#pragma omp simd
    for (int64_t i = 0; i < d; i++) o[i] += weight * v[i];
}

#ifdef STARQA_X86
/* weighted_sum for D = 16 * NC: the G rows' sums in registers, GB rows at a time (a value
   row is widened once per GB rows, from the cache after the first). */
#define WSUM_AVX512(NC)                                                                    \
    AVX512 static void wsum_avx512_##NC(const char *const *vp, int64_t m, int bf16,        \
                                        const float *w, int64_t room, int64_t per,         \
                                        float *const *outs) {                              \
        enum { GB = 16 / NC };                                                             \
        const size_t esize = bf16 ? 2 : 4;                                                 \
        for (int64_t g0 = 0; g0 < per; g0 += GB) {                                         \
            const int64_t gn = per - g0 < GB ? per - g0 : GB;                              \
            __m512 acc[GB][NC];                                                            \
            for (int g = 0; g < GB; g++)                                                   \
                for (int c = 0; c < NC; c++)                                               \
                    acc[g][c] = g < gn ? _mm512_loadu_ps(outs[g0 + g] + c * 16)            \
                                       : _mm512_setzero_ps();                              \
            for (int64_t u = 0; u < m; u++) {                                              \
                if (u + AHEAD_ROWS < m)                                                    \
                    for (size_t y = 0; y < NC * 16 * esize; y += 64)                       \
                        __builtin_prefetch(vp[u + AHEAD_ROWS] + y, 0, TO_L2);              \
                __m512 v[NC];                                                              \
                for (int c = 0; c < NC; c++) v[c] = load16(vp[u] + c * 16 * esize, bf16);  \
                for (int g = 0; g < GB; g++) {                                             \
                    const __m512 wg = _mm512_set1_ps(g < gn ? w[(g0 + g) * room + u] : 0.0f); \
                    for (int c = 0; c < NC; c++) acc[g][c] = _mm512_fmadd_ps(wg, v[c], acc[g][c]); \
                }                                                                          \
            }                                                                              \
            for (int g = 0; g < gn; g++)                                                   \
                for (int c = 0; c < NC; c++) _mm512_storeu_ps(outs[g0 + g] + c * 16, acc[g][c]); \
        }                                                                                  \
    }
WSUM_AVX512(4)
WSUM_AVX512(8)

/* weighted_sum with AVX2 for D a multiple of 32: 3 rows' sums over 32 columns in 12 ymm at
   a time (a value row's 32 columns widened once per 3 rows, from the cache after the
   first slice). */
AVX2 static void wsum_avx2(const char *const *vp, int64_t m, int bf16, const float *w,
                           int64_t room, int64_t per, int64_t d, float *const *outs) {
    enum { GB = 3, CW = 4 };
    const size_t esize = bf16 ? 2 : 4;
    for (int64_t g0 = 0; g0 < per; g0 += GB) {
        const int64_t gn = per - g0 < GB ? per - g0 : GB;
        for (int64_t c0 = 0; c0 < d; c0 += CW * 8) {
            __m256 acc[GB][CW];
            for (int g = 0; g < GB; g++)
                for (int c = 0; c < CW; c++)
                    acc[g][c] = g < gn ? _mm256_loadu_ps(outs[g0 + g] + c0 + c * 8)
                                       : _mm256_setzero_ps();
            for (int64_t u = 0; u < m; u++) {
                if (c0 == 0 && u + AHEAD_ROWS < m)
                    for (size_t y = 0; y < (size_t)d * esize; y += 64)
                        __builtin_prefetch(vp[u + AHEAD_ROWS] + y, 0, TO_L2);
                __m256 wg[GB];
                for (int g = 0; g < GB; g++)
                    wg[g] = _mm256_set1_ps(g < gn ? w[(g0 + g) * room + u] : 0.0f);
                for (int c = 0; c < CW; c++) {
                    const __m256 v = load8(vp[u] + (c0 + c * 8) * esize, bf16);
                    for (int g = 0; g < GB; g++) acc[g][c] = _mm256_fmadd_ps(wg[g], v, acc[g][c]);
                }
            }
            for (int g = 0; g < gn; g++)
                for (int c = 0; c < CW; c++)
                    _mm256_storeu_ps(outs[g0 + g] + c0 + c * 8, acc[g][c]);
        }
    }
}
#endif

/* (_topk.h) With AVX-512 or AVX2 where D allows, portable C elsewhere. */
void topk_weighted_sum(const char *const *vp, int64_t m, int bf16, const float *w,
                       int64_t room, int64_t per, int64_t d, float *const *outs,
                       float *value) {
#ifdef STARQA_X86
    if (has_avx512() && (d == 64 || d == 128)) {
        (d == 64 ? wsum_avx512_4 : wsum_avx512_8)(vp, m, bf16, w, room, per, outs);
        return;
    }
    if (has_avx2() && d % 32 == 0) {
        wsum_avx2(vp, m, bf16, w, room, per, d, outs);
        return;
    }
#endif
    const size_t esize = bf16 ? 2 : 4;
    for (int64_t u = 0; u < m; u++) {
        if (u + AHEAD_ROWS < m)
            for (size_t y = 0; y < (size_t)d * esize; y += 64)
                __builtin_prefetch(vp[u + AHEAD_ROWS] + y, 0, TO_L2);
        widen_row(vp[u], bf16, d, value);
        for (int64_t g = 0; g < per; g++) accumulate(outs[g], value, w[g * room + u], d);
    }
}
