/* AVX2 integer dot kernels (see quant_int8.c): exact integer sums with maddubs/madd, then the shared
 * scalar epilogue per block. The AVX-512 slot uses these where quant_int8_avx512.c has no kernel. */
#pragma GCC target("avx2,fma,f16c,ssse3")
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"
#include "quant_int8.h"
#include "quant_int8_simd.h"

/* sum of signed a[i] * b[i] per 4 bytes into 8 int32 lanes (|a| <= 128, |b| <= 127: no int16 overflow) */
static inline __m256i dot_i8_32(__m256i a, __m256i b) {
    __m256i ua = _mm256_sign_epi8(a, a);
    __m256i sb = _mm256_sign_epi8(b, a);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ua, sb), _mm256_set1_epi16(1));
}

/* one q8_0 block's lane sums times its scale product, added to f */
static inline __m256 q8_0_block(const uint8_t *w, const ms_q8_0x *x, __m256 f) {
    __m256i qw = _mm256_loadu_si256((const __m256i *)(w + 2));
    __m256i qx = _mm256_loadu_si256((const __m256i *)x->q);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i8_32(qw, qx)), _mm256_set1_ps(h2f(w) * x->d), f);
}

void ms_dot4_q8_0_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const ms_q8_0x *x = (const ms_q8_0x *)xp;
    int64_t nb = m->cols / 32;
    const int l2 = ms_prefetch_into_l2(4 * m->row_bytes);
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2, w += 68) {
            prefetch_ahead(w, 4 * m->row_bytes, 68, l2);
            even = q8_0_block(w, &x[b], even);
            odd = q8_0_block(w + 34, &x[b + 1], odd);
        }
        if (b < nb) even = q8_0_block(w, &x[b], even);
        out[r] = reduce8(_mm256_add_ps(even, odd));
    }
}

/* int16 index m of each 128-bit lane in all eight of its int16 slots (pshufb masks, m = 0..7) */
static inline __m256i lane_word_mask(int m) { return _mm256_set1_epi16((short)((2 * m) | ((2 * m + 1) << 8))); }

/* int16 m of each 128-bit lane of v in all eight int16 slots of that lane (m a constant: the mask is a
 * memory operand, not a register) */
static inline __m256i pick_word(__m256i v, int m) { return _mm256_shuffle_epi8(v, lane_word_mask(m)); }

/* One q4_k block w against the token's block x, added to a row's lanes a->f and min lanes a->fmin. */
static inline void q4_k_block_avx2(const void *consts, const uint8_t *w, const char *xb, row_lanes *a) {
    (void)consts;
    const ms_q8_kx *x = (const ms_q8_kx *)xb;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m128i sc, mn;
    q4k_scales_mins(w + 4, &sc, &mn);
    /* the 8 scales as int16 in both lanes; sub-block j's scale in every slot by one byte shuffle */
    __m256i scales = _mm256_broadcastsi128_si256(sc);
    const uint8_t *q = w + 16;
    const int8_t *qx = x->q;
    __m256i acc = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) { /* 32 bytes: sub-block 2k in the low nibbles, 2k+1 in the high */
        __m256i bytes = _mm256_loadu_si256((const __m256i *)(q + 32 * k));
        __m256i lo = _mm256_and_si256(bytes, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(qx + 64 * k)));
        __m256i p_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(qx + 64 * k + 32)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p_lo, pick_word(scales, 2 * k)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p_hi, pick_word(scales, 2 * k + 1)));
    }
    a->f = q4k_epilogue(w, x, mn, acc, a->f, &a->fmin);
}

/* A format's one-token kernels from its block function: the tile kernel, its rows one after another with
 * the next tile prefetched (4 rows ahead), and the run-of-rows kernel in ms_weight_streams_for() streams
 * (rows_streams), each row's sum the tile kernel's. */
#define ONE_TOKEN_KERNELS(NAME, BYTES, XTYPE)                                                                 \
    void ms_dot4_##NAME##_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {    \
        rows_one_stream(m, row0, nrows, (const char *)xp, out, BYTES, sizeof(XTYPE), 4 * m->row_bytes,        \
                        NAME##_block_avx2, NAME##_finish, NULL);                                              \
    }                                                                                                        \
    void ms_rows_##NAME##_avx2(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out) { \
        rows_streams(m, row0, nrows, (const char *)xp, out, BYTES, sizeof(XTYPE), 4 * m->row_bytes,           \
                     NAME##_block_avx2, NAME##_finish, NULL);                                                 \
    }

ONE_TOKEN_KERNELS(q4_k, 144, ms_q8_kx)

/* int4 against the pair layout of the activations (quant_int8.h): two blocks' 32 weight bytes are one
 * load, their low nibbles (the even columns of both blocks) one register and their high nibbles another,
 * each against 32 contiguous activation bytes. So the lanes come permuted: the low-nibble register's
 * madd gives lanes 0..3 of both blocks, the high one's lanes 4..7. The row's accumulators keep that
 * permutation: a[0] holds lanes 0..3 of chains 0 and 1 (block b % 4) in its halves, a[1] their lanes
 * 4..7, a[2] and a[3] the same for chains 2 and 3. Every lane takes the fused multiply-adds of the
 * canonical order; the permutation is undone in the final sums. */
static inline __m256i int4_lanes(__m256i nib, const int8_t *q, const int32_t *s8) {
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(nib, _mm256_loadu_si256((const __m256i *)q)),
                                  _mm256_set1_epi16(1));
    return _mm256_sub_epi32(p, _mm256_loadu_si256((const __m256i *)s8)); /* 8 * sum(x) per lane comes off */
}

