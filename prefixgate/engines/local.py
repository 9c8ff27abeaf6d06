"""A Worker API servicer held in the gateway's process, with the surface of its gRPC stub.

Contract
--------
`LocalWorker(servicer)` offers what the gateway's pool, feeds and status follower call
on a `worker_pb2_grpc.WorkerServiceStub` (`GetInfo`, `GetStatus`, `FlushCache`,
`PullBlocks` awaited with an optional `timeout`; `Generate`, `ExportBlocks`,
`WatchEvents`, `WatchStatus` iterated, and cancelled), plus
`serving()` (the health check, in place of grpc.health.v1) and `close(grace)` (in place of
the channel's; it leaves the servicer running: its owner closes it). Calls run the
servicer's own methods on the caller's event loop with a `LocalContext`; a status the
servicer aborts with arrives as the `grpc.aio.AioRpcError` a stub raises (trailing
metadata included, so request-scoped failures stay request-scoped), and any other
exception as UNKNOWN, as a gRPC server would send it. No serialization, no socket: the
gateway holds it in `WorkerHandle.stub` and `.channel` (gateway/pool.py `local`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import grpc

__all__ = ["LocalCall", "LocalContext", "LocalWorker"]


class LocalContext:
    """The part of `grpc.aio.ServicerContext` the Worker API servicers use."""

    def __init__(self, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] = ()) -> None:
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._metadata = tuple(metadata)

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return "local"

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Sequence[tuple[str, str]] = ()) -> None:
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(),
                                   grpc.aio.Metadata(*trailing_metadata), details)


class LocalCall:
    """A server-streaming call made in process, as a grpc.aio call is used: iterate it;
    `cancel()` ends it early (the servicer's generator is closed: its cleanup runs)."""

    _closing: set[asyncio.Task] = set()  # cancellations in progress (kept referenced)

    def __init__(self, stream: AsyncIterator) -> None:
        self._stream = stream

    def __aiter__(self) -> AsyncIterator:
        return self._stream

    def cancel(self) -> bool:
        task = asyncio.ensure_future(self._stream.aclose())  # type: ignore[attr-defined]
        LocalCall._closing.add(task)
        task.add_done_callback(LocalCall._closing.discard)
        return True


def _unknown(exc: Exception) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNKNOWN, grpc.aio.Metadata(),
                                grpc.aio.Metadata(),
                                f"Unexpected {type(exc).__name__}: {exc}")


class LocalWorker:
    def __init__(self, servicer) -> None:
        self.servicer = servicer

    async def _unary(self, method, request, timeout: float | None):
        try:
            return await method(request, LocalContext(timeout))
        except grpc.aio.AioRpcError:
            raise
        except Exception as exc:
            raise _unknown(exc) from exc

    async def _stream(self, method, request, timeout: float | None) -> AsyncIterator:
        stream = method(request, LocalContext(timeout))
        try:
            async for item in stream:
                yield item
        except grpc.aio.AioRpcError:
            raise
        except Exception as exc:
            raise _unknown(exc) from exc
        finally:
            await stream.aclose()  # the caller stopped reading: the servicer cleans up now

    async def GetInfo(self, request, timeout: float | None = None, **_):
        return await self._unary(self.servicer.GetInfo, request, timeout)

    async def GetStatus(self, request, timeout: float | None = None, **_):
        return await self._unary(self.servicer.GetStatus, request, timeout)

    async def FlushCache(self, request, timeout: float | None = None, **_):
        return await self._unary(self.servicer.FlushCache, request, timeout)

    def Generate(self, request, timeout: float | None = None, **_) -> LocalCall:
        return LocalCall(self._stream(self.servicer.Generate, request, timeout))

    async def PullBlocks(self, request, timeout: float | None = None, **_):
        return await self._unary(self.servicer.PullBlocks, request, timeout)

    def ExportBlocks(self, request, timeout: float | None = None, **_) -> LocalCall:
        return LocalCall(self._stream(self.servicer.ExportBlocks, request, timeout))

    def WatchEvents(self, request, timeout: float | None = None, **_) -> LocalCall:
        return LocalCall(self._stream(self.servicer.WatchEvents, request, timeout))

    def WatchStatus(self, request, timeout: float | None = None, **_) -> LocalCall:
        return LocalCall(self._stream(self.servicer.WatchStatus, request, timeout))

    async def serving(self) -> bool:
        """The servicer's health (its `serving()` when it has one)."""
        check = getattr(self.servicer, "serving", None)
        return True if check is None else await check()

    async def close(self, grace: float | None = None) -> None:
        """Nothing to close: the servicer's owner stops it."""
