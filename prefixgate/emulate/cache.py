"""The block cache of an emulated worker, shared by the emulated fleet and the simulator.

Contract: `BlockCache(capacity_blocks, sink)` holds chained block hashes in a `RadixTree`
(each block's value is its own hash), least recently used leaves evicted first, and
reports every change to `sink` (a `KVEventSink`) as a real worker's prefix cache does:
`stored(parent, new hashes)` for the blocks new to it, `removed(hashes)` for evicted ones.

  held(hashes)           leading blocks held now, without touching them
  expected(hashes)       leading blocks held now or reserved, without touching them (a
                         queued request's expected hit when its prefill starts)
  reserve(hashes) / unreserve(hashes)
                         blocks a request queued or in prefill will store before the
                         requests queued behind it start (publish at prefill end): they
                         count in `expected`, so a burst of prompts sharing a new prefix is
                         counted as one prefill of it, not one per prompt (reference
                         counted; a reserved block is not held and is never evicted or
                         published by this)
  acquire(hashes)        leading blocks held now, touched and locked for a request:
                         (handle, number of blocks)
  store(handle, hashes)  the request computed `hashes` (a prefix path): insert them, keep
                         them locked for the request instead of `handle`, publish the new
                         ones, evict down to the capacity; returns the new handle
  release(handle)        the request ended: unlock, evict down to the capacity
  flush()                drop every unlocked block (`cleared` when nothing stays)

Locked blocks are never evicted, so a cache may exceed its capacity while requests run;
`overflow_blocks` is the most it ever did. Not thread-safe: one loop or one simulation.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixgate.radix import Node, RadixTree
from prefixgate.wire.events import KVEventSink, NullSink

__all__ = ["BlockCache"]


class BlockCache:
    def __init__(self, capacity_blocks: int, sink: KVEventSink | None = None) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.sink = sink or NullSink()
        self.tree: RadixTree[int] = RadixTree(1)
        self.overflow_blocks = 0
        self._reserved: dict[int, int] = {}  # block hash -> requests that will store it

    @property
    def num_blocks(self) -> int:
        return self.tree.num_blocks

    def held(self, hashes: Sequence[int]) -> int:
        return self.tree.match(hashes, touch=False).num_blocks

    def expected(self, hashes: Sequence[int]) -> int:
        n = self.tree.match(hashes, touch=False).num_blocks
        reserved = self._reserved
        while n < len(hashes) and hashes[n] in reserved:
            n += 1
        return n

    def reserve(self, hashes: Sequence[int]) -> None:
        reserved = self._reserved
        for h in hashes:
            reserved[h] = reserved.get(h, 0) + 1

    def unreserve(self, hashes: Sequence[int]) -> None:
        reserved = self._reserved
        for h in hashes:
            n = reserved[h] - 1
            if n:
                reserved[h] = n
            else:
                del reserved[h]

    def acquire(self, hashes: Sequence[int]) -> tuple[Node[int], int]:
        m = self.tree.match(hashes)
        self.tree.lock(m.node)
        return m.node, m.num_blocks

    def store(self, handle: Node[int] | None, hashes: Sequence[int]) -> Node[int] | None:
        if not hashes:
            return handle
        r = self.tree.insert(hashes, hashes)
        self.tree.lock(r.node)
        if handle is not None:
            self.tree.unlock(handle)
        m = r.num_cached_blocks
        if r.num_new_blocks:
            self.sink.stored(hashes[m - 1] if m else None, hashes[m:])
        self._evict()
        return r.node

    def release(self, handle: Node[int] | None) -> None:
        if handle is not None:
            self.tree.unlock(handle)
        self._evict()

    def flush(self) -> int:
        """Drop every unlocked block; returns how many were dropped."""
        if self.tree.num_locked_blocks == 0:
            n = len(self.tree.clear())
            self.sink.cleared()
            return n
        gone = self.tree.evict(self.tree.num_evictable_blocks)
        if gone:
            self.sink.removed(gone)
        return len(gone)

    def _evict(self) -> None:
        over = self.tree.num_blocks - self.capacity_blocks
        if over > 0:
            gone = self.tree.evict(over)
            if gone:
                self.sink.removed(gone)
            self.overflow_blocks = max(self.overflow_blocks, over - len(gone))
