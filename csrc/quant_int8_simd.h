/* Shared by the AVX2 and AVX-512 integer kernels (both compile with AVX2 enabled): half-float reads,
 * q4_k scale unpacking, and the pieces of the several-token (gemm) kernels. */
#ifndef MOESTREAM_QUANT_INT8_SIMD_H
#define MOESTREAM_QUANT_INT8_SIMD_H
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "matmul.h"
#include "quant.h"
#include "quant_int8.h"

static inline float h2f(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }

/* The rows of a dot4 tile are short streams the hardware prefetcher picks up late; each kernel asks for
 * the same bytes of the row four rows ahead (the next tile) while it works on this one: into L1, or with
 * l2 (ms_prefetch_into_l2(ahead), asked once a kernel call) into L2 only. */
static inline void prefetch_ahead(const uint8_t *p, int64_t ahead, int nbytes, int l2) {
    for (int o = 0; o < nbytes; o += 64) prefetch_line(p + ahead + o, l2);
}

/* The same, no more than 8 KB ahead (q6_k's decode, against q6_k records; the low-bit formats' kernels, which read
 * four rows at once, ask four rows on whatever the width: Q8K_ROWS4): with a token's
 * activations (q6_k: 576 bytes per 256 columns, 32 KB at 14336) and a farther window, the lines prefetched
 * leave L1 before they are read (q6_k, one thread, 4096x14336 from memory: 47 KB ahead 20.5 GB/s, 10-16 KB
 * 23-25, 8 KB 30, 6 KB 31; 3584x3072, 10 KB -> 8 KB: 87-89% -> 91-93% of the read). */
static inline int64_t next_tile_ahead(const ms_matrix *m) { return 4 * m->row_bytes < 8192 ? 4 * m->row_bytes : 8192; }

/* The sum of the eight int32 lanes of v (exact). */
static inline int32_t sum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* q3_k's 16 signed scales (ms_q3_k_scale) from its 12 scale bytes: the low nibbles of bytes 0..7 then
 * their high nibbles, each with 2 bits of bytes 8..11 (shifted by 0, 2, 4, 6 for the four groups of 4). */
static inline __m128i q3k_scales(const uint8_t *s) {
    /* the 16 bytes ending at the block's end (2 before the scales, d after them), moved down by 2: a direct
     * load (a copy through the stack stalled every block on store forwarding: in cache 5.3 -> 12.2 GB/s) */
    const __m128i v = _mm_srli_si128(_mm_loadu_si128((const __m128i *)(s - 2)), 2), low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(v, low4), _mm_and_si128(_mm_srli_epi16(v, 4), low4));
    const __m128i top = _mm_shuffle_epi32(_mm_srli_si128(v, 8), 0); /* bytes 8..11 in each 32-bit lane */
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(top, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
}

