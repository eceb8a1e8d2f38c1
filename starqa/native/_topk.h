/* starqa's CPU top-k attention kernel (METHODS.md section 6; loaded with the other kernels by
   starqa.native.ops through ctypes; plain C): one call per layer gives every query row the
   softmax attention, with its log-sum-exp, over the k keys of a worker's shard that have
   the largest inner product with it. What its files share; each file is one stage:

     _topk_scratch.c  per-thread scratch memory kept between calls
     _topk_score.c    inner products of query rows with key rows, and the scan of a run
     _topk_lists.c    a list's positions scanned or prefetched, buffer by buffer
     _topk_best.c     the k best of scored candidates
     _topk_pick.c     stages 1-2: each row's lists chosen, scanned, its best kept
                      (and starqa_topk_select, the selection alone)
     _topk_values.c   scores to softmax weights, weighted sums of value rows
     _topk_tail.c     ivf's tail: the keys a union leaves out, list by list
     _topk_attend.c   stage 3: the GQA unions attended, merged (starqa_topk_attend)

   Layout. H KV heads; R query rows per head (starqa.attention.fold_gqa's order), q fp32
   [H, R, D]. A head's N keys are numbered by *position* 0 .. N-1: for flat the shard's
   rows themselves, for ivf the keys in list order (list c of head h holds the positions
   offsets[h][c] .. offsets[h][c + 1]), where map [H, N] gives each position's row in the
   shard. Keys and values may lie in several buffers (a worker's blocks, memory-mapped with
   --kv-on-disk): key buffer b holds positions start[b] .. start[b + 1] of every head,
   head h at element h * stride[b]; value buffer b likewise holds shard rows start[b] ..
   start[b + 1]. Rows below `skip` (the sink) are never picked: every row attends to them
   besides its picks. The own keys (optional): the query host's own keys and values (the
   question and answer so far, this call's `tokens` last); the row at position m of the
   call attends causally to the first before + m + 1 of them. So one call gives a worker's
   whole partial attention: sink, retrieved keys and own keys under one softmax.

   Per row: (ivf) score its head's centroids and choose the `probes` nearest lists; score
   every key of the chosen lists (all keys for flat) exactly in fp32 (bf16 keys widened);
   keep the k best (per span of positions, then over the spans: `topk_best_of`).

   GQA: the G query heads of one KV head share what they retrieve. At each position of the
   forward, each of the G rows picks its own k keys, and every one of them attends over the
   union of the G picks (up to G * k keys: a key that one head needs is seldom useless to
   the others, and the union costs only G rows' dot products with keys already chosen).
   Attention over the union U, per row: out = sum_j w_j v_j / sum_j w_j with
   w_j = exp((s_j - max s) * scale), lse = max s * scale + log(sum_j w_j), s_j the row's
   own inner product with key j; U also holds the sink's rows and the row's own keys. Only
   the union's value rows are read, once for the G rows.

   The tail (ivf, lists.tail given; starqa.attention.topk's docstring says why): the keys of
   the shard outside a position's union enter each of its rows' softmax list by list, as u_c
   copies of the list's centre (its mean key, whose score the row has from choosing its
   lists) holding the list's mean value: weights u_c * exp(q . centre_c * scale), one more
   part of the row's merge (`topk_tail_rows`; the union's keys counted by the list each was
   scanned in, `cand.list`). With every key in the union, nothing.

   Row independence: a position's lists, scores, picks, union and outputs depend on that
   position's queries only (never on the other positions of the call), so a decode step
   that also checks drafted tokens gives every token exactly what a one-token step gives.

   Work: tasks over OpenMP threads. ivf's choice of lists: a (head, group of rows, piece
   of the centroids) task scores them, then a task per row picks its lists. The scan:
   (head, rows, span of positions) tasks, a group of up to GROUP rows of a head scored in
   one pass over the keys it reads (ivf: a list is read once for the rows of the group
   that chose it, and scored against those only; where groups are too few tasks for the
   threads, as in a decode, a row per task, which then picks its k once); keys are
   widened CHUNK at a time (with AVX-512 a row's CHUNK dot products are reduced together,
   as in _attend.c), each row's scores kept, and its best picked (`topk_best_of`). Then a
   task per (head, position) merges its rows' spans' selections into the union (in shard
   row order), a task per PIECE keys of a union attends its G rows to them (and with the
   tail, a task per row its tail), and each row's pieces are merged by log-sum-exp, in
   order. */

#ifndef STARQA_TOPK_H
#define STARQA_TOPK_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_kernels.h"

