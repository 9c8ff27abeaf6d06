"""Block hashing: pinned test vectors, the byte-level spec, chaining, validation."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from prefixgate.radix import BlockHasher, HashMemo, packed, tokens_to_bytes

# (block_size, model_fingerprint, namespace, tokens) -> (root_hash, block hashes).
# These pin spec version 1; if they change, every cache and every other-language
# gateway breaks. Do not update them without bumping the version.
VECTORS = [
    (
        (16, "", "", list(range(40))),
        (12068666088880749107, [8325511188454026647, 2530147490003843695]),
    ),
    (
        (4, "smollm2-135m", "tenant-a", [0, 1, 2**32 - 1, 7, 5, 5, 5, 5, 9]),
        (10144594955154075467, [1456867550292728548, 11260328032782221985]),
    ),
    (
        (1, "", "", [3, 1, 4]),
        (3350391159689632182, [7956898436975381149, 4962434818734960089, 13561955406425634079]),
    ),
    (
        (16, "", "tenant-b", list(range(40))),
        (12753254530760938219, [13809764109765419393, 1783318459551090451]),
    ),
]


@pytest.mark.parametrize(("config", "expected"), VECTORS)
def test_vectors(config, expected):
    block_size, fingerprint, namespace, tokens = config
    hasher = BlockHasher(block_size, fingerprint, namespace)
    assert (hasher.root_hash, hasher.hash_blocks(tokens)) == expected


def spec_hashes(block_size: int, fingerprint: str, namespace: str, tokens: list[int]):
    """The module docstring's spec, written out independently with struct."""
    fp, ns = fingerprint.encode(), namespace.encode()
    material = (
        b"prefixgate.block.v1\x00"
        + struct.pack("<I", block_size)
        + struct.pack("<I", len(fp))
        + fp
        + struct.pack("<I", len(ns))
        + ns
    )
    salt = xxhash.xxh3_64_intdigest(material, seed=0)
    out, parent = [], salt
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        data = struct.pack("<Q", parent) + struct.pack(f"<{block_size}I", *block)
        parent = xxhash.xxh3_64_intdigest(data, seed=salt)
        out.append(parent)
    return salt, out


@given(
    block_size=st.integers(1, 8),
    fingerprint=st.text(max_size=5),
    namespace=st.text(max_size=5),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40),
)
def test_matches_written_spec(block_size, fingerprint, namespace, tokens):
    hasher = BlockHasher(block_size, fingerprint, namespace)
    assert (hasher.root_hash, hasher.hash_blocks(tokens)) == spec_hashes(
        block_size, fingerprint, namespace, tokens
    )


@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=60), cut=st.integers(0, 10))
def test_chaining(tokens, cut):
    hasher = BlockHasher(4)
    whole = hasher.hash_blocks(tokens)
    split = min(cut, len(whole)) * 4
    head = hasher.hash_blocks(tokens[:split])
    parent = head[-1] if head else None
    assert head + hasher.hash_blocks(tokens[split:], parent) == whole


def test_only_full_blocks():
    hasher = BlockHasher(16)
    assert hasher.hash_blocks([]) == []
    assert hasher.hash_blocks(list(range(15))) == []
    assert hasher.hash_blocks(list(range(31))) == hasher.hash_blocks(list(range(16)))
    assert hasher.hash_blocks(range(32)) == hasher.hash_blocks(list(range(32)))  # any Sequence
    assert hasher.hash_blocks(tuple(range(32))) == hasher.hash_blocks(list(range(32)))


def test_salt_separates_namespaces_models_and_sizes():
    tokens = list(range(64))
    hashers = [
        BlockHasher(16),
        BlockHasher(16, namespace="a"),
        BlockHasher(16, namespace="b"),
        BlockHasher(16, model_fingerprint="a"),
        BlockHasher(16, "a", "bc"),
        BlockHasher(16, "ab", "c"),
        BlockHasher(8),
    ]
    seen = set()
    for hasher in hashers:
        hashes = [hasher.root_hash, *hasher.hash_blocks(tokens)]
        assert seen.isdisjoint(hashes)
        seen.update(hashes)
    # The salt enters every block, not only the root: same parent, different namespace.
    a, b = BlockHasher(4, namespace="a"), BlockHasher(4, namespace="b")
    assert a.hash_blocks([1, 2, 3, 4], parent_hash=7) != b.hash_blocks([1, 2, 3, 4], parent_hash=7)


