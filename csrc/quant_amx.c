/* q4_k and q6_k (at the end) against several tokens with AMX-INT8 (Xeon Sapphire Rapids and later): the tile
 * multiply-adds of 16 weight rows by 8 tokens at a time give every row and token the exact integer lane sums of the
 * canonical order (quant_int8.c), and the float epilogue is the decode kernel's, so the bits are those of
 * every other path.
 *
 * Canonical lane L of a block is sum_j sc_j * sum_{p < 4} q[j][4L + p] * x[32 j + 4L + p] over its 8
 * sub-blocks j. The scales go into the weights: for each row, lane L's 32 weights (4 of each sub-block)
 * become 32 int16 products sc_j * q (at most 63 * 15 = 945), those at the even positions first, then those
 * at the odd ones. The lanes go in pairs (2p, 2p + 1): a tile row of 64 bytes holds the low bytes of lane
 * 2p's 32 products, then those of lane 2p + 1's (the weight tile A_p: 16 rows x 64 bytes), and another the
 * high bytes (H_p). TDPBUSD multiplies those unsigned bytes by signed activation bytes four at a time; the
 * pair's activation tile B_p holds, for each of 8 tokens, x under lane 2p's bytes (zero under 2p + 1's) in
 * columns 0..7 and x under lane 2p + 1's in columns 8..15, so that A_p B_p + 256 H_p B_p holds the two
 * lanes' exact sums (|sum| <= 32 * 945 * 127 < 2^22), lane 2p's in columns t and 2p + 1's in 8 + t, as the
 * epilogue takes them. Each block then gets, per row and token, f[L] = fmaf(lane_L, d * d(x), f[L]) and the
 * mins' 4 lanes as in ms_dot4_q4_k_scalar; the rows' sums are reduced as there at the end. (Before, each
 * lane had a tile of its low and high bytes together against x under the low bytes in columns 0..7 and the
 * high in 8..15: the same tile products, but twice the activation tiles to lay out and load, and two
 * shuffles a lane pair to bring each lane's two halves together. Model-167 Xeon, one thread, 128 tokens:
 * 768x2048 / 2048x768 / 2048x4096 q4_k 1.24 / 1.17 / 1.24x, q6_k 1.21 / 1.19 / 1.21x.)
 *
 * A thread takes each of its runs of rows in one call (ms_matmul_many, which deals out prefill's rows in
 * runs of 16): the activation tiles of the tokens are laid out ~1 MB at a time (AMX_XBLOCKS), then 16 rows
 * at a time are turned into weight tiles and run against every group of 8 tokens laid out. When all the
 * groups fit at once, the thread keeps them for its next call in the same batch (ms_batch_serial): another
 * run of rows of the product, or a product of the same tokens, as an expert's gate and up. (Laid out anew at
 * every call, the runs of 1/32 of a batch that prefill deals out made the tokens' layout cost more than the
 * tiles on matrices of 768 rows; keeping it, two threads, 128 tokens: 768x2048 q4_k 1.28x, q6_k 2.03x.) It
 * is taken from 24 tokens and for rows of up to 4096 columns (ms_gemm_rows_q4_k_avx512, at the end): with fewer
 * tokens the weight tiles' layout (~40 cycles a row's block, once for every 8 tokens), the tile loads and stores
 * (a tile's load, tdpbusd and store ~40 cycles where tdpbusd alone takes 18) and the float epilogue cost more
 * than the VNNI gemm's arithmetic (768x2048 at 8 tokens: 0.78-0.83x). Overlapping a block's epilogue with the
 * next block's tiles was slower (0.75-0.91x). */