/* The pair g = blocks 2g, 2g + 1 of the row at w into a[0..1] (h = 0, chains 0 and 1) or a[2..3] (h = 1),
 * d: the pair's scale products, block 2g's in the low half and 2g + 1's in the high one. */
static inline void int4_pair_avx2(const uint8_t *w, const ms_int4x *x, int64_t g, __m256 d, __m256 a[2]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * g));
    const __m256i lo = int4_lanes(_mm256_and_si256(v, low4), x->q + 64 * g, x->s8 + 16 * g);
    const __m256i hi = int4_lanes(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), x->q + 64 * g + 32,
                                  x->s8 + 16 * g + 8);
    a[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), d, a[0]);
    a[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), d, a[1]);
}

/* The last block b of an odd count (b % 4 = 0 or 2: the low halves of a[0..1]), its activations in nibble
 * order: its 16 bytes in both lanes, the high lane shifted, are its nibbles in nibble order. */
static inline void int4_last_avx2(const uint8_t *w, const ms_int4x *x, int64_t b, float dd, __m256 a[2]) {
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(w + 16 * b)));
    const __m256i nib = _mm256_and_si256(_mm256_srlv_epi64(bytes, _mm256_setr_epi64x(0, 0, 4, 4)),
                                         _mm256_set1_epi8(0x0F));
    const __m256 t = _mm256_cvtepi32_ps(int4_lanes(nib, x->q + 32 * b, x->s8 + 8 * b)); /* lanes 0..7 */
    const __m256 sum = _mm256_fmadd_ps(t, _mm256_set1_ps(dd), _mm256_permute2f128_ps(a[0], a[1], 0x20));
    a[0] = _mm256_permute2f128_ps(sum, a[0], 0x30); /* lanes 0..3 into a[0]'s low half */
    a[1] = _mm256_permute2f128_ps(sum, a[1], 0x31); /* lanes 4..7 into a[1]'s */
}

void ms_dot4_int4_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const int64_t nb = m->cols / 32;
    const ms_int4x x = ms_int4x_at(xp, nb);
    const __m256i first = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), second = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    const int l2 = ms_prefetch_into_l2(4 * m->row_bytes);
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        const float *s = ms_int4_scale_row(m, row0 + r);
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        int64_t b = 0;
        for (; b + 4 <= nb; b += 4) { /* four blocks a step, two pairs */
            prefetch_ahead(w + 16 * b, 4 * m->row_bytes, 64, l2);
            if ((b & 15) == 0) prefetch_line(s + b + 4 * nb, l2); /* next tile's scales */
            const __m256 dd = _mm256_castps128_ps256(_mm_mul_ps(_mm_loadu_ps(s + b), _mm_loadu_ps(x.d + b)));
            int4_pair_avx2(w, &x, b / 2, _mm256_permutevar8x32_ps(dd, first), a);
            int4_pair_avx2(w, &x, b / 2 + 1, _mm256_permutevar8x32_ps(dd, second), a + 2);
        }
        if (b + 2 <= nb) { /* a last pair, chains 0 and 1 */
            const __m256 dd = _mm256_set_m128(_mm_set1_ps(s[b + 1] * x.d[b + 1]), _mm_set1_ps(s[b] * x.d[b]));
            int4_pair_avx2(w, &x, b / 2, dd, a);
            b += 2;
        }
        if (b < nb) int4_last_avx2(w, &x, b, s[b] * x.d[b], b % 4 == 0 ? a : a + 2);
        /* lane L: (chain 0 + chain 1) + (chain 2 + chain 3), lanes 0..3 from a[0], a[2], 4..7 from a[1], a[3] */
        const __m128 f03 = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(a[0]), _mm256_extractf128_ps(a[0], 1)),
                                      _mm_add_ps(_mm256_castps256_ps128(a[2]), _mm256_extractf128_ps(a[2], 1)));
        const __m128 f47 = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(a[1]), _mm256_extractf128_ps(a[1], 1)),
                                      _mm_add_ps(_mm256_castps256_ps128(a[3]), _mm256_extractf128_ps(a[3], 1)));
        out[r] = reduce8(_mm256_set_m128(f47, f03));
    }
}

/* One q6_k block w against the token's block x, added to a row's lanes a->f: the 16 int8 scales reordered
 * even ones first, so that after widening the low lane holds the even scales and the high lane the odd
 * ones (scale pair (g, g + 1) is int16 g / 2 of both lanes). */
static inline void q6_k_block_avx2(const void *consts, const uint8_t *w, const char *xb, row_lanes *a) {
    (void)consts;
    const ms_q6_kx *x = (const ms_q6_kx *)xb;
    const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m256i scales = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(w + 192)), even_odd));
    const int8_t *qx = x->k.q;
    const int16_t *x32 = x->x32;
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        __m256i q[4];
        q6k_values(w, h, q);
        for (int k = 0; k < 4; k++) { /* (q - 32) x = q x - 32 x, both exact int16 pair sums */
            int c = 4 * h + k;
            __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i *)(qx + 32 * c)));
            p = _mm256_sub_epi16(p, _mm256_loadu_si256((const __m256i *)(x32 + 16 * c)));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, pick_word(scales, c))); /* sc[2c], sc[2c + 1] */
            KEEP_IN_REGISTER(acc);
        }
    }
    a->f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(h2f(w + 208) * x->k.d), a->f);
}

ONE_TOKEN_KERNELS(q6_k, 210, ms_q6_kx)

