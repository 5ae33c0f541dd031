/* Integer dot products for q8_0 and q4_k weights: the activations are quantized once per token to int8
 * blocks (the prep_x hook), each block's integer sum is exact, and the per-block float epilogue is the
 * same scalar code on every ISA, so all paths give the same bits. Accumulation over a row is in block
 * order. This file: the activation formats, the scalar kernels and the shared epilogues.
 *
 * Canonical order (what the SIMD kernels reproduce): a row keeps 8 float lanes; for every block, lane L
 * receives the exact integer sum of the products at positions 4L..4L+3 of each 32-element chunk (the lane
 * layout of maddubs + madd), converted to float and fused-multiply-added with the block's scale product;
 * the lanes are reduced as a fixed tree at the end, and a row's minimum terms (q4_k) are summed apart. */
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
        for (int j = 0; j < 8; j++) {
            int s = 0;
            for (int l = 0; l < 32; l++) s += b[i].q[32 * j + l];
            b[i].bsums[j] = (int16_t)s;
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
        float f[8] = {0};
        for (int64_t b = 0; b < nb; b++, w += 34) {
            const int8_t *q = (const int8_t *)(w + 2);
            float dd = h2f(w) * x[b].d;
            for (int L = 0; L < 8; L++) {
                int32_t s = 0;
                for (int i = 4 * L; i < 4 * L + 4; i++) s += (int32_t)q[i] * x[b].q[i];
                f[L] = fmaf((float)s, dd, f[L]);
            }
        }
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

void ms_dot4_q4_k_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const ms_q8_kx *x = (const ms_q8_kx *)xp;
    int64_t nb = m->cols / 256;
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        float f[8] = {0}, fmin = 0.0f;
        for (int64_t b = 0; b < nb; b++, w += 144) {
            uint8_t sc[8], mn[8];
            ms_q4_k_scales(w + 4, sc, mn);
            const uint8_t *q = w + 16;
            int32_t lanes[8] = {0}, sm = 0;
            for (int j = 0; j < 8; j++) {
                const uint8_t *qq = q + 32 * (j / 2);
                int shift = (j & 1) * 4;
                for (int i = 0; i < 32; i++)
                    lanes[i / 4] += sc[j] * (int32_t)((qq[i] >> shift) & 0x0F) * x[b].q[32 * j + i];
                sm += mn[j] * x[b].bsums[j];
            }
            float dd = h2f(w) * x[b].d, dm = h2f(w + 2) * x[b].d;
            for (int L = 0; L < 8; L++) f[L] = fmaf((float)lanes[L], dd, f[L]);
            fmin += dm * (float)sm;
        }
        out[r] = ms_lanes8_reduce(f) - fmin;
    }
}

/* ---- compressed-tensors int4 (value = nibble - 8, one f32 scale per 32) -------------------------- */

/* Activations in the weights' nibble order (low nibbles = even columns first), so that lane L takes
 * positions 4L..4L+3 of that order: the SIMD kernel multiplies the nibbles (0..15) as they lie and
 * takes 8 * sum(x) of the lane off, the same exact integer as sum((nibble - 8) * x). */
void ms_prep_x_int4(const float *x, int64_t n, float *xp) {
    ms_int4x *b = (ms_int4x *)xp;
    for (int64_t i = 0; i < n / 32; i++) {
        int8_t q[32];
        quantize_run(x + 32 * i, 32, &b[i].d, q);
        for (int p = 0; p < 32; p++) b[i].q[p] = q[p < 16 ? 2 * p : 2 * (p - 16) + 1];
        for (int L = 0; L < 8; L++)
            b[i].s8[L] = 8 * (b[i].q[4 * L] + b[i].q[4 * L + 1] + b[i].q[4 * L + 2] + b[i].q[4 * L + 3]);
    }
}

void ms_dot4_int4_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const ms_int4x *x = (const ms_int4x *)xp;
    int64_t nb = m->cols / 32;
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        const float *s = ms_int4_scale_row(m, row0 + r);
        float f[8] = {0};
        for (int64_t b = 0; b < nb; b++, w += 16) {
            float dd = s[b] * x[b].d;
            for (int L = 0; L < 8; L++) {
                int32_t acc = 0;
                for (int p = 4 * L; p < 4 * L + 4; p++) /* position p: byte p % 16, low nibble if p < 16 */
                    acc += (((w[p % 16] >> (p < 16 ? 0 : 4)) & 0x0F) - 8) * x[b].q[p];
                f[L] = fmaf((float)acc, dd, f[L]);
            }
        }
        out[r] = ms_lanes8_reduce(f);
    }
}

/* ---- mxfp4 against two-term int16 activations -------------------------------------------------------
 * Each 32-block of activations becomes x ~ a * da + b * db with int16 a, b and power-of-two da, db = da/2^15
 * (b carries the rounding residue of a, so the representation is good to 2^-29 of the block's max: float
 * accuracy), stored in the nibble order of the weights (even columns, then odd). Doubled E2M1 values are
 * small integers, so each lane's integer sums are exact; lane L holds columns 4L..4L+3 of the block,
 * t = fma(sum_b, db, sum_a * da) and f[L] = fma(t, s, f[L]) with s = 2^(e-128), in block order. */

void ms_prep_x_mxfp4(const float *x, int64_t n, float *xp) {
    ms_mxfp4x *blk = (ms_mxfp4x *)xp;
    for (int64_t k = 0; k < n / 32; k++) {
        const float *v = x + 32 * k;
        ms_mxfp4x *o = &blk[k];
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
        memset(o->a, 0, sizeof o->a);
        memset(o->b, 0, sizeof o->b);
        if (!(amax > 0.0f) || !isfinite(amax)) { /* zeros: all zero; inf/nan: the sums become nan */
            o->da = o->db = amax == 0.0f ? 0.0f : NAN;
            continue;
        }
        int e;
        frexpf(amax, &e);           /* amax < 2^e */
        if (e < -96) e = -96;       /* keep db = 2^(e-29) a normal number */
        o->da = ldexpf(1.0f, e - 14); /* |a| <= 2^14 */
        o->db = ldexpf(1.0f, e - 29); /* |b| <= 2^14 */
        for (int i = 0; i < 32; i++) {
            int j = (i & 1) * 16 + i / 2;
            float qa = rintf(v[i] / o->da);
            float res = v[i] - qa * o->da; /* exact: both are multiples of ulp(v[i]) near it */
            o->a[j] = (int16_t)qa;
            o->b[j] = (int16_t)rintf(res / o->db);
        }
    }
}

void ms_dot4_mxfp4_int_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const ms_mxfp4x *x = (const ms_mxfp4x *)xp;
    int64_t nb = m->cols / 32;
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        const uint8_t *s8 = ms_mxfp4_scale_row(m, row0 + r);
        float f[8] = {0};
        for (int64_t b = 0; b < nb; b++, w += 16) {
            float s = ms_e8m0_half_lut[s8[b]];
            for (int L = 0; L < 8; L++) {
                int32_t ia = 0, ib = 0;
                for (int c = 4 * L; c < 4 * L + 4; c++) {
                    int k = ms_e2m1_x2_lut[(w[c / 2] >> ((c & 1) * 4)) & 0x0F], j = (c & 1) * 16 + c / 2;
                    ia += k * x[b].a[j];
                    ib += k * x[b].b[j];
                }
                float t = fmaf((float)ib, x[b].db, (float)ia * x[b].da); /* the block's dot with the activations */
                f[L] = fmaf(t, s, f[L]);
            }
        }
        out[r] = ms_lanes8_reduce(f);
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
