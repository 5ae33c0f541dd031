/* Matrix products over the format table, threaded over output rows, with runtime ISA dispatch. */
#include "matmul.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <immintrin.h>

#include "quant_int8.h"
#include "threadpool.h"

static ms_isa active_isa = MS_ISA_SCALAR;
static ms_level active_level = MS_LEVEL_SCALAR;

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

int ms_level_supported(ms_level level) {
    switch (level) {
        case MS_LEVEL_SCALAR: return ms_isa_supported(MS_ISA_SCALAR);
        case MS_LEVEL_AVX2: return ms_isa_supported(MS_ISA_AVX2);
        case MS_LEVEL_AVX512: return ms_isa_supported(MS_ISA_AVX512);
        case MS_LEVEL_AVX512_VNNI: return ms_isa_supported(MS_ISA_AVX512) && __builtin_cpu_supports("avx512vnni");
        case MS_LEVEL_AVX512_VBMI:
            return ms_level_supported(MS_LEVEL_AVX512_VNNI) && __builtin_cpu_supports("avx512vbmi");
        case MS_LEVEL_AMX: return ms_level_supported(MS_LEVEL_AVX512_VBMI) && ms_amx_usable();
        default: return 0;
    }
}

/* Weight streams a thread reads at once in the decode kernels that can take several
 * (ms_weight_streams_for), and where the decode kernels' far prefetches go (ms_prefetch_into_l2). Four
 * streams suit Intel, whose per-stream prefetchers keep more lines in flight for four interleaved streams
 * (Xeon Sapphire Rapids: a plain read 11.8 -> 18.6 GB/s on one thread), and wide rows on a small L1: there
 * a token's activations (q8_0 16 KB at 14336 columns, q6_k 32 KB) and a window of lines prefetched into L1
 * do not fit together, and four rows taking each block of activations in turn keep only that block near.
 * Zen 4 (L1d 32 KB), in-process A/B of one stream against four, one / two threads: 4096x14336 q8_0 1.66 /
 * 1.35x, q4_k 1.26 / 1.23x, q6_k 1.69 / 1.52x, int4 1.3-1.45x; but with narrow rows (2048, 3072 columns:
 * 2-7 KB of activations) two threads lost 5-17% (q4_k, q6_k), and the gain starts between 8 KB (q8_0 at
 * 9216 columns 1.28 / 1.13x) and 16 KB (q6_k at 5120 columns, 11.5 KB, 1.07 / 0.97x; at 7168, 16 KB, 1.11
 * / 1.11x). For the same reason prefetches that reach further than a quarter of a small L1 go into L2:
 * the AVX2 kernels (one row at a time, the next tile prefetched) 4096x14336 q8_0 2.1 / 2.0x, q4_k 1.7 /
 * 1.3x, int4 1.5 / 1.5x, q6_k 2.2 / 2.2x; int4 and mxfp4 on AVX-512 (16 KB or more ahead) 1.1-1.5x at every
 * shape, q8_0 3584x3072 (13 KB ahead) 1.1x; nearer ones stay in L1: q4_k and q6_k read in four streams
 * (4 blocks ahead) lost 0-27% by L2 prefetches, as did q4_k 7168x2048 (4.6 KB ahead) on AVX2 (0.9x). Zen
 * 5 (48 KB) reads fastest in one stream with L1 prefetches. */
static int weight_streams = 0, prefetch_level = 1, intel = 0, small_l1 = 0; /* small_l1: L1d < 48 KB */
static int has_gfni = 0; /* asked once (ms_init): ms_use_gfni runs at every kernel call */
static long l1d_bytes = 0;

int ms_weight_streams(void) { return weight_streams; }

int ms_set_weight_streams(int n) {
    if (n != 0 && n != 1 && n != 4) return -1;
    weight_streams = n;
    return 0;
}

/* A thread's run of a product at least this long also takes four streams where the L1 is small: the output
 * matrix of a model (Zen 3, the 8-layer Qwen3-30B-A3B-width pack's Q6_K 151936x2048, 255 MB, mapped from
 * the pack, two threads; one stream against four in alternate calls, 20-24 pairs each: 1.12, 1.18 and 1.18x
 * at the median, 1.20x on an anonymous copy). Measured with the AVX2 kernels, which now take four at every
 * length (below); for the AVX-512 ones on a small L1 (Zen 4) it is not measured. */
#define LONG_RUN_BYTES (32LL << 20)

