/* The top-k kernel's entry point and stage 3 (_topk.h): after each row's picks
   (`topk_pick`), each (head, position): the G query heads of the KV head at that position
   share retrieval. (1) Each row's k best of its spans' selections; the union of the G rows'
   keys, in shard row order (a position's own order, whatever else the call holds), the
   sink's rows first, then the position's own keys. (2) The union cut into pieces of PIECE
   keys, a task each (every thread busy however few the positions): each row's scores of
   the piece's keys computed afresh (or, kept, looked up: the same bits, a key's dot
   product being the same whichever chunk holds it), its weights and weighted sum of the
   piece's values (read once for the G rows), with the piece's maximum and total.
   (3) Each row's pieces merged in order by log-sum-exp. The cuts depend on the position's
   keys only, so its result does too.

   The call's bias b (Phase 2's context bias) weighs every shard key by e^b but the shard
   rows below `unbiased` (the keys the context holds once: star's anchor), and no own key:
   in (2) the biased keys' raw scores move by b / scale before a piece's weights (a union
   is in row order, so its unbiased rows are its first `fronts[t]`), and in (3) the tail's
   maximum does (its weights are relative to it: the keys it estimates are taken as biased,
   the unbiased rows being at most a block of the shard). The picks are made without it:
   the same b on every key they choose among leaves their order as it was (the unbiased
   rows are few, and the sink among them is always attended).

   The three steps run in one OpenMP parallel region (a worksharing loop each, in the
   functions below, called from that region only). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_kernels.h"
#include "_topk.h"

/* What the steps share: the call, its picks, and (in scratch slots of the calling thread,
   which no task uses) each position t's union: its shard rows' keys ukeys[t * room ..]
   and values uvals[t * room ..] (then its own keys'), unions[t] shard rows (the first
   fronts[t] of them below `unbiased`), owns[t] own keys, its pieces first[t] ..
   first[t + 1] - 1 (piece_of: each piece's position) and their parts [per * (D + 2)]
   each (G rows of out [D], max, total); urows (kept scores): the union's shard rows;
   lcounts and tparts (the tail): each position's union counted by list, and its rows'
   parts. */
typedef struct {
    const starqa_topk_args *args;
    const picks *found;
    const float *keep;
    int tails;
    int64_t per, ht, picked, room, part;
    const char **ukeys, **uvals;
    int64_t *unions, *owns, *first, *piece_of, *urows, *fronts;
    float *parts, *tparts;
    int32_t *lcounts;
} unions_of;

/* A thread's scratch for the steps (ok: all of it allocated). */
typedef struct {
    cand *all;
    float *tmp;
    uint64_t *marks;
    int64_t *union_rows;
    float *w, *block, *value, *tw;
    const char **tvp;
    int ok;
} union_scratch;

static union_scratch scratch_of(const unions_of *u) {
    const int64_t spans = u->found->spans, kcap = u->found->kcap, n = u->args->table->n;
    const int64_t lists = u->args->table->lists.count;
    union_scratch s;
    s.all = scratch_get(S_ALL, (size_t)(spans * kcap) * sizeof(cand));
    s.tmp = scratch_get(S_TMP, (size_t)(2 * spans * kcap) * sizeof(float));
    s.marks = scratch_get(S_SEEN, (size_t)((n + 63) / 64 + 1) * sizeof(uint64_t));
    s.union_rows = scratch_get(S_UNION, (size_t)(u->picked + 1) * sizeof(int64_t));
    s.w = scratch_get(S_WEIGHTS, (size_t)(u->per * (PIECE + CHUNK)) * sizeof(float));
    s.block = scratch_get(S_BLOCK, (size_t)MAX_DIM * CHUNK * sizeof(float));
    s.value = scratch_get(S_VALUE, (size_t)MAX_DIM * sizeof(float));
    s.tw = u->tails ? scratch_get(S_TAILW, (size_t)(u->per * (lists + CHUNK)) * sizeof(float))
                    : NULL;
    s.tvp = u->tails ? scratch_get(S_TAILV, (size_t)lists * sizeof(char *)) : NULL;
    s.ok = s.all && s.tmp && s.marks && s.union_rows && s.w && s.block && s.value &&
           (!u->tails || (s.tw && s.tvp));
    return s;
}

