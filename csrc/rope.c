/* Rotary position embedding (see rope.h). Built with -ffp-contract=off: no product is fused into its sum. */
#include "rope.h"

void ms_rope(const float *x, int64_t T, int64_t heads, int64_t D, const float *cos, const float *sin, int interleave,
             float *out) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *v = x + (t * heads + h) * D;
            float *o = out + (t * heads + h) * D;
            if (interleave) {
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = v[2 * i], x2 = v[2 * i + 1];
                    o[i] = x1 * c[i] - x2 * s[i];
                    o[i + half] = x2 * c[i] + x1 * s[i];
                }
            } else {
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = v[i], x2 = v[i + half];
                    o[i] = x1 * c[i] - x2 * s[i];
                    o[i + half] = x2 * c[i] + x1 * s[i];
                }
            }
        }
    }
}