/* The exact sums of four vectors of int32 lanes a[0..3] into s[0..3] (integers: any order gives them). */
static inline void sums4_256(const __m256i a[4], int32_t s[4]) {
    const __m256i u = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    _mm_storeu_si128((__m128i *)s, _mm_add_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}

/* The rows of a q8_k format whose block sum is one exact integer and one chain (tq2_0, tq1_0, q3_k), or two (q2_k:
 * its mins, over dmin): in a kernel with the dot4 parameters (m, row0, nrows, xp, out), for each row and each block
 * of BYTES bytes at w (against the activations xb), S = the sum of the block's integer lanes LANES(w, xb, &mins) (a
 * VEC) plus CORR_EXPR (an integer of the activations xb alone), and f = fmaf(S, d * d(x), f) in block order, d the
 * f16 at w + D_AT; with MIN_AT, also g = fmaf(sum of mins' lanes, dmin * d(x), g), dmin the f16 at w + MIN_AT, and
 * the row's result f - g.
 * Four rows go at a time: each block's activations serve the four, SUMS4(lanes[4], s[4]) reduces their sums
 * together where each block had its own horizontal reduction (REDUCE, still that of the rows past the last four),
 * and each row asks for its block four rows on (the next tile) with no 8 KB cap (next_tile_ahead's): on wide rows
 * 8 KB fell inside the four rows being read. Model-167 Xeon, VNNI, against one row at a time (kernels_ab.py,
 * 4096x14336 / 7168x2048 / 3584x3072, two threads from memory): q2_k 1.19 / 1.16 / 1.10x, q3_k 1.57 / 1.04 /
 * 1.33x, tq2_0 1.29 / 1.02 / 1.07x, tq1_0 1.14 / 1.11 / 1.13x; in L2, one thread, q2_k 1.21-1.22x, q3_k 1.21x,
 * tq2_0 1.23-1.25x; the AVX2 kernels in L2 1.09-1.16x. */
#define Q8K_ROWS4(BYTES, D_AT, MIN_AT, VEC, SUMS4, REDUCE, LANES, CORR_EXPR)                            \
    do {                                                                                                \
        const ms_q8_kx *x_ = (const ms_q8_kx *)xp;                                                      \
        const int64_t nb_ = m->cols / 256, ahead_ = 4 * m->row_bytes; /* the next four rows' block */  \
        const int l2_ = ms_prefetch_into_l2(ahead_);                                                    \
        int r_ = 0;                                                                                     \
        for (; r_ + 4 <= nrows; r_ += 4) {                                                              \
            const uint8_t *w0_ = m->data + (row0 + r_) * m->row_bytes;                                  \
            float f_[4] = {0.0f, 0.0f, 0.0f, 0.0f}, g_[4] = {0.0f, 0.0f, 0.0f, 0.0f};                   \
            for (int64_t b_ = 0; b_ < nb_; b_++) {                                                      \
                const ms_q8_kx *xb = &x_[b_];                                                           \
                const int32_t c_ = (CORR_EXPR);                                                         \
                VEC a_[4], mn_[4];                                                                      \
                int32_t s_[4], t_[4];                                                                   \
                for (int i_ = 0; i_ < 4; i_++) {                                                        \
                    const uint8_t *w = w0_ + i_ * m->row_bytes + b_ * (BYTES);                          \
                    prefetch_ahead(w, ahead_, (BYTES), l2_);                                            \
                    a_[i_] = LANES(w, xb, &mn_[i_]);                                                    \
                }                                                                                       \
                SUMS4(a_, s_);                                                                          \
                if (MIN_AT) SUMS4(mn_, t_);                                                             \
                for (int i_ = 0; i_ < 4; i_++) {                                                        \
                    const uint8_t *w = w0_ + i_ * m->row_bytes + b_ * (BYTES);                          \
                    f_[i_] = fmaf((float)(s_[i_] + c_), h2f(w + (D_AT)) * xb->d, f_[i_]);               \
                    if (MIN_AT) g_[i_] = fmaf((float)t_[i_], h2f(w + (MIN_AT)) * xb->d, g_[i_]);        \
                }                                                                                       \
            }                                                                                           \
            for (int i_ = 0; i_ < 4; i_++) out[r_ + i_] = f_[i_] - g_[i_];                              \
        }                                                                                               \
        for (; r_ < nrows; r_++) {                                                                      \
            const uint8_t *w = m->data + (row0 + r_) * m->row_bytes;                                    \
            float f1_ = 0.0f, g1_ = 0.0f;                                                               \
            for (int64_t b_ = 0; b_ < nb_; b_++, w += (BYTES)) {                                        \
                const ms_q8_kx *xb = &x_[b_];                                                           \
                prefetch_ahead(w, ahead_, (BYTES), l2_);                                                \
                VEC mn1_;                                                                               \
                const int32_t s1_ = REDUCE(LANES(w, xb, &mn1_)) + (CORR_EXPR);                          \
                f1_ = fmaf((float)s1_, h2f(w + (D_AT)) * xb->d, f1_);                                   \
                if (MIN_AT) g1_ = fmaf((float)REDUCE(mn1_), h2f(w + (MIN_AT)) * xb->d, g1_);            \
            }                                                                                           \
            out[r_] = f1_ - g1_;                                                                        \
        }                                                                                               \
    } while (0)

/* sum(a) over a q8_k block (made with its bsums by the preparation, once per token rather than per row:
 * tq2_0 with VNNI, with the k2k layout, one thread in L2: 1.27-1.30x with both). */
static inline int32_t q8k_sum(const ms_q8_kx *x) { return x->sum; }

/* tq1_0's qh (the block's bytes 48..51) as the 16 bytes whose trits 0 (t > 85 plus t > 170) are elements
 * 240..255: byte 4j + k is qh[k] * 3^j mod 256 (trit j of qh byte k is element 240 + 4j + k). */
static inline __m128i tq1_qh_bytes(const uint8_t *w) {
    uint32_t qh4;
    memcpy(&qh4, w + 48, 4);
    const __m128i h0 = _mm_set1_epi32((int)qh4), h1 = _mm_add_epi8(h0, _mm_add_epi8(h0, h0));
    const __m128i h2 = _mm_add_epi8(h1, _mm_add_epi8(h1, h1)), h3 = _mm_add_epi8(h2, _mm_add_epi8(h2, h2));
    return _mm_blend_epi32(_mm_blend_epi32(h0, h1, 0x2), _mm_blend_epi32(h2, h3, 0x8), 0xC);
}

/* The end of a q4_k block against one token (w: the block, acc: its exact lane sums): the lanes times
 * d * d(x) added to f, and dmin * d(x) times the 4 exact sums of mins * bsums (sub-blocks 2l, 2l + 1) to
 * the row's 4 min lanes. d and dmin are converted together. */
static inline __m256 q4k_epilogue(const uint8_t *w, const ms_q8_kx *x, __m128i mins, __m256i acc, __m256 f,
                                  __m128 *fmin) {
    __m128i ms = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)x->bsums));
    uint32_t h;
    memcpy(&h, w, 4);
    __m128 dd = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)h)), _mm_set1_ps(x->d)); /* d, dmin times d(x) */
    *fmin = _mm_fmadd_ps(_mm_cvtepi32_ps(ms), _mm_shuffle_ps(dd, dd, 0x55), *fmin);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_broadcastss_ps(dd), f);
}

