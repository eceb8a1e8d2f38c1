/* A forward's decoder layers in one call, for a world of one on the CPU (loaded by
   starqa.native.ops through ctypes; plain C).

   Per layer: _layer.c's steps before the attention; the forward's own keys and values
   written after the question's so far; the attention of its query rows over the shard and
   the own keys, by _attend.c's exact kernel (a key table laid out once) or _topk.c's top-k
   kernel (a top-k table laid out once); _layer.c's steps after it. These are the kernels
   starqa.models.decoder's loop calls one by one, in that order and with the same roundings (the
   query rows widened from the cache's dtype to fp32, the attention's fp32 output rounded
   to the model's dtype to nearest even, as torch converts): the same bits. What goes is
   the Python and torch work between them, ~20 tensor operations and 3-4 ctypes calls a
   layer: 6-8 ms of a 2-core machine's decode token, exact's and top-k's alike
   (benchmarks/decode_split.py).

   A layer is two arrays of int64 words that stay the same from call to call: the model's
   (weights, sizes; `M_*`) and the attention's (its table, the own buffers; `A_*`). Floats
   are stored as their fp32 bits. Returns 0, 1 for impossible shapes, 2 when out of
   memory. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "_kernels.h"
#include "_simd.h"

/* The model's words of a layer: dtype (1 bf16, 0 fp32), hidden size, query heads, KV heads,
   head size, the MLP's inner size, RMSNorm's eps (fp32 bits), then addresses: the
   attention's norm, qkv tiles and bias, output tiles and bias, the MLP's norm, gate-up tiles
   and bias, down tiles and bias (a bias 0 where there is none). */
enum { M_BF16, M_HIDDEN, M_HEADS, M_KV_HEADS, M_DIM, M_INNER, M_EPS, M_ATTN_NORM, M_QKV,
       M_QKV_BIAS, M_OUT, M_OUT_BIAS, M_MLP_NORM, M_GATE_UP, M_GATE_UP_BIAS, M_DOWN,
       M_DOWN_BIAS, M_WORDS };

/* The attention's words of a layer: its kind, the scale (fp32 bits), the own buffers
   (keys, values [Hkv, capacity, D] in the model's dtype) and their capacity, then
   exact (A_EXACT): the key table (`kernels.KeyTable`: its laid-out buffers, and the
   addresses of its starts, key and value addresses, key and value head strides; the slot
   after the laid-out buffers is the own buffer's, written here); top-k (A_TOPK): the top-k
   kernel's arguments that a `native.TopKTable` lays out, then k, the sink's rows, the
   kernel's drop, and the address and count of (address, length) pairs: the memory-mapped
   pages of the layer (--kv-on-disk) released after its attention, as
   `tensorfile.MappedTensor.release` releases them (0, 0: none). */
enum { A_KIND, A_SCALE, A_OWN_K, A_OWN_V, A_CAPACITY, A_ARGS };
enum { A_EXACT = 0, A_TOPK = 1 };
enum { E_PIECES = A_ARGS, E_STARTS, E_KEYS, E_VALUES, E_KEY_STRIDES, E_VALUE_STRIDES, E_WORDS };
enum { T_KEYS_BF16 = A_ARGS, T_VALUES_BF16, T_N, T_KBUFFERS, T_KSTART, T_KPTR, T_KSTRIDE,
       T_MAP, T_INV, T_VBUFFERS, T_VSTART, T_VPTR, T_VSTRIDE, T_LISTS, T_CENTROIDS,
       T_OFFSETS, T_PROBES, T_TAIL, T_TAIL_LISTS, T_K, T_SKIP, T_DROP, T_RELEASE, T_RELEASES,
       T_WORDS };
#define A_WORDS ((int)E_WORDS > (int)T_WORDS ? (int)E_WORDS : (int)T_WORDS)

