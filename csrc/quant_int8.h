/* Activation blocks for the integer dot kernels (quant_int8*.c). */
#ifndef MOESTREAM_QUANT_INT8_H
#define MOESTREAM_QUANT_INT8_H
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"

typedef struct {
    float d;
    int8_t q[32];
} ms_q8_0x; /* 36 bytes per 32 activations */

typedef struct {
    int8_t q[256];    /* first, so that every 64-byte load of q is aligned (the records are 64-aligned) */
    int16_t bsums[8]; /* sums of q per 32 */
    float d;
    int16_t bsums16[16]; /* sums of q per 16 (q2_k's sub-blocks) */
    int32_t sum;         /* the sum of q (what tq1_0's and tq2_0's -1 takes off), made once per token */
    float pad[2];
} ms_q8_kx;              /* 320 bytes per 256 activations */

typedef struct {
    ms_q8_kx k;
    int16_t x32[128]; /* 32 * (q[2i] + q[2i+1]): the part of the q6_k sums that the -32 takes off, in the int16
                       * pair layout of maddubs, made once per token for every row */
} ms_q6_kx;          /* 576 bytes per 256 activations */
_Static_assert(sizeof(ms_q8_kx) % 64 == 0 && sizeof(ms_q6_kx) % 64 == 0, "q8_k records keep q 64-aligned");

/* mxfp4 activations of one token, per 32-block b (MS_MXFP4X_BYTES each, as arrays over the nb blocks of
 * the token): x ~ q * d[b] with the integer q (|q| <= 2^20) split into three int8 digits
 * q = p0 * 2^14 + p1 * 2^7 + p2 (each in -64..64) at the positions of the weights' nibble order
 * ([0..15]: the block's even columns, the low nibbles; [16..31]: the odd ones, the high nibbles), and
 * noff[4b + L] = -12 * (sum of q over positions 4L..4L+3 and 16+4L..16+4L+3), what lane L's share of the
 * +12 that makes the doubled E2M1 values unsigned (0..24) for maddubs / vpdpbusd takes off (negated, so
 * that it starts a vpdpbusd chain as it is loaded). d[b] is a power of two (0: zero
 * block; NaN: inf/NaN). The digits come in groups of four blocks (the last may be shorter, n blocks): a
 * group's low halves (positions 0..15 of each block, 16 bytes each) and then its high halves, so that the
 * 64 weight bytes of four blocks, split into low and high nibbles, meet their activations in two 512-bit
 * loads. ms_mxfp4x_pos gives the places. */
#define MS_MXFP4X_BYTES 116
typedef struct {
    int8_t *p0, *p1, *p2; /* [nb * 32] */
    int32_t *noff;        /* [nb * 4] */
    float *d;             /* [nb] */
} ms_mxfp4x;

/* Index in a digit array of position i (0..31, nibble order) of block b of nb. */
static inline int64_t ms_mxfp4x_pos(int64_t nb, int64_t b, int i) {
    int64_t g = b / 4, j = b % 4, n = nb - 4 * g < 4 ? nb - 4 * g : 4;
    return 128 * g + (i < 16 ? 16 * j + i : 16 * n + 16 * j + (i - 16));
}

static inline ms_mxfp4x ms_mxfp4x_at(const float *xp, int64_t nb) {
    char *base = (char *)xp;
    ms_mxfp4x v = {(int8_t *)base, (int8_t *)base + 32 * nb, (int8_t *)base + 64 * nb,
                   (int32_t *)(base + 96 * nb), (float *)(base + 112 * nb)};
    return v;
}

