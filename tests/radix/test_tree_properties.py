"""RadixTree and OwnerIndex against deliberately simple reference models.

The tree model is a dict from block path (a tuple of blocks, each a tuple of tokens) to
value, with a logical clock for access times and a lock count per block. Every answer
of the tree (match lengths and values, insert's cached count, eviction order, removed
values, sizes, snapshots) is compared with the model after every step.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from prefixgate.radix import BlockHasher, LockedError, OwnerIndex, RadixTree

BS = 2
# A tiny alphabet and short sequences make shared prefixes, splits and ties common.
tokens_st = st.lists(st.integers(0, 2), max_size=5 * BS + 1)


def blocks_of(tokens: list[int], bs: int = BS) -> list[tuple[int, ...]]:
    return [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(len(tokens) // bs)]


class TreeModel:
    def __init__(self) -> None:
        self.value: dict[tuple, int] = {}  # block path -> value
        self.time: dict[tuple, int] = {}
        self.locks: dict[tuple, int] = {}
        self.clock = 0

    def prefix_len(self, blocks) -> int:
        m = 0
        while m < len(blocks) and tuple(blocks[: m + 1]) in self.value:
            m += 1
        return m

    def has_child(self, path) -> bool:
        return any(len(p) == len(path) + 1 and p[:-1] == path for p in self.value)

    def evict_one(self):
        leaves = [p for p in self.value if not self.locks[p] and not self.has_child(p)]
        if not leaves:
            return None
        oldest = min(self.time[p] for p in leaves)
        winners = [p for p in leaves if self.time[p] == oldest]
        assert len(winners) == 1, "the tree claims LRU ties never happen"
        return winners[0]

    def drop(self, path) -> int:
        del self.time[path], self.locks[path]
        return self.value.pop(path)


class TreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree: RadixTree[int] = RadixTree(BS)
        self.model = TreeModel()
        self.next_value = 0
        self.locked: list[tuple[object, tuple]] = []  # (handle, locked path)

    def _lock(self, node, blocks, m: int) -> None:
        if m == 0:
            return
        self.tree.lock(node)
        path = tuple(blocks[:m])
        for i in range(1, m + 1):
            self.model.locks[path[:i]] += 1
        self.locked.append((node, path))

    @rule(tokens=tokens_st, lock=st.booleans())
    def insert(self, tokens, lock):
        blocks = blocks_of(tokens)
        values = list(range(self.next_value, self.next_value + len(blocks)))
        self.next_value += len(blocks)
        res = self.tree.insert(tokens, values)
        m = self.model.prefix_len(blocks)
        assert res.num_cached_blocks == m
        assert res.num_new_blocks == len(blocks) - m
        self.model.clock += 1
        for i in range(len(blocks)):
            path = tuple(blocks[: i + 1])
            if path not in self.model.value:
                self.model.value[path] = values[i]
                self.model.locks[path] = 0
            self.model.time[path] = self.model.clock
        if lock:
            self._lock(res.node, blocks, len(blocks))

    @rule(tokens=tokens_st, touch=st.booleans(), lock=st.booleans())
    def match(self, tokens, touch, lock):
        blocks = blocks_of(tokens)
        res = self.tree.match(tokens, touch=touch)
        m = self.model.prefix_len(blocks)
        assert res.num_blocks == m
        assert res.num_tokens == m * BS
        assert res.values == [self.model.value[tuple(blocks[: i + 1])] for i in range(m)]
        if touch:
            self.model.clock += 1
            for i in range(m):
                self.model.time[tuple(blocks[: i + 1])] = self.model.clock
        if lock:
            self._lock(res.node, blocks, m)

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locked) - 1))
        node, path = self.locked.pop(i)
        self.tree.unlock(node)
        for j in range(1, len(path) + 1):
            self.model.locks[path[:j]] -= 1

    @rule(num_blocks=st.integers(0, 8))
    def evict(self, num_blocks):
        got = self.tree.evict(num_blocks)
        expected = []
        for _ in range(num_blocks):
            path = self.model.evict_one()
            if path is None:
                break
            expected.append(self.model.drop(path))
        assert got == expected

    @rule(tokens=tokens_st)
    def remove(self, tokens):
        blocks = blocks_of(tokens)
        if not blocks:
            with pytest.raises(ValueError):
                self.tree.remove(tokens)
            return
        top = tuple(blocks)
        if top not in self.model.value:
            assert self.tree.remove(tokens) == []
            return
        if self.model.locks[top]:
            before = self.tree.num_blocks
            with pytest.raises(LockedError):
                self.tree.remove(tokens)
            assert self.tree.num_blocks == before
            return
        doomed = [p for p in self.model.value if p[: len(top)] == top]
        expected = Counter(self.model.drop(p) for p in doomed)
        got = self.tree.remove(tokens)
        assert Counter(got) == expected and len(got) == len(doomed)

    @invariant()
    def sizes_are_exact(self):
        model = self.model
        assert self.tree.num_blocks == len(model.value)
        assert self.tree.num_tokens == len(model.value) * BS
        locked = sum(1 for c in model.locks.values() if c)
        assert self.tree.num_locked_blocks == locked
        assert self.tree.num_evictable_blocks == len(model.value) - locked

    @invariant()
    def snapshot_matches(self):
        leaves = {p for p in self.model.value if not self.model.has_child(p)}
        got = {}
        for tokens, values in self.tree.items():
            path = tuple(blocks_of(list(tokens)))
            assert len(values) == len(path)
            got[path] = values
        assert set(got) == leaves
        for path, values in got.items():
            assert values == [self.model.value[path[: i + 1]] for i in range(len(path))]

    def teardown(self):
        # Everything unlocked can go; with every lock released, everything can.
        for node, _ in self.locked:
            self.tree.unlock(node)
        n = self.tree.num_blocks
        assert len(self.tree.evict(n + 5)) == n
        assert self.tree.num_blocks == 0 and self.tree.num_locked_blocks == 0


TestTreeAgainstModel = TreeMachine.TestCase


# --------------------------------------------------------------------- OwnerIndex

OWNERS = ["w0", "w1", "w2"]
hasher = BlockHasher(block_size=1)
path_st = st.lists(st.integers(0, 2), max_size=6)


class OwnerMachine(RuleBasedStateMachine):
    """Model: dict block path -> set of owners; ownerless leaves are pruned."""

    def __init__(self) -> None:
        super().__init__()
        self.index = OwnerIndex()
        self.owners: dict[tuple, set[str]] = {}

    def _prune(self) -> None:
        changed = True
        while changed:
            changed = False
            for p in list(self.owners):
                if not self.owners[p] and not any(
                    len(q) == len(p) + 1 and q[:-1] == p for q in self.owners
                ):
                    del self.owners[p]
                    changed = True

    @rule(path=path_st, owner=st.sampled_from(OWNERS))
    def add(self, path, owner):
        new = sum(1 for i in range(len(path)) if tuple(path[: i + 1]) not in self.owners)
        assert self.index.add(hasher.hash_blocks(path), owner) == new
        for i in range(len(path)):
            self.owners.setdefault(tuple(path[: i + 1]), set()).add(owner)

    @rule(path=path_st, owner=st.sampled_from(OWNERS), last_only=st.booleans())
    def discard(self, path, owner, last_only):
        hashes = hasher.hash_blocks(path)
        prefixes = [tuple(path[: i + 1]) for i in range(len(path))]
        if last_only:
            hashes, prefixes = hashes[-1:], prefixes[-1:]
        before = len(self.owners)
        for p in prefixes:
            if p in self.owners:
                self.owners[p].discard(owner)
        self._prune()
        assert self.index.discard(hashes, owner) == before - len(self.owners)

    @rule(owner=st.sampled_from(OWNERS))
    def remove_owner(self, owner):
        before = len(self.owners)
        for s in self.owners.values():
            s.discard(owner)
        self._prune()
        assert self.index.remove_owner(owner) == before - len(self.owners)

    @rule(path=path_st)
    def match_owners(self, path):
        res = self.index.match_owners(hasher.hash_blocks(path))
        m = 0
        while m < len(path) and tuple(path[: m + 1]) in self.owners:
            m += 1
        assert res.num_blocks == m
        expected = [self.owners[tuple(path[: i + 1])] for i in range(m)]
        assert [set(s) for s in res.owners] == expected
        runs = {}
        for o in expected[0] if expected else ():
            runs[o] = next((i for i, s in enumerate(expected) if o not in s), m)
        assert res.run_blocks == runs

    @rule(num_blocks=st.integers(0, 3))
    def evict(self, num_blocks):
        got = self.index.evict(num_blocks)
        assert len(got) == min(num_blocks, len(self.owners))
        # Which blocks went is the tree's business (tested above); resync the model.
        present = set()
        for tokens, _ in self.index.items():
            present.update(tokens)
        self.owners = {
            p: s for p, s in self.owners.items() if hasher.hash_blocks(list(p))[-1] in present
        }
        before = len(self.owners)
        self._prune()
        assert before == len(self.owners), "the index must prune ownerless leaves too"

    @invariant()
    def consistent(self):
        assert self.index.num_blocks == len(self.owners)
        for owner in OWNERS:
            held = sum(1 for s in self.owners.values() if owner in s)
            assert self.index.num_owned_blocks(owner) == held
        for p, s in self.owners.items():
            assert set(self.index.owners_of(hasher.hash_blocks(list(p))[-1])) == s


TestOwnerIndexAgainstModel = OwnerMachine.TestCase
