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
 * Work is split over (sequence, KV head) pairs with OpenMP; built with -fopenmp it shares the
 * OpenMP runtime torch has loaded (the same libgomp.so.1), so it uses torch's threads.
 * Scores are kept per pair (G x len floats), then one softmax, then one pass over V.
 */
#include <math.h>
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
    int failed = 0;

#pragma omp parallel
    {
        float *scores = NULL;
        int64_t capacity = 0;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t h = 0; h < Hkv; h++) {
                const int64_t n = lens[b];
                float *o = out + (b * Hq + h * G) * D;
                memset(o, 0, sizeof(float) * G * D);
                if (n <= 0 || n > max_blocks * block_size) {
                    continue;
                }
                if (n > capacity) {
                    free(scores);
                    capacity = n;
                    scores = malloc(sizeof(float) * G * capacity);
                    if (scores == NULL) {
                        capacity = 0;
#pragma omp atomic write
                        failed = 2;
                        continue;
                    }
                }
                const float *qh = q + (b * Hq + h * G) * D;
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
                const int64_t head_offset = h * D;

                /* scores[g][t] = q_g . k_t * scale */
                for (int64_t t0 = 0; t0 < n; t0 += block_size) {
                    const int64_t block = table[t0 / block_size];
                    const float *kb = kv + block * block_stride + head_offset;
                    const int64_t len = n - t0 < block_size ? n - t0 : block_size;
                    for (int64_t i = 0; i < len; i++) {
                        const float *k = kb + i * token_stride;
                        for (int64_t g = 0; g < G; g++) {
                            const float *qg = qh + g * D;
                            float s = 0.0f;
#pragma omp simd reduction(+ : s)
                            for (int64_t d = 0; d < D; d++) {
                                s += qg[d] * k[d];
                            }
                            scores[g * n + t0 + i] = s * scale;
                        }
                    }
                }
                /* softmax per query head */
                float inv_sum[G];
                for (int64_t g = 0; g < G; g++) {
                    float *row = scores + g * n;
                    float peak = row[0];
                    for (int64_t t = 1; t < n; t++) {
                        peak = row[t] > peak ? row[t] : peak;
                    }
                    float sum = 0.0f;
                    for (int64_t t = 0; t < n; t++) {
                        row[t] = expf(row[t] - peak);
                        sum += row[t];
                    }
                    inv_sum[g] = 1.0f / sum;
                }
                /* o_g = sum_t p[g][t] v_t */
                for (int64_t t0 = 0; t0 < n; t0 += block_size) {
                    const int64_t block = table[t0 / block_size];
                    const float *vb = v_base + block * block_stride + head_offset;
                    const int64_t len = n - t0 < block_size ? n - t0 : block_size;
                    for (int64_t i = 0; i < len; i++) {
                        const float *v = vb + i * token_stride;
                        for (int64_t g = 0; g < G; g++) {
                            const float p = scores[g * n + t0 + i];
                            float *og = o + g * D;
#pragma omp simd
                            for (int64_t d = 0; d < D; d++) {
                                og[d] += p * v[d];
                            }
                        }
                    }
                }
                for (int64_t g = 0; g < G; g++) {
                    float *og = o + g * D;
                    const float f = inv_sum[g];
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) {
                        og[d] *= f;
                    }
                }
            }
        }
        free(scores);
    }
    return failed;
}