/* mxfp4 x three-digit int8 activations (see quant_int8.c): a byte shuffle makes the nibbles the unsigned
 * doubled E2M1 values k + 12 (0..24), so maddubs against a digit (|p| <= 64) stays in int16 (a low-nibble
 * pair and its high-nibble twin added: |.| <= 6144), and madd by 2^14, 2^7 and 1 puts each digit's share
 * of lane L's sum in int32 lane L. */

/* The doubled E2M1 values plus 12, in both lanes (a byte shuffle table). */
static inline __m256i mx_unsigned_lut(void) {
    int8_t t[16];
    for (int i = 0; i < 16; i++) t[i] = (int8_t)(ms_e2m1_x2_lut[i] + 12);
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t));
}

/* One digit's share: its int16 pair sums of the low nibbles (ul) against lo and the high ones (uh) against
 * hi, added, then by madd times the digit's weight. */
static inline __m256i mx_digit(__m256i ul, __m256i uh, const int8_t *lo, const int8_t *hi, short weight) {
    __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(ul, _mm256_loadu_si256((const __m256i *)lo)),
                                 _mm256_maddubs_epi16(uh, _mm256_loadu_si256((const __m256i *)hi)));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(weight));
}

static inline __m128i mx_digit1(__m128i ul, __m128i uh, const int8_t *lo, const int8_t *hi, short weight) {
    __m128i s = _mm_add_epi16(_mm_maddubs_epi16(ul, _mm_loadu_si128((const __m128i *)lo)),
                              _mm_maddubs_epi16(uh, _mm_loadu_si128((const __m128i *)hi)));
    return _mm_madd_epi16(s, _mm_set1_epi16(weight));
}

/* R rows (1 or 2) at once. A row keeps the four chains of the canonical order (block b into chain b % 4)
 * in two registers: acc[h] holds chains 2h and 2h + 1, one per 128-bit lane. A full group's blocks 2h,
 * 2h + 1 are 32 contiguous weight bytes whose low and high nibbles meet 32 contiguous activation bytes
 * each (the grouped layout); a shorter last group goes block by block, in 128 bits, its sums blended into
 * its chain's lane. */
static inline __attribute__((always_inline)) void mx_rows_avx2(const ms_matrix *m, int64_t row0, const int R,
                                                               const ms_mxfp4x *x, int64_t nb, __m256i ulut,
                                                               float *out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const uint8_t *w[2], *s[2];
    __m256 acc[2][2];
    for (int r = 0; r < R; r++) {
        w[r] = m->data + (row0 + r) * m->row_bytes;
        s[r] = ms_mxfp4_scale_row(m, row0 + r);
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    }
    const int64_t ahead = 4 * m->row_bytes;
    const int l2 = ms_prefetch_into_l2(ahead);
    int64_t b0 = 0;
    for (; b0 + 4 <= nb; b0 += 4) {
        for (int r = 0; r < R; r++) {
            prefetch_ahead(w[r] + 16 * b0, ahead, 64, l2);
            if ((b0 & 63) == 0) prefetch_line(s[r] + b0 + 4 * nb, l2); /* next tile's */
        }
        for (int h = 0; h < 2; h++) {
            const int64_t b = b0 + 2 * h, lo = 32 * b0 + 32 * h, hi = lo + 64;
            const __m256i noff = _mm256_loadu_si256((const __m256i *)(x->noff + 4 * b));
            for (int r = 0; r < R; r++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(w[r] + 16 * b));
                __m256i ul = _mm256_shuffle_epi8(ulut, _mm256_and_si256(v, m4));
                __m256i uh = _mm256_shuffle_epi8(ulut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
                __m256 d = _mm256_set_m128(_mm_set1_ps(ms_e8m0_half_lut[s[r][b + 1]] * x->d[b + 1]),
                                           _mm_set1_ps(ms_e8m0_half_lut[s[r][b]] * x->d[b]));
                __m256i t = mx_digit(ul, uh, x->p0 + lo, x->p0 + hi, 16384);
                t = _mm256_add_epi32(t, mx_digit(ul, uh, x->p1 + lo, x->p1 + hi, 128));
                t = _mm256_add_epi32(t, mx_digit(ul, uh, x->p2 + lo, x->p2 + hi, 1));
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(t, noff)), d, acc[r][h]);
            }
        }
    }
    const int n = (int)(nb - b0);
    for (int c = 0; c < n; c++) { /* the shorter last group */
        const int64_t b = b0 + c, lo = 32 * b0 + 16 * c, hi = 32 * b0 + 16 * n + 16 * c;
        const __m128i noff = _mm_loadu_si128((const __m128i *)(x->noff + 4 * b));
        for (int r = 0; r < R; r++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(w[r] + 16 * b));
            __m128i ul = _mm_shuffle_epi8(_mm256_castsi256_si128(ulut), _mm_and_si128(v, _mm256_castsi256_si128(m4)));
            __m128i uh = _mm_shuffle_epi8(_mm256_castsi256_si128(ulut),
                                          _mm_and_si128(_mm_srli_epi16(v, 4), _mm256_castsi256_si128(m4)));
            __m128i t = mx_digit1(ul, uh, x->p0 + lo, x->p0 + hi, 16384);
            t = _mm_add_epi32(t, mx_digit1(ul, uh, x->p1 + lo, x->p1 + hi, 128));
            t = _mm_add_epi32(t, mx_digit1(ul, uh, x->p2 + lo, x->p2 + hi, 1));
            __m128 tf = _mm_cvtepi32_ps(_mm_add_epi32(t, noff));
            __m256 d = _mm256_set1_ps(ms_e8m0_half_lut[s[r][b]] * x->d[b]);
            __m256 sum = _mm256_fmadd_ps(_mm256_set_m128(tf, tf), d, acc[r][c / 2]);
            acc[r][c / 2] = c % 2 == 0 ? _mm256_blend_ps(acc[r][c / 2], sum, 0x0F)
                                       : _mm256_blend_ps(acc[r][c / 2], sum, 0xF0);
        }
    }
    for (int r = 0; r < R; r++) { /* lane L: (chain 0 + chain 1) + (chain 2 + chain 3), then (0 + 2) + (1 + 3) */
        __m128 c01 = _mm_add_ps(_mm256_castps256_ps128(acc[r][0]), _mm256_extractf128_ps(acc[r][0], 1));
        __m128 c23 = _mm_add_ps(_mm256_castps256_ps128(acc[r][1]), _mm256_extractf128_ps(acc[r][1], 1));
        __m128 f = _mm_add_ps(c01, c23);
        f = _mm_add_ps(f, _mm_movehl_ps(f, f));
        out[r] = _mm_cvtss_f32(_mm_add_ss(f, _mm_movehdup_ps(f)));
    }
}

