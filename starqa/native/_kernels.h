/* The boundary of starqa's CPU kernels: every entry point of the library (_attend*.so) and
   every struct they take, declared once. Each defining file includes this, so a definition
   that drifted from its declaration is a compile error; starqa/native/kernels.py mirrors
   each struct as a ctypes.Structure and each prototype as a signature, and
   tests/test_kernel_boundary.py checks that mirror against this file, field by field (so
   keep to its grammar: `typedef struct { ... } name;`, one field or parameter per
   declarator, the types below). What each kernel computes: its own file.

   Arrays are passed by address, their layouts in brackets ([H, R, D]: H heads of R rows of
   D elements, the last fastest); "bf16" flags say whether the 16-bit or the fp32 layout is
   meant. Kernels that can fail return 0, 1 for impossible arguments, 2 out of memory. */

#ifndef STARQA_KERNELS_H
#define STARQA_KERNELS_H

#include <stdint.h>

/* The library exports the entry points only (it is built with -fvisibility=hidden). */
#define STARQA_API __attribute__((visibility("default")))

/* ---- shared pieces ------------------------------------------------------------------ */

/* Query rows: q fp32 [heads, rows, d]. */
typedef struct {
    const float *q;
    int64_t heads;
    int64_t rows;
    int64_t d;
} starqa_queries;

/* Where the attention of query rows goes: out fp32 [H, R, D] and its log-sum-exp lse fp32
   [H, R] (scores scaled by `scale`; a row with no key gets 0 and -inf). */
typedef struct {
    float scale;
    float *out;
    float *lse;
} starqa_outputs;

/* ---- exact attention (_attend.c) ---------------------------------------------------- */

/* Key and value buffers in order, `pieces` of them (kernels.KeyTable lays them out once):
   piece p holds positions starts[p] .. starts[p + 1] - 1 (starts[0] = 0), its keys at
   address keys[p] and values at values[p], [H, >= its length, D], heads key_strides[p] and
   value_strides[p] elements apart, bf16 or fp32 (the `bf16` flag); or, where key_scales[p]
   is not 0, int8 rows (int8 KV), each row with an fp32 scale: key_scales[p] and
   value_scales[p] [H, >= its length], laid out as the rows (heads key_strides[p] / D
   apart). biases[p] (fp32; biases NULL: all 0) is added to the score of every key of
   piece p before the softmax (Phase 2's context bias: b on a shard's pieces, 0 on the own
   keys). Arrays of int64 (addresses as integers) but biases; _step.c writes the question's
   own buffer (float, bias 0) into the slot after the laid-out ones. */
typedef struct {
    int bf16;
    int64_t pieces;
    int64_t *starts;
    int64_t *keys;
    int64_t *values;
    int64_t *key_strides;
    int64_t *value_strides;
    int64_t *key_scales;
    int64_t *value_scales;
    float *biases;
} starqa_key_table;

/* starqa_attend: the rows over the table's keys; own = M > 0: the last M keys are the M
   query positions' own, attended causally (rows are G blocks of M, the position fastest). */
typedef struct {
    starqa_key_table table;
    starqa_queries queries;
    int64_t own;
    starqa_outputs result;
    int threads;
} starqa_attend_args;

STARQA_API int starqa_attend(const starqa_attend_args *args);

/* starqa_attend_batch: several questions' rows over the table's buffers (the laid-out ones,
   no slot filled), then each over its own keys: segment s holds rows row_starts[s] ..
   row_starts[s + 1] - 1 of every head (G blocks of own[s] positions, the position fastest;
   row_starts[segments] = rows) and its own buffer (keys at own_keys[s], values at
   own_values[s], [H, >= own_lengths[s], D], heads own_key_strides[s] and
   own_value_strides[s] elements apart, of the table's float kind, bias 0), own[s] of its
   keys its rows' own. The shard is read once for every question; each row gets, bit for
   bit, what starqa_attend gives it over the table with its own buffer in the slot. */
typedef struct {
    starqa_key_table table;
    starqa_queries queries;
    int64_t segments;
    int64_t *row_starts;
    int64_t *own_keys;
    int64_t *own_values;
    int64_t *own_lengths;
    int64_t *own_key_strides;
    int64_t *own_value_strides;
    int64_t *own;
    starqa_outputs result;
    int threads;
} starqa_attend_batch_args;

STARQA_API int starqa_attend_batch(const starqa_attend_batch_args *args);

/* ---- top-k attention (_topk_*.c) ---------------------------------------------------- */

/* Key buffers (by position) or value buffers (by shard row): buffer b holds rows
   start[b] .. start[b + 1] - 1 of every head, head h at element h * stride[b] of address
   ptr[b]; count buffers (start has count + 1). */
