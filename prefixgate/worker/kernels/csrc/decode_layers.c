/* All decoder layers of a Llama decode step in one call, Q4_1 weights (the products on
   quant.c's path, AVX-512 or AVX2 + FMA, with float32 or 8-bit activations;
   prefixgate/worker/kernels/cpu_llama.py says why). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pg_internal.h"
#include "pg_kernels.h"

static void rmsnorm(const float *x, const float *w, float *out, int B, int n, float eps) {
    for (int b = 0; b < B; b++) {
        const float *xr = x + (int64_t)b * n; float *o = out + (int64_t)b * n;
        float ss = 0.f;
        for (int i = 0; i < n; i++) ss += xr[i] * xr[i];
        float r = 1.f / sqrtf(ss / n + eps);
        for (int i = 0; i < n; i++) o[i] = w[i] * (xr[i] * r);
    }
}

/* layer pointers, per layer: ln1, qkv, o, ln2, gate_up, down */
int pg_decode_layers(int L, const int64_t *ptrs, float *x, int B, int hidden, int nh,
                     int nkv, int hd, int inter, float eps, const float *cos,
                     const float *sin, const int64_t *slots, float *kpool, float *vpool,
                     int64_t layer_stride, const int32_t *bt, int64_t bt_stride,
                     const int32_t *ctx, int bs, float scale, float *scratch, int a8, int nth) {
    if (!pg_quant_path()) return -2;
    if (hd > 256 || hidden % 32 || inter % 32 || (nh * hd) % 32) return -1;
    int qkvw = (nh + 2 * nkv) * hd;
    float *h = scratch;                          /* [B, hidden] */
    float *qkv = h + (int64_t)B * hidden;        /* [B, qkvw] */
    float *att = qkv + (int64_t)B * qkvw;        /* [B, nh * hd] */
    float *gu = att + (int64_t)B * nh * hd;      /* [B, 2 * inter] */
    float *act = gu + (int64_t)B * 2 * inter;    /* [B, inter] */
    float *tmp = act + (int64_t)B * inter;       /* [B, hidden] */
    int64_t slot_stride = (int64_t)nkv * hd;
    int (*gemm)(const float *, int64_t, int, int, int, const uint8_t *, float *, int64_t,
                int) = a8 ? pg_q4_1_a8_gemm : pg_q4_1_gemm;
    for (int l = 0; l < L; l++) {
        const int64_t *p = ptrs + 6 * l;
        float *kl = kpool + l * layer_stride, *vl = vpool + l * layer_stride;
        rmsnorm(x, (const float *)p[0], h, B, hidden, eps);
        gemm(h, hidden, B, hidden, qkvw, (const uint8_t *)p[1], qkv, qkvw, nth);
        for (int b = 0; b < B; b++) {
            const float *c = cos + (int64_t)b * hd, *s = sin + (int64_t)b * hd;
            float *row = qkv + (int64_t)b * qkvw, t[256];
            for (int head = 0; head < nh + nkv; head++) {
                float *v = row + head * hd;
                memcpy(t, v, hd * 4);
                for (int i = 0; i < hd; i++) v[i] = t[i] * c[i] + t[(i + hd / 2) % hd] * s[i];
            }
            memcpy(kl + slots[b] * slot_stride, row + nh * hd, slot_stride * 4);
            memcpy(vl + slots[b] * slot_stride, row + (nh + nkv) * hd, slot_stride * 4);
        }
        pg_attention_job j = {qkv, qkvw, hd, kl, vl, slot_stride, 0, bt, bt_stride, ctx, att, B, nh,
                   nkv, hd, bs, scale};
        pg_pool_run(pg_decode_item, &j, B * nkv, nth);
        gemm(att, nh * hd, B, nh * hd, hidden, (const uint8_t *)p[2], tmp, hidden, nth);
        for (int64_t i = 0; i < (int64_t)B * hidden; i++) x[i] += tmp[i];
        rmsnorm(x, (const float *)p[3], h, B, hidden, eps);
        gemm(h, hidden, B, hidden, 2 * inter, (const uint8_t *)p[4], gu, 2 * inter, nth);
        for (int b = 0; b < B; b++) {
            const float *g = gu + (int64_t)b * 2 * inter, *u = g + inter;
            float *a = act + (int64_t)b * inter;
            for (int i = 0; i < inter; i++) a[i] = g[i] / (1.f + expf(-g[i])) * u[i];
        }
        gemm(act, inter, B, inter, hidden, (const uint8_t *)p[5], tmp, hidden, nth);
        for (int64_t i = 0; i < (int64_t)B * hidden; i++) x[i] += tmp[i];
    }
    return 0;
}
