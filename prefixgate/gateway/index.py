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
                                       `parent_hash` (None: a chain from the root), and
                                       with it the path to that parent: an engine extends
                                       only a prefix it holds, so an ancestor an earlier
                                       `removed` named is held by w again
  removed(w, epoch, hs) / cleared(w, epoch) / remove_worker(w)
An event carrying an epoch older than the one the index knows for `w` is ignored (a late
event of a dead incarnation never resurrects its blocks); a newer epoch resets `w` first.
A `stored` chain whose parent block is unknown here (evicted by `max_blocks`, or events
were missed) is dropped and counted in `num_orphan_events`: the feed's resynchronisation
(snapshot) repairs it.

Predicted ownership: between routing a turn and the chosen worker's `stored` event (its
prefill, then event batching and delivery) the index would not know where the prompt's
blocks are going. `predict(w, hs)` records them at once as *expected* on `w` (those `w`
does not already hold), until one of:
  * a `stored` event of `w` naming the block: confirmed (counted in `num_confirmed_blocks`);
  * a `removed` naming it, `cleared`, a new epoch of `w`, `remove_worker`, or
    `drop_predictions(w)` (the gateway saw `w` fail): dropped, events always win;
  * `prediction_ttl_s` seconds on `clock` without confirmation: expired (counted in
    `num_expired_blocks`).
`match` reports per worker both its certain run (`cached_blocks`, events only) and its
expected run (`expected_blocks`: leading blocks held or expected, >= the certain run).
`prediction_confidence` is the measured share of predicted blocks that events later
confirmed (Laplace-smoothed): the router credits expected blocks at that weight.
Predicted blocks live in the same tree under a separate owner key per worker, so a
`stored` chain may extend a predicted parent (chained hashes name their whole prefix).

Shared prefixes: a match that ends at a block which already has `spread_fanout` or more
distinct continuations in the index (other conversations branched off right there: a
shared system prompt) is reported `shared=True`; the router discounts such prefixes so
that they do not pull every new conversation onto the first worker that cached them
(docs/routing.md).

Memory: one radix block per distinct block hash any worker holds, so it is bounded by the
workers' total KV capacity (workers report evictions). `max_blocks` > 0 adds a hard cap
(least recently matched or stored blocks are dropped first; an expected block dropped so
is no longer expected, and counts as neither confirmed nor expired).
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from prefixgate.radix import OwnerIndex
from prefixgate.radix.owners import owner_runs

__all__ = ["PrefixIndex", "PrefixMatch"]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What the index knows about one prompt's blocks."""

    num_blocks: int  # leading blocks present in the index (held or expected by someone)
    cached_blocks: dict[str, int]  # worker id -> leading blocks it holds (> 0 only; events)
    shared: bool  # the match ends where other conversations already branched off
    fanout: int  # distinct continuations stored below the match end
    # worker id -> leading blocks it holds or is expected to hold (>= cached_blocks)
    expected_blocks: dict[str, int] = field(default_factory=dict)


class _Expected:
    """The owner key of one worker's *expected* blocks in the tree (one object per worker,
    compared by identity: never equal to the worker id, a str, that owns certain blocks)."""

    __slots__ = ("worker_id", "_hash")

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._hash = hash(("expected", worker_id))

    def __hash__(self) -> int:
        return self._hash


