/* See activations.h. The scalar loops are the definition; the AVX2 and AVX-512 ones do the same float
 * operations on 8 or 16 elements at once (no fused multiply-adds: -ffp-contract=off). */
#include "activations.h"

#include <immintrin.h>
#include <stdlib.h>

#include "exp_f32.h"
#include "matmul.h"
#include "threadpool.h"

/* p[s] = exp(p[s] - m) for s < S, ms_exp_f32's bits on every instruction set */
static void exp_shifted_scalar(float *p, int64_t S, float m) {
    for (int64_t s = 0; s < S; s++) p[s] = ms_exp_f32(p[s] - m);
}

__attribute__((target("avx2"))) static void exp_shifted_avx2(float *p, int64_t S, float m) {
    int64_t s = 0;
    for (const __m256 mv = _mm256_set1_ps(m); s + 8 <= S; s += 8)
        _mm256_storeu_ps(p + s, ms_exp_f32_avx2(_mm256_sub_ps(_mm256_loadu_ps(p + s), mv)));
    exp_shifted_scalar(p + s, S - s, m);
}

__attribute__((target("avx512f"))) static void exp_shifted_avx512(float *p, int64_t S, float m) {
    int64_t s = 0;
    for (const __m512 mv = _mm512_set1_ps(m); s + 16 <= S; s += 16)
        _mm512_storeu_ps(p + s, ms_exp_f32_avx512(_mm512_sub_ps(_mm512_loadu_ps(p + s), mv)));
    exp_shifted_avx2(p + s, S - s, m);
}

void ms_exp_shifted(float *p, int64_t S, float m) {
    if (ms_get_isa() == MS_ISA_AVX512)
        exp_shifted_avx512(p, S, m);
    else if (ms_get_isa() == MS_ISA_AVX2)
        exp_shifted_avx2(p, S, m);
    else
        exp_shifted_scalar(p, S, m);
}

static void silu_mul_scalar(const float *g, const float *u, float *h, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float d = 1.0f + ms_exp_f32(-g[i]);
        h[i] = (g[i] / d) * u[i];
    }
}

__attribute__((target("avx2"))) static void silu_mul_avx2(const float *g, const float *u, float *h, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 d = _mm256_add_ps(one, ms_exp_f32_avx2(_mm256_xor_ps(gv, sign)));
        _mm256_storeu_ps(h + i, _mm256_mul_ps(_mm256_div_ps(gv, d), _mm256_loadu_ps(u + i)));
    }
    silu_mul_scalar(g + i, u + i, h + i, n - i);
}

__attribute__((target("avx512f"))) static void silu_mul_avx512(const float *g, const float *u, float *h, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), _mm512_set1_epi32(INT32_MIN)));
        const __m512 d = _mm512_add_ps(one, ms_exp_f32_avx512(neg));
        _mm512_storeu_ps(h + i, _mm512_mul_ps(_mm512_div_ps(gv, d), _mm512_loadu_ps(u + i)));
    }
    silu_mul_avx2(g + i, u + i, h + i, n - i);
}

typedef struct {
    const float *g, *u;
    float *h;
    int64_t n;
} silu_job;

static void silu_task(void *ctx, int ith, int nth) {
    const silu_job *j = (const silu_job *)ctx;
    const int64_t i0 = j->n * ith / nth, i1 = j->n * (ith + 1) / nth;
    const ms_isa isa = ms_get_isa();
    if (isa == MS_ISA_AVX512)
        silu_mul_avx512(j->g + i0, j->u + i0, j->h + i0, i1 - i0);
    else if (isa == MS_ISA_AVX2)
        silu_mul_avx2(j->g + i0, j->u + i0, j->h + i0, i1 - i0);
    else
        silu_mul_scalar(j->g + i0, j->u + i0, j->h + i0, i1 - i0);
}

void ms_silu_mul(const float *g, const float *u, float *h, int64_t n, int nthreads) {
    silu_job j = {g, u, h, n};
    /* an exp costs about as much as a few dozen multiply-adds */
    ms_parallel(ms_threads_for(nthreads, (n + 1023) / 1024, 32 * n), silu_task, &j);
}

int ms_softmax_topk(const float *logits, int64_t T, int64_t n, int k, int renormalize, int64_t *idx, float *w) {
    float *p = malloc((size_t)n * sizeof(float));
    unsigned char *taken = malloc((size_t)n);
    if (p == NULL || taken == NULL) {
        free(p);
        free(taken);
        return -1;
    }
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * n;
        float m = l[0];
        for (int64_t i = 1; i < n; i++) m = l[i] > m ? l[i] : m;
        for (int64_t i = 0; i < n; i++) p[i] = l[i];
        ms_exp_shifted(p, n, m);
        float s = 0.0f;
        for (int64_t i = 0; i < n; i++) s = s + p[i];
        for (int64_t i = 0; i < n; i++) {
            p[i] = p[i] / s;
            taken[i] = 0;
        }
        int64_t *it = idx + t * k;
        float *wt = w + t * k;
        for (int j = 0; j < k; j++) {
            int64_t best = 0;
            while (taken[best]) best++;
            for (int64_t i = best + 1; i < n; i++)
                if (!taken[i] && p[i] > p[best]) best = i;
            taken[best] = 1;
            it[j] = best;
            wt[j] = p[best];
        }
        if (renormalize) {
            float total = 0.0f;
            for (int j = 0; j < k; j++) total = total + wt[j];
            for (int j = 0; j < k; j++) wt[j] = wt[j] / total;
        }
    }
    free(p);
    free(taken);
    return 0;
}
