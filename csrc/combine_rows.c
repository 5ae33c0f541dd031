/* out[h, :] = sum over n < N of coef[h, n] * W[first + h * stride + n, :] (see matmul.h): each row
 * dequantized by its format's kernel (bit for bit the numpy reference on every instruction set), then
 * added into out[h] with one fused multiply-add per element, n in order from zero, so the result is the
 * same on every path. Threads split h. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "matmul.h"
#include "threadpool.h"

typedef struct {
    const ms_matrix *m;
    int64_t first, stride;
    int H, N;
    const float *coef;
    float *out, *scratch; /* scratch: [nth, cols] */
    ms_isa isa;
} combine_job;

static void axpy_scalar(float a, const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

/* The same fused multiply-adds, vectorised by the compiler. */
__attribute__((target("avx2,fma"))) static void axpy_avx2(float a, const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

__attribute__((target("avx512f"))) static void axpy_avx512(float a, const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

static void combine_task(void *ctx, int ith, int nth) {
    const combine_job *j = (const combine_job *)ctx;
    const int64_t cols = j->m->cols;
    const int h0 = (int)((int64_t)j->H * ith / nth), h1 = (int)((int64_t)j->H * (ith + 1) / nth);
    float *row = j->scratch + ith * cols;
    const ms_dequant_fn dequant = ms_formats[j->m->fmt].dequant[j->isa];
    void (*axpy)(float, const float *, float *, int64_t) =
        j->isa == MS_ISA_AVX512 ? axpy_avx512 : j->isa == MS_ISA_AVX2 ? axpy_avx2 : axpy_scalar;
    for (int h = h0; h < h1; h++) {
        float *out = j->out + (int64_t)h * cols;
        memset(out, 0, (size_t)cols * sizeof(float));
        for (int n = 0; n < j->N; n++) {
            dequant(j->m, j->first + h * j->stride + n, row);
            axpy(j->coef[(int64_t)h * j->N + n], row, out, cols);
        }
    }
}

int ms_combine_rows(const ms_matrix *m, int64_t first, int64_t stride, int H, int N, const float *coef, float *out,
                    int nthreads) {
    const int nth = ms_threads_for(nthreads, H, (int64_t)H * N * m->cols);
    float *scratch = malloc((size_t)nth * (size_t)(m->cols > 0 ? m->cols : 1) * sizeof(float));
    combine_job j = {m, first, stride, H, N, coef, out, scratch, ms_get_isa()};
    if (!j.scratch) return -1;
    if (H > 0) ms_parallel(nth, combine_task, &j);
    free(j.scratch);
    return 0;
}

/* Rows [r0, r0 + n) of m as a matrix of their own (the same bytes); -1 when fp8's 128-row scale blocks
 * would not line up (r0 not a multiple of 128). */
static int rows_view(const ms_matrix *m, int64_t r0, int64_t n, ms_matrix *v) {
    *v = *m;
    v->data = m->data + r0 * m->row_bytes;
    v->rows = n;
    if (m->fmt == MS_FP8_E4M3_B128) {
        if (r0 % 128) return -1;
        v->scales = ms_fp8_scale_row(m, r0);
    } else if (m->fmt == MS_MXFP4) {
        v->scales = ms_mxfp4_scale_row(m, r0);
    } else if (m->fmt == MS_INT4_G32) {
        v->scales = ms_int4_scale_row(m, r0);
    }
    return 0;
}

int ms_block_rows_matmul(const ms_matrix *m, int64_t first, int64_t stride, int H, int V, const float *x, float *out,
                         int nthreads) {
    if (H <= 0) return 0;
    ms_product *p = malloc((size_t)H * sizeof(ms_product));
    if (!p) return -1;
    for (int h = 0; h < H; h++) {
        if (rows_view(m, first + h * stride, V, &p[h].m) < 0) {
            free(p);
            return -2;
        }
        p[h].x = x + (int64_t)h * m->cols;
        p[h].T = 1;
        p[h].out = out + (int64_t)h * V;
    }
    const int rc = ms_matmul_many(p, H, nthreads);
    free(p);
    return rc;
}
