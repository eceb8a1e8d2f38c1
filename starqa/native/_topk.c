/* starqa's CPU top-k attention kernel (METHODS.md section 6; loaded with _attend.c's by
   starqa.native.ops through ctypes; plain C): one call per layer gives every query row the
   softmax attention, with its log-sum-exp, over the k keys of a worker's shard that have
   the largest inner product with it.

   Layout. H KV heads; R query rows per head (starqa.attention.fold_gqa's order), q fp32
   [H, R, D]. A head's N keys are numbered by *position* 0 .. N-1: for flat the shard's
   rows themselves, for ivf the keys in list order (list c of head h holds the positions
   offsets[h][c] .. offsets[h][c + 1]), where map [H, N] gives each position's row in the
   shard. Keys and values may lie in several buffers (a worker's blocks, memory-mapped with
   --kv-on-disk): key buffer b holds positions kstart[b] .. kstart[b + 1] of every head,
   head h at element h * kstride[b]; value buffer b likewise holds shard rows vstart[b] ..
   vstart[b + 1]. Rows below `skip` (the sink) are never picked: every row attends to them
   besides its picks. own_k, own_v (optional; NULL: none): the query host's own keys and
   values (the question and answer so far, this call's `tokens` last), head h's row j at
   element h * own_stride + j * d; the row at position m of the call attends causally to
   the first own_before + m + 1 of them. So one call gives a worker's whole partial
   attention: sink, retrieved keys and own keys under one softmax.

   Per row: (ivf) score its head's centroids and choose the `probes` nearest lists; score
   every key of the chosen lists (all keys for flat) exactly in fp32 (bf16 keys widened);
   keep the k best (per span of positions, then over the spans: `best_of`).

   GQA: the G query heads of one KV head share what they retrieve. At each position of the
   forward, each of the G rows picks its own k keys, and every one of them attends over the
   union of the G picks (up to G * k keys: a key that one head needs is seldom useless to
   the others, and the union costs only G rows' dot products with keys already chosen).
   Attention over the union U, per row: out = sum_j w_j v_j / sum_j w_j with
   w_j = exp((s_j - max s) * scale), lse = max s * scale + log(sum_j w_j), s_j the row's
   own inner product with key j; U also holds the sink's rows and the row's own keys. Only
   the union's value rows are read, once for the G rows.

   The tail (ivf, `tail` given; starqa.attention.topk's docstring says why): the keys of the shard
   outside a position's union enter each of its rows' softmax list by list, as u_c copies
   of the list's centre (its mean key, whose score the row has from choosing its lists)
   holding the list's mean value: weights u_c * exp(q . centre_c * scale), one more part
   of the row's merge (`tail_rows`; the union's keys counted by the list each was scanned
   in, `cand.list`). With every key in the union, nothing.

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
   as in _attend.c), each row's scores kept, and its best picked (`best_of`). Then a task per
   (head, position) merges its rows' spans' selections into the union (in shard row
   order), a task per PIECE keys of a union attends its G rows to them (and with the tail,
   a task per row its tail), and each row's pieces are merged by log-sum-exp, in order. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "_kernels.h"
#include "_simd.h"

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
#define DROP_KEYS 1 /* starqa_topk_attend's drop: see there */
#define KEEP_HELD ((size_t)64 << 20) /* kept scores larger than this are freed after a call */

static const float zeros[MAX_DIM]; /* a key row past a chunk's end (zero bits: bf16 too) */

typedef struct {
    float s;      /* raw inner product q . key (unscaled) */
    int32_t list; /* ivf: the list the key was scanned in (the tail counts by it) */
    int64_t row;  /* the key's row in the shard */
} cand;

/* A row's scores are appended a scanned piece of positions at a time: the scores from
   index `at` on are those of positions pos, pos + 1, ... (until the next segment). A key's
   position is looked up only for the few candidates that clear `best_of`'s bar, not
   written for every key scored. */
typedef struct {
    int64_t at, pos, list; /* list: the one these positions belong to (flat: 0) */
} seg;

/* Scratch memory kept by each thread between calls (OpenMP's threads live on): a call
   per layer per token would otherwise allocate its buffers every time (above glibc's mmap
   threshold: fresh pages, cleared by the kernel). A slot grows to the largest size asked
   of it and is kept, but for kept scores past KEEP_HELD (`scratch_drop`). */
enum { S_CHOSEN, S_SEL, S_COUNT, S_NEAR, S_BEST, S_BLOCK, S_SCORES, S_SEGS, S_POOL,
       S_ALL, S_TMP, S_ORDER, S_WEIGHTS, S_SEEN, S_UNION, S_VALUE, S_UKEYS, S_UVALS, S_UCOUNT,
       S_PIECES, S_PARTS, S_KEEP, S_UROWS, S_TAILP, S_LCOUNT, S_TAILW, S_TAILV, SLOTS };
static __thread struct { void *p; size_t size; } scratch[SLOTS];

static void *scratch_get(int slot, size_t bytes) {
    bytes = (bytes + 63) / 64 * 64;
    if (scratch[slot].size < bytes) {
        free(scratch[slot].p);
        scratch[slot].p = aligned_alloc(64, bytes);
        scratch[slot].size = scratch[slot].p ? bytes : 0;
    }
    return scratch[slot].p;
}

/* A slot's memory returned (the next scratch_get allocates afresh). */
static void scratch_drop(int slot) {
    free(scratch[slot].p);
    scratch[slot].p = NULL;
    scratch[slot].size = 0;
}

static inline float median3(float x, float y, float z) {
    return x > y ? (y > z ? y : (x > z ? z : x)) : (x > z ? x : (y > z ? z : y));
}

/* The k-th largest of v[0 .. n) (1 <= k <= n), v and tmp [n] both used as scratch: a
   quickselect whose partitions write out of place without branches (those above the pivot
   from the front of the other buffer, those below from its back): a branch on random
   scores is mispredicted half the time, and swapping in place waits on its own stores. */
static float kth_largest(float *v, int64_t n, int64_t k, float *tmp) {
    float *src = v, *dst = tmp;
    while (n > 1) {
        const float x = median3(src[0], src[n / 2], src[n - 1]);
        int64_t above = 0, below = n; /* dst[0 .. above) > x, dst[below .. n) < x */
        for (int64_t i = 0; i < n; i++) {
            const float y = src[i];
            dst[above] = y;
            dst[below - 1] = y;
            above += y > x;
            below -= y < x;
        }
        if (k <= above) {
            n = above;
        } else if (k <= below) {
            return x; /* the k-th is one of those equal to x (NaN: any will do) */
        } else {
            k -= below;
            n -= below;
            dst += below;
        }
        float *next = src; /* the region just written is read next; the other buffer is free */
        src = dst;
        dst = next;
    }
    return src[0];
}

/* Moves the k best (largest s) of a[0 .. n) to a[0 .. k), in their order (ties at the
   k-th score: the first ones). tmp: scratch of 2n floats. */
