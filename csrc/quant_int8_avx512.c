/* AVX-512 integer kernels: mxfp4, int4, q8_0 and the q8_k low-bit formats (q3_k, q2_k, tq2_0, tq1_0) with
 * VNNI (vpdpbusd; mxfp4 four blocks per register, their low and high nibbles in two registers summed in the
 * same chains, its body in quant_mxfp4_avx512.h and its VBMI build in quant_mxfp4_vbmi.c; int4 and q8_0 two
 * blocks per register, even blocks in the low half and odd ones in the high half; on an AVX-512 CPU without
 * VNNI the AVX2 kernels run instead); q4_k and q6_k (decode and gemm) with AVX-512BW, two sub-blocks
 * (chunks) per register. The same exact lane integers and the same canonical float order as the scalar path
 * (quant_int8.c). */
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "matmul.h"
#include "quant.h"
#include "quant_int8.h"
#include "quant_int8_simd.h"

/* Only the functions that use vpdpbusd are compiled for VNNI, so that the compiler cannot put VNNI
 * instructions into the kernels an AVX-512 CPU without it runs. */
#define VNNI __attribute__((target("avx512vnni")))
/* GFNI's affine bit maps (vgf2p8affineqb) split nibbles and 2-bit fields in one instruction where shifts and
 * masks take two or more; the CPUs with AVX-512 VBMI that lack it (Cannon Lake) take the shifts
 * (ms_use_gfni). GF_LOW4 and GF_HIGH4 are the qword bit matrices of x & 15 and x >> 4 for each byte (output
 * bit i is input bit j where byte 7 - i of the matrix is 1 << j). */
#define GFNI __attribute__((target("gfni")))
#define VNNI_GFNI __attribute__((target("avx512vnni,gfni")))
#define GF_LOW4 0x0102040800000000LL
#define GF_HIGH4 0x1020408000000000LL

/* ms_dot4_NAME_avx512: the VNNI kernel NAME_vnni where the CPU (and the chosen path) has VNNI, else the
 * AVX2 kernel, as on Skylake-X. */
#define VNNI_OR_AVX2(name)                                                                                   \
    void ms_dot4_##name##_avx512(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) { \
        if (ms_use_vnni())                                                                                   \
            name##_vnni(m, row0, nrows, xp, out);                                                            \
        else                                                                                                 \
            ms_dot4_##name##_avx2(m, row0, nrows, xp, out);                                                  \
    }

/* The 32 bytes of two consecutive blocks of a row, each block's 16 bytes twice. */
static inline __m512i pair_bytes(const uint8_t *w) {
    const __m512i dup = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3);
    return _mm512_permutexvar_epi64(dup, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)w)));
}

/* The same as the nibbles of both in nibble order: the second copy of each block shifted right by 4, all
 * masked to 0..15. */
typedef __m512i (*pair_nibbles_fn)(const uint8_t *w);
static inline __m512i pair_nibbles(const uint8_t *w) {
    const __m512i shift = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
    return _mm512_and_si512(_mm512_srlv_epi64(pair_bytes(w), shift), _mm512_set1_epi8(0x0F));
}
/* The same with one GFNI bit map instead of the shift and the mask (int4, Zen 4, one thread in L2:
 * 2048x768, 768x2048 and 7168x2048 1.12-1.14x). */
static inline GFNI __m512i pair_nibbles_gfni(const uint8_t *w) {
    const __m512i maps = _mm512_setr_epi64(GF_LOW4, GF_LOW4, GF_HIGH4, GF_HIGH4, GF_LOW4, GF_LOW4, GF_HIGH4, GF_HIGH4);
    return _mm512_gf2p8affine_epi64_epi8(pair_bytes(w), maps, 0);
}

static inline __m256i one_nibbles(const uint8_t *w) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w));
    return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

/* The high 256 bits of a (the low ones are _mm512_castps512_ps256). */
static inline __m256 high_half(__m512 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); }

/* The two 8-lane halves of a added. */
static inline __m256 halves_sum(__m512 a) { return _mm256_add_ps(_mm512_castps512_ps256(a), high_half(a)); }

/* int4's four sets of 8 lanes (block b % 4 = 0, 1 in the halves of a, 2, 3 in those of b) added as
 * (set 0 + set 1) + (set 2 + set 3), then the fixed 8-lane tree. */
static inline float finish2(__m512 a, __m512 b) { return reduce8(_mm256_add_ps(halves_sum(a), halves_sum(b))); }

/* The even-block and odd-block accumulators of a row added, then the fixed 8-lane tree. */
static inline float finish(__m512 acc) { return reduce8(halves_sum(acc)); }

/* mxfp4 (quant_mxfp4_avx512.h) with VNNI: the nibbles looked up by vpshufb, masked to 0..15. */
#define MX_TARGET VNNI
static inline MX_TARGET void mx_nibbles(__m512i v, __m512i lut, __m512i *ul, __m512i *uh) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    *ul = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, m4));
    *uh = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
}
#include "quant_mxfp4_avx512.h"

/* A run of rows tile by tile through a tile kernel (the AVX2 one, where the AVX-512 run-of-rows kernels lack
 * VNNI): the rows the dispatcher would give it one tile at a time. */
static void by_tiles(ms_dot4_fn dot4, const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out) {
    for (int64_t r = 0; r < nrows; r += 4) dot4(m, row0 + r, nrows - r < 4 ? (int)(nrows - r) : 4, xp, out + r);
}

/* mxfp4 decode over a run of rows (mx_decode_rows); without VNNI the AVX2 kernel tile by tile. */
void ms_rows_mxfp4_int_avx512(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out) {
    if (ms_use_vbmi())
        ms_rows_mxfp4_vbmi(m, row0, nrows, xp, out);
    else if (ms_use_vnni())
        mx_decode_rows(m, row0, nrows, xp, out);
    else
        by_tiles(ms_dot4_mxfp4_int_avx2, m, row0, nrows, xp, out);
}

/* A tile against one token: the run-of-rows kernel, whose tiles of at most four rows are computed alone. */
void ms_dot4_mxfp4_int_avx512(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    ms_rows_mxfp4_int_avx512(m, row0, nrows, xp, out);
}

/* mxfp4 against several tokens (prefill): token by token, each tile's rows four at once (mx_prefill),
 * each row with the one-token kernel's bits; without VNNI the AVX2 kernel. */
void ms_gemm_mxfp4_avx512(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride, int64_t T,
                          float *out, int64_t out_stride) {
    const ms_dot4_fn dot4 = ms_use_vbmi()   ? ms_dot4_mxfp4_vbmi_prefill
                            : ms_use_vnni() ? mx_prefill
                                            : ms_dot4_mxfp4_int_avx2;
    dot4_per_token(dot4, m, row0, nrows, xp, stride, T, out, out_stride);
}

/* Loads of scales and activation scales are masked only for a last, partial group of 16 blocks: on Zen 5
 * a masked load that misses the cache stalls the loop (int4 from memory: 7 GB/s masked, 16 unmasked);
 * the next tile's scales are prefetched with its weights (16 -> 36 GB/s on one thread for int4). mxfp4's
 * kernels (quant_mxfp4_avx512.h) do the same. */

/* int4 (nibble - 8, one f32 scale per 32): the nibbles multiplied as they lie against the int8
 * activations in nibble order, 8 * sum(x) per lane taken off; a pair of blocks' activations and lane
 * offsets are one 512-bit load each (quant_int8.h), the scales d 16 at a time, and the 16 products s * d of
 * a group of blocks are made per row. */
/* Blocks b, b + 1 of a row, their nibbles nib (pair_nibbles), k = b - b0 in the group of 16 whose scale
 * products are dd, into acc. wide (a constant): the lanes' 8 * sum(x) made by a second vpdpbusd (8 against
 * the activations) instead of loaded, the same integers: a token whose activations and lane offsets
 * (68 bytes a block) pass 16 KB then reads half as much from L1 beside the weights streaming in (one
 * thread from memory, in-process A/B: 4096x14336 28.0-29.7 -> 31.1-35.3 GB/s, 1024x9216 28.3-30.5 ->
 * 31.7-33.0; 2048x7168 and narrower the same either way, and in cache 3-4% slower, so only there). */
static inline __attribute__((always_inline)) VNNI __m512 int4_pair_of(__m512i nib, const ms_int4x *x, int64_t b,
                                                                 int k, __m512 dd, __m512 acc, const int wide) {
    const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i q = _mm512_loadu_si512(x->q + 32 * b);
    const __m512i off = wide ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(8), q)
                             : _mm512_loadu_si512(x->s8 + 8 * b);
    const __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), nib, q);
    const __m512 d = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(k), lanes), dd); /* b's, b + 1's */
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(t, off)), d, acc);
}

/* Blocks b, b + 1 of the row at w into acc (int4_pair_of). */
static inline __attribute__((always_inline)) VNNI __m512 int4_pair(const uint8_t *w, const ms_int4x *x, int64_t b,
                                                              int k, __m512 dd, __m512 acc, const int wide,
                                                              pair_nibbles_fn nibbles) {
    return int4_pair_of(nibbles(w + 16 * b), x, b, k, dd, acc, wide);
}

