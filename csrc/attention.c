/* Decode attention for grouped-query models (see attention.h). The scalar loops are the definition;
 * the AVX2 and AVX-512 versions of the two hot loops do the same multiplies and adds in the same order
 * (scores: 16 lanes, then a fixed tree; p V: each output column summed over positions in order), with
 * no fused multiply-adds anywhere (-ffp-contract=off), so the bits do not depend on the instruction set. */
#include "attention.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "matmul.h"
#include "norm.h"
#include "threadpool.h"

#define LANES 16

/* out [D] = rope(rms_norm(x) * w) (w NULL: rope(x)); sq is [D] scratch. */
static void norm_rope(const float *x, const ms_gqa_decode_args *a, const float *w, float *sq, float *out) {
    const int half = a->D / 2;
    const float *src = x;
    if (w != NULL) {
        ms_rms_norm_row(x, w, a->D, a->eps, sq, sq); /* in place: each element is read before written */
        src = sq;
    }
    const int step = a->interleave ? 2 : 1, second = a->interleave ? 1 : half;
    for (int i = 0; i < half; i++) {
        float x1 = src[i * step], x2 = src[i * step + second];
        float c = a->cos[i], s = a->sin[i];
        out[i] = x1 * c - x2 * s;
        out[i + half] = x2 * c + x1 * s;
    }
}

/* The sum of lane[0..LANES) as halves added pairwise: (l + l+8), then (l + l+4), ... */
static inline float lanes_reduce(float *lane) {
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

/* x[i] summed into lane i % LANES, then the lanes reduced. */
static inline float lane_sum(const float *x, int64_t n) {
    float lane[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += x[i + l];
    for (int l = 0; i + l < n; l++) lane[l] += x[i + l];
    return lanes_reduce(lane);
}

static inline float lane_dot(const float *x, const float *y, int n) {
    float lane[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += x[i + l] * y[i + l];
    for (int l = 0; i + l < n; l++) lane[l] += x[i + l] * y[i + l];
    return lanes_reduce(lane);
}

/* The hot loops of one head, as the definition: scores p[s] = dot(q, K[s]) * scaling (lane_dot), and
 * o = sum over s, in order, of p[s] V[s]. The SIMD versions below do the same operations on the same
 * lanes. */
static void scores_scalar(const float *q, const float *K, int64_t S, int D, float scaling, float *p) {
    for (int64_t s = 0; s < S; s++) p[s] = lane_dot(q, K + s * D, D) * scaling;
}

/* o[d] for columns [d, D): p[0] V[0, d] + p[1] V[1, d] + ... in that order */
static void pv_columns(const float *p, const float *V, int64_t S, int D, int d, float *o) {
    for (; d < D; d++) {
        float a = 0.0f;
        for (int64_t s = 0; s < S; s++) a += p[s] * V[s * D + d];
        o[d] = a;
    }
}

/* pv_columns over all columns, as rows of V (the same sums; the compiler can vectorise along d) */
static void pv_scalar(const float *p, const float *V, int64_t S, int D, float *o) {
    for (int d = 0; d < D; d++) o[d] = 0.0f;
    for (int64_t s = 0; s < S; s++)
        for (int d = 0; d < D; d++) o[d] += p[s] * V[s * D + d];
}

/* lanes l + l+4, l + l+2, l + l+1 of an 8-lane sum (lanes 0..7 already hold l + l+8) */
__attribute__((target("avx2"))) static inline float reduce8_avx2(__m256 s8) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

__attribute__((target("avx2"))) static void scores_avx2(const float *q, const float *K, int64_t S, int D,
                                                        float scaling, float *p) {
    if (D % LANES != 0) {
        scores_scalar(q, K, S, D, scaling, p);
        return;
    }
    for (int64_t s = 0; s < S; s++) {
        const float *k = K + s * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(); /* lanes 0..7, 8..15 */
        for (int i = 0; i < D; i += LANES) {
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i)));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8)));
        }
        p[s] = reduce8_avx2(_mm256_add_ps(a0, a1)) * scaling;
    }
}

__attribute__((target("avx2"))) static void pv_avx2(const float *p, const float *V, int64_t S, int D, float *o) {
    int d = 0;
    for (; d + 64 <= D; d += 64) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (int64_t s = 0; s < S; s++) {
            const __m256 ps = _mm256_set1_ps(p[s]);
            const float *v = V + s * D + d;
            for (int j = 0; j < 8; j++)
                a[j] = _mm256_add_ps(a[j], _mm256_mul_ps(ps, _mm256_loadu_ps(v + 8 * j)));
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + d + 8 * j, a[j]);
    }
    for (; d + 8 <= D; d += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t s = 0; s < S; s++)
            a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(p[s]), _mm256_loadu_ps(V + s * D + d)));
        _mm256_storeu_ps(o + d, a);
    }
    pv_columns(p, V, S, D, d, o);
}

