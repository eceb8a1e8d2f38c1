/* starqa's row-wise kernels of a decode step (loaded by starqa.native through ctypes; plain
   C): RMSNorm and RoPE, each one call where torch runs 6-8 small operators (RMSNorm ~11 µs
   a call in torch on a 2-core Zen 5, 61 calls per SmolLM2 token). Rows are independent
   and computed in one order whatever their number (drafted tokens change nothing), and the
   roundings are transformers' own:

   RMSNorm (LlamaRMSNorm): y = w · round(x / sqrt(mean(x²) + eps)), the mean and the
   normalisation in fp32, round() to the input's dtype, the product with the weight rounded
   to it again (bf16: two roundings, as transformers does; fp32: none but fp32's).

   RoPE (rotate_half convention): x' = round(round(x · cos) + round(rot(x) · sin)), each
   product and the sum rounded to the dtype as torch's bf16 operators round them, with
   rot(x) = [-x[D/2:], x[:D/2]] and cos, sin given per row in the dtype. */

#include <math.h>
#include <stdint.h>

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
