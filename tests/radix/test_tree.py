"""RadixTree and OwnerIndex edge cases."""

from __future__ import annotations

from array import array

import pytest

from prefixgate.radix import LockedError, OwnerIndex, RadixTree


def test_empty_and_short_sequences():
    tree: RadixTree[int] = RadixTree(4)
    res = tree.match([])
    assert (res.num_blocks, res.num_tokens, res.values) == (0, 0, [])
    ins = tree.insert([1, 2, 3], [])  # shorter than a block: nothing to insert
    assert (ins.num_cached_blocks, ins.num_new_blocks, tree.num_blocks) == (0, 0, 0)
    tree.lock(ins.node)  # the root handle: a no-op
    tree.unlock(ins.node)
    assert tree.num_locked_blocks == 0
    assert tree.evict(10) == [] and list(tree.items()) == []
    with pytest.raises(ValueError):
        tree.remove([1, 2, 3])


def test_tail_is_ignored_and_values_must_match_blocks():
    tree: RadixTree[str] = RadixTree(2)
    assert tree.insert([1, 2, 3, 4, 5], ["a", "b"]).num_new_blocks == 2
    assert tree.num_tokens == 4
    assert tree.match([1, 2, 3, 4, 5, 6]).num_tokens == 4
    assert tree.match([1, 2, 3, 9]).values == ["a"]
    with pytest.raises(ValueError):
        tree.insert([1, 2, 3, 4], ["a"])


def test_duplicate_insert_keeps_first_values():
    tree: RadixTree[str] = RadixTree(2)
    tree.insert([1, 2, 3, 4], ["a", "b"])
    res = tree.insert([1, 2, 3, 4], ["x", "y"])
    assert (res.num_cached_blocks, res.num_new_blocks) == (2, 0)
    res = tree.insert([1, 2, 3, 4, 5, 6], ["x", "y", "z"])
    assert (res.num_cached_blocks, res.num_new_blocks) == (2, 1)
    assert tree.match([1, 2, 3, 4, 5, 6]).values == ["a", "b", "z"]
    assert tree.num_blocks == 3


def test_split_inside_a_node_only_at_block_boundaries():
    tree: RadixTree[int] = RadixTree(2)
    tree.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    # Differs inside block 1: only block 0 matches.
    assert tree.match([1, 2, 3, 9, 5, 6]).num_blocks == 1
    tree.insert([1, 2, 3, 9], [7, 8])
    assert sorted(tree.items()) == [((1, 2, 3, 4, 5, 6), [0, 1, 2]), ((1, 2, 3, 9), [0, 8])]


def test_lru_order_and_partial_eviction():
    tree: RadixTree[str] = RadixTree(1)
    tree.insert([1, 2, 3], ["a", "b", "c"])
    tree.insert([5, 6], ["e", "f"])
    tree.match([1])  # touches "a" only; "b", "c" keep the older time
    # The oldest leaf node holds "b", "c" (split off by the touch); its tail goes first.
    assert tree.evict(1) == ["c"]
    assert tree.evict(1) == ["b"]  # partial eviction keeps the node first in line
    assert tree.evict(1) == ["f"]  # [5, 6] is older than the touch of "a"
    assert tree.evict(10) == ["e", "a"]
    assert tree.num_blocks == 0


def test_locked_blocks_survive_and_evict_more_than_evictable():
    tree: RadixTree[str] = RadixTree(1)
    locked = tree.insert([1, 2], ["a", "b"]).node
    tree.insert([1, 2, 3], ["a", "b", "c"])
    tree.insert([7], ["g"])
    tree.lock(locked)
    tree.lock(locked)
    assert (tree.num_locked_blocks, tree.num_evictable_blocks) == (2, 2)
    assert tree.evict(100) == ["c", "g"]
    assert tree.num_blocks == 2 and tree.num_evictable_blocks == 0
    tree.unlock(locked)
    assert tree.evict(1) == []
    tree.unlock(locked)
    with pytest.raises(ValueError):
        tree.unlock(locked)
    assert tree.evict(5) == ["b", "a"]
    with pytest.raises(ValueError):
        tree.lock(locked)  # stale handle


