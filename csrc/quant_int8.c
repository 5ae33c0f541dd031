/* Integer dot products for q8_0 and q4_k weights: the activations are quantized once per token to int8
 * blocks (the prep_x hook), each block's integer sum is exact, and the per-block float epilogue is the
 * same scalar code on every ISA, so all paths give the same bits. Accumulation over a row is in block
 * order. This file: the activation formats, the scalar kernels and the shared epilogues.
 *
 * Canonical order (what the SIMD kernels reproduce): a row keeps 8 float lanes; for every block, lane L
 * receives the exact integer sum of the products at positions 4L..4L+3 of each 32-element chunk (the lane
 * layout of maddubs + madd), converted to float and fused-multiply-added with the block's scale product;
 * the lanes are reduced as a fixed tree at the end. q4_k's minimum terms are summed apart in 4 lanes, lane l
 * taking dmin * d(x) times the exact mins * bsums of sub-blocks 2l and 2l + 1 (the lanes of madd) by a
 * fused multiply-add per block, reduced as (l0 + l1) + (l2 + l3) and taken off the row's sum.
 * q8_0 keeps two sets of 8 lanes, for the even and the odd blocks, added before the tree (two chains of
 * fused multiply-adds instead of one; two blocks fill a 512-bit register); int4 keeps four sets of 8 lanes and
 * mxfp4 four sets of 4, by block number mod 4, added as (set 0 + set 1) + (set 2 + set 3) (int4: two
 * registers of two blocks; mxfp4: four blocks fill a register). */
#include <float.h>
#include <math.h>
#include <string.h>

#include "quant.h"
#include "quant_int8.h"

static inline float h2f(const uint8_t *p) { return ms_f16_to_f32((uint16_t)(p[0] | (p[1] << 8))); }

/* x[0:n] -> n/block blocks of {f32 d; i8 q[block]} (+ i16 sums per 32 for q8_k). */
static void quantize_run(const float *x, int block, float *d, int8_t *q) {
    float amax = 0.0f;
    for (int i = 0; i < block; i++) amax = fmaxf(amax, fabsf(x[i]));
    if (amax == 0.0f) {
        *d = 0.0f;
        memset(q, 0, (size_t)block);
        return;
    }
    float iscale = 127.0f / amax;
    *d = amax / 127.0f;
    for (int i = 0; i < block; i++) {
        long v = lrintf(x[i] * iscale);
        q[i] = (int8_t)(v > 127 ? 127 : v < -127 ? -127 : v);
    }
}

void ms_prep_x_q8_0(const float *x, int64_t n, float *xp) {
    ms_q8_0x *b = (ms_q8_0x *)xp;
    for (int64_t i = 0; i < n / 32; i++) quantize_run(x + 32 * i, 32, &b[i].d, b[i].q);
}

void ms_prep_x_q8_k(const float *x, int64_t n, float *xp) {
    ms_q8_kx *b = (ms_q8_kx *)xp;
    for (int64_t i = 0; i < n / 256; i++) {
        quantize_run(x + 256 * i, 256, &b[i].d, b[i].q);
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += b[i].q[16 * j + l];
            b[i].bsums16[j] = (int16_t)s;
        }
        b[i].sum = 0;
        for (int j = 0; j < 8; j++) {
            b[i].bsums[j] = (int16_t)(b[i].bsums16[2 * j] + b[i].bsums16[2 * j + 1]);
            b[i].sum += b[i].bsums[j];
        }
    }
}

void ms_prep_x_q6_k(const float *x, int64_t n, float *xp) {
    ms_q6_kx *b = (ms_q6_kx *)xp;
    for (int64_t i = 0; i < n / 256; i++) {
        ms_prep_x_q8_k(x + 256 * i, 256, (float *)&b[i].k);
        for (int j = 0; j < 128; j++) b[i].x32[j] = (int16_t)(32 * (b[i].k.q[2 * j] + b[i].k.q[2 * j + 1]));
    }
}

/* ---- q8_0 ------------------------------------------------------------------------------------ */

float ms_lanes8_reduce(const float f[8]) {
    float a[4] = {f[0] + f[4], f[1] + f[5], f[2] + f[6], f[3] + f[7]};
    float c0 = a[0] + a[2], c1 = a[1] + a[3];
    return c0 + c1;
}

void ms_dot4_q8_0_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const ms_q8_0x *x = (const ms_q8_0x *)xp;
    int64_t nb = m->cols / 32;
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        float acc[16] = {0}, f[8];
        for (int64_t b = 0; b < nb; b++, w += 34) {
            const int8_t *q = (const int8_t *)(w + 2);
            float dd = h2f(w) * x[b].d;
            for (int L = 0; L < 8; L++) {
                int32_t s = 0;
                for (int i = 4 * L; i < 4 * L + 4; i++) s += (int32_t)q[i] * x[b].q[i];
                acc[8 * (b & 1) + L] = fmaf((float)s, dd, acc[8 * (b & 1) + L]);
            }
        }
        for (int L = 0; L < 8; L++) f[L] = acc[L] + acc[8 + L];
        out[r] = ms_lanes8_reduce(f);
    }
}

