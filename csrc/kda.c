/* Kimi Delta Attention's recurrence (see kda.h). The scalar loop is the definition; the AVX2 and AVX-512
 * paths take the value dimension in chunks of registers (64 and 128 columns) and run, per element, the
 * same multiplies and fused multiply-adds in the same order: a column's u, d, update and output depend on
 * that column alone, so chunking the columns leaves every element's arithmetic as it is. */
#include "kda.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include "matmul.h"
#include "threadpool.h"

/* Columns [c0, c1) of one head's state s [D, D] for one token: decay and predict (u), then update and
 * read out. u is [D] scratch, which then holds d. */
static void token_scalar(float *s, const float *q, const float *k, const float *v, const float *alpha, float beta,
                         float *out, int D, int c0, int c1, float *u) {
    for (int j = c0; j < c1; j++) u[j] = 0.0f;
    for (int i = 0; i < D; i++) {
        float *row = s + (int64_t)i * D;
        for (int j = c0; j < c1; j++) {
            row[j] = row[j] * alpha[i];
            u[j] = fmaf(k[i], row[j], u[j]);
        }
    }
    for (int j = c0; j < c1; j++) {
        u[j] = (v[j] - u[j]) * beta; /* d */
        out[j] = 0.0f;
    }
    for (int i = 0; i < D; i++) {
        float *row = s + (int64_t)i * D;
        for (int j = c0; j < c1; j++) {
            row[j] = fmaf(k[i], u[j], row[j]);
            out[j] = fmaf(q[i], row[j], out[j]);
        }
    }
}

/* 128 columns from c0 (eight registers), on AVX-512. */
__attribute__((target("avx512f"))) static void chunk_avx512(float *s, const float *q, const float *k, const float *v,
                                                            const float *alpha, float beta, float *out, int D,
                                                            int c0) {
    __m512 u[8], o[8];
    for (int r = 0; r < 8; r++) u[r] = _mm512_setzero_ps();
    for (int i = 0; i < D; i++) {
        float *row = s + (int64_t)i * D + c0;
        const __m512 a = _mm512_set1_ps(alpha[i]), ki = _mm512_set1_ps(k[i]);
        for (int r = 0; r < 8; r++) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * r), a);
            _mm512_storeu_ps(row + 16 * r, x);
            u[r] = _mm512_fmadd_ps(ki, x, u[r]);
        }
    }
    const __m512 b = _mm512_set1_ps(beta);
    for (int r = 0; r < 8; r++) {
        u[r] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + c0 + 16 * r), u[r]), b); /* d */
        o[r] = _mm512_setzero_ps();
    }
    for (int i = 0; i < D; i++) {
        float *row = s + (int64_t)i * D + c0;
        const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
        for (int r = 0; r < 8; r++) {
            const __m512 x = _mm512_fmadd_ps(ki, u[r], _mm512_loadu_ps(row + 16 * r));
            _mm512_storeu_ps(row + 16 * r, x);
            o[r] = _mm512_fmadd_ps(qi, x, o[r]);
        }
    }
    for (int r = 0; r < 8; r++) _mm512_storeu_ps(out + c0 + 16 * r, o[r]);
}

/* 64 columns from c0 (eight registers), on AVX2. */
__attribute__((target("avx2,fma"))) static void chunk_avx2(float *s, const float *q, const float *k, const float *v,
                                                           const float *alpha, float beta, float *out, int D, int c0) {
    __m256 u[8], o[8];
    for (int r = 0; r < 8; r++) u[r] = _mm256_setzero_ps();
    for (int i = 0; i < D; i++) {
        float *row = s + (int64_t)i * D + c0;
        const __m256 a = _mm256_set1_ps(alpha[i]), ki = _mm256_set1_ps(k[i]);
        for (int r = 0; r < 8; r++) {
            const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(row + 8 * r), a);
            _mm256_storeu_ps(row + 8 * r, x);
            u[r] = _mm256_fmadd_ps(ki, x, u[r]);
        }
    }
    const __m256 b = _mm256_set1_ps(beta);
    for (int r = 0; r < 8; r++) {
        u[r] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + c0 + 8 * r), u[r]), b); /* d */
        o[r] = _mm256_setzero_ps();
    }
    for (int i = 0; i < D; i++) {
        float *row = s + (int64_t)i * D + c0;
        const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
        for (int r = 0; r < 8; r++) {
            const __m256 x = _mm256_fmadd_ps(ki, u[r], _mm256_loadu_ps(row + 8 * r));
            _mm256_storeu_ps(row + 8 * r, x);
            o[r] = _mm256_fmadd_ps(qi, x, o[r]);
        }
    }
    for (int r = 0; r < 8; r++) _mm256_storeu_ps(out + c0 + 8 * r, o[r]);
}

typedef struct {
    const ms_kda_args *a;
    float *scratch; /* [nth, D] */
} kda_job;

static void heads_task(void *ctx, int ith, int nth) {
    const kda_job *j = (const kda_job *)ctx;
    const ms_kda_args *a = j->a;
    const int D = a->D, H = a->H;
    const int h0 = (int)((int64_t)H * ith / nth), h1 = (int)((int64_t)H * (ith + 1) / nth);
    const ms_isa isa = ms_get_isa();
    const int W = isa == MS_ISA_AVX512 ? 128 : isa == MS_ISA_AVX2 ? 64 : 0;
    float *u = j->scratch + (int64_t)ith * D;
    for (int h = h0; h < h1; h++) {
        float *s = a->S + (int64_t)h * D * D;
        for (int64_t t = 0; t < a->T; t++) {
            const int64_t at = (t * H + h) * D;
            const float *q = a->q + at, *k = a->k + at, *v = a->v + at, *al = a->alpha + at;
            const float beta = a->beta[t * H + h];
            float *out = a->out + at;
            int c0 = 0;
            if (W == 128)
                for (; c0 + 128 <= D; c0 += 128) chunk_avx512(s, q, k, v, al, beta, out, D, c0);
            else if (W == 64)
                for (; c0 + 64 <= D; c0 += 64) chunk_avx2(s, q, k, v, al, beta, out, D, c0);
            if (c0 < D) token_scalar(s, q, k, v, al, beta, out, D, c0, D, u); /* fmaf: the same rounding */
        }
    }
}

int ms_kda_recurrence(const ms_kda_args *a, int nthreads) {
    const int nth = ms_threads_for(nthreads, a->H, 4 * a->T * (int64_t)a->H * a->D * a->D);
    kda_job j = {.a = a, .scratch = malloc((size_t)nth * (size_t)(a->D > 0 ? a->D : 1) * sizeof(float))};
    if (!j.scratch) return -1;
    if (a->H > 0 && a->D > 0) ms_parallel(nth, heads_task, &j);
    free(j.scratch);
    return 0;
}
