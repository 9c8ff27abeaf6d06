"""What several commands share: the logging and model flags, the stop signal, metrics.

Imports nothing heavy at top level (the gateway-side commands never import torch).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
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


def cache_dir(args: argparse.Namespace) -> Path | None:
    return Path(args.cache_dir) if args.cache_dir else None


def stop_event() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (call inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def start_metrics(port: int, model_name: str) -> None:
    """Serve Prometheus metrics on `port` at /metrics (0: off), every prefixgate series
    labelled `model_name` (prefixgate/metrics_export.py)."""
    if port:
        from prefixgate import metrics_export

        metrics_export.serve(port, model_name)
        log.info("Prometheus metrics on :%d/metrics", port)
