"""Paged KV pool: preallocated fixed-size blocks for every layer, with reference counts.

Contract
--------
- Memory is allocated once: `k` and `v` are tensors of shape
  [num_layers, num_blocks * block_size, num_kv_heads, head_dim]. Block b holds the token
  slots [b * block_size, (b + 1) * block_size) of every layer. A token's KV is written
  once, at its slot, and read in place; it is copied only when a sequence takes a copy of
  a partial block it will write into (`copy_prefix`: a cached tail, a forked sample's
  last block) or when shifted reuse moves cached K/V to new positions (worker/reindex.py).
- `allocate(num_blocks)` returns distinct free block ids each with one reference, or
  None (allocating nothing) when fewer are free. `ref` adds a reference (a block shared
  by a sequence and the prefix cache, or by several sequences); `release` drops one and
  returns the block to the free list at zero. Freeing is O(1) per block.
- Bytes per token = 2 (K and V) x layers x kv_heads x head_dim x element size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVPoolConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    @property
    def bytes_per_token(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def num_blocks_for_memory(kv_cache_memory_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """How many blocks fit in `kv_cache_memory_bytes`."""
    return kv_cache_memory_bytes // (bytes_per_token * block_size)


class KVPool:
    def __init__(self, config: KVPoolConfig) -> None:
        self.config = config
        shape = (config.num_layers, config.num_tokens, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=config.dtype, device=config.device)
        self.v = torch.zeros(shape, dtype=config.dtype, device=config.device)
        self._refs = [0] * config.num_blocks
        # Low ids first: keeps the touched memory compact while the pool is not full.
        self._free = list(range(config.num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.config.num_blocks - len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        if num_blocks > len(self._free):
            return None
        out = [self._free.pop() for _ in range(num_blocks)]
        for b in out:
            self._refs[b] = 1
        return out

    def ref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} is free"
            self._refs[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            assert self._refs[b] > 0, f"block {b} released twice"
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def copy_prefix(self, src_block: int, dst_block: int, num_tokens: int) -> None:
        """Copy the first `num_tokens` token slots of `src_block` to `dst_block`, all layers."""
        bs = self.config.block_size
        src = slice(src_block * bs, src_block * bs + num_tokens)
        dst = slice(dst_block * bs, dst_block * bs + num_tokens)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def check_free_list(self) -> None:
        """Raise AssertionError unless the free list holds each unreferenced block once."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        unreferenced = {b for b, n in enumerate(self._refs) if n == 0}
        assert free == unreferenced, f"free list != unreferenced blocks: {free ^ unreferenced}"
