/* Paged decode attention on CPU, float32 and bfloat16: one query token per sequence, read
 * straight from the paged KV cache.
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

#include "bf16.h"

/* float32 */
#define PA_T float
#define PA_LOAD(x) (x)
#define PA_STORE_ROWS(dst, src, count) memcpy((dst), (src), sizeof(float) * (size_t)(count))
#define PA_ATTENTION pdmesh_paged_decode_attention_f32
#define PA_CACHE pdmesh_reshape_and_cache_f32
#include "paged_attention_body.h"
#undef PA_T
#undef PA_LOAD
#undef PA_STORE_ROWS
#undef PA_ATTENTION
#undef PA_CACHE

/* bfloat16: K, V and q widened as they are read, the output rounded once at the end. */
static inline void store_bf16_rows(uint16_t *dst, const float *src, int64_t count) {
    for (int64_t e = 0; e < count; e++) dst[e] = f32_to_bf16(src[e]);
}
#define PA_T uint16_t
#define PA_LOAD(x) bf16_to_f32(x)
#define PA_STORE_ROWS(dst, src, count) store_bf16_rows((dst), (src), (count))
#define PA_ATTENTION pdmesh_paged_decode_attention_bf16
#define PA_CACHE pdmesh_reshape_and_cache_bf16
#include "paged_attention_body.h"
