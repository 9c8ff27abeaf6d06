"""`prefixgate worker`: one model worker serving prefixgate.v1.WorkerService (needs torch)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc

from prefixgate.cli import security
from prefixgate.cli.common import (
    cache_dir,
    drain_flag,
    listen_flags,
    log,
    log_flags,
    model_flags,
    overflow_flag,
    redis_url_flag,
    service_flags,
    service_model,
    tracing_flag,
    transfer_bytes_per_s_of,
    transfer_flags,
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
    redis_url_flag(w, "register in this Redis (redis://host:port/db)")
    flag(w, "--lease-ms", type=int, default=10000, help="registry lease, renewed every third of it")
    security.worker_flags(w)
    limit_flags(w)
    flag(w, "--kv-cache-memory", type=int, default=1 << 30,
         help="bytes of KV pool (ignored when --num-blocks is given)")
    flag(w, "--num-blocks", type=int, default=0, help="KV pool size in blocks (0: from --kv-cache-memory)")
    flag(w, "--max-num-seqs", type=int, default=32, help="most requests in the running batch")
    flag(w, "--max-waiting-requests", type=int, default=4096,
         help="most requests waiting for their first token (queued, pulling or prefilling); "
              "more are refused with RESOURCE_EXHAUSTED naming this flag (0: no bound)")
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
    tracing_flag(w)
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
    flag(w, "--vllm-export", default="",
         help="--engine vllm: HOST:PORT of its prefixgate KV connector's ExportBlocks, if it "
              "runs one (block pulls, and the drain hand-off of its cached conversations)")
    emulation_flags(w)  # --emulate: no model (prefixgate/emulate)


def emulation_flags(w: argparse.ArgumentParser) -> None:
    """--emulate and its flags (emulate/worker.py EmulatedWorkerConfig; the worker flags
    give the rest: --model, --block-size, --num-blocks as the cache capacity in blocks,
    --host/--port/--worker-id, --redis-url/--lease-ms, limits and security)."""
    from prefixgate.emulate.worker import DEFAULT_CAPACITY_BLOCKS

    flag(w, "--emulate", action="store_true",
         help="no model: emulate a worker (LRU block cache of --num-blocks blocks, default "
              f"{DEFAULT_CAPACITY_BLOCKS}; one prefill at a time; docs/traces.md)")
    service_flags(w, "emulated")
    flag(w, "--time-scale", type=float, default=1.0,
         help="emulated: emulated seconds per wall-clock second (service times are divided "
              "by it; reported timings are emulated)")
    flag(w, "--emulate-records", default="",
         help="emulated: on shutdown, write one JSON line per finished request here")
    flag(w, "--publish-at", default="prefill", choices=("prefill", "finish"),
         help="emulated: cache and publish a prompt's blocks when its prefill completes, or "
              "only when the request finishes (as engines that publish with the reply do)")
    transfer_flags(w, "emulated", real_workers=True)
    flag(w, "--http-port", type=int, default=-1,
         help="emulated: also answer OpenAI /v1/completions over HTTP on this port, for HTTP "
              "routers (0: any free port; -1: off)")


def weights_flags(parser: argparse.ArgumentParser) -> None:
    """--weights and --kv-dtype (worker and up): worker/model_loader.WeightsConfig, with
    the choices of prefixgate.model.catalog (building the parser imports no torch)."""
    from prefixgate.model.catalog import KV_DTYPES, WEIGHT_FORMATS

    flag(parser, "--weights", default="auto", choices=("auto", *WEIGHT_FORMATS),
         help="weight format: float32 (the reference), bfloat16, float16, int8 "
              "(weight-only int8, bfloat16 compute, CPU only) or q4_1 (GGUF's 4-bit "
              "blocks, float32 compute, CPU with AVX-512 or AVX2 + FMA) or q4_1-a8 (q4_1's "
              "weights times 8-bit activations in integer dot products, as llama.cpp; "
              "lossy, an option) (auto: q4_1 on "
              "CPU where it is lossless, a Q4_1 GGUF such as SmolLM2's, else float32; "
              "bfloat16 on GPU; "
              "quality and speed of each in docs/benchmarks.md)")
    flag(parser, "--kv-dtype", default="auto", choices=KV_DTYPES,
         help="KV cache element type (auto: the compute dtype, bfloat16 under int8 weights)")


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        asyncio.run(_serve_vllm(args))
        return 0
    from prefixgate.workerapi.startup import passive_omp_wait

    passive_omp_wait()
    asyncio.run(_serve_emulated(args) if args.emulate else _serve(args))
    # The server has stopped. The interpreter's final collection would walk every object
    # the model and tokenizer left (seconds of exit for a worker already stopped, which
    # `up` and orchestrators wait on); frozen objects are skipped by it.
    gc.freeze()
    return 0


async def _serve_vllm(args: argparse.Namespace) -> None:
    """The Worker API for one vLLM server (engines/vllm.py), registered like any worker."""
    from prefixgate.engines.vllm import VLLMConfig, VLLMWorker, worker_id_of
    from prefixgate.launch.serving import stop_event
    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.telemetry import metrics_export
    from prefixgate.workerapi.startup import serve_worker

    try:
        vllm = VLLMConfig.parse(",".join(p for p in (
            args.vllm_url, args.vllm_events, args.vllm_replay,
            "grpc://" + args.vllm_export if args.vllm_export else "") if p))
    except ValueError as exc:
        raise SystemExit(f"prefixgate worker --engine vllm: --vllm-url and --vllm-events "
                         f"are needed: {exc}") from None
    spec = resolve_model(args.model, cache_dir(args))
    metrics_export.serve(args.metrics_port, spec.name, args.host)
    config = dataclasses.replace(worker_config(args),
                                 worker_id=args.worker_id or worker_id_of(vllm.url))
    service = VLLMWorker(spec, ChatTokenizer(spec), config, vllm)
    await service.start()
    await serve_worker(service, stop_event(), registry_lease(args), 0)


async def _serve_emulated(args: argparse.Namespace) -> None:
    from prefixgate.emulate.worker import (
        DEFAULT_CAPACITY_BLOCKS,
        EmulatedWorkerConfig,
        serve_emulated,
    )
    from prefixgate.launch.serving import stop_event

    emulation = EmulatedWorkerConfig(
        model=args.model, cache_dir=cache_dir(args),
        capacity_blocks=args.num_blocks or DEFAULT_CAPACITY_BLOCKS,
        service=service_model(args), time_scale=args.time_scale, publish_at=args.publish_at,
        records_path=args.emulate_records, http_port=args.http_port,
        transfer_bytes_per_s=transfer_bytes_per_s_of(args, emulated=True),
        kv_bytes_per_token=args.kv_bytes_per_token)
    await serve_emulated(emulation, worker_config(args), registry_lease(args), stop_event())


async def _serve(args: argparse.Namespace) -> None:
    try:
        import torch
    except ModuleNotFoundError:
        raise SystemExit(
            "prefixgate worker: torch is not installed: a worker needs the worker extra "
            "(pip install torch==2.13.0, then pip install 'prefixgate[worker]'; see README). "
            "A gateway-only install runs `prefixgate gateway` and emulated workers "
            "(prefixgate worker --emulate).") from None

    from prefixgate.launch.serving import stop_event
    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.overflow import user_turn_prefix
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.telemetry import metrics_export
    from prefixgate.worker.engine import PagedEngine
    from prefixgate.worker.kv_pool import num_blocks_for_memory
    from prefixgate.worker.model_loader import WeightsConfig, load_model
    from prefixgate.worker.model_runner import pool_config_for
    from prefixgate.workerapi.api import EngineConfig
    from prefixgate.workerapi.events import EventLog
    from prefixgate.workerapi.metrics import WorkerMetrics
    from prefixgate.workerapi.server import WorkerService
    from prefixgate.workerapi.startup import serve_worker

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    stop = stop_event()
    spec = resolve_model(args.model, cache_dir(args))
    metrics_export.serve(args.metrics_port, spec.name, args.host)
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
    service = WorkerService(engine, spec, worker_config(args), vocab_size=tokenizer.vocab_size,
                            events=events)
    await serve_worker(service, stop, registry_lease(args), num_blocks)


def worker_config(args: argparse.Namespace):
    """The WorkerConfig the worker flags describe (real and emulated workers alike)."""
    from prefixgate.workerapi.server import WorkerConfig

    # No --worker-id: "" until bound, then worker-<bound port> (workerapi/server.py).
    return WorkerConfig(worker_id=args.worker_id, host=args.host, port=args.port, block_size=args.block_size,
                        drain_seconds=args.drain_seconds, limits=request_limits(args),
                        transfer_bytes_per_s=transfer_bytes_per_s_of(args, args.emulate),
                        transfer_probe=True, max_waiting_requests=args.max_waiting_requests,
                        **security.worker_security(args))


def registry_lease(args: argparse.Namespace):
    """The RegistryLease the --redis-url, --lease-ms and --advertise-address flags give."""
    from prefixgate.workerapi.startup import RegistryLease

    return RegistryLease(redis_url=args.redis_url, lease_ms=args.lease_ms,
                         advertise_address=args.advertise_address)
