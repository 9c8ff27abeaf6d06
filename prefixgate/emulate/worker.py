"""`prefixgate worker --emulate`: an `EmulatedEngine` behind the real WorkerService.

Contract: `await serve_emulated(emulation, worker, lease, stop)` serves until `stop` is
set, through the same start-up as a real worker (workerapi/startup.py: with a Redis lease,
registration and KV events published exactly as a real worker does; the same request
limits and security, `worker`: its WorkerConfig). It never imports torch.
`EmulatedWorkerConfig` holds the rest (the command's emulation flags): the model whose
tokenizer and fingerprint it serves, its cache capacity in blocks, its service model
(emulate/service.py), its block-transfer link (emulate/transfer.py) and clock; with `records_path` it writes one JSON line per finished
request there on shutdown (`ServedRecord`: hit and worker-side TTFT as the worker saw
them); with `http_port` >= 0 it also answers OpenAI completions over HTTP
(emulate/http.py) from the same engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from prefixgate.emulate.service import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_TRANSFER_BYTES_PER_S,
    ServiceModel,
)
from prefixgate.workerapi.startup import RegistryLease

log = logging.getLogger(__name__)

DEFAULT_CAPACITY_BLOCKS = 4000

__all__ = ["DEFAULT_CAPACITY_BLOCKS", "EmulatedWorkerConfig", "attach_transfer",
           "serve_emulated"]


@dataclass(frozen=True)
class EmulatedWorkerConfig:
    model: str = "smollm2-135m"
    cache_dir: Path | None = None
    capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS
    service: ServiceModel = ServiceModel()
    time_scale: float = 1.0  # emulated seconds per wall-clock second
    publish_at: str = "prefill"  # "prefill" | "finish" (emulate/engine.py)
    records_path: str = ""  # "" : none written
    http_port: int = -1  # -1: no HTTP face; 0: any free port
    # Block transfer: the link, bytes per emulated second, and the KV bytes of one token
    # of the model it stands for (emulate/transfer.py); 0 for either: none.
    transfer_bytes_per_s: float = DEFAULT_TRANSFER_BYTES_PER_S
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN


def attach_transfer(engine, service, loop: asyncio.AbstractEventLoop) -> None:
    """Ready an emulated engine's block transfer on the loop `service` runs on: the
    engine's state lives on that loop (transfers reach it from threads), exports wait out
    their link time on threads (enough of them that waiting pulls never hold up the
    worker's other work), and the worker reports its link's rate until a pull measures it
    (emulate/transfer.py)."""
    engine.attach(loop)
    if engine.transfer is None:
        return
    from concurrent.futures import ThreadPoolExecutor

    loop.set_default_executor(ThreadPoolExecutor(64, thread_name_prefix="emulated"))
    service.transfer_rate.assume(engine.transfer.declared_bytes_per_s, 0.0, "declared")


async def serve_emulated(emulation: EmulatedWorkerConfig, worker, lease: RegistryLease,
                         stop: asyncio.Event) -> None:
    """Serve an emulated worker (module docstring); `worker`: its WorkerConfig."""
    from prefixgate.emulate.engine import EmulatedEngine, EmulationConfig
    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.workerapi.events import EventLog
    from prefixgate.workerapi.server import WorkerService
    from prefixgate.workerapi.startup import serve_worker

    spec = resolve_model(emulation.model, emulation.cache_dir)
    vocab_size = ChatTokenizer(spec).vocab_size
    events = EventLog()
    engine = EmulatedEngine(EmulationConfig(
        capacity_blocks=emulation.capacity_blocks, block_size=worker.block_size,
        service=emulation.service, time_scale=emulation.time_scale,
        model_fingerprint=spec.fingerprint, vocab_size=vocab_size,
        max_context_tokens=spec.max_context_tokens, publish_at=emulation.publish_at,
        kv_bytes_per_token=emulation.kv_bytes_per_token,
        transfer_bytes_per_s=emulation.transfer_bytes_per_s), events)
    service = WorkerService(engine, spec, worker, vocab_size=vocab_size, events=events)
    attach_transfer(engine, service, asyncio.get_running_loop())
    log.info("emulated worker %s: %d blocks of %d tokens, %.0f prefill tok/s, %.3f s/token, "
             "time x%g", worker.worker_id or "(id from its port)", emulation.capacity_blocks, worker.block_size,
             emulation.service.prefill_tokens_per_s, emulation.service.decode_s_per_token,
             emulation.time_scale)
    http = None
    if emulation.http_port >= 0:
        from prefixgate.emulate.http import serve_http

        http = asyncio.create_task(serve_http(engine, worker.host, emulation.http_port,
                                              spec.name, stop))
    try:
        await serve_worker(service, stop, lease, emulation.capacity_blocks)
        if http is not None:
            await http
    finally:
        if emulation.records_path:
            with open(emulation.records_path, "w") as f:
                for r in engine.records:
                    f.write(json.dumps({"worker": worker.worker_id, **asdict(r)}) + "\n")