/* The AVX2 kernels (q4_k and q6_k read in streams) take four at every width where the L1 is small: Zen 3
 * (L1d 32 KB), in-process A/B of one stream against four from memory, one / two threads: q4_k 768x2048
 * 1.26 / 1.07x, 2048x768 1.19 / 1.00x, 4096x2048 1.29 / 1.20x, 7168x2048 1.18 / 1.09x, 3584x3072 1.16 /
 * 1.13x; q6_k at the same shapes 1.13-1.28 / 1.10-1.17x; decode of the 8-layer Qwen3-30B-A3B-width pack
 * with four streams everywhere against the rule before (four only for wide rows and long runs), 30
 * alternate rounds of 32 tokens: 1.045x at the median (quartiles 1.022-1.077). */
int ms_weight_streams_for(int64_t x_bytes, int64_t run_bytes) {
    if (weight_streams) return weight_streams;
    if (intel || (small_l1 && active_isa == MS_ISA_AVX2)) return 4;
    return small_l1 && (8 * x_bytes > 3 * (int64_t)l1d_bytes || run_bytes >= LONG_RUN_BYTES) ? 4 : 1;
}

int64_t ms_long_run_bytes(void) { return LONG_RUN_BYTES; }

/* q4_k's VNNI gemm: each vpdpwssd takes the lane sums of two vpdpbusd, paired by a shift and a word blend
 * (2), or of one, with the scales in the low int16 of each lane (1): on Intel, whose zmm shifts and blends
 * take the multiplies' ports, one (in-process A/B, Xeon, one thread in cache, 768x2048 and 2048x768: 8
 * tokens 0.99-1.03x, 64 tokens 1.05-1.06x); on Zen 4, which runs them beside its one zmm multiply a cycle,
 * two (882492b). 0: automatic. The same integer sums, so the same bits. */
#ifndef MS_Q4K_PAIRS_INTEL
#define MS_Q4K_PAIRS_INTEL 1
#endif
static int q4k_pairs = 0;

int ms_q4k_pairs_setting(void) { return q4k_pairs; }

int ms_set_q4k_pairs(int n) {
    if (n < 0 || n > 2) return -1;
    q4k_pairs = n;
    return 0;
}

int ms_q4k_pairs(void) { return q4k_pairs ? q4k_pairs == 2 : intel ? MS_Q4K_PAIRS_INTEL == 2 : 1; }

int ms_prefetch_level(void) { return prefetch_level; }

int ms_set_prefetch_level(int level) {
    if (level != 1 && level != 2) return -1;
    prefetch_level = level;
    return 0;
}

long ms_l1d_bytes(void) { return l1d_bytes; }

int ms_prefetch_into_l2(int64_t ahead) { return prefetch_level == 2 && 4 * ahead > (int64_t)l1d_bytes; }

void ms_init(void) {
    ms_quant_init();
    __builtin_cpu_init();
#ifdef _SC_LEVEL1_DCACHE_SIZE
    l1d_bytes = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    if (l1d_bytes < 0) l1d_bytes = 0;
#endif
    intel = __builtin_cpu_is("intel");
    has_gfni = __builtin_cpu_supports("gfni");
    small_l1 = l1d_bytes > 0 && l1d_bytes < 48 * 1024;
    prefetch_level = small_l1 ? 2 : 1;
    for (int l = MS_NUM_LEVELS - 1; l >= 0; l--)
        if (ms_set_level((ms_level)l) == 0) break;
}

ms_isa ms_get_isa(void) { return active_isa; }

ms_level ms_get_level(void) { return active_level; }

int ms_set_level(ms_level level) {
    if (!ms_level_supported(level)) return -1;
    active_level = level;
    active_isa = level >= MS_LEVEL_AVX512 ? MS_ISA_AVX512 : (ms_isa)level;
    return 0;
}

int ms_use_vnni(void) { return active_level >= MS_LEVEL_AVX512_VNNI; }

int ms_use_vbmi(void) { return active_level >= MS_LEVEL_AVX512_VBMI; }

int ms_use_gfni(void) { return active_level >= MS_LEVEL_AVX512_VBMI && has_gfni; }

int ms_use_amx(void) { return active_level >= MS_LEVEL_AMX; }

/* Rows [r0, r1) of thread ith: contiguous, multiples of 4 so that dot4 tiles never straddle. */
static void row_range(int64_t rows, int ith, int nth, int64_t *r0, int64_t *r1) {
    int64_t tiles = (rows + 3) / 4;
    *r0 = (tiles * ith / nth) * 4;
    *r1 = (tiles * (ith + 1) / nth) * 4;
    if (*r1 > rows) *r1 = rows;
    if (*r0 > rows) *r0 = rows;
}

