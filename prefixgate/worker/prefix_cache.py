"""The worker's prefix cache: radix tree of block hashes -> KV block ids, over the pool.

Contract
--------
Keys are chained block hashes (`prefixgate.radix.BlockHasher`, salted with the model
fingerprint and the request's namespace), one per full block, so one tree serves every
namespace without sharing across them, and the keys are exactly what the gateway hashes
and what events carry. The tree holds one pool reference on each block it contains.

- `match(block_hashes)` -> (handle, block ids of the longest cached prefix); the handle is
  locked (its blocks cannot be evicted) and the caller gets one extra reference on each
  block. `unlock(handle)` when done.
- `insert(block_hashes, block_ids)` hands the caller's references on `block_ids` to the
  cache: blocks new to the tree are kept; blocks already present (the same id, or a
  duplicate computed concurrently) have the caller's reference released. Emits `stored`.
- `evict(num_blocks)` frees up to that many unlocked blocks, least recently used leaves
  first, emitting `removed`; `flush()` drops every unlocked block (`cleared` when the
  tree ends up empty).
All calls happen on the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixgate.events import KVEventSink, NullSink
from prefixgate.radix import Node, RadixTree
from prefixgate.worker.kv_pool import KVPool


class PrefixCache:
    def __init__(self, pool: KVPool, events: KVEventSink | None = None) -> None:
        self.pool = pool
        self.events = events or NullSink()
        self.tree: RadixTree[int] = RadixTree(block_size=1)
        self._hash_of: dict[int, int] = {}  # block id -> block hash, for blocks in the tree

    @property
    def num_blocks(self) -> int:
        return self.tree.num_blocks

    @property
    def num_evictable_blocks(self) -> int:
        return self.tree.num_evictable_blocks

    def match(self, block_hashes: Sequence[int]) -> tuple[Node[int], list[int]]:
        m = self.tree.match(block_hashes)
        self.tree.lock(m.node)
        self.pool.ref(m.values)
        return m.node, list(m.values)

    def unlock(self, handle: Node[int]) -> None:
        self.tree.unlock(handle)

    def insert(self, block_hashes: Sequence[int], block_ids: Sequence[int]) -> None:
        if not block_hashes:
            return
        r = self.tree.insert(block_hashes, block_ids)
        m = r.num_cached_blocks
        self.pool.release(block_ids[:m])
        for h, b in zip(block_hashes[m:], block_ids[m:], strict=True):
            self._hash_of[b] = h
        if m < len(block_hashes):
            self.events.stored(block_hashes[m - 1] if m else None, block_hashes[m:])

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks; returns how many were freed."""
        ids = self.tree.evict(num_blocks)
        if ids:
            self.events.removed([self._hash_of.pop(b) for b in ids])
            self.pool.release(ids)
        return len(ids)

    def flush(self) -> int:
        """Drop every unlocked block; returns the number dropped."""
        if self.tree.num_locked_blocks == 0:
            ids = self.tree.clear()
            self._hash_of.clear()
            self.pool.release(ids)
            self.events.cleared()
            return len(ids)
        return self.evict(self.tree.num_evictable_blocks)
