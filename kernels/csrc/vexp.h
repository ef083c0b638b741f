/* exp(x) in fp32 to ~1 ulp, written so that loops over it vectorize (libm's expf does not
 * without -ffast-math): x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial, times 2^n
 * put together in the exponent bits. x is clamped to [-87, 88] (results 1.6e-38 .. 1.7e38:
 * no denormals, no inf); callers take softmax weights (x <= 0) and SiLU's sigmoid, where the
 * clamp moves nothing they keep. Shared by paged_decode.c and cpu_ops.c. */
#ifndef ZS_VEXP_H
#define ZS_VEXP_H
#include <math.h>
#include <stdint.h>

static inline float zs_expf(float x) {
    x = x < -87.0f ? -87.0f : x;  /* two selects: fminf / fmaxf would not vectorize */
    x = x > 88.0f ? 88.0f : x;
    const float n = rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {((int32_t)n + 127) << 23};  /* 2^n (a memcpy does not vectorize) */
    return p * scale.f;
}
#endif
