/* starqa's CPU attention kernel (loaded by starqa.native.ops through ctypes; plain C, no
   Python headers, so any C compiler builds it): partial attention with its log-sum-exp
   over a cached shard, on CPU.

   One call attends R query rows of each of H KV heads to n keys of that head, held by one
   or more buffers in order (the shard's blocks where they lie, then the question's own
   keys; keys and values bf16 or fp32, rows of D contiguous elements, heads any distance
   apart: a slice of a longer buffer is read in place) and returns, per row, the attention
   output and the LSE that starqa.attention.merge combines across shards and workers.

   int8 KV (starqa.attention.kvint8): a piece may hold int8 rows, each with its fp32 scale
   s. A block of them is widened to fp32 and multiplied by its rows' scales as it is read
   (q . (s k) = s (q . k); the output sums p s_v v), so the rest of the pass is the same.

   A piece's bias b (the table's biases: Phase 2's context bias on a shard's keys) is added
   to every score of its keys. A task's keys are one piece's, so the task runs on the
   scores without it and the merge adds b to the task's running maximum: exp(s + b - (m +
   b)) = exp(s - m), the same softmax and LSE, whichever SIMD path scored the keys.

   Why starqa has its own kernel: a decode step has only R = G rows per KV head (G query
   heads share one KV head), so attention is a pass over the shard that should run at
   memory speed. torch's CPU flash kernel spends most of such a step in the fixed costs of
   its per-block GEMM calls (about 19 ms per token for SmolLM2 over 7.5K keys on a 2-core
   Zen 5), and two oneDNN GEMMs with a softmax between them leave the scores rounded to
   bf16 and still cost 13 ms. Here each key and value row is read once, widened to fp32,
   and used at once by every row: scores, softmax and output accumulate in fp32 (online
   softmax over blocks of keys, as in FlashAttention), so nothing is rounded to bf16 but
   the inputs themselves.

   Work is split into (head, run of keys of one buffer) tasks over OpenMP threads; loaded
   after torch, this module shares torch's libgomp and so its thread pool. Each task keeps its running
   maximum, sum and unnormalised output; the tasks of a head are merged at the end by the
   same LSE rule as starqa.attention.merge.

   Causal tail: with own = M > 0, the last M keys are the M queries' own, and the rows are
   G blocks of M (the query index fastest, starqa.attention.fold_gqa's layout): row r sees
   the keys before n - M + (r % M) + 1. A row that sees no key gets output 0, LSE -inf. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 64      /* keys per online-softmax step */
#define ROWS 32       /* query rows per pass over a task's keys */
#define TASK_KEYS 512 /* keys per task */
#define MAX_DIM 256

/* What a piece's rows hold: fp32, bf16, or int8 with an fp32 scale per row. */
enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_I8 = 2 };

static inline size_t kind_size(int kind) { return kind == KIND_I8 ? 1 : kind == KIND_BF16 ? 2 : 4; }

#include "_kernels.h"
#include "_simd.h"

/* Rows j0 .. j0 + jn of keys or values (D each, rows row_bytes apart) in fp32: bf16 rows
   widened into `block`, int8 rows widened and scaled (scales[j]: row j's), fp32 rows used
   where they lie. */
static inline const float *fp32_rows(const char *src, int kind, const float *scales,
                                     int64_t j0, int64_t jn, int64_t d, size_t row_bytes,
                                     float *block) {
    src += (size_t)j0 * row_bytes;
    if (kind == KIND_F32) return (const float *)src;
    if (kind == KIND_I8) {
        const int8_t *x = (const int8_t *)src;
        for (int64_t j = 0; j < jn; j++) {
            const float s = scales[j0 + j];
#pragma omp simd
            for (int64_t i = 0; i < d; i++) block[j * d + i] = s * (float)x[j * d + i];
        }
        return block;
    }
    const uint16_t *h = (const uint16_t *)src;
#pragma omp simd
    for (int64_t i = 0; i < jn * d; i++) {
        union { uint32_t u; float f; } wide = {.u = (uint32_t)h[i] << 16};
        block[i] = wide.f;
    }
    return block;
}

/* The online-softmax step for one block of jn keys: the scores s[r][0..jn) become the
   weights exp(s - m[r]) under each row's running maximum m[r], whose sum joins l[r]; the
   row's output so far (acc) shrinks when the maximum grows. */
