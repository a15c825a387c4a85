/* Softmax cross entropy of rows of logits against one label each, forward and backward, for the CPU
 * language-model losses (erniekit/nn/cross_entropy.py).
 *
 * Paddle's CPU cross_entropy_with_softmax writes the whole softmax in its forward (~5.6 ms for the
 * embedded default's [2048, 1024] logits at 2 threads, torch ~1.1 ms); here the forward keeps one
 * log-sum-exp per row and the backward recomputes the probabilities from the logits. The arithmetic
 * is erniekit/nn/cross_entropy.py's numpy path operation for operation, so the two give the same bits:
 *   m = max(x); s = sum16(exp_neg(x - m)); lse = m + (float)log((double)s); nll = lse - x[label]
 *   dx = exp_neg(x - lse) * g, and dx[label] -= g      (rows whose label is `ignore`: nll 0, dx 0)
 * exp_neg (Cephes' expf) and sum16 (16 lanes) are lanes.h's. A call handles the rows [r0, r1).
 */
#include <math.h>

#include "lanes.h"

void erniekit_ce_fwd(const float *x, const int64_t *label, float *nll, float *lse, int64_t V, int64_t ignore,
                     int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; row++) {
        const float *xr = x + row * V;
        float mx[LANES];
        for (int l = 0; l < LANES; l++) mx[l] = -__builtin_inff();
        FOR_LANES(V, j, l, mx[l] = xr[j] > mx[l] ? xr[j] : mx[l]);
        float m = mx[0];
        for (int l = 1; l < LANES; l++) m = mx[l] > m ? mx[l] : m;
        float acc[LANES] = {0};
        FOR_LANES(V, j, l, acc[l] += exp_neg(xr[j] - m));
        const float t = m + (float)log((double)lane_total(acc));
        lse[row] = t;
        nll[row] = label[row] == ignore ? 0.0f : t - xr[label[row]];
    }
}

void erniekit_ce_bwd(const float *x, const int64_t *label, const float *lse, const float *g, float *dx, int64_t V,
                     int64_t ignore, int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; row++) {
        const float *xr = x + row * V;
        float *out = dx + row * V;
        if (label[row] == ignore) {
            for (int64_t j = 0; j < V; j++) out[j] = 0.0f;
            continue;
        }
        const float t = lse[row], gr = g[row];
        for (int64_t j = 0; j < V; j++) out[j] = exp_neg(xr[j] - t) * gr;
        out[label[row]] = out[label[row]] - gr;
    }
}