static void keep_best(cand *a, int64_t n, int64_t k, float *tmp) {
    if (k <= 0 || k >= n) return;
    for (int64_t i = 0; i < n; i++) tmp[i] = a[i].s;
    const float t = kth_largest(tmp, n, k, tmp + n);
    int64_t above = 0;
    for (int64_t i = 0; i < n; i++) above += a[i].s > t;
    int64_t ties = k - above, got = 0; /* how many equal to t still fit */
    for (int64_t i = 0; i < n && got < k; i++) {
        const int64_t tie = a[i].s == t, keep = (a[i].s > t) | (tie & (ties > 0));
        a[got] = a[i];
        got += keep;
        ties -= tie & keep;
    }
}

/* The k best of m scored candidates whose rows are not below `skip`, into out as (score,
   row); returns how many (at most k). scores[i] is that of position segs[s].pos + i -
   segs[s].at for the last of the nsegs segments with at <= i, and the position's row is
   rowmap[position] (NULL: the position). A
   bar is set first from a sample of the scores (the 1.5k/m-th quantile of every step-th
   one), so that the selection looks at about 1.5k candidates instead of all m; where
   fewer than k clear it, every candidate is looked at. On a 32K ivf decode's 1,080 rows
   (k 328 of ~2,600 scanned) none fell short; a 2k bar took 12% longer a row, a 1.25k
   one fell short on 28 rows (each then a second pass) and gained ~3% more.
   Either way the result is the k best: the bar only skips candidates that cannot be.
   out: room for m; tmp: scratch of 2m floats. */
SIMD_CLONES static int64_t best_of(const float *scores, const seg *segs, int64_t nsegs,
                                   const int64_t *rowmap, int64_t m, int64_t skip, int64_t k,
                                   cand *out, float *tmp) {
    float bar = -INFINITY;
    if (m > 2 * k && m > 256) {
        const int64_t step = m / 256, samples = m / step;
        int64_t rank = (3 * k * samples / 2 + m - 1) / m; /* ~1.5k of the m clear it */
        for (int64_t i = 0; i < samples; i++) out[i] = (cand){scores[i * step], 0, 0};
        keep_best(out, samples, rank, tmp);
        bar = INFINITY;
        for (int64_t i = 0; i < rank; i++) bar = out[i].s < bar ? out[i].s : bar;
    }
    for (int pass = 0; pass < 2; pass++) {
        int64_t got = 0, s = 0;
        for (int64_t i0 = 0; i0 < m; i0 += CHUNK) { /* a chunk at a time: most fall short */
            const int64_t end = i0 + CHUNK < m ? i0 + CHUNK : m;
            float top = -INFINITY;
#pragma omp simd reduction(max : top)
            for (int64_t i = i0; i < end; i++) top = scores[i] > top ? scores[i] : top;
            if (!(top >= bar)) continue;
            int64_t clear[CHUNK], many = 0; /* those at or above the bar, without a branch */
            for (int64_t i = i0; i < end; i++) {
                clear[many] = i;
                many += scores[i] >= bar;
            }
            for (int64_t c = 0; c < many; c++) { /* their positions, rows asked for */
                const int64_t i = clear[c];
                while (s + 1 < nsegs && segs[s + 1].at <= i) s++;
                const int64_t p = segs[s].pos + (i - segs[s].at);
                out[got++] = (cand){scores[i], (int32_t)segs[s].list, p};
                if (rowmap) __builtin_prefetch(rowmap + p, 0, 3);
            }
        }
        /* Positions to rows, once all are asked for: a lookup as each candidate is found
           waits on its cache miss (the map is megabytes; 7% of an ivf decode's kernel). */
        int64_t kept = 0;
        for (int64_t j = 0; j < got; j++) {
            const int64_t row = rowmap ? rowmap[out[j].row] : out[j].row;
            out[kept] = (cand){out[j].s, out[j].list, row};
            kept += row >= skip;
        }
        got = kept;
        if (got >= k || bar == -INFINITY) {
            keep_best(out, got, k, tmp);
            return got < k ? got : k;
        }
        bar = -INFINITY; /* too few cleared the bar: look at every candidate */
    }
    return 0; /* not reached */
}

/* The buffer holding position (or row) p: the b with start[b] <= p < start[b + 1]. */
static inline int64_t buffer_of(const int64_t *start, int64_t buffers, int64_t p) {
    int64_t lo = 0, hi = buffers - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (start[mid] <= p) lo = mid; else hi = mid - 1;
    }
    return lo;
}

static inline const char *row_at(const int64_t *start, const int64_t *ptr,
                                 const int64_t *stride, int64_t buffers, int64_t h,
                                 int64_t p, int64_t d, size_t esize) {
    int64_t b = buffer_of(start, buffers, p);
    return (const char *)(intptr_t)ptr[b] +
           ((size_t)(h * stride[b]) + (size_t)(p - start[b]) * d) * esize;
}


/* Inner product of two fp32 rows. */
SIMD_CLONES static float dot(const float *a, const float *b, int64_t d) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; i++) acc += a[i] * b[i];
    return acc;
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

/* The inner products of nq query rows qs[i] [D] with the CHUNK key rows kp[x] (bf16 or
   fp32; the first `width` real, the rest zeros), into outs[i][0 .. CHUNK); block: scratch
   of CHUNK * D floats (the keys widened once for every row). */
static void score_any(const char *const *kp, int width, int bf16, const float *const *qs,
                      int64_t nq, int64_t d, float *const *outs, float *block) {
    for (int x = 0; x < width; x++) widen_row(kp[x], bf16, d, block + x * d);
    for (int64_t i = 0; i < nq; i++)
        for (int x = 0; x < CHUNK; x++)
            outs[i][x] = x < width ? dot(qs[i], block + x * d, d) : 0.0f;
}

#ifdef STARQA_X86
/* D = 16 * NC (NC = 4: D 64, NC = 8: D 128): each row's CHUNK scores in one vector (16 dot
   products reduced together, as in _attend.c). For more than DIRECT_ROWS rows the chunk's
   keys are widened once into `block` and the rows read that; for fewer (an ivf decode scans
   a row at a time) each row widens them as it reads them where they lie: the same products
   in the same order (the same bits) without the copy's stores and loads (7-10% of an ivf
   decode's kernel at 32K on a Zen 4, 3-5% of its token). */
#define SCORE_AVX512(NC)                                                                   \
    AVX512 static void score_avx512_##NC(const char *const *kp, int bf16,                 \
                                         const float *const *qs, int64_t nq,              \
                                         float *const *outs, float *block) {              \
        const char *widened[CHUNK];                                                        \
        const char *const *keys = kp; /* where the rows read the keys: as they lie, */     \
        int keys_bf16 = bf16;         /* or widened into block */                          \
        if (nq > DIRECT_ROWS) {                                                            \
            const size_t esize = bf16 ? 2 : 4;                                             \
            for (int x = 0; x < CHUNK; x++) {                                              \
                for (int c = 0; c < NC; c++)                                               \
                    _mm512_store_ps(block + (x * NC + c) * 16,                             \
                                    load16(kp[x] + c * 16 * esize, bf16));                 \
                widened[x] = (const char *)(block + x * NC * 16);                          \
            }                                                                              \
            keys = widened;                                                                \
            keys_bf16 = 0;                                                                 \
        }                                                                                  \
        const size_t step = keys_bf16 ? 32 : 64; /* bytes of 16 elements */               \
        for (int64_t i = 0; i < nq; i++) {                                                 \
            __m512 qr[NC], dots[CHUNK];                                                    \
            for (int c = 0; c < NC; c++) qr[c] = _mm512_loadu_ps(qs[i] + c * 16);          \
            for (int x = 0; x < CHUNK; x++) {                                              \
                __m512 acc = _mm512_mul_ps(qr[0], load16(keys[x], keys_bf16));             \
                for (int c = 1; c < NC; c++)                                               \
                    acc = _mm512_fmadd_ps(qr[c], load16(keys[x] + c * step, keys_bf16), acc); \
                dots[x] = acc;                                                             \
            }                                                                              \
            _mm512_storeu_ps(outs[i], sum16(dots));                                        \
        }                                                                                  \
    }
