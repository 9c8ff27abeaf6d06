"""What several commands share: the logging, model, listening, drain and context-overflow
flags, the stop signal, starting a server, metrics.

Imports nothing heavy at top level (the gateway-side commands never import torch).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from prefixgate.cli.flags import flag

log = logging.getLogger("prefixgate")


def log_flags(p: argparse.ArgumentParser) -> None:
    flag(p, "--log-level", help="logging level", default="INFO",
         choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    flag(p, "--log-format", help="text, or json: one JSON object per line (structured "
         "fields as keys, e.g. the gateway's one line per turn)", default="text",
         choices=["text", "json"])


def model_flags(p: argparse.ArgumentParser) -> None:
    flag(p, "--model", default="smollm2-135m",
         help="smollm2-135m, tiny-random, or a local Hugging Face checkpoint directory")
    flag(p, "--cache-dir", default=None,
         help="where materialised models are kept (default: ~/.cache/prefixgate)")
    flag(p, "--block-size", type=int, default=16, help="prefix-cache block size in tokens")


def listen_flags(p: argparse.ArgumentParser, port: int, whose: str = "") -> None:
    """--host and --port of a server (`whose`: "gateway " where the command runs several)."""
    flag(p, "--host", default="127.0.0.1", help=f"{whose}address to listen on")
    flag(p, "--port", type=int, default=port, help=f"{whose}port to listen on (0: any free port)")


def drain_flag(p: argparse.ArgumentParser) -> None:
    flag(p, "--drain-seconds", type=float, default=30.0,
         help="on SIGTERM, how long requests in flight may finish")


def overflow_flag(p: argparse.ArgumentParser) -> None:
    """--context-overflow, whose choices are the protocol's (prefixgate/wire/protocol.py)."""
    from prefixgate.wire.protocol import OVERFLOW_FROM_PROTO

    flag(p, "--context-overflow", default="fail", choices=[n for n in
                                                           OVERFLOW_FROM_PROTO.values() if n],
         help="requests that do not choose: prompt + max_tokens over the context fails, or "
              "keeps the system prompt and drops the oldest turns (docs/reindex.md)")


def cache_dir(args: argparse.Namespace) -> Path | None:
    return Path(args.cache_dir) if args.cache_dir else None


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (call inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def start_server(serve: Callable[[asyncio.Future[int]], Awaitable[None]]
                       ) -> tuple[asyncio.Task, int]:
    """Run `serve(started)` (a gateway's or worker's serve(), which sets `started` to its
    bound port) as a task; return the task and the port once it listens. A server that
    fails to start raises its error here: the command ends instead of waiting for a port
    that will never come."""
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


def start_metrics(port: int, model_name: str, host: str) -> None:
    """Serve Prometheus metrics on host:`port` at /metrics (0: off; `host` is the
    command's --host, so a loopback server keeps its metrics on loopback too), every
    prefixgate series labelled `model_name` (prefixgate/telemetry/metrics_export.py)."""
    if port:
        from prefixgate.telemetry import metrics_export
        metrics_export.serve(port, model_name, host)
        log.info("Prometheus metrics on %s:%d/metrics", host, port)
