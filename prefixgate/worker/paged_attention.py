"""Attention over the paged KV pool, plugged into transformers' attention interface.

One step runs the model once on a flat batch: the new tokens of every scheduled sequence
(a prefill chunk or one decode token each) concatenated into input_ids of shape [1, T],
with their absolute positions as position_ids (so RoPE is applied per token, and cached
keys are stored already rotated). transformers calls `paged_attention_forward` in every
layer with that layer's q, k, v for the T new tokens. It

  writes  the T new keys and values into their slots of the pool (one index_copy per
          layer: `StepMetadata.slot_mapping`), exactly once;
  reads   each sequence's whole context through its block table: one gather per layer
          builds padded K/V [B, kv_heads, max_context, head_dim] from the pool's blocks,
          then one scaled-dot-product attention call computes every sequence's queries
          against its own context under a causal mask (query i of a sequence with
          context_len c and q_len n sits at position c - n + i and sees keys 0..that).

No per-request cache object exists: the pool is the cache, block tables are the only
per-request state, and the batch may change every step. No Python loop runs over tokens
or blocks (the metadata tensors are built once per step; layers reuse them). A GPU
kernel can replace `_attend` behind the same metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from prefixgate.worker.kv_pool import KVPool

ATTN_IMPLEMENTATION = "prefixgate_paged"


@dataclass
class StepMetadata:
    """Tensors describing one step (B sequences, T new tokens in all)."""

    pool: KVPool
    slot_mapping: torch.Tensor  # [T] pool slot each new token's K/V is written to
    context_slots: torch.Tensor  # [B, max_context] pool slot of each context position
    query_index: torch.Tensor  # [B, max_q] index into the T new tokens (padding: 0)
    token_seq: torch.Tensor  # [T] which sequence each new token belongs to
    token_pos: torch.Tensor  # [T] its index among that sequence's new tokens
    mask: torch.Tensor  # [B, 1, max_q, max_context] True where attention is allowed

    @staticmethod
    def build(pool: KVPool, block_tables: list[list[int]], context_lens: list[int],
              query_lens: list[int]) -> StepMetadata:
        """`context_lens[b]` counts sequence b's tokens including its `query_lens[b]` new
        ones; `block_tables[b]` covers ceil(context_lens[b] / block_size) blocks."""
        bs = pool.config.block_size
        num_seqs = len(block_tables)
        max_ctx, max_q = max(context_lens), max(query_lens)
        max_blocks = (max_ctx + bs - 1) // bs
        table = torch.zeros((num_seqs, max_blocks), dtype=torch.long)
        for b, blocks in enumerate(block_tables):
            n = min(len(blocks), max_blocks)
            table[b, :n] = torch.tensor(blocks[:n], dtype=torch.long)
        offsets = torch.arange(bs, dtype=torch.long)
        context_slots = (table[:, :, None] * bs + offsets).reshape(num_seqs, -1)[:, :max_ctx]
        ctx = torch.tensor(context_lens, dtype=torch.long)
        qlen = torch.tensor(query_lens, dtype=torch.long)
        q_start = torch.cumsum(qlen, 0) - qlen
        i = torch.arange(max_q, dtype=torch.long)
        valid_q = i[None, :] < qlen[:, None]  # [B, max_q]
        query_index = torch.where(valid_q, q_start[:, None] + i[None, :], 0)
        token_seq = torch.repeat_interleave(torch.arange(num_seqs), qlen)
        token_pos = torch.arange(int(qlen.sum())) - q_start[token_seq]
        # Slots written this step: the last q_len positions of each context.
        write_pos = ctx[token_seq] - qlen[token_seq] + token_pos
        slot_mapping = context_slots[token_seq, write_pos]
        q_abs = ctx[:, None] - qlen[:, None] + i[None, :]  # [B, max_q] absolute positions
        j = torch.arange(max_ctx, dtype=torch.long)
        mask = (j[None, None, :] <= q_abs[:, :, None]) & (j[None, None, :] < ctx[:, None, None])
        # Padding query rows attend to key 0 only, so softmax never sees an empty row.
        mask |= (~valid_q[:, :, None]) & (j[None, None, :] == 0)
        # Built on the CPU (small), used where the pool lives.
        dev = pool.k.device
        return StepMetadata(pool, slot_mapping.to(dev), context_slots.to(dev),
                            query_index.to(dev), token_seq.to(dev), token_pos.to(dev),
                            mask[:, None].to(dev))


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            pg_step: StepMetadata | None = None, **kwargs
                            ) -> tuple[torch.Tensor, None]:
    """transformers attention function. query [1, H, T, D]; key/value [1, KVH, T, D]
    (rotated, new tokens only). Returns [1, T, H, D]."""
    if pg_step is None:
        raise RuntimeError("paged attention needs the step metadata (pg_step=...)")
    pool, layer = pg_step.pool, module.layer_idx
    k_layer, v_layer = pool.k[layer], pool.v[layer]  # [slots, KVH, D]
    k_layer.index_copy_(0, pg_step.slot_mapping, key[0].transpose(0, 1).to(k_layer.dtype))
    v_layer.index_copy_(0, pg_step.slot_mapping, value[0].transpose(0, 1).to(v_layer.dtype))
    out = _attend(query[0], k_layer, v_layer, pg_step, scaling)  # [H, T, D]
    return out.transpose(0, 1).unsqueeze(0), None


def _attend(query: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
            step: StepMetadata, scaling: float | None) -> torch.Tensor:
    """query [H, T, D] -> [H, T, D], each sequence against its own paged context."""
    q = query[:, step.query_index].permute(1, 0, 2, 3)  # [B, H, max_q, D]
    k = k_layer[step.context_slots].permute(0, 2, 1, 3).to(q.dtype)  # [B, KVH, max_ctx, D]
    v = v_layer[step.context_slots].permute(0, 2, 1, 3).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=step.mask, scale=scaling,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[step.token_seq, :, step.token_pos].transpose(0, 1)  # [H, T, D]


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
