"""`prefixgate bench vllm-overflow`: an overflowing conversation on a vLLM server, its kept
turns moved back through prefixgate's KV connector (re-rotated) vs recomputed.

One vLLM server starts as `prefixgate up --engine vllm` starts it (launch/vllm.py: with the
connector), its context cut to `--context` tokens (`--max-model-len`), and is followed in
this process by the adapter (engines/vllm.py `VLLMWorker`, the one the gateway runs), so
every turn takes the path a gateway's turn takes past routing. Real ShareGPT
conversations (recorded replies, `--trace`) as bench/reindex.py picks them: the first turn
of each conversation that overflows the context and keeps part of the turn before it.
Per conversation: the previous turn's prompt is served (vLLM computes it; the connector
keeps its blocks), then the overflowing turn under the policy keep-system-drop-oldest,
`--max-tokens` greedy tokens with vLLM's top `--top-logprobs` alternatives per token:
  * shift: the kept turns' KV loaded from the connector's store, keys re-rotated back by
    the dropped length (what vLLM counts in `external_prefix_cache_hits_total`);
  * recompute: the same truncated prompt computed (the system prompt reused): exact.
Reported: time to first token (the adapter's, p50 of each and the ratio recompute /
shift, measured in the same run), and the quality of shift against recompute, as
docs/reindex.md's gates: top-1 agreement and KL(recompute || shift) of the first next-token
distribution (over the top alternatives, the rest lumped into one bucket: a lower bound
of the full KL, near it when the alternatives hold almost all the mass), and how many of
the greedy tokens match before the first difference; the same two figures over every
generated position whose prefix both replies share; where the top token differs, the
recompute's margin between its first two alternatives (a near tie flips on any error).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
from pathlib import Path

from prefixgate.bench.reindex import DEFAULT_TRACE

TARGETS = {"ttft_speedup_shift_over_recompute": 3.0, "top1_agreement": 0.97, "kl_mean": 0.05}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--vllm-python", default=os.environ.get("PREFIXGATE_VLLM_PYTHON", ""),
                        help="python of an environment with vLLM (default "
                             "$PREFIXGATE_VLLM_PYTHON)")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                        help="ShareGPT conversations")
    parser.add_argument("--context", type=int, default=2048,
                        help="vLLM's context (--max-model-len) the conversations overflow")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256,
                        help="skip turns whose new user message is longer")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per turn")
    parser.add_argument("--top-logprobs", type=int, default=20,
                        help="alternatives per token the quality figures use (at most 20: "
                             "the Worker API's limit)")
    parser.add_argument("--block-size", type=int, default=16, help="prefixgate's block size")
    parser.add_argument("--kv-cache-mib", type=int, default=1024)
    parser.add_argument("--cache-dir", default="")
    parser.add_argument("--startup-timeout", type=float, default=900)


def run(args: argparse.Namespace) -> dict:
    from prefixgate.launch.vllm import VLLMLaunch, start_fleet
    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.overflow import user_turn_prefix
    from prefixgate.model.tokenizer import ChatTokenizer

    if not args.trace.is_file():
        raise SystemExit(f"prefixgate bench vllm-overflow: no trace at {args.trace} "
                         "(--trace: ShareGPT conversations)")
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    spec = resolve_model(args.model, cache_dir)
    tok = ChatTokenizer(spec)
    turns = _pick(args, tok, user_turn_prefix(tok))
    launch = VLLMLaunch(args.vllm_python, spec.model_dir, spec.name,
                        kv_cache_bytes=args.kv_cache_mib << 20, max_model_len=args.context)
    try:
        fleet = asyncio.run(start_fleet(launch, 1, args.model, cache_dir, args.startup_timeout))
    except ValueError as exc:
        raise SystemExit(f"prefixgate bench vllm-overflow: {exc}") from None
    try:
        rows = asyncio.run(_measure(args, spec, tok, fleet.servers[0], turns))
    finally:
        fleet.group.stop(30)
    return _summary(args, spec.name, rows)


def _pick(args, tok, turn_prefix) -> list[tuple[str, list[int], list[int]]]:
    from prefixgate.bench.reindex import _pick_turns

    return _pick_turns(argparse.Namespace(trace=args.trace, conversations=args.conversations,
                                          max_new_tokens=args.max_new_tokens),
                       tok, args.context, turn_prefix)


async def _measure(args, spec, tok, server, turns) -> list[dict]:
    from tqdm import tqdm

    from prefixgate.engines.vllm import VLLMConfig, VLLMWorker
    from prefixgate.v1 import common_pb2
    from prefixgate.workerapi.client import InProcessWorkerClient
    from prefixgate.workerapi.server import WorkerConfig

    worker = VLLMWorker(spec, tok, WorkerConfig(server.worker_id, block_size=args.block_size),
                        VLLMConfig(server.url, server.events, server.replay,
                                   export=server.export.removeprefix("grpc://")))
    await worker.start(wait_s=60)
    local = InProcessWorkerClient(worker)
    modes = {"shift": common_pb2.SHIFTED_REUSE_SHIFT,
             "recompute": common_pb2.SHIFTED_REUSE_RECOMPUTE}
    rows = []
    try:
        for conv_id, history, prompt in tqdm(turns, desc="conversations", file=sys.stderr):
            ns = f"bench-{conv_id}"  # each conversation cached on its own
            await _generate(local, f"{conv_id}-history", history, 1, 0, 0, ns)
            row: dict = {"conversation": conv_id, "history_tokens": len(history),
                         "prompt_tokens_sent": len(prompt)}
            for name, mode in modes.items():
                loaded = await _loaded(worker)
                row[name] = await _generate(local, f"{conv_id}-{name}", prompt, args.max_tokens,
                                            args.top_logprobs, mode, ns)
                row[name]["loaded_tokens"] = int(await _loaded(worker) - loaded)
            rows.append(row)
    finally:
        await worker.close()
    return rows


async def _loaded(worker) -> float:
    """vLLM's `external_prefix_cache_hits_total` (tokens the connector loaded)."""
    text = await asyncio.to_thread(_metrics_text, worker.vllm.url)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:external_prefix_cache_hits_total"))


