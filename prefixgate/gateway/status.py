"""Fresh worker load for routing: each healthy worker's status, pushed.

Contract: `StatusFollower.sync(workers)` keeps one task per given worker handle that sets
`handle.status` (`set_status`) from the worker's WatchStatus stream (prefixgate/wire/status.py: the current
status at once, then each change, at most one message per `interval_ms`), so the load a
turn is routed on is at most about `interval_ms` plus one hop old; it cancels the tasks of
handles no longer given. A worker without WatchStatus (UNIMPLEMENTED) is polled with
GetStatus every `interval_ms` instead. A broken stream clears `handle.status` (no stale
figures; the gateway's own in-flight counts still count) and reconnects after
`interval_ms`; the pool's probes decide health, never this. Costs are in docs/routing.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import grpc

from prefixgate.gateway.pool import WorkerHandle
from prefixgate.v1 import worker_pb2

log = logging.getLogger(__name__)

__all__ = ["StatusFollower"]


class StatusFollower:
    def __init__(self, interval_ms: int = 50) -> None:
        if interval_ms < 1:
            raise ValueError(f"status interval must be at least 1 ms, got {interval_ms}")
        self.interval_ms = interval_ms
        self._tasks: dict[int, tuple[WorkerHandle, asyncio.Task]] = {}

    def sync(self, workers: Iterable[WorkerHandle]) -> None:
        """Follow exactly `workers` (handles are followed by identity: a replaced handle,
        e.g. a worker back at a new address, gets a new stream)."""
        wanted = {id(w): w for w in workers}
        for key in list(self._tasks):
            if key not in wanted:
                self._tasks.pop(key)[1].cancel()
        for key, w in wanted.items():
            if key not in self._tasks:
                self._tasks[key] = (w, asyncio.create_task(self._follow(w)))

    async def close(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, w: WorkerHandle) -> None:
        interval_s = self.interval_ms / 1e3
        while True:
            try:
                async for status in w.client.WatchStatus(
                        worker_pb2.WatchStatusRequest(min_interval_ms=self.interval_ms)):
                    w.set_status(status)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    await self._poll(w, interval_s)
                    return
                log.debug("status stream of %s broke: %s", w.worker_id, exc.code().name)
            w.set_status(None)
            await asyncio.sleep(interval_s)

    async def _poll(self, w: WorkerHandle, interval_s: float) -> None:
        while True:
            try:
                w.set_status(await w.client.GetStatus(worker_pb2.GetStatusRequest(),
                                                      timeout=max(1.0, 10 * interval_s)))
            except grpc.aio.AioRpcError:
                w.set_status(None)
            await asyncio.sleep(interval_s)