static inline void softmax_block(int64_t rows, int64_t jn, int64_t d, float s[][BLOCK],
                                 float *m, float *l, float *acc) {
    for (int64_t r = 0; r < rows; r++) {
        float top = -INFINITY;
        const float *sr0 = s[r];
#pragma omp simd reduction(max : top)
        for (int64_t j = 0; j < jn; j++) top = sr0[j] > top ? sr0[j] : top;
        if (top == -INFINITY) { /* every key of the block hidden from this row */
            for (int64_t j = 0; j < jn; j++) s[r][j] = 0.0f;
            continue;
        }
        if (top > m[r]) {
            float shrink = m[r] == -INFINITY ? 0.0f : exp_nonpositive(m[r] - top);
            l[r] *= shrink;
            float *ar = acc + r * d;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) ar[i] *= shrink;
            m[r] = top;
        }
        float mr = m[r], sum = 0.0f;
        float *sr = s[r];
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < jn; j++) {
            float p = exp_nonpositive(sr[j] - mr);
            sr[j] = p;
            sum += p;
        }
        l[r] += sum;
    }
}

/* Arguments of a task: rows [r0, r0 + rows) (at most ROWS) of one head, whose queries are
   q [R, D], over its keys [a, b); each row's running max m, sum l and unnormalised output
   acc [rows, D], at r - r0. */
#define TASK_ARGS                                                                          \
    const float *q, int64_t d, const char *k, const char *v, int kind, const float *ks,       \
        const float *vs, int64_t a, int64_t b, int64_t n, int64_t own, int64_t r0,            \
        int64_t rows, float scale, float *m, float *l, float *acc
#define TASK_PASS q, d, k, v, kind, ks, vs, a, b, n, own, r0, rows, scale, m, l, acc

static void task_start(TASK_ARGS, int64_t *limit) {
    (void)q, (void)k, (void)v, (void)kind, (void)ks, (void)vs, (void)a, (void)b, (void)scale;
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(acc + r * d, 0, (size_t)d * sizeof(float));
        limit[r] = own ? n - own + (r0 + r) % own + 1 : n;
    }
}

/* Any D: plain loops the compiler vectorises. */
SIMD_CLONED(static, void, task_any, (TASK_ARGS), (TASK_PASS)) {
    const size_t row_bytes = (size_t)d * kind_size(kind);
    float s[ROWS][BLOCK];
    float block[BLOCK * MAX_DIM]; /* this block's keys, then its values, in fp32 */
    int64_t limit[ROWS];
    task_start(TASK_PASS, limit);
    for (int64_t j0 = a; j0 < b; j0 += BLOCK) {
        int64_t jn = b - j0 < BLOCK ? b - j0 : BLOCK;
        const float *keys = fp32_rows(k, kind, ks, j0, jn, d, row_bytes, block);
        for (int64_t r = 0; r < rows; r++) {
            const float *qr = q + (r0 + r) * d;
            for (int64_t j = 0; j < jn; j++) {
                const float *key = keys + j * d;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < d; i++) dot += qr[i] * key[i];
                s[r][j] = j0 + j < limit[r] ? dot * scale : -INFINITY;
            }
        }
        softmax_block(rows, jn, d, s, m, l, acc);
        const float *values = fp32_rows(v, kind, vs, j0, jn, d, row_bytes, block);
        for (int64_t r = 0; r < rows; r++) {
            float *ar = acc + r * d;
            for (int64_t j = 0; j < jn; j++) {
                const float p = s[r][j], *value = values + j * d;
#pragma omp simd
                for (int64_t i = 0; i < d; i++) ar[i] += p * value[i];
            }
        }
    }
}

#ifdef STARQA_X86
/* Rows j0 .. j0 + jn (nc * 16 elements each, rows row_bytes apart) widened into `block`
   [jn][nc * 16] fp32 (int8 rows times their scales), the next block's rows fetched into
   the cache meanwhile. */
AVX512 static inline void widen_rows(const char *src, int kind, const float *scales,
                                     int64_t j0, int64_t jn, int nc, size_t row_bytes,
                                     float *block) {
    const size_t esize = kind_size(kind);
    for (int64_t j = 0; j < jn; j++) {
        const char *row = src + (size_t)(j0 + j) * row_bytes;
        for (size_t x = 0; x < row_bytes; x += 64)
            _mm_prefetch(row + BLOCK * row_bytes + x, _MM_HINT_T0);
        if (kind == KIND_I8) {
            const __m512 s = _mm512_set1_ps(scales[j0 + j]);
            for (int c = 0; c < nc; c++) {
                __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + c * 16)));
                _mm512_store_ps(block + (j * nc + c) * 16, _mm512_mul_ps(s, _mm512_cvtepi32_ps(wide)));
            }
            continue;
        }
        for (int c = 0; c < nc; c++)
            _mm512_store_ps(block + (j * nc + c) * 16,
                            load16(row + c * 16 * esize, kind == KIND_BF16));
    }
}

