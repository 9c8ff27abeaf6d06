"""In-process registry for one machine with no Redis (`prefixgate up`'s default).

Contract: the `Registry` interface (registry/base.py) held in a dict; leases expire on the
monotonic clock. Workers given to the gateway by address are registered by the gateway.
Ownership is not kept here: without Redis, gateways follow each worker's WatchEvents.
"""

from __future__ import annotations

import time
from dataclasses import replace

from prefixgate.registry.base import Registry, WorkerRecord


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
