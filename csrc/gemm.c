/* y = x @ w^T for a few rows of x (an engine step of decodes and short prompts), fp32, on the CPU.
 *
 * A decode step of a small model streams every weight once; with one row or with a dozen, the
 * weights are the same bytes, so a step of a few rows should cost what one row costs until the
 * arithmetic catches up with memory (~16 rows on 2 cores here). torch's CPU build does not get
 * there: F.linear and mm(w, x^T) took 39-42 ms over SmolLM2-135M's weights at 6-8 rows against
 * 17 ms at 2 (engine/cpu_gemm.py). This kernel reads each block of 4 weight rows once and
 * computes it against up to 6 rows of x held in registers (4 x 6 accumulators), so the weights
 * leave memory once per call at any row count up to 6 and once per 6 rows beyond.
 *
 * Every output element is the same sum in the same order whatever the row count, the block it
 * falls in or the thread that computes it (lane-wise partial sums over k, then one fixed
 * reduction), so a row's result does not depend on what else is in the step.
 *
 * Threads: each call splits the output columns over torch's OpenMP threads (below). Plain C,
 * loaded with ctypes (engine/native_gemm.py); the kernel (AVX-512, AVX2+FMA, scalar) is picked
 * from the CPU at first use. */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define GEMM_ABI 1
#define MAX_THREADS 64
#define MB 6          /* rows of x per register block */
#define NB 4          /* weight rows per register block */

typedef struct {
    const float *x, *w;
    float *y;
    int64_t ldx, ldw, ldy, M, N, K;
} args_t;

typedef void (*kernel_t)(const args_t *, int64_t n0, int64_t n1);

/* ---- scalar: 16 lane-wise fused partial sums, then the SIMD kernels' pairwise reduction: every
 * kernel gives the same bits ---- */
static float reduce16(const float *s) {
    float t8[8], t4[4], t2[2];
    for (int i = 0; i < 8; i++) t8[i] = s[i] + s[i + 8];
    for (int i = 0; i < 4; i++) t4[i] = t8[i] + t8[i + 4];
    for (int i = 0; i < 2; i++) t2[i] = t4[i] + t4[i + 2];
    return t2[0] + t2[1];
}

static void k_scalar(const args_t *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        const float *w = a->w + n * a->ldw;
        for (int64_t m = 0; m < a->M; m++) {
            const float *x = a->x + m * a->ldx;
            float s[16] = {0};
            for (int64_t k = 0; k < a->K; k++) s[k & 15] = __builtin_fmaf(x[k], w[k], s[k & 15]);
            a->y[m * a->ldy + n] = reduce16(s);
        }
    }
}

