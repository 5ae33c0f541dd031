/* mxfp4's AVX-512 kernels, compiled once in each translation unit that includes this: with VNNI
 * (quant_int8_avx512.c, the nibbles looked up by vpshufb after masking) and with VNNI and VBMI
 * (quant_mxfp4_vbmi.c, by vpermb, which reads only the low six bits of each index, so that the 16-entry
 * table repeated four times needs no masks: ~+3-5% from memory on Zen 5). The includer defines MX_TARGET
 * (the target attribute of the functions that use vpdpbusd) and
 * mx_nibbles(v, lut, &ul, &uh): ul and uh, the doubled E2M1 values + 12 of the low and the high nibbles of
 * the 64 bytes v, from lut (those 16 values in each 128-bit lane). It gets mx_decode_rows, a run of rows
 * against one token for decode, and mx_prefill, a tile of rows against one token for prefill. */

/* ms_e8m0_half_lut[s] * xd for 16 E8M0 bytes s: vscalefps multiplies xd by 2^(s-128) exactly as the
 * product with the table's value rounds (both are powers of two, s = 0 and 1 the subnormals 2^-128 and
 * 2^-127; xd 0 or NaN stays so), in 6 instructions where building the table's values and multiplying
 * took 9; s = 255 takes the product with the table's NaN. With the lane offsets stored negated (noff), in
 * cache one thread: 8.1-8.4 -> 7.1-7.2 cycles a group of four blocks. */
static inline __m512 e8m0_scale16(__m128i s8, int32_t nan_bits, __m512 xd) {
    const __m512i s = _mm512_cvtepu8_epi32(s8);
    const __m512 e = _mm512_cvtepi32_ps(_mm512_sub_epi32(s, _mm512_set1_epi32(128)));
    return _mm512_mask_mul_ps(_mm512_scalef_ps(xd, e), _mm512_cmpeq_epi32_mask(s, _mm512_set1_epi32(255)),
                              _mm512_castsi512_ps(_mm512_set1_epi32(nan_bits)), xd);
}

/* The exact lane sums of four blocks (lane L of 128-bit lane c: block c's positions 4L..4L+3 and their
 * high-nibble twins) from the unsigned values k + 12 of the low nibbles (ul) and the high ones (uh) against
 * the three digits of the matching halves, as A0 * 2^14 + A1 * 2^7 + (A2 + noff), exact in int32; three
 * short chains rather than one long one. */
static inline MX_TARGET __m512i mx_quad(__m512i ul, __m512i uh, const __m512i p[6], __m512i noff) {
    const __m512i z = _mm512_setzero_si512();
    const __m512i a0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, ul, p[0]), uh, p[1]);
    const __m512i a1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, ul, p[2]), uh, p[3]);
    const __m512i a2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(noff, ul, p[4]), uh, p[5]);
    return _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(a0, 14), _mm512_slli_epi32(a1, 7)), a2);
}

/* mxfp4's four chains, one per 128-bit lane: lane L is (chain 0 + chain 1) + (chain 2 + chain 3), then
 * (lane 0 + lane 2) + (lane 1 + lane 3). */
static inline float finish4(__m512 acc) {
    acc = _mm512_add_ps(acc, _mm512_shuffle_f32x4(acc, acc, 0xB1)); /* 128-bit lanes 0+1 and 2+3 */
    acc = _mm512_add_ps(acc, _mm512_shuffle_f32x4(acc, acc, 0x4E)); /* (0+1) + (2+3) in lane 0 */
    __m128 f = _mm512_castps512_ps128(acc);
    f = _mm_add_ps(f, _mm_movehl_ps(f, f)); /* f0 + f2, f1 + f3 */
    return _mm_cvtss_f32(_mm_add_ss(f, _mm_movehdup_ps(f)));
}

