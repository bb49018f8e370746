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
 *   window > 0: each query sees only its context's last `window` tokens (a sliding window;
 *          the blocks before it are not read); 0: the whole context.
 * Returns 0, 1 for a bad shape, 2 when out of memory, 3 for a block id outside the cache.
 * Query heads h * G .. h * G + G - 1 share KV head h (G = Hq / Hkv, grouped-query attention).
 *
 * Work is split with OpenMP over sequences, each item taking all KV heads when there are
 * enough sequences to keep every thread busy (each token's K and V rows are then read whole
 * and in order: 1.5-2x faster at long contexts than one head at a time), else over
 * (sequence, KV head) pairs. Built with -fopenmp it shares the OpenMP runtime torch has
 * loaded (the same libgomp.so.1), so it uses torch's threads. Scores are kept per item
 * (its query heads x len floats), then one softmax, then one pass over V.
 *
 * The arithmetic was the cost, then memory stalls: one step of SmolLM2's 30 layers (16
 * sequences of ~300 tokens) took 20-22 ms where reading its K/V takes ~9. With AVX-512 the
 * scores of 16 tokens are reduced together (pa_sum16x16: a transpose-and-add tree, ~3
 * instructions a dot instead of a horizontal sum each) and a row's output stays in registers
 * across a block; the next block's rows are prefetched as the current one is read (blocks lie
 * anywhere, so the hardware prefetcher cannot follow); head sizes 64 and 128 are compiled in.
 * Now ~13 ms. Other CPUs and head sizes take the plain C loops.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp_f32.h"

/* Ask for `rows` rows of `row_bytes` each, `stride` elements of `elem` bytes apart, ahead of
 * use: a sequence's blocks lie anywhere in the cache, so the hardware prefetcher cannot guess
 * the next one, and without this a core waits on memory at every block (bench/README.md,
 * "The decode step's kernels"). */
static inline void pa_prefetch_rows(const void *p, int64_t rows, int64_t stride,
                                    int64_t row_bytes, size_t elem) {
    const char *c = (const char *)p;
    for (int64_t i = 0; i < rows; i++) {
        for (int64_t off = 0; off < row_bytes; off += 64) {
            __builtin_prefetch(c + i * stride * (int64_t)elem + off, 0, 3);
        }
    }
}

#if defined(__AVX512F__)
/* With AVX-512: 16 dot products reduced together (a transpose-and-add tree, ~3 instructions
 * a dot instead of a horizontal sum each) and the output rows kept in registers. */
#include <immintrin.h>
#define PA_AVX512 1
#define PA_MAX_VECTORS 16 /* head_dim up to 256 in registers */

/* Per 128-bit chunk j: [sum_j(a), sum_j(b), sum_j(c), sum_j(d)], sum_j the chunk's 4 lanes. */
static inline __m512 pa_sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
}

/* Lane t of the result: the sum of x[t]'s 16 lanes. */
static inline __m512 pa_sum16x16(const __m512 x[16]) {
    const __m512 y0 = pa_sum4(x[0], x[1], x[2], x[3]), y1 = pa_sum4(x[4], x[5], x[6], x[7]);
    const __m512 y2 = pa_sum4(x[8], x[9], x[10], x[11]);
    const __m512 y3 = pa_sum4(x[12], x[13], x[14], x[15]);
    const __m512 p = _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(y2, y3, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(y2, y3, _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(p, q, _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline __m512 pa_load16_bf16(const uint16_t *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* float32 */
#define PA_T float
#define PA_LOAD(x) (x)
#define PA_STORE_ROWS(dst, src, count) memcpy((dst), (src), sizeof(float) * (size_t)(count))
#define PA_ATTENTION pdmesh_paged_decode_attention_f32
#define PA_CACHE pdmesh_reshape_and_cache_f32
#define PA_FN(name) pa_##name##_f32
#define PA_LOAD16(p) _mm512_loadu_ps(p)
#include "paged_attention_body.h"
#undef PA_T
#undef PA_LOAD
#undef PA_STORE_ROWS
#undef PA_ATTENTION
#undef PA_CACHE
#undef PA_FN
#undef PA_LOAD16

/* bfloat16: K, V and q widened as they are read, the output rounded once at the end. */
static inline void store_bf16_rows(uint16_t *dst, const float *src, int64_t count) {
    for (int64_t e = 0; e < count; e++) dst[e] = f32_to_bf16(src[e]);
}
#define PA_T uint16_t
#define PA_LOAD(x) bf16_to_f32(x)
#define PA_STORE_ROWS(dst, src, count) store_bf16_rows((dst), (src), (count))
#define PA_ATTENTION pdmesh_paged_decode_attention_bf16
#define PA_CACHE pdmesh_reshape_and_cache_bf16
#define PA_FN(name) pa_##name##_bf16
#define PA_LOAD16(p) pa_load16_bf16(p)
#include "paged_attention_body.h"
