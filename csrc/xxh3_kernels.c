/* The stripe kernels of XXH3-64 fused with a copy (see xxh3_copy.c for why), one per
 * instruction set: scalar (any CPU), AVX2 and AVX-512 (x86-64), compiled with target attributes
 * and picked at load time from the CPU (no -march flag baked into the build). Each 64-byte
 * stripe is loaded once, stored from the registers it was loaded into, and hashed from the same
 * registers; an empty asm statement makes each loaded value opaque, so the compiler cannot
 * re-read the source for the hash. Non-temporal stores (`nt`) need an aligned destination: 64
 * bytes, else four 16-byte ones, else plain stores.
 */
#include "xxh3.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TKV_X86 1
#endif

#define PREFETCH 4096 /* bytes ahead of the read: +9% on a 2-core VM's DRAM (a prefetch never faults) */

/* The algorithm's default secret (a constant of XXH3, as listed in its specification). */
const uint8_t TKV_SECRET[SECRET_LEN] __attribute__((aligned(64))) = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static void k_scalar(uint64_t *acc, uint32_t *stripes, const uint8_t *src, uint8_t *dst, size_t n,
                     int nt, uint8_t *last) {
    (void)nt;
    uint32_t k = *stripes;
    uint8_t v[STRIPE];
    for (size_t s = 0; s < n; s++) {
        memcpy(v, src + STRIPE * s, STRIPE);
        __asm__ volatile("" ::: "memory"); /* v is what was read; src is never read again */
        if (dst) memcpy(dst + STRIPE * s, v, STRIPE);
        stripe_scalar(acc, v, TKV_SECRET + 8 * k);
        if (++k == STRIPES_PER_BLOCK) {
            scramble_scalar(acc, TKV_SECRET + SCRAMBLE_KEY);
            k = 0;
        }
    }
    memcpy(last, v, STRIPE);
    *stripes = k;
}

#ifdef TKV_X86
__attribute__((target("avx2"))) static inline __m256i acc256(__m256i a, __m256i d, const uint8_t *key) {
    __m256i dk = _mm256_xor_si256(d, _mm256_loadu_si256((const __m256i *)key));
    __m256i prod = _mm256_mul_epu32(dk, _mm256_srli_epi64(dk, 32));
    __m256i swapped = _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2));
    return _mm256_add_epi64(a, _mm256_add_epi64(prod, swapped));
}

__attribute__((target("avx2"))) static inline __m256i scr256(__m256i a, const uint8_t *key) {
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    __m256i x = _mm256_xor_si256(_mm256_xor_si256(a, _mm256_srli_epi64(a, 47)),
                                 _mm256_loadu_si256((const __m256i *)key));
    __m256i lo = _mm256_mul_epu32(x, prime);
    __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), prime);
    return _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
}

__attribute__((target("avx2"))) static void k_avx2(uint64_t *acc, uint32_t *stripes, const uint8_t *src,
                                                   uint8_t *dst, size_t n, int nt, uint8_t *last) {
    __m256i a0 = _mm256_loadu_si256((const __m256i *)acc), a1 = _mm256_loadu_si256((const __m256i *)(acc + 4));
    __m256i d0 = _mm256_setzero_si256(), d1 = _mm256_setzero_si256();
    int stream = !(nt && dst) ? 0 : ((uintptr_t)dst & 31) == 0 ? 32 : ((uintptr_t)dst & 15) == 0 ? 16 : 0;
    uint32_t k = *stripes;
    for (size_t s = 0; s < n; s++) {
        const uint8_t *p = src + STRIPE * s;
        _mm_prefetch((const char *)(p + PREFETCH), _MM_HINT_T0);
        d0 = _mm256_loadu_si256((const __m256i *)p);
        d1 = _mm256_loadu_si256((const __m256i *)(p + 32));
        __asm__("" : "+x"(d0), "+x"(d1)); /* the hashed value is the stored value */
        if (stream == 32) {
            _mm256_stream_si256((__m256i *)(dst + STRIPE * s), d0);
            _mm256_stream_si256((__m256i *)(dst + STRIPE * s + 32), d1);
        } else if (stream == 16) {
            __m128i *q = (__m128i *)(dst + STRIPE * s);
            _mm_stream_si128(q, _mm256_castsi256_si128(d0));
            _mm_stream_si128(q + 1, _mm256_extracti128_si256(d0, 1));
            _mm_stream_si128(q + 2, _mm256_castsi256_si128(d1));
            _mm_stream_si128(q + 3, _mm256_extracti128_si256(d1, 1));
        } else if (dst) {
            _mm256_storeu_si256((__m256i *)(dst + STRIPE * s), d0);
            _mm256_storeu_si256((__m256i *)(dst + STRIPE * s + 32), d1);
        }
        a0 = acc256(a0, d0, TKV_SECRET + 8 * k);
        a1 = acc256(a1, d1, TKV_SECRET + 8 * k + 32);
        if (++k == STRIPES_PER_BLOCK) {
            a0 = scr256(a0, TKV_SECRET + SCRAMBLE_KEY);
            a1 = scr256(a1, TKV_SECRET + SCRAMBLE_KEY + 32);
            k = 0;
        }
    }
    _mm256_storeu_si256((__m256i *)acc, a0);
    _mm256_storeu_si256((__m256i *)(acc + 4), a1);
    _mm256_storeu_si256((__m256i *)last, d0);
    _mm256_storeu_si256((__m256i *)(last + 32), d1);
    *stripes = k;
}

