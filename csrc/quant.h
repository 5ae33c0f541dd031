/* Weight formats: one row of the table per format.
 *
 * A weight matrix W is [rows, cols] (as stored in checkpoints: out x in). Each format stores a row as
 * consecutive blocks of `block` elements in `block_bytes` bytes; some formats also carry a separate
 * scale array (fp8 block scales). Every format provides, per instruction set:
 *   - dequant: one row to f32 (bit-exact across ISAs, tested against the numpy oracle);
 *   - dot4: up to 4 rows against one f32 vector.
 *
 * Canonical reduction order (so that scalar, AVX2 and AVX-512 agree bit for bit, and so that a row's
 * result never depends on the thread count or on how many tokens are in the batch): element i is
 * accumulated into lane (i mod 16) with a fused multiply-add, lanes are then added as a fixed tree
 * (lane j += lane j+8, then +4, +2, +1). */
#ifndef MOESTREAM_QUANT_H
#define MOESTREAM_QUANT_H

#include <stdint.h>

#define MS_LANES 16

typedef enum {
    MS_F32 = 0,
    MS_BF16 = 1,
    MS_F16 = 2,
    MS_FP8_E4M3_B128 = 3, /* e4m3 bytes with a f32 scale per 128x128 block (DeepSeek-V3 weight_scale_inv) */
    MS_MXFP4 = 4,         /* OCP MXFP4: E2M1 nibbles (low nibble = even column), one E8M0 byte per 32 */
    MS_Q8_0 = 5,          /* GGUF block formats, bit for bit as GGUF stores them */
    MS_Q4_K = 6,
    MS_Q6_K = 7,
    MS_Q3_K = 8,
    MS_Q2_K = 9,
    MS_TQ2_0 = 10,
    MS_TQ1_0 = 11,
    MS_INT4_G32 = 12,     /* compressed-tensors pack-quantized int4: nibble - 8, one f32 scale per 32 */
    MS_NUM_FORMATS
} ms_format;

typedef enum { MS_ISA_SCALAR = 0, MS_ISA_AVX2 = 1, MS_ISA_AVX512 = 2, MS_NUM_ISAS } ms_isa;

/* A weight matrix as the kernels see it. */
typedef struct {
    ms_format fmt;
    const uint8_t *data;  /* rows * row_bytes */
    const void *scales;   /* fp8: [ceil(rows/128), ceil(cols/128)] f32; mxfp4: [rows, cols/32] u8 */
    int64_t rows, cols;
    int64_t row_bytes;
} ms_matrix;

/* out[r] = dot(W[row0 + r, :], x) for r < nrows (nrows <= 4). */
typedef void (*ms_dot4_fn)(const ms_matrix *m, int64_t row0, int nrows, const float *x, float *out);
/* out[0:cols] = W[row, :] as f32. */
typedef void (*ms_dequant_fn)(const ms_matrix *m, int64_t row, float *out);
/* Some kernels want the activations in another order (or format); prep_x writes that form of
 * x[0:n] to xp[0:n] once per token, and dot4 then receives xp. NULL: dot4 takes x as it is. */
typedef void (*ms_prep_x_fn)(const float *x, int64_t n, float *xp); /* xp: prep_bytes per block */

/* out[t * out_stride + r] = dot4(W[row0 + r, :], token t) for r < nrows, t < T; the prepared activations
 * of token t start at xp + t * stride. The same numbers as dot4, faster when T > 1 (work per weight block
 * done once per tile instead of once per token). */
typedef void (*ms_gemm_fn)(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride, int64_t T,
                           float *out, int64_t out_stride);
/* out[r] = dot4(W[row0 + r, :], x) for r < nrows, any nrows: one token against a run of rows (whole tiles
 * but the matrix's last), with the same numbers as dot4 tile by tile, for kernels that gain from taking
 * more than four rows at once (mxfp4's wide rows: eight). */