/* mxfp4, R rows (R a constant, so the row loops unroll): for each group of 16 blocks, the 16 products
 * 2^(s-128) * d of every row at once; per group of four blocks, a row's 64 bytes split into low and high
 * nibbles (positions 0..15 and 16..31 of each block) become two registers of unsigned values, and three
 * short vpdpbusd chains (one per digit) over both against the group's activations (laid out to match,
 * quant_int8.h) give the four lanes of each block; block c of the group adds into 128-bit lane c of the
 * row's accumulator (the four chains of the canonical order), scaled by its own product.
 *
 * mx_group is one group of g blocks (4, or fewer in the last group) at block b of R rows, k = b - b0 in its
 * tile of 16; mx_rows runs the tiles. Each row's weights are loaded as its turn comes, once: loaded for
 * all R rows first, two of four were spilled to the stack and the others loaded twice (the shift's
 * operand from memory); four rows at once in cache, one thread, 7.2 -> 5.9 cycles a row's group of four
 * blocks, and prefill 7-13% faster. */
/* With four weight streams, how far each row's prefetch reaches (Xeon, one thread from memory, A/B: 256
 * bytes 0.92-0.93x of 512, 1024 1.05-1.09x, 2048 and 4096 as 1024). */
#define MX_STREAM_AHEAD 1024
static inline __attribute__((always_inline)) MX_TARGET void mx_group(const uint8_t *const w[8], const int R, int64_t b,
                                                                int k, int g, int64_t ahead, const int l2,
                                                                const int streams, const ms_mxfp4x *x,
                                                                const __m512i ulut, const __m512 dd[8],
                                                                __m512 acc[8]) {
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    /* block c's scale product in 128-bit lane c */
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(k), quad);
    /* The tile ahead_rows rows on, in address order: its R rows are contiguous, and a group takes 64 bytes of
     * each row, so R lines a group cover it by the end of this tile. Four rows at once, prefetched as four
     * streams (each row at the same column), ran at 78-86% of the read from memory (two threads,
     * 4096x14336, read ~45 GB/s) and one stream at 86-91%; one thread 69% -> 82%. Into L2 with l2. */
    if (streams) /* R rows far apart (four weight streams, mx_decode): each row's line MX_STREAM_AHEAD on */
        for (int r = 0; r < R; r++) prefetch_line(w[r] + MX_STREAM_AHEAD + 16 * b, 0);
    else
        for (int r = 0; r < R; r++) prefetch_line(w[0] + ahead + R * 16 * b + 64 * r, l2);
    int8_t *const q[3] = {x->p0 + 32 * b, x->p1 + 32 * b, x->p2 + 32 * b};
    __m512i p[6], noff;
    if (g == 4) {
        for (int i = 0; i < 3; i++) {
            p[2 * i] = _mm512_loadu_si512(q[i]);
            p[2 * i + 1] = _mm512_loadu_si512(q[i] + 64);
        }
        noff = _mm512_loadu_si512(x->noff + 4 * b);
    } else { /* the last, shorter group: its halves are 16 g bytes long */
        const __mmask64 kb = ((__mmask64)1 << (16 * g)) - 1;
        for (int i = 0; i < 3; i++) {
            p[2 * i] = _mm512_maskz_loadu_epi8(kb, q[i]);
            p[2 * i + 1] = _mm512_maskz_loadu_epi8(kb, q[i] + 16 * g);
        }
        noff = _mm512_maskz_loadu_epi32((__mmask16)((1u << (4 * g)) - 1), x->noff + 4 * b);
    }
    const __mmask16 lanes = g == 4 ? (__mmask16)0xFFFF : (__mmask16)((1u << (4 * g)) - 1);
    for (int r = 0; r < R; r++) {
        __m512i ul, uh, v = g == 4 ? _mm512_loadu_si512(w[r] + 16 * b)
                                   : _mm512_maskz_loadu_epi8(((__mmask64)1 << (16 * g)) - 1, w[r] + 16 * b);
        KEEP_IN_REGISTER(v);
        mx_nibbles(v, ulut, &ul, &uh);
        __m512 d = _mm512_permutexvar_ps(idx, dd[r]);
        acc[r] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(mx_quad(ul, uh, p, noff)), d, acc[r], lanes);
    }
}