void ms_dot4_mxfp4_int_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    int64_t nb = m->cols / 32;
    ms_mxfp4x x = ms_mxfp4x_at(xp, nb);
    const __m256i ulut = mx_unsigned_lut();
    int r = 0;
    for (; r + 2 <= nrows; r += 2) mx_rows_avx2(m, row0 + r, 2, &x, nb, ulut, out + r); /* two share the loads */
    if (r < nrows) mx_rows_avx2(m, row0 + r, 1, &x, nb, ulut, out + r);
}

/* q4_k against several tokens (the tile unpacked once, quant_int8_simd.h): each unpacked vector is loaded
 * once for the group's nt (1..4) tokens; the block epilogue runs for two tokens per register, one 128-bit
 * lane each (mins times bsums, dmin * d(x) and d * d(x), the running min lanes), from token vectors made
 * once per group for all the rows. Every token's float operations are ms_dot4_q4_k_avx2's. */
/* reduce8 of two tokens' 8 lanes at once, a's sum in float 0 and b's in float 4: the same additions in the
 * same order (one at a time, the tail of a row cost a quarter of a 768-column gemm). */
static inline __m256 reduce8_x2(__m256 a, __m256 b) {
    __m256 s = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)); /* f_j + f_j+4 */
    __m256 c = _mm256_add_ps(s, _mm256_shuffle_ps(s, s, 0xEE));                                          /* s0 + s2, s1 + s3 */
    return _mm256_add_ps(c, _mm256_shuffle_ps(c, c, 0x55));                                              /* c0 + c1 */
}

/* q4k_min_reduce of each 128-bit lane, in floats 0 and 4: (l0 + l1) + (l2 + l3). */
static inline __m256 min_reduce_x2(__m256 m) {
    __m256 t = _mm256_add_ps(m, _mm256_shuffle_ps(m, m, 0xB1)); /* l0 + l1, -, l2 + l3, - */
    return _mm256_add_ps(t, _mm256_shuffle_ps(t, t, 0xEE));
}

typedef struct {
    __m256i bsums[2]; /* tokens 2g and 2g + 1: their 8 bsums in the low and high lane (zero beyond nt) */
    __m256 d[2];      /* their d, likewise */
} q4k_group;

static _Thread_local q4k_group *q4k_grp;
static _Thread_local int64_t q4k_grp_cap;

static inline __attribute__((always_inline)) void q4k_tokens(const q4k_unpacked *buf, int64_t nb, int nrows,
                                                             const char *xp, int64_t stride, int nt, float *out,
                                                             int64_t out_stride) {
    const int ng = (nt + 1) / 2;
    q4k_group *g = q4k_grp;
    for (int64_t b = 0; b < nb; b++) {
        for (int h = 0; h < 2; h++) {
            __m128i bs[2] = {_mm_setzero_si128(), _mm_setzero_si128()};
            __m128 d[2] = {_mm_setzero_ps(), _mm_setzero_ps()};
            for (int l = 0; l < 2; l++) {
                if (2 * h + l >= nt) break;
                const ms_q8_kx *x = (const ms_q8_kx *)(xp + (2 * h + l) * stride) + b;
                bs[l] = _mm_loadu_si128((const __m128i *)x->bsums);
                d[l] = _mm_set1_ps(x->d);
            }
            g[b].bsums[h] = _mm256_setr_m128i(bs[0], bs[1]);
            g[b].d[h] = _mm256_setr_m128(d[0], d[1]);
        }
    }
    for (int r = 0; r < nrows; r++) {
        const q4k_unpacked *u = &buf[r * nb];
        __m256 f[4], fmin[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int i = 0; i < 4; i++) f[i] = _mm256_setzero_ps(); /* all four: the tail reads them in pairs */
        for (int64_t b = 0; b < nb; b++, u++) {
            __m256i acc[4];
            for (int i = 0; i < nt; i++) acc[i] = _mm256_setzero_si256();
            const __m256i scales = _mm256_broadcastsi128_si256(u->sc);
            for (int k = 0; k < 8; k++) {
                const __m256i q = u->q[k], sc = pick_word(scales, k);
                for (int i = 0; i < nt; i++) {
                    const ms_q8_kx *x = (const ms_q8_kx *)(xp + i * stride) + b;
                    __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(x->q + 32 * k)));
                    acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p, sc));
                    KEEP_IN_REGISTER(acc[i]);
                }
            }
            const __m256i mins = _mm256_broadcastsi128_si256(u->mn);
            const __m256 vd = _mm256_set1_ps(u->d), vdmin = _mm256_set1_ps(u->dmin);
            for (int h = 0; h < ng; h++) {
                __m256i ms = _mm256_madd_epi16(mins, g[b].bsums[h]); /* the 4 sums of mins * bsums per lane */
                __m256 dm = _mm256_mul_ps(vdmin, g[b].d[h]);
                fmin[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), dm, fmin[h]);
                __m256 dd = _mm256_mul_ps(vd, g[b].d[h]);
                for (int l = 0; l < 2 && 2 * h + l < nt; l++) {
                    __m256 di = _mm256_permutevar8x32_ps(dd, _mm256_set1_epi32(4 * l));
                    f[2 * h + l] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[2 * h + l]), di, f[2 * h + l]);
                }
            }
        }
        for (int h = 0; h < ng; h++) {
            float res[8]; /* tokens 2h and 2h + 1 in floats 0 and 4 */
            _mm256_storeu_ps(res, _mm256_sub_ps(reduce8_x2(f[2 * h], f[2 * h + 1]), min_reduce_x2(fmin[h])));
            for (int l = 0; l < 2 && 2 * h + l < nt; l++) out[(2 * h + l) * out_stride + r] = res[4 * l];
        }
    }
}

