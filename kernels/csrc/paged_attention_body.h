/* The body of the paged decode attention and cache-write kernels, once per element type:
 * paged_attention_cpu.c includes it with PA_T (the element type), PA_LOAD (an element as
 * float32), PA_STORE_ROWS (float32 rows into elements) and the two function names defined.
 * The arithmetic is float32 whatever the element type; only loads and the final store differ.
 */
int PA_ATTENTION(
    const PA_T *q, const PA_T *kv, const int64_t *tables, const int64_t *lens, PA_T *out,
    int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size, int64_t num_blocks,
    int64_t max_blocks, float scale)
{
    if (Hkv <= 0 || Hq % Hkv != 0 || D <= 0 || block_size <= 0) {
        return 1;
    }
    const int64_t G = Hq / Hkv;
    const int64_t token_stride = Hkv * D;
    const int64_t block_stride = block_size * token_stride;
    const PA_T *v_base = kv + num_blocks * block_stride;
    /* KV heads per work item: all of them when the sequences alone keep the threads busy. */
    const int64_t HC = B >= 2 * (int64_t)omp_get_max_threads() ? Hkv : 1;
    const int64_t chunks = Hkv / HC;
    const int64_t R = HC * G; /* query rows per item */
    int failed = 0;

#pragma omp parallel
    {
        float *scores = NULL;
        int64_t capacity = 0;
        float *acc = malloc(sizeof(float) * 2 * R * D); /* the item's output rows, then its q */
        float *qf = acc != NULL ? acc + R * D : NULL;
        if (acc == NULL) {
#pragma omp atomic write
            failed = 2;
        }
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t n = lens[b];
                const int64_t h0 = c * HC;
                PA_T *o = out + (b * Hq + h0 * G) * D; /* R rows of D */
                if (acc == NULL) {
                    continue;
                }
                memset(acc, 0, sizeof(float) * R * D);
                if (n <= 0 || n > max_blocks * block_size) {
                    PA_STORE_ROWS(o, acc, R * D);
                    continue;
                }
                if (n > capacity) {
                    free(scores);
                    capacity = n;
                    scores = malloc(sizeof(float) * R * capacity);
                    if (scores == NULL) {
                        capacity = 0;
#pragma omp atomic write
                        failed = 2;
                        PA_STORE_ROWS(o, acc, R * D);
                        continue;
                    }
                }
                const PA_T *qc = q + (b * Hq + h0 * G) * D;
                for (int64_t e = 0; e < R * D; e++) {
                    qf[e] = PA_LOAD(qc[e]);
                }
                const int64_t *table = tables + b * max_blocks;
                int bad_block = 0;
                for (int64_t j = 0; j < (n + block_size - 1) / block_size; j++) {
                    bad_block |= table[j] < 0 || table[j] >= num_blocks;
                }
                if (bad_block) {
#pragma omp atomic write
                    failed = 3;
                    PA_STORE_ROWS(o, acc, R * D);
                    continue;
                }

                /* scores[r][t] = q_r . k_t(head of r) * scale */
                for (int64_t t0 = 0; t0 < n; t0 += block_size) {
                    const PA_T *kb = kv + table[t0 / block_size] * block_stride + h0 * D;
                    const int64_t len = n - t0 < block_size ? n - t0 : block_size;
                    for (int64_t i = 0; i < len; i++) {
                        const PA_T *krow = kb + i * token_stride;
                        for (int64_t r = 0; r < R; r++) {
                            const PA_T *k = krow + (r / G) * D;
                            const float *qr = qf + r * D;
                            float s = 0.0f;
#pragma omp simd reduction(+ : s)
                            for (int64_t d = 0; d < D; d++) {
                                s += qr[d] * PA_LOAD(k[d]);
                            }
                            scores[r * n + t0 + i] = s * scale;
                        }
                    }
                }
                /* softmax per query row; its 1 / sum is applied at the end */
                for (int64_t r = 0; r < R; r++) {
                    float *row = scores + r * n;
                    float peak = row[0];
                    for (int64_t t = 1; t < n; t++) {
                        peak = row[t] > peak ? row[t] : peak;
                    }
                    float sum = 0.0f;
                    for (int64_t t = 0; t < n; t++) {
                        row[t] = expf(row[t] - peak);
                        sum += row[t];
                    }
                    const float f = 1.0f / sum;
                    for (int64_t t = 0; t < n; t++) {
                        row[t] *= f;
                    }
                }
                /* o_r = sum_t p[r][t] v_t(head of r) */
                for (int64_t t0 = 0; t0 < n; t0 += block_size) {
                    const PA_T *vb = v_base + table[t0 / block_size] * block_stride + h0 * D;
                    const int64_t len = n - t0 < block_size ? n - t0 : block_size;
                    for (int64_t i = 0; i < len; i++) {
                        const PA_T *vrow = vb + i * token_stride;
                        for (int64_t r = 0; r < R; r++) {
                            const PA_T *v = vrow + (r / G) * D;
                            const float p = scores[r * n + t0 + i];
                            float *orow = acc + r * D;
#pragma omp simd
                            for (int64_t d = 0; d < D; d++) {
                                orow[d] += p * PA_LOAD(v[d]);
                            }
                        }
                    }
                }
                PA_STORE_ROWS(o, acc, R * D);
            }
        }
        free(scores);
        free(acc);
    }
    return failed;
}

/* Write the step's K and V rows into the paged cache: token t's key (Hkv * D elements, rows
 * `k_stride` / `v_stride` elements apart, views into the QKV projection's output) goes to
 * kv[0][slots[t]], its value to kv[1][slots[t]]. One call per layer instead of two indexed
 * copies. Returns 0, or 3 when a slot lies outside the cache (nothing written for it). */
int PA_CACHE(
    const PA_T *key, const PA_T *value, PA_T *kv, const int64_t *slots, int64_t T,
    int64_t row, int64_t k_stride, int64_t v_stride, int64_t num_slots)
{
    int bad = 0;
    PA_T *const v_cache = kv + num_slots * row;
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0 || slot >= num_slots) {
            bad = 1;
            continue;
        }
        memcpy(kv + slot * row, key + t * k_stride, (size_t)row * sizeof(PA_T));
        memcpy(v_cache + slot * row, value + t * v_stride, (size_t)row * sizeof(PA_T));
    }
    return bad ? 3 : 0;
}
