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
  duplicate computed concurrently) have the caller's reference released. Emits `stored`
  for the new ones, calls `on_insert(new block ids)` when set (block transfer records
  their page digests: worker/kv_transfer.py) and returns the handle of the whole path
  (not locked).
- `hot_chains()`: every cached root-to-leaf chain of block hashes, the most reused first
  (by the tokens its blocks served as hits: each `match` counts its matched blocks), for
  a draining worker's hand-off (workerapi/handoff.py).
- `evict(num_blocks)` frees up to that many unlocked blocks, least recently used leaves
  first, emitting `removed`; `flush()` drops every unlocked block (`cleared` when the
  tree ends up empty) and returns the number of tokens it dropped.
- Tails: a finished request's last, partial block (fewer than block_size tokens) is kept
  too, keyed by the hash of the full block before it (or the namespace's root hash).
  Without it every turn would recompute up to block_size - 1 tokens of the previous
  turn; with it, turn N+1 reuses all of turn N that was computed. A tail is never shared
  in place: `match_tail` tells the caller how many of its tokens match, and the caller
  copies those slots into a block of its own (copy-on-write of < block_size tokens).
  Tails are worker-local (gateways route on full blocks) and are evicted first, LRU.
All calls happen on the engine thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from prefixgate.radix import Node, RadixTree
from prefixgate.wire.events import KVEventSink, NullSink
from prefixgate.worker.kv_pool import KVPool


class PrefixCache:
    def __init__(self, pool: KVPool, events: KVEventSink | None = None) -> None:
        self.pool = pool
        self.events = events or NullSink()
        self.tree: RadixTree[int] = RadixTree(block_size=1)
        self._hash_of: dict[int, int] = {}  # block id -> block hash, for blocks in the tree
        self._hits: dict[int, int] = {}  # block id -> times matched since it was stored
        # parent block hash -> (tokens of the partial block, its block id); LRU order.
        self._tails: OrderedDict[int, tuple[tuple[int, ...], int]] = OrderedDict()
        self.on_insert: Callable[[Sequence[int]], None] | None = None

    @property
    def num_blocks(self) -> int:
        return self.tree.num_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks `evict` can drop now: unlocked tree blocks and every tail."""
        return self.tree.num_evictable_blocks + len(self._tails)

    def match(self, block_hashes: Sequence[int]) -> tuple[Node[int], list[int]]:
        m = self.tree.match(block_hashes)
        self.tree.lock(m.node)
        self.pool.ref(m.values)
        hits = self._hits
        for b in m.values:
            hits[b] = hits.get(b, 0) + 1
        return m.node, list(m.values)

    def hot_chains(self) -> list[list[int]]:
        scored = [(sum(self._hits.get(b, 0) for b in ids), len(ids), list(hashes))
                  for hashes, ids in self.tree.items()]
        scored.sort(key=lambda t: (-t[0], -t[1]))
        return [chain for _, _, chain in scored]

    def unlock(self, handle: Node[int]) -> None:
        self.tree.unlock(handle)

    def insert(self, block_hashes: Sequence[int], block_ids: Sequence[int]) -> Node[int] | None:
        if not block_hashes:
            return None
        r = self.tree.insert(block_hashes, block_ids)
        m = r.num_cached_blocks
        self.pool.release(block_ids[:m])
        for h, b in zip(block_hashes[m:], block_ids[m:], strict=True):
            self._hash_of[b] = h
        if m < len(block_hashes):
            if self.on_insert is not None:
                self.on_insert(block_ids[m:])
            self.events.stored(block_hashes[m - 1] if m else None, block_hashes[m:])
        return r.node

    def store_tail(self, parent_hash: int, tokens: Sequence[int], block_id: int) -> None:
        """Keep `block_id` (holding `tokens`, fewer than a block) as the tail after
        `parent_hash`; takes the caller's reference. Replaces an older tail there."""
        old = self._tails.pop(parent_hash, None)
        if old is not None:
            self.pool.release([old[1]])
        self._tails[parent_hash] = (tuple(tokens), block_id)

    def match_tail(self, parent_hash: int, tokens: Sequence[int]) -> tuple[int, int]:
        """(block id, number of leading `tokens` it holds) of the tail after
        `parent_hash`; (-1, 0) when there is none or nothing matches."""
        tail = self._tails.get(parent_hash)
        if tail is None:
            return -1, 0
        stored, block_id = tail
        n = 0
        for a, b in zip(stored, tokens, strict=False):  # at most block_size - 1 tokens
            if a != b:
                break
            n += 1
        if n:
            self._tails.move_to_end(parent_hash)
        return block_id, n

    def evict(self, num_blocks: int) -> int:
        """Free up to `num_blocks` blocks, tails first; returns how many were freed."""
        freed = 0
        while self._tails and freed < num_blocks:
            self.pool.release([self._tails.popitem(last=False)[1][1]])
            freed += 1
        ids = self.tree.evict(num_blocks - freed)
        if ids:
            hashes = [self._hash_of.pop(b) for b in ids]
            for b in ids:
                self._hits.pop(b, None)
            for h in hashes:  # a tail after an evicted block can never match again
                tail = self._tails.pop(h, None)
                if tail is not None:
                    self.pool.release([tail[1]])
            self.events.removed(hashes)
            self.pool.release(ids)
        return freed + len(ids)

    def flush(self) -> int:
        """Drop every unlocked block and every tail; returns the number of cached tokens
        dropped (block_size per full block, a tail's own length per tail)."""
        tail_tokens = sum(len(tokens) for tokens, _ in self._tails.values())
        self.pool.release([b for _, b in self._tails.values()])
        self._tails.clear()
        if self.tree.num_locked_blocks == 0:
            ids = self.tree.clear()
            self._hash_of.clear()
            self._hits.clear()
            self.pool.release(ids)
            self.events.cleared()
            num_blocks = len(ids)
        else:
            num_blocks = self.evict(self.tree.num_evictable_blocks)
        return num_blocks * self.pool.config.block_size + tail_tokens

    def referenced_blocks(self) -> list[int]:
        """Every block the cache holds a pool reference on (tree blocks and tails), once
        per reference; for integrity checks."""
        assert len(self._hash_of) == self.tree.num_blocks, "block index out of step with the tree"
        return [*self._hash_of, *(b for _, b in self._tails.values())]
