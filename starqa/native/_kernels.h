/* The entry points of starqa's CPU kernels that other kernels compose (_layer.c, _step.c),
   declared once: each defining file includes this too, so a declaration that drifted from
   its definition is a compile error, not a wrong call. What each computes: its own file. */

#ifndef STARQA_KERNELS_H
#define STARQA_KERNELS_H

#include <stdint.h>

/* _int4.c */
int starqa_int4_mm(int x_bf16, const void *x, int64_t m, int64_t k, const uint8_t *w,
                   int64_t n, int y_bf16, void *y, int fast, int threads);
/* _rows.c */
void starqa_rms_norm(int bf16, const void *x, int64_t m, int64_t h, const void *w, float eps,
                     void *y);
int starqa_rope(int bf16, void *x, int64_t m, int64_t row, int64_t heads, int64_t d,
                const void *cos, const void *sin);
void starqa_silu_mul(int bf16, const void *x, int64_t m, int64_t n, void *y);
void starqa_add(int bf16, void *x, int64_t m, int64_t n, const void *y, int64_t stride);
/* _layer.c */
int starqa_layer_before(int bf16, const void *hidden, int64_t m, int64_t h, const void *norm,
                        float eps, const uint8_t *w_qkv, int64_t n, const void *bias,
                        int64_t rotated, int64_t d, const void *cos, const void *sin,
                        void *qkv, int threads);
int starqa_layer_after(int bf16, void *hidden, int64_t m, int64_t h, const void *attn,
                       int64_t k, const uint8_t *w_out, const void *bias_out, const void *norm,
                       float eps, const uint8_t *w_gate_up, int64_t inner,
                       const void *bias_gate_up, const uint8_t *w_down, const void *bias_down,
                       int threads);
/* _attend.c */
int starqa_attend(int bf16, const float *q, int64_t pieces, const int64_t *starts,
                  const int64_t *k_addr, const int64_t *v_addr, const int64_t *k_strides,
                  const int64_t *v_strides, float *out, float *lse, int64_t heads,
                  int64_t rows, int64_t d, int64_t own, float scale, int threads);
/* _topk.c */
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
                       int threads);

#endif
