/* Float formats (f32, bf16, f16, fp8 e4m3 with 128x128 block scales): the format table, the shared
 * helpers and the scalar reference path. The scalar path is the definition of the canonical order
 * described in quant.h; the SIMD files must reproduce it bit for bit. */
#include <math.h>
#include <string.h>

#include "quant.h"
#include "quant_int8.h"

float ms_fp8_e4m3_lut[256];
const float ms_e2m1_lut[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f}; /* -0 decodes as +0 */
const int8_t ms_e2m1_x2_lut[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
float ms_e8m0_lut[256];
float ms_e8m0_half_lut[256];

float ms_lanes_reduce(const float lanes[MS_LANES]) {
    float l[MS_LANES];
    memcpy(l, lanes, sizeof(l));
    for (int s = MS_LANES / 2; s >= 1; s /= 2)
        for (int j = 0; j < s; j++) l[j] += l[j + s];
    return l[0];
}

float ms_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24, exact in f32 */
        float f = (float)man * 5.9604644775390625e-08f;
        v.f = f;
        v.u |= sign;
        return v.f;
    }
    if (exp == 31) {
        v.u = sign | 0x7f800000u | (man << 13);
        return v.f;
    }
    v.u = sign | ((exp + 112) << 23) | (man << 13);
    return v.f;
}

static float fp8_e4m3_decode(uint8_t b) {
    int sign = b >> 7;
    int exp = (b >> 3) & 0xf;
    int man = b & 0x7;
    float v;
    if (exp == 15 && man == 7) {
        v = NAN; /* e4m3fn has no infinity; 0x7f / 0xff are NaN */
    } else if (exp == 0) {
        v = ldexpf((float)man, -9); /* subnormal: man/8 * 2^-6 */
    } else {
        v = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    }
    return sign ? -v : v;
}

void ms_quant_init(void) {
    for (int i = 0; i < 256; i++) {
        ms_fp8_e4m3_lut[i] = fp8_e4m3_decode((uint8_t)i);
        ms_e8m0_lut[i] = i == 255 ? NAN : ldexpf(1.0f, i - 127);
        ms_e8m0_half_lut[i] = i == 255 ? NAN : ldexpf(1.0f, i - 128);
    }
}

/* ---- scalar dequantization ---------------------------------------------------------------- */

void ms_dequant_f32_scalar(const ms_matrix *m, int64_t row, float *out) {
    memcpy(out, m->data + row * m->row_bytes, (size_t)m->cols * sizeof(float));
}

void ms_dequant_bf16_scalar(const ms_matrix *m, int64_t row, float *out) {
    const uint16_t *w = (const uint16_t *)(m->data + row * m->row_bytes);
    for (int64_t i = 0; i < m->cols; i++) out[i] = ms_bf16_to_f32(w[i]);
}

void ms_dequant_f16_scalar(const ms_matrix *m, int64_t row, float *out) {
    const uint16_t *w = (const uint16_t *)(m->data + row * m->row_bytes);
    for (int64_t i = 0; i < m->cols; i++) out[i] = ms_f16_to_f32(w[i]);
}

void ms_dequant_fp8_scalar(const ms_matrix *m, int64_t row, float *out) {
    const uint8_t *w = m->data + row * m->row_bytes;
    const float *s = ms_fp8_scale_row(m, row);
    for (int64_t i = 0; i < m->cols; i++) out[i] = ms_fp8_e4m3_lut[w[i]] * s[i / 128];
}

void ms_dequant_mxfp4_scalar(const ms_matrix *m, int64_t row, float *out) {
    const uint8_t *w = m->data + row * m->row_bytes;
    const uint8_t *s = ms_mxfp4_scale_row(m, row);
    for (int64_t i = 0; i < m->cols; i++) {
        uint8_t nib = (w[i / 2] >> ((i & 1) * 4)) & 0xf;
        out[i] = ms_e2m1_lut[nib] * ms_e8m0_lut[s[i / 32]];
    }
}

/* ---- scalar dot: dequantize a chunk, then the canonical lane FMA ---------------------------- */

#define CHUNK 512 /* a multiple of MS_LANES and of 128 */

