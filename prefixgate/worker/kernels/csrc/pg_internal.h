/* What the kernel library's translation units share with each other; not part of its
   ABI (pg_kernels.h). Built with -fvisibility=hidden: none of this is exported. */
#ifndef PG_INTERNAL_H
#define PG_INTERNAL_H

#include <stdint.h>

/* The vector path the quantized kernels (quant.c) and the decode layers (decode_layers.c)
   are compiled for, from the build's target flags: 2 AVX-512 (-march=x86-64-v4 or a
   native build on such a CPU), 1 AVX2 + FMA (x86-64-v3), both reading float16 scales
   with F16C; 0 none (those kernels return -2). pg_quant_path() reports it at run time,
   0 when the CPU lacks its instructions (cpuid). */
#if defined(__AVX512F__) && defined(__F16C__)
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