SCORE_AVX512(4)
SCORE_AVX512(8)
#endif

#ifdef STARQA_X86
/* dots8 of q with the 8 key rows kp[x] read where they lie (bf16 or fp32), each piece
   widened as it is used: the same products summed in the same order as dots8 over their
   widened copies (the same bits), without writing the copies. */
AVX2 static inline __m256 dots8_at(const float *q, const char *const *kp, int nc, int bf16) {
    const size_t esize = bf16 ? 2 : 4;
    __m256 dots[8];
    const __m256 q0 = _mm256_loadu_ps(q);
    for (int x = 0; x < 8; x++) dots[x] = _mm256_mul_ps(q0, load8(kp[x], bf16));
    for (int c = 1; c < nc; c++) {
        const __m256 qc = _mm256_loadu_ps(q + c * 8);
        for (int x = 0; x < 8; x++)
            dots[x] = _mm256_fmadd_ps(qc, load8(kp[x] + c * 8 * esize, bf16), dots[x]);
    }
    return sum8(dots);
}

/* The AVX-512 scorers' work for CPUs with AVX2 but not AVX-512, D = 8 * NC (NC = 8: D 64,
   16: D 128): eight keys at a time, each row's 8 dot products reduced together (`dots8`),
   the eights that hold the chunk's `width` keys only (an ivf list's last chunk is often
   part empty). For more than DIRECT_ROWS rows the chunk's keys are widened once into
   `block`; for fewer (a decode: a row, or a KV head's G rows) each row reads them where
   they lie (`dots8_at`), which spares the copy's stores and loads (6% of an ivf decode's
   kernel, 3 rows). */
#define SCORE_AVX2(NC)                                                                     \
    AVX2 static void score_avx2_##NC(const char *const *kp, int width, int bf16,          \
                                     const float *const *qs, int64_t nq,                  \
                                     float *const *outs, float *block) {                  \
        const size_t esize = bf16 ? 2 : 4;                                                 \
        const int keys = (width + 7) / 8 * 8; /* whole eights: past `width`, zero rows */  \
        if (nq <= DIRECT_ROWS) {                                                           \
            for (int64_t i = 0; i < nq; i++)                                               \
                for (int x0 = 0; x0 < keys; x0 += 8)                                       \
                    _mm256_storeu_ps(outs[i] + x0, bf16 ? dots8_at(qs[i], kp + x0, NC, 1)  \
                                                        : dots8_at(qs[i], kp + x0, NC, 0)); \
            return;                                                                        \
        }                                                                                  \
        for (int x = 0; x < keys; x++)                                                     \
            for (int c = 0; c < NC; c++)                                                   \
                _mm256_store_ps(block + (x * NC + c) * 8, load8(kp[x] + c * 8 * esize, bf16)); \
        for (int64_t i = 0; i < nq; i++)                                                   \
            for (int x0 = 0; x0 < keys; x0 += 8)                                           \
                _mm256_storeu_ps(outs[i] + x0, dots8(qs[i], block + x0 * NC * 8, NC));      \
    }
SCORE_AVX2(8)
SCORE_AVX2(16)
#endif

/* score_any, with AVX-512 or AVX2 where D is 64 or 128. kp[x] for x >= width must point at
   zeros; a row's scores past `width` may be left unwritten. */
static void score_keys(const char *const *kp, int width, int bf16, const float *const *qs,
                       int64_t nq, int64_t d, float *const *outs, float *block) {
#ifdef STARQA_X86
    if (has_avx512() && (d == 64 || d == 128)) {
        (d == 64 ? score_avx512_4 : score_avx512_8)(kp, bf16, qs, nq, outs, block);
        return;
    }
    if (has_avx2() && (d == 64 || d == 128)) {
        (d == 64 ? score_avx2_8 : score_avx2_16)(kp, width, bf16, qs, nq, outs, block);
        return;
    }
#endif
    score_any(kp, width, bf16, qs, nq, d, outs, block);
}

/* The scores of the query rows qs[0 .. nq) against the key rows kr[0 .. m) (bf16 or
   fp32, lying anywhere: each fetched AHEAD_KEYS ahead of its use), row g's at
   w + g * room (a chunk is written whole: room holds CHUNK more). */
static void score_rows(const char *const *kr, int64_t m, int bf16, const float *const *qs,
                       int64_t nq, int64_t d, float *w, int64_t room, float *block) {
    const size_t bytes = (size_t)d * (bf16 ? 2 : 4);
    float *outs[MAX_GROUP];
    for (int64_t u = 0; u < (m < AHEAD_KEYS ? m : AHEAD_KEYS); u++)
        for (size_t y = 0; y < bytes; y += 64) __builtin_prefetch(kr[u] + y, 0, TO_L2);
    for (int64_t u0 = 0; u0 < m; u0 += CHUNK) {
        const int width = m - u0 < CHUNK ? (int)(m - u0) : CHUNK;
        for (int64_t u = u0 + AHEAD_KEYS; u < u0 + AHEAD_KEYS + width && u < m; u++)
            for (size_t y = 0; y < bytes; y += 64) __builtin_prefetch(kr[u] + y, 0, TO_L2);
        const char *kp[CHUNK];
        for (int x = 0; x < CHUNK; x++) kp[x] = x < width ? kr[u0 + x] : (const char *)zeros;
        for (int64_t g = 0; g < nq; g++) outs[g] = w + g * room + u0;
        score_keys(kp, width, bf16, qs, nq, d, outs, block);
    }
}

/* Keys at positions [lo, hi) of one buffer (position lo at `base`, rows row_bytes apart),
   scored against the rows who[0 .. many) of a group (queries q + r * d): row r's scores are
   appended at scores + r * stride + got[r] (a row's room holds a chunk more than its
   candidates: a chunk is written whole), and, where segs is given, the piece is noted in
   the row's segments segs + r * segroom (nsegs[r] of them; see `seg`), as of `list`. */
