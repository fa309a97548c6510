/* XXH3-64 (seed 0, default secret, inputs over 240 bytes) computed over the bytes a copy writes,
 * in the same pass, written for tierkv from the published algorithm (xxhash's spec document):
 * a block's checksum (kvstore/block.py) is xxh3_64 of its zeroed header and payload, and the
 * connector must check it over the bytes that landed in the KV pool.
 *
 * Why our own kernel rather than the xxhash library's streaming calls: the library can only hash
 * bytes already in memory, so a copy + check is two passes over the destination (copy a chunk,
 * read it back). Here each 64-byte stripe is loaded once from the source into registers, stored
 * to the destination from those registers, and hashed from the same registers: one read, one
 * write, with non-temporal stores where the bytes are not needed in cache. The checksum is of
 * exactly the bytes written: a source that another process changes meanwhile (shared memory)
 * can make the copy differ from the source, never from the checksum. An empty asm statement
 * makes each loaded value opaque, so the compiler cannot re-read the source for the hash.
 *
 * This file is the streaming state machine over the stripe kernels (xxh3_kernels.c: scalar,
 * AVX2, AVX-512, chosen at load time from the CPU). connector/native_lib.py self-tests the
 * chosen one against python-xxhash before using it.
 */
#include "xxh3.h"

/* ---- streaming -------------------------------------------------------------------------- */

void tkv_hash_reset(tkv_hash *h) {
    static const uint64_t init[8] = {P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1};
    memcpy(h->acc, init, sizeof init);
    h->total = 0;
    h->buflen = 0;
    h->stripes = 0;
}

/* A stripe is consumed only once at least one byte follows it: XXH3 treats the input's final
 * 1..64 bytes apart (its last stripe), and the stream's end is not known in advance. */
void tkv_hash_feed(tkv_hash *h, const uint8_t *src, uint8_t *dst, size_t len, int nt) {
    kernel_fn kernel = tkv_kernel();
    h->total += len;
    while (len) {
        if (h->buflen == STRIPE) { /* more bytes follow the held-back stripe */
            kernel(h->acc, &h->stripes, h->buf, NULL, 1, 0, h->last);
            h->buflen = 0;
        }
        if (h->buflen == 0 && len > STRIPE) {
            size_t n = (len - 1) / STRIPE;
            kernel(h->acc, &h->stripes, src, dst, n, nt, h->last);
            src += STRIPE * n;
            if (dst) dst += STRIPE * n;
            len -= STRIPE * n;
            continue;
        }
        size_t take = STRIPE - h->buflen;
        if (take > len) take = len;
        memcpy(h->buf + h->buflen, src, take); /* read once into private memory ... */
        if (dst) {
            memcpy(dst, h->buf + h->buflen, take); /* ... and written from there */
            dst += take;
        }
        h->buflen += (uint32_t)take;
        src += take;
        len -= take;
    }
}

/* tkv_hash_feed on two states in the same position (same bytes fed so far) with the same length,
 * streaming both at once; they stay in the same position. */
void tkv_hash_feed2(tkv_hash *ha, tkv_hash *hb, const uint8_t *src_a, uint8_t *dst_a, const uint8_t *src_b,
                    uint8_t *dst_b, size_t len, int nt) {
    kernel_fn kernel = tkv_kernel();
    kernel2_fn kernel2 = tkv_kernel2();
    ha->total += len;
    hb->total += len;
    while (len) {
        if (ha->buflen == STRIPE) {
            uint32_t k = ha->stripes;
            kernel(ha->acc, &k, ha->buf, NULL, 1, 0, ha->last);
            kernel(hb->acc, &hb->stripes, hb->buf, NULL, 1, 0, hb->last);
            ha->stripes = hb->stripes;
            ha->buflen = hb->buflen = 0;
        }
        if (ha->buflen == 0 && len > STRIPE) {
            size_t n = (len - 1) / STRIPE;
            kernel2(ha->acc, hb->acc, &ha->stripes, src_a, dst_a, src_b, dst_b, n, nt, ha->last, hb->last);
            hb->stripes = ha->stripes;
            src_a += STRIPE * n;
            src_b += STRIPE * n;
            if (dst_a) dst_a += STRIPE * n;
            if (dst_b) dst_b += STRIPE * n;
            len -= STRIPE * n;
            continue;
        }
        size_t take = STRIPE - ha->buflen;
        if (take > len) take = len;
        memcpy(ha->buf + ha->buflen, src_a, take);
        memcpy(hb->buf + hb->buflen, src_b, take);
        if (dst_a) {
            memcpy(dst_a, ha->buf + ha->buflen, take);
            dst_a += take;
        }
        if (dst_b) {
            memcpy(dst_b, hb->buf + hb->buflen, take);
            dst_b += take;
        }
        ha->buflen += (uint32_t)take;
        hb->buflen += (uint32_t)take;
        src_a += take;
        src_b += take;
        len -= take;
    }
}

static uint64_t fold128(uint64_t a, uint64_t b) {
    unsigned __int128 p = (unsigned __int128)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

uint64_t tkv_hash_digest(const tkv_hash *h) {
    uint64_t acc[8];
    uint8_t last[STRIPE];
    memcpy(acc, h->acc, sizeof acc);
    size_t before = STRIPE - h->buflen; /* bytes of the final stripe that were already consumed */
    memcpy(last, h->last + h->buflen, before);
    memcpy(last + before, h->buf, h->buflen);
    stripe_scalar(acc, last, TKV_SECRET + LAST_STRIPE_KEY);
    uint64_t r = h->total * P64_1;
    for (int i = 0; i < 4; i++)
        r += fold128(acc[2 * i] ^ rd64(TKV_SECRET + MERGE_KEY + 16 * i), acc[2 * i + 1] ^ rd64(TKV_SECRET + MERGE_KEY + 16 * i + 8));
    r ^= r >> 37;
    r *= PMX_1;
    return r ^ (r >> 32);
}
