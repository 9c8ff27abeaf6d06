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
CPU kernel library's pool (csrc/decode_attention.c, built into that library on first
use: cbuild.py; no compiler, or a failed build, leaves `available()` False and the torch
path in use).
"""

from __future__ import annotations

import torch

from prefixgate.worker.kernels import cpu_quant


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