/* ms_lanes8_reduce in registers, the same additions in the same order: (f0+f4 + f2+f6) + (f1+f5 + f3+f7). */
static inline float reduce8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* f0+f4, .., f3+f7 */
    __m128 c = _mm_add_ps(a, _mm_movehl_ps(a, a));                                   /* a0+a2, a1+a3 */
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

/* (l0 + l1) + (l2 + l3) of the 4 min lanes, as ms_q4_k_min_reduce */
static inline float q4k_min_reduce(__m128 m) {
    __m128 t = _mm_add_ps(m, _mm_shuffle_ps(m, m, 0xb1)); /* l0 + l1, -, l2 + l3, - */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehl_ps(t, t)));
}

/* q4k_scale_bytes widened to int16 */
static inline void q4k_scales_mins(const uint8_t *s, __m128i *sc, __m128i *mn) {
    uint64_t sc8, mn8;
    q4k_scale_bytes(s, &sc8, &mn8);
    *sc = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8));
    *mn = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn8));
}

/* A row's float lanes while its blocks are summed, for the decode drivers below (the AVX2 and AVX-512
 * kernels' blocks plug into them). */
typedef struct {
    __m256 f;
    __m128 fmin;
} row_lanes;

typedef void (*block_fn)(const void *consts, const uint8_t *w, const char *xb, row_lanes *a);
typedef float (*finish_fn)(row_lanes a);

/* Rows [row0, row0 + nrows) one after another against one token's prepared blocks xp (x_bytes each), each
 * block's bytes prefetched `ahead` bytes on. */
static inline __attribute__((always_inline)) void rows_one_stream(const ms_matrix *m, int64_t row0, int64_t nrows,
                                                                  const char *xp, float *out, int bytes,
                                                                  int x_bytes, int64_t ahead, block_fn block,
                                                                  finish_fn finish, const void *consts) {
    const int64_t nb = m->cols / 256;
    const int l2 = ms_prefetch_into_l2(ahead);
    for (int64_t r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        row_lanes a = {_mm256_setzero_ps(), _mm_setzero_ps()};
        for (int64_t b = 0; b < nb; b++, w += bytes) {
            prefetch_ahead(w, ahead, bytes, l2);
            block(consts, w, xp + b * x_bytes, &a);
        }
        out[r] = finish(a);
    }
}

/* The same rows with the same sums, read as ms_weight_streams_for() streams: with four, the run is taken as four
 * runs of consecutive rows whose blocks are read in turn, one block of each, each prefetched 4 blocks
 * ahead, so that four streams are in flight at once, which the prefetchers of Intel CPUs follow each on
 * its own, and each block of a wide row's activations serves four rows while it is in a small L1; the rows
 * left over (fewer than four) and the case of one stream as rows_one_stream. The AVX2 q4_k and q6_k kernels
 * too (Zen 3, L1d 32 KB, 4096x14336 from memory, kernels.py: two threads q4_k 78 -> 86% of the read, q6_k
 * 77 -> 90%; in-process A/B, one thread, q6_k 82-86 -> 96-108% of a one-stream read). */
