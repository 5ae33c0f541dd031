/* A persistent pool of worker threads. ms_parallel runs fn(ctx, ith, nth) for ith in [0, nth) with
 * the caller as ith = 0 and returns when all are done. Calls from several threads are serialised. */
#ifndef MOESTREAM_THREADPOOL_H
#define MOESTREAM_THREADPOOL_H
#include <stdint.h>

typedef void (*ms_task_fn)(void *ctx, int ith, int nth);

#define MS_MAX_THREADS 256

void ms_parallel(int nth, ms_task_fn fn, void *ctx);

/* How many threads to split `parts` independent parts (heads) of `macs` multiply-adds in all: at most
 * nthreads, parts and MS_MAX_THREADS, and only as many as get about 64k multiply-adds each (waking a thread
 * costs more than less work saves); at least 1. */
int ms_threads_for(int nthreads, int64_t parts, int64_t macs);

#endif
