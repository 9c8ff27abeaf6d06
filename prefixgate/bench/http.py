"""HTTP front vs gRPC: the latency the OpenAI-compatible front adds, through one gateway.

One emulated worker (no model, torch-free) behind one real gateway process (`prefixgate
gateway --http-port`), both started like users start them (prefixgate/emulate/fleet.py).
For each prompt size, the same chat turn (one user message of about that many tokens,
streamed, `--max-tokens` tokens) is sent alternately over gRPC (prefixgate.wire.client) and
over HTTP (`POST /v1/chat/completions`, SSE, aiohttp client), one at a time, after
`--warmup` turns of each; the prompt is the same every time, so after the first turn the
worker serves it from its prefix cache and the difference between the two fronts is the
gateway's (and the client's) protocol cost. TTFT is measured at the client: request sent
to the first token's text received. Reports p50/p99 per front and size, and the HTTP
front's added p50 (target: <= 2 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

TARGET_ADDED_P50_MS = 2.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-tokens", default="1024,12288",
                   help="prompt sizes in tokens, comma-separated")
    p.add_argument("--turns", type=int, default=200, help="measured turns per front and size")
    p.add_argument("--warmup", type=int, default=10, help="unmeasured turns per front and size")
    p.add_argument("--max-tokens", type=int, default=2, help="tokens per reply")


def _summary(ms: list[float]) -> dict[str, float]:
    """p50 (the median) and p99 of milliseconds, rounded to microseconds."""
    xs = sorted(ms)
    return {"p50": round(statistics.median(xs), 3),
            "p99": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 3)}


def _prompt(num_tokens: int, tokenizer) -> str:
    """A user message whose chat-templated prompt is about `num_tokens` tokens."""
    unit = "the quick brown fox jumps over the lazy dog. "
    per_unit = len(tokenizer.encode_messages([("user", unit * 100)])) / 100
    return unit * max(1, round(num_tokens / per_unit))


async def _grpc_ttft(client, text: str, max_tokens: int) -> tuple[float, int]:
    from prefixgate.v1 import common_pb2

    t0 = time.perf_counter()
    first = 0.0

    def on_text(_: str) -> None:
        nonlocal first
        first = first or time.perf_counter()

    r = await client.turn([("user", text)], on_text=on_text,
                          sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
    return (first - t0) * 1e3, r.prompt_tokens


async def _http_ttft(session, url: str, model: str, text: str, max_tokens: int) -> float:
    body = {"model": model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}]}
    t0 = time.perf_counter()
    first = 0.0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if first or not line.startswith(b"data: {"):
                continue
            doc = json.loads(line[6:])
            if any((c.get("delta") or {}).get("content") for c in doc["choices"]):
                first = time.perf_counter()
    return (first - t0) * 1e3


async def _run(args: argparse.Namespace) -> dict:
    import aiohttp

    from prefixgate.emulate.fleet import Fleet, FleetConfig
    from prefixgate.emulate.model import emulation_model_dir
    from prefixgate.emulate.service import ServiceModel
    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.wire.client import ChatClient
    from prefixgate.wire.rpc import free_port

    sizes = [int(s) for s in args.prompt_tokens.split(",") if s]
    http_port = free_port()
    config = FleetConfig(num_workers=1, block_size=16, capacity_blocks=8192,
                         service=ServiceModel(1e6, 0.001),
                         gateway_flags=("--http-port", str(http_port)))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        async with Fleet(config, Path(tmp)) as fleet:
            client = ChatClient(fleet.gateways[0])
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{http_port}/v1/chat/completions"
                async with session.get(f"http://127.0.0.1:{http_port}/v1/models") as r:
                    model_name = (await r.json())["data"][0]["id"]
                tokenizer = ChatTokenizer(resolve_model(str(emulation_model_dir(
                    config.model, config.max_context_tokens))))
                for size in sizes:
                    text = _prompt(size, tokenizer)
                    grpc_ms, http_ms, prompt_tokens = [], [], 0
                    for i in range(args.warmup + args.turns):
                        g, prompt_tokens = await _grpc_ttft(client, text, args.max_tokens)
                        h = await _http_ttft(session, url, model_name, text, args.max_tokens)
                        if i >= args.warmup:
                            grpc_ms.append(g)
                            http_ms.append(h)
                    grpc, http = _summary(grpc_ms), _summary(http_ms)
                    added = http["p50"] - grpc["p50"]  # the figures the row reports
                    row = {"prompt_tokens": prompt_tokens, "turns": args.turns,
                           "grpc_ttft_ms": grpc, "http_ttft_ms": http,
                           "http_added_p50_ms": round(added, 3),
                           "target_met": added <= TARGET_ADDED_P50_MS}
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    results.append(row)
            await client.close()
    return {"benchmark": "http", "target_added_p50_ms": TARGET_ADDED_P50_MS,
            "results": results}


def run(args: argparse.Namespace) -> dict:
    return asyncio.run(_run(args))