/* Where row p of head h (D elements of esize bytes) lies in `buffers`. */
static inline const char *row_at(const starqa_buffers *buffers, int64_t h, int64_t p,
                                 int64_t d, size_t esize) {
    const int64_t b = buffer_of(buffers->start, buffers->count, p);
    return (const char *)(intptr_t)buffers->ptr[b] +
           ((size_t)(h * buffers->stride[b]) + (size_t)(p - buffers->start[b]) * d) * esize;
}

/* Step (1): a task per (head, position). */
static void gather_unions(const unions_of *u, const union_scratch *s) {
    const starqa_topk_args *args = u->args;
    const starqa_topk_table *table = args->table;
    const starqa_buffers keys = table->keys, values = table->values;
    const int64_t rows = args->queries.rows, d = args->queries.d, tokens = args->tokens;
    const int64_t n = table->n, lists = table->lists.count, skip = args->skip, k = args->k;
    const int32_t *inv = table->inv, *tail_lists = table->lists.tail_lists;
    const size_t kes = keys.bf16 ? 2 : 4, ves = values.bf16 ? 2 : 4;
    const size_t oes = args->own.bf16 ? 2 : 4;
    const char *own_k = args->own.k, *own_v = args->own.v;
    const int64_t own_stride = args->own.stride, own_before = args->own.before;
    const int64_t per = u->per, ht = u->ht, room = u->room;
    const char **ukeys = u->ukeys, **uvals = u->uvals;
    int64_t *unions = u->unions, *owns = u->owns, *urows = u->urows, *fronts = u->fronts;
    const int64_t unbiased = args->unbiased;
    int32_t *lcounts = u->lcounts;
    const float *keep = u->keep;
    uint64_t *marks = s->marks;
    int64_t *union_rows = s->union_rows;
#pragma omp for schedule(dynamic)
    for (int64_t t = 0; t < ht; t++) {
        unions[t] = owns[t] = fronts[t] = 0;
        if (!s->ok) continue;
        const int64_t h = t / tokens, m = t % tokens;
        memset(marks, 0, (size_t)((n + 63) / 64) * sizeof(uint64_t));
        /* the tail's counts (tails): the union's keys by list, the sink's rows too */
        int32_t *lcount = lcounts ? lcounts + t * lists : NULL;
        if (lcount) {
            memset(lcount, 0, (size_t)lists * sizeof(int32_t));
            for (int64_t r = 0; r < skip; r++) lcount[tail_lists[h * n + r]]++;
        }
        for (int64_t g = 0; g < per; g++) {
            const int64_t row = h * rows + g * tokens + m;
            const cand *mine;
            const int64_t got = topk_row_best(u->found, row, k, s->all, s->tmp, &mine);
            for (int64_t j = 0; j < got; j++) {
                const uint64_t bit = (uint64_t)1 << (mine[j].row & 63);
                if (lcount && !(marks[mine[j].row >> 6] & bit)) lcount[mine[j].list]++;
                marks[mine[j].row >> 6] |= bit;
            }
        }
        int64_t nu = 0; /* the union's rows, in order: the sink's, then the picks */
        for (int64_t r = 0; r < skip; r++) union_rows[nu++] = r;
        for (int64_t word = 0; word < (n + 63) / 64; word++)
            for (uint64_t bits = marks[word]; bits; bits &= bits - 1)
                union_rows[nu++] = word * 64 + __builtin_ctzll(bits);
        const char **kr = ukeys + t * room, **vp = uvals + t * room;
        for (int64_t j = 0; j < nu; j++) {
            const int64_t r = union_rows[j];
            if (!keep) /* kept scores: the union's keys are never read */
                kr[j] = row_at(&keys, h, inv ? inv[h * n + r] : r, d, kes);
            vp[j] = row_at(&values, h, r, d, ves);
        }
        const int64_t no = own_k ? own_before + m + 1 : 0; /* own keys seen (causal) */
        for (int64_t j = 0; j < no; j++) {
            const size_t at = ((size_t)(h * own_stride) + (size_t)j * d) * oes;
            kr[nu + j] = own_k + at;
            vp[nu + j] = own_v + at;
        }
        if (urows) memcpy(urows + t * room, union_rows, (size_t)nu * sizeof(int64_t));
        int64_t front = 0; /* the union's rows below `unbiased`: its first, rows ascending */
        while (front < nu && union_rows[front] < unbiased) front++;
        fronts[t] = front;
        unions[t] = nu;
        owns[t] = no;
    }
}

