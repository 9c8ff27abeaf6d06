"""CPU kernels: matrix products against group-quantized weights (GGUF's Q4_1 and Q8_0).

Why: decoding at batch 1 streams every weight once per token, so its speed is the weight
bytes over the memory bandwidth. Q4_1 holds 32 weights in 24 bytes here (0.75 B/weight,
float32 holds 4), Q8_0 in 36 (1.125). On a model shipped as a GGUF in those formats (the
built-in SmolLM2 is), the float32 reference weights are these blocks dequantized, so the
blocks carry exactly the reference values: the products below equal the float32 ones up
to float32 summation order.

Layouts (one row per output feature, rows of `K // 32` blocks, K a multiple of 32):
  Q4_1  block = float32 d, float32 m, 16 bytes q: weight j of the block is
        d * q_j + m, q_j = low nibble of byte j (j < 16) / high nibble of byte j - 16
        (GGUF's order); a [N, K // 32 * 24] uint8 tensor.
  Q8_0  block = float32 d, 32 int8 q: weight j = d * q_j; a [N, K // 32 * 36] uint8 tensor.
(GGUF stores d and m as float16; float32 here costs 4 bytes per block and saves a
conversion per block in the inner loop.)

Contract: `q4_1_linear(x, packed, n)` / `q8_0_linear(x, packed, n)`: x [M, K] float32
(rows contiguous) -> [M, N] float32 = x @ dequantized(packed).T. `dequantize_q4_1` and
`dequantize_q8_0` return the float32 weight [N, K] (the prefill path: a long chunk
multiplies faster through torch's GEMM on a dequantized copy). `pack_q4_1` / `pack_q8_0`
(torch, no kernel) quantize a float32 weight the way llama.cpp does (Q4_1: min and
(max - min) / 15 per block; Q8_0: max |w| / 127; d and m rounded to float16 as GGUF stores
them) and return the packed tensor; on weights that are already such blocks dequantized
(a GGUF model's) this recovers the blocks exactly, which `load_model` verifies.

Threads: work (64-row slices of N) is spread over `torch.get_num_threads()` threads of a
pool the library keeps (started on first use). Between calls a pool thread spins for
about `SPIN_US` microseconds, then sleeps on a futex: a decode step makes ~150 calls a
few tens of microseconds apart, so a short spin keeps each wake-up off the critical path,
while a thread that is not needed soon gives its core back (on a loaded machine spinning
steals the slices the working threads need). No OpenMP: a second runtime beside torch's
would spin against it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

from prefixgate.worker.kernels import cbuild

log = logging.getLogger(__name__)

BLOCK = 32
Q4_1_BYTES = 24
Q8_0_BYTES = 36
# How long an idle pool thread spins before it sleeps. 200 us covers the gap between two
# kernel calls of a decode step (Python and torch work of a few to ~100 us); the gap
# between steps (sampling, scheduling, gRPC) is longer, and there the threads sleep.
SPIN_US = int(os.environ.get("PREFIXGATE_KERNEL_SPIN_US", "200"))

_SOURCE = r"""
#define _GNU_SOURCE
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#else
#define _mm_pause() ((void)0)
#endif
#include <math.h>
#include <linux/futex.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* ---- a small persistent thread pool ------------------------------------------------
   pool_run(fn, arg, nitems, nth) calls fn(arg, i) once for every item i < nitems, on the
   caller and up to nth - 1 pool threads. Items are claimed one at a time with a CAS on
   `claim` = (job generation << 32 | next item), and the caller waits for the number of
   *finished* items, never for a thread to show up: a pool thread that the OS has not
   scheduled (a loaded machine) simply takes no part, and the caller does its items. A
   late thread's CAS fails on the generation, so it never touches a finished job. */
typedef void (*item_fn)(void *arg, int item);
#define MAXT 64
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static int pool_started = 0;
static _Atomic unsigned pool_gen = 0;       /* futex word: bumped per job */
static _Atomic uint64_t pool_claim = 0;     /* gen << 32 | next item */
static _Atomic int pool_done = 0;
static _Atomic int pool_sleepers = 0;
static item_fn pool_fn; static void *pool_arg; static int pool_items;
static long spin_ns = 200000;

