/* Products against GGUF's Q4_1 and Q8_0 blocks, and their dequantization, on the vector
   path the build targets (pg_internal.h: PG_QUANT_PATH): AVX-512 (16 lanes, a block's
   16 possible weights picked by permutes) or AVX2 + FMA (8 lanes, codes converted and
   scaled by one multiply-add). The blocks are GGUF's own (float16 scales, read with
   F16C); the layouts are described in prefixgate/worker/kernels/cpu_quant.py. Both paths
   dequantize exactly (d * q + m with d, m float16 values and |q| < 256 is exact before
   the one rounding of the add) and multiply-add in float32: the products equal
   x @ dequantized.T up to summation order. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pg_internal.h"   /* the intrinsics (<immintrin.h>, or SIMDe's for AVX-512) */
#include "pg_kernels.h"

int pg_quant_built(void) { return PG_QUANT_PATH; }

int pg_quant_path(void) {
    /* The library is built for one path; a CPU without its instructions (a library
       carried to another host) gets none rather than an illegal instruction. */
#if PG_QUANT_PATH == 2 && !defined(PG_SIMDE_AVX512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c") ? 2 : 0;
#elif PG_QUANT_PATH  /* AVX2 + FMA, or the AVX-512 code on SIMDe built for x86-64-v3 */
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c") ? PG_QUANT_PATH : 0;
#else
    return 0;
#endif
}

#if PG_QUANT_PATH
#define ROWS_PER_TASK 64
#define Q4_1_BYTES 20   /* float16 d, float16 m, 16 bytes of 4-bit codes */
#define Q8_0_BYTES 34   /* float16 d, 32 int8 codes */

/* The float16 at p (a block's scale or minimum) as a float32: exact. */
static inline float f16_at(const uint8_t *p) {
    uint16_t h; memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

typedef struct {
    const float *x; int64_t xs; int M, K, N;
    const uint8_t *w; float *out; int64_t os;
    int rows;   /* weight rows per work item (item_rows) */
} gemm_t;

#if PG_QUANT_PATH == 2
/* ---- AVX-512 -------------------------------------------------------------------------- */
#define MB 8   /* activation rows per pass over a weight row (8 accumulators) */

static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

static inline __attribute__((always_inline))
void q4_rows(const gemm_t *g, int n, int m0, int mb) {
    int nb = g->K / 32;
    const uint8_t *row = g->w + (int64_t)n * nb * Q4_1_BYTES;
    __m512 acc[MB];
    for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_ps();
    /* The block's 16 possible weights d * q + m in one register; each code picks its
       weight with a permute (which reads only the low 4 bits of each index). */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * Q4_1_BYTES;
        float d = f16_at(blk), m = f16_at(blk + 2);
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 4)));
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
    const uint8_t *row = g->w + (int64_t)n * nb * Q8_0_BYTES;
    __m512 acc[MB];
    for (int r = 0; r < mb; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * Q8_0_BYTES;
        __m512 dv = _mm512_set1_ps(f16_at(blk));
        __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(blk + 2)))), dv);
        __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(blk + 18)))), dv);
        for (int r = 0; r < mb; r++) {
            const float *xr = g->x + (int64_t)(m0 + r) * g->xs + b * 32;
            acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r]);
            acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc[r]);
        }
    }
    for (int r = 0; r < mb; r++) g->out[(int64_t)(m0 + r) * g->os + n] = hsum(acc[r]);
}

static inline void deq_q4(const uint8_t *blk, float *o) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 4)));
    __m512 dv = _mm512_set1_ps(f16_at(blk)), mv = _mm512_set1_ps(f16_at(blk + 2));
    _mm512_storeu_ps(o, _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), dv, mv));
    _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), dv, mv));
}

static inline void deq_q8(const uint8_t *blk, float *o) {
    __m512 dv = _mm512_set1_ps(f16_at(blk));
    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)(blk + 2)))), dv));
    _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)(blk + 18)))), dv));
}

