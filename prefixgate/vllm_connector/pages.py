"""vLLM's paged KV cache (CPU backend) <-> prefixgate's wire pages.

Contract
--------
`PagedLayout.of(kv_cache, isa)` describes one attention layer's cache tensor of vLLM's
CPU backend: `[num_blocks, num_kv_heads, block_size, 2 * head_dim]`, where each (block,
head) holds `block_size * head_dim` key elements then as many value elements, each half in
an order of the attention kernel's choosing (the "vec" kernel stores keys dimension-major,
values token-major; the AMX one other ways). Rather than hard-code any of those orders, the
layout is *probed*: vLLM's own `cpu_attn_reshape_and_cache` writes coded values into a
scratch block with the layer's ISA, and where each (token, dim) landed gives the index maps
(`key_index`, `value_index`: position of element `token * head_dim + dim` within its half).
So a page is read and written exactly where vLLM's kernels put and read it.

`read(kv_cache, block_ids)` -> (k, v), each `[num_blocks * block_size, num_kv_heads,
head_dim]`: the tokens of those vLLM blocks in order; `write(kv_cache, block_ids, k, v)`
stores whole blocks there. Both move whole blocks with two gathers (`index_select` of the
blocks, then of the positions within a block: memory-bound copies, ~20x faster than
per-token indexing). Keys are as cached: after rotary embedding, as prefixgate's workers
cache them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedLayout:
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype
    # Per half (K, V): position within the half of element `token * head_dim + dim`
    # (`index`), and the element held at each position (`element`, its inverse).
    key_index: torch.Tensor
    value_index: torch.Tensor
    key_element: torch.Tensor
    value_element: torch.Tensor
    # Per half: "tokens" (token-major, as written), "dims" (dimension-major: [dim, token])
    # or "gather" (any other order): the first two copy as views, the last gathers.
    key_order: str = "gather"
    value_order: str = "gather"

    @classmethod
    def of(cls, kv_cache: torch.Tensor, isa: str) -> PagedLayout:
        """The layout of `kv_cache` (one layer), probed with vLLM's cache writer for `isa`.
        ValueError when the tensor is not the CPU backend's or the probe finds no
        one-to-one placement."""
        if kv_cache.dim() != 4 or kv_cache.shape[3] % 2 or not kv_cache.is_contiguous():
            raise ValueError(f"a KV cache of shape {tuple(kv_cache.shape)} is not vLLM's CPU "
                             "layout [blocks, kv_heads, block_size, 2 * head_dim]")
        _, heads, bs, two_hd = kv_cache.shape
        hd = two_hd // 2
        if max(bs, hd) > 256:
            raise ValueError(f"block size {bs} or head dim {hd} over 256 cannot be probed")
        key_index, value_index = _probe(kv_cache.dtype, bs, hd, isa)
        return cls(heads, bs, hd, kv_cache.dtype, key_index, value_index,
                   torch.argsort(key_index), torch.argsort(value_index),
                   _order(key_index, bs, hd), _order(value_index, bs, hd))

    def _halves(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        view = kv_cache.view(kv_cache.shape[0], self.num_kv_heads, 2,
                             self.block_size * self.head_dim)
        return view[:, :, 0], view[:, :, 1]  # [blocks, heads, block_size * head_dim] each

    def read(self, kv_cache: torch.Tensor, block_ids: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks' tokens, in order: [blocks * block_size, heads, dim]."""
        out = []
        n, heads, bs, hd = block_ids.numel(), self.num_kv_heads, self.block_size, self.head_dim
        for half, index, order in zip(self._halves(kv_cache), (self.key_index, self.value_index),
                                      (self.key_order, self.value_order), strict=True):
            blocks = half.index_select(0, block_ids)  # [n, heads, bs * hd] as stored
            if order == "tokens":
                tokens = blocks.view(n, heads, bs, hd)
            elif order == "dims":
                tokens = blocks.view(n, heads, hd, bs).transpose(2, 3)
            else:
                tokens = blocks.index_select(2, index).view(n, heads, bs, hd)
            out.append(tokens.transpose(1, 2).reshape(n * bs, heads, hd))
        return out[0], out[1]

    def write(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store K and V ([blocks * block_size, heads, dim]) as those blocks' tokens."""
        n, heads, bs, hd = block_ids.numel(), self.num_kv_heads, self.block_size, self.head_dim
        for half, element, order, data in zip(
                self._halves(kv_cache), (self.key_element, self.value_element),
                (self.key_order, self.value_order), (k, v), strict=True):
            tokens = data.to(self.dtype).view(n, bs, heads, hd).transpose(1, 2)  # [n, h, bs, hd]
            if order == "tokens":
                stored = tokens.reshape(n, heads, bs * hd)
            elif order == "dims":
                stored = tokens.transpose(2, 3).reshape(n, heads, bs * hd)
            else:
                stored = tokens.reshape(n, heads, bs * hd).index_select(2, element)
            half.index_copy_(0, block_ids, stored)


def _order(index: torch.Tensor, bs: int, hd: int) -> str:
    """Which copy a half's placement `index` allows (PagedLayout.key_order)."""
    tokens = torch.arange(bs * hd)
    if torch.equal(index, tokens):
        return "tokens"
    token, dim = tokens // hd, tokens % hd
    if torch.equal(index, dim * bs + token):
        return "dims"
    return "gather"


def _probe(dtype: torch.dtype, bs: int, hd: int, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's cache writer puts element (token, dim) of each half, for this dtype,
    block size, head dim and ISA. Token and dim are written in two passes (values up to
    256, exact in every supported dtype)."""
    from vllm import _custom_ops as ops

    placed = []
    for coded in ("token", "dim"):
        scratch = torch.full((1, 1, bs, 2 * hd), -1.0, dtype=dtype)
        kc, vc = scratch.view(1, 1, 2 * bs, hd).chunk(2, dim=2)
        token = torch.arange(bs).view(bs, 1, 1).expand(bs, 1, hd)
        dim = torch.arange(hd).view(1, 1, hd).expand(bs, 1, hd)
        val = (token if coded == "token" else dim).to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(val, val.clone(), kc, vc, torch.arange(bs), isa)
        placed.append(scratch.view(2, bs * hd).to(torch.float32))
    token_at, dim_at = placed
    maps = []
    for half in (0, 1):
        code = (token_at[half] * hd + dim_at[half]).long()  # element held at each position
        if torch.any(token_at[half] < 0) or not torch.equal(
                code.sort().values, torch.arange(bs * hd)):
            raise ValueError(f"vLLM's {isa} cache writer does not place a {bs}-token block "
                             "one element per position: its layout cannot be mapped")
        index = torch.empty(bs * hd, dtype=torch.long)
        index[code] = torch.arange(bs * hd)
        maps.append(index)
    return maps[0], maps[1]
