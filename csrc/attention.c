/* Decode attention for grouped-query models (see attention.h). The scalar loops are the definition;
 * the AVX2 and AVX-512 versions of the three hot loops do the same operations in the same order
 * (scores: 16 lanes, then a fixed tree; the softmax's exp: exp_f32.h; p V: each output column summed over
 * positions in order), with no fused multiply-adds anywhere (-ffp-contract=off), so the bits do not
 * depend on the instruction set. */
#include "attention.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "activations.h"
#include "exp_f32.h"
#include "matmul.h"
#include "norm.h"
#include "rope.h"
#include "threadpool.h"

#define LANES 16

/* out [D] = rope(rms_norm(x) * w) (w NULL: rope(x)); sq is [D] scratch. */
static void norm_rope(const float *x, const ms_gqa_decode_args *a, const float *w, float *sq, float *out) {
    const float *src = x;
    if (w != NULL) {
        ms_rms_norm_row(x, w, a->D, a->eps, sq, sq); /* in place: each element is read before written */
        src = sq;
    }
    ms_rope_row(src, a->D, a->cos, a->sin, a->interleave, out);
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
 * o += p[s] V[s] for s in order (o starts at zero; a long context comes in blocks of positions, each
 * continuing the sums). The SIMD versions below do the same operations in the same order. */
static void scores_scalar(const float *q, const float *K, int64_t S, int D, float scaling, float *p) {
    for (int64_t s = 0; s < S; s++) p[s] = lane_dot(q, K + s * D, D) * scaling;
}

/* o[d] += p[0] V[0, d], then += p[1] V[1, d], ... for columns [d, D) */
static void pv_columns(const float *p, const float *V, int64_t S, int D, int d, float *o) {
    for (; d < D; d++) {
        float a = o[d];
        for (int64_t s = 0; s < S; s++) a += p[s] * V[s * D + d];
        o[d] = a;
    }
}

/* pv_columns over all columns, as rows of V (the same sums; the compiler can vectorise along d) */
static void pv_scalar(const float *p, const float *V, int64_t S, int D, float *o) {
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
    int64_t s = 0;
    for (; s + 4 <= S; s += 4) { /* four positions at once, as scores_avx512 */
        const float *k = K + s * D;
        __m256 a[4][2]; /* lanes 0..7 and 8..15 of each position */
        for (int r = 0; r < 4; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int i = 0; i < D; i += LANES) {
            const __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + i + 8);
            for (int r = 0; r < 4; r++) {
                a[r][0] = _mm256_add_ps(a[r][0], _mm256_mul_ps(q0, _mm256_loadu_ps(k + r * D + i)));
                a[r][1] = _mm256_add_ps(a[r][1], _mm256_mul_ps(q1, _mm256_loadu_ps(k + r * D + i + 8)));
            }
        }
        for (int r = 0; r < 4; r++) p[s + r] = reduce8_avx2(_mm256_add_ps(a[r][0], a[r][1])) * scaling;
    }
    for (; s < S; s++) {
        const float *k = K + s * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(); /* lanes 0..7, 8..15 */
        for (int i = 0; i < D; i += LANES) {
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i)));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8)));
        }
        p[s] = reduce8_avx2(_mm256_add_ps(a0, a1)) * scaling;
    }
}

/* scores_avx2 for two heads (queries q0, q1) against the same keys, two positions at a time: each key
 * vector loaded once for both heads (the single-head loop is bound by its loads); every score has the
 * operations of scores_avx2 in its order. */