#else
/* ---- AVX2 + FMA ----------------------------------------------------------------------- */
#define MB 4   /* activation rows per pass: 16 ymm registers hold 4 rows' accumulators,
                  a block's 4 dequantized vectors and the constants */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* A block's 32 codes as 4 x 8 int32 lanes, weights 0-7, 8-15, 16-23, 24-31: byte j
   holds weight j in its low nibble and weight j + 16 in its high one. */
static inline void q4_codes(const uint8_t *nibbles, __m256i c[4]) {
    const __m256i mask = _mm256_set1_epi32(15);
    __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)nibbles));
    __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(nibbles + 8)));
    c[0] = _mm256_and_si256(b0, mask);
    c[1] = _mm256_and_si256(b1, mask);
    c[2] = _mm256_srli_epi32(b0, 4);
    c[3] = _mm256_srli_epi32(b1, 4);
}

static inline void q4_weights(const uint8_t *blk, __m256 w[4]) {
    __m256 dv = _mm256_set1_ps(f16_at(blk)), mv = _mm256_set1_ps(f16_at(blk + 2));
    __m256i c[4];
    q4_codes(blk + 4, c);
    for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c[i]), dv, mv);
}

static inline void q8_weights(const uint8_t *blk, __m256 w[4]) {
    __m256 dv = _mm256_set1_ps(f16_at(blk));
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * i)))), dv);
}

/* One weight row against mb activation rows. A multiply-add chain on one register is
   bound by the FMA's latency (4 cycles) rather than its throughput (2 a cycle): a block
   feeds its 4 products to 4 accumulators per row at 1-2 rows, 2 at 3-4 rows (more
   rows are independent chains already). */
#define AVX2_ROWS(NAME, BYTES, WEIGHTS)                                                  \
static inline __attribute__((always_inline))                                             \
void NAME(const gemm_t *g, int n, int m0, int mb) {                                      \
    int nb = g->K / 32;                                                                  \
    const uint8_t *row = g->w + (int64_t)n * nb * BYTES;                                 \
    const int na = mb <= 2 ? 4 : 2;                                                      \
    __m256 acc[MB][4];                                                                   \
    for (int r = 0; r < mb; r++) for (int a = 0; a < na; a++) acc[r][a] = _mm256_setzero_ps(); \
    for (int b = 0; b < nb; b++) {                                                       \
        __m256 w[4];                                                                     \
        WEIGHTS(row + b * BYTES, w);                                                     \
        for (int r = 0; r < mb; r++) {                                                   \
            const float *xr = g->x + (int64_t)(m0 + r) * g->xs + b * 32;                 \
            for (int i = 0; i < 4; i++)                                                  \
                acc[r][i % na] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i),      \
                                                 acc[r][i % na]);                        \
        }                                                                                \
    }                                                                                    \
    for (int r = 0; r < mb; r++) {                                                       \
        __m256 s = acc[r][0];                                                            \
        for (int a = 1; a < na; a++) s = _mm256_add_ps(s, acc[r][a]);                    \
        g->out[(int64_t)(m0 + r) * g->os + n] = hsum(s);                                 \
    }                                                                                    \
}
AVX2_ROWS(q4_rows, Q4_1_BYTES, q4_weights)
AVX2_ROWS(q8_rows, Q8_0_BYTES, q8_weights)

static inline void deq_q4(const uint8_t *blk, float *o) {
    __m256 w[4];
    q4_weights(blk, w);
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, w[i]);
}

static inline void deq_q8(const uint8_t *blk, float *o) {
    __m256 w[4];
    q8_weights(blk, w);
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, w[i]);
}
#endif

/* ---- both paths: work items of item_rows() weight rows ------------------------------- */
#if MB == 8
#define MORE_ROWS(ROWS)                                                                  \
    case 5: ROWS(g, n, m0, 5); break; case 6: ROWS(g, n, m0, 6); break;                 \
    case 7: ROWS(g, n, m0, 7); break; case 8: ROWS(g, n, m0, 8); break;
#else
#define MORE_ROWS(ROWS)
#endif