static inline __attribute__((always_inline)) void rows_streams(const ms_matrix *m, int64_t row0, int64_t nrows,
                                                               const char *xp, float *out, int bytes, int x_bytes,
                                                               int64_t ahead, block_fn block, finish_fn finish,
                                                               const void *consts) {
    const int64_t nb = m->cols / 256;
    const int64_t q = ms_weight_streams_for(nb * x_bytes, nrows * m->row_bytes) == 4 ? nrows / 4 : 0;
    for (int64_t i = 0; i < q; i++) {
        const uint8_t *w[4];
        row_lanes a[4];
        for (int s = 0; s < 4; s++) {
            w[s] = m->data + (row0 + s * q + i) * m->row_bytes;
            a[s] = (row_lanes){_mm256_setzero_ps(), _mm_setzero_ps()};
        }
        for (int64_t b = 0; b < nb; b++) {
            for (int s = 0; s < 4; s++) {
                prefetch_ahead(w[s] + b * bytes, 4 * bytes, bytes, 0);
                block(consts, w[s] + b * bytes, xp + b * x_bytes, &a[s]);
            }
        }
        for (int s = 0; s < 4; s++) out[s * q + i] = finish(a[s]);
    }
    rows_one_stream(m, row0 + 4 * q, nrows - 4 * q, xp, out + 4 * q, bytes, x_bytes, ahead, block, finish, consts);
}

/* A q4_k row's sum from its lanes (the mins' share off), a q6_k row's. */
static inline float q4_k_finish(row_lanes a) { return reduce8(a.f) - q4k_min_reduce(a.fmin); }
static inline float q6_k_finish(row_lanes a) { return reduce8(a.f); }

/* q4_k against several tokens: each weight block of the tile is unpacked once (nibbles split, scales
 * widened, super-scales converted) into a per-thread buffer, then every token runs over the unpacked
 * tile with exactly the arithmetic of ms_dot4_q4_k_avx2. 320 bytes a block, so that the tile of a
 * 4096-column matrix (4 rows x 16 blocks) stays in L1 while the tokens pass over it. */
typedef struct {
    __m256i q[8]; /* sub-block j's 32 nibbles as bytes */
    __m128i sc;   /* the 8 scales as int16 (sub-block j's broadcast by a byte shuffle) */
    __m128i mn;   /* the 8 mins as int16 */
    float d, dmin;
    float pad[6];
} q4k_unpacked;

/* A gemm without memory for its buffers: the decode kernel token by token, four rows at a time (the same
 * numbers). */
static inline void dot4_per_token(ms_dot4_fn dot4, const ms_matrix *m, int64_t row0, int nrows, const char *xp,
                                  int64_t stride, int64_t T, float *out, int64_t out_stride) {
    for (int64_t t = 0; t < T; t++)
        for (int r0 = 0; r0 < nrows; r0 += 4) {
            const int n = nrows - r0 < 4 ? nrows - r0 : 4;
            float tmp[4];
            dot4(m, row0 + r0, n, (const float *)(xp + t * stride), tmp);
            for (int r = 0; r < n; r++) out[t * out_stride + r0 + r] = tmp[r];
        }
}

/* Calls FN(..., nrows, xp, stride, nt, out, out_stride), the leading arguments given after FN, for the
 * tokens of a gemm 4 at a time, then the last 1..3 together (nt a constant in each call, so the inlined
 * loops unroll). */
#define TOKEN_GROUPS(FN, ...)                                                                                  \
    do {                                                                                                       \
        int64_t t_ = 0;                                                                                        \
        for (; t_ + 4 <= T; t_ += 4)                                                                           \
            FN(__VA_ARGS__, nrows, xp + t_ * stride, stride, 4, out + t_ * out_stride, out_stride);            \
        switch (T - t_) {                                                                                      \
            case 3: FN(__VA_ARGS__, nrows, xp + t_ * stride, stride, 3, out + t_ * out_stride, out_stride); break; \
            case 2: FN(__VA_ARGS__, nrows, xp + t_ * stride, stride, 2, out + t_ * out_stride, out_stride); break; \
            case 1: FN(__VA_ARGS__, nrows, xp + t_ * stride, stride, 1, out + t_ * out_stride, out_stride); break; \
            default: break;                                                                                    \
        }                                                                                                      \
    } while (0)

/* Each thread's buffer of unpacked q4_k tiles (one per file that includes this header) */
static _Thread_local q4k_unpacked *q4k_buf;
static _Thread_local int64_t q4k_cap;

/* Asks for the rows [row0 + nrows, row0 + 2 nrows) of m (the next tile) while this one runs. With several
 * tokens a tile is unpacked in one burst and then computed on for longer than the hardware prefetcher
 * looks ahead: out of cache, one thread, q4_k 768x2048 at 8 tokens 175-185 -> 250 GOPS, 12 tokens 190 ->
 * 256, 128 tokens 302 -> 316. Below 6 tokens the tile is computed sooner than its successor arrives this way,
 * and the hardware prefetcher does better alone (4 tokens: 222-232 without, 200 with). */
