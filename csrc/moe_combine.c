/* A MoE layer's output from its experts' rows (see matmul.h): per token, the product of the first chosen
 * expert's row with its weight, then each further one's product added, in top-k order, each operation a
 * float32 multiply or add rounded on its own (no fused multiply-add: these are numpy's operations, in its
 * order). Threads split the tokens. */
#include "matmul.h"
#include "threadpool.h"

typedef struct {
    const float *ys;
    int64_t width;
    const int64_t *rows;
    const float *w;
    int64_t T;
    int k;
    float *out;
} combine_job;

static void combine_task(void *ctx, int ith, int nth) {
    const combine_job *j = (const combine_job *)ctx;
    const int64_t t0 = j->T * ith / nth, t1 = j->T * (ith + 1) / nth, n = j->width;
    for (int64_t t = t0; t < t1; t++) {
        float *o = j->out + t * n;
        const float *y = j->ys + j->rows[t * j->k] * n, w0 = j->w[t * j->k];
        for (int64_t i = 0; i < n; i++) o[i] = y[i] * w0;
        for (int s = 1; s < j->k; s++) {
            const float *ys = j->ys + j->rows[t * j->k + s] * n, ws = j->w[t * j->k + s];
            for (int64_t i = 0; i < n; i++) {
                const float term = ys[i] * ws;
                o[i] = o[i] + term;
            }
        }
    }
}

void ms_moe_combine(const float *ys, int64_t width, const int64_t *rows, const float *w, int64_t T, int k, float *out,
                    int nthreads) {
    combine_job j = {ys, width, rows, w, T, k, out};
    ms_parallel(ms_threads_for(nthreads, T, T * k * width), combine_task, &j);
}
