/* RMSNorm (see norm.h). */
#include "norm.h"

#include <math.h>
#include <stdlib.h>

/* As numpy/_core/src/umath/loops_utils.h.src sums float32: up to 8 values in a row, up to 128 in eight
 * interleaved partial sums, longer halves recursively. */
float ms_pairwise_sum(const float *a, int64_t n) {
    if (n < 8) {
        float r = 0.0f;
        for (int64_t i = 0; i < n; i++) r += a[i];
        return r;
    }
    if (n <= 128) {
        float r[8];
        for (int j = 0; j < 8; j++) r[j] = a[j];
        int64_t i = 8;
        for (; i < n - n % 8; i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return ms_pairwise_sum(a, n2) + ms_pairwise_sum(a + n2, n - n2);
}

void ms_rms_norm_row(const float *x, const float *w, int64_t n, float eps, float *sq, float *out) {
    for (int64_t i = 0; i < n; i++) sq[i] = x[i] * x[i];
    const float var = ms_pairwise_sum(sq, n) / (float)n;
    const float r = 1.0f / sqrtf(var + eps);
    if (w != NULL)
        for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
    else
        for (int64_t i = 0; i < n; i++) out[i] = x[i] * r;
}

int ms_rms_norm(const float *x, const float *w, int64_t rows, int64_t n, float eps, float *out) {
    float *sq = malloc((size_t)n * sizeof(float));
    if (sq == NULL) return -1;
    for (int64_t r = 0; r < rows; r++) ms_rms_norm_row(x + r * n, w, n, eps, sq, out + r * n);
    free(sq);
    return 0;
}