typedef void (*ms_rows_fn)(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out);
/* A gemm over a run of rows (any nrows: a thread's share, whole tiles but the matrix's last), with the
 * numbers of ms_gemm_fn tile by tile, for kernels that gain from taking more than a tile at once (q4_k with
 * AMX: 16 rows). */
typedef void (*ms_gemm_rows_fn)(const ms_matrix *m, int64_t row0, int64_t nrows, const char *xp, int64_t stride,
                                int64_t T, float *out, int64_t out_stride);
/* A gemm that unpacks its tile once for all the tokens (q4_k, q6_k) over a run of rows, in tiles as large as
 * keep the unpacked tile near (csrc/matmul.c): the numbers of gemm tile by tile, whatever the tiles. */
void ms_gemm_by_tiles(ms_gemm_fn gemm, const ms_matrix *m, int64_t row0, int64_t nrows, const char *xp, int64_t stride,
                      int64_t T, float *out, int64_t out_stride);

typedef struct {
    const char *name;
    int block;       /* elements per block */
    int block_bytes; /* bytes per block */
    ms_dot4_fn dot4[MS_NUM_ISAS];
    ms_dequant_fn dequant[MS_NUM_ISAS];
    ms_prep_x_fn prep_x[MS_NUM_ISAS];
    int prep_bytes; /* bytes of prepared activations per block (0: 4 per element, as floats) */
    ms_gemm_fn gemm[MS_NUM_ISAS]; /* optional: a tile of rows against T > 1 tokens, as dot4 would do each */
    ms_rows_fn rows[MS_NUM_ISAS]; /* optional: a run of rows against one token, as dot4 would do each tile */
    ms_gemm_rows_fn gemm_rows[MS_NUM_ISAS]; /* optional: a run of rows against T > 1 tokens, as gemm would */
} ms_format_traits;

extern const ms_format_traits ms_formats[MS_NUM_FORMATS];

/* Shared helpers for the per-ISA files. */
float ms_lanes_reduce(const float lanes[MS_LANES]);
extern float ms_fp8_e4m3_lut[256]; /* filled by ms_quant_init() */
void ms_quant_init(void);

static inline float ms_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

float ms_f16_to_f32(uint16_t h);

/* E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} with bit 3 as the sign, as f32 and doubled as int8 (the
 * doubled values are exact small integers, which the SIMD paths look up with a byte shuffle). */
extern const float ms_e2m1_lut[16];
extern const int8_t ms_e2m1_x2_lut[16];
extern float ms_e8m0_lut[256];      /* 2^(s-127); 255 is NaN */
extern float ms_e8m0_half_lut[256]; /* 2^(s-128): pairs with the doubled nibble values */

/* tq1_0's trit j (0..4) of byte v, 0..2 (GGUF: five base-3 digits, most significant first, scaled to
 * 0..255): the low byte of v * 3^j, times 3, over 256. */
static inline int ms_tq1_trit(uint8_t v, int j) {
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    uint8_t t = (uint8_t)(v * pow3[j]);
    return (int)(((uint16_t)t * 3) >> 8);
}

/* The 2-bit value (0..3) of element e (0..255) of a 256-block's 64 bytes b, laid out as GGUF's tq2_0,
 * q2_k and q3_k lay them out: bytes 32 (e / 128) + e % 32, bits 2 ((e % 128) / 32). It is tq2_0's stored
 * value q (the weight is d * (q - 1)); ms_tq1_q is tq1_0's. */
static inline int ms_tq2_q(const uint8_t *b, int e) { return (b[32 * (e / 128) + e % 32] >> (((e % 128) / 32) * 2)) & 3; }
static inline int ms_tq1_q(const uint8_t *b, int e) {
    if (e < 160) return ms_tq1_trit(b[e % 32], e / 32);
    if (e < 240) return ms_tq1_trit(b[32 + (e - 160) % 16], (e - 160) / 16);
    return ms_tq1_trit(b[48 + (e - 240) % 4], (e - 240) / 4);
}

