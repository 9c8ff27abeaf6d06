"""Worker identity in the shared registry: one Ed25519 key per worker, signed
registrations, signed ownership, signed lifecycle entries (torch-free).

Why: anyone who can write to Redis could otherwise register a worker under the public
model fingerprint (and receive users' prompts) or write block ownership for another
worker (and steer turns). Each worker signs what it writes with its own private key;
gateways hold only the workers' public keys, so a gateway verifies but cannot sign as a
worker, and a worker's files (its key, its Redis user, its certificate) let their holder
sign as that worker only: never register, publish or leave as another.

Contract
--------
Keyring file (`--worker-keyring`), one entry per line, `#` comments:

    <worker id>  ed25519-private:<64 hex: the key's 32-byte seed>   a worker's own key
    <worker id>  ed25519:<64 hex: the raw 32-byte public key>         gateways: to verify it
    @gateways    hmac:<64 hex>                                        gateways only (below)
    @tickets     ed25519:<64 hex>                                     workers: gateways' pull
                                                                      tickets (security/tickets.py)

`prefixgate token --worker-key ID` prints a worker's pair of lines, `prefixgate token
--gateway-key` the `@gateways` line. A worker's keyring must hold its own private line
and no other private key nor the gateways' key (`Keyring.for_worker`); a gateway's must
hold no private key (`Keyring.for_gateway`). The shared forms of earlier versions
(`<id> <hex>` HMAC keys, a `*` master line every id derived its key from) are refused
with a message: one file let every pod sign as every worker.

What is signed (over length-prefixed fields; Ed25519 with the worker's key unless said):
  registration   worker id, address, model fingerprint, capacity -> `WorkerRecord.signature`
                 (128 hex; the epoch is Redis' to assign: a copied signature only ever
                 points at the genuine worker's own address). `verify_registration`.
  each batch     worker id, epoch, the batch's sequence number (1, 2, ... within the
                 epoch: the entry's `q` field) and each event's kind, parent and hashes as
                 they travel (registry/wire.py) -> the entry's `s` field. A gateway applies
                 a worker's batches only in increasing (epoch, sequence) order and only a
                 bounded step ahead of the last it applied (`position_refused`): a copy put
                 back on the stream is refused, and so is a far-future number (10^12),
                 without moving what the gateway expects next, so it cannot fence off the
                 worker's genuine batches.
  held blocks    the set of (block, parent) the worker's pg:kv hash holds after each batch,
                 as an order-free, incremental set hash (`HeldSet`: LtHash, 1024 lanes of
                 16 bits, so no secret is needed to recompute it and no forged set can be
                 made to match), signed with worker id, epoch, sequence number and count ->
                 the record's `kvmac` (hex) and `kvseq` fields. A gateway rebuilding its
                 index from pg:kv recomputes it and drops a worker's blocks when it differs.
  leave          worker id, epoch -> the `leave` entry's `s` field (the worker's shutdown).
  reap           worker id, epoch, HMAC with the gateways' key (`@gateways`) -> the `reap`
                 entry's `s`: gateways reap expired workers; workers hold no such key.
  predictions    a gateway's routing prediction for a worker: worker id, epoch, the
                 gateway's id, its sequence number (per gateway) and the packed hashes,
                 HMAC with the gateways' key -> the entry's `s`; readers apply each
                 gateway's predictions in increasing sequence order only.
With a keyring, gateways refuse unsigned leave, reap, batch and predict entries, and skip
`join` entries (Redis writes them; a worker's first signed batch of an epoch resets it).
Not covered: a holder of Redis credentials can still delete keys or reset a worker's
blocks (denial of service); it can no longer be routed to, nor steer turns. The holder of
one worker's key can act as that one worker (its pod is that worker).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from prefixgate.security.auth import credential_lines
from prefixgate.security.tickets import TICKETS, TicketSigner, ticket_key
from prefixgate.wire.events import OwnershipEvent

PRIVATE, PUBLIC, SECRET = "ed25519-private:", "ed25519:", "hmac:"
GATEWAYS = "@gateways"  # the keyring line of the gateways' shared key
# How far a signed sequence number may run ahead of the last one a gateway applied for
# that worker (a gateway sees every batch of an epoch in order unless the stream was
# trimmed, and then it rebuilds): beyond it the batch is refused, nothing else changes.
MAX_SEQ_AHEAD = 1 << 16
MAX_EPOCH_AHEAD = 1 << 10  # registrations between two batches a gateway applies


def _fields(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


def _raw(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    if isinstance(key, Ed25519PrivateKey):
        return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                 serialization.NoEncryption())
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def new_worker_key(worker_id: str) -> tuple[str, str]:
    """(the worker's private keyring line, the gateways' public line) of a fresh key."""
    key = Ed25519PrivateKey.generate()
    return (f"{worker_id} {PRIVATE}{_raw(key).hex()}",
            f"{worker_id} {PUBLIC}{_raw(key.public_key()).hex()}")


def new_gateway_key() -> str:
    """A fresh `@gateways` line (the gateways' shared key for predictions and reaps)."""
    return f"{GATEWAYS} {SECRET}{secrets.token_hex(32)}"


class Keyring:
    """Worker id -> public key (gateways), a worker's own private key, the gateways' key."""

    def __init__(self, public: dict[str, Ed25519PublicKey] | None = None,
                 private: dict[str, Ed25519PrivateKey] | None = None,
                 gateway_key: bytes | None = None,
                 ticket_key: Ed25519PublicKey | None = None) -> None:
        self.public = dict(public or {})
        self.private = dict(private or {})
        self.gateway_key = gateway_key
        # The public half of the gateways' pull-ticket key (the `@tickets` line; gateways
        # derive the private half from gateway_key: security/tickets.py).
        self.ticket_key = ticket_key
        for wid, key in self.private.items():  # a worker verifies its own entries too
            self.public.setdefault(wid, key.public_key())

    def __len__(self) -> int:
        return len(self.public)

    def ticket_signer(self) -> TicketSigner | None:
        """A gateway's pull-ticket signer (from the `@gateways` secret), or None."""
        return TicketSigner(ticket_key(self.gateway_key)) if self.gateway_key else None

    def public_key(self, worker_id: str) -> Ed25519PublicKey | None:
        return self.public.get(worker_id)

    def private_key(self, worker_id: str) -> Ed25519PrivateKey | None:
        return self.private.get(worker_id)

    @classmethod
    def parse(cls, text: str, source: str = "<keyring>") -> Keyring:
        public: dict[str, Ed25519PublicKey] = {}
        private: dict[str, Ed25519PrivateKey] = {}
        gateway_key = None
        ticket_key = None
        for where, fields in credential_lines(text, source):
            if len(fields) != 2:
                raise ValueError(f"{where}: expected '<worker id> ed25519:<hex>' (or "
                                 "ed25519-private:, or '@gateways hmac:<hex>')")
            wid, value = fields
            kind, sep, hexkey = value.partition(":")
            try:
                raw = bytes.fromhex(hexkey)
            except ValueError:
                raw = b""
            if not sep or kind + ":" not in (PRIVATE, PUBLIC, SECRET) or len(raw) != 32:
                raise ValueError(
                    f"{where}: not a per-worker key. Shared keys ('<id> <hex>' lines, a '*' "
                    "master) are no longer accepted: they let every holder sign as every "
                    "worker. Make one key per worker with `prefixgate token --worker-key ID` "
                    "(the worker gets the ed25519-private line, gateways the ed25519 line)")
            if wid == TICKETS:
                if kind + ":" != PUBLIC or ticket_key is not None:
                    raise ValueError(f"{where}: '{TICKETS}' holds one 'ed25519:' (public) key")
                ticket_key = Ed25519PublicKey.from_public_bytes(raw)
                continue
            if (wid == GATEWAYS) != (kind + ":" == SECRET):
                raise ValueError(f"{where}: only the '{GATEWAYS}' line holds an hmac: key, "
                                 "and it holds nothing else")
            if wid == GATEWAYS:
                if gateway_key is not None:
                    raise ValueError(f"{where}: '{GATEWAYS}' is listed twice")
                gateway_key = raw
                continue
            table = private if kind + ":" == PRIVATE else public
            if wid in table:
                raise ValueError(f"{where}: worker {wid!r} is listed twice")
            if table is private:
                private[wid] = Ed25519PrivateKey.from_private_bytes(raw)
            else:
                public[wid] = Ed25519PublicKey.from_public_bytes(raw)
        if not (public or private):
            raise ValueError(f"{source}: no worker keys")
        return cls(public, private, gateway_key, ticket_key)

    @classmethod
    def from_file(cls, path: str | Path) -> Keyring:
        return cls.parse(Path(path).read_text(), str(path))

    def for_gateway(self, source: str) -> Keyring:
        """This keyring, checked fit for a gateway: public keys only (a gateway that could
        sign as a worker would make every gateway pod a key to every worker)."""
        if self.private:
            raise ValueError(f"{source} holds the private key of worker "
                             f"{sorted(self.private)[0]!r}: give gateways only the "
                             "'ed25519:' (public) lines")
        return self

    def for_worker(self, worker_id: str, source: str) -> Keyring:
        """This keyring, checked fit for worker `worker_id`: its own private key, no
        other worker's, not the gateways' key."""
        if worker_id not in self.private:
            raise ValueError(f"{source} has no 'ed25519-private:' line for worker id "
                             f"{worker_id!r} (`prefixgate token --worker-key {worker_id}`)")
        others = sorted(set(self.private) - {worker_id})
        if others:
            raise ValueError(f"{source} also holds the private key of worker {others[0]!r}: "
                             "each worker gets its own line only")
        if self.gateway_key is not None:
            raise ValueError(f"{source} holds the gateways' key ('{GATEWAYS}'): workers "
                             "must not have it (it signs predictions and reaps)")
        return self


def _verifies(key: Ed25519PublicKey | None, signature: bytes, message: bytes) -> bool:
    if key is None or len(signature) != 64:
        return False
    try:
        key.verify(signature, message)
    except InvalidSignature:
        return False
    return True


def _registration_message(worker_id: str, address: str, model_fingerprint: str,
                          capacity_blocks: int) -> bytes:
    return _fields(b"register", worker_id.encode(), address.encode(),
                   model_fingerprint.encode(), str(capacity_blocks).encode())


def sign_registration(key: Ed25519PrivateKey, worker_id: str, address: str,
                      model_fingerprint: str, capacity_blocks: int) -> str:
    return key.sign(_registration_message(worker_id, address, model_fingerprint,
                                          capacity_blocks)).hex()


def verify_registration(keyring: Keyring, worker_id: str, address: str,
                        model_fingerprint: str, capacity_blocks: int, signature: str) -> str:
    """"" when the registration verifies, else why not (for the gateway's log)."""
    key = keyring.public_key(worker_id)
    if key is None:
        return (f"worker id {worker_id!r} is not in the gateway's --worker-keyring: add its "
                "public line there (`prefixgate token --worker-key ID` prints it)")
    if not signature:
        return ("its registration is not signed: start the worker with --worker-keyring "
                "holding its private key")
    try:
        sig = bytes.fromhex(signature)
    except ValueError:
        sig = b""
    if not _verifies(key, sig, _registration_message(worker_id, address, model_fingerprint,
                                                     capacity_blocks)):
        return ("its registration signature does not verify: the worker's key is not the "
                "one the gateway's --worker-keyring lists, or someone else registered this id")
    return ""


def batch_message(worker_id: str, epoch: int, seq: int,
                  events: Sequence[tuple[bytes, bytes, bytes]]) -> bytes:
    """The signed bytes of batch number `seq` of `epoch`: (kind, parent bytes, packed
    hashes) per event."""
    return _fields(b"batch", worker_id.encode(), str(epoch).encode(), str(seq).encode(),
                   *(f for ev in events for f in ev))


def verify_batch(keyring: Keyring, worker_id: str, message: bytes, signature: bytes) -> bool:
    return _verifies(keyring.public_key(worker_id), signature, message)


def position_refused(last: tuple[int, int] | None, position: tuple[int, int]) -> str:
    """"" when a verified batch at (epoch, seq) `position` may be applied after `last`
    (the last one applied for that worker; None: none yet, and then any position is the
    start: a gateway that starts while a worker has sent 10^5 batches must follow it;
    only that worker's key signs its batches), else why not."""
    epoch, seq = position
    if seq < 1:
        return "its sequence number is not positive"
    if last is None:
        return ""
    if position <= last:
        return "not after the last one applied (a copy put back on the stream)"
    if epoch == last[0] and seq > last[1] + MAX_SEQ_AHEAD:
        return f"sequence number {seq} is more than {MAX_SEQ_AHEAD} after {last[1]}"
    if epoch > last[0] and (epoch > last[0] + MAX_EPOCH_AHEAD or seq > MAX_SEQ_AHEAD):
        return f"epoch {epoch} / sequence number {seq} is far ahead of epoch {last[0]}"
    return ""


def _lifecycle_message(kind: str, worker_id: str, epoch: int) -> bytes:
    return _fields(kind.encode(), worker_id.encode(), str(epoch).encode())


def sign_leave(key: Ed25519PrivateKey, worker_id: str, epoch: int) -> bytes:
    return key.sign(_lifecycle_message("leave", worker_id, epoch))


def reap_mac(gateway_key: bytes, worker_id: str, epoch: int) -> bytes:
    return hmac.new(gateway_key, _lifecycle_message("reap", worker_id, epoch),
                    hashlib.sha256).digest()


def verify_lifecycle(keyring: Keyring, kind: str, worker_id: str, epoch: int,
                     signature: bytes) -> bool:
    """Whether a `leave` (signed by the worker) or `reap` (by a gateway) entry verifies."""
    if kind == "leave":
        return _verifies(keyring.public_key(worker_id), signature,
                         _lifecycle_message("leave", worker_id, epoch))
    if kind == "reap" and keyring.gateway_key is not None:
        return hmac.compare_digest(reap_mac(keyring.gateway_key, worker_id, epoch), signature)
    return False


def prediction_mac(gateway_key: bytes, worker_id: str, epoch: int, source: str, seq: int,
                   packed_hashes: bytes) -> bytes:
    """The MAC of prediction `seq` of gateway `source`: `packed_hashes` expected on
    `worker_id` (under `epoch`), with the gateways' key."""
    msg = _fields(b"predict", worker_id.encode(), str(epoch).encode(), source.encode(),
                  str(seq).encode(), packed_hashes)
    return hmac.new(gateway_key, msg, hashlib.sha256).digest()[:16]


# --- the held-block set -----------------------------------------------------------------

_LANES = 1024  # LtHash16: 1024 lanes of 16 bits (2 KiB), summed mod 2^16 lane by lane


def _terms(pairs: Iterable[tuple[int, int]]) -> np.ndarray:
    """One row of 1024 uint16 lanes per (block, parent): SHAKE-128 of the pair."""
    rows = b"".join(hashlib.shake_128(b"pg-kv" + b.to_bytes(8, "little")
                                      + p.to_bytes(8, "little")).digest(2 * _LANES)
                    for b, p in pairs)
    return np.frombuffer(rows, dtype="<u2").reshape(-1, _LANES)


class HeldSet:
    """An incremental hash of a set of (block, parent) pairs: the lane-wise sum mod 2^16
    of each pair's SHAKE-128 expansion (LtHash; finding a different set with the same sum
    is a lattice problem, so anyone may recompute it and no one can forge a match).
    Adding and removing a pair are one vector addition each."""

    def __init__(self) -> None:
        self._sum = np.zeros(_LANES, dtype=np.uint16)
        self.count = 0

    @classmethod
    def of(cls, blocks: dict[int, int | None]) -> HeldSet:
        held = cls()
        items = [(b, p or 0) for b, p in blocks.items()]
        for i in range(0, len(items), 4096):  # bounded temporary memory (8 MiB)
            held._sum += _terms(items[i:i + 4096]).sum(axis=0, dtype=np.uint16)
        held.count = len(items)
        return held

    def add(self, block: int, parent: int) -> None:
        self._sum += _terms([(block, parent)])[0]
        self.count += 1

    def remove(self, block: int, parent: int) -> None:
        self._sum -= _terms([(block, parent)])[0]
        self.count -= 1

    def clear(self) -> None:
        self._sum[:] = 0
        self.count = 0

    def digest(self) -> bytes:
        return hashlib.sha256(b"pg-kv-set" + self._sum.astype("<u2").tobytes()).digest()


def held_set_message(worker_id: str, epoch: int, seq: int, held: HeldSet) -> bytes:
    return _fields(b"kvset", worker_id.encode(), str(epoch).encode(), str(seq).encode(),
                   str(held.count).encode(), held.digest())


def verify_held_set(keyring: Keyring, worker_id: str, epoch: int, seq: int,
                    blocks: dict[int, int | None], signature_hex: bytes | str | None) -> bool:
    """Whether `blocks` (as read from pg:kv) is the set worker `worker_id` signed after
    its batch `seq` of `epoch`."""
    if not signature_hex:
        return False
    try:
        sig = bytes.fromhex(signature_hex.decode() if isinstance(signature_hex, bytes)
                            else signature_hex)
    except ValueError:
        return False
    return _verifies(keyring.public_key(worker_id), sig,
                     held_set_message(worker_id, epoch, seq, HeldSet.of(blocks)))


class OwnershipSigner:
    """A worker's signing state: its key, the blocks its pg:kv hash holds, and the
    sequence number of its last signed batch in the current epoch (`seq`)."""

    def __init__(self, key: Ed25519PrivateKey, worker_id: str) -> None:
        self.key = key
        self.worker_id = worker_id
        self._held: dict[int, int] = {}  # block -> parent (0: root), as in pg:kv
        self._set = HeldSet()
        self.seq = 0

    def registration(self, address: str, model_fingerprint: str, capacity_blocks: int) -> str:
        """Sign a registration; the registry empties pg:kv, so the held set starts empty."""
        self._held.clear()
        self._set.clear()
        self.seq = 0
        return sign_registration(self.key, self.worker_id, address, model_fingerprint,
                                 capacity_blocks)

    def leave(self, epoch: int) -> bytes:
        return sign_leave(self.key, self.worker_id, epoch)

    def _put(self, block: int, parent: int) -> None:
        old = self._held.get(block)
        if old == parent:
            return
        if old is not None:
            self._set.remove(block, old)
        self._held[block] = parent
        self._set.add(block, parent)

    def sign(self, epoch: int, events: Sequence[OwnershipEvent],
             wire: Sequence[tuple[bytes, bytes, bytes]]) -> tuple[bytes, bytes]:
        """(batch signature, held-set signature after the batch) for `events`, whose wire
        form is `wire`, as batch number `self.seq` (the next one) of `epoch`. Applying the
        same batch twice gives the same held set (idempotent)."""
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
                        self._set.remove(h, old)
            else:
                self._held.clear()
                self._set.clear()
        return (self.key.sign(batch_message(self.worker_id, epoch, self.seq, wire)),
                self.key.sign(held_set_message(self.worker_id, epoch, self.seq, self._set)))