/* exp_nonpositive on 16 lanes, the same arithmetic lane by lane. */
AVX512 static inline __m512 exp_nonpositive16(__m512 x) {
    const __m512 low = _mm512_set1_ps(-87.0f);
    __m512 t = _mm512_mul_ps(_mm512_max_ps(x, low), _mm512_set1_ps(LOG2_E));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(EXP2_C6);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C5));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_GE_OQ), e);
}

/* softmax_block with AVX-512: each row's maximum, weights and their sum 16 lanes at a
   time (the portable loop's sum ended in 16 dependent scalar adds per row and block). */
AVX512 static inline void softmax_block16(int64_t rows, int64_t jn, int64_t d,
                                          float s[][BLOCK], float *m, float *l, float *acc) {
    for (int64_t r = 0; r < rows; r++) {
        float *sr = s[r];
        __m512 top16 = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < jn; j += 16) {
            __mmask16 live = jn - j >= 16 ? 0xFFFF : (__mmask16)((1u << (jn - j)) - 1);
            top16 = _mm512_mask_max_ps(top16, live, top16, _mm512_load_ps(sr + j));
        }
        float top = _mm512_reduce_max_ps(top16);
        if (top == -INFINITY) { /* every key of the block hidden from this row */
            for (int64_t j = 0; j < jn; j++) sr[j] = 0.0f;
            continue;
        }
        if (top > m[r]) {
            float shrink = m[r] == -INFINITY ? 0.0f : exp_nonpositive(m[r] - top);
            l[r] *= shrink;
            float *ar = acc + r * d;
            for (int64_t i = 0; i < d; i++) ar[i] *= shrink;
            m[r] = top;
        }
        __m512 mr = _mm512_set1_ps(m[r]), sum16 = _mm512_setzero_ps();
        for (int64_t j = 0; j < jn; j += 16) {
            __mmask16 live = jn - j >= 16 ? 0xFFFF : (__mmask16)((1u << (jn - j)) - 1);
            __m512 p = exp_nonpositive16(_mm512_sub_ps(_mm512_load_ps(sr + j), mr));
            _mm512_store_ps(sr + j, p);
            sum16 = _mm512_mask_add_ps(sum16, live, sum16, p);
        }
        l[r] += _mm512_reduce_add_ps(sum16);
    }
}

/* D = 16 * NC (NC = 4: D 64, NC = 8: D 128), AVX-512: scores 16 keys at a time with one
   transposed reduction, each output row in registers over the block. */
