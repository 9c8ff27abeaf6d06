"""`prefixgate worker --emulate`: an `EmulatedEngine` behind the real WorkerService.

Contract: `add_arguments(parser)` adds the emulation flags (the worker command's own flags
give the rest: --model, --block-size, --num-blocks as the cache capacity in blocks,
--host/--port/--worker-id, --redis-url/--lease-ms). `serve_emulated(args, stop)` serves
until `stop` is set through the worker command's own `serve_worker` (with `--redis-url`:
registration under a lease and KV events published exactly as a real worker does, and
the same request limits and security flags); it never imports torch. With
`--emulate-records PATH` it writes one JSON line per finished request there on shutdown
(`ServedRecord`: hit and worker-side TTFT as the worker saw them). With `--http-port` it also
answers OpenAI completions over HTTP (emulate/http.py) from the same engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from dataclasses import asdict
from pathlib import Path

from prefixgate.cli.flags import flag

log = logging.getLogger(__name__)

DEFAULT_CAPACITY_BLOCKS = 4000


def add_arguments(w: argparse.ArgumentParser) -> None:
    flag(w, "--emulate", action="store_true",
         help="no model: emulate a worker (LRU block cache of --num-blocks blocks, default "
              f"{DEFAULT_CAPACITY_BLOCKS}; one prefill at a time; docs/traces.md)")
    flag(w, "--prefill-tokens-per-s", type=float, default=20_000.0,
         help="emulated: prefill speed (uncached prompt tokens per emulated second)")
    flag(w, "--decode-s-per-token", type=float, default=0.030,
         help="emulated: seconds per output token of one sequence (decoding is batched)")
    flag(w, "--time-scale", type=float, default=1.0,
         help="emulated: emulated seconds per wall-clock second (service times are divided "
              "by it; reported timings are emulated)")
    flag(w, "--emulate-records", default="",
         help="emulated: on shutdown, write one JSON line per finished request here")
    flag(w, "--publish-at", default="prefill", choices=("prefill", "finish"),
         help="emulated: cache and publish a prompt's blocks when its prefill completes, or "
              "only when the request finishes (as engines that publish with the reply do)")
    flag(w, "--http-port", type=int, default=-1,
         help="emulated: also answer OpenAI /v1/completions over HTTP on this port, for HTTP "
              "routers (0: any free port; -1: off)")


async def serve_emulated(args: argparse.Namespace, stop: asyncio.Event) -> None:
    from prefixgate.cli.worker import serve_worker, worker_config
    from prefixgate.emulate.engine import EmulatedEngine, EmulationConfig
    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.worker.events import EventLog
    from prefixgate.worker.server import WorkerService

    spec = resolve_model(args.model, Path(args.cache_dir) if args.cache_dir else None)
    vocab_size = ChatTokenizer(spec).vocab_size
    capacity = args.num_blocks or DEFAULT_CAPACITY_BLOCKS
    events = EventLog()
    engine = EmulatedEngine(EmulationConfig(
        capacity_blocks=capacity, block_size=args.block_size,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_s_per_token=args.decode_s_per_token, time_scale=args.time_scale,
        model_fingerprint=spec.fingerprint, vocab_size=vocab_size,
        max_context_tokens=spec.max_context_tokens, publish_at=args.publish_at), events)
    config = worker_config(args, args.worker_id)  # "": worker-<bound port> (server.py)
    service = WorkerService(engine, spec, config, vocab_size=vocab_size, events=events)
    log.info("emulated worker %s: %d blocks of %d tokens, %.0f prefill tok/s, %.3f s/token, "
             "time x%g", args.worker_id or "(id from its port)", capacity, args.block_size,
             args.prefill_tokens_per_s,
             args.decode_s_per_token, args.time_scale)
    http = None
    if args.http_port >= 0:
        from prefixgate.emulate.http import serve_http

        http = asyncio.create_task(serve_http(engine, args.host, args.http_port, spec.name,
                                              stop))
    try:
        await serve_worker(service, stop, args, capacity)
        if http is not None:
            await http
    finally:
        if args.emulate_records:
            with open(args.emulate_records, "w") as f:
                for r in engine.records:
                    f.write(json.dumps({"worker": service.config.worker_id, **asdict(r)})
                            + "\n")
