"""Membership and block ownership in Redis, shared by any number of gateways and workers.

Contract
--------
The `Registry` interface (registry/base.py), plus ownership. Keys (prefix `pg:`):
  pg:workers              set of worker ids
  pg:worker:{id}          hash: address, model_fingerprint, epoch, capacity_blocks,
                          sig (signed registration), kvmac and kvseq (MAC of the held
                          blocks, sequence number of the batch that left them)
  pg:lease:{id}           epoch, expires after lease_ms (PX)
  pg:epoch:{id}           counter (INCR on each registration)
  pg:kv:{id}              hash: block hash -> parent hash (8 bytes each, little-endian;
                          parent 0 = root): the blocks the worker's current epoch holds
  pg:events               stream of ownership changes (one entry per published batch or
                          lifecycle change) and of gateways' routing predictions (one
                          "predict" entry per routed turn); fields in registry/wire.py

The block -> owners relation is stored per owner (pg:kv:{id}) so that reaping a worker is
one DEL and a gateway's bootstrap reads one hash per worker; gateways invert it into their
in-memory index and never query Redis to route.
  publish(record, events)  one EVALSHA per batch: if the lease still holds the record's
                           epoch, apply the batch to pg:kv:{id} and XADD it to pg:events
                           (MAXLEN ~ stream_maxlen); else change nothing and return False
                           (the worker lost its lease: it registers again, which clears
                           its blocks, and republishes a snapshot).
  register                 atomically: new epoch, lease, record, pg:kv:{id} emptied, a
                           "join" entry (gateways forget the older epoch's blocks).
  deregister / reap_expired  atomically: record, lease and pg:kv:{id} removed, a "leave"
                           or "reap" entry; fenced by epoch and idempotent (Lua), so any
                           number of gateways may reap the same dead worker.
The scripts are in registry/lua.py.

With a `keyring` (prefixgate.security.identity) the registry signs what a worker writes with that
worker's private key (registration, each batch, the held-block set, its leave) and, for
gateways, reads only entries that verify against the worker's public key: a batch whose
signature fails, or whose (epoch, sequence number) is not after the last one this
registry applied for the worker or runs far ahead of it (`identity.position_refused`: a
replayed copy, a far-future number; the snapshot sets where each worker's batches resume)
is skipped without changing what is expected next; a worker whose pg:kv does not match its
signed held set is left out of `ownership_snapshot` (both logged); unsigned or forged
"leave" and "reap" entries are skipped; and "join" entries are skipped: Redis writes them
unsigned, and a forged one with a high epoch would fence off the worker's genuine
batches. Nothing is lost, since a worker's first batch after registering is a signed
"clear" under its new epoch, which resets it. Gateways sign their "predict" and "reap"
entries with the gateways' key, and apply another gateway's prediction only when it
verifies and is newer than that gateway's last (and not far ahead of it).
Registrations are verified by the gateway's WorkerPool (it says why it refuses one).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from prefixgate.registry import lua
from prefixgate.registry.base import Registry, WorkerRecord
from prefixgate.registry.wire import (
    StreamEntry,
    decode_entry,
    pack_hashes,
    parent_bytes,
    stream_position,
    unpack_hashes,
)
from prefixgate.security import identity
from prefixgate.wire.events import OwnershipEvent

log = logging.getLogger(__name__)


class RedisRegistry(Registry):
    """Membership and block ownership in Redis (see the module docstring).

    `stream_maxlen` bounds pg:events (entries, trimmed approximately); a gateway that falls
    further behind rebuilds from the pg:kv hashes. `max_batch_events` bounds one publish
    (Lua's argument stack)."""

    max_batch_events = 1000

    def __init__(self, url: str, prefix: str = "pg:", stream_maxlen: int = 100_000,
                 timeout_s: float = 5.0, keyring: identity.Keyring | None = None) -> None:
        import redis.asyncio as aioredis

        kwargs = dict(socket_connect_timeout=min(2.0, timeout_s), socket_timeout=timeout_s)
        self.url = redact_url(url)  # for logs: never the password
        self.redis = aioredis.Redis.from_url(url, decode_responses=True, **kwargs)
        self.raw = aioredis.Redis.from_url(url, **kwargs)  # bytes: block hashes, the stream
        self.prefix = prefix
        self.stream_maxlen = stream_maxlen
        self.timeout_s = timeout_s
        self.keyring = keyring
        self._signers: dict[str, identity.OwnershipSigner] = {}  # a worker's own signing state
        # Gateways: worker id -> (epoch, sequence number) of its last batch accepted.
        self._accepted: dict[str, tuple[int, int]] = {}
        self._prediction_seq = 0  # gateways: the last prediction this process signed
        self._predictions_seen: dict[str, int] = {}  # gateway id -> its last accepted
        self._register = self.redis.register_script(lua.REGISTER)
        self._renew = self.redis.register_script(lua.RENEW)
        self._remove = self.redis.register_script(lua.REMOVE)
        self._publish = self.raw.register_script(lua.PUBLISH)
        self._dump_kv = self.raw.register_script(lua.DUMP_KV)

    def _key(self, kind: str, worker_id: str = "") -> str:
        return f"{self.prefix}{kind}" + (f":{worker_id}" if worker_id else "")

    @property
    def events_key(self) -> str:
        return self._key("events")

    # ------------------------------------------------------------------ membership

    async def register(self, record: WorkerRecord, lease_ms: int) -> WorkerRecord:
        wid = record.worker_id
        signer = self._signer(wid)
        signature = "" if signer is None else signer.registration(
            record.address, record.model_fingerprint, record.capacity_blocks)
        epoch = await self._register(
            keys=[self._key("workers"), self._key("worker", wid), self._key("lease", wid),
                  self._key("epoch", wid), self._key("kv", wid), self.events_key],
            args=[wid, record.address, record.model_fingerprint, lease_ms, self.stream_maxlen,
                  record.capacity_blocks, signature])
        return replace(record, epoch=int(epoch), signature=signature)

    def _signer(self, worker_id: str) -> identity.OwnershipSigner | None:
        """The signing state of a worker this process is (None without a keyring)."""
        if self.keyring is None:
            return None
        signer = self._signers.get(worker_id)
        if signer is None:
            key = self.keyring.private_key(worker_id)
            if key is None:
                raise ValueError(f"worker {worker_id!r} has no private key in "
                                 "--worker-keyring")
            signer = self._signers[worker_id] = identity.OwnershipSigner(key, worker_id)
        return signer

    async def renew(self, record: WorkerRecord, lease_ms: int) -> bool:
        return bool(await self._renew(keys=[self._key("lease", record.worker_id)],
                                      args=[record.epoch, lease_ms]))

    async def _remove_worker(self, worker_id: str, kind: str, epoch: int,
                             signature: bytes = b"") -> bool:
        return bool(await self._remove(
            keys=[self._key("workers"), self._key("worker", worker_id),
                  self._key("lease", worker_id), self._key("kv", worker_id), self.events_key],
            args=[worker_id, kind, epoch, self.stream_maxlen, signature]))

    async def deregister(self, record: WorkerRecord) -> None:
        signer = self._signer(record.worker_id)
        await self._remove_worker(record.worker_id, "leave", record.epoch,
                                  b"" if signer is None else signer.leave(record.epoch))

    async def reap_expired(self) -> list[str]:
        """Remove every listed worker whose lease expired (its blocks too); returns the ids
        this call reaped (another gateway may have reaped the rest)."""
        ids = sorted(await self.redis.smembers(self._key("workers")))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.exists(self._key("lease", wid))
                pipe.hget(self._key("worker", wid), "epoch")
            replies = await pipe.execute()
        gateway_key = self.keyring.gateway_key if self.keyring is not None else None
        reaped = []
        for wid, live, epoch in zip(ids, replies[::2], replies[1::2], strict=True):
            # A lease may also hold a stale epoch only transiently; the script decides
            # (and reaps only the epoch read here: the one the signature names).
            if live or epoch is None:
                continue
            sig = b"" if gateway_key is None else identity.reap_mac(gateway_key, wid, int(epoch))
            if await self._remove_worker(wid, "reap", int(epoch), sig):
                reaped.append(wid)
        return reaped

    async def list_workers(self) -> list[WorkerRecord]:
        ids = sorted(await self.redis.smembers(self._key("workers")))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.hgetall(self._key("worker", wid))
                pipe.get(self._key("lease", wid))
            replies = await pipe.execute()
        out = []
        for wid, info, lease in zip(ids, replies[::2], replies[1::2], strict=True):
            if info and lease is not None and lease == info.get("epoch"):
                out.append(WorkerRecord(wid, info["address"], info.get("model_fingerprint", ""),
                                        int(info["epoch"]), int(info.get("capacity_blocks", 0)),
                                        info.get("sig", "")))
        return out

    # ------------------------------------------------------------------ ownership

    async def publish(self, record: WorkerRecord, events: Sequence[OwnershipEvent]) -> bool:
        """Apply a batch (at most `max_batch_events`) for `record`'s epoch; False when its
        lease no longer holds that epoch (nothing was changed)."""
        if len(events) > self.max_batch_events:
            raise ValueError(f"at most {self.max_batch_events} events per batch")
        wire = [(ev.kind.encode(), parent_bytes(ev.parent_hash), pack_hashes(ev.block_hashes))
                for ev in events]
        signer = self._signer(record.worker_id)
        if signer is None:
            bmac, kvmac, seq = b"", "", ""
        else:
            bmac, held_sig = signer.sign(record.epoch, events, wire)
            kvmac, seq = held_sig.hex(), str(signer.seq)
        args: list = [record.worker_id, record.epoch, self.stream_maxlen, bmac, kvmac, seq]
        for fields in wire:
            args += fields
        wid = record.worker_id
        return bool(await self._publish(
            keys=[self._key("lease", wid), self._key("kv", wid), self.events_key,
                  self._key("worker", wid)], args=args))

    async def publish_predictions(self, items: Sequence[tuple[WorkerRecord, Sequence[int]]],
                                  source: str) -> None:
        """Tell every gateway that `source` routed turns: for each (worker record, the
        prompt's block hashes) one "predict" entry on the event stream (nothing else
        changes: predictions are not ownership). One round trip for the lot. With the
        gateways' key (keyring) each is signed with it."""
        if not items:
            return
        async with self.raw.pipeline(transaction=False) as pipe:
            for record, hashes in items:
                wid, packed = record.worker_id, pack_hashes(hashes)
                fields = {"w": wid, "e": record.epoch, "k": "predict", "g": source,
                          "h": packed}
                key = self.keyring.gateway_key if self.keyring is not None else None
                if key is not None:
                    self._prediction_seq += 1
                    fields["q"] = self._prediction_seq
                    fields["s"] = identity.prediction_mac(key, wid, record.epoch, source,
                                                          self._prediction_seq, packed)
                pipe.xadd(self.events_key, fields, maxlen=self.stream_maxlen,
                          approximate=True)
            await pipe.execute()

    async def server_id(self) -> str:
        """The Redis server's run id: it changes when Redis restarts (data may be gone)."""
        info = await self.redis.info("server")
        return str(info.get("run_id", ""))

    async def ownership_snapshot(self) -> tuple[bytes, int, dict[str, tuple[int, dict[int, int | None]]]]:
        """(stream id to follow from, entries ever added to the stream up to it, {worker
        id: (epoch, {block: parent})}) for the workers with a current lease. The stream
        position is read before the blocks, so replaying the stream after it over the
        snapshot converges (events are idempotent)."""
        async with self.raw.pipeline(transaction=True) as pipe:
            pipe.xinfo_stream(self.events_key)
            pipe.smembers(self._key("workers"))
            info, members = await pipe.execute(raise_on_error=False)
        last_id, added = stream_position(info)
        ids = sorted(m.decode() for m in members)
        async with self.raw.pipeline(transaction=True) as pipe:
            for wid in ids:
                pipe.hget(self._key("worker", wid), "epoch")
                pipe.get(self._key("lease", wid))
                await self._dump_kv(keys=[self._key("kv", wid)], client=pipe)
                pipe.hget(self._key("worker", wid), "kvmac")
                pipe.hget(self._key("worker", wid), "kvseq")
            replies = await pipe.execute()
        out: dict[str, tuple[int, dict[int, int | None]]] = {}
        self._accepted.clear()  # the batches to accept resume after this snapshot's
        for i, wid in enumerate(ids):
            epoch, lease, dump, kvmac, kvseq = replies[5 * i: 5 * i + 5]
            if epoch is None or lease != epoch:
                continue
            pairs = unpack_hashes(dump or b"")
            blocks = dict(zip(pairs[::2], [p or None for p in pairs[1::2]], strict=True))
            if self.keyring is not None:
                seq = int(kvseq or 0)
                if self._held_set_verifies(wid, int(epoch), seq, blocks, kvmac):
                    # Batches resume after the signed one; an unsigned kvseq (anyone with
                    # a worker's Redis user can write one) is never where they resume.
                    self._accepted[wid] = (int(epoch), seq)
                elif blocks:
                    continue
            out[wid] = (int(epoch), blocks)
        return last_id, added, out

    async def stream_state(self) -> tuple[bytes, int, int]:
        """(last entry id, entries ever added, entries held now) of the event stream
        (b"0-0", 0, 0 when it does not exist). Entries are only removed by trimming,
        oldest first, so a reader that consumed c entries missed some when
        added - held > c."""
        async with self.raw.pipeline(transaction=False) as pipe:
            pipe.xinfo_stream(self.events_key)
            (info,) = await pipe.execute(raise_on_error=False)
        last_id, added = stream_position(info)
        return last_id, added, int(info.get("length", 0)) if isinstance(info, dict) else 0

    def _held_set_verifies(self, wid: str, epoch: int, seq: int,
                           blocks: dict[int, int | None], kvmac: bytes | None) -> bool:
        if self.keyring is not None and identity.verify_held_set(self.keyring, wid, epoch, seq,
                                                                 blocks, kvmac):
            return True
        if blocks:
            log.warning("ignoring the %d blocks Redis lists for worker %s: they are not "
                        "signed with its key (forged, or written without --worker-keyring)",
                        len(blocks), wid)
        return False

    def _batch_verifies(self, f: dict[bytes, bytes]) -> bool:
        assert self.keyring is not None
        wid = f[b"w"].decode(errors="replace")
        if b"s" in f and b"q" in f:
            position = (int(f[b"e"]), int(f[b"q"]))
            wire = [(f[b"k%d" % i], f[b"p%d" % i], f[b"h%d" % i]) for i in range(int(f[b"n"]))]
            if identity.verify_batch(self.keyring, wid,
                                     identity.batch_message(wid, *position, wire), f[b"s"]):
                last = self._accepted.get(wid)
                why = identity.position_refused(last, position)
                if not why:
                    self._accepted[wid] = position
                    return True
                # A copy put back on the stream, a batch a snapshot already holds, or a
                # number far ahead: what is expected next does not move.
                log.log(logging.DEBUG if last is not None and position <= last
                        else logging.WARNING, "skipping batch %d of worker %s epoch %d: %s",
                        position[1], wid[:64], position[0], why)
                return False
        log.warning("ignoring an ownership batch for worker %s: not signed with its key "
                    "(forged, or written without --worker-keyring)", wid[:64])
        return False

    def _prediction_verifies(self, f: dict[bytes, bytes]) -> bool:
        assert self.keyring is not None
        wid = f[b"w"].decode(errors="replace")
        key = self.keyring.gateway_key
        if key is not None and b"s" in f and b"q" in f:
            source, seq = f[b"g"].decode(errors="replace"), int(f[b"q"])
            mac = identity.prediction_mac(key, wid, int(f[b"e"]), source, seq, f[b"h"])
            if identity.hmac.compare_digest(mac, f[b"s"]):
                last = self._predictions_seen.get(source)
                if last is not None and identity.position_refused((0, last), (0, seq)):
                    return False  # a copy put back on the stream, or far ahead
                if len(self._predictions_seen) >= 4096:  # gateway ids seen (restarts)
                    self._predictions_seen.clear()
                self._predictions_seen[source] = seq
                return True
        # Debug, not warning: a gateway without the gateways' key publishes every routed
        # turn unsigned (its predictions are then its own only; it warned at start).
        log.debug("ignoring a routing prediction for worker %s: not signed with the "
                  "gateways' key", wid[:64])
        return False

    def _lifecycle_verifies(self, f: dict[bytes, bytes]) -> bool:
        assert self.keyring is not None
        wid, kind = f[b"w"].decode(errors="replace"), f[b"k"].decode(errors="replace")
        if identity.verify_lifecycle(self.keyring, kind, wid, int(f[b"e"]), f.get(b"s", b"")):
            return True
        log.warning("ignoring a %s entry for worker %s: not signed by %s", kind, wid[:64],
                    "the worker" if kind == "leave" else "a gateway (the gateways' key)")
        return False

    def _trusted(self, f: dict[bytes, bytes]) -> bool:
        """With a keyring, whether entry `f` may change the index (see the module
        docstring): a verified batch, prediction, leave or reap."""
        kind = f.get(b"k")
        if kind == b"batch":
            return self._batch_verifies(f)
        if kind == b"predict":
            return self._prediction_verifies(f)
        if kind in (b"leave", b"reap"):
            return self._lifecycle_verifies(f)
        return False  # join (unsigned: Redis writes it), or a kind this version does not know

    async def read_events(self, after_id: bytes, block_ms: int, count: int = 1000,
                          ) -> list[StreamEntry]:
        """Stream entries after `after_id`, waiting up to `block_ms` for the first. An
        entry that cannot change the index comes back as a batch with no events: with a
        keyring, one that does not verify; always, one that does not decode (anyone who
        can write the stream could otherwise stop every gateway's feed at it)."""
        reply = await self.raw.xread({self.events_key: after_id}, count=count, block=block_ms)
        out: list[StreamEntry] = []
        for _key, entries in reply or ():
            for entry_id, f in entries:
                try:
                    if self.keyring is not None and not self._trusted(f):
                        f = {b"w": f[b"w"], b"e": f[b"e"], b"k": b"batch", b"n": b"0"}
                    out.append(decode_entry(entry_id, f))
                except (KeyError, ValueError, UnicodeDecodeError) as exc:
                    log.warning("skipping malformed event stream entry %s: %s",
                                entry_id.decode(errors="replace"), repr(exc)[:200])
                    out.append(StreamEntry(entry_id, "", -1, "batch", []))
        return out

    async def close(self) -> None:
        await self.redis.aclose()
        await self.raw.aclose()


def check_url(url: str) -> str:
    """`url` if redis-py can connect by it; ValueError saying what is wrong otherwise (a
    missing scheme, a port that is not a number), before anything is started."""
    from redis.connection import parse_url

    try:
        parse_url(url)
    except ValueError as exc:
        raise ValueError(f"{redact_url(url)!r} is not a Redis URL ({exc}); write it as "
                         "redis://[user:password@]host:port/db (rediss:// for TLS)") from None
    return url


async def check_reachable(url: str, timeout_s: float = 3.0) -> None:
    """Return once Redis at `url` answers PING; ConnectionError naming it otherwise."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, socket_connect_timeout=timeout_s,
                                     socket_timeout=timeout_s)
    try:
        await client.ping()
    except Exception as exc:
        raise ConnectionError(f"cannot reach Redis at {redact_url(url)}: {exc}") from None
    finally:
        await client.aclose()


def redact_url(url: str) -> str:
    """`url` with any password replaced by ***, for logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
