/* The ABI of prefixgate's CPU kernel library (libpg_cpu): every function Python calls.

   This header is the one source of truth for the signatures: the ctypes argtypes and
   restypes are read from the declarations below (prefixgate/worker/kernels/cbuild.py),
   so a signature is written once. Keep each declaration of the form
   `PG_API <type> pg_<name>(<type> <name>, ...);` with types from: void, int, float,
   int64_t and pointers (any pointer travels as a void pointer).

   Conventions: matrices are row-major float32 with an explicit row stride in elements;
   `nth` / `nthreads` is how many threads may work (the caller's and the library's pool:
   pool.c); functions returning int return 0 on success, -1 for a geometry outside their
   limits, -2 when the library has no quantized path for this CPU (pg_quant_path() == 0). */
#ifndef PG_KERNELS_H
#define PG_KERNELS_H

#include <stdint.h>

#define PG_API __attribute__((visibility("default")))

/* pool.c: how long an idle pool thread spins (microseconds) before it sleeps. */
PG_API void pg_set_spin_us(int us);

/* quant.c: the vector path the quantized kernels below run on this CPU: 2 AVX-512,
   1 AVX2 + FMA, 0 none (they return -2): the path the library was compiled for, 0 when
   the CPU lacks its instructions (cpuid). */
PG_API int pg_quant_path(void);
/* quant.c: the path the library was compiled for (2, 1 or 0 as above), whatever this CPU
   runs; safe to call on any x86-64 CPU. */
PG_API int pg_quant_built(void);

/* quant.c: out[m, n] = sum_k x[m, k] * W[n, k] for m < M, n < N; W given as GGUF blocks
   of 32 weights as GGUF stores them (Q4_1: 20 bytes, Q8_0: 34 bytes per block, float16
   scales; rows of K / 32 blocks);
   xs and os: row strides of x and out; K a multiple of 32. */
PG_API int pg_q4_1_gemm(const float *x, int64_t xs, int M, int K, int N, const uint8_t *w,
                        float *out, int64_t os, int nth);
PG_API int pg_q8_0_gemm(const float *x, int64_t xs, int M, int K, int N, const uint8_t *w,
                        float *out, int64_t os, int nth);

/* quant.c: the same products with the activations quantized to 8 bits first (the
   q4_1-a8 format; llama.cpp's Q8_1 scheme): each row of x, per block of 32, to int8
   codes p = round(x / d) with d = max |x| / 127, then integer dot products against the
   weight codes. out = xq @ dequantized(W).T where xq is x so quantized, up to float32
   summation order; lossy against x @ dequantized(W).T (|x - xq| <= d / 2 per element).
   -3: out of memory for the quantized rows. */
PG_API int pg_q4_1_a8_gemm(const float *x, int64_t xs, int M, int K, int N,
                           const uint8_t *w, float *out, int64_t os, int nth);
PG_API int pg_q8_0_a8_gemm(const float *x, int64_t xs, int M, int K, int N,
                           const uint8_t *w, float *out, int64_t os, int nth);

/* quant.c: the float32 weight [N, K] of Q4_1 (q8 = 0) or Q8_0 (q8 = 1) blocks. */
PG_API int pg_dequantize(const uint8_t *w, float *out, int K, int N, int q8, int nth);

/* decode_attention.c: one query row per head for each of `nd` sequences against its
   whole context, read in place through block tables. q [nd, H, D] (strides q_sb, q_sh);
   k, v one pool layer [slots, KVH, D] (float32, or bfloat16 when bf16 = 1; slot_stride
   elements per slot); bt [nd, bt_stride] int32 block tables; ctx [nd] int32 context
   lengths; bs tokens per block; out [nd, H, D]. Limits: H / KVH <= 16, D <= 256. */
PG_API int pg_decode_attention(const float *q, int64_t q_sb, int64_t q_sh, const void *k,
                               const void *v, int64_t slot_stride, int bf16,
                               const int32_t *bt, int64_t bt_stride, const int32_t *ctx,
                               float *out, int nd, int H, int KVH, int D, int bs,
                               float scale, int nthreads);

/* decode_layers.c: all L decoder layers of a Llama decode step over B rows x [B, hidden]
   (updated in place), Q4_1 projections (a8 = 1: with 8-bit activations, pg_q4_1_a8_gemm's
   products; 0: float32 activations). ptrs: 6 per layer (ln1, qkv, o, ln2, gate_up,
   down); cos, sin [B, hd]; slots [B] where each row's K/V is written; kpool, vpool
   float32 [L, slots, nkv, hd] (layer_stride elements per layer); bt, ctx, bs as above;
   scratch: B x (2 hidden + (nh + 2 nkv) hd + nh hd + 3 inter) floats. Limits: hd <= 256,
   hidden, inter and nh x hd multiples of 32. */
PG_API int pg_decode_layers(int L, const int64_t *ptrs, float *x, int B, int hidden, int nh,
                            int nkv, int hd, int inter, float eps, const float *cos,
                            const float *sin, const int64_t *slots, float *kpool,
                            float *vpool, int64_t layer_stride, const int32_t *bt,
                            int64_t bt_stride, const int32_t *ctx, int bs, float scale,
                            float *scratch, int a8, int nth);

#endif
