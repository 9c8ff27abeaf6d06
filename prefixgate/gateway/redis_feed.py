"""The gateway's Redis feed: bootstrap the PrefixIndex from Redis, then follow pg:events.

Contract
--------
`RedisStreamFeed(index, registry)` (an `EventFeed`, see feeds.py), started by the first
`sync()`:
  * rebuild: reads the stream's last id, then every live worker's pg:kv hash (epoch
    checked against its lease), clears the index and loads it; entries after that id
    are replayed on top (events are idempotent, so the overlap converges);
  * follow: XREAD BLOCK from its cursor; before each read, XINFO STREAM tells how many
    entries were ever added and how many remain: when more were trimmed than this
    gateway consumed, it missed some and rebuilds (as when the stream went backwards);
  * a Redis error marks the feed `degraded` (the index keeps serving what it knew);
    on reconnection the Redis run id is compared: a restarted Redis (new run id) or a
    stream that went backwards means a rebuild, else it resumes from its cursor.
`sync()` also reaps workers whose lease expired (`RedisRegistry.reap_expired`, atomic and
idempotent, so every gateway may do it). Routing never waits on any of this.

Predictions: `predicted(record, hashes)` queues this gateway's routing prediction; a
publisher task sends what is queued in one pipeline (RedisRegistry.publish_predictions),
so a burst costs one round trip. Every gateway applies the "predict" entries of the
others (its own are already in its index) when the entry's epoch is the one it follows
for the worker: the stream's order puts a prediction before the worker's stored event
for the same blocks, so events still win. A full queue (`max_pending_predictions`, Redis
slow or down) drops the oldest: predictions are hints, the events are the truth. With a
keyring the registry signs them and applies only others' that verify (registry/).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import Iterable, Sequence

from prefixgate.gateway import metrics
from prefixgate.gateway.feeds import EventFeed, apply_event
from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.pool import WorkerHandle
from prefixgate.registry import RedisRegistry, StreamEntry, WorkerRecord, stream_id_newer
from prefixgate.wire.events import chains

log = logging.getLogger(__name__)

__all__ = ["RedisStreamFeed"]


class RedisStreamFeed(EventFeed):
    def __init__(self, index: PrefixIndex, registry: RedisRegistry, block_ms: int = 1000,
                 retry_s: float = 0.5, max_pending_predictions: int = 10_000) -> None:
        self.index = index
        self.registry = registry
        self.block_ms = block_ms
        self.retry_s = retry_s
        self.degraded = False
        self.cursor: bytes | None = None  # last applied stream id (None: rebuild)
        self.consumed = 0  # stream entries applied or covered by the last rebuild
        self.num_rebuilds = 0
        self.num_entries = 0
        self._server_id = ""
        self._task: asyncio.Task | None = None
        self._closed = False
        self.ready = asyncio.Event()  # set after the first rebuild
        self.gateway_id = uuid.uuid4().hex[:16]  # marks this gateway's own predictions
        # Routing predictions not yet sent (the oldest dropped when full: hints only).
        self._pending: deque[tuple[WorkerRecord, Sequence[int]]] = deque(
            maxlen=max_pending_predictions)
        self._wake = asyncio.Event()
        self._publisher: asyncio.Task | None = None
        self.num_predictions_applied = 0

    def predicted(self, record: WorkerRecord, block_hashes: Sequence[int]) -> None:
        if not block_hashes:
            return
        self._pending.append((record, block_hashes))
        self._wake.set()
        if self._publisher is None and not self._closed:
            self._publisher = asyncio.create_task(self._publish())

    async def _publish(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            batch = list(self._pending)
            self._pending.clear()
            try:
                await self.registry.publish_predictions(batch, self.gateway_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # hints only: the events repair the index anyway
                log.debug("publishing %d predictions failed: %s", len(batch), exc)

    async def sync(self, workers: Iterable[WorkerHandle]) -> None:
        if self._task is None:
            self._closed = False
            self._task = asyncio.create_task(self._run())
        if self.degraded:
            return
        try:
            for wid in await self.registry.reap_expired():
                log.warning("reaped worker %s: its lease expired", wid)
                metrics.REAPED.inc()
        except Exception as exc:
            log.debug("reaping failed: %s", exc)

    async def _run(self) -> None:
        while not self._closed:
            try:
                if self.cursor is None:
                    await self.rebuild()
                await self.step()
                if self.degraded:
                    log.info("Redis is back: routing index follows the event stream again")
                self.degraded = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down or unreachable: keep routing, retry
                if self._closed:  # redis-py turns a cancelled read into an error
                    return
                if not self.degraded:
                    log.warning("Redis unreachable (%s): routing on the last known index", exc)
                self.degraded = True
                metrics.REGISTRY_DEGRADED.set(1)
                await asyncio.sleep(self.retry_s)

    async def rebuild(self) -> None:
        """Replace the index with Redis' current ownership."""
        self._server_id = await self.registry.server_id()
        last_id, added, owners = await self.registry.ownership_snapshot()
        index = self.index
        index.clear()
        for wid, (epoch, blocks) in owners.items():
            index.reset_worker(wid, epoch)
            for parent, hs in chains(blocks):
                index.stored(wid, epoch, parent, hs)
        self.cursor = last_id
        self.consumed = added  # stream entries accounted for by the index
        self.num_rebuilds += 1
        metrics.RESYNCS.labels("redis").inc()
        metrics.INDEX_BLOCKS.set(index.num_blocks)
        log.info("routing index rebuilt from Redis: %d workers, %d blocks", len(owners),
                 index.num_blocks)
        self.ready.set()

    async def step(self) -> int:
        """One read: check for a restart or trimming, apply what arrived. Returns the
        entries applied (a read waits up to block_ms)."""
        if self.degraded and await self.registry.server_id() != self._server_id:
            log.warning("Redis restarted: rebuilding the routing index")
            self.cursor = None
            return 0
        assert self.cursor is not None
        last, added, held = await self.registry.stream_state()
        if added - held > self.consumed or added < self.consumed \
                or stream_id_newer(self.cursor, last):
            log.warning("event stream trimmed past this gateway (or reset): rebuilding")
            self.cursor = None
            return 0
        entries = await self.registry.read_events(self.cursor, self.block_ms)
        for entry in entries:
            self.apply(entry)
            self.cursor = entry.entry_id
        self.consumed += len(entries)
        self.num_entries += len(entries)
        if entries:
            metrics.INDEX_BLOCKS.set(self.index.num_blocks)
        return len(entries)

    def apply(self, entry: StreamEntry) -> None:
        index, wid, epoch = self.index, entry.worker_id, entry.epoch
        if entry.kind == "predict":
            if entry.source != self.gateway_id and index.epoch_of(wid) == epoch:
                index.predict(wid, entry.events[0].block_hashes)
                self.num_predictions_applied += 1
        elif entry.kind == "join":
            index.reset_worker(wid, epoch)
        elif entry.kind in ("leave", "reap"):
            if index.epoch_of(wid) <= epoch:
                index.remove_worker(wid)
        else:
            blocks = sum(apply_event(index, wid, epoch, ev.kind, ev.parent_hash,
                                     ev.block_hashes, "redis") for ev in entry.events)
            metrics.EVENT_BLOCKS.labels("redis").inc(blocks)
            return
        metrics.EVENTS.labels("redis", entry.kind).inc()

    async def close(self) -> None:
        self._closed = True
        for task in (self._task, self._publisher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._publisher = None