#define GROUP 16          /* rows of one head scored in one pass over a span's keys */
#define MIN_SPAN 4096     /* key positions per task, at least (fewer keys: one span) */
#define MAX_GROUP 128     /* query heads per KV head */
#define CHUNK 16          /* keys scored at once */
#define DIRECT_ROWS 3     /* up to this many rows read a chunk's keys where they lie */
#define MAX_DIM 256
#define AHEAD 64          /* keys prefetched ahead of a scan */
#define AHEAD_ROWS 8      /* value rows prefetched ahead of the one read */
#define AHEAD_KEYS 48     /* union key rows prefetched ahead of the chunk scored */
#define PIECE 128         /* a position's union keys attended per task (then merged) */
#define PREFETCH_LISTS 3  /* ivf: lists prefetched ahead of the one scanned */
#define PREFETCH_KEYS 512 /* ... when they are at most this long (longer: the scan's own) */
#define MIN_LISTS 128     /* centroids per task choosing lists, at least (fewer: one piece) */
/* Prefetches of keys and values ahead of their use go to L2, not L1 (locality 2, x86's
   prefetcht1): a row's next lists (~5 KB each at 32K) asked for into L1 held its few miss
   buffers and evicted the chunk being scored; into L2 the replayed decode kernel took 16.5
   → 13.5 ms a token (32K, ivf, Zen 4; an A/B of two builds), the same picks. */
#define TO_L2 2
#define KEEP_HELD ((size_t)64 << 20) /* kept scores larger than this are freed after a call */

typedef struct {
    float s;      /* raw inner product q . key (unscaled) */
    int32_t list; /* ivf: the list the key was scanned in (the tail counts by it) */
    int64_t row;  /* the key's row in the shard */
} cand;

/* A row's scores are appended a scanned piece of positions at a time: the scores from
   index `at` on are those of positions pos, pos + 1, ... (until the next segment). A key's
   position is looked up only for the few candidates that clear `topk_best_of`'s bar, not
   written for every key scored. */
typedef struct {
    int64_t at, pos, list; /* list: the one these positions belong to (flat: 0) */
} seg;

/* ---- _topk_scratch.c --------------------------------------------------------------- */

/* Scratch memory kept by each thread between calls (OpenMP's threads live on): a call
   per layer per token would otherwise allocate its buffers every time (above glibc's mmap
   threshold: fresh pages, cleared by the kernel). A slot grows to the largest size asked
   of it and is kept, but for kept scores past KEEP_HELD (`scratch_drop`). */
enum { S_CHOSEN, S_SEL, S_COUNT, S_NEAR, S_BEST, S_BLOCK, S_SCORES, S_SEGS, S_POOL,
       S_ALL, S_TMP, S_ORDER, S_WEIGHTS, S_SEEN, S_UNION, S_VALUE, S_UKEYS, S_UVALS, S_UCOUNT,
       S_PIECES, S_PARTS, S_KEEP, S_UROWS, S_TAILP, S_LCOUNT, S_TAILW, S_TAILV, SLOTS };

void *scratch_get(int slot, size_t bytes);
/* A slot's memory returned (the next scratch_get allocates afresh). */
void scratch_drop(int slot);

/* ---- buffers ------------------------------------------------------------------------ */

