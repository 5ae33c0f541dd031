/* The delta-rule recurrence of Kimi Delta Attention (models/kda.py) over T tokens, in place on the state:
 * per head h and token t, with S = S[h] [D, D] (key dim rows, value dim columns),
 *   S[i, :] *= alpha[t, h, i];  u = sum_i k[t, h, i] S[i, :];  d = (v[t, h] - u) * beta[t, h];
 *   S[i, :] += k[t, h, i] d;    out[t, h] = sum_i q[t, h, i] S[i, :].
 * The sums are fused multiply-add chains over i in order, the update one fused multiply-add per element, so
 * the scalar, AVX2 and AVX-512 paths give the same bits, and T tokens at once give the bits of T calls of
 * one token. Threads split heads; each head's state stays in cache across its tokens. */
#ifndef MOESTREAM_KDA_H
#define MOESTREAM_KDA_H
#include <stdint.h>

typedef struct {
    float *S;                                   /* [H, D, D] */
    const float *q, *k, *v, *alpha;             /* [T, H, D] */
    const float *beta;                          /* [T, H] */
    float *out;                                 /* [T, H, D] */
    int64_t T;
    int H, D;
} ms_kda_args;

/* 0, or -1 when scratch memory cannot be allocated. */
int ms_kda_recurrence(const ms_kda_args *a, int nthreads);

#endif
