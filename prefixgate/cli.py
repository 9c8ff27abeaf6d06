"""The `prefixgate` command: worker, gateway, up, chat, bench.

Every flag has an environment-variable equivalent, named in its --help line
(PREFIXGATE_<FLAG>); a flag given on the command line wins over the variable. The
gateway-side commands (gateway, chat) never import torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

DEMO_SCRIPT = (
    "What is the capital of France?",
    "What is a famous museum there?",
    "Thanks! Summarise our conversation in one sentence.",
)

log = logging.getLogger("prefixgate")


# --- flags with environment-variable equivalents ----------------------------------------


def flag(parser: argparse.ArgumentParser, name: str, *, help: str, type: Callable = str,
         default: Any = None, action: str | None = None, choices: Sequence[str] | None = None,
         ) -> None:
    """Add `--name`, defaulting to $PREFIXGATE_NAME when set."""
    env = "PREFIXGATE_" + name.lstrip("-").replace("-", "_").upper()
    raw = os.environ.get(env)
    if action == "store_true":
        value = raw.lower() in ("1", "true", "yes", "on") if raw is not None else bool(default)
        parser.add_argument(name, action="store_true", default=value, help=f"{help} [env {env}]")
        return
    if action == "append":
        value = [v for v in raw.split(",") if v] if raw else list(default or [])
        parser.add_argument(name, action="append", type=type, default=None,
                            help=f"{help} (repeatable) [env {env}, comma-separated]")
        parser.set_defaults(**{_dest(name) + "_env_default": value})
        return
    value = type(raw) if raw is not None else default
    shown = f" (default: {default})" if default not in (None, "") else ""
    parser.add_argument(name, type=type, default=value, choices=choices,
                        help=f"{help}{shown} [env {env}]")


def _dest(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


def _appended(args: argparse.Namespace, name: str) -> list:
    given = getattr(args, _dest(name))
    return given if given is not None else getattr(args, _dest(name) + "_env_default")


def _common(p: argparse.ArgumentParser) -> None:
    flag(p, "--log-level", help="logging level", default="INFO",
         choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def _model_flags(p: argparse.ArgumentParser) -> None:
    flag(p, "--model", default="smollm2-135m",
         help="smollm2-135m, tiny-random, or a local Hugging Face checkpoint directory")
    flag(p, "--cache-dir", default=None,
         help="where materialised models are kept (default: ~/.cache/prefixgate)")
    flag(p, "--block-size", type=int, default=16, help="prefix-cache block size in tokens")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixgate",
        description="Conversational prefix-cache gateway for LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    w = sub.add_parser("worker", help="run one model worker (WorkerService over gRPC)",
                       description="Run one model worker serving prefixgate.v1.WorkerService.")
    _common(w)
    _model_flags(w)
    flag(w, "--host", default="127.0.0.1", help="address to listen on")
    flag(w, "--port", type=int, default=50061, help="port to listen on (0: any free port)")
    flag(w, "--worker-id", default="", help="stable worker id (default: worker-<port>)")
    flag(w, "--advertise-address", default="",
         help="host:port gateways use to reach this worker (default: host:port)")
    flag(w, "--redis-url", default="", help="register in this Redis (redis://host:port/db)")
    flag(w, "--lease-ms", type=int, default=10000, help="registry lease, renewed every third of it")
    flag(w, "--kv-cache-memory", type=int, default=1 << 30,
         help="bytes of KV pool (ignored when --num-blocks is given)")
    flag(w, "--num-blocks", type=int, default=0, help="KV pool size in blocks (0: from --kv-cache-memory)")
    flag(w, "--max-num-seqs", type=int, default=32, help="most requests in the running batch")
    flag(w, "--max-num-batched-tokens", type=int, default=512,
         help="tokens per step (decodes plus prefill chunks)")
    flag(w, "--disable-prefix-cache", action="store_true",
         help="compute every prompt in full (for comparisons)")
    flag(w, "--context-overflow", default="fail", choices=("fail", "keep-system-drop-oldest"),
         help="prompt + max_tokens over the context: fail, or keep the system prompt and drop "
              "the oldest turns (requests may choose per request)")
    flag(w, "--shifted-reuse", default="blend", choices=("recompute", "shift", "blend"),
         help="how an overflowing turn reuses its kept turns' cached KV (docs/reindex.md)")
    flag(w, "--blend-tokens", type=int, default=64,
         help="tokens after the dropped gap recomputed under --shifted-reuse blend")
    flag(w, "--reindex-backend", default="auto", choices=("auto", "torch", "triton"),
         help="KV re-rotation: triton kernel (auto: on CUDA when installed) or torch")
    flag(w, "--device", default="auto",
         help="torch device for the model and KV pool: cpu, cuda, cuda:N (auto: cuda if available)")
    flag(w, "--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
         help="model and KV dtype (auto: float32 on CPU, bfloat16 on GPU)")
    flag(w, "--torch-threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    flag(w, "--drain-seconds", type=float, default=30.0,
         help="on SIGTERM, how long in-flight requests may finish")
    flag(w, "--metrics-port", type=int, default=0,
         help="serve Prometheus metrics on this port at /metrics (0: off)")

    g = sub.add_parser("gateway", help="run the Chat gateway",
                       description="Run the gateway serving prefixgate.v1.ChatService.")
    _common(g)
    _model_flags(g)
    flag(g, "--host", default="127.0.0.1", help="address to listen on")
    flag(g, "--port", type=int, default=50051, help="port to listen on (0: any free port)")
    flag(g, "--worker", action="append",
         help="worker address host:port (embedded registry); not needed with --redis-url")
    flag(g, "--redis-url", default="", help="discover workers through this Redis")
    _policy_flag(g)
    _record_trace_flag(g)
    flag(g, "--drain-seconds", type=float, default=30.0,
         help="on SIGTERM, how long in-flight streams may finish")
    _overflow_flag(g)
    flag(g, "--metrics-port", type=int, default=0,
         help="serve Prometheus metrics on this port at /metrics (0: off)")

    u = sub.add_parser("up", help="run N workers and a gateway on this machine",
                       description="Start N workers and a gateway on this machine; Ctrl-C "
                                   "stops every process it started.")
    _common(u)
    _model_flags(u)
    flag(u, "--workers", type=int, default=2, help="number of workers")
    flag(u, "--host", default="127.0.0.1", help="gateway address to listen on")
    flag(u, "--port", type=int, default=50051, help="gateway port (0: any free port)")
    flag(u, "--redis-url", default="",
         help="use this Redis as the registry (default: embedded, no Redis)")
    _policy_flag(u)
    _overflow_flag(u)
    _record_trace_flag(u)
    flag(u, "--torch-threads", type=int, default=0,
         help="torch threads per worker (0: CPU count / workers)")
    flag(u, "--demo", action="store_true",
         help="hold the scripted demo chat through the gateway, print it, then stop")
    flag(u, "--startup-timeout", type=float, default=900.0,
         help="seconds to wait for workers to load the model")

    c = sub.add_parser("chat", help="interactive multi-turn chat client",
                       description="Chat with a prefixgate gateway. Type a message and press "
                                   "Enter; /reset starts a new conversation, /quit ends.")
    _common(c)
    flag(c, "--address", default="127.0.0.1:50051", help="gateway host:port")
    flag(c, "--message", action="append",
         help="send these messages as successive turns instead of reading stdin")
    flag(c, "--system", default="", help="system prompt")
    flag(c, "--conversation-id", default="", help="conversation id (default: a new one)")
    flag(c, "--namespace", default="", help="cache namespace (tenant)")
    flag(c, "--max-tokens", type=int, default=None, help="max tokens per reply (default: 256)")
    flag(c, "--temperature", type=float, default=0.0, help="0 is greedy")
    flag(c, "--top-p", type=float, default=0.0, help="nucleus sampling mass (0: off)")
    flag(c, "--top-k", type=int, default=0, help="top-k sampling (0: off)")
    flag(c, "--seed", type=int, default=None, help="sampling seed")
    flag(c, "--context-overflow", default="", choices=("", "fail", "keep-system-drop-oldest"),
         help="when the conversation outgrows the context: fail, or drop its oldest turns "
              "(empty: the worker's default)")
    flag(c, "--shifted-reuse", default="", choices=("", "recompute", "shift", "blend"),
         help="how a turn that dropped turns reuses the cache (empty: the worker's default)")
    flag(c, "--timeout", type=float, default=300.0, help="deadline per turn in seconds")

    b = sub.add_parser("bench", help="benchmarks (prints JSON with --json)",
                       description="Run a benchmark; with --json, one JSON document on stdout.")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="NAME")
    from prefixgate.bench import BENCHMARKS, load

    for name in BENCHMARKS:
        # Benchmark modules import only the standard library at top level (heavy imports
        # live in run()), so building this parser stays cheap and torch-free.
        module = load(name)
        bp = bsub.add_parser(name, help=(module.__doc__ or name).strip().splitlines()[0],
                             description=module.__doc__)
        _common(bp)
        bp.add_argument("--json", action="store_true", help="print one JSON document on stdout")
        module.add_arguments(bp)
        bp.set_defaults(_bench_run=module.run)

    # --- replay (prefixgate/replay/cli.py holds its flags and body) ---
    from prefixgate.replay import cli as replay_cli

    r = sub.add_parser("replay", help="replay a recorded trace against a gateway or an "
                                      "OpenAI-compatible server, or simulate routing",
                       description=replay_cli.DESCRIPTION)
    _common(r)
    replay_cli.add_arguments(r, flag)
    return parser


def _overflow_flag(p: argparse.ArgumentParser) -> None:
    flag(p, "--context-overflow", default="fail", choices=("fail", "keep-system-drop-oldest"),
         help="requests that do not choose: over the context, fail or keep the system prompt "
              "and drop the oldest turns (docs/reindex.md)")


def _policy_flag(p: argparse.ArgumentParser) -> None:
    from prefixgate.gateway.routing import POLICIES, RoutingConfig

    d = RoutingConfig()  # the flags' defaults are the config's

    flag(p, "--policy", default=d.policy, choices=POLICIES,
         help="routing policy (see docs/routing.md)")
    flag(p, "--prefix-weight", type=float, default=d.prefix_weight,
         help="prefix policy: score per cached prompt token")
    flag(p, "--load-weight", type=float, default=d.load_weight,
         help="prefix policy: score subtracted per queued prefill token")
    flag(p, "--running-weight", type=float, default=d.running_weight,
         help="prefix policy: queued-token equivalents per running sequence")
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


def _record_trace_flag(p: argparse.ArgumentParser) -> None:
    flag(p, "--record-trace", default="",
         help="append one JSON line per finished turn to this file (block hashes, not text), "
              "replayable with prefixgate replay --trace")


# --- worker ------------------------------------------------------------------------------


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _run_worker(args: argparse.Namespace) -> None:
    import torch

    from prefixgate.models import resolve_model
    from prefixgate.overflow import user_turn_prefix
    from prefixgate.registry import RedisRegistry, WorkerRecord
    from prefixgate.tokenizer import ChatTokenizer
    from prefixgate.worker.engine import EngineConfig, PagedEngine
    from prefixgate.worker.events import EventLog, RedisPublisher
    from prefixgate.worker.kv_pool import num_blocks_for_memory
    from prefixgate.worker.metrics import WorkerMetrics
    from prefixgate.worker.model_loader import load_model
    from prefixgate.worker.model_runner import pool_config_for
    from prefixgate.worker.server import WorkerConfig, WorkerService, serve

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    _start_metrics(args.metrics_port)
    stop = _stop_event()
    spec = resolve_model(args.model, _cache_dir(args))
    tokenizer = ChatTokenizer(spec)
    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (
        torch.float32 if device == "cpu" else torch.bfloat16)
    model = await asyncio.to_thread(load_model, spec, dtype, device)
    bytes_per_token = pool_config_for(model, args.block_size, 1).bytes_per_token
    num_blocks = args.num_blocks or num_blocks_for_memory(
        args.kv_cache_memory, bytes_per_token, args.block_size)
    log.info("KV pool: %d bytes per token, %d blocks of %d tokens = %d tokens (%.1f MiB)",
             bytes_per_token, num_blocks, args.block_size, num_blocks * args.block_size,
             num_blocks * args.block_size * bytes_per_token / 2**20)
    events = EventLog()  # the engine's KV event sink; WatchEvents and Redis read it
    engine = PagedEngine(model, tokenizer, EngineConfig(
        num_blocks=num_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_cache=not args.disable_prefix_cache,
        eos_token_ids=tokenizer.eos_token_ids, max_context_tokens=spec.max_context_tokens,
        model_fingerprint=spec.fingerprint, context_overflow=args.context_overflow,
        turn_prefix=user_turn_prefix(tokenizer), shifted_reuse=args.shifted_reuse,
        blend_tokens=args.blend_tokens, reindex_backend=args.reindex_backend),
        metrics=WorkerMetrics(), event_sink=events)
    worker_id = args.worker_id or f"worker-{args.port}"
    config = WorkerConfig(worker_id=worker_id, host=args.host, port=args.port,
                          block_size=args.block_size, drain_seconds=args.drain_seconds)
    service = WorkerService(engine, spec, config, vocab_size=tokenizer.vocab_size,
                            events=events)
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(service, stop, started))
    port = await started
    if not args.redis_url:
        await server
        return
    # Registration, lease renewal and KV event publishing (worker/events.py).
    registry = RedisRegistry(args.redis_url)
    address = args.advertise_address or f"{args.host}:{port}"
    publisher = RedisPublisher(events, registry, WorkerRecord(
        worker_id, address, spec.fingerprint, capacity_blocks=num_blocks), args.lease_ms)
    await publisher.run(stop)
    await server
    await registry.close()


def _start_metrics(port: int) -> None:
    if port:
        from prometheus_client import start_http_server

        start_http_server(port)
        log.info("Prometheus metrics on :%d/metrics", port)


def _cache_dir(args: argparse.Namespace):
    from pathlib import Path

    return Path(args.cache_dir) if args.cache_dir else None


# --- gateway -----------------------------------------------------------------------------


def _gateway_config(args: argparse.Namespace, workers: Sequence[str], port: int):
    from prefixgate.gateway.routing import RoutingConfig
    from prefixgate.gateway.server import GatewayConfig

    return GatewayConfig(host=args.host, port=port, block_size=args.block_size,
                         routing=RoutingConfig(
                             policy=args.policy, prefix_weight=args.prefix_weight,
                             load_weight=args.load_weight, running_weight=args.running_weight,
                             shared_prefix_weight=args.shared_prefix_weight,
                             occupancy_slack=args.occupancy_slack,
                             spread_fanout=args.spread_fanout),
                         index_max_blocks=args.index_max_blocks,
                         static_workers=tuple(workers),
                         drain_seconds=getattr(args, "drain_seconds", 30.0),
                         record_trace=args.record_trace,
                         context_overflow=args.context_overflow)


async def _run_gateway(args: argparse.Namespace) -> None:
    from prefixgate.gateway.server import serve
    from prefixgate.models import resolve_model
    from prefixgate.registry import make_registry

    _start_metrics(args.metrics_port)
    workers = [a for item in _appended(args, "--worker") for a in item.split(",") if a]
    if not workers and not args.redis_url:
        raise SystemExit("prefixgate gateway: give workers with --worker HOST:PORT "
                         "or a registry with --redis-url")
    spec = resolve_model(args.model, _cache_dir(args))
    await serve(spec, make_registry(args.redis_url or None),
                _gateway_config(args, workers, args.port), _stop_event())


# --- up ----------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """Child processes get SIGTERM when `prefixgate up` dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def _wait_healthy(address: str, deadline: float, procs: list[subprocess.Popen]) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # Short reconnect backoff: the worker is expected to start listening any moment.
    options = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 500)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                raise SystemExit(f"prefixgate up: a worker exited with code {dead[0].returncode} "
                                 "during start-up (its log is above)")
            with contextlib.suppress(grpc.aio.AioRpcError):
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            await asyncio.sleep(0.5)
    raise SystemExit(f"prefixgate up: {address} did not become healthy in time")