#define _GNU_SOURCE /* syscall */
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,amx-tile,amx-int8")
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "matmul.h"
#include "quant.h"
#include "quant_int8.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether this process may use the AMX tile registers (Linux asks each process to request them). */
int ms_amx_usable(void) {
    static int usable = -1;
    if (usable < 0) {
        unsigned a, b, c, d;
        __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        const int cpu = (d >> 24 & 1) && (d >> 25 & 1); /* AMX-TILE, AMX-INT8 */
        usable = cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return usable;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Every tile 16 rows of 64 bytes, loaded once per thread (the configuration is per thread). */
static _Thread_local int configured;
static void configure_tiles(void) {
    if (configured) return;
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
    _tile_loadconfig(&c);
    configured = 1;
}

/* The sub-block of position t (0..31) of a lane's 32 weights: t < 16 the low nibbles of the 4 pairs of
 * sub-blocks (0, 2, 4, 6), then the high ones (1, 3, 5, 7); its column in the sub-block is 4L + t % 4. */
static inline int chunk_of(int t) { return t < 16 ? 2 * (t / 4) : 2 * ((t - 16) / 4) + 1; }

typedef struct {
    int8_t a[4][2][16][64]; /* per lane pair, the weight tiles of the products' low [0] and high [1] bytes */
    float d[16], dmin[16];
    __m128i mn[16]; /* the 8 mins as int16 */
} amx_block;          /* one block of 16 rows */

typedef struct {
    int32_t b[4][16][16]; /* per lane pair, the activation tile (16 rows of 16 dwords) */
    __m512 dx2;            /* tokens' d(x) in floats t and 8 + t (0 beyond the group) */
    __m512 dx4[2];         /* token 4h + i's d(x) in floats 4i..4i+3 of [h] */
    __m512i bsums[2];      /* token 4h + i's 8 bsums in 128-bit lane i of [h] */
} amx_xblock;             /* one block of a group of 8 tokens */

static _Thread_local amx_block *wbuf;
static _Thread_local int64_t wcap;
static _Thread_local amx_xblock *xbuf;
static _Thread_local int64_t xcap;

static inline float h2f(const uint8_t *p) { return _cvtsh_ss((unsigned short)(p[0] | (p[1] << 8))); }

/* out[j] (16 dwords) = dword j of in[0..15], a 16 x 16 transpose of dwords, keeping dwords 0..7 of rows j < 8 and
 * dwords 8..15 of rows j >= 8 (the others zero). */
static inline void transpose16_halves(const __m512i in[16], int32_t out[16][16]) {
    __m512i t[16], u[16];
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_epi32(in[2 * k], in[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(in[2 * k], in[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) { /* u[4k + m], 128-bit lane c: column 4c + m of rows 4k..4k+3 */
        u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int m = 0; m < 4; m++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44);
        const __m512i v1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
        const __m512i w0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
        const __m512i w1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
        _mm512_storeu_si512(out[m], _mm512_maskz_shuffle_i32x4(0x00FF, v0, v1, 0x88));
        _mm512_storeu_si512(out[4 + m], _mm512_maskz_shuffle_i32x4(0x00FF, v0, v1, 0xDD));
        _mm512_storeu_si512(out[8 + m], _mm512_maskz_shuffle_i32x4(0xFF00, w0, w1, 0x88));
        _mm512_storeu_si512(out[12 + m], _mm512_maskz_shuffle_i32x4(0xFF00, w0, w1, 0xDD));
    }
}

/* The activation tiles of tokens [t0, t0 + n) (n <= 8) for every block. Row r of B_p: for r < 8, dword t
 * holds token t's x at lane 2p's positions 4r .. 4r + 3 (the weight tiles' order: even positions, then
 * odd) and dword 8 + t zero; for r >= 8, dword t zero and dword 8 + t token t's x at lane 2p + 1's
 * positions 4(r - 8) .. 4(r - 8) + 3. A token's bytes for lanes 2p and 2p + 1 are gathered by two byte
 * permutes and scattered into column t (and 8 + t) of each row. */
static void lay_out_tokens(const char *xp, int64_t stride, int64_t rec, int64_t t0, int n, int64_t nb, amx_xblock *xb) {
    int8_t gi[4][64]; /* lanes 2i, 2i + 1: the index into the block's 256 activations of each byte */
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < 64; k++) {
            const int L = 2 * i + k / 32, u = k % 32, t = u < 16 ? 2 * u : 2 * (u - 16) + 1;
            gi[i][k] = (int8_t)(32 * chunk_of(t) + 4 * L + t % 4); /* 0..255: bit 7 picks the upper half */
        }
    for (int64_t b = 0; b < nb; b++) {
        amx_xblock *o = &xb[b];
        float dx[8] = {0};
        int16_t bs[8][8];
        memset(bs, 0, sizeof bs);
        __m512i v[8][4]; /* token t's bytes of lanes 2i, 2i + 1 */
        for (int t = 0; t < 8; t++) {
            if (t < n) {
                const ms_q8_kx *x = (const ms_q8_kx *)(xp + (t0 + t) * stride + b * rec);
                dx[t] = x->d;
                memcpy(bs[t], x->bsums, sizeof bs[t]);
                const __m512i q0 = _mm512_loadu_si512(x->q), q1 = _mm512_loadu_si512(x->q + 64);
                const __m512i q2 = _mm512_loadu_si512(x->q + 128), q3 = _mm512_loadu_si512(x->q + 192);
                for (int i = 0; i < 4; i++) {
                    const __m512i idx = _mm512_loadu_si512(gi[i]);
                    const __m512i lo = _mm512_permutex2var_epi8(q0, idx, q1);
                    const __m512i hi = _mm512_permutex2var_epi8(q2, idx, q3);
                    v[t][i] = _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), lo, hi);
                }
            } else {
                v[t][0] = v[t][1] = v[t][2] = v[t][3] = _mm512_setzero_si512();
            }
        }
        for (int p = 0; p < 4; p++) {
            __m512i in[16]; /* [t] and [8 + t]: token t's bytes of lanes 2p (dwords 0..7) and 2p + 1 (8..15) */
            for (int t = 0; t < 8; t++) in[t] = in[8 + t] = v[t][p];
            transpose16_halves(in, o->b[p]);
        }
        float d2[16], d4[2][16];
        for (int t = 0; t < 8; t++) {
            d2[t] = d2[8 + t] = dx[t];
            for (int i = 0; i < 4; i++) d4[t / 4][4 * (t % 4) + i] = dx[t];
        }
        o->dx2 = _mm512_loadu_ps(d2);
        o->dx4[0] = _mm512_loadu_ps(d4[0]);
        o->dx4[1] = _mm512_loadu_ps(d4[1]);
        o->bsums[0] = _mm512_loadu_si512(bs[0]);
        o->bsums[1] = _mm512_loadu_si512(bs[4]);
    }
}

/* Row r of a lane pair's two weight tiles a[0] (low bytes) and a[1] (high bytes) from the pair's products as words:
 * e holds lane 2p's products at the even positions t (words 0..15) and lane 2p + 1's (16..31), od those at the odd
 * ones. Each tile row is lane 2p's 32 bytes, then lane 2p + 1's, each lane's in the order of the activation tiles:
 * the even positions, then the odd ones. */
static inline void split_bytes(__m512i e, __m512i od, int8_t a[2][16][64], int r) {
    /* byte j: word j % 16 of e's (j / 16 even) or od's half j / 32, its low byte (+ 1: the high one) */
    const __m512i lo = _mm512_setr_epi32(0x06040200, 0x0E0C0A08, 0x16141210, 0x1E1C1A18, 0x46444240, 0x4E4C4A48,
                                         0x56545250, 0x5E5C5A58, 0x26242220, 0x2E2C2A28, 0x36343230, 0x3E3C3A38,
                                         0x66646260, 0x6E6C6A68, 0x76747270, 0x7E7C7A78);
    const __m512i hi = _mm512_add_epi8(lo, _mm512_set1_epi8(1));
    _mm512_storeu_si512(a[0][r], _mm512_permutex2var_epi8(e, lo, od));
    _mm512_storeu_si512(a[1][r], _mm512_permutex2var_epi8(e, hi, od));
}

/* Rows [row0, row0 + nrows) (nrows <= 16) turned into weight tiles, block by block; rows past nrows are
 * zero. */
static void lay_out_rows(const ms_matrix *m, int64_t row0, int nrows, int64_t nb, amx_block *wb) {
    /* t0 dword 4L + s = qs dword 8s + L (L < 4), t1 the same for L = 4..7: lane L's 4 bytes of each of the
     * 4 pairs of sub-blocks, together */
    const __m512i tr0 = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
    const __m512i tr1 = _mm512_setr_epi32(4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31);
    /* lane L's 16 low-nibble bytes, then its 16 high-nibble ones, two lanes a register */
    const __m512i pr0 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i pr1 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    int8_t ie[64], io[64]; /* byte t of a lane: the scale of its sub-block at the even (ie) or odd (io) t */
    for (int i = 0; i < 64; i++) {
        const int t = i % 32, c = chunk_of(t);
        ie[i] = (int8_t)(t % 2 == 0 ? c : -128);
        io[i] = (int8_t)(t % 2 == 1 ? c : -128);
    }
    const __m512i sel_even = _mm512_loadu_si512(ie), sel_odd = _mm512_loadu_si512(io);
    for (int64_t b = 0; b < nb; b++) {
        amx_block *o = &wb[b];
        for (int r = 0; r < 16; r++) {
            if (r >= nrows) {
                for (int p = 0; p < 4; p++) memset(o->a[p][0][r], 0, 64), memset(o->a[p][1][r], 0, 64);
                o->d[r] = o->dmin[r] = 0.0f;
                o->mn[r] = _mm_setzero_si128();
                continue;
            }
            const uint8_t *w = m->data + (row0 + r) * m->row_bytes + b * 144;
            uint64_t sc8, mn8;
            q4k_scale_bytes(w + 4, &sc8, &mn8);
            o->mn[r] = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn8));
            o->d[r] = h2f(w);
            o->dmin[r] = h2f(w + 2);
            const __m512i scb = _mm512_set1_epi64((long long)sc8);
            const __m512i pe = _mm512_shuffle_epi8(scb, sel_even), po = _mm512_shuffle_epi8(scb, sel_odd);
            const __m512i v0 = _mm512_loadu_si512(w + 16), v1 = _mm512_loadu_si512(w + 80);
            const __m512i t[2] = {_mm512_permutex2var_epi32(v0, tr0, v1), _mm512_permutex2var_epi32(v0, tr1, v1)};
            for (int h = 0; h < 2; h++) {
                const __m512i lo = _mm512_and_si512(t[h], low4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(t[h], 4), low4);
                const __m512i p[2] = {_mm512_permutex2var_epi64(lo, pr0, hi), _mm512_permutex2var_epi64(lo, pr1, hi)};
                for (int k = 0; k < 2; k++) { /* lanes 4h + 2k and 4h + 2k + 1 */
                    const __m512i e = _mm512_maddubs_epi16(p[k], pe), od = _mm512_maddubs_epi16(p[k], po);
                    split_bytes(e, od, o->a[2 * h + k], r);
                }
            }
        }
    }
}

