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
"""

from __future__ import annotations

import logging

import torch

from prefixgate.worker.kv_pool import KVPool, KVPoolConfig
from prefixgate.worker.paged_attention import ATTN_IMPLEMENTATION, StepMetadata


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
        if pool.k.device.type == "cuda":
            _register_triton_backend()

    @torch.inference_mode()
    def forward(self, input_ids: list[int], positions: list[int], step: StepMetadata,
                sample_indices: list[int]) -> torch.Tensor:
        device = self.pool.config.device
        out = self.model(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            use_cache=False,
            logits_to_keep=torch.tensor(sample_indices, dtype=torch.long, device=device),
            pg_step=step,
        )
        # Sampling runs on the CPU with per-request generators: hand it fp32 CPU logits.
        return out.logits[0, :, :self.num_token_ids].float().cpu()


def _register_triton_backend() -> None:
    """GPU dispatch: importing the Triton kernels registers the "triton" attention
    backend, which `paged_attention.resolve_backend("auto")` then picks on CUDA."""
    try:
        import prefixgate.worker.kernels.paged_attention_triton  # noqa: F401
    except ImportError as exc:  # no triton: the torch backend serves, slower
        logging.getLogger(__name__).warning("Triton attention unavailable (%s); "
                                            "using the torch backend", exc)
