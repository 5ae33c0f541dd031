/* AVX-512 (F, BW, VL) kernels for the float formats; called only when the CPU has them. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c,ssse3")
#include <immintrin.h>
#include <math.h>

#include "quant.h"

#define VEC __m512
#define VW 16
#define NV 1
#define VZERO() _mm512_setzero_ps()
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VLOADX(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)

#include "quant_float_simd.h"

static inline void load_f32(rowctx c, int64_t i, __m512 w[1]) { w[0] = _mm512_loadu_ps((const float *)c.p + i); }

static inline void load_bf16(rowctx c, int64_t i, __m512 w[1]) {
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)c.p + i));
    w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void load_f16(rowctx c, int64_t i, __m512 w[1]) {
    w[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)c.p + i)));
}

/* Through f16 bits, the table for a run holding a NaN byte (quant_float_simd.h). */
static inline void load_fp8(rowctx c, int64_t i, __m512 w[1]) {
    const __m128i b = _mm_loadu_si128((const __m128i *)(c.p + i));
    const __m512 s = _mm512_set1_ps(c.s[i / 128]);
    if (fp8_has_nan(b)) {
        w[0] = _mm512_mul_ps(_mm512_i32gather_ps(_mm512_cvtepu8_epi32(b), ms_fp8_e4m3_lut, 4), s);
        return;
    }
    w[0] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtph_ps(fp8_f16_bits(b)), _mm512_set1_ps(256.0f)), s);
}

static inline void load_mxfp4(rowctx c, int64_t i, __m512 w[1]) {
    __m128i v = mxfp4_x2_int8(c, i);
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), _mm512_set1_ps(ms_e8m0_half_lut[c.s8[i / 32]]));
}

DEFINE_DOT(f32, avx512, load_f32, ELEM_F32)
DEFINE_DEQUANT(mxfp4, avx512, load_mxfp4, ELEM_MXFP4) /* products: quant_int8*.c */
DEFINE_DOT(bf16, avx512, load_bf16, ELEM_BF16)
DEFINE_DOT(f16, avx512, load_f16, ELEM_F16)
DEFINE_DOT(fp8, avx512, load_fp8, ELEM_FP8)
