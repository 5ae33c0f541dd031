/* GGUF block formats (q8_0, q4_k, q6_k, q3_k, q2_k, tq2_0, tq1_0): one block of bytes to floats, in
 * exactly the float operations of the numpy reference (src/moestream/quant/blocks.py), the same on every
 * ISA. Their products are integer kernels against int8 activations (quant_int8*.c). */
#include <math.h>
#include <string.h>

#include "quant.h"

static inline float h2f(const uint8_t *p) { return ms_f16_to_f32((uint16_t)(p[0] | (p[1] << 8))); }

static void deq_q8_0(const uint8_t *b, float *y) {
    float d = h2f(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int i = 0; i < 32; i++) y[i] = (float)q[i] * d;
}

static void k4_scale_min(int j, const uint8_t *s, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

static void deq_q4_k(const uint8_t *b, float *y) {
    float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t *s = b + 4, *q = b + 16;
    for (int j = 0; j < 8; j++) { /* sub-block j: bytes q[32*(j/2) ..], low nibble for even j */
        uint8_t sc, m;
        k4_scale_min(j, s, &sc, &m);
        float dl = d * (float)sc, ml = dmin * (float)m;
        const uint8_t *qq = q + 32 * (j / 2);
        int shift = (j & 1) * 4;
        for (int l = 0; l < 32; l++) y[32 * j + l] = dl * (float)((qq[l] >> shift) & 0x0F) - ml;
    }
}

static void deq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = h2f(b + 208);
    for (int half = 0; half < 2; half++) {
        const uint8_t *L = ql + 64 * half, *Hh = qh + 32 * half;
        float *Y = y + 128 * half;
        for (int l = 0; l < 32; l++) {
            int q1 = ((L[l] & 0x0F) | (((Hh[l] >> 0) & 3) << 4)) - 32;
            int q2 = ((L[l + 32] & 0x0F) | (((Hh[l] >> 2) & 3) << 4)) - 32;
            int q3 = ((L[l] >> 4) | (((Hh[l] >> 4) & 3) << 4)) - 32;
            int q4 = ((L[l + 32] >> 4) | (((Hh[l] >> 6) & 3) << 4)) - 32;
            int g = 8 * half + l / 16; /* scale of element 16*g + (l % 16) */
            Y[l] = (d * (float)sc[g]) * (float)q1;
            Y[l + 32] = (d * (float)sc[g + 2]) * (float)q2;
            Y[l + 64] = (d * (float)sc[g + 4]) * (float)q3;
            Y[l + 96] = (d * (float)sc[g + 6]) * (float)q4;
        }
    }
}

static void deq_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
    float d = h2f(b + 108);
    for (int g = 0; g < 16; g++) { /* 16 sub-blocks of 16 */
        float dl = d * (float)ms_q3_k_scale(s, g);
        for (int l = 0; l < 16; l++) y[16 * g + l] = dl * (float)(ms_q3_k_u(hm, qs, 16 * g + l) - 4);
    }
}

static void deq_q2_k(const uint8_t *b, float *y) {
    const uint8_t *s = b, *qs = b + 16;
    float d = h2f(b + 80), dmin = h2f(b + 82);
    for (int g = 0; g < 16; g++) {
        float dl = d * (float)(s[g] & 0x0F), ml = dmin * (float)(s[g] >> 4);
        for (int l = 0; l < 16; l++) {
            int e = 16 * g + l;
            y[e] = dl * (float)ms_tq2_q(qs, e) - ml; /* the 2-bit values lie as tq2_0's */
        }
    }
}

static void deq_tq2_0(const uint8_t *b, float *y) {
    float d = h2f(b + 64);
    for (int e = 0; e < 256; e++) {
        y[e] = d * (float)(ms_tq2_q(b, e) - 1);
    }
}

static void deq_tq1_0(const uint8_t *b, float *y) {
    float d = h2f(b + 52);
    for (int j = 0; j < 5; j++)
        for (int i = 0; i < 32; i++) y[32 * j + i] = d * (float)(ms_tq1_trit(b[i], j) - 1);
    for (int j = 0; j < 5; j++)
        for (int i = 0; i < 16; i++) y[160 + 16 * j + i] = d * (float)(ms_tq1_trit(b[32 + i], j) - 1);
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) y[240 + 4 * j + i] = d * (float)(ms_tq1_trit(b[48 + i], j) - 1);
}

typedef void (*block_fn)(const uint8_t *b, float *y);

static block_fn block_dequant(ms_format f) {
    switch (f) {
        case MS_Q8_0: return deq_q8_0;
        case MS_Q4_K: return deq_q4_k;
        case MS_Q6_K: return deq_q6_k;
        case MS_Q3_K: return deq_q3_k;
        case MS_Q2_K: return deq_q2_k;
        case MS_TQ2_0: return deq_tq2_0;
        case MS_TQ1_0: return deq_tq1_0;
        default: return NULL;
    }
}

/* Row dequantization: the same on every ISA (the block functions are the definition). */
void ms_dequant_blocks(const ms_matrix *m, int64_t row, float *out) {
    const ms_format_traits *t = &ms_formats[m->fmt];
    block_fn f = block_dequant(m->fmt);
    const uint8_t *p = m->data + row * m->row_bytes;
    for (int64_t c = 0; c < m->cols; c += t->block, p += t->block_bytes) f(p, out + c);
}

/* ---- compressed-tensors int4 (pack-quantized, symmetric, group 32) ---------------------------------
 * weight_packed is int32 [rows, cols/8] holding 8 nibbles each, element j of a word in bits 4j..4j+3,
 * i.e. little-endian bytes with the even element in the low nibble; the value is nibble - 8; the scale
 * (stored bf16/f16, f32 here) is one per 32 elements. */

static void deq_int4_run(const uint8_t *p, const float *s, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = (float)(((p[i / 2] >> ((i & 1) * 4)) & 0x0F) - 8) * s[i / 32];
}

void ms_dequant_int4(const ms_matrix *m, int64_t row, float *out) {
    deq_int4_run(m->data + row * m->row_bytes, ms_int4_scale_row(m, row), m->cols, out);
}
