"""Event feeds: keep the gateway's `PrefixIndex` in step with the workers' KV caches.

Contract
--------
A feed applies worker events to one `PrefixIndex` on the gateway's event loop and never
blocks routing (routing reads the index; feeds write it between awaits). `sync(workers)`
is called on every pool refresh with the workers currently routable; `close()` stops it.
`degraded` is True while the feed cannot follow its source (the index then keeps serving
what it last knew and is repaired when the source returns). `predicted(record, hashes)`
shares this gateway's routing prediction (gateway/index.py) with the other gateways where
the source is shared (Redis); it never blocks and never raises.

  WorkerStreamFeed  no Redis (`prefixgate up`, static workers): one WatchEvents stream per
                    worker. A (re)connecting stream resumes after its last (incarnation,
                    seq); the worker answers with a snapshot when it cannot resume, and the
                    feed replaces that worker's blocks with it. Workers that leave the pool
                    are forgotten.
  RedisStreamFeed   (gateway/redis_feed.py) Redis: bootstrap from the ownership hashes,
                    then follow the shared event stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc

from prefixgate.gateway import metrics
from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.pool import WorkerHandle
from prefixgate.registry import WorkerRecord
from prefixgate.v1 import worker_pb2

log = logging.getLogger(__name__)

__all__ = ["EventFeed", "WorkerStreamFeed", "apply_batch", "apply_event", "count_events"]


class EventFeed:
    """Base: a source of worker events for a PrefixIndex."""

    degraded: bool = False

    async def sync(self, workers: Iterable[WorkerHandle]) -> None:
        """The routable workers now (called on each pool refresh)."""

    def predicted(self, record: WorkerRecord, block_hashes: Sequence[int]) -> None:
        """This gateway routed a turn with `block_hashes` to `record`'s worker (nothing to
        share without a shared source: each worker's own stream reaches one gateway)."""

    async def close(self) -> None:
        """Stop following."""


_EVENTS: dict[tuple[str, str], object] = {}  # (source, kind) -> its counter's child


def count_events(source: str, kind: str, num_events: int) -> None:
    """Count applied events; the labelled child is looked up once per (source, kind)
    (`labels()` takes a lock and builds a key: ~2 us, once per event before)."""
    child = _EVENTS.get((source, kind))
    if child is None:
        child = _EVENTS[(source, kind)] = metrics.EVENTS.labels(source, kind)
    child.inc(num_events)  # type: ignore[attr-defined]


def apply_event(index: PrefixIndex, worker_id: str, epoch: int, kind: str,
                parent_hash: int | None, block_hashes: Sequence[int], source: str,
                count: bool = True) -> int:
    """Apply one KV event (prefixgate.wire.events.OwnershipEvent's kinds: "store", "remove",
    "clear"; any other changes nothing) of `worker_id` under `epoch`, counted under
    `source` (unless `count` is False: the caller counts a batch at once); returns the
    blocks it names."""
    if kind == "store":
        index.stored(worker_id, epoch, parent_hash, block_hashes)
    elif kind == "remove":
        index.removed(worker_id, epoch, block_hashes)
    elif kind == "clear":
        index.cleared(worker_id, epoch)
    else:
        kind = "unknown"
    if count:
        count_events(source, kind, 1)
    return len(block_hashes)


def apply_batch(index: PrefixIndex, worker_id: str, epoch: int, batch: worker_pb2.KVEventBatch,
                source: str) -> None:
    """Apply one WatchEvents batch for `worker_id` under `epoch` (its incarnation); the
    batch's events and blocks are counted once per kind, not once per event."""
    if batch.snapshot:
        index.reset_worker(worker_id, epoch)
    blocks = stores = removes = 0
    for ev in batch.events:
        kind = ev.WhichOneof("event")
        if kind == "stored":
            s = ev.stored
            hs = s.block_hashes
            index.stored(worker_id, epoch, s.parent_hash if s.has_parent else None, hs)
            blocks += len(hs)
            stores += 1
        elif kind == "removed":
            hs = ev.removed.block_hashes
            index.removed(worker_id, epoch, hs)
            blocks += len(hs)
            removes += 1
        else:
            apply_event(index, worker_id, epoch, "clear" if kind == "cleared" else str(kind),
                        None, (), source)
    if stores:
        count_events(source, "store", stores)
    if removes:
        count_events(source, "remove", removes)
    if blocks:
        metrics.EVENT_BLOCKS.labels(source).inc(blocks)
    metrics.INDEX_BLOCKS.set(index.num_blocks)


