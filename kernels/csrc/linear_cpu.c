/* y = x W^T on CPU, float32, from a weight packed once at load time.
 *
 * Why: a decode step multiplies a few rows (one per running sequence) by every weight of the
 * model, so its GEMMs are a stream of the weights through the cores. oneDNN's packed GEMM
 * (engine/worker/models/packed_linear.py) streamed them at about half the memory bandwidth at
 * 16 rows (bench/README.md, "The decode step's kernels"; bench/linear.py). Here the weight
 * is stored in blocks of 16 output features, each block k-major ([N/16][K][16]), so a tile of
 * the output is a sequence of outer products: per k, up to three 16-wide loads of the weight,
 * one broadcast of each row's x[m][k], and a multiply-add into a register per (row, block).
 * There is no horizontal sum, each weight is read once per chunk of rows, in address order,
 * the next tile's weights prefetched while the current tile's last rows run from L2 (so memory
 * and arithmetic overlap), and the same code serves a prefill chunk's hundreds of rows in
 * chunks whose x stays in L2. Measured (SmolLM2, 2 cores, AVX-512): a decode step's GEMMs
 * 35 -> 26 ms in the engine; from 512 rows 5-9 % behind oneDNN, whose large-M kernels
 * block K for L1 (slicing K here, the sums reloaded per slice, was slower still).
 *
 * The 16-wide vectors are GCC vector extensions: one register with AVX-512, two with AVX2.
 * The engine uses this kernel where AVX-512 is present (measured there); elsewhere oneDNN's.
 *
 * Return codes: 0 ok, 1 bad shape.
 */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

/* acc += x * w as one fused multiply-add: -std=c11 turns contraction off, and without it each
 * step is a multiply and an add (twice the instructions, twice the latency). */
#pragma GCC optimize("fp-contract=fast")

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

#define LIN_MR 8 /* rows per tile: 8 x 3 accumulators + 3 weights + 1 broadcast registers */
#define LIN_NB 3 /* 16-wide blocks of output features per tile */
#define LIN_X_BYTES (1 << 20) /* a chunk of rows: its x stays in L2 across the tiles */

/* Pack w [N, K] (row-major, a Linear's weight) into wp [ceil(N/16)][K][16], zero past N. */
int pdmesh_linear_pack_f32(const float *w, float *wp, int64_t N, int64_t K) {
    if (N <= 0 || K <= 0) {
        return 1;
    }
    const int64_t blocks = (N + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        float *dst = wp + b * K * 16;
        for (int64_t j = 0; j < 16; j++) {
            const int64_t n = b * 16 + j;
            for (int64_t k = 0; k < K; k++) {
                dst[k * 16 + j] = n < N ? w[n * K + k] : 0.0f;
            }
        }
    }
    return 0;
}

/* One tile: rows m0 .. m0 + MR - 1 by blocks nb0 .. nb0 + NBC - 1. Always inlined with
 * constant MR and NBC, so the accumulators are registers. */
static inline __attribute__((always_inline)) void lin_tile(
    const float *restrict x, const float *restrict wp, float *restrict y, int64_t K, int64_t N,
    int64_t m0, int64_t nb0, const float *ahead, const int64_t MR, const int64_t NBC)
{
    v16 acc[LIN_MR][LIN_NB];
    for (int64_t m = 0; m < MR; m++) {
        for (int64_t b = 0; b < NBC; b++) {
            acc[m][b] = (v16){0};
        }
    }
    const float *xr = x + m0 * K;
    const float *w0 = wp + nb0 * K * 16;
    for (int64_t k = 0; k < K; k++) {
        v16 w[LIN_NB];
        for (int64_t b = 0; b < NBC; b++) {
            w[b] = *(const v16u *)(w0 + b * K * 16 + k * 16);
            if (ahead != NULL) {
                __builtin_prefetch(ahead + b * K * 16 + k * 16, 0, 2);
            }
        }
        for (int64_t m = 0; m < MR; m++) {
            const float xv = xr[m * K + k];
            for (int64_t b = 0; b < NBC; b++) {
                acc[m][b] += xv * w[b];
            }
        }
    }
    for (int64_t m = 0; m < MR; m++) {
        float *yr = y + (m0 + m) * N;
        for (int64_t b = 0; b < NBC; b++) {
            const int64_t n = (nb0 + b) * 16;
            if (n + 16 <= N) {
                *(v16u *)(yr + n) = acc[m][b];
            } else {
                for (int64_t j = 0; n + j < N; j++) {
                    yr[n + j] = acc[m][b][j];
                }
            }
        }
    }
}

#define LIN_TILE(MR_)                                                   \
    (nbc == 3   ? lin_tile(x, wp, y, K, N, m0, nb0, ahead, MR_, 3)      \
     : nbc == 2 ? lin_tile(x, wp, y, K, N, m0, nb0, ahead, MR_, 2)      \
                : lin_tile(x, wp, y, K, N, m0, nb0, ahead, MR_, 1))

static void lin_tile_rows(const float *x, const float *wp, float *y, int64_t K, int64_t N,
                          int64_t m0, int64_t mr, int64_t nb0, int64_t nbc, const float *ahead) {
    switch (mr) {
    case 8: LIN_TILE(8); break;
    case 7: LIN_TILE(7); break;
    case 6: LIN_TILE(6); break;
    case 5: LIN_TILE(5); break;
    case 4: LIN_TILE(4); break;
    case 3: LIN_TILE(3); break;
    case 2: LIN_TILE(2); break;
    default: LIN_TILE(1); break;
    }
}

/* y [M, N] = x [M, K] (rows contiguous) times the packed weight's transpose. Threads split the
 * output features; each goes through a chunk's rows for its tiles. */
int pdmesh_linear_f32(const float *x, const float *wp, float *y, int64_t M, int64_t K,
                      int64_t N) {
    if (M < 0 || N <= 0 || K <= 0) {
        return 1;
    }
    const int64_t blocks = (N + 15) / 16;
    const int64_t tiles = (blocks + LIN_NB - 1) / LIN_NB;
    int64_t chunk = LIN_X_BYTES / (K * (int64_t)sizeof(float)) / LIN_MR * LIN_MR;
    chunk = chunk < LIN_MR ? LIN_MR : chunk;
#pragma omp parallel
    {
        /* this thread's tiles, in order: the next one's weights are fetched while the
         * current tile's last rows run (from L2), so memory and arithmetic overlap */
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t t_begin = tiles * me / threads, t_end = tiles * (me + 1) / threads;
        for (int64_t c0 = 0; c0 < M; c0 += chunk) {
            const int64_t c1 = c0 + chunk < M ? c0 + chunk : M;
            for (int64_t t = t_begin; t < t_end; t++) {
                const int64_t nb0 = t * LIN_NB;
                const int64_t nbc = blocks - nb0 < LIN_NB ? blocks - nb0 : LIN_NB;
                const float *next = t + 1 < t_end ? wp + (nb0 + LIN_NB) * K * 16 : NULL;
                for (int64_t m0 = c0; m0 < c1; m0 += LIN_MR) {
                    const int64_t mr = c1 - m0 < LIN_MR ? c1 - m0 : LIN_MR;
                    lin_tile_rows(x, wp, y, K, N, m0, mr, nb0, nbc,
                                  m0 + LIN_MR >= c1 ? next : NULL);
                }
            }
        }
    }
    return 0;
}