/* q3_k: the signed 6-bit scale of sub-block g (0..15) from the block's 12 scale bytes s, and element e's
 * 3-bit value plus 4 (0..7: the 2 low bits from qs, 4 when the hmask bit is set; the weight is d * scale *
 * (u - 4)). */
static inline int ms_q3_k_scale(const uint8_t *s, int g) {
    return (((s[g % 8] >> (4 * (g / 8))) & 0x0F) | (((s[8 + g % 4] >> (2 * (g / 4))) & 0x03) << 4)) - 32;
}
static inline int ms_q3_k_u(const uint8_t *hm, const uint8_t *qs, int e) {
    return ms_tq2_q(qs, e) + 4 * ((hm[e % 32] >> (e / 32)) & 1);
}

static inline const float *ms_fp8_scale_row(const ms_matrix *m, int64_t row) {
    int64_t ncb = (m->cols + 127) / 128;
    return (const float *)m->scales + (row / 128) * ncb;
}

static inline const float *ms_int4_scale_row(const ms_matrix *m, int64_t row) {
    return (const float *)m->scales + row * (m->cols / 32);
}

static inline const uint8_t *ms_mxfp4_scale_row(const ms_matrix *m, int64_t row) {
    return (const uint8_t *)m->scales + row * (m->cols / 32);
}

/* Per-format, per-ISA kernels: quant_float.c (scalar), quant_float_avx2.c, quant_float_avx512.c. */
#define MS_DECLARE_FORMAT(NAME, ISA)                                                            \
    void ms_dot4_##NAME##_##ISA(const ms_matrix *m, int64_t row0, int nrows, const float *x, float *out); \
    void ms_dequant_##NAME##_##ISA(const ms_matrix *m, int64_t row, float *out);
#define MS_DECLARE_ALL_ISAS(NAME) \
    MS_DECLARE_FORMAT(NAME, scalar) MS_DECLARE_FORMAT(NAME, avx2) MS_DECLARE_FORMAT(NAME, avx512)
MS_DECLARE_ALL_ISAS(f32)
MS_DECLARE_ALL_ISAS(bf16)
MS_DECLARE_ALL_ISAS(f16)
MS_DECLARE_ALL_ISAS(fp8)
void ms_dequant_mxfp4_scalar(const ms_matrix *m, int64_t row, float *out); /* products: quant_int8*.c */
void ms_dequant_mxfp4_avx2(const ms_matrix *m, int64_t row, float *out);
void ms_dequant_mxfp4_avx512(const ms_matrix *m, int64_t row, float *out);
void ms_prep_x_bf16_avx2(const float *x, int64_t n, float *xp);

