/* RMSNorm with the bits of numpy's float32 expression (models/base.py: rms_norm). */
#ifndef MOESTREAM_NORM_H
#define MOESTREAM_NORM_H
#include <stdint.h>

/* numpy's pairwise float32 sum of a[0:n] */
float ms_pairwise_sum(const float *a, int64_t n);

/* out[r] = w * (x[r] * (1 / sqrt(sum(x[r]^2) / n + eps))) for each of rows rows of n; sq is [n] scratch.
 * w may be NULL (no weight). out may be x. */
void ms_rms_norm_row(const float *x, const float *w, int64_t n, float eps, float *sq, float *out);

/* ms_rms_norm_row over rows rows; 0, or -1 when scratch cannot be allocated */
int ms_rms_norm(const float *x, const float *w, int64_t rows, int64_t n, float eps, float *out);

#endif
