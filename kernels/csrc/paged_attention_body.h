/* The body of the paged decode attention and cache-write kernels, once per element type:
 * paged_attention_cpu.c includes it with PA_T (the element type), PA_LOAD (an element as
 * float32), PA_LOAD16 (16 elements as a float32 vector, where PA_AVX512 is defined),
 * PA_STORE_ROWS (float32 rows into elements), the two function names and PA_FN (a helper's
 * name for that type) defined. The arithmetic is float32 whatever the element type; only
 * loads and the final store differ.
 */
#ifdef PA_AVX512
/* q . k as 16 partial sums (D a multiple of 16) */
static inline __attribute__((always_inline)) __m512 PA_FN(dot16)(
    const float *restrict q, const PA_T *restrict k, const int64_t D)
{
    __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q), PA_LOAD16(k));
    for (int64_t c = 16; c < D; c += 16) {
        s = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), PA_LOAD16(k + c), s);
    }
    return s;
}
#endif

/* scores[r][t0 + i] = q_r . k_i * scale for the `len` tokens of one block, query rows
 * r0 .. r0 + G - 1 sharing the KV head whose rows start at `kh`. */
static inline __attribute__((always_inline)) void PA_FN(block_scores)(
    const float *restrict qf, const PA_T *restrict kh, float *restrict scores, int64_t n,
    int64_t t0, int64_t len, int64_t r0, int64_t G, int64_t token_stride, float scale,
    const int64_t D)
{
#ifdef PA_AVX512
    if (D % 16 == 0) {
        /* 16 tokens at a time: each dot a vector of partial sums, the 16 reduced together */
        for (int64_t i0 = 0; i0 < len; i0 += 16) {
            const int64_t m = len - i0 < 16 ? len - i0 : 16;
            for (int64_t g = 0; g < G; g++) {
                const float *qr = qf + (r0 + g) * D;
                __m512 part[16];
                const PA_T *k = kh + i0 * token_stride;
                if (m == 16) { /* a whole group, no test per token: ~9 % off a step (--step 30) */
                    for (int64_t t = 0; t < 16; t++) {
                        part[t] = PA_FN(dot16)(qr, k + t * token_stride, D);
                    }
                } else {
                    for (int64_t t = 0; t < 16; t++) {
                        part[t] = t < m ? PA_FN(dot16)(qr, k + t * token_stride, D)
                                        : _mm512_setzero_ps();
                    }
                }
                const __m512 sums = _mm512_mul_ps(pa_sum16x16(part), _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(scores + (r0 + g) * n + t0 + i0,
                                      (__mmask16)((1u << m) - 1u), sums);
            }
        }
        return;
    }
#endif
    for (int64_t i = 0; i < len; i++) {
        const PA_T *k = kh + i * token_stride;
        for (int64_t g = 0; g < G; g++) {
            const float *qr = qf + (r0 + g) * D;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; d++) {
                s += qr[d] * PA_LOAD(k[d]);
            }
            scores[(r0 + g) * n + t0 + i] = s * scale;
        }
    }
}

/* orow += sum_i p[i] v_i over the `len` tokens of one block whose V rows (of one head) start
 * at `vh`: the row's sums stay in registers across the block. */
static inline __attribute__((always_inline)) void PA_FN(block_values)(
    const float *restrict p, const PA_T *restrict vh, float *restrict orow, int64_t len,
    int64_t token_stride, const int64_t D)
{
#ifdef PA_AVX512
    if (D % 16 == 0 && D <= 16 * PA_MAX_VECTORS) {
        __m512 o[PA_MAX_VECTORS];
        for (int64_t c = 0; c < D / 16; c++) {
            o[c] = _mm512_loadu_ps(orow + 16 * c);
        }
        for (int64_t i = 0; i < len; i++) {
            const __m512 pi = _mm512_set1_ps(p[i]);
            const PA_T *v = vh + i * token_stride;
            for (int64_t c = 0; c < D / 16; c++) {
                o[c] = _mm512_fmadd_ps(pi, PA_LOAD16(v + 16 * c), o[c]);
            }
        }
        for (int64_t c = 0; c < D / 16; c++) {
            _mm512_storeu_ps(orow + 16 * c, o[c]);
        }
        return;
    }
#endif
    for (int64_t i = 0; i < len; i++) {
        const PA_T *v = vh + i * token_stride;
        const float pi = p[i];
#pragma omp simd
        for (int64_t d = 0; d < D; d++) {
            orow[d] += pi * PA_LOAD(v[d]);
        }
    }
}

/* Block j of a sequence (its rows of K or of V, from `base`), the next block's rows asked for
 * as this one is read. */
static inline __attribute__((always_inline)) const PA_T *PA_FN(block)(
    const PA_T *base, const int64_t *table, int64_t j, int64_t blocks, int64_t block_stride,
    int64_t block_size, int64_t token_stride, int64_t row_bytes)
{
    if (j + 1 < blocks) {
        pa_prefetch_rows(base + table[j + 1] * block_stride, block_size, token_stride, row_bytes,
                         sizeof(PA_T));
    }
    return base + table[j] * block_stride;
}