/* ---- q4_k ------------------------------------------------------------------------------------ */

void ms_q4_k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            sc[j] = s[j] & 63;
            mn[j] = s[j + 4] & 63;
        } else {
            sc[j] = (uint8_t)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
            mn[j] = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
        }
    }
}

float ms_q4_k_min_reduce(const float fmin[4]) { return (fmin[0] + fmin[1]) + (fmin[2] + fmin[3]); }

void ms_dot4_q4_k_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const ms_q8_kx *x = (const ms_q8_kx *)xp;
    int64_t nb = m->cols / 256;
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        float f[8] = {0}, fmin[4] = {0};
        for (int64_t b = 0; b < nb; b++, w += 144) {
            uint8_t sc[8], mn[8];
            ms_q4_k_scales(w + 4, sc, mn);
            const uint8_t *q = w + 16;
            int32_t lanes[8] = {0}, sm[4] = {0};
            for (int j = 0; j < 8; j++) {
                const uint8_t *qq = q + 32 * (j / 2);
                int shift = (j & 1) * 4;
                for (int i = 0; i < 32; i++)
                    lanes[i / 4] += sc[j] * (int32_t)((qq[i] >> shift) & 0x0F) * x[b].q[32 * j + i];
                sm[j / 2] += mn[j] * x[b].bsums[j];
            }
            float dd = h2f(w) * x[b].d, dm = h2f(w + 2) * x[b].d;
            for (int L = 0; L < 8; L++) f[L] = fmaf((float)lanes[L], dd, f[L]);
            for (int l = 0; l < 4; l++) fmin[l] = fmaf((float)sm[l], dm, fmin[l]);
        }
        out[r] = ms_lanes8_reduce(f) - ms_q4_k_min_reduce(fmin);
    }
}

/* ---- tq2_0 and tq1_0 (ternary: d * (q - 1), q in 0..2) against q8_k activations --------------------
 * A block's exact integer S = sum(q * a) - sum(a) (the latter from the q8_k record's bsums), then one
 * fused multiply-add a block in block order, f = fmaf(S, d * d(x), f): every path makes the same S and
 * the same chain, so the same bits. */
static void dot4_ternary(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out,
                         int (*q_of)(const uint8_t *, int), int bytes) {
    const ms_q8_kx *x = (const ms_q8_kx *)xp;
    int64_t nb = m->cols / 256;
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        float f = 0.0f;
        for (int64_t b = 0; b < nb; b++, w += bytes) {
            int32_t s = 0;
            for (int e = 0; e < 256; e++) s += q_of(w, e) * x[b].q[e];
            for (int j = 0; j < 8; j++) s -= x[b].bsums[j];
            f = fmaf((float)s, h2f(w + bytes - 2) * x[b].d, f);
        }
        out[r] = f;
    }
}

void ms_dot4_tq2_0_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    dot4_ternary(m, row0, nrows, xp, out, ms_tq2_q, 66);
}

void ms_dot4_tq1_0_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    dot4_ternary(m, row0, nrows, xp, out, ms_tq1_q, 54);
}

/* ---- q2_k (d * (scale & 15) * q - dmin * (scale >> 4) per 16, q in 0..3) against q8_k activations -----
 * A block's exact integers S = sum over its 16 sub-blocks of (scale & 15) * sum(q * a) and
 * M = sum of (scale >> 4) * sum(a) (the record's bsums16), then two chains in block order,
 * f = fmaf(S, d * d(x), f) and g = fmaf(M, dmin * d(x), g); the row is f - g. */
void ms_dot4_q2_k_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const ms_q8_kx *x = (const ms_q8_kx *)xp;
    int64_t nb = m->cols / 256;
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        float f = 0.0f, g = 0.0f;
        for (int64_t b = 0; b < nb; b++, w += 84) {
            int32_t s = 0, mins = 0;
            for (int sb = 0; sb < 16; sb++) {
                int32_t t = 0;
                for (int e = 16 * sb; e < 16 * sb + 16; e++) t += ms_tq2_q(w + 16, e) * x[b].q[e];
                s += (w[sb] & 0x0F) * t;
                mins += (w[sb] >> 4) * x[b].bsums16[sb];
            }
            f = fmaf((float)s, h2f(w + 80) * x[b].d, f);
            g = fmaf((float)mins, h2f(w + 82) * x[b].d, g);
        }
        out[r] = f - g;
    }
}