typedef struct {
    int bf16;
    int64_t count;
    const int64_t *start;
    const int64_t *ptr;
    const int64_t *stride;
} starqa_buffers;

/* ivf's lists of positions: list c of head h holds positions offsets[h][c] ..
   offsets[h][c + 1] - 1, centroids bf16 [H, count, D]; a row scans its `probes` nearest.
   The tail (both NULL: none): each list's mean value, bf16 [H, count, D], and each shard
   row's list, int32 [H, N]. Flat: count 1, probes 1, the arrays NULL. */
typedef struct {
    int64_t count;
    const uint16_t *centroids;
    const int64_t *offsets;
    int64_t probes;
    const uint16_t *tail;
    const int32_t *tail_lists;
} starqa_lists;

/* What the top-k kernel reads that stays the same from call to call (ops.TopKTable): n
   positions per head; map int64 [H, N] each position's shard row and inv int32 [H, N] each
   shard row's position (both NULL: the same); values.count 0: a table that only selects.
   drop: STARQA_DROP_KEYS where the key buffers are clean private file mappings whose pages
   the scan drops as it passes them (flat's --kv-on-disk). */
#define STARQA_DROP_KEYS 1
typedef struct {
    int64_t n;
    starqa_buffers keys;
    const int64_t *map;
    const int32_t *inv;
    starqa_buffers values;
    starqa_lists lists;
    int drop;
} starqa_topk_table;

/* The query host's own keys and values (k NULL: none): head h's row j at element
   h * stride + j * D; the call's position m sees the first before + m + 1 of them. */
typedef struct {
    int bf16;
    const char *k;
    const char *v;
    int64_t stride;
    int64_t before;
} starqa_own_keys;

/* starqa_topk_attend: R = G * tokens rows (G query heads per KV head, each at `tokens`
   positions, the position fastest), each over its k best keys (the G rows of a position
   over the union of their picks), the sink (shard rows below `skip`) and its own keys.
   bias: added to the scaled score of every shard key (the sink's, the picks', the tail's)
   but the shard rows below `unbiased` (the keys the context holds once, Phase 2's context
   bias), never to the own keys'; the picks do not depend on it. */
typedef struct {
    const starqa_topk_table *table;
    starqa_queries queries;
    int64_t tokens;
    int64_t k;
    int64_t skip;
    float bias;
    int64_t unbiased;
    starqa_own_keys own;
    starqa_outputs result;
    int threads;
} starqa_topk_args;

STARQA_API int starqa_topk_attend(const starqa_topk_args *args);

/* starqa_topk_select: each row's k best keys without attending; rows int64 and scores fp32
   [H, R, k] (shard rows and raw inner products; -1 and -inf past the keys found). */
typedef struct {
    const starqa_topk_table *table;
    starqa_queries queries;
    int64_t k;
    int64_t skip;
    int64_t *rows;
    float *scores;
    int threads;
} starqa_select_args;

STARQA_API int starqa_topk_select(const starqa_select_args *args);

/* ---- int4 weights (_int4.c) --------------------------------------------------------- */

/* y [M, N] = x [M, K] times the int4 tiles w (N outputs) transposed; x and y bf16 or fp32;
   fast 0: the plain C path (tests compare both). */
typedef struct {
    int x_bf16;
    const void *x;
    int64_t m;
    int64_t k;
    const uint8_t *w;
    int64_t n;
    int y_bf16;
    void *y;
    int fast;
    int threads;
} starqa_int4_args;

STARQA_API int starqa_int4_mm(const starqa_int4_args *args);
/* The fast path this CPU runs: 2 AVX-512 VNNI, 1 AVX2, 0 none. */
STARQA_API int starqa_int4_fast(void);

/* ---- rows (_rows.c) ----------------------------------------------------------------- */

STARQA_API void starqa_rms_norm(int bf16, const void *x, int64_t m, int64_t h, const void *w,
                                float eps, void *y);
STARQA_API int starqa_rope(int bf16, void *x, int64_t m, int64_t row, int64_t heads, int64_t d,
                           const void *cos, const void *sin);
/* cos, sin [M, D] of angles position · inv_freq, each times `attention` in fp32 (a RoPE
   scaling's factor on cos and sin: yarn's, longrope's; 1 otherwise), in the dtype. */
STARQA_API void starqa_rope_table(int bf16, const int64_t *position, int64_t m,
                                  const float *inv_freq, int64_t d, float attention,
                                  void *cos_out, void *sin_out);
