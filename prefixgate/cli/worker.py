"""`prefixgate worker`: one model worker serving prefixgate.v1.WorkerService (needs torch)."""

from __future__ import annotations

import argparse
import asyncio

from prefixgate.cli import security
from prefixgate.cli.common import (
    cache_dir,
    drain_flag,
    listen_flags,
    log,
    log_flags,
    model_flags,
    overflow_flag,
    start_metrics,
    start_server,
    stop_event,
)
from prefixgate.cli.flags import flag
from prefixgate.cli.limits import limit_flags, request_limits

HELP = "run one model worker (WorkerService over gRPC)"
DESCRIPTION = "Run one model worker serving prefixgate.v1.WorkerService."


def add_arguments(w: argparse.ArgumentParser) -> None:
    from prefixgate.wire.protocol import SHIFTED_REUSE_FROM_PROTO

    log_flags(w)
    model_flags(w)
    listen_flags(w, 50061)
    flag(w, "--worker-id", default="",
         help="stable worker id (default: worker-<port>, the port it listens on)")
    flag(w, "--advertise-address", default="",
         help="host:port gateways use to reach this worker (default: host:port)")
    flag(w, "--redis-url", default="", help="register in this Redis (redis://host:port/db)")
    flag(w, "--lease-ms", type=int, default=10000, help="registry lease, renewed every third of it")
    security.worker_flags(w)
    limit_flags(w)
    flag(w, "--kv-cache-memory", type=int, default=1 << 30,
         help="bytes of KV pool (ignored when --num-blocks is given)")
    flag(w, "--num-blocks", type=int, default=0, help="KV pool size in blocks (0: from --kv-cache-memory)")
    flag(w, "--max-num-seqs", type=int, default=32, help="most requests in the running batch")
    flag(w, "--max-num-batched-tokens", type=int, default=512,
         help="tokens per step (decodes plus prefill chunks)")
    flag(w, "--disable-prefix-cache", action="store_true",
         help="compute every prompt in full (for comparisons)")
    overflow_flag(w)
    flag(w, "--shifted-reuse", default="blend",
         choices=[n for n in SHIFTED_REUSE_FROM_PROTO.values() if n],
         help="how an overflowing turn reuses its kept turns' cached KV (docs/reindex.md)")
    flag(w, "--blend-tokens", type=int, default=64,
         help="tokens after the dropped gap recomputed under --shifted-reuse blend")
    flag(w, "--reindex-backend", default="auto", choices=("auto", "torch", "triton"),
         help="KV re-rotation: triton kernel (auto: on CUDA when installed) or torch")
    flag(w, "--device", default="auto",
         help="torch device for the model and KV pool: cpu, cuda, cuda:N (auto: cuda if available)")
    weights_flags(w)
    flag(w, "--torch-threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    drain_flag(w)
    flag(w, "--metrics-port", type=int, default=0,
         help="serve Prometheus metrics on --host at this port, /metrics (0: off)")
    flag(w, "--engine", default="prefixgate", choices=("prefixgate", "vllm"),
         help="prefixgate: this process runs the model; vllm: it serves the Worker API for a "
              "vLLM server (--vllm-url, --vllm-events; no model, no torch here; docs/vllm.md)")
    flag(w, "--vllm-url", default="", help="--engine vllm: the server's HTTP API, e.g. "
                                           "http://127.0.0.1:8000")
    flag(w, "--vllm-events", default="",
         help="--engine vllm: its KV events (--kv-events-config endpoint) as seen from here, "
              "e.g. tcp://127.0.0.1:5557")
    flag(w, "--vllm-replay", default="",
         help="--engine vllm: its kv-events replay_endpoint, if set (lost events are replayed)")
    from prefixgate.emulate.worker import add_arguments as add_emulation_arguments

    add_emulation_arguments(w)  # --emulate: no model (prefixgate/emulate)


def weights_flags(parser: argparse.ArgumentParser) -> None:
    """--weights and --kv-dtype (worker and up): worker/model_loader.WeightsConfig, with
    the choices of prefixgate.model.catalog (building the parser imports no torch)."""
    from prefixgate.model.catalog import KV_DTYPES, WEIGHT_FORMATS

    flag(parser, "--weights", default="auto", choices=("auto", *WEIGHT_FORMATS),
         help="weight format: float32 (the reference), bfloat16, float16, int8 "
              "(weight-only int8, bfloat16 compute, CPU only) or q4_1 (GGUF's 4-bit "
              "blocks, float32 compute, CPU with AVX-512) (auto: q4_1 on CPU where it is "
              "lossless, a Q4_1 GGUF such as SmolLM2's, else float32; bfloat16 on GPU; "
              "quality and speed of each in docs/benchmarks.md)")
    flag(parser, "--kv-dtype", default="auto", choices=KV_DTYPES,
         help="KV cache element type (auto: the compute dtype, bfloat16 under int8 weights)")


def passive_omp_wait() -> None:
    """Make torch's OpenMP threads sleep, not spin, while they wait for work: call before
    torch is imported. Why: a worker shares its host with the gateway, other workers and
    its own gRPC threads; with more runnable threads than cores, spinning threads burn
    the slices the working ones need (measured here, 2 threads on 2 busy cores, SmolLM2
    int8 decode: 2.8 s per token spinning, 48 ms passive). The cost of passive waiting is
    a wake-up per parallel operator: it hurt when every decode operator went through
    OpenMP, but q4_1 decode steps now run on the CPU kernels' own pool (bounded spin,
    never waits for an unscheduled thread; worker/kernels/cpu_quant.py) and OpenMP serves
    prefill GEMMs of milliseconds each (docs/benchmarks.md, weight formats: threads).
    An OMP_WAIT_POLICY the user set wins."""
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        asyncio.run(_serve_vllm(args))
        return 0
    passive_omp_wait()
    asyncio.run(_serve_emulated(args) if args.emulate else _serve(args))
    return 0


async def _serve_vllm(args: argparse.Namespace) -> None:
    """The Worker API for one vLLM server (engines/vllm.py), registered like any worker."""
    from prefixgate.engines.vllm import VLLMConfig, VLLMWorker, worker_id_of
    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.tokenizer import ChatTokenizer

    try:
        vllm = VLLMConfig.parse(",".join(p for p in (args.vllm_url, args.vllm_events,
                                                      args.vllm_replay) if p))
    except ValueError as exc:
        raise SystemExit(f"prefixgate worker --engine vllm: --vllm-url and --vllm-events "
                         f"are needed: {exc}") from None
    spec = resolve_model(args.model, cache_dir(args))
    start_metrics(args.metrics_port, spec.name, args.host)
    service = VLLMWorker(spec, ChatTokenizer(spec), worker_config(
        args, args.worker_id or worker_id_of(vllm.url)), vllm)
    await service.start()
    await serve_worker(service, stop_event(), args, 0)


async def _serve_emulated(args: argparse.Namespace) -> None:
    from prefixgate.emulate.worker import serve_emulated

    await serve_emulated(args, stop_event())


async def _serve(args: argparse.Namespace) -> None:
    try:
        import torch
    except ModuleNotFoundError:
        raise SystemExit(
            "prefixgate worker: torch is not installed: a worker needs the worker extra "
            "(pip install torch==2.13.0, then pip install 'prefixgate[worker]'; see README). "
            "A gateway-only install runs `prefixgate gateway` and emulated workers "
            "(prefixgate worker --emulate).") from None

    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.overflow import user_turn_prefix
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.worker.engine import EngineConfig, PagedEngine
    from prefixgate.worker.events import EventLog
    from prefixgate.worker.kv_pool import num_blocks_for_memory
    from prefixgate.worker.metrics import WorkerMetrics
    from prefixgate.worker.model_loader import WeightsConfig, load_model
    from prefixgate.worker.model_runner import pool_config_for
    from prefixgate.worker.server import WorkerService

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    stop = stop_event()
    spec = resolve_model(args.model, cache_dir(args))
    start_metrics(args.metrics_port, spec.name, args.host)
    tokenizer = ChatTokenizer(spec)
    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    weights = WeightsConfig(args.weights, args.kv_dtype).resolved(device, spec)
    log.info("weights %s, KV %s", weights.weights, weights.kv_torch_dtype)
    model = await asyncio.to_thread(load_model, spec, device=device, weights=weights)
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
    config = worker_config(args, args.worker_id)  # "": worker-<bound port> (server.py)
    service = WorkerService(engine, spec, config, vocab_size=tokenizer.vocab_size,
                            events=events)
    await serve_worker(service, stop, args, num_blocks)


def worker_config(args: argparse.Namespace, worker_id: str):
    """The WorkerConfig the worker flags describe (real and emulated workers alike)."""
    from prefixgate.worker.server import WorkerConfig

    return WorkerConfig(worker_id=worker_id, host=args.host, port=args.port,
                        block_size=args.block_size, drain_seconds=args.drain_seconds,
                        limits=request_limits(args), **security.worker_security(args))


async def serve_worker(service, stop: asyncio.Event, args: argparse.Namespace,
                       capacity_blocks: int) -> None:
    """Serve `service` until `stop`; with --redis-url, register under a lease, renew it and
    publish the service's KV event log (worker/events.py). Real and emulated workers."""
    from prefixgate.registry import RedisRegistry, WorkerRecord
    from prefixgate.worker.events import RedisPublisher
    from prefixgate.worker.server import serve

    server, port = await start_server(lambda started: serve(service, stop, started))
    if not args.redis_url:
        await server
        return
    worker_id = service.config.worker_id
    registry = RedisRegistry(args.redis_url, keyring=security.worker_keyring(args, worker_id))
    address = args.advertise_address or f"{args.host}:{port}"
    publisher = RedisPublisher(service.events, registry, WorkerRecord(
        worker_id, address, service.spec.fingerprint, capacity_blocks=capacity_blocks),
        args.lease_ms)
    await publisher.run(stop)
    await server
    await registry.close()
