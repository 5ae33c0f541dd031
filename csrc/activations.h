/* Elementwise activations and the softmax router's choice, on exp_f32.h's exp: each element one fixed
 * sequence of float32 operations, so the bits do not depend on the instruction set or the thread count. */
#ifndef MOESTREAM_ACTIVATIONS_H
#define MOESTREAM_ACTIVATIONS_H
#include <stdint.h>

/* p[s] = exp(p[s] - m) for s < S (the softmaxes of decode attention and of the router). */
void ms_exp_shifted(float *p, int64_t S, float m);

/* h[i] = (g[i] / (1 + exp(-g[i]))) * u[i] for i < n (SwiGLU: silu(gate) times up; h may be g or u). Threads
 * split the elements. */
void ms_silu_mul(const float *g, const float *u, float *h, int64_t n, int nthreads);

/* Per row t of logits [T, n]: p = softmax(row) (m = the max; e_i = exp(l_i - m); s = e_0 + e_1 + ... in index
 * order; p_i = e_i / s), the k largest p largest first (ties to the lower index; a NaN is never larger)
 * into idx [T, k], and their p into w [T, k], divided by their sum (w_0 + w_1 + ... in slot order) when
 * renormalize. 0, or -1 when out of memory. */
int ms_softmax_topk(const float *logits, int64_t T, int64_t n, int k, int renormalize, int64_t *idx, float *w);

#endif
