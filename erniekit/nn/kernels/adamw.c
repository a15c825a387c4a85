/* One AdamW update of a float32 parameter in place, in one pass (erniekit/train/optim.py).
 *
 * The numpy path's arithmetic element for element, each operation rounded to float32 as written
 * (sqrt and division are correctly rounded in both), so the two give the same bits:
 *   m = m * b1 + g * c1;  v = v * b2 + (g * g) * c2;  p = p * decay (when decay_on)
 *   p = p + (m * neg_lr_bc1) / (sqrt(v / bc2) + eps)
 * Build without -ffast-math and with -ffp-contract=off. Elements [i0, i1) per call.
 */
#include <math.h>
#include <stdint.h>

void erniekit_adamw(float *p, const float *g, float *m, float *v, float b1, float c1, float b2, float c2,
                    int64_t decay_on, float decay, float bc2, float eps, float neg_lr_bc1, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
        const float gi = g[i];
        float mi = m[i] * b1;
        mi = mi + gi * c1;
        m[i] = mi;
        float vi = v[i] * b2;
        vi = vi + (gi * gi) * c2;
        v[i] = vi;
        float pi = p[i];
        if (decay_on) pi = pi * decay;
        float den = sqrtf(vi / bc2);
        den = den + eps;
        float u = mi * neg_lr_bc1;
        u = u / den;
        p[i] = pi + u;
    }
}