#define TASK_AVX512(NC)                                                                    \
    AVX512 static void task_avx512_##NC(TASK_ARGS) {                                      \
        const size_t row_bytes = (size_t)d * kind_size(kind);                              \
        float s[ROWS][BLOCK] __attribute__((aligned(64)));                                 \
        float block[BLOCK * 16 * NC] __attribute__((aligned(64)));                         \
        int64_t limit[ROWS];                                                               \
        task_start(TASK_PASS, limit);                                                      \
        for (int64_t j0 = a; j0 < b; j0 += BLOCK) {                                        \
            int64_t jn = b - j0 < BLOCK ? b - j0 : BLOCK;                                  \
            widen_rows(k, kind, ks, j0, jn, NC, row_bytes, block); /* the block's keys */  \
            for (int64_t j = jn; j < (jn + 15) / 16 * 16; j++) /* pad to 16 keys */        \
                for (int c = 0; c < NC; c++)                                               \
                    _mm512_store_ps(block + (j * NC + c) * 16, _mm512_setzero_ps());       \
            for (int64_t r = 0; r < rows; r++) {                                           \
                __m512 qr[NC];                                                             \
                for (int c = 0; c < NC; c++) qr[c] = _mm512_loadu_ps(q + (r0 + r) * d + c * 16); \
                for (int64_t j = 0; j < jn; j += 16) {                                     \
                    __m512 dots[16];                                                       \
                    for (int x = 0; x < 16; x++) {                                         \
                        const float *key = block + (j + x) * NC * 16;                      \
                        __m512 acc0 = _mm512_mul_ps(qr[0], _mm512_load_ps(key));           \
                        for (int c = 1; c < NC; c++)                                       \
                            acc0 = _mm512_fmadd_ps(qr[c], _mm512_load_ps(key + c * 16), acc0); \
                        dots[x] = acc0;                                                    \
                    }                                                                      \
                    _mm512_store_ps(&s[r][j], _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale))); \
                }                                                                          \
                for (int64_t j = limit[r] - j0 < 0 ? 0 : limit[r] - j0; j < jn; j++)       \
                    s[r][j] = -INFINITY; /* keys after the row's causal limit */           \
            }                                                                              \
            softmax_block16(rows, jn, d, s, m, l, acc);                                    \
            widen_rows(v, kind, vs, j0, jn, NC, row_bytes, block); /* and its values */    \
            /* even and odd keys into separate sums: 2 * NC chains of FMAs per row, so    \
               both FMA units stay busy; with D 64 two rows share each value load (with D  \
               128 their sums would not fit in the registers). A row's sums are the same  \
               alone or paired. */                                                         \
            for (int64_t r = 0; r < rows; r += NC == 4 ? 2 : 1) {                          \
                const int64_t r1 = NC == 4 && r + 1 < rows ? r + 1 : r;                    \
                __m512 even0[NC], odd0[NC], even1[NC], odd1[NC];                           \
                for (int c = 0; c < NC; c++) {                                             \
                    even0[c] = _mm512_loadu_ps(acc + r * d + c * 16);                      \
                    even1[c] = NC == 4 ? _mm512_loadu_ps(acc + r1 * d + c * 16) : even0[c]; \
                    odd0[c] = odd1[c] = _mm512_setzero_ps();                               \
                }                                                                          \
                int64_t j = 0;                                                             \
                for (; j + 1 < jn; j += 2) {                                               \
                    __m512 p00 = _mm512_set1_ps(s[r][j]), p01 = _mm512_set1_ps(s[r][j + 1]); \
                    __m512 p10 = _mm512_set1_ps(s[r1][j]), p11 = _mm512_set1_ps(s[r1][j + 1]); \
                    for (int c = 0; c < NC; c++) {                                         \
                        __m512 x0 = _mm512_load_ps(block + (j * NC + c) * 16);             \
                        __m512 x1 = _mm512_load_ps(block + ((j + 1) * NC + c) * 16);       \
                        even0[c] = _mm512_fmadd_ps(p00, x0, even0[c]);                     \
                        odd0[c] = _mm512_fmadd_ps(p01, x1, odd0[c]);                       \
                        if (NC == 4) {                                                     \
                            even1[c] = _mm512_fmadd_ps(p10, x0, even1[c]);                 \
                            odd1[c] = _mm512_fmadd_ps(p11, x1, odd1[c]);                   \
                        }                                                                  \
                    }                                                                      \
                }                                                                          \
                if (j < jn) {                                                              \
                    __m512 p00 = _mm512_set1_ps(s[r][j]), p10 = _mm512_set1_ps(s[r1][j]);  \
                    for (int c = 0; c < NC; c++) {                                         \
                        __m512 x0 = _mm512_load_ps(block + (j * NC + c) * 16);             \
                        even0[c] = _mm512_fmadd_ps(p00, x0, even0[c]);                     \
                        if (NC == 4) even1[c] = _mm512_fmadd_ps(p10, x0, even1[c]);        \
                    }                                                                      \
                }                                                                          \
                for (int c = 0; c < NC; c++) {                                             \
                    _mm512_storeu_ps(acc + r * d + c * 16, _mm512_add_ps(even0[c], odd0[c])); \
                    if (NC == 4)                                                           \
                        _mm512_storeu_ps(acc + r1 * d + c * 16, _mm512_add_ps(even1[c], odd1[c])); \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }
TASK_AVX512(4)
TASK_AVX512(8)

/* The same for CPUs with AVX2 but not AVX-512, 8 lanes: rows j0 .. j0 + jn widened into
   `block` [jn][nc * 8] fp32 (int8 rows times their scales), the next block's rows fetched
   meanwhile. */
AVX2 static inline void widen_rows8(const char *src, int kind, const float *scales, int64_t j0,
                                    int64_t jn, int nc, size_t row_bytes, float *block) {
    const size_t esize = kind_size(kind);
    for (int64_t j = 0; j < jn; j++) {
        const char *row = src + (size_t)(j0 + j) * row_bytes;
        for (size_t x = 0; x < row_bytes; x += 64)
            _mm_prefetch(row + BLOCK * row_bytes + x, _MM_HINT_T0);
        if (kind == KIND_I8) {
            const __m256 s = _mm256_set1_ps(scales[j0 + j]);
            for (int c = 0; c < nc; c++) {
                __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c * 8)));
                _mm256_store_ps(block + (j * nc + c) * 8, _mm256_mul_ps(s, _mm256_cvtepi32_ps(wide)));
            }
            continue;
        }
        for (int c = 0; c < nc; c++)
            _mm256_store_ps(block + (j * nc + c) * 8, load8(row + c * 8 * esize, kind == KIND_BF16));
    }
}

