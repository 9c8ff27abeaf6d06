"""Attention over the paged KV pool, plugged into transformers' attention interface.

One step runs the model once on a flat batch: the new tokens of every scheduled sequence
(a prefill chunk or one decode token each) concatenated into input_ids of shape [1, T],
with their absolute positions as position_ids (so RoPE is applied per token, and cached
keys are stored already rotated). Nothing is padded: sequence b owns rows
`cu_seqlens_q[b]:cu_seqlens_q[b + 1]` of the batch. transformers calls
`paged_attention_forward` in every layer with that layer's q, k, v for the T new tokens;
it

  writes  the T new keys and values into their pool slots (`StepMetadata.slot_mapping`,
          one index_copy per layer), exactly once, before attending;
  attends each sequence's queries to its own context, read through its block table, by
          the step's backend (`BACKENDS[step.backend]`, same metadata for every backend).

The pool is the cache: no per-request cache object exists, block tables are the only
per-request state, and the batch may change every step. The metadata tensors are built
once per step (`StepMetadata.build`); every layer reuses them.

Backends
--------
An attention backend is a function `(query, k_cache, v_cache, step, scale) -> out`:
query [T, H, D] (the step's new tokens, any strides), k_cache/v_cache
[num_slots, KVH, D] (one layer of the pool, this step's K/V already written), out
[T, H, D] contiguous, dtype of query. H is a multiple of KVH (GQA: query head h reads KV
head h // (H // KVH)). "torch" (below) runs anywhere: one batched attention for the
decode rows (padded only to the longest decode context, never to a prefill chunk) and
one attention per prefill chunk; it gathers each context's slots out of the pool. "cpu"
reads the decode rows' K/V in place (worker/kernels/cpu_decode.py, read once instead of
three times) and runs prefill chunks as "torch" does. Other backends (Triton on CUDA)
register themselves in `BACKENDS`; `resolve_backend("auto", ...)` picks one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from prefixgate.worker.kv_pool import KVPool

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "prefixgate_paged"


@dataclass
class StepMetadata:
    """What one step's attention needs, for B sequences and T new tokens in all.

    The contract every backend is written against (the torch path here, the Triton
    kernels in worker/kernels/). Tensors live on the pool's device; int32 unless noted.

    - `cu_seqlens_q` [B + 1]: cumulative query lengths, 0 first, T last. Sequence b's
      new tokens are rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of the flat batch (q_len_b
      >= 1 of them).
    - `context_lens` [B]: tokens of sequence b's context *including* its new ones, so
      its query i sits at absolute position context_lens[b] - q_len_b + i and attends to
      the keys at positions 0..that position (causal; the new tokens' own K/V are in the
      pool before attention runs).
    - `block_tables` [B, max_num_blocks]: pool block ids of each sequence, position p
      of sequence b at slot block_tables[b, p // block_size] * block_size
      + p % block_size. Entries past ceil(context_lens[b] / block_size) are padding
      (0) and must not be read.
    - `slot_mapping` [T] int64: pool slot each new token's K and V are written to (int64:
      torch's index_copy_ takes no other).
    - `num_decodes`: sequences 0..num_decodes-1 have exactly one new token (the
      scheduler puts decodes first); a backend may run them as a decode batch and the
      rest as variable-length prefill. Later sequences may also have one token.
    - `max_query_len`, `max_context_len`: host ints (kernel grid sizes).
    - `block_size`: tokens per block (the pool's).
    - `backend`: key of `BACKENDS` that attends this step.
    """

    pool: KVPool
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_context_len: int
    block_size: int
    backend: str = "torch"
    # Host copies of the per-sequence lengths (the torch path loops over prefill chunks).
    query_lens_host: list[int] = field(default_factory=list, repr=False)
    context_lens_host: list[int] = field(default_factory=list, repr=False)
    _torch_plan: _TorchPlan | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @staticmethod
    def build(pool: KVPool, block_tables: list[list[int]], context_lens: list[int],
              query_lens: list[int], backend: str = "torch") -> StepMetadata:
        """`context_lens[b]` counts sequence b's tokens including its `query_lens[b]` new
        ones; `block_tables[b]` covers at least ceil(context_lens[b] / block_size)
        blocks."""
        bs = pool.config.block_size
        num_seqs = len(block_tables)
        max_blocks = max(-(-c // bs) for c in context_lens)
        table = torch.zeros((num_seqs, max_blocks), dtype=torch.int32)
        for b, (blocks, c) in enumerate(zip(block_tables, context_lens, strict=True)):
            n = -(-c // bs)
            assert len(blocks) >= n, f"sequence {b}: {len(blocks)} blocks for {c} tokens"
            table[b, :n] = torch.tensor(blocks[:n], dtype=torch.int32)
        qlen = torch.tensor(query_lens, dtype=torch.int64)
        ctx = torch.tensor(context_lens, dtype=torch.int64)
        cu = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(qlen, 0, out=cu[1:])
        # Slots written this step: the last q_len positions of each context.
        token_seq = torch.repeat_interleave(torch.arange(num_seqs), qlen)
        pos = torch.arange(int(cu[-1])) - cu[token_seq] + ctx[token_seq] - qlen[token_seq]
        slot_mapping = table[token_seq, pos // bs].long() * bs + pos % bs
        num_decodes = 0
        while num_decodes < num_seqs and query_lens[num_decodes] == 1:
            num_decodes += 1
        dev = pool.k.device  # built on the CPU (small), used where the pool lives
        return StepMetadata(
            pool=pool, cu_seqlens_q=cu.to(torch.int32).to(dev),
            context_lens=ctx.to(torch.int32).to(dev), block_tables=table.to(dev),
            slot_mapping=slot_mapping.to(dev), num_decodes=num_decodes,
            max_query_len=max(query_lens), max_context_len=max(context_lens),
            block_size=bs, backend=backend, query_lens_host=list(query_lens),
            context_lens_host=list(context_lens))


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StepMetadata, float],
                       torch.Tensor]


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
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = BACKENDS[pg_step.backend](query[0].transpose(0, 1), k_layer, v_layer, pg_step, scale)
    return out.unsqueeze(0), None


# --- the torch backend --------------------------------------------------------------------

@dataclass
class _TorchPlan:
    """Index tensors of the torch path, built at the first layer and shared by all."""

    decode_slots: torch.Tensor | None  # [num_decodes, max decode context] (padding: 0)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max] True: a real key; None: all
    # Per prefill chunk: its rows, its context's slots, and an additive float mask
    # (0 / -inf) when it follows earlier tokens (None: plain causal). Float and 4-D: the
    # shapes torch's fused CPU attention takes (a bool mask falls back to the math path).
    prefill: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]


def _context_slots(step: StepMetadata, b: int, num_tokens: int) -> torch.Tensor:
    bs = step.block_size
    blocks = step.block_tables[b, :-(-num_tokens // bs)].long()
    return (blocks[:, None] * bs + torch.arange(bs, device=blocks.device)).reshape(-1)[:num_tokens]


def _torch_plan(step: StepMetadata, dtype: torch.dtype) -> _TorchPlan:
    nd, bs = step.num_decodes, step.block_size
    dev = step.block_tables.device
    decode_slots = decode_mask = None
    if nd:
        ctx = step.context_lens_host[:nd]
        longest = max(ctx)
        blocks = step.block_tables[:nd, :-(-longest // bs)].long()
        decode_slots = (blocks[:, :, None] * bs + torch.arange(bs, device=dev)
                        ).reshape(nd, -1)[:, :longest]
        if min(ctx) < longest:
            lens = step.context_lens[:nd, None]
            decode_mask = (torch.arange(longest, device=dev)[None, :] < lens)[:, None, None]
    prefill = []
    start = nd
    for b in range(nd, step.num_seqs):
        q_len, c = step.query_lens_host[b], step.context_lens_host[b]
        mask = None
        if q_len != c:  # a chunk after cached or earlier-computed tokens: offset causal
            i = torch.arange(q_len, device=dev)[:, None]
            visible = torch.arange(c, device=dev)[None, :] <= i + (c - q_len)
            mask = torch.zeros((1, 1, q_len, c), dtype=dtype, device=dev)
            mask.masked_fill_(~visible, float("-inf"))
        prefill.append((start, start + q_len, _context_slots(step, b, c), mask))
        start += q_len
    return _TorchPlan(decode_slots, decode_mask, prefill)


def _prepared(step: StepMetadata, dtype: torch.dtype) -> _TorchPlan:
    if step._torch_plan is None:
        step._torch_plan = _torch_plan(step, dtype)
    return step._torch_plan


def _prefill_torch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   step: StepMetadata, scale: float, out: torch.Tensor) -> None:
    """One attention per prefill chunk (sequences num_decodes.., rows out of `query`)."""
    gqa = query.shape[1] != k_cache.shape[1]
    for lo, hi, slots, mask in _prepared(step, query.dtype).prefill:
        k = k_cache[slots].to(query.dtype).transpose(0, 1)[None]  # [1, KVH, ctx, D]
        v = v_cache[slots].to(query.dtype).transpose(0, 1)[None]
        q = query[lo:hi].transpose(0, 1)[None]  # [1, H, q_len, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=scale, enable_gqa=gqa)
        out[lo:hi] = o[0].transpose(0, 1)


def torch_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    step: StepMetadata, scale: float) -> torch.Tensor:
    """The reference backend (any device): query [T, H, D] -> [T, H, D]. Decodes: one
    batched attention, padded to the longest decode context only."""
    plan = _prepared(step, query.dtype)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if plan.decode_slots is not None:
        nd = step.num_decodes
        k = k_cache[plan.decode_slots].to(query.dtype).transpose(1, 2)  # [nd, KVH, ctx, D]
        v = v_cache[plan.decode_slots].to(query.dtype).transpose(1, 2)
        q = query[:nd, :, None]  # [nd, H, 1, D]
        out[:nd] = F.scaled_dot_product_attention(
            q, k, v, attn_mask=plan.decode_mask, scale=scale,
            enable_gqa=query.shape[1] != k_cache.shape[1])[:, :, 0]
    _prefill_torch(query, k_cache, v_cache, step, scale, out)
    return out


def cpu_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  step: StepMetadata, scale: float) -> torch.Tensor:
    """CPU backend: decodes by the kernel that reads blocks in place
    (worker/kernels/cpu_decode.py), prefill chunks as in the torch path."""
    from prefixgate.worker.kernels import cpu_decode

    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    nd = step.num_decodes
    if nd:
        out[:nd] = cpu_decode.decode_attention(query[:nd], k_cache, v_cache,
                                               step.block_tables[:nd], step.context_lens[:nd],
                                               step.block_size, scale)
    _prefill_torch(query, k_cache, v_cache, step, scale, out)
    return out


BACKENDS: dict[str, AttentionFn] = {"torch": torch_attention, "cpu": cpu_attention}


def resolve_backend(name: str, pool: KVPool, num_heads: int) -> str:
    """The backend `name` stands for: "auto" picks the fastest one that runs here (a
    registered "triton" on CUDA; the CPU kernel when it builds and fits; else "torch").
    On CUDA this imports the Triton kernels first, which registers "triton"."""
    if pool.k.device.type == "cuda" and "triton" not in BACKENDS:
        try:  # registers "triton" on import
            import prefixgate.worker.kernels.paged_attention_triton  # noqa: F401
        except ImportError as e:
            log.warning("Triton paged attention unavailable (%s); using the torch path", e)
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"unknown attention backend {name!r} (have {sorted(BACKENDS)})")
        return name
    if pool.k.device.type == "cuda":
        return "triton" if "triton" in BACKENDS else "torch"
    from prefixgate.worker.kernels import cpu_decode

    if pool.k.device.type == "cpu" and cpu_decode.supports(pool.k[0], num_heads) \
            and cpu_decode.available():
        return "cpu"
    return "torch"


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
