"""The gateway's routing index: which workers hold which KV blocks, fed by worker events.

Contract
--------
`PrefixIndex` mirrors, in process memory, the prefix caches of every worker: a radix tree
of chained block hashes (`prefixgate.radix.OwnerIndex`, block_size=1) whose blocks carry
the set of worker ids holding them. It is pure Python with no I/O (no gRPC, no Redis):
the gateway's event feeds (gateway/feeds.py) and the replay simulator drive the same
methods.

Queries (no I/O, never blocks):
  match(block_hashes) -> PrefixMatch   per-worker cached prefix length in blocks (the
                                       longest run of leading blocks each worker holds),
                                       and whether the match ends at a *shared* prefix
                                       (see below)
Updates, one per worker event, fenced by the worker's epoch (an incarnation number that
grows on every registration of the same worker id):
  reset_worker(w, epoch)               a new incarnation: forget w's blocks
  stored(w, epoch, parent_hash, hs)    w now holds the chain hs; hs[0] extends the block
                                       `parent_hash` (None: a chain from the root)
  removed(w, epoch, hs) / cleared(w, epoch) / remove_worker(w)
An event carrying an epoch older than the one the index knows for `w` is ignored (a late
event of a dead incarnation never resurrects its blocks); a newer epoch resets `w` first.
A `stored` chain whose parent block is unknown here (evicted by `max_blocks`, or events
were missed) is dropped and counted in `num_orphan_events`: the feed's resynchronisation
(snapshot) repairs it.

Shared prefixes: a match that ends at a block which already has `spread_fanout` or more
distinct continuations in the index (other conversations branched off right there: a
shared system prompt) is reported `shared=True`; the router discounts such prefixes so
that they do not pull every new conversation onto the first worker that cached them
(docs/routing.md).

Memory: one radix block per distinct block hash any worker holds, so it is bounded by the
workers' total KV capacity (workers report evictions). `max_blocks` > 0 adds a hard cap
(least recently matched or stored blocks are dropped first).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prefixgate.radix import OwnerIndex

__all__ = ["PrefixIndex", "PrefixMatch"]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What the index knows about one prompt's blocks."""

    num_blocks: int  # leading blocks present in the index (held by someone)
    cached_blocks: dict[str, int]  # worker id -> leading blocks it holds (> 0 only)
    shared: bool  # the match ends where other conversations already branched off
    fanout: int  # distinct continuations stored below the match end


class _Tree(OwnerIndex):
    """OwnerIndex plus the lookups the event feed needs (path of a block, fan-out)."""

    def path_to(self, block_hash: int) -> array | None:
        """Hashes from the root to `block_hash` inclusive; None if it is not indexed."""
        node = self._where.get(block_hash)
        if node is None:
            return None
        parts = [node.key[: node.key.index(block_hash) + 1]]
        node = node.parent
        root = self._root
        while node is not None and node is not root:
            parts.append(node.key)
            node = node.parent
        if len(parts) == 1:
            return parts[0]
        out = array("Q")
        for part in reversed(parts):
            out += part
        return out

    def fanout(self, block_hash: int) -> int:
        """Distinct continuations stored right after `block_hash` (0 if unknown)."""
        node = self._where.get(block_hash)
        if node is None:
            return 0
        if node.key[-1] != block_hash:
            return 1  # inside a node: exactly one continuation
        return len(node.children) if node.children else 0


class PrefixIndex:
    """Worker ownership of KV blocks, for routing (see module docstring)."""

    def __init__(self, *, max_blocks: int = 0, spread_fanout: int = 2) -> None:
        if max_blocks < 0 or spread_fanout < 1:
            raise ValueError("max_blocks must be >= 0 and spread_fanout >= 1")
        self.max_blocks = max_blocks
        self.spread_fanout = spread_fanout
        self._tree = _Tree()
        self._epochs: dict[str, int] = {}
        self.num_orphan_events = 0  # stored chains dropped because their parent was unknown

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        """Distinct blocks indexed (each counted once, however many workers hold it)."""
        return self._tree.num_blocks

    def num_owned_blocks(self, worker_id: str) -> int:
        """Blocks `worker_id` holds according to the index."""
        return self._tree.num_owned_blocks(worker_id)

    def epoch_of(self, worker_id: str) -> int:
        """The epoch the index follows for `worker_id` (-1: unknown)."""
        return self._epochs.get(worker_id, -1)

    def workers(self) -> dict[str, int]:
        """Worker id -> the epoch the index follows for it."""
        return dict(self._epochs)

    def owners_of(self, block_hash: int) -> frozenset[str]:
        return self._tree.owners_of(block_hash)

    def match(self, block_hashes: Sequence[int]) -> PrefixMatch:
        """Per-worker cached prefix of `block_hashes` (a prompt's chained hashes)."""
        if not block_hashes:
            return PrefixMatch(0, {}, False, 0)
        m = self._tree.match_owners(block_hashes)
        if not m.num_blocks:
            return PrefixMatch(0, {}, False, 0)
        fanout = self._tree.fanout(block_hashes[m.num_blocks - 1])
        return PrefixMatch(m.num_blocks, m.run_blocks, fanout >= self.spread_fanout, fanout)

    # ------------------------------------------------------------------ updates

    def _current(self, worker_id: str, epoch: int) -> bool:
        """Fence: False for a stale epoch; a newer one resets the worker first."""
        known = self._epochs.get(worker_id)
        if known is None or epoch > known:
            if known is not None:
                self._tree.remove_owner(worker_id)
            self._epochs[worker_id] = epoch
            return True
        return epoch == known

    def reset_worker(self, worker_id: str, epoch: int) -> None:
        """Worker `worker_id` starts (again) under `epoch` with an empty cache."""
        if self._epochs.get(worker_id, -1) <= epoch:
            self._tree.remove_owner(worker_id)
            self._epochs[worker_id] = epoch

    def stored(self, worker_id: str, epoch: int, parent_hash: int | None,
               block_hashes: Sequence[int]) -> int:
        """Record the chain; returns blocks added to the index (0 if dropped)."""
        if not block_hashes or not self._current(worker_id, epoch):
            return 0
        if parent_hash is None:
            path: Sequence[int] = block_hashes
        else:
            prefix = self._tree.path_to(parent_hash)
            if prefix is None:
                self.num_orphan_events += 1
                return 0
            prefix.extend(block_hashes)
            path = prefix
        added = self._tree.add(path, worker_id)
        if self.max_blocks and self._tree.num_blocks > self.max_blocks:
            self._tree.evict(self._tree.num_blocks - self.max_blocks)
        return added

    def removed(self, worker_id: str, epoch: int, block_hashes: Iterable[int]) -> None:
        if self._current(worker_id, epoch):
            self._tree.discard(block_hashes, worker_id)

    def cleared(self, worker_id: str, epoch: int) -> None:
        if self._current(worker_id, epoch):
            self._tree.remove_owner(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker entirely (it left or was reaped)."""
        self._tree.remove_owner(worker_id)
        self._epochs.pop(worker_id, None)

    def clear(self) -> None:
        """Forget everything (before a rebuild from a snapshot)."""
        self._tree.clear(force=True)
        self._epochs.clear()