__attribute__((target("avx512f"))) static void k_avx512(uint64_t *acc, uint32_t *stripes, const uint8_t *src,
                                                       uint8_t *dst, size_t n, int nt, uint8_t *last) {
    const __m512i prime = _mm512_set1_epi32((int)P32_1);
    const __m512i skey = _mm512_loadu_si512((const void *)(TKV_SECRET + SCRAMBLE_KEY));
    __m512i a = _mm512_loadu_si512((const void *)acc), d = _mm512_setzero_si512();
    /* non-temporal stores need an aligned destination: 64 bytes, else four 16-byte ones */
    int stream = !(nt && dst) ? 0 : ((uintptr_t)dst & 63) == 0 ? 64 : ((uintptr_t)dst & 15) == 0 ? 16 : 0;
    uint32_t k = *stripes;
    for (size_t s = 0; s < n; s++) {
        _mm_prefetch((const char *)(src + STRIPE * s + PREFETCH), _MM_HINT_T0);
        d = _mm512_loadu_si512((const void *)(src + STRIPE * s));
        __asm__("" : "+v"(d)); /* the hashed value is the stored value */
        if (stream == 64) {
            _mm512_stream_si512((void *)(dst + STRIPE * s), d);
        } else if (stream == 16) {
            __m128i *q = (__m128i *)(dst + STRIPE * s);
            _mm_stream_si128(q, _mm512_extracti32x4_epi32(d, 0));
            _mm_stream_si128(q + 1, _mm512_extracti32x4_epi32(d, 1));
            _mm_stream_si128(q + 2, _mm512_extracti32x4_epi32(d, 2));
            _mm_stream_si128(q + 3, _mm512_extracti32x4_epi32(d, 3));
        } else if (dst)
            _mm512_storeu_si512((void *)(dst + STRIPE * s), d);
        __m512i dk = _mm512_xor_si512(d, _mm512_loadu_si512((const void *)(TKV_SECRET + 8 * k)));
        __m512i prod = _mm512_mul_epu32(dk, _mm512_srli_epi64(dk, 32));
        __m512i swapped = _mm512_shuffle_epi32(d, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2));
        a = _mm512_add_epi64(a, _mm512_add_epi64(prod, swapped));
        if (++k == STRIPES_PER_BLOCK) {
            __m512i x = _mm512_xor_si512(_mm512_xor_si512(a, _mm512_srli_epi64(a, 47)), skey);
            __m512i lo = _mm512_mul_epu32(x, prime);
            __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), prime);
            a = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
            k = 0;
        }
    }
    _mm512_storeu_si512((void *)acc, a);
    _mm512_storeu_si512((void *)last, d);
    *stripes = k;
}
#endif

/* Two streams at once: twice the reads in flight, ~20% more bandwidth per thread than one
 * stream on this VM's DRAM (AVX-512, which has the registers for it). */

static void k2_scalar(uint64_t *acc_a, uint64_t *acc_b, uint32_t *stripes, const uint8_t *src_a, uint8_t *dst_a,
                      const uint8_t *src_b, uint8_t *dst_b, size_t n, int nt, uint8_t *last_a, uint8_t *last_b) {
    uint32_t k = *stripes;
    k_scalar(acc_a, &k, src_a, dst_a, n, nt, last_a);
    k_scalar(acc_b, stripes, src_b, dst_b, n, nt, last_b);
}

#ifdef TKV_X86
__attribute__((target("avx2"))) static void k2_avx2(uint64_t *acc_a, uint64_t *acc_b, uint32_t *stripes,
                                                    const uint8_t *src_a, uint8_t *dst_a, const uint8_t *src_b,
                                                    uint8_t *dst_b, size_t n, int nt, uint8_t *last_a,
                                                    uint8_t *last_b) {
    uint32_t k = *stripes;
    k_avx2(acc_a, &k, src_a, dst_a, n, nt, last_a); /* AVX2 has too few registers to gain here */
    k_avx2(acc_b, stripes, src_b, dst_b, n, nt, last_b);
}

__attribute__((target("avx512f"))) static inline __m512i acc512(__m512i a, __m512i d, const uint8_t *key) {
    __m512i dk = _mm512_xor_si512(d, _mm512_loadu_si512((const void *)key));
    __m512i prod = _mm512_mul_epu32(dk, _mm512_srli_epi64(dk, 32));
    __m512i swapped = _mm512_shuffle_epi32(d, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2));
    return _mm512_add_epi64(a, _mm512_add_epi64(prod, swapped));
}