class _Tree(OwnerIndex):
    """OwnerIndex plus the lookups the event feed needs (path of a block, fan-out), and
    the expected blocks an `evict` dropped (`evict_expected`)."""

    _evicted: list[tuple[str, int]] | None = None  # (worker id, block) while evicting

    def evict_expected(self, num_blocks: int) -> list[tuple[str, int]]:
        """`evict`; returns (worker id, block) for each *expected* block it dropped."""
        self._evicted = []
        try:
            self.evict(num_blocks)
            return self._evicted
        finally:
            self._evicted = None

    def _on_drop(self, node, start: int) -> None:
        if self._evicted is not None:
            for h, owners in zip(node.key[start:], node.values[start:], strict=True):
                self._evicted.extend((o.worker_id, h) for o in owners if type(o) is _Expected)
        super()._on_drop(node, start)

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

    def take_over(self, path: Sequence[int], num_blocks: int, old: object) -> list[int]:
        """Remove owner `old` from the last `num_blocks` blocks of the indexed path `path`,
        which another owner also holds (`add` just gave them to it: no block is left
        ownerless, none is dropped). Returns the blocks that listed `old`. One walk up
        from the path's end with C loops per block, no hash-wide lookup per block."""
        node = self._where[path[-1]]
        key = node.key
        end = len(key) if key[-1] == path[-1] else key.index(path[-1]) + 1
        gone = frozenset((old,))
        hit = self._change_path(node, end, num_blocks, lambda s: old in s, lambda s: s - gone)
        held = self._by_owner.get(old)
        if hit and held is not None:
            held.difference_update(hit)
            if not held:
                del self._by_owner[old]
        return hit

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

    def __init__(self, *, max_blocks: int = 0, spread_fanout: int = 2,
                 prediction_ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_blocks < 0 or spread_fanout < 1 or prediction_ttl_s < 0:
            raise ValueError("max_blocks and prediction_ttl_s must be >= 0, spread_fanout >= 1")
        self.max_blocks = max_blocks
        self.spread_fanout = spread_fanout
        self.prediction_ttl_s = prediction_ttl_s
        self.clock = clock
        self._tree = _Tree()
        self._epochs: dict[str, int] = {}
        self.num_orphan_events = 0  # stored chains dropped because their parent was unknown
        # Predictions: worker -> {block: expiry}, and (expiry, worker, blocks) in time order.
        self._expected: dict[str, dict[int, float]] = {}
        self._expiries: deque[tuple[float, str, Sequence[int]]] = deque()
        self._keys: dict[str, _Expected] = {}
        self._holders: dict[frozenset, frozenset] = {}  # owner set -> workers (held or expected)
        self._certain: dict[frozenset, frozenset] = {}  # owner set -> workers holding (events)
        self.num_predicted_blocks = 0
        self.num_confirmed_blocks = 0
        self.num_expired_blocks = 0

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

    def num_expected_blocks(self, worker_id: str | None = None) -> int:
        """Blocks expected (predicted, not yet confirmed) on `worker_id` (None: all)."""
        if worker_id is not None:
            return len(self._expected.get(worker_id, ()))
        return sum(len(e) for e in self._expected.values())

    @property
    def prediction_confidence(self) -> float:
        """Share of predicted blocks that a `stored` event confirmed, of those decided
        (confirmed or expired), with one success and one failure as prior."""
        return (self.num_confirmed_blocks + 1) / (
            self.num_confirmed_blocks + self.num_expired_blocks + 2)

    def match(self, block_hashes: Sequence[int]) -> PrefixMatch:
        """Per-worker cached (events) and expected (events + predictions) prefix of
        `block_hashes` (a prompt's chained hashes)."""
        if not block_hashes:
            return PrefixMatch(0, {}, False, 0)
        self.expire_predictions()
        res = self._tree.match(block_hashes)
        if not res.num_blocks:
            return PrefixMatch(0, {}, False, 0)
        sets = res.values
        cached = owner_runs(sets, self._certain_of if self._expected else None)
        expected = owner_runs(sets, self._holders_of) if self._expected else cached
        cached = {w: n for w, n in cached.items() if n}
        fanout = self._tree.fanout(block_hashes[res.num_blocks - 1])
        return PrefixMatch(res.num_blocks, cached, fanout >= self.spread_fanout, fanout,
                           expected)

    def _holders_of(self, owners: frozenset) -> frozenset:
        h = self._holders.get(owners)
        if h is None:
            if len(self._holders) > 65536:
                self._holders.clear()
            h = self._holders[owners] = frozenset(
                o if type(o) is str else o.worker_id for o in owners)
        return h

    def _certain_of(self, owners: frozenset) -> frozenset:
        h = self._certain.get(owners)
        if h is None:
            if len(self._certain) > 65536:
                self._certain.clear()
            h = self._certain[owners] = frozenset(o for o in owners if type(o) is str)
        return h

    # ------------------------------------------------------------------ predictions

    def _key(self, worker_id: str) -> _Expected:
        k = self._keys.get(worker_id)
        if k is None:
            k = self._keys[worker_id] = _Expected(worker_id)
        return k

    def predict(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """`worker_id` is about to cache the chain `block_hashes` (from the root): record
        the blocks it does not hold as expected there. Returns how many were new
        predictions (0 without a TTL: predictions are off)."""
        if not block_hashes or not self.prediction_ttl_s:
            return 0
        self.expire_predictions()
        # One walk of the path's tree nodes (C loops per block: a fresh 12k-token prompt
        # is 768 blocks of 16 tokens, a next turn's prompt mostly blocks it holds).
        todo = self._tree.add_unheld(block_hashes, self._key(worker_id), worker_id)
        if not todo:
            return 0
        expiry = self.clock() + self.prediction_ttl_s
        mine = self._expected.setdefault(worker_id, {})
        before = len(mine)
        mine.update(dict.fromkeys(todo, expiry))  # a chain's hashes are distinct
        new = len(mine) - before
        self._expiries.append((expiry, worker_id, todo))
        self._cap()
        self.num_predicted_blocks += new
        return new

    def _cap(self) -> None:
        """Evict down to `max_blocks`; evicted expected blocks are no longer expected."""
        if not self.max_blocks or self._tree.num_blocks <= self.max_blocks:
            return
        for wid, h in self._tree.evict_expected(self._tree.num_blocks - self.max_blocks):
            mine = self._expected.get(wid)
            if mine is not None and mine.pop(h, None) is not None and not mine:
                del self._expected[wid]

    def expire_predictions(self) -> int:
        """Drop predictions older than the TTL; returns the blocks expired."""
        q = self._expiries
        if not q:
            return 0
        now = self.clock()
        gone = 0
        while q and q[0][0] <= now:
            _, wid, hashes = q.popleft()
            mine = self._expected.get(wid)
            if not mine:
                continue
            # Those still expected (confirmed ones are gone): found in C, then checked.
            stale = [h for h in mine.keys() & hashes if mine[h] <= now]
            for h in stale:
                del mine[h]
            if not mine:
                del self._expected[wid]
            if stale:
                self._tree.discard(stale, self._key(wid))
                gone += len(stale)
        self.num_expired_blocks += gone
        return gone

    def expected_workers(self) -> set[str]:
        """Workers with blocks expected (predicted, not yet confirmed)."""
        return set(self._expected)

    def drop_predictions(self, worker_id: str) -> None:
        """Forget what `worker_id` was expected to store (it failed, restarted or left).
        Not counted against the confidence: the routing, not the prediction, failed."""
        if self._expected.pop(worker_id, None) is not None:
            self._tree.remove_owner(self._key(worker_id))

    def _unexpect(self, worker_id: str, block_hashes: Iterable[int]) -> None:
        """`worker_id` is no longer expected to hold these blocks (a `removed` event)."""
        mine = self._expected.get(worker_id)
        if not mine:
            return
        hit = mine.keys() & block_hashes  # once each; a C loop over block_hashes
        if not hit:
            return
        if len(hit) == len(mine):
            del self._expected[worker_id]
        else:
            deque(map(mine.__delitem__, hit), maxlen=0)
        self._tree.discard(hit, self._key(worker_id))

    # ------------------------------------------------------------------ updates

    def _current(self, worker_id: str, epoch: int) -> bool:
        """Fence: False for a stale epoch; a newer one resets the worker first."""
        known = self._epochs.get(worker_id)
        if known is None or epoch > known:
            if known is not None:
                self._tree.remove_owner(worker_id)
                self.drop_predictions(worker_id)
            self._epochs[worker_id] = epoch
            return True
        return epoch == known

    def reset_worker(self, worker_id: str, epoch: int) -> None:
        """Worker `worker_id` starts (again) under `epoch` with an empty cache."""
        if self._epochs.get(worker_id, -1) <= epoch:
            self._tree.remove_owner(worker_id)
            self.drop_predictions(worker_id)
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
        mine = self._expected.get(worker_id)
        if mine:  # confirm: the chain's blocks expected there are held now
            hit = self._tree.take_over(path, len(block_hashes), self._key(worker_id))
            if hit:
                deque(map(mine.pop, hit, repeat(None)), maxlen=0)
                if not mine:
                    del self._expected[worker_id]
                self.num_confirmed_blocks += len(hit)
        self._cap()
        return added

    def removed(self, worker_id: str, epoch: int, block_hashes: Iterable[int]) -> None:
        if self._current(worker_id, epoch):
            hs = block_hashes if isinstance(block_hashes, Sequence) else list(block_hashes)
            self._tree.discard(hs, worker_id)
            self._unexpect(worker_id, hs)

    def cleared(self, worker_id: str, epoch: int) -> None:
        if self._current(worker_id, epoch):
            self._tree.remove_owner(worker_id)
            self.drop_predictions(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker entirely (it left or was reaped)."""
        self._tree.remove_owner(worker_id)
        self.drop_predictions(worker_id)
        self._epochs.pop(worker_id, None)

    def clear(self) -> None:
        """Forget everything (before a rebuild from a snapshot); predictions too."""
        self._tree.clear(force=True)
        self._epochs.clear()
        self._expected.clear()
        self._expiries.clear()
        self._holders.clear()
        self._certain.clear()

