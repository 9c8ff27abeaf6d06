"""CPU kernel: all decoder layers of a Llama decode step in one call, for q4_1 weights.

Why: a decode token through torch is ~16 operators per layer (~500 per token), each a few
microseconds of dispatch, which at batch 1 was a third of the step once the weights
became 4-bit. This runs the same computation as `model_runner.LlamaStep` (RMSNorm, fused
q|k|v, RoPE, K/V into the pool, paged decode attention, o, residual, RMSNorm, fused
gate|up, SiLU * up, down, residual) in C, with the products on the library's thread pool.

Contract: `decode_layers(plan, x, cos, sin, step)` updates x [B, hidden] (float32,
contiguous: the embeddings of B decoding sequences' new tokens) in place to the last
layer's output (before the final norm), writing each layer's new K/V into the pool at
`step.slot_mapping`. Only for steps whose B rows are all decodes, a float32 KV pool, and
layers whose projections are all Q4_1 (`LayerPlan.build` returns None otherwise);
cos / sin [B, head_dim] as in LlamaStep._rope (sin's first half negated).
"""

from __future__ import annotations

import torch

from prefixgate.worker.kernels import cpu_quant
from prefixgate.worker.model_loader import QUANT_KERNEL_MAX_ROWS, QuantLinear

SOURCE = r"""
#ifdef __AVX512F__
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
                     const int32_t *ctx, int bs, float scale, float *scratch, int nth) {
    if (hd > 256 || hidden % 32 || inter % 32 || (nh * hd) % 32) return -1;
    int qkvw = (nh + 2 * nkv) * hd;
    float *h = scratch;                          /* [B, hidden] */
    float *qkv = h + (int64_t)B * hidden;        /* [B, qkvw] */
    float *att = qkv + (int64_t)B * qkvw;        /* [B, nh * hd] */
    float *gu = att + (int64_t)B * nh * hd;      /* [B, 2 * inter] */
    float *act = gu + (int64_t)B * 2 * inter;    /* [B, inter] */
    float *tmp = act + (int64_t)B * inter;       /* [B, hidden] */
    int64_t slot_stride = (int64_t)nkv * hd;
    for (int l = 0; l < L; l++) {
        const int64_t *p = ptrs + 6 * l;
        float *kl = kpool + l * layer_stride, *vl = vpool + l * layer_stride;
        rmsnorm(x, (const float *)p[0], h, B, hidden, eps);
        pg_q4_1_gemm(h, hidden, B, hidden, qkvw, (const uint8_t *)p[1], qkv, qkvw, nth);
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
        job_t j = {qkv, qkvw, hd, kl, vl, slot_stride, 0, bt, bt_stride, ctx, att, B, nh,
                   nkv, hd, bs, scale};
        pool_run(decode_item, &j, B * nkv, nth);
        pg_q4_1_gemm(att, nh * hd, B, nh * hd, hidden, (const uint8_t *)p[2], tmp, hidden, nth);
        for (int64_t i = 0; i < (int64_t)B * hidden; i++) x[i] += tmp[i];
        rmsnorm(x, (const float *)p[3], h, B, hidden, eps);
        pg_q4_1_gemm(h, hidden, B, hidden, 2 * inter, (const uint8_t *)p[4], gu, 2 * inter, nth);
        for (int b = 0; b < B; b++) {
            const float *g = gu + (int64_t)b * 2 * inter, *u = g + inter;
            float *a = act + (int64_t)b * inter;
            for (int i = 0; i < inter; i++) a[i] = g[i] / (1.f + expf(-g[i])) * u[i];
        }
        pg_q4_1_gemm(act, inter, B, inter, hidden, (const uint8_t *)p[5], tmp, hidden, nth);
        for (int64_t i = 0; i < (int64_t)B * hidden; i++) x[i] += tmp[i];
    }
    return 0;
}
#endif
"""


class LayerPlan:
    """The per-layer pointers and geometry `decode_layers` needs, built once per model
    (the tensors they point into stay referenced here)."""

    def __init__(self, layers: list, hidden: int, nh: int, nkv: int, hd: int, inter: int,
                 eps: float, scale: float) -> None:
        self.keep = [t for layer in layers for t in layer]
        self.ptrs = torch.tensor([t.data_ptr() for layer in layers for t in layer],
                                 dtype=torch.int64)
        self.num_layers = len(layers)
        self.hidden, self.nh, self.nkv, self.hd, self.inter = hidden, nh, nkv, hd, inter
        self.eps, self.scale = eps, scale

    @staticmethod
    def build(step_layers: list, hidden: int, nh: int, nkv: int, hd: int, eps: float
              ) -> LayerPlan | None:
        """From LlamaStep's layer tuples; None unless every projection is Q4_1, the
        scaling is shared, and the kernels run here."""
        if not cpu_quant.available() or hd > 256:
            return None
        layers, scales = [], set()
        for ln1, qkv, o, ln2, gate_up, down, _, scale in step_layers:
            if not all(isinstance(m, QuantLinear) and m.kind == "q4_1"
                       for m in (qkv, o, gate_up, down)):
                return None
            layers.append((ln1.detach().float().contiguous(), qkv.packed, o.packed,
                           ln2.detach().float().contiguous(), gate_up.packed, down.packed))
            scales.add(scale)
        if len(scales) != 1:
            return None
        return LayerPlan(layers, hidden, nh, nkv, hd, step_layers[0][4].out_features // 2,
                         eps, scales.pop())

    def runs(self, step, pool) -> bool:
        """Whether `decode_layers` takes this step: decodes only, on the CPU backend, a
        float32 pool with contiguous layers, at most QUANT_KERNEL_MAX_ROWS rows."""
        return (step.num_decodes == step.num_seqs and step.backend == "cpu"
                and step.num_seqs <= QUANT_KERNEL_MAX_ROWS and pool.k.dtype == torch.float32
                and pool.k.is_contiguous() and pool.v.is_contiguous())


def decode_layers(plan: LayerPlan, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  step) -> None:
    lib = cpu_quant.library()
    assert lib is not None and cpu_quant.available()
    b = x.shape[0]
    scratch = torch.empty(b * (2 * plan.hidden + (plan.nh + 2 * plan.nkv) * plan.hd
                               + plan.nh * plan.hd + 3 * plan.inter), dtype=torch.float32)
    pool = step.pool
    rc = lib.pg_decode_layers(
        plan.num_layers, plan.ptrs.data_ptr(), x.data_ptr(), b, plan.hidden, plan.nh,
        plan.nkv, plan.hd, plan.inter, plan.eps, cos.data_ptr(), sin.data_ptr(),
        step.slot_mapping.data_ptr(), pool.k.data_ptr(), pool.v.data_ptr(), pool.k.stride(0),
        step.block_tables.data_ptr(), step.block_tables.stride(0),
        step.context_lens.data_ptr(), step.block_size, plan.scale, scratch.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise ValueError("geometry outside the CPU decode-layers kernel's limits")
