/* One token through a MoE layer's chosen experts in one call (see matmul.h): what the Python glue did in
 * a dozen steps (two passes of products, the activation between them, the weighted sum), with the same
 * products, ms_silu_mul and ms_moe_combine's sum. */
#include <stdlib.h>

#include "activations.h"
#include "matmul.h"

int ms_glu_experts_one_x(const ms_matrix *m, int n, const float *x, const float *w, float *out, int nthreads) {
    const int64_t inner = m[0].rows, width = m[2].rows;
    float *gu = malloc((size_t)(2 * n * inner) * sizeof(float)); /* gate outputs [n, inner], then up's */
    float *ys = w != NULL ? malloc((size_t)(n * width) * sizeof(float)) : out; /* [n, width] */
    ms_product *p = malloc((size_t)(2 * n) * sizeof(ms_product));
    int64_t *rows = malloc((size_t)n * sizeof(int64_t));
    int rc = -1;
    if (gu == NULL || ys == NULL || p == NULL || rows == NULL) goto done;
    float *g = gu, *u = gu + n * inner;
    for (int i = 0; i < n; i++) {
        p[2 * i] = (ms_product){m[3 * i], x, 1, g + i * inner};         /* gate */
        p[2 * i + 1] = (ms_product){m[3 * i + 1], x, 1, u + i * inner}; /* up */
    }
    if (ms_matmul_many(p, 2 * n, nthreads) != 0) goto done;
    ms_silu_mul(g, u, g, n * inner, nthreads);
    for (int i = 0; i < n; i++) p[i] = (ms_product){m[3 * i + 2], g + i * inner, 1, ys + i * width}; /* down */
    if (ms_matmul_many(p, n, nthreads) != 0) goto done;
    if (w != NULL) {
        for (int i = 0; i < n; i++) rows[i] = i;
        ms_moe_combine(ys, width, rows, w, 1, n, out, 1);
    }
    rc = 0;
done:
    free(gu);
    if (ys != out) free(ys);
    free(p);
    free(rows);
    return rc;
}
