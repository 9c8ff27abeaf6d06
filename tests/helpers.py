"""Helpers the tests share: an event loop in a thread, engines, workers and gateways on
loopback ports chosen at run time, the CLI as a subprocess.

Servers run on an asyncio loop in a background thread (`LoopThread`), so tests talk to
them over real gRPC with ordinary synchronous stubs, as a separate client would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from prefixgate.model.catalog import ModelSpec

REPO = Path(__file__).resolve().parent.parent


class LoopThread:
    """An asyncio event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Awaitable) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# Engines made during the current test: conftest checks their integrity after it.
ENGINES: list = []


def track(engine):
    """Have `engine`'s pool integrity (`PagedEngine.check_integrity`) checked when the
    current test ends; returns it."""
    ENGINES.append(engine)
    return engine


def make_engine(spec: ModelSpec, model, event_sink=None, **config):
    """A PagedEngine for `spec` (EngineConfig fields as keyword arguments) reporting its
    KV events to `event_sink`, checked for integrity when the test ends."""
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.worker.engine import PagedEngine
    from prefixgate.workerapi.api import EngineConfig

    tokenizer = ChatTokenizer(spec)
    config.setdefault("num_blocks", 512)
    return track(PagedEngine(model, tokenizer, EngineConfig(
        eos_token_ids=tokenizer.eos_token_ids, max_context_tokens=spec.max_context_tokens,
        model_fingerprint=spec.fingerprint, **config), event_sink=event_sink))


def start_worker(loop_thread: LoopThread, spec: ModelSpec, model, worker_id: str,
                 events=None, worker_config: dict | None = None,
                 **engine_config) -> tuple[str, asyncio.Event]:
    """Start a WorkerService on a free loopback port; returns (address, stop event). Its
    engine reports KV events to `events` (default: a new EventLog), as in `prefixgate
    worker`; gateways follow them by WatchEvents. `worker_config`: more WorkerConfig
    fields (tls, auth, ...)."""
    from prefixgate.workerapi.events import EventLog
    from prefixgate.workerapi.server import WorkerConfig, WorkerService, serve

    events = events if events is not None else EventLog()
    engine = make_engine(spec, model, event_sink=events, **engine_config)
    service = WorkerService(engine, spec, WorkerConfig(worker_id=worker_id, drain_seconds=1,
                                                         **(worker_config or {})),
                            vocab_size=engine.tokenizer.vocab_size, events=events)

    async def start() -> tuple[int, asyncio.Event]:
        stop = asyncio.Event()
        started = asyncio.get_running_loop().create_future()
        asyncio.create_task(serve(service, stop, started))
        return await started, stop

    port, stop = loop_thread.run(start())
    return f"127.0.0.1:{port}", stop


def start_gateway(loop_thread: LoopThread, spec: ModelSpec, workers: list[str],
                  registry=None, **config_kwargs) -> tuple[str, asyncio.Event]:
    """Start a gateway on a free loopback port; returns (address, stop event). It is
    ready when it has probed its workers once."""
    from prefixgate.gateway.server import GatewayConfig, serve
    from prefixgate.registry import EmbeddedRegistry

    config = GatewayConfig(static_workers=tuple(workers), drain_seconds=1, **config_kwargs)

    async def start() -> tuple[int, asyncio.Event]:
        stop = asyncio.Event()
        started = asyncio.get_running_loop().create_future()
        asyncio.create_task(serve(spec, registry or EmbeddedRegistry(), config, stop, started))
        return await started, stop

    port, stop = loop_thread.run(start())
    return f"127.0.0.1:{port}", stop


@contextlib.contextmanager
def two_worker_cluster(loop_thread: LoopThread, spec: ModelSpec, model) -> Iterator[dict]:
    """Workers w0 and w1 and a gateway in front of them, ready (the gateway sees both):
    yields {"gateway", "workers", "stub" (a ChatService stub), "channel"}; stops them all."""
    import grpc

    from prefixgate.v1 import chat_pb2, chat_pb2_grpc

    w0, stop0 = start_worker(loop_thread, spec, model, "w0")
    w1, stop1 = start_worker(loop_thread, spec, model, "w1")
    gw, gstop = start_gateway(loop_thread, spec, [w0, w1])
    channel = grpc.insecure_channel(gw)
    stub = chat_pb2_grpc.ChatServiceStub(channel)
    try:
        wait_for(lambda: stub.ListModels(chat_pb2.ListModelsRequest()).models[0].num_workers
                 == 2, what="gateway to see both workers")
        yield {"gateway": gw, "workers": [w0, w1], "stub": stub, "channel": channel}
    finally:
        channel.close()
        for stop in (gstop, stop0, stop1):
            loop_thread.loop.call_soon_threadsafe(stop.set)