/* ---- q3_k (d * scale * (u - 4) per 16, u in 0..7) against q8_k activations ----------------------------
 * A block's exact S = sum over its sub-blocks of scale * sum((u - 4) * a), then f = fmaf(S, d * d(x), f)
 * in block order. */
void ms_dot4_q3_k_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const ms_q8_kx *x = (const ms_q8_kx *)xp;
    int64_t nb = m->cols / 256;
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        float f = 0.0f;
        for (int64_t b = 0; b < nb; b++, w += 110) {
            int32_t s = 0;
            for (int sb = 0; sb < 16; sb++) {
                int32_t t = 0;
                for (int e = 16 * sb; e < 16 * sb + 16; e++) t += (ms_q3_k_u(w, w + 32, e) - 4) * x[b].q[e];
                s += ms_q3_k_scale(w + 96, sb) * t;
            }
            f = fmaf((float)s, h2f(w + 108) * x[b].d, f);
        }
        out[r] = f;
    }
}

/* ---- compressed-tensors int4 (value = nibble - 8, one f32 scale per 32) -------------------------- */

/* Activations in the weights' nibble order (low nibbles = even columns first), so that lane L takes
 * positions 4L..4L+3 of that order: the SIMD kernels multiply the nibbles (0..15) as they lie and
 * take 8 * sum(x) of the lane off, the same exact integer as sum((nibble - 8) * x). Like mxfp4's, a row's
 * blocks go to four sets of lanes by b % 4 (two blocks fill a 512-bit register, and two registers make two
 * chains of fused multiply-adds, so that one row alone keeps the multiply-add units busy). */
void ms_prep_x_int4(const float *x, int64_t n, float *xp) {
    ms_int4x o = ms_int4x_at(xp, n / 32);
    for (int64_t i = 0; i < n / 32; i++) {
        int8_t q[32], *oq = o.q + 32 * i;
        quantize_run(x + 32 * i, 32, &o.d[i], q);
        for (int p = 0; p < 32; p++) oq[p] = q[p < 16 ? 2 * p : 2 * (p - 16) + 1];
        for (int L = 0; L < 8; L++) o.s8[8 * i + L] = 8 * (oq[4 * L] + oq[4 * L + 1] + oq[4 * L + 2] + oq[4 * L + 3]);
    }
}

void ms_dot4_int4_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    int64_t nb = m->cols / 32;
    const ms_int4x x = ms_int4x_at(xp, nb);
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        const float *s = ms_int4_scale_row(m, row0 + r);
        float acc[32] = {0}, f[8];
        for (int64_t b = 0; b < nb; b++, w += 16) {
            float dd = s[b] * x.d[b];
            for (int L = 0; L < 8; L++) {
                int32_t S = 0;
                for (int p = 4 * L; p < 4 * L + 4; p++) /* position p: byte p % 16, low nibble if p < 16 */
                    S += (((w[p % 16] >> (p < 16 ? 0 : 4)) & 0x0F) - 8) * x.q[32 * b + p];
                acc[8 * (b % 4) + L] = fmaf((float)S, dd, acc[8 * (b % 4) + L]);
            }
        }
        for (int L = 0; L < 8; L++) f[L] = (acc[L] + acc[8 + L]) + (acc[16 + L] + acc[24 + L]);
        out[r] = ms_lanes8_reduce(f);
    }
}

/* ---- mxfp4 against three-digit int8 activations -----------------------------------------------------
 * Each 32-block of activations becomes x ~ q * d with d = 2^(e-20) for amax < 2^e, so |q| <= 2^20 and
 * |x - q d| <= 2^-20 of the block's max (float accuracy for a dot product), the integer q written as
 * three int8 digits (quant_int8.h). Doubled E2M1 values are small integers (|k| <= 12), so a lane's sum
 * S = sum k q over its eight positions is exact in int32 (|S| < 2^27); the SIMD kernels get it as
 * ((A0 * 2^7 + A1) * 2^7 + A2) + noff from the digit dot products A of the unsigned k + 12.
 * Canonical order: lane L (0..3) of block b holds positions 4L..4L+3 and 16+4L..16+4L+3 of the nibble
 * order (a low-nibble lane and its high-nibble twin, summed in the integer); it is added as
 * acc[4 * (b % 4) + L] = fma((float)S, dd, acc[...]) with dd = 2^(s-128) * d (a power of two), in block
 * order (four chains: four blocks fill a 512-bit register); with f[L] = (acc[L] + acc[4 + L]) +
 * (acc[8 + L] + acc[12 + L]), the row's result is (f[0] + f[2]) + (f[1] + f[3]). */

