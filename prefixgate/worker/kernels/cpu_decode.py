"""CPU kernel: decode attention that reads K/V blocks in place, through block tables.

Why: the torch path gathers every decoding sequence's whole context out of the pool into a
fresh tensor in every layer, so a step reads its K/V three times (gather read, gather
write, attention read). Decode attention is memory-bound, so that is most of its cost at
long contexts. This kernel walks each sequence's block table and reads each key and value
once, with an online softmax (per 16 tokens: scores, running max, rescale, accumulate).

Contract: `decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)`
with query [B, H, D] (float32, last dim contiguous), k_cache/v_cache one layer of the pool
[num_slots, KVH, D] contiguous (float32 or bfloat16), block_tables [B, max_blocks] int32
and context_lens [B] int32 as in `StepMetadata` (paged_attention.py), returns [B, H, D]
float32: each sequence's one query row per head against keys 0..context_lens[b]-1 (all of
its context, the new token's own K/V included). Query head h reads KV head h // (H // KVH).
Work items (sequence, KV head) are spread over `torch.get_num_threads()` threads of the
CPU kernel library's pool (cpu_quant.py: the C source below is built into that library,
on first use; no compiler, or a failed build, leaves `available()` False and the torch
path in use).
"""

from __future__ import annotations

import torch

from prefixgate.worker.kernels import cpu_quant

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAXG 16
#define MAXD 256
#define TILE 16

typedef struct {
    const float *q; int64_t q_sb, q_sh;
    const void *k, *v; int64_t slot_stride; int bf16;
    const int32_t *bt; int64_t bt_stride; const int32_t *ctx;
    float *out; int nd, H, KVH, D, bs; float scale;
} job_t;

static inline void load_row(const void *base, int bf16, int64_t off, int D, float *dst) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int d = 0; d < D; d++) { uint32_t u = (uint32_t)p[d] << 16; memcpy(dst + d, &u, 4); }
    } else {
        memcpy(dst, (const float *)base + off, (size_t)D * 4);
    }
}

static void one(job_t *j, int b, int kh) {
    int G = j->H / j->KVH, D = j->D, bs = j->bs;
    float qv[MAXG][MAXD], acc[MAXG][MAXD], m[MAXG], l[MAXG], s[MAXG][TILE], row[MAXD];
    for (int g = 0; g < G; g++) {
        const float *qp = j->q + b * j->q_sb + (kh * G + g) * j->q_sh;
        for (int d = 0; d < D; d++) { qv[g][d] = qp[d] * j->scale; acc[g][d] = 0.f; }
        m[g] = -INFINITY; l[g] = 0.f;
    }
    int c = j->ctx[b];
    const int32_t *table = j->bt + b * j->bt_stride;
    for (int p0 = 0; p0 < c; p0 += TILE) {
        int nt = c - p0 < TILE ? c - p0 : TILE;
        for (int t = 0; t < nt; t++) {
            int p = p0 + t;
            int64_t off = ((int64_t)table[p / bs] * bs + p % bs) * j->slot_stride + kh * D;
            const float *kp = row;
            if (j->bf16) load_row(j->k, 1, off, D, row); else kp = (const float *)j->k + off;
            for (int g = 0; g < G; g++) {
                float dot = 0.f;
                for (int d = 0; d < D; d++) dot += qv[g][d] * kp[d];
                s[g][t] = dot;
            }
        }
        for (int g = 0; g < G; g++) {
            float mx = m[g];
            for (int t = 0; t < nt; t++) mx = s[g][t] > mx ? s[g][t] : mx;
            float corr = expf(m[g] - mx);
            m[g] = mx; l[g] *= corr;
            for (int d = 0; d < D; d++) acc[g][d] *= corr;
            for (int t = 0; t < nt; t++) { s[g][t] = expf(s[g][t] - mx); l[g] += s[g][t]; }
        }
        for (int t = 0; t < nt; t++) {
            int p = p0 + t;
            int64_t off = ((int64_t)table[p / bs] * bs + p % bs) * j->slot_stride + kh * D;
            const float *vp = row;
            if (j->bf16) load_row(j->v, 1, off, D, row); else vp = (const float *)j->v + off;
            for (int g = 0; g < G; g++) {
                float w = s[g][t];
                for (int d = 0; d < D; d++) acc[g][d] += w * vp[d];
            }
        }
    }
    for (int g = 0; g < G; g++) {
        float *op = j->out + ((int64_t)b * j->H + kh * G + g) * D;
        float inv = 1.f / l[g];
        for (int d = 0; d < D; d++) op[d] = acc[g][d] * inv;
    }
}

static void decode_item(void *arg, int i) {
    job_t *j = (job_t *)arg;
    one(j, i / j->KVH, i % j->KVH);
}

int pg_decode_attention(const float *q, int64_t q_sb, int64_t q_sh, const void *k,
                        const void *v, int64_t slot_stride, int bf16, const int32_t *bt,
                        int64_t bt_stride, const int32_t *ctx, float *out, int nd, int H,
                        int KVH, int D, int bs, float scale, int nthreads) {
    if (H % KVH || H / KVH > MAXG || D > MAXD) return -1;
    job_t j = {q, q_sb, q_sh, k, v, slot_stride, bf16, bt, bt_stride, ctx, out, nd, H, KVH,
               D, bs, scale};
    pool_run(decode_item, &j, nd * KVH, nthreads);
    return 0;
}
"""

def available() -> bool:
    """Whether the kernel is built (building the CPU kernel library on the first call)."""
    return cpu_quant.library() is not None


def supports(k_cache: torch.Tensor, num_heads: int) -> bool:
    """Whether this pool layer and geometry fit the kernel's limits."""
    kvh, d = k_cache.shape[1], k_cache.shape[2]
    return (k_cache.device.type == "cpu" and k_cache.is_contiguous()
            and k_cache.dtype in (torch.float32, torch.bfloat16) and num_heads % kvh == 0
            and num_heads // kvh <= 16 and d <= 256)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                     scale: float) -> torch.Tensor:
    lib = cpu_quant.library()
    if lib is None:
        raise RuntimeError("the CPU decode kernel could not be built (see the log)")
    q = query.float()
    if q.stride(-1) != 1:
        q = q.contiguous()
    nd, num_heads, head_dim = q.shape
    out = torch.empty((nd, num_heads, head_dim), dtype=torch.float32)
    rc = lib.pg_decode_attention(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), int(k_cache.dtype == torch.bfloat16), block_tables.data_ptr(),
        block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(), nd, num_heads,
        k_cache.shape[1], head_dim, block_size, scale, torch.get_num_threads())
    if rc != 0:
        raise ValueError("geometry outside the CPU decode kernel's limits")
    return out