void ms_gemm_q4_k_avx2(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride, int64_t T,
                       float *out, int64_t out_stride) {
    GEMM_OVER_TILE(q4k_buf, q4k_cap, q4k_unpack_tile, q4k_tokens, ms_dot4_q4_k_avx2,
                   grow((void **)&q4k_grp, &q4k_grp_cap, nb, sizeof(q4k_group)));
}

void ms_gemm_rows_q4_k_avx2(const ms_matrix *m, int64_t row0, int64_t nrows, const char *xp, int64_t stride,
                            int64_t T, float *out, int64_t out_stride) {
    ms_gemm_by_tiles(ms_gemm_q4_k_avx2, m, row0, nrows, xp, stride, T, out, out_stride);
}

/* ---- activation quantization (the same bytes as quantize_run in quant_int8.c) ------------------ */

/* x[0:block] (block a multiple of 32) -> d and int8 q: amax ignores NaN like fmaxf (max_ps returns its
 * second operand when either is NaN), rounding is to nearest even like lrintf, and the clamp to +-127
 * also catches the "integer indefinite" that NaN converts to. */
static inline void quantize_run_avx2(const float *x, int block, float *d, int8_t *q) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 vmax = _mm256_setzero_ps();
    for (int i = 0; i < block; i += 8) vmax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), vmax);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    float amax = _mm_cvtss_f32(m4);
    if (amax == 0.0f) {
        *d = 0.0f;
        memset(q, 0, (size_t)block);
        return;
    }
    float iscale = 127.0f / amax;
    *d = amax / 127.0f;
    const __m256 vs = _mm256_set1_ps(iscale);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < block; i += 32) {
        __m256i v[4];
        for (int k = 0; k < 4; k++) {
            __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * k), vs));
            v[k] = _mm256_min_epi32(_mm256_max_epi32(r, lo), hi);
        }
        __m256i a = _mm256_packs_epi32(v[0], v[1]); /* per 128-bit lane: v0[0..3] v1[0..3] | v0[4..7] v1[4..7] */
        __m256i b = _mm256_packs_epi32(v[2], v[3]);
        __m256i c = _mm256_packs_epi16(a, b); /* lane 0: v0 0-3, v1 0-3, v2 0-3, v3 0-3; lane 1: the 4-7s */
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(c, perm));
    }
}

void ms_prep_x_q8_0_avx2(const float *x, int64_t n, float *xp) {
    ms_q8_0x *b = (ms_q8_0x *)xp;
    for (int64_t i = 0; i < n / 32; i++) quantize_run_avx2(x + 32 * i, 32, &b[i].d, b[i].q);
}

void ms_prep_x_q8_k_avx2(const float *x, int64_t n, float *xp) {
    ms_q8_kx *b = (ms_q8_kx *)xp;
    const __m256i ones = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < n / 256; i++) {
        quantize_run_avx2(x + 256 * i, 256, &b[i].d, b[i].q);
        b[i].sum = 0;
        for (int j = 0; j < 8; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(b[i].q + 32 * j));
            __m256i w = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, v), ones16); /* 8 sums of 4: 16 per half */
            __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
            lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0x4e));
            hi = _mm_add_epi32(hi, _mm_shuffle_epi32(hi, 0x4e));
            const int s0 = _mm_cvtsi128_si32(_mm_add_epi32(lo, _mm_shuffle_epi32(lo, 0xb1)));
            const int s1 = _mm_cvtsi128_si32(_mm_add_epi32(hi, _mm_shuffle_epi32(hi, 0xb1)));
            b[i].bsums16[2 * j] = (int16_t)s0;
            b[i].bsums16[2 * j + 1] = (int16_t)s1;
            b[i].bsums[j] = (int16_t)(s0 + s1);
            b[i].sum += s0 + s1;
        }
    }
}

