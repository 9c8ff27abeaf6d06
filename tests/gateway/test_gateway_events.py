"""WatchEvents over real gRPC and the worker's EventLog: snapshot first, resume by cursor,
snapshot again when the cursor is of another incarnation or fell out of the ring; and the
gateway's WorkerStreamFeed applying it to a PrefixIndex."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.gateway.feeds import WorkerStreamFeed
from prefixgate.gateway.index import PrefixIndex
from prefixgate.registry import WorkerRecord
from prefixgate.v1 import worker_pb2, worker_pb2_grpc
from prefixgate.wire.events import chains
from prefixgate.workerapi.events import EventLog
from tests.helpers import wait_for


class _NoEngine:
    def shutdown(self) -> None:
        pass


@pytest.fixture
def event_worker(loop_thread, tiny_spec):
    """A WorkerService serving only its EventLog (ring of 8 events)."""
    from prefixgate.workerapi.server import WorkerConfig, WorkerService, serve

    log = EventLog(capacity_events=8)
    service = WorkerService(_NoEngine(), tiny_spec, WorkerConfig("ev", drain_seconds=1), 259,
                            events=log)

    async def start():
        stop = asyncio.Event()
        started = asyncio.get_running_loop().create_future()
        asyncio.create_task(serve(service, stop, started))
        return await started, stop

    port, stop = loop_thread.run(start())
    yield f"127.0.0.1:{port}", log
    loop_thread.loop.call_soon_threadsafe(stop.set)


def _take(address: str, n: int, incarnation: int = 0, after_seq: int = 0):
    with grpc.insecure_channel(address) as ch:
        stream = worker_pb2_grpc.WorkerServiceStub(ch).WatchEvents(
            worker_pb2.WatchEventsRequest(incarnation=incarnation, after_seq=after_seq),
            timeout=10)
        out = []
        for batch in stream:
            out.append(batch)
            if len(out) == n:
                stream.cancel()
                break
        return out


def test_snapshot_then_resume_then_snapshot_again(event_worker) -> None:
    address, log = event_worker
    log.stored(None, [1, 2, 3])
    log.stored(2, [4])
    log.removed([3])
    (snap,) = _take(address, 1)
    assert snap.snapshot and snap.worker_id == "ev" and snap.last_seq == 3
    assert [(e.stored.has_parent, list(e.stored.block_hashes)) for e in snap.events] == \
        [(False, [1, 2, 4])]
    inc = snap.incarnation
    log.stored(4, [5, 6])
    (live,) = _take(address, 1, inc, 3)  # resumes: no snapshot, only the new event
    assert not live.snapshot and live.last_seq == 4
    assert live.events[0].stored.parent_hash == 4 and list(live.events[0].stored.block_hashes) == [5, 6]
    for i in range(10):  # more than the ring holds
        log.stored(None, [100 + i])
    (again,) = _take(address, 1, inc, 4)
    assert again.snapshot and again.last_seq == 14
    (other,) = _take(address, 1, inc + 1, 14)  # a cursor of another incarnation
    assert other.snapshot


@dataclass
class _Handle:  # what WorkerStreamFeed needs of a WorkerHandle
    record: WorkerRecord
    client: worker_pb2_grpc.WorkerServiceStub  # a workerapi.client.WorkerClient
    worker_id: str


def test_worker_stream_feed_follows_and_forgets(loop_thread, event_worker) -> None:
    address, log = event_worker
    log.stored(None, [1, 2, 3])
    index = PrefixIndex()

    async def start():
        channel = grpc.aio.insecure_channel(address)
        feed = WorkerStreamFeed(index)
        handle = _Handle(WorkerRecord("ev", address), worker_pb2_grpc.WorkerServiceStub(channel),
                         "ev")
        await feed.sync([handle])
        return feed, handle, channel

    feed, handle, channel = loop_thread.run(start())
    wait_for(lambda: index.match([1, 2, 3]).cached_blocks == {"ev": 3}, what="snapshot")
    log.stored(3, [7])
    log.removed([7])
    log.stored(3, [8])
    wait_for(lambda: index.match([1, 2, 3, 8]).cached_blocks == {"ev": 4}, what="live events")
    assert index.match([1, 2, 3, 7]).cached_blocks == {"ev": 3}
    log.cleared()
    wait_for(lambda: index.num_blocks == 0, what="cleared")
    log.stored(None, [9])
    wait_for(lambda: index.num_blocks == 1, what="more events")
    loop_thread.run(feed.sync([]))  # the worker left the pool: forgotten
    assert index.num_blocks == 0 and index.workers() == {}
    loop_thread.run(feed.close())
    loop_thread.run(channel.close())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), max_size=60))
def test_chains_rebuild_exactly_the_blocks(edges) -> None:
    """`chains(blocks)`: every block once, each chain after the chain holding its parent
    (or with a parent outside `blocks`), links inside a chain are parent -> child."""
    blocks: dict[int, int | None] = {}
    for h, parent in edges:  # a forest: a parent id smaller than its child, 0 = root
        if h not in blocks:
            blocks[h] = parent if 0 < parent < h else None
    out = chains(blocks)
    seen: set[int] = set()
    for parent, hs in out:
        assert parent is None or parent in seen or parent not in blocks
        assert blocks[hs[0]] == parent
        for a, b in zip(hs, hs[1:], strict=False):
            assert blocks[b] == a
        assert not seen & set(hs)
        seen.update(hs)
    assert seen == set(blocks)


def test_worker_stream_feed_reconnects_with_backoff() -> None:
    """A worker whose event stream keeps failing is asked again at growing intervals
    (exponential backoff with jitter), not at a fixed rate; a stream that delivers starts
    the backoff over."""
    import time

    calls: list[float] = []
    deliver = {"from": 6}  # the 6th call delivers a batch, then fails again

    class _Failing:
        def WatchEvents(self, request):  # noqa: N802
            calls.append(time.monotonic())

            async def stream():
                if len(calls) == deliver["from"]:
                    yield worker_pb2.KVEventBatch(worker_id="x", incarnation=1, last_seq=1,
                                                  snapshot=True)
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "down")
            return stream()

    async def scenario() -> None:
        feed = WorkerStreamFeed(PrefixIndex(), retry_s=0.02, max_retry_s=0.5)
        await feed.sync([_Handle(WorkerRecord("x", "nowhere"), _Failing(), "x")])
        await asyncio.sleep(2.0)
        await feed.close()

    asyncio.run(scenario())
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    # Fixed 20 ms retries would make ~80 calls; backoff doubles 20, 40, 80, 160 ms...
    assert 6 < len(calls) < 25, gaps
    assert gaps[3] > 2 * gaps[0]
    # After the delivering 6th call, the wait is back near the first one.
    assert gaps[5] < gaps[4] / 2, gaps