#define GEMM_ITEM(NAME, ROWS)                                                           \
static void NAME(void *arg, int item) {                                                \
    const gemm_t *g = (const gemm_t *)arg;                                              \
    int n0 = item * g->rows;                                                            \
    int n1 = n0 + g->rows < g->N ? n0 + g->rows : g->N;                                \
    for (int m0 = 0; m0 < g->M; m0 += MB) {                                             \
        int mb = g->M - m0 < MB ? g->M - m0 : MB;                                       \
        for (int n = n0; n < n1; n++) switch (mb) {                                     \
            case 1: ROWS(g, n, m0, 1); break; case 2: ROWS(g, n, m0, 2); break;         \
            case 3: ROWS(g, n, m0, 3); break; case 4: ROWS(g, n, m0, 4); break;         \
            MORE_ROWS(ROWS)                                                             \
            default: break;                                                             \
        }                                                                               \
    }                                                                                   \
}
GEMM_ITEM(q4_item, q4_rows)
GEMM_ITEM(q8_item, q8_rows)

#define SLICES(N) (((N) + ROWS_PER_TASK - 1) / ROWS_PER_TASK)

/* Weight rows per work item of a product: ROWS_PER_TASK, or fewer when that would leave
   fewer than 8 items per thread, so that threads finish together (a 576-row product
   is 9 items of 64: one thread of two would do 5, the other 4, and the caller waits on
   the fifth); at least 16 rows, a few microseconds of work against the pool's claim. */
static inline int item_rows(int N, int nth) {
    if (nth <= 1) return ROWS_PER_TASK;
    int rows = N / (8 * nth);
    rows = rows < 16 ? 16 : rows > ROWS_PER_TASK ? ROWS_PER_TASK : rows;
    return rows;
}

int pg_q4_1_gemm(const float *x, int64_t xs, int M, int K, int N, const uint8_t *w,
                 float *out, int64_t os, int nth) {
    if (!pg_quant_path()) return -2;
    if (K % 32) return -1;
    gemm_t g = {x, xs, M, K, N, w, out, os, item_rows(N, nth)};
    pg_pool_run(q4_item, &g, (N + g.rows - 1) / g.rows, nth);
    return 0;
}

int pg_q8_0_gemm(const float *x, int64_t xs, int M, int K, int N, const uint8_t *w,
                 float *out, int64_t os, int nth) {
    if (!pg_quant_path()) return -2;
    if (K % 32) return -1;
    gemm_t g = {x, xs, M, K, N, w, out, os, item_rows(N, nth)};
    pg_pool_run(q8_item, &g, (N + g.rows - 1) / g.rows, nth);
    return 0;
}

/* ---- 8-bit activations (the q4_1-a8 format), on both paths ----------------------------
   llama.cpp's scheme: each activation row is quantized per block of 32 to int8 codes p
   with one float scale d_x = max |x| / 127 (p = round(x / d_x), ties to even) and the
   block's s_x = d_x * sum(p) (ggml's block_q8_1, with float32 d and s). Then per block
   Q4_1 . Q8: (d_w q + m_w) . (d_x p) = d_w d_x (q . p) + m_w s_x, and
   Q8_0 . Q8: d_w d_x (q . p), the integer dot products by maddubs (unsigned x signed
   bytes into 16-bit pairs, no saturation here: 15 * 127 * 2 and 127 * 127 * 2 < 2^15)
   and madd into 8 int32 lanes. Half the instructions of the float path per block, and
   no float activation loads. 256-bit AVX2 on both paths (an AVX-512 CPU has AVX2). */
typedef struct { float d, s; int8_t q[32]; } act_q8;   /* 40 bytes */

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Row m's K floats -> K / 32 act_q8 blocks. */
static void quantize_row_q8(const float *x, act_q8 *o, int K) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int b = 0; b < K / 32; b++) {
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + 32 * b + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float d = _mm_cvtss_f32(m4) / 127.f;
        float id = d != 0.f ? 1.f / d : 0.f;
        __m256i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        int32_t sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                                _mm256_add_epi32(q[2], q[3])));
        /* int32 -> int8 packs interleave the 128-bit lanes; a permute restores order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                       _mm256_packs_epi32(q[2], q[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        o[b].d = d;
        o[b].s = d * (float)sum;
        _mm256_storeu_si256((__m256i *)o[b].q, p);
    }
}

typedef struct {
    const act_q8 *xq; int M, K, N;   /* xq: M rows of K / 32 blocks */
    const uint8_t *w; float *out; int64_t os;
    int rows;   /* weight rows per work item (item_rows) */
} gemm_a8_t;