/* The last block of an odd count (b % 4 = 0 or 2, the low half of acc[b % 4 / 2]), its nibbles nib
 * (one_nibbles), k = b - b0, into acc. */
static inline __attribute__((always_inline)) VNNI void int4_last(__m256i nib, const ms_int4x *x, int64_t b, int k,
                                                            __m512 dd, __m512 acc[2]) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
    const __m256i off = _mm256_loadu_si256((const __m256i *)(x->s8 + 8 * b));
    const __m256i t = _mm256_sub_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), nib, q), off);
    const __m512 d = _mm512_permutexvar_ps(_mm512_set1_epi32(k), dd);
    const __m512 tf = _mm512_castps256_ps512(_mm256_cvtepi32_ps(t));
    if (k % 4 == 0) /* a constant index, so that the accumulators stay in registers */
        acc[0] = _mm512_mask3_fmadd_ps(tf, d, acc[0], (__mmask16)0x00FF);
    else
        acc[1] = _mm512_mask3_fmadd_ps(tf, d, acc[1], (__mmask16)0x00FF);
}

/* R rows (a constant) against one token, each row's arithmetic the same whatever R: the row's two chains of
 * multiply-adds (blocks b % 4 = 0, 1 in acc[r][0]; 2, 3 in acc[r][1]) keep it fast in cache; the R rows
 * share each activation load. */
static inline __attribute__((always_inline)) VNNI void int4_rows(const ms_matrix *m, int64_t row0, const int R,
                                                            int64_t step, const ms_int4x *x, int64_t nb,
                                                            int64_t ahead_rows, const int wide, const int l2,
                                                            pair_nibbles_fn nibbles, float *out) {
    const int64_t ahead = ahead_rows * m->row_bytes;
    const uint8_t *w[4];
    const float *s[4];
    __m512 acc[4][2], dd[4];
    for (int r = 0; r < R; r++) {
        w[r] = m->data + (row0 + r * step) * m->row_bytes;
        s[r] = ms_int4_scale_row(m, row0 + r * step);
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    }
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int n = nb - b0 < 16 ? (int)(nb - b0) : 16;
        const __mmask16 km = (__mmask16)((1u << n) - 1);
        for (int r = 0; r < R; r++) {
            prefetch_line(s[r] + b0 + ahead_rows * nb, l2); /* the scales as far ahead */
            dd[r] = n == 16 ? _mm512_mul_ps(_mm512_loadu_ps(s[r] + b0), _mm512_loadu_ps(x->d + b0))
                            : _mm512_mul_ps(_mm512_maskz_loadu_ps(km, s[r] + b0), _mm512_maskz_loadu_ps(km, x->d + b0));
        }
        int k = 0;
        for (; k + 4 <= n; k += 4)
            for (int r = 0; r < R; r++) {
                prefetch_line(w[r] + 16 * (b0 + k) + ahead, l2);
                acc[r][0] = int4_pair(w[r], x, b0 + k, k, dd[r], acc[r][0], wide, nibbles);
                acc[r][1] = int4_pair(w[r], x, b0 + k + 2, k + 2, dd[r], acc[r][1], wide, nibbles);
            }
        if (k + 2 <= n) {
            for (int r = 0; r < R; r++) {
                prefetch_line(w[r] + 16 * (b0 + k) + ahead, l2);
                acc[r][0] = int4_pair(w[r], x, b0 + k, k, dd[r], acc[r][0], wide, nibbles);
            }
            k += 2;
        }
        if (k < n) /* the last block of an odd count */
            for (int r = 0; r < R; r++) int4_last(one_nibbles(w[r] + 16 * (b0 + k)), x, b0 + k, k, dd[r], acc[r]);
    }
    for (int r = 0; r < R; r++) out[r * step] = finish2(acc[r][0], acc[r][1]);
}

/* Rows one after another: the weights and scales of a tile stream in order, which from memory beats several
 * consecutive rows sharing the activation loads (two threads, 4096x14336: 86% of the memory read against
 * 80% for two rows at once; 3584x3072: 100% against 79% for four, with the read at ~47 GB/s). With
 * ms_weight_streams_for() four, a run's rows i, q + i, 2q + i, 3q + i (q = nrows / 4) are taken at once, each
 * stream prefetched ahead_rows of its rows on (as rows_streams). Activations and lane offsets of more than
 * 16 KB are made instead of loaded (int4_pair_of's wide). l2: the prefetches go to L2 (ms_prefetch_into_l2). */
static inline __attribute__((always_inline)) VNNI void int4_run(const ms_matrix *m, int64_t row0, int64_t nrows,
                                                           const float *xp, float *out, const int wide,
                                                           const int l2, int four, pair_nibbles_fn nibbles) {
    const int64_t nb = m->cols / 32;
    const ms_int4x x = ms_int4x_at(xp, nb);
    /* prefetch at least 16 KB ahead (narrow rows: 7168x2048 at two threads, read ~80 GB/s, 72% -> ~86%) */
    const int64_t ahead_rows = prefetch_rows(m->row_bytes, 1, 4);
    const int64_t q = four ? nrows / 4 : 0;
    for (int64_t i = 0; i < q; i++) int4_rows(m, row0 + i, 4, q, &x, nb, ahead_rows, wide, l2, nibbles, out + i);
    for (int64_t r = 4 * q; r < nrows; r++)
        int4_rows(m, row0 + r, 1, 1, &x, nb, ahead_rows, wide, l2, nibbles, out + r);
}

/* int4_run with its constants chosen: wide, l2, and the nibbles made by shifts (VNNI) or by GFNI. */
#define INT4_DECODE(name, target, nibbles)                                                                     \
    static target void name(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out,      \
                            int four) {                                                                        \
        const int wide = (m->cols / 32) * MS_INT4X_BYTES > 16384;                                              \
        const int l2 = ms_prefetch_into_l2(prefetch_rows(m->row_bytes, 1, 4) * m->row_bytes);                  \
        if (wide)                                                                                              \
            l2 ? int4_run(m, row0, nrows, xp, out, 1, 1, four, nibbles)                                        \
               : int4_run(m, row0, nrows, xp, out, 1, 0, four, nibbles);                                       \
        else                                                                                                   \
            l2 ? int4_run(m, row0, nrows, xp, out, 0, 1, four, nibbles)                                        \
               : int4_run(m, row0, nrows, xp, out, 0, 0, four, nibbles);                                       \
    }
INT4_DECODE(int4_decode_shifts, VNNI, pair_nibbles)
INT4_DECODE(int4_decode_gfni, VNNI_GFNI, pair_nibbles_gfni)

static void int4_decode(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out, int four) {
    if (ms_use_gfni())
        int4_decode_gfni(m, row0, nrows, xp, out, four);
    else
        int4_decode_shifts(m, row0, nrows, xp, out, four);
}

/* The VNNI kernels read the activations in nibble order; without VNNI the AVX2 kernel reads the pair layout. */
void ms_prep_x_int4_avx512(const float *x, int64_t n, float *xp) {
    if (ms_use_vnni())
        ms_prep_x_int4_nibbles_avx2(x, n, xp);
    else
        ms_prep_x_int4_avx2(x, n, xp);
}

/* A tile: its rows one after another. */
static VNNI void int4_vnni(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    int4_decode(m, row0, nrows, xp, out, 0);
}

VNNI_OR_AVX2(int4)

/* int4 decode over a run of rows; without VNNI the AVX2 kernel tile by tile. */
void ms_rows_int4_avx512(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out) {
    if (ms_use_vnni())
        int4_decode(m, row0, nrows, xp, out,
                    ms_weight_streams_for((m->cols / 32) * MS_INT4X_BYTES, nrows * m->row_bytes) == 4);
    else
        by_tiles(ms_dot4_int4_avx2, m, row0, nrows, xp, out);
}

/* nt tokens (a constant, 1..4) against the tile's rows, row by row: each pair of blocks' nibbles made once
 * and multiplied against every token, each token's accumulators, scale products and tails those of
 * int4_rows (so each token's result has the one-token kernel's bits). */