/* The tiles of ms_gemm_by_tiles: 16 rows up to 2048 columns, 8 up to 4096, else 4, so that the work set up
 * once a tile and token group (the group's scales, the row loop) is spread over more rows while a tile's
 * unpacked blocks (~320 bytes a block: 15-41 KB up to 4096 columns) stay in L1 or L2 for every group. Zen 4,
 * kernels_ab.py --tokens 8, two threads, against 4-row tiles: q4_k 768x2048 / 4096x2048 / 2048x768 1.04 / 1.04 /
 * 1.05x, q6_k (two rows a pass since the same commit) 1.16 / 1.06 / 1.09x. */
void ms_gemm_by_tiles(ms_gemm_fn gemm, const ms_matrix *m, int64_t row0, int64_t nrows, const char *xp, int64_t stride,
                      int64_t T, float *out, int64_t out_stride) {
    const int64_t tile = m->cols <= 2048 ? 16 : m->cols <= 4096 ? 8 : 4;
    for (int64_t r = 0; r < nrows; r += tile)
        gemm(m, row0 + r, nrows - r < tile ? (int)(nrows - r) : (int)tile, xp, stride, T, out + r, out_stride);
}

/* One product of a batch as the threads see it: the activations prepared (or not) and the cost of
 * its 4-row tiles, by which the batch's tiles are shared out. */
typedef struct {
    const ms_matrix *m;
    const char *x;    /* token t's activations (prepared or not) start at x + t * stride */
    int64_t stride;   /* bytes */
    int64_t T;
    float *out;
    ms_dot4_fn dot4;
    ms_gemm_fn gemm;  /* NULL: dot4 per token */
    ms_rows_fn rows;  /* one token and a format with a kernel for a run of tiles; else NULL */
    ms_gemm_rows_fn gemm_rows; /* several tokens and a format with a gemm for a run of tiles; else NULL */
    int64_t tiles;
    int64_t tile_cost; /* weight bytes of a tile times tokens */
    int64_t cost0;     /* cost of the products before this one */
} product_job;

typedef struct {
    product_job *jobs;
    int n;
    int64_t cost;
    int64_t chunk;     /* 0: thread ith takes the ith of nth equal shares; else shares of this cost, taken in turn */
    atomic_llong next; /* the first cost unit of the next share */
    uint64_t serial;   /* ms_batch_serial */
} batch_job;

static atomic_ullong batches_begun;
static _Thread_local uint64_t running_batch;
uint64_t ms_batch_serial(void) { return running_batch; }

static void run_tile(const product_job *j, int64_t tile) {
    int64_t r = tile * 4;
    int nr = j->m->rows - r < 4 ? (int)(j->m->rows - r) : 4;
    if (j->gemm != NULL) {
        j->gemm(j->m, r, nr, j->x, j->stride, j->T, j->out + r, j->m->rows);
        return;
    }
    float tmp[4];
    for (int64_t t = 0; t < j->T; t++) {
        j->dot4(j->m, r, nr, (const float *)(j->x + t * j->stride), tmp);
        memcpy(j->out + t * j->m->rows + r, tmp, (size_t)nr * sizeof(float));
    }
}

/* k rounded up to a multiple of 4, at most `tiles` */
static inline int64_t up_to_4(int64_t k, int64_t tiles) { return (k + 3) / 4 * 4 < tiles ? (k + 3) / 4 * 4 : tiles; }

/* The tiles whose first cost unit lies in [lo, hi): contiguous rows of each product, every row computed as
 * it would be alone. */
static void run_share(const batch_job *b, int64_t lo, int64_t hi) {
    int first = 0, last = b->n; /* the first product that ends past lo */
    while (first < last) {
        const int mid = (first + last) / 2;
        const product_job *j = &b->jobs[mid];
        if (j->cost0 + j->tiles * j->tile_cost <= lo)
            first = mid + 1;
        else
            last = mid;
    }
    for (int i = first; i < b->n && b->jobs[i].cost0 < hi; i++) {
        const product_job *j = &b->jobs[i];
        int64_t c = j->tile_cost;
        int64_t end = j->cost0 + j->tiles * c;
        int64_t k0 = lo <= j->cost0 ? 0 : (lo - j->cost0 + c - 1) / c;
        int64_t k1 = hi >= end ? j->tiles : (hi - j->cost0 + c - 1) / c;
        if (j->gemm_rows != NULL) { /* whole runs of 16 rows (AMX's weight tiles); every share rounds alike */
            k0 = up_to_4(k0, j->tiles);
            k1 = up_to_4(k1, j->tiles);
        }
        if (j->rows != NULL && k1 > k0) {
            const int64_t r0 = 4 * k0, r1 = 4 * k1 < j->m->rows ? 4 * k1 : j->m->rows;
            j->rows(j->m, r0, r1 - r0, (const float *)j->x, j->out + r0);
        } else if (j->gemm_rows != NULL && k1 > k0) {
            const int64_t r0 = 4 * k0, r1 = 4 * k1 < j->m->rows ? 4 * k1 : j->m->rows;
            j->gemm_rows(j->m, r0, r1 - r0, j->x, j->stride, j->T, j->out + r0, j->m->rows);
        } else {
            for (int64_t k = k0; k < k1; k++) run_tile(j, k);
        }
    }
}

