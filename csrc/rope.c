/* CacheBlend's re-rotation of cached K, in place: K was rotated (RoPE, "rotate_half" convention)
 * at its chunk positions; undo that and rotate at the prompt positions, in one pass over K.
 *
 * The torch version (connector/blend/blender.py) is two `rotate` calls, each x*cos +
 * rotate_half(x)*sin over the whole [layers, tokens, heads, dim] tensor with temporaries. Here
 * each row is read once and written once, and the arithmetic is the same IEEE fp32 operations
 * in the same order (a product per term, then their sum: built with -ffp-contract=off so no
 * multiply-add is fused), so the result is bit for bit the torch one
 * (tests/test_native_rope.py). Vector width is picked at load time (target_clones).
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdint.h>

#define MAX_THREADS 16

typedef struct {
    float *k;
    int64_t layers, n, heads, half;
    const float *c1, *s1, *c2, *s2; /* [n, 2 * half]: undo (cos, -sin at the old position), redo (cos, sin) */
    int64_t first, last;            /* rows (layer * n + token) of this worker */
} rope_job;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void rotate_rows(float *restrict k, int64_t first, int64_t last, int64_t n, int64_t heads, int64_t half,
                        const float *restrict c1, const float *restrict s1, const float *restrict c2,
                        const float *restrict s2) {
    const int64_t dim = 2 * half;
    for (int64_t row = first; row < last; row++) {
        int64_t t = row % n;
        /* full-width tables, used exactly as torch's x * cos + rotate_half(x) * sin uses them */
        const float *a1 = c1 + t * dim, *b1 = s1 + t * dim, *a2 = c2 + t * dim, *b2 = s2 + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *restrict x1 = k + (row * heads + h) * dim;
            float *restrict x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                float y1 = x1[i] * a1[i] + (-x2[i]) * b1[i];
                float y2 = x2[i] * a1[half + i] + x1[i] * b1[half + i];
                x1[i] = y1 * a2[i] + (-y2) * b2[i];
                x2[i] = y2 * a2[half + i] + y1 * b2[half + i];
            }
        }
    }
}

static void *rope_worker(void *arg) {
    rope_job *j = arg;
    rotate_rows(j->k, j->first, j->last, j->n, j->heads, j->half, j->c1, j->s1, j->c2, j->s2);
    return NULL;
}

/* K: [layers, n, heads, 2 * half] contiguous fp32, rotated in place; returns threads used. */
int tkv_rerotate_f32(float *k, int64_t layers, int64_t n, int64_t heads, int64_t half, const float *c1,
                     const float *s1, const float *c2, const float *s2, int32_t threads) {
    int64_t rows = layers * n;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > rows) threads = (int32_t)(rows > 0 ? rows : 1);
    rope_job jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started = 0;
    for (int i = 0; i < threads; i++) {
        jobs[i] = (rope_job){k, layers, n, heads, half, c1, s1, c2, s2, rows * i / threads, rows * (i + 1) / threads};
    }
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&tids[started], NULL, rope_worker, &jobs[i]) != 0) {
            /* no thread: do its rows here */
            rope_worker(&jobs[i]);
            continue;
        }
        started++;
    }
    rope_worker(&jobs[0]);
    for (int i = 0; i < started; i++) pthread_join(tids[i], NULL);
    return started + 1;
}