/* A token's int4 activations as three arrays over its nb blocks (MS_INT4X_BYTES per block), so that a
 * pair of blocks is one 512-bit load of each: q[32 b .. 32 b + 31], block b's int8 activations in the
 * nibble order of the weights ([0..15] the block's even columns, [16..31] the odd ones); s8[8 b + L] =
 * 8 * (q[4L] + ... + q[4L+3]), lane L's share of the -8 in (nibble - 8); d[b], the block's scale. That is
 * the nibble order of the scalar and AVX-512 VNNI kernels. The AVX2 kernel reads the pair layout: the
 * blocks 2g, 2g + 1 of a pair (the last block of an odd count stays as above) as q[64 g ..] = 2g's
 * [0..15], 2g + 1's [0..15], 2g's [16..31], 2g + 1's [16..31] (the low nibbles of a pair's 32 weight bytes
 * against 32 contiguous bytes, the high ones against the next 32) and s8[16 g ..] = 2g's lanes 0..3, 2g + 1's
 * 0..3, 2g's 4..7, 2g + 1's 4..7. Each ISA's prep writes the layout its kernels read. */
#define MS_INT4X_BYTES 68
typedef struct {
    int8_t *q;   /* [nb * 32] */
    int32_t *s8; /* [nb * 8] */
    float *d;    /* [nb] */
} ms_int4x;

static inline ms_int4x ms_int4x_at(const float *xp, int64_t nb) {
    char *base = (char *)xp;
    ms_int4x v = {(int8_t *)base, (int32_t *)(base + 32 * nb), (float *)(base + 64 * nb)};
    return v;
}

void ms_q4_k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]);
float ms_lanes8_reduce(const float f[8]); /* (f0+f4 + f2+f6) + (f1+f5 + f3+f7) */
float ms_q4_k_min_reduce(const float fmin[4]); /* (m0 + m1) + (m2 + m3) */

/* An empty asm on a vector (any vector register: ymm or, in the AVX-512 kernels, zmm0-31) that GCC must
 * take as changed there. On a running integer sum, it keeps each addition where it is written (the sums
 * are exact in any order, and GCC regroups them into a tree whose partial products spill to the stack);
 * on a loaded vector, it keeps the one load (mxfp4: GCC otherwise spilled or loaded again two of the four
 * rows' weight vectors, a load from memory in each of its uses). */
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v))

/* How many rows ahead the one-row-stream kernels (int4, mxfp4) prefetch: at least min_rows, and at least
 * 16 KB, in steps of `step` rows (the rows a pass takes together). */
static inline int64_t prefetch_rows(int64_t row_bytes, int64_t step, int64_t min_rows) {
    const int64_t rows = step * ((16384 + step * row_bytes - 1) / (step * row_bytes));
    return rows > min_rows ? rows : min_rows;
}

/* The 12 scale bytes of a q4_k block as 8 six-bit scales and 8 six-bit mins, a byte each in sc and mn
 * (little-endian: sub-block j's in byte j), with 32-bit word operations in general registers: the values
 * of ms_q4_k_scales, without bytes stored one by one and loaded again as a word. */
static inline void q4k_scale_bytes(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t u[3];
    memcpy(u, s, 12);
    const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
    const uint64_t sc_lo = u[0] & m6, mn_lo = u[1] & m6;
    const uint64_t sc_hi = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);
    const uint64_t mn_hi = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);
    *sc = sc_lo | sc_hi << 32;
    *mn = mn_lo | mn_hi << 32;
}

/* A per-thread buffer of at least need items of size bytes, 64-aligned: 1, or 0 when out of memory. */
static inline int grow(void **buf, int64_t *cap, int64_t need, size_t size) {
    if (*cap >= need) return 1;
    free(*buf);
    *buf = aligned_alloc(64, (size_t)need * size);
    *cap = *buf ? need : 0;
    return *buf != NULL;
}

/* Whether the kernels' prefetches `ahead` bytes on go into L2 rather than L1: with prefetch level 2 (the
 * default on a small L1, csrc/matmul.c), those that reach past a quarter of the L1. */
int ms_prefetch_into_l2(int64_t ahead);

/* The line at p asked for into L1, or with l2 (a constant where this is inlined, or asked once a kernel
 * call: ms_prefetch_into_l2) into L2 only. */
static inline __attribute__((always_inline)) void prefetch_line(const void *p, const int l2) {
    if (l2)
        _mm_prefetch((const char *)p, _MM_HINT_T1);
    else
        _mm_prefetch((const char *)p, _MM_HINT_T0);
}

#endif