__attribute__((target("avx512f"))) static inline __m512i scr512(__m512i a, __m512i key) {
    const __m512i prime = _mm512_set1_epi32((int)P32_1);
    __m512i x = _mm512_xor_si512(_mm512_xor_si512(a, _mm512_srli_epi64(a, 47)), key);
    __m512i lo = _mm512_mul_epu32(x, prime);
    __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), prime);
    return _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
}

__attribute__((target("avx512f"))) static inline void store512(uint8_t *dst, __m512i d, int stream) {
    if (stream == 64) {
        _mm512_stream_si512((void *)dst, d);
    } else if (stream == 16) {
        __m128i *q = (__m128i *)dst;
        _mm_stream_si128(q, _mm512_extracti32x4_epi32(d, 0));
        _mm_stream_si128(q + 1, _mm512_extracti32x4_epi32(d, 1));
        _mm_stream_si128(q + 2, _mm512_extracti32x4_epi32(d, 2));
        _mm_stream_si128(q + 3, _mm512_extracti32x4_epi32(d, 3));
    } else {
        _mm512_storeu_si512((void *)dst, d);
    }
}

static int nt_mode(const uint8_t *dst, int nt) {
    return !(nt && dst) ? 0 : ((uintptr_t)dst & 63) == 0 ? 64 : ((uintptr_t)dst & 15) == 0 ? 16 : 0;
}

__attribute__((target("avx512f"))) static void k2_avx512(uint64_t *acc_a, uint64_t *acc_b, uint32_t *stripes,
                                                        const uint8_t *src_a, uint8_t *dst_a, const uint8_t *src_b,
                                                        uint8_t *dst_b, size_t n, int nt, uint8_t *last_a,
                                                        uint8_t *last_b) {
    const __m512i skey = _mm512_loadu_si512((const void *)(TKV_SECRET + SCRAMBLE_KEY));
    __m512i a = _mm512_loadu_si512((const void *)acc_a), b = _mm512_loadu_si512((const void *)acc_b);
    __m512i da = _mm512_setzero_si512(), db = _mm512_setzero_si512();
    int sa = nt_mode(dst_a, nt), sb = nt_mode(dst_b, nt);
    uint32_t k = *stripes;
    for (size_t s = 0; s < n; s++) {
        _mm_prefetch((const char *)(src_a + STRIPE * s + PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(src_b + STRIPE * s + PREFETCH), _MM_HINT_T0);
        da = _mm512_loadu_si512((const void *)(src_a + STRIPE * s));
        db = _mm512_loadu_si512((const void *)(src_b + STRIPE * s));
        __asm__("" : "+v"(da), "+v"(db)); /* the hashed values are the stored values */
        if (dst_a) store512(dst_a + STRIPE * s, da, sa);
        if (dst_b) store512(dst_b + STRIPE * s, db, sb);
        a = acc512(a, da, TKV_SECRET + 8 * k);
        b = acc512(b, db, TKV_SECRET + 8 * k);
        if (++k == STRIPES_PER_BLOCK) {
            a = scr512(a, skey);
            b = scr512(b, skey);
            k = 0;
        }
    }
    _mm512_storeu_si512((void *)acc_a, a);
    _mm512_storeu_si512((void *)acc_b, b);
    _mm512_storeu_si512((void *)last_a, da);
    _mm512_storeu_si512((void *)last_b, db);
    *stripes = k;
}
#endif

/* ---- dispatch ----------------------------------------------------------------------------- */

static kernel_fn KERNELS[3] = {k_scalar,
#ifdef TKV_X86
                               k_avx2, k_avx512
#else
                               0, 0
#endif
};
static kernel2_fn KERNELS2[3] = {k2_scalar,
#ifdef TKV_X86
                                 k2_avx2, k2_avx512
#else
                                 0, 0
#endif
};
static int g_impl = -1;

int tkv_impl_supported(int impl) {
    if (impl == TKV_IMPL_SCALAR) return 1;
#ifdef TKV_X86
    __builtin_cpu_init();
    if (impl == TKV_IMPL_AVX2) return __builtin_cpu_supports("avx2");
    if (impl == TKV_IMPL_AVX512) return __builtin_cpu_supports("avx512f");
#endif
    return 0;
}

/* The best kernel this CPU supports. */
int tkv_best_impl(void) {
    for (int i = TKV_IMPL_AVX512; i > TKV_IMPL_SCALAR; i--)
        if (tkv_impl_supported(i)) return i;
    return TKV_IMPL_SCALAR;
}

int tkv_impl(void) {
    if (g_impl < 0) g_impl = tkv_best_impl();
    return g_impl;
}

/* Force a kernel (tests and the benchmark compare them); -1 if the CPU lacks it. */
int tkv_set_impl(int impl) {
    if (impl < 0 || impl > TKV_IMPL_AVX512 || !tkv_impl_supported(impl)) return -1;
    g_impl = impl;
    return 0;
}

void tkv_store_fence(void) {
#ifdef TKV_X86
    _mm_sfence();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

kernel_fn tkv_kernel(void) { return KERNELS[tkv_impl()]; }
kernel2_fn tkv_kernel2(void) { return KERNELS2[tkv_impl()]; }
