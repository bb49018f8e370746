/* Per-block XXH64 of a paged KV cache, and the same-host pull that copies and hashes in one pass.
 *
 * The cache is [layers, 2, num_blocks, block bytes], so one block is `num_pieces` (= 2 * layers)
 * pieces of `piece_bytes`, piece p of block b at ((p * num_blocks) + b) * piece_bytes. A block's
 * digest is XXH64 (seed 0) of its pieces streamed in (layer, K/V) order: the value
 * `xxhash.xxh64()` gives when updated piece by piece, so Python can check any digest made here.
 * Calling Python once per piece (60 per block for a 30-layer model) cost more than hashing the
 * bytes; here a whole list of blocks is one call, spread over threads by block.
 *
 * Those threads are short-lived pthreads, not OpenMP's: a pull runs on a connector thread,
 * which would start an OpenMP team of its own beside the model's, and libgomp's workers spin
 * after every parallel region before they sleep (~10 ms by default, ~0.3 ms under a core's
 * GOMP_SPINCOUNT), taking a core from what runs next: the peer core's pull, the control plane.
 * Starting a thread costs tens of microseconds against milliseconds of copying.
 *
 * XXH64 as its public specification describes it (Yann Collet, xxhash.com doc/xxhash_spec.md):
 * four 64-bit lanes eat 32-byte stripes, merged and then fed the < 32-byte tail, then avalanched.
 * Input words are little-endian; a big-endian build refuses (code 4) and Python hashes instead.
 *
 * Return codes: 0 ok, 1 bad shape, 3 a block id outside its cache, 4 unsupported build.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define P4 0x85EBCA77C2B2AE63ULL
#define P5 0x27D4EB2F165667C5ULL

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define KV_LITTLE_ENDIAN 1
#else
#define KV_LITTLE_ENDIAN 0
#endif

typedef struct {
    uint64_t total;    /* bytes consumed so far */
    uint64_t v[4];     /* the four lanes */
    uint8_t mem[32];   /* a stripe not yet complete (pieces need not be multiples of 32) */
    uint32_t memsize;
} xxh64_state;

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t read32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t xxh_round(uint64_t acc, uint64_t lane) {
    acc += lane * P2;
    acc = rotl64(acc, 31);
    return acc * P1;
}

static inline uint64_t merge_round(uint64_t acc, uint64_t lane) {
    acc ^= xxh_round(0, lane);
    return acc * P1 + P4;
}

static void xxh64_reset(xxh64_state *st, uint64_t seed) {
    st->total = 0;
    st->v[0] = seed + P1 + P2;
    st->v[1] = seed + P2;
    st->v[2] = seed;
    st->v[3] = seed - P1;
    st->memsize = 0;
}

/* Whole stripes only, from `src`; when `dst` is not NULL each stripe is also stored there, from
 * the same registers that were hashed: the digest names exactly the bytes written. */
static void consume_stripes(xxh64_state *st, uint8_t *dst, const uint8_t *src, size_t n) {
    uint64_t v0 = st->v[0], v1 = st->v[1], v2 = st->v[2], v3 = st->v[3];
    for (size_t i = 0; i < n; i += 32) {
        uint64_t a = read64(src + i), b = read64(src + i + 8);
        uint64_t c = read64(src + i + 16), d = read64(src + i + 24);
        if (dst != NULL) {
            memcpy(dst + i, &a, 8);
            memcpy(dst + i + 8, &b, 8);
            memcpy(dst + i + 16, &c, 8);
            memcpy(dst + i + 24, &d, 8);
        }
        v0 = xxh_round(v0, a);
        v1 = xxh_round(v1, b);
        v2 = xxh_round(v2, c);
        v3 = xxh_round(v3, d);
    }
    st->v[0] = v0;
    st->v[1] = v1;
    st->v[2] = v2;
    st->v[3] = v3;
    st->total += n;
}

static void xxh64_update(xxh64_state *st, const uint8_t *p, size_t len) {
    if (st->memsize) { /* complete the carried stripe first */
        size_t take = 32 - st->memsize;
        if (take > len) take = len;
        memcpy(st->mem + st->memsize, p, take);
        st->memsize += (uint32_t)take;
        p += take;
        len -= take;
        if (st->memsize < 32) return;
        consume_stripes(st, NULL, st->mem, 32);
        st->memsize = 0;
    }
    size_t whole = len & ~(size_t)31;
    consume_stripes(st, NULL, p, whole);
    memcpy(st->mem, p + whole, len - whole);
    st->memsize = (uint32_t)(len - whole);
}

