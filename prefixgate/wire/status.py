"""Worker load status, pushed: the worker side of WorkerService.WatchStatus.

Gateways route on each worker's load (running requests, prefill tokens queued). Polling
GetStatus costs a whole unary call per worker per interval whether anything changed or not
(measured on loopback: ~128 bytes of HTTP/2 frames a call, 2.5 KB/s per gateway per worker
at 50 ms, and a round of gRPC work on both event loops). WatchStatus sends one
WorkerStatus message (~27 bytes framed) when the status changed, at most one per
`min_interval_ms`: ~10 B/s while idle, ~530 B/s at 50 ms under constant change, and never
older than the interval plus one hop (docs/routing.md has the table). The worker reads
its own status in memory each interval (no I/O).

Contract of `watch_status`: yields the current status at once, then each status that
differs from the last one yielded, checking every `min_interval_ms` (floored at
`MIN_INTERVAL_S`), until `closing()` returns True (server shutdown; at most one interval
later). Torch-free, so real and emulated workers share it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from prefixgate.v1 import worker_pb2

__all__ = ["MIN_INTERVAL_S", "watch_status"]

MIN_INTERVAL_S = 0.010  # the worker's floor: a subscriber cannot ask for a busier stream


async def watch_status(read: Callable[[], worker_pb2.WorkerStatus], min_interval_ms: int,
                       closing: Callable[[], bool]) -> AsyncIterator[worker_pb2.WorkerStatus]:
    interval_s = max(MIN_INTERVAL_S, min_interval_ms / 1e3)
    last: worker_pb2.WorkerStatus | None = None
    while not closing():
        status = read()
        if status != last:
            last = status
            yield status
        await asyncio.sleep(interval_s)
