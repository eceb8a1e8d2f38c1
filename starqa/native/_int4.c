/* starqa's int4 matrix product for decode (loaded by starqa.native.ops through ctypes; plain C):
   y = x Wᵀ for a few rows x [M, K] (bf16 or fp32) and int4 weights W [N, K] in groups of
   32 along K, each group asymmetric: w = q · scale + (zero - 8 · scale), q in 0..15, with
   scale and zero bf16 per (output, group) (starqa.models.decoder.Linear's int4, the same numbers
   torch's packed CPU format holds).

   Why starqa has its own: decode reads every weight once per token, so this product should
   run at memory speed; torch's `_weight_int4pack_mm_for_cpu` widens every weight to fp32
   and stays near 25-30 GB/s of weights on a 2-core Zen 5, which is most of a decode step
   (Qwen2.5-Coder-1.5B: 27 of 31 ms). Here the activations are quantised to 14 bits per
   group of 32, written as two int8 digits (x14 = 128 · h + l, |h| <= 64, -64 <= l < 64),
   and each group's dot products are integer sums of 4 products at a time (AVX-512 VNNI
   `vpdpbusd`: 64 products per instruction; two per digit pair), scaled once per group:

       y[m, n] = sum over groups g of  scale[n, g] · sx[m, g] · sum_i q[n, i] · x14[m, i]
                                     + (zero[n, g] - 8 · scale[n, g]) · xsum[m, g]

   with x14 = round(x / sx), sx = max |x| / 8191 over the group, and xsum the group's exact
   fp32 sum of x. 14 bits keep an activation within 1/16382 of its group's largest, finer
   than bf16 itself rounds it: 8 bits (llama.cpp's Q8 blocks; this kernel's first version)
   cost SmolLM2 two answers of twenty at 8K tokens against torch's int4 kernel. The integer
   sums are exact; per row the float steps run in one order whatever M is, so a row's
   result never depends on the other rows (drafted tokens).

   Layout ("tiles"): N / 16 tiles of 16 outputs; a tile is K / 32 records of 320 bytes:
   256 bytes of nibbles, then 16 bf16 scales and 16 bf16 zeros. Nibble byte
   64 · c + 4 · lane + j holds q[lane, 4c + j] (low nibble) and q[lane, 16 + 4c + j] (high),
   c, j in 0..3: each 64-byte chunk gives, by a mask or a shift, 16 lanes of 4 consecutive
   weights, what `vpdpbusd` multiplies by 4 consecutive activations. A thread streams whole
   tiles, so it reads one contiguous run of memory. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_kernels.h"
#include "_simd.h"

#define GROUP 32
#define RECORD 320 /* bytes of one tile's group: 256 of nibbles, 32 of scales, 32 of zeros */
#define DIGITS 64  /* bytes of one row's group of activations: 32 high digits, 32 low */
#define LEVELS 8191.0f /* the largest |x14| */
#define ROW_STEP 4 /* rows sharing one pass over a tile's weights */
/* Records ahead that the fast path asks the memory for: one stream per thread left the
   hardware prefetcher alone ~30 GB/s from memory; 16 records (5 KB) ahead, 45-50. */
#define PREFETCH 16

/* Row r of x [M, K] → its digits (x8: DIGITS bytes a group), sx and xsum, stored
   group-major (group g of row r at g · M + r: a group's rows lie side by side, as the
   tiles read them). */
static void quantise_row(const void *x, int bf16, int64_t r, int64_t m, int64_t k, int8_t *x8,
                         float *sx, float *xsum) {
    float row[GROUP];
    for (int64_t g = 0; g < k / GROUP; g++) {
        float top = 0.0f, sum = 0.0f;
        for (int i = 0; i < GROUP; i++) {
            int64_t at = r * k + g * GROUP + i;
            row[i] = bf16 ? bf16_to_float(((const uint16_t *)x)[at]) : ((const float *)x)[at];
            float a = fabsf(row[i]);
            top = a > top ? a : top;
            sum += row[i];
        }
        float inverse = top > 0.0f ? LEVELS / top : 0.0f;
        int8_t *digits = x8 + (g * m + r) * DIGITS;
        for (int i = 0; i < GROUP; i++) {
            int32_t x14 = (int32_t)lrintf(row[i] * inverse);
            int32_t high = (x14 + 64) >> 7; /* floor: x14 - 128 · high in [-64, 64) */
            digits[i] = (int8_t)high;
            digits[GROUP + i] = (int8_t)(x14 - 128 * high);
        }
        sx[g * m + r] = top / LEVELS;
        xsum[g * m + r] = sum;
    }
}

