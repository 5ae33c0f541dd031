#define _GNU_SOURCE
#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <immintrin.h>

/* Workers spin this many pause instructions for the next job before sleeping on the condition
 * variable: decode issues hundreds of small kernels per token, back to back. */
#define SPIN_ITERS 20000

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER; /* one ms_parallel at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_start = PTHREAD_COND_INITIALIZER;
static atomic_uint gen;      /* incremented for every job */
static atomic_int pending;   /* workers still running the current job */
static int n_workers;        /* threads created so far (excluding callers) */
static ms_task_fn job_fn;
static void *job_ctx;
static int job_nth;
static unsigned start_gen[MS_MAX_THREADS]; /* gen when worker i was created: its first job is the next */

static void *worker_main(void *arg) {
    int idx = (int)(long)arg; /* worker idx runs ith = idx + 1 */
    unsigned seen = start_gen[idx];
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&gen, memory_order_acquire)) == seen && spins < SPIN_ITERS) {
            _mm_pause();
            spins++;
        }
        /* Read the generation and the job together under the lock: the job fields belong to
         * exactly that generation, so each job is run at most once. */
        pthread_mutex_lock(&mu);
        while ((g = atomic_load(&gen)) == seen) pthread_cond_wait(&cv_start, &mu);
        seen = g;
        ms_task_fn fn = job_fn;
        void *ctx = job_ctx;
        int nth = job_nth;
        pthread_mutex_unlock(&mu);
        if (idx + 1 < nth) {
            fn(ctx, idx + 1, nth);
            atomic_fetch_sub_explicit(&pending, 1, memory_order_release);
        }
    }
    return NULL;
}

int ms_threads_for(int nthreads, int64_t parts, int64_t macs) {
    int64_t nth = nthreads < MS_MAX_THREADS ? nthreads : MS_MAX_THREADS;
    if (nth > parts) nth = parts;
    while (nth > 1 && macs / nth < (1 << 16)) nth--;
    return nth < 1 ? 1 : (int)nth;
}

void ms_parallel(int nth, ms_task_fn fn, void *ctx) {
    if (nth > MS_MAX_THREADS) nth = MS_MAX_THREADS;
    if (nth <= 1) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&call_lock);
    while (n_workers < nth - 1) {
        pthread_t t;
        start_gen[n_workers] = atomic_load(&gen);
        if (pthread_create(&t, NULL, worker_main, (void *)(long)n_workers) != 0) break;
        pthread_detach(t);
        n_workers++;
    }
    if (n_workers < nth - 1) nth = n_workers + 1; /* could not start more threads: fewer rows each */
    pthread_mutex_lock(&mu);
    job_fn = fn;
    job_ctx = ctx;
    job_nth = nth;
    atomic_store(&pending, nth - 1);
    atomic_fetch_add_explicit(&gen, 1, memory_order_release);
    pthread_cond_broadcast(&cv_start);
    pthread_mutex_unlock(&mu);
    fn(ctx, 0, nth);
    while (atomic_load_explicit(&pending, memory_order_acquire) > 0) _mm_pause();
    pthread_mutex_unlock(&call_lock);
}
