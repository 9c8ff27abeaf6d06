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

Contract: `spawn(target, args, n)` starts n processes (spawn start method: no state
inherited but the pickled args), each running `target(args_i, on_listening)` where
`args_i` is a copy of `args` with `metrics_port` offset by i + 1 (when set); the children
get SIGTERM when the parent dies (Linux). `wait_ready` returns once each has called
`on_listening`; the caller (process 0) then binds last, so a health check that passes on
the port means all N listen. `stop` drains them (SIGTERM) and kills stragglers.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import multiprocessing
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event

__all__ = ["Child", "die_with_parent", "spawn", "stop", "wait_ready"]


def die_with_parent() -> None:
    """Get SIGTERM when the parent process dies, even by SIGKILL (Linux; a no-op elsewhere)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _child(target: Callable[[argparse.Namespace, Callable[[], None]], object],
           args: argparse.Namespace, ready: Event) -> None:
    die_with_parent()
    target(args, ready.set)


@dataclass
class Child:
    process: BaseProcess
    ready: Event  # set by the child once it listens


def spawn(target: Callable[[argparse.Namespace, Callable[[], None]], object],
          args: argparse.Namespace, n: int) -> list[Child]:
    """Start `n` processes running `target(args_i, on_listening)` (a module-level function
    that calls `on_listening()` once its server is bound)."""
    ctx = multiprocessing.get_context("spawn")
    children = []
    for i in range(n):
        child = copy.copy(args)
        if getattr(child, "metrics_port", 0):
            child.metrics_port = args.metrics_port + i + 1
        ready = ctx.Event()
        p = ctx.Process(target=_child, args=(target, child, ready),
                        name=f"prefixgate-gateway-{i + 1}")
        p.start()
        children.append(Child(p, ready))
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
    procs = [c.process for c in children]
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join()