/* nt (1..4) tokens against the unpacked rows of a tile, each unpacked vector loaded once for all of them. */
static inline __attribute__((always_inline)) void q6k_tokens(const q6k_unpacked *buf, int64_t nb, int nrows,
                                                             const char *xp, int64_t stride, int nt, float *out,
                                                             int64_t out_stride) {
    for (int r = 0; r < nrows; r++) {
        const q6k_unpacked *u = &buf[r * nb];
        __m256 f[4];
        for (int i = 0; i < 4; i++) f[i] = _mm256_setzero_ps(); /* all four: the tail reads them in pairs */
        for (int64_t b = 0; b < nb; b++, u++) {
            __m256i acc[4];
            for (int i = 0; i < nt; i++) acc[i] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i q = u->q[c], sc = pick_word(u->sc, c);
                for (int i = 0; i < nt; i++) {
                    const ms_q6_kx *x = (const ms_q6_kx *)(xp + i * stride) + b;
                    __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(x->k.q + 32 * c)));
                    p = _mm256_sub_epi16(p, _mm256_loadu_si256((const __m256i *)(x->x32 + 16 * c)));
                    acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p, sc));
                    KEEP_IN_REGISTER(acc[i]);
                }
            }
            for (int i = 0; i < nt; i++) {
                const ms_q6_kx *x = (const ms_q6_kx *)(xp + i * stride) + b;
                f[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), _mm256_set1_ps(u->d * x->k.d), f[i]);
            }
        }
        for (int h = 0; 2 * h < nt; h++) {
            float res[8]; /* tokens 2h and 2h + 1 in floats 0 and 4 */
            _mm256_storeu_ps(res, reduce8_x2(f[2 * h], f[2 * h + 1]));
            for (int l = 0; l < 2 && 2 * h + l < nt; l++) out[(2 * h + l) * out_stride + r] = res[4 * l];
        }
    }
}

void ms_gemm_q6_k_avx2(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride, int64_t T,
                       float *out, int64_t out_stride) {
    GEMM_OVER_TILE(q6k_buf, q6k_cap, q6k_unpack_tile, q6k_tokens, ms_dot4_q6_k_avx2, 1);
}

void ms_gemm_rows_q6_k_avx2(const ms_matrix *m, int64_t row0, int64_t nrows, const char *xp, int64_t stride,
                            int64_t T, float *out, int64_t out_stride) {
    ms_gemm_by_tiles(ms_gemm_q6_k_avx2, m, row0, nrows, xp, stride, T, out, out_stride);
}

/* int4's activations in nibble order (quant_int8.h): per block, its 32 int8 values and 8 lane offsets. */
static inline void int4_block_x(const float *x, float *d, __m256i *q, __m256i *s8) {
    /* per 128-bit lane: its even bytes, then its odd ones; then the lanes' evens together, odds together */
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10,
                                           12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    int8_t v[32];
    quantize_run_avx2(x, 32, d, v);
    *q = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)v), split), 0xD8);
    *s8 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), *q), _mm256_set1_epi16(8));
}

void ms_prep_x_int4_nibbles_avx2(const float *x, int64_t n, float *xp) {
    ms_int4x o = ms_int4x_at(xp, n / 32);
    for (int64_t i = 0; i < n / 32; i++) {
        __m256i q, s8;
        int4_block_x(x + 32 * i, &o.d[i], &q, &s8);
        _mm256_storeu_si256((__m256i *)(o.q + 32 * i), q);
        _mm256_storeu_si256((__m256i *)(o.s8 + 8 * i), s8);
    }
}

void ms_prep_x_int4_avx2(const float *x, int64_t n, float *xp) {
    const int64_t nb = n / 32;
    ms_int4x o = ms_int4x_at(xp, nb);
    for (int64_t i = 0; i < nb; i++) {
        __m256i q, s8;
        int4_block_x(x + 32 * i, &o.d[i], &q, &s8);
        if (i / 2 < nb / 2) { /* in a pair: its halves beside the other block's */
            const int64_t g = i / 2, k = i % 2;
            _mm_storeu_si128((__m128i *)(o.q + 64 * g + 16 * k), _mm256_castsi256_si128(q));
            _mm_storeu_si128((__m128i *)(o.q + 64 * g + 32 + 16 * k), _mm256_extracti128_si256(q, 1));
            _mm_storeu_si128((__m128i *)(o.s8 + 16 * g + 4 * k), _mm256_castsi256_si128(s8));
            _mm_storeu_si128((__m128i *)(o.s8 + 16 * g + 8 + 4 * k), _mm256_extracti128_si256(s8, 1));
        } else {
            _mm256_storeu_si256((__m256i *)(o.q + 32 * i), q);
            _mm256_storeu_si256((__m256i *)(o.s8 + 8 * i), s8);
        }
    }
}

/* The same bytes as ms_prep_x_mxfp4: per block, the exponent of the max |x| read off its bits (frexpf's
 * e for a normal number; a subnormal max gets the floor of -100 either way), q = x * 2^(20-e) rounded to
 * nearest even by cvtps, the digits by arithmetic shifts, packed to bytes and put in nibble order. */
static inline __m256i mx_pack_nibble_order(const __m256i v[4]) {
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10,
                                           12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m256i c = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    c = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(c, perm), split); /* element order, then per lane */
    return _mm256_permute4x64_epi64(c, 0xD8);                             /* evens of both lanes, then odds */
}

/* v's low and high 128 bits to elements lo and hi (of size bytes) of a grouped array (quant_int8.h) */
static inline void mx_store_halves(void *arr, int size, int64_t lo, int64_t hi, __m256i v) {
    _mm_storeu_si128((__m128i *)((char *)arr + size * lo), _mm256_castsi256_si128(v));
    _mm_storeu_si128((__m128i *)((char *)arr + size * hi), _mm256_extracti128_si256(v, 1));
}

