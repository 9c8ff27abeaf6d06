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
                      pg:worker:{id}          hash: address, model_fingerprint, epoch
                      pg:lease:{id}           epoch, expires after lease_ms (PX)
                      pg:epoch:{id}           counter (INCR on each registration)
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    address: str  # host:port of its WorkerService
    model_fingerprint: str = ""
    epoch: int = 0


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

    async def close(self) -> None:
        """Release connections."""


class EmbeddedRegistry(Registry):
    def __init__(self) -> None:
        self._workers: dict[str, tuple[WorkerRecord, float]] = {}  # id -> (record, expiry)
        self._epochs: dict[str, int] = {}

    async def register(self, record: WorkerRecord, lease_ms: int) -> WorkerRecord:
        epoch = self._epochs.get(record.worker_id, 0) + 1
        self._epochs[record.worker_id] = epoch
        record = WorkerRecord(record.worker_id, record.address, record.model_fingerprint, epoch)
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


# Deregister only when the caller's epoch is still current (a restarted worker with the
# same id must not be removed by its predecessor's late shutdown).
_DEREGISTER = """
if redis.call('HGET', KEYS[2], 'epoch') == ARGV[2] then
  redis.call('SREM', KEYS[1], ARGV[1]); redis.call('DEL', KEYS[2], KEYS[3]); return 1
end
return 0
"""
# Renew only our own lease: PEXPIRE when the lease still holds our epoch.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class RedisRegistry(Registry):
    def __init__(self, url: str, prefix: str = "pg:") -> None:
        import redis.asyncio as aioredis

        self.redis = aioredis.Redis.from_url(url, decode_responses=True)
        self.prefix = prefix
        self._deregister = self.redis.register_script(_DEREGISTER)
        self._renew = self.redis.register_script(_RENEW)

    def _key(self, kind: str, worker_id: str = "") -> str:
        return f"{self.prefix}{kind}" + (f":{worker_id}" if worker_id else "")

    async def register(self, record: WorkerRecord, lease_ms: int) -> WorkerRecord:
        wid = record.worker_id
        epoch = int(await self.redis.incr(self._key("epoch", wid)))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.sadd(self._key("workers"), wid)
            pipe.hset(self._key("worker", wid), mapping={
                "address": record.address, "model_fingerprint": record.model_fingerprint,
                "epoch": epoch})
            pipe.set(self._key("lease", wid), epoch, px=lease_ms)
            await pipe.execute()
        return WorkerRecord(wid, record.address, record.model_fingerprint, epoch)

    async def renew(self, record: WorkerRecord, lease_ms: int) -> bool:
        return bool(await self._renew(keys=[self._key("lease", record.worker_id)],
                                      args=[record.epoch, lease_ms]))

    async def deregister(self, record: WorkerRecord) -> None:
        wid = record.worker_id
        await self._deregister(
            keys=[self._key("workers"), self._key("worker", wid), self._key("lease", wid)],
            args=[wid, record.epoch])

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
                                        int(info["epoch"])))
        return out

    async def close(self) -> None:
        await self.redis.aclose()


def make_registry(redis_url: str | None) -> Registry:
    """RedisRegistry when a URL is given, else the embedded one."""
    return RedisRegistry(redis_url) if redis_url else EmbeddedRegistry()