/* Thread ith's share of the batch: the ith of nth equal shares of the cost, or (chunk) shares of chunk cost
 * units taken in turn while any is left, so that a thread that started late or ran slow takes fewer. Which
 * thread runs a row changes nothing in it. */
static void batch_task(void *ctx, int ith, int nth) {
    batch_job *b = ctx;
    running_batch = b->serial;
    if (b->chunk == 0) {
        run_share(b, b->cost * ith / nth, b->cost * (ith + 1) / nth);
    } else {
        for (;;) {
            const int64_t lo = atomic_fetch_add_explicit(&b->next, b->chunk, memory_order_relaxed);
            if (lo >= b->cost) break;
            run_share(b, lo, lo + b->chunk < b->cost ? lo + b->chunk : b->cost);
        }
    }
    running_batch = 0; /* its prepared activations are freed after it */
}

/* The prepared activations of product i may be those of an earlier product j: same tokens, same
 * preparation. Returns j, or -1. */
static int same_prepared(const ms_product *p, int i, const ms_prep_x_fn *prep) {
    for (int j = 0; j < i; j++) {
        if (p[j].x == p[i].x && p[j].T == p[i].T && p[j].m.cols == p[i].m.cols && prep[j] == prep[i] &&
            ms_formats[p[j].m.fmt].prep_bytes == ms_formats[p[i].m.fmt].prep_bytes &&
            ms_formats[p[j].m.fmt].block == ms_formats[p[i].m.fmt].block)
            return j;
    }
    return -1;
}

int ms_matmul_many(const ms_product *p, int n, int nthreads) {
    if (n <= 0) return 0;
    product_job *jobs = calloc((size_t)n, sizeof(product_job));
    ms_prep_x_fn *prep = calloc((size_t)n, sizeof(ms_prep_x_fn));
    int64_t *offset = calloc((size_t)n, sizeof(int64_t)); /* into the prepared buffer; -1: raw x */
    char *owner = calloc((size_t)n, 1);                    /* 1: this product prepares its x */
    if (jobs == NULL || prep == NULL || offset == NULL || owner == NULL) {
        free(jobs);
        free(prep);
        free(offset);
        free(owner);
        return -1;
    }
    int64_t prepared = 0, cost = 0, tiles = 0, max_T = 0;
    for (int i = 0; i < n; i++) {
        const ms_format_traits *f = &ms_formats[p[i].m.fmt];
        product_job *j = &jobs[i];
        prep[i] = f->prep_x[active_isa];
        j->m = &p[i].m;
        j->T = p[i].T;
        if (p[i].T > max_T) max_T = p[i].T;
        j->out = p[i].out;
        j->dot4 = f->dot4[active_isa];
        j->gemm = p[i].T > 1 ? f->gemm[active_isa] : NULL;
        j->rows = p[i].T == 1 ? f->rows[active_isa] : NULL;
        j->gemm_rows = p[i].T > 1 ? f->gemm_rows[active_isa] : NULL;
        j->stride = p[i].m.cols * (int64_t)sizeof(float);
        offset[i] = -1;
        if (prep[i] != NULL) {
            if (f->prep_bytes) j->stride = (p[i].m.cols / f->block) * f->prep_bytes;
            j->stride = (j->stride + 63) & ~(int64_t)63;
            int s = same_prepared(p, i, prep);
            if (s >= 0) {
                offset[i] = offset[s];
            } else {
                offset[i] = prepared;
                owner[i] = 1;
                prepared += p[i].T * j->stride;
            }
        }
        j->tiles = (p[i].m.rows + 3) / 4;
        j->tile_cost = 4 * p[i].m.row_bytes * p[i].T;
        j->cost0 = cost;
        cost += j->tiles * j->tile_cost;
        tiles += j->tiles;
    }
    char *xp = NULL;
    if (prepared > 0 && (xp = aligned_alloc(64, (size_t)prepared)) == NULL) {
        free(jobs);
        free(prep);
        free(offset);
        free(owner);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        product_job *j = &jobs[i];
        if (offset[i] < 0) {
            j->x = (const char *)p[i].x;
            continue;
        }
        j->x = xp + offset[i];
        if (!owner[i]) continue;
        for (int64_t t = 0; t < p[i].T; t++)
            prep[i](p[i].x + t * p[i].m.cols, p[i].m.cols, (float *)(xp + offset[i] + t * j->stride));
    }
    /* Prefill's batches (some product of several tokens) in shares of 1/16 of a thread's: the gemms' speed
     * per cost unit moves with their token groups, and a worker woken from sleep starts late. Decode's keep
     * one contiguous share a thread, which the weight streams are laid out over. */
    batch_job b = {.jobs = jobs, .n = n, .cost = cost, .serial = atomic_fetch_add(&batches_begun, 1) + 1};
    atomic_init(&b.next, 0);
    if (nthreads > tiles) nthreads = (int)tiles;
    if (max_T > 1 && nthreads > 1) b.chunk = cost / (16 * (int64_t)nthreads) + 1;
    ms_parallel(nthreads < 1 ? 1 : nthreads, batch_task, &b);
    free(xp);
    free(jobs);
    free(prep);
    free(offset);
    free(owner);
    return 0;
}

