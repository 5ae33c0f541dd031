/* A persistent pool of worker threads. ms_parallel runs fn(ctx, ith, nth) for ith in [0, nth) with
 * the caller as ith = 0 and returns when all are done. Calls from several threads are serialised. */
#ifndef MOESTREAM_THREADPOOL_H
#define MOESTREAM_THREADPOOL_H

typedef void (*ms_task_fn)(void *ctx, int ith, int nth);

#define MS_MAX_THREADS 256

void ms_parallel(int nth, ms_task_fn fn, void *ctx);

#endif
