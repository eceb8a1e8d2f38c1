/* A decoder layer's work on either side of its attention, one call each (loaded by
   starqa.native.ops through ctypes, and by starqa.coldstart.firsttoken on numpy arrays; plain C).

   Each side is a few of starqa's own kernels (_rows.c's RMSNorm, RoPE, SiLU·mul and adds,
   _int4.c's int4 product) called in the order, and with the buffers, that the callers
   used to call them one by one from Python: about ten calls a layer, whose overhead
   (argument checks, tensors made, ctypes) was ~3 of SmolLM2's 10-13 ms a decode step on a
   2-core Zen 3 (benchmarks/dev/decode_step.py). Same kernels, same order: the same bits.

   before: x = RMSNorm(hidden); qkv = x Wqkvᵀ (+ bias); RoPE on qkv's first `rotated` heads.
   after:  hidden = round(hidden + (attn Woᵀ (+ bias)));  x = RMSNorm(hidden);
           hidden = round(hidden + silu·mul(x Wguᵀ (+ bias)) Wdᵀ (+ bias)).

   Weights in _int4.c's tiles ([N / 16, K / 32, 320] bytes); every activation, norm weight
   and bias in one dtype, bf16 or fp32. Both return 0, 1 for impossible shapes, 2 when out
   of memory. */

#include <stdint.h>
#include <stdlib.h>

#include "_kernels.h"

/* y [M, N] = x [M, K] Wᵀ (+ bias [N]): a Linear of int4 tiles, as starqa.models.decoder's. */
static int linear(int bf16, const void *x, int64_t m, int64_t k, const uint8_t *w,
                  int64_t n, const void *bias, void *y, int threads) {
    const int code = starqa_int4_mm(bf16, x, m, k, w, n, bf16, y, 1, threads);
    if (!code && bias) starqa_add(bf16, y, m, n, bias, 0);
    return code;
}

/* hidden [M, H] → qkv [M, N] (N = heads · D, the query, key and value heads side by side),
   RoPE'd on its first `rotated` heads with cos, sin [M, D]. */
int starqa_layer_before(int bf16, const void *hidden, int64_t m, int64_t h, const void *norm,
                        float eps, const uint8_t *w_qkv, int64_t n, const void *bias,
                        int64_t rotated, int64_t d, const void *cos, const void *sin,
                        void *qkv, int threads) {
    if (m < 1 || h < 1 || d < 1 || n % d || rotated < 0 || rotated > n / d) return 1;
    const size_t esize = bf16 ? 2 : 4;
    void *x = malloc((size_t)(m * h) * esize);
    if (!x) return 2;
    starqa_rms_norm(bf16, hidden, m, h, norm, eps, x);
    int code = linear(bf16, x, m, h, w_qkv, n, bias, qkv, threads);
    free(x);
    if (!code && starqa_rope(bf16, qkv, m, n, rotated, d, cos, sin)) code = 1;
    return code;
}

/* hidden [M, H] in place, from the attention's output attn [M, K] (its heads side by side):
   the output projection and residual, then the MLP (gate and up [2I], down) and its
   residual. */
int starqa_layer_after(int bf16, void *hidden, int64_t m, int64_t h, const void *attn,
                       int64_t k, const uint8_t *w_out, const void *bias_out, const void *norm,
                       float eps, const uint8_t *w_gate_up, int64_t inner,
                       const void *bias_gate_up, const uint8_t *w_down, const void *bias_down,
                       int threads) {
    if (m < 1 || h < 1 || k < 1 || inner < 1) return 1;
    const size_t esize = bf16 ? 2 : 4;
    char *y = malloc((size_t)(m * (2 * h + 3 * inner)) * esize);
    if (!y) return 2;
    char *x = y + (size_t)(m * h) * esize, *gate_up = x + (size_t)(m * h) * esize;
    char *act = gate_up + (size_t)(m * 2 * inner) * esize;
    int code = linear(bf16, attn, m, k, w_out, h, bias_out, y, threads);
    if (!code) {
        starqa_add(bf16, hidden, m, h, y, h);
        starqa_rms_norm(bf16, hidden, m, h, norm, eps, x);
        code = linear(bf16, x, m, h, w_gate_up, 2 * inner, bias_gate_up, gate_up, threads);
    }
    if (!code) {
        starqa_silu_mul(bf16, gate_up, m, inner, act);
        code = linear(bf16, act, m, inner, w_down, h, bias_down, y, threads);
    }
    if (!code) starqa_add(bf16, hidden, m, h, y, h);
    free(y);
    return code;
}
