"""Chained, salted hashes of full token blocks.

A prompt is cut into blocks of `block_size` tokens; only FULL blocks are hashed (the
tail shorter than a block is ignored). Block i's hash depends on every token before it
through the parent hash, so equal hashes mean equal prefixes, and a continuation hashed
from its prefix's last hash equals hashing the whole sequence at once.

Byte-level spec (version 1). All integers are little-endian; XXH3_64 is the 64-bit
XXH3 of xxHash (>= 0.8), returned as an unsigned 64-bit integer.

1. Salt material, from the hasher's configuration::

       b"prefixgate.block.v1\\x00"          20 bytes, ASCII, ends with one zero byte
       u32(block_size)                       4 bytes
       u32(len(F)) || F                      F = model_fingerprint encoded as UTF-8
       u32(len(N)) || N                      N = namespace encoded as UTF-8

   The length prefixes make (F="a", N="bc") differ from (F="ab", N="c").

2. ``salt = XXH3_64(salt material, seed=0)``. The root hash, the parent of the first
   block of every sequence, is the salt itself: ``root_hash = salt``.

3. Block i with tokens t_0 .. t_{block_size-1} (each 0 <= t < 2**32)::

       h_i = XXH3_64(u64(h_{i-1}) || u32(t_0) || ... || u32(t_{block_size-1}), seed=salt)
       h_{-1} = root_hash  (or the caller's parent_hash)

   so the block input is 8 + 4 * block_size bytes (72 bytes at the default 16) and the
   salt enters every block as the XXH3 seed, not only through the chain: two hashers
   with different namespaces give different hashes even for the same parent_hash.

Guarantees: identical across processes, machines and runs (no use of Python's `hash`);
different (model_fingerprint, namespace, block_size) give unrelated hash streams, so a
tenant's prefix never matches another tenant's except by a 64-bit collision (about
n**2 / 2**65 for n distinct blocks). Test vectors in tests/radix/test_hashing.py pin the
spec; changing any byte above is a new version.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

__all__ = ["BlockHasher", "HASH_VERSION", "HashMemo", "SALT_PREFIX", "packed", "tokens_to_bytes"]

HASH_VERSION = 1
SALT_PREFIX = b"prefixgate.block.v1\x00"

# An array typecode holding exactly 4 bytes ('I' on every mainstream platform).
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_BIG_ENDIAN = sys.byteorder == "big"
_xxh3 = xxhash.xxh3_64_intdigest
_u64 = struct.Struct("<Q").pack


def _u32(n: int) -> bytes:
    return n.to_bytes(4, "little")


def tokens_to_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as consecutive little-endian u32; ValueError if one is out of range."""
    try:
        arr = array(_U32, token_ids)
    except OverflowError:
        bad = next(t for t in token_ids if not 0 <= t < 2**32)
        raise ValueError(f"token id {bad} out of range: token ids must be in [0, 2**32)") from None
    except TypeError as exc:
        raise ValueError(f"token ids must be ints: {exc}") from None
    if _BIG_ENDIAN:  # the spec is little-endian on every host
        arr.byteswap()
    return arr.tobytes()


def packed(data: bytes) -> memoryview:
    """`data` (token ids as consecutive little-endian u32, the spec's own byte form) as a
    read-only sequence of token ids without copying: len() is the number of ids, and
    `BlockHasher.hash_blocks` hashes it straight from these bytes. ValueError when the
    length is not a multiple of 4. (Indexing it reads host byte order: equal to the ids
    on every little-endian host; the hashes are right on any host.)"""
    if len(data) % 4:
        raise ValueError(f"packed token ids are {len(data)} bytes, not a multiple of 4")
    return memoryview(data).cast("B").cast(_U32)


