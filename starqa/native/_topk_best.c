/* The top-k kernel's selection (_topk.h): the k best of scored candidates, found without a
   sort: a bar set from a sample, then a branch-free quickselect over those that clear it. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_simd.h"
#include "_topk.h"

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


void topk_keep_best(cand *a, int64_t n, int64_t k, float *tmp) {
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


/* (_topk.h) A bar is set first from a sample of the scores (the 1.5k/m-th quantile of every step-th
   one), so that the selection looks at about 1.5k candidates instead of all m; where
   fewer than k clear it, every candidate is looked at. On a 32K ivf decode's 1,080 rows
   (k 328 of ~2,600 scanned) none fell short; a 2k bar took 12% longer a row, a 1.25k
   one fell short on 28 rows (each then a second pass) and gained ~3% more.
   Either way the result is the k best: the bar only skips candidates that cannot be.
   out: room for m; tmp: scratch of 2m floats. */
SIMD_CLONED(extern, int64_t, topk_best_of,
            (const float *scores, const seg *segs, int64_t nsegs, const int64_t *rowmap,
             int64_t m, int64_t skip, int64_t k, cand *out, float *tmp),
            (scores, segs, nsegs, rowmap, m, skip, k, out, tmp)) {
    float bar = -INFINITY;
    if (m > 2 * k && m > 256) {
        const int64_t step = m / 256, samples = m / step;
        int64_t rank = (3 * k * samples / 2 + m - 1) / m; /* ~1.5k of the m clear it */
        for (int64_t i = 0; i < samples; i++) out[i] = (cand){scores[i * step], 0, 0};
        topk_keep_best(out, samples, rank, tmp);
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
            topk_keep_best(out, got, k, tmp);
            return got < k ? got : k;
        }
        bar = -INFINITY; /* too few cleared the bar: look at every candidate */
    }
    return 0; /* not reached */
}

int64_t topk_row_best(const picks *found, int64_t row, int64_t k, cand *all, float *tmp,
                      const cand **best) {
    const int64_t spans = found->spans, kcap = found->kcap;
    if (spans == 1) {
        *best = found->sel + row * kcap;
        return found->count[row];
    }
    int64_t got = 0;
    for (int64_t span = 0; span < spans; span++) {
        const int64_t slot = row * spans + span;
        memcpy(all + got, found->sel + slot * kcap, (size_t)found->count[slot] * sizeof(cand));
        got += found->count[slot];
    }
    topk_keep_best(all, got, k, tmp);
    *best = all;
    return got < k ? got : k;
}
