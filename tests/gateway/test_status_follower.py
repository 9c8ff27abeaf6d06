"""The gateway follows each worker's load: pushed over WatchStatus on change, polled with
GetStatus where a worker lacks it; turns that ended here since the last status no longer
count as running there (real gRPC on loopback)."""

from __future__ import annotations

import asyncio
import time

import grpc

from prefixgate.gateway.pool import WorkerHandle
from prefixgate.gateway.status import StatusFollower
from prefixgate.registry import WorkerRecord
from prefixgate.v1 import worker_pb2
from prefixgate.wire.status import watch_status
from prefixgate.workerapi.client import GrpcWorkerClient

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]


class Load:
    """A worker's load, changed by the test."""

    def __init__(self) -> None:
        self.status = worker_pb2.WorkerStatus(num_running_requests=0)
        self.watchers = 0

    async def GetStatus(self, request, context):
        return self.status

    async def WatchStatus(self, request, context):
        self.watchers += 1
        async for s in watch_status(lambda: self.status, request.min_interval_ms, lambda: False):
            yield s


async def wait_until(predicate, timeout_s: float = 5.0) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, "timed out"
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


async def follow(push: bool) -> None:
    load = Load()
    server = grpc.aio.server()
    handlers = {"GetStatus": grpc.unary_unary_rpc_method_handler(
        load.GetStatus, worker_pb2.GetStatusRequest.FromString,
        worker_pb2.WorkerStatus.SerializeToString)}
    if push:  # else an older worker: WatchStatus is UNIMPLEMENTED
        handlers["WatchStatus"] = grpc.unary_stream_rpc_method_handler(
            load.WatchStatus, worker_pb2.WatchStatusRequest.FromString,
            worker_pb2.WorkerStatus.SerializeToString)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE.full_name,
                                                                          handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    handle = WorkerHandle(WorkerRecord("w", f"127.0.0.1:{port}"), GrpcWorkerClient(channel))
    follower = StatusFollower(interval_ms=20)
    try:
        follower.sync([handle])
        await wait_until(lambda: handle.status is not None)
        load.status = worker_pb2.WorkerStatus(num_running_requests=3,
                                              num_queued_prefill_tokens=500)
        await wait_until(lambda: handle.num_running_requests == 3)
        assert handle.num_queued_prefill_tokens == 500
        # One of those turns ends here: it stops counting at once, not an interval later.
        handle.finished_since_status += 1
        assert handle.num_running_requests == 2
        assert load.watchers == (1 if push else 0)
        follower.sync([])  # no longer followed: the stream is cancelled
        await asyncio.sleep(0.1)
        load.status = worker_pb2.WorkerStatus(num_running_requests=7)
        await asyncio.sleep(0.1)
        assert handle.num_running_requests == 2
    finally:
        await follower.close()
        await channel.close()
        await server.stop(0)


def test_status_is_pushed_on_change() -> None:
    asyncio.run(follow(push=True))


def test_a_worker_without_watch_status_is_polled() -> None:
    asyncio.run(follow(push=False))


async def stream_breaks_and_resumes() -> None:
    load = Load()
    handlers = {"WatchStatus": grpc.unary_stream_rpc_method_handler(
        load.WatchStatus, worker_pb2.WatchStatusRequest.FromString,
        worker_pb2.WorkerStatus.SerializeToString)}

    async def start(port: int = 0) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            SERVICE.full_name, handlers)])
        port = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server, port

    server, port = await start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    handle = WorkerHandle(WorkerRecord("w", f"127.0.0.1:{port}"), GrpcWorkerClient(channel))
    follower = StatusFollower(interval_ms=20)
    try:
        load.status = worker_pb2.WorkerStatus(num_running_requests=4)
        follower.sync([handle])
        await wait_until(lambda: handle.status is not None)
        await server.stop(0)  # the stream breaks: no stale figures are kept
        await wait_until(lambda: handle.status is None)
        server, _ = await start(port)  # the worker is back: the follower reconnects
        await wait_until(lambda: handle.status is not None, timeout_s=15)
        assert handle.num_running_requests == 4 and load.watchers == 2
    finally:
        await follower.close()
        await channel.close()
        await server.stop(0)


def test_a_broken_stream_clears_the_status_and_reconnects() -> None:
    asyncio.run(stream_breaks_and_resumes())