static void scan(const char *base, size_t row_bytes, int bf16, int64_t lo, int64_t hi,
                 int64_t list, const float *q, int64_t d, const int64_t *who, int64_t many,
                 float *scores, int64_t stride, int64_t *got, float *block, seg *segs,
                 int64_t segroom, int64_t *nsegs) {
    const float *qs[GROUP];
    float *outs[GROUP];
    for (int64_t w = 0; segs && w < many; w++) {
        const int64_t r = who[w];
        seg *last = segs + r * segroom + nsegs[r] - 1;
        if (!nsegs[r] || last->pos + (got[r] - last->at) != lo || last->list != list)
            segs[r * segroom + nsegs[r]++] = (seg){got[r], lo, list}; /* else on the last */
    }
    float tail[GROUP][CHUNK]; /* a last chunk's scores, `width` of them copied: a row's
                                 scores are written up to hi, never past (kept scores) */
    for (int64_t p = lo; p < hi; p += CHUNK) {
        const int width = hi - p < CHUNK ? (int)(hi - p) : CHUNK;
        const char *kp[CHUNK];
        for (int x = 0; x < CHUNK; x++) {
            kp[x] = x < width ? base + (size_t)(p - lo + x) * row_bytes : (const char *)zeros;
            if (p + x + AHEAD < hi) /* rows a few chunks on, into the cache meanwhile */
                for (size_t y = 0; y < row_bytes; y += 64)
                    __builtin_prefetch(kp[x] + AHEAD * row_bytes + y, 0, TO_L2);
        }
        for (int64_t w = 0; w < many; w++) {
            qs[w] = q + who[w] * d;
            outs[w] = width < CHUNK ? tail[w] : scores + who[w] * stride + got[who[w]];
        }
        score_keys(kp, width, bf16, qs, many, d, outs, block);
        for (int64_t w = 0; w < many; w++) {
            if (width < CHUNK)
                memcpy(scores + who[w] * stride + got[who[w]], tail[w], (size_t)width * sizeof(float));
            got[who[w]] += width;
        }
    }
}

/* Drops the pages wholly inside [from, to) from this process (MADV_DONTNEED): for buffers
   that are clean private file mappings (--kv-on-disk) only, whose pages a later read maps
   again from the page cache. The pages at either end, which may hold rows another task
   still reads, are kept (the caller releases the layer's pages after its call). */
static void drop_pages(const char *from, const char *to) {
#ifdef MADV_DONTNEED
    const long size = sysconf(_SC_PAGESIZE), page = size > 0 ? size : 4096;
    const uintptr_t a = ((uintptr_t)from + (uintptr_t)page - 1) / (uintptr_t)page * (uintptr_t)page;
    const uintptr_t b = (uintptr_t)to / (uintptr_t)page * (uintptr_t)page;
    if (b > a) madvise((void *)a, b - a, MADV_DONTNEED);
#else
    (void)from;
    (void)to;
#endif
}

/* Scores s[0 .. m) (raw inner products) → weights exp((s - max s) * scale), in place;
   returns their sum, and the maximum in *top. */
SIMD_CLONES static float weigh(float *s, int64_t m, float scale, float *top) {
    float best = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : best)
    for (int64_t j = 0; j < m; j++) best = s[j] > best ? s[j] : best;
    for (int64_t j = 0; j < m; j++) {
        s[j] = exp_nonpositive((s[j] - best) * scale);
        total += s[j];
    }
    *top = best;
    return total;
}

/* o [D] += weight * v. */
SIMD_CLONES static void accumulate(float *o, const float *v, float weight, int64_t d) {
#pragma omp simd
    for (int64_t i = 0; i < d; i++) o[i] += weight * v[i];
}

#ifdef STARQA_X86
/* weighted_sum for D = 16 * NC: the G rows' sums in registers, GB rows at a time (a value
   row is widened once per GB rows, from the cache after the first). */
#define WSUM_AVX512(NC)                                                                    \
    AVX512 static void wsum_avx512_##NC(const char *const *vp, int64_t m, int bf16,        \
                                        const float *w, int64_t room, int64_t per,         \
                                        float *const *outs) {                              \
        enum { GB = 16 / NC };                                                             \
        const size_t esize = bf16 ? 2 : 4;                                                 \
        for (int64_t g0 = 0; g0 < per; g0 += GB) {                                         \
            const int64_t gn = per - g0 < GB ? per - g0 : GB;                              \
            __m512 acc[GB][NC];                                                            \
            for (int g = 0; g < GB; g++)                                                   \
                for (int c = 0; c < NC; c++)                                               \
                    acc[g][c] = g < gn ? _mm512_loadu_ps(outs[g0 + g] + c * 16)            \
                                       : _mm512_setzero_ps();                              \
            for (int64_t u = 0; u < m; u++) {                                              \
                if (u + AHEAD_ROWS < m)                                                    \
                    for (size_t y = 0; y < NC * 16 * esize; y += 64)                       \
                        __builtin_prefetch(vp[u + AHEAD_ROWS] + y, 0, TO_L2);              \
                __m512 v[NC];                                                              \
                for (int c = 0; c < NC; c++) v[c] = load16(vp[u] + c * 16 * esize, bf16);  \
                for (int g = 0; g < GB; g++) {                                             \
                    const __m512 wg = _mm512_set1_ps(g < gn ? w[(g0 + g) * room + u] : 0.0f); \
                    for (int c = 0; c < NC; c++) acc[g][c] = _mm512_fmadd_ps(wg, v[c], acc[g][c]); \
                }                                                                          \
            }                                                                              \
            for (int g = 0; g < gn; g++)                                                   \
                for (int c = 0; c < NC; c++) _mm512_storeu_ps(outs[g0 + g] + c * 16, acc[g][c]); \
        }                                                                                  \
    }
WSUM_AVX512(4)
WSUM_AVX512(8)

/* weighted_sum with AVX2 for D a multiple of 32: 3 rows' sums over 32 columns in 12 ymm at
   a time (a value row's 32 columns widened once per 3 rows, from the cache after the
   first slice). */
AVX2 static void wsum_avx2(const char *const *vp, int64_t m, int bf16, const float *w,
                           int64_t room, int64_t per, int64_t d, float *const *outs) {
    enum { GB = 3, CW = 4 };
    const size_t esize = bf16 ? 2 : 4;
    for (int64_t g0 = 0; g0 < per; g0 += GB) {
        const int64_t gn = per - g0 < GB ? per - g0 : GB;
        for (int64_t c0 = 0; c0 < d; c0 += CW * 8) {
            __m256 acc[GB][CW];
            for (int g = 0; g < GB; g++)
                for (int c = 0; c < CW; c++)
                    acc[g][c] = g < gn ? _mm256_loadu_ps(outs[g0 + g] + c0 + c * 8)
                                       : _mm256_setzero_ps();
            for (int64_t u = 0; u < m; u++) {
                if (c0 == 0 && u + AHEAD_ROWS < m)
                    for (size_t y = 0; y < (size_t)d * esize; y += 64)
                        __builtin_prefetch(vp[u + AHEAD_ROWS] + y, 0, TO_L2);
                __m256 wg[GB];
                for (int g = 0; g < GB; g++)
                    wg[g] = _mm256_set1_ps(g < gn ? w[(g0 + g) * room + u] : 0.0f);
                for (int c = 0; c < CW; c++) {
                    const __m256 v = load8(vp[u] + (c0 + c * 8) * esize, bf16);
                    for (int g = 0; g < GB; g++) acc[g][c] = _mm256_fmadd_ps(wg[g], v, acc[g][c]);
                }
            }
            for (int g = 0; g < gn; g++)
                for (int c = 0; c < CW; c++)
                    _mm256_storeu_ps(outs[g0 + g] + c0 + c * 8, acc[g][c]);
        }
    }
}
#endif