/* Copy `len` bytes src -> dst and feed them to the state, reading the source once where the
 * stream is at a stripe boundary (the usual case: pieces are multiples of 32 bytes). */
static void xxh64_copy_update(xxh64_state *st, uint8_t *dst, const uint8_t *src, size_t len) {
    size_t whole = st->memsize ? 0 : len & ~(size_t)31;
    consume_stripes(st, dst, src, whole);
    memcpy(dst + whole, src + whole, len - whole);
    xxh64_update(st, dst + whole, len - whole);
}

static uint64_t xxh64_digest(const xxh64_state *st) {
    uint64_t total = st->total + st->memsize;
    uint64_t acc;
    if (st->total >= 32) { /* at least one stripe went through the lanes */
        acc = rotl64(st->v[0], 1) + rotl64(st->v[1], 7) + rotl64(st->v[2], 12)
            + rotl64(st->v[3], 18);
        for (int i = 0; i < 4; i++) acc = merge_round(acc, st->v[i]);
    } else {
        acc = st->v[2] /* the seed */ + P5;
    }
    acc += total;
    const uint8_t *p = st->mem;
    size_t left = st->memsize;
    while (left >= 8) {
        acc ^= xxh_round(0, read64(p));
        acc = rotl64(acc, 27) * P1 + P4;
        p += 8;
        left -= 8;
    }
    if (left >= 4) {
        acc ^= (uint64_t)read32(p) * P1;
        acc = rotl64(acc, 23) * P2 + P3;
        p += 4;
        left -= 4;
    }
    while (left > 0) {
        acc ^= (uint64_t)(*p) * P5;
        acc = rotl64(acc, 11) * P1;
        p++;
        left--;
    }
    acc ^= acc >> 33;
    acc *= P2;
    acc ^= acc >> 29;
    acc *= P3;
    acc ^= acc >> 32;
    return acc;
}

/* Blocks of one geometry advance in lockstep (their pieces are the same length), so where a
 * piece is whole stripes GROUP blocks are hashed together, each block's four lanes one 256-bit
 * vector (GCC/Clang vector extensions: vpmullq where AVX-512DQ is there, emulated elsewhere).
 * One block alone is latency-bound (a stripe waits on the previous one's two multiplies); four
 * independent chains keep the multiplier busy. A short group repeats its last block (same bytes,
 * same place: copying it again changes nothing). */
#define GROUP 4

/* Each stream is prefetched this far ahead, into the start of its next piece near a piece's
 * end, and the destination for writing. A block's next piece lies num_blocks pieces further
 * on in memory, a jump no hardware prefetcher follows, and a store to a line not in cache
 * waits for the line to be read first: measured on a cold 64-block pull (2 threads), 15 % off
 * the copy and the hash alike (bench/README.md). */
#define PREFETCH_AHEAD 2048
typedef uint64_t u64x4 __attribute__((vector_size(32)));

static inline u64x4 load4(const uint8_t *p) {
    u64x4 v;
    memcpy(&v, p, 32);
    return v;
}

static inline u64x4 round4(u64x4 acc, u64x4 lane) {
    acc += lane * P2;
    acc = (acc << 31) | (acc >> 33);
    return acc * P1;
}

/* Hash (and when dst is not NULL, copy) blocks src[k] -> dst[k], k < GROUP: out[k] digests. */
static void group_stripes(uint8_t *const *dst, const uint8_t *const *src, int64_t num_pieces,
                          size_t piece_bytes, size_t dst_stride, size_t src_stride,
                          uint64_t *out) {
    const u64x4 init = {P1 + P2, P2, 0, (uint64_t)0 - P1}; /* seed 0 */
    u64x4 acc[GROUP];
    for (int k = 0; k < GROUP; k++) acc[k] = init;
    for (int64_t p = 0; p < num_pieces; p++) {
        const uint8_t *from[GROUP], *from_next[GROUP];
        uint8_t *to[GROUP], *to_next[GROUP];
        const size_t next = (size_t)(p + 1 < num_pieces ? p + 1 : p);
        for (int k = 0; k < GROUP; k++) {
            from[k] = src[k] + (size_t)p * src_stride;
            from_next[k] = src[k] + next * src_stride;
            to[k] = dst != NULL ? dst[k] + (size_t)p * dst_stride : NULL;
            to_next[k] = dst != NULL ? dst[k] + next * dst_stride : NULL;
        }
        for (size_t i = 0; i < piece_bytes; i += 32) {
            if ((i & 63) == 0) { /* one prefetch per cache line and stream */
                const size_t ahead = i + PREFETCH_AHEAD;
                const int here = ahead < piece_bytes;
                const size_t at = here ? ahead : ahead - piece_bytes;
                for (int k = 0; k < GROUP && at < piece_bytes; k++) {
                    __builtin_prefetch((here ? from[k] : from_next[k]) + at, 0, 3);
                    if (dst != NULL) __builtin_prefetch((here ? to[k] : to_next[k]) + at, 1, 3);
                }
            }
            for (int k = 0; k < GROUP; k++) {
                u64x4 lane = load4(from[k] + i);
                if (dst != NULL) memcpy(to[k] + i, &lane, 32);
                acc[k] = round4(acc[k], lane);
            }
        }
    }
    for (int k = 0; k < GROUP; k++) {
        xxh64_state st;
        for (int j = 0; j < 4; j++) st.v[j] = acc[k][j];
        st.total = (uint64_t)num_pieces * piece_bytes;
        st.memsize = 0;
        out[k] = xxh64_digest(&st);
    }
}

