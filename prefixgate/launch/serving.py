"""Running a server inside this process: the stop signal and the start-up handshake.

Contract: `stop_event()` (inside the running loop) returns an event set by SIGINT or
SIGTERM; `await start_server(serve)` runs `serve(started)` (a gateway's or worker's serve,
which sets `started` to its bound port) as a task and returns (task, port) once it
listens; a server that fails to start raises its error here, so the caller ends instead
of waiting for a port that never comes. Torch-free.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

__all__ = ["start_server", "stop_event"]


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (call inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def start_server(serve: Callable[[asyncio.Future[int]], Awaitable[None]]
                       ) -> tuple[asyncio.Task, int]:
    """Run `serve(started)` as a task; the task and the port once it listens."""
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(started))
    try:
        await asyncio.wait({started, task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not started.done():
        task.result()
    return task, started.result()