__attribute__((target("avx2"))) static void scores2_avx2(const float *q0, const float *q1, const float *K, int64_t S,
                                                         int D, float scaling, float *p0, float *p1) {
    if (D % LANES != 0) {
        scores_scalar(q0, K, S, D, scaling, p0);
        scores_scalar(q1, K, S, D, scaling, p1);
        return;
    }
    int64_t s = 0;
    for (; s + 2 <= S; s += 2) {
        const float *k = K + s * D;
        __m256 a[2][2][2]; /* [head][position][lanes 0..7, 8..15] */
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < 2; r++) a[h][r][0] = a[h][r][1] = _mm256_setzero_ps();
        for (int i = 0; i < D; i += LANES) {
            const __m256 x00 = _mm256_loadu_ps(q0 + i), x01 = _mm256_loadu_ps(q0 + i + 8);
            const __m256 x10 = _mm256_loadu_ps(q1 + i), x11 = _mm256_loadu_ps(q1 + i + 8);
            for (int r = 0; r < 2; r++) {
                const __m256 k0 = _mm256_loadu_ps(k + r * D + i), k1 = _mm256_loadu_ps(k + r * D + i + 8);
                a[0][r][0] = _mm256_add_ps(a[0][r][0], _mm256_mul_ps(x00, k0));
                a[0][r][1] = _mm256_add_ps(a[0][r][1], _mm256_mul_ps(x01, k1));
                a[1][r][0] = _mm256_add_ps(a[1][r][0], _mm256_mul_ps(x10, k0));
                a[1][r][1] = _mm256_add_ps(a[1][r][1], _mm256_mul_ps(x11, k1));
            }
        }
        for (int r = 0; r < 2; r++) {
            p0[s + r] = reduce8_avx2(_mm256_add_ps(a[0][r][0], a[0][r][1])) * scaling;
            p1[s + r] = reduce8_avx2(_mm256_add_ps(a[1][r][0], a[1][r][1])) * scaling;
        }
    }
    if (s < S) {
        scores_avx2(q0, K + s * D, S - s, D, scaling, p0 + s);
        scores_avx2(q1, K + s * D, S - s, D, scaling, p1 + s);
    }
}

__attribute__((target("avx2"))) static void pv_avx2(const float *p, const float *V, int64_t S, int D, float *o) {
    int d = 0;
    for (; d + 64 <= D; d += 64) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_loadu_ps(o + d + 8 * j);
        for (int64_t s = 0; s < S; s++) {
            const __m256 ps = _mm256_set1_ps(p[s]);
            const float *v = V + s * D + d;
            for (int j = 0; j < 8; j++)
                a[j] = _mm256_add_ps(a[j], _mm256_mul_ps(ps, _mm256_loadu_ps(v + 8 * j)));
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + d + 8 * j, a[j]);
    }
    for (; d + 8 <= D; d += 8) {
        __m256 a = _mm256_loadu_ps(o + d);
        for (int64_t s = 0; s < S; s++)
            a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(p[s]), _mm256_loadu_ps(V + s * D + d)));
        _mm256_storeu_ps(o + d, a);
    }
    pv_columns(p, V, S, D, d, o);
}

/* lanes l + l+8 of a 16-lane sum, then reduce8_avx2 */
__attribute__((target("avx512f"))) static inline float reduce16_avx512(__m512 a) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return reduce8_avx2(_mm256_add_ps(_mm512_castps512_ps256(a), hi));
}

__attribute__((target("avx512f"))) static void scores_avx512(const float *q, const float *K, int64_t S, int D,
                                                             float scaling, float *p) {
    if (D % LANES != 0) {
        scores_scalar(q, K, S, D, scaling, p);
        return;
    }
    int64_t s = 0;
    for (; s + 4 <= S; s += 4) { /* four positions at once: four independent chains, q loaded once */
        const float *k = K + s * D;
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int i = 0; i < D; i += LANES) {
            const __m512 qv = _mm512_loadu_ps(q + i);
            for (int r = 0; r < 4; r++) a[r] = _mm512_add_ps(a[r], _mm512_mul_ps(qv, _mm512_loadu_ps(k + r * D + i)));
        }
        for (int r = 0; r < 4; r++) p[s + r] = reduce16_avx512(a[r]) * scaling;
    }
    for (; s < S; s++) {
        const float *k = K + s * D;
        __m512 a = _mm512_setzero_ps(); /* lanes 0..15 */
        for (int i = 0; i < D; i += LANES)
            a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i)));
        p[s] = reduce16_avx512(a) * scaling;
    }
}

