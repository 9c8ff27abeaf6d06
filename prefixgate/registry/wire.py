"""The Redis registry's wire format: block hashes as bytes, stream entries, stream ids.

Contract
--------
Block hashes travel as consecutive little-endian u64 (`pack_hashes` / `unpack_hashes`);
a parent hash as 8 such bytes, or "" for the root. One pg:events stream entry has fields
  w  worker id          e  epoch          k  join | leave | reap | batch | predict
and for a batch  n (number of events), then per event i: k{i} (store, remove, clear),
p{i} (parent, 8 bytes or ""), h{i} (block hashes, 8 bytes each), and when the worker
signs (prefixgate.security.identity) s (the batch MAC) and q (its sequence number in the epoch);
for a predict entry (a gateway routed a turn to w: its prompt's blocks are expected
there, gateway/index.py) g (the publishing gateway's id) and h (the prompt's chained
block hashes from the root), decoded as one "store" event. `StreamEntry` is one entry decoded. Stream ids are "ms-seq";
`stream_id_newer` orders them.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from prefixgate.wire.events import OwnershipEvent

_BIG_ENDIAN = sys.byteorder == "big"


@dataclass(frozen=True)
class StreamEntry:
    """One pg:events entry: a lifecycle change (kind join / leave / reap) or a batch."""

    entry_id: bytes
    worker_id: str
    epoch: int
    kind: str
    events: list[OwnershipEvent]
    source: str = ""  # predict: the gateway that published it


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Block hashes as consecutive little-endian u64 (the Redis wire format)."""
    a = array("Q", hashes)
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tobytes()


def unpack_hashes(data: bytes) -> list[int]:
    a = array("Q")
    a.frombytes(data)
    if _BIG_ENDIAN:
        a.byteswap()
    return a.tolist()


def parent_bytes(parent: int | None) -> bytes:
    return b"" if parent is None else parent.to_bytes(8, "little")


def parent_int(data: bytes) -> int | None:
    return int.from_bytes(data, "little") if data else None


def decode_entry(entry_id: bytes, f: dict[bytes, bytes]) -> StreamEntry:
    """A raw XREAD entry (bytes field -> bytes value) as a StreamEntry."""
    kind = f[b"k"].decode()
    events = []
    source = ""
    if kind == "batch":
        for i in range(int(f[b"n"])):
            events.append(OwnershipEvent(f[b"k%d" % i].decode(), unpack_hashes(f[b"h%d" % i]),
                                         parent_int(f[b"p%d" % i])))
    elif kind == "predict":
        events.append(OwnershipEvent("store", unpack_hashes(f[b"h"])))
        source = f[b"g"].decode()
    return StreamEntry(entry_id, f[b"w"].decode(), int(f[b"e"]), kind, events, source)


def stream_id_newer(a: bytes, b: bytes) -> bool:
    """Whether stream id `a` is after `b` ("ms-seq" ids)."""
    ams, _, aseq = a.partition(b"-")
    bms, _, bseq = b.partition(b"-")
    return (int(ams), int(aseq or 0)) > (int(bms), int(bseq or 0))


def _as_bytes(v: object) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


def stream_position(info: object) -> tuple[bytes, int]:
    """(last generated id, entries added) from an XINFO STREAM reply, or the empty
    stream's position when it failed because the stream does not exist yet."""
    if isinstance(info, Exception):
        if "no such key" in str(info).lower():
            return b"0-0", 0
        raise info
    assert isinstance(info, dict)
    return _as_bytes(info.get("last-generated-id", b"0-0")), int(info.get("entries-added", 0))