/* outs[g] [D] += sum_u w[g * room + u] * v_u for the rows g < per, over the value rows
   vp[u] (bf16 or fp32), u < m; value: scratch of D floats. */
static void weighted_sum(const char *const *vp, int64_t m, int bf16, const float *w,
                         int64_t room, int64_t per, int64_t d, float *const *outs,
                         float *value) {
#ifdef STARQA_X86
    if (has_avx512() && (d == 64 || d == 128)) {
        (d == 64 ? wsum_avx512_4 : wsum_avx512_8)(vp, m, bf16, w, room, per, outs);
        return;
    }
    if (has_avx2() && d % 32 == 0) {
        wsum_avx2(vp, m, bf16, w, room, per, d, outs);
        return;
    }
#endif
    const size_t esize = bf16 ? 2 : 4;
    for (int64_t u = 0; u < m; u++) {
        if (u + AHEAD_ROWS < m)
            for (size_t y = 0; y < (size_t)d * esize; y += 64)
                __builtin_prefetch(vp[u + AHEAD_ROWS] + y, 0, TO_L2);
        widen_row(vp[u], bf16, d, value);
        for (int64_t g = 0; g < per; g++) accumulate(outs[g], value, w[g * room + u], d);
    }
}

/* List c of head h, its positions within [a, b), cut where the key buffers change: each
   piece scanned (see `scan`) or, where q is NULL, only prefetched so that it is in the
   cache when its scan comes. drop: each piece's pages dropped once scanned (`drop_pages`). */
static void for_list(int64_t c, int64_t h, int64_t lists, const int64_t *offsets, int64_t n,
                     int64_t a, int64_t b, const int64_t *kstart, const int64_t *kptr,
                     const int64_t *kstride, int64_t kbuffers, int64_t d, size_t kes,
                     const float *q, int bf16, const int64_t *who, int64_t many, float *scores,
                     int64_t stride, int64_t *got, float *block, seg *segs, int64_t segroom,
                     int64_t *nsegs, int drop) {
    int64_t lo = offsets ? offsets[h * (lists + 1) + c] : 0;
    int64_t hi = offsets ? offsets[h * (lists + 1) + c + 1] : n;
    lo = lo > a ? lo : a;
    hi = hi < b ? hi : b;
    while (lo < hi) {
        const int64_t kb = buffer_of(kstart, kbuffers, lo);
        const int64_t end = hi < kstart[kb + 1] ? hi : kstart[kb + 1];
        const char *base = (const char *)(intptr_t)kptr[kb] +
                           ((size_t)(h * kstride[kb]) + (size_t)(lo - kstart[kb]) * d) * kes;
        if (q) {
            scan(base, (size_t)d * kes, bf16, lo, end, c, q, d, who, many, scores, stride, got,
                 block, segs, segroom, nsegs);
            if (drop) drop_pages(base, base + (size_t)(end - lo) * d * kes);
        } else if (end - lo <= PREFETCH_KEYS) {
            for (size_t y = 0; y < (size_t)(end - lo) * d * kes; y += 64)
                __builtin_prefetch(base + y, 0, TO_L2);
        }
        lo = end;
    }
}

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

/* Stages 1 and 2 of a call (the file's comment): each row's lists chosen (ivf) and
   scanned, and the row's best kcap keys of each span of positions kept: *sel_out [H * R *
   spans][kcap] (raw score, shard row), *count_out [H * R * spans] how many, in scratch
   slots of the calling thread. keep (flat only; NULL: none): every row's score of every
   position, row r's at keep + r * keep_stride (keep_stride >= n), written by the scan
   instead of its scratch, and each scanned piece of keys dropped (`drop_pages`): the
   union's attention then reads no key. want_near (ivf): every row's scores of its head's
   centroids kept, *near_out [H * R][lists + CHUNK] (else NULL: only where lists were
   chosen by them), for the tail (`tail_rows`). Returns 0, or 2 when out of memory. */
static int pick(int k_bf16, const float *q, int64_t heads, int64_t rows, int64_t d, int64_t n,
                int64_t kbuffers, const int64_t *kstart, const int64_t *kptr,
                const int64_t *kstride, const int64_t *map, int64_t lists,
                const uint16_t *centroids, const int64_t *offsets, int64_t probes, int64_t k,
                int64_t skip, int threads, float *keep, int64_t keep_stride, int want_near,
                float **near_out, cand **sel_out, int64_t **count_out, int64_t *spans_out,
                int64_t *kcap_out) {
    const size_t kes = k_bf16 ? 2 : 4;
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
    const int64_t group = lists > 1 && heads * row_groups < 4 * threads ? 1 : GROUP;
    const int64_t groups = (rows + group - 1) / group;
    int64_t span_len;
    const int64_t spans = cut(n, heads * groups, threads, MIN_SPAN, &span_len);
    const int64_t stride = span_len + CHUNK;
    const int64_t kcap = k < span_len ? k : span_len; /* a span's selection per row */
    const int64_t segroom = lists + kbuffers; /* a row's pieces in a span, at most */
    const int64_t chosen_lists = probes < lists ? probes : lists;
    unsigned char *chosen = scratch_get(S_CHOSEN, (size_t)(heads * rows * lists));
    cand *sel = scratch_get(S_SEL, (size_t)(heads * rows * spans * kcap) * sizeof(cand));
    int64_t *count = scratch_get(S_COUNT, (size_t)(heads * rows * spans) * sizeof(int64_t));
    int failed = !chosen || !sel || !count;
    if (failed) return 2;

    /* Each row's lists: the probes nearest centroids (every list when all are probed).
       (1) A (head, group of up to GROUP rows, piece of the centroids) task scores the
       piece's centroids once for all the group's rows (the head's centroids are cut into
       pieces only where there are too few (head, group) tasks for the threads: a decode
       reads each head's centroids once, not once per row); (2) a task per row picks its
       nearest lists from all its scores. */
    memset(chosen, chosen_lists == lists, (size_t)(heads * rows * lists));
    *near_out = NULL;
    if (chosen_lists < lists || want_near) { /* want_near: the scores kept (the tail's) */
        const int64_t room = lists + CHUNK; /* a row's scores of the centroids */
        int64_t piece;
        cut(lists, heads * row_groups, threads, MIN_LISTS, &piece);
        const int64_t pieces = (lists + piece - 1) / piece; /* none past the last list */
        float *near = scratch_get(S_NEAR, (size_t)(heads * rows * room) * sizeof(float));
        if (!near) return 2;

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
                /* the centroids are bf16 rows: scored like keys, positions = list numbers */
                scan((const char *)(centroids + (h * lists + c0) * d), (size_t)d * 2, 1, c0, c1,
                     0, q + (h * rows + r0) * d, d, who, rn, near + (h * rows + r0) * room, room,
                     got, block, NULL, 0, NULL);
            }
            const seg whole = {0, 0};
#pragma omp for schedule(dynamic)
            for (int64_t row = 0; row < heads * rows; row++) { /* (2) */
                if (!ok || chosen_lists == lists) continue;
                best_of(near + row * room, &whole, 1, NULL, lists, 0, chosen_lists, best, tmp);
                unsigned char *mine = chosen + row * lists;
                for (int64_t c = 0; c < chosen_lists; c++) mine[best[c].row] = 1;
            }
        }
        if (failed) return 2;
        *near_out = near;
    }

    /* Each (head, group of rows, span): every row's best kcap keys of the span. The
       scores of a row's candidates are kept (they fit in the cache), then `best_of`
       picks its kcap best. */
