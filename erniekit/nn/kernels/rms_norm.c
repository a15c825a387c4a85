/* RMSNorm over the last axis, forward and backward, one pass per row (erniekit/nn/norm.py).
 *
 * Paddle's eager ops make ~5 passes forward and ~12 backward over the activation, each a separate
 * kernel; these do each direction in one. The arithmetic is erniekit/nn/norm.py's numpy path
 * operation for operation, so the two give the same bits:
 *   forward:  r = 1 / sqrt(sum16(x * x) / H + eps);  y = (x * r) * w
 *   backward: n = x * r;  dn = dy * w;  t = sum16(dn * n) / H
 *             dx = (dn - n * t) * (r * (r / r));  p = dy * n   (dw = the column sums of p)
 * r * (r / r) is r, or NaN where mean(x^2) overflowed (r = 0), as autograd's rsqrt gives.
 * sum16 is lanes.h's (16 lanes, then the lanes in order).
 *
 * Layout: x, y, dy, dx, p [N, H] contiguous, w [H], r [N]. A call handles the rows [r0, r1).
 * dx or p may be NULL (the input or the weight needs no gradient).
 */
#include <math.h>

#include "lanes.h"

void erniekit_rms_norm_fwd(const float *x, const float *w, float *y, float *r, int64_t H, float eps, int64_t r0,
                           int64_t r1) {
    const float fh = (float)H;
    for (int64_t i = r0; i < r1; i++) {
        const float *xr = x + i * H;
        float *yr = y + i * H;
        float acc[LANES] = {0};
        FOR_LANES(H, j, l, acc[l] += xr[j] * xr[j]);
        float m = lane_total(acc) / fh;
        m = m + eps;
        const float ri = 1.0f / sqrtf(m);
        r[i] = ri;
        for (int64_t j = 0; j < H; j++) yr[j] = (xr[j] * ri) * w[j];
    }
}

void erniekit_rms_norm_bwd(const float *x, const float *w, const float *r, const float *dy, float *dx, float *p,
                           int64_t H, int64_t r0, int64_t r1) {
    const float fh = (float)H;
    for (int64_t i = r0; i < r1; i++) {
        const float *xr = x + i * H, *dyr = dy + i * H;
        const float ri = r[i];
        if (p) {
            float *pr = p + i * H;
            for (int64_t j = 0; j < H; j++) pr[j] = dyr[j] * (xr[j] * ri);
        }
        if (!dx) continue;
        float acc[LANES] = {0};
        FOR_LANES(H, j, l, acc[l] += (dyr[j] * w[j]) * (xr[j] * ri));
        const float t = lane_total(acc) / fh;
        const float rr = ri * (ri / ri);
        float *dxr = dx + i * H;
        for (int64_t j = 0; j < H; j++) {
            const float n = xr[j] * ri;
            dxr[j] = ((dyr[j] * w[j]) - n * t) * rr;
        }
    }
}