/* exp_nonpositive on 8 lanes, the same arithmetic lane by lane. */
AVX2 static inline __m256 exp_nonpositive8(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.0f);
    __m256 t = _mm256_mul_ps(_mm256_max_ps(x, low), _mm256_set1_ps(LOG2_E));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(EXP2_C6);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C5));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_and_ps(e, _mm256_cmp_ps(x, low, _CMP_GE_OQ));
}

/* softmax_block with AVX2; s[r][jn .. jn rounded up to 8) must hold -inf (weight 0). */
AVX2 static inline void softmax_block8(int64_t rows, int64_t jn, int64_t d, float s[][BLOCK],
                                       float *m, float *l, float *acc) {
    const int64_t jp = (jn + 7) / 8 * 8;
    for (int64_t r = 0; r < rows; r++) {
        float *sr = s[r];
        __m256 top8 = _mm256_set1_ps(-INFINITY);
        for (int64_t j = 0; j < jp; j += 8) top8 = _mm256_max_ps(top8, _mm256_load_ps(sr + j));
        float lanes[8] __attribute__((aligned(32)));
        _mm256_store_ps(lanes, top8);
        float top = -INFINITY;
        for (int x = 0; x < 8; x++) top = lanes[x] > top ? lanes[x] : top;
        if (top == -INFINITY) { /* every key of the block hidden from this row */
            for (int64_t j = 0; j < jp; j++) sr[j] = 0.0f;
            continue;
        }
        if (top > m[r]) {
            float shrink = m[r] == -INFINITY ? 0.0f : exp_nonpositive(m[r] - top);
            l[r] *= shrink;
            float *ar = acc + r * d;
            for (int64_t i = 0; i < d; i++) ar[i] *= shrink;
            m[r] = top;
        }
        __m256 mr = _mm256_set1_ps(m[r]), sum8 = _mm256_setzero_ps();
        for (int64_t j = 0; j < jp; j += 8) {
            __m256 p = exp_nonpositive8(_mm256_sub_ps(_mm256_load_ps(sr + j), mr));
            _mm256_store_ps(sr + j, p);
            sum8 = _mm256_add_ps(sum8, p);
        }
        _mm256_store_ps(lanes, sum8);
        float sum = 0.0f;
        for (int x = 0; x < 8; x++) sum += lanes[x];
        l[r] += sum;
    }
}

/* D = 8 * NC (NC = 8: D 64, NC = 16: D 128), AVX2: scores 8 keys at a time with one
   transposed reduction (`dots8`), each output row's sums in registers over the block, even
   and odd keys in separate chains (D 64; with D 128 the halves of a row one after the
   other). */
#define TASK_AVX2(NC)                                                                      \
    AVX2 static void task_avx2_##NC(TASK_ARGS) {                                          \
        enum { HALF = NC < 8 ? NC : 8 }; /* ymm of a row's sums per pass */               \
        const size_t row_bytes = (size_t)d * kind_size(kind);                              \
        float s[ROWS][BLOCK] __attribute__((aligned(64)));                                 \
        float block[BLOCK * 8 * NC] __attribute__((aligned(64)));                          \
        int64_t limit[ROWS];                                                               \
        task_start(TASK_PASS, limit);                                                      \
        for (int64_t j0 = a; j0 < b; j0 += BLOCK) {                                        \
            int64_t jn = b - j0 < BLOCK ? b - j0 : BLOCK;                                  \
            const int64_t jp = (jn + 7) / 8 * 8;                                           \
            widen_rows8(k, kind, ks, j0, jn, NC, row_bytes, block); /* the block's keys */ \
            for (int64_t j = jn; j < jp; j++) /* pad to 8 keys */                          \
                for (int c = 0; c < NC; c++)                                               \
                    _mm256_store_ps(block + (j * NC + c) * 8, _mm256_setzero_ps());        \
            for (int64_t r = 0; r < rows; r++) {                                           \
                const float *qr = q + (r0 + r) * d;                                        \
                for (int64_t j = 0; j < jp; j += 8)                                        \
                    _mm256_store_ps(&s[r][j], _mm256_mul_ps(dots8(qr, block + j * NC * 8, NC), \
                                                            _mm256_set1_ps(scale)));       \
                for (int64_t j = limit[r] - j0 < 0 ? 0 : limit[r] - j0; j < jn; j++)       \
                    s[r][j] = -INFINITY; /* keys after the row's causal limit */           \
                for (int64_t j = jn; j < jp; j++) s[r][j] = -INFINITY; /* the padding */   \
            }                                                                              \
            softmax_block8(rows, jn, d, s, m, l, acc);                                     \
            widen_rows8(v, kind, vs, j0, jn, NC, row_bytes, block); /* and its values */   \
            for (int64_t r = 0; r < rows; r++)                                             \
                for (int c0 = 0; c0 < NC; c0 += HALF) {                                    \
                    float *ar = acc + r * d + c0 * 8;                                      \
                    __m256 even[HALF], odd[HALF];                                          \
                    for (int c = 0; c < HALF; c++) {                                       \
                        even[c] = _mm256_loadu_ps(ar + c * 8);                             \
                        odd[c] = _mm256_setzero_ps();                                      \
                    }                                                                      \
                    int64_t j = 0;                                                         \
                    for (; j + 1 < jn; j += 2) {                                           \
                        const __m256 p0 = _mm256_set1_ps(s[r][j]), p1 = _mm256_set1_ps(s[r][j + 1]); \
                        for (int c = 0; c < HALF; c++) {                                   \
                            even[c] = _mm256_fmadd_ps(p0, _mm256_load_ps(block + (j * NC + c0 + c) * 8), even[c]); \
                            odd[c] = _mm256_fmadd_ps(p1, _mm256_load_ps(block + ((j + 1) * NC + c0 + c) * 8), odd[c]); \
                        }                                                                  \
                    }                                                                      \
                    if (j < jn) {                                                          \
                        const __m256 p0 = _mm256_set1_ps(s[r][j]);                         \
                        for (int c = 0; c < HALF; c++)                                     \
                            even[c] = _mm256_fmadd_ps(p0, _mm256_load_ps(block + (j * NC + c0 + c) * 8), even[c]); \
                    }                                                                      \
                    for (int c = 0; c < HALF; c++)                                         \
                        _mm256_storeu_ps(ar + c * 8, _mm256_add_ps(even[c], odd[c]));      \
                }                                                                          \
        }                                                                                  \
    }