#pragma omp parallel num_threads(threads)
    {
        float *scores = scratch_get(S_SCORES, (size_t)(group * stride) * sizeof(float));
        seg *segs = scratch_get(S_SEGS, (size_t)(group * segroom) * sizeof(seg));
        cand *pool = scratch_get(S_POOL, (size_t)span_len * sizeof(cand));
        float *tmp = scratch_get(S_TMP, (size_t)(2 * span_len) * sizeof(float));
        int64_t *order = scratch_get(S_ORDER, (size_t)lists * sizeof(int64_t));
        float *block = scratch_get(S_BLOCK, (size_t)MAX_DIM * CHUNK * sizeof(float));
        if (!scores || !segs || !pool || !block || !tmp || !order) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < heads * groups * spans; t++) {
            if (!scores || !segs || !pool || !block || !tmp || !order) continue;
            const int64_t h = t / (groups * spans), g = t / spans % groups, span = t % spans;
            const int64_t r0 = g * group, rn = rows - r0 < group ? rows - r0 : group;
            const int64_t a = span * span_len, b = a + span_len < n ? a + span_len : n;
            int64_t got[GROUP] = {0}, nsegs[GROUP] = {0};
            /* the group's scores: kept by position (row r's from mine + r * apart), else
               this thread's scratch */
            float *mine = keep ? keep + (h * rows + r0) * keep_stride + a : scores;
            const int64_t apart = keep ? keep_stride : stride;
            int64_t todo = 0; /* the lists some row of the group scans, in order */
            for (int64_t c = 0; c < lists; c++) {
                int64_t any = 0;
                for (int64_t r = 0; r < rn; r++) any |= chosen[(h * rows + r0 + r) * lists + c];
                if (any) order[todo++] = c;
            }
            for (int64_t i = 0; i < todo + PREFETCH_LISTS; i++) {
                if (i < todo) /* a list whose scan comes later: its keys on their way meanwhile */
                    for_list(order[i], h, lists, offsets, n, a, b, kstart, kptr, kstride, kbuffers,
                             d, kes, NULL, 0, NULL, 0, NULL, 0, NULL, NULL, NULL, 0, NULL, 0);
                if (i < PREFETCH_LISTS) continue;
                const int64_t c = order[i - PREFETCH_LISTS];
                int64_t who[GROUP], many = 0;
                for (int64_t r = 0; r < rn; r++)
                    if (chosen[(h * rows + r0 + r) * lists + c]) who[many++] = r;
                for_list(c, h, lists, offsets, n, a, b, kstart, kptr, kstride, kbuffers, d, kes,
                         q + (h * rows + r0) * d, k_bf16, who, many, mine, apart, got, block,
                         segs, segroom, nsegs, keep != NULL);
            }
            for (int64_t r = 0; r < rn; r++) {
                const int64_t slot = (h * rows + r0 + r) * spans + span;
                count[slot] = best_of(mine + r * apart, segs + r * segroom, nsegs[r],
                                      map ? map + h * n : NULL, got[r], skip, kcap, pool, tmp);
                memcpy(sel + slot * kcap, pool, (size_t)count[slot] * sizeof(cand));
            }
        }
    }
    if (failed) return 2;
    *sel_out = sel;
    *count_out = count;
    *spans_out = spans;
    *kcap_out = kcap;
    return 0;
}

/* A row's k best keys of its spans' selections (`pick`'s sel and count): returns how many
   (at most k) and sets *best to where they lie: in sel itself where there is one span
   (a span keeps at most k), else gathered into `all` (room for spans * kcap; tmp: 2 *
   spans * kcap floats) and the k best kept. */
static int64_t row_best(const cand *sel, const int64_t *count, int64_t row, int64_t spans,
                        int64_t kcap, int64_t k, cand *all, float *tmp, const cand **best) {
    if (spans == 1) {
        *best = sel + row * kcap;
        return count[row];
    }
    int64_t got = 0;
    for (int64_t span = 0; span < spans; span++) {
        const int64_t slot = row * spans + span;
        memcpy(all + got, sel + slot * kcap, (size_t)count[slot] * sizeof(cand));
        got += count[slot];
    }
    keep_best(all, got, k, tmp);
    *best = all;
    return got < k ? got : k;
}

/* The tail (the file's comment) of one position's G rows, as a part each: lcount
   [lists], the position's union's keys counted by list (the sink's rows too: stage (1) of
   starqa_topk_attend); list c's u_c = size_c - lcount[c] keys outside the union weigh
   u_c * exp((near_g[c] - top_g) * scale) together in row g (near_g = near + g *
   near_step: its centroid scores; top_g the largest of them among lists with any) and
   stand for the list's mean value (values [lists, D] bf16, the head's: read once for the
   G rows). piece: G rows of [D] (the weighted sum), then top_g and the weights' sum; with
   no key left out, -inf and 0 (no weight in the merge). Scratch: w [G][lists + CHUNK],
   vp [lists], value [D]. */
static void tail_rows(const int32_t *lcount, const int64_t *offsets, int64_t lists,
                      const float *near, int64_t near_step, int64_t per,
                      const uint16_t *values, int64_t d, float scale, float *w,
                      const char **vp, float *value, float *piece) {
    const int64_t room = lists + CHUNK;
    float *outs[MAX_GROUP];
    int64_t left = 0;
    for (int64_t c = 0; c < lists; c++) {
        w[c] = (float)(offsets[c + 1] - offsets[c] - lcount[c]); /* u_c, row 0's for now */
        left += w[c] > 0.0f;
    }
    for (int64_t g = 0; g < per; g++) {
        outs[g] = piece + (size_t)g * (d + 2);
        memset(outs[g], 0, (size_t)d * sizeof(float));
        outs[g][d] = -INFINITY;
        outs[g][d + 1] = 0.0f;
    }
    if (!left) return; /* every key is in the union */
    for (int64_t g = per - 1; g >= 0; g--) { /* row 0 last: its w holds the u_c until then */
        const float *mine = near + g * near_step;
        float *wg = w + g * room, top = -INFINITY, total = 0.0f;
        for (int64_t c = 0; c < lists; c++)
            if (w[c] > 0.0f && mine[c] > top) top = mine[c];
#pragma omp simd reduction(+ : total)
        for (int64_t c = 0; c < lists; c++) {
            wg[c] = w[c] > 0.0f ? w[c] * exp_nonpositive((mine[c] - top) * scale) : 0.0f;
            total += wg[c];
        }
        outs[g][d] = top;
        outs[g][d + 1] = total;
    }
    for (int64_t c = 0; c < lists; c++) vp[c] = (const char *)(values + c * d);
    weighted_sum(vp, lists, 1, w, room, per, d, outs, value);
}

