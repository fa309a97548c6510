/* Internal to csrc/xxh3_*.c: XXH3's constants, the default secret, and the stripe kernels'
 * interface (kernels in xxh3_kernels.c, the streaming state machine in xxh3_copy.c). */
#ifndef TKV_XXH3_H
#define TKV_XXH3_H

#include <string.h>

#include "tkv.h"

#define P32_1 0x9E3779B1u
#define P32_2 0x85EBCA77u
#define P32_3 0xC2B2AE3Du
#define P64_1 0x9E3779B185EBCA87ull
#define P64_2 0xC2B2AE3D27D4EB4Full
#define P64_3 0x165667B19E3779F9ull
#define P64_4 0x85EBCA77C2B2AE63ull
#define P64_5 0x27D4EB2F165667C5ull
#define PMX_1 0x165667919E3779F9ull

#define STRIPE 64
#define SECRET_LEN 192
#define STRIPES_PER_BLOCK ((SECRET_LEN - STRIPE) / 8) /* 16: a 1 KiB block, then a scramble */
#define SCRAMBLE_KEY (SECRET_LEN - STRIPE)            /* 128 */
#define LAST_STRIPE_KEY (SECRET_LEN - STRIPE - 7)     /* 121 */
#define MERGE_KEY 11

extern const uint8_t TKV_SECRET[SECRET_LEN]; /* XXH3's default secret */

static inline uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v; /* little endian: the self-test refuses the kernels on a big-endian machine */
}

/* One stripe into the accumulators (scalar): lane i takes data[i ^ 1] plus lo32 * hi32 of
 * data[i] ^ key[i]. */
static inline void stripe_scalar(uint64_t *acc, const uint8_t *data, const uint8_t *key) {
    for (int i = 0; i < 8; i++) {
        uint64_t v = rd64(data + 8 * i), k = v ^ rd64(key + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFu) * (k >> 32);
    }
}

static inline void scramble_scalar(uint64_t *acc, const uint8_t *key) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= rd64(key + 8 * i);
        acc[i] = a * P32_1;
    }
}

/* A kernel consumes n >= 1 whole stripes of src (copying them to dst unless it is NULL) and
 * leaves the last of them in `last`. `stripes`: position in the current 1 KiB block. */
typedef void (*kernel_fn)(uint64_t *acc, uint32_t *stripes, const uint8_t *src, uint8_t *dst,
                          size_t n, int nt, uint8_t *last);
/* The same on two streams at once (two blocks whose hash states are in the same position). */
typedef void (*kernel2_fn)(uint64_t *acc_a, uint64_t *acc_b, uint32_t *stripes, const uint8_t *src_a,
                           uint8_t *dst_a, const uint8_t *src_b, uint8_t *dst_b, size_t n, int nt,
                           uint8_t *last_a, uint8_t *last_b);

/* The kernels of the implementation in use (tkv_impl()). */
kernel_fn tkv_kernel(void);
kernel2_fn tkv_kernel2(void);

#endif
