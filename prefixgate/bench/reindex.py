"""Shifted KV reuse on context overflow: TTFT and quality per mode, and kernel bandwidth.

Real ShareGPT conversations (recorded replies) are replayed on SmolLM2 under a reduced
context window (default 1024 and 2048 tokens) with the policy keep-system-drop-oldest.
For each conversation the first turn that overflows (and keeps part of the turn before
it) is measured: the previous turn's prompt is served first (so its KV is cached in its
own layout, as a live worker would hold it), then the overflowing turn, once per mode:

  recompute   the baseline: the truncated prompt computed exactly (system prompt reused)
  shift       the kept turns' cached KV moved back by the dropped length (keys re-rotated)
  blend-R     shift, then the first R tokens after the gap recomputed

Per mode: TTFT (median, and the ratio recompute / mode measured in the same run), and
quality against recompute (exact: the full recompute of the truncated prompt): KL
divergence KL(recompute || mode) of the first next-token distribution (mean), top-1
agreement, and how many of 32 greedy tokens match before the first difference (mean).

Kernel: GB/s of the fused gather + rotate K + copy V (torch path on this CPU, SmolLM2's
pool geometry, float32 and bfloat16) against a plain gather + copy of the same slots in
the same run; the Triton kernel runs under TRITON_INTERPRET=1 on the CPU as a correctness
check only (its GPU bandwidth needs a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

DEFAULT_TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / \
    "sharegpt_multiturn_dev.jsonl.gz"
GREEDY_TOKENS = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model to benchmark")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="ShareGPT conversations")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048],
                        help="reduced context windows (tokens) the conversations overflow")
    parser.add_argument("--conversations", type=int, default=4,
                        help="overflowing conversations measured per context")
    parser.add_argument("--blend-tokens", type=int, nargs="+", default=[32, 64],
                        help="R of the blend modes measured")
    parser.add_argument("--max-new-tokens", type=int, default=256,
                        help="skip turns whose new user message is longer (its prefill is "
                             "the same in every mode)")
    parser.add_argument("--kernel-tokens", type=int, default=2048, help="tokens moved per kernel call")
    parser.add_argument("--kernel-repeats", type=int, default=5)
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of KL vs TTFT speedup")


def _log(msg: str) -> None:
    print(f"[bench reindex] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict:
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: the interpreter (before triton loads)
    import torch

    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.worker.model_loader import load_model

    spec = resolve_model(args.model)
    tok = ChatTokenizer(spec)
    _log(f"loading {spec.name}")
    model = load_model(spec)
    out: dict = {"model": spec.name, "torch_threads": torch.get_num_threads(),
                 "modes": ["recompute", "shift", *[f"blend-{r}" for r in args.blend_tokens]]}
    if args.trace.is_file():
        out["quality"] = {str(c): _quality(args, spec, tok, model, c) for c in args.contexts}
        out["target"] = _target(out["quality"])
    else:
        _log(f"{args.trace} not found: quality part skipped")
    out["kernel"] = _kernel(args, model)
    if args.plot and "quality" in out:
        _plot(out["quality"], args.plot)
        out["plot"] = str(args.plot)
    return out


def _conversation_prompts(tok, conv) -> list[list[int]]:
    messages = [("system", conv.system)] if conv.system else []
    prompts = []
    for turn in conv.turns:
        messages.append(("user", turn.user))
        prompts.append(tok.encode_messages(messages))
        messages.append(("assistant", turn.reply))
    return prompts


def _pick_turns(args, tok, context: int, turn_prefix) -> list[tuple[str, list[int], list[int]]]:
    """(conversation id, cached prefix, overflowing prompt) for the first overflowing turn
    of each conversation that keeps more than 64 tokens of the turns before it. The cached
    prefix is that prompt up to its last user message: the previous turn's prompt and
    reply, as the worker that generated the reply holds them (it fits the context)."""
    from prefixgate.model.overflow import find_turn_starts, plan_overflow
    from prefixgate.replay.traces import read_trace

    picked = []
    for conv in read_trace(args.trace, "sharegpt", skip_malformed=True).conversations:
        for prompt in _conversation_prompts(tok, conv)[1:]:
            plan = plan_overflow(prompt, GREEDY_TOKENS, context, turn_prefix)
            if plan is None:
                continue
            history = prompt[:find_turn_starts(prompt, turn_prefix)[-1]]
            kept_of_history = len(history) - plan.n_keep - plan.dropped_tokens
            if plan.fits and len(history) < context and kept_of_history > 64 and \
                    len(prompt) - len(history) <= args.max_new_tokens:
                picked.append((conv.conversation_id, history, prompt))
            break  # only the first overflowing turn: its history is cached unshifted
        if len(picked) == args.conversations:
            break
    return picked


def _quality(args, spec, tok, model, context: int) -> dict:
    import torch
    from tqdm import tqdm

    from prefixgate.model.overflow import user_turn_prefix
    from prefixgate.wire.protocol import SamplingConfig
    from prefixgate.worker.engine import PagedEngine
    from prefixgate.workerapi.api import EngineConfig

    turn_prefix = user_turn_prefix(tok)
    turns = _pick_turns(args, tok, context, turn_prefix)
    _log(f"context {context}: {len(turns)} overflowing turns")
    modes = [("recompute", "recompute", 0), ("shift", "shift", 0),
             *[(f"blend-{r}", "blend", r) for r in args.blend_tokens]]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in modes}
    bar = tqdm(total=len(turns) * len(modes), desc=f"context {context}", file=sys.stderr)
    for name, mode, r in modes:
        engine = PagedEngine(model, tok, EngineConfig(
            num_blocks=6 * context // 16, block_size=16, max_context_tokens=context,
            model_fingerprint=spec.fingerprint, turn_prefix=turn_prefix, eos_token_ids=(),
            context_overflow="keep-system-drop-oldest", shifted_reuse=mode,
            blend_tokens=max(r, 1), max_num_batched_tokens=4096))
        captured: list[torch.Tensor] = []
        forward = engine.runner.forward

        def capture(*a, _forward=forward, _captured=captured, **k):
            logits = _forward(*a, **k)
            if len(logits):
                _captured.append(logits[0].float().clone())
            return logits
        engine.runner.forward = capture
        for conv_id, prev, prompt in turns:
            engine.flush_cache()
            _serve(engine, prev, SamplingConfig(max_tokens=1), "history")
            captured.clear()
            tokens, final = _serve(engine, prompt, SamplingConfig(max_tokens=GREEDY_TOKENS), "turn")
            results[name].append({"conversation": conv_id, "ttft_ms": final.ttft_ms,
                                  "tokens": tokens, "logits": captured[0],
                                  "prompt_tokens": final.prompt_tokens,
                                  "cached_tokens": final.cached_tokens,
                                  "dropped_tokens": final.dropped_tokens,
                                  "new_tokens": len(prompt) - len(prev)})
            bar.update()
        engine.shutdown()
    bar.close()
    return _summarise(results)


def _serve(engine, prompt: list[int], sampling, rid: str):
    from prefixgate.workerapi.api import Request

    return engine.run_to_completion(Request(rid, tuple(prompt), sampling))


def _summarise(results: dict[str, list[dict]]) -> dict:
    base = results["recompute"]
    out: dict = {"turns": [{k: r[k] for k in ("conversation", "prompt_tokens", "dropped_tokens",
                                              "new_tokens")} for r in base]}
    base_ttft = statistics.median(r["ttft_ms"] for r in base) if base else 0.0
    for name, rows in results.items():
        kls, top1, match, speed = [], [], [], []
        for r, b in zip(rows, base, strict=True):
            p = b["logits"].log_softmax(-1)
            q = r["logits"].log_softmax(-1)
            kls.append(float((p.exp() * (p - q)).sum()))
            top1.append(int(p.argmax() == q.argmax()))
            n = next((i for i, (x, y) in enumerate(zip(r["tokens"], b["tokens"], strict=False))
                      if x != y), min(len(r["tokens"]), len(b["tokens"])))
            match.append(n)
            speed.append(b["ttft_ms"] / r["ttft_ms"])
        if not rows:
            continue
        ttft = statistics.median(r["ttft_ms"] for r in rows)
        out[name] = {
            "ttft_ms_median": round(ttft, 1),
            "ttft_speedup_vs_recompute": round(base_ttft / ttft, 2),
            "ttft_speedup_per_turn_median": round(statistics.median(speed), 2),
            "kl_mean": round(statistics.fmean(kls), 5),
            "kl_max": round(max(kls), 5),
            "top1_agreement": round(statistics.fmean(top1), 3),
            f"greedy_match_of_{GREEDY_TOKENS}_mean": round(statistics.fmean(match), 1),
            "cached_tokens_mean": round(statistics.fmean(r["cached_tokens"] for r in rows), 1),
        }
    return out


def _target(quality: dict) -> dict:
    """blend >= 3x faster TTFT than recompute with mean KL <= 0.02, per blend R and context."""
    out = {}
    for context, q in quality.items():
        for name, m in q.items():
            if name.startswith("blend-"):
                out[f"{context}/{name}"] = (m["ttft_speedup_vs_recompute"] >= 3.0
                                            and m["kl_mean"] <= 0.02)
    return out


def _kernel(args, model) -> dict:
    import torch

    from prefixgate.worker.kv_pool import KVPool
    from prefixgate.worker.model_runner import pool_config_for
    from prefixgate.worker.reindex import RopeSpec, reindex_slots, triton_available

    rope = RopeSpec.from_model(model)
    n, bs = args.kernel_tokens, 16
    out: dict = {"tokens_per_call": n, "device": "cpu"}
    for dtype in (torch.float32, torch.bfloat16):
        cfg = pool_config_for(model, bs, 2 * n // bs + 2)
        pool = KVPool(type(cfg)(**{**cfg.__dict__, "dtype": dtype}))
        pool.k.normal_()
        pool.v.normal_()
        src = torch.randperm(n)  # scattered source slots, fresh destination blocks
        dst = n + torch.arange(n)
        delta = torch.full((n,), 517)
        moved = 2 * n * pool.config.bytes_per_token  # K and V read once and written once

        t_rot = _best_time(args.kernel_repeats, reindex_slots, pool, src, dst, delta, rope,
                           backend="torch")
        t_copy = _best_time(args.kernel_repeats, _copy_slots, pool, src, dst)
        name = str(dtype).removeprefix("torch.")
        # Three significant figures, not two decimals: a small model's pool moves few
        # bytes per call, and a rate of 0.004 GB/s must not print as 0.0.
        out[name] = {"torch_gb_s": float(f"{moved / t_rot / 1e9:.3g}"),
                     "plain_copy_gb_s": float(f"{moved / t_copy / 1e9:.3g}"),
                     "torch_vs_copy": round(t_copy / t_rot, 2),
                     "ms_per_call": round(t_rot * 1e3, 2)}
    if triton_available():
        # Correctness only: the interpreter runs the kernel in numpy on the CPU.
        cfg = pool_config_for(model, bs, 4)
        pools = [KVPool(cfg), KVPool(cfg)]
        pools[0].k.normal_()
        pools[0].v.normal_()
        pools[1].k.copy_(pools[0].k)
        pools[1].v.copy_(pools[0].v)
        src, dst, delta = torch.arange(0, 20), torch.arange(30, 50), torch.arange(100, 120)
        reindex_slots(pools[0], src, dst, delta, rope, backend="torch")
        reindex_slots(pools[1], src, dst, delta, rope, backend="triton")
        out["triton_interpreter_max_abs_diff"] = float((pools[0].k - pools[1].k).abs().max())
    out["gpu"] = "not measured: no GPU in this run"
    return out


def _copy_slots(pool, src, dst) -> None:
    """The baseline: the same gather and scatter without the rotation."""
    pool.k[:, dst] = pool.k[:, src]
    pool.v[:, dst] = pool.v[:, src]


def _best_time(repeats: int, fn, *a, **k) -> float:
    fn(*a, **k)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*a, **k)
        best = min(best, time.perf_counter() - t0)
    return best


def _plot(quality: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for context, q in quality.items():
        names = [k for k in q if k not in ("turns", "recompute")]  # the baseline: 1x, KL 0
        xs = [q[k]["ttft_speedup_vs_recompute"] for k in names]
        ys = [max(q[k]["kl_mean"], 1e-6) for k in names]
        ax.scatter(xs, ys, label=f"context {context}")
        for name, x, y in zip(names, xs, ys, strict=True):
            ax.annotate(name, (x, y), fontsize=7)
    ax.axhline(0.02, color="grey", ls="--", lw=0.8)
    ax.axvline(3.0, color="grey", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("TTFT speedup vs recompute (x)")
    ax.set_ylabel("mean KL to recompute (exact)")
    ax.set_title("Shifted KV reuse on SmolLM2 (ShareGPT, overflowing turns)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