static inline __attribute__((always_inline)) MX_TARGET void mx_rows(const ms_matrix *m, int64_t row0, const int R,
                                                               int64_t rs, const ms_mxfp4x *x, int64_t nb,
                                                               int64_t ahead_rows, const int l2, const int streams,
                                                               int32_t nan_bits, const __m512i ulut, float *out) {
    const uint8_t *w[8], *s[8];
    __m512 acc[8], dd[8];
    for (int r = 0; r < R; r++) { /* rows row0, row0 + rs, ...; out[0], out[rs], ... */
        w[r] = m->data + (row0 + r * rs) * m->row_bytes;
        s[r] = ms_mxfp4_scale_row(m, row0 + r * rs);
        acc[r] = _mm512_setzero_ps();
    }
    const int64_t ahead = ahead_rows * m->row_bytes; /* the weights and scales ahead_rows rows on */
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        int n = nb - b0 < 16 ? (int)(nb - b0) : 16;
        __mmask16 km = (__mmask16)((1u << n) - 1);
        __m512 xd = n == 16 ? _mm512_loadu_ps(x->d + b0) : _mm512_maskz_loadu_ps(km, x->d + b0);
        for (int r = 0; r < R; r++) {
            if (streams)
                prefetch_line(s[r] + b0 + 64, 0);
            else
                prefetch_line(s[r] + b0 + ahead_rows * nb, l2);
            __m128i s8 = n == 16 ? _mm_loadu_si128((const __m128i *)(s[r] + b0)) : _mm_maskz_loadu_epi8(km, s[r] + b0);
            dd[r] = e8m0_scale16(s8, nan_bits, xd);
        }
        if (n == 16) { /* a full tile, without the tail's branches, two groups an iteration: one thread
                        * from memory 24-27 -> 29-32 GB/s (one row at a time), two threads with the read at
                        * ~80 GB/s 7168x2048 45 -> 54 GB/s, with the read at ~50 the same; by four, one row
                        * from memory fell to 64% of the read (70% as before) */
#pragma GCC unroll 2
            for (int k = 0; k < 16; k += 4) mx_group(w, R, b0 + k, k, 4, ahead, l2, streams, x, ulut, dd, acc);
        } else {
            for (int k = 0; k < n; k += 4)
                mx_group(w, R, b0 + k, k, n - k < 4 ? n - k : 4, ahead, l2, streams, x, ulut, dd, acc);
        }
    }
    for (int r = 0; r < R; r++) out[r * rs] = finish4(acc[r]);
}

/* The doubled E2M1 values + 12 in each 128-bit lane (mx_nibbles' table), and the bits of the scale table's
 * NaN (E8M0 byte 255). */
static inline __m512i mx_consts(int32_t *nan_bits) {
    int8_t t[16];
    for (int i = 0; i < 16; i++) t[i] = (int8_t)(ms_e2m1_x2_lut[i] + 12);
    memcpy(nan_bits, &ms_e8m0_half_lut[255], sizeof *nan_bits);
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t));
}

/* A tile of nrows rows against one token: four rows at once, so that each activation load serves four
 * rows (a tail of fewer rows one at a time). Decode prefetches at least 16 KB ahead, prefill the next tile
 * only (no division per token). Decode had taken rows one at a time while a token's activations fit in L1
 * (up to 9024 columns), so that a row's weights stream in order, which won at the read of ~47 GB/s while
 * the four-row loop spilled two rows' weight vectors; since 061e041 four rows win (kernels.py at df17590,
 * A/B runs in turn): one thread 7168x2048 75-78 -> 81-83% of the read, 3584x3072 72-78 -> 83-88%, and two
 * threads with the read at ~75 GB/s 73 -> 77%. */
static inline __attribute__((always_inline)) MX_TARGET void mxfp4_tile(const ms_matrix *m, int64_t row0, int nrows,
                                                                  const float *xp, float *out, const int prefill,
                                                                  const int l2) {
    int64_t nb = m->cols / 32;
    ms_mxfp4x x = ms_mxfp4x_at(xp, nb);
    int32_t nan_bits;
    const __m512i ulut = mx_consts(&nan_bits);
    if (nrows == 4) {
        mx_rows(m, row0, 4, 1, &x, nb, prefill ? 4 : prefetch_rows(m->row_bytes, 4, 4), l2, 0, nan_bits, ulut, out);
        return;
    }
    const int64_t ahead_rows = prefill ? 4 : prefetch_rows(m->row_bytes, 1, 1);
    for (int r = 0; r < nrows; r++) mx_rows(m, row0 + r, 1, 1, &x, nb, ahead_rows, l2, 0, nan_bits, ulut, out + r);
}