def wait_for(predicate: Callable[[], bool], timeout: float = 20, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie not reaped yet counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGATE_")}
    env.update(extra)
    return env


def run_side_by_side(argvs: list[list[str]], timeout_s: float = 120,
                     **popen: Any) -> list[subprocess.CompletedProcess]:
    """Run the commands at once and wait for all of them (for commands that mostly wait,
    e.g. a client's wait for a gateway that never answers, so that the waits overlap):
    each one's result (stdout and stderr as text), in order. Any still running after
    `timeout_s` is killed, the test failing with subprocess.TimeoutExpired."""
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              **popen) for argv in argvs]
    try:
        deadline = time.monotonic() + timeout_s
        results = []
        for p in procs:
            out, err = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def start_up(args: list[str], env: dict[str, str], timeout_s: float = 120) -> subprocess.Popen:
    """Start `prefixgate up ARGS` and return once it printed that it is up (its stdout
    and stderr are merged into the returned process's stdout)."""
    up = subprocess.Popen([sys.executable, "-m", "prefixgate", "up", *args], env=env, cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline:
        lines.append(up.stdout.readline())
        if "prefixgate is up" in lines[-1] or up.poll() is not None:
            break
    if "prefixgate is up" not in lines[-1]:
        up.kill()
        raise AssertionError("prefixgate up did not come up:\n" + "".join(lines))
    up.startup_lines = lines  # type: ignore[attr-defined]
    return up


def start_emulated_worker(loop_thread: LoopThread, spec: ModelSpec, worker_id: str,
                          events=None, **emulation) -> tuple[str, asyncio.Event, Any]:
    """Start an emulated worker (prefixgate.emulate: no model) behind the real
    WorkerService on a free loopback port; returns (address, stop event, its engine).
    `emulation`: EmulationConfig fields (block size 16 and 512 blocks unless given)."""
    from prefixgate.emulate.engine import EmulatedEngine, EmulationConfig
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.workerapi.events import EventLog
    from prefixgate.workerapi.server import WorkerConfig, WorkerService, serve

    events = events if events is not None else EventLog()
    vocab_size = ChatTokenizer(spec).vocab_size
    emulation.setdefault("block_size", 16)
    emulation.setdefault("capacity_blocks", 512)
    engine = EmulatedEngine(EmulationConfig(
        model_fingerprint=spec.fingerprint, vocab_size=vocab_size,
        max_context_tokens=spec.max_context_tokens, **emulation), events)
    service = WorkerService(engine, spec, WorkerConfig(
        worker_id=worker_id, drain_seconds=1, block_size=emulation["block_size"]),
        vocab_size=vocab_size, events=events)

    async def start() -> tuple[int, asyncio.Event]:
        from prefixgate.emulate.worker import attach_transfer

        attach_transfer(engine, service, asyncio.get_running_loop())
        stop = asyncio.Event()
        started = asyncio.get_running_loop().create_future()
        asyncio.create_task(serve(service, stop, started))
        return await started, stop

    port, stop = loop_thread.run(start())
    return f"127.0.0.1:{port}", stop, engine


def shifting_engine(spec: ModelSpec, model, system_tokens: int, turns: int):
    """An engine that keeps the system prompt, drops the oldest turns and moves cached
    K/V (shifted_reuse "shift"), and a prompt for it: `system_tokens` system tokens, then
    `turns` distinct 3-token user turns. Returns (engine, user turn prefix, prompt)."""
    from prefixgate.model.overflow import user_turn_prefix
    from prefixgate.model.tokenizer import ChatTokenizer

    prefix = user_turn_prefix(ChatTokenizer(spec))
    engine = make_engine(spec, model, num_blocks=512, turn_prefix=prefix,
                         context_overflow="keep-system-drop-oldest", shifted_reuse="shift")
    prompt = [90] * system_tokens
    for i in range(turns):
        prompt += [*prefix, 100 + i % 50, 150 + i // 50 % 50, 200]
    return engine, prefix, prompt


def one_token_turn(stub, token_ids: list[int], timeout: float = 30):
    """One ChatService turn of raw token ids asking for a single reply token; its final
    event (worker, usage, predicted tokens, timings)."""
    from prefixgate.v1 import chat_pb2, common_pb2

    req = chat_pb2.ChatRequest(sampling=common_pb2.SamplingParams(max_tokens=1))
    req.prompt_token_ids.token_ids.extend(token_ids)
    return list(stub.Chat(req, timeout=timeout))[-1].final


def wait_for_workers(stub, num_workers: int) -> None:
    """Wait until the gateway behind ChatService `stub` lists `num_workers` workers."""
    from prefixgate.v1 import chat_pb2

    wait_for(lambda: stub.ListModels(chat_pb2.ListModelsRequest()).models[0].num_workers
             == num_workers, what=f"the gateway to list {num_workers} workers")
