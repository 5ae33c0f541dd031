/* Generator for the SIMD dot kernels of the float formats. Included by quant_float_avx2.c and
 * quant_float_avx512.c after they define:
 *   VEC, VZERO(), VFMA(a, b, c) = a*b + c, VLOADX(p), VSTORE(p, v), VW  = lanes per vector
 *   NV = MS_LANES / VW vectors per 16-element step
 *   LOAD_<FMT>(rowctx, i, w[NV])  the 16 weights starting at element i as f32 vectors
 * Each row keeps NV accumulators that together are the 16 canonical lanes; the tail is finished
 * with scalar fmaf on the same lanes, then ms_lanes_reduce, exactly as the scalar path. */

typedef struct {
    const uint8_t *p;   /* row start */
    const float *s;     /* fp8: this row's block scales */
    const uint8_t *s8;  /* mxfp4: this row's E8M0 scales */
} rowctx;

static inline rowctx row_at(const ms_matrix *m, int64_t row) {
    rowctx c;
    c.p = m->data + row * m->row_bytes;
    c.s = m->fmt == MS_FP8_E4M3_B128 ? ms_fp8_scale_row(m, row) : NULL;
    c.s8 = m->fmt == MS_MXFP4 ? ms_mxfp4_scale_row(m, row) : NULL;
    return c;
}

/* fp8 e4m3 bytes as f16 bits (sign << 8, the rest << 7) are their values times 2^-8, subnormals included,
 * so F16C and a multiply by 256 give the table's values exactly; a run holding a NaN byte (0x7f, 0xff)
 * takes the table instead (its NaNs' bits). One thread from memory, 4096x14336: 2.7 GB/s by gathers from
 * the table for every run. */
static inline int fp8_has_nan(__m128i b) { /* some byte with its low 7 bits set */
    const __m128i b80 = _mm_or_si128(b, _mm_set1_epi8((char)0x80)), ff = _mm_set1_epi8((char)0xFF);
#ifdef __AVX512BW__
    return _mm_cmpeq_epi8_mask(b80, ff) != 0; /* a compare into a mask (the AVX-512 file) */
#else
    return _mm_movemask_epi8(_mm_cmpeq_epi8(b80, ff));
#endif
}

static inline __m256i fp8_f16_bits(__m128i b) {
    /* the byte << 7 puts the rest at bits 7..13 and the sign at bit 14; adding bit 14 to itself carries the
     * sign to bit 15 and clears bit 14 (4 instructions where masking each part and or-ing them took 6) */
    const __m256i t = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 7);
    return _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)));
}

/* The 16 E2M1 nibbles of elements i..i+15 (i a multiple of 16), in element order, as doubled int8
 * values (exact small integers): one byte shuffle. */
static inline __m128i mxfp4_x2_int8(rowctx c, int64_t i) {
    __m128i b = _mm_loadl_epi64((const __m128i *)(c.p + i / 2));
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
    __m128i nib = _mm_unpacklo_epi8(lo, hi); /* element 2j = low nibble of byte j */
    return _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)ms_e2m1_x2_lut), nib);
}

/* Float kernels against one token: four rows at once; a 4-row tile of at most this many bytes prefetches
 * the next tile while it runs (one thread from memory, bf16 7168x2048: 21 -> 33 GB/s). Wider tiles do not:
 * the next tile is then too far ahead for L1 (f32 4096x14336: 37-39 -> 34 GB/s with it). */
#define MS_FLOAT_PREFETCH 24576