STARQA_API void starqa_silu_mul(int bf16, const void *x, int64_t m, int64_t n, void *y);
STARQA_API void starqa_add(int bf16, void *x, int64_t m, int64_t n, const void *y,
                           int64_t stride);

/* ---- a decoder layer (_layer.c) ----------------------------------------------------- */

/* A linear layer: int4 tiles (_int4.c's layout) and a bias in the model's dtype (NULL:
   none). */
typedef struct {
    const uint8_t *tiles;
    const void *bias;
} starqa_linear;

/* starqa_layer_before: qkv [M, N] = RMSNorm(hidden [M, H]) times qkv's weights, RoPE'd on
   its first `rotated` heads of D with cos, sin [M, D]. */
typedef struct {
    int bf16;
    const void *hidden;
    int64_t m;
    int64_t h;
    const void *norm;
    float eps;
    starqa_linear qkv;
    int64_t n;
    int64_t rotated;
    int64_t d;
    const void *cos;
    const void *sin;
    void *out;
    int threads;
} starqa_before_args;

STARQA_API int starqa_layer_before(const starqa_before_args *args);

/* starqa_layer_after: hidden [M, H] in place from the attention's output attn [M, K]: the
   output projection and its residual, RMSNorm, the MLP (gate and up [2 inner], down) and
   its residual. */
typedef struct {
    int bf16;
    void *hidden;
    int64_t m;
    int64_t h;
    const void *attn;
    int64_t k;
    starqa_linear out;
    const void *norm;
    float eps;
    starqa_linear gate_up;
    int64_t inner;
    starqa_linear down;
    int threads;
} starqa_after_args;

STARQA_API int starqa_layer_after(const starqa_after_args *args);

/* ---- a forward's layers in one call (_step.c) --------------------------------------- */

/* A decoder layer as the step reads it (laid out once): its sizes, RMSNorm's eps, its norms
   and its weights (int4 tiles; a bias NULL where there is none). */
typedef struct {
    int bf16;
    int64_t hidden;
    int64_t heads;
    int64_t kv_heads;
    int64_t dim;
    int64_t inner;
    float eps;
    const void *attn_norm;
    const uint8_t *qkv;
    const void *qkv_bias;
    const uint8_t *out;
    const void *out_bias;
    const void *mlp_norm;
    const uint8_t *gate_up;
    const void *gate_up_bias;
    const uint8_t *down;
    const void *down_bias;
} starqa_step_model;

#define STARQA_STEP_EXACT 0
#define STARQA_STEP_TOPK 1

/* A layer's attention as the step reads it (laid out once): its kind, the scale, the own
   buffers (keys, values [Hkv, capacity, D] in the model's dtype), then exact's key table
   (the own buffer goes in the slot after its pieces) or top-k's table, k, the sink's rows
   and `releases` (address, length) pairs at `release`: the memory-mapped pages of the layer
   (--kv-on-disk) dropped after its attention; bias and unbiased: top-k's
   (starqa_topk_args'; exact's are its table's biases). */
typedef struct {
    int kind;
    float scale;
    void *own_k;
    void *own_v;
    int64_t capacity;
    const starqa_key_table *exact;
    const starqa_topk_table *topk;
    int64_t k;
    int64_t skip;
    const int64_t *release;
    int64_t releases;
    float bias;
    int64_t unbiased;
} starqa_step_attention;

/* starqa_decode_layers: every layer of a forward of M rows on hidden [M, H] in place;
   model and attention [layers]; cos, sin [M, D]; before: the own keys written before this
   forward's; q_rows [L, Hkv, G * M, D] and lse [L, Hkv, G * M] fp32: each layer's folded
   query rows and their LSE. */
typedef struct {
    int64_t layers;
    const starqa_step_model *model;
    const starqa_step_attention *attention;
    void *hidden;
    int64_t m;
    const void *cos;
    const void *sin;
    int64_t before;
    float *q_rows;
    float *lse;
    int threads;
} starqa_decode_args;

STARQA_API int starqa_decode_layers(const starqa_decode_args *args);

/* ---- the library itself (_simd.c) --------------------------------------------------- */

/* The paths the kernels take in this process, capped by STARQA_SIMD (2 AVX-512, 1 AVX2,
   0 portable C): cap, the cap read; written, the widest hand-written path allowed here;
   cloned, the build of the compiler's multi-versioned loops dispatched to (-1: this
   compiler builds one); taken, a bit per build of those that has run so far. */
typedef struct {
    int cap;
    int written;
    int cloned;
    int taken;
} starqa_simd_report;

STARQA_API void starqa_simd_paths(starqa_simd_report *report);
/* The hash of the sources the library was built from (starqa/native/build.py's). */
STARQA_API const char *starqa_source_hash(void);

#endif
