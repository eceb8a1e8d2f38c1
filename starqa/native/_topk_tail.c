/* The top-k kernel's tail (ivf; _topk.h): the keys of the shard that a position's union
   leaves out, entered into each of its rows' softmax list by list, as copies of the list's
   centre holding the list's mean value. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_simd.h"
#include "_topk.h"

/* List c's u_c = size_c - lcount[c] keys outside the union weigh u_c * exp((near_g[c] -
   top_g) * scale) together in row g (near_g: its centroid scores; top_g the largest of
   them among lists with any) and stand for the list's mean value (read once for the G
   rows). */
void topk_tail_rows(const tail_part *tail, float *w, const char **vp, float *value,
                    float *piece) {
    const int32_t *lcount = tail->lcount;
    const int64_t *offsets = tail->offsets;
    const int64_t lists = tail->lists, near_step = tail->near_step, per = tail->per;
    const int64_t d = tail->d;
    const float *near = tail->near, scale = tail->scale;
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
    for (int64_t c = 0; c < lists; c++) vp[c] = (const char *)(tail->values + c * d);
    topk_weighted_sum(vp, lists, 1, w, room, per, d, outs, value);
}