/* The 4 lane pairs' tiles of one block of 16 rows (a: the weight tiles) against one group of tokens, into c: per
 * pair, the low bytes' and the high bytes' products against the pair's activation tile. */
static inline void lane_tiles(const int8_t a[4][2][16][64], const amx_xblock *x, int32_t c[4][2][16][16]) {
    for (int p = 0; p < 4; p++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(4, x->b[p], 64);
        _tile_loadd(2, a[p][0], 64);
        _tile_loadd(3, a[p][1], 64);
        _tile_dpbusd(0, 2, 4);
        _tile_dpbusd(1, 3, 4);
        _tile_stored(0, c[p][0], 64);
        _tile_stored(1, c[p][1], 64);
    }
}

/* Row r's sums of lanes 2p (dwords t) and 2p + 1 (8 + t) from their tiles: lo + 256 hi. */
static inline __m512i lane_pair(const int32_t c[4][2][16][16], int r, int p) {
    const __m512i lo = _mm512_loadu_si512(c[p][0][r]), hi = _mm512_loadu_si512(c[p][1][r]);
    return _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 8));
}

/* ms_lanes8_reduce of 8 tokens' lanes at once (F[p]: lanes 2p in floats t, 2p + 1 in 8 + t): the same additions in
 * the same order. */