async def _run_up(args: argparse.Namespace) -> int:
    from prefixgate.rpc import free_port

    n = args.workers
    if n < 1:
        raise SystemExit("prefixgate up: --workers must be at least 1")
    threads = args.torch_threads or max(1, (os.cpu_count() or 1) // n)
    procs: list[subprocess.Popen] = []
    addresses = []
    stop = _stop_event()
    try:
        for i in range(n):
            port = free_port()
            addresses.append(f"127.0.0.1:{port}")
            cmd = [sys.executable, "-m", "prefixgate", "worker", "--model", args.model,
                   "--port", str(port), "--worker-id", f"worker-{i}",
                   "--torch-threads", str(threads), "--block-size", str(args.block_size),
                   "--context-overflow", args.context_overflow,
                   "--log-level", args.log_level]
            if args.cache_dir:
                cmd += ["--cache-dir", args.cache_dir]
            if args.redis_url:
                cmd += ["--redis-url", args.redis_url]
            procs.append(subprocess.Popen(cmd, preexec_fn=_die_with_parent))
        log.info("starting %d workers (%s); the first start of a model may take a minute", n,
                 args.model)
        deadline = time.monotonic() + args.startup_timeout
        for address in addresses:
            await _wait_healthy(address, deadline, procs)
        from prefixgate.gateway.server import serve
        from prefixgate.models import resolve_model
        from prefixgate.registry import make_registry

        spec = resolve_model(args.model, _cache_dir(args))
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        static = [] if args.redis_url else addresses
        gw_stop = asyncio.Event()
        gateway = asyncio.create_task(serve(
            spec, make_registry(args.redis_url or None),
            _gateway_config(args, static, args.port), gw_stop, started))
        try:
            port = await started
            address = f"{args.host}:{port}"
            log.info("prefixgate is up: gateway %s, workers %s", address, ", ".join(addresses))
            if args.demo:
                # The demo prints each turn's figures itself; keep the terminal readable.
                logging.getLogger("prefixgate.gateway").setLevel(logging.WARNING)
                return await _demo(address, len(addresses))
            print(f"prefixgate up: gateway on {address}; chat with: prefixgate chat --address "
                  f"{address}   (Ctrl-C stops everything)", file=sys.stderr, flush=True)
            await stop.wait()
            return 0
        finally:
            gw_stop.set()
            await gateway
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


async def _demo(address: str, num_workers: int) -> int:
    from prefixgate.client import ChatClient

    client = ChatClient(address)
    await client.wait_ready(30)
    # The gateway probes workers on start; wait until it routes to all of them.
    for _ in range(100):
        models = await client.list_models()
        if models.models[0].num_workers >= num_workers:
            break
        await asyncio.sleep(0.2)
    results = await _converse(client, list(DEMO_SCRIPT), conversation_id="demo",
                              system="", sampling_kwargs={"max_tokens": 96})
    await client.close()
    if len(results) < len(DEMO_SCRIPT):
        return 1
    first = results[0].text
    if "paris" not in first.lower():
        print(f"demo: the first reply does not mention Paris: {first!r}", file=sys.stderr)
        return 1
    return 0


# --- chat --------------------------------------------------------------------------------


def _figures(r) -> str:
    rate = r.completion_tokens / (r.total_ms / 1e3) if r.total_ms else 0.0
    dropped = f" | dropped {r.dropped_tokens} tok" if r.dropped_tokens else ""
    return (f"[worker {r.worker_id} | prompt {r.prompt_tokens} tok | cached {r.cached_tokens} "
            f"tok{dropped} | ttft {r.ttft_ms:.0f} ms | {r.completion_tokens} tok in "
            f"{r.total_ms / 1e3:.2f} s ({rate:.1f} tok/s) | {r.finish_reason}]")


async def _converse(client, messages: Sequence[str] | None, conversation_id: str, system: str,
                    sampling_kwargs: dict, namespace: str = "", timeout_s: float = 300.0):
    """Hold a conversation: the given messages, or lines from stdin when None."""
    import uuid

    import grpc

    from prefixgate.v1 import common_pb2

    conversation_id = conversation_id or uuid.uuid4().hex[:12]
    history: list[tuple[str, str]] = [("system", system)] if system else []
    sampling = common_pb2.SamplingParams(**{k: v for k, v in sampling_kwargs.items()
                                            if v is not None})
    results = []
    lines = iter(messages) if messages is not None else None
    while True:
        if lines is not None:
            text = next(lines, None)
            if text is None:
                break
            print(f"you> {text}", flush=True)
        else:
            try:
                text = input("you> ")
            except EOFError:
                break
        if text.strip() == "/quit":
            break
        if text.strip() == "/reset":
            history = [("system", system)] if system else []
            conversation_id = uuid.uuid4().hex[:12]
            continue
        if not text.strip():
            continue
        history.append(("user", text))
        print("assistant> ", end="", flush=True)
        try:
            r = await client.turn(history, conversation_id=conversation_id, namespace=namespace,
                                  sampling=sampling, timeout_s=timeout_s,
                                  on_text=lambda t: print(t, end="", flush=True))
        except grpc.aio.AioRpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", flush=True)
            history.pop()
            if lines is not None:
                break
            continue
        print("\n" + _figures(r), flush=True)
        history.append(("assistant", r.text))
        results.append(r)
    return results


def _overflow_params(args: argparse.Namespace) -> dict:
    """SamplingParams fields for --context-overflow / --shifted-reuse (enum values)."""
    from prefixgate.protocol import OVERFLOW_FROM_PROTO, SHIFTED_REUSE_FROM_PROTO

    by_name = lambda table, name: next(k for k, v in table.items() if v == name)  # noqa: E731
    return {"context_overflow": by_name(OVERFLOW_FROM_PROTO, args.context_overflow),
            "shifted_reuse": by_name(SHIFTED_REUSE_FROM_PROTO, args.shifted_reuse)}


async def _run_chat(args: argparse.Namespace) -> None:
    from prefixgate.client import ChatClient

    client = ChatClient(args.address)
    try:
        await client.wait_ready(10)
    except TimeoutError:
        raise SystemExit(f"prefixgate chat: no gateway answers at {args.address}") from None
    await _converse(client, _appended(args, "--message") or None, args.conversation_id,
                    args.system, {"max_tokens": args.max_tokens, "temperature": args.temperature,
                                  "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
                                  **_overflow_params(args)},
                    namespace=args.namespace, timeout_s=args.timeout)
    await client.close()


# --- main --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "bench":
        result = args._bench_run(args)
        print(json.dumps(result, indent=None if args.json else 2))
        return 0
    if args.command == "replay":
        from prefixgate.replay.cli import run as run_replay

        return run_replay(args)
    runners = {"worker": _run_worker, "gateway": _run_gateway, "up": _run_up, "chat": _run_chat}
    try:
        return asyncio.run(runners[args.command](args)) or 0
    except KeyboardInterrupt:
        return 130