static inline __attribute__((always_inline)) VNNI void int4_tokens(pair_nibbles_fn pair_nibbles, const ms_matrix *m,
                                                              int64_t row0, int nrows, const char *xp,
                                                              int64_t stride, const int nt, float *out,
                                                              int64_t out_stride) {
    const int64_t nb = m->cols / 32;
    ms_int4x x[4];
    for (int i = 0; i < nt; i++) x[i] = ms_int4x_at((const float *)(xp + i * stride), nb);
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        const float *s = ms_int4_scale_row(m, row0 + r);
        __m512 acc[4][2], dd[4];
        for (int i = 0; i < nt; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        for (int64_t b0 = 0; b0 < nb; b0 += 16) {
            const int n = nb - b0 < 16 ? (int)(nb - b0) : 16;
            const __mmask16 km = (__mmask16)((1u << n) - 1);
            const __m512 sv = n == 16 ? _mm512_loadu_ps(s + b0) : _mm512_maskz_loadu_ps(km, s + b0);
            for (int i = 0; i < nt; i++)
                dd[i] = _mm512_mul_ps(sv, n == 16 ? _mm512_loadu_ps(x[i].d + b0) : _mm512_maskz_loadu_ps(km, x[i].d + b0));
            int k = 0;
            for (; k + 4 <= n; k += 4) {
                const __m512i nib0 = pair_nibbles(w + 16 * (b0 + k)), nib1 = pair_nibbles(w + 16 * (b0 + k + 2));
                for (int i = 0; i < nt; i++) {
                    acc[i][0] = int4_pair_of(nib0, &x[i], b0 + k, k, dd[i], acc[i][0], 0);
                    acc[i][1] = int4_pair_of(nib1, &x[i], b0 + k + 2, k + 2, dd[i], acc[i][1], 0);
                }
            }
            if (k + 2 <= n) {
                const __m512i nib0 = pair_nibbles(w + 16 * (b0 + k));
                for (int i = 0; i < nt; i++) acc[i][0] = int4_pair_of(nib0, &x[i], b0 + k, k, dd[i], acc[i][0], 0);
                k += 2;
            }
            if (k < n) {
                const __m256i nib = one_nibbles(w + 16 * (b0 + k));
                for (int i = 0; i < nt; i++) int4_last(nib, &x[i], b0 + k, k, dd[i], acc[i]);
            }
        }
        for (int i = 0; i < nt; i++) out[i * out_stride + r] = finish2(acc[i][0], acc[i][1]);
    }
}

static VNNI void gemm_int4_vnni(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride,
                                int64_t T, float *out, int64_t out_stride) {
    if (T >= 6) prefetch_next_tile(m, row0, nrows);
    TOKEN_GROUPS(int4_tokens, pair_nibbles, m, row0);
}

static VNNI_GFNI void gemm_int4_gfni(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride,
                                     int64_t T, float *out, int64_t out_stride) {
    if (T >= 6) prefetch_next_tile(m, row0, nrows);
    TOKEN_GROUPS(int4_tokens, pair_nibbles_gfni, m, row0);
}

/* int4 against several tokens (prefill): up to four tokens at a time against each row, the nibbles of a
 * pair of blocks made once for them (int4_tokens), each token with the one-token kernel's bits; without
 * VNNI the AVX2 kernel token by token. */
void ms_gemm_int4_avx512(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride, int64_t T,
                         float *out, int64_t out_stride) {
    if (ms_use_gfni())
        gemm_int4_gfni(m, row0, nrows, xp, stride, T, out, out_stride);
    else if (ms_use_vnni())
        gemm_int4_vnni(m, row0, nrows, xp, stride, T, out, out_stride);
    else
        dot4_per_token(ms_dot4_int4_avx2, m, row0, nrows, xp, stride, T, out, out_stride);
}

/* 32 bytes at lo in the low half, 32 at hi in the high half (q8_0's 34-byte weight blocks and 36-byte
 * activation records of a pair). */
static inline __m512i pair_of(const void *lo, const void *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}

/* q8_0: a block pair's 64 weight bytes against the pair's activations, |w| (unsigned) times x with w's
 * sign, four products a lane by vpdpbusd (the lanes of maddubs + madd in the AVX2 kernel); the even block
 * in the low half, the odd in the high half, one fused multiply-add for both. Without VNNI the AVX2
 * kernel runs. */
static inline __attribute__((always_inline)) VNNI __m512i q8_dot(__m512i w, __m512i x) {
    __m512i sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x); /* x * sign(w) */
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w), sx);
}

/* Blocks b, b + 1 of the q8_0 row whose block b is at w, into acc. */
static inline __attribute__((always_inline)) VNNI __m512 q8_pair(const uint8_t *w, const ms_q8_0x *x, int64_t b,
                                                            __m512 acc) {
    __m512i s = q8_dot(pair_of(w + 2, w + 36), pair_of(x[b].q, x[b + 1].q));
    __m512 dd = _mm512_mask_broadcastss_ps(_mm512_set1_ps(h2f(w) * x[b].d), (__mmask16)0xFF00,
                                           _mm_set_ss(h2f(w + 34) * x[b + 1].d));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dd, acc);
}

/* A row's sum from its accumulator: the last block b of an odd count (an even block, the low half) at w
 * added first. */
static inline __attribute__((always_inline)) VNNI float q8_finish(const uint8_t *w, const ms_q8_0x *x, int64_t b,
                                                             int64_t nb, __m512 acc) {
    if (b < nb) {
        __m512i wq = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + 2)));
        __m512i xq = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)x[b].q));
        __m512 s = _mm512_cvtepi32_ps(q8_dot(wq, xq));
        acc = _mm512_mask3_fmadd_ps(s, _mm512_set1_ps(h2f(w) * x[b].d), acc, (__mmask16)0x00FF);
    }
    return finish(acc);
}

/* Rows one after another, each prefetched 4 rows ahead. */
static inline __attribute__((always_inline)) VNNI void q8_0_one_stream(const ms_matrix *m, int64_t row0,
                                                                  int64_t nrows, const ms_q8_0x *x, float *out) {
    const int64_t nb = m->cols / 32;
    const int l2 = ms_prefetch_into_l2(4 * m->row_bytes);
    for (int64_t r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        __m512 acc = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2, w += 68) {
            prefetch_ahead(w, 4 * m->row_bytes, 68, l2);
            acc = q8_pair(w, x, b, acc);
        }
        out[r] = q8_finish(w, x, b, nb, acc);
    }
}

static VNNI void q8_0_vnni(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    q8_0_one_stream(m, row0, nrows, (const ms_q8_0x *)xp, out);
}

/* A run of rows against one token in ms_weight_streams_for() streams, as rows_streams: with four, rows i,
 * q + i, 2q + i, 3q + i (q = nrows / 4) a pair of blocks of each in turn, each stream prefetched 8 pairs
 * ahead; each row's sum the one-stream kernel's. */
static VNNI void q8_0_rows_vnni(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out) {
    const ms_q8_0x *x = (const ms_q8_0x *)xp;
    const int64_t nb = m->cols / 32;
    const int streams = ms_weight_streams_for(nb * (int64_t)sizeof(ms_q8_0x), nrows * m->row_bytes);
    const int64_t q = streams == 4 ? nrows / 4 : 0;
    for (int64_t i = 0; i < q; i++) {
        const uint8_t *w[4];
        __m512 acc[4];
        for (int s = 0; s < 4; s++) {
            w[s] = m->data + (row0 + s * q + i) * m->row_bytes;
            acc[s] = _mm512_setzero_ps();
        }
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2)
            for (int s = 0; s < 4; s++) {
                prefetch_ahead(w[s] + 34 * b, 8 * 68, 68, 0);
                acc[s] = q8_pair(w[s] + 34 * b, x, b, acc[s]);
            }
        for (int s = 0; s < 4; s++) out[s * q + i] = q8_finish(w[s] + 34 * b, x, b, nb, acc[s]);
    }
    q8_0_one_stream(m, row0 + 4 * q, nrows - 4 * q, x, out + 4 * q);
}

/* q8_0 decode over a run of rows; without VNNI the AVX2 kernel tile by tile. */
void ms_rows_q8_0_avx512(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out) {
    if (ms_use_vnni())
        q8_0_rows_vnni(m, row0, nrows, xp, out);
    else
        by_tiles(ms_dot4_q8_0_avx2, m, row0, nrows, xp, out);
}

VNNI_OR_AVX2(q8_0)

/* The block epilogue of tokens 2p and 2p + 1 of a gemm together: each token's two 256-bit halves of exact
 * lane sums added (its 8 canonical lanes), token 2p's in the low half and 2p + 1's in the high half,
 * converted and multiply-added with d (their scale products, likewise) into F: the float operations of
 * each token's epilogue in the decode kernel, two tokens an instruction. */
static inline __m512 pair_epilogue(__m512i a0, __m512i a1, __m512 d, __m512 F) {
    /* (a0's high half, a1's low half) + (a0's low half, a1's high half): one shuffle and a blend, where two
     * shuffles were (Zen 4 runs blends beside its multiplies, shuffles partly on the same pipes) */
    __m512i cross = _mm512_shuffle_i64x2(a0, a1, 0x4E), same = _mm512_mask_blend_epi64(0xF0, a0, a1);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(cross, same)), d, F);
}

/* reduce8 of four tokens' running lanes at once (token 2p's in the low half of the pair accumulator Fp of
 * pair_epilogue, 2p + 1's in the high half), token i's sum in float 4i: the same additions in the same
 * order, four tokens an instruction (one at a time, the tail of a row cost a quarter of a 768-column gemm). */
static inline __m512 reduce8_x4(__m512 F0, __m512 F1) {
    /* 128-bit lane i: token i's lanes 0..3, plus its lanes 4..7 */
    __m512 a = _mm512_add_ps(_mm512_shuffle_f32x4(F0, F1, 0x88), _mm512_shuffle_f32x4(F0, F1, 0xDD));
    __m512 c = _mm512_add_ps(a, _mm512_shuffle_ps(a, a, 0xEE)); /* a0 + a2, a1 + a3 */
    return _mm512_add_ps(c, _mm512_shuffle_ps(c, c, 0x55));     /* c0 + c1 */
}