static inline __m256 lanes8_sum(const __m512 F[4]) {
    /* a: f0 + f4 (tokens t), f1 + f5 (8 + t); b: f2 + f6, f3 + f7; c: c0 and c1 */
    const __m512 a = _mm512_add_ps(F[0], F[2]), b = _mm512_add_ps(F[1], F[3]);
    const __m512 c = _mm512_add_ps(a, b);
    return _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
}

/* One block of the 16-row tile against one group of tokens: the 8 lanes' tiles, then each row's float
 * epilogue. F[r][p]: row r's running lanes 2p (floats t) and 2p + 1 (floats 8 + t); fmin[r][h]: tokens 4h..4h+3's
 * min lanes. */
static void block_times_group(const amx_block *w, const amx_xblock *x, int nrows, __m512 F[16][4], __m512 fmin[16][2]) {
    int32_t c[4][2][16][16];
    lane_tiles(w->a, x, c);
    for (int r = 0; r < nrows; r++) {
        const __m512 dd = _mm512_mul_ps(_mm512_set1_ps(w->d[r]), x->dx2);
        for (int p = 0; p < 4; p++) {
            const __m512i lane = lane_pair(c, r, p);
            F[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lane), dd, F[r][p]);
        }
        const __m512i mn = _mm512_broadcast_i32x4(w->mn[r]);
        const __m512 dmin = _mm512_set1_ps(w->dmin[r]);
        for (int h = 0; h < 2; h++) {
            const __m512i sm = _mm512_madd_epi16(mn, x->bsums[h]); /* token 4h + i: lanes 4i..4i+3 */
            fmin[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sm), _mm512_mul_ps(dmin, x->dx4[h]), fmin[r][h]);
        }
    }
}

