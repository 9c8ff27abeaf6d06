"""The gateway's view: which owners (workers) hold each block of a prefix tree.

`OwnerIndex` is a `RadixTree[frozenset[O]]` with block_size=1 whose "tokens" are chained
block hashes (see hashing.py): each hash is one block, and since a chained hash names
its whole prefix, it also names the block's position in the tree. Two side indexes make
per-block updates cheap without scanning the tree:

* hash -> node holding that block (kept right across splits and drops by tree hooks);
* owner -> hashes of the blocks it holds (for `remove_owner` of a dead worker).

Owner sets are interned frozensets, so the many blocks held by the same workers share
one set object (a pointer per block instead of a set per block).

Invariants: every resident block is either on the path to an owned block or has at
least one owner; a leaf block with no owner is dropped at once (its parent may then be
dropped in turn). Block hashes must be unique per block, which chained hashes are.
Locks are not used by the index; its `evict` still works for bounding memory (the
side indexes follow).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from typing import Generic, TypeVar

from prefixgate.radix.tree import Node, RadixTree

__all__ = ["OwnerIndex", "OwnerMatch", "owner_runs"]

O = TypeVar("O", bound=Hashable)  # noqa: E741


@dataclass(frozen=True, slots=True)
class OwnerMatch(Generic[O]):
    """Result of `OwnerIndex.match_owners`."""

    num_blocks: int  # leading blocks present in the index (owned or on an owned path)
    owners: list[frozenset[O]]  # one owner set per matched block
    # owner -> its longest run of leading blocks it holds (only owners of block 0)
    run_blocks: dict[O, int]


def owner_runs(sets: Sequence[frozenset],
               key: Callable[[frozenset], frozenset] | None = None) -> dict:
    """For each owner of the first block (after `key`, which maps an owner set to the
    owners it stands for), how many leading blocks it holds. `sets` are interned, so runs
    of the same set object are skipped by identity (the common case)."""
    runs: dict = {}
    if not sets:
        return runs
    prev = sets[0]
    alive = set(key(prev) if key else prev)
    for i, s in enumerate(sets):
        if s is prev:
            continue
        prev = s
        cur = key(s) if key else s
        for o in alive - cur:
            runs[o] = i
        alive &= cur
        if not alive:
            break
    for o in alive:
        runs[o] = len(sets)
    return runs


def _remap(vals: list, change: Callable[[frozenset], frozenset]) -> None:
    """vals[i] = change(vals[i]) for every i, calling `change` once per distinct set (the
    sets are interned: a node's blocks share a few set objects) and looping in C."""
    distinct = dict.fromkeys(vals)  # frozensets cache their hash: a C pass
    if len(distinct) == 1:
        vals[:] = [change(vals[0])] * len(vals)
    else:
        vals[:] = map({s: change(s) for s in distinct}.__getitem__, vals)


class OwnerIndex(RadixTree[frozenset]):
    """Blocks (chained hashes) -> the set of owners holding them."""

    def __init__(self) -> None:
        self._where: dict[int, Node[frozenset]] = {}
        self._by_owner: dict[Hashable, set[int]] = {}
        self._interned: dict[frozenset, frozenset] = {}
        # Nodes that may have become leaves ending in ownerless blocks: prune them.
        self._orphans: list[Node[frozenset]] = []
        super().__init__(block_size=1)

    # ------------------------------------------------------------------ queries

    def owners_of(self, block_hash: int) -> frozenset:
        """Owners of one block (empty if unknown)."""
        node = self._where.get(block_hash)
        if node is None:
            return frozenset()
        return node.values[node.key.index(block_hash)]

    def num_owned_blocks(self, owner: Hashable) -> int:
        """How many blocks list `owner`."""
        return len(self._by_owner.get(owner, ()))

    def match_owners(self, block_hashes: Sequence[int], *, touch: bool = True) -> OwnerMatch:
        """Per-block owner sets of the longest cached prefix of `block_hashes`, and for
        each owner of the first block the number of leading blocks it holds."""
        res = self.match(block_hashes, touch=touch)
        return OwnerMatch(res.num_blocks, res.values, owner_runs(res.values))

    # ------------------------------------------------------------------ updates

    def add(self, block_hashes: Sequence[int], owner: Hashable) -> int:
        """Record that `owner` holds every block of the path `block_hashes` (from the
        root). Creates missing blocks; returns how many blocks were created."""
        return self._give(block_hashes, owner, owner)[0]

    def add_unheld(self, path: Sequence[int], owner: Hashable, holder: Hashable) -> list[int]:
        """Give `owner` every block of the path `path` (from the root) that `holder` does
        not hold, creating the missing blocks (`holder` holds none of those). Unlike
        `add`, the rest of the path keeps its owners (a prediction names only the blocks a
        worker does not hold yet). Returns those blocks' hashes (not in path order)."""
        return self._give(path, owner, holder)[1]

    def _give(self, path: Sequence[int], owner: Hashable,
              holder: Hashable) -> tuple[int, list[int]]:
        """Add `owner` to every block of `path` whose owner set lacks `holder`, creating
        the missing blocks. Returns (blocks created, blocks whose set lacked `holder`).

        Cost: one walk of the path's nodes. Per block only C loops run over the node's
        owner sets (a few distinct interned objects per node); the hash-wide side indexes
        are updated for the blocks given only (a next turn's prompt is mostly blocks
        already held, a fresh 12k-token one 768 blocks of 16 tokens)."""
        single = self._intern(frozenset((owner,)))
        res = self.insert(path, [single] * len(path))
        node = res.node
        given: list[int] = []
        if res.num_new_blocks:  # the new leaf: exactly the created blocks
            given.extend(node.key)
            node = node.parent
        given += self._change_path(node, len(node.values), len(path),
                                   lambda s: holder not in s, lambda s: s | single)
        if given:
            self._by_owner.setdefault(owner, set()).update(given)
        return res.num_new_blocks, given

    def discard(self, block_hashes: Iterable[int], owner: Hashable) -> int:
        """Remove `owner` from the given blocks (wherever they are); drop blocks left
        with no owner and no children. Returns how many blocks were dropped."""
        held = self._by_owner.get(owner)
        if not held:
            return 0
        mine = held.intersection(block_hashes)  # distinct, as _replace_sets wants
        gone = frozenset((owner,))
        nodes = self._replace_sets(mine, lambda s: s - gone)
        held.difference_update(mine)
        if not held:
            del self._by_owner[owner]
        before = self._num_blocks
        for node in nodes:
            self._prune(node)
        self._prune_orphans()
        return before - self._num_blocks

    def evict(self, num_blocks: int) -> list[frozenset]:
        """`RadixTree.evict`, then drop ancestors left as ownerless leaves (not counted
        in `num_blocks`, not returned: they held nothing)."""
        out = super().evict(num_blocks)
        self._prune_orphans()
        return out

    def remove(self, tokens: Sequence[int]) -> list[frozenset]:
        """`RadixTree.remove`, then drop ancestors left as ownerless leaves (not returned)."""
        out = super().remove(tokens)
        self._prune_orphans()
        return out

    def remove_owner(self, owner: Hashable) -> int:
        """Remove `owner` from every block (a dead worker). Returns blocks dropped.
        Cost is linear in the blocks `owner` held, not in the tree."""
        return self.discard(list(self._by_owner.get(owner, ())), owner)

    # ------------------------------------------------------------------ internals

    def _intern(self, s: frozenset) -> frozenset:
        return self._interned.setdefault(s, s)

    def _change_path(self, node: Node[frozenset], end: int, num_blocks: int,
                     test: Callable[[frozenset], bool],
                     change: Callable[[frozenset], frozenset]) -> list[int]:
        """Walk up the path that ends at block `end` - 1 of `node`, over its last
        `num_blocks` blocks (or up to the root), and replace each owner set `s` for which
        `test(s)` by `change(s)`, interned. Returns the hashes of the blocks changed.
        `test` and `change` run once per distinct (interned) set; per block only C loops
        run (a fresh 12k-token prompt is 768 blocks of 16 tokens). The side indexes are
        the caller's."""
        hit: list[int] = []
        changed: dict[frozenset, frozenset] = {}  # each distinct set changed once
        root = self._root
        while num_blocks > 0 and node is not None and node is not root:
            start = max(0, end - num_blocks)
            vals, key = node.values, node.key
            whole = start == 0 and end == len(vals)  # the usual case: no slice copies
            part = vals if whole else vals[start:end]
            listed = {s: test(s) for s in dict.fromkeys(part)}
            if any(listed.values()):
                hit.extend(compress(key if whole else key[start:end],
                                    map(listed.__getitem__, part)))
                for s, has in listed.items():
                    if has:
                        u = changed.get(s)
                        if u is None:
                            u = changed[s] = self._intern(change(s))
                        listed[s] = u
                    else:
                        listed[s] = s
                vals[start:end] = map(listed.__getitem__, part)
            num_blocks -= end - start
            node = node.parent
            if node is not None:
                end = len(node.values)
        return hit

    def _replace_sets(self, block_hashes: Iterable[int],
                      change: Callable[[frozenset], frozenset]) -> Iterable[Node[frozenset]]:
        """Replace the owner set of each given block (distinct, all indexed) by
        `change(set)`, interned. Grouped by node, so each node's key is scanned once however
        many of its blocks are listed (a dead worker may hold thousands of blocks of one
        node), and each distinct (interned) set is changed once. Returns the nodes touched.
        Per block only C loops run (a 12k-token prompt is 768 blocks of 16 tokens)."""
        hashes = block_hashes if isinstance(block_hashes, (set, frozenset, list, tuple)) \
            else list(block_hashes)
        per_node = Counter(map(self._where.__getitem__, hashes))  # node -> blocks listed
        changed: dict[frozenset, frozenset] = {}

        def new_set(s: frozenset) -> frozenset:
            u = changed.get(s)
            if u is None:
                u = changed[s] = self._intern(change(s))
            return u

        wanted: set[int] | frozenset[int] | None = None
        for node, count in per_node.items():
            vals = node.values
            if count == len(vals):  # the whole node: the usual case
                _remap(vals, new_set)
                continue
            if wanted is None:
                wanted = hashes if isinstance(hashes, (set, frozenset)) else set(hashes)
            for i in compress(range(len(vals)), map(wanted.__contains__, node.key)):
                vals[i] = new_set(vals[i])
        return per_node.keys()

    def _prune(self, node: Node[frozenset]) -> None:
        """Drop ownerless blocks from the tail of leaf `node`, then up its ancestors."""
        root = self._root
        while node is not root and node.parent is not None and not node.children:
            if node.lock_ref:
                return
            vals = node.values
            k = 0
            while k < len(vals) and not vals[len(vals) - 1 - k]:
                k += 1
            if k == 0:
                return
            parent = node.parent
            self._drop_tail(node, k)
            if node.parent is not None:  # partially trimmed: still has owned blocks
                return
            node = parent

    def _prune_orphans(self) -> None:
        while self._orphans:
            self._prune(self._orphans.pop())

    def _on_attach(self, node: Node[frozenset]) -> None:
        self._where.update(zip(node.key, repeat(node)))

    def _on_split(self, head: Node[frozenset]) -> None:
        self._on_attach(head)

    def _on_drop(self, node: Node[frozenset], start: int) -> None:
        where, by_owner = self._where, self._by_owner
        # What may now end in ownerless blocks: the node itself if only its tail goes,
        # else its parent (which may have become a leaf).
        pending = node if start else node.parent
        if pending is not None:
            self._orphans.append(pending)
        keys = node.key[start:]
        deque(map(where.pop, keys, repeat(None)), maxlen=0)  # C loop: no per-block frame
        # An owner listed on some dropped block loses the dropped blocks it holds (the
        # others are not in its set: each hash is one block).
        for o in {o for s in dict.fromkeys(node.values[start:]) for o in s}:
            held = by_owner.get(o)
            if held is not None:
                held.difference_update(keys)
                if not held:
                    del by_owner[o]

    def _on_clear(self) -> None:
        self._where.clear()
        self._by_owner.clear()
        self._interned.clear()
        self._orphans.clear()