/* Each position's union cut into pieces of PIECE keys (one thread). */
static void number_pieces(const unions_of *u) {
#pragma omp single
    {
        u->first[0] = 0;
        for (int64_t t = 0; t < u->ht; t++) {
            const int64_t many = (u->unions[t] + u->owns[t] + PIECE - 1) / PIECE;
            for (int64_t i = 0; i < many; i++) u->piece_of[u->first[t] + i] = t;
            u->first[t + 1] = u->first[t] + many;
        }
    }
}

/* Step (2): a task per piece (with the tail, first a task per position: each reads its
   head's mean values, the longest tasks, begun before the pieces that fill in around
   them). */
static void attend_pieces(const unions_of *u, const union_scratch *s) {
    const starqa_topk_args *args = u->args;
    const starqa_topk_table *table = args->table;
    const float *q = args->queries.q, scale = args->result.scale;
    const int64_t rows = args->queries.rows, d = args->queries.d, tokens = args->tokens;
    const int64_t n = table->n, lists = table->lists.count;
    const int k_bf16 = table->keys.bf16, v_bf16 = table->values.bf16, o_bf16 = args->own.bf16;
    const int64_t per = u->per, ht = u->ht, room = u->room, tails = u->tails;
    const size_t part = (size_t)u->part;
    const char **ukeys = u->ukeys, **uvals = u->uvals;
    const int64_t *unions = u->unions, *owns = u->owns, *first = u->first;
    const int64_t *piece_of = u->piece_of, *urows = u->urows, *fronts = u->fronts;
    const float *keep = u->keep;
    float *parts = u->parts, *w = s->w, *block = s->block, *value = s->value;
    const float shift = args->bias != 0.0f ? args->bias / scale : 0.0f; /* raw scores' */
#pragma omp for schedule(dynamic)
    for (int64_t j = 0; j < first[ht] + (tails ? ht : 0); j++) {
        if (!s->ok) continue;
        const int64_t i = tails ? j - ht : j;
        if (i < 0) {
            const int64_t t = j, h = t / tokens;
            const tail_part tail = {
                u->lcounts + t * lists, table->lists.offsets + h * (lists + 1), lists,
                u->found->near + (h * rows + t % tokens) * (lists + CHUNK),
                tokens * (lists + CHUNK), per, table->lists.tail + h * lists * d, d, scale};
            topk_tail_rows(&tail, s->tw, s->tvp, value, u->tparts + (size_t)t * part);
            continue;
        }
        const int64_t t = piece_of[i], h = t / tokens, m = t % tokens;
        const int64_t nu = unions[t], a = (i - first[t]) * PIECE;
        const int64_t b = a + PIECE < nu + owns[t] ? a + PIECE : nu + owns[t];
        const int64_t cut = nu < a ? a : nu > b ? b : nu; /* [a, cut) shard, [cut, b) own */
        const char **kr = ukeys + t * room, **vp = uvals + t * room;
        const float *qs[MAX_GROUP];
        float *outs[MAX_GROUP], *piece = parts + (size_t)i * part;
        for (int64_t g = 0; g < per; g++) {
            qs[g] = q + (h * rows + g * tokens + m) * d;
            outs[g] = piece + (size_t)g * (d + 2);
            memset(outs[g], 0, (size_t)d * sizeof(float));
        }
        const int64_t wroom = PIECE + CHUNK;
        if (keep) { /* flat with its keys dropped: the scan's scores, by position */
            for (int64_t g = 0; g < per; g++) {
                const float *mine = keep + (h * rows + g * tokens + m) * n;
                for (int64_t x = a; x < cut; x++)
                    w[g * wroom + (x - a)] = mine[urows[t * room + x]];
            }
        } else {
            topk_score_rows(kr + a, cut - a, k_bf16, qs, per, d, w, wroom, block);
        }
        if (shift != 0.0f) { /* the biased shard keys' bias: not the unbiased, not own */
            const int64_t from = fronts[t] > a ? fronts[t] - a : 0;
            for (int64_t g = 0; g < per; g++)
                for (int64_t x = from; x < cut - a; x++) w[g * wroom + x] += shift;
        }
        topk_score_rows(kr + cut, b - cut, o_bf16, qs, per, d, w + (cut - a), wroom, block);
        for (int64_t g = 0; g < per; g++) /* scores → weights exp((s - max s) * scale) */
            outs[g][d + 1] = topk_weigh(w + g * wroom, b - a, scale, &outs[g][d]);
        topk_weighted_sum(vp + a, cut - a, v_bf16, w, wroom, per, d, outs, value);
        topk_weighted_sum(vp + cut, b - cut, o_bf16, w + (cut - a), wroom, per, d, outs, value);
    }
}

