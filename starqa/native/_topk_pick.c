/* The top-k kernel's stages 1 and 2 (_topk.h): each row's lists chosen (ivf: the `probes`
   nearest centroids) and scanned, and the row's best keys of each span of positions kept;
   and starqa_topk_select, those picks returned without attending (a caller that attends
   elsewhere, a GPU holding the values). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_kernels.h"
#include "_topk.h"

/* How many pieces n items (key positions, centroids) are cut into so that `tasks` tasks
   become about two per thread, none shorter than `least` items (n <= least: one piece);
   *len: a piece's length, whole chunks (a chunk's scores are written whole: no two pieces'
   tasks write the same scores), the last piece what is left. */
static int64_t cut(int64_t n, int64_t tasks, int64_t threads, int64_t least, int64_t *len) {
    int64_t pieces = (2 * threads + tasks - 1) / tasks;
    const int64_t most = n > least ? n / least : 1;
    pieces = pieces < most ? pieces : most;
    *len = n > 0 ? ((n + pieces - 1) / pieces + CHUNK - 1) / CHUNK * CHUNK : 1;
    return pieces;
}

/* Stage 1, each row's lists: the probes nearest centroids (every list when all are
   probed), marked in chosen [H * R][lists]. (1) A (head, group of up to GROUP rows, piece
   of the centroids) task scores the piece's centroids once for all the group's rows (the
   head's centroids are cut into pieces only where there are too few (head, group) tasks
   for the threads: a decode reads each head's centroids once, not once per row); (2) a
   task per row picks its nearest lists from all its scores. *near_out: every row's scores
   of the centroids [H * R][lists + CHUNK], in a scratch slot. Returns 0, or 2 out of
   memory. */
static int choose_lists(const starqa_lists *lists_of, const starqa_queries *queries,
                        int64_t chosen_lists, int threads, unsigned char *chosen,
                        float **near_out) {
    const float *q = queries->q;
    const int64_t heads = queries->heads, rows = queries->rows, d = queries->d;
    const int64_t lists = lists_of->count;
    const uint16_t *centroids = lists_of->centroids;
    const int64_t row_groups = (rows + GROUP - 1) / GROUP; /* of up to GROUP rows */
    const int64_t room = lists + CHUNK; /* a row's scores of the centroids */
    int64_t piece;
    cut(lists, heads * row_groups, threads, MIN_LISTS, &piece);
    const int64_t pieces = (lists + piece - 1) / piece; /* none past the last list */
    float *near = scratch_get(S_NEAR, (size_t)(heads * rows * room) * sizeof(float));
    if (!near) return 2;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        cand *best = scratch_get(S_BEST, (size_t)lists * sizeof(cand));
        float *tmp = scratch_get(S_TMP, (size_t)(2 * lists) * sizeof(float));
        float *block = scratch_get(S_BLOCK, (size_t)MAX_DIM * CHUNK * sizeof(float));
        const int ok = best && block && tmp;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < heads * row_groups * pieces; t++) { /* (1) */
            if (!ok) continue;
            const int64_t h = t / (row_groups * pieces), r0 = t / pieces % row_groups * GROUP;
            const int64_t rn = rows - r0 < GROUP ? rows - r0 : GROUP;
            const int64_t c0 = t % pieces * piece, c1 = c0 + piece < lists ? c0 + piece : lists;
            int64_t who[GROUP], got[GROUP];
            for (int64_t r = 0; r < rn; r++) {
                who[r] = r;
                got[r] = c0;
            }
            const scan_rows group = {q + (h * rows + r0) * d, d, who, rn,
                                     near + (h * rows + r0) * room, room, got, block,
                                     NULL, 0, NULL};
            /* the centroids are bf16 rows: scored like keys, positions = list numbers */
            topk_scan((const char *)(centroids + (h * lists + c0) * d), (size_t)d * 2, 1, c0,
                      c1, 0, &group);
        }
        const seg whole = {0, 0, 0};
#pragma omp for schedule(dynamic)
        for (int64_t row = 0; row < heads * rows; row++) { /* (2) */
            if (!ok || chosen_lists == lists) continue;
            topk_best_of(near + row * room, &whole, 1, NULL, lists, 0, chosen_lists, best, tmp);
            unsigned char *mine = chosen + row * lists;
            for (int64_t c = 0; c < chosen_lists; c++) mine[best[c].row] = 1;
        }
    }
    if (failed) return 2;
    *near_out = near;
    return 0;
}

/* How stage 2 cuts its work: groups of `group` rows (`groups` a head), spans of span_len
   positions; a row's scores of a span at `stride` floats apart, its best kcap kept, its
   pieces of positions at most segroom. */
