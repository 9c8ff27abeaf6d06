"""Worker identity in the shared registry: per-worker keys, signed registrations, signed
ownership (torch-free).

Why: anyone who can write to Redis could otherwise register a worker under the public
model fingerprint (and receive users' prompts) or write block ownership for another
worker (and steer turns). With a keyring, every worker signs what it writes with its own
key, and gateways, which hold every worker's key, accept only what verifies.

Contract
--------
Keyring file (`--worker-keyring`), one worker per line, `#` comments:

    <worker id>  <key: at least 32 hex digits>

Gateways load every line; a worker needs (at least) its own line. A line `* <key>` is a
master key: a worker id with no line of its own gets HMAC(master, id) (for fleets whose
ids are not known in advance, e.g. a StatefulSet; every holder of the master can then sign
as any worker, so give it to workers only where they cannot be told apart anyway).
`prefixgate token --worker-key ID` prints a line.

What is signed (HMAC-SHA256 with the worker's key, over length-prefixed fields):
  registration   worker id, address, model fingerprint, capacity -> `WorkerRecord.signature`
                 (the epoch is Redis' to assign; a copied signature only ever points at
                 the genuine worker's own address). `verify_registration` says why not.
  each batch     worker id, epoch, the batch's sequence number (1, 2, ... within the
                 epoch: the entry's `q` field) and each event's kind, parent and hashes
                 exactly as they travel (registry/wire.py) -> the stream entry's `s` field
                 (`batch_mac`). A gateway applies a worker's batches only in increasing
                 (epoch, sequence) order, so a genuine batch copied onto the stream again
                 later (a replayed "store" would list blocks since evicted) is refused.
  held blocks    the set of (block, parent) the worker's pg:kv hash holds after each batch,
                 as an order-free digest (XOR of a keyed hash per block, with the count),
                 MACed with worker id, epoch and the sequence number of the batch that
                 left it -> the record's `kvmac` and `kvseq` fields. A gateway rebuilding
                 its index from pg:kv recomputes it (`kv_set_mac`), drops a worker's blocks
                 when it differs, and applies only that worker's batches after `kvseq`.
                 `OwnershipSigner` keeps the worker's side of that set in step with the Lua
                 that applies batches (store chains, remove, clear); re-sending a batch
                 whose reply was lost signs it under the next sequence number (applying
                 it twice leaves the same set).
  predictions    a gateway's routing prediction for a worker (registry/wire.py "predict"):
                 worker id, epoch, the gateway's id, its sequence number (per gateway) and
                 the packed hashes, with the key of the worker it names (gateways hold
                 every worker's key) -> the entry's `s` field (`prediction_mac`); readers
                 apply each gateway's predictions in increasing sequence order only.
Not covered: a holder of Redis credentials can still delete or reset (denial of service);
it can no longer be routed to, nor steer turns. Redis ACL users (deploy/) narrow who that is.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from pathlib import Path

from prefixgate.security.auth import credential_lines
from prefixgate.wire.events import OwnershipEvent

_MIN_KEY_HEX = 32


def _fields(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


class Keyring:
    """worker id -> key."""

    def __init__(self, keys: dict[str, bytes]) -> None:
        self._keys = dict(keys)

    def __len__(self) -> int:
        return len(self._keys)

    def key(self, worker_id: str) -> bytes | None:
        key = self._keys.get(worker_id)
        if key is None and "*" in self._keys:
            key = hmac.new(self._keys["*"], b"prefixgate-worker-key\0" + worker_id.encode(),
                           hashlib.sha256).digest()
        return key

    @classmethod
    def parse(cls, text: str, source: str = "<keyring>") -> Keyring:
        keys: dict[str, bytes] = {}
        for where, fields in credential_lines(text, source):
            if len(fields) != 2:
                raise ValueError(f"{where}: expected '<worker id> <hex key>'")
            wid, hexkey = fields
            try:
                key = bytes.fromhex(hexkey)
            except ValueError:
                raise ValueError(f"{where}: the key is not hex") from None
            if len(hexkey) < _MIN_KEY_HEX:
                raise ValueError(f"{where}: the key must have at least {_MIN_KEY_HEX} hex "
                                 "digits (`openssl rand -hex 32`)")
            if wid in keys:
                raise ValueError(f"{where}: worker {wid!r} is listed twice")
            keys[wid] = key
        if not keys:
            raise ValueError(f"{source}: no keys")
        return cls(keys)

    @classmethod
    def from_file(cls, path: str | Path) -> Keyring:
        return cls.parse(Path(path).read_text(), str(path))


def sign_registration(key: bytes, worker_id: str, address: str, model_fingerprint: str,
                      capacity_blocks: int) -> str:
    msg = _fields(b"register", worker_id.encode(), address.encode(), model_fingerprint.encode(),
                  str(capacity_blocks).encode())
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def verify_registration(keyring: Keyring, worker_id: str, address: str,
                        model_fingerprint: str, capacity_blocks: int, signature: str) -> str:
    """"" when the registration verifies, else why not (for the gateway's log)."""
    key = keyring.key(worker_id)
    if key is None:
        return (f"worker id {worker_id!r} is not in the gateway's --worker-keyring: add its "
                "key there (and give the worker the same line)")
    if not signature:
        return ("its registration is not signed: start the worker with --worker-keyring "
                "holding its key")
    expected = sign_registration(key, worker_id, address, model_fingerprint, capacity_blocks)
    if not hmac.compare_digest(expected, signature):
        return ("its registration signature does not verify: the worker's key differs from "
                "the gateway's --worker-keyring, or someone else registered this id")
    return ""


def batch_message(worker_id: str, epoch: int, seq: int,
                  events: Sequence[tuple[bytes, bytes, bytes]]) -> bytes:
    """The signed bytes of batch number `seq` of `epoch`: (kind, parent bytes, packed
    hashes) per event."""
    return _fields(b"batch", worker_id.encode(), str(epoch).encode(), str(seq).encode(),
                   *(f for ev in events for f in ev))


def batch_mac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()[:16]


def prediction_mac(key: bytes, worker_id: str, epoch: int, source: str, seq: int,
                   packed_hashes: bytes) -> bytes:
    """The MAC of prediction `seq` of gateway `source`: `packed_hashes` expected on
    `worker_id` (under `epoch`), with that worker's key."""
    msg = _fields(b"predict", worker_id.encode(), str(epoch).encode(), source.encode(),
                  str(seq).encode(), packed_hashes)
    return hmac.new(key, msg, hashlib.sha256).digest()[:16]


def _block_term(key: bytes, block: int, parent: int) -> int:
    h = hashlib.blake2b(block.to_bytes(8, "little") + parent.to_bytes(8, "little"),
                        key=key[:64], digest_size=16, person=b"pg-kv-set")
    return int.from_bytes(h.digest(), "little")


def _set_mac(key: bytes, worker_id: str, epoch: int, seq: int, count: int,
             digest: int) -> bytes:
    msg = _fields(b"kvset", worker_id.encode(), str(epoch).encode(), str(seq).encode(),
                  str(count).encode(), digest.to_bytes(16, "little"))
    return hmac.new(key, msg, hashlib.sha256).digest()[:16]


def kv_set_mac(key: bytes, worker_id: str, epoch: int, seq: int,
               blocks: dict[int, int | None]) -> bytes:
    """The MAC of a worker's held blocks (block -> parent, None: root) after its batch
    `seq` of `epoch`, as a gateway recomputes it from pg:kv."""
    digest = 0
    for block, parent in blocks.items():
        digest ^= _block_term(key, block, parent or 0)
    return _set_mac(key, worker_id, epoch, seq, len(blocks), digest)


class OwnershipSigner:
    """A worker's signing state: its key, the blocks its pg:kv hash holds, and the
    sequence number of its last signed batch in the current epoch (`seq`)."""

    def __init__(self, key: bytes, worker_id: str) -> None:
        self.key = key
        self.worker_id = worker_id
        self._held: dict[int, int] = {}  # block -> parent (0: root), as in pg:kv
        self._digest = 0
        self.seq = 0

    def registration(self, address: str, model_fingerprint: str, capacity_blocks: int) -> str:
        """Sign a registration; the registry empties pg:kv, so the held set starts empty."""
        self._held.clear()
        self._digest = 0
        self.seq = 0
        return sign_registration(self.key, self.worker_id, address, model_fingerprint,
                                 capacity_blocks)

    def _put(self, block: int, parent: int) -> None:
        old = self._held.get(block)
        if old is not None:
            self._digest ^= _block_term(self.key, block, old)
        self._held[block] = parent
        self._digest ^= _block_term(self.key, block, parent)

    def sign(self, epoch: int, events: Sequence[OwnershipEvent],
             wire: Sequence[tuple[bytes, bytes, bytes]]) -> tuple[bytes, bytes]:
        """(batch MAC, held-set MAC after the batch) for `events`, whose wire form is
        `wire`, as batch number `self.seq` (the next one) of `epoch`. Applying the same
        batch twice gives the same held set (idempotent)."""
        self.seq += 1
        for ev in events:
            if ev.kind == "store":
                parent = ev.parent_hash or 0
                for h in ev.block_hashes:
                    self._put(h, parent)
                    parent = h
            elif ev.kind == "remove":
                for h in ev.block_hashes:
                    old = self._held.pop(h, None)
                    if old is not None:
                        self._digest ^= _block_term(self.key, h, old)
            else:
                self._held.clear()
                self._digest = 0
        return (batch_mac(self.key, batch_message(self.worker_id, epoch, self.seq, wire)),
                _set_mac(self.key, self.worker_id, epoch, self.seq, len(self._held),
                         self._digest))