#define DEFINE_DOT_ONLY(NAME, ISA, LOADFN, ELEMFN)                                                       \
    void ms_dot4_##NAME##_##ISA(const ms_matrix *m, int64_t row0, int nrows, const float *x,         \
                                  float *out) {                                                     \
        const int64_t n = m->cols;                                                                  \
        const int64_t n16 = n & ~(int64_t)(MS_LANES - 1);                                          \
        if (nrows == 4) {                                                                           \
            rowctx c0 = row_at(m, row0), c1 = row_at(m, row0 + 1), c2 = row_at(m, row0 + 2),       \
                   c3 = row_at(m, row0 + 3);                                                        \
            VEC a0[NV], a1[NV], a2[NV], a3[NV];                                                     \
            for (int v = 0; v < NV; v++) a0[v] = a1[v] = a2[v] = a3[v] = VZERO();                  \
            /* a tile of up to 24 KB asks for the next one (its 4 rows contiguous) in address order, */ \
            /* eb lines a step; wider tiles leave it to the hardware prefetcher (MS_FLOAT_PREFETCH) */ \
            const uint8_t *next = m->data + (row0 + 4) * m->row_bytes;                               \
            const int64_t eb = 4 * m->row_bytes <= MS_FLOAT_PREFETCH ? m->row_bytes / n : 0;         \
            for (int64_t i = 0; i < n16; i += MS_LANES) {                                           \
                for (int64_t o = 0; o < 64 * eb; o += 64)                                           \
                    _mm_prefetch((const char *)(next + 4 * eb * i + o), _MM_HINT_T0);             \
                VEC xv[NV], w[NV];                                                                  \
                for (int v = 0; v < NV; v++) xv[v] = VLOADX(x + i + v * VW);                        \
                LOADFN(c0, i, w);                                                                   \
                for (int v = 0; v < NV; v++) a0[v] = VFMA(w[v], xv[v], a0[v]);                      \
                LOADFN(c1, i, w);                                                                   \
                for (int v = 0; v < NV; v++) a1[v] = VFMA(w[v], xv[v], a1[v]);                      \
                LOADFN(c2, i, w);                                                                   \
                for (int v = 0; v < NV; v++) a2[v] = VFMA(w[v], xv[v], a2[v]);                      \
                LOADFN(c3, i, w);                                                                   \
                for (int v = 0; v < NV; v++) a3[v] = VFMA(w[v], xv[v], a3[v]);                      \
            }                                                                                       \
            VEC *accs[4] = {a0, a1, a2, a3};                                                        \
            rowctx cs[4] = {c0, c1, c2, c3};                                                        \
            for (int r = 0; r < 4; r++) {                                                           \
                float lanes[MS_LANES];                                                              \
                for (int v = 0; v < NV; v++) VSTORE(lanes + v * VW, accs[r][v]);                    \
                for (int64_t i = n16; i < n; i++)                                                   \
                    lanes[i & (MS_LANES - 1)] = fmaf(ELEMFN(cs[r], i), x[i], lanes[i & (MS_LANES - 1)]); \
                out[r] = ms_lanes_reduce(lanes);                                                    \
            }                                                                                       \
            return;                                                                                 \
        }                                                                                           \
        for (int r = 0; r < nrows; r++) {                                                           \
            rowctx c = row_at(m, row0 + r);                                                         \
            VEC a[NV];                                                                              \
            for (int v = 0; v < NV; v++) a[v] = VZERO();                                            \
            for (int64_t i = 0; i < n16; i += MS_LANES) {                                           \
                VEC w[NV];                                                                          \
                LOADFN(c, i, w);                                                                    \
                for (int v = 0; v < NV; v++) a[v] = VFMA(w[v], VLOADX(x + i + v * VW), a[v]);       \
            }                                                                                       \
            float lanes[MS_LANES];                                                                  \
            for (int v = 0; v < NV; v++) VSTORE(lanes + v * VW, a[v]);                              \
            for (int64_t i = n16; i < n; i++)                                                       \
                lanes[i & (MS_LANES - 1)] = fmaf(ELEMFN(c, i), x[i], lanes[i & (MS_LANES - 1)]);    \
            out[r] = ms_lanes_reduce(lanes);                                                        \
        }                                                                                           \
    }

#define DEFINE_DEQUANT(NAME, ISA, LOADFN, ELEMFN)                                                  \
    void ms_dequant_##NAME##_##ISA(const ms_matrix *m, int64_t row, float *out) {                   \
        rowctx c = row_at(m, row);                                                                  \
        const int64_t n = m->cols;                                                                  \
        const int64_t n16 = n & ~(int64_t)(MS_LANES - 1);                                          \
        for (int64_t i = 0; i < n16; i += MS_LANES) {                                               \
            VEC w[NV];                                                                              \
            LOADFN(c, i, w);                                                                        \
            for (int v = 0; v < NV; v++) VSTORE(out + i + v * VW, w[v]);                            \
        }                                                                                           \
        for (int64_t i = n16; i < n; i++) out[i] = ELEMFN(c, i);                                    \
    }


#define DEFINE_DOT(NAME, ISA, LOADFN, ELEMFN) \
    DEFINE_DOT_ONLY(NAME, ISA, LOADFN, ELEMFN) DEFINE_DEQUANT(NAME, ISA, LOADFN, ELEMFN)

/* Scalar element accessors for the tails (shared by both ISAs). */
#define ELEM_F32(c, i) (((const float *)(c).p)[i])
#define ELEM_BF16(c, i) ms_bf16_to_f32(((const uint16_t *)(c).p)[i])
#define ELEM_F16(c, i) ms_f16_to_f32(((const uint16_t *)(c).p)[i])
#define ELEM_FP8(c, i) (ms_fp8_e4m3_lut[(c).p[i]] * (c).s[(i) / 128])
#define ELEM_MXFP4(c, i) (ms_e2m1_lut[((c).p[(i) / 2] >> (((i) & 1) * 4)) & 0xf] * ms_e8m0_lut[(c).s8[(i) / 32]])
