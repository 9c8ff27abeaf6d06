"""Run a transformers causal LM over the paged KV pool, one flat batch per step.

Contract: `ModelRunner(model, pool, num_token_ids).forward(input_ids, positions, step,
sample_indices)` runs the model once on the T new tokens of a step (`input_ids`,
`positions`: length T; `step`: the StepMetadata for their sequences), writes their K/V into
the pool, and returns the next-token logits [len(sample_indices), num_token_ids] (fp32, on
the CPU) of the tokens at `sample_indices` (the last new token of each sequence that
samples this step). `num_token_ids` is the tokenizer's vocabulary: models often have more
embedding rows than tokens (padding to a multiple of 64 or 128), and an id past the
tokenizer's vocabulary can be neither decoded nor sent back as a prompt, so those rows are
never offered to sampling (None: every row). Only Llama-family models with
rotary embeddings are supported (the architecture of every built-in model).

Two ways to run a step, same inputs, same pool, same attention backends:
  `LlamaStep` (CPU, float32 activations: the float32 and q4_1 formats) runs the layers
        itself with fused projections (one q|k|v and one gate|up product per layer, the
        separate projections left as views of the fused weights, so nothing is copied)
        and ~16 operators per layer; decode-only steps on q4_1 weights go further and
        run every layer in one C call (kernels/cpu_llama.py). Why: a decode token at
        batch 1 is ~1,000 torch operators through transformers' modules; once the
        weights were 4-bit their dispatch cost as much as the matmuls (SmolLM2 q4_1, one
        thread, batch 1, same run at load 2.3: 19.8 ms per token through transformers,
        15.9 ms through the torch loop here, 10.2 ms with the C layers).
  transformers' own forward, with `paged_attention_forward` as its attention function:
        every other format and device (bfloat16/float16/int8, GPUs).
All give the same logits up to float32 rounding (tests/worker/test_paged_attention.py
against transformers, tests/worker/test_quant.py for q4_1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixgate.worker.kernels.cpu_llama import LayerPlan, decode_layers
from prefixgate.worker.kv_pool import KVPool, KVPoolConfig
from prefixgate.worker.model_loader import QuantLinear
from prefixgate.worker.paged_attention import ATTN_IMPLEMENTATION, BACKENDS, StepMetadata


def pool_config_for(model: torch.nn.Module, block_size: int, num_blocks: int) -> KVPoolConfig:
    """The KV pool geometry of `model` (kv_heads, not attention heads, under GQA), in
    the KV dtype the loader chose (`model.kv_cache_dtype`; else the model's dtype)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return KVPoolConfig(num_layers=c.num_hidden_layers,
                        num_kv_heads=getattr(c, "num_key_value_heads", c.num_attention_heads),
                        head_dim=head_dim, block_size=block_size, num_blocks=num_blocks,
                        dtype=getattr(model, "kv_cache_dtype", model.dtype),
                        device=str(model.device))


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool,
                 num_token_ids: int | None = None) -> None:
        self.model = model
        self.pool = pool
        self.num_token_ids = num_token_ids
        # Every attention layer now calls paged_attention_forward (no mask is built:
        # transformers skips mask creation for attention functions it does not know).
        model.config._attn_implementation = ATTN_IMPLEMENTATION
        self.fast = LlamaStep(model) if LlamaStep.supports(model) else None

    @torch.inference_mode()
    def forward(self, input_ids: list[int], positions: list[int], step: StepMetadata,
                sample_indices: list[int]) -> torch.Tensor:
        device = self.pool.config.device
        if self.fast is not None:
            logits = self.fast.forward(input_ids, positions, step, sample_indices)
            return logits[:, :self.num_token_ids]
        out = self.model(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            use_cache=False,
            logits_to_keep=torch.tensor(sample_indices, dtype=torch.long, device=device),
            pg_step=step,
        )
        # Sampling runs on the CPU with per-request generators: hand it fp32 CPU logits.
        return out.logits[0, :, :self.num_token_ids].float().cpu()


