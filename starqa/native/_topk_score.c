/* The top-k kernel's inner products (_topk.h): query rows against chunks of CHUNK key rows
   (bf16 or fp32), with AVX-512 or AVX2 where D is 64 or 128 and portable C elsewhere; the
   scan of a run of keys that lie one after the other (a list's piece of a buffer), and the
   scores of a union's keys that lie anywhere. */

#include <stdint.h>
#include <string.h>

#include "_simd.h"
#include "_topk.h"

static const float zeros[MAX_DIM]; /* a key row past a chunk's end (zero bits: bf16 too) */

/* Inner product of two fp32 rows. */
SIMD_CLONED(static, float, dot, (const float *a, const float *b, int64_t d), (a, b, d)) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; i++) acc += a[i] * b[i];
    return acc;
}

/* The inner products of nq query rows qs[i] [D] with the CHUNK key rows kp[x] (bf16 or
   fp32; the first `width` real, the rest zeros), into outs[i][0 .. CHUNK); block: scratch
   of CHUNK * D floats (the keys widened once for every row). */
static void score_any(const char *const *kp, int width, int bf16, const float *const *qs,
                      int64_t nq, int64_t d, float *const *outs, float *block) {
    for (int x = 0; x < width; x++) widen_row(kp[x], bf16, d, block + x * d);
    for (int64_t i = 0; i < nq; i++)
        for (int x = 0; x < CHUNK; x++)
            outs[i][x] = x < width ? dot(qs[i], block + x * d, d) : 0.0f;
}

#ifdef STARQA_X86
/* D = 16 * NC (NC = 4: D 64, NC = 8: D 128): each row's CHUNK scores in one vector (16 dot
   products reduced together, as in _attend.c). For more than DIRECT_ROWS rows the chunk's
   keys are widened once into `block` and the rows read that; for fewer (an ivf decode scans
   a row at a time) each row widens them as it reads them where they lie: the same products
   in the same order (the same bits) without the copy's stores and loads (7-10% of an ivf
   decode's kernel at 32K on a Zen 4, 3-5% of its token). */
#define SCORE_AVX512(NC)                                                                   \
    AVX512 static void score_avx512_##NC(const char *const *kp, int bf16,                 \
                                         const float *const *qs, int64_t nq,              \
                                         float *const *outs, float *block) {              \
        const char *widened[CHUNK];                                                        \
        const char *const *keys = kp; /* where the rows read the keys: as they lie, */     \
        int keys_bf16 = bf16;         /* or widened into block */                          \
        if (nq > DIRECT_ROWS) {                                                            \
            const size_t esize = bf16 ? 2 : 4;                                             \
            for (int x = 0; x < CHUNK; x++) {                                              \
                for (int c = 0; c < NC; c++)                                               \
                    _mm512_store_ps(block + (x * NC + c) * 16,                             \
                                    load16(kp[x] + c * 16 * esize, bf16));                 \
                widened[x] = (const char *)(block + x * NC * 16);                          \
            }                                                                              \
            keys = widened;                                                                \
            keys_bf16 = 0;                                                                 \
        }                                                                                  \
        const size_t step = keys_bf16 ? 32 : 64; /* bytes of 16 elements */               \
        for (int64_t i = 0; i < nq; i++) {                                                 \
            __m512 qr[NC], dots[CHUNK];                                                    \
            for (int c = 0; c < NC; c++) qr[c] = _mm512_loadu_ps(qs[i] + c * 16);          \
            for (int x = 0; x < CHUNK; x++) {                                              \
                __m512 acc = _mm512_mul_ps(qr[0], load16(keys[x], keys_bf16));             \
                for (int c = 1; c < NC; c++)                                               \
                    acc = _mm512_fmadd_ps(qr[c], load16(keys[x] + c * step, keys_bf16), acc); \
                dots[x] = acc;                                                             \
            }                                                                              \
            _mm512_storeu_ps(outs[i], sum16(dots));                                        \
        }                                                                                  \
    }