def test_handle_survives_split():
    tree: RadixTree[int] = RadixTree(1)
    handle = tree.insert([1, 2, 3, 4], [1, 2, 3, 4]).node
    tree.lock(handle)
    tree.insert([1, 2, 9], [1, 2, 9])  # splits the locked node
    assert tree.num_locked_blocks == 4
    assert tree.evict(10) == [9]
    tree.unlock(handle)
    assert tree.num_locked_blocks == 0
    assert tree.evict(10) == [4, 3, 2, 1]


def test_remove_subtree():
    tree: RadixTree[str] = RadixTree(1)
    tree.insert([1, 2, 3], ["a", "b", "c"])
    tree.insert([1, 2, 4], ["a", "b", "d"])
    tree.insert([1, 5], ["a", "e"])
    assert tree.remove([9]) == [] and tree.remove([1, 2, 3, 4]) == []
    assert sorted(tree.remove([1, 2])) == ["b", "c", "d"]
    assert (tree.num_blocks, list(tree.items())) == (2, [((1, 5), ["a", "e"])])
    handle = tree.match([1, 5]).node
    tree.lock(handle)
    with pytest.raises(LockedError):
        tree.remove([1])
    assert tree.num_blocks == 2
    with pytest.raises(LockedError):
        tree.clear()
    assert sorted(tree.clear(force=True)) == ["a", "e"]
    assert (tree.num_blocks, tree.num_locked_blocks, tree.match([1]).num_blocks) == (0, 0, 0)


def test_items_rebuild_the_tree():
    tree: RadixTree[int] = RadixTree(2)
    tree.insert([1, 1, 2, 2, 3, 3], [1, 2, 3])
    tree.insert([1, 1, 4, 4], [1, 4])
    tree.insert([5, 5], [5])
    items = list(tree)
    assert items == [((1, 1, 2, 2, 3, 3), [1, 2, 3]), ((1, 1, 4, 4), [1, 4]), ((5, 5), [5])]
    copy: RadixTree[int] = RadixTree(2)
    for tokens, values in items:
        copy.insert(tokens, values)
    assert list(copy) == items and copy.num_blocks == tree.num_blocks == 5


def test_accepts_arrays_and_large_keys():
    tree: RadixTree[int] = RadixTree(1)
    big = [2**64 - 1, 2**63, 0]
    tree.insert(big, [1, 2, 3])
    assert tree.match(array("Q", big)).num_blocks == 3
    with pytest.raises(ValueError):
        tree.match([2**64])
    with pytest.raises(ValueError):
        tree.insert([-1], [0])
    with pytest.raises(ValueError):
        RadixTree(0)


def test_owner_index_basics():
    index = OwnerIndex()
    assert index.add([10, 11, 12], "w1") == 3
    assert index.add([10, 11, 13], "w2") == 1
    res = index.match_owners([10, 11, 12, 99])
    assert res.num_blocks == 3
    assert res.run_blocks == {"w1": 3, "w2": 2}
    assert index.owners_of(11) == {"w1", "w2"} and index.owners_of(99) == frozenset()
    # Blocks held by the same workers share one interned set.
    assert res.owners[0] is res.owners[1]
    # w1 evicted block 12: it is dropped (no other owner, no children).
    assert index.discard([12], "w1") == 1
    assert index.num_blocks == 3 and index.num_owned_blocks("w1") == 2
    # Dead worker: its blocks go where nobody else holds them; w2's path stays whole.
    assert index.remove_owner("w2") == 1
    assert index.num_blocks == 2 and index.match_owners([10, 11, 13]).run_blocks == {"w1": 2}
    assert index.remove_owner("w1") == 2 and index.num_blocks == 0
    assert index.remove_owner("nobody") == 0


def test_owner_index_middle_block_without_owner_is_kept():
    index = OwnerIndex()
    index.add([1, 2, 3], "w1")
    index.add([1], "w2")
    assert index.discard([2], "w1") == 0  # block 3 below still has an owner
    assert index.match_owners([1, 2, 3]).run_blocks == {"w1": 1, "w2": 1}
    assert index.discard([3], "w1") == 2  # 3 goes, then the ownerless 2
    assert index.num_blocks == 1 and index.owners_of(1) == {"w1", "w2"}