/* Decode of a run of rows. A token whose activations pass MX_EIGHT_ROWS_BYTES (rows wider than 9024
 * columns) no longer fits in L1 beside the weights streaming in, and each activation line comes from L2:
 * there pairs of tiles are taken eight rows at once, so that each activation load serves eight rows. One
 * thread from memory, 4096x14336 (numpy's weights, on huge pages), seven A/B pairs against 43397ab: 80-85
 * -> 81-88% of the read, never less. In a C harness the gain moved with where the buffers lay (+9% at one
 * placement, none with random offsets). Narrower rows lose by it (harness: 7168x2048 -7%, 3584x3072
 * -10%) and run tile by tile. Each row's arithmetic is the same whatever the rows beside it, so the bits
 * are those of a tile alone. With l2 the prefetches go to L2 (ms_prefetch_into_l2).
 * With four weight streams (ms_weight_streams_for: Intel, and a small L1 for wide rows or long runs), the run is taken
 * as four runs of consecutive rows, a row of each four at a time, each row prefetched on its own line
 * MX_STREAM_AHEAD bytes on, as the q4_k, q6_k, q8_0 and int4 kernels read on Intel: Xeon (L1d 48 KB),
 * in-process A/B against four adjacent rows a tile, one / two threads from memory: 4096x14336 1.41 / 1.27x,
 * 7168x2048 1.20 / 1.17x, 3584x3072 1.25 / 1.25x, kernels.py 60-64% -> 77-83% of the read at two threads.
 * Eight runs instead of four: the same (0.95-1.02x). Not measured on Zen 4, whose rows past ~3400 columns
 * (a token's activations past 3/8 of its 32 KB L1) now take this path as well. */
#define MX_EIGHT_ROWS_BYTES 32768
static inline __attribute__((always_inline)) MX_TARGET void mx_decode(const ms_matrix *m, int64_t row0,
                                                                 int64_t nrows, const float *xp, float *out,
                                                                 const int l2) {
    const int64_t nb = m->cols / 32;
    int64_t r = 0;
    if (ms_weight_streams_for(nb * MS_MXFP4X_BYTES, nrows * m->row_bytes) == 4 && nrows >= 4) {
        ms_mxfp4x x = ms_mxfp4x_at(xp, nb);
        int32_t nan_bits;
        const __m512i ulut = mx_consts(&nan_bits);
        const int64_t q = nrows / 4;
        for (int64_t i = 0; i < q; i++) mx_rows(m, row0 + i, 4, q, &x, nb, 0, 0, 1, nan_bits, ulut, out + i);
        r = 4 * q;
    } else if (nb * MS_MXFP4X_BYTES > MX_EIGHT_ROWS_BYTES && nrows >= 8) {
        ms_mxfp4x x = ms_mxfp4x_at(xp, nb);
        int32_t nan_bits;
        const __m512i ulut = mx_consts(&nan_bits);
        const int64_t ahead_rows = prefetch_rows(m->row_bytes, 8, 8);
        for (; r + 8 <= nrows; r += 8)
            mx_rows(m, row0 + r, 8, 1, &x, nb, ahead_rows, l2, 0, nan_bits, ulut, out + r);
    }
    for (; r < nrows; r += 4) mxfp4_tile(m, row0 + r, nrows - r < 4 ? (int)(nrows - r) : 4, xp, out + r, 0, l2);
}

static MX_TARGET void mx_decode_rows(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out) {
    if (ms_prefetch_into_l2(16384)) /* decode prefetches at least 16 KB ahead */
        mx_decode(m, row0, nrows, xp, out, 1);
    else
        mx_decode(m, row0, nrows, xp, out, 0);
}

/* For prefill: four rows at once whatever their width; the tile is in cache after the first token, where
 * sharing each activation load among four rows beats streaming one row. */
static MX_TARGET void mx_prefill(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out) {
    mxfp4_tile(m, row0, nrows, xp, out, 1, 0);
}