/* Blocks [first, first + GROUP) of the id lists (the last one repeated past n), grouped. */
static void hash_group(uint8_t *dst, size_t dst_stride, const uint8_t *src, size_t src_stride,
                       int64_t num_pieces, size_t piece_bytes, const int64_t *dst_ids,
                       const int64_t *src_ids, int64_t first, int64_t n, uint64_t *out) {
    uint8_t *to[GROUP];
    const uint8_t *from[GROUP];
    uint64_t sums[GROUP];
    for (int k = 0; k < GROUP; k++) {
        int64_t i = first + k < n ? first + k : n - 1;
        from[k] = src + (size_t)src_ids[i] * piece_bytes;
        to[k] = dst != NULL ? dst + (size_t)dst_ids[i] * piece_bytes : NULL;
    }
    group_stripes(dst != NULL ? to : NULL, from, num_pieces, piece_bytes, dst_stride,
                  src_stride, sums);
    for (int k = 0; k < GROUP && first + k < n; k++) out[first + k] = sums[k];
}

static int ids_in_range(const int64_t *ids, int64_t n, int64_t num_blocks) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= num_blocks) return 0;
    return 1;
}

/* Work over [0, count), claimed a few items at a time by the caller and up to workers - 1
 * pthreads, all joined before it returns. Claimed, not cut into one range per thread: on a host
 * whose other cores are busy (the engine's model threads, a peer core, the control plane) a
 * thread may start milliseconds late, and with fixed ranges the caller would finish its share
 * and then wait for the late one to do all of its own; here the caller keeps claiming and a
 * late thread finds less (or nothing) left. At most MAX_WORKERS threads, and none for fewer
 * than MIN_ITEMS_PER_WORKER items each: the copy is bound by memory bandwidth long before a big
 * host's last core, and each thread started costs the caller tens of microseconds. */
#define MAX_WORKERS 16
#define MIN_ITEMS_PER_WORKER 2
#define CLAIMS_PER_WORKER 4 /* claims a thread makes when all start together */
typedef void (*range_fn)(const void *ctx, int64_t begin, int64_t end);
typedef struct {
    range_fn fn;
    const void *ctx;
    int64_t count, chunk;
    atomic_int_fast64_t next; /* the first item not yet claimed */
} shared_work;

static void claim_until_done(shared_work *w) {
    for (;;) {
        int64_t begin = atomic_fetch_add_explicit(&w->next, w->chunk, memory_order_relaxed);
        if (begin >= w->count) return;
        w->fn(w->ctx, begin, begin + w->chunk < w->count ? begin + w->chunk : w->count);
    }
}

static void *claim_main(void *arg) {
    claim_until_done(arg);
    return NULL;
}

static void parallel_ranges(range_fn fn, const void *ctx, int64_t count, int64_t workers) {
    if (workers > count / MIN_ITEMS_PER_WORKER) workers = count / MIN_ITEMS_PER_WORKER;
    if (workers > MAX_WORKERS) workers = MAX_WORKERS;
    if (workers <= 1) {
        if (count > 0) fn(ctx, 0, count);
        return;
    }
    int64_t chunk = count / (workers * CLAIMS_PER_WORKER);
    shared_work work = {fn, ctx, count, chunk > 0 ? chunk : 1, 0};
    pthread_t threads[MAX_WORKERS];
    int started[MAX_WORKERS];
    for (int64_t w = 1; w < workers; w++)
        started[w] = pthread_create(&threads[w], NULL, claim_main, &work) == 0;
    claim_until_done(&work); /* a thread that did not start leaves its claims to the caller */
    for (int64_t w = 1; w < workers; w++)
        if (started[w]) pthread_join(threads[w], NULL);
}