/* Rows r0 .. r0 + rn of one tile (w: its first record), any C compiler. */
static void tile_plain(const uint8_t *w, int64_t groups, const int8_t *x8, const float *sx,
                       const float *xsum, int64_t m, int64_t r0, int64_t rn, float *y) {
    for (int64_t r = r0; r < r0 + rn; r++) {
        for (int lane = 0; lane < 16; lane++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                const uint8_t *rec = w + g * RECORD;
                const int8_t *xg = x8 + (g * m + r) * DIGITS;
                int32_t dot_high = 0, dot_low = 0;
                for (int c = 0; c < 4; c++)
                    for (int j = 0; j < 4; j++) {
                        uint8_t byte = rec[64 * c + 4 * lane + j];
                        int i = 4 * c + j;
                        dot_high += (byte & 15) * xg[i] + (byte >> 4) * xg[16 + i];
                        dot_low += (byte & 15) * xg[GROUP + i] + (byte >> 4) * xg[GROUP + 16 + i];
                    }
                int32_t dot = 128 * dot_high + dot_low;
                const uint16_t *scales = (const uint16_t *)(rec + 256); /* then the zeros */
                float scale = bf16_to_float(scales[lane]);
                float low = bf16_to_float(scales[16 + lane]) - scale * 8.0f;
                acc = fmaf((float)dot, scale * sx[g * m + r], acc);
                acc = fmaf(low, xsum[g * m + r], acc);
            }
            y[(r - r0) * 16 + lane] = acc;
        }
    }
}

#ifdef STARQA_X86
#define VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma")))

static int has_vnni(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = has_avx512() && __builtin_cpu_supports("avx512vnni");
    }
    return known;
}

/* The same sums as tile_plain, 16 outputs per register. Each group's 8 integer dot products
   run as 4 independent pairs (their latency would otherwise bound a row's pass). */
VNNI static void tile_vnni(const uint8_t *w, int64_t groups, const int8_t *x8, const float *sx,
                           const float *xsum, int64_t m, int64_t r0, int64_t rn, float *y) {
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512 acc[ROW_STEP];
    for (int r = 0; r < ROW_STEP; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *rec = w + g * RECORD;
        for (int line = 0; line < RECORD; line += 64) /* the stream ahead, from memory */
            _mm_prefetch((const char *)rec + PREFETCH * RECORD + line, _MM_HINT_T0);
        __m512i lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            __m512i bytes = _mm512_loadu_si512((const void *)(rec + 64 * c));
            lo[c] = _mm512_and_si512(bytes, nibble);
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
        }
        __m512 scale = load16((const char *)rec + 256, 1);
        __m512 low = _mm512_sub_ps(load16((const char *)rec + 288, 1),
                                   _mm512_mul_ps(scale, _mm512_set1_ps(8.0f)));
        for (int64_t r = 0; r < rn; r++) {
            const int32_t *xh = (const int32_t *)(x8 + (g * m + r0 + r) * DIGITS), *xl = xh + 8;
            __m512i dh[4], dl[4];
            for (int c = 0; c < 4; c++) {
                dh[c] = _mm512_dpbusd_epi32(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[c], _mm512_set1_epi32(xh[c])),
                    hi[c], _mm512_set1_epi32(xh[4 + c]));
                dl[c] = _mm512_dpbusd_epi32(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[c], _mm512_set1_epi32(xl[c])),
                    hi[c], _mm512_set1_epi32(xl[4 + c]));
            }
            __m512i dot_high = _mm512_add_epi32(_mm512_add_epi32(dh[0], dh[1]),
                                                _mm512_add_epi32(dh[2], dh[3]));
            __m512i dot_low = _mm512_add_epi32(_mm512_add_epi32(dl[0], dl[1]),
                                               _mm512_add_epi32(dl[2], dl[3]));
            __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dot_high, 7), dot_low);
            int64_t at = g * m + r0 + r;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                     _mm512_mul_ps(scale, _mm512_set1_ps(sx[at])), acc[r]);
            acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(xsum[at]), acc[r]);
        }
    }
    for (int64_t r = 0; r < rn; r++) _mm512_storeu_ps(y + r * 16, acc[r]);
}

/* The 16-bit sums of a half tile's 8 lanes with one digit (d [8]: the group's 32 digits
   as 8 words of 4): for each lane, pairs of nibble · digit products (maddubs), the 8
   registers' pairs added in 16 bits (each pair is at most 2 · 15 · 64 = 1,920 in size, so
   8 of them, 15,360, never overflow), then pairs of those to 32 bits: per lane the exact
   integer dot product of its 32 nibbles with the digits. */
AVX2 static inline __m256i dot_digits(const __m256i *lo, const __m256i *hi, const int32_t *d) {
    __m256i sum = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(d[0]));
    sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(d[4])));
    for (int c = 1; c < 4; c++) {
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(lo[c], _mm256_set1_epi32(d[c])));
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(hi[c], _mm256_set1_epi32(d[4 + c])));
    }
    return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
}

/* tile_vnni for CPUs with AVX2 but no AVX-512 VNNI: the same integer sums and float steps
   (so the same bits), a tile's 16 outputs as two halves of 8. */