/* Arguments: see the file's comment; pointers ptr[] are addresses. R = G * tokens rows (G
   query heads, each at `tokens` positions of the forward, the position fastest). centroids
   bf16 [H, lists, D] and offsets int64 [H, lists + 1] for ivf, both NULL for flat (one
   list of every position); map NULL: position = row; inv [H, N] int32: each shard row's
   position (NULL: the same). tail bf16 [H, lists, D] each list's mean value and tail_lists
   int32 [H, N] each shard row's list (read for the sink's rows; a pick's list is the one
   it was scanned in) (ivf; either NULL: no tail). out fp32 [H, R, D], lse fp32 [H, R].
   drop: DROP_KEYS where the key buffers are clean private file mappings (flat's
   --kv-on-disk): their pages are
   dropped as the scan passes them (`drop_pages`), each row's score of every position kept
   for the union's attention, which then reads no key: the same bits, and a layer's keys
   are never resident at once (32K, SmolLM2: 12.6 MB a layer). With lists (ivf) the keys
   are in memory and never dropped. (The values' pages, dropped piece by piece of the
   union, measured no lower peak and up to a third slower decodes: each piece's drop took
   pages the next one read again; they are released after the call, by the caller.)
   Returns 0, 1 for impossible arguments, 2 when out of memory. */
