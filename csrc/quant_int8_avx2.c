/* AVX2 integer dot kernels for q8_0 and q4_k (see quant_int8.c): exact integer sums with
 * maddubs/madd, then the shared scalar epilogue per block. Also serves the AVX-512 slot for now. */
#pragma GCC target("avx2,fma,f16c,ssse3")
#include <immintrin.h>

#include "quant.h"
#include "quant_int8.h"

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* sum of signed a[i] * b[i] over 32 int8 (|a| <= 128, |b| <= 127: the int16 pair sums do not overflow) */
static inline __m256i dot_i8_32(__m256i a, __m256i b) {
    __m256i ua = _mm256_sign_epi8(a, a);
    __m256i sb = _mm256_sign_epi8(b, a);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ua, sb), _mm256_set1_epi16(1));
}

void ms_dot4_q8_0_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const ms_q8_0x *x = (const ms_q8_0x *)xp;
    int64_t nb = m->cols / 32;
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++, w += 34) {
            __m256i qw = _mm256_loadu_si256((const __m256i *)(w + 2));
            __m256i qx = _mm256_loadu_si256((const __m256i *)x[b].q);
            acc += ms_q8_0_block_value(w, &x[b], hsum_i32(dot_i8_32(qw, qx)));
        }
        out[r] = acc;
    }
}

void ms_dot4_q4_k_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const ms_q8_kx *x = (const ms_q8_kx *)xp;
    int64_t nb = m->cols / 256;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; b++, w += 144) {
            uint8_t sc[8], mn[8];
            ms_q4_k_scales(w + 4, sc, mn);
            const uint8_t *q = w + 16;
            const int8_t *qx = x[b].q;
            __m256i acc_s = _mm256_setzero_si256();
            for (int k = 0; k < 4; k++) { /* 32 bytes: sub-block 2k in the low nibbles, 2k+1 in the high */
                __m256i bytes = _mm256_loadu_si256((const __m256i *)(q + 32 * k));
                __m256i lo = _mm256_and_si256(bytes, low4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
                __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(qx + 64 * k)));
                __m256i p_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(qx + 64 * k + 32)));
                acc_s = _mm256_add_epi32(acc_s, _mm256_madd_epi16(p_lo, _mm256_set1_epi16(sc[2 * k])));
                acc_s = _mm256_add_epi32(acc_s, _mm256_madd_epi16(p_hi, _mm256_set1_epi16(sc[2 * k + 1])));
            }
            int32_t sm = 0;
            for (int j = 0; j < 8; j++) sm += mn[j] * x[b].bsums[j];
            acc += ms_q4_k_block_value(w, &x[b], hsum_i32(acc_s), sm);
        }
        out[r] = acc;
    }
}
