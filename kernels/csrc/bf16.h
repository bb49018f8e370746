/* bfloat16 <-> float32 for the CPU kernels: a bfloat16 is the top half of a float32, so
 * widening is a shift and narrowing rounds to nearest, ties to even (a NaN stays a quiet NaN),
 * as torch rounds. Inline and branch-light: loops over them vectorize. */
#ifndef PDMESH_BF16_H
#define PDMESH_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#endif