/* Every row tile of [row0, row0 + nrows) against the groups [g0, g1) of 8 tokens laid out in xbuf. */
static void run_groups(const ms_matrix *m, int64_t row0, int64_t nrows, int64_t nb, int64_t g0, int64_t g1, int64_t T,
                       float *out, int64_t out_stride) {
    for (int64_t r0 = 0; r0 < nrows; r0 += 16) {
        const int nr = nrows - r0 < 16 ? (int)(nrows - r0) : 16;
        lay_out_rows(m, row0 + r0, nr, nb, wbuf);
        for (int64_t g = g0; g < g1; g++) {
            const int n = T - 8 * g < 8 ? (int)(T - 8 * g) : 8;
            __m512 F[16][4], fmin[16][2];
            for (int r = 0; r < nr; r++) {
                for (int p = 0; p < 4; p++) F[r][p] = _mm512_setzero_ps();
                fmin[r][0] = fmin[r][1] = _mm512_setzero_ps();
            }
            for (int64_t b = 0; b < nb; b++) block_times_group(&wbuf[b], &xbuf[(g - g0) * nb + b], nr, F, fmin);
            /* ms_lanes8_reduce of each token's 8 lanes, less ms_q4_k_min_reduce of its 4 min lanes: the same
             * additions in the same order, 8 tokens at once */
            const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
            for (int r = 0; r < nr; r++) {
                const __m256 sum = lanes8_sum(F[r]);
                __m512 mr[2];
                for (int h = 0; h < 2; h++) {
                    const __m512 mm = fmin[r][h], t2 = _mm512_add_ps(mm, _mm512_shuffle_ps(mm, mm, 0xB1));
                    mr[h] = _mm512_add_ps(t2, _mm512_shuffle_ps(t2, t2, 0xEE)); /* token 4h + i's in float 4i */
                }
                const __m512 mins = _mm512_permutex2var_ps(mr[0], pick, mr[1]);
                float res[8];
                _mm256_storeu_ps(res, _mm256_sub_ps(sum, _mm512_castps512_ps256(mins)));
                for (int t = 0; t < n; t++) out[(8 * g + t) * out_stride + r0 + r] = res[t];
            }
        }
    }
}

/* The activation tiles of at most this many blocks of groups of 8 tokens (~1 MB) are laid out at a time, so that
 * they stay in L2 while every row tile runs against them (with tiles of lanes one by one, 2048x4096 at 128 tokens,
 * all 16 groups' 2.1 MB at once: 0.87-0.88x the VNNI gemm; 64 tokens, 1.1 MB: 1.14-1.15x; with the tiles of lane
 * pairs a block of a group takes half the bytes, and 256 blocks, 2048x4096 at 128 tokens all at once, against
 * 128: q4_k 1.14x, q6_k 1.51x at two threads). */
#define AMX_XBLOCKS 256

/* ---- q6_k ------------------------------------------------------------------------------------------------
 * Canonical lane L of a q6_k block is sum over its 32 positions e (4 of each 32-value chunk) of
 * sc[e / 16] * (q[e] - 32) * x[e] (ms_dot4_q6_k_scalar). The products p = sc * (q - 32), at most 4096 in
 * magnitude, go into the weight tiles as p + 4096 (0..8192, an unsigned low byte and a high byte of at most 32),
 * in the order of the q4_k tiles (position t of a lane is e = 32 * chunk_of(t) + 4L + t % 4), so the activation
 * tiles are those of q4_k; lane L's sum is then its sum of the low and 256 times the high bytes' products (as for
 * q4_k) less 4096 * S_L(t), S_L being the sum of the lane's 32 activations of token t (|sum| <= 32 * 8192 * 127
 * < 2^25). */

typedef struct {
    int8_t a[4][2][16][64]; /* per lane pair, the weight tiles of the low [0] and high [1] bytes */
    float d[16];
} amx_block6;           /* one q6_k block of 16 rows */

