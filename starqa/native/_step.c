/* A forward's decoder layers in one call, for a world of one on the CPU (loaded by
   starqa.native.ops through ctypes; plain C).

   Per layer: _layer.c's steps before the attention; the forward's own keys and values
   written after the question's so far; the attention of its query rows over the shard and
   the own keys, by _attend.c's exact kernel (a key table laid out once) or _topk_*.c's top-k
   kernel (a top-k table laid out once); _layer.c's steps after it. These are the kernels
   starqa.models.decoder's loop calls one by one, in that order and with the same roundings (the
   query rows widened from the cache's dtype to fp32, the attention's fp32 output rounded
   to the model's dtype to nearest even, as torch converts): the same bits. What goes is
   the Python and torch work between them, ~20 tensor operations and 3-4 ctypes calls a
   layer: 6-8 ms of a 2-core machine's decode token, exact's and top-k's alike
   (benchmarks/decode_split.py).

   A layer is two structs that stay the same from call to call, laid out once by
   starqa.native.ops (_kernels.h): the model's (weights, sizes; starqa_step_model) and the
   attention's (its table, the own buffers; starqa_step_attention). Returns 0, 1 for
   impossible shapes, 2 when out of memory. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "_kernels.h"
#include "_simd.h"

/* Pages of a memory-mapped file dropped from this process (they stay in the page cache, and
   a later read maps them again): `count` (address, length) pairs, whole pages. */
static void release(const int64_t *pairs, int64_t count) {
#ifdef MADV_DONTNEED
    for (int64_t i = 0; i < count; i++)
        madvise((void *)(intptr_t)pairs[2 * i], (size_t)pairs[2 * i + 1], MADV_DONTNEED);
#else
    (void)pairs;
    (void)count;
#endif
}

/* The forward's keys and values (in qkv [M, width, D], after the query heads) written
   after the own ones so far: position i's key head j to row before + i of head j. */
static void write_own(const starqa_step_model *mw, const starqa_step_attention *aw,
                      const char *qkv, int64_t m, int64_t before) {
    const size_t es = mw->bf16 ? 2 : 4, row = (size_t)mw->dim * es;
    const int64_t heads = mw->heads, kv = mw->kv_heads, d = mw->dim, capacity = aw->capacity;
    const int64_t width = heads + 2 * kv;
    char *own_k = aw->own_k, *own_v = aw->own_v;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < kv; j++) {
            const char *src = qkv + (size_t)((i * width + heads + j) * d) * es;
            const size_t at = (size_t)((j * capacity + before + i) * d) * es;
            memcpy(own_k + at, src, row);
            memcpy(own_v + at, src + (size_t)(kv * d) * es, row);
        }
}

/* The layer's attention of the folded query rows q_rows [Hkv, G * M, D] into out and lse:
   exact's kernel over its table, the own buffer in the slot after the shard's, or top-k's
   (then the layer's mapped pages released). */
static int attend(const starqa_step_model *mw, const starqa_step_attention *aw,
                  const float *q_rows, int64_t m, int64_t before, float *out, float *lse,
                  int threads) {
    const int64_t kv = mw->kv_heads, d = mw->dim, rows = mw->heads / kv * m;
    const starqa_queries queries = {q_rows, kv, rows, d};
    const starqa_outputs result = {aw->scale, out, lse};
    if (aw->kind == STARQA_STEP_EXACT) {
        starqa_key_table table = *aw->exact;
        const int64_t pieces = table.pieces;
        table.starts[pieces + 1] = table.starts[pieces] + before + m;
        table.keys[pieces] = (int64_t)(intptr_t)aw->own_k;
        table.values[pieces] = (int64_t)(intptr_t)aw->own_v;
        table.key_strides[pieces] = aw->capacity * d;
        table.value_strides[pieces] = aw->capacity * d;
        table.key_scales[pieces] = table.value_scales[pieces] = 0; /* float keys */
        if (table.biases) table.biases[pieces] = 0.0f; /* the own keys: no context bias */
        table.pieces = pieces + 1;
        table.bf16 = mw->bf16;
        const starqa_attend_args args = {table, queries, m, result, threads};
        return starqa_attend(&args);
    }
    if (aw->kind == STARQA_STEP_TOPK) {
        const starqa_own_keys own = {mw->bf16, aw->own_k, aw->own_v, aw->capacity * d, before};
        const starqa_topk_args args = {aw->topk, queries, m, aw->k, aw->skip, aw->bias,
                                       aw->unbiased, own, result, threads};
        const int code = starqa_topk_attend(&args);
        release(aw->release, aw->releases);
        return code;
    }
    return 1;
}

