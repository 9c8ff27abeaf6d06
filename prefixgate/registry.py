"""Worker membership: which workers exist and where (shared by workers and gateways).

Contract
--------
A `Registry` records `WorkerRecord`s. Workers `register` themselves (getting a new epoch,
a fencing token that increases on every registration of the same id), `renew` their
lease while alive, and `deregister` on graceful shutdown. Gateways call `list_workers`,
which returns only workers whose lease is current.

Backends:
  EmbeddedRegistry  in-process, for one machine with no Redis (`prefixgate up` default);
                    workers given to the gateway by address are registered by it.
  RedisRegistry     shared by any number of gateways and workers. Keys (prefix `pg:`):
                      pg:workers              set of worker ids
                      pg:worker:{id}          hash: address, model_fingerprint, epoch,
                                              capacity_blocks
                      pg:lease:{id}           epoch, expires after lease_ms (PX)
                      pg:epoch:{id}           counter (INCR on each registration)
                      pg:kv:{id}              hash: block hash -> parent hash (8 bytes
                                              each, little-endian; parent 0 = root): the
                                              blocks the worker's current epoch holds
                      pg:events               stream of ownership changes (one entry per
                                              published batch or lifecycle change)

Ownership (Redis only). The block -> owners relation is stored per owner (pg:kv:{id}) so
that reaping a worker is one DEL and a gateway's bootstrap reads one hash per worker;
gateways invert it into their in-memory index and never query Redis to route.
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
Stream entry fields: w (worker id), e (epoch), k (join, leave, reap, or batch), and for a
batch n (events) with k{i} (store, remove, clear), p{i} (parent, 8 bytes or ""), h{i}
(block hashes, 8 bytes each).
"""

from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace

_BIG_ENDIAN = sys.byteorder == "big"


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    address: str  # host:port of its WorkerService
    model_fingerprint: str = ""
    epoch: int = 0
    capacity_blocks: int = 0  # KV blocks the worker can hold (0: unknown)


@dataclass(frozen=True)
class OwnershipEvent:
    """One change of a worker's blocks, as published to and read from Redis.
    kind: "store" (parent_hash, block_hashes), "remove" (block_hashes) or "clear"."""

    kind: str
    block_hashes: Sequence[int] = ()
    parent_hash: int | None = None


@dataclass(frozen=True)
class StreamEntry:
    """One pg:events entry: a lifecycle change (kind join / leave / reap) or a batch."""

    entry_id: bytes
    worker_id: str
    epoch: int
    kind: str
    events: list[OwnershipEvent]


class Registry(ABC):
    @abstractmethod
    async def register(self, record: WorkerRecord, lease_ms: int) -> WorkerRecord:
        """Record the worker under a fresh lease; returns it with its new epoch."""

    @abstractmethod
    async def renew(self, record: WorkerRecord, lease_ms: int) -> bool:
        """Extend the lease; False when the lease was lost (expired or superseded)."""

    @abstractmethod
    async def deregister(self, record: WorkerRecord) -> None:
        """Remove the worker if `record.epoch` is still its current epoch."""

    @abstractmethod
    async def list_workers(self) -> list[WorkerRecord]:
        """Workers whose lease is current, sorted by worker id."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections."""


class EmbeddedRegistry(Registry):
    def __init__(self) -> None:
        self._workers: dict[str, tuple[WorkerRecord, float]] = {}  # id -> (record, expiry)
        self._epochs: dict[str, int] = {}

    async def register(self, record: WorkerRecord, lease_ms: int) -> WorkerRecord:
        epoch = self._epochs.get(record.worker_id, 0) + 1
        self._epochs[record.worker_id] = epoch
        record = replace(record, epoch=epoch)
        self._workers[record.worker_id] = (record, time.monotonic() + lease_ms / 1e3)
        return record

    async def renew(self, record: WorkerRecord, lease_ms: int) -> bool:
        current = self._workers.get(record.worker_id)
        if current is None or current[0].epoch != record.epoch or current[1] < time.monotonic():
            return False
        self._workers[record.worker_id] = (current[0], time.monotonic() + lease_ms / 1e3)
        return True

    async def deregister(self, record: WorkerRecord) -> None:
        current = self._workers.get(record.worker_id)
        if current is not None and current[0].epoch == record.epoch:
            del self._workers[record.worker_id]

    async def list_workers(self) -> list[WorkerRecord]:
        now = time.monotonic()
        return sorted((r for r, exp in self._workers.values() if exp >= now),
                      key=lambda r: r.worker_id)