static _Thread_local amx_block6 *wbuf6;
static _Thread_local int64_t wcap6;
static _Thread_local __m512i *corr6; /* [group's block][4]: 4096 * S of lanes 2p (dwords t), 2p + 1 (8 + t) */
static _Thread_local int64_t ccap6;

/* corr[4] of one block of a group of n tokens (records rec bytes apart, tokens stride apart) */
static void lane_sums(const char *xp, int64_t stride, int64_t rec, int64_t t0, int n, int64_t b, __m512i corr[4]) {
    int32_t c[4][16];
    memset(c, 0, sizeof c);
    for (int t = 0; t < n; t++) {
        const int8_t *q = ((const ms_q8_kx *)(xp + (t0 + t) * stride + b * rec))->q;
        for (int L = 0; L < 8; L++) {
            int32_t sum = 0;
            for (int k = 0; k < 8; k++)
                for (int i = 0; i < 4; i++) sum += q[32 * k + 4 * L + i];
            c[L / 2][8 * (L % 2) + t] = 4096 * sum;
        }
    }
    for (int p = 0; p < 4; p++) corr[p] = _mm512_loadu_si512(c[p]);
}

/* Rows [row0, row0 + nrows) (nrows <= 16) of q6_k turned into weight tiles, block by block; rows past nrows are
 * zero. */
static void lay_out_rows_q6(const ms_matrix *m, int64_t row0, int nrows, int64_t nb, amx_block6 *wb) {
    int8_t gi[4][64], se[2][64], so[2][64];
    for (int k = 0; k < 64; k++) {
        const int t = k % 32;
        for (int i = 0; i < 4; i++) { /* lanes 2i, 2i + 1: each position's index into the block's 256 values */
            const int L = 2 * i + k / 32;
            gi[i][k] = (int8_t)(32 * chunk_of(t) + 4 * L + t % 4);
        }
        for (int h = 0; h < 2; h++) { /* lanes 4h..4h+3: the scale of each position, at even (se) or odd (so) t */
            const int8_t idx = (int8_t)(2 * chunk_of(t) + h);
            se[h][k] = t % 2 == 0 ? idx : -128;
            so[h][k] = t % 2 == 1 ? idx : -128;
        }
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3), x32 = _mm512_set1_epi8(32);
    const __m512i base = _mm512_set1_epi16(4096);
    const __m512i sh01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1); /* words 0 / 2 */
    const __m512i sh23 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);   /* words 4 / 6 */
    for (int64_t b = 0; b < nb; b++) {
        amx_block6 *o = &wb[b];
        for (int r = 0; r < 16; r++) {
            if (r >= nrows) {
                for (int p = 0; p < 4; p++) memset(o->a[p][0][r], 0, 64), memset(o->a[p][1][r], 0, 64);
                o->d[r] = 0.0f;
                continue;
            }
            const uint8_t *w = m->data + (row0 + r) * m->row_bytes + b * 210;
            o->d[r] = h2f(w + 208);
            __m512i z[4]; /* the block's 256 values q (0..63) in order, 64 a register */
            for (int h = 0; h < 2; h++) {
                const __m512i ql = _mm512_loadu_si512(w + 64 * h);
                const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h)));
                const __m512i b01 = _mm512_and_si512(_mm512_srlv_epi16(qh, sh01), three);
                const __m512i b23 = _mm512_and_si512(_mm512_srlv_epi16(qh, sh23), three);
                z[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(b01, 4));
                const __m512i hi4 = _mm512_and_si512(_mm512_srli_epi16(ql, 4), low4);
                z[2 * h + 1] = _mm512_or_si512(hi4, _mm512_slli_epi16(b23, 4));
            }
            const __m512i scb = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(w + 192)));
            __m512i pe[2], po[2], oe[2], oo[2];
            for (int h = 0; h < 2; h++) {
                pe[h] = _mm512_shuffle_epi8(scb, _mm512_loadu_si512(se[h]));
                po[h] = _mm512_shuffle_epi8(scb, _mm512_loadu_si512(so[h]));
                oe[h] = _mm512_sub_epi16(base, _mm512_maddubs_epi16(x32, pe[h])); /* 4096 - 32 sc */
                oo[h] = _mm512_sub_epi16(base, _mm512_maddubs_epi16(x32, po[h]));
            }
            for (int i = 0; i < 4; i++) { /* lanes 2i and 2i + 1 */
                const __m512i idx = _mm512_loadu_si512(gi[i]);
                const __m512i lo = _mm512_permutex2var_epi8(z[0], idx, z[1]);
                const __m512i hi = _mm512_permutex2var_epi8(z[2], idx, z[3]);
                const __m512i p = _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), lo, hi);
                const int h = i / 2;
                const __m512i e = _mm512_add_epi16(_mm512_maddubs_epi16(p, pe[h]), oe[h]);
                const __m512i od = _mm512_add_epi16(_mm512_maddubs_epi16(p, po[h]), oo[h]);
                split_bytes(e, od, o->a[i], r);
            }
        }
    }
}

