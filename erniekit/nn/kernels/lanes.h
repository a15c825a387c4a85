/* Arithmetic the CPU kernels share, written so that their numpy twins (erniekit/nn/native.py,
 * erniekit/nn/masked_softmax.py) compute the same bits. Included by the kernels' .c files; the
 * build cache key covers this header (erniekit/nn/native.py).
 *
 * lane_total: sums go into LANES lanes (element j of a row into lane j % 16, in order, by FOR_LANES),
 * then the lanes are added in order; the compiler vectorises the lanes, numpy repeats it with two cumsums.
 * exp_neg: exp(x) for x <= 0 as Cephes' expf computes it (range reduction by ln 2 in two parts, a
 * degree-6 polynomial, the power of two from the exponent bits), 0 below -87. The constants are
 * written in hex: the float32 values the numpy path uses, with no decimal rounding.
 * Build without -ffast-math and with -ffp-contract=off: every operation rounds as written.
 */
#ifndef ERNIEKIT_LANES_H
#define ERNIEKIT_LANES_H

#include <stdint.h>
#include <string.h>

#define LANES 16

static inline float lane_total(const float *acc) {
    float t = acc[0];
    for (int l = 1; l < LANES; l++) t += acc[l];
    return t;
}

/* The statement(s) after (n, j, l) for j = 0 .. n - 1 in order, with l = j % LANES: the whole
 * groups of LANES first (the inner loop is the one the compiler vectorises), then the tail. Every
 * lane sum in the kernels walks its row through this, so where an element lands is written once. */
#define FOR_LANES(n, j, l, ...)                     \
    do {                                            \
        const int64_t n_ = (n), full_ = n_ - n_ % LANES; \
        int64_t base_ = 0;                          \
        for (; base_ < full_; base_ += LANES)       \
            for (int l = 0; l < LANES; l++) {       \
                const int64_t j = base_ + l;        \
                __VA_ARGS__;                        \
            }                                       \
        for (int l = 0; base_ + l < n_; l++) {      \
            const int64_t j = base_ + l;            \
            __VA_ARGS__;                            \
        }                                           \
    } while (0)

static inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

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

#endif
