"""Worker-side KV event publishing: the engine's sink and the transports that follow it.

Contract
--------
`EventLog` is the one `KVEventSink` a worker gives its engine. Called from the engine's
thread, it only appends under a lock (never blocks on I/O): each event gets a sequence
number (1, 2, ...) in a bounded ring, and a mirror of the blocks the cache holds now
(block hash -> parent hash) is kept up to date, so a snapshot needs no engine API.
Transports read it from the asyncio side, each with its own cursor:

  WorkerService.WatchEvents  (server.py) streams it to gateways that follow the worker
                             directly (embedded registry, `prefixgate up` without Redis);
  RedisPublisher             (below) applies it to Redis: block ownership and the shared
                             event stream, one round trip per batch, fenced by the lease's
                             epoch.

`read(after_seq)` returns the events after a cursor, or None when the ring no longer holds
them (the reader fell behind): it then takes `snapshot()` (the whole cache as stored
chains, parents first, and the sequence number it reflects) and continues from there.
`incarnation` (nanoseconds since the epoch at creation) identifies this process's log: a
reader holding a cursor of another incarnation must start from a snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

from prefixgate.registry import RedisRegistry, WorkerRecord
from prefixgate.wire.events import KVEventSink, OwnershipEvent, chains

log = logging.getLogger(__name__)

__all__ = ["EventLog", "RedisPublisher"]


class EventLog(KVEventSink):
    """Sequenced, bounded log of cache events plus a mirror of the cached blocks."""

    def __init__(self, capacity_events: int = 65536) -> None:
        """`capacity_events`: events kept for readers that resume (older: snapshot)."""
        if capacity_events < 1:
            raise ValueError("capacity_events must be >= 1")
        self.incarnation = time.time_ns()
        self._lock = threading.Lock()
        self._ring: deque[OwnershipEvent] = deque(maxlen=capacity_events)
        self._seq = 0  # sequence number of the newest event
        self._blocks: dict[int, int | None] = {}  # cached block -> its parent (None: root)
        self._listeners: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ sink (engine thread)

    def stored(self, parent_hash: int | None, block_hashes: Sequence[int]) -> None:
        if not block_hashes:
            return
        hs = tuple(block_hashes)
        with self._lock:
            blocks = self._blocks
            parent = parent_hash
            for h in hs:
                blocks[h] = parent
                parent = h
            self._append(OwnershipEvent("store", hs, parent_hash))

    def removed(self, block_hashes: Sequence[int]) -> None:
        if not block_hashes:
            return
        hs = tuple(block_hashes)
        with self._lock:
            for h in hs:
                self._blocks.pop(h, None)
            self._append(OwnershipEvent("remove", hs))

    def cleared(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._append(OwnershipEvent("clear"))

    def _append(self, event: OwnershipEvent) -> None:
        self._ring.append(event)
        self._seq += 1
        for notify in self._listeners:
            try:
                notify()
            except Exception:  # a closed loop of a gone reader must not break the engine
                log.debug("event listener failed", exc_info=True)

    # ------------------------------------------------------------------ readers

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def num_blocks(self) -> int:
        """Blocks the cache holds now (per the events)."""
        return len(self._blocks)

    def subscribe(self, notify: Callable[[], None]) -> Callable[[], None]:
        """Call `notify()` (from the engine's thread: make it thread-safe and quick) after
        each new event; returns the function that unsubscribes."""
        with self._lock:
            self._listeners = [*self._listeners, notify]

        def unsubscribe() -> None:
            with self._lock:
                self._listeners = [f for f in self._listeners if f is not notify]
        return unsubscribe

    def read(self, after_seq: int, max_events: int = 4096
             ) -> tuple[list[OwnershipEvent], int] | None:
        """Up to `max_events` events after `after_seq` and the sequence number of the last
        one returned; None when they are no longer held (take a snapshot)."""
        with self._lock:
            seq, ring = self._seq, self._ring
            first = seq - len(ring) + 1  # sequence number of ring[0]
            if after_seq > seq or after_seq < first - 1:
                return None
            start = after_seq - first + 1
            n = min(max_events, seq - after_seq)
            events = [ring[i] for i in range(start, start + n)]
            return events, after_seq + n

    def snapshot(self) -> tuple[list[OwnershipEvent], int]:
        """The cached blocks as stored chains (each chain's parent comes earlier, or is
        None) and the sequence number they reflect."""
        with self._lock:
            blocks = dict(self._blocks)
            seq = self._seq
        return [OwnershipEvent("store", tuple(hs), parent) for parent, hs in chains(blocks)], seq


class RedisPublisher:
    """The worker's side of Redis: its registration (lease, epoch) and its blocks.

    `run(stop)` registers, renews the lease every third of `lease_ms`, and publishes the
    event log in batches (one round trip each, `flush_interval_s` after the first new
    event so bursts share a batch). After each (re)registration (a new epoch, its pg:kv
    emptied) it publishes a snapshot of the log first: a "clear" then the cached chains.
    A batch refused because the lease moved on, or a lease that could not be renewed,
    means registering again. A Redis outage is logged and retried; the worker keeps
    serving and resynchronises when Redis returns (publishing is idempotent, so a batch
    whose reply was lost is simply sent again). On `stop` it deregisters (fenced).
    """

    def __init__(self, events: EventLog, registry: RedisRegistry, record: WorkerRecord,
                 lease_ms: int, flush_interval_s: float = 0.005) -> None:
        self.events = events
        self.registry = registry
        self.record = replace(record, epoch=0)
        self.lease_ms = lease_ms
        self.flush_interval_s = flush_interval_s
        self.num_batches = 0  # published batches (round trips), for tests and benchmarks
        self.connected = False
        self._said_unreachable = False  # the outage in progress was logged

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        unsubscribe = self.events.subscribe(lambda: loop.call_soon_threadsafe(wake.set))
        relay = asyncio.create_task(self._relay(stop, wake))
        cursor: int | None = None
        next_renew = 0.0
        try:
            while not stop.is_set():
                wake.clear()
                try:
                    if not self.record.epoch:
                        self.record = await self.registry.register(self.record, self.lease_ms)
                        cursor = None
                        next_renew = time.monotonic() + self.lease_ms / 3e3
                        log.info("registered as %s epoch %d", self.record.worker_id,
                                 self.record.epoch)
                    elif time.monotonic() >= next_renew:
                        if not await self.registry.renew(self.record, self.lease_ms):
                            log.warning("lease of %s epoch %d lost; registering again",
                                        self.record.worker_id, self.record.epoch)
                            self.record = replace(self.record, epoch=0)
                            continue
                        next_renew = time.monotonic() + self.lease_ms / 3e3
                    cursor = await self._publish(cursor)
                    if cursor is None and not self.record.epoch:
                        continue
                    if not self.connected:
                        log.info("publishing KV events to %s", self.registry.url)
                    self.connected, self._said_unreachable = True, False
                except Exception as exc:  # Redis outage: keep serving, retry
                    # Said once per outage, also when Redis was never reached: gateways
                    # that find workers through it do not route here meanwhile.
                    if not self._said_unreachable:
                        log.warning("registry %s unreachable (%s): gateways that find workers "
                                    "through it will not route to %s until it is; retrying",
                                    self.registry.url, exc, self.record.worker_id)
                    self.connected, self._said_unreachable = False, True
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), min(1.0, self.lease_ms / 3e3))
                    continue
                timeout = max(0.0, next_renew - time.monotonic())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout)
                if not stop.is_set() and self.flush_interval_s:
                    await asyncio.sleep(self.flush_interval_s)  # let a burst fill the batch
        finally:
            unsubscribe()
            relay.cancel()
            if self.record.epoch:
                with contextlib.suppress(Exception):
                    await self.registry.deregister(self.record)

    @staticmethod
    async def _relay(stop: asyncio.Event, wake: asyncio.Event) -> None:
        await stop.wait()
        wake.set()

    async def _publish(self, cursor: int | None) -> int | None:
        """Publish what the log holds after `cursor`; returns the new cursor (None with
        epoch 0 when the lease was lost)."""
        limit = self.registry.max_batch_events
        while True:
            if cursor is None:
                chains_, seq = self.events.snapshot()
                batches = [[OwnershipEvent("clear"), *chains_[: limit - 1]]]
                batches += [chains_[i: i + limit] for i in range(limit - 1, len(chains_), limit)]
                for batch in batches:
                    if not await self._send(batch):
                        return None
                cursor = seq
                continue
            got = self.events.read(cursor, limit)
            if got is None:  # fell behind the ring: resend everything
                cursor = None
                continue
            batch, new = got
            if not batch:
                return cursor
            if not await self._send(batch):
                return None
            cursor = new

    async def _send(self, batch: list[OwnershipEvent]) -> bool:
        ok = await self.registry.publish(self.record, batch)
        self.num_batches += 1
        if not ok:
            log.warning("Redis refused events of %s epoch %d (lease lost); registering again",
                        self.record.worker_id, self.record.epoch)
            self.record = replace(self.record, epoch=0)
        return ok
