/* Native data path of the connector: copy KV pages between blocks and the pool while computing
 * each block's xxh3_64 checksum in the same pass (xxh3_copy.c), on one or several threads.
 *
 * Plain C with no Python headers (loaded with ctypes), so it builds wherever a C compiler is
 * present. connector/native.py checks every argument (bounds, strides, page indices) before
 * calling in; these functions trust them.
 *
 * Layout: a block's payload is [layers, 2, n, seg] (seg: the bytes of one page of one layer's K
 * or V); a pool is [layers, 2, pages, seg] with any byte strides on its first three axes and
 * contiguous seg bytes. The checksum covers the block's zeroed header (the "prefix"), then the
 * payload in that order. What is hashed is what was written (see xxh3_copy.c).
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "tkv.h"

#define TKV_ABI 3
#define TKV_MAX_THREADS 16
#define FLAG_NT 1 /* non-temporal stores: the bytes are not needed in cache after the copy */

int tkv_abi_version(void) { return TKV_ABI; }

/* Copy one block between two strided arrays and hash it, after `prefix`. *_pages: the page on
 * that side of block page j (NULL: j). Returns 0, or -3 if the hashed stream is too short for
 * the long-input algorithm (the caller then uses the library). */
static int copy_hash(const uint8_t *prefix, size_t prefix_len, const uint8_t *src, const int64_t *ss,
                     const int64_t *sp, uint8_t *dst, const int64_t *ds, const int64_t *dp, int64_t layers,
                     int64_t n, int64_t seg, int nt, uint64_t *digest) {
    if ((uint64_t)prefix_len + (uint64_t)(layers * 2 * n * seg) <= TKV_XXH3_MIDSIZE_MAX) return -3;
    tkv_hash h;
    tkv_hash_reset(&h);
    tkv_hash_feed(&h, prefix, NULL, prefix_len, 0);
    for (int64_t l = 0; l < layers; l++) {
        for (int64_t kv = 0; kv < 2; kv++) {
            for (int64_t j = 0; j < n; j++) {
                int64_t s = sp ? sp[j] : j, d = dp ? dp[j] : j;
                tkv_hash_feed(&h, src + l * ss[0] + kv * ss[1] + s * ss[2], dst + l * ds[0] + kv * ds[1] + d * ds[2],
                              (size_t)seg, nt);
            }
        }
    }
    if (nt) tkv_store_fence();
    *digest = tkv_hash_digest(&h);
    return 0;
}

int tkv_copy_hash(const uint8_t *prefix, size_t prefix_len, const uint8_t *src, const int64_t *src_strides,
                  const int64_t *src_pages, uint8_t *dst, const int64_t *dst_strides, const int64_t *dst_pages,
                  int64_t layers, int64_t n, int64_t seg, int32_t flags, uint64_t *digest) {
    return copy_hash(prefix, prefix_len, src, src_strides, src_pages, dst, dst_strides, dst_pages, layers, n, seg,
                     flags & FLAG_NT, digest);
}

/* One block between a contiguous buffer and `count` pieces of `seg` bytes each, wherever they
 * are (vLLM allocates every layer's KV apart, so a block's pieces have no common stride): dir 0
 * scatters `buf` into the pieces at the addresses `pieces[i]`, dir 1 gathers them into `buf`.
 * The checksum is of `prefix`, then the bytes written, in buffer order. Returns 0, or -3 if the
 * stream is too short for the long-input algorithm. */
int tkv_pieces_hash(int32_t dir, const uint8_t *prefix, size_t prefix_len, uint8_t *buf, const uint64_t *pieces,
                    int64_t count, int64_t seg, int32_t flags, uint64_t *digest) {
    if ((uint64_t)prefix_len + (uint64_t)(count * seg) <= TKV_XXH3_MIDSIZE_MAX) return -3;
    int nt = flags & FLAG_NT;
    tkv_hash h;
    tkv_hash_reset(&h);
    tkv_hash_feed(&h, prefix, NULL, prefix_len, 0);
    for (int64_t i = 0; i < count; i++) {
        uint8_t *piece = (uint8_t *)(uintptr_t)pieces[i], *here = buf + i * seg;
        if (dir == 0)
            tkv_hash_feed(&h, here, piece, (size_t)seg, nt);
        else
            tkv_hash_feed(&h, piece, here, (size_t)seg, nt);
    }
    if (nt) tkv_store_fence();
    *digest = tkv_hash_digest(&h);
    return 0;
}

/* XXH3-64 of `len` contiguous bytes (> 240), for the self-test and the benchmark. */
int tkv_hash_bytes(const uint8_t *data, size_t len, uint64_t *digest) {
    if (len <= TKV_XXH3_MIDSIZE_MAX) return -3;
    tkv_hash h;
    tkv_hash_reset(&h);
    tkv_hash_feed(&h, data, NULL, len, 0);
    *digest = tkv_hash_digest(&h);
    return 0;
}

/* ---- batches: many one-page blocks <-> pool pages, on several threads -------------------------- */

typedef struct {
    int64_t count;
    int dir; /* 0: block -> pool (unpack), 1: pool -> block (pack) */
    const uint64_t *prefixes;
    const int64_t *prefix_lens;
    const uint64_t *blocks; /* each block's payload: [layers, 2, 1, seg] contiguous */
    uint8_t *pool;
    const int64_t *pool_strides;
    const int64_t *pages;
    int64_t layers, seg;
    int nt;
    struct timespec deadline; /* tv_sec < 0: none */
    int64_t next;             /* next block to take (atomic) */
    uint64_t *digests;
    int8_t *status; /* per block: 1 done, -3 too short, 0 not reached (deadline) */
} batch;

