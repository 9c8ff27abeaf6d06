"""Pull tickets: who may read which KV blocks from which worker (torch-free).

Why: a worker's cached KV pages are its tenants' prompts in another form. Without a
ticket, any caller holding the peer credential (any worker pod's files) could export any
chain from any worker. A ticket names one pull: the gateway signs it where it plans the
pull (gateway/pulls.py), the receiver passes it on unchanged, and the holder checks it
before it pins a block (workerapi/server.py ExportBlocks; PERMISSION_DENIED otherwise, and
the receiver computes instead).

Contract
--------
  chain_digest(block_hashes) -> 32 bytes: SHA-256 of the chain's hashes (u64 little-endian).
  TicketSigner(key).sign(receiver, holder, namespace, block_hashes, ttl_s) -> bytes
      A ticket for `receiver` to read the blocks of `block_hashes` (a leading run of
      them, any length) from `holder` until now + ttl_s (wall clock, Unix seconds).
  check_ticket(ticket, keys, holder, block_hashes, caller_names, now) -> PullTicket
      The decoded ticket when it verifies with one of `keys` (Ed25519 public keys), names
      `holder` (this worker), `block_hashes` is exactly its chain (the receiver sends the
      whole ticketed chain and `ExportBlocksRequest.max_blocks`), it has not expired, and
      `caller_names` (the names in the caller's TLS certificate; empty: not known, e.g.
      plain text on loopback) include its receiver. Raises PermissionDenied otherwise,
      with a message that says which check failed.

Wire form: b"pgt1", then length-prefixed receiver, holder, namespace, chain digest,
number of blocks and expiry (milliseconds), then the 64-byte Ed25519 signature over all
of it. About 150 bytes.

Keys: gateways sign with a key derived from the `@gateways` secret of their keyring
(`ticket_key`), so every gateway signs alike and no new secret is needed; workers hold
only its public half, the `@tickets ed25519:<hex>` keyring line (`ticket_public_line`).
A worker also accepts tickets it signed itself with its own worker key: the pulls it
starts (the drain hand-off, its copy-path probe) are its own to allow.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from prefixgate.security.auth import PermissionDenied

MAGIC = b"pgt1"
TICKETS = "@tickets"  # the keyring line of the gateways' ticket key (public, for workers)
DEFAULT_TTL_S = 120.0  # a planned pull starts within milliseconds; clocks may differ a little
_SIGNATURE_BYTES = 64
MAX_TICKET_BYTES = 1024


def chain_digest(block_hashes: Sequence[int]) -> bytes:
    """SHA-256 of a chain of block hashes (each as 8 bytes, little-endian)."""
    return hashlib.sha256(b"pg-chain" + struct.pack(f"<{len(block_hashes)}Q",
                                                    *block_hashes)).digest()


def ticket_key(gateway_key: bytes) -> Ed25519PrivateKey:
    """The gateways' ticket-signing key, derived from their `@gateways` secret."""
    seed = hmac.new(gateway_key, b"pg-pull-ticket", hashlib.sha256).digest()
    return Ed25519PrivateKey.from_private_bytes(seed)


def ticket_public_line(gateway_key: bytes) -> str:
    """The `@tickets ed25519:<hex>` keyring line workers need to check gateway tickets."""
    public = ticket_key(gateway_key).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return f"{TICKETS} ed25519:{public.hex()}"


@dataclass(frozen=True)
class PullTicket:
    receiver: str
    holder: str
    namespace: str
    chain: bytes  # chain_digest of the ticketed chain
    num_blocks: int
    expires_ms: int


def _lp(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(2, "little") + p for p in parts)


def _body(t: PullTicket) -> bytes:
    return MAGIC + _lp(t.receiver.encode(), t.holder.encode(), t.namespace.encode(), t.chain,
                       str(t.num_blocks).encode(), str(t.expires_ms).encode())


def _parse(data: bytes) -> tuple[PullTicket, bytes, bytes]:
    """(ticket, signed bytes, signature); ValueError when malformed."""
    if len(data) > MAX_TICKET_BYTES or not data.startswith(MAGIC):
        raise ValueError("not a pull ticket")
    body, signature = data[:-_SIGNATURE_BYTES], data[-_SIGNATURE_BYTES:]
    fields, at = [], len(MAGIC)
    while at < len(body):
        n = int.from_bytes(body[at:at + 2], "little")
        fields.append(body[at + 2:at + 2 + n])
        at += 2 + n
    if at != len(body) or len(fields) != 6 or len(signature) != _SIGNATURE_BYTES:
        raise ValueError("a malformed pull ticket")
    receiver, holder, namespace, chain, num_blocks, expires = fields
    return (PullTicket(receiver.decode(), holder.decode(), namespace.decode(), chain,
                       int(num_blocks), int(expires)), body, signature)


class TicketSigner:
    """Signs pull tickets with one Ed25519 key (the gateways', or a worker's own)."""

    def __init__(self, key: Ed25519PrivateKey, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.key = key
        self.ttl_s = ttl_s

    def sign(self, receiver: str, holder: str, namespace: str, block_hashes: Sequence[int],
             now: float | None = None) -> bytes:
        t = PullTicket(receiver, holder, namespace, chain_digest(block_hashes),
                       len(block_hashes),
                       int(((time.time() if now is None else now) + self.ttl_s) * 1000))
        body = _body(t)
        return body + self.key.sign(body)


def check_ticket(ticket: bytes, keys: Iterable[Ed25519PublicKey], holder: str,
                 block_hashes: Sequence[int], caller_names: Iterable[str] = (),
                 now: float | None = None) -> PullTicket:
    """The ticket, verified (module docstring); PermissionDenied otherwise."""
    if not ticket:
        raise PermissionDenied(
            f"worker {holder} exports KV blocks only with a pull ticket signed by a gateway "
            "(PullSpec.ticket): this pull was not planned by a gateway that signs tickets "
            "(its --worker-keyring needs the '@gateways' line); compute the blocks instead")
    try:
        t, body, signature = _parse(ticket)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PermissionDenied(f"the pull ticket does not parse ({exc})") from None
    for key in keys:
        try:
            key.verify(signature, body)
            break
        except InvalidSignature:
            continue
    else:
        raise PermissionDenied(
            "the pull ticket's signature does not verify: it was not signed by the gateways' "
            f"ticket key (worker {holder}'s '{TICKETS}' keyring line) nor by this worker")
    if t.holder != holder:
        raise PermissionDenied(f"the pull ticket is for holder {t.holder!r}, not {holder!r}")
    if t.num_blocks != len(block_hashes) or t.chain != chain_digest(block_hashes):
        raise PermissionDenied("the pull ticket is for another chain of blocks than the one "
                               "asked for")
    now_ms = int((time.time() if now is None else now) * 1000)
    if now_ms > t.expires_ms:
        raise PermissionDenied(f"the pull ticket expired {(now_ms - t.expires_ms) / 1e3:.1f} s "
                               "ago (check that the gateways' and workers' clocks agree)")
    names = set(caller_names)
    if names and t.receiver not in names:
        raise PermissionDenied(f"the pull ticket is for worker {t.receiver!r}; the caller's "
                               f"certificate names {sorted(names)[:4]}")
    return t
