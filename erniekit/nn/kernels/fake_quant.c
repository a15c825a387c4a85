/* Block-scaled FP8 fake quantisation on the CPU in one pass over the data (erniekit/nn/fp8.py).
 *
 * The same arithmetic as fp8.py's numpy path, element for element, so the values are bit-identical:
 *   amax  = max |x| over the tile, as float32 bits (NaN above inf)
 *   scale = max(amax / fmax, 2^-126)            (float32; a NaN amax stays NaN)
 *   t     = x / scale                           (IEEE division, correctly rounded)
 *   M     = bits((max(bits(t) & exp_mask, floor_bits)) + add_bits)
 *   out   = ((t + M) - M) * scale
 * Build without -ffast-math and with -ffp-contract=off: every operation must round as written.
 *
 * A tile is `cols` consecutive columns of a run of rows [starts[k], starts[k+1]): rowwise 1 x b
 * tiles are runs of one row with cols = b; b x b weight tiles runs of b rows with cols = b; dW's
 * token-run tiles runs that start at each expert group's first row with cols = 1.
 */
#include <stdint.h>
#include <string.h>

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

void erniekit_fake_quant_runs(const float *x, float *out, int64_t C, const int64_t *starts, int64_t nruns,
                              int64_t cols, float fmax, uint32_t floor_bits, uint32_t add_bits,
                              uint32_t *amax, float *scale) {
    const float scale_floor = u2f(0x00800000u); /* 2^-126, the smallest normal float32 */
    for (int64_t k = 0; k < nruns; k++) {
        const int64_t r0 = starts[k], r1 = starts[k + 1];
        for (int64_t c = 0; c < C; c++) amax[c] = 0;
        for (int64_t r = r0; r < r1; r++) {
            const float *row = x + r * C;
            for (int64_t c = 0; c < C; c++) {
                uint32_t u = f2u(row[c]) & 0x7FFFFFFFu;
                amax[c] = u > amax[c] ? u : amax[c];
            }
        }
        for (int64_t c0 = 0; c0 < C; c0 += cols) {
            uint32_t m = 0;
            for (int64_t c = c0; c < c0 + cols; c++) m = amax[c] > m ? amax[c] : m;
            float s = u2f(m) / fmax;
            if (s < scale_floor) s = scale_floor; /* false for NaN: NaN stays */
            for (int64_t c = c0; c < c0 + cols; c++) scale[c] = s;
        }
        for (int64_t r = r0; r < r1; r++) {
            const float *row = x + r * C;
            float *o = out + r * C;
            for (int64_t c = 0; c < C; c++) {
                float t = row[c] / scale[c];
                uint32_t e = f2u(t) & 0x7F800000u;
                e = e > floor_bits ? e : floor_bits;
                float magic = u2f(e + add_bits);
                float q = t + magic;
                q = q - magic;
                o[c] = q * scale[c];
            }
        }
    }
}
