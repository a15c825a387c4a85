/* ERNIE 4.5's rotary embedding on interleaved pairs, forward and backward, for float32 CPU
 * activations (erniekit/nn/rope.py).
 *
 * The eager rope is an expand of cos and sin to the heads, a 2x2 pair-rotation matmul, two
 * products and a sum each way; here one pass reads x (or its gradient) and the unexpanded cos/sin.
 * The arithmetic is the eager ops' and the numpy path's, operation for operation:
 *   y[2i]   = x[2i] * cos[2i] + (-x[2i+1]) * sin[2i]      y[2i+1]  = x[2i+1] * cos[2i+1] + x[2i] * sin[2i+1]
 *   dx[2i]  = g[2i] * cos[2i] + g[2i+1] * sin[2i+1]       dx[2i+1] = g[2i+1] * cos[2i+1] + (-g[2i]) * sin[2i]
 * Layout: x, y [R, H, D] contiguous (R = batch * sequence positions), cos, sin [R, D] shared by
 * the H heads. A call handles the positions [r0, r1).
 */
#include <stdint.h>

void erniekit_rope_fwd(const float *x, const float *cs, const float *sn, float *y, int64_t H, int64_t D, int64_t r0,
                       int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *c = cs + r * D, *s = sn + r * D;
        for (int64_t h = 0; h < H; h++) {
            const float *xr = x + (r * H + h) * D;
            float *yr = y + (r * H + h) * D;
            for (int64_t i = 0; i < D; i += 2) {
                const float a = xr[i], b = xr[i + 1];
                yr[i] = a * c[i] + (-b) * s[i];
                yr[i + 1] = b * c[i + 1] + a * s[i + 1];
            }
        }
    }
}

void erniekit_rope_bwd(const float *g, const float *cs, const float *sn, float *dx, int64_t H, int64_t D, int64_t r0,
                       int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *c = cs + r * D, *s = sn + r * D;
        for (int64_t h = 0; h < H; h++) {
            const float *gr = g + (r * H + h) * D;
            float *out = dx + (r * H + h) * D;
            for (int64_t i = 0; i < D; i += 2) {
                const float a = gr[i], b = gr[i + 1];
                out[i] = a * c[i] + b * s[i + 1];
                out[i + 1] = b * c[i + 1] + (-a) * s[i];
            }
        }
    }
}
