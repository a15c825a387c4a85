/* silu(gate) * up elementwise, forward and backward, for the SwiGLU MLPs and experts
 * (erniekit/nn/swiglu.py).
 *
 * Paddle's CPU silu runs at ~1/3 of torch's speed on one thread and does not use a second one;
 * with the product and their backward that is ~6 passes over the MLP's widest activation. These do
 * it in one pass each way. The arithmetic is erniekit/nn/swiglu.py's numpy path operation for
 * operation, so the two give the same bits:
 *   e = exp_neg(-|g|);  d = 1 + e;  s = g >= 0 ? 1 / d : e / d   (sigmoid(g), either sign stable)
 *   forward:  h = (g * s) * u
 *   backward: du = dh * (g * s);  dg = (dh * u) * (s * (1 + g * (1 - s)))
 * exp_neg (Cephes' expf) is lanes.h's. Elements [i0, i1) per call; dg or du may be NULL.
 */
#include "lanes.h"

static inline float sigmoid(float g) {
    const float e = exp_neg(g >= 0.0f ? -g : g);
    const float d = 1.0f + e;
    return (g >= 0.0f ? 1.0f : e) / d; /* 1 / d or e / d: one division a lane, not two and a blend */
}

void erniekit_swiglu_fwd(const float *g, const float *u, float *h, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
        const float gi = g[i];
        h[i] = (gi * sigmoid(gi)) * u[i];
    }
}

/* One loop per case: with the NULL checks inside, GCC vectorised only one of the unswitched copies
 * (the backward ran ~3x the forward's time on one thread; AMD EPYC, AVX2). */
void erniekit_swiglu_bwd(const float *restrict g, const float *restrict u, const float *restrict dh, float *restrict dg,
                         float *restrict du, int64_t i0, int64_t i1) {
    if (dg && du) {
        for (int64_t i = i0; i < i1; i++) {
            const float gi = g[i], s = sigmoid(gi);
            du[i] = dh[i] * (gi * s);
            dg[i] = (dh[i] * u[i]) * (s * (1.0f + gi * (1.0f - s)));
        }
    } else if (dg) {
        for (int64_t i = i0; i < i1; i++) {
            const float gi = g[i], s = sigmoid(gi);
            dg[i] = (dh[i] * u[i]) * (s * (1.0f + gi * (1.0f - s)));
        }
    } else if (du) {
        for (int64_t i = i0; i < i1; i++) du[i] = dh[i] * (g[i] * sigmoid(g[i]));
    }
}