static void dot4_scalar_generic(const ms_matrix *m, int64_t row0, int nrows, const float *x, float *out,
                                ms_dequant_fn deq) {
    float buf[CHUNK];
    for (int r = 0; r < nrows; r++) {
        float lanes[MS_LANES] = {0};
        /* Dequantize the row in chunks through a temporary single-row matrix view. */
        for (int64_t c0 = 0; c0 < m->cols; c0 += CHUNK) {
            int64_t n = m->cols - c0 < CHUNK ? m->cols - c0 : CHUNK;
            ms_matrix sub = *m;
            sub.cols = n;
            if (m->fmt == MS_FP8_E4M3_B128) {
                /* column offset c0 is a multiple of 128: shift data and scales together */
                sub.data = m->data + (row0 + r) * m->row_bytes + c0;
                sub.scales = ms_fp8_scale_row(m, row0 + r) + c0 / 128;
                sub.rows = 1;
            } else if (m->fmt == MS_MXFP4) {
                /* one row of n columns starting at c0 (a multiple of 32): its bytes and scales */
                sub.data = m->data + (row0 + r) * m->row_bytes + c0 / 2;
                sub.scales = ms_mxfp4_scale_row(m, row0 + r) + c0 / 32;
                sub.rows = 1;
            } else {
                int64_t esize = m->row_bytes / m->cols;
                sub.data = m->data + (row0 + r) * m->row_bytes + c0 * esize;
                sub.rows = 1;
            }
            deq(&sub, 0, buf);
            for (int64_t i = 0; i < n; i++) {
                int lane = (int)((c0 + i) & (MS_LANES - 1));
                lanes[lane] = fmaf(buf[i], x[c0 + i], lanes[lane]);
            }
        }
        out[r] = ms_lanes_reduce(lanes);
    }
}

void ms_dot4_f32_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *x, float *out) {
    dot4_scalar_generic(m, row0, nrows, x, out, ms_dequant_f32_scalar);
}
void ms_dot4_bf16_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *x, float *out) {
    dot4_scalar_generic(m, row0, nrows, x, out, ms_dequant_bf16_scalar);
}
void ms_dot4_f16_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *x, float *out) {
    dot4_scalar_generic(m, row0, nrows, x, out, ms_dequant_f16_scalar);
}
void ms_dot4_fp8_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *x, float *out) {
    dot4_scalar_generic(m, row0, nrows, x, out, ms_dequant_fp8_scalar);
}

/* ---- the table ---------------------------------------------------------------------------- */

