/* Rotary position embedding of a prefill's heads, with the bits of numpy's float32 steps (models/base.py:
 * Rope.apply). */
#ifndef MOESTREAM_ROPE_H
#define MOESTREAM_ROPE_H
#include <stdint.h>

/* x [T, heads, D] -> out [T, heads, D] (out may not be x): for token t's head, with c = cos[t], s = sin[t]
 * ([T, D/2] each) and x1, x2 its two halves (interleave: its even and odd elements), the low half of out
 * x1 * c - x2 * s and the high half x2 * c + x1 * s, each product and sum rounded to float32 as numpy does. */
void ms_rope(const float *x, int64_t T, int64_t heads, int64_t D, const float *cos, const float *sin, int interleave,
             float *out);

#endif
