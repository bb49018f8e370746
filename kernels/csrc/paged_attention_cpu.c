/* Paged decode attention on CPU, float32: one query token per sequence, read straight from
 * the paged KV cache.
 *
 * Why: torch can only attend over a contiguous K/V, so the SDPA path first gathers every
 * sequence's blocks into a fresh buffer (a full copy of the context, at memory bandwidth) and
 * then reads it again. This kernel reads each K and V row once, where it lies, which is the
 * memory floor of a decode step.
 *
 * Layouts (all contiguous):
 *   q      [B, Hq, D]                         the step's queries
 *   kv     [2, num_blocks, block_size, Hkv, D] one layer of the cache (K then V)
 *   tables [B, max_blocks]                    int64 block ids per sequence
 *   lens   [B]                                int64 context length, the new token included
 *   out    [B, Hq, D]
 * Returns 0, 1 for a bad shape, 2 when out of memory, 3 for a block id outside the cache.
 * Query heads h * G .. h * G + G - 1 share KV head h (G = Hq / Hkv, grouped-query attention).
 *
 * Work is split with OpenMP over sequences, each item taking all KV heads when there are
 * enough sequences to keep every thread busy (each token's K and V rows are then read whole
 * and in order: 1.5-2x faster at long contexts than one head at a time), else over
 * (sequence, KV head) pairs. Built with -fopenmp it shares the OpenMP runtime torch has
 * loaded (the same libgomp.so.1), so it uses torch's threads. Scores are kept per item
 * (its query heads x len floats), then one softmax, then one pass over V.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int pdmesh_paged_decode_attention_f32(
    const float *q, const float *kv, const int64_t *tables, const int64_t *lens, float *out,
    int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size, int64_t num_blocks,
    int64_t max_blocks, float scale)
{
    if (Hkv <= 0 || Hq % Hkv != 0 || D <= 0 || block_size <= 0) {
        return 1;
    }
    const int64_t G = Hq / Hkv;
    const int64_t token_stride = Hkv * D;
    const int64_t block_stride = block_size * token_stride;
    const float *v_base = kv + num_blocks * block_stride;
    /* KV heads per work item: all of them when the sequences alone keep the threads busy. */
    const int64_t HC = B >= 2 * (int64_t)omp_get_max_threads() ? Hkv : 1;
    const int64_t chunks = Hkv / HC;
    const int64_t R = HC * G; /* query rows per item */
    int failed = 0;

#pragma omp parallel
    {
        float *scores = NULL;
        int64_t capacity = 0;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t n = lens[b];
                const int64_t h0 = c * HC;
                float *o = out + (b * Hq + h0 * G) * D; /* R rows of D */
                memset(o, 0, sizeof(float) * R * D);
                if (n <= 0 || n > max_blocks * block_size) {
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
                        continue;
                    }
                }
                const float *qc = q + (b * Hq + h0 * G) * D;
                const int64_t *table = tables + b * max_blocks;
                int bad_block = 0;
                for (int64_t j = 0; j < (n + block_size - 1) / block_size; j++) {
                    bad_block |= table[j] < 0 || table[j] >= num_blocks;
                }
                if (bad_block) {
#pragma omp atomic write
                    failed = 3;
                    continue;
                }

                /* scores[r][t] = q_r . k_t(head of r) * scale */
                for (int64_t t0 = 0; t0 < n; t0 += block_size) {
                    const float *kb = kv + table[t0 / block_size] * block_stride + h0 * D;
                    const int64_t len = n - t0 < block_size ? n - t0 : block_size;
                    for (int64_t i = 0; i < len; i++) {
                        const float *krow = kb + i * token_stride;
                        for (int64_t r = 0; r < R; r++) {
                            const float *k = krow + (r / G) * D;
                            const float *qr = qc + r * D;
                            float s = 0.0f;
#pragma omp simd reduction(+ : s)
                            for (int64_t d = 0; d < D; d++) {
                                s += qr[d] * k[d];
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
                    const float *vb = v_base + table[t0 / block_size] * block_stride + h0 * D;
                    const int64_t len = n - t0 < block_size ? n - t0 : block_size;
                    for (int64_t i = 0; i < len; i++) {
                        const float *vrow = vb + i * token_stride;
                        for (int64_t r = 0; r < R; r++) {
                            const float *v = vrow + (r / G) * D;
                            const float p = scores[r * n + t0 + i];
                            float *orow = o + r * D;
#pragma omp simd
                            for (int64_t d = 0; d < D; d++) {
                                orow[d] += p * v[d];
                            }
                        }
                    }
                }
            }
        }
        free(scores);
    }
    return failed;
}

/* Write the step's K and V rows into the paged cache: token t's key (Hkv * D floats, rows
 * `k_stride` / `v_stride` floats apart, views into the QKV projection's output) goes to
 * kv[0][slots[t]], its value to kv[1][slots[t]]. One call per layer instead of two indexed
 * copies. Returns 0, or 3 when a slot lies outside the cache (nothing written for it). */
int pdmesh_reshape_and_cache_f32(
    const float *key, const float *value, float *kv, const int64_t *slots, int64_t T,
    int64_t row, int64_t k_stride, int64_t v_stride, int64_t num_slots)
{
    int bad = 0;
    float *const v_cache = kv + num_slots * row;
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0 || slot >= num_slots) {
            bad = 1;
            continue;
        }
        memcpy(kv + slot * row, key + t * k_stride, (size_t)row * sizeof(float));
        memcpy(v_cache + slot * row, value + t * v_stride, (size_t)row * sizeof(float));
    }
    return bad ? 3 : 0;
}
