/* softmax(s + bias) over the last axis, forward and backward, for the CPU attention
 * (erniekit/nn/masked_softmax.py).
 *
 * One pass per row where Paddle runs an expand, an add and a softmax forward and their backward
 * over the whole score tensor. The arithmetic is erniekit/nn/masked_softmax.py's numpy path
 * operation for operation, so the two give the same bits:
 *   z = s + bias; m = max(z); e = exp_neg(z - m); p = e * (1 / sum16(e))
 *   ds = p * (dp - sum16(p * dp))
 * exp_neg (Cephes' expf) and sum16 (16 lanes) are lanes.h's.
 *
 * Layout: s, p, dp, ds [B, G, Sq, Sk] contiguous; bias [Bb, 1, Sq, Sk] with Bb = 1 or B (shared
 * by the G heads). A call handles the planes [p0, p1) of the B * G planes of Sq rows.
 */
#include "lanes.h"

void erniekit_masked_softmax_fwd(const float *s, const float *bias, float *p, int64_t G, int64_t Sq, int64_t Sk,
                                 int64_t bias_batched, int64_t p0, int64_t p1) {
    for (int64_t plane = p0; plane < p1; plane++) {
        const int64_t b = plane / G;
        for (int64_t i = 0; i < Sq; i++) {
            const int64_t off = (plane * Sq + i) * Sk;
            const float *srow = s + off;
            const float *brow = bias + ((bias_batched ? b : 0) * Sq + i) * Sk;
            float *prow = p + off;
            float mx[LANES];
            for (int l = 0; l < LANES; l++) mx[l] = -__builtin_inff();
            FOR_LANES(Sk, j, l, {
                const float z = srow[j] + brow[j];
                prow[j] = z;
                mx[l] = z > mx[l] ? z : mx[l];
            });
            float m = mx[0];
            for (int l = 1; l < LANES; l++) m = mx[l] > m ? mx[l] : m;
            float acc[LANES] = {0};
            FOR_LANES(Sk, j, l, {
                const float e = exp_neg(prow[j] - m);
                prow[j] = e;
                acc[l] += e;
            });
            const float inv = 1.0f / lane_total(acc);
            for (int64_t j = 0; j < Sk; j++) prow[j] = prow[j] * inv;
        }
    }
}

void erniekit_masked_softmax_bwd(const float *p, const float *dp, float *ds, int64_t Sk, int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; row++) {
        const float *prow = p + row * Sk, *drow = dp + row * Sk;
        float *out = ds + row * Sk;
        float acc[LANES] = {0};
        FOR_LANES(Sk, j, l, acc[l] += prow[j] * drow[j]);
        const float dot = lane_total(acc);
        for (int64_t j = 0; j < Sk; j++) out[j] = prow[j] * (drow[j] - dot);
    }
}
