/* Shared declarations of tierkv's native data path (csrc/). Plain C, no Python headers: the
 * library is loaded with ctypes (connector/native.py). */
#ifndef TKV_H
#define TKV_H

#include <stddef.h>
#include <stdint.h>

/* ---- xxh3_copy.c: XXH3-64 (long inputs) streamed over the bytes a copy writes ---------- */

/* Below this many bytes XXH3 uses its short-input algorithms, which are not implemented
 * here: callers hash such blocks with the python xxhash library instead. */
#define TKV_XXH3_MIDSIZE_MAX 240

/* Kernel implementations, chosen once at load time from what the CPU supports. */
enum { TKV_IMPL_SCALAR = 0, TKV_IMPL_AVX2 = 1, TKV_IMPL_AVX512 = 2 };

typedef struct {
    uint64_t acc[8];
    uint8_t buf[64];   /* bytes not yet consumed: the stream's last 1..64 bytes so far */
    uint8_t last[64];  /* the last stripe consumed (the final stripe may overlap it) */
    uint64_t total;    /* bytes fed */
    uint32_t buflen;
    uint32_t stripes;  /* stripes consumed in the current 1 KiB block (0..15) */
} tkv_hash;

void tkv_hash_reset(tkv_hash *h);
/* Feed ``len`` bytes read once from ``src``: when ``dst`` is not NULL they are also written
 * there, and what is hashed is exactly what was written. ``nt``: non-temporal stores. */
void tkv_hash_feed(tkv_hash *h, const uint8_t *src, uint8_t *dst, size_t len, int nt);
/* tkv_hash_feed of two states in the same position, at once (more reads in flight). */
void tkv_hash_feed2(tkv_hash *ha, tkv_hash *hb, const uint8_t *src_a, uint8_t *dst_a, const uint8_t *src_b,
                    uint8_t *dst_b, size_t len, int nt);
/* The XXH3-64 digest (seed 0) of everything fed; valid only when ``total`` > 240. */
uint64_t tkv_hash_digest(const tkv_hash *h);
/* Store fence after non-temporal stores, before the bytes are handed to another thread. */
void tkv_store_fence(void);

int tkv_impl(void);
int tkv_best_impl(void);
int tkv_impl_supported(int impl);
int tkv_set_impl(int impl);

#endif