void ms_prep_x_mxfp4_avx2(const float *x, int64_t n, float *xp) {
    int64_t nb = n / 32;
    ms_mxfp4x o = ms_mxfp4x_at(xp, nb);
    const __m256 sign = _mm256_set1_ps(-0.0f), fmax = _mm256_set1_ps(FLT_MAX);
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < nb; b++) {
        const float *v = x + 32 * b;
        __m256 a[4], vmax = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        for (int k = 0; k < 4; k++) {
            a[k] = _mm256_loadu_ps(v + 8 * k);
            __m256 m = _mm256_andnot_ps(sign, a[k]);
            vmax = _mm256_max_ps(m, vmax);
            ok = _mm256_and_ps(ok, _mm256_cmp_ps(m, fmax, _CMP_LE_OQ)); /* false for inf and nan */
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        float amax = _mm_cvtss_f32(m4);
        int finite = _mm256_movemask_ps(ok) == 0xFF;
        if (!finite || amax == 0.0f) {
            const __m256i z = _mm256_setzero_si256();
            mx_store_halves(o.p0, 1, ms_mxfp4x_pos(nb, b, 0), ms_mxfp4x_pos(nb, b, 16), z);
            mx_store_halves(o.p1, 1, ms_mxfp4x_pos(nb, b, 0), ms_mxfp4x_pos(nb, b, 16), z);
            mx_store_halves(o.p2, 1, ms_mxfp4x_pos(nb, b, 0), ms_mxfp4x_pos(nb, b, 16), z);
            _mm_storeu_si128((__m128i *)(o.noff + 4 * b), _mm256_castsi256_si128(z));
            o.d[b] = finite ? 0.0f : NAN;
            continue;
        }
        uint32_t bits;
        memcpy(&bits, &amax, 4);
        int e = (int)((bits >> 23) & 0xFF) - 126;
        if (e < -100) e = -100;
        uint32_t dbits = (uint32_t)(e - 20 + 127) << 23, sbits = (uint32_t)(20 - e + 127) << 23;
        float scale;
        memcpy(&o.d[b], &dbits, 4);
        memcpy(&scale, &sbits, 4);
        __m256i d0[4], d1[4], d2[4];
        for (int k = 0; k < 4; k++) {
            __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(a[k], _mm256_set1_ps(scale)));
            d0[k] = _mm256_srai_epi32(_mm256_add_epi32(q, _mm256_set1_epi32(8192)), 14);
            __m256i r = _mm256_sub_epi32(q, _mm256_slli_epi32(d0[k], 14));
            d1[k] = _mm256_srai_epi32(_mm256_add_epi32(r, _mm256_set1_epi32(64)), 7);
            d2[k] = _mm256_sub_epi32(r, _mm256_slli_epi32(d1[k], 7));
        }
        __m256i p0 = mx_pack_nibble_order(d0), p1 = mx_pack_nibble_order(d1), p2 = mx_pack_nibble_order(d2);
        const int64_t lo = ms_mxfp4x_pos(nb, b, 0), hi = ms_mxfp4x_pos(nb, b, 16);
        mx_store_halves(o.p0, 1, lo, hi, p0);
        mx_store_halves(o.p1, 1, lo, hi, p1);
        mx_store_halves(o.p2, 1, lo, hi, p2);
        /* lane sums of q from its digits, negated: -12 * (2^14 sum p0 + 2^7 sum p1 + sum p2), exact in int32 */
        __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, p0), _mm256_set1_epi16(-16384 * 12 / 16));
        s = _mm256_slli_epi32(s, 4);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(ones, p1), _mm256_set1_epi16(-128 * 12)));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(ones, p2), _mm256_set1_epi16(-12)));
        _mm_storeu_si128((__m128i *)(o.noff + 4 * b), /* lane L and its high-nibble twin */
                         _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
    }
}

void ms_prep_x_q6_k_avx2(const float *x, int64_t n, float *xp) {
    ms_q6_kx *b = (ms_q6_kx *)xp;
    const __m256i k32 = _mm256_set1_epi8(32);
    for (int64_t i = 0; i < n / 256; i++) {
        ms_prep_x_q8_k_avx2(x + 256 * i, 256, (float *)&b[i].k);
        for (int c = 0; c < 8; c++)
            _mm256_storeu_si256((__m256i *)(b[i].x32 + 16 * c),
                                _mm256_maddubs_epi16(k32, _mm256_loadu_si256((const __m256i *)(b[i].k.q + 32 * c))));
    }
}

/* ---- tq2_0 and tq1_0 against q8_k activations: ms_dot4_tq2_0_scalar's exact block sums and chain ---- */

/* tq2_0: each 32 bytes of 2-bit values shifted by 0, 2, 4, 6 give four runs of 32 values (0..2), each
 * multiplied by maddubs against its 32 activations (int16 pair sums, |.| <= 508; eight of them added in
 * int16, |.| <= 4064), then widened by madd. */
static inline __m256i tq2_0_block(const uint8_t *w, const ms_q8_kx *x, __m256i *mins) { /* lanes, less sum(a) */
    *mins = _mm256_setzero_si256(); /* none */
    const __m256i m3 = _mm256_set1_epi8(3);
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < 2; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 * j));
        for (int l = 0; l < 4; l++) {
            const __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 2 * l), m3);
            const __m256i a = _mm256_loadu_si256((const __m256i *)(x->q + 128 * j + 32 * l));
            acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(q, a));
        }
    }
    return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
}

void ms_dot4_tq2_0_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    Q8K_ROWS4(66, 64, 0, __m256i, sums4_256, sum_epi32, tq2_0_block, -q8k_sum(xb));
}

/* tq1_0's trits: byte v's trit j is floor(3 t / 256) for t the low byte of v * 3^j, that is [t > 85] +
 * [t > 170]; t for j + 1 is 3 t (two byte adds), so no multiplies. */