/* q4k_min_reduce of each 128-bit lane (token i's four min lanes), in float 4i: (l0 + l1) + (l2 + l3). */
static inline __m512 min_reduce_x4(__m512 m) {
    __m512 t = _mm512_add_ps(m, _mm512_shuffle_ps(m, m, 0xB1)); /* l0 + l1, -, l2 + l3, - */
    return _mm512_add_ps(t, _mm512_shuffle_ps(t, t, 0xEE));
}

/* q4_k against several tokens (with VNNI; the AVX2 gemm otherwise): the tile unpacked as for AVX2
 * (quant_int8_simd.h), then per token four sub-blocks per vpdpbusd pair, their lane sums multiplied by the
 * sub-blocks' scales with vpdpwssd (q4k_tokens); the halves are added at the end of the block, exact
 * integers, the lanes of ms_dot4_q4_k_avx2. The block epilogue runs for
 * the group's tokens together, one 128-bit lane each: the sums of mins times bsums, dmin * d(x) and
 * d * d(x), and the running min lanes; the same float operations per token as ms_dot4_q4_k_avx2. */
typedef struct {
    __m512i bsums; /* token i's 8 bsums in 128-bit lane i (zero beyond the group) */
    __m512 d;      /* token i's d in 128-bit lane i */
} q4k_group;

static _Thread_local q4k_group *q4k_grp;
static _Thread_local int64_t q4k_grp_cap;

/* Rows r0 .. r0 + R - 1 (R = 1 or 2) of the unpacked tile against a group of nt tokens (q4k_tokens): each
 * activation load serves the R rows; every row and token keeps its own chains, so its bits do not depend
 * on R. */
static inline __attribute__((always_inline)) VNNI void q4k_rows(const q4k_unpacked *buf, int64_t nb, int r0,
                                                                const int R, const int paired,
                                                                const __m512i spair[4], const char *xp,
                                                                int64_t stride, const int nt, float *out,
                                                                int64_t out_stride) {
    const __m512i dpair[2] = {_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4),
                              _mm512_setr_epi32(8, 8, 8, 8, 8, 8, 8, 8, 12, 12, 12, 12, 12, 12, 12, 12)};
    const q4k_group *g = q4k_grp;
    const q4k_unpacked *u[2];
    __m512 F[2][2], fmin[2]; /* row j: tokens 2p, 2p + 1 in F[j][p] */
    for (int j = 0; j < R; j++) {
        u[j] = &buf[(r0 + j) * nb];
        F[j][0] = F[j][1] = fmin[j] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        __m512i acc[2][4];
        for (int j = 0; j < R; j++)
            for (int i = 0; i < nt; i++) acc[j][i] = _mm512_setzero_si512();
        for (int k = 0; k < 4 && !paired; k++) { /* sub-blocks 2k, 2k + 1: one vpdpwssd a vpdpbusd */
            __m512i q0[2], sc[2];
            for (int j = 0; j < R; j++) {
                q0[j] = _mm512_load_si512(&u[j][b].q[2 * k]);
                sc[j] = _mm512_maskz_permutexvar_epi16(0x55555555u, spair[k], _mm512_castsi128_si512(u[j][b].sc));
            }
            for (int i = 0; i < nt; i++) {
                const __m512i x0 = _mm512_load_si512(((const ms_q8_kx *)(xp + i * stride) + b)->q + 64 * k);
                for (int j = 0; j < R; j++) {
                    const __m512i a0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q0[j], x0);
                    acc[j][i] = _mm512_dpwssd_epi32(acc[j][i], a0, sc[j]);
                    KEEP_IN_REGISTER(acc[j][i]);
                }
            }
        }
        for (int k = 0; k < 4 && paired; k += 2) {
            __m512i q0[2], q1[2], sc[2];
            for (int j = 0; j < R; j++) {
                q0[j] = _mm512_load_si512(&u[j][b].q[2 * k]);
                q1[j] = _mm512_load_si512(&u[j][b].q[2 * k + 2]);
                sc[j] = _mm512_permutexvar_epi16(spair[k / 2], _mm512_castsi128_si512(u[j][b].sc));
            }
            for (int i = 0; i < nt; i++) {
                const ms_q8_kx *x = (const ms_q8_kx *)(xp + i * stride) + b;
                const __m512i x0 = _mm512_load_si512(x->q + 64 * k), x1 = _mm512_load_si512(x->q + 64 * k + 64);
                for (int j = 0; j < R; j++) {
                    __m512i a0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q0[j], x0);
                    __m512i a1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q1[j], x1);
                    const __m512i pair = _mm512_mask_blend_epi16(0xAAAAAAAAu, a0, _mm512_slli_epi32(a1, 16));
                    acc[j][i] = _mm512_dpwssd_epi32(acc[j][i], pair, sc[j]);
                    KEEP_IN_REGISTER(acc[j][i]);
                }
            }
        }
        for (int j = 0; j < R; j++) {
            const q4k_unpacked *v = &u[j][b];
            __m512i ms = _mm512_madd_epi16(_mm512_broadcast_i32x4(v->mn), g[b].bsums); /* token i: lane i */
            __m512 dm = _mm512_mul_ps(_mm512_set1_ps(v->dmin), g[b].d);
            fmin[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ms), dm, fmin[j]);
            __m512 dd = _mm512_mul_ps(_mm512_set1_ps(v->d), g[b].d); /* token i's in lane 4i */
            for (int p = 0; 2 * p < nt; p++) {
                const __m512i second = 2 * p + 1 < nt ? acc[j][2 * p + 1] : acc[j][2 * p]; /* (unused if absent) */
                F[j][p] = pair_epilogue(acc[j][2 * p], second, _mm512_permutexvar_ps(dpair[p], dd), F[j][p]);
            }
        }
    }
    for (int j = 0; j < R; j++) {
        float res[16]; /* token i's in float 4i */
        _mm512_storeu_ps(res, _mm512_sub_ps(reduce8_x4(F[j][0], F[j][1]), min_reduce_x4(fmin[j])));
        for (int i = 0; i < nt; i++) out[i * out_stride + r0 + j] = res[4 * i];
    }
}

static inline __attribute__((always_inline)) VNNI void q4k_tokens_as(const int paired, const q4k_unpacked *buf,
                                                                     int64_t nb, int nrows, const char *xp,
                                                                     int64_t stride, int nt, float *out,
                                                                     int64_t out_stride) {
    /* vpdpbusd sums 4 products a lane, per sub-block: a0 holds sub-blocks 2k (lanes 0..7) and 2k + 1 (8..15),
     * a1 sub-blocks 2k + 2 and 2k + 3 (each |sum| <= 4 * 15 * 127, exact in int16). A word blend puts a1's
     * lane in the high int16 of a0's (a1 shifted up by 16), and vpdpwssd multiplies the pair by their
     * sub-blocks' scales (spair[k / 2]: 2k, 2k + 2 in lanes 0..7, 2k + 1, 2k + 3 in 8..15) into lane L
     * (sub-blocks 0, 2, 4, 6) or 8 + L (1, 3, 5, 7): the two halves add up to canonical lane L's integer
     * sum. The shift and blend run beside the multiplies on Zen 4, where the vpermt2w that paired a0's
     * lanes L and 8 + L before took their pipes. With that, pair_epilogue's blend and two rows a pass
     * (q4k_rows), Zen 4, one thread, a 4 x 2048 tile in L1: 13.4 -> 12.2 cycles a block and token at 8
     * tokens, 10.9 -> 9.4 at 64; kernels_ab.py --tokens 8, 768x2048 and 2048x768: 1.11-1.15x. */
    /* paired: the scales of sub-blocks 2k, 2k + 2 (lanes 0..7) and 2k + 1, 2k + 3 (8..15) as int16 pairs in
     * spair[k / 2]; else those of 2k (lanes 0..7) and 2k + 1 (8..15) in the low int16 of spair[k] */
    __m512i spair[4];
    {
        short si[4][32];
        for (int L = 0; L < 8; L++)
            for (int h = 0; h < 4; h++) {
                if (paired && h < 2) {
                    si[h][2 * L] = (short)(4 * h), si[h][2 * L + 1] = (short)(4 * h + 2);
                    si[h][16 + 2 * L] = (short)(4 * h + 1), si[h][16 + 2 * L + 1] = (short)(4 * h + 3);
                } else {
                    si[h][2 * L] = (short)(2 * h), si[h][16 + 2 * L] = (short)(2 * h + 1);
                    si[h][2 * L + 1] = si[h][16 + 2 * L + 1] = 0;
                }
            }
        for (int h = 0; h < 4; h++) spair[h] = _mm512_loadu_si512(si[h]);
    }
    q4k_group *g = q4k_grp;
    for (int64_t b = 0; b < nb; b++) {
        __m512i bs = _mm512_setzero_si512();
        __m512 d = _mm512_setzero_ps();
        for (int i = 0; i < nt; i++) {
            const ms_q8_kx *x = (const ms_q8_kx *)(xp + i * stride) + b;
            __mmask16 lane = (__mmask16)(0xFu << (4 * i));
            bs = _mm512_mask_broadcast_i32x4(bs, lane, _mm_loadu_si128((const __m128i *)x->bsums));
            d = _mm512_mask_mov_ps(d, lane, _mm512_set1_ps(x->d));
        }
        g[b].bsums = bs;
        g[b].d = d;
    }
    int r = 0;
    for (; r + 2 <= nrows; r += 2) q4k_rows(buf, nb, r, 2, paired, spair, xp, stride, nt, out, out_stride);
    if (r < nrows) q4k_rows(buf, nb, r, 1, paired, spair, xp, stride, nt, out, out_stride);
}

