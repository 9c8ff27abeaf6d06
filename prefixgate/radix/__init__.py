"""Token-block hashing and a radix tree with LRU subtree eviction.

Shared by the gateway and the worker; pure Python (stdlib + xxhash), no torch, no I/O.

* `BlockHasher` (hashing.py): chained, salted u64 hashes of full token blocks, with a
  byte-level spec so other languages can reproduce them; `packed(data)` views token ids
  sent as little-endian u32 bytes as a sequence that hashes without per-id objects;
  `HashMemo` hashes only the blocks a prompt adds to one seen before (the next turn).
* `Hashers` (hashers.py): the bounded per-namespace map of `BlockHasher`s.
* `RadixTree[V]` (tree.py): longest-prefix match over whole blocks, insert, ref-counted
  locks, LRU leaf eviction in O(log n) per block, subtree removal, snapshots. Each block
  carries one V (the worker: a KV block id).
* `OwnerIndex` (owners.py): a `RadixTree` keyed by block hashes whose blocks carry the
  set of workers holding them (the gateway), with per-owner updates that never scan.
"""

from prefixgate.radix.hashers import Hashers
from prefixgate.radix.hashing import (
    HASH_VERSION,
    BlockHasher,
    HashMemo,
    packed,
    tokens_to_bytes,
)
from prefixgate.radix.owners import OwnerIndex, OwnerMatch
from prefixgate.radix.tree import InsertResult, LockedError, MatchResult, Node, RadixTree

__all__ = [
    "HASH_VERSION",
    "BlockHasher",
    "HashMemo",
    "Hashers",
    "InsertResult",
    "LockedError",
    "MatchResult",
    "Node",
    "OwnerIndex",
    "OwnerMatch",
    "RadixTree",
    "packed",
    "tokens_to_bytes",
]