void ms_prep_x_mxfp4(const float *x, int64_t n, float *xp) {
    int64_t nb = n / 32;
    ms_mxfp4x o = ms_mxfp4x_at(xp, nb);
    for (int64_t b = 0; b < nb; b++) {
        const float *v = x + 32 * b;
        float amax = 0.0f;
        int finite = 1;
        for (int i = 0; i < 32; i++) {
            amax = fmaxf(amax, fabsf(v[i]));
            finite &= fabsf(v[i]) <= FLT_MAX;
        }
        for (int L = 0; L < 4; L++) o.noff[4 * b + L] = 0;
        if (!finite || amax == 0.0f) { /* zeros: all zero; inf/nan anywhere: the block's sums become nan */
            for (int j = 0; j < 32; j++) {
                int64_t at = ms_mxfp4x_pos(nb, b, j);
                o.p0[at] = o.p1[at] = o.p2[at] = 0;
            }
            o.d[b] = finite ? 0.0f : NAN;
            continue;
        }
        int e;
        frexpf(amax, &e);  /* amax < 2^e */
        if (e < -100) e = -100; /* keep d a normal number */
        o.d[b] = ldexpf(1.0f, e - 20);
        float scale = ldexpf(1.0f, 20 - e);
        for (int i = 0; i < 32; i++) {
            int j = (i & 1) * 16 + i / 2;                       /* nibble order */
            int32_t q = (int32_t)rintf(v[i] * scale);           /* |q| <= 2^20, to nearest even */
            int32_t d0 = (q + 8192) >> 14, r = q - d0 * 16384;  /* d0 in -64..64, r in -8192..8191 */
            int32_t d1 = (r + 64) >> 7, d2 = r - d1 * 128;      /* d1 in -64..64, d2 in -64..63 */
            int64_t at = ms_mxfp4x_pos(nb, b, j);
            o.p0[at] = (int8_t)d0;
            o.p1[at] = (int8_t)d1;
            o.p2[at] = (int8_t)d2;
            o.noff[4 * b + (j % 16) / 4] -= 12 * q;
        }
    }
}

/* The digit value q at position j of block b of nb. */
static inline int32_t mx_q(const ms_mxfp4x *x, int64_t nb, int64_t b, int j) {
    int64_t i = ms_mxfp4x_pos(nb, b, j);
    return x->p0[i] * 16384 + x->p1[i] * 128 + x->p2[i];
}

void ms_dot4_mxfp4_int_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    int64_t nb = m->cols / 32;
    ms_mxfp4x x = ms_mxfp4x_at(xp, nb);
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        const uint8_t *s8 = ms_mxfp4_scale_row(m, row0 + r);
        float acc[16] = {0}, f[4];
        for (int64_t b = 0; b < nb; b++, w += 16) {
            float dd = ms_e8m0_half_lut[s8[b]] * x.d[b];
            for (int L = 0; L < 4; L++) {
                int32_t S = 0;
                for (int j = 4 * L; j < 4 * L + 4; j++) /* byte j: its low nibble is position j, its high j + 16 */
                    S += ms_e2m1_x2_lut[w[j] & 0x0F] * mx_q(&x, nb, b, j) +
                         ms_e2m1_x2_lut[w[j] >> 4] * mx_q(&x, nb, b, j + 16);
                acc[4 * (b % 4) + L] = fmaf((float)S, dd, acc[4 * (b % 4) + L]);
            }
        }
        for (int L = 0; L < 4; L++) f[L] = (acc[L] + acc[4 + L]) + (acc[8 + L] + acc[12 + L]);
        out[r] = (f[0] + f[2]) + (f[1] + f[3]);
    }
}

/* ---- q6_k (16 sub-blocks of 16 with int8 scales; values in -32..31) ----------------------------- */

static inline int q6_value(const uint8_t *b, int e) {
    int h = e / 128, k = (e % 128) / 32, i = e % 32;
    const uint8_t *ql = b + 64 * h + 32 * (k & 1), *qh = b + 128 + 32 * h;
    int lo = (k < 2) ? (ql[i] & 0x0F) : (ql[i] >> 4);
    return (lo | (((qh[i] >> (2 * k)) & 3) << 4)) - 32;
}

void ms_dot4_q6_k_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const ms_q6_kx *x = (const ms_q6_kx *)xp;
    int64_t nb = m->cols / 256;
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        float f[8] = {0};
        for (int64_t b = 0; b < nb; b++, w += 210) {
            const int8_t *sc = (const int8_t *)(w + 192);
            int32_t lanes[8] = {0};
            for (int e = 0; e < 256; e++) lanes[(e % 32) / 4] += sc[e / 16] * q6_value(w, e) * x[b].k.q[e];
            float dd = h2f(w + 208) * x[b].k.d;
            for (int L = 0; L < 8; L++) f[L] = fmaf((float)lanes[L], dd, f[L]);
        }
        out[r] = ms_lanes8_reduce(f);
    }
}