/* q4k_tokens_as with the group's size and the pairing (ms_q4k_pairs) as constants */
static VNNI void q4k_tokens(const q4k_unpacked *buf, int64_t nb, int nrows, const char *xp, int64_t stride, int nt,
                            float *out, int64_t out_stride) {
    switch (2 * nt + ms_q4k_pairs()) {
#define Q4K_CASE(N, P) \
    case 2 * N + P: q4k_tokens_as(P, buf, nb, nrows, xp, stride, N, out, out_stride); break;
        Q4K_CASE(4, 1) Q4K_CASE(4, 0) Q4K_CASE(3, 1) Q4K_CASE(3, 0) Q4K_CASE(2, 1) Q4K_CASE(2, 0) Q4K_CASE(1, 1)
        Q4K_CASE(1, 0)
#undef Q4K_CASE
        default: break;
    }
}

static VNNI void gemm_q4_k_vnni(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride,
                                int64_t T, float *out, int64_t out_stride) {
    GEMM_OVER_TILE(q4k_buf, q4k_cap, q4k_unpack_tile, q4k_tokens, ms_dot4_q4_k_avx2,
                   grow((void **)&q4k_grp, &q4k_grp_cap, nb, sizeof(q4k_group)));
}

void ms_gemm_q4_k_avx512(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride, int64_t T,
                         float *out, int64_t out_stride) {
    if (ms_use_vnni()) /* the same sums as the AVX2 gemm, which runs without VNNI */
        gemm_q4_k_vnni(m, row0, nrows, xp, stride, T, out, out_stride);
    else
        ms_gemm_q4_k_avx2(m, row0, nrows, xp, stride, T, out, out_stride);
}

/* q6_k against several tokens: the tile unpacked as for AVX2, then per token two 32-value chunks per
 * register, (v - 32) x as maddubs(v, x) - 32 x, madd by the four 16-value sub-blocks' scales; the halves
 * are added at the end of the block, so every token's lanes are those of ms_dot4_q6_k_avx2. */

static _Thread_local __m512 *q6k_grp; /* [nb][2]: per block, tokens 2p and 2p + 1's d in the halves of [p] */
static _Thread_local int64_t q6k_grp_cap;

/* Rows r0 .. r0 + R - 1 (R = 1 or 2) of the unpacked tile against a group of nt tokens (q6k_tokens): each
 * activation load (x and its 32 x) serves the R rows; every row and token keeps its own chain, so its bits
 * do not depend on R. */
static inline __attribute__((always_inline)) void q6k_rows(const q6k_unpacked *buf, int64_t nb, int r0, const int R,
                                                           const __m512i pair[4], const char *xp, int64_t stride,
                                                           const int nt, float *out, int64_t out_stride) {
    const __m512 *g = q6k_grp;
    const q6k_unpacked *u[2];
    __m512 F[2][2]; /* row j: tokens 2p, 2p + 1 in F[j][p] */
    for (int j = 0; j < R; j++) {
        u[j] = &buf[(r0 + j) * nb];
        F[j][0] = F[j][1] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        __m512i acc[2][4];
        for (int j = 0; j < R; j++)
            for (int i = 0; i < nt; i++) acc[j][i] = _mm512_setzero_si512();
        for (int k = 0; k < 4; k++) {
            __m512i q[2], sc[2];
            for (int j = 0; j < R; j++) {
                q[j] = _mm512_load_si512(&u[j][b].q[2 * k]);
                sc[j] = _mm512_permutexvar_epi16(pair[k], _mm512_castsi256_si512(u[j][b].sc));
            }
            for (int i = 0; i < nt; i++) {
                const ms_q6_kx *x = (const ms_q6_kx *)(xp + i * stride) + b;
                const __m512i xq = _mm512_loadu_si512(x->k.q + 64 * k), x32 = _mm512_loadu_si512(x->x32 + 32 * k);
                for (int j = 0; j < R; j++) {
                    const __m512i p = _mm512_sub_epi16(_mm512_maddubs_epi16(q[j], xq), x32);
                    acc[j][i] = _mm512_add_epi32(acc[j][i], _mm512_madd_epi16(p, sc[j]));
                    KEEP_IN_REGISTER(acc[j][i]);
                }
            }
        }
        for (int j = 0; j < R; j++) {
            const __m512 wd = _mm512_set1_ps(u[j][b].d);
            for (int p = 0; 2 * p < nt; p++) {
                const int s = 2 * p + 1 < nt ? 2 * p + 1 : 2 * p; /* (unused if absent) */
                F[j][p] = pair_epilogue(acc[j][2 * p], acc[j][s], _mm512_mul_ps(wd, g[2 * b + p]), F[j][p]);
            }
        }
    }
    for (int j = 0; j < R; j++) {
        float res[16]; /* token i's in float 4i */
        _mm512_storeu_ps(res, reduce8_x4(F[j][0], F[j][1]));
        for (int i = 0; i < nt; i++) out[i * out_stride + r0 + j] = res[4 * i];
    }
}

static inline __attribute__((always_inline)) void q6k_tokens(const q6k_unpacked *buf, int64_t nb, int nrows,
                                                             const char *xp, int64_t stride, int nt, float *out,
                                                             int64_t out_stride) {
    __m512i pair[4]; /* chunks 2k, 2k + 1: scales 4k..4k+3, at int16 2k, 8 + 2k, 2k + 1, 9 + 2k of u->sc */
    for (int k = 0; k < 4; k++) {
        __m512i lo = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)(2 * k)),
                                             _mm512_set1_epi16((short)(2 * k + 1)));
        pair[k] = _mm512_mask_add_epi16(lo, 0xFF00FF00u, lo, _mm512_set1_epi16(8));
    }
    __m512 *g = q6k_grp;
    for (int64_t b = 0; b < nb; b++)
        for (int p = 0; 2 * p < nt; p++) {
            const int j = 2 * p + 1 < nt ? 2 * p + 1 : 2 * p; /* (unused if absent) */
            const float d0 = ((const ms_q6_kx *)(xp + 2 * p * stride) + b)->k.d;
            const float d1 = ((const ms_q6_kx *)(xp + j * stride) + b)->k.d;
            g[2 * b + p] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(d0)),
                                                               _mm256_castps_pd(_mm256_set1_ps(d1)), 1));
        }
    int r = 0;
    for (; r + 2 <= nrows; r += 2) q6k_rows(buf, nb, r, 2, pair, xp, stride, nt, out, out_stride);
    if (r < nrows) q6k_rows(buf, nb, r, 1, pair, xp, stride, nt, out, out_stride);
}

void ms_gemm_q6_k_avx512(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride, int64_t T,
                         float *out, int64_t out_stride) {
    GEMM_OVER_TILE(q6k_buf, q6k_cap, q6k_unpack_tile, q6k_tokens, ms_dot4_q6_k_avx2,
                   grow((void **)&q6k_grp, &q6k_grp_cap, 2 * nb, sizeof(__m512)));
}

/* A one-token kernel NAME compiled for TARGET: the rows, nrows of type NROWS_T, through DRIVER
 * (rows_one_stream for a tile, rows_streams for a run of rows) with blocks of BYTES bytes against X_T
 * activation records, each by BLOCK with the constants MAKE() of type CONSTS_T, prefetched AHEAD bytes on,
 * and each row's sum by FINISH. */
#define ONE_TOKEN_KERNEL(name, target, driver, nrows_t, consts_t, make, bytes, x_t, ahead, block, finish)    \
    static target void name(const ms_matrix *m, int64_t row0, nrows_t nrows, const float *xp, float *out) { \
        const consts_t c = make();                                                                         \
        driver(m, row0, nrows, (const char *)xp, out, bytes, sizeof(x_t), ahead, block, finish, &c);       \
    }

/* q6_k against one token: per half block, the 64 low-bit bytes and the 32 high-bit bytes (twice) give two
 * pairs of 32-value chunks, (low nibbles | 2 high bits << 4) for chunks 4h, 4h + 1 and (high nibbles |
 * ...) for 4h + 2, 4h + 3; then (v - 32) x = maddubs(v, x) - 32 x and madd by the four sub-blocks' scales,
 * the halves added at the end of the block: the lanes of ms_dot4_q6_k_avx2. */
typedef struct {
    __m512i pair[4]; /* int16 indices of the scales of chunks 2k, 2k + 1: 4k, 4k + 1, 4k + 2, 4k + 3 */
    __m512i m4, m2, sh01, sh23;
    __m512i gf01, gf23, gfhi; /* GF(2) bit matrices per qword (q6k_split_gfni) */
} q6k_consts;

