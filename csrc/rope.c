/* Rotary position embedding (see rope.h). Built with -ffp-contract=off: no product is fused into its sum. */
#include "rope.h"

void ms_rope_row(const float *x, int64_t D, const float *c, const float *s, int interleave, float *out) {
    const int64_t half = D / 2;
    if (interleave) {
        for (int64_t i = 0; i < half; i++) {
            const float x1 = x[2 * i], x2 = x[2 * i + 1];
            out[i] = x1 * c[i] - x2 * s[i];
            out[i + half] = x2 * c[i] + x1 * s[i];
        }
    } else {
        for (int64_t i = 0; i < half; i++) {
            const float x1 = x[i], x2 = x[i + half];
            out[i] = x1 * c[i] - x2 * s[i];
            out[i + half] = x2 * c[i] + x1 * s[i];
        }
    }
}

void ms_rope(const float *x, int64_t T, int64_t heads, int64_t D, const float *cos, const float *sin, int interleave,
             float *out) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++)
            ms_rope_row(x + (t * heads + h) * D, D, cos + t * (D / 2), sin + t * (D / 2), interleave,
                        out + (t * heads + h) * D);
}
