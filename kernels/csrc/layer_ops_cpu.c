/* Per-layer elementwise ops of a Llama block on CPU, float32: RMSNorm (with the residual add
 * fused in), SiLU-and-mul and rotate-half RoPE in place.
 *
 * Why C: at a decode step's few rows each of these is a handful of torch ops on a few
 * kilobytes, and the dispatch around them costs more than the arithmetic (RMSNorm alone is
 * pow, mean, add, rsqrt, mul, mul). One pass per row here, vectorized by the compiler. Rows
 * are split over torch's OpenMP threads only when there is enough work to pay for waking them
 * (a prefill chunk); a decode step's rows run on the calling thread.
 *
 * Numerics follow the torch reference (kernels/layer_ops.py, TorchLayerOps) up to float32
 * rounding: sums of squares in 16 partial sums, and exp from a Cephes-style polynomial
 * (~1 ulp, exp_f32.h) because the C library's expf does not vectorize without -ffast-math.
 *
 * Return codes: 0 ok, 1 bad shape.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp_f32.h"

#define PARALLEL_MIN_ELEMS 32768 /* below this, one thread: waking the others costs more */
#define LANES 16

static inline float sum_of_squares(const float *h, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += h[i + j] * h[i + j];
    float total = 0.0f;
    for (int j = 0; j < LANES; j++) total += acc[j];
    for (; i < n; i++) total += h[i] * h[i];
    return total;
}

static inline void normalize_row(const float *h, const float *w, float *out, int64_t n,
                                 float eps) {
    const float inv = 1.0f / sqrtf(sum_of_squares(h, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (h[i] * inv);
}

/* out[r] = w * x[r] / rms(x[r]) */
int pdmesh_rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t n,
                        float eps) {
    if (rows < 0 || n <= 0) return 1;
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) normalize_row(x + r * n, w, out + r * n, n, eps);
    return 0;
}

/* residual[r] += x[r]; out[r] = w * residual[r] / rms(residual[r]) */
int pdmesh_add_rms_norm_f32(const float *x, float *residual, const float *w, float *out,
                            int64_t rows, int64_t n, float eps) {
    if (rows < 0 || n <= 0) return 1;
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        float *h = residual + r * n;
        const float *add = x + r * n;
        for (int64_t i = 0; i < n; i++) h[i] += add[i];
        normalize_row(h, w, out + r * n, n, eps);
    }
    return 0;
}

/* gate_up[r] = [gate | up] (2n values); out[r] = silu(gate) * up */
int pdmesh_silu_and_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t n) {
    if (rows < 0 || n <= 0) return 1;
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * n;
        const float *up = gate + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = gate[i] / (1.0f + exp_f32(-gate[i])) * up[i];
    }
    return 0;
}

static inline void rotate_heads(float *row, int64_t heads, int64_t dim, const float *c,
                                const float *s) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *a = row + h * dim;
        float *b = a + half;
        for (int64_t i = 0; i < half; i++) {
            const float ai = a[i], bi = b[i];
            a[i] = ai * c[i] - bi * s[i];
            b[i] = bi * c[i] + ai * s[i];
        }
    }
}

/* Rotate-half RoPE in place on q [T, hq, dim] and k [T, hk, dim], heads contiguous within a
 * token's row, rows `q_stride` / `k_stride` floats apart (views into the QKV projection's
 * output); cos and sin are [T, dim / 2]. */
int pdmesh_rope_f32(float *q, float *k, const float *cos_t, const float *sin_t, int64_t tokens,
                    int64_t hq, int64_t hk, int64_t dim, int64_t q_stride, int64_t k_stride) {
    if (tokens < 0 || dim <= 0 || dim % 2 || q_stride < hq * dim || k_stride < hk * dim)
        return 1;
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (tokens * (hq + hk) * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        rotate_heads(q + t * q_stride, hq, dim, c, s);
        rotate_heads(k + t * k_stride, hk, dim, c, s);
    }
    return 0;
}