TASK_AVX2(8)
TASK_AVX2(16)

#endif

static void task(TASK_ARGS) {
#ifdef STARQA_X86
    if (has_avx512() && (d == 64 || d == 128)) {
        (d == 64 ? task_avx512_4 : task_avx512_8)(TASK_PASS);
        return;
    }
    if (has_avx2() && (d == 64 || d == 128)) {
        (d == 64 ? task_avx2_8 : task_avx2_16)(TASK_PASS);
        return;
    }
#endif
    task_any(TASK_PASS);
}

/* One span of keys: [a, b) of piece `piece` (positions relative to its first key). */
typedef struct {
    int64_t piece, a, b;
} span_t;

/* A buffer of keys and values as a task reads it: addresses, head strides (elements), int8
   rows' scales (0: float rows), its first key's position and its keys, and its score bias. */
typedef struct {
    int64_t keys, values, key_stride, value_stride, key_scales, value_scales;
    int64_t start, length;
    float bias;
} piece_t;

/* A question's rows [r0, r0 + rows) of every head, over the shared pieces then `extra` (its
   own keys, none when extra.length is 0 and no piece), `own` of the last keys its rows' own. */
typedef struct {
    int64_t r0, rows, own, n;
    piece_t extra;
    int has_extra;
} segment_t;

/* The spans of `pieces` pieces (TASK_KEYS keys each, from each piece's first key) into
   `out` (NULL: only counted); returns how many. */
static int64_t list_spans(const piece_t *pieces, int64_t count, int64_t first, span_t *out) {
    int64_t n = 0;
    for (int64_t p = 0; p < count; p++)
        for (int64_t a = 0; a < pieces[p].length; a += TASK_KEYS, n++)
            if (out)
                out[n] = (span_t){first + p, a,
                                  a + TASK_KEYS < pieces[p].length ? a + TASK_KEYS : pieces[p].length};
    return n;
}

/* The attention of every segment's rows over the shared pieces and its own extra piece:
   tasks of (head, segment, group of ROWS rows, span) over threads, then each row's spans
   merged in order (starqa.attention.merge's rule, each span's maximum moved by its piece's
   bias). A row's result depends only on its query and its keys, never on the other rows
   or segments (each task's rows are independent; a segment's groups start at its first
   row). */