@dataclass(frozen=True)
class BlockHasher:
    """Hashes full blocks of token ids into chained u64 hashes (spec: module docstring).

    Immutable and cheap to share; one per (model, namespace, block size).
    """

    block_size: int = 16
    model_fingerprint: str = ""
    namespace: str = ""
    _salt: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or not 0 < self.block_size < 2**32:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        fp = self.model_fingerprint.encode("utf-8")
        ns = self.namespace.encode("utf-8")
        material = b"".join(
            (SALT_PREFIX, _u32(self.block_size), _u32(len(fp)), fp, _u32(len(ns)), ns)
        )
        object.__setattr__(self, "_salt", _xxh3(material))

    @property
    def root_hash(self) -> int:
        """The parent hash of a sequence's first block (= the salt)."""
        return self._salt

    def num_full_blocks(self, num_tokens: int) -> int:
        """How many full blocks `num_tokens` tokens make (the tail is not hashed)."""
        return num_tokens // self.block_size

    def hash_blocks(self, token_ids: Sequence[int] | memoryview,
                    parent_hash: int | None = None) -> list[int]:
        """One u64 hash per FULL block of `token_ids`, chained from `parent_hash`.

        `token_ids` is any sequence of ints, or packed ids (`packed(data)`: a memoryview
        of 4-byte items), which are hashed from their bytes with no per-id Python object.

        `parent_hash` defaults to `root_hash` (the sequence starts at position 0); pass
        the last hash of a prefix to hash its continuation. Raises ValueError for a
        token id outside [0, 2**32) or a parent_hash outside [0, 2**64). Pure: no state
        changes.
        """
        n = len(token_ids) // self.block_size
        if n == 0:
            return []
        h = self._salt if parent_hash is None else parent_hash
        if not 0 <= h < 2**64:
            raise ValueError(f"parent_hash must be an unsigned 64-bit int, got {h}")
        if isinstance(token_ids, memoryview) and token_ids.itemsize == 4:
            # Already the spec's little-endian u32 bytes: one C copy (slicing bytes is
            # cheaper than slicing a memoryview in the loop below).
            data = token_ids.cast("B")[: n * 4 * self.block_size].tobytes()
        else:
            data = tokens_to_bytes(token_ids[: n * self.block_size])
        step = 4 * self.block_size
        seed = self._salt
        out: list[int] = []
        append = out.append
        # The per-block loop is the hot path (2,048 iterations for 32k tokens): one
        # concatenation and one C call each, no per-token Python work.
        for off in range(0, n * step, step):
            h = _xxh3(_u64(h) + data[off : off + step], seed)
            append(h)
        return out


class HashMemo:
    """Block hashes of recent prompts, so that a prompt extending one seen before hashes
    only its new blocks (a multi-turn chat's next turn repeats the whole conversation:
    at 12k tokens that is ~750 blocks of 16 hashed again for ~30 new ones).

    Contract: `hash_blocks(hasher, token_ids, key)` returns exactly
    `hasher.hash_blocks(token_ids)`. It looks up the last prompt remembered under `key`
    (a conversation id; empty: the prompt's first block hash, so prompts that start alike
    share an entry) and with the same hasher, reuses the hashes of the full blocks both
    prompts share byte for byte (checked with memcmp, never assumed), hashes the rest,
    and remembers this prompt in its place. Its memory stays under about `max_bytes`
    (prompt bytes, kept by reference, plus an estimate of the hash list and entry; least
    recently used entries go first).
    """

    _ENTRY_BYTES = 256  # dict slot, tuple, key (estimate)
    _HASH_BYTES = 40  # one int in a list (estimate)

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[object, tuple[BlockHasher, bytes, list[int], int]] = \
            OrderedDict()
        self._bytes = 0
        # Full blocks of the prompts given: hashed, or their hashes reused from the memo.
        self.hashed_blocks = 0
        self.reused_blocks = 0

    def hash_blocks(self, hasher: BlockHasher, token_ids: memoryview, key: str = "") -> list[int]:
        step = 4 * hasher.block_size
        n = len(token_ids) // hasher.block_size
        if n == 0 or self.max_bytes <= 0:
            self.hashed_blocks += n
            return hasher.hash_blocks(token_ids)
        data = token_ids.obj if isinstance(token_ids.obj, bytes) and \
            len(token_ids.obj) == 4 * len(token_ids) else token_ids.cast("B").tobytes()
        if not key:
            key = hasher.hash_blocks(packed(data[:step]))[0]
        entry = self._entries.pop(key, None)
        same = 0
        if entry is not None:
            self._bytes -= entry[3]
            if entry[0] == hasher:
                same = self._shared_blocks(data, entry[1], min(n, len(entry[2])), step)
        if same:
            prev = entry[2]
            out = prev[:same] + hasher.hash_blocks(packed(data[same * step: n * step]),
                                                   prev[same - 1])
        else:
            out = hasher.hash_blocks(token_ids)
        self.hashed_blocks += n - same
        self.reused_blocks += same
        size = len(data) + self._HASH_BYTES * len(out) + self._ENTRY_BYTES
        if size <= self.max_bytes:
            self._entries[key] = (hasher, data, out, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._bytes -= self._entries.popitem(last=False)[1][3]
        return out

    @staticmethod
    def _shared_blocks(data: bytes, prev: bytes, limit: int, step: int) -> int:
        """The most leading full blocks (<= limit) equal in `data` and `prev`."""
        view = memoryview(prev)
        if data.startswith(view[: limit * step]):  # the usual case: a continuation
            return limit
        lo, hi = 0, limit - 1  # binary search: lo blocks are known equal
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if data.startswith(view[: mid * step]):
                lo = mid
            else:
                hi = mid - 1
        return lo