def _metrics_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


async def _generate(local, rid: str, prompt: list[int], max_tokens: int, top: int,
                    mode: int, namespace: str) -> dict:
    from prefixgate.v1 import common_pb2, worker_pb2

    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0, shifted_reuse=mode,
        context_overflow=common_pb2.CONTEXT_OVERFLOW_KEEP_SYSTEM_DROP_OLDEST)
    if top:
        sampling.top_logprobs = top
    req = worker_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                     sampling=sampling, namespace=namespace)
    tokens, logprobs, final = [], [], None
    async for ev in local.Generate(req, timeout=1800):
        if ev.HasField("chunk"):
            tokens += ev.chunk.token_ids
            logprobs += ev.chunk.logprobs
        else:
            final = ev.final
    assert final is not None
    return {"ttft_ms": round(final.timings.ttft_ms, 1), "tokens": list(tokens),
            "logprobs": [dict(zip(lp.top_token_ids, lp.top_logprobs, strict=True))
                         for lp in logprobs],
            "prompt_tokens": final.usage.prompt_tokens,
            "cached_tokens": final.usage.cached_tokens,
            "dropped_tokens": final.usage.dropped_tokens}


def kl_top(p: dict[int, float], q: dict[int, float]) -> float:
    """KL(p || q) of two top-k alternatives (token -> logprob), coarse-grained onto the
    tokens both list plus one bucket for the rest: a lower bound of the full KL."""
    both = set(p) & set(q)
    kl = sum(math.exp(p[t]) * (p[t] - q[t]) for t in both)
    p_rest = max(1e-12, 1 - sum(math.exp(p[t]) for t in both))
    q_rest = max(1e-12, 1 - sum(math.exp(q[t]) for t in both))
    return kl + p_rest * math.log(p_rest / q_rest)