static float word_float(int64_t word) {
    uint32_t bits = (uint32_t)word;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#define ADDR(words, i) ((void *)(intptr_t)(words)[i])

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

/* One layer on hidden [M, H] in place. `before`: own keys already written (the question's
   and answer's so far); q_rows [Hkv, G * M, D] and lse [Hkv, G * M], fp32: where the
   folded query rows and their LSE go (starqa.phase2 keeps them for source attribution). */
static int layer(const int64_t *mw, int64_t *aw, void *hidden, int64_t m, const void *cos,
                 const void *sin, int64_t before, float *q_rows, float *lse, int threads) {
    const int bf16 = (int)mw[M_BF16];
    const int64_t h = mw[M_HIDDEN], heads = mw[M_HEADS], kv = mw[M_KV_HEADS], d = mw[M_DIM];
    const int64_t capacity = aw[A_CAPACITY];
    if (kv < 1 || heads % kv || before < 0 || before + m > capacity) return 1;
    const int64_t groups = heads / kv, rows = groups * m, width = heads + 2 * kv;
    const size_t es = bf16 ? 2 : 4;
    const float eps = word_float(mw[M_EPS]);
    /* qkv [M, width, D] and the attention's output [M, heads * D] in the model's dtype,
       the kernel's output [Hkv, rows, D] fp32 */
    char *qkv = malloc((size_t)(m * (width + heads) * d) * es + (size_t)(kv * rows * d) * 4);
    if (!qkv) return 2;
    char *attended = qkv + (size_t)(m * width * d) * es;
    float *out = (float *)(attended + (size_t)(m * heads * d) * es);
    int code = starqa_layer_before(bf16, hidden, m, h, ADDR(mw, M_ATTN_NORM), eps,
                                   ADDR(mw, M_QKV), width * d, ADDR(mw, M_QKV_BIAS),
                                   heads + kv, d, cos, sin, qkv, threads);
    if (code) goto done;
    /* the forward's keys and values after the own ones so far: position i's key head j
       to row before + i of head j */
    char *own_k = ADDR(aw, A_OWN_K), *own_v = ADDR(aw, A_OWN_V);
    const size_t row = (size_t)d * es;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < kv; j++) {
            const char *src = qkv + (size_t)((i * width + heads + j) * d) * es;
            const size_t at = (size_t)((j * capacity + before + i) * d) * es;
            memcpy(own_k + at, src, row);
            memcpy(own_v + at, src + (size_t)(kv * d) * es, row);
        }
    /* query rows folded (starqa.attention.fold_gqa): KV head j's row g * M + i is query
       head j * G + g at position i, widened to fp32 */
    for (int64_t hq = 0; hq < heads; hq++)
        for (int64_t i = 0; i < m; i++) {
            const char *src = qkv + (size_t)((i * width + hq) * d) * es;
            float *to = q_rows + ((hq / groups) * rows + (hq % groups) * m + i) * d;
            for (int64_t e = 0; e < d; e++)
                to[e] = bf16 ? bf16_to_float(((const uint16_t *)src)[e]) : ((const float *)src)[e];
        }
    const float scale = word_float(aw[A_SCALE]);
    if (aw[A_KIND] == A_EXACT) { /* the own buffer in the table's slot after the shard's */
        const int64_t pieces = aw[E_PIECES];
        int64_t *starts = ADDR(aw, E_STARTS);
        starts[pieces + 1] = starts[pieces] + before + m;
        ((int64_t *)ADDR(aw, E_KEYS))[pieces] = (int64_t)(intptr_t)own_k;
        ((int64_t *)ADDR(aw, E_VALUES))[pieces] = (int64_t)(intptr_t)own_v;
        ((int64_t *)ADDR(aw, E_KEY_STRIDES))[pieces] = capacity * d;
        ((int64_t *)ADDR(aw, E_VALUE_STRIDES))[pieces] = capacity * d;
        code = starqa_attend(bf16, q_rows, pieces + 1, starts, ADDR(aw, E_KEYS),
                             ADDR(aw, E_VALUES), ADDR(aw, E_KEY_STRIDES),
                             ADDR(aw, E_VALUE_STRIDES), out, lse, kv, rows, d, m, scale,
                             threads);
    } else if (aw[A_KIND] == A_TOPK) {
        code = starqa_topk_attend(
            (int)aw[T_KEYS_BF16], (int)aw[T_VALUES_BF16], q_rows, kv, rows, m, d, aw[T_N],
            aw[T_KBUFFERS], ADDR(aw, T_KSTART), ADDR(aw, T_KPTR), ADDR(aw, T_KSTRIDE),
            ADDR(aw, T_MAP), ADDR(aw, T_INV), aw[T_VBUFFERS], ADDR(aw, T_VSTART),
            ADDR(aw, T_VPTR), ADDR(aw, T_VSTRIDE), aw[T_LISTS], ADDR(aw, T_CENTROIDS),
            ADDR(aw, T_OFFSETS), aw[T_PROBES], ADDR(aw, T_TAIL), ADDR(aw, T_TAIL_LISTS),
            aw[T_K], aw[T_SKIP], bf16, own_k, own_v, capacity * d, before, scale, out, lse,
            (int)aw[T_DROP], threads);
        release(ADDR(aw, T_RELEASE), aw[T_RELEASES]);
    } else {
        code = 1;
    }
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
    code = starqa_layer_after(bf16, hidden, m, h, attended, heads * d, ADDR(mw, M_OUT),
                              ADDR(mw, M_OUT_BIAS), ADDR(mw, M_MLP_NORM), eps,
                              ADDR(mw, M_GATE_UP), mw[M_INNER], ADDR(mw, M_GATE_UP_BIAS),
                              ADDR(mw, M_DOWN), ADDR(mw, M_DOWN_BIAS), threads);
done:
    free(qkv);
    return code;
}

/* Every layer of a forward of M rows: hidden [M, H] in place (after the last layer, before
   the final norm), cos and sin [M, D] its RoPE; model and attention: `layers` arrays of
   M_WORDS and A_WORDS words, one after the other; `before` as for `layer`. q_rows [L, Hkv,
   G * M, D] and lse [L, Hkv, G * M], fp32: each layer's folded query rows and their LSE. */
int starqa_decode_layers(int64_t layers, const int64_t *model, int64_t *attention,
                         void *hidden, int64_t m, const void *cos, const void *sin,
                         int64_t before, float *q_rows, float *lse, int threads) {
    if (layers < 1 || m < 1) return 1;
    for (int64_t l = 0; l < layers; l++) {
        const int64_t *mw = model + l * M_WORDS;
        const int64_t rows = mw[M_HEADS] * m; /* every KV head's rows: the query heads' */
        const int code = layer(mw, attention + l * A_WORDS, hidden, m, cos, sin, before,
                               q_rows + l * rows * mw[M_DIM], lse + l * rows, threads);
        if (code) return code;
    }
    return 0;
}

/* The word counts, for the caller's arrays: model, attention. */
int64_t starqa_step_words(int which) { return which ? A_WORDS : M_WORDS; }
