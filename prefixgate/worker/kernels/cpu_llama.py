"""CPU kernel: all decoder layers of a Llama decode step in one call, for q4_1 weights.

Why: a decode token through torch is ~16 operators per layer (~500 per token), each a few
microseconds of dispatch, which at batch 1 was a third of the step once the weights
became 4-bit. This runs the same computation as `model_runner.LlamaStep` (RMSNorm, fused
q|k|v, RoPE, K/V into the pool, paged decode attention, o, residual, RMSNorm, fused
gate|up, SiLU * up, down, residual) in C (csrc/decode_layers.c), with the products on the
library's thread pool.

Contract: `decode_layers(plan, x, cos, sin, step)` updates x [B, hidden] (float32,
contiguous: the embeddings of B decoding sequences' new tokens) in place to the last
layer's output (before the final norm), writing each layer's new K/V into the pool at
`step.slot_mapping`. Only for steps whose B rows are all decodes, a float32 KV pool, and
layers whose projections are all Q4_1 (`LayerPlan.build` returns None otherwise), with
float32 activations or all with 8-bit ones (the q4_1-a8 format: `QuantLinear.a8`);
cos / sin [B, head_dim] as in LlamaStep._rope (sin's first half negated).
"""

from __future__ import annotations

import torch

from prefixgate.worker.kernels import cpu_quant
from prefixgate.worker.model_loader import QUANT_KERNEL_MAX_ROWS, QuantLinear


class LayerPlan:
    """The per-layer pointers and geometry `decode_layers` needs, built once per model
    (the tensors they point into stay referenced here)."""

    def __init__(self, layers: list, hidden: int, nh: int, nkv: int, hd: int, inter: int,
                 eps: float, scale: float, a8: bool = False) -> None:
        self.keep = [t for layer in layers for t in layer]
        self.ptrs = torch.tensor([t.data_ptr() for layer in layers for t in layer],
                                 dtype=torch.int64)
        self.num_layers = len(layers)
        self.hidden, self.nh, self.nkv, self.hd, self.inter = hidden, nh, nkv, hd, inter
        self.eps, self.scale, self.a8 = eps, scale, a8

    @staticmethod
    def build(step_layers: list, hidden: int, nh: int, nkv: int, hd: int, eps: float
              ) -> LayerPlan | None:
        """From LlamaStep's layer tuples; None unless every projection is Q4_1, the
        scaling is shared, and the kernels run here."""
        if not cpu_quant.available() or hd > 256:
            return None
        layers, scales, a8 = [], set(), set()
        for ln1, qkv, o, ln2, gate_up, down, _, scale in step_layers:
            if not all(isinstance(m, QuantLinear) and m.kind == "q4_1"
                       for m in (qkv, o, gate_up, down)):
                return None
            a8.update(m.a8 for m in (qkv, o, gate_up, down))
            layers.append((ln1.detach().float().contiguous(), qkv.packed, o.packed,
                           ln2.detach().float().contiguous(), gate_up.packed, down.packed))
            scales.add(scale)
        if len(scales) != 1 or len(a8) != 1:
            return None
        return LayerPlan(layers, hidden, nh, nkv, hd, step_layers[0][4].out_features // 2,
                         eps, scales.pop(), a8.pop())

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
        int(plan.a8), torch.get_num_threads())
    if rc != 0:
        raise ValueError("geometry outside the CPU decode-layers kernel's limits")