/* Step (3): a task per position merges each of its rows' pieces (and tail) in order. */
static void merge_rows(const unions_of *u) {
    const starqa_topk_args *args = u->args;
    const int64_t rows = args->queries.rows, d = args->queries.d, tokens = args->tokens;
    const float scale = args->result.scale;
    const float shift = args->bias != 0.0f ? args->bias / scale : 0.0f; /* the tail's */
    float *out = args->result.out, *lse = args->result.lse;
    const int64_t per = u->per, ht = u->ht;
    const size_t part = (size_t)u->part;
    const int64_t *first = u->first;
    const float *parts = u->parts, *tparts = u->tparts;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < ht; t++) {
        const int64_t h = t / tokens, m = t % tokens;
        for (int64_t g = 0; g < per; g++) {
            const int64_t row = h * rows + g * tokens + m;
            float *o = out + row * d, top = -INFINITY, total = 0.0f;
            memset(o, 0, (size_t)d * sizeof(float));
            /* the tail's part (tails), where it counts any key */
            const float *rest = tparts ? tparts + (size_t)t * part + (size_t)g * (d + 2) : NULL;
            if (rest && !(rest[d + 1] > 0.0f)) rest = NULL;
            const float tail_top = rest ? rest[d] + shift : -INFINITY;
            if (rest) top = tail_top;
            for (int64_t i = first[t]; i < first[t + 1]; i++) {
                const float peak = parts[(size_t)i * part + (size_t)g * (d + 2) + d];
                top = peak > top ? peak : top;
            }
            for (int64_t i = first[t]; i < first[t + 1]; i++) {
                const float *piece = parts + (size_t)i * part + (size_t)g * (d + 2);
                const float f = expf((piece[d] - top) * scale);
                total += f * piece[d + 1];
                for (int64_t x = 0; x < d; x++) o[x] += f * piece[x];
            }
            if (rest) {
                const float f = expf((tail_top - top) * scale);
                total += f * rest[d + 1];
                for (int64_t x = 0; x < d; x++) o[x] += f * rest[x];
            }
            if (first[t + 1] == first[t] && !rest) { /* no key: weighs nothing */
                lse[row] = -INFINITY;
                continue;
            }
            for (int64_t x = 0; x < d; x++) o[x] /= total;
            lse[row] = top * scale + logf(total);
        }
    }
}

/* The union's memory, in scratch slots of the calling thread; returns 0, or 2 out of
   memory. */
static int lay_out(unions_of *u, int64_t own_most) {
    const starqa_topk_args *args = u->args;
    const int64_t n = args->table->n, k = args->k, skip = args->skip;
    const int64_t lists = args->table->lists.count;
    const int64_t kk = k < n ? k : n, ht = u->ht;
    u->picked = skip + u->per * kk < n ? skip + u->per * kk : n; /* shard rows, once */
    u->room = u->picked + own_most; /* a position's keys, at most */
    const int64_t pieces_most = (u->room + PIECE - 1) / PIECE;
    u->part = u->per * (args->queries.d + 2);
    const size_t part = (size_t)u->part;
    u->ukeys = scratch_get(S_UKEYS, (size_t)(ht * u->room + 1) * sizeof(char *));
    u->uvals = scratch_get(S_UVALS, (size_t)(ht * u->room + 1) * sizeof(char *));
    int64_t *ucount = scratch_get(S_UCOUNT, (size_t)(4 * ht + 2) * sizeof(int64_t));
    u->piece_of = scratch_get(S_PIECES, (size_t)(ht * pieces_most + 1) * sizeof(int64_t));
    u->parts = scratch_get(S_PARTS, (size_t)(ht * pieces_most + 1) * part * sizeof(float));
    u->urows = u->keep ? scratch_get(S_UROWS, (size_t)(ht * u->room + 1) * sizeof(int64_t))
                       : NULL;
    u->lcounts = u->tails ? scratch_get(S_LCOUNT, (size_t)(ht * lists) * sizeof(int32_t))
                          : NULL;
    u->tparts = u->tails ? scratch_get(S_TAILP, (size_t)ht * part * sizeof(float)) : NULL;
    if (!u->ukeys || !u->uvals || !ucount || !u->piece_of || !u->parts ||
        (u->keep && !u->urows) || (u->tails && (!u->tparts || !u->lcounts)))
        return 2;
    u->unions = ucount;
    u->owns = ucount + ht;
    u->first = ucount + 2 * ht; /* [ht + 1] */
    u->fronts = ucount + 3 * ht + 1;
    return 0;
}