static inline q6k_consts q6k_make_consts(void) {
    q6k_consts c;
    for (int k = 0; k < 4; k++)
        c.pair[k] = _mm512_setr_epi64(0x0001000100010001LL * (4 * k), 0x0001000100010001LL * (4 * k),
                                      0x0001000100010001LL * (4 * k + 1), 0x0001000100010001LL * (4 * k + 1),
                                      0x0001000100010001LL * (4 * k + 2), 0x0001000100010001LL * (4 * k + 2),
                                      0x0001000100010001LL * (4 * k + 3), 0x0001000100010001LL * (4 * k + 3));
    c.m4 = _mm512_set1_epi8(0x0F);
    c.m2 = _mm512_set1_epi8(3);
    c.sh01 = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    c.sh23 = _mm512_setr_epi64(4, 4, 4, 4, 6, 6, 6, 6);
    /* output bit i of a byte takes input bit j where byte 7 - i of the qword is 1 << j */
    const long long b01 = 0x0000000001020000LL, b23 = 0x0000000004080000LL, b45 = 0x0000000010200000LL,
                    b67 = 0x0000000040800000LL, shr4 = GF_HIGH4;
    c.gf01 = _mm512_setr_epi64(b01, b01, b01, b01, b23, b23, b23, b23);
    c.gf23 = _mm512_setr_epi64(b45, b45, b45, b45, b67, b67, b67, b67);
    c.gfhi = _mm512_set1_epi64(shr4);
    return c;
}

/* acc + the sums of each pair of products p * sc: madd then add, or with VNNI vpdpwssd in one instruction (the
 * same sums: none can overflow, q4_k's |acc| <= 256 * 15 * 128 * 63, q6_k's <= 256 * 32 * 128 * 128). */
typedef __m512i (*pair_sums_fn)(__m512i acc, __m512i p, __m512i sc);
static inline __m512i madd_add(__m512i acc, __m512i p, __m512i sc) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, sc));
}
static inline VNNI __m512i dpwssd(__m512i acc, __m512i p, __m512i sc) { return _mm512_dpwssd_epi32(acc, p, sc); }

/* The 6-bit values of chunks 4h, 4h + 1 (v[0]) and 4h + 2, 4h + 3 (v[1]) from the low-bit bytes lo and the
 * high-bit bytes hi (broadcast to both halves): shifts and masks (11 instructions), or with GFNI affine
 * bit maps and a ternary logic (5). Zen 4, one thread, in-process A/B: 2048x768 and 768x2048 in L2
 * 1.12 / 1.27x, the 151936x2048 output matrix from memory 1.21x. */
typedef void (*q6k_split_fn)(__m512i lo, __m512i hi, const q6k_consts *c, __m512i v[2]);
static inline void q6k_split_shifts(__m512i lo, __m512i hi, const q6k_consts *c, __m512i v[2]) {
    v[0] = _mm512_or_si512(_mm512_and_si512(lo, c->m4),
                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(hi, c->sh01), c->m2), 4));
    v[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), c->m4),
                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(hi, c->sh23), c->m2), 4));
}
static inline GFNI void q6k_split_gfni(__m512i lo, __m512i hi, const q6k_consts *c, __m512i v[2]) {
    v[0] = _mm512_ternarylogic_epi64(lo, c->m4, _mm512_gf2p8affine_epi64_epi8(hi, c->gf01, 0), 0xEA); /* a&b|c */
    v[1] = _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8(lo, c->gfhi, 0),
                           _mm512_gf2p8affine_epi64_epi8(hi, c->gf23, 0));
}

/* One q6_k block w against the token's block x, added to a row's lanes a->f. */
static inline __attribute__((always_inline)) void q6k_block(const void *consts, const uint8_t *w, const char *xb,
                                                            row_lanes *a, q6k_split_fn split,
                                                            pair_sums_fn add_pairs) {
    const q6k_consts *c = consts;
    const ms_q6_kx *x = (const ms_q6_kx *)xb;
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)(w + 192));
    const __m512i scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc8));
    const int8_t *qx = x->k.q;
    const int16_t *x32 = x->x32;
    __m512i acc = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        __m512i lo = _mm512_loadu_si512(w + 64 * h); /* chunks 4h, 4h + 1 */
        __m512i hi = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h)));
        __m512i v[2];
        split(lo, hi, c, v);
        for (int k = 0; k < 2; k++) { /* chunks 4h + 2k, 4h + 2k + 1 */
            int ch = 4 * h + 2 * k;
            __m512i p = _mm512_maddubs_epi16(v[k], _mm512_loadu_si512(qx + 32 * ch));
            p = _mm512_sub_epi16(p, _mm512_loadu_si512(x32 + 16 * ch));
            __m512i sc = _mm512_permutexvar_epi16(c->pair[2 * h + k], scales);
            acc = add_pairs(acc, p, sc);
            KEEP_IN_REGISTER(acc);
        }
    }
    __m256i t = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    a->f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(h2f(w + 208) * x->k.d), a->f);
}

static inline void q6k_block_avx512(const void *consts, const uint8_t *w, const char *xb, row_lanes *a) {
    q6k_block(consts, w, xb, a, q6k_split_shifts, madd_add);
}
/* The GFNI path (a CPU with VBMI, so with VNNI too) also adds the products by vpdpwssd (Zen 4, one thread in
 * L2: 1.04-1.05x). */
static inline VNNI_GFNI void q6k_block_gfni(const void *consts, const uint8_t *w, const char *xb, row_lanes *a) {
    q6k_block(consts, w, xb, a, q6k_split_gfni, dpwssd);
}

/* q6_k's one-token kernels: a tile (rows_one_stream) or a run of rows (rows_streams), the next tile
 * prefetched at most 8 KB ahead (next_tile_ahead). */
#define Q6K_KERNEL(name, target, driver, nrows_t, block) \
    ONE_TOKEN_KERNEL(name, target, driver, nrows_t, q6k_consts, q6k_make_consts, 210, ms_q6_kx, next_tile_ahead(m), \
                     block, q6_k_finish)
Q6K_KERNEL(dot4_q6_k_plain, , rows_one_stream, int, q6k_block_avx512)
Q6K_KERNEL(dot4_q6_k_gfni, VNNI_GFNI, rows_one_stream, int, q6k_block_gfni)
Q6K_KERNEL(rows_q6_k_plain, , rows_streams, int64_t, q6k_block_avx512)
Q6K_KERNEL(rows_q6_k_gfni, VNNI_GFNI, rows_streams, int64_t, q6k_block_gfni)

void ms_dot4_q6_k_avx512(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    (ms_use_gfni() ? dot4_q6_k_gfni : dot4_q6_k_plain)(m, row0, nrows, xp, out);
}

void ms_rows_q6_k_avx512(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out) {
    (ms_use_gfni() ? rows_q6_k_gfni : rows_q6_k_plain)(m, row0, nrows, xp, out);
}

typedef struct {
    __m512i pick[4]; /* byte shuffles: scale byte 2k to each int16 of the low half, 2k + 1 of the high, zero-extended */
    __m512i m4, shift, gf;
} q4k_consts;

static inline q4k_consts q4k_make_consts(void) {
    q4k_consts c;
    for (int k = 0; k < 4; k++)
        c.pick[k] = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)(0x8000 | (2 * k))),
                                            _mm512_set1_epi16((short)(0x8000 | (2 * k + 1))));
    c.m4 = _mm512_set1_epi8(0x0F);
    c.shift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    c.gf = _mm512_setr_epi64(GF_LOW4, GF_LOW4, GF_LOW4, GF_LOW4, GF_HIGH4, GF_HIGH4, GF_HIGH4, GF_HIGH4);
    return c;
}

/* A register of 32 q4_k bytes broadcast to both halves as nibbles: the low ones in the low half, the high
 * ones in the high half; by a shift and a mask, or by one GFNI affine bit map. */
typedef __m512i (*q4k_nibbles_fn)(__m512i v, const q4k_consts *c);
static inline __m512i q4k_nibbles_shift(__m512i v, const q4k_consts *c) {
    return _mm512_and_si512(_mm512_srlv_epi64(v, c->shift), c->m4);
}
static inline GFNI __m512i q4k_nibbles_gfni(__m512i v, const q4k_consts *c) {
    return _mm512_gf2p8affine_epi64_epi8(v, c->gf, 0);
}

/* One q4_k block w against the token's block x, added to a row's lanes a->f and min lanes a->fmin. The
 * scales are picked for each pair of sub-blocks by a byte shuffle from their 8 bytes in every qword, the
 * high byte of each int16 zeroed (Zen 4, one thread in L2, against a word permute of the widened scales:
 * 1.00-1.02x). */