#define ROW(NAME, BLOCK, BYTES, PREP_AVX2)                                           \
    {#NAME, BLOCK, BYTES,                                                           \
     {ms_dot4_##NAME##_scalar, ms_dot4_##NAME##_avx2, ms_dot4_##NAME##_avx512},     \
     {ms_dequant_##NAME##_scalar, ms_dequant_##NAME##_avx2, ms_dequant_##NAME##_avx512}, \
     {NULL, PREP_AVX2, NULL}}

/* The GGUF low-bit formats (blocks of 256 against q8_k activations, one dot per block, no gemm): their
 * scalar and AVX2 kernels, and the AVX-512 slot's kernel and activation preparation (the AVX2 ones until a
 * 512-bit one exists). */
#define Q8K_ROW(NAME, BYTES, DOT_AVX512, PREP_AVX512)                                                    \
    {#NAME, 256, BYTES, {ms_dot4_##NAME##_scalar, ms_dot4_##NAME##_avx2, DOT_AVX512},                  \
     {ms_dequant_blocks, ms_dequant_blocks, ms_dequant_blocks},                                         \
     {ms_prep_x_q8_k, ms_prep_x_q8_k_avx2, PREP_AVX512}, (int)sizeof(ms_q8_kx)}

/* Integer kernels; the AVX-512 slot uses the AVX2 kernel until a 512-bit one exists. */
const ms_format_traits ms_formats[MS_NUM_FORMATS] = {
    [MS_F32] = ROW(f32, 1, 4, NULL),
    [MS_BF16] = ROW(bf16, 1, 2, ms_prep_x_bf16_avx2),
    [MS_F16] = ROW(f16, 1, 2, NULL),
    [MS_FP8_E4M3_B128] = ROW(fp8, 1, 1, NULL),
    [MS_MXFP4] = {"mxfp4", 32, 16,
                  {ms_dot4_mxfp4_int_scalar, ms_dot4_mxfp4_int_avx2, ms_dot4_mxfp4_int_avx512},
                  {ms_dequant_mxfp4_scalar, ms_dequant_mxfp4_avx2, ms_dequant_mxfp4_avx512},
                  {ms_prep_x_mxfp4, ms_prep_x_mxfp4_avx2, ms_prep_x_mxfp4_avx2}, MS_MXFP4X_BYTES,
                  {NULL, NULL, ms_gemm_mxfp4_avx512},
                  {NULL, NULL, ms_rows_mxfp4_int_avx512}},
    [MS_Q8_0] = {"q8_0", 32, 34,
                 {ms_dot4_q8_0_scalar, ms_dot4_q8_0_avx2, ms_dot4_q8_0_avx512},
                 {ms_dequant_blocks, ms_dequant_blocks, ms_dequant_blocks},
                 {ms_prep_x_q8_0, ms_prep_x_q8_0_avx2, ms_prep_x_q8_0_avx2}, 0,
                 {NULL, NULL, NULL},
                 {NULL, NULL, ms_rows_q8_0_avx512}},
    [MS_Q4_K] = {"q4_k", 256, 144,
                 {ms_dot4_q4_k_scalar, ms_dot4_q4_k_avx2, ms_dot4_q4_k_avx512},
                 {ms_dequant_blocks, ms_dequant_blocks, ms_dequant_blocks},
                 {ms_prep_x_q8_k, ms_prep_x_q8_k_avx2, ms_prep_x_q8_k_avx2}, (int)sizeof(ms_q8_kx),
                 {NULL, ms_gemm_q4_k_avx2, ms_gemm_q4_k_avx512},
                 {NULL, ms_rows_q4_k_avx2, ms_rows_q4_k_avx512},
                 {NULL, ms_gemm_rows_q4_k_avx2, ms_gemm_rows_q4_k_avx512}},
    [MS_Q6_K] = {"q6_k", 256, 210,
                 {ms_dot4_q6_k_scalar, ms_dot4_q6_k_avx2, ms_dot4_q6_k_avx512},
                 {ms_dequant_blocks, ms_dequant_blocks, ms_dequant_blocks},
                 {ms_prep_x_q6_k, ms_prep_x_q6_k_avx2, ms_prep_x_q6_k_avx2}, (int)sizeof(ms_q6_kx),
                 {NULL, ms_gemm_q6_k_avx2, ms_gemm_q6_k_avx512},
                 {NULL, ms_rows_q6_k_avx2, ms_rows_q6_k_avx512},
                 {NULL, ms_gemm_rows_q6_k_avx2, ms_gemm_rows_q6_k_avx512}},
    [MS_Q3_K] = Q8K_ROW(q3_k, 110, ms_dot4_q3_k_avx512, ms_prep_x_q8_k_avx512),
    [MS_Q2_K] = Q8K_ROW(q2_k, 84, ms_dot4_q2_k_avx512, ms_prep_x_q8_k_avx512),
    [MS_TQ2_0] = Q8K_ROW(tq2_0, 66, ms_dot4_tq2_0_avx512, ms_prep_x_q8_k_avx512),
    [MS_TQ1_0] = Q8K_ROW(tq1_0, 54, ms_dot4_tq1_0_avx512, ms_prep_x_q8_k_avx2),
    [MS_INT4_G32] = {"int4", 32, 16,
                     {ms_dot4_int4_scalar, ms_dot4_int4_avx2, ms_dot4_int4_avx512},
                     {ms_dequant_int4, ms_dequant_int4, ms_dequant_int4},
                     {ms_prep_x_int4, ms_prep_x_int4_avx2, ms_prep_x_int4_avx512}, MS_INT4X_BYTES,
                     {NULL, NULL, ms_gemm_int4_avx512},
                     {NULL, NULL, ms_rows_int4_avx512}},
};
