/* exp(x) for float32 in one fixed sequence of float operations (no fused multiply-adds: the build has
 * -ffp-contract=off), so that the scalar, AVX2 and AVX-512 versions give the same bits: the softmaxes of
 * decode attention and of the router and SwiGLU's silu take it on every instruction set (csrc/activations.c;
 * libm's expf, one call an element, took about a third of the attention kernel's time).
 *
 * The method is the usual one: n = x log2(e) rounded to nearest (by adding and taking off 1.5 * 2^23), the
 * remainder r = x - n ln 2 in two steps (ln 2 as 0.693359375, exact in 9 bits, and a small correction), a
 * degree-5 polynomial for (exp(r) - 1 - r) / r^2 on |r| <= ln(2) / 2, and 2^n put into the exponent bits.
 * Within 1 ulp of the true value for x in [-87.3, 88.3] (0.98 at most over a sweep of 4 million points,
 * tests/test_attention.py; numpy's float32 exp there: 2.4); 0 below that range (where the result would be
 * near or under the smallest normal float), +inf above it (though exp is finite up to 88.72), NaN for NaN.
 * The softmaxes take x <= 0; silu takes exp(-g), whose overflow above 88.3 gives silu(g) = -0. */
#ifndef MOESTREAM_EXP_F32_H
#define MOESTREAM_EXP_F32_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MS_EXP_LO (-87.3f) /* below: 0 (exp(-87.3) is 1.3e-38, near the smallest normal float) */
#define MS_EXP_HI 88.3f    /* above: +inf (n would pass 127) */
#define MS_EXP_LOG2E 1.44269504088896341f
#define MS_EXP_ROUND 12582912.0f /* 1.5 * 2^23: v + it - it is v rounded to nearest, ties to even */
#define MS_EXP_LN2_HI 0.693359375f
#define MS_EXP_LN2_LO (-2.12194440e-4f)
#define MS_EXP_P0 1.9875691500e-4f
#define MS_EXP_P1 1.3981999507e-3f
#define MS_EXP_P2 8.3334519073e-3f
#define MS_EXP_P3 4.1665795894e-2f
#define MS_EXP_P4 1.6666665459e-1f
#define MS_EXP_P5 5.0000001201e-1f

static inline float ms_exp_f32(float x) {
    if (x != x) return x + x; /* NaN (a quiet one) */
    const float xc = x > MS_EXP_HI ? MS_EXP_HI : x;
    const float n = (xc * MS_EXP_LOG2E + MS_EXP_ROUND) - MS_EXP_ROUND;
    const float r = (xc - n * MS_EXP_LN2_HI) - n * MS_EXP_LN2_LO;
    float p = MS_EXP_P0 * r + MS_EXP_P1;
    p = p * r + MS_EXP_P2;
    p = p * r + MS_EXP_P3;
    p = p * r + MS_EXP_P4;
    p = p * r + MS_EXP_P5;
    const float y = (p * (r * r) + r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n; n in [-126, 127] for x in range */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    if (x > MS_EXP_HI) return (float)INFINITY;
    return x < MS_EXP_LO ? 0.0f : y * scale;
}

__attribute__((target("avx2"))) static inline __m256 ms_exp_f32_avx2(__m256 x) {
    const __m256 xn = _mm256_min_ps(_mm256_set1_ps(MS_EXP_HI), x); /* x NaN: min gives its second operand */
    const __m256 round = _mm256_set1_ps(MS_EXP_ROUND);
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xn, _mm256_set1_ps(MS_EXP_LOG2E)), round), round);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(xn, _mm256_mul_ps(n, _mm256_set1_ps(MS_EXP_LN2_HI))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(MS_EXP_LN2_LO)));
    __m256 p = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(MS_EXP_P0), r), _mm256_set1_ps(MS_EXP_P1));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(MS_EXP_P2));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(MS_EXP_P3));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(MS_EXP_P4));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(MS_EXP_P5));
    const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
    out = _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(MS_EXP_LO), _CMP_LT_OQ), out);
    const __m256 above = _mm256_cmp_ps(x, _mm256_set1_ps(MS_EXP_HI), _CMP_GT_OQ);
    return _mm256_blendv_ps(out, _mm256_set1_ps((float)INFINITY), above);
}

__attribute__((target("avx512f"))) static inline __m512 ms_exp_f32_avx512(__m512 x) {
    const __m512 xn = _mm512_min_ps(_mm512_set1_ps(MS_EXP_HI), x); /* x NaN: min gives its second operand */
    const __m512 round = _mm512_set1_ps(MS_EXP_ROUND);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(xn, _mm512_set1_ps(MS_EXP_LOG2E)), round), round);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(xn, _mm512_mul_ps(n, _mm512_set1_ps(MS_EXP_LN2_HI))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(MS_EXP_LN2_LO)));
    __m512 p = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(MS_EXP_P0), r), _mm512_set1_ps(MS_EXP_P1));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(MS_EXP_P2));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(MS_EXP_P3));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(MS_EXP_P4));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(MS_EXP_P5));
    const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 out = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
    out = _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, _mm512_set1_ps(MS_EXP_LO), _CMP_LT_OQ), out);
    return _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(x, _mm512_set1_ps(MS_EXP_HI), _CMP_GT_OQ),
                              _mm512_set1_ps((float)INFINITY));
}

#endif
