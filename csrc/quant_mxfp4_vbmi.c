/* mxfp4's AVX-512 kernels (quant_mxfp4_avx512.h) with VNNI and VBMI: the nibbles looked up by vpermb,
 * which reads only the low six bits of each index, against the 16 doubled E2M1 values + 12 repeated in
 * the four 128-bit lanes, so that neither nibble needs a mask (two instructions fewer per 64 weight bytes;
 * the same bytes as vpshufb's lookups). Its own file, so that VBMI instructions cannot reach the kernels a
 * CPU with VNNI but without VBMI (Cascade Lake) runs. */
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")
#include <immintrin.h>
#include <string.h>

#include "matmul.h"
#include "quant.h"
#include "quant_int8.h"

#define MX_TARGET
static inline void mx_nibbles(__m512i v, __m512i lut, __m512i *ul, __m512i *uh) {
    *ul = _mm512_permutexvar_epi8(v, lut);
    *uh = _mm512_permutexvar_epi8(_mm512_srli_epi16(v, 4), lut);
}
#include "quant_mxfp4_avx512.h"

void ms_rows_mxfp4_vbmi(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out) {
    mx_decode_rows(m, row0, nrows, xp, out);
}

void ms_dot4_mxfp4_vbmi_prefill(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    mx_prefill(m, row0, nrows, xp, out);
}
