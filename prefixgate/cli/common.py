"""What several commands share: the logging (and quieting httpx's), model, listening, drain, context-overflow and
service-model flags.

Imports nothing heavy at top level (the gateway-side commands never import torch).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from prefixgate.cli.flags import flag

log = logging.getLogger("prefixgate")


def log_flags(p: argparse.ArgumentParser) -> None:
    flag(p, "--log-level", help="logging level", default="INFO",
         choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    flag(p, "--log-format", help="text, or json: one JSON object per line (structured "
         "fields as keys, e.g. the gateway's one line per turn)", default="text",
         choices=["text", "json"])


def quiet_http_client_logs() -> None:
    """httpx logs every request at INFO; a client command (chat's replies on stdout,
    replay's progress bar) would show one line per turn."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


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


def service_flags(p: argparse.ArgumentParser, who: str) -> None:
    """--prefill-tokens-per-s and --decode-s-per-token: an emulated or simulated worker's
    speed (`who`: "emulated" or "simulated"), defaults from emulate/service.py."""
    from prefixgate.emulate.service import ServiceModel

    d = ServiceModel()
    flag(p, "--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s,
         help=f"{who}: prefill speed per worker (uncached prompt tokens per emulated second)")
    flag(p, "--decode-s-per-token", type=float, default=d.decode_s_per_token,
         help=f"{who}: seconds per output token of one sequence (decoding is batched)")


def transfer_flags(p: argparse.ArgumentParser, who: str, real_workers: bool = False) -> None:
    """--transfer-bytes-per-s and --kv-bytes-per-token: an emulated or simulated worker's
    block-transfer link and the KV bytes of one token of the model it stands for,
    defaults from emulate/service.py (100 Gb/s, an 8B model). With `real_workers` (the
    worker command), --transfer-bytes-per-s also declares a real worker's link: its
    default is then None (`transfer_bytes_per_s_of` gives the emulated default)."""
    from prefixgate.emulate.service import (
        DEFAULT_KV_BYTES_PER_TOKEN,
        DEFAULT_TRANSFER_BYTES_PER_S,
    )

    real = ("; a real worker: its declared link rate, reported as its transfer rate until "
            "its pulls measure it (default: probed at start-up, docs/transfer.md)"
            if real_workers else "")
    flag(p, "--transfer-bytes-per-s", type=float,
         default=None if real_workers else DEFAULT_TRANSFER_BYTES_PER_S,
         help=f"{who}: each worker's link for KV block transfers, bytes per emulated second "
              f"(default 12.5e9: 100 Gb/s between GPUs; 0: no transfers){real}")
    flag(p, "--kv-bytes-per-token", type=int, default=DEFAULT_KV_BYTES_PER_TOKEN,
         help=f"{who}: KV bytes of one token (default 131072: an 8B model, Llama-3-8B in "
              "bf16, the model the default prefill rate stands for)")


def transfer_bytes_per_s_of(args: argparse.Namespace, emulated: bool) -> float:
    """--transfer-bytes-per-s as given, else its default: emulate/service.py's link for
    an emulated worker, 0 (none declared: probe) for a real one."""
    from prefixgate.emulate.service import DEFAULT_TRANSFER_BYTES_PER_S

    value = args.transfer_bytes_per_s
    if value is None:
        return DEFAULT_TRANSFER_BYTES_PER_S if emulated else 0.0
    if value < 0:
        raise SystemExit(f"prefixgate {args.command}: --transfer-bytes-per-s must be >= 0, "
                         f"not {value:g}")
    return value


def service_model(args: argparse.Namespace):
    """The ServiceModel the parsed service flags stand for."""
    from prefixgate.emulate.service import ServiceModel

    try:
        return ServiceModel(args.prefill_tokens_per_s, args.decode_s_per_token)
    except ValueError as exc:
        raise SystemExit(f"prefixgate {args.command}: {exc}") from None


def redis_url_flag(p: argparse.ArgumentParser, help: str) -> None:
    """--redis-url, checked as the command line is read: a value redis-py cannot use
    (`notaurl`) is a usage error naming it, not a traceback once servers are starting."""
    flag(p, "--redis-url", default="", type=_redis_url, help=help)


def _redis_url(value: str) -> str:
    from prefixgate.registry.redis_registry import check_url

    if not value:
        return value
    try:
        return check_url(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def tracing_flag(p: argparse.ArgumentParser) -> None:
    """--otel-traces: OpenTelemetry spans of turns (prefixgate/telemetry/tracing.py)."""
    from prefixgate.telemetry.tracing import EXPORTERS

    flag(p, "--otel-traces", default="off", choices=EXPORTERS,
         help="OpenTelemetry traces of turns (W3C traceparent in and out): console (spans "
              "on stderr) or otlp (to the collector the standard OTEL_EXPORTER_OTLP_* "
              "variables name); needs the tracing extra, pip install 'prefixgate[tracing]'")