static inline __attribute__((always_inline)) void q4k_block(const void *consts, const uint8_t *w, const char *xb,
                                                            row_lanes *a, pair_sums_fn add_pairs,
                                                            q4k_nibbles_fn nibbles) {
    const q4k_consts *c = consts;
    const ms_q8_kx *x = (const ms_q8_kx *)xb;
    uint64_t sc8, mn8;
    q4k_scale_bytes(w + 4, &sc8, &mn8);
    const __m128i mn = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn8));
    const __m512i scales = _mm512_set1_epi64((long long)sc8);
    __m512i acc = _mm512_setzero_si512();
    for (int k = 0; k < 4; k++) {
        __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 16 + 32 * k)));
        __m512i p = _mm512_maddubs_epi16(nibbles(v, c), _mm512_loadu_si512(x->q + 64 * k));
        acc = add_pairs(acc, p, _mm512_shuffle_epi8(scales, c->pick[k]));
        KEEP_IN_REGISTER(acc);
    }
    __m256i t = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    a->f = q4k_epilogue(w, x, mn, t, a->f, &a->fmin);
}

static inline void q4k_block_avx512(const void *consts, const uint8_t *w, const char *xb, row_lanes *a) {
    q4k_block(consts, w, xb, a, madd_add, q4k_nibbles_shift);
}

/* With vpdpwssd a block takes 4 of its ~55 instructions fewer (model-167 Xeon, one thread, 512x2048 in L2:
 * 24.1 -> 25.9 GB/s, 256x3072 23.8 -> 25.5). */
static inline VNNI void q4k_block_vnni(const void *consts, const uint8_t *w, const char *xb, row_lanes *a) {
    q4k_block(consts, w, xb, a, dpwssd, q4k_nibbles_shift);
}

/* With GFNI the nibbles take one instruction instead of two (Zen 4, one thread in L2: 2048x768, 4096x2048
 * and 768x2048 1.06-1.09x). */
static inline VNNI_GFNI void q4k_block_gfni(const void *consts, const uint8_t *w, const char *xb, row_lanes *a) {
    q4k_block(consts, w, xb, a, dpwssd, q4k_nibbles_gfni);
}

/* q4_k against one token: each 32 bytes of nibbles broadcast to both halves, the high half shifted, give
 * sub-blocks 2k (low nibbles) and 2k + 1 (high) against 64 consecutive activations, madd by the two
 * sub-blocks' scales; the halves are added at the end of the block: the lanes of ms_dot4_q4_k_avx2, and
 * its epilogue (q4k_block_vnni where the CPU has VNNI, q4k_block_gfni where it has GFNI too). The next tile
 * is prefetched (4 rows ahead). */
#define Q4K_KERNEL(name, target, driver, nrows_t, block) \
    ONE_TOKEN_KERNEL(name, target, driver, nrows_t, q4k_consts, q4k_make_consts, 144, ms_q8_kx, 4 * m->row_bytes, \
                     block, q4_k_finish)
Q4K_KERNEL(dot4_q4_k_plain, , rows_one_stream, int, q4k_block_avx512)
Q4K_KERNEL(dot4_q4_k_vnni, VNNI, rows_one_stream, int, q4k_block_vnni)
Q4K_KERNEL(dot4_q4_k_gfni, VNNI_GFNI, rows_one_stream, int, q4k_block_gfni)

void ms_dot4_q4_k_avx512(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const ms_dot4_fn f = ms_use_gfni() ? dot4_q4_k_gfni : ms_use_vnni() ? dot4_q4_k_vnni : dot4_q4_k_plain;
    f(m, row0, nrows, xp, out);
}

/* Xeon Sapphire Rapids, 2 threads, from memory, one -> four streams (kernels.py, alternate runs): q4_k
 * 4096x14336 65-72% -> 62-80% of the read, 7168x2048 69-71% -> 64-80%, 3584x3072 67-75% -> 69-77%; q6_k
 * 68-72% -> 96%, 68-76% -> 92-95%, 69-72% -> 77-85%. */
Q4K_KERNEL(rows_q4_k_plain, , rows_streams, int64_t, q4k_block_avx512)
Q4K_KERNEL(rows_q4_k_vnni, VNNI, rows_streams, int64_t, q4k_block_vnni)
Q4K_KERNEL(rows_q4_k_gfni, VNNI_GFNI, rows_streams, int64_t, q4k_block_gfni)

void ms_rows_q4_k_avx512(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out) {
    if (ms_use_gfni())
        rows_q4_k_gfni(m, row0, nrows, xp, out);
    else if (ms_use_vnni())
        rows_q4_k_vnni(m, row0, nrows, xp, out);
    else
        rows_q4_k_plain(m, row0, nrows, xp, out);
}

/* q2_k and q3_k with VNNI: a block's 64 bytes of 2-bit values (as tq2_0's) in one register, shifted by 2j,
 * put sub-blocks 2j, 2j + 1, 8 + 2j, 9 + 2j (of 16 values) in its four 128-bit lanes. k2k_acts is run j's
 * activations to match; vpdpbusd of a run's values u against them gives each lane four sums of 4 (|.| <=
 * 4 * 7 * 128); k2k_scaled packs two runs' sums to int16 and multiplies them by their sub-blocks' scales
 * (sc: the 16 scales as int16 in a register's low half; idx: k2k_index(h) for runs 2h, 2h + 1) by
 * vpdpwssd into exact int32 lanes. */
static inline __m512i k2k_acts(const ms_q8_kx *x, int j) { return _mm512_load_si512(x->q + 64 * j); }

/* The q8_k activations of q2_k, q3_k and tq2_0 (their AVX-512 slot): with VNNI in the k2k layout, run j's
 * 64 bytes (activations 32j..32j+31, then 128 + 32j..) at 64j, so that k2k_acts is one aligned load where
 * two loads and an insert were; bsums, bsums16 and sum as they are. Without VNNI (the AVX2 kernels) in
 * order. */
void ms_prep_x_q8_k_avx512(const float *x, int64_t n, float *xp) {
    ms_prep_x_q8_k_avx2(x, n, xp);
    if (!ms_use_vnni()) return;
    ms_q8_kx *b = (ms_q8_kx *)xp;
    for (int64_t i = 0; i < n / 256; i++) {
        const __m512i q0 = _mm512_load_si512(b[i].q), q1 = _mm512_load_si512(b[i].q + 64);
        const __m512i q2 = _mm512_load_si512(b[i].q + 128), q3 = _mm512_load_si512(b[i].q + 192);
        _mm512_store_si512(b[i].q, _mm512_shuffle_i64x2(q0, q2, 0x44)); /* 0..31, 128..159 */
        _mm512_store_si512(b[i].q + 64, _mm512_shuffle_i64x2(q0, q2, 0xEE));
        _mm512_store_si512(b[i].q + 128, _mm512_shuffle_i64x2(q1, q3, 0x44));
        _mm512_store_si512(b[i].q + 192, _mm512_shuffle_i64x2(q1, q3, 0xEE));
    }
}

static inline __m512i k2k_index(int h) { /* int16 k: run 2h + (k % 8 >= 4) of lane k / 8 */
    int16_t t[32];
    for (int k = 0; k < 32; k++) {
        const int L = k / 8, j = 2 * h + (k % 8 >= 4);
        t[k] = (int16_t)(2 * j + (L & 1) + 8 * (L >> 1));
    }
    return _mm512_loadu_si512(t);
}

static inline VNNI __m512i k2k_scaled(__m512i acc, __m512i u0, __m512i u1, const ms_q8_kx *x, int h, __m512i idx,
                                      __m512i sc) {
    const __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, k2k_acts(x, 2 * h));
    const __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u1, k2k_acts(x, 2 * h + 1));
    return _mm512_dpwssd_epi32(acc, _mm512_packs_epi32(s0, s1), _mm512_permutexvar_epi16(idx, sc));
}

/* q2_k with VNNI (ms_dot4_q2_k_scalar's sums; the mins as in AVX2). In cache, one thread, 1024x3072: 15.4
 * GB/s (the AVX2 kernel) -> 20.3. Four rows at a time as Q8K_ROWS4 (quant_int8_simd.h), the sums and the mins each
 * reduced by sums4_512: in L2 1.21-1.22x, from memory at two threads 1.19 / 1.16 / 1.10x (4096x14336 / 7168x2048 /
 * 3584x3072). Without VNNI the AVX2 kernel. q2_k_lanes: one block's lanes of scale * sum, and its 8 lanes of
 * mins * bsums. */
static inline VNNI __m512i q2_k_lanes(const uint8_t *w, const ms_q8_kx *x, const __m512i idx[2], __m512i *mins) {
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i s8 = _mm_loadu_si128((const __m128i *)w);
    const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(s8, low4)));
    const __m256i mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), low4));
    const __m512i v = _mm512_loadu_si512(w + 16);
    __m512i acc = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++)
        acc = k2k_scaled(acc, _mm512_and_si512(_mm512_srli_epi16(v, 4 * h), m3),
                         _mm512_and_si512(_mm512_srli_epi16(v, 4 * h + 2), m3), x, h, idx[h], sc);
    *mins = _mm512_castsi256_si512(_mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)x->bsums16)));
    return acc;
}

