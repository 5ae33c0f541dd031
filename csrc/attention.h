/* Grouped-query attention of one new token (decode) against its key/value cache, with the per-head
 * RMSNorm and rotary embedding of Qwen3-style models, in one call: what numpy did in a dozen small
 * operations per layer. */
#ifndef MOESTREAM_ATTENTION_H
#define MOESTREAM_ATTENTION_H
#include <stdint.h>

typedef struct {
    const float *q;              /* [H, D] the new token's query projection (before norm and rope) */
    const float *k, *v;          /* [KV, D] its key and value projections */
    float *kcache, *vcache;      /* [KV, cap, D]; position pos is written here */
    int64_t cap, pos;            /* capacity of the caches; the new token's position */
    int64_t window;              /* attend to positions > pos - window; 0 for all */
    int H, KV, D;                /* heads, key/value heads (H % KV == 0), head dim (even) */
    const float *q_norm, *k_norm; /* [D] RMSNorm weights, or NULL for none */
    float eps;
    const float *cos, *sin;      /* [D/2] for position pos (attention factor included) */
    int interleave;              /* rope pairs (2i, 2i+1) instead of (i, i + D/2) */
    float scaling;
    float *out;                  /* [H, D] */
} ms_gqa_decode_args;

/* Writes the new key and value into the caches and out = softmax(q K^T * scaling) V per head. The
 * norm and rope give the bits of the numpy blocks (models/base.py: rms_norm, Rope.apply); each score
 * and output element has one fixed reduction order, the same on every instruction set; threads split
 * heads. 0, or -1 when scratch memory cannot be allocated. */
int ms_gqa_decode(const ms_gqa_decode_args *a, int nthreads);

#endif
