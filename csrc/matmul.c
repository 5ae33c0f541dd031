/* Matrix products over the format table, threaded over output rows, with runtime ISA dispatch. */
#include "matmul.h"

#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "threadpool.h"

static ms_isa active_isa = MS_ISA_SCALAR;

int ms_isa_supported(ms_isa isa) {
    __builtin_cpu_init();
    switch (isa) {
        case MS_ISA_SCALAR: return 1;
        case MS_ISA_AVX2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   __builtin_cpu_supports("f16c");
        case MS_ISA_AVX512:
            return ms_isa_supported(MS_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
                   __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
        default: return 0;
    }
}

void ms_init(void) {
    ms_quant_init();
    active_isa = MS_ISA_SCALAR;
    if (ms_isa_supported(MS_ISA_AVX2)) active_isa = MS_ISA_AVX2;
    if (ms_isa_supported(MS_ISA_AVX512)) active_isa = MS_ISA_AVX512;
}

ms_isa ms_get_isa(void) { return active_isa; }

int ms_set_isa(ms_isa isa) {
    if (isa < 0 || isa >= MS_NUM_ISAS || !ms_isa_supported(isa)) return -1;
    active_isa = isa;
    return 0;
}

/* Rows [r0, r1) of thread ith: contiguous, multiples of 4 so that dot4 tiles never straddle. */
static void row_range(int64_t rows, int ith, int nth, int64_t *r0, int64_t *r1) {
    int64_t tiles = (rows + 3) / 4;
    *r0 = (tiles * ith / nth) * 4;
    *r1 = (tiles * (ith + 1) / nth) * 4;
    if (*r1 > rows) *r1 = rows;
    if (*r0 > rows) *r0 = rows;
}

typedef struct {
    const ms_matrix *m;
    const char *x;    /* token t's activations (prepared or not) start at x + t * stride */
    int64_t stride;   /* bytes */
    int64_t T;
    float *out;
    ms_dot4_fn dot4;
    ms_gemm_fn gemm; /* NULL: dot4 per token */
} matmul_job;

static void matmul_task(void *ctx, int ith, int nth) {
    const matmul_job *j = ctx;
    int64_t r0, r1;
    row_range(j->m->rows, ith, nth, &r0, &r1);
    float tmp[4];
    for (int64_t r = r0; r < r1; r += 4) {
        int nr = r1 - r < 4 ? (int)(r1 - r) : 4;
        if (j->gemm != NULL) {
            j->gemm(j->m, r, nr, j->x, j->stride, j->T, j->out + r, j->m->rows);
            continue;
        }
        for (int64_t t = 0; t < j->T; t++) {
            j->dot4(j->m, r, nr, (const float *)(j->x + t * j->stride), tmp);
            memcpy(j->out + t * j->m->rows + r, tmp, (size_t)nr * sizeof(float));
        }
    }
}

int ms_matmul(const ms_matrix *m, const float *x, int64_t T, float *out, int nthreads) {
    const ms_format_traits *f = &ms_formats[m->fmt];
    ms_prep_x_fn prep = f->prep_x[active_isa];
    int64_t stride = m->cols * (int64_t)sizeof(float);
    char *xp = NULL;
    if (prep != NULL) {
        if (f->prep_bytes) stride = (m->cols / f->block) * f->prep_bytes;
        stride = (stride + 63) & ~(int64_t)63;
        xp = malloc((size_t)(T * stride));
        if (xp == NULL) return -1;
        for (int64_t t = 0; t < T; t++) prep(x + t * m->cols, m->cols, (float *)(xp + t * stride));
    }
    matmul_job j = {m, xp ? xp : (const char *)x, stride, T, out, f->dot4[active_isa],
                    T > 1 ? f->gemm[active_isa] : NULL};
    int64_t tiles = (m->rows + 3) / 4;
    if (nthreads > tiles) nthreads = (int)tiles;
    ms_parallel(nthreads < 1 ? 1 : nthreads, matmul_task, &j);
    free(xp);
    return 0;
}

typedef struct {
    const ms_matrix *m;
    float *out;
    ms_dequant_fn deq;
} dequant_job;

static void dequant_task(void *ctx, int ith, int nth) {
    const dequant_job *j = ctx;
    int64_t r0, r1;
    row_range(j->m->rows, ith, nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) j->deq(j->m, r, j->out + r * j->m->cols);
}

void ms_dequant(const ms_matrix *m, float *out, int nthreads) {
    dequant_job j = {m, out, ms_formats[m->fmt].dequant[active_isa]};
    ms_parallel(nthreads < 1 ? 1 : nthreads, dequant_task, &j);
}

/* ---- memory read baseline ------------------------------------------------------------------ */

typedef struct {
    const uint8_t *p;
    int64_t n;
    double sums[256];
} memread_job;

__attribute__((target("avx2"))) static double read_avx2(const uint8_t *p, int64_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    uint64_t l[4];
    _mm256_storeu_si256((__m256i *)l, a0);
    uint64_t s = l[0] ^ l[1] ^ l[2] ^ l[3];
    for (; i < n; i++) s ^= p[i];
    return (double)(s & 0xffff);
}

static double read_scalar(const uint8_t *p, int64_t n) {
    uint64_t s = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        s ^= v;
    }
    for (; i < n; i++) s ^= p[i];
    return (double)(s & 0xffff);
}

static void memread_task(void *ctx, int ith, int nth) {
    memread_job *j = ctx;
    int64_t a = j->n * ith / nth, b = j->n * (ith + 1) / nth;
    j->sums[ith] = ms_isa_supported(MS_ISA_AVX2) ? read_avx2(j->p + a, b - a) : read_scalar(j->p + a, b - a);
}

double ms_memread(const uint8_t *p, int64_t n, int nthreads) {
    memread_job j;
    memset(&j, 0, sizeof(j));
    j.p = p;
    j.n = n;
    if (nthreads > 256) nthreads = 256;
    if (nthreads < 1) nthreads = 1;
    ms_parallel(nthreads, memread_task, &j);
    double s = 0;
    for (int i = 0; i < nthreads; i++) s += j.sums[i];
    return s;
}