#if defined(__x86_64__)
/* ---- AVX-512: 16 lanes ---- */
__attribute__((target("avx512f"))) static inline float hsum512(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

/* R rows of x (from m0) against NB weight rows (from n; the first nw are real, the rest repeat row n) */
__attribute__((target("avx512f"), always_inline)) static inline void b512(const args_t *a, const float *const *w,
                                                                          int nw, int64_t m0, int64_t n,
                                                                          const int R) {
    const float *x[MB];
    for (int r = 0; r < R; r++) x[r] = a->x + (m0 + r) * a->ldx;
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    const int64_t K = a->K, kv = K & ~(int64_t)15;
    __m512 acc[MB][NB];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++) acc[r][j] = _mm512_setzero_ps();
    const int64_t ahead = NB * a->ldw; /* the next block's rows: short rows train no prefetcher */
    for (int64_t k = 0; k < kv; k += 16) {
        _mm_prefetch((const char *)(w0 + ahead + k), _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + ahead + k), _MM_HINT_T0);
        _mm_prefetch((const char *)(w2 + ahead + k), _MM_HINT_T0);
        _mm_prefetch((const char *)(w3 + ahead + k), _MM_HINT_T0);
        __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w1 + k);
        __m512 v2 = _mm512_loadu_ps(w2 + k), v3 = _mm512_loadu_ps(w3 + k);
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_loadu_ps(x[r] + k);
            acc[r][0] = _mm512_fmadd_ps(xv, v0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xv, v1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(xv, v2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(xv, v3, acc[r][3]);
        }
    }
    if (kv < K) { /* the last K % 16 columns, the other lanes zero */
        __mmask16 mk = (__mmask16)((1u << (K - kv)) - 1u);
        __m512 v0 = _mm512_maskz_loadu_ps(mk, w0 + kv), v1 = _mm512_maskz_loadu_ps(mk, w1 + kv);
        __m512 v2 = _mm512_maskz_loadu_ps(mk, w2 + kv), v3 = _mm512_maskz_loadu_ps(mk, w3 + kv);
        for (int r = 0; r < R; r++) {
            __m512 xv = _mm512_maskz_loadu_ps(mk, x[r] + kv);
            acc[r][0] = _mm512_fmadd_ps(xv, v0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xv, v1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(xv, v2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(xv, v3, acc[r][3]);
        }
    }
    float *y = a->y + m0 * a->ldy + n;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < nw; j++) y[r * a->ldy + j] = hsum512(acc[r][j]);
}
#define BLOCK512(R)                                                                                        \
    __attribute__((target("avx512f"))) static void b512_##R(const args_t *a, const float *const *w, int nw, \
                                                            int64_t m0, int64_t n) {                      \
        b512(a, w, nw, m0, n, R);                                                                          \
    }
BLOCK512(1) BLOCK512(2) BLOCK512(3) BLOCK512(4) BLOCK512(5) BLOCK512(6)

__attribute__((target("avx512f"))) static void k_avx512(const args_t *a, int64_t n0, int64_t n1) {
    typedef void (*blk_t)(const args_t *, const float *const *, int, int64_t, int64_t);
    static const blk_t blk[MB + 1] = {0, b512_1, b512_2, b512_3, b512_4, b512_5, b512_6};
    for (int64_t n = n0; n < n1; n += NB) {
        int nw = n1 - n < NB ? (int)(n1 - n) : NB;
        const float *w[NB];
        for (int j = 0; j < NB; j++) w[j] = a->w + (n + (j < nw ? j : 0)) * a->ldw;
        for (int64_t m0 = 0; m0 < a->M; m0 += MB) {
            int r = a->M - m0 < MB ? (int)(a->M - m0) : MB;
            blk[r](a, w, nw, m0, n);
        }
    }
}

/* ---- AVX2 + FMA: 8 lanes, accumulated as two 8-lane halves so the sum order matches 16 lanes ---- */
__attribute__((target("avx2,fma"))) static inline float hsum256x2(__m256 lo, __m256 hi) {
    __m256 h = _mm256_add_ps(lo, hi); /* lanes i and i + 8 of the 16 */
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

/* one row of x at a time: 4 weight rows x 2 halves = 8 accumulators (AVX2 has 16 registers); the
 * weight block stays in L1 while the rows of x go by */
__attribute__((target("avx2,fma"))) static void b256(const args_t *a, const float *const *w, int nw, int64_t m,
                                                     int64_t n) {
    __m256 lo[NB], hi[NB];
    _Pragma("GCC unroll 4") for (int j = 0; j < NB; j++) lo[j] = hi[j] = _mm256_setzero_ps();
    const int64_t K = a->K, kv = K & ~(int64_t)15;
    const float *xr = a->x + m * a->ldx;
    for (int64_t k = 0; k < kv; k += 16) {
        __m256 x0 = _mm256_loadu_ps(xr + k), x1 = _mm256_loadu_ps(xr + k + 8);
        _Pragma("GCC unroll 4") for (int j = 0; j < NB; j++) {
            lo[j] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w[j] + k), lo[j]);
            hi[j] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w[j] + k + 8), hi[j]);
        }
    }
    for (int j = 0; j < nw; j++) {
        float s[16];
        _mm256_storeu_ps(s, lo[j]);
        _mm256_storeu_ps(s + 8, hi[j]);
        for (int64_t k = kv; k < K; k++) s[k & 15] = __builtin_fmaf(xr[k], w[j][k], s[k & 15]);
        a->y[m * a->ldy + n + j] = hsum256x2(_mm256_loadu_ps(s), _mm256_loadu_ps(s + 8));
    }
}