/* One work item: the R = HC * G query rows of KV heads h0 .. h0 + HC - 1 of one sequence of n
 * tokens, whose blocks `table` lists (k_base, v_base: head h0's rows in block 0). Always
 * inlined where D is a constant (64, 128), so the loops over D unroll into straight vector
 * code. Each block's K rows, then later its V rows, are read once, the next block's asked for
 * ahead (pa_prefetch): blocks lie anywhere in the cache. */
static inline __attribute__((always_inline)) void PA_FN(attend)(
    const float *restrict qf, const PA_T *restrict k_base, const PA_T *restrict v_base,
    const int64_t *table, int64_t n, int64_t first, int64_t HC, int64_t G,
    int64_t token_stride, int64_t block_stride, int64_t block_size, float scale,
    float *restrict scores, float *restrict acc, const int64_t D)
{
    /* Tokens first .. n - 1 are attended (first > 0: a sliding window); the blocks before
     * first's are never read, and its block's earlier tokens are scored but left out. */
    const int64_t R = HC * G;
    const int64_t row_bytes = HC * D * (int64_t)sizeof(PA_T);
    const int64_t blocks = (n + block_size - 1) / block_size;
    const int64_t j0 = first / block_size;
    for (int64_t j = j0; j < blocks; j++) {
        const int64_t t0 = j * block_size;
        const int64_t len = n - t0 < block_size ? n - t0 : block_size;
        const PA_T *kb = PA_FN(block)(k_base, table, j, blocks, block_stride, block_size,
                                      token_stride, row_bytes);
        for (int64_t h = 0; h < HC; h++) {
            PA_FN(block_scores)(qf, kb + h * D, scores, n, t0, len, h * G, G, token_stride,
                                scale, D);
        }
    }
    pa_prefetch_rows(v_base + table[j0] * block_stride, block_size, token_stride, row_bytes,
                     sizeof(PA_T));
    /* softmax per query row; exp_f32 vectorizes where the C library's expf does not */
    for (int64_t r = 0; r < R; r++) {
        float *row = scores + r * n;
        float peak = row[first];
#pragma omp simd reduction(max : peak)
        for (int64_t t = first + 1; t < n; t++) {
            peak = row[t] > peak ? row[t] : peak;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = first; t < n; t++) {
            row[t] = exp_f32(row[t] - peak);
            sum += row[t];
        }
        const float f = 1.0f / sum;
#pragma omp simd
        for (int64_t t = first; t < n; t++) {
            row[t] *= f;
        }
    }
    /* o_r = sum_t p[r][t] v_t(head of r); a block's V rows stay in L1 across its rows */
    for (int64_t j = j0; j < blocks; j++) {
        const int64_t t0 = j * block_size;
        const int64_t len = n - t0 < block_size ? n - t0 : block_size;
        const int64_t skip = first > t0 ? first - t0 : 0; /* the window's first block */
        const PA_T *vb = PA_FN(block)(v_base, table, j, blocks, block_stride, block_size,
                                      token_stride, row_bytes);
        for (int64_t r = 0; r < R; r++) {
            PA_FN(block_values)(scores + r * n + t0 + skip,
                                vb + skip * token_stride + (r / G) * D, acc + r * D,
                                len - skip, token_stride, D);
        }
    }
}

int PA_ATTENTION(
    const PA_T *q, const PA_T *kv, const int64_t *tables, const int64_t *lens, PA_T *out,
    int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size, int64_t num_blocks,
    int64_t max_blocks, int64_t window, float scale)
{
    if (Hkv <= 0 || Hq % Hkv != 0 || D <= 0 || block_size <= 0 || window < 0) {
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
                const int64_t first = window > 0 && n > window ? n - window : 0;
                int bad_block = 0;
                for (int64_t j = first / block_size; j < (n + block_size - 1) / block_size; j++) {
                    bad_block |= table[j] < 0 || table[j] >= num_blocks;
                }
                if (bad_block) {
#pragma omp atomic write
                    failed = 3;
                    PA_STORE_ROWS(o, acc, R * D);
                    continue;
                }
                const PA_T *kh = kv + h0 * D, *vh = v_base + h0 * D;
                if (D == 64) {
                    PA_FN(attend)(qf, kh, vh, table, n, first, HC, G, token_stride,
                                  block_stride, block_size, scale, scores, acc, 64);
                } else if (D == 128) {
                    PA_FN(attend)(qf, kh, vh, table, n, first, HC, G, token_stride,
                                  block_stride, block_size, scale, scores, acc, 128);
                } else {
                    PA_FN(attend)(qf, kh, vh, table, n, first, HC, G, token_stride,
                                  block_stride, block_size, scale, scores, acc, D);
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