int starqa_topk_attend(int k_bf16, int v_bf16, const float *q, int64_t heads, int64_t rows,
                       int64_t tokens, int64_t d, int64_t n, int64_t kbuffers,
                       const int64_t *kstart, const int64_t *kptr, const int64_t *kstride,
                       const int64_t *map, const int32_t *inv,
                       int64_t vbuffers, const int64_t *vstart, const int64_t *vptr,
                       const int64_t *vstride, int64_t lists, const uint16_t *centroids,
                       const int64_t *offsets, int64_t probes, const uint16_t *tail,
                       const int32_t *tail_lists, int64_t k, int64_t skip, int o_bf16,
                       const char *own_k, const char *own_v, int64_t own_stride,
                       int64_t own_before, float scale, float *out, float *lse, int drop,
                       int threads) {
    if (d < 1 || d > MAX_DIM || heads < 1 || rows < 1 || n < 0 || n > INT32_MAX || k < 1 ||
        kbuffers < 1 || vbuffers < 1 || lists < 1 || (lists > 1 && (!centroids || !offsets)) ||
        probes < 1 || tokens < 1 || rows % tokens || rows / tokens > MAX_GROUP || skip < 0 ||
        skip > n || (own_k && (!own_v || own_before < 0 || own_stride < (own_before + tokens) * d)))
        return 1;
    const size_t oes = o_bf16 ? 2 : 4;
    const int64_t own_most = own_k ? own_before + tokens : 0; /* a row sees at most these */
    threads = threads > 0 ? threads : 1;
    const size_t kes = k_bf16 ? 2 : 4, ves = v_bf16 ? 2 : 4;
    cand *sel;
    int64_t *count, spans, kcap;
    float *keep = NULL; /* every row's score of every position (flat, keys dropped) */
    if ((drop & DROP_KEYS) && lists == 1 && n > 0) {
        keep = scratch_get(S_KEEP, (size_t)(heads * rows) * (size_t)n * sizeof(float));
        if (!keep) return 2;
    }
    /* the keys the unions leave out, estimated (`tail_rows`) */
    const int tails = tail && tail_lists && centroids && offsets;
    float *near;
    int failed = pick(k_bf16, q, heads, rows, d, n, kbuffers, kstart, kptr, kstride, map, lists,
                      centroids, offsets, probes, k, skip, threads, keep, n, tails, &near, &sel,
                      &count, &spans, &kcap);
    if (failed) goto done;

    /* Each (head, token): the G query heads of the KV head at that token share
       retrieval. (1) Each row's k best of its spans' selections; the union of the G rows'
       keys, in shard row order (a position's own order, whatever else the call holds), the
       sink's rows first, then the position's own keys. (2) The union cut into pieces of
       PIECE keys, a task each (every thread busy however few the positions): each row's
       scores of the piece's keys computed afresh (or, kept, looked up: the same bits, a
       key's dot product being the same whichever chunk holds it), its weights and weighted
       sum of the piece's values (read once for the G rows), with the piece's maximum and
       total.
       (3) Each row's pieces merged in order by log-sum-exp. The cuts depend on the
       position's keys only, so its result does too. */
    const int64_t per = rows / tokens; /* G */
    const int64_t kk = k < n ? k : n;
    const int64_t ht = heads * tokens;
    const int64_t picked = skip + per * kk < n ? skip + per * kk : n; /* shard rows, once */
    const int64_t room = picked + own_most; /* a position's keys, at most */
    const int64_t pieces_most = (room + PIECE - 1) / PIECE;
    const size_t part = (size_t)per * (d + 2); /* a piece's G rows: out [D], max, total */
    /* shared by the threads (slots of the calling thread no task uses) */
    const char **ukeys = scratch_get(S_UKEYS, (size_t)(ht * room + 1) * sizeof(char *));
    const char **uvals = scratch_get(S_UVALS, (size_t)(ht * room + 1) * sizeof(char *));
    int64_t *ucount = scratch_get(S_UCOUNT, (size_t)(3 * ht + 2) * sizeof(int64_t));
    int64_t *piece_of = scratch_get(S_PIECES, (size_t)(ht * pieces_most + 1) * sizeof(int64_t));
    float *parts = scratch_get(S_PARTS, (size_t)(ht * pieces_most + 1) * part * sizeof(float));
    int64_t *urows = keep ? scratch_get(S_UROWS, (size_t)(ht * room + 1) * sizeof(int64_t)) : NULL;
    /* the tail: each position's union counted by list, then its rows' parts */
    int32_t *lcounts = tails ? scratch_get(S_LCOUNT, (size_t)(ht * lists) * sizeof(int32_t))
                             : NULL;
    float *tparts = tails ? scratch_get(S_TAILP, (size_t)ht * part * sizeof(float)) : NULL;
    if (!ukeys || !uvals || !ucount || !piece_of || !parts || (keep && !urows) ||
        (tails && (!tparts || !lcounts))) {
        failed = 1;
        goto done;
    }
    int64_t *unions = ucount, *owns = ucount + ht, *first = ucount + 2 * ht; /* first [ht + 1] */
#pragma omp parallel num_threads(threads)
    {
        cand *all = scratch_get(S_ALL, (size_t)(spans * kcap) * sizeof(cand));
        float *tmp = scratch_get(S_TMP, (size_t)(2 * spans * kcap) * sizeof(float));
        uint64_t *marks = scratch_get(S_SEEN, (size_t)((n + 63) / 64 + 1) * sizeof(uint64_t));
        int64_t *union_rows = scratch_get(S_UNION, (size_t)(picked + 1) * sizeof(int64_t));
        float *w = scratch_get(S_WEIGHTS, (size_t)(per * (PIECE + CHUNK)) * sizeof(float));
        float *block = scratch_get(S_BLOCK, (size_t)MAX_DIM * CHUNK * sizeof(float));
        float *value = scratch_get(S_VALUE, (size_t)MAX_DIM * sizeof(float));
        float *tw = tails ? scratch_get(S_TAILW, (size_t)(per * (lists + CHUNK)) * sizeof(float))
                          : NULL;
        const char **tvp = tails ? scratch_get(S_TAILV, (size_t)lists * sizeof(char *)) : NULL;
        const int ok = all && tmp && marks && union_rows && w && block && value &&
                       (!tails || (tw && tvp));
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < ht; t++) { /* (1) */
            unions[t] = owns[t] = 0;
            if (!ok) continue;
            const int64_t h = t / tokens, m = t % tokens;
            memset(marks, 0, (size_t)((n + 63) / 64) * sizeof(uint64_t));
            /* the tail's counts (tails): the union's keys by list, the sink's rows too */
            int32_t *lcount = tails ? lcounts + t * lists : NULL;
            if (lcount) {
                memset(lcount, 0, (size_t)lists * sizeof(int32_t));
                for (int64_t r = 0; r < skip; r++) lcount[tail_lists[h * n + r]]++;
            }
            for (int64_t g = 0; g < per; g++) {
                const int64_t row = h * rows + g * tokens + m;
                const cand *mine;
                const int64_t got = row_best(sel, count, row, spans, kcap, k, all, tmp, &mine);
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
            for (int64_t u = 0; u < nu; u++) {
                const int64_t r = union_rows[u];
                if (!keep) /* kept scores: the union's keys are never read */
                    kr[u] = row_at(kstart, kptr, kstride, kbuffers, h, inv ? inv[h * n + r] : r,
                                   d, kes);
                vp[u] = row_at(vstart, vptr, vstride, vbuffers, h, r, d, ves);
            }
            const int64_t no = own_k ? own_before + m + 1 : 0; /* own keys seen (causal) */
            for (int64_t j = 0; j < no; j++) {
                const size_t at = ((size_t)(h * own_stride) + (size_t)j * d) * oes;
                kr[nu + j] = own_k + at;
                vp[nu + j] = own_v + at;
            }
            if (urows) memcpy(urows + t * room, union_rows, (size_t)nu * sizeof(int64_t));
            unions[t] = nu;
            owns[t] = no;
        }
#pragma omp single
        {
            first[0] = 0;
            for (int64_t t = 0; t < ht; t++) {
                const int64_t many = (unions[t] + owns[t] + PIECE - 1) / PIECE;
                for (int64_t i = 0; i < many; i++) piece_of[first[t] + i] = t;
                first[t + 1] = first[t] + many;
            }
        }
#pragma omp for schedule(dynamic)
        for (int64_t j = 0; j < first[ht] + (tails ? ht : 0); j++) { /* (2) */
            if (!ok) continue;
            /* with the tail, a task per position first (each reads its head's mean values:
               the longest tasks, begun before the pieces that fill in around them) */
            const int64_t i = tails ? j - ht : j;
            if (i < 0) {
                const int64_t t = j, h = t / tokens;
                tail_rows(lcounts + t * lists, offsets + h * (lists + 1), lists,
                          near + (h * rows + t % tokens) * (lists + CHUNK),
                          tokens * (lists + CHUNK), per, tail + h * lists * d, d, scale, tw,
                          tvp, value, tparts + (size_t)t * part);
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
                    for (int64_t u = a; u < cut; u++)
                        w[g * wroom + (u - a)] = mine[urows[t * room + u]];
                }
            } else {
                score_rows(kr + a, cut - a, k_bf16, qs, per, d, w, wroom, block);
            }
            score_rows(kr + cut, b - cut, o_bf16, qs, per, d, w + (cut - a), wroom, block);
            for (int64_t g = 0; g < per; g++) /* scores → weights exp((s - max s) * scale) */
                outs[g][d + 1] = weigh(w + g * wroom, b - a, scale, &outs[g][d]);
            weighted_sum(vp + a, cut - a, v_bf16, w, wroom, per, d, outs, value);
            weighted_sum(vp + cut, b - cut, o_bf16, w + (cut - a), wroom, per, d, outs, value);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ht; t++) { /* (3) */
            const int64_t h = t / tokens, m = t % tokens;
            for (int64_t g = 0; g < per; g++) {
                const int64_t row = h * rows + g * tokens + m;
                float *o = out + row * d, top = -INFINITY, total = 0.0f;
                memset(o, 0, (size_t)d * sizeof(float));
                /* the tail's part (tails), where it counts any key */
                const float *rest =
                    tails ? tparts + (size_t)t * part + (size_t)g * (d + 2) : NULL;
                if (rest && !(rest[d + 1] > 0.0f)) rest = NULL;
                if (rest) top = rest[d];
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
                    const float f = expf((rest[d] - top) * scale);
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

done:
    /* kept scores past a decode's size (a question's forward over a long shard: rows x n
       floats) are not held for the process's life */
    if (keep && (size_t)(heads * rows) * (size_t)n * sizeof(float) > KEEP_HELD)
        scratch_drop(S_KEEP);
    return failed ? 2 : 0;
}

/* The selection alone, for a caller that attends elsewhere (a GPU holding the values):
   every row's k best keys, as a call of starqa_topk_attend picks them (stages 1 and 2,
   then its k best of its spans'), each row on its own (no GQA union). The arguments are
   starqa_topk_attend's less the values, the own keys and `tokens`; out_rows int64 and
   out_scores fp32 [H, R, k]: each row's picks, shard rows and raw inner products
   q . key, in no set order; -1 and -inf past the keys found. Returns 0, 1 for impossible
   arguments, 2 when out of memory. */
int starqa_topk_select(int k_bf16, const float *q, int64_t heads, int64_t rows, int64_t d,
                       int64_t n, int64_t kbuffers, const int64_t *kstart, const int64_t *kptr,
                       const int64_t *kstride, const int64_t *map, int64_t lists,
                       const uint16_t *centroids, const int64_t *offsets, int64_t probes,
                       int64_t k, int64_t skip, int64_t *out_rows, float *out_scores,
                       int threads) {
    if (d < 1 || d > MAX_DIM || heads < 1 || rows < 1 || n < 0 || n > INT32_MAX || k < 1 ||
        kbuffers < 1 || lists < 1 || (lists > 1 && (!centroids || !offsets)) || probes < 1 ||
        skip < 0 || skip > n)
        return 1;
    threads = threads > 0 ? threads : 1;
    cand *sel;
    int64_t *count, spans, kcap;
    float *near;
    if (pick(k_bf16, q, heads, rows, d, n, kbuffers, kstart, kptr, kstride, map, lists,
             centroids, offsets, probes, k, skip, threads, NULL, 0, 0, &near, &sel, &count,
             &spans, &kcap))
        return 2;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        cand *all = scratch_get(S_ALL, (size_t)(spans * kcap) * sizeof(cand));
        float *tmp = scratch_get(S_TMP, (size_t)(2 * spans * kcap) * sizeof(float));
        if (!all || !tmp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t row = 0; row < heads * rows; row++) {
            if (!all || !tmp) continue;
            const cand *mine;
            const int64_t got = row_best(sel, count, row, spans, kcap, k, all, tmp, &mine);
            int64_t *to = out_rows + row * k;
            float *at = out_scores + row * k;
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