/* One layer on hidden [M, H] in place. `before`: own keys already written (the question's
   and answer's so far); q_rows [Hkv, G * M, D] and lse [Hkv, G * M], fp32: where the
   folded query rows and their LSE go (starqa.phase2 keeps them for source attribution). */
static int layer(const starqa_step_model *mw, const starqa_step_attention *aw, void *hidden,
                 int64_t m, const void *cos, const void *sin, int64_t before, float *q_rows,
                 float *lse, int threads) {
    const int bf16 = mw->bf16;
    const int64_t h = mw->hidden, heads = mw->heads, kv = mw->kv_heads, d = mw->dim;
    if (kv < 1 || heads % kv || before < 0 || before + m > aw->capacity) return 1;
    const int64_t groups = heads / kv, rows = groups * m, width = heads + 2 * kv;
    const size_t es = bf16 ? 2 : 4;
    /* qkv [M, width, D] and the attention's output [M, heads * D] in the model's dtype,
       the kernel's output [Hkv, rows, D] fp32 */
    char *qkv = malloc((size_t)(m * (width + heads) * d) * es + (size_t)(kv * rows * d) * 4);
    if (!qkv) return 2;
    char *attended = qkv + (size_t)(m * width * d) * es;
    float *out = (float *)(attended + (size_t)(m * heads * d) * es);
    const starqa_before_args before_args = {
        bf16, hidden, m, h, mw->attn_norm, mw->eps, {mw->qkv, mw->qkv_bias}, width * d,
        heads + kv, d, cos, sin, qkv, threads};
    int code = starqa_layer_before(&before_args);
    if (code) goto done;
    write_own(mw, aw, qkv, m, before);
    /* query rows folded (starqa.attention.fold_gqa): KV head j's row g * M + i is query
       head j * G + g at position i, widened to fp32 */
    for (int64_t hq = 0; hq < heads; hq++)
        for (int64_t i = 0; i < m; i++) {
            const char *src = qkv + (size_t)((i * width + hq) * d) * es;
            float *to = q_rows + ((hq / groups) * rows + (hq % groups) * m + i) * d;
            for (int64_t e = 0; e < d; e++)
                to[e] = bf16 ? bf16_to_float(((const uint16_t *)src)[e]) : ((const float *)src)[e];
        }
    code = attend(mw, aw, q_rows, m, before, out, lse, threads);
    if (code) goto done;
    /* back to positions: [M, heads * D], each value rounded to the model's dtype */
    for (int64_t hq = 0; hq < heads; hq++)
        for (int64_t i = 0; i < m; i++) {
            const float *src = out + ((hq / groups) * rows + (hq % groups) * m + i) * d;
            char *to = attended + (size_t)((i * heads + hq) * d) * es;
            for (int64_t e = 0; e < d; e++) {
                if (bf16) ((uint16_t *)to)[e] = float_to_bf16(src[e]);
                else ((float *)to)[e] = src[e];
            }
        }
    const starqa_after_args after_args = {
        bf16, hidden, m, h, attended, heads * d, {mw->out, mw->out_bias}, mw->mlp_norm, mw->eps,
        {mw->gate_up, mw->gate_up_bias}, mw->inner, {mw->down, mw->down_bias}, threads};
    code = starqa_layer_after(&after_args);
done:
    free(qkv);
    return code;
}

/* Every layer of a forward of M rows: hidden [M, H] in place (after the last layer, before
   the final norm). */
int starqa_decode_layers(const starqa_decode_args *args) {
    const int64_t m = args->m;
    if (args->layers < 1 || m < 1) return 1;
    float *q_rows = args->q_rows, *lse = args->lse;
    for (int64_t l = 0; l < args->layers; l++) {
        const starqa_step_model *mw = args->model + l;
        const int code = layer(mw, args->attention + l, args->hidden, m, args->cos, args->sin,
                               args->before, q_rows, lse, args->threads);
        if (code) return code;
        const int64_t rows = mw->heads * m; /* every KV head's rows: the query heads' */
        q_rows += rows * mw->dim;
        lse += rows;
    }
    return 0;
}
