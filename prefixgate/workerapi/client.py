"""How a gateway calls a worker: over gRPC, or in its own process.

Contract
--------
`WorkerClient` is what the gateway's pool, event feeds, status follower and turns call
on a worker (gateway/pool.py `WorkerHandle.client`): the RPCs of
`prefixgate.v1.WorkerService` under their proto names, each taking the request and the
keyword arguments `timeout` (seconds, None: none) and `metadata` ((key, value) pairs);
unary ones are awaited, server-streaming ones iterated or `read()` message by
message (`grpc.aio.EOF` after the last), and may be `cancel()`led. A
call that fails raises `grpc.aio.AioRpcError`: its code, details and trailing metadata
(`prefixgate-error-scope: request` on a request-scoped failure, wire/protocol.py) are
what the gateway classifies, whichever client made the call. Plus `serving(timeout)`,
the worker's health (False while it drains), and `close(grace)`.

- `GrpcWorkerClient(channel)`: the generated stub over a channel; `serving` is the
  grpc.health.v1 check of the worker service (a worker without the health service
  counts as serving); `close` closes the channel, letting calls in flight finish for
  `grace` seconds.
- `InProcessWorkerClient(service)`: a Worker API service held in this process (e.g.
  engines/vllm.py's vLLM adapter), its call-level methods (workerapi/calls.py) called
  directly on the caller's event loop: no serialization, no socket, no servicer context.
  The scope is `CallScope.within(timeout, metadata)`; the deadline is kept as a gRPC
  channel keeps it (DEADLINE_EXCEEDED once it passes, the call's generator closed). A
  `Refused` arrives as the AioRpcError a gRPC call would raise for it (same code, details
  and trailing metadata), any other exception as UNKNOWN, as a gRPC server sends it.
  A stream cancelled or left early is closed: the service's clean-up runs (a Generate
  cancels its request). `serving` is the service's own `serving()` when it has one;
  `close` leaves the service running: its owner stops it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixgate.v1 import worker_pb2, worker_pb2_grpc
from prefixgate.workerapi.calls import CallScope, Refused

__all__ = ["GrpcWorkerClient", "InProcessWorkerClient", "StreamCall", "WorkerClient"]

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
Metadata = Sequence[tuple[str, str]]


class StreamCall(Protocol):
    """A server-streaming call: iterate it, or `read()` its next message (`grpc.aio.EOF`
    after the last; not both on one call); `cancel()` ends it early."""

    def __aiter__(self) -> AsyncIterator: ...

    async def read(self) -> Any: ...

    def cancel(self) -> bool: ...


class WorkerClient(Protocol):
    """The Worker API as the gateway calls it (see the module's contract)."""

    def GetInfo(self, request: worker_pb2.GetInfoRequest, *, timeout: float | None = None,
                metadata: Metadata | None = None) -> Awaitable[worker_pb2.WorkerInfo]: ...

    def GetStatus(self, request: worker_pb2.GetStatusRequest, *,
                  timeout: float | None = None,
                  metadata: Metadata | None = None) -> Awaitable[worker_pb2.WorkerStatus]: ...

    def FlushCache(self, request: worker_pb2.FlushCacheRequest, *,
                   timeout: float | None = None, metadata: Metadata | None = None
                   ) -> Awaitable[worker_pb2.FlushCacheResponse]: ...

    def PullBlocks(self, request: worker_pb2.PullBlocksRequest, *,
                   timeout: float | None = None, metadata: Metadata | None = None
                   ) -> Awaitable[worker_pb2.PullBlocksResponse]: ...

    def Generate(self, request: worker_pb2.GenerateRequest, *, timeout: float | None = None,
                 metadata: Metadata | None = None) -> StreamCall: ...

    def ExportBlocks(self, request: worker_pb2.ExportBlocksRequest, *,
                     timeout: float | None = None,
                     metadata: Metadata | None = None) -> StreamCall: ...

    def WatchEvents(self, request: worker_pb2.WatchEventsRequest, *,
                    timeout: float | None = None, metadata: Metadata | None = None
                    ) -> StreamCall: ...

    def WatchStatus(self, request: worker_pb2.WatchStatusRequest, *,
                    timeout: float | None = None, metadata: Metadata | None = None
                    ) -> StreamCall: ...

    async def serving(self, timeout: float | None = None) -> bool: ...

    async def close(self, grace: float | None = None) -> None: ...


class GrpcWorkerClient:
    """A worker over a gRPC channel: the generated stub's calls, its health service."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        self.GetInfo = stub.GetInfo
        self.GetStatus = stub.GetStatus
        self.FlushCache = stub.FlushCache
        self.PullBlocks = stub.PullBlocks
        self.Generate = stub.Generate
        self.ExportBlocks = stub.ExportBlocks
        self.WatchEvents = stub.WatchEvents
        self.WatchStatus = stub.WatchStatus
        self._health = health_pb2_grpc.HealthStub(channel)

    async def serving(self, timeout: float | None = None) -> bool:
        try:
            health = await self._health.Check(
                health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return True
            raise
        return health.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self, grace: float | None = None) -> None:
        await self.channel.close(grace)


def _rpc_error(code: grpc.StatusCode, details: str,
               trailing: Metadata = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing),
                                details)


def _failure(exc: Exception) -> grpc.aio.AioRpcError:
    """What a gRPC client would receive for `exc` raised by the service."""
    if isinstance(exc, Refused):
        return _rpc_error(exc.code, exc.message, exc.trailing_metadata)
    return _rpc_error(grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}")


_DEADLINE = "Deadline Exceeded"  # gRPC's own details for it


class InProcessCall:
    """A server-streaming call made in process: iterate it or `read()` it; `cancel()` ends
    it early (the service's generator is closed: its clean-up runs)."""

    _closing: set[asyncio.Task] = set()  # closings in progress (kept referenced)

    def __init__(self, stream: AsyncIterator) -> None:
        self._stream = stream

    def __aiter__(self) -> AsyncIterator:
        return self._stream

    async def read(self) -> Any:
        """The next message, or `grpc.aio.EOF` after the last (as a gRPC call's read())."""
        return await anext(self._stream, grpc.aio.EOF)

    def cancel(self) -> bool:
        task = asyncio.ensure_future(self._stream.aclose())  # type: ignore[attr-defined]
        InProcessCall._closing.add(task)
        task.add_done_callback(InProcessCall._closing.discard)
        return True


async def _as_rpc(waiting: asyncio.Timeout, step: Awaitable):
    """`step` awaited within `waiting`, its failures as a gRPC call's: a deadline that
    passed is DEADLINE_EXCEEDED, a refusal or crash what `_failure` makes of it; the end
    of a stream (StopAsyncIteration) passes through."""
    try:
        async with waiting:
            return await step
    except StopAsyncIteration:
        raise
    except TimeoutError as exc:
        if waiting.expired():
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, _DEADLINE) from None
        raise _failure(exc) from exc
    except Exception as exc:
        raise _failure(exc) from exc


class InProcessWorkerClient:
    """A Worker API service in this process, called directly (see the module's contract).
    `service` has the call-level methods of workerapi/calls.py."""

    def __init__(self, service: Any) -> None:
        self.service = service

    async def _unary(self, call: Callable, request, timeout: float | None,
                     metadata: Metadata | None):
        scope = CallScope.within(timeout, metadata)
        return await _as_rpc(asyncio.timeout(timeout), call(request, scope))

    async def _stream(self, call: Callable, request, timeout: float | None,
                      metadata: Metadata | None) -> AsyncIterator:
        scope = CallScope.within(timeout, metadata)
        events = call(request, scope)
        loop = asyncio.get_running_loop()
        # The deadline on the loop's clock. It can only fire while this waits for the
        # service's next event (cancelling the service's step there): a timeout around
        # the yield would cancel the caller's task wherever it is.
        deadline = None if timeout is None else loop.time() + timeout
        try:
            while True:
                try:
                    event = await _as_rpc(asyncio.timeout_at(deadline), anext(events))
                except StopAsyncIteration:
                    return
                yield event
        finally:
            await events.aclose()  # the caller stopped reading: the service cleans up now

    def _call(name: str, streaming: bool):  # noqa: N805 (builds the methods below)
        def unary(self, request, *, timeout: float | None = None,
                  metadata: Metadata | None = None, **_):
            return self._unary(getattr(self.service, name), request, timeout, metadata)

        def stream(self, request, *, timeout: float | None = None,
                   metadata: Metadata | None = None, **_) -> InProcessCall:
            return InProcessCall(self._stream(getattr(self.service, name), request, timeout,
                                              metadata))
        return stream if streaming else unary

    GetInfo = _call("get_info", False)
    GetStatus = _call("get_status", False)
    FlushCache = _call("flush_cache", False)
    PullBlocks = _call("pull_blocks", False)
    Generate = _call("generate", True)
    ExportBlocks = _call("export_blocks", True)
    WatchEvents = _call("watch_events", True)
    WatchStatus = _call("watch_status", True)
    del _call

    async def serving(self, timeout: float | None = None) -> bool:
        """The service's health (its `serving()` when it has one)."""
        check = getattr(self.service, "serving", None)
        return True if check is None else await check()

    async def close(self, grace: float | None = None) -> None:
        """Nothing to close: the service's owner stops it."""