AVX2 static void tile_avx2(const uint8_t *w, int64_t groups, const int8_t *x8, const float *sx,
                           const float *xsum, int64_t m, int64_t r0, int64_t rn, float *y) {
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256 acc[ROW_STEP][2];
    for (int r = 0; r < ROW_STEP; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *rec = w + g * RECORD;
        for (int line = 0; line < RECORD; line += 64)
            _mm_prefetch((const char *)rec + PREFETCH * RECORD + line, _MM_HINT_T0);
        for (int half = 0; half < 2; half++) { /* lanes 8 · half .. 8 · half + 7 */
            __m256i lo[4], hi[4];
            for (int c = 0; c < 4; c++) {
                __m256i bytes = _mm256_loadu_si256((const __m256i *)(rec + 64 * c + 32 * half));
                lo[c] = _mm256_and_si256(bytes, nibble);
                hi[c] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
            }
            __m256 scale = load8((const char *)rec + 256 + 16 * half, 1);
            __m256 low = _mm256_sub_ps(load8((const char *)rec + 288 + 16 * half, 1),
                                       _mm256_mul_ps(scale, _mm256_set1_ps(8.0f)));
            for (int64_t r = 0; r < rn; r++) {
                const int32_t *xh = (const int32_t *)(x8 + (g * m + r0 + r) * DIGITS), *xl = xh + 8;
                __m256i dot = _mm256_add_epi32(_mm256_slli_epi32(dot_digits(lo, hi, xh), 7),
                                               dot_digits(lo, hi, xl));
                int64_t at = g * m + r0 + r;
                acc[r][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                               _mm256_mul_ps(scale, _mm256_set1_ps(sx[at])),
                                               acc[r][half]);
                acc[r][half] = _mm256_fmadd_ps(low, _mm256_set1_ps(xsum[at]), acc[r][half]);
            }
        }
    }
    for (int64_t r = 0; r < rn; r++) {
        _mm256_storeu_ps(y + r * 16, acc[r][0]);
        _mm256_storeu_ps(y + r * 16 + 8, acc[r][1]);
    }
}
#endif

/* The fast path this CPU runs: 2 AVX-512 VNNI, 1 AVX2 (with FMA), 0 none. */
int starqa_int4_fast(void) {
#ifdef STARQA_X86
    return has_vnni() ? 2 : has_avx2() ? 1 : 0;
#else
    return 0;
#endif
}

/* y [M, N] = x [M, K] Wᵀ, W in the tiles layout above (N a multiple of 16, K of 32); x and
   y bf16 or fp32 (x_bf16, y_bf16). fast = 0 runs the plain C path (tests compare both).
   Returns 0, 1 for impossible shapes, 2 when out of memory. */
int starqa_int4_mm(const starqa_int4_args *args) {
    const int x_bf16 = args->x_bf16, y_bf16 = args->y_bf16, threads = args->threads;
    const void *x = args->x;
    const int64_t m = args->m, k = args->k, n = args->n;
    const uint8_t *w = args->w;
    void *y = args->y;
    if (m < 0 || k <= 0 || n <= 0 || k % GROUP || n % 16) return 1;
    if (m == 0) return 0;
    int64_t groups = k / GROUP, tiles = n / 16;
    int8_t *x8 = malloc((size_t)(m * groups * DIGITS));
    float *sx = malloc((size_t)(2 * m * groups) * sizeof(float));
    if (!x8 || !sx) {
        free(x8);
        free(sx);
        return 2;
    }
    float *xsum = sx + m * groups;
    for (int64_t r = 0; r < m; r++)
        quantise_row(x, x_bf16, r, m, k, x8, sx, xsum);
    const int fast = args->fast ? starqa_int4_fast() : 0;
#pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *tile = w + (size_t)t * (size_t)groups * RECORD;
        float part[ROW_STEP * 16];
        for (int64_t r0 = 0; r0 < m; r0 += ROW_STEP) {
            int64_t rn = m - r0 < ROW_STEP ? m - r0 : ROW_STEP;
#ifdef STARQA_X86
            if (fast == 2)
                tile_vnni(tile, groups, x8, sx, xsum, m, r0, rn, part);
            else if (fast == 1)
                tile_avx2(tile, groups, x8, sx, xsum, m, r0, rn, part);
            else
#endif
                tile_plain(tile, groups, x8, sx, xsum, m, r0, rn, part);
            for (int64_t r = 0; r < rn; r++) {
                int64_t at = (r0 + r) * n + t * 16;
                if (y_bf16)
                    for (int lane = 0; lane < 16; lane++)
                        ((uint16_t *)y)[at + lane] = float_to_bf16(part[r * 16 + lane]);
                else
                    memcpy((float *)y + at, part + r * 16, 16 * sizeof(float));
            }
        }
    }
    free(sx);
    free(x8);
    return 0;
}