/* The buffer holding position (or row) p: the b with start[b] <= p < start[b + 1]. */
static inline int64_t buffer_of(const int64_t *start, int64_t buffers, int64_t p) {
    int64_t lo = 0, hi = buffers - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (start[mid] <= p) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* One key or value row (bf16 or fp32) in fp32. */
static inline void widen_row(const char *src, int bf16, int64_t d, float *to) {
    if (!bf16) {
        memcpy(to, src, (size_t)d * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < d; i++) {
        const uint16_t half = ((const uint16_t *)src)[i];
        union { uint32_t u; float f; } wide = {.u = (uint32_t)half << 16};
        to[i] = wide.f;
    }
}

/* ---- _topk_score.c ------------------------------------------------------------------ */

/* The rows of a group that a scan scores, and where their scores go: rows who[0 .. many)
   (queries q + r * d); row r's scores appended at scores + r * stride + got[r] (a row's
   room holds a chunk more than its candidates: a chunk is written whole), and, where segs
   is given, each scanned piece noted in the row's segments segs + r * segroom (nsegs[r] of
   them; see `seg`). block: scratch of CHUNK * MAX_DIM floats. */
typedef struct {
    const float *q;
    int64_t d;
    const int64_t *who;
    int64_t many;
    float *scores;
    int64_t stride;
    int64_t *got;
    float *block;
    seg *segs;
    int64_t segroom;
    int64_t *nsegs;
} scan_rows;

/* Keys at positions [lo, hi) of one buffer (position lo at `base`, rows row_bytes apart,
   bf16 or fp32), scored against `rows`, as of list `list`. */
void topk_scan(const char *base, size_t row_bytes, int bf16, int64_t lo, int64_t hi,
               int64_t list, const scan_rows *rows);

/* The scores of the query rows qs[0 .. nq) against the key rows kr[0 .. m) (bf16 or
   fp32, lying anywhere), row g's at w + g * room (a chunk is written whole: room holds
   CHUNK more). block: scratch of CHUNK * MAX_DIM floats. */
void topk_score_rows(const char *const *kr, int64_t m, int bf16, const float *const *qs,
                     int64_t nq, int64_t d, float *w, int64_t room, float *block);

/* ---- _topk_lists.c ------------------------------------------------------------------ */

/* The positions [*lo, *hi) of list c of head h within [a, b) (flat: one list, every
   position). */
void topk_list_range(const starqa_lists *lists, int64_t n, int64_t c, int64_t h, int64_t a,
                     int64_t b, int64_t *lo, int64_t *hi);

/* Positions [lo, hi) of head h's keys, cut where the key buffers change, each piece
   scanned (`topk_scan`, as of list c); drop: each piece's pages dropped once scanned. */
void topk_scan_list(const starqa_buffers *keys, int64_t h, int64_t lo, int64_t hi, int64_t c,
                    const scan_rows *rows, int drop);

/* Positions [lo, hi) of head h's keys (D each) asked into the cache ahead of their scan,
   where a piece is at most PREFETCH_KEYS long (longer: the scan's own prefetch). */
void topk_prefetch_list(const starqa_buffers *keys, int64_t h, int64_t d, int64_t lo,
                        int64_t hi);

/* ---- _topk_best.c ------------------------------------------------------------------- */

/* Moves the k best (largest s) of a[0 .. n) to a[0 .. k), in their order (ties at the
   k-th score: the first ones). tmp: scratch of 2n floats. */
void topk_keep_best(cand *a, int64_t n, int64_t k, float *tmp);

/* The k best of m scored candidates whose rows are not below `skip`, into out as (score,
   list, row); returns how many (at most k). scores[i] is that of position segs[s].pos + i -
   segs[s].at for the last of the nsegs segments with at <= i, and the position's row is
   rowmap[position] (NULL: the position). out: room for m; tmp: scratch of 2m floats. */
int64_t topk_best_of(const float *scores, const seg *segs, int64_t nsegs,
                     const int64_t *rowmap, int64_t m, int64_t skip, int64_t k, cand *out,
                     float *tmp);

/* ---- _topk_pick.c ------------------------------------------------------------------- */

/* What a pick is asked for beyond the table and the rows: each row's k best keys, rows
   below `skip` never; keep (flat only; NULL: none): every row's score of every position,
   row r's at keep + r * keep_stride (keep_stride >= n), written by the scan instead of its
   scratch, and each scanned piece of keys dropped; want_near (ivf): every row's scores of
   its head's centroids kept (the tail's). */
typedef struct {
    int64_t k;
    int64_t skip;
    int threads;
    float *keep;
    int64_t keep_stride;
    int want_near;
} pick_plan;

/* Stages 1 and 2's result, in scratch slots of the calling thread: each row's best kcap
   keys of each of `spans` spans of positions, sel [H * R * spans][kcap], count [H * R *
   spans] how many; near [H * R][lists + CHUNK] each row's centroid scores (NULL where
   lists were neither chosen by them nor wanted). */
typedef struct {
    cand *sel;
    int64_t *count;
    int64_t spans;
    int64_t kcap;
    float *near;
} picks;

/* Stages 1 and 2 (_topk.h's comment): each row's lists chosen (ivf) and scanned, and the
   row's best kcap keys of each span of positions kept. Returns 0, or 2 out of memory. */
int topk_pick(const starqa_topk_table *table, const starqa_queries *rows,
              const pick_plan *plan, picks *out);

/* A row's k best keys of its spans' selections (`topk_pick`'s): returns how many (at most
   k) and sets *best to where they lie: in sel itself where there is one span (a span
   keeps at most k), else gathered into `all` (room for spans * kcap; tmp: 2 * spans *
   kcap floats) and the k best kept. */
int64_t topk_row_best(const picks *found, int64_t row, int64_t k, cand *all, float *tmp,
                      const cand **best);

/* ---- _topk_values.c ----------------------------------------------------------------- */

/* Scores s[0 .. m) (raw inner products) → weights exp((s - max s) * scale), in place;
   returns their sum, and the maximum in *top. */
float topk_weigh(float *s, int64_t m, float scale, float *top);

/* outs[g] [D] += sum_u w[g * room + u] * v_u for the rows g < per, over the value rows
   vp[u] (bf16 or fp32), u < m; value: scratch of D floats. */
void topk_weighted_sum(const char *const *vp, int64_t m, int bf16, const float *w,
                       int64_t room, int64_t per, int64_t d, float *const *outs,
                       float *value);

/* ---- _topk_tail.c ------------------------------------------------------------------- */

/* One position's tail (_topk.h's comment), for its G rows: lcount [lists], the position's
   union's keys counted by list (the sink's rows too); offsets [lists + 1] and values
   [lists, D] bf16, the head's lists and mean values; near: row g's centroid scores at
   near + g * near_step. */
typedef struct {
    const int32_t *lcount;
    const int64_t *offsets;
    int64_t lists;
    const float *near;
    int64_t near_step;
    int64_t per;
    const uint16_t *values;
    int64_t d;
    float scale;
} tail_part;

/* The tail's part of each of the G rows into piece: G rows of [D] (the weighted sum), then
   top_g and the weights' sum; with no key left out, -inf and 0 (no weight in the merge).
   Scratch: w [G][lists + CHUNK], vp [lists], value [D]. */
void topk_tail_rows(const tail_part *tail, float *w, const char **vp, float *value,
                    float *piece);

#endif
