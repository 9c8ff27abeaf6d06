/* What the kernel library's translation units share with each other; not part of its
   ABI (pg_kernels.h). Built with -fvisibility=hidden: none of this is exported. */
#ifndef PG_INTERNAL_H
#define PG_INTERNAL_H

#include <stdint.h>

/* The vector path the quantized kernels (quant.c) and the decode layers (decode_layers.c)
   are compiled for, from the build's target flags: 2 AVX-512 (-march=x86-64-v4 or a
   native build on such a CPU), 1 AVX2 + FMA (x86-64-v3), both reading float16 scales
   with F16C; 0 none (those kernels return -2). pg_quant_path() reports it at run time,
   0 when the CPU lacks its instructions (cpuid).

   PG_SIMDE_AVX512 (cbuild.EMULATED_AVX512, a test build for x86-64-v3): the AVX-512
   path's code with SIMDe's portable implementations (simde/x86/avx512.h) standing in
   for the AVX-512 intrinsics, everything else native, so a CPU without AVX-512 runs and
   checks that code. It reports path 2 and needs only x86-64-v3's instructions. */
#if defined(PG_SIMDE_AVX512)
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__) || defined(__AVX512F__)
#error "PG_SIMDE_AVX512 is built for x86-64-v3 (AVX2, FMA, F16C; no AVX-512)"
#endif
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#define PG_QUANT_PATH 2
#elif defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(PG_SIMDE_AVX512)
/* AVX-512 intrinsics older SIMDe releases (Debian 12's 0.7.4) lack, written from Intel's
   definitions on SIMDe's types; a SIMDe that has one (its alias is a macro) keeps its own. */
#ifndef _mm512_cvtepi8_epi32
static inline simde__m512i pg_mm512_cvtepi8_epi32(simde__m128i a) {
    simde__m128i_private a_ = simde__m128i_to_private(a);
    simde__m512i_private r_;
    for (int i = 0; i < 16; i++) r_.i32[i] = a_.i8[i];
    return simde__m512i_from_private(r_);
}
#define _mm512_cvtepi8_epi32(a) pg_mm512_cvtepi8_epi32(a)
#endif
#ifndef _mm512_cvtepu8_epi32
static inline simde__m512i pg_mm512_cvtepu8_epi32(simde__m128i a) {
    simde__m128i_private a_ = simde__m128i_to_private(a);
    simde__m512i_private r_;
    for (int i = 0; i < 16; i++) r_.i32[i] = a_.u8[i];
    return simde__m512i_from_private(r_);
}
#define _mm512_cvtepu8_epi32(a) pg_mm512_cvtepu8_epi32(a)
#endif
#ifndef _mm512_cvtepi32_ps
static inline simde__m512 pg_mm512_cvtepi32_ps(simde__m512i a) {
    simde__m512i_private a_ = simde__m512i_to_private(a);
    simde__m512_private r_;
    for (int i = 0; i < 16; i++) r_.f32[i] = (float)a_.i32[i];
    return simde__m512_from_private(r_);
}
#define _mm512_cvtepi32_ps(a) pg_mm512_cvtepi32_ps(a)
#endif
#ifndef _mm512_reduce_add_ps
/* Halves added pairwise (16 -> 8 -> 4 -> 2 -> 1 lanes), as GCC's and Clang's do. */
static inline float pg_mm512_reduce_add_ps(simde__m512 a) {
    simde__m512_private a_ = simde__m512_to_private(a);
    for (int w = 8; w > 0; w /= 2)
        for (int i = 0; i < w; i++) a_.f32[i] += a_.f32[i + w];
    return a_.f32[0];
}
#define _mm512_reduce_add_ps(a) pg_mm512_reduce_add_ps(a)
#endif
#elif defined(__AVX512F__) && defined(__F16C__)
#define PG_QUANT_PATH 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PG_QUANT_PATH 1
#else
#define PG_QUANT_PATH 0
#endif

/* pool.c: calls fn(arg, i) once for every item i < nitems, on the caller and up to
   nth - 1 pool threads; returns when all are done. One job at a time. */
typedef void (*pg_item_fn)(void *arg, int item);
void pg_pool_run(pg_item_fn fn, void *arg, int nitems, int nth);

/* decode_attention.c: one decode-attention job (pg_decode_attention's arguments); its
   items are (sequence, KV head) pairs, nd * KVH of them. decode_layers.c runs it too. */
typedef struct {
    const float *q; int64_t q_sb, q_sh;
    const void *k, *v; int64_t slot_stride; int bf16;
    const int32_t *bt; int64_t bt_stride; const int32_t *ctx;
    float *out; int nd, H, KVH, D, bs; float scale;
} pg_attention_job;
void pg_decode_item(void *arg, int item);

#endif