static inline long now_ns(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Claim and run items of job `gen` until none is left; returns items run. */
static int pool_work(unsigned gen) {
    int ran = 0;
    for (;;) {
        uint64_t c = atomic_load(&pool_claim);
        if ((unsigned)(c >> 32) != gen || (int)(uint32_t)c >= pool_items) return ran;
        if (!atomic_compare_exchange_weak(&pool_claim, &c, c + 1)) continue;
        pool_fn(pool_arg, (int)(uint32_t)c);
        atomic_fetch_add(&pool_done, 1);
        ran++;
    }
}

static void *pool_main(void *p) {
    (void)p;
    unsigned seen = atomic_load(&pool_gen);
    for (;;) {
        unsigned g;
        long t0 = 0; int i = 0;
        while ((g = atomic_load(&pool_gen)) == seen) {
            if (++i < 64) { _mm_pause(); continue; }
            i = 0;
            long t = now_ns();
            if (!t0) t0 = t;
            if (t - t0 < spin_ns) continue;
            atomic_fetch_add(&pool_sleepers, 1);
            if (atomic_load(&pool_gen) == seen)
                syscall(SYS_futex, &pool_gen, FUTEX_WAIT_PRIVATE, seen, 0, 0, 0);
            atomic_fetch_sub(&pool_sleepers, 1);
            t0 = 0;
        }
        seen = g;
        pool_work(g);
    }
    return 0;
}

static void pool_run(item_fn fn, void *arg, int nitems, int nth) {
    if (nitems <= 0) return;
    if (nth > MAXT) nth = MAXT;
    if (nth > nitems) nth = nitems;
    if (nth <= 1) { for (int i = 0; i < nitems; i++) fn(arg, i); return; }
    pthread_mutex_lock(&pool_lock);  /* one job at a time; threads started on demand */
    while (pool_started < nth - 1) {
        pthread_t th;
        if (pthread_create(&th, 0, pool_main, 0)) break;
        pthread_detach(th);
        pool_started++;
    }
    pool_fn = fn; pool_arg = arg; pool_items = nitems;
    atomic_store(&pool_done, 0);
    unsigned gen = atomic_load(&pool_gen) + 1;
    atomic_store(&pool_claim, (uint64_t)gen << 32);
    atomic_store(&pool_gen, gen);
    if (atomic_load(&pool_sleepers))
        syscall(SYS_futex, &pool_gen, FUTEX_WAKE_PRIVATE, nth - 1, 0, 0, 0);
    pool_work(gen);
    int i = 0;
    while (atomic_load(&pool_done) < nitems) {
        if (++i < 4096) _mm_pause(); else { sched_yield(); i = 0; }
    }
    pthread_mutex_unlock(&pool_lock);
}

void pg_set_spin_us(int us) { spin_ns = (long)us * 1000; }

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
    pool_run(q4_item, &g, SLICES(N), nth);
    return 0;
}

