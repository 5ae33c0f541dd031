#ifndef MOESTREAM_MATMUL_H
#define MOESTREAM_MATMUL_H
#include <stdint.h>

#include "quant.h"

void ms_init(void);
int ms_isa_supported(ms_isa isa);
ms_isa ms_get_isa(void);
int ms_set_isa(ms_isa isa); /* 0 on success, -1 if this CPU lacks it */

/* out[t, r] = dot(W[r, :], x[t, :]) for t < T, r < rows; x is [T, cols], out is [T, rows]. Threads
 * split the rows; every element has the canonical reduction order, so the result does not depend on
 * nthreads or on T. */
/* 0, or -1 when the prepared activations cannot be allocated */
int ms_matmul(const ms_matrix *m, const float *x, int64_t T, float *out, int nthreads);

/* One product of a batch: out [T, rows] = x [T, cols] W^T. */
typedef struct {
    ms_matrix m;
    const float *x;
    int64_t T;
    float *out;
} ms_product;

/* n products in one parallel pass (the tiles of all of them shared out among the threads by weight
 * bytes times tokens), activations prepared once when several products take the same x. Each result
 * is bit for bit what ms_matmul gives for that product alone. 0, or -1 when out of memory. */
int ms_matmul_many(const ms_product *p, int n, int nthreads);
void ms_dequant(const ms_matrix *m, float *out, int nthreads);
/* Reads n bytes as a memory bandwidth baseline; returns a checksum. */
double ms_memread(const uint8_t *p, int64_t n, int nthreads);
#endif
