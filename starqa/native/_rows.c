/* starqa's row-wise kernels of a decode step (loaded by starqa.native.ops through ctypes; plain
   C): RMSNorm and RoPE, each one call where torch runs 6-8 small operators (RMSNorm ~11 µs
   a call in torch on a 2-core Zen 5, 61 calls per SmolLM2 token). Rows are independent
   and computed in one order whatever their number (drafted tokens change nothing), and the
   roundings are transformers' own:

   RMSNorm (LlamaRMSNorm): y = w · round(x / sqrt(mean(x²) + eps)), the mean and the
   normalisation in fp32, round() to the input's dtype, the product with the weight rounded
   to it again (bf16: two roundings, as transformers does; fp32: none but fp32's).

   RoPE (rotate_half convention): x' = round(round(x · cos) + round(rot(x) · sin)), each
   product and the sum rounded to the dtype as torch's bf16 operators round them, with
   rot(x) = [-x[D/2:], x[:D/2]] and cos, sin given per row in the dtype, from
   starqa_rope_table: angle (float)position · inv_freq in fp32 (transformers' RoPE, the
   frequencies of any scaling given: starqa.models.rope), its cos and sin by libm in fp32,
   each times the scaling's attention factor in fp32 (yarn's mscale, longrope's; 1 leaves
   the bits), rounded to the dtype.

   SiLU·mul (the MLP's gate): y = round(round(silu(g)) · u), silu in fp32 by one exp
   (starqa's exp_nonpositive, _simd.h), rounded as torch's F.silu(g) * u rounds.

   Residual and bias adds: x = round(x + y), as torch's operator rounds.

   starqa.models.decoder's CPU forward and starqa.coldstart.firsttoken's (a cold ask's first token, computed
   before torch is imported) both run these, so the two give the same bits. */

#include <math.h>
#include <stdint.h>

#include "_kernels.h"
#include "_simd.h"

static inline float get(const void *x, int bf16, int64_t i) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static inline float round_to(float f, int bf16) { /* to bf16 (nearest even) and back */
    return bf16 ? bf16_to_float(float_to_bf16(f)) : f;
}

static inline void put(void *y, int bf16, int64_t i, float f) {
    if (bf16)
        ((uint16_t *)y)[i] = float_to_bf16(f);
    else
        ((float *)y)[i] = f;
}

/* y [M, H] = RMSNorm(x [M, H]) with weight w [H]; x, w, y all bf16 or all fp32. */
void starqa_rms_norm(int bf16, const void *x, int64_t m, int64_t h, const void *w, float eps,
                     void *y) {
    for (int64_t r = 0; r < m; r++) {
        float sum = 0.0f;
        for (int64_t i = 0; i < h; i++) {
            float v = get(x, bf16, r * h + i);
            sum += v * v;
        }
        float inverse = 1.0f / sqrtf(sum / (float)h + eps);
        for (int64_t i = 0; i < h; i++)
            put(y, bf16, r * h + i,
                round_to(get(x, bf16, r * h + i) * inverse, bf16) * get(w, bf16, i));
    }
}

/* RoPE in place on the first `heads` heads of each row of x (rows `row` elements apart,
   heads of D contiguous elements), cos and sin [M, D] in x's dtype. Returns 0, or 1 where
   D is odd or over 512. */
int starqa_rope(int bf16, void *x, int64_t m, int64_t row, int64_t heads, int64_t d,
                 const void *cos, const void *sin) {
    const int64_t half = d / 2;
    float in[512];
    if (d > 512 || d % 2) return 1;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t hd = 0; hd < heads; hd++) {
            int64_t at = r * row + hd * d;
            for (int64_t i = 0; i < d; i++) in[i] = get(x, bf16, at + i);
            for (int64_t i = 0; i < d; i++) {
                float rotated = i < half ? -in[i + half] : in[i - half];
                float a = round_to(in[i] * get(cos, bf16, r * d + i), bf16);
                float b = round_to(rotated * get(sin, bf16, r * d + i), bf16);
                put(x, bf16, at + i, a + b);
            }
        }
    }
    return 0;
}

/* cos, sin [M, D] in the dtype for positions [M] (see the top). */
void starqa_rope_table(int bf16, const int64_t *position, int64_t m, const float *inv_freq,
                       int64_t d, float attention, void *cos_out, void *sin_out) {
    const int64_t half = d / 2;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t i = 0; i < half; i++) {
            float angle = (float)position[r] * inv_freq[i];
            float c = cosf(angle) * attention, s = sinf(angle) * attention;
            put(cos_out, bf16, r * d + i, c);
            put(cos_out, bf16, r * d + half + i, c);
            put(sin_out, bf16, r * d + i, s);
            put(sin_out, bf16, r * d + half + i, s);
        }
    }
}

/* y [M, N] = round(round(silu(g)) · u) for x [M, 2N], g its first N columns and u its
   last N; silu(g) = g / (1 + e^-g), computed as g / (1 + e) for g >= 0 and g · e / (1 + e)
   below, e = exp(-|g|) (so the exp never overflows). */
SIMD_CLONED(static, void, silu_mul, (int bf16, const void *x, int64_t m, int64_t n, void *y),
            (bf16, x, m, n, y)) {
    for (int64_t r = 0; r < m; r++) {
        const int64_t in = r * 2 * n, out = r * n;
        if (bf16) {
            const uint16_t *g = (const uint16_t *)x + in, *u = g + n;
            uint16_t *o = (uint16_t *)y + out;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                float v = bf16_to_float(g[i]);
                float e = exp_nonpositive(v < 0.0f ? v : -v);
                float s = bf16_to_float(float_to_bf16((v < 0.0f ? v * e : v) / (1.0f + e)));
                o[i] = float_to_bf16(s * bf16_to_float(u[i]));
            }
        } else {
            const float *g = (const float *)x + in, *u = g + n;
            float *o = (float *)y + out;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                float v = g[i], e = exp_nonpositive(v < 0.0f ? v : -v);
                o[i] = (v < 0.0f ? v * e : v) / (1.0f + e) * u[i];
            }
        }
    }
}

/* x [M, N] += y, y's rows `stride` elements apart (0: one row, a bias, added to every row
   of x), each sum rounded to the dtype. */
SIMD_CLONED(static, void, add,
            (int bf16, void *x, int64_t m, int64_t n, const void *y, int64_t stride),
            (bf16, x, m, n, y, stride)) {
    for (int64_t r = 0; r < m; r++) {
        if (bf16) {
            uint16_t *a = (uint16_t *)x + r * n;
            const uint16_t *b = (const uint16_t *)y + r * stride;
#pragma omp simd
            for (int64_t i = 0; i < n; i++)
                a[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
        } else {
            float *a = (float *)x + r * n;
            const float *b = (const float *)y + r * stride;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) a[i] += b[i];
        }
    }
}

void starqa_silu_mul(int bf16, const void *x, int64_t m, int64_t n, void *y) {
    silu_mul(bf16, x, m, n, y);
}

void starqa_add(int bf16, void *x, int64_t m, int64_t n, const void *y, int64_t stride) {
    add(bf16, x, m, n, y, stride);
}
