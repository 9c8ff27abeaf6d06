"""A fleet of real processes for the fault suite: redis-server, `prefixgate worker`s and a
`prefixgate gateway` (tiny-random), started through the CLI as an operator would, and a
client that counts what callers see.

Every figure a fault test measures goes through `report(name, **figures)`: printed, and
appended as one JSON line to $PREFIXGATE_FAULTS_REPORT when that is set (docs/reliability.md
is written from that file).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from prefixgate.launch.processes import ProcessGroup
from prefixgate.launch.redis_server import RedisServer
from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2
from prefixgate.wire.rpc import free_port
from tests.helpers import REPO, cli_env, wait_for


def report(name: str, **figures) -> None:
    line = json.dumps({"fault": name, **figures}, sort_keys=True)
    print(line, file=sys.stderr)
    path = os.environ.get("PREFIXGATE_FAULTS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Outcome:
    code: str  # "OK" or a grpc.StatusCode name; "HANG" when the client's deadline passed
    num_tokens: int
    seconds: float
    details: str = ""
    worker_id: str = ""
    cached_tokens: int = 0


def turn(stub: chat_pb2_grpc.ChatServiceStub, request: chat_pb2.ChatRequest,
         deadline_s: float = 60.0, on_token=None) -> Outcome:
    """One Chat call, as a client sees it."""
    t0 = time.monotonic()
    tokens, worker, cached = 0, "", 0
    try:
        for ev in stub.Chat(request, timeout=deadline_s):
            if ev.HasField("delta"):
                tokens += len(ev.delta.token_ids)
                if on_token is not None:
                    on_token()
            else:
                worker, cached = ev.final.worker_id, ev.final.usage.cached_tokens
        return Outcome("OK", tokens, time.monotonic() - t0, worker_id=worker, cached_tokens=cached)
    except grpc.RpcError as exc:
        code = exc.code().name
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and \
                time.monotonic() - t0 >= deadline_s * 0.99:
            code = "HANG"
        return Outcome(code, tokens, time.monotonic() - t0, exc.details() or "")


def chat_request(conversation: str, prompt: list[int], max_tokens: int = 32,
                 **sampling) -> chat_pb2.ChatRequest:
    req = chat_pb2.ChatRequest(conversation_id=conversation, sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, **sampling))
    req.prompt_token_ids.token_ids.extend(prompt)
    return req


def prompt_for(i: int, length: int = 40) -> list[int]:
    return [3 + (i * 7 + j) % 250 for j in range(length)]


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    return dict(Counter(o.code for o in outcomes))


def concurrently(fn, args: list, timeout_s: float = 120) -> list:
    """fn(*a) for every a in `args`, each on its own thread; results in order."""
    results: list = [None] * len(args)

    def run(i: int) -> None:
        results[i] = fn(*args[i])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return results


@dataclass
class Fleet:
    """redis-server + workers + one gateway, as processes on loopback ports (started
    through prefixgate.launch, as `prefixgate up` and the emulated fleet start theirs)."""

    workdir: Path
    redis: RedisServer | None = None
    worker_ports: dict[str, int] = field(default_factory=dict)
    gateway_port: int = 0
    http_port: int = 0  # the gateway's OpenAI-compatible HTTP front, when started with one
    lease_ms: int = 1500
    extra_worker_args: tuple[str, ...] = ()
    log_level: str = "WARNING"
    procs: ProcessGroup = field(init=False)

    def __post_init__(self) -> None:
        self.procs = ProcessGroup(self.workdir, scrub_env=True, cwd=REPO)

    @property
    def workers(self) -> dict[str, subprocess.Popen]:
        return {n: p for n, p in self.procs.procs.items() if n != "gateway"}

    @property
    def gateway(self) -> subprocess.Popen | None:
        return self.procs.procs.get("gateway")

    @property
    def env(self) -> dict[str, str]:
        return cli_env(PREFIXGATE_CACHE_DIR=str(self.workdir / "cache"),
                       PREFIXGATE_MODEL="tiny-random", PREFIXGATE_LOG_LEVEL=self.log_level,
                       PREFIXGATE_REDIS_URL=self.redis.url if self.redis else "")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway_port}"

    def start_redis(self) -> None:
        if self.redis is None:
            self.redis = RedisServer(self.workdir / "redis")
            (self.workdir / "redis").mkdir(parents=True, exist_ok=True)
        self.redis.start()

    def kill_redis(self) -> None:
        assert self.redis is not None and self.redis.proc is not None
        self.redis.proc.kill()
        self.redis.proc.wait(10)
        self.redis.proc = None

    def start_worker(self, worker_id: str, *extra: str, wait: bool = True) -> None:
        """Start worker `worker_id` (same port as its last run); `wait`: return once it
        serves."""
        port = self.worker_ports.setdefault(worker_id, free_port())
        self.procs.start_prefixgate(
            worker_id, "worker", "--port", str(port), "--worker-id", worker_id,
            "--lease-ms", str(self.lease_ms), "--num-blocks", "512", "--torch-threads", "1",
            "--drain-seconds", "5", *self.extra_worker_args, *extra, env=self.env)
        # Serving before this returns: the gateway may still list the process this one
        # replaces (its probe has not failed yet), so waiting on the gateway's count alone
        # could return while no worker process serves.
        if wait:
            asyncio.run(self.procs.wait_serving(f"127.0.0.1:{port}", timeout_s=180))

    def signal_worker(self, worker_id: str, sig: int = signal.SIGKILL, wait_s: float = 30) -> None:
        self.procs.signal(worker_id, sig, wait_s)

    def start_gateway(self, *extra: str) -> None:
        self.gateway_port = self.gateway_port or free_port()
        self.procs.start_prefixgate("gateway", "gateway", "--port", str(self.gateway_port),
                                    *extra, env=self.env)

    def num_workers(self) -> int:
        try:
            with grpc.insecure_channel(self.address) as ch:
                return chat_pb2_grpc.ChatServiceStub(ch).ListModels(
                    chat_pb2.ListModelsRequest(), timeout=2).models[0].num_workers
        except grpc.RpcError:
            return -1

    def wait_workers(self, n: int, timeout_s: float = 120) -> None:
        wait_for(lambda: self.num_workers() == n, timeout=timeout_s,
                 what=f"the gateway to list {n} workers")

    def alive(self) -> bool:
        procs = [*self.workers.values(), self.gateway]
        return all(p is not None and p.poll() is None for p in procs)

    def stop(self) -> None:
        for name in list(self.procs.procs):
            self.procs.signal(name, signal.SIGKILL, 10)
        if self.redis is not None:
            self.redis.stop()

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else ""
