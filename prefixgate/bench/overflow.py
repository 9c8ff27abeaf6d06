"""Overflow stall: engine time of one over-long prompt under keep-system-drop-oldest.

A client may set `context_overflow = keep-system-drop-oldest` per request and send a
prompt far longer than the context, with as many turn starts as it likes. The worker then
plans which turns to drop (prefixgate/model/overflow.py) and looks for the kept turns' KV under
every earlier layout of the conversation (worker/reuse.py) on its engine thread, where
every other request waits. For each prompt size this measures, in one run:

  recompute  the request with shifted_reuse = recompute (no layout search): the baseline;
  shift      the same request with shifted_reuse = shift (the layout search);
  bystander  the latency of a short request submitted right after the overflowing one
             (shift), against the same short request on an idle engine.

The prompts are synthetic chats of `--turn-tokens`-token turns (the model's own
user-turn prefix, then filler), a system prompt of `--system-tokens`, on tiny-random
(a 2048-token context), and the conversation's previous turn is served first so its
layout is cached, as on a live worker. Reported per size: seconds (median of
`--repeats`), shift / recompute, and bystander / idle.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[25_000, 50_000, 100_000],
                        help="prompt sizes in tokens")
    parser.add_argument("--turn-tokens", type=int, default=8,
                        help="tokens per turn (fewer: more turn starts to search)")
    parser.add_argument("--system-tokens", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)


def run(args: argparse.Namespace) -> dict:
    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.overflow import user_turn_prefix
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.wire.protocol import SamplingConfig
    from prefixgate.worker.engine import PagedEngine
    from prefixgate.worker.model_loader import load_model
    from prefixgate.workerapi.api import EngineConfig, Request

    spec = resolve_model("tiny-random")
    tokenizer = ChatTokenizer(spec)
    prefix = user_turn_prefix(tokenizer)
    engine = PagedEngine(load_model(spec), tokenizer, EngineConfig(
        num_blocks=1024, max_context_tokens=spec.max_context_tokens,
        model_fingerprint=spec.fingerprint, turn_prefix=prefix,
        context_overflow="keep-system-drop-oldest", shifted_reuse="shift"))

    def chat(num_tokens: int) -> list[int]:
        filler = max(1, args.turn_tokens - len(prefix))
        turn = [*prefix, *([100] * filler)]
        body = turn * ((num_tokens - args.system_tokens) // len(turn) + 1)
        return [90] * args.system_tokens + body[:num_tokens - args.system_tokens]

    def timed(prompt: list[int], rid: str, **sampling) -> float:
        t0 = time.perf_counter()
        engine.run_to_completion(Request(rid, tuple(prompt), SamplingConfig(
            max_tokens=1, context_overflow="keep-system-drop-oldest", **sampling)))
        return time.perf_counter() - t0

    def bystander(prompt: list[int], rid: str) -> float:
        """Latency of a short request submitted just after `prompt` (shift)."""
        import queue

        done: queue.Queue = queue.Queue()
        engine.submit(Request(rid, tuple(prompt), SamplingConfig(
            max_tokens=1, context_overflow="keep-system-drop-oldest", shifted_reuse="shift")),
            lambda ev: None)
        t0 = time.perf_counter()
        engine.submit(Request(rid + "-short", tuple(range(3, 40)), SamplingConfig(max_tokens=1)),
                      done.put)
        done.get(timeout=600)
        return time.perf_counter() - t0

    rows = []
    try:
        idle = statistics.median(timed(list(range(3, 40)), f"idle{i}")
                                 for i in range(args.repeats))
        for size in args.sizes:
            prompt = chat(size)
            previous = prompt[:len(prompt) - 4 * args.turn_tokens]
            timed(previous, f"prev{size}", shifted_reuse="recompute")  # its layout is cached
            got: dict[str, list[float]] = {"recompute": [], "shift": [], "bystander": []}
            for r in range(args.repeats):
                got["recompute"].append(timed(prompt, f"r{size}.{r}", shifted_reuse="recompute"))
                got["shift"].append(timed(prompt, f"s{size}.{r}", shifted_reuse="shift"))
                got["bystander"].append(bystander(prompt, f"b{size}.{r}"))
            med = {k: statistics.median(v) for k, v in got.items()}
            row = {"prompt_tokens": size, "turn_starts": size // args.turn_tokens,
                   "recompute_s": round(med["recompute"], 4), "shift_s": round(med["shift"], 4),
                   "shift_over_recompute": round(med["shift"] / med["recompute"], 2),
                   "bystander_s": round(med["bystander"], 4),
                   "bystander_over_idle": round(med["bystander"] / idle, 1)}
            print(row, file=sys.stderr)
            rows.append(row)
    finally:
        engine.shutdown()
    return {"benchmark": "overflow", "model": "tiny-random", "idle_short_request_s":
            round(idle, 4), "turn_tokens": args.turn_tokens, "rows": rows}