class LlamaStep:
    """A Llama forward over the paged pool for CPU float32 activations: embeddings,
    per layer RMSNorm -> fused q|k|v -> RoPE -> K/V into the pool -> attention (the
    step's backend) -> o -> residual -> RMSNorm -> fused gate|up -> SiLU * up -> down ->
    residual, final norm, LM head on the sampled rows only. Linear modules may be
    nn.Linear or the loader's QuantLinear (fused by concatenating rows: both hold one
    row per output feature)."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        c = model.config
        rope = (getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None)
                or {})
        layers = getattr(getattr(model, "model", None), "layers", None)
        if c.model_type != "llama" or layers is None or model.device.type != "cpu" \
                or model.dtype != torch.float32 or c.hidden_act != "silu" \
                or rope.get("rope_type", "default") in ("dynamic", "longrope"):
            return False
        linear = (torch.nn.Linear, QuantLinear)
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            mods = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj,
                    mlp.down_proj)
            if not all(isinstance(m, linear) and getattr(m, "bias", None) is None
                       for m in mods):
                return False
            if len({type(m) for m in mods}) != 1 or (
                    isinstance(a.q_proj, QuantLinear)
                    and len({m.kind for m in (a.q_proj, a.k_proj, a.v_proj)}) != 1):
                return False
        return True

    def __init__(self, model: torch.nn.Module) -> None:
        c = model.config
        self.model = model
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = getattr(c, "num_key_value_heads", c.num_attention_heads)
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.num_heads
        self.hidden = c.hidden_size
        self.eps = c.rms_norm_eps
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.float().clone()
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.layers = []
        for layer in model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                layer.input_layernorm.weight, _fuse(a, ("q_proj", "k_proj", "v_proj")),
                a.o_proj, layer.post_attention_layernorm.weight,
                _fuse(mlp, ("gate_proj", "up_proj")), mlp.down_proj, a.layer_idx,
                float(a.scaling)))
        # Decode-only steps on q4_1 weights run all layers in one C call (no torch
        # operator per layer); the torch loop below computes the same.
        in_order = [layer[6] for layer in self.layers] == list(range(len(self.layers)))
        self.plan = LayerPlan.build(self.layers, self.hidden, self.num_heads,
                                    self.num_kv_heads, self.head_dim, self.eps) \
            if in_order else None

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] for rotate-by-half RoPE; sin's first half negated, so that
        rotated = x * cos + roll(x, D/2) * sin."""
        freqs = positions[:, None].float() * self.inv_freq[None]
        cos = freqs.cos() * self.rope_scale
        sin = freqs.sin() * self.rope_scale
        return (torch.cat([cos, cos], -1)[:, None],
                torch.cat([-sin, sin], -1)[:, None])

    def forward(self, input_ids: list[int], positions: list[int], step: StepMetadata,
                sample_indices: list[int]) -> torch.Tensor:
        m = self.model.model
        cos, sin = self._rope(torch.tensor(positions))
        x = m.embed_tokens(torch.tensor(input_ids)).float()
        if self.plan is not None and self.plan.runs(step, step.pool):
            x = x.contiguous()
            decode_layers(self.plan, x, cos[:, 0].contiguous(), sin[:, 0].contiguous(), step)
        else:
            x = self._layers(x, cos, sin, step)
        rows = x[torch.tensor(sample_indices, dtype=torch.long)]
        return self.model.lm_head(m.norm(rows)).float()

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                step: StepMetadata) -> torch.Tensor:
        """Every decoder layer in torch operators: x [T, hidden] -> the last layer's output."""
        num_tokens, hd = x.shape[0], self.head_dim
        nh, nkv = self.num_heads, self.num_kv_heads
        pool = step.pool
        attend = BACKENDS[step.backend]
        width = (nh + nkv) * hd
        for ln1, qkv_proj, o_proj, ln2, gate_up, down, layer_idx, scale in self.layers:
            h = F.rms_norm(x, (self.hidden,), ln1, self.eps)
            qkv = qkv_proj(h)
            qk = qkv[:, :width].view(num_tokens, nh + nkv, hd)
            qk = qk * cos + qk.roll(hd // 2, -1) * sin
            k_layer, v_layer = pool.k[layer_idx], pool.v[layer_idx]
            k_layer.index_copy_(0, step.slot_mapping, qk[:, nh:].to(k_layer.dtype))
            v_layer.index_copy_(0, step.slot_mapping,
                                qkv[:, width:].view(num_tokens, nkv, hd).to(v_layer.dtype))
            attn = attend(qk[:, :nh], k_layer, v_layer, step, scale)
            x = x + o_proj(attn.reshape(num_tokens, nh * hd))
            gu = gate_up(F.rms_norm(x, (self.hidden,), ln2, self.eps))
            half = gu.shape[-1] // 2
            x = x + down(F.silu(gu[:, :half]) * gu[:, half:])
        return x


def _fuse(parent: torch.nn.Module, names: tuple[str, ...]) -> torch.nn.Module:
    """One module computing the named linears of `parent` side by side (their outputs
    concatenated); the named modules then hold views of its weight (no copy kept)."""
    mods = [getattr(parent, n) for n in names]
    if isinstance(mods[0], QuantLinear):
        fused = QuantLinear.concat(mods)
        start = 0
        for mod in mods:
            mod.packed = fused.packed[start:start + mod.out_features]
            start += mod.out_features
        return fused
    with torch.no_grad():
        weight = torch.cat([mod.weight for mod in mods])
        fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        fused.weight = torch.nn.Parameter(weight, requires_grad=False)
        start = 0
        for mod in mods:
            n = mod.out_features
            mod.weight = torch.nn.Parameter(weight[start:start + n], requires_grad=False)
            start += n
    return fused
