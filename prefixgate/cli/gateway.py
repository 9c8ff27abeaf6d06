"""`prefixgate gateway`: the Chat gateway (prefixgate.v1.ChatService); never imports torch.

Also holds the gateway flag groups `prefixgate up` shares (routing policy, overflow default,
trace recording) and `gateway_config` / `gateway_startup`, the one place flags become a
GatewayConfig and a GatewayStartup (prefixgate/gateway/startup.py).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from prefixgate.cli import security
from prefixgate.cli.common import (
    cache_dir,
    drain_flag,
    listen_flags,
    log_flags,
    model_flags,
    overflow_flag,
    redis_url_flag,
    tracing_flag,
)
from prefixgate.cli.flags import flag
from prefixgate.cli.limits import limit_flags, request_limits

HELP = "run the Chat gateway"
DESCRIPTION = "Run the gateway serving prefixgate.v1.ChatService."


def add_arguments(g: argparse.ArgumentParser) -> None:
    log_flags(g)
    model_flags(g)
    listen_flags(g, 50051)
    flag(g, "--worker", action="append",
         help="worker address host:port (embedded registry); not needed with --redis-url")
    vllm_worker_flag(g)
    redis_url_flag(g, "discover workers through this Redis")
    policy_flags(g)
    record_trace_flag(g)
    drain_flag(g)
    overflow_flag(g)
    http_flag(g, -1)
    flag(g, "--metrics-port", type=int, default=0,
         help="serve Prometheus metrics on --host at this port, /metrics (0: off; with --processes "
              "N, process i serves on this port + i)")
    processes_flag(g)
    tracing_flag(g)
    security.gateway_flags(g)
    limit_flags(g)


def _vllm_worker(text: str) -> str:
    from prefixgate.engines.vllm import VLLMConfig

    try:
        VLLMConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def vllm_worker_flag(p: argparse.ArgumentParser) -> None:
    flag(p, "--vllm-worker", action="append", type=_vllm_worker, comma_separated=False,
         help="a vLLM server as a worker, followed from this process: URL,EVENTS[,REPLAY], "
              "its HTTP API and its --kv-events-config endpoint (and replay_endpoint), e.g. "
              "http://127.0.0.1:8000,tcp://127.0.0.1:5557 (docs/vllm.md)")


def http_flag(p: argparse.ArgumentParser, default: int) -> None:
    flag(p, "--http-port", type=int, default=default,
         help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
              "/v1/models, /health, /metrics) on this port, on --host (-1: off; 0: any free "
              "port)")


def policy_flags(p: argparse.ArgumentParser) -> None:
    from prefixgate.gateway.routing import POLICIES, RoutingConfig

    d = RoutingConfig()  # the flags' defaults are the config's

    flag(p, "--policy", default=d.policy, choices=POLICIES,
         help="routing policy (see docs/routing.md)")
    flag(p, "--prefix-weight", type=float, default=d.prefix_weight,
         help="prefix policy: weight of the prefill and later re-prefill seconds in the cost")
    flag(p, "--load-weight", type=float, default=d.load_weight,
         help="prefix policy: weight of the queued prefill and decode seconds in the cost")
    flag(p, "--work-weight", type=float, default=d.work_weight,
         help="prefix policy: weight of the delay a choice's added prefill imposes on the "
              "turns arriving behind it (0: price a choice by this turn's seconds alone)")
    flag(p, "--arrival-window-turns", type=int, default=d.arrival_window_turns,
         help="prefix policy: turns over which the arrival rate of the work cost is measured")
    flag(p, "--running-weight", type=float, default=d.running_weight,
         help="prefix policy: queued-token equivalents per running sequence, for workers "
              "that report no measured decode step time")
    flag(p, "--default-prefill-tokens-per-s", type=float,
         default=d.default_prefill_tokens_per_s,
         help="prefix policy: prefill rate assumed until a worker reports its measured one")
    flag(p, "--no-measured-rates", action="store_true", default=False,
         help="prefix policy: rank every worker at the default rate (identical workers "
              "whose measurement noise should not steer)")
    flag(p, "--no-transfer", action="store_true", default=False,
         help="prefix policy: never pull a prompt's cached blocks from another worker "
              "(only wait for the cached worker or recompute; docs/routing.md)")
    flag(p, "--prediction-ttl-s", type=float, default=d.prediction_ttl_s,
         help="prefix policy: a routed turn's blocks count as expected on its worker this "
              "long unless the worker's events confirm or drop them (0: no predictions)")
    flag(p, "--shared-prefix-weight", type=float, default=d.shared_prefix_weight,
         help="prefix policy: credit per cached token of a prefix many conversations share, "
              "on a worker whose cache is fuller than the rest (see --occupancy-slack)")
    flag(p, "--occupancy-slack", type=float, default=d.occupancy_slack,
         help="prefix policy: a worker holding more than (1 + this) x the mean indexed "
              "blocks gets only --shared-prefix-weight for shared prefixes")
    flag(p, "--spread-fanout", type=int, default=d.spread_fanout,
         help="prefix policy: continuations after which a prefix counts as shared")
    flag(p, "--index-max-blocks", type=int, default=0,
         help="cap on the gateway's routing index in blocks (0: bounded by the workers)")


def processes_flag(p: argparse.ArgumentParser) -> None:
    flag(p, "--processes", type=int, default=1,
         help="gateway processes sharing the port (SO_REUSEPORT), one core each; each "
              "follows the workers' events itself (docs/routing.md)")
    flag(p, "--status-interval-ms", type=int, default=50,
         help="worker load pushed to the gateway at most this often (WatchStatus)")


def record_trace_flag(p: argparse.ArgumentParser) -> None:
    flag(p, "--record-trace", default="",
         help="append one JSON line per finished turn to this file (block hashes, not text), "
              "replayable with prefixgate replay --trace")


def gateway_config(args: argparse.Namespace, workers: Sequence[str], port: int):
    """The GatewayConfig the parsed gateway flags stand for."""
    from prefixgate.gateway.routing import RoutingConfig
    from prefixgate.gateway.server import GatewayConfig

    return GatewayConfig(host=args.host, port=port, block_size=args.block_size,
                         routing=RoutingConfig(
                             policy=args.policy, prefix_weight=args.prefix_weight,
                             load_weight=args.load_weight, running_weight=args.running_weight,
                             work_weight=args.work_weight,
                             arrival_window_turns=args.arrival_window_turns,
                             shared_prefix_weight=args.shared_prefix_weight,
                             occupancy_slack=args.occupancy_slack,
                             spread_fanout=args.spread_fanout,
                             default_prefill_tokens_per_s=args.default_prefill_tokens_per_s,
                             measured_rates=not args.no_measured_rates,
                             transfer=not args.no_transfer,
                             prediction_ttl_s=args.prediction_ttl_s),
                         index_max_blocks=args.index_max_blocks,
                         static_workers=tuple(workers),
                         vllm_workers=tuple(getattr(args, "vllm_worker", None) or ()),
                         # `up` has no --drain-seconds: the config's default there.
                         drain_seconds=getattr(args, "drain_seconds", GatewayConfig.drain_seconds),
                         record_trace=args.record_trace,
                         status_interval_ms=args.status_interval_ms,
                         context_overflow=args.context_overflow,
                         http_port=args.http_port,
                         share_port=getattr(args, "processes", 1) > 1,
                         limits=request_limits(args),
                         **security.gateway_security(args))


def gateway_startup(args: argparse.Namespace, workers: Sequence[str], port: int):
    """The GatewayStartup (model, registry, metrics, logging and GatewayConfig) of one
    gateway process the parsed flags stand for."""
    from prefixgate.gateway.startup import GatewayStartup

    return GatewayStartup(model=args.model, config=gateway_config(args, workers, port),
                          cache_dir=cache_dir(args), redis_url=args.redis_url,
                          metrics_port=getattr(args, "metrics_port", 0),
                          log_level=args.log_level, log_format=args.log_format,
                          otel_traces=getattr(args, "otel_traces", "off"))


def run(args: argparse.Namespace) -> int:
    if args.processes < 1:
        raise SystemExit("prefixgate gateway: --processes must be at least 1")
    if not args.worker and not args.redis_url and not args.vllm_worker:
        raise SystemExit("prefixgate gateway: give workers with --worker HOST:PORT or "
                         "--vllm-worker URL,EVENTS, or a registry with --redis-url")
    if args.redis_url and args.vllm_worker:
        raise SystemExit("prefixgate gateway: --vllm-worker follows a vLLM server from this "
                         "gateway alone; with --redis-url run `prefixgate worker --engine vllm` "
                         "beside each vLLM server instead, so every gateway sees its blocks")
    if args.processes == 1:
        asyncio.run(_serve(gateway_startup(args, args.worker, args.port)))
        return 0
    from prefixgate.gateway import processes
    from prefixgate.gateway.startup import serve_process
    from prefixgate.wire.rpc import free_port

    args.port = args.port or free_port(args.host)  # one port for all of them
    if args.http_port == 0:
        args.http_port = free_port(args.host)
    startup = gateway_startup(args, args.worker, args.port)
    # The processes share their ports (SO_REUSEPORT), which would also share them with
    # an unrelated listener: refuse a busy port before the first process binds.
    processes.refuse_busy_ports(startup.config)
    children = processes.spawn(serve_process, startup, args.processes - 1)
    try:
        processes.wait_ready(children, timeout_s=300)
        asyncio.run(_serve(startup))
    finally:
        processes.stop(children, args.drain_seconds + 5)
    return 0


async def _serve(startup) -> None:
    from prefixgate.gateway.startup import run_gateway
    from prefixgate.launch.serving import stop_event

    await run_gateway(startup, stop_event())