/* One q6_k block of the 16-row tile against one group of tokens: the 8 lanes' tiles, then each row's float
 * epilogue (F[r][p]: row r's running lanes 2p in floats t and 2p + 1 in floats 8 + t). */
static void block_times_group6(const amx_block6 *w, const amx_xblock *x, const __m512i corr[4], int nrows,
                               __m512 F[16][4]) {
    int32_t c[4][2][16][16];
    lane_tiles(w->a, x, c);
    for (int r = 0; r < nrows; r++) {
        const __m512 dd = _mm512_mul_ps(_mm512_set1_ps(w->d[r]), x->dx2);
        for (int p = 0; p < 4; p++) {
            const __m512i lane = _mm512_sub_epi32(lane_pair(c, r, p), corr[p]);
            F[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lane), dd, F[r][p]);
        }
    }
}

/* Every 16-row tile of [row0, row0 + nrows) against the groups [g0, g1) laid out in xbuf and corr6. */
static void run_groups_q6(const ms_matrix *m, int64_t row0, int64_t nrows, int64_t nb, int64_t g0, int64_t g1,
                          int64_t T, float *out, int64_t out_stride) {
    for (int64_t r0 = 0; r0 < nrows; r0 += 16) {
        const int nr = nrows - r0 < 16 ? (int)(nrows - r0) : 16;
        lay_out_rows_q6(m, row0 + r0, nr, nb, wbuf6);
        for (int64_t g = g0; g < g1; g++) {
            const int n = T - 8 * g < 8 ? (int)(T - 8 * g) : 8;
            __m512 F[16][4];
            for (int r = 0; r < nr; r++)
                for (int p = 0; p < 4; p++) F[r][p] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; b++)
                block_times_group6(&wbuf6[b], &xbuf[(g - g0) * nb + b], &corr6[4 * ((g - g0) * nb + b)], nr, F);
            for (int r = 0; r < nr; r++) {
                float res[8];
                _mm256_storeu_ps(res, lanes8_sum(F[r]));
                for (int t = 0; t < n; t++) out[(8 * g + t) * out_stride + r0 + r] = res[t];
            }
        }
    }
}

/* What xbuf (and corr6) hold: the token tiles of these prepared activations in the batch `batch` (0: none) */
typedef struct {
    uint64_t batch;
    const char *xp;
    int64_t stride, T, nb;
    int64_t q6;
} laid_out;
static _Thread_local laid_out laid;

/* q4_k (q6 0) or q6_k (q6 1) over the run of rows with AMX: the tokens laid out AMX_XBLOCKS blocks at a time (q6_k
 * with its lanes' activation sums), every 16-row tile run against each such run. */