typedef struct {
    uint8_t *dst;
    size_t dst_stride;
    const uint8_t *src;
    size_t src_stride;
    int64_t num_pieces;
    size_t piece_bytes;
    const int64_t *dst_ids, *src_ids;
    int64_t n;
    uint64_t *out;
} blocks_job;

/* Groups [begin, end) of GROUP blocks (piece_bytes a multiple of 32). */
static void grouped_range(const void *ctx, int64_t begin, int64_t end) {
    const blocks_job *j = ctx;
    for (int64_t g = begin; g < end; g++)
        hash_group(j->dst, j->dst_stride, j->src, j->src_stride, j->num_pieces, j->piece_bytes,
                   j->dst_ids, j->src_ids, g * GROUP, j->n, j->out);
}

/* Blocks [begin, end) one at a time (pieces of any length). */
static void single_range(const void *ctx, int64_t begin, int64_t end) {
    const blocks_job *j = ctx;
    for (int64_t i = begin; i < end; i++) {
        xxh64_state st;
        xxh64_reset(&st, 0);
        const uint8_t *from = j->src + (size_t)j->src_ids[i] * j->piece_bytes;
        uint8_t *to = j->dst != NULL ? j->dst + (size_t)j->dst_ids[i] * j->piece_bytes : NULL;
        for (int64_t p = 0; p < j->num_pieces; p++) {
            if (to != NULL)
                xxh64_copy_update(&st, to + (size_t)p * j->dst_stride,
                                  from + (size_t)p * j->src_stride, j->piece_bytes);
            else
                xxh64_update(&st, from + (size_t)p * j->src_stride, j->piece_bytes);
        }
        j->out[i] = xxh64_digest(&st);
    }
}

/* out[i] = XXH64 of src block src_ids[i], its pieces in order; when dst is not NULL the block
 * is also copied to dst block dst_ids[i] in the same pass, and out[i] names what was written. */
static void blocks_xxh64(uint8_t *dst, size_t dst_stride, const uint8_t *src, size_t src_stride,
                         int64_t num_pieces, size_t piece_bytes, const int64_t *dst_ids,
                         const int64_t *src_ids, int64_t n, uint64_t *out, int64_t threads) {
    const blocks_job job = {dst, dst_stride, src, src_stride, num_pieces, piece_bytes,
                            dst_ids, src_ids, n, out};
    if (piece_bytes % 32 == 0)
        parallel_ranges(grouped_range, &job, (n + GROUP - 1) / GROUP, threads);
    else
        parallel_ranges(single_range, &job, n, threads);
}

/* out[i] = XXH64 of block ids[i] of `cache`, its pieces in order. */
int pdmesh_kv_blocks_xxh64(const uint8_t *cache, int64_t num_pieces, int64_t num_blocks,
                           int64_t piece_bytes, const int64_t *ids, int64_t n, uint64_t *out,
                           int64_t threads) {
    if (!KV_LITTLE_ENDIAN) return 4;
    if (num_pieces <= 0 || num_blocks <= 0 || piece_bytes <= 0 || n < 0 || threads < 1) return 1;
    if (!ids_in_range(ids, n, num_blocks)) return 3;
    blocks_xxh64(NULL, 0, cache, (size_t)num_blocks * (size_t)piece_bytes, num_pieces,
                 (size_t)piece_bytes, NULL, ids, n, out, threads);
    return 0;
}

/* dst block dst_ids[i] = src block src_ids[i], piece by piece, and out[i] = the XXH64 of what
 * was written: the receiver's check without reading the pulled bytes a second time. The two
 * caches share the block layout (num_pieces, piece_bytes), not their block counts. */
int pdmesh_kv_copy_blocks_xxh64(uint8_t *dst, int64_t dst_blocks, const uint8_t *src,
                                int64_t src_blocks, int64_t num_pieces, int64_t piece_bytes,
                                const int64_t *dst_ids, const int64_t *src_ids, int64_t n,
                                uint64_t *out, int64_t threads) {
    if (!KV_LITTLE_ENDIAN) return 4;
    if (num_pieces <= 0 || dst_blocks <= 0 || src_blocks <= 0 || piece_bytes <= 0 || n < 0
        || threads < 1)
        return 1;
    if (!ids_in_range(dst_ids, n, dst_blocks) || !ids_in_range(src_ids, n, src_blocks)) return 3;
    blocks_xxh64(dst, (size_t)dst_blocks * (size_t)piece_bytes, src,
                 (size_t)src_blocks * (size_t)piece_bytes, num_pieces, (size_t)piece_bytes,
                 dst_ids, src_ids, n, out, threads);
    return 0;
}
