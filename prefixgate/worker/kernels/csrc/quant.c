/* Products against GGUF's Q4_1 and Q8_0 blocks, and their dequantization (AVX-512;
   the layouts are described in prefixgate/worker/kernels/cpu_quant.py). */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

#include "pg_internal.h"
#include "pg_kernels.h"

#ifdef __AVX512F__
int pg_has_avx512(void) { return 1; }
/* ---- products ---------------------------------------------------------------------- */
#define ROWS_PER_TASK 64
#define MB 8   /* activation rows per pass over a weight row (8 accumulators) */

typedef struct {
    const float *x; int64_t xs; int M, K, N;
    const uint8_t *w; float *out; int64_t os;
} gemm_t;

static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

static inline __attribute__((always_inline))
void q4_rows(const gemm_t *g, int n, int m0, int mb) {
    int nb = g->K / 32;
    const uint8_t *row = g->w + (int64_t)n * nb * 24;
    __m512 acc[MB];
    for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_ps();
    /* The block's 16 possible weights d * q + m in one register; each code picks its
       weight with a permute (which reads only the low 4 bits of each index). */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 24;
        float d, m; memcpy(&d, blk, 4); memcpy(&m, blk + 4, 4);
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 8)));
        __m512 lut = _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(m));
        __m512 lo = _mm512_permutexvar_ps(v, lut);
        __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
        for (int r = 0; r < mb; r++) {
            const float *xr = g->x + (int64_t)(m0 + r) * g->xs + b * 32;
            acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r]);
            acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[r]);
        }
    }
    for (int r = 0; r < mb; r++) g->out[(int64_t)(m0 + r) * g->os + n] = hsum(acc[r]);
}

static inline __attribute__((always_inline))
void q8_rows(const gemm_t *g, int n, int m0, int mb) {
    int nb = g->K / 32;
    const uint8_t *row = g->w + (int64_t)n * nb * 36;
    __m512 acc[MB];
    for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * 36;
        float d; memcpy(&d, blk, 4);
        __m512 dv = _mm512_set1_ps(d);
        __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(blk + 4)))), dv);
        __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(blk + 20)))), dv);
        for (int r = 0; r < mb; r++) {
            const float *xr = g->x + (int64_t)(m0 + r) * g->xs + b * 32;
            acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r]);
            acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[r]);
        }
    }
    for (int r = 0; r < mb; r++) g->out[(int64_t)(m0 + r) * g->os + n] = hsum(acc[r]);
}

#define GEMM_ITEM(NAME, ROWS)                                                           \
static void NAME(void *arg, int item) {                                                \
    const gemm_t *g = (const gemm_t *)arg;                                              \
    int n0 = item * ROWS_PER_TASK;                                                      \
    int n1 = n0 + ROWS_PER_TASK < g->N ? n0 + ROWS_PER_TASK : g->N;                    \
    for (int m0 = 0; m0 < g->M; m0 += MB) {                                             \
        int mb = g->M - m0 < MB ? g->M - m0 : MB;                                       \
        for (int n = n0; n < n1; n++) switch (mb) {                                     \
            case 1: ROWS(g, n, m0, 1); break; case 2: ROWS(g, n, m0, 2); break;         \
            case 3: ROWS(g, n, m0, 3); break; case 4: ROWS(g, n, m0, 4); break;         \
            case 5: ROWS(g, n, m0, 5); break; case 6: ROWS(g, n, m0, 6); break;         \
            case 7: ROWS(g, n, m0, 7); break; default: ROWS(g, n, m0, 8); break;        \
        }                                                                               \
    }                                                                                   \
}
GEMM_ITEM(q4_item, q4_rows)
GEMM_ITEM(q8_item, q8_rows)

#define SLICES(N) (((N) + ROWS_PER_TASK - 1) / ROWS_PER_TASK)

int pg_q4_1_gemm(const float *x, int64_t xs, int M, int K, int N, const uint8_t *w,
                 float *out, int64_t os, int nth) {
    if (K % 32) return -1;
    gemm_t g = {x, xs, M, K, N, w, out, os};
    pg_pool_run(q4_item, &g, SLICES(N), nth);
    return 0;
}

int pg_q8_0_gemm(const float *x, int64_t xs, int M, int K, int N, const uint8_t *w,
                 float *out, int64_t os, int nth) {
    if (K % 32) return -1;
    gemm_t g = {x, xs, M, K, N, w, out, os};
    pg_pool_run(q8_item, &g, SLICES(N), nth);
    return 0;
}

/* dequantize: rows n of [N, K] float32 */
typedef struct { const uint8_t *w; float *out; int K, N, q8; } deq_t;

static void deq_item(void *arg, int item) {
    const deq_t *j = (const deq_t *)arg;
    int nb = j->K / 32;
    const __m512i mask = _mm512_set1_epi32(15);
    int n0 = item * ROWS_PER_TASK;
    int n1 = n0 + ROWS_PER_TASK < j->N ? n0 + ROWS_PER_TASK : j->N;
    for (int n = n0; n < n1; n++) for (int b = 0; b < nb; b++) {
        float *o = j->out + (int64_t)n * j->K + b * 32;
        if (j->q8) {
            const uint8_t *blk = j->w + ((int64_t)n * nb + b) * 36;
            float d; memcpy(&d, blk, 4);
            __m512 dv = _mm512_set1_ps(d);
            _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(blk + 4)))), dv));
            _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(blk + 20)))), dv));
        } else {
            const uint8_t *blk = j->w + ((int64_t)n * nb + b) * 24;
            float d, m; memcpy(&d, blk, 4); memcpy(&m, blk + 4, 4);
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 8)));
            __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
            _mm512_storeu_ps(o, _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_and_si512(v, mask)), dv, mv));
            _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), dv, mv));
        }
    }
}

int pg_dequantize(const uint8_t *w, float *out, int K, int N, int q8, int nth) {
    if (K % 32) return -1;
    deq_t j = {w, out, K, N, q8};
    pg_pool_run(deq_item, &j, SLICES(N), nth);
    return 0;
}
#else
/* Built without AVX-512: the library holds the decode attention only. */
int pg_has_avx512(void) { return 0; }
int pg_q4_1_gemm(const float *x, int64_t xs, int M, int K, int N, const uint8_t *w,
                 float *out, int64_t os, int nth) {
    (void)x; (void)xs; (void)M; (void)K; (void)N; (void)w; (void)out; (void)os; (void)nth;
    return -2;
}
int pg_q8_0_gemm(const float *x, int64_t xs, int M, int K, int N, const uint8_t *w,
                 float *out, int64_t os, int nth) {
    (void)x; (void)xs; (void)M; (void)K; (void)N; (void)w; (void)out; (void)os; (void)nth;
    return -2;
}
int pg_dequantize(const uint8_t *w, float *out, int K, int N, int q8, int nth) {
    (void)w; (void)out; (void)K; (void)N; (void)q8; (void)nth;
    return -2;
}
#endif
