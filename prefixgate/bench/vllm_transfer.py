"""`prefixgate bench vllm-transfer`: a follow-up turn on an idle vLLM server whose history
another vLLM server holds: pulled through prefixgate's KV connector vs recomputed.

Two vLLM servers start as `prefixgate up --engine vllm` starts them (launch/vllm.py: each
with the connector). The holder computes a `--history-tokens` prompt (token ids, the
prefixgate block hashes of namespace "" in `kv_transfer_params`, as the adapter sends
them), which its connector keeps. Then, `--rounds` times, the other server (idle) serves
the follow-up turn (the history plus `--new-tokens` new ids, `--max-tokens` greedy tokens,
streamed):
  * recomputed: no pull; it computes the whole prompt;
  * pulled: the pull names the holder's ExportBlocks, as the adapter does for a routed
    pull; vLLM loads the history's whole blocks and computes the rest.
Each request carries its own vLLM `cache_salt`, so neither finds the other's blocks in the
idle server's own cache. Reported: time to first token (p50 and each round's), the
speedup (recomputed / pulled p50; target >= 5 on this CPU), whether every pulled reply's
greedy tokens equal the recomputed ones', and the tokens vLLM loaded
(`vllm:external_prefix_cache_hits_total`) per pulled turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

TARGETS = {"ttft_speedup_pulled_over_recomputed": 5.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--vllm-python", default=os.environ.get("PREFIXGATE_VLLM_PYTHON", ""),
                        help="python of an environment with vLLM (default "
                             "$PREFIXGATE_VLLM_PYTHON)")
    parser.add_argument("--history-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16,
                        help="prefixgate's block size (the hashes' and the wire's)")
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument("--cache-dir", default="")
    parser.add_argument("--startup-timeout", type=float, default=900)


def _stream(url: str, body: dict) -> tuple[float, list[int]]:
    """Time to the first token (s) and the greedy token ids of a streamed completion."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps(
        {**body, "stream": True}).encode(), {"Content-Type": "application/json"})
    began = time.monotonic()
    ttft = 0.0
    tokens: list[int] = []
    with urllib.request.urlopen(req, timeout=1800) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices") or ():
                ids = choice.get("token_ids") or ()
                if ids and not ttft:
                    ttft = time.monotonic() - began
                tokens += ids
    return ttft, tokens


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return sum(float(line.rsplit(" ", 1)[1]) for line in resp.read().decode().splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))


def run(args: argparse.Namespace) -> dict:
    import random

    from tqdm import tqdm

    from prefixgate.launch.processes import ProcessGroup
    from prefixgate.launch.vllm import VLLMLaunch, start_fleet
    from prefixgate.model.catalog import resolve_model
    from prefixgate.radix import Hashers
    from prefixgate.vllm_connector.params import PullParams, TransferParams

    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    spec = resolve_model(args.model, cache_dir)
    launch = VLLMLaunch(args.vllm_python, spec.model_dir, spec.name,
                        kv_cache_bytes=args.kv_cache_mib << 20,
                        max_model_len=args.history_tokens + args.new_tokens + args.max_tokens + 64)
    try:
        fleet = asyncio.run(start_fleet(launch, 2, args.model, cache_dir, args.startup_timeout))
    except ValueError as exc:
        raise SystemExit(f"prefixgate bench vllm-transfer: {exc}") from None
    group: ProcessGroup = fleet.group
    try:
        holder, idle = fleet.servers
        rnd = random.Random(0)
        vocab = 48000
        history = [rnd.randrange(100, vocab) for _ in range(args.history_tokens)]
        base = {"model": spec.name, "temperature": 0, "return_token_ids": True,
                "max_tokens": args.max_tokens}
        hashes = Hashers(args.block_size, spec.fingerprint).get("").hash_blocks(history)
        params = TransferParams(args.block_size, spec.fingerprint, tuple(hashes))
        _stream(holder.url, {**base, "prompt": history, "max_tokens": 1,
                             "kv_transfer_params": params.to_json()})
        pull = TransferParams(args.block_size, spec.fingerprint, tuple(hashes), PullParams(
            f"{holder.host}:{holder.export_port}", holder.name, len(hashes)))
        rows = []
        for r in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
            prompt = history + [rnd.randrange(100, vocab) for _ in range(args.new_tokens)]
            t_re, tok_re = _stream(idle.url, {**base, "prompt": prompt,
                                              "cache_salt": f"bench-{r}-recompute"})
            loaded = _metric(idle.url, "vllm:external_prefix_cache_hits_total")
            t_pull, tok_pull = _stream(idle.url, {**base, "prompt": prompt,
                                                  "cache_salt": f"bench-{r}-pulled",
                                                  "kv_transfer_params": pull.to_json()})
            loaded = _metric(idle.url, "vllm:external_prefix_cache_hits_total") - loaded
            rows.append({"ttft_recomputed_ms": round(t_re * 1e3, 1),
                         "ttft_pulled_ms": round(t_pull * 1e3, 1),
                         "loaded_tokens": int(loaded), "tokens_equal": tok_re == tok_pull})
    finally:
        group.stop(30)
    re_p50 = statistics.median(r["ttft_recomputed_ms"] for r in rows)
    pull_p50 = statistics.median(r["ttft_pulled_ms"] for r in rows)
    return {
        "benchmark": "vllm-transfer", "model": spec.name,
        "history_tokens": args.history_tokens, "new_tokens": args.new_tokens,
        "prompt_tokens": args.history_tokens + args.new_tokens, "rounds": args.rounds,
        "kv_bytes_per_token_float32": _kv_bytes(spec.model_dir),
        "ttft_recomputed_ms_p50": re_p50, "ttft_pulled_ms_p50": pull_p50,
        "ttft_speedup_pulled_over_recomputed": round(re_p50 / pull_p50, 2),
        "greedy_tokens_equal": all(r["tokens_equal"] for r in rows),
        "loaded_tokens_per_pulled_turn": min(r["loaded_tokens"] for r in rows),
        "rows": rows, "targets": TARGETS,
        "cpus": len(os.sched_getaffinity(0)), "load_avg_1m": os.getloadavg()[0],
    }


def _kv_bytes(model_dir: Path) -> int:
    from prefixgate.engines.vllm import kv_bytes_per_token

    return kv_bytes_per_token(model_dir, "float32")
