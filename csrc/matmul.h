#ifndef MOESTREAM_MATMUL_H
#define MOESTREAM_MATMUL_H
#include <stdint.h>

#include "quant.h"

void ms_init(void);
int ms_isa_supported(ms_isa isa);
ms_isa ms_get_isa(void);

/* The kernel paths one can choose: an instruction set, and with AVX-512 whether the integer kernels use
 * VNNI (vpdpbusd) or, as on an AVX-512 CPU without it, run their AVX2 versions; and with VNNI whether
 * mxfp4's use VBMI (vpermb) too. */
typedef enum {
    MS_LEVEL_SCALAR,
    MS_LEVEL_AVX2,
    MS_LEVEL_AVX512,
    MS_LEVEL_AVX512_VNNI,
    MS_LEVEL_AVX512_VBMI, /* VNNI and VBMI */
    MS_LEVEL_AMX,         /* and AMX-INT8 for q4_k's and q6_k's gemms of many tokens (quant_amx.c) */
    MS_NUM_LEVELS
} ms_level;
int ms_level_supported(ms_level level);
ms_level ms_get_level(void);
int ms_set_level(ms_level level); /* 0 on success, -1 if this CPU lacks it */
/* How many runs of rows a thread's decode kernels read at once, block by block in turn, where a format has
 * such a kernel (1 or 4; the same bits either way), for a token whose prepared activations take x_bytes
 * and a run of run_bytes of weights: as set, or automatically (the default, setting 0) 4 on Intel CPUs and,
 * where the L1 data cache is smaller than 48 KB, for the AVX2 kernels, and for the others for activations of
 * more than 3/8 of it or a run of ms_long_run_bytes() or more; else 1. */
int ms_weight_streams_for(int64_t x_bytes, int64_t run_bytes);
int64_t ms_long_run_bytes(void);
int ms_weight_streams(void);      /* the setting: 0 automatic, 1 or 4 */
int ms_set_weight_streams(int n); /* 0; -1 unless n is 0, 1 or 4 */
/* Where the decode kernels' software prefetches go: level 1, into L1; level 2 (the default where the L1
 * data cache is smaller than 48 KB), those reaching more than a quarter of the L1 ahead into L2 only
 * (ms_prefetch_into_l2, quant_int8.h). The same bits either way. */
/* q4_k's VNNI gemm: 1 when it pairs two sub-blocks' lane sums per vpdpwssd, 0 when it takes one (the same
 * bits either way); the setting 0 (automatic: one on Intel, two elsewhere), 1 or 2 */
int ms_q4k_pairs(void);
int ms_q4k_pairs_setting(void);
int ms_set_q4k_pairs(int n); /* 0; -1 unless n is 0, 1 or 2 */
int ms_prefetch_level(void);
int ms_set_prefetch_level(int level); /* 0; -1 unless level is 1 or 2 */
long ms_l1d_bytes(void);               /* the L1 data cache per core as the C library reports it; 0 unknown */
int ms_use_vnni(void);            /* the AVX-512 integer kernels take their VNNI paths */
int ms_use_vbmi(void);            /* and mxfp4's its VBMI path */
int ms_use_gfni(void);            /* and (at the VBMI level) GFNI's bit maps for splitting nibbles */
int ms_use_amx(void);             /* and q4_k's gemm of many tokens its AMX path */
int ms_amx_usable(void);          /* the CPU has AMX-INT8 and Linux lets this process use it */

/* The batch of products (one ms_matmul_many call) whose rows the calling thread is running: a number no other batch
 * of this process has had, so that a gemm may keep what it made of a batch's prepared activations (the AMX token
 * tiles) from one of its calls on that thread to the next. */
uint64_t ms_batch_serial(void);

/* out[t, r] = dot(W[r, :], x[t, :]) for t < T, r < rows; x is [T, cols], out is [T, rows]. Threads
 * split the rows; every element has the canonical reduction order, so the result does not depend on
 * nthreads or on T. */
/* 0, or -1 when the prepared activations cannot be allocated */
int ms_matmul(const ms_matrix *m, const float *x, int64_t T, float *out, int nthreads);

/* One product of a batch: out [T, rows] = x [T, cols] W^T. */
typedef struct {
    ms_matrix m;
    const float *x;
    int64_t T;
    float *out;
} ms_product;

/* n products in one parallel pass (the tiles of all of them shared out among the threads by weight
 * bytes times tokens), activations prepared once when several products take the same x. Each result
 * is bit for bit what ms_matmul gives for that product alone. 0, or -1 when out of memory. */
int ms_matmul_many(const ms_product *p, int n, int nthreads);
void ms_dequant(const ms_matrix *m, float *out, int nthreads);
/* out [H, cols] = for each h, sum over n < N of coef[h, n] * W[first + h * stride + n, :] (coef [H, N]): a
 * block of rows weighted and added (x^T W for each h, as MLA's absorbed decode needs), each row dequantized
 * by its format's kernel, one fused multiply-add chain per element in n order; the same bits on every
 * instruction set and thread count. 0, or -1 when out of memory. */
int ms_combine_rows(const ms_matrix *m, int64_t first, int64_t stride, int H, int N, const float *coef, float *out,
                    int nthreads);
/* out [H, V]: out[h] = x[h] @ W[first + h * stride : ... + V]^T (x [H, cols]), H products of one token in one
 * pass of the kernels, each row with the bits of the whole matrix's product. 0; -1 when out of memory; -2
 * when fp8's 128-row scale blocks do not line up with the blocks of rows. */
int ms_block_rows_matmul(const ms_matrix *m, int64_t first, int64_t stride, int H, int V, const float *x, float *out,
                         int nthreads);
/* out [T, width]: out[t] = ys[rows[t, 0]] * w[t, 0] + ys[rows[t, 1]] * w[t, 1] + ... (rows, w [T, k]; ys [N,
 * width]), each multiply and add a float32 operation of its own, in top-k order: a MoE layer's sum of its
 * experts' outputs, as numpy computes it. Threads split the tokens (csrc/moe_combine.c). */
void ms_moe_combine(const float *ys, int64_t width, const int64_t *rows, const float *w, int64_t T, int k, float *out,
                    int nthreads);
/* One token x [cols] through n experts of SwiGLU shape, m [3n] their matrices expert by expert (gate_i and
 * up_i [inner, cols], down_i [width, inner]): y_i = down_i (silu(gate_i x) * up_i x), the gate and up
 * products of all of them in one pass of ms_matmul_many (x prepared once), ms_silu_mul over all, then the
 * down products in one pass. With w (n coefficients) out [width] = y_0 * w[0] + y_1 * w[1] + ..., summed as
 * ms_moe_combine does; without (NULL) out [n, width] holds the y_i. Each product has the bits of ms_matmul
 * alone (csrc/moe_decode.c). 0, or -1 when out of memory. */
int ms_glu_experts_one_x(const ms_matrix *m, int n, const float *x, const float *w, float *out, int nthreads);
/* Reads n bytes as a memory bandwidth baseline, each thread its share as `streams` runs read 256 bytes from
 * each in turn (1..64); returns the sum over threads of the low 16 bits of the XOR of their share's 8-byte
 * words (the bytes past the last whole word XORed in alone), the same for any `streams`. */
double ms_memread(const uint8_t *p, int64_t n, int nthreads, int streams);
#endif
