/* AVX2 + FMA + F16C kernels for the float formats; compiled for that target, called only when the
 * CPU has it (see dispatch in matmul.c). */
#pragma GCC target("avx2,fma,f16c,ssse3")
#include <immintrin.h>
#include <math.h>

#include "quant.h"

#define VEC __m256
#define VW 8
#define NV 2
#define VZERO() _mm256_setzero_ps()
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VLOADX(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)

#include "quant_float_simd.h"

static inline void load_f32(rowctx c, int64_t i, __m256 w[2]) {
    const float *p = (const float *)c.p + i;
    w[0] = _mm256_loadu_ps(p);
    w[1] = _mm256_loadu_ps(p + 8);
}

static inline void load_bf16(rowctx c, int64_t i, __m256 w[2]) {
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)c.p + i));
    __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(h));
    __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1));
    w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
    w[1] = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
}

static inline void load_f16(rowctx c, int64_t i, __m256 w[2]) {
    const uint16_t *p = (const uint16_t *)c.p + i;
    w[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    w[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
}

/* Through f16 bits, the table for a run holding a NaN byte (quant_float_simd.h). */
static inline void load_fp8(rowctx c, int64_t i, __m256 w[2]) {
    __m128i b = _mm_loadu_si128((const __m128i *)(c.p + i));
    __m256 s = _mm256_set1_ps(c.s[i / 128]);
    if (fp8_has_nan(b)) {
        w[0] = _mm256_mul_ps(_mm256_i32gather_ps(ms_fp8_e4m3_lut, _mm256_cvtepu8_epi32(b), 4), s);
        w[1] = _mm256_mul_ps(_mm256_i32gather_ps(ms_fp8_e4m3_lut, _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)), 4), s);
        return;
    }
    const __m256i h = fp8_f16_bits(b);
    const __m256 k = _mm256_set1_ps(256.0f);
    w[0] = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k), s);
    w[1] = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k), s);
}

/* The doubled E2M1 value times half the E8M0 scale: both exact, so the product is the scalar path's
 * lut[nibble] * 2^(s-127) to the bit. */
static inline void load_mxfp4(rowctx c, int64_t i, __m256 w[2]) {
    __m128i v = mxfp4_x2_int8(c, i);
    __m256 s = _mm256_set1_ps(ms_e8m0_half_lut[c.s8[i / 32]]);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), s);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), s);
}

DEFINE_DOT(f32, avx2, load_f32, ELEM_F32)
DEFINE_DEQUANT(mxfp4, avx2, load_mxfp4, ELEM_MXFP4) /* products: quant_int8*.c */
DEFINE_DOT(f16, avx2, load_f16, ELEM_F16)
DEFINE_DOT(fp8, avx2, load_fp8, ELEM_FP8)

/* bf16 without cross-lane conversion: unpacking 16 bf16 against zero inside each 128-bit lane puts
 * elements {0-3, 8-11} in the low vector and {4-7, 12-15} in the high one. The activations are
 * permuted the same way once per token (prep_x), each vector lane still owns one residue class mod 16,
 * and the lanes are put back in canonical order before the reduction, so the result is bit-identical
 * to the scalar path. */
static const int perm16[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

void ms_prep_x_bf16_avx2(const float *x, int64_t n, float *xp) {
    int64_t n16 = n & ~(int64_t)15;
    for (int64_t i = 0; i < n16; i += 16)
        for (int j = 0; j < 16; j++) xp[i + j] = x[i + perm16[j]];
    for (int64_t i = n16; i < n; i++) xp[i] = x[i];
}

static inline void bf16_unpack(const uint16_t *p, __m256 *lo, __m256 *hi) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    __m256i z = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h));
}

static inline float bf16_finish(__m256 a, __m256 b, const uint16_t *w, const float *xp, int64_t n16, int64_t n) {
    if (n16 == n) {
        /* The canonical tree in registers: a holds lanes {0-3, 8-11}, b holds {4-7, 12-15}. */
        __m128 s8a = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* l[j] + l[j+8], j<4 */
        __m128 s8b = _mm_add_ps(_mm256_castps256_ps128(b), _mm256_extractf128_ps(b, 1)); /* j = 4..7 */
        __m128 s4 = _mm_add_ps(s8a, s8b);                                                   /* + l[j+4] */
        __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                  /* + l[j+2] */
        __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));                              /* + l[1] */
        return _mm_cvtss_f32(s1);
    }
    float v[16], lanes[MS_LANES];
    _mm256_storeu_ps(v, a);
    _mm256_storeu_ps(v + 8, b);
    for (int j = 0; j < 16; j++) lanes[perm16[j]] = v[j];
    for (int64_t i = n16; i < n; i++)
        lanes[i & (MS_LANES - 1)] = fmaf(ms_bf16_to_f32(w[i]), xp[i], lanes[i & (MS_LANES - 1)]);
    return ms_lanes_reduce(lanes);
}

void ms_dot4_bf16_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const int64_t n = m->cols;
    const int64_t n16 = n & ~(int64_t)15;
    const uint16_t *w[4];
    for (int r = 0; r < nrows; r++) w[r] = (const uint16_t *)(m->data + (row0 + r) * m->row_bytes);
    if (nrows == 4) {
        __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
        for (int64_t i = 0; i < n16; i += 16) {
            __m256 x0 = _mm256_loadu_ps(xp + i), x1 = _mm256_loadu_ps(xp + i + 8), lo, hi;
            bf16_unpack(w[0] + i, &lo, &hi);
            a0 = _mm256_fmadd_ps(lo, x0, a0);
            b0 = _mm256_fmadd_ps(hi, x1, b0);
            bf16_unpack(w[1] + i, &lo, &hi);
            a1 = _mm256_fmadd_ps(lo, x0, a1);
            b1 = _mm256_fmadd_ps(hi, x1, b1);
            bf16_unpack(w[2] + i, &lo, &hi);
            a2 = _mm256_fmadd_ps(lo, x0, a2);
            b2 = _mm256_fmadd_ps(hi, x1, b2);
            bf16_unpack(w[3] + i, &lo, &hi);
            a3 = _mm256_fmadd_ps(lo, x0, a3);
            b3 = _mm256_fmadd_ps(hi, x1, b3);
        }
        out[0] = bf16_finish(a0, b0, w[0], xp, n16, n);
        out[1] = bf16_finish(a1, b1, w[1], xp, n16, n);
        out[2] = bf16_finish(a2, b2, w[2], xp, n16, n);
        out[3] = bf16_finish(a3, b3, w[3], xp, n16, n);
        return;
    }
    for (int r = 0; r < nrows; r++) {
        __m256 a = _mm256_setzero_ps(), b = a, lo, hi;
        for (int64_t i = 0; i < n16; i += 16) {
            bf16_unpack(w[r] + i, &lo, &hi);
            a = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xp + i), a);
            b = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xp + i + 8), b);
        }
        out[r] = bf16_finish(a, b, w[r], xp, n16, n);
    }
}

void ms_dequant_bf16_avx2(const ms_matrix *m, int64_t row, float *out) {
    rowctx c = row_at(m, row);
    const int64_t n = m->cols;
    const int64_t n16 = n & ~(int64_t)15;
    for (int64_t i = 0; i < n16; i += 16) {
        __m256 w[2];
        load_bf16(c, i, w);
        _mm256_storeu_ps(out + i, w[0]);
        _mm256_storeu_ps(out + i + 8, w[1]);
    }
    for (int64_t i = n16; i < n; i++) out[i] = ELEM_BF16(c, i);
}