def _top(alternatives: dict[int, float]) -> int:
    return max(alternatives, key=alternatives.__getitem__)


def _summary(args, model: str, rows: list[dict]) -> dict:
    out_rows = []
    for r in rows:
        s, e = r["shift"], r["recompute"]
        match = next((i for i, (a, b) in enumerate(zip(s["tokens"], e["tokens"], strict=False))
                      if a != b), min(len(s["tokens"]), len(e["tokens"])))
        top1 = _top(e["logprobs"][0]) == _top(s["logprobs"][0])
        # Every position whose prefix both replies share (up to the first difference).
        shared = range(min(match + 1, len(s["logprobs"]), len(e["logprobs"])))
        pos_top1 = [_top(e["logprobs"][i]) == _top(s["logprobs"][i]) for i in shared]
        pos_kl = [kl_top(e["logprobs"][i], s["logprobs"][i]) for i in shared]
        ranked = sorted(e["logprobs"][0].values(), reverse=True)
        out_rows.append({
            "conversation": r["conversation"], "history_tokens": r["history_tokens"],
            "prompt_tokens_sent": r["prompt_tokens_sent"],
            "dropped_tokens": s["dropped_tokens"], "kept_tokens": s["prompt_tokens"],
            "ttft_recompute_ms": e["ttft_ms"], "ttft_shift_ms": s["ttft_ms"],
            "cached_tokens_shift": s["cached_tokens"],
            "cached_tokens_recompute": e["cached_tokens"],
            "moved_tokens": s["loaded_tokens"],
            "kl_first_token": round(kl_top(e["logprobs"][0], s["logprobs"][0]), 5),
            "top1_agree": top1, "greedy_match": match,
            "top2_margin_recompute": round(ranked[0] - ranked[1], 4) if len(ranked) > 1
            else None,
            "positions": len(pos_top1), "positions_top1_agree": sum(pos_top1),
            "positions_kl_sum": sum(pos_kl),
            "same_dropped": s["dropped_tokens"] == e["dropped_tokens"]})
    re_p50 = statistics.median(r["ttft_recompute_ms"] for r in out_rows)
    sh_p50 = statistics.median(r["ttft_shift_ms"] for r in out_rows)
    kls = [r["kl_first_token"] for r in out_rows]
    return {
        "benchmark": "vllm-overflow", "model": model, "context": args.context,
        "conversations": len(out_rows), "max_tokens": args.max_tokens,
        "top_logprobs": args.top_logprobs,
        "ttft_recompute_ms_p50": re_p50, "ttft_shift_ms_p50": sh_p50,
        "ttft_speedup_shift_over_recompute": round(re_p50 / sh_p50, 2),
        "kl_mean": round(statistics.fmean(kls), 5), "kl_max": round(max(kls), 5),
        "top1_agreement": round(statistics.fmean(r["top1_agree"] for r in out_rows), 3),
        "greedy_match_mean": round(statistics.fmean(r["greedy_match"] for r in out_rows), 1),
        # Over every generated position whose prefix both replies share.
        "positions_compared": sum(r["positions"] for r in out_rows),
        "top1_agreement_positions": round(sum(r["positions_top1_agree"] for r in out_rows) /
                                          sum(r["positions"] for r in out_rows), 3),
        "kl_mean_positions": round(sum(r.pop("positions_kl_sum") for r in out_rows) /
                                   sum(r["positions"] for r in out_rows), 5),
        "moved_share_of_kept": round(sum(r["moved_tokens"] for r in out_rows) /
                                     sum(r["kept_tokens"] for r in out_rows), 3),
        "rows": out_rows, "targets": TARGETS,
        "cpus": len(os.sched_getaffinity(0)), "load_avg_1m": os.getloadavg()[0],
    }
