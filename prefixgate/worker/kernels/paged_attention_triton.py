"""Triton paged attention: decode and variable-length prefill, K/V read in place.

Contract: `triton_attention(query, k_cache, v_cache, step, scale)` is an attention backend
of worker/paged_attention.py (registered there as "triton" when this module is imported):
query [T, H, D] (the step's new tokens, any strides, last dim contiguous), k_cache /
v_cache one layer of the pool [num_slots, KVH, D] (contiguous; float32, float16 or
bfloat16, this step's K/V already written), `step` the StepMetadata, `scale` the softmax
scale; returns [T, H, D] contiguous in query's dtype, equal to the torch backend's result
up to float rounding. Query head h reads KV head h // (H // KVH).

How: FlashAttention-style online softmax in float32 (running max, running sum, rescaled
accumulator), keys and values streamed tile by tile straight out of the pool: key j of
sequence b sits at slot block_tables[b, j // block_size] * block_size + j % block_size,
so no per-step gather or padded copy is ever made. Two kernels share that loop:
  decode   sequences 0..num_decodes-1 (one new token each), program (sequence, KV head):
           the G = H / KVH query heads of a KV head are one [G, D] tile, so each key and
           value is read once per KV head, not once per query head;
  prefill  the other sequences, program (query tile of BLOCK_M rows, sequence, head):
           causal within the chunk and after its cached context (query i of a sequence
           with context c and q_len n sits at position c - n + i); key tiles past the
           tile's last query are never loaded.
Runs on CUDA devices, or on CPU tensors when TRITON_INTERPRET=1 was set before triton was
imported (the tests do; slow, for correctness only). The worker dispatches here only on
CUDA (`resolve_backend` imports this module for a CUDA pool; "auto" then picks "triton").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgate.worker.paged_attention import BACKENDS, StepMetadata

LOG2E = 1.4426950408889634


@triton.jit
def _tile_slots(bt_row, start, ctx, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pool slots (int64) of keys start..start+BLOCK_N-1 of one sequence, and which exist."""
    j = start + tl.arange(0, BLOCK_N)
    valid = j < ctx
    block = tl.load(bt_row + j // BS, mask=valid, other=0).to(tl.int64)
    return block * BS + j % BS, j, valid


@triton.jit
def _kv_tile(k_ptr, v_ptr, bt_row, start, ctx, kvh, d, dmask, slot_stride,
             D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """K and V [BLOCK_N, BLOCK_D] (float32, 0 where absent) of keys start.. of one
    sequence's KV head `kvh`, their positions j, and which exist."""
    slot, j, valid = _tile_slots(bt_row, start, ctx, BS, BLOCK_N)
    kv_off = slot[:, None] * slot_stride + kvh * D + d[None, :]
    kv_mask = valid[:, None] & dmask[None, :]
    k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
    return k, v, j, valid


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, ctx_ptr,
                   q_st, q_sh, o_st, o_sh, slot_stride, bt_stride, qk_scale,
                   G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < G
    dmask = d < D
    head = kvh * G + g
    q = tl.load(q_ptr + b * q_st + head[:, None] * q_sh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    ctx = tl.load(ctx_ptr + b)
    bt_row = bt_ptr + b.to(tl.int64) * bt_stride
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, ctx, BLOCK_N):
        k, v, _, valid = _kv_tile(k_ptr, v_ptr, bt_row, start, ctx, kvh, d, dmask,
                                  slot_stride, D, BS, BLOCK_N)
        scores = tl.dot(q, tl.trans(k)) * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        s = s * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    out = acc / s[:, None]
    tl.store(o_ptr + b * o_st + head[:, None] * o_sh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, ctx_ptr, cu_ptr, first_seq,
                    q_st, q_sh, o_st, o_sh, slot_stride, bt_stride, qk_scale,
                    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    tile = tl.program_id(0)
    b = first_seq + tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // G
    q_lo = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_lo
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(ctx_ptr + b)
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows of this chunk
    d = tl.arange(0, BLOCK_D)
    imask = i < q_len
    dmask = d < D
    rows = (q_lo + i).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * q_st + h * q_sh + d[None, :],
                mask=imask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    q_pos = ctx - q_len + i  # absolute positions; key j is visible when j <= q_pos
    bt_row = bt_ptr + b.to(tl.int64) * bt_stride
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(ctx, ctx - q_len + tile * BLOCK_M + BLOCK_M)  # past the last query
    for start in range(0, hi, BLOCK_N):
        k, v, j, valid = _kv_tile(k_ptr, v_ptr, bt_row, start, ctx, kvh, d, dmask,
                                  slot_stride, D, BS, BLOCK_N)
        scores = tl.dot(q, tl.trans(k)) * qk_scale
        visible = valid[None, :] & (j[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        # Padding rows (i >= q_len) may see no key at all: keep their max finite.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        s = s * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    out = acc / tl.where(s > 0, s, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None] * o_st + h * o_sh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=imask[:, None] & dmask[None, :])


def triton_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     step: StepMetadata, scale: float) -> torch.Tensor:
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the pool's K/V layers must be contiguous")
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_tokens, heads, head_dim = query.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty((num_tokens, heads, head_dim), dtype=query.dtype, device=query.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    qk_scale = scale * LOG2E  # softmax in base 2: exp2(x * log2 e) = exp(x)
    bt, ctx = step.block_tables, step.context_lens
    common = (query.stride(0), query.stride(1), out.stride(0), out.stride(1),
              k_cache.stride(0), bt.stride(0), qk_scale)
    nd = step.num_decodes
    if nd:
        _decode_kernel[(nd, kv_heads)](
            query, k_cache, v_cache, out, bt, ctx, *common, G=group, D=head_dim,
            BS=step.block_size, BLOCK_G=max(16, triton.next_power_of_2(group)),
            BLOCK_D=block_d, BLOCK_N=64)
    num_prefill = step.num_seqs - nd
    if num_prefill:
        max_q = max(step.query_lens_host[nd:])
        block_m = 16 if max_q <= 16 else 64
        _prefill_kernel[(triton.cdiv(max_q, block_m), num_prefill, heads)](
            query, k_cache, v_cache, out, bt, ctx, step.cu_seqlens_q, nd, *common,
            G=group, D=head_dim, BS=step.block_size, BLOCK_M=block_m, BLOCK_D=block_d,
            BLOCK_N=64)
    return out


BACKENDS["triton"] = triton_attention
