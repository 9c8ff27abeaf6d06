"""Several gateway processes on one host, sharing one port (SO_REUSEPORT).

A gateway is one asyncio event loop: one core. To use more, run N gateway processes that
all listen on the same port; every gateway server sets SO_REUSEPORT, so the kernel
spreads incoming *connections* over the N listening sockets (by a hash of the
connection's addresses). A gRPC channel is one connection, so one client channel is
always served by one process; many clients (or a client with several channels) spread.

What the processes share: the port, the workers, and (with Redis) the registry and its
event stream. What they do not: the routing index, the in-flight counts and the metrics.
Each process follows the same feeds as a replica on another host does (each worker's
WatchEvents, or the Redis event stream) and its own status streams, so their indexes agree
as replicas' do; each counts only its own turns in flight (the pushed worker status counts
everyone's). With `--metrics-port P` process i serves its metrics on P + i.

Contract: `spawn(target, startup, n)` starts n processes (spawn start method: no state
inherited but the pickled `startup`, a frozen dataclass such as gateway/startup.py's
GatewayStartup), each running `target(startup_i, on_listening)` where `startup_i` is
`startup` with `metrics_port` offset by i + 1 (when set); the children
get SIGTERM when the parent dies (Linux), and the parent logs an error when a child exits
before `stop` is called (the port then has one listener fewer). `wait_ready` returns once
each has called `on_listening`; `prefixgate gateway` then binds process 0 last, so a
health check that passes on the port means all N listen (`prefixgate up` binds it first
and spawns the others onto its port). `stop` drains them (SIGTERM) and kills
stragglers.

SO_REUSEPORT also means that a gateway started on a port another gateway (or any server
that set it: gRPC does by default) already listens on would silently join it and take a
share of its connections. `refuse_busy_port(host, port)` probes the port with a plain
bind first and raises `rpc.BindError` when anything listens there; a launcher calls
`refuse_busy_ports(config)` (each of the GatewayConfig's `SHARED_PORTS`) before the first
process binds, with one process or N.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_any
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from typing import Any

from prefixgate.launch.processes import die_with_parent
from prefixgate.wire.rpc import BindError

log = logging.getLogger(__name__)

SHARED_PORTS = ("port", "http_port", "health_port")  # GatewayConfig's, on every process

__all__ = ["Child", "SHARED_PORTS", "refuse_busy_port", "refuse_busy_ports", "spawn", "stop",
           "wait_ready"]


def refuse_busy_port(host: str, port: int) -> None:
    """Raise `BindError` when something listens on `host:port` (port 0: nothing to check).

    The probe binds without SO_REUSEPORT (and with SO_REUSEADDR, as gRPC does, so that
    connections of a previous run in TIME_WAIT do not count), which the kernel refuses
    while any socket listens there, SO_REUSEPORT or not."""
    if not port:
        return
    try:
        addresses = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(f"gateway: cannot listen on {host}:{port}: {exc}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise BindError(
                    f"gateway: cannot listen on {host}:{port}: {exc.strerror}; another server "
                    "(perhaps another gateway) listens there and this one would share its "
                    "connections: choose another port, or stop that server") from None


def refuse_busy_ports(config: Any) -> None:
    """`refuse_busy_port` for each of `SHARED_PORTS` that `config` (a GatewayConfig) sets
    (> 0)."""
    for name in SHARED_PORTS:
        refuse_busy_port(config.host, max(0, getattr(config, name, 0) or 0))


def _child(target: Callable[[Any, Callable[[], None]], object], startup: Any, ready: Event,
           parent_pid: int) -> None:
    die_with_parent(parent_pid)
    target(startup, ready.set)


@dataclass
class Child:
    process: BaseProcess
    ready: Event  # set by the child once it listens
    stopping: threading.Event = field(default_factory=threading.Event)  # set by `stop`


def _watch(children: list[Child]) -> None:
    """Log an error for each child that exits after listening and before `stop` asked it
    to (one that exits before listening is `wait_ready`'s to report)."""
    running = {c.process.sentinel: c for c in children}
    while running:
        for sentinel in wait_any(list(running)):
            c = running.pop(sentinel)
            if c.ready.is_set() and not c.stopping.is_set():
                c.process.join()  # reap it (it has exited: its sentinel is ready)
                log.error("gateway process %s exited with code %s; %d of %d processes still "
                          "listen on the port (its log is above)", c.process.name,
                          c.process.exitcode, len(running) + 1, len(children) + 1)


def spawn(target: Callable[[Any, Callable[[], None]], object], startup: Any,
          n: int) -> list[Child]:
    """Start `n` processes running `target(startup_i, on_listening)` (a module-level
    function that calls `on_listening()` once its server is bound; `startup` a frozen
    dataclass with a `metrics_port`). It checks no port: the caller may already listen
    there (`prefixgate up` binds process 0 first); a launcher calls `refuse_busy_ports`
    before anything binds."""
    ctx = multiprocessing.get_context("spawn")
    children = []
    for i in range(n):
        child = startup
        if startup.metrics_port:
            child = dataclasses.replace(startup, metrics_port=startup.metrics_port + i + 1)
        ready = ctx.Event()
        p = ctx.Process(target=_child, args=(target, child, ready, os.getpid()),
                        name=f"prefixgate-gateway-{i + 1}")
        p.start()
        children.append(Child(p, ready))
    threading.Thread(target=_watch, args=(children,), name="prefixgate-gateway-watch",
                     daemon=True).start()
    return children


def wait_ready(children: list[Child], timeout_s: float) -> None:
    """Return once every child listens; SystemExit if one exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    for c in children:
        while not c.ready.wait(0.1):
            if not c.process.is_alive():
                raise SystemExit(f"prefixgate gateway: process {c.process.name} exited with "
                                 f"code {c.process.exitcode} before listening (its log is above)")
            if time.monotonic() > deadline:
                raise SystemExit(f"prefixgate gateway: process {c.process.name} did not listen "
                                 f"within {timeout_s:.0f} s")


def stop(children: list[Child], timeout_s: float) -> None:
    """SIGTERM (a graceful drain), wait up to `timeout_s`, then kill what is left."""
    for c in children:
        c.stopping.set()
    procs = [c.process for c in children]
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join()