SCORE_AVX512(4)
SCORE_AVX512(8)
#endif

#ifdef STARQA_X86
/* dots8 of q with the 8 key rows kp[x] read where they lie (bf16 or fp32), each piece
   widened as it is used: the same products summed in the same order as dots8 over their
   widened copies (the same bits), without writing the copies. */
AVX2 static inline __m256 dots8_at(const float *q, const char *const *kp, int nc, int bf16) {
    const size_t esize = bf16 ? 2 : 4;
    __m256 dots[8];
    const __m256 q0 = _mm256_loadu_ps(q);
    for (int x = 0; x < 8; x++) dots[x] = _mm256_mul_ps(q0, load8(kp[x], bf16));
    for (int c = 1; c < nc; c++) {
        const __m256 qc = _mm256_loadu_ps(q + c * 8);
        for (int x = 0; x < 8; x++)
            dots[x] = _mm256_fmadd_ps(qc, load8(kp[x] + c * 8 * esize, bf16), dots[x]);
    }
    return sum8(dots);
}

/* The AVX-512 scorers' work for CPUs with AVX2 but not AVX-512, D = 8 * NC (NC = 8: D 64,
   16: D 128): eight keys at a time, each row's 8 dot products reduced together (`dots8`),
   the eights that hold the chunk's `width` keys only (an ivf list's last chunk is often
   part empty). For more than DIRECT_ROWS rows the chunk's keys are widened once into
   `block`; for fewer (a decode: a row, or a KV head's G rows) each row reads them where
   they lie (`dots8_at`), which spares the copy's stores and loads (6% of an ivf decode's
   kernel, 3 rows). */
#define SCORE_AVX2(NC)                                                                     \
    AVX2 static void score_avx2_##NC(const char *const *kp, int width, int bf16,          \
                                     const float *const *qs, int64_t nq,                  \
                                     float *const *outs, float *block) {                  \
        const size_t esize = bf16 ? 2 : 4;                                                 \
        const int keys = (width + 7) / 8 * 8; /* whole eights: past `width`, zero rows */  \
        if (nq <= DIRECT_ROWS) {                                                           \
            for (int64_t i = 0; i < nq; i++)                                               \
                for (int x0 = 0; x0 < keys; x0 += 8)                                       \
                    _mm256_storeu_ps(outs[i] + x0, bf16 ? dots8_at(qs[i], kp + x0, NC, 1)  \
                                                        : dots8_at(qs[i], kp + x0, NC, 0)); \
            return;                                                                        \
        }                                                                                  \
        for (int x = 0; x < keys; x++)                                                     \
            for (int c = 0; c < NC; c++)                                                   \
                _mm256_store_ps(block + (x * NC + c) * 8, load8(kp[x] + c * 8 * esize, bf16)); \
        for (int64_t i = 0; i < nq; i++)                                                   \
            for (int x0 = 0; x0 < keys; x0 += 8)                                           \
                _mm256_storeu_ps(outs[i] + x0, dots8(qs[i], block + x0 * NC * 8, NC));      \
    }
SCORE_AVX2(8)
SCORE_AVX2(16)
#endif

/* score_any, with AVX-512 or AVX2 where D is 64 or 128. kp[x] for x >= width must point at
   zeros; a row's scores past `width` may be left unwritten. */
static void score_keys(const char *const *kp, int width, int bf16, const float *const *qs,
                       int64_t nq, int64_t d, float *const *outs, float *block) {
#ifdef STARQA_X86
    if (has_avx512() && (d == 64 || d == 128)) {
        (d == 64 ? score_avx512_4 : score_avx512_8)(kp, bf16, qs, nq, outs, block);
        return;
    }
    if (has_avx2() && (d == 64 || d == 128)) {
        (d == 64 ? score_avx2_8 : score_avx2_16)(kp, width, bf16, qs, nq, outs, block);
        return;
    }
#endif
    score_any(kp, width, bf16, qs, nq, d, outs, block);
}

