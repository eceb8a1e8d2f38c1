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
static int linear(int bf16, const void *x, int64_t m, int64_t k, starqa_linear w, int64_t n,
                  void *y, int threads) {
    const starqa_int4_args product = {bf16, x, m, k, w.tiles, n, bf16, y, 1, threads};
    const int code = starqa_int4_mm(&product);
    if (!code && w.bias) starqa_add(bf16, y, m, n, w.bias, 0);
    return code;
}

/* hidden [M, H] → out [M, N] (N = heads · D, the query, key and value heads side by side),
   RoPE'd on its first `rotated` heads with cos, sin [M, D]. */
int starqa_layer_before(const starqa_before_args *args) {
    const int bf16 = args->bf16;
    const int64_t m = args->m, h = args->h, n = args->n, d = args->d;
    if (m < 1 || h < 1 || d < 1 || n % d || args->rotated < 0 || args->rotated > n / d)
        return 1;
    const size_t esize = bf16 ? 2 : 4;
    void *x = malloc((size_t)(m * h) * esize);
    if (!x) return 2;
    starqa_rms_norm(bf16, args->hidden, m, h, args->norm, args->eps, x);
    int code = linear(bf16, x, m, h, args->qkv, n, args->out, args->threads);
    free(x);
    if (!code && starqa_rope(bf16, args->out, m, n, args->rotated, d, args->cos, args->sin))
        code = 1;
    return code;
}

/* hidden [M, H] in place, from the attention's output attn [M, K] (its heads side by side):
   the output projection and residual, then the MLP (gate and up [2I], down) and its
   residual. */
int starqa_layer_after(const starqa_after_args *args) {
    const int bf16 = args->bf16, threads = args->threads;
    const int64_t m = args->m, h = args->h, k = args->k, inner = args->inner;
    void *hidden = args->hidden;
    if (m < 1 || h < 1 || k < 1 || inner < 1) return 1;
    const size_t esize = bf16 ? 2 : 4;
    char *y = malloc((size_t)(m * (2 * h + 3 * inner)) * esize);
    if (!y) return 2;
    char *x = y + (size_t)(m * h) * esize, *gate_up = x + (size_t)(m * h) * esize;
    char *act = gate_up + (size_t)(m * 2 * inner) * esize;
    int code = linear(bf16, args->attn, m, k, args->out, h, y, threads);
    if (!code) {
        starqa_add(bf16, hidden, m, h, y, h);
        starqa_rms_norm(bf16, hidden, m, h, args->norm, args->eps, x);
        code = linear(bf16, x, m, h, args->gate_up, 2 * inner, gate_up, threads);
    }
    if (!code) {
        starqa_silu_mul(bf16, gate_up, m, inner, act);
        code = linear(bf16, act, m, inner, args->down, h, y, threads);
    }
    if (!code) starqa_add(bf16, hidden, m, h, y, h);
    free(y);
    return code;
}