typedef struct {
    int64_t group, groups, spans, span_len, stride, kcap, segroom;
} span_plan;

/* The lists some row of rows [r0, r0 + rn) of head h scans, in order, into order; returns
   how many. */
static int64_t lists_scanned(const unsigned char *chosen, int64_t h, int64_t rows, int64_t r0,
                             int64_t rn, int64_t lists, int64_t *order) {
    int64_t todo = 0;
    for (int64_t c = 0; c < lists; c++) {
        int64_t any = 0;
        for (int64_t r = 0; r < rn; r++) any |= chosen[(h * rows + r0 + r) * lists + c];
        if (any) order[todo++] = c;
    }
    return todo;
}

/* Stage 2: each (head, group of rows, span) task gives every row of the group its best
   kcap keys of the span, into found (sel and count). The scores of a row's candidates are
   kept (they fit in the cache), then `topk_best_of` picks its kcap best. Returns 0, or 2
   out of memory. */
static int scan_spans(const starqa_topk_table *table, const starqa_queries *queries,
                      const pick_plan *plan, const span_plan *cuts,
                      const unsigned char *chosen, picks *found) {
    const float *q = queries->q;
    const int64_t heads = queries->heads, rows = queries->rows, d = queries->d;
    const int64_t n = table->n, lists = table->lists.count, *map = table->map;
    const int64_t group = cuts->group, groups = cuts->groups, spans = cuts->spans;
    const int64_t span_len = cuts->span_len, stride = cuts->stride, kcap = cuts->kcap;
    const int64_t segroom = cuts->segroom, skip = plan->skip, keep_stride = plan->keep_stride;
    float *keep = plan->keep;
    cand *sel = found->sel;
    int64_t *count = found->count;
    int failed = 0;
#pragma omp parallel num_threads(plan->threads)
    {
        float *scores = scratch_get(S_SCORES, (size_t)(group * stride) * sizeof(float));
        seg *segs = scratch_get(S_SEGS, (size_t)(group * segroom) * sizeof(seg));
        cand *pool = scratch_get(S_POOL, (size_t)span_len * sizeof(cand));
        float *tmp = scratch_get(S_TMP, (size_t)(2 * span_len) * sizeof(float));
        int64_t *order = scratch_get(S_ORDER, (size_t)lists * sizeof(int64_t));
        float *block = scratch_get(S_BLOCK, (size_t)MAX_DIM * CHUNK * sizeof(float));
        const int ok = scores && segs && pool && block && tmp && order;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < heads * groups * spans; t++) {
            if (!ok) continue;
            const int64_t h = t / (groups * spans), g = t / spans % groups, span = t % spans;
            const int64_t r0 = g * group, rn = rows - r0 < group ? rows - r0 : group;
            const int64_t a = span * span_len, b = a + span_len < n ? a + span_len : n;
            int64_t got[GROUP] = {0}, nsegs[GROUP] = {0}, who[GROUP], lo, hi;
            /* the group's scores: kept by position (row r's from mine + r * apart), else
               this thread's scratch */
            float *mine = keep ? keep + (h * rows + r0) * keep_stride + a : scores;
            const int64_t apart = keep ? keep_stride : stride;
            scan_rows scanned = {q + (h * rows + r0) * d, d, who, 0, mine, apart, got, block,
                                 segs, segroom, nsegs};
            const int64_t todo = lists_scanned(chosen, h, rows, r0, rn, lists, order);
            for (int64_t i = 0; i < todo + PREFETCH_LISTS; i++) {
                if (i < todo) { /* a list whose scan comes later: its keys on their way */
                    topk_list_range(&table->lists, n, order[i], h, a, b, &lo, &hi);
                    topk_prefetch_list(&table->keys, h, d, lo, hi);
                }
                if (i < PREFETCH_LISTS) continue;
                const int64_t c = order[i - PREFETCH_LISTS];
                scanned.many = 0;
                for (int64_t r = 0; r < rn; r++)
                    if (chosen[(h * rows + r0 + r) * lists + c]) who[scanned.many++] = r;
                topk_list_range(&table->lists, n, c, h, a, b, &lo, &hi);
                topk_scan_list(&table->keys, h, lo, hi, c, &scanned, keep != NULL);
            }
            for (int64_t r = 0; r < rn; r++) {
                const int64_t slot = (h * rows + r0 + r) * spans + span;
                count[slot] = topk_best_of(mine + r * apart, segs + r * segroom, nsegs[r],
                                           map ? map + h * n : NULL, got[r], skip, kcap, pool,
                                           tmp);
                memcpy(sel + slot * kcap, pool, (size_t)count[slot] * sizeof(cand));
            }
        }
    }
    return failed ? 2 : 0;
}

