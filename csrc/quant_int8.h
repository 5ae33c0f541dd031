/* Activation blocks for the integer dot kernels (quant_int8*.c). */
#ifndef MOESTREAM_QUANT_INT8_H
#define MOESTREAM_QUANT_INT8_H
#include <stdint.h>

#include "quant.h"

typedef struct {
    float d;
    int8_t q[32];
} ms_q8_0x; /* 36 bytes per 32 activations */

typedef struct {
    float d;
    int8_t q[256];
    int16_t bsums[8]; /* sums of q per 32 */
} ms_q8_kx;           /* 276 bytes per 256 activations (<= 4 bytes each, so it fits the prep buffer) */

typedef struct {
    ms_q8_kx k;
    int16_t x32[128]; /* 32 * (q[2i] + q[2i+1]): the part of the q6_k sums that the -32 takes off, in the int16
                       * pair layout of maddubs, made once per token for every row */
} ms_q6_kx;          /* 532 bytes per 256 activations */

typedef struct {
    float da, db;  /* powers of two, db = da / 2^15 */
    int16_t a[32]; /* x ~ a * da + b * db; [0..15]: the block's even columns, [16..31]: the odd ones */
    int16_t b[32]; /* (the nibble order of the weights) */
} ms_mxfp4x;       /* 136 bytes per 32 activations; |x - (a da + b db)| <= 2^-29 of the block's max */

typedef struct {
    float d;
    int8_t q[32];   /* int8 activations in the nibble order of the weights: [0..15] the block's even
                     * columns, [16..31] the odd ones */
    int32_t s8[8];  /* 8 * (q[4L] + ... + q[4L+3]): lane L's share of the -8 in (nibble - 8) */
} ms_int4x;         /* 68 bytes per 32 activations */

void ms_q4_k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]);
float ms_lanes8_reduce(const float f[8]); /* (f0+f4 + f2+f6) + (f1+f5 + f3+f7) */
#endif
