/* The per-layer elementwise ops of layer_ops_cpu.c for bfloat16 tensors: RMSNorm (with the
 * residual add), SiLU-and-mul and rotate-half RoPE in place.
 *
 * Why: in bfloat16 the torch forms of these ops are slower than in float32 (each op converts
 * to float and back, RMSNorm five times over): a bfloat16 step of SmolLM2 spent more in them
 * than in its GEMMs' AMX work saved (bench/README.md, "bfloat16 on CPU"). Here each value is
 * widened to float32 once, computed in float32, and rounded back to bfloat16 (round to
 * nearest even) where the torch reference (kernels/layer_ops.py, TorchLayerOps) rounds: the
 * normalised row before the weight multiplies it, silu(gate) before `up` does, the residual
 * after the add, each RoPE product (of cos and sin rounded to bfloat16) before their sum:
 * bit for bit what the reference gives, as transformers' Llama does in bfloat16.
 *
 * Return codes: 0 ok, 1 bad shape.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp_f32.h"

#define BF16_PARALLEL_MIN_ELEMS 32768 /* below this, one thread: waking the others costs more */
#define BF16_LANES 16

static inline void normalize_row_bf16(const uint16_t *h, const uint16_t *w, uint16_t *out,
                                      int64_t n, float eps) {
    float acc[BF16_LANES] = {0};
    int64_t i = 0;
    for (; i + BF16_LANES <= n; i += BF16_LANES)
        for (int j = 0; j < BF16_LANES; j++) {
            const float v = bf16_to_f32(h[i + j]);
            acc[j] += v * v;
        }
    float total = 0.0f;
    for (int j = 0; j < BF16_LANES; j++) total += acc[j];
    for (; i < n; i++) total += bf16_to_f32(h[i]) * bf16_to_f32(h[i]);
    const float inv = 1.0f / sqrtf(total / (float)n + eps);
    for (i = 0; i < n; i++)
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_round(bf16_to_f32(h[i]) * inv));
}

/* out[r] = w * x[r] / rms(x[r]) */
int pdmesh_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t rows,
                         int64_t n, float eps) {
    if (rows < 0 || n <= 0) return 1;
#pragma omp parallel for schedule(static) if (rows * n >= BF16_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) normalize_row_bf16(x + r * n, w, out + r * n, n, eps);
    return 0;
}

/* residual[r] += x[r] (rounded to bfloat16, as the reference's in-place add); out[r] = w *
 * residual[r] / rms(residual[r]) */
int pdmesh_add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *w,
                             uint16_t *out, int64_t rows, int64_t n, float eps) {
    if (rows < 0 || n <= 0) return 1;
#pragma omp parallel for schedule(static) if (rows * n >= BF16_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *h = residual + r * n;
        const uint16_t *add = x + r * n;
        for (int64_t i = 0; i < n; i++)
            h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(add[i]));
        normalize_row_bf16(h, w, out + r * n, n, eps);
    }
    return 0;
}

/* gate_up[r] = [gate | up] (2n values); out[r] = silu(gate) * up */
int pdmesh_silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t n) {
    if (rows < 0 || n <= 0) return 1;
#pragma omp parallel for schedule(static) if (rows * n >= BF16_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * n;
        const uint16_t *up = gate + n;
        uint16_t *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float g = bf16_to_f32(gate[i]);
            o[i] = f32_to_bf16(bf16_round(g / (1.0f + exp_f32(-g))) * bf16_to_f32(up[i]));
        }
    }
    return 0;
}

static inline void rotate_heads_bf16(uint16_t *row, int64_t heads, int64_t dim, const float *c,
                                     const float *s) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *a = row + h * dim;
        uint16_t *b = a + half;
        for (int64_t i = 0; i < half; i++) {
            const float ai = bf16_to_f32(a[i]), bi = bf16_to_f32(b[i]);
            const float ci = bf16_round(c[i]), si = bf16_round(s[i]);
            a[i] = f32_to_bf16(bf16_round(ai * ci) - bf16_round(bi * si));
            b[i] = f32_to_bf16(bf16_round(bi * ci) + bf16_round(ai * si));
        }
    }
}

/* Rotate-half RoPE in place on bfloat16 q [T, hq, dim] and k [T, hk, dim] (rows `q_stride` /
 * `k_stride` elements apart, as pdmesh_rope_f32); cos and sin are float32 [T, dim / 2]. */
int pdmesh_rope_bf16(uint16_t *q, uint16_t *k, const float *cos_t, const float *sin_t,
                     int64_t tokens, int64_t hq, int64_t hk, int64_t dim, int64_t q_stride,
                     int64_t k_stride) {
    if (tokens < 0 || dim <= 0 || dim % 2 || q_stride < hq * dim || k_stride < hk * dim)
        return 1;
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) \
    if (tokens * (hq + hk) * dim >= BF16_PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        rotate_heads_bf16(q + t * q_stride, hq, dim, c, s);
        rotate_heads_bf16(k + t * k_stride, hk, dim, c, s);
    }
    return 0;
}
