"""The gateway's routing index: which workers hold which KV blocks, fed by worker events.

Contract
--------
`PrefixIndex` mirrors, in process memory, the prefix caches of every worker: for each
chained block hash (a hash names its whole prefix, so it is one node of the prefix tree)
an owners bitmask, its parent block and its number of child blocks, in three flat dicts.
It is pure Python with no I/O (no gRPC, no Redis): the gateway's event feeds
(gateway/feeds.py) and the replay simulator drive the same methods.

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
Predicted blocks live in the same maps under a second bit per worker, so a `stored` chain
may extend a predicted parent (chained hashes name their whole prefix).

Shared prefixes: a match that ends at a block which already has `spread_fanout` or more
distinct continuations in the index (other conversations branched off right there: a
shared system prompt) is reported `shared=True`; the router discounts such prefixes so
that they do not pull every new conversation onto the first worker that cached them
(docs/routing.md).

Memory: one entry per distinct block hash any worker holds or is expected to hold (and
the ownerless blocks on the paths to them), so it is bounded by the workers' total KV
capacity (workers report evictions). `max_blocks` > 0 adds a hard cap (least recently
matched or stored leaf blocks are dropped first; an expected block dropped so is no longer
expected, and counts as neither confirmed nor expired).

Cost (why flat maps, not a tree of nodes): every update and lookup is a dict operation per
block, run in C loops (`map`, `dict.update`, `itertools.accumulate`) wherever the blocks of
a chain are handled alike; Python code runs per distinct owners bitmask (a handful per
prompt), never per block of a common case. A `stored` event costs its own blocks, not
the path to its parent; a `match` is one C pass per step over the prompt's hashes; the
per-block objects are ints (interned bitmasks), not nodes.

Layout: worker slot i (`_slots`) owns bit 2i (holds the block: events) and bit 2i + 1
(expected there: a prediction); a block's owners bitmask is 0 when only its descendants
are owned. A block is resident while its bitmask is non-zero or it has children; a leaf
that loses its last owner is dropped at once, and then its parent if that became an
ownerless leaf (the invariant every update keeps).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain, compress, repeat
from operator import and_

__all__ = ["PrefixIndex", "PrefixMatch"]

_NONE = frozenset()


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What the index knows about one prompt's blocks."""

    num_blocks: int  # leading blocks present in the index (held or expected by someone)
    cached_blocks: dict[str, int]  # worker id -> leading blocks it holds (> 0 only; events)
    shared: bool  # the match ends where other conversations already branched off
    fanout: int  # distinct continuations stored below the match end
    # worker id -> leading blocks it holds or is expected to hold (>= cached_blocks)
    expected_blocks: dict[str, int] = field(default_factory=dict)


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
        self._mask: dict[int, int] = {}  # block -> owners bitmask (module docstring)
        self._parent: dict[int, int | None] = {}  # block -> its parent block (None: root)
        self._kids: dict[int, int] = {}  # block -> number of child blocks
        # Least recently used first; kept only under a cap (max_blocks).
        self._lru: OrderedDict[int, None] | None = OrderedDict() if max_blocks else None
        self._slots: dict[str, int] = {}  # worker id -> slot
        self._ids: list[str | None] = []  # slot -> worker id (None: free)
        self._held: dict[str, set[int]] = {}  # worker -> blocks it holds (events)
        self._epochs: dict[str, int] = {}
        self.num_orphan_events = 0  # stored chains dropped because their parent was unknown
        # Predictions: worker -> {block: expiry}, and (expiry, worker, blocks) in time order.
        self._expected: dict[str, dict[int, float]] = {}
        self._expiries: deque[tuple[float, str, Sequence[int]]] = deque()
        self._interned: dict[int, int] = {}  # bitmask -> one int object for it
        self._even = 0  # bit 2i of every slot i in use
        self._version = 0  # grows on every change of a mask (the scan cache's key)
        self._last_scan: tuple | None = None
        self.num_predicted_blocks = 0
        self.num_confirmed_blocks = 0
        self.num_expired_blocks = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        """Distinct blocks indexed (each counted once, however many workers hold it)."""
        return len(self._mask)

    def num_owned_blocks(self, worker_id: str) -> int:
        """Blocks `worker_id` holds according to the index."""
        return len(self._held.get(worker_id, ()))

    def epoch_of(self, worker_id: str) -> int:
        """The epoch the index follows for `worker_id` (-1: unknown)."""
        return self._epochs.get(worker_id, -1)

    def workers(self) -> dict[str, int]:
        """Worker id -> the epoch the index follows for it."""
        return dict(self._epochs)

    def owners_of(self, block_hash: int) -> frozenset[str]:
        """Workers holding `block_hash` (events; empty if unknown)."""
        m = self._mask.get(block_hash)
        return frozenset(self._workers_in(m & self._even)) if m else _NONE

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
        n, masks, distinct = self._scan(block_hashes)
        if not n:
            return PrefixMatch(0, {}, False, 0)
        if self._lru is not None:
            self._touch(block_hashes[:n])
        cached = self._runs(masks, distinct)
        if self._expected:
            # Holder bit 2i: bit 2i (holds) or bit 2i + 1 (expected); once per distinct mask.
            holder = {m: self._intern(m | m >> 1) for m in distinct}
            expected = self._runs(masks, dict.fromkeys(holder.values()), holder)
        else:
            expected = cached
        fanout = self._kids[block_hashes[n - 1]]
        return PrefixMatch(n, cached, fanout >= self.spread_fanout, fanout, expected)

    def _scan(self, hs: Sequence[int]) -> tuple[int, list[int], dict[int, None]]:
        """(n, masks, distinct): the leading blocks of the chain `hs` that are indexed,
        their bitmasks and the distinct ones (in order). A resident block's parent is
        resident, so n is found by bisection; the masks cost one C pass. The last scan is
        kept for the same `hs` object until the index changes (a turn's `predict` follows
        its `match`)."""
        last = self._last_scan
        if (last is not None and last[0] is hs and last[1] == self._version
                and last[2] == len(hs)):  # the same, unchanged chain object
            return last[3]
        mask = self._mask
        lo, hi = 0, len(hs)  # hs[:lo] indexed, hs[hi:] not
        if hs[-1] in mask:
            lo = hi
        while lo < hi:
            mid = (lo + hi) // 2
            if hs[mid] in mask:
                lo = mid + 1
            else:
                hi = mid
        n = lo
        masks = list(map(mask.__getitem__, hs[:n] if n < len(hs) else hs))
        # Interned masks: one object along a path held alike, counted by identity in C.
        if n and masks.count(masks[0]) == n:
            distinct = {masks[0]: None}
        else:
            distinct = dict.fromkeys(masks)
        out = (n, masks, distinct)
        self._last_scan = (hs, self._version, len(hs), out)
        return out

    def _runs(self, masks: list[int], distinct: dict[int, None],
              view: dict[int, int] | None = None) -> dict[str, int]:
        """Worker -> leading blocks whose mask (through `view`, if given) has its even
        bit (> 0 only); `distinct`: the distinct masks (through `view`). The running AND of the masks is monotone: one C pass for it, then
        a bisection per change (at most one per worker)."""
        first = masks[0] if view is None else view[masks[0]]
        alive = first & self._even
        if not alive:
            return {}
        n = len(masks)
        if len(distinct) == 1:
            return dict.fromkeys(self._workers_in(alive), n)
        seq = masks if view is None else list(map(view.__getitem__, masks))
        acc = list(accumulate(seq, and_))
        runs: dict[str, int] = {}
        lo = 0
        while alive:
            a = alive
            i = bisect_left(acc, True, lo, n, key=lambda v: v & a != a)
            if i == n:
                break
            lost = alive & ~acc[i]
            for w in self._workers_in(lost):
                runs[w] = i
            alive &= acc[i]
            lo = i
        for w in self._workers_in(alive):
            runs[w] = n
        return runs

    def _workers_in(self, bits: int) -> Iterable[str]:
        """The workers whose slot's even bit is set in `bits`."""
        ids = self._ids
        while bits:
            low = bits & -bits
            yield ids[(low.bit_length() - 1) >> 1]  # type: ignore[misc]
            bits ^= low

    # ------------------------------------------------------------------ predictions

    def predict(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """`worker_id` is about to cache the chain `block_hashes` (from the root): record
        the blocks it does not hold as expected there. Returns how many were new
        predictions (0 without a TTL: predictions are off)."""
        if not block_hashes or not self.prediction_ttl_s:
            return 0
        self.expire_predictions()
        bit = 1 << 2 * self._slot(worker_id)
        ebit = bit << 1
        hs = block_hashes
        k, masks, distinct = self._scan(hs)  # blocks k.. are new to the index
        todo: list[int] = []
        if k:
            lacks = {m: not m & bit for m in distinct}
            if any(lacks.values()):
                known = hs[:k] if k < len(hs) else hs
                if len(distinct) == 1:
                    todo = list(known)
                    self._mask.update(zip(todo, repeat(self._intern(masks[0] | ebit))))
                else:
                    todo = list(compress(known, map(lacks.__getitem__, masks)))
                    new = {m: self._intern(m | ebit) for m, lack in lacks.items() if lack}
                    self._mask.update(zip(todo, map(new.__getitem__, compress(
                        masks, map(lacks.__getitem__, masks))), strict=True))
                self._version += 1
        if k < len(hs):
            tail = hs[k:]
            self._insert(hs[k - 1] if k else None, tail, ebit)
            todo += tail
        if self._lru is not None:
            self._touch(hs)
        if not todo:
            return 0
        expiry = self.clock() + self.prediction_ttl_s
        mine = self._expected.setdefault(worker_id, {})
        before = len(mine)
        mine.update(dict.fromkeys(todo, expiry))  # a chain's hashes are distinct
        new_count = len(mine) - before
        self._expiries.append((expiry, worker_id, todo))
        self._cap()
        self.num_predicted_blocks += new_count
        return new_count

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
                self._clear_bits(stale, 2 << 2 * self._slots[wid])
                gone += len(stale)
        self.num_expired_blocks += gone
        return gone

    def expected_workers(self) -> set[str]:
        """Workers with blocks expected (predicted, not yet confirmed)."""
        return set(self._expected)

    def drop_predictions(self, worker_id: str) -> None:
        """Forget what `worker_id` was expected to store (it failed, restarted or left).
        Not counted against the confidence: the routing, not the prediction, failed."""
        mine = self._expected.pop(worker_id, None)
        if mine is not None:
            self._clear_bits(mine.keys(), 2 << 2 * self._slots[worker_id])

    # ------------------------------------------------------------------ updates

    def _current(self, worker_id: str, epoch: int) -> bool:
        """Fence: False for a stale epoch; a newer one resets the worker first."""
        known = self._epochs.get(worker_id)
        if known is None or epoch > known:
            if known is not None:
                self._forget_held(worker_id)
                self.drop_predictions(worker_id)
            self._epochs[worker_id] = epoch
            return True
        return epoch == known

    def reset_worker(self, worker_id: str, epoch: int) -> None:
        """Worker `worker_id` starts (again) under `epoch` with an empty cache."""
        if self._epochs.get(worker_id, -1) <= epoch:
            self._forget_held(worker_id)
            self.drop_predictions(worker_id)
            self._epochs[worker_id] = epoch

    def stored(self, worker_id: str, epoch: int, parent_hash: int | None,
               block_hashes: Sequence[int]) -> int:
        """Record the chain; returns blocks added to the index (0 if dropped)."""
        if not block_hashes or not self._current(worker_id, epoch):
            return 0
        mask = self._mask
        if parent_hash is not None and parent_hash not in mask:
            self.num_orphan_events += 1
            return 0
        bit = 1 << 2 * self._slot(worker_id)
        ebit = bit << 1
        hs = block_hashes
        masks = list(map(mask.get, hs))
        try:
            k = masks.index(None)  # blocks k.. are new (a new block's children are new)
        except ValueError:
            k = len(masks)
        if k:
            del masks[k:]
            known = hs[:k] if k < len(hs) else hs
            distinct = dict.fromkeys(masks)
            if any(m & ebit for m in distinct):  # confirm: expected there, held now
                was = {m: bool(m & ebit) for m in distinct}
                hit = list(compress(known, map(was.__getitem__, masks)))
                mine = self._expected.get(worker_id)
                if mine is not None:
                    deque(map(mine.pop, hit, repeat(None)), maxlen=0)
                    if not mine:
                        del self._expected[worker_id]
                self.num_confirmed_blocks += len(hit)
            new = {m: self._intern((m | bit) & ~ebit) for m in distinct}
            if any(new[m] != m for m in distinct):
                mask.update(zip(known, map(new.__getitem__, masks), strict=True))
                self._version += 1
        added = len(hs) - k
        if added:
            self._insert(hs[k - 1] if k else parent_hash, hs[k:], bit)
        held = self._held.get(worker_id)
        if held is None:
            held = self._held[worker_id] = set()
        held.update(hs)
        if self._lru is not None:
            self._touch(hs)
            self._cap()
        return added

    def removed(self, worker_id: str, epoch: int, block_hashes: Iterable[int]) -> None:
        if not self._current(worker_id, epoch):
            return
        held = self._held.get(worker_id)
        mine = self._expected.get(worker_id)
        if not held and not mine:
            return
        hs = block_hashes if isinstance(block_hashes, (set, frozenset, list, tuple)) \
            else list(block_hashes)
        bit = 1 << 2 * self._slots[worker_id]
        if held:
            gone = held.intersection(hs)
            if gone:
                held.difference_update(gone)
                if not held:
                    del self._held[worker_id]
                self._clear_bits(gone, bit)
        if mine:
            hit = mine.keys() & hs  # once each; a C loop over the hashes
            if hit:
                if len(hit) == len(mine):
                    del self._expected[worker_id]
                else:
                    deque(map(mine.__delitem__, hit), maxlen=0)
                self._clear_bits(hit, bit << 1)

    def cleared(self, worker_id: str, epoch: int) -> None:
        if self._current(worker_id, epoch):
            self._forget_held(worker_id)
            self.drop_predictions(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker entirely (it left or was reaped)."""
        self._forget_held(worker_id)
        self.drop_predictions(worker_id)
        self._epochs.pop(worker_id, None)
        slot = self._slots.pop(worker_id, None)
        if slot is not None:  # its bits are clear everywhere now: the slot is reused
            self._ids[slot] = None

    def clear(self) -> None:
        """Forget everything (before a rebuild from a snapshot); predictions too."""
        self._mask.clear()
        self._version += 1
        self._last_scan = None
        self._even = 0
        self._parent.clear()
        self._kids.clear()
        if self._lru is not None:
            self._lru.clear()
        self._slots.clear()
        self._ids.clear()
        self._held.clear()
        self._epochs.clear()
        self._expected.clear()
        self._expiries.clear()
        self._interned.clear()

    # ------------------------------------------------------------------ internals

    def _slot(self, worker_id: str) -> int:
        slot = self._slots.get(worker_id)
        if slot is None:
            ids = self._ids
            slot = ids.index(None) if None in ids else len(ids)
            if slot == len(ids):
                ids.append(worker_id)
            else:
                ids[slot] = worker_id
            self._slots[worker_id] = slot
            self._even |= 1 << 2 * slot
        return slot

    def _intern(self, m: int) -> int:
        """One int object per distinct bitmask (a million blocks share a few)."""
        return self._interned.setdefault(m, m)

    def _insert(self, parent: int | None, hs: Sequence[int], m: int) -> None:
        """Add the new blocks `hs`, a chain below `parent` (None: the root), with mask m."""
        m = self._intern(m)
        self._version += 1
        self._mask.update(zip(hs, repeat(m)))
        self._parent.update(zip(hs, chain((parent,), hs), strict=False))  # one longer
        kids = self._kids
        kids.update(zip(hs, repeat(1)))
        kids[hs[-1]] = 0
        if parent is not None:
            kids[parent] += 1

    def _forget_held(self, worker_id: str) -> None:
        """`worker_id` holds nothing (its expected blocks stay)."""
        held = self._held.pop(worker_id, None)
        if held:
            self._clear_bits(held, 1 << 2 * self._slots[worker_id])

    def _clear_bits(self, block_hashes: Iterable[int], bits: int) -> None:
        """Clear `bits` in each given block (distinct, all indexed), then drop the blocks
        left ownerless leaves, and their parents that become so."""
        hs = block_hashes if isinstance(block_hashes, (list, tuple)) else list(block_hashes)
        mask = self._mask
        self._version += 1
        masks = list(map(mask.__getitem__, hs))
        new = {m: self._intern(m & ~bits) for m in dict.fromkeys(masks)}
        after = list(map(new.__getitem__, masks))
        mask.update(zip(hs, after, strict=True))
        if 0 in new.values():
            self._prune(compress(hs, map((0).__eq__, after)))

    def _prune(self, ownerless: Iterable[int]) -> int:
        """Drop each given ownerless block that is a leaf, then each parent left an
        ownerless leaf in turn. Returns the blocks dropped."""
        mask, kids, parent, lru = self._mask, self._kids, self._parent, self._lru
        dropped = 0
        for h in ownerless:
            while h is not None and not kids.get(h, 1) and not mask[h]:
                del mask[h], kids[h]
                if lru is not None:
                    lru.pop(h, None)
                p = parent.pop(h)
                dropped += 1
                if p is not None:
                    kids[p] -= 1
                h = p
        return dropped

    def _touch(self, block_hashes: Sequence[int]) -> None:
        """Mark blocks used now (the cap's LRU order): deepest first, so that a parent is
        never older than the child used with it (leaves go first)."""
        lru = self._lru
        assert lru is not None
        move = lru.move_to_end
        for h in reversed(block_hashes):
            if h in self._mask:
                if h in lru:
                    move(h)
                else:
                    lru[h] = None

    def _cap(self) -> None:
        """Evict least recently used leaves down to `max_blocks` (and the ancestors left
        ownerless leaves); evicted blocks leave their holders' and expectations' books."""
        lru = self._lru
        if lru is None or len(self._mask) <= self.max_blocks:
            return
        mask, kids, parent = self._mask, self._kids, self._parent
        self._version += 1
        skipped = 0
        while len(mask) > self.max_blocks and lru and skipped <= len(lru):
            h, _ = lru.popitem(last=False)
            if h not in mask:
                continue
            if kids[h]:  # not a leaf: used with its children, kept
                lru[h] = None
                skipped += 1
                continue
            skipped = 0
            m = mask.pop(h)
            del kids[h]
            for w in self._workers_in(m & self._even):
                held = self._held.get(w)
                if held is not None:
                    held.discard(h)
                    if not held:
                        del self._held[w]
            for w in self._workers_in((m >> 1) & self._even):
                mine = self._expected.get(w)
                if mine is not None and mine.pop(h, None) is not None and not mine:
                    del self._expected[w]
            p = parent.pop(h)
            if p is not None:
                kids[p] -= 1
                if not mask[p]:
                    self._prune((p,))