__attribute__((target("avx512f"))) static void scores_avx512(const float *q, const float *K, int64_t S, int D,
                                                             float scaling, float *p) {
    if (D % LANES != 0) {
        scores_scalar(q, K, S, D, scaling, p);
        return;
    }
    for (int64_t s = 0; s < S; s++) {
        const float *k = K + s * D;
        __m512 a = _mm512_setzero_ps(); /* lanes 0..15 */
        for (int i = 0; i < D; i += LANES)
            a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i)));
        __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
        __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), hi);
        p[s] = reduce8_avx2(s8) * scaling;
    }
}

__attribute__((target("avx512f"))) static void pv_avx512(const float *p, const float *V, int64_t S, int D,
                                                         float *o) {
    int d = 0;
    for (; d + 128 <= D; d += 128) {
        __m512 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
        for (int64_t s = 0; s < S; s++) {
            const __m512 ps = _mm512_set1_ps(p[s]);
            const float *v = V + s * D + d;
            for (int j = 0; j < 8; j++)
                a[j] = _mm512_add_ps(a[j], _mm512_mul_ps(ps, _mm512_loadu_ps(v + 16 * j)));
        }
        for (int j = 0; j < 8; j++) _mm512_storeu_ps(o + d + 16 * j, a[j]);
    }
    for (; d + 16 <= D; d += 16) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t s = 0; s < S; s++)
            a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_set1_ps(p[s]), _mm512_loadu_ps(V + s * D + d)));
        _mm512_storeu_ps(o + d, a);
    }
    pv_columns(p, V, S, D, d, o);
}

typedef void (*scores_fn)(const float *q, const float *K, int64_t S, int D, float scaling, float *p);
typedef void (*pv_fn)(const float *p, const float *V, int64_t S, int D, float *o);

typedef struct {
    const ms_gqa_decode_args *a;
    int64_t lo;  /* first position attended to */
    float *work; /* per thread: [2 D + S] */
    int64_t work_stride;
} head_job;

/* Heads [h0, h1) of thread ith: query norm and rope, scores, softmax, p V. */
static void heads_task(void *ctx, int ith, int nth) {
    const head_job *j = (const head_job *)ctx;
    const ms_gqa_decode_args *a = j->a;
    const int D = a->D, rep = a->H / a->KV;
    const int h0 = (int)((int64_t)a->H * ith / nth), h1 = (int)((int64_t)a->H * (ith + 1) / nth);
    const int64_t S = a->pos + 1 - j->lo;
    float *q = j->work + ith * j->work_stride, *sq = q + D, *p = q + 2 * D;
    scores_fn scores = scores_scalar;
    pv_fn pv = pv_scalar;
    if (ms_get_isa() == MS_ISA_AVX512) {
        scores = scores_avx512;
        pv = pv_avx512;
    } else if (ms_get_isa() == MS_ISA_AVX2) {
        scores = scores_avx2;
        pv = pv_avx2;
    }
    for (int h = h0; h < h1; h++) {
        norm_rope(a->q + (int64_t)h * D, a, a->q_norm, sq, q);
        const int64_t kv = h / rep;
        scores(q, a->kcache + (kv * a->cap + j->lo) * D, S, D, a->scaling, p);
        float m = -INFINITY;
        for (int64_t s = 0; s < S; s++) m = p[s] > m ? p[s] : m;
        for (int64_t s = 0; s < S; s++) p[s] = expf(p[s] - m);
        const float total = lane_sum(p, S);
        for (int64_t s = 0; s < S; s++) p[s] = p[s] / total;
        pv(p, a->vcache + (kv * a->cap + j->lo) * D, S, D, a->out + (int64_t)h * D);
    }
}

int ms_gqa_decode(const ms_gqa_decode_args *a, int nthreads) {
    head_job j = {.a = a, .lo = 0};
    if (a->window > 0 && a->pos - a->window + 1 > 0) j.lo = a->pos - a->window + 1;
    const int64_t S = a->pos + 1 - j.lo;
    /* threads only where the work outweighs waking them: about 64k multiply-adds a thread */
    int nth = nthreads < 1 ? 1 : nthreads;
    const int64_t macs = 2 * (int64_t)a->H * S * a->D;
    while (nth > 1 && macs / nth < (1 << 16)) nth--;
    if (nth > a->H) nth = a->H;
    j.work_stride = (2 * (int64_t)a->D + S + 15) / 16 * 16;
    j.work = malloc((size_t)(j.work_stride * nth) * sizeof(float));
    if (j.work == NULL) return -1;
    const int D = a->D;
    for (int kv = 0; kv < a->KV; kv++) { /* the new key and value into the caches */
        norm_rope(a->k + (int64_t)kv * D, a, a->k_norm, j.work, a->kcache + (kv * a->cap + a->pos) * D);
        memcpy(a->vcache + (kv * a->cap + a->pos) * D, a->v + (int64_t)kv * D, (size_t)D * sizeof(float));
    }
    if (nth == 1)
        heads_task(&j, 0, 1);
    else
        ms_parallel(nth, heads_task, &j);
    free(j.work);
    return 0;
}