int pg_q8_0_gemm(const float *x, int64_t xs, int M, int K, int N, const uint8_t *w,
                 float *out, int64_t os, int nth) {
    if (K % 32) return -1;
    gemm_t g = {x, xs, M, K, N, w, out, os};
    pool_run(q8_item, &g, SLICES(N), nth);
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
    pool_run(deq_item, &j, SLICES(N), nth);
    return 0;
}
#else
int pg_has_avx512(void) { return 0; }
#endif
"""

_lib: ctypes.CDLL | None = None
_avx512 = False
_tried = False
_lock = threading.Lock()


def _build() -> ctypes.CDLL | None:
    from prefixgate.worker.kernels import cpu_decode, cpu_llama

    lib = cbuild.load("pg_cpu", _SOURCE + cpu_decode.SOURCE + cpu_llama.SOURCE)
    if lib is None:
        return None
    p, i64, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.pg_decode_attention.restype = i
    lib.pg_decode_attention.argtypes = [p, i64, i64, p, p, i64, i, p, i64, p, p, i, i, i, i,
                                        i, f, i]
    lib.pg_set_spin_us.argtypes = [i]
    lib.pg_set_spin_us(SPIN_US)
    if lib.pg_has_avx512():
        for name in ("pg_q4_1_gemm", "pg_q8_0_gemm"):
            fn = getattr(lib, name)
            fn.restype = i
            fn.argtypes = [p, i64, i, i, i, p, p, i64, i]
        lib.pg_dequantize.restype = i
        lib.pg_dequantize.argtypes = [p, p, i, i, i, i]
        lib.pg_decode_layers.restype = i
        lib.pg_decode_layers.argtypes = [i, p, p, i, i, i, i, i, i, f, p, p, p, p, p, i64, p,
                                         i64, p, i, f, p, i]
    return lib


def library() -> ctypes.CDLL | None:
    """The CPU kernel library (this module's kernels, the decode attention of
    cpu_decode.py, one thread pool), built on the first call; None without a compiler."""
    global _lib, _avx512, _tried
    with _lock:
        if not _tried:
            _tried = True
            _lib = _build()
            _avx512 = _lib is not None and bool(_lib.pg_has_avx512())
    return _lib


def available() -> bool:
    """Whether the quantized kernels run here: the library builds and the CPU has
    AVX-512 (without it the library holds only the decode attention)."""
    library()
    return _avx512


def _lib_or_raise() -> ctypes.CDLL:
    if not available():
        raise RuntimeError("the CPU quantized-weight kernels are unavailable: no C compiler "
                           "or no AVX-512 (see the log)")
    assert _lib is not None
    return _lib


def _gemm(fn_name: str, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    lib = _lib_or_raise()
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        x = x.float().contiguous()
    m, k = x.shape
    out = torch.empty((m, n), dtype=torch.float32)
    rc = getattr(lib, fn_name)(x.data_ptr(), x.stride(0), m, k, n, packed.data_ptr(),
                               out.data_ptr(), n, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"K={k} is not a multiple of {BLOCK}")
    return out


def q4_1_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return _gemm("pg_q4_1_gemm", x, packed, n)


def q8_0_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return _gemm("pg_q8_0_gemm", x, packed, n)


def _dequantize(packed: torch.Tensor, k: int, q8: bool, out: torch.Tensor | None
                ) -> torch.Tensor:
    lib = _lib_or_raise()
    n = packed.shape[0]
    if out is None:
        out = torch.empty((n, k), dtype=torch.float32)
    assert out.shape == (n, k) and out.dtype == torch.float32 and out.is_contiguous()
    lib.pg_dequantize(packed.data_ptr(), out.data_ptr(), k, n, int(q8), torch.get_num_threads())
    return out


def dequantize_q4_1(packed: torch.Tensor, k: int, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """The float32 weight [N, K], into `out` when given (a reused buffer)."""
    return _dequantize(packed, k, False, out)


def dequantize_q8_0(packed: torch.Tensor, k: int, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    return _dequantize(packed, k, True, out)


# --- packing (torch only) -------------------------------------------------------------

def _blocks(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"in_features {k} is not a multiple of {BLOCK}")
    return w.detach().float().reshape(n, k // BLOCK, BLOCK)


def _f16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).float()


def pack_q4_1(w: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] -> Q4_1 blocks [N, K // 32 * 24] uint8 (llama.cpp's quantizer)."""
    blocks = _blocks(w)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    m = _f16(lo)
    d = _f16((hi - m) / 15)
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round((blocks - m[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # byte j: weight j (low), j + 16 (high)
    head = torch.stack([d, m], -1).contiguous().view(torch.uint8)  # [N, nb, 8]
    return torch.cat([head, nibbles], -1).reshape(w.shape[0], -1).contiguous()


def pack_q8_0(w: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] -> Q8_0 blocks [N, K // 32 * 36] uint8 (llama.cpp's quantizer)."""
    blocks = _blocks(w)
    d = _f16(blocks.abs().amax(-1) / 127)
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(blocks / safe[..., None]).clamp(-127, 127).to(torch.int8)
    head = d[..., None].contiguous().view(torch.uint8)  # [N, nb, 4]
    return torch.cat([head, q.view(torch.uint8)], -1).reshape(w.shape[0], -1).contiguous()


def unpack_reference(packed: torch.Tensor, k: int, q8: bool) -> torch.Tensor:
    """The float32 weight the blocks stand for, in torch (the kernels' reference)."""
    n = packed.shape[0]
    size = Q8_0_BYTES if q8 else Q4_1_BYTES
    blocks = packed.reshape(n, k // BLOCK, size)
    if q8:
        d = blocks[..., :4].contiguous().view(torch.float32)
        q = blocks[..., 4:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, k)
    dm = blocks[..., :8].contiguous().view(torch.float32)
    nib = blocks[..., 8:]
    q = torch.cat([nib & 15, nib >> 4], -1).float()
    return (q * dm[..., :1] + dm[..., 1:]).reshape(n, k)