static void gemm_rows_amx(int q6, const ms_matrix *m, int64_t row0, int64_t nrows, const char *xp, int64_t stride,
                          int64_t T, float *out, int64_t out_stride) {
    const int64_t nb = m->cols / 256, groups = (T + 7) / 8;
    const int64_t chunk = AMX_XBLOCKS / nb < 1 ? 1 : AMX_XBLOCKS / nb; /* groups laid out at a time */
    const int64_t blocks = (groups < chunk ? groups : chunk) * nb;
    const int64_t rec = q6 ? (int64_t)sizeof(ms_q6_kx) : (int64_t)sizeof(ms_q8_kx);
    const int ok = grow((void **)&xbuf, &xcap, blocks, sizeof(amx_xblock)) &&
                   (q6 ? grow((void **)&corr6, &ccap6, 4 * blocks, 64) &&
                             grow((void **)&wbuf6, &wcap6, nb, sizeof(amx_block6))
                       : grow((void **)&wbuf, &wcap, nb, sizeof(amx_block)));
    if (!ok) {
        laid = (laid_out){0}; /* a buffer may have been let go */
        ms_gemm_by_tiles(q6 ? ms_gemm_q6_k_avx512 : ms_gemm_q4_k_avx512, m, row0, nrows, xp, stride, T, out,
                         out_stride);
        return;
    }
    configure_tiles();
    /* all the groups at once: xbuf may hold them from this thread's last call in the batch (another run of rows of
     * this product, or a product of the same tokens) */
    const laid_out key = {ms_batch_serial(), xp, stride, T, nb, q6};
    const int whole = groups <= chunk, kept = whole && key.batch != 0 && memcmp(&key, &laid, sizeof key) == 0;
    laid = whole ? key : (laid_out){0};
    for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
        const int64_t g1 = groups - g0 < chunk ? groups : g0 + chunk;
        for (int64_t g = g0; g < g1 && !kept; g++) {
            const int n = T - 8 * g < 8 ? (int)(T - 8 * g) : 8;
            lay_out_tokens(xp, stride, rec, 8 * g, n, nb, &xbuf[(g - g0) * nb]);
            for (int64_t b = 0; q6 && b < nb; b++)
                lane_sums(xp, stride, rec, 8 * g, n, b, &corr6[4 * ((g - g0) * nb + b)]);
        }
        if (q6)
            run_groups_q6(m, row0, nrows, nb, g0, g1, T, out, out_stride);
        else
            run_groups(m, row0, nrows, nb, g0, g1, T, out, out_stride);
    }
}

/* Format q6 (0 q4_k, 1 q6_k) against T > 1 tokens over a run of rows: with AMX (gemm_rows_amx) from amx_from
 * tokens on rows of up to 4096 columns, where it beat the AVX-512 gemm; else that gemm tile by tile. */
static void amx_or_tiles(int q6, int64_t amx_from, const ms_matrix *m, int64_t row0, int64_t nrows, const char *xp,
                         int64_t stride, int64_t T, float *out, int64_t out_stride) {
    if (T >= amx_from && m->cols <= 4096 && ms_use_amx())
        gemm_rows_amx(q6, m, row0, nrows, xp, stride, T, out, out_stride);
    else
        ms_gemm_by_tiles(q6 ? ms_gemm_q6_k_avx512 : ms_gemm_q4_k_avx512, m, row0, nrows, xp, stride, T, out,
                         out_stride);
}

/* q4_k: AMX from 24 tokens (model-167 Xeon, one thread, against VNNI: 768x2048 at 8 tokens 0.78-0.83x, 16
 * 0.91-0.97x, 24 1.07x, 32 1.09x; at 128 tokens 4096x2048 1.10-1.17x, 512x2048 1.09-1.19x; 768x2048 at 256 / 512
 * tokens 1.20 / 1.19x; 2048x4096 at 24 / 64 / 128 / 256 tokens 1.05 / 1.15 / 1.11 / 1.10x once the tokens are laid
 * out ~1 MB at a time. With the lane pairs' tiles and the layout kept, two threads, 768x2048 / 2048x768: 8 tokens
 * 0.98 / 0.84x, 12 0.92 / 0.77x, 16 1.13 / 1.00x, 20 1.02 / 0.92x, 24 1.16 / 1.05x; q6_k at 12 tokens 1.05 /
 * 0.96x, 16 1.28 / 1.23x). */
void ms_gemm_rows_q4_k_avx512(const ms_matrix *m, int64_t row0, int64_t nrows, const char *xp, int64_t stride,
                              int64_t T, float *out, int64_t out_stride) {
    amx_or_tiles(0, 24, m, row0, nrows, xp, stride, T, out, out_stride);
}

/* q6_k: AMX from 16 tokens (model-167 Xeon, one thread, against the AVX-512 gemm: 2048x768 at 8 / 12 / 16 / 20 /
 * 24 / 128 tokens 0.95 / 1.01 / 1.17 / 1.13 / 1.33-1.38 / 1.74-1.78x, 512x2048 at 16 / 24 / 128 1.32 / 1.46 /
 * 1.63x, 2048x4096 at 24 / 128 / 256 1.60 / 1.58 / 2.39x). */
void ms_gemm_rows_q6_k_avx512(const ms_matrix *m, int64_t row0, int64_t nrows, const char *xp, int64_t stride,
                              int64_t T, float *out, int64_t out_stride) {
    amx_or_tiles(1, 16, m, row0, nrows, xp, stride, T, out, out_stride);
}
