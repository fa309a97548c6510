/* Native data path of the connector: copy KV pages between a block and the pool while
 * computing the block's xxh3_64 checksum in the same pass.
 *
 * Plain C with no Python headers (loaded with ctypes), so it builds wherever gcc is present.
 * The xxh3 functions are not compiled here: connector/native.py hands us the entry points of
 * the xxhash library already loaded in the process (the python `xxhash` package exports its
 * XXH3_* streaming API), so the checksum is by construction the one kvstore/block.py computes.
 *
 * One pass over the bytes: each (layer, k/v, page) segment is copied in chunks of CHUNK bytes
 * and every chunk is hashed from the *destination* right after it was written, while it is
 * still in cache. The hash is therefore of the bytes that landed, never of a source that
 * another process could change after the check (copy first, verify the copy).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void *(*xx_create_fn)(void);
typedef int (*xx_free_fn)(void *);
typedef int (*xx_reset_fn)(void *);
typedef int (*xx_update_fn)(void *, const void *, size_t);
typedef uint64_t (*xx_digest_fn)(const void *);

static xx_create_fn xx_create;
static xx_free_fn xx_free;
static xx_reset_fn xx_reset;
static xx_update_fn xx_update;
static xx_digest_fn xx_digest;

#define CHUNK (32 * 1024)

int tkv_abi_version(void) { return 1; }

/* Install the XXH3 streaming entry points (createState, freeState, 64bits_reset,
 * 64bits_update, 64bits_digest). Returns 0, or -1 if one is missing. */
int tkv_init(void *create, void *free_, void *reset, void *update, void *digest) {
    if (!create || !free_ || !reset || !update || !digest) return -1;
    xx_create = (xx_create_fn)create;
    xx_free = (xx_free_fn)free_;
    xx_reset = (xx_reset_fn)reset;
    xx_update = (xx_update_fn)update;
    xx_digest = (xx_digest_fn)digest;
    return 0;
}

/* Copy a block laid out [layers, 2, n, seg] between two strided byte arrays and hash the
 * destination in that order, after ``prefix`` (the block header with its checksum zeroed).
 *
 * src / dst: base pointers; *_strides: byte strides of the (layer, k/v, page) axes; the seg
 * bytes of one (layer, k/v, page) are contiguous on both sides. *_pages: the page index on that
 * side for block page j (NULL: j itself). The caller (connector/native.py) has checked every
 * bound. Returns 0 with *digest set, -1 if not initialised, -2 if the hash state failed. */
int tkv_copy_hash(const uint8_t *prefix, size_t prefix_len,
                  const uint8_t *src, const int64_t *src_strides, const int64_t *src_pages,
                  uint8_t *dst, const int64_t *dst_strides, const int64_t *dst_pages,
                  int64_t layers, int64_t n, int64_t seg, uint64_t *digest) {
    if (!xx_create) return -1;
    void *st = xx_create();
    if (!st) return -2;
    int rc = 0;
    if (xx_reset(st) != 0 || xx_update(st, prefix, prefix_len) != 0) {
        rc = -2;
        goto out;
    }
    for (int64_t l = 0; l < layers; l++) {
        for (int64_t kv = 0; kv < 2; kv++) {
            for (int64_t j = 0; j < n; j++) {
                int64_t sp = src_pages ? src_pages[j] : j;
                int64_t dp = dst_pages ? dst_pages[j] : j;
                const uint8_t *s = src + l * src_strides[0] + kv * src_strides[1] + sp * src_strides[2];
                uint8_t *d = dst + l * dst_strides[0] + kv * dst_strides[1] + dp * dst_strides[2];
                for (int64_t off = 0; off < seg; off += CHUNK) {
                    size_t len = (size_t)(seg - off < CHUNK ? seg - off : CHUNK);
                    memcpy(d + off, s + off, len);
                    if (xx_update(st, d + off, len) != 0) {
                        rc = -2;
                        goto out;
                    }
                }
            }
        }
    }
    *digest = xx_digest(st);
out:
    xx_free(st);
    return rc;
}
