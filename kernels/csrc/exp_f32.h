/* exp(x) for float32 without the C library, shared by the layer-op kernels: range reduction
 * by ln 2 in two parts, a degree-6 polynomial on [-ln2/2, ln2/2] (Cephes-style, ~1 ulp), and
 * 2^n built in the exponent bits. Inputs are clamped to where 2^n stays a normal number;
 * branch-free and inline, so the loops that call it vectorize (the C library's expf does not
 * without -ffast-math). */
#ifndef PDMESH_EXP_F32_H
#define PDMESH_EXP_F32_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float exp_f32(float x) {
    x = x < -87.33654f ? -87.33654f : x;
    x = x > 88.0f ? 88.0f : x;
    const float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
