/* float32 products for prefill attention (see gemm_f32.h). The scalar loops are the definition: out[i, j]
 * = fma(a[i, k-1], b(k-1, j), ... fma(a[i, 0], b(0, j), 0)). The AVX2 and AVX-512 paths run the same chain
 * per element, vectorized across j (a tile of rows times a panel of 16 or 32 columns, each a of a row
 * broadcast against the panel's b), so every path gives the same bits. Against OpenBLAS pinned to its
 * Haswell kernels, one Zen 5 core: 512x128 @ 128x2048 126 -> ~195 GFLOPS. */
#include "gemm_f32.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "matmul.h"

/* Rows a tile takes at once (its accumulators: ROWS x 2 registers). */
#define ROWS 6

static void gemm_scalar(const float *a, const float *b, float *out, int64_t m, int64_t k, int64_t n, int tb) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            float s = 0.0f;
            for (int64_t t = 0; t < k; t++) s = fmaf(a[i * k + t], tb ? b[j * k + t] : b[t * n + j], s);
            out[i * n + j] = s;
        }
}

/* b's columns j0 .. j0 + w - 1 (w <= W) as a [k, W] panel, zero past w: for a transposed b, its rows. */
static void pack_panel(const float *b, int64_t k, int64_t n, int tb, int64_t j0, int64_t w, int W, float *panel) {
    for (int64_t t = 0; t < k; t++) {
        float *p = panel + t * W;
        for (int64_t j = 0; j < w; j++) p[j] = tb ? b[(j0 + j) * k + t] : b[t * n + j0 + j];
        for (int64_t j = w; j < W; j++) p[j] = 0.0f;
    }
}

/* The driver of an instruction set: b a panel of W columns at a time, packed once, against the rows in
 * tiles of ROWS and a shorter last tile. */
#define GEMM_DRIVER(name, target_isa, tile, W)                                                                     \
    __attribute__((target(target_isa))) static void name(const float *a, const float *b, float *out, int64_t m,    \
                                                         int64_t k, int64_t n, int tb, float *panel) {             \
        for (int64_t j0 = 0; j0 < n; j0 += W) {                                                                    \
            const int w = n - j0 < W ? (int)(n - j0) : W;                                                          \
            pack_panel(b, k, n, tb, j0, w, W, panel);                                                              \
            int64_t i = 0;                                                                                         \
            for (; i + ROWS <= m; i += ROWS) tile(a + i * k, panel, out + i * n + j0, k, n, w, ROWS);              \
            switch (m - i) {                                                                                       \
            case 5: tile(a + i * k, panel, out + i * n + j0, k, n, w, 5); break;                                   \
            case 4: tile(a + i * k, panel, out + i * n + j0, k, n, w, 4); break;                                   \
            case 3: tile(a + i * k, panel, out + i * n + j0, k, n, w, 3); break;                                   \
            case 2: tile(a + i * k, panel, out + i * n + j0, k, n, w, 2); break;                                   \
            case 1: tile(a + i * k, panel, out + i * n + j0, k, n, w, 1); break;                                   \
            default: break;                                                                                        \
            }                                                                                                      \
        }                                                                                                          \
    }

/* ---- AVX-512: panels of 32 columns ---- */

/* R rows (a constant) at a, against the [k, 32] panel; the first w columns go to out (row stride n). */
static inline __attribute__((always_inline, target("avx512f"))) void tile_avx512(const float *a, const float *panel,
                                                                                 float *out, int64_t k, int64_t n,
                                                                                 int w, const int R) {
    __m512 c[ROWS][2];
    for (int r = 0; r < R; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
    for (int64_t t = 0; t < k; t++) {
        const __m512 b0 = _mm512_loadu_ps(panel + 32 * t), b1 = _mm512_loadu_ps(panel + 32 * t + 16);
        for (int r = 0; r < R; r++) {
            const __m512 x = _mm512_set1_ps(a[r * k + t]);
            c[r][0] = _mm512_fmadd_ps(x, b0, c[r][0]);
            c[r][1] = _mm512_fmadd_ps(x, b1, c[r][1]);
        }
    }
    const __mmask16 m0 = w >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << w) - 1);
    const __mmask16 m1 = w >= 32 ? (__mmask16)0xFFFF : w <= 16 ? 0 : (__mmask16)((1u << (w - 16)) - 1);
    for (int r = 0; r < R; r++) {
        _mm512_mask_storeu_ps(out + r * n, m0, c[r][0]);
        _mm512_mask_storeu_ps(out + r * n + 16, m1, c[r][1]);
    }
}

GEMM_DRIVER(gemm_avx512, "avx512f", tile_avx512, 32)

/* ---- AVX2: panels of 16 columns ---- */

static inline __attribute__((always_inline, target("avx2,fma"))) void tile_avx2(const float *a, const float *panel,
                                                                                float *out, int64_t k, int64_t n,
                                                                                int w, const int R) {
    __m256 c[ROWS][2];
    for (int r = 0; r < R; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
    for (int64_t t = 0; t < k; t++) {
        const __m256 b0 = _mm256_loadu_ps(panel + 16 * t), b1 = _mm256_loadu_ps(panel + 16 * t + 8);
        for (int r = 0; r < R; r++) {
            const __m256 x = _mm256_set1_ps(a[r * k + t]);
            c[r][0] = _mm256_fmadd_ps(x, b0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(x, b1, c[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (w == 16) {
            _mm256_storeu_ps(out + r * n, c[r][0]);
            _mm256_storeu_ps(out + r * n + 8, c[r][1]);
        } else {
            float t[16];
            _mm256_storeu_ps(t, c[r][0]);
            _mm256_storeu_ps(t + 8, c[r][1]);
            memcpy(out + r * n, t, (size_t)w * sizeof(float));
        }
    }
}

GEMM_DRIVER(gemm_avx2, "avx2,fma", tile_avx2, 16)

int ms_gemm_f32(const float *a, const float *b, float *out, int64_t m, int64_t k, int64_t n, int transpose_b) {
    const ms_isa isa = ms_get_isa();
    if (isa == MS_ISA_SCALAR || m == 0 || n == 0) {
        gemm_scalar(a, b, out, m, k, n, transpose_b);
        return 0;
    }
    const int W = isa == MS_ISA_AVX512 ? 32 : 16;
    float *panel = malloc((size_t)(k > 0 ? k : 1) * W * sizeof(float));
    if (!panel) return -1;
    if (isa == MS_ISA_AVX512)
        gemm_avx512(a, b, out, m, k, n, transpose_b, panel);
    else
        gemm_avx2(a, b, out, m, k, n, transpose_b, panel);
    free(panel);
    return 0;
}
