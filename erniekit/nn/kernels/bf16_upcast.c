/* bf16 -> float32 into a caller's buffer (erniekit/nn/lora.py `_upcast`): a bf16 value is the upper
 * 16 bits of the float32 of the same value, so each output is the input shifted left by 16, exactly
 * Paddle's cast and numpy's `left_shift` twin. One pass, no allocation. */
#include <stdint.h>

void erniekit_bf16_upcast(const uint16_t *src, uint32_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = (uint32_t)src[i] << 16;
}