/* The block formats (quant_blocks.c): one dequantizer for all ISAs. */
void ms_dequant_blocks(const ms_matrix *m, int64_t row, float *out);
/* Integer dot kernels (quant_int8*.c): the activations are prepared (quantized) by prep_x. */
void ms_prep_x_q8_0(const float *x, int64_t n, float *xp);
void ms_prep_x_q8_k(const float *x, int64_t n, float *xp);
void ms_prep_x_q6_k(const float *x, int64_t n, float *xp); /* q8_k + 32 * pair sums (quant_int8.h) */
void ms_prep_x_q6_k_avx2(const float *x, int64_t n, float *xp);
void ms_prep_x_q8_0_avx2(const float *x, int64_t n, float *xp); /* the same bytes, faster */
void ms_prep_x_q8_k_avx2(const float *x, int64_t n, float *xp);
void ms_prep_x_q8_k_avx512(const float *x, int64_t n, float *xp); /* q2_k, q3_k, tq2_0: the k2k layout with VNNI */
void ms_dot4_q8_0_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_q8_0_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_q8_0_avx512(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_rows_q8_0_avx512(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out);
void ms_rows_int4_avx512(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out);
void ms_dot4_q4_k_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_q4_k_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_gemm_q4_k_avx2(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride, int64_t T,
                       float *out, int64_t out_stride);
void ms_dot4_q4_k_avx512(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_rows_q4_k_avx2(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out);
void ms_rows_q4_k_avx512(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out);
void ms_gemm_q4_k_avx512(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride, int64_t T,
                         float *out, int64_t out_stride);
void ms_gemm_rows_q4_k_avx2(const ms_matrix *m, int64_t row0, int64_t nrows, const char *xp, int64_t stride,
                            int64_t T, float *out, int64_t out_stride);
void ms_gemm_rows_q6_k_avx2(const ms_matrix *m, int64_t row0, int64_t nrows, const char *xp, int64_t stride,
                            int64_t T, float *out, int64_t out_stride);
void ms_gemm_rows_q4_k_avx512(const ms_matrix *m, int64_t row0, int64_t nrows, const char *xp, int64_t stride,
                              int64_t T, float *out, int64_t out_stride);
void ms_gemm_rows_q6_k_avx512(const ms_matrix *m, int64_t row0, int64_t nrows, const char *xp, int64_t stride,
                              int64_t T, float *out, int64_t out_stride);
void ms_dot4_q6_k_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_q6_k_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_gemm_q6_k_avx2(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride, int64_t T,
                       float *out, int64_t out_stride);
void ms_dot4_q6_k_avx512(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_rows_q6_k_avx2(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out);
void ms_rows_q6_k_avx512(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out);
void ms_gemm_q6_k_avx512(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride, int64_t T,
                         float *out, int64_t out_stride);
void ms_prep_x_mxfp4(const float *x, int64_t n, float *xp);
void ms_prep_x_mxfp4_avx2(const float *x, int64_t n, float *xp); /* the same bytes, faster */
void ms_dot4_mxfp4_int_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_mxfp4_int_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_mxfp4_int_avx512(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out); /* the rows kernel */
void ms_gemm_mxfp4_avx512(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride, int64_t T,
                          float *out, int64_t out_stride); /* VNNI; else the AVX2 kernel token by token */
void ms_rows_mxfp4_int_avx512(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out);
/* The VNNI + VBMI kernels that ms_rows_mxfp4_int_avx512 (and through it ms_dot4_mxfp4_int_avx512) and
 * ms_gemm_mxfp4_avx512 run when ms_use_vbmi(): a run of rows against one token for decode, and a tile for
 * prefill. */
void ms_rows_mxfp4_vbmi(const ms_matrix *m, int64_t row0, int64_t nrows, const float *xp, float *out);
void ms_dot4_mxfp4_vbmi_prefill(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_tq2_0_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_tq2_0_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_tq2_0_avx512(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out); /* VNNI */
void ms_dot4_q3_k_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_q3_k_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_q3_k_avx512(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out); /* VNNI */
void ms_dot4_q2_k_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_q2_k_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_q2_k_avx512(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out); /* VNNI */
void ms_dot4_tq1_0_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_tq1_0_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_tq1_0_avx512(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out); /* VNNI */
void ms_prep_x_int4(const float *x, int64_t n, float *xp);
void ms_prep_x_int4_avx2(const float *x, int64_t n, float *xp);         /* the pair layout (quant_int8.h) */
void ms_prep_x_int4_nibbles_avx2(const float *x, int64_t n, float *xp); /* nibble order, as the scalar one */
void ms_prep_x_int4_avx512(const float *x, int64_t n, float *xp);       /* the layout its kernels read */
void ms_dequant_int4(const ms_matrix *m, int64_t row, float *out);
void ms_dot4_int4_scalar(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_int4_avx2(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out);
void ms_dot4_int4_avx512(const ms_matrix *m, int64_t row0, int nrows, const float *xp, float *out); /* VNNI */
void ms_gemm_int4_avx512(const ms_matrix *m, int64_t row0, int nrows, const char *xp, int64_t stride, int64_t T,
                         float *out, int64_t out_stride); /* VNNI; else the AVX2 kernel token by token */

#endif