#define MB8 4   /* activation rows per pass over a weight row */

/* One weight block's products with mb activation rows' blocks (a: row 0's, then every
   `stride` blocks), into acc[r] (and, for Q4_1, the minimum's term into summ[r]). */
static inline __attribute__((always_inline))
void q4a8_block(const uint8_t *blk, const act_q8 *a, int64_t stride, int mb, __m256 *acc,
                float *summ) {
    const __m256i ones = _mm256_set1_epi16(1);
    float dw = f16_at(blk), mw = f16_at(blk + 2);
    /* the 16 code bytes as 32 unsigned bytes in weight order (byte j: weight j low,
       weight j + 16 high nibble) */
    __m128i raw = _mm_loadu_si128((const __m128i *)(blk + 4));
    __m256i wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                                  _mm256_set1_epi8(15));
    for (int r = 0; r < mb; r++) {
        const act_q8 *ar = a + r * stride;
        __m256i p = _mm256_loadu_si256((const __m256i *)ar->q);
        __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, p), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ar->d), _mm256_cvtepi32_ps(dot), acc[r]);
        summ[r] += mw * ar->s;
    }
}

/* Q8_0: signed x signed as |w| x (p with w's sign), maddubs' unsigned x signed form. */
static inline __attribute__((always_inline))
void q8a8_block(const uint8_t *blk, const act_q8 *a, int64_t stride, int mb, __m256 *acc,
                float *summ) {
    (void)summ;
    const __m256i ones = _mm256_set1_epi16(1);
    float dw = f16_at(blk);
    __m256i wq = _mm256_loadu_si256((const __m256i *)(blk + 2));
    __m256i wabs = _mm256_sign_epi8(wq, wq);
    for (int r = 0; r < mb; r++) {
        const act_q8 *ar = a + r * stride;
        __m256i p = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)ar->q), wq);
        __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, p), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ar->d), _mm256_cvtepi32_ps(dot), acc[r]);
    }
}

/* One weight row against mb quantized activation rows; per row two accumulators, even
   and odd blocks, so that a multiply-add does not wait on the previous block's. */
#define A8_ROWS(NAME, BYTES, BLOCK)                                                      \
static inline __attribute__((always_inline))                                             \
void NAME(const gemm_a8_t *g, int n, int m0, int mb) {                                   \
    int nb = g->K / 32;                                                                  \
    const uint8_t *row = g->w + (int64_t)n * nb * BYTES;                                 \
    const act_q8 *a = g->xq + (int64_t)m0 * nb;                                          \
    __m256 acc0[MB8], acc1[MB8];                                                         \
    float summ[MB8];                                                                     \
    for (int r = 0; r < mb; r++) {                                                       \
        acc0[r] = acc1[r] = _mm256_setzero_ps(); summ[r] = 0.f;                          \
    }                                                                                    \
    int b = 0;                                                                           \
    for (; b + 1 < nb; b += 2) {                                                         \
        BLOCK(row + b * BYTES, a + b, nb, mb, acc0, summ);                               \
        BLOCK(row + (b + 1) * BYTES, a + b + 1, nb, mb, acc1, summ);                     \
    }                                                                                    \
    if (b < nb) BLOCK(row + b * BYTES, a + b, nb, mb, acc0, summ);                       \
    for (int r = 0; r < mb; r++)                                                         \
        g->out[(int64_t)(m0 + r) * g->os + n] =                                          \
            hsum8(_mm256_add_ps(acc0[r], acc1[r])) + summ[r];                           \
}
A8_ROWS(q4a8_rows, Q4_1_BYTES, q4a8_block)
A8_ROWS(q8a8_rows, Q8_0_BYTES, q8a8_block)