@dataclass
class _Watch:
    task: asyncio.Task
    address: str


class _NoProgress(Exception):
    """A WatchEvents stream that failed or ended before delivering any batch."""


class _Unimplemented(Exception):
    """The worker has no WatchEvents (routing to it uses load only)."""


class WorkerStreamFeed(EventFeed):
    """Follows each worker's WatchEvents stream (see the module docstring). A stream that
    fails or ends is reopened with exponential backoff and jitter (tenacity), from
    `retry_s` up to `max_retry_s`: a worker that is down is not asked twice a second for
    ever, and gateways that lost the same worker do not reconnect in lockstep. A stream
    that delivered batches starts the backoff over."""

    def __init__(self, index: PrefixIndex, retry_s: float = 0.5,
                 max_retry_s: float = 10.0) -> None:
        self.index = index
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self._watches: dict[str, _Watch] = {}

    @property
    def degraded(self) -> bool:  # type: ignore[override]
        return False  # each worker's stream stands alone; a lost one is that worker lost

    async def sync(self, workers: Iterable[WorkerHandle]) -> None:
        current = {w.worker_id: w for w in workers}
        for wid in list(self._watches):
            watch = self._watches[wid]
            w = current.get(wid)
            if w is None or w.record.address != watch.address:
                watch.task.cancel()
                del self._watches[wid]
                self.index.remove_worker(wid)
        for wid, w in current.items():
            if wid not in self._watches:
                self._watches[wid] = _Watch(asyncio.create_task(self._follow(w)),
                                            w.record.address)

    async def _follow(self, w: WorkerHandle) -> None:
        from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential_jitter

        cursor = [0, 0]  # incarnation, last seq: where a reopened stream resumes
        while True:
            try:
                async for attempt in AsyncRetrying(
                        wait=wait_exponential_jitter(multiplier=self.retry_s, max=self.max_retry_s,
                                                     jitter=self.retry_s),
                        retry=retry_if_exception_type(_NoProgress), reraise=True):
                    with attempt:
                        await self._stream(w, cursor)
            except _Unimplemented:
                log.warning("worker %s does not publish KV events; routing to it uses "
                            "load only", w.worker_id)
                return
            await asyncio.sleep(self.retry_s)  # it delivered, then ended: reopen soon

    async def _stream(self, w: WorkerHandle, cursor: list[int]) -> None:
        """One WatchEvents stream, applied to the index until it ends; _NoProgress when
        it failed or ended before any batch."""
        progressed = False
        try:
            stream = w.client.WatchEvents(worker_pb2.WatchEventsRequest(
                incarnation=cursor[0], after_seq=cursor[1]))
            async for batch in stream:
                if batch.snapshot or batch.incarnation != cursor[0]:
                    cursor[0] = batch.incarnation
                apply_batch(self.index, w.worker_id, cursor[0], batch, "worker")
                cursor[1] = batch.last_seq
                progressed = True
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise _Unimplemented() from None
            log.debug("event stream of %s: %s", w.worker_id, exc.code().name)
        except Exception:  # never let one worker's stream take the gateway down
            log.exception("event stream of %s failed", w.worker_id)
        if not progressed:
            raise _NoProgress()

    async def close(self) -> None:
        for watch in self._watches.values():
            watch.task.cancel()
        await asyncio.gather(*(w.task for w in self._watches.values()), return_exceptions=True)
        self._watches.clear()