int topk_pick(const starqa_topk_table *table, const starqa_queries *queries,
              const pick_plan *plan, picks *out) {
    const int64_t heads = queries->heads, rows = queries->rows, n = table->n;
    const int64_t lists = table->lists.count, probes = table->lists.probes;
    const int threads = plan->threads;
    /* Tasks: a group of up to GROUP rows of a head scored in one pass over the keys it
       reads (flat: all of them; ivf: the lists some row of the group chose, each scored
       against the rows that chose it only). Keys are cut into spans only where there are
       too few (head, rows) tasks for the threads. Where groups would be too few tasks for
       the threads (a decode: G rows per KV head, 3 heads on 2 threads), an ivf scan takes
       a row per task instead: its lists are its own, so each row's k best are picked once,
       from all its candidates, where a head's group cut into two spans picked k from each
       span and then k of the two (a flat scan keeps its groups: a row at a time would read
       every key G times). */
    const int64_t row_groups = (rows + GROUP - 1) / GROUP; /* of up to GROUP rows */
    span_plan cuts;
    cuts.group = lists > 1 && heads * row_groups < 4 * threads ? 1 : GROUP;
    cuts.groups = (rows + cuts.group - 1) / cuts.group;
    cuts.spans = cut(n, heads * cuts.groups, threads, MIN_SPAN, &cuts.span_len);
    cuts.stride = cuts.span_len + CHUNK;
    cuts.kcap = plan->k < cuts.span_len ? plan->k : cuts.span_len; /* a span's, per row */
    cuts.segroom = lists + table->keys.count; /* a row's pieces in a span, at most */
    const int64_t chosen_lists = probes < lists ? probes : lists;
    unsigned char *chosen = scratch_get(S_CHOSEN, (size_t)(heads * rows * lists));
    out->sel = scratch_get(S_SEL, (size_t)(heads * rows * cuts.spans * cuts.kcap) * sizeof(cand));
    out->count = scratch_get(S_COUNT, (size_t)(heads * rows * cuts.spans) * sizeof(int64_t));
    out->spans = cuts.spans;
    out->kcap = cuts.kcap;
    out->near = NULL;
    if (!chosen || !out->sel || !out->count) return 2;
    memset(chosen, chosen_lists == lists, (size_t)(heads * rows * lists));
    /* plan->want_near: the scores kept (the tail's) */
    if ((chosen_lists < lists || plan->want_near) &&
        choose_lists(&table->lists, queries, chosen_lists, threads, chosen, &out->near))
        return 2;
    return scan_spans(table, queries, plan, &cuts, chosen, out);
}

int starqa_topk_select(const starqa_select_args *args) {
    const starqa_topk_table *table = args->table;
    const starqa_lists *lists = &table->lists;
    const int64_t heads = args->queries.heads, rows = args->queries.rows;
    const int64_t d = args->queries.d, n = table->n, k = args->k, skip = args->skip;
    if (d < 1 || d > MAX_DIM || heads < 1 || rows < 1 || n < 0 || n > INT32_MAX || k < 1 ||
        table->keys.count < 1 || lists->count < 1 ||
        (lists->count > 1 && (!lists->centroids || !lists->offsets)) || lists->probes < 1 ||
        skip < 0 || skip > n)
        return 1;
    const int threads = args->threads > 0 ? args->threads : 1;
    const pick_plan plan = {k, skip, threads, NULL, 0, 0};
    picks found;
    if (topk_pick(table, &args->queries, &plan, &found)) return 2;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        cand *all = scratch_get(S_ALL, (size_t)(found.spans * found.kcap) * sizeof(cand));
        float *tmp = scratch_get(S_TMP, (size_t)(2 * found.spans * found.kcap) * sizeof(float));
        if (!all || !tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t row = 0; row < heads * rows; row++) {
            if (!all || !tmp) continue;
            const cand *mine;
            const int64_t got = topk_row_best(&found, row, k, all, tmp, &mine);
            int64_t *to = args->rows + row * k;
            float *at = args->scores + row * k;
            for (int64_t j = 0; j < got; j++) {
                to[j] = mine[j].row;
                at[j] = mine[j].s;
            }
            for (int64_t j = got; j < k; j++) {
                to[j] = -1;
                at[j] = -INFINITY;
            }
        }
    }
    return failed ? 2 : 0;
}
