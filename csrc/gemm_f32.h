/* float32 matrix products for prefill attention (scores = Q K^T, then P V), on one thread: the caller
 * splits heads among threads. Every output element is one fused multiply-add chain over k in order,
 * starting from zero, so the scalar, AVX2 and AVX-512 paths give the same bits, whatever the BLAS. */
#ifndef MOESTREAM_GEMM_F32_H
#define MOESTREAM_GEMM_F32_H
#include <stdint.h>

/* out[m, n] = a[m, k] @ b^T with b [n, k] (transpose_b) or a[m, k] @ b with b [k, n]; all row-major and
 * contiguous. 0, or -1 when scratch memory cannot be allocated. */
int ms_gemm_f32(const float *a, const float *b, float *out, int64_t m, int64_t k, int64_t n, int transpose_b);

#endif
