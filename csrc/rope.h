/* Rotary position embedding with the bits of numpy's float32 steps (models/base.py: Rope.apply). */
#ifndef MOESTREAM_ROPE_H
#define MOESTREAM_ROPE_H
#include <stdint.h>

/* One head's x [D] -> out [D] (out may not be x): with x1, x2 its two halves (interleave: its even and odd
 * elements), the low half of out x1 * c - x2 * s and the high half x2 * c + x1 * s (c, s [D/2]), each product
 * and sum rounded to float32 as numpy does. */
void ms_rope_row(const float *x, int64_t D, const float *c, const float *s, int interleave, float *out);

/* ms_rope_row over a prefill's heads: x [T, heads, D] -> out, token t's with cos[t], sin[t] ([T, D/2] each). */
void ms_rope(const float *x, int64_t T, int64_t heads, int64_t D, const float *cos, const float *sin, int interleave,
             float *out);

#endif
