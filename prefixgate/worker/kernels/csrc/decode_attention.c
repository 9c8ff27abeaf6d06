/* Decode attention that reads K/V blocks in place, through block tables, with an online
   softmax (prefixgate/worker/kernels/cpu_decode.py says why). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pg_internal.h"
#include "pg_kernels.h"

#define MAXG 16
#define MAXD 256
#define TILE 16


static inline void load_row(const void *base, int bf16, int64_t off, int D, float *dst) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int d = 0; d < D; d++) { uint32_t u = (uint32_t)p[d] << 16; memcpy(dst + d, &u, 4); }
    } else {
        memcpy(dst, (const float *)base + off, (size_t)D * 4);
    }
}

static void one(pg_attention_job *j, int b, int kh) {
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

void pg_decode_item(void *arg, int i) {
    pg_attention_job *j = (pg_attention_job *)arg;
    one(j, i / j->KVH, i % j->KVH);
}

int pg_decode_attention(const float *q, int64_t q_sb, int64_t q_sh, const void *k,
                        const void *v, int64_t slot_stride, int bf16, const int32_t *bt,
                        int64_t bt_stride, const int32_t *ctx, float *out, int nd, int H,
                        int KVH, int D, int bs, float scale, int nthreads) {
    if (H % KVH || H / KVH > MAXG || D > MAXD) return -1;
    pg_attention_job j = {q, q_sb, q_sh, k, v, slot_stride, bf16, bt, bt_stride, ctx, out, nd, H, KVH,
               D, bs, scale};
    pg_pool_run(pg_decode_item, &j, nd * KVH, nthreads);
    return 0;
}
