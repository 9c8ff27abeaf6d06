"""A gateway process's start-up: what the command line describes, made a running gateway.

Contract: `GatewayStartup` holds what one gateway process needs beyond its GatewayConfig
(the model to resolve, the registry, the metrics port, logging), parsed once at the
command line's edge. `await run_gateway(startup, stop, started)` resolves the model,
serves metrics (when `metrics_port`), opens the registry (Redis at `redis_url`, else the
embedded one holding `config.static_workers`) and serves until `stop` (gateway/server.py
`serve`; `started` receives the bound port). `serve_process(startup, on_listening)` is the
same as a whole process: logging configured, stopped by SIGINT/SIGTERM; the target of
gateway/processes.py `spawn`. Never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prefixgate.gateway.config import GatewayConfig

__all__ = ["GatewayStartup", "run_gateway", "serve_process"]


@dataclass(frozen=True)
class GatewayStartup:
    model: str
    config: GatewayConfig
    cache_dir: Path | None = None
    redis_url: str = ""  # "" : the embedded registry (config.static_workers)
    metrics_port: int = 0  # Prometheus /metrics on config.host (0: off)
    log_level: str = "INFO"
    log_format: str = "text"
    otel_traces: str = "off"  # telemetry/tracing.py EXPORTERS


async def run_gateway(startup: GatewayStartup, stop: asyncio.Event,
                      started: asyncio.Future[int] | None = None) -> None:
    from prefixgate.gateway.server import serve
    from prefixgate.model.catalog import resolve_model
    from prefixgate.registry import make_registry
    from prefixgate.telemetry import metrics_export

    spec = resolve_model(startup.model, startup.cache_dir)
    metrics_export.serve(startup.metrics_port, spec.name, startup.config.host)
    await serve(spec, make_registry(startup.redis_url or None), startup.config, stop, started)


def serve_process(startup: GatewayStartup, on_listening: Callable[[], None]) -> None:
    """One of `--processes` gateway processes (gateway/processes.py)."""
    from prefixgate.launch.serving import stop_event
    from prefixgate.telemetry import logs

    logs.configure(startup.log_level, startup.log_format)
    from prefixgate.telemetry import tracing

    tracing.configure(startup.otel_traces, "prefixgate-gateway")

    async def main() -> None:
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        started.add_done_callback(lambda _: on_listening())
        await run_gateway(startup, stop_event(), started)

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C reaches every process
        asyncio.run(main())