/* Whether the arguments are possible (_kernels.h says what each is). */
static int possible(const starqa_topk_args *args) {
    const starqa_topk_table *t = args->table;
    const starqa_queries *q = &args->queries;
    const starqa_own_keys *own = &args->own;
    const int64_t d = q->d, tokens = args->tokens;
    return !(d < 1 || d > MAX_DIM || q->heads < 1 || q->rows < 1 || t->n < 0 ||
             t->n > INT32_MAX || args->k < 1 || t->keys.count < 1 || t->values.count < 1 ||
             t->lists.count < 1 ||
             (t->lists.count > 1 && (!t->lists.centroids || !t->lists.offsets)) ||
             t->lists.probes < 1 || tokens < 1 || q->rows % tokens ||
             q->rows / tokens > MAX_GROUP || args->skip < 0 || args->skip > t->n ||
             !isfinite(args->bias) || (args->bias != 0.0f && !(args->result.scale > 0.0f)) ||
             args->unbiased < 0 ||
             (own->k && (!own->v || own->before < 0 ||
                         own->stride < (own->before + tokens) * d)));
}

/* drop (STARQA_DROP_KEYS, flat's --kv-on-disk): the key buffers' pages are dropped as the
   scan passes them (`drop_pages`), each row's score of every position kept for the union's
   attention, which then reads no key: the same bits, and a layer's keys are never
   resident at once (32K, SmolLM2: 12.6 MB a layer). With lists (ivf) the keys are in
   memory and never dropped. (The values' pages, dropped piece by piece of the union,
   measured no lower peak and up to a third slower decodes: each piece's drop took pages
   the next one read again; they are released after the call, by the caller.) */
int starqa_topk_attend(const starqa_topk_args *args) {
    if (!possible(args)) return 1;
    const starqa_topk_table *table = args->table;
    const int64_t heads = args->queries.heads, rows = args->queries.rows, n = table->n;
    const int threads = args->threads > 0 ? args->threads : 1;
    float *keep = NULL; /* every row's score of every position (flat, keys dropped) */
    if ((table->drop & STARQA_DROP_KEYS) && table->lists.count == 1 && n > 0) {
        keep = scratch_get(S_KEEP, (size_t)(heads * rows) * (size_t)n * sizeof(float));
        if (!keep) return 2;
    }
    /* the keys the unions leave out, estimated (`topk_tail_rows`) */
    const starqa_lists *lists = &table->lists;
    const int tails = lists->tail && lists->tail_lists && lists->centroids && lists->offsets;
    const pick_plan plan = {args->k, args->skip, threads, keep, n, tails};
    picks found;
    unions_of u = {.args = args, .found = &found, .keep = keep, .tails = tails,
                   .per = rows / args->tokens, .ht = heads * args->tokens};
    const int64_t own_most = args->own.k ? args->own.before + args->tokens : 0;
    int failed = topk_pick(table, &args->queries, &plan, &found) || lay_out(&u, own_most);
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
            const union_scratch s = scratch_of(&u);
            if (!s.ok) {
#pragma omp atomic write
                failed = 1;
            }
            gather_unions(&u, &s);
            number_pieces(&u);
            attend_pieces(&u, &s);
            merge_rows(&u);
        }
    }
    /* kept scores past a decode's size (a question's forward over a long shard: rows x n
       floats) are not held for the process's life */
    if (keep && (size_t)(heads * rows) * (size_t)n * sizeof(float) > KEEP_HELD)
        scratch_drop(S_KEEP);
    return failed ? 2 : 0;
}
