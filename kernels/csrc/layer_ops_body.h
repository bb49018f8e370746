/* The body of the per-layer elementwise ops, once per element type: layer_ops_cpu.c includes it
 * with LO_T (the element type), LO_LOAD (an element as float32), LO_STORE (a float32 as an
 * element), LO_ROUND (a float32 rounded to the element type's precision, where the torch
 * reference rounds an intermediate: the identity for float32) and LO_NAME(op) (the exported
 * name of `op` for this type) defined. The arithmetic is float32 whatever the element type.
 */

static inline void LO_NAME(normalize_row)(const LO_T *h, const LO_T *w, LO_T *out, int64_t n,
                                          float eps) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) {
            const float v = LO_LOAD(h[i + j]);
            acc[j] += v * v;
        }
    float total = 0.0f;
    for (int j = 0; j < LANES; j++) total += acc[j];
    for (; i < n; i++) total += LO_LOAD(h[i]) * LO_LOAD(h[i]);
    const float inv = 1.0f / sqrtf(total / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = LO_STORE(LO_LOAD(w[i]) * LO_ROUND(LO_LOAD(h[i]) * inv));
}

/* out[r] = w * x[r] / rms(x[r]) */
int LO_NAME(rms_norm)(const LO_T *x, const LO_T *w, LO_T *out, int64_t rows, int64_t n,
                      float eps) {
    if (rows < 0 || n <= 0) return 1;
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) LO_NAME(normalize_row)(x + r * n, w, out + r * n, n, eps);
    return 0;
}

/* residual[r] += x[r]; out[r] = w * residual[r] / rms(residual[r]) */
int LO_NAME(add_rms_norm)(const LO_T *x, LO_T *residual, const LO_T *w, LO_T *out,
                          int64_t rows, int64_t n, float eps) {
    if (rows < 0 || n <= 0) return 1;
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        LO_T *h = residual + r * n;
        const LO_T *add = x + r * n;
        for (int64_t i = 0; i < n; i++) h[i] = LO_STORE(LO_LOAD(h[i]) + LO_LOAD(add[i]));
        LO_NAME(normalize_row)(h, w, out + r * n, n, eps);
    }
    return 0;
}

/* gate_up[r] = [gate | up] (2n values); out[r] = silu(gate) * up */
int LO_NAME(silu_and_mul)(const LO_T *gate_up, LO_T *out, int64_t rows, int64_t n) {
    if (rows < 0 || n <= 0) return 1;
#pragma omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const LO_T *gate = gate_up + r * 2 * n;
        const LO_T *up = gate + n;
        LO_T *o = out + r * n;
        for (int64_t i = 0; i < n; i++) {
            const float g = LO_LOAD(gate[i]);
            o[i] = LO_STORE(LO_ROUND(g / (1.0f + exp_f32(-g))) * LO_LOAD(up[i]));
        }
    }
    return 0;
}

static inline void LO_NAME(rotate_heads)(LO_T *row, int64_t heads, int64_t dim, const float *c,
                                         const float *s) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        LO_T *a = row + h * dim;
        LO_T *b = a + half;
        for (int64_t i = 0; i < half; i++) {
            const float ai = LO_LOAD(a[i]), bi = LO_LOAD(b[i]);
            const float ci = LO_ROUND(c[i]), si = LO_ROUND(s[i]);
            a[i] = LO_STORE(LO_ROUND(ai * ci) - LO_ROUND(bi * si));
            b[i] = LO_STORE(LO_ROUND(bi * ci) + LO_ROUND(ai * si));
        }
    }
}

/* Rotate-half RoPE in place on q [T, hq, dim] and k [T, hk, dim], heads contiguous within a
 * token's row, rows `q_stride` / `k_stride` elements apart (views into the QKV projection's
 * output); cos and sin are float32 [T, dim / 2]. */
int LO_NAME(rope)(LO_T *q, LO_T *k, const float *cos_t, const float *sin_t, int64_t tokens,
                  int64_t hq, int64_t hk, int64_t dim, int64_t q_stride, int64_t k_stride) {
    if (tokens < 0 || dim <= 0 || dim % 2 || q_stride < hq * dim || k_stride < hk * dim)
        return 1;
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (tokens * (hq + hk) * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        LO_NAME(rotate_heads)(q + t * q_stride, hq, dim, c, s);
        LO_NAME(rotate_heads)(k + t * k_stride, hk, dim, c, s);
    }
    return 0;
}
