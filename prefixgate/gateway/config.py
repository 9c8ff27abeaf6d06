"""The gateway's configuration: one frozen dataclass the command line builds
(cli/gateway.py) and `serve` (gateway/server.py) takes; the turn core, both fronts and the
process start-up read it, none of them parses flags or environment variables.

Units are in the names (`_s`, `_ms`, `_bytes`, `_blocks`); ports: 0 any free port, -1 off
where a front is optional.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixgate.gateway.routing import RoutingConfig
from prefixgate.security import auth
from prefixgate.wire.protocol import RequestLimits
from prefixgate.wire.rpc import TLSConfig

__all__ = ["GatewayConfig"]


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 0
    block_size: int = 16
    routing: RoutingConfig = RoutingConfig()
    # Workers given by address (embedded registry); with Redis, workers register themselves.
    static_workers: tuple[str, ...] = ()
    # vLLM servers served as workers from this process (engines/vllm.py), each
    # "URL,EVENTS[,REPLAY]": its HTTP API and KV event endpoints.
    vllm_workers: tuple[str, ...] = ()
    refresh_interval_s: float = 2.0  # registry, worker probes, index feeds
    # Worker load is pushed at most this often (WatchStatus; polled where unsupported).
    status_interval_ms: int = 50
    # Recent prompts kept so that a turn hashes only its new blocks (radix.HashMemo).
    hash_memo_bytes: int = 64 << 20
    drain_seconds: float = 30.0
    record_trace: str = ""  # append one line per finished turn here (prefixgate.telemetry.trace_recorder)
    index_max_blocks: int = 0  # hard cap on the routing index (0: bounded by the workers)
    # Overflow policy for requests that do not choose one: "fail" or
    # "keep-system-drop-oldest". It is made explicit on the way to the worker, so every
    # worker answers a turn alike whatever its own default.
    context_overflow: str = "fail"
    tls: TLSConfig = TLSConfig()  # the Chat API's certificate (+ client CA: mTLS)
    health_port: int = 0  # plaintext grpc.health.v1 only, for probes without TLS (0: off)
    worker_tls: TLSConfig = TLSConfig()  # to workers: their CA, our client cert
    auth: auth.AuthConfig = auth.AuthConfig()  # tokens (public), internal credential
    limits: RequestLimits = RequestLimits()  # what one request may carry
    # The OpenAI-compatible HTTP front (gateway/http.py) on this port: -1 off, 0 any free.
    http_port: int = -1
    # Several gateway processes serve these ports (SO_REUSEPORT; gateway/processes.py).
    # Off, binding a port something already listens on fails with a clear message instead
    # of silently sharing it with that listener.
    share_port: bool = False
