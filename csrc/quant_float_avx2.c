/* AVX2 + FMA + F16C kernels for the float formats; compiled for that target, called only when the
 * CPU has it (see dispatch in matmul.c). */
#pragma GCC target("avx2,fma,f16c")
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

static inline void load_fp8(rowctx c, int64_t i, __m256 w[2]) {
    __m128i b = _mm_loadu_si128((const __m128i *)(c.p + i));
    __m256i i0 = _mm256_cvtepu8_epi32(b);
    __m256i i1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    __m256 s = _mm256_set1_ps(c.s[i / 128]);
    w[0] = _mm256_mul_ps(_mm256_i32gather_ps(ms_fp8_e4m3_lut, i0, 4), s);
    w[1] = _mm256_mul_ps(_mm256_i32gather_ps(ms_fp8_e4m3_lut, i1, 4), s);
}

DEFINE_DOT(f32, avx2, load_f32, ELEM_F32)
DEFINE_DOT(bf16, avx2, load_bf16, ELEM_BF16)
DEFINE_DOT(f16, avx2, load_f16, ELEM_F16)
DEFINE_DOT(fp8, avx2, load_fp8, ELEM_FP8)