__attribute__((target("avx512f"))) static void pv_avx512(const float *p, const float *V, int64_t S, int D,
                                                         float *o) {
    int d = 0;
    for (; d + 128 <= D; d += 128) {
        __m512 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm512_loadu_ps(o + d + 16 * j);
        for (int64_t s = 0; s < S; s++) {
            const __m512 ps = _mm512_set1_ps(p[s]);
            const float *v = V + s * D + d;
            for (int j = 0; j < 8; j++)
                a[j] = _mm512_add_ps(a[j], _mm512_mul_ps(ps, _mm512_loadu_ps(v + 16 * j)));
        }
        for (int j = 0; j < 8; j++) _mm512_storeu_ps(o + d + 16 * j, a[j]);
    }
    for (; d + 16 <= D; d += 16) {
        __m512 a = _mm512_loadu_ps(o + d);
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
    float *work; /* per thread: queries [rep, D], scratch [D], scores [rep, S] */
    int64_t work_stride;
} head_job;

/* Heads [h0, h1) of thread ith, in runs that share a key/value head: each run's queries normed and
 * rotated, then blocks of positions (32 KB of keys or values) passed over by every head of the run while
 * they sit in L1, instead of each head streaming the whole cache again. */
static void heads_task(void *ctx, int ith, int nth) {
    const head_job *j = (const head_job *)ctx;
    const ms_gqa_decode_args *a = j->a;
    const int D = a->D, rep = a->H / a->KV;
    const int h0 = (int)((int64_t)a->H * ith / nth), h1 = (int)((int64_t)a->H * (ith + 1) / nth);
    const int64_t S = a->pos + 1 - j->lo, block = D >= 8192 ? 1 : 8192 / D;
    float *qs = j->work + ith * j->work_stride, *sq = qs + (int64_t)rep * D, *ps = sq + D;
    scores_fn scores = scores_scalar;
    pv_fn pv = pv_scalar;
    int pair = 0; /* scores2_avx2 for pairs of heads */
    if (ms_get_isa() == MS_ISA_AVX512) {
        scores = scores_avx512;
        pv = pv_avx512;
    } else if (ms_get_isa() == MS_ISA_AVX2) {
        scores = scores_avx2;
        pv = pv_avx2;
        pair = 1;
    }
    for (int g0 = h0; g0 < h1;) {
        const int64_t kv = g0 / rep;
        const int g1 = (int)((kv + 1) * rep) < h1 ? (int)((kv + 1) * rep) : h1, nh = g1 - g0;
        const float *K = a->kcache + (kv * a->cap + j->lo) * D, *V = a->vcache + (kv * a->cap + j->lo) * D;
        for (int i = 0; i < nh; i++) norm_rope(a->q + (int64_t)(g0 + i) * D, a, a->q_norm, sq, qs + i * D);
        for (int64_t s0 = 0; s0 < S; s0 += block) {
            const int64_t n = S - s0 < block ? S - s0 : block;
            int i = 0;
            if (pair) /* two heads at a time */
                for (; i + 2 <= nh; i += 2)
                    scores2_avx2(qs + i * D, qs + (i + 1) * D, K + s0 * D, n, D, a->scaling, ps + i * S + s0,
                                 ps + (i + 1) * S + s0);
            for (; i < nh; i++) scores(qs + i * D, K + s0 * D, n, D, a->scaling, ps + i * S + s0);
        }
        for (int i = 0; i < nh; i++) {
            float *p = ps + i * S, m = -INFINITY;
            for (int64_t s = 0; s < S; s++) m = p[s] > m ? p[s] : m;
            ms_exp_shifted(p, S, m);
            const float total = lane_sum(p, S);
            for (int64_t s = 0; s < S; s++) p[s] = p[s] / total;
            memset(a->out + (int64_t)(g0 + i) * D, 0, (size_t)D * sizeof(float));
        }
        for (int64_t s0 = 0; s0 < S; s0 += block) {
            const int64_t n = S - s0 < block ? S - s0 : block;
            for (int i = 0; i < nh; i++) pv(ps + i * S + s0, V + s0 * D, n, D, a->out + (int64_t)(g0 + i) * D);
        }
        g0 = g1;
    }
}

int ms_gqa_decode(const ms_gqa_decode_args *a, int nthreads) {
    head_job j = {.a = a, .lo = 0};
    if (a->window > 0 && a->pos - a->window + 1 > 0) j.lo = a->pos - a->window + 1;
    const int64_t S = a->pos + 1 - j.lo;
    const int nth = ms_threads_for(nthreads, a->H, 2 * (int64_t)a->H * S * a->D);
    const int64_t rep = a->H / a->KV;
    j.work_stride = ((rep + 1) * a->D + rep * S + 15) / 16 * 16;
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