/* (_topk.h) Each key row is fetched AHEAD_KEYS ahead of its use. */
void topk_score_rows(const char *const *kr, int64_t m, int bf16, const float *const *qs,
                     int64_t nq, int64_t d, float *w, int64_t room, float *block) {
    const size_t bytes = (size_t)d * (bf16 ? 2 : 4);
    float *outs[MAX_GROUP];
    for (int64_t u = 0; u < (m < AHEAD_KEYS ? m : AHEAD_KEYS); u++)
        for (size_t y = 0; y < bytes; y += 64) __builtin_prefetch(kr[u] + y, 0, TO_L2);
    for (int64_t u0 = 0; u0 < m; u0 += CHUNK) {
        const int width = m - u0 < CHUNK ? (int)(m - u0) : CHUNK;
        for (int64_t u = u0 + AHEAD_KEYS; u < u0 + AHEAD_KEYS + width && u < m; u++)
            for (size_t y = 0; y < bytes; y += 64) __builtin_prefetch(kr[u] + y, 0, TO_L2);
        const char *kp[CHUNK];
        for (int x = 0; x < CHUNK; x++) kp[x] = x < width ? kr[u0 + x] : (const char *)zeros;
        for (int64_t g = 0; g < nq; g++) outs[g] = w + g * room + u0;
        score_keys(kp, width, bf16, qs, nq, d, outs, block);
    }
}

/* (_topk.h) Rows a few chunks on are asked into the cache meanwhile. */
void topk_scan(const char *base, size_t row_bytes, int bf16, int64_t lo, int64_t hi,
               int64_t list, const scan_rows *rows) {
    /* the group's fields, in registers (the loops below store to its scores and counts) */
    const float *q = rows->q;
    const int64_t d = rows->d, *who = rows->who, many = rows->many, stride = rows->stride;
    const int64_t segroom = rows->segroom;
    float *scores = rows->scores, *block = rows->block;
    int64_t *got = rows->got, *nsegs = rows->nsegs;
    seg *segs = rows->segs;
    const float *qs[GROUP];
    float *outs[GROUP];
    for (int64_t w = 0; segs && w < many; w++) {
        const int64_t r = who[w];
        seg *last = segs + r * segroom + nsegs[r] - 1;
        if (!nsegs[r] || last->pos + (got[r] - last->at) != lo || last->list != list)
            segs[r * segroom + nsegs[r]++] = (seg){got[r], lo, list}; /* else on the last */
    }
    float tail[GROUP][CHUNK]; /* a last chunk's scores, `width` of them copied: a row's
                                 scores are written up to hi, never past (kept scores) */
    for (int64_t p = lo; p < hi; p += CHUNK) {
        const int width = hi - p < CHUNK ? (int)(hi - p) : CHUNK;
        const char *kp[CHUNK];
        for (int x = 0; x < CHUNK; x++) {
            kp[x] = x < width ? base + (size_t)(p - lo + x) * row_bytes : (const char *)zeros;
            if (p + x + AHEAD < hi) /* rows a few chunks on, into the cache meanwhile */
                for (size_t y = 0; y < row_bytes; y += 64)
                    __builtin_prefetch(kp[x] + AHEAD * row_bytes + y, 0, TO_L2);
        }
        for (int64_t w = 0; w < many; w++) {
            qs[w] = q + who[w] * d;
            outs[w] = width < CHUNK ? tail[w] : scores + who[w] * stride + got[who[w]];
        }
        score_keys(kp, width, bf16, qs, many, d, outs, block);
        for (int64_t w = 0; w < many; w++) {
            if (width < CHUNK)
                memcpy(scores + who[w] * stride + got[who[w]], tail[w],
                       (size_t)width * sizeof(float));
            got[who[w]] += width;
        }
    }
}
