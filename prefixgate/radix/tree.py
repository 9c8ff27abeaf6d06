"""A radix tree over token blocks with reference-counted locks and LRU leaf eviction.

Keys are sequences of ints in [0, 2**64) called "tokens". The tree only ever looks at
whole blocks of `block_size` tokens: a sequence of L tokens is L // block_size blocks and
its tail is ignored. Both users key it by chained block hashes with block_size=1 (each
hash is one "token" and one block): the worker's prefix cache, whose values are KV block
ids, and the gateway's owner index, whose values are sets of workers.

Each block carries one value of type V. A node holds a run of blocks (its `key` holds
their tokens, `values` one value per block) and every node boundary is a block boundary:
splits happen only there.

Contract, shared by every method:

* Sizes are exact: `num_blocks` counts resident blocks, `num_tokens` is
  `num_blocks * block_size`, `num_locked_blocks` counts blocks on at least one locked
  path, `num_evictable_blocks = num_blocks - num_locked_blocks` (an unlocked block has
  an unlocked subtree, so all of them can be evicted leaf first).
* Access times come from a logical clock that ticks once per touching `match` and per
  `insert`; every block on the touched path gets the new tick. Because one call touches
  one root-to-node path, no two leaves ever share a tick, so the LRU order is total and
  deterministic.
* Locks count references per path root..node; a locked block is never evicted or
  removed.
* A node handle (from `match` or `insert`) names the path that ends at its last block.
  Later splits keep it valid (the handle object keeps the deeper half). Eviction or
  removal of its blocks invalidates it: lock a handle right after getting it.

Cost: `match`/`insert` walk O(nodes on the path) in Python and compare token runs in C;
`evict` is O(log n) per evicted node (a heap of leaves with lazy invalidation; never a
scan); `remove` is linear in the removed subtree.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["InsertResult", "LockedError", "MatchResult", "Node", "RadixTree"]

V = TypeVar("V")


class LockedError(RuntimeError):
    """Raised when removing or clearing blocks that are locked."""


class Node(Generic[V]):
    """One run of blocks. Opaque to callers: use it only as a lock/unlock handle."""

    __slots__ = ("parent", "key", "values", "children", "last_access", "lock_ref", "in_heap")

    def __init__(self, parent: Node[V] | None, key: array, values: list[V], tick: int) -> None:
        self.parent = parent
        self.key = key  # tokens of this node's blocks, len(values) * block_size of them
        self.values = values  # one value per block
        self.children: dict[object, Node[V]] | None = None  # None while a leaf (saves memory)
        self.last_access = tick
        self.lock_ref = 0
        self.in_heap = False  # an entry for this node is in the eviction heap


@dataclass(frozen=True, slots=True)
class MatchResult(Generic[V]):
    """The longest cached prefix: `num_blocks` full blocks, `num_tokens` tokens."""

    num_blocks: int
    num_tokens: int
    values: list[V]  # one per matched block, in path order
    node: Node[V]  # handle for lock/unlock of exactly the matched path (root if none)


@dataclass(frozen=True, slots=True)
class InsertResult(Generic[V]):
    """What `insert` found and added."""

    num_cached_blocks: int  # leading blocks already present (their tree values were kept)
    num_new_blocks: int  # blocks added
    node: Node[V]  # handle for the whole inserted path (root if the key had no full block)


class RadixTree(Generic[V]):
    """Radix tree of token blocks, each carrying a value of type V (see module docstring)."""

    def __init__(self, block_size: int, *, key_typecode: str = "Q") -> None:
        """`key_typecode` is the array type storing tokens: "Q" (any u64, the default)
        or "I" (u32: token ids; half the key memory). Keys out of range: ValueError."""
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if key_typecode not in ("Q", "I"):
            raise ValueError(f"key_typecode must be 'Q' or 'I', got {key_typecode!r}")
        self.block_size = block_size
        self._typecode = key_typecode
        self._root: Node[V] = Node(None, array(key_typecode), [], 0)
        self._clock = 0
        self._num_blocks = 0
        self._num_locked_blocks = 0
        # (last_access, seq, node) for leaves that may be evictable. An entry can be stale
        # (node touched, locked, given a child, or removed since): evict() checks and
        # re-pushes or drops it. At most one entry per node (Node.in_heap).
        self._heap: list[tuple[int, int, Node[V]]] = []
        self._seq = itertools.count()

    # ------------------------------------------------------------------ sizes

    @property
    def num_blocks(self) -> int:
        """Resident blocks."""
        return self._num_blocks

    @property
    def num_tokens(self) -> int:
        """Resident tokens (= num_blocks * block_size)."""
        return self._num_blocks * self.block_size

    @property
    def num_locked_blocks(self) -> int:
        """Blocks on at least one locked path."""
        return self._num_locked_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks `evict` could free right now (all unlocked blocks)."""
        return self._num_blocks - self._num_locked_blocks

    # ------------------------------------------------------------------ lookup / insert

    def match(self, tokens: Sequence[int], *, touch: bool = True) -> MatchResult[V]:
        """Longest cached prefix of `tokens` in whole blocks.

        Mutates: with `touch`, sets the access time of every matched block to a new
        tick. May split a node at the match end (invisible to callers) so that the
        returned handle covers exactly the matched blocks.
        """
        n = len(tokens) // self.block_size
        q = self._as_keys(tokens, n)
        tick = self._tick() if touch else None
        node, m, values = self._walk(q, n, tick, collect=True)
        return MatchResult(m, m * self.block_size, values, node)

    def insert(self, tokens: Sequence[int], values: Sequence[V]) -> InsertResult[V]:
        """Add the full blocks of `tokens`, `values[i]` for block i; touch the whole path.

        `values` must have exactly `len(tokens) // block_size` entries. Blocks already
        present keep their values: the caller owns `values[:num_cached_blocks]` and
        should free them. Does not lock: lock the returned handle if needed.
        """
        bs = self.block_size
        n = len(tokens) // bs
        if len(values) != n:
            raise ValueError(f"need one value per full block: {n} blocks, {len(values)} values")
        q = self._as_keys(tokens, n)
        tick = self._tick()
        node, m, _ = self._walk(q, n, tick, collect=False)
        if m < n:
            leaf: Node[V] = Node(node, q[m * bs :], list(values[m:]), tick)
            if node.children is None:
                node.children = {}
            node.children[self._child_key(leaf.key, 0)] = leaf
            self._num_blocks += n - m
            self._on_attach(leaf)
            self._push(leaf)
            node = leaf
        return InsertResult(m, n - m, node)

    # ------------------------------------------------------------------ locks

    def lock(self, node: Node[V]) -> None:
        """Add one reference to every block on the path root..node (never evicted while >0)."""
        self._check_attached(node)
        root = self._root
        while node is not root:
            if node.lock_ref == 0:
                self._num_locked_blocks += len(node.values)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node[V]) -> None:
        """Drop one reference from every block on root..node; ValueError if not locked."""
        if node is self._root:
            return
        self._check_attached(node)
        if node.lock_ref <= 0:
            raise ValueError("unlock of a path that is not locked")
        root = self._root
        while node is not root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_locked_blocks -= len(node.values)
                if not node.children:
                    self._push(node)
            node = node.parent  # type: ignore[assignment]

    # ------------------------------------------------------------------ eviction / removal

    def evict(self, num_blocks: int) -> list[V]:
        """Evict up to `num_blocks` unlocked blocks, least recently used leaf first.

        A block is evicted only while it is a leaf, so children always go before their
        parent (a parent becomes a leaf when its last child goes). Within a node the tail
        block goes first; a partially evicted node keeps its access time, so it stays
        first in line. Returns the evicted values in eviction order (the caller frees
        them); fewer than asked when fewer are evictable.
        """
        out: list[V] = []
        need = num_blocks
        heap = self._heap
        while need > 0 and heap:
            t, _, node = heapq.heappop(heap)
            node.in_heap = False
            if node.parent is None or node.children or node.lock_ref:
                continue  # removed, no longer a leaf, or locked: pushed again when it qualifies
            if t != node.last_access:
                self._push(node)  # touched since pushed: requeue at its real time
                continue
            k = min(need, len(node.values))
            out += self._drop_tail(node, k)
            need -= k
        return out

    def remove(self, tokens: Sequence[int]) -> list[V]:
        """Remove every block whose path starts with all full blocks of `tokens`.

        That is the block ending at `tokens`' last full block and its whole subtree.
        Returns the removed values (children before parents, tail first in a node);
        [] if that path is not fully cached. Raises ValueError if `tokens` has no full
        block (use `clear`) and LockedError, changing nothing, if any removed block is
        locked. Does not touch access times.
        """
        bs = self.block_size
        n = len(tokens) // bs
        if n == 0:
            raise ValueError("remove() needs at least one full block; use clear()")
        node, m, _ = self._walk(self._as_keys(tokens, n), n, None, collect=False)
        if m < n:
            return []
        # Locks cover whole root..handle paths and handles end at node ends, so a node's
        # lock_ref > 0 means all its blocks, including the last, are locked.
        if node.lock_ref:
            raise LockedError("cannot remove locked blocks")
        if len(node.values) > 1:
            self._split(node, len(node.values) - 1)  # `node` keeps just the last block
        out: list[V] = []
        stack = [node]
        order: list[Node[V]] = []
        while stack:  # pre-order, then reversed: children before parents
            x = stack.pop()
            order.append(x)
            if x.children:
                stack.extend(x.children.values())
        for x in reversed(order):
            if x.children:  # its children are already gone; detach() expects a leaf
                x.children = None
            out += self._drop_tail(x, len(x.values))
        return out

    def clear(self, *, force: bool = False) -> list[V]:
        """Drop every block and return their values (pre-order, path order in a node).

        Raises LockedError if any block is locked, unless `force` (then outstanding
        handles are invalid and must not be unlocked).
        """
        if self._num_locked_blocks and not force:
            raise LockedError(f"{self._num_locked_blocks} blocks are locked")
        out: list[V] = []
        for node in self._nodes():
            out += node.values
            node.parent = None
        self._root.children = None
        self._heap.clear()
        self._num_blocks = self._num_locked_blocks = 0
        self._on_clear()
        return out

    # ------------------------------------------------------------------ snapshots

    def items(self) -> Iterator[tuple[tuple[int, ...], list[V]]]:
        """Yield `(tokens, values)` for each root-to-leaf path, pre-order.

        `tokens` is the whole path (num_blocks * block_size ints) and `values` one value
        per block of it. Children are visited in insertion order of their first block.
        Inserting every yielded pair into an empty tree rebuilds the same blocks. Do not
        mutate the tree while iterating.
        """
        path: list[int] = []
        vals: list[V] = []
        stack: list[tuple[Node[V], int, int]] = [
            (c, 0, 0) for c in reversed(self._children(self._root))
        ]
        while stack:
            node, plen, vlen = stack.pop()
            del path[plen:], vals[vlen:]
            path += node.key
            vals += node.values
            if node.children:
                n_tok, n_val = len(path), len(vals)
                stack.extend((c, n_tok, n_val) for c in reversed(node.children.values()))
            else:
                yield tuple(path), list(vals)

    def __iter__(self) -> Iterator[tuple[tuple[int, ...], list[V]]]:
        return self.items()

    # ------------------------------------------------------------------ internals

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _as_keys(self, tokens: Sequence[int], n_blocks: int) -> array:
        """The first `n_blocks` blocks of `tokens` as an array('Q') (compared in C)."""
        size = n_blocks * self.block_size
        if isinstance(tokens, array) and tokens.typecode == self._typecode:
            return tokens if len(tokens) == size else tokens[:size]
        try:
            return array(self._typecode, tokens[:size])
        except (OverflowError, TypeError) as exc:
            bound = "2**64" if self._typecode == "Q" else "2**32"
            raise ValueError(f"tokens must be ints in [0, {bound}): {exc}") from None

    def _child_key(self, key: array, start: int) -> object:
        """Dict key of the block starting at token `start`: the int itself at block_size 1
        (cheapest), else the block's bytes (much smaller than a tuple of int objects)."""
        if self.block_size == 1:
            return key[start]
        return key[start : start + self.block_size].tobytes()

    def _walk(
        self, q: array, n: int, tick: int | None, *, collect: bool
    ) -> tuple[Node[V], int, list[V]]:
        """Follow `q` (n blocks) down the tree; split at the match end if it falls inside
        a node. Returns (deepest matched node, matched blocks, their values if collect)."""
        bs = self.block_size
        node = self._root
        pos = 0
        values: list[V] = []
        while pos < n and node.children:
            child = node.children.get(self._child_key(q, pos * bs))
            if child is None:
                break
            nb = len(child.values)
            avail = min(nb, n - pos)
            start = pos * bs
            # Fast path: the whole node matches (one C-level array comparison).
            if avail == nb and child.key == q[start : start + nb * bs]:
                m = nb
            else:
                m = self._common_blocks(child.key, q, start, avail)
                if m < nb:
                    child = self._split(child, m)
            if tick is not None:
                child.last_access = tick
            if collect:
                values += child.values
            pos += m
            node = child
            if m < nb:
                break
        return node, pos, values

    def _common_blocks(self, key: array, q: array, start: int, hi: int) -> int:
        """Largest m in [1, hi] with key[:m blocks] == q[start:][:m blocks] (block 0 is
        known to match). Binary search: ~log2(hi) C comparisons instead of a Python loop
        per block, which matters for long nodes (a 32k-token prompt is 2,048 blocks)."""
        bs = self.block_size
        lo = 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key[: mid * bs] == q[start : start + mid * bs]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _split(self, node: Node[V], m: int) -> Node[V]:
        """Cut `node` after its first m blocks; return the new parent holding them.

        The original object keeps the deeper blocks so handles to it stay valid."""
        bs = self.block_size
        parent = node.parent
        assert parent is not None and 0 < m < len(node.values)
        head: Node[V] = Node(parent, node.key[: m * bs], node.values[:m], node.last_access)
        head.lock_ref = node.lock_ref  # same paths go through both halves
        parent.children[self._child_key(head.key, 0)] = head  # type: ignore[index]
        node.key = node.key[m * bs :]
        node.values = node.values[m:]
        node.parent = head
        head.children = {self._child_key(node.key, 0): node}
        self._on_split(head)
        return head

    def _drop_tail(self, node: Node[V], k: int) -> list[V]:
        """Remove the last k blocks of leaf `node` (all: detach it). Returns their values,
        tail first. Keeps counters and the heap right; requeues the node or its parent
        when it becomes an evictable leaf."""
        nb = len(node.values)
        self._on_drop(node, nb - k)
        out = node.values[nb - k :]
        out.reverse()
        self._num_blocks -= k
        if node.lock_ref:
            self._num_locked_blocks -= k
        if k < nb:
            del node.values[nb - k :]
            del node.key[(nb - k) * self.block_size :]
            if not node.lock_ref:
                self._push(node)
            return out
        parent = node.parent
        assert parent is not None and parent.children is not None
        del parent.children[self._child_key(node.key, 0)]
        # Detached: free its memory now (a stale heap entry may still point at it).
        node.parent, node.key, node.values = None, array(self._typecode), []
        if not parent.children:
            parent.children = None
            if parent is not self._root and not parent.lock_ref:
                self._push(parent)
        return out

    def _push(self, node: Node[V]) -> None:
        if not node.in_heap:
            node.in_heap = True
            heapq.heappush(self._heap, (node.last_access, next(self._seq), node))

    def _check_attached(self, node: Node[V]) -> None:
        if node.parent is None and node is not self._root:
            raise ValueError("stale handle: its blocks were evicted or removed")

    def _children(self, node: Node[V]) -> list[Node[V]]:
        return list(node.children.values()) if node.children else []

    def _nodes(self) -> Iterator[Node[V]]:
        """Every node except the root, pre-order."""
        stack = list(reversed(self._children(self._root)))
        while stack:
            node = stack.pop()
            yield node
            if node.children:
                stack.extend(reversed(node.children.values()))

    # Hooks for subclasses that index blocks by key (see owners.OwnerIndex). No-ops here.
    def _on_attach(self, node: Node[V]) -> None:
        """`node` was just added with all its blocks."""

    def _on_split(self, head: Node[V]) -> None:
        """`head` now holds blocks that were at the front of its only child."""

    def _on_drop(self, node: Node[V], start: int) -> None:
        """Blocks `start:` of `node` are about to be removed."""

    def _on_clear(self) -> None:
        """Every block was dropped."""