static int past(const struct timespec *d) {
    if (d->tv_sec < 0) return 0;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec > d->tv_sec || (now.tv_sec == d->tv_sec && now.tv_nsec >= d->tv_nsec);
}

static void batch_one(batch *b, int64_t k) {
    const int64_t block_strides[3] = {2 * b->seg, b->seg, b->seg};
    const uint8_t *prefix = (const uint8_t *)(uintptr_t)b->prefixes[k];
    uint8_t *blk = (uint8_t *)(uintptr_t)b->blocks[k];
    int rc = b->dir == 0
                 ? copy_hash(prefix, (size_t)b->prefix_lens[k], blk, block_strides, NULL, b->pool, b->pool_strides,
                             &b->pages[k], b->layers, 1, b->seg, b->nt, &b->digests[k])
                 : copy_hash(prefix, (size_t)b->prefix_lens[k], b->pool, b->pool_strides, &b->pages[k], blk,
                             block_strides, NULL, b->layers, 1, b->seg, b->nt, &b->digests[k]);
    b->status[k] = rc == 0 ? 1 : (int8_t)rc;
}

/* Two blocks with prefixes of the same length, streamed side by side (tkv_hash_feed2). */
static void batch_pair(batch *b, int64_t ka, int64_t kb) {
    size_t plen = (size_t)b->prefix_lens[ka];
    if (plen + (size_t)(b->layers * 2 * b->seg) <= TKV_XXH3_MIDSIZE_MAX) {
        b->status[ka] = b->status[kb] = -3;
        return;
    }
    tkv_hash ha, hb;
    tkv_hash_reset(&ha);
    tkv_hash_reset(&hb);
    tkv_hash_feed2(&ha, &hb, (const uint8_t *)(uintptr_t)b->prefixes[ka], NULL,
                   (const uint8_t *)(uintptr_t)b->prefixes[kb], NULL, plen, 0);
    uint8_t *blk_a = (uint8_t *)(uintptr_t)b->blocks[ka], *blk_b = (uint8_t *)(uintptr_t)b->blocks[kb];
    const int64_t *ps = b->pool_strides;
    for (int64_t l = 0; l < b->layers; l++) {
        for (int64_t kv = 0; kv < 2; kv++) {
            uint8_t *pa = b->pool + l * ps[0] + kv * ps[1] + b->pages[ka] * ps[2];
            uint8_t *pb = b->pool + l * ps[0] + kv * ps[1] + b->pages[kb] * ps[2];
            uint8_t *qa = blk_a + (l * 2 + kv) * b->seg, *qb = blk_b + (l * 2 + kv) * b->seg;
            if (b->dir == 0)
                tkv_hash_feed2(&ha, &hb, qa, pa, qb, pb, (size_t)b->seg, b->nt);
            else
                tkv_hash_feed2(&ha, &hb, pa, qa, pb, qb, (size_t)b->seg, b->nt);
        }
    }
    if (b->nt) tkv_store_fence();
    b->digests[ka] = tkv_hash_digest(&ha);
    b->digests[kb] = tkv_hash_digest(&hb);
    b->status[ka] = b->status[kb] = 1;
}

static void *batch_worker(void *arg) {
    batch *b = arg;
    int64_t k;
    /* blocks are taken two by two in order, so a deadline leaves (nearly) a leading run done */
    while ((k = __atomic_fetch_add(&b->next, 2, __ATOMIC_RELAXED)) < b->count) {
        if (past(&b->deadline)) break;
        if (k + 1 < b->count && b->prefix_lens[k] == b->prefix_lens[k + 1]) {
            batch_pair(b, k, k + 1);
            continue;
        }
        batch_one(b, k);
        if (k + 1 < b->count && !past(&b->deadline)) batch_one(b, k + 1);
    }
    return NULL;
}

/* Unpack (dir 0) or pack (dir 1) `count` one-page blocks; `blocks[k]` points at block k's
 * payload, `pages[k]` is its pool page, `prefixes[k]`/`prefix_lens[k]` its zeroed header.
 * `threads`: workers (the caller's thread is one of them). `budget_s` > 0: blocks not started
 * within that many seconds are left undone (status 0). Returns the number of threads used. */
int tkv_batch(int32_t dir, int64_t count, const uint64_t *prefixes, const int64_t *prefix_lens,
              const uint64_t *blocks, uint8_t *pool, const int64_t *pool_strides, const int64_t *pages,
              int64_t layers, int64_t seg, int32_t threads, int32_t flags, double budget_s, uint64_t *digests,
              int8_t *status) {
    batch b = {count, dir, prefixes, prefix_lens, blocks, pool, pool_strides, pages, layers, seg, flags & FLAG_NT,
               {-1, 0}, 0, digests, status};
    memset(status, 0, (size_t)count);
    if (budget_s > 0) {
        clock_gettime(CLOCK_MONOTONIC, &b.deadline);
        double whole = (double)(int64_t)budget_s;
        b.deadline.tv_sec += (time_t)whole;
        b.deadline.tv_nsec += (long)((budget_s - whole) * 1e9);
        if (b.deadline.tv_nsec >= 1000000000L) {
            b.deadline.tv_sec += 1;
            b.deadline.tv_nsec -= 1000000000L;
        }
    }
    if (threads > TKV_MAX_THREADS) threads = TKV_MAX_THREADS;
    if (threads > count) threads = (int32_t)count;
    pthread_t tids[TKV_MAX_THREADS];
    int started = 0;
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&tids[started], NULL, batch_worker, &b) != 0) break; /* fewer threads then */
        started++;
    }
    batch_worker(&b);
    for (int i = 0; i < started; i++) pthread_join(tids[i], NULL);
    return started + 1;
}
