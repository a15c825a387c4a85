/* softmax(s + bias) over the last axis, forward and backward, for the CPU attention
 * (erniekit/nn/masked_softmax.py).
 *
 * One pass per row where Paddle runs an expand, an add and a softmax forward and their backward
 * over the whole score tensor. The arithmetic is erniekit/nn/masked_softmax.py's numpy path
 * operation for operation, so the two give the same bits:
 *   z = s + bias; m = max(z); e = exp_neg(z - m); p = e * (1 / sum16(e))
 *   ds = p * (dp - sum16(p * dp))
 * exp_neg is Cephes' expf (range reduction by ln 2 in two parts, a degree-6 polynomial, the power
 * of two from the exponent bits), 0 below -87; sum16 adds element j into lane j % 16 in order, then
 * the 16 lanes in order (the compiler vectorises the lanes; numpy repeats it with two cumsums).
 * The constants are written in hex: the float32 values the numpy path uses, with no decimal rounding.
 * Build without -ffast-math and with -ffp-contract=off: every operation rounds as written.
 *
 * Layout: s, p, dp, ds [B, G, Sq, Sk] contiguous; bias [Bb, 1, Sq, Sk] with Bb = 1 or B (shared
 * by the G heads). A call handles the planes [p0, p1) of the B * G planes of Sq rows.
 */
#include <stdint.h>
#include <string.h>

#define LANES 16

static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float exp_neg(float x) {
    const float lo = -87.0f;
    float c = x < lo ? lo : x;
    float n = __builtin_floorf(c * 0x1.715476p+0f + 0.5f);
    float r = c - n * 0x1.63p-1f;
    r = r - n * -0x1.bd0106p-13f;
    float p = 0x1.a0d2cep-13f;
    p = p * r + 0x1.6e879cp-10f;
    p = p * r + 0x1.11121p-7f;
    p = p * r + 0x1.555382p-5f;
    p = p * r + 0x1.555554p-3f;
    p = p * r + 0x1p-1f;
    p = p * (r * r) + r;
    p = p + 1.0f;
    int32_t e = (int32_t)n + 127;
    float two_n = u2f((uint32_t)e << 23);
    return x < lo ? 0.0f : p * two_n;
}

static inline float lane_total(const float *acc) {
    float t = acc[0];
    for (int l = 1; l < LANES; l++) t += acc[l];
    return t;
}

void erniekit_masked_softmax_fwd(const float *s, const float *bias, float *p, int64_t G, int64_t Sq, int64_t Sk,
                                 int64_t bias_batched, int64_t p0, int64_t p1) {
    const int64_t full = Sk - Sk % LANES;
    for (int64_t plane = p0; plane < p1; plane++) {
        const int64_t b = plane / G;
        for (int64_t i = 0; i < Sq; i++) {
            const int64_t off = (plane * Sq + i) * Sk;
            const float *srow = s + off;
            const float *brow = bias + ((bias_batched ? b : 0) * Sq + i) * Sk;
            float *prow = p + off;
            float mx[LANES];
            for (int l = 0; l < LANES; l++) mx[l] = -__builtin_inff();
            int64_t j = 0;
            for (; j < full; j += LANES)
                for (int l = 0; l < LANES; l++) {
                    float z = srow[j + l] + brow[j + l];
                    prow[j + l] = z;
                    mx[l] = z > mx[l] ? z : mx[l];
                }
            for (int l = 0; j + l < Sk; l++) {
                float z = srow[j + l] + brow[j + l];
                prow[j + l] = z;
                mx[l] = z > mx[l] ? z : mx[l];
            }
            float m = mx[0];
            for (int l = 1; l < LANES; l++) m = mx[l] > m ? mx[l] : m;
            float acc[LANES] = {0};
            for (j = 0; j < full; j += LANES)
                for (int l = 0; l < LANES; l++) {
                    float e = exp_neg(prow[j + l] - m);
                    prow[j + l] = e;
                    acc[l] += e;
                }
            for (int l = 0; j + l < Sk; l++) {
                float e = exp_neg(prow[j + l] - m);
                prow[j + l] = e;
                acc[l] += e;
            }
            const float inv = 1.0f / lane_total(acc);
            for (j = 0; j < Sk; j++) prow[j] = prow[j] * inv;
        }
    }
}

void erniekit_masked_softmax_bwd(const float *p, const float *dp, float *ds, int64_t Sk, int64_t r0, int64_t r1) {
    const int64_t full = Sk - Sk % LANES;
    for (int64_t row = r0; row < r1; row++) {
        const float *prow = p + row * Sk, *drow = dp + row * Sk;
        float *out = ds + row * Sk;
        float acc[LANES] = {0};
        int64_t j = 0;
        for (; j < full; j += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += prow[j + l] * drow[j + l];
        for (int l = 0; j + l < Sk; l++) acc[l] += prow[j + l] * drow[j + l];
        const float dot = lane_total(acc);
        for (j = 0; j < Sk; j++) out[j] = prow[j] * (drow[j] - dot);
    }
}