int ms_matmul(const ms_matrix *m, const float *x, int64_t T, float *out, int nthreads) {
    ms_product p = {*m, x, T, out};
    return ms_matmul_many(&p, 1, nthreads);
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
    int streams;
    double sums[256];
} memread_job;

/* XOR of the 8-byte words of p[0:n], read as `streams` equal runs (whole 256-byte steps) taken 256 bytes from
 * each in turn, then the bytes left over. One stream is a plain sequential read; several keep more lines in
 * flight on CPUs whose prefetchers follow each stream on its own (Xeon Sapphire Rapids, 2 threads: one
 * stream 20-23 GB/s, four 25-32). */
__attribute__((target("avx2"))) static uint64_t read_avx2(const uint8_t *p, int64_t n, int streams) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    const int64_t run = n / streams / 256 * 256;
    for (int64_t i = 0; i < run; i += 256) {
        for (int s = 0; s < streams; s++) {
            const uint8_t *q = p + s * run + i;
            for (int o = 0; o < 256; o += 128) {
                a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i *)(q + o)));
                a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i *)(q + o + 32)));
                a2 = _mm256_xor_si256(a2, _mm256_loadu_si256((const __m256i *)(q + o + 64)));
                a3 = _mm256_xor_si256(a3, _mm256_loadu_si256((const __m256i *)(q + o + 96)));
            }
        }
    }
    a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    uint64_t l[4];
    _mm256_storeu_si256((__m256i *)l, a0);
    uint64_t s = l[0] ^ l[1] ^ l[2] ^ l[3];
    int64_t i = run * streams;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        s ^= v;
    }
    for (; i < n; i++) s ^= p[i];
    return s;
}

static uint64_t read_scalar(const uint8_t *p, int64_t n, int streams) {
    uint64_t s = 0;
    const int64_t run = n / streams / 256 * 256;
    for (int64_t i = 0; i < run; i += 256) {
        for (int k = 0; k < streams; k++) {
            for (int o = 0; o < 256; o += 8) {
                uint64_t v;
                memcpy(&v, p + k * run + i + o, 8);
                s ^= v;
            }
        }
    }
    int64_t i = run * streams;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        memcpy(&v, p + i, 8);
        s ^= v;
    }
    for (; i < n; i++) s ^= p[i];
    return s;
}

static void memread_task(void *ctx, int ith, int nth) {
    memread_job *j = ctx;
    int64_t a = j->n * ith / nth, b = j->n * (ith + 1) / nth;
    uint64_t s = active_isa >= MS_ISA_AVX2 ? read_avx2(j->p + a, b - a, j->streams)
                                               : read_scalar(j->p + a, b - a, j->streams);
    j->sums[ith] = (double)(s & 0xffff);
}

double ms_memread(const uint8_t *p, int64_t n, int nthreads, int streams) {
    memread_job j;
    memset(&j, 0, sizeof(j));
    j.p = p;
    j.n = n;
    j.streams = streams < 1 ? 1 : streams > 64 ? 64 : streams;
    if (nthreads > 256) nthreads = 256;
    if (nthreads < 1) nthreads = 1;
    ms_parallel(nthreads, memread_task, &j);
    double s = 0;
    for (int i = 0; i < nthreads; i++) s += j.sums[i];
    return s;
}