static int attend_segments(int bf16, const piece_t *shared, int64_t count, const float *q,
                           int64_t heads, int64_t rows, int64_t d, const segment_t *segs,
                           int64_t segments, float scale, float *out, float *lse,
                           int threads) {
    const int64_t common = list_spans(shared, count, 0, NULL);
    int64_t most = 0; /* the most spans a segment has */
    int64_t *first_task = malloc((size_t)(segments + 1) * sizeof(int64_t));
    if (!first_task) return 2;
    first_task[0] = 0;
    for (int64_t s = 0; s < segments; s++) {
        int64_t spans = common + (segs[s].has_extra ? list_spans(&segs[s].extra, 1, count, NULL) : 0);
        spans = spans ? spans : 1; /* no keys: one empty span (output 0, LSE -inf) */
        most = spans > most ? spans : most;
        first_task[s + 1] = first_task[s] + heads * ((segs[s].rows + ROWS - 1) / ROWS) * spans;
    }
    const int64_t tasks = first_task[segments];
    span_t *span_of = malloc((size_t)(segments * most + 1) * sizeof(span_t));
    float *state = malloc((size_t)(tasks ? tasks : 1) * ROWS * (size_t)(d + 2) * sizeof(float));
    if (!span_of || !state) {
        free(first_task), free(span_of), free(state);
        return 2;
    }
    for (int64_t s = 0; s < segments; s++) { /* segment s's spans at span_of[s * most] */
        span_t *mine = span_of + s * most;
        mine[0] = (span_t){0, 0, 0};
        int64_t n = list_spans(shared, count, 0, mine);
        if (segs[s].has_extra) list_spans(&segs[s].extra, 1, count, mine + n);
    }
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t s = 0;
        while (t >= first_task[s + 1]) s++;
        const segment_t *seg = &segs[s];
        const int64_t groups = (seg->rows + ROWS - 1) / ROWS, local = t - first_task[s];
        const int64_t spans = (first_task[s + 1] - first_task[s]) / (heads * groups);
        const int64_t h = local / (spans * groups), rest = local % (spans * groups);
        const int64_t g = rest / spans;
        const span_t sp = span_of[s * most + rest % spans];
        const int64_t r0 = g * ROWS, rn = seg->rows - r0 < ROWS ? seg->rows - r0 : ROWS;
        float *m = state + (size_t)t * ROWS * (d + 2), *l = m + ROWS, *acc = l + ROWS;
        const int any = count + seg->has_extra > 0;
        const piece_t *pc = !any ? NULL : sp.piece < count ? &shared[sp.piece] : &seg->extra;
        /* the piece's keys and values of head h; positions relative to its first key, so
           the causal limit (n - own + ...) moves by its start too */
        const int quant = pc && pc->key_scales; /* int8 rows with their scales */
        const int kind = quant ? KIND_I8 : bf16 ? KIND_BF16 : KIND_F32;
        const size_t es = kind_size(kind);
        const char *k = pc ? (const char *)(intptr_t)pc->keys + (size_t)(h * pc->key_stride) * es : NULL;
        const char *v = pc ? (const char *)(intptr_t)pc->values + (size_t)(h * pc->value_stride) * es : NULL;
        const float *ks = quant ? (const float *)(intptr_t)pc->key_scales + h * (pc->key_stride / d) : NULL;
        const float *vs = quant ? (const float *)(intptr_t)pc->value_scales + h * (pc->value_stride / d) : NULL;
        task(q + (h * rows + seg->r0) * d, d, k, v, kind, ks, vs, sp.a, sp.b,
             seg->n - (pc ? pc->start : 0), seg->own, r0, rn, scale, m, l, acc);
    }
    for (int64_t s = 0; s < segments; s++) {
        const segment_t *seg = &segs[s];
        const int64_t groups = (seg->rows + ROWS - 1) / ROWS;
        const int64_t spans = (first_task[s + 1] - first_task[s]) / (heads * groups);
        const int any = count + seg->has_extra > 0;
        for (int64_t h = 0; h < heads; h++) {
            for (int64_t r = 0; r < seg->rows; r++) {
                const int64_t g = r / ROWS, i = r % ROWS;
                const float *base = state + (size_t)(first_task[s] + (h * groups + g) * spans) *
                                                ROWS * (d + 2);
                float top = -INFINITY, total = 0.0f;
                float *o = out + (h * rows + seg->r0 + r) * d;
                for (int64_t span = 0; span < spans; span++) {
                    const float *m = base + (size_t)span * ROWS * (d + 2);
                    const int64_t piece = span_of[s * most + span].piece;
                    const float bias = !any ? 0.0f : piece < count ? shared[piece].bias : seg->extra.bias;
                    const float peak = m[i] + bias;
                    top = peak > top ? peak : top;
                }
                memset(o, 0, (size_t)d * sizeof(float));
                if (top == -INFINITY) {
                    lse[h * rows + seg->r0 + r] = -INFINITY;
                    continue;
                }
                for (int64_t span = 0; span < spans; span++) {
                    const float *m = base + (size_t)span * ROWS * (d + 2);
                    if (m[i] == -INFINITY) continue;
                    const int64_t piece = span_of[s * most + span].piece;
                    const float bias = !any ? 0.0f : piece < count ? shared[piece].bias : seg->extra.bias;
                    float w = expf(m[i] + bias - top);
                    total += w * m[ROWS + i];
                    const float *acc = m + 2 * ROWS + i * d;
                    for (int64_t x = 0; x < d; x++) o[x] += w * acc[x];
                }
                for (int64_t x = 0; x < d; x++) o[x] /= total;
                lse[h * rows + seg->r0 + r] = top + logf(total);
            }
        }
    }
    free(first_task);
    free(span_of);
    free(state);
    return 0;
}