__attribute__((target("avx2,fma"))) static void k_avx2(const args_t *a, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += NB) {
        int nw = n1 - n < NB ? (int)(n1 - n) : NB;
        const float *w[NB];
        for (int j = 0; j < NB; j++) w[j] = a->w + (n + (j < nw ? j : 0)) * a->ldw;
        for (int64_t m = 0; m < a->M; m++) b256(a, w, nw, m, n);
    }
}
#endif

/* ---- kernel choice ---- */
static const kernel_t KERNELS[3] = {
    k_scalar,
#if defined(__x86_64__)
    k_avx2, k_avx512,
#else
    0, 0,
#endif
};
static int cpu_has(int k) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (k == 2) return __builtin_cpu_supports("avx512f");
    if (k == 1) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    return k == 0;
}
static atomic_int active = -1;

int tkv_gemm_abi(void) { return GEMM_ABI; }

int tkv_gemm_kernel(void) {
    int k = atomic_load(&active);
    if (k < 0) {
        k = cpu_has(2) ? 2 : cpu_has(1) ? 1 : 0;
        atomic_store(&active, k);
    }
    return k;
}

/* Force a kernel (tests compare them); -1 if the CPU lacks it. */
int tkv_gemm_set_kernel(int k) {
    if (k < 0 || k > 2 || !cpu_has(k)) return -1;
    atomic_store(&active, k);
    return 0;
}

/* ---- threads: torch's own OpenMP pool ----
 * Built with -fopenmp, this library asks for libgomp.so.1, which the process has loaded already
 * with torch (torch/lib/libgomp.so.1): the same runtime, so these parallel regions run on the
 * threads torch's own ops use. A pool of our own fought them for the cores (on 2 cores, a decode
 * step took 102 ms instead of 26: a worker of ours waiting for the next call held a core one of
 * torch's threads had been woken on, spinning or yielding alike). torch's threads sleep between
 * regions, so each call pays a wake-up (~50 us here): the start-up timing (engine/cpu_gemm.py)
 * weighs that against the other forms at each row count. */
#ifdef _OPENMP
#include <omp.h>
#endif

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ w[N, K]^T (row stride ldw), on ``threads``
 * threads (the caller's included). Returns 0, or -1 for arguments it does not take. */
int tkv_sgemm_nt(const float *x, int64_t ldx, const float *w, int64_t ldw, float *y, int64_t ldy, int64_t M,
                 int64_t N, int64_t K, int threads) {
    if (M < 0 || N < 0 || K < 0 || ldx < K || ldw < K || ldy < N) return -1;
    if (M == 0 || N == 0) return 0;
    kernel_t fn = KERNELS[tkv_gemm_kernel()];
    args_t a = {x, w, y, ldx, ldw, ldy, M, N, K};
    int64_t most = (N + 63) / 64; /* parts of at least 64 columns */
    int parts = threads < 1 ? 1 : (threads > most ? (int)most : threads);
    if (parts > MAX_THREADS) parts = MAX_THREADS;
#ifdef _OPENMP
    if (parts > 1) {
#pragma omp parallel num_threads(parts)
        {
            int64_t i = omp_get_thread_num(), p = omp_get_num_threads();
            /* cut at multiples of 16 columns: whole cache lines of y */
            int64_t n0 = (N * i / p) & ~(int64_t)15, n1 = i + 1 == p ? N : (N * (i + 1) / p) & ~(int64_t)15;
            fn(&a, n0, n1);
        }
        return 0;
    }
#endif
    fn(&a, 0, N);
    return 0;
}