static inline __m256i trit256(__m256i t) {
    const __m256i one = _mm256_set1_epi8(1);
    return _mm256_add_epi8(_mm256_min_epu8(_mm256_subs_epu8(t, _mm256_set1_epi8(85)), one),
                           _mm256_min_epu8(_mm256_subs_epu8(t, _mm256_set1_epi8((char)170)), one));
}

static inline __m256i times3(__m256i t) { return _mm256_add_epi8(t, _mm256_add_epi8(t, t)); }

/* tq1_0: the first 32 bytes give five runs of 32 values (trits 0..4 of each byte); the next 16, five runs of
 * 16, two at a time (the high half one trit ahead); the last 4 (qh), four runs of 4 together (byte k of
 * run j at 4j + k); maddubs against the activations as for tq2_0 (|.| <= 5588 in int16). In cache, one
 * thread: 4.3 GB/s with the trits made by 16-bit multiplies, 5.7 with byte adds and compares. */
static inline __m256i tq1_0_block(const uint8_t *w, const ms_q8_kx *x, __m256i *mins) { /* lanes, less sum(a) */
    *mins = _mm256_setzero_si256(); /* none */
    const int8_t *a = x->q;
    __m256i t = _mm256_loadu_si256((const __m256i *)w);
    /* bytes 32..47 in the low half, and in the high half the same one step on (trit j + 1) */
    const __m128i v16 = _mm_loadu_si128((const __m128i *)(w + 32));
    __m256i t16 = _mm256_set_m128i(_mm256_castsi256_si128(times3(_mm256_castsi128_si256(v16))), v16);
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < 5; j++) {
        const __m256i a32 = _mm256_loadu_si256((const __m256i *)(a + 32 * j));
        acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(trit256(t), a32));
        t = times3(t);
    }
    for (int j = 0; j < 5; j += 2) { /* trits j and j + 1 of bytes 32..47: activations 160 + 16 j.. */
        const __m256i a16 = j < 4 ? _mm256_loadu_si256((const __m256i *)(a + 160 + 16 * j))
                                  : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(a + 224)));
        acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(trit256(t16), a16));
        t16 = times3(times3(t16));
    }
    /* qh: byte k's trit j at 4j + k, against activations 240..255 */
    const __m256i th = _mm256_zextsi128_si256(tq1_qh_bytes(w));
    const __m256i ah = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(a + 240)));
    acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(trit256(th), ah));
    return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
}

void ms_dot4_tq1_0_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    Q8K_ROWS4(54, 52, 0, __m256i, sums4_256, sum_epi32, tq1_0_block, -q8k_sum(xb));
}

/* q2_k (ms_dot4_q2_k_scalar's sums): the 2-bit values lie as tq2_0's, each run of 32 being sub-blocks 2c
 * and 2c + 1; maddubs against the activations, then madd by the two sub-blocks' scales (pick_word, the
 * scales reordered even ones first as for q6_k), and the mins by madd against the 16 bsums16. */
static inline __m256i q2_k_lanes_avx2(const uint8_t *w, const ms_q8_kx *x, __m256i *mins) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m128i s8 = _mm_loadu_si128((const __m128i *)w);
    const __m256i sc = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_and_si128(s8, low4), even_odd));
    const __m256i mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), low4));
    __m256i acc = _mm256_setzero_si256();
    for (int n = 0; n < 2; n++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * n));
        for (int j = 0; j < 4; j++) {
            const int c = 4 * n + j;
            const __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 2 * j), m3);
            const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(x->q + 32 * c)));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, pick_word(sc, c)));
        }
    }
    *mins = _mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)x->bsums16));
    return acc;
}

void ms_dot4_q2_k_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    Q8K_ROWS4(84, 80, 82, __m256i, sums4_256, sum_epi32, q2_k_lanes_avx2, 0);
}

/* q3_k (ms_dot4_q3_k_scalar's sums): each run of 32 values u = (2 low bits, as q2_k's) | (the hmask bit
 * << 2), 0..7, by maddubs against the activations (|.| <= 1778) and madd by the sub-blocks' signed scales;
 * the -4 comes off as 4 * sum of scale * sum(a) per 16 (the bsums16). */
static inline __m256i q3_k_block(const uint8_t *w, const ms_q8_kx *x, __m256i *mins) {
    *mins = _mm256_setzero_si256(); /* none */
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m128i s8 = q3k_scales(w + 96);
    const __m256i scp = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, even_odd)), scn = _mm256_cvtepi8_epi16(s8);
    const __m256i hm = _mm256_loadu_si256((const __m256i *)w);
    __m256i acc = _mm256_setzero_si256();
    for (int n = 0; n < 2; n++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 32 + 32 * n));
        for (int j = 0; j < 4; j++) {
            const int c = 4 * n + j;
            const __m256i h = _mm256_and_si256(_mm256_srli_epi16(hm, c), one);
            const __m256i u = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 2 * j), m3),
                                              _mm256_slli_epi16(h, 2));
            const __m256i p = _mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)(x->q + 32 * c)));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, pick_word(scp, c)));
        }
    }
    /* less 4 * the sum of scale * bsum, as lanes: the lanes' sum is the block's */
    const __m256i bs = _mm256_madd_epi16(scn, _mm256_loadu_si256((const __m256i *)x->bsums16));
    return _mm256_sub_epi32(acc, _mm256_slli_epi32(bs, 2));
}

void ms_dot4_q3_k_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    Q8K_ROWS4(110, 108, 0, __m256i, sums4_256, sum_epi32, q3_k_block, 0);
}