/* The table's buffers as pieces (their biases: 0 where the table has none); 1 where the
   table is not one starqa_attend takes. */
static int table_pieces(const starqa_key_table *table, int64_t d, piece_t *out) {
    for (int64_t p = 0; p < table->pieces; p++) {
        const int64_t *st = table->starts;
        if (st[p + 1] < st[p] || (p == 0 && st[0] != 0)) return 1;
        if (table->key_scales[p] && (!table->value_scales[p] || table->key_strides[p] % d ||
                                     table->value_strides[p] % d))
            return 1;
        if (table->biases && !isfinite(table->biases[p])) return 1;
        out[p] = (piece_t){table->keys[p], table->values[p], table->key_strides[p],
                           table->value_strides[p], table->key_scales[p], table->value_scales[p],
                           st[p], st[p + 1] - st[p], table->biases ? table->biases[p] : 0.0f};
    }
    return 0;
}

/* The keys are those of the table's buffers in order (_kernels.h), so the shard's blocks
   are read where they lie (memory-mapped files) and the question's own keys from their own
   buffer, with no copy into one. */
int starqa_attend(const starqa_attend_args *args) {
    const int64_t pieces = args->table.pieces, d = args->queries.d;
    const int64_t heads = args->queries.heads, rows = args->queries.rows, own = args->own;
    if (d < 1 || d > MAX_DIM || heads < 1 || rows < 1 || pieces < 0 || own < 0 ||
        (own && rows % own))
        return 1;
    piece_t *table = malloc((size_t)(pieces + 1) * sizeof(piece_t));
    if (!table) return 2;
    int code = table_pieces(&args->table, d, table);
    const int64_t n = pieces ? args->table.starts[pieces] : 0;
    if (!code && own > n) code = 1;
    if (!code) {
        const segment_t one = {0, rows, own, n, {0}, 0};
        code = attend_segments(args->table.bf16, table, pieces, args->queries.q, heads, rows,
                               d, &one, 1, args->result.scale, args->result.out,
                               args->result.lse, args->threads);
    }
    free(table);
    return code;
}

/* Several questions' rows: the table's buffers shared, each question's own keys its own
   (_kernels.h). */
int starqa_attend_batch(const starqa_attend_batch_args *args) {
    const int64_t pieces = args->table.pieces, d = args->queries.d;
    const int64_t heads = args->queries.heads, rows = args->queries.rows;
    const int64_t segments = args->segments;
    if (d < 1 || d > MAX_DIM || heads < 1 || rows < 1 || pieces < 0 || segments < 1 ||
        args->row_starts[0] != 0 || args->row_starts[segments] != rows)
        return 1;
    piece_t *table = malloc((size_t)(pieces + 1) * sizeof(piece_t));
    segment_t *segs = malloc((size_t)segments * sizeof(segment_t));
    if (!table || !segs) {
        free(table), free(segs);
        return 2;
    }
    int code = table_pieces(&args->table, d, table);
    const int64_t shared = pieces ? args->table.starts[pieces] : 0;
    for (int64_t s = 0; s < segments && !code; s++) {
        const int64_t r0 = args->row_starts[s], count = args->row_starts[s + 1] - r0;
        const int64_t length = args->own_lengths[s], own = args->own[s];
        if (count < 1 || length < 0 || own < 0 || own > length || (own && count % own)) {
            code = 1;
            break;
        }
        segs[s] = (segment_t){r0, count, own, shared + length,
                              {args->own_keys[s], args->own_values[s], args->own_key_strides[s],
                               args->own_value_strides[s], 0, 0, shared, length, 0.0f},
                              length > 0};
    }
    if (!code)
        code = attend_segments(args->table.bf16, table, pieces, args->queries.q, heads, rows, d,
                               segs, segments, args->result.scale, args->result.out,
                               args->result.lse, args->threads);
    free(table);
    free(segs);
    return code;
}