/* The exact sums of four vectors of int32 lanes a[0..3] into s[0..3] (integers: any order gives them). */
static inline VNNI void sums4_512(const __m512i a[4], int32_t s[4]) {
    /* t01: a[0]'s 256-bit halves added in its low half, a[1]'s in its high half; t23 likewise */
    const __m512i t01 = _mm512_add_epi32(_mm512_shuffle_i64x2(a[0], a[1], 0x44),
                                         _mm512_shuffle_i64x2(a[0], a[1], 0xEE));
    const __m512i t23 = _mm512_add_epi32(_mm512_shuffle_i64x2(a[2], a[3], 0x44),
                                         _mm512_shuffle_i64x2(a[2], a[3], 0xEE));
    __m512i u = _mm512_add_epi32(_mm512_shuffle_i64x2(t01, t23, 0x88), _mm512_shuffle_i64x2(t01, t23, 0xDD));
    u = _mm512_add_epi32(u, _mm512_shuffle_epi32(u, 0x4E));
    u = _mm512_add_epi32(u, _mm512_shuffle_epi32(u, 0xB1)); /* a[i]'s sum in lane 4i */
    _mm_storeu_si128((__m128i *)s, _mm512_castsi512_si128(_mm512_permutexvar_epi32(
                                       _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), u)));
}

static VNNI void q2_k_vnni(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const __m512i idx[2] = {k2k_index(0), k2k_index(1)};
#define Q2K_LANES(w, x, mins) q2_k_lanes(w, x, idx, mins)
    Q8K_ROWS4(84, 80, 82, __m512i, sums4_512, _mm512_reduce_add_epi32, Q2K_LANES, 0);
#undef Q2K_LANES
}

/* q3_k with VNNI (ms_dot4_q3_k_scalar's sums): u = the 2 low bits (as q2_k's) + 4 where the hmask bit is
 * set (hmask broadcast to both halves: run j's bit is j in the low half, 4 + j in the high one), signed
 * scales; the -4 comes off as 4 * sum of scale * sum(a) per 16, as in AVX2. In cache, one thread, 1024x3072:
 * 12.8 GB/s (the AVX2 kernel) -> 19.9. Without VNNI the AVX2 kernel. */
static inline VNNI __m512i q3_k_block_vnni(const uint8_t *w, const ms_q8_kx *x, const __m512i idx[2],
                                            const __m512i bit[4], __m512i *mins) {
    *mins = _mm512_setzero_si512(); /* none */
    const __m512i m3 = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
    const __m256i scn = _mm256_cvtepi8_epi16(q3k_scales(w + 96));
    const __m512i sc = _mm512_castsi256_si512(scn);
    const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)w));
    const __m512i v = _mm512_loadu_si512(w + 32);
    __m512i u[4];
    for (int j = 0; j < 4; j++) {
        const __m512i q = _mm512_and_si512(_mm512_srli_epi16(v, 2 * j), m3);
        u[j] = _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(hm, bit[j]), q, four);
    }
    __m512i acc = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) acc = k2k_scaled(acc, u[2 * h], u[2 * h + 1], x, h, idx[h], sc);
    /* less 4 * the sum of scale * bsum, as lanes: the lanes' sum is the block's */
    const __m256i bs = _mm256_madd_epi16(scn, _mm256_loadu_si256((const __m256i *)x->bsums16));
    return _mm512_sub_epi32(acc, _mm512_castsi256_si512(_mm256_slli_epi32(bs, 2)));
}

static VNNI void q3_k_vnni(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    const __m512i idx[2] = {k2k_index(0), k2k_index(1)};
    __m512i bit[4];
    for (int j = 0; j < 4; j++)
        bit[j] = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << j)), _mm256_set1_epi8((char)(1 << (4 + j))), 1);
#define Q3K_LANES(w, x, mins) q3_k_block_vnni(w, x, idx, bit, mins)
    Q8K_ROWS4(110, 108, 0, __m512i, sums4_512, _mm512_reduce_add_epi32, Q3K_LANES, 0);
#undef Q3K_LANES
}

VNNI_OR_AVX2(q3_k)
VNNI_OR_AVX2(q2_k)

/* tq2_0 with VNNI (ms_dot4_tq2_0_scalar's sums): the block's 64 bytes of 2-bit values in one register,
 * shifted by 0, 2, 4, 6, each run of 64 values against activations 32l..32l+31 (low half) and 128 + 32l..
 * (high half, k2k_acts), by vpdpbusd into exact int32 lanes. Without VNNI the AVX2 kernel. */
static inline VNNI __m512i tq2_0_block_vnni(const uint8_t *w, const ms_q8_kx *x, __m512i *mins) {
    *mins = _mm512_setzero_si512(); /* none */
    const __m512i v = _mm512_loadu_si512(w);
    __m512i acc = _mm512_setzero_si512();
    for (int l = 0; l < 4; l++)
        acc = _mm512_dpbusd_epi32(acc, _mm512_and_si512(_mm512_srli_epi16(v, 2 * l), _mm512_set1_epi8(3)),
                                  k2k_acts(x, l));
    return acc;
}

static VNNI void tq2_0_vnni(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    Q8K_ROWS4(66, 64, 0, __m512i, sums4_512, _mm512_reduce_add_epi32, tq2_0_block_vnni, -q8k_sum(xb));
}

/* tq1_0's trits of the bytes t (ms_dot4_tq1_0_avx2: [t > 85] + [t > 170], t the low byte of v * 3^j) in the
 * bytes of `lanes`, 0 elsewhere; times3_512, t * 3 mod 256 per byte. */
static inline VNNI __m512i trit512(__m512i t, __mmask64 lanes) {
    const __m512i one = _mm512_set1_epi8(1);
    const __m512i t1 = _mm512_maskz_mov_epi8(_mm512_mask_cmpgt_epu8_mask(lanes, t, _mm512_set1_epi8(85)), one);
    return _mm512_mask_add_epi8(t1, _mm512_mask_cmpgt_epu8_mask(lanes, t, _mm512_set1_epi8((char)170)), t1, one);
}

static inline VNNI __m512i times3_512(__m512i t) { return _mm512_add_epi8(t, _mm512_add_epi8(t, t)); }

/* tq1_0 with VNNI (ms_dot4_tq1_0_scalar's sums): the first 32 bytes broadcast to both halves, the high
 * half one trit on, give the runs of 32 values two at a time (trits 0-1, 2-3, 4) against 64 contiguous
 * activations; the next 16 broadcast to the four 128-bit lanes, lane L L trits on, give runs 0..3 of 16
 * at once (activations 160..223); their run 4 and the four runs of 4 of qh (byte k's trit j at 4j + k)
 * meet activations 224..255 in one 256-bit register; all by vpdpbusd into exact int32 lanes. One thread,
 * kernels.py: 5.3-6.2 GB/s (the AVX2 kernel) -> 7.7-8.0, two threads 12 -> 15 (a trit made by compares
 * into masks or by saturating subtractions: the same). Without VNNI the AVX2 kernel. */
static inline VNNI __m512i tq1_0_block_vnni(const uint8_t *w, const ms_q8_kx *x, __m512i *mins) {
    *mins = _mm512_setzero_si512(); /* none */
    const __mmask64 all = ~(__mmask64)0, low = 0xFFFFFFFFull, hi32 = ~low;
    const __mmask64 lanes123 = ~(__mmask64)0xFFFF, lanes23 = ~(__mmask64)0xFFFFFFFF, lane3 = ~(__mmask64)0xFFFFFFFFFFFFull;
    const int8_t *a = x->q;
    /* bytes 0..31: [v | 3 v], then 9 times that twice */
    __m512i t = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)w));
    t = _mm512_mask_add_epi8(t, hi32, t, _mm512_add_epi8(t, t));
    __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), trit512(t, all), _mm512_loadu_si512(a));
    t = times3_512(times3_512(t));
    acc = _mm512_dpbusd_epi32(acc, trit512(t, all), _mm512_loadu_si512(a + 64));
    t = times3_512(times3_512(t));
    acc = _mm512_dpbusd_epi32(acc, trit512(t, low), _mm512_loadu_si512(a + 128)); /* run 4 only */
    /* bytes 32..47: lane L holds v * 3^L */
    __m512i u = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(w + 32)));
    u = _mm512_mask_add_epi8(u, lanes123, u, _mm512_add_epi8(u, u));
    u = _mm512_mask_add_epi8(u, lanes23, u, _mm512_add_epi8(u, u));
    u = _mm512_mask_add_epi8(u, lane3, u, _mm512_add_epi8(u, u));
    acc = _mm512_dpbusd_epi32(acc, trit512(u, all), _mm512_loadu_si512(a + 160));
    /* run 4 of bytes 32..47 (v * 81) and qh (byte k's trit j at 4j + k) against activations 224..255 */
    const __m128i th = tq1_qh_bytes(w);
    const __m128i u81 = _mm512_extracti32x4_epi32(times3_512(u), 3);
    const __m512i tail = _mm512_castsi256_si512(_mm256_set_m128i(th, u81));
    const __m512i ta = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a + 224)));
    return _mm512_dpbusd_epi32(acc, trit512(tail, low), ta);
}

static VNNI void tq1_0_vnni(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    Q8K_ROWS4(54, 52, 0, __m512i, sums4_512, _mm512_reduce_add_epi32, tq1_0_block_vnni, -q8k_sum(xb));
}

VNNI_OR_AVX2(tq1_0)
VNNI_OR_AVX2(tq2_0)
