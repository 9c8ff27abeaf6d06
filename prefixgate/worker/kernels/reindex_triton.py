"""Triton kernel: fused gather + RoPE re-rotation of K + copy of V over the paged pool.

Contract: `reindex_slots_triton(pool, src, dst, delta, rope)` does what
`prefixgate.worker.reindex.reindex_slots_torch` does (same tables, same float32 math,
one rounding to the pool dtype) in one launch: program (n, layer) reads slot src[n] of
that layer ([kv_heads, head_dim] of K and of V), rotates K with the per-token tables
(out = x * cos + x[partner] * sin, which covers rotate-half, interleaved and partial
rotary layouts alike) and writes slot dst[n]. Pool tensors must be contiguous
[num_layers, num_slots, kv_heads, head_dim] in float32, float16 or bfloat16. Runs on a
CUDA device, or on CPU tensors when TRITON_INTERPRET=1 was set before triton was
imported (the tests do; slow, for correctness only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgate.worker.kv_pool import KVPool
from prefixgate.worker.reindex import RopeSpec


@triton.jit
def _reindex_kernel(k_ptr, v_ptr, src_ptr, dst_ptr, cos_ptr, sin_ptr, partner_ptr,
                    layer_stride, slot_stride,
                    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    n = tl.program_id(0)
    layer = tl.program_id(1)
    src = tl.load(src_ptr + n)
    dst = tl.load(dst_ptr + n)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < D)
    dmask = tl.arange(0, BLOCK_D) < D
    cos = tl.load(cos_ptr + n * D + tl.arange(0, BLOCK_D), mask=dmask, other=1.0)[None, :]
    sin = tl.load(sin_ptr + n * D + tl.arange(0, BLOCK_D), mask=dmask, other=0.0)[None, :]
    partner = tl.load(partner_ptr + tl.arange(0, BLOCK_D), mask=dmask, other=0)[None, :]
    base = layer.to(tl.int64) * layer_stride
    src_off = base + src * slot_stride + h * D
    dst_off = base + dst * slot_stride + h * D
    x = tl.load(k_ptr + src_off + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(k_ptr + src_off + partner, mask=mask, other=0.0).to(tl.float32)
    out = x * cos + xp * sin
    tl.store(k_ptr + dst_off + d, out.to(k_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + src_off + d, mask=mask, other=0.0)
    tl.store(v_ptr + dst_off + d, v, mask=mask)


def reindex_slots_triton(pool: KVPool, src: torch.Tensor, dst: torch.Tensor,
                         delta: torch.Tensor, rope: RopeSpec) -> None:
    k, v = pool.k, pool.v
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("the pool's K/V tensors must be contiguous")
    num_layers, _, heads, head_dim = k.shape
    device = k.device
    cos, sin, partner = rope.tables(delta, device)
    src = src.to(device=device, dtype=torch.int64).contiguous()
    dst = dst.to(device=device, dtype=torch.int64).contiguous()
    grid = (len(src), num_layers)
    _reindex_kernel[grid](k, v, src, dst, cos.contiguous(), sin.contiguous(),
                          partner.to(torch.int64).contiguous(), k.stride(0), k.stride(1),
                          H=heads, D=head_dim, BLOCK_H=triton.next_power_of_2(heads),
                          BLOCK_D=triton.next_power_of_2(head_dim))