# All scripts run atomically in Redis; each is one round trip (EVALSHA).
_REGISTER = """
local e = redis.call('INCR', KEYS[4])
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], 'address', ARGV[2], 'model_fingerprint', ARGV[3], 'epoch', e,
           'capacity_blocks', ARGV[6])
redis.call('SET', KEYS[3], e, 'PX', ARGV[4])
redis.call('DEL', KEYS[5])
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[5], '*', 'w', ARGV[1], 'e', e, 'k', 'join')
return e
"""
# Renew only our own lease: PEXPIRE when the lease still holds our epoch.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# Remove a worker: `leave` only when the caller's epoch is still current (a restarted
# worker with the same id must not be removed by its predecessor's late shutdown); `reap`
# only when its lease is gone or no longer its epoch. Idempotent: a second call finds
# nothing and writes no entry.
_REMOVE = """
local epoch = redis.call('HGET', KEYS[2], 'epoch')
if not epoch or redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 0 then return 0 end
if ARGV[2] == 'leave' then
  if epoch ~= ARGV[3] then return 0 end
elseif redis.call('GET', KEYS[3]) == epoch then
  return 0
end
redis.call('SREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2], KEYS[4])
if ARGV[2] == 'leave' then redis.call('DEL', KEYS[3]) end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[4], '*', 'w', ARGV[1], 'e', epoch, 'k', ARGV[2])
return 1
"""
# Apply one batch of ownership events, fenced by the lease's epoch, and append it to the
# stream as one entry. ARGV: id, epoch, maxlen, then (kind, parent, hashes) per event.
_PUBLISH = """
local ROOT = string.rep('\\0', 8)
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
local entry = {'XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'w', ARGV[1], 'e', ARGV[2],
               'k', 'batch', 'n', tostring((#ARGV - 3) / 3)}
local n = 0
for i = 4, #ARGV, 3 do
  local kind, parent, hs = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if parent == '' then parent = ROOT end
  if kind == 'store' then
    for j = 1, #hs, 8 do
      local h = string.sub(hs, j, j + 7)
      redis.call('HSET', KEYS[2], h, parent)
      parent = h
    end
  elseif kind == 'remove' then
    for j = 1, #hs, 8 do redis.call('HDEL', KEYS[2], string.sub(hs, j, j + 7)) end
  else
    redis.call('DEL', KEYS[2])
  end
  entry[#entry + 1] = 'k' .. n; entry[#entry + 1] = kind
  entry[#entry + 1] = 'p' .. n; entry[#entry + 1] = ARGV[i + 1]
  entry[#entry + 1] = 'h' .. n; entry[#entry + 1] = hs
  n = n + 1
end
redis.call(unpack(entry))
return 1
"""


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


def _parent_bytes(parent: int | None) -> bytes:
    return b"" if parent is None else parent.to_bytes(8, "little")


# A worker's whole ownership hash as one string: 16 bytes per block (hash, parent; parent
# 0 = root). Parsing 2 bulk strings per block in Python costs ~10 µs; this costs ~0.1 µs.
_DUMP_KV = """
return table.concat(redis.call('HGETALL', KEYS[1]))
"""


def _parent_int(data: bytes) -> int | None:
    return int.from_bytes(data, "little") if data else None