#define GEMM_A8_ITEM(NAME, ROWS)                                                        \
static void NAME(void *arg, int item) {                                                \
    const gemm_a8_t *g = (const gemm_a8_t *)arg;                                        \
    int n0 = item * g->rows;                                                            \
    int n1 = n0 + g->rows < g->N ? n0 + g->rows : g->N;                                \
    for (int m0 = 0; m0 < g->M; m0 += MB8) {                                            \
        int mb = g->M - m0 < MB8 ? g->M - m0 : MB8;                                     \
        for (int n = n0; n < n1; n++) switch (mb) {                                     \
            case 1: ROWS(g, n, m0, 1); break; case 2: ROWS(g, n, m0, 2); break;         \
            case 3: ROWS(g, n, m0, 3); break; default: ROWS(g, n, m0, 4); break;        \
        }                                                                               \
    }                                                                                   \
}
GEMM_A8_ITEM(q4a8_item, q4a8_rows)
GEMM_A8_ITEM(q8a8_item, q8a8_rows)

/* The calling thread's buffer for quantized activations (grown, never shrunk). */
static __thread act_q8 *a8_buf;
static __thread int64_t a8_cap;

static int gemm_a8(const float *x, int64_t xs, int M, int K, int N, const uint8_t *w,
                   float *out, int64_t os, int nth, pg_item_fn item) {
    if (!pg_quant_path()) return -2;
    if (K % 32) return -1;
    int64_t need = (int64_t)M * (K / 32);
    if (need > a8_cap) {
        act_q8 *buf = realloc(a8_buf, need * sizeof(act_q8));
        if (!buf) return -3;
        a8_buf = buf; a8_cap = need;
    }
    for (int m = 0; m < M; m++) quantize_row_q8(x + (int64_t)m * xs, a8_buf + (int64_t)m * (K / 32), K);
    gemm_a8_t g = {a8_buf, M, K, N, w, out, os, item_rows(N, nth)};
    pg_pool_run(item, &g, (N + g.rows - 1) / g.rows, nth);
    return 0;
}

int pg_q4_1_a8_gemm(const float *x, int64_t xs, int M, int K, int N, const uint8_t *w,
                    float *out, int64_t os, int nth) {
    return gemm_a8(x, xs, M, K, N, w, out, os, nth, q4a8_item);
}

int pg_q8_0_a8_gemm(const float *x, int64_t xs, int M, int K, int N, const uint8_t *w,
                    float *out, int64_t os, int nth) {
    return gemm_a8(x, xs, M, K, N, w, out, os, nth, q8a8_item);
}

/* dequantize: rows n of [N, K] float32 */
typedef struct { const uint8_t *w; float *out; int K, N, q8; } deq_t;

static void deq_item(void *arg, int item) {
    const deq_t *j = (const deq_t *)arg;
    int nb = j->K / 32;
    int n0 = item * ROWS_PER_TASK;
    int n1 = n0 + ROWS_PER_TASK < j->N ? n0 + ROWS_PER_TASK : j->N;
    for (int n = n0; n < n1; n++) for (int b = 0; b < nb; b++) {
        float *o = j->out + (int64_t)n * j->K + b * 32;
        if (j->q8) deq_q8(j->w + ((int64_t)n * nb + b) * Q8_0_BYTES, o);
        else deq_q4(j->w + ((int64_t)n * nb + b) * Q4_1_BYTES, o);
    }
}

int pg_dequantize(const uint8_t *w, float *out, int K, int N, int q8, int nth) {
    if (!pg_quant_path()) return -2;
    if (K % 32) return -1;
    deq_t j = {w, out, K, N, q8};
    pg_pool_run(deq_item, &j, SLICES(N), nth);
    return 0;
}
#else
/* Built for neither path: the library holds the decode attention only. */
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
int pg_q4_1_a8_gemm(const float *x, int64_t xs, int M, int K, int N, const uint8_t *w,
                    float *out, int64_t os, int nth) {
    return pg_q4_1_gemm(x, xs, M, K, N, w, out, os, nth);
}
int pg_q8_0_a8_gemm(const float *x, int64_t xs, int M, int K, int N, const uint8_t *w,
                    float *out, int64_t os, int nth) {
    return pg_q8_0_gemm(x, xs, M, K, N, w, out, os, nth);
}
int pg_dequantize(const uint8_t *w, float *out, int K, int N, int q8, int nth) {
    (void)w; (void)out; (void)K; (void)N; (void)q8; (void)nth;
    return -2;
}
#endif