def test_hashes_are_u64_and_hasher_is_frozen():
    hasher = BlockHasher(2)
    assert all(0 <= h < 2**64 for h in hasher.hash_blocks(list(range(100))))
    with pytest.raises(AttributeError):
        hasher.block_size = 4  # type: ignore[misc]
    assert BlockHasher(2) == hasher and hash(BlockHasher(2)) == hash(hasher)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**64])
def test_rejects_out_of_range_tokens(bad):
    with pytest.raises(ValueError, match="out of range"):
        BlockHasher(2).hash_blocks([1, bad])


def test_rejects_bad_config_and_parent():
    with pytest.raises(ValueError):
        BlockHasher(0)
    with pytest.raises(ValueError):
        BlockHasher(2).hash_blocks([1, 2], parent_hash=-1)
    with pytest.raises(ValueError):
        BlockHasher(2).hash_blocks([1, 2], parent_hash=2**64)


@given(block_size=st.integers(1, 8), tokens=st.lists(st.integers(0, 2**32 - 1), max_size=60),
       parent=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_packed_ids_hash_like_the_list(block_size, tokens, parent):
    # Packed ids (the wire form) are hashed from their bytes: same hashes as the ints.
    hasher = BlockHasher(block_size, "fp", "ns")
    view = packed(tokens_to_bytes(tokens))
    assert len(view) == len(tokens)
    assert hasher.hash_blocks(view, parent) == hasher.hash_blocks(tokens, parent)


def test_packed_rejects_a_partial_id():
    with pytest.raises(ValueError, match="multiple of 4"):
        packed(b"\x01\x00\x00")


@given(steps=st.lists(st.tuples(st.sampled_from(["extend", "cut", "new", "other-ns"]),
                                st.integers(0, 40), st.sampled_from(["", "c1", "c2"])),
                      min_size=1, max_size=25),
       max_bytes=st.sampled_from([0, 700, 1 << 20]))
def test_hash_memo_equals_hashing(steps, max_bytes):
    # Whatever was seen before (continuations, cut prompts, unrelated ones, another
    # namespace under the same key, eviction), the memo returns exactly the hashes.
    hashers = {"a": BlockHasher(4, "fp", "a"), "b": BlockHasher(4, "fp", "b")}
    memo = HashMemo(max_bytes)
    prompt: list[int] = [1, 2, 3, 4, 5]
    num_blocks = 0  # full blocks asked for: each one either hashed or reused
    for i, (op, n, key) in enumerate(steps):
        if op == "extend":
            prompt = prompt + list(range(i, i + n))
        elif op == "cut":
            prompt = prompt[: n] + [i]
        else:
            prompt = [i] + list(range(n))
        hasher = hashers["b" if op == "other-ns" else "a"]
        view = packed(tokens_to_bytes(prompt))
        assert memo.hash_blocks(hasher, view, key) == hasher.hash_blocks(prompt)
        num_blocks += len(prompt) // 4
    assert memo.hashed_blocks + memo.reused_blocks == num_blocks


def test_hash_memo_hashes_only_new_blocks():
    hasher, memo = BlockHasher(16), HashMemo()
    turn1 = list(range(1600))
    memo.hash_blocks(hasher, packed(tokens_to_bytes(turn1)))
    turn2 = turn1 + list(range(5000, 5100))
    assert memo.hash_blocks(hasher, packed(tokens_to_bytes(turn2))) == hasher.hash_blocks(turn2)
    assert (memo.reused_blocks, memo.hashed_blocks) == (100, 100 + 6)