class RedisRegistry(Registry):
    """Membership and block ownership in Redis (see the module docstring).

    `stream_maxlen` bounds pg:events (entries, trimmed approximately); a gateway that falls
    further behind rebuilds from the pg:kv hashes. `max_batch_events` bounds one publish
    (Lua's argument stack)."""

    max_batch_events = 1000

    def __init__(self, url: str, prefix: str = "pg:", stream_maxlen: int = 100_000,
                 timeout_s: float = 5.0) -> None:
        import redis.asyncio as aioredis

        kwargs = dict(socket_connect_timeout=min(2.0, timeout_s), socket_timeout=timeout_s)
        self.url = redact_url(url)  # for logs: never the password
        self.redis = aioredis.Redis.from_url(url, decode_responses=True, **kwargs)
        self.raw = aioredis.Redis.from_url(url, **kwargs)  # bytes: block hashes, the stream
        self.prefix = prefix
        self.stream_maxlen = stream_maxlen
        self.timeout_s = timeout_s
        self._register = self.redis.register_script(_REGISTER)
        self._renew = self.redis.register_script(_RENEW)
        self._remove = self.redis.register_script(_REMOVE)
        self._publish = self.raw.register_script(_PUBLISH)
        self._dump_kv = self.raw.register_script(_DUMP_KV)

    def _key(self, kind: str, worker_id: str = "") -> str:
        return f"{self.prefix}{kind}" + (f":{worker_id}" if worker_id else "")

    @property
    def events_key(self) -> str:
        return self._key("events")

    # ------------------------------------------------------------------ membership

    async def register(self, record: WorkerRecord, lease_ms: int) -> WorkerRecord:
        wid = record.worker_id
        epoch = await self._register(
            keys=[self._key("workers"), self._key("worker", wid), self._key("lease", wid),
                  self._key("epoch", wid), self._key("kv", wid), self.events_key],
            args=[wid, record.address, record.model_fingerprint, lease_ms, self.stream_maxlen,
                  record.capacity_blocks])
        return replace(record, epoch=int(epoch))

    async def renew(self, record: WorkerRecord, lease_ms: int) -> bool:
        return bool(await self._renew(keys=[self._key("lease", record.worker_id)],
                                      args=[record.epoch, lease_ms]))

    async def _remove_worker(self, worker_id: str, kind: str, epoch: int = 0) -> bool:
        return bool(await self._remove(
            keys=[self._key("workers"), self._key("worker", worker_id),
                  self._key("lease", worker_id), self._key("kv", worker_id), self.events_key],
            args=[worker_id, kind, epoch, self.stream_maxlen]))

    async def deregister(self, record: WorkerRecord) -> None:
        await self._remove_worker(record.worker_id, "leave", record.epoch)

    async def reap_expired(self) -> list[str]:
        """Remove every listed worker whose lease expired (its blocks too); returns the ids
        this call reaped (another gateway may have reaped the rest)."""
        ids = sorted(await self.redis.smembers(self._key("workers")))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.exists(self._key("lease", wid))
            alive = await pipe.execute()
        reaped = []
        for wid, live in zip(ids, alive, strict=True):
            # A lease may also hold a stale epoch only transiently; the script decides.
            if not live and await self._remove_worker(wid, "reap"):
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
                                        int(info["epoch"]), int(info.get("capacity_blocks", 0))))
        return out

    # ------------------------------------------------------------------ ownership

    async def publish(self, record: WorkerRecord, events: Sequence[OwnershipEvent]) -> bool:
        """Apply a batch (at most `max_batch_events`) for `record`'s epoch; False when its
        lease no longer holds that epoch (nothing was changed)."""
        if len(events) > self.max_batch_events:
            raise ValueError(f"at most {self.max_batch_events} events per batch")
        args: list = [record.worker_id, record.epoch, self.stream_maxlen]
        for ev in events:
            args += [ev.kind, _parent_bytes(ev.parent_hash), pack_hashes(ev.block_hashes)]
        wid = record.worker_id
        return bool(await self._publish(
            keys=[self._key("lease", wid), self._key("kv", wid), self.events_key], args=args))

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
        last_id, added = _stream_position(info)
        ids = sorted(m.decode() for m in members)
        async with self.raw.pipeline(transaction=True) as pipe:
            for wid in ids:
                pipe.hget(self._key("worker", wid), "epoch")
                pipe.get(self._key("lease", wid))
                await self._dump_kv(keys=[self._key("kv", wid)], client=pipe)
            replies = await pipe.execute()
        out: dict[str, tuple[int, dict[int, int | None]]] = {}
        for i, wid in enumerate(ids):
            epoch, lease, dump = replies[3 * i: 3 * i + 3]
            if epoch is None or lease != epoch:
                continue
            pairs = unpack_hashes(dump or b"")
            blocks = dict(zip(pairs[::2], [p or None for p in pairs[1::2]], strict=True))
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
        last_id, added = _stream_position(info)
        return last_id, added, int(info.get("length", 0)) if isinstance(info, dict) else 0

    async def read_events(self, after_id: bytes, block_ms: int, count: int = 1000,
                          ) -> list[StreamEntry]:
        """Stream entries after `after_id`, waiting up to `block_ms` for the first."""
        reply = await self.raw.xread({self.events_key: after_id}, count=count, block=block_ms)
        out: list[StreamEntry] = []
        for _key, entries in reply or ():
            for entry_id, f in entries:
                kind = f[b"k"].decode()
                events = []
                if kind == "batch":
                    for i in range(int(f[b"n"])):
                        events.append(OwnershipEvent(
                            f[b"k%d" % i].decode(), unpack_hashes(f[b"h%d" % i]),
                            _parent_int(f[b"p%d" % i])))
                out.append(StreamEntry(entry_id, f[b"w"].decode(), int(f[b"e"]), kind, events))
        return out

    async def close(self) -> None:
        await self.redis.aclose()
        await self.raw.aclose()


def stream_id_newer(a: bytes, b: bytes) -> bool:
    """Whether stream id `a` is after `b` ("ms-seq" ids)."""
    ams, _, aseq = a.partition(b"-")
    bms, _, bseq = b.partition(b"-")
    return (int(ams), int(aseq or 0)) > (int(bms), int(bseq or 0))


def _as_bytes(v: object) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


def _stream_position(info: object) -> tuple[bytes, int]:
    """(last generated id, entries added) from an XINFO STREAM reply, or the empty
    stream's position when it failed because the stream does not exist yet."""
    if isinstance(info, Exception):
        if "no such key" in str(info).lower():
            return b"0-0", 0
        raise info
    assert isinstance(info, dict)
    return _as_bytes(info.get("last-generated-id", b"0-0")), int(info.get("entries-added", 0))


def make_registry(redis_url: str | None) -> Registry:
    """RedisRegistry when a URL is given, else the embedded one."""
    return RedisRegistry(redis_url) if redis_url else EmbeddedRegistry()


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