static inline void prefetch_next_tile(const ms_matrix *m, int64_t row0, int nrows) {
    const int64_t r1 = row0 + 2 * nrows < m->rows ? row0 + 2 * nrows : m->rows;
    const uint8_t *end = m->data + r1 * m->row_bytes;
    for (const uint8_t *p = m->data + (row0 + nrows) * m->row_bytes; p < end; p += 64)
        _mm_prefetch((const char *)p, _MM_HINT_T0);
}

/* The body of a gemm (m, row0, nrows, xp, stride, T, out, out_stride) over a 256-block tile unpacked
 * once: this thread's buffer BUF (capacity CAP) grown to the tile, and EXTRA_OK (any further buffer, or 1),
 * else the decode kernel DOT4 token by token; the tile unpacked by UNPACK, the next one asked for (from 6
 * tokens), then TOKENS for the tokens in groups (TOKEN_GROUPS). */
#define GEMM_OVER_TILE(BUF, CAP, UNPACK, TOKENS, DOT4, EXTRA_OK)                                       \
    do {                                                                                           \
        int64_t nb = m->cols / 256;                                                                \
        if (!grow((void **)&BUF, &CAP, nrows * nb, sizeof(*BUF)) || !(EXTRA_OK)) {                 \
            dot4_per_token(DOT4, m, row0, nrows, xp, stride, T, out, out_stride);                  \
            return;                                                                                \
        }                                                                                          \
        UNPACK(m, row0, nrows, nb, BUF);                                                           \
        if (T >= 6) prefetch_next_tile(m, row0, nrows);                                            \
        TOKEN_GROUPS(TOKENS, BUF, nb);                                                             \
    } while (0)

/* The rows [row0, row0 + nrows) of a q4_k matrix unpacked block by block into buf[r * nb + b]. */
static inline void q4k_unpack_tile(const ms_matrix *m, int64_t row0, int nrows, int64_t nb, q4k_unpacked *buf) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        for (int64_t b = 0; b < nb; b++, w += 144) {
            q4k_unpacked *u = &buf[r * nb + b];
            q4k_scales_mins(w + 4, &u->sc, &u->mn);
            for (int k = 0; k < 4; k++) {
                __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * k));
                u->q[2 * k] = _mm256_and_si256(bytes, low4);
                u->q[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            }
            u->d = h2f(w);
            u->dmin = h2f(w + 2);
        }
    }
}

/* The 6-bit values (0..63) of q6_k chunks 4h..4h+3 (128 weights) of the block at w. */
static inline void q6k_values(const uint8_t *w, int h, __m256i q[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    __m256i ql0 = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
    __m256i ql1 = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
    __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
    q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
}

/* q6_k against several tokens: each weight block of the tile unpacked once (6-bit values as unsigned
 * bytes, scale pairs widened), then per token (v - 32) x as q x - 32 x: maddubs(q, x) - maddubs(32, x)
 * is the same int16 pair sum as the decode kernel's (no int16 overflow on either side), and the 32 x
 * half is made once per token for all the rows of the tile. */
typedef struct {
    __m256i q[8];  /* chunk c = 4h + k: 32 values 0..63 */
    __m256i sc;    /* the 16 scales as int16, even ones in the low lane: chunk c's pair is int16 c of both */
    float d;
    float pad[7];
} q6k_unpacked;

/* Each thread's buffer of unpacked q6_k tiles (one per file that includes this header) */
static _Thread_local q6k_unpacked *q6k_buf;
static _Thread_local int64_t q6k_cap;

/* The rows [row0, row0 + nrows) of a q6_k matrix unpacked block by block into buf[r * nb + b]. */
static inline void q6k_unpack_tile(const ms_matrix *m, int64_t row0, int nrows, int64_t nb, q6k_unpacked *buf) {
    const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int r = 0; r < nrows; r++) {
        const uint8_t *w = m->data + (row0 + r) * m->row_bytes;
        for (int64_t b = 0; b < nb; b++, w += 210) {
            q6k_unpacked *u = &buf[r * nb + b];
            __m256i scales =
                _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(w + 192)), even_odd));
            q6k_values(w, 0, u->q);
            q6k_values(w, 1, u->q + 4);
            u->sc = scales;
            u->d = h2f(w + 208);
        }
    }
}

#endif
