"""Weight formats on the worker (`prefixgate bench worker`): speed and fidelity per format.

Contract: `add_arguments(parser)` adds this part's flags to `bench worker`;
`weight_figures(args, spec, tok, prompt)` loads the model once per format in
`--weight-formats` (worker/model_loader.WeightsConfig) and returns

  decode    {format: {"batch<B>_tok_s": aggregate decode tokens/s}} for every B in
            `--batches`, through the real engine (prefix cache off, `prompt(128)` token
            prompts, `--decode-tokens` tokens each; the rate counts tokens after each
            request's first over the time after the batch's last first token), plus
            "batch1_vs_float32";
  fidelity  {format: {...}} against float32 on the ShareGPT dev chats (`--trace`): the
            first `--fidelity-conversations` conversations, up to `--fidelity-turns` user
            turns each (history: the recorded messages), float32 greedy replies of
            `--fidelity-tokens` tokens as the reference. Per format:
              greedy_agreement  mean share of the reference reply the format's own greedy
                                reply reproduces before it first differs;
              identical_replies share of turns whose greedy reply is identical;
              top1_agreement    share of reply positions (teacher-forced on the reference
                                reply) where the format's argmax is the reference token;
              mean_kl / max_kl  KL(float32 || format) of the next-token distributions at
                                those positions, nats;
              holds             top1_agreement >= TOP1_MIN and mean_kl <= KL_MAX;
  default_cpu  the format `--weights auto` picks on the CPU for this model;
  quantization_error  {format: largest |dequantized - float32| weight} for q4_1 (0.0:
            lossless, the blocks of the model's GGUF recovered exactly);
  llama_cpp {"batch1_tok_s", "prefixgate_over_llama_cpp"} when `--llama-cpp-url` names a
            running llama.cpp server (OpenAI API): the same prompt as text, streamed,
            the same token count, measured right after prefixgate's figures;
  llama_bench  when `--llama-bench` names llama.cpp's llama-bench binary: batch-1 decode
            of every format and of llama-bench on the model's GGUF (`spec.gguf_path`),
            taken alternately `--alternations` times (format 1, format 2, ...,
            llama-bench; again), with the same thread count (torch's), a 128-token
            context before the `--decode-tokens` timed tokens on both sides:
            {"threads", "runs", "median_tok_s": {format or "llama.cpp": tok/s},
            "all_tok_s": {...: [each run]}, "median_over_llama_cpp": {format: ratio of
            medians}, "command": llama-bench's command line}. Medians of alternating runs
            keep a shared machine's load swings out of the ratio; llama-bench times
            llama.cpp's bare decode (no server, no sampling), prefixgate's the engine's.
Both models run the worker's own paged path (ModelRunner over a KV pool), so the
figures are the served ones. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Quality bar for a format to be the default (docs/benchmarks.md, "Weight formats"):
# bfloat16, the format GPU serving uses without a second thought, measures well inside
# it; a format past it changes the reply visibly more often than rounding does.
TOP1_MIN = 0.97
KL_MAX = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weight-formats", nargs="+", default=["float32", "bfloat16", "int8", "q4_1"],
                        help="weight formats to measure (float32 is the fidelity reference; "
                             "q4_1-a8, q4_1 with 8-bit activations, is lossy: its fidelity "
                             "decides where it may serve)")
    parser.add_argument("--fidelity-conversations", type=int, default=12,
                        help="ShareGPT conversations for the fidelity figures (0: skip)")
    parser.add_argument("--fidelity-turns", type=int, default=4,
                        help="user turns per conversation for the fidelity figures")
    parser.add_argument("--fidelity-tokens", type=int, default=32,
                        help="greedy reply tokens per turn for the fidelity figures")
    parser.add_argument("--llama-cpp-url", default="",
                        help="a running llama.cpp server (http://HOST:PORT) on the same GGUF: "
                             "its batch-1 decode rate is measured in the same run")
    parser.add_argument("--llama-bench", type=Path, default=None,
                        help="llama.cpp's llama-bench binary: batch-1 decode on the model's "
                             "GGUF with torch's thread count, alternated with every format's "
                             "(medians of --alternations runs each)")
    parser.add_argument("--alternations", type=int, default=5,
                        help="runs per side for --llama-bench, taken alternately")


def _log(msg: str) -> None:
    print(f"[bench worker] {msg}", file=sys.stderr, flush=True)


def weight_figures(args: argparse.Namespace, spec, tok, prompt: Callable[[int], list[int]]
                   ) -> dict:
    from prefixgate.worker.model_loader import WeightsConfig, default_weights, load_model

    formats = list(dict.fromkeys(["float32", *args.weight_formats]))
    models = {}
    out: dict = {"default_cpu": default_weights("cpu", spec), "decode": {}, "fidelity": {},
                 "quantization_error": {}}
    for fmt in formats:
        _log(f"loading {spec.name} as {fmt}")
        models[fmt] = load_model(spec, weights=WeightsConfig(fmt))
        if hasattr(models[fmt], "quantization_error"):  # q4_1: 0.0 = lossless
            out["quantization_error"][fmt] = models[fmt].quantization_error
    prompts = {b: [prompt(128) for _ in range(b)] for b in args.batches}
    for fmt in args.weight_formats if args.batches else ():
        _log(f"decode throughput, {fmt}")
        out["decode"][fmt] = _decode_rates(models[fmt], spec, tok, prompts, args.decode_tokens)
    if "float32" in out["decode"] and 1 in args.batches:
        base = out["decode"]["float32"]["batch1_tok_s"]
        for rates in out["decode"].values():
            rates["batch1_vs_float32"] = round(rates["batch1_tok_s"] / base, 2)
    if args.llama_cpp_url and 1 in args.batches:
        _log(f"decode throughput, llama.cpp at {args.llama_cpp_url}")
        rate = _llama_cpp_decode(args.llama_cpp_url, tok.decode(prompts[1][0]),
                                 args.decode_tokens)
        out["llama_cpp"] = {"batch1_tok_s": round(rate, 1), "prefixgate_over_llama_cpp": {
            fmt: round(r["batch1_tok_s"] / rate, 2) for fmt, r in out["decode"].items()}}
    if args.llama_bench is not None and 1 in args.batches:
        if spec.gguf_path is None:
            raise SystemExit(f"--llama-bench: {spec.name} has no GGUF to run llama.cpp on")
        out["llama_bench"] = _alternate_with_llama_bench(
            {fmt: models[fmt] for fmt in args.weight_formats}, spec, tok, prompts[1][0],
            args.decode_tokens, args.llama_bench, args.alternations)
    if args.fidelity_conversations > 0 and args.trace.is_file():
        turns = _dev_turns(args.trace, tok, args.fidelity_conversations, args.fidelity_turns,
                           spec.max_context_tokens - args.fidelity_tokens - 1)
        out["fidelity"] = _fidelity(models, [f for f in args.weight_formats if f != "float32"],
                                    turns, args.fidelity_tokens)
        out["fidelity_thresholds"] = {"top1_agreement_min": TOP1_MIN, "mean_kl_max": KL_MAX}
    return out


def default_over_llama_cpp(result: dict) -> float:
    """prefixgate's batch-1 decode in the worker's default CPU format over llama.cpp's
    (0.0 when not measured)."""
    weights = result.get("weights", {})
    ratios = weights.get("llama_cpp", {}).get("prefixgate_over_llama_cpp", {})
    return ratios.get(weights.get("default_cpu", "float32"), 0.0)


def _decode_rates(model, spec, tok, prompts: dict[int, list[list[int]]], num_tokens: int
                  ) -> dict:
    from prefixgate.wire.protocol import SamplingConfig
    from prefixgate.worker.engine import PagedEngine
    from prefixgate.workerapi.api import EngineConfig, Request

    longest = max(prompts)
    engine = PagedEngine(model, tok, EngineConfig(
        num_blocks=longest * ((128 + num_tokens) // 16 + 2) + 16, enable_prefix_cache=False,
        max_num_seqs=max(32, longest), max_context_tokens=spec.max_context_tokens,
        model_fingerprint=spec.fingerprint))
    counter = iter(range(10**9))

    def run(batch: list[list[int]], n: int) -> float:
        finals = engine.run_batch([Request(f"w{next(counter)}", tuple(p),
                                           SamplingConfig(max_tokens=n)) for p in batch], 900)
        span_ms = max(f.total_ms for f in finals) - max(f.ttft_ms for f in finals)
        return len(batch) * (n - 1) / max(1e-9, span_ms / 1e3)

    try:
        run(prompts[min(prompts)][:1], 4)  # warm-up: one-time kernel builds, allocator
        # Best of two: the machine is shared, and a stall only ever slows a run down.
        return {f"batch{b}_tok_s": round(max(run(p, num_tokens) for _ in range(2)), 1)
                for b, p in prompts.items()}
    finally:
        engine.shutdown()


class _Batch1:
    """Batch-1 decode runs of one model through the real engine (as `_decode_rates`)."""

    def __init__(self, model, spec, tok, num_tokens: int) -> None:
        from prefixgate.worker.engine import PagedEngine
        from prefixgate.workerapi.api import EngineConfig

        self.engine = PagedEngine(model, tok, EngineConfig(
            num_blocks=(128 + num_tokens) // 16 + 18, enable_prefix_cache=False,
            max_num_seqs=4, max_context_tokens=spec.max_context_tokens,
            model_fingerprint=spec.fingerprint))
        self.num_tokens, self.count = num_tokens, 0

    def rate(self, prompt: list[int], num_tokens: int | None = None) -> float:
        from prefixgate.wire.protocol import SamplingConfig
        from prefixgate.workerapi.api import Request

        n = num_tokens or self.num_tokens
        self.count += 1
        (final,) = self.engine.run_batch([Request(f"a{self.count}", tuple(prompt),
                                                  SamplingConfig(max_tokens=n))], 900)
        return (n - 1) / max(1e-9, (final.total_ms - final.ttft_ms) / 1e3)


def llama_bench_command(binary: Path, gguf: Path, threads: int, num_tokens: int,
                        context_tokens: int = 128) -> list[str]:
    """llama-bench timing `num_tokens` decoded tokens after `context_tokens` of context,
    once (after its warm-up run), as JSON."""
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0",
            "-n", str(num_tokens), "-d", str(context_tokens), "-r", "1", "-o", "json"]


def _llama_bench_rate(command: list[str]) -> float:
    import subprocess

    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"llama-bench failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    (row,) = json.loads(proc.stdout)
    return float(row["avg_ts"])


def _alternate_with_llama_bench(models: dict, spec, tok, prompt: list[int], num_tokens: int,
                                binary: Path, runs: int) -> dict:
    import statistics

    import torch
    from tqdm import tqdm

    threads = torch.get_num_threads()
    command = llama_bench_command(binary, spec.gguf_path, threads, num_tokens, len(prompt))
    sides = {fmt: _Batch1(m, spec, tok, num_tokens) for fmt, m in models.items()}
    rates: dict[str, list[float]] = {**{fmt: [] for fmt in sides}, "llama.cpp": []}
    try:
        for side in sides.values():
            side.rate(prompt, 4)  # warm-up: kernel builds, allocator
        for _ in tqdm(range(runs), desc="alternating with llama-bench", file=sys.stderr):
            for fmt, side in sides.items():
                rates[fmt].append(round(side.rate(prompt), 1))
            rates["llama.cpp"].append(round(_llama_bench_rate(command), 1))
    finally:
        for side in sides.values():
            side.engine.shutdown()
    medians = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    return {"threads": threads, "runs": runs, "median_tok_s": medians, "all_tok_s": rates,
            "median_over_llama_cpp": {fmt: round(medians[fmt] / medians["llama.cpp"], 2)
                                      for fmt in sides},
            "command": " ".join(command)}


def _llama_cpp_decode(url: str, prompt_text: str, num_tokens: int, repeats: int = 3) -> float:
    """Best decode rate (tokens after the first / time after the first) of `repeats`
    streamed greedy completions of `num_tokens` tokens."""
    import httpx

    best = 0.0
    body = {"prompt": prompt_text, "max_tokens": num_tokens, "temperature": 0.0,
            "stream": True}
    with httpx.Client(timeout=300.0) as client:
        for _ in range(repeats + 1):  # the first one warms its cache of the prompt up
            stamps = []
            with client.stream("POST", url.rstrip("/") + "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                        if any(c.get("text") for c in json.loads(line[5:]).get("choices", ())):
                            stamps.append(time.perf_counter())
            if len(stamps) > 1:
                best = max(best, (len(stamps) - 1) / (stamps[-1] - stamps[0]))
            body["prompt"] = prompt_text + " "  # a different prompt: no whole-prompt reuse
    return best


def _dev_turns(trace: Path, tok, conversations: int, turns: int, max_prompt_tokens: int
               ) -> list[list[int]]:
    """Prompts of the first user turns of the first conversations (recorded history)."""
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    prompts = []
    with gzip.open(trace, "rt") as f:
        for _, line in zip(range(conversations), f, strict=False):
            history: list[tuple[str, str]] = []
            n = 0
            for msg in json.loads(line)["conversations"]:
                role = roles.get(msg["from"])
                if role is None:
                    continue
                history.append((role, msg["value"]))
                if role == "user" and n < turns:
                    ids = tok.encode_messages(history)
                    if len(ids) > max_prompt_tokens:
                        break
                    prompts.append(ids)
                    n += 1
    return prompts


class _Paged:
    """Greedy decoding and teacher-forced logits of one model over a private paged pool
    (the worker's ModelRunner and attention path; one sequence at a time)."""

    def __init__(self, model, max_tokens: int, block_size: int = 16) -> None:
        from prefixgate.worker.kv_pool import KVPool
        from prefixgate.worker.model_runner import ModelRunner, pool_config_for
        from prefixgate.worker.paged_attention import resolve_backend

        num_blocks = max_tokens // block_size + 2
        self.pool = KVPool(pool_config_for(model, block_size, num_blocks))
        self.runner = ModelRunner(model, self.pool)
        self.backend = resolve_backend("auto", self.pool, model.config.num_attention_heads)
        self.table = list(range(num_blocks))

    def _step(self, ids: list[int], start: int, sample: list[int]):
        from prefixgate.worker.paged_attention import StepMetadata

        n = start + len(ids)
        step = StepMetadata.build(self.pool, [self.table], [n], [len(ids)], self.backend)
        return self.runner.forward(ids, list(range(start, n)), step, sample)

    def logits(self, ids: list[int], first: int):
        """Next-token logits [len(ids) - first, vocab] after ids[:first+1] .. ids[:]."""
        return self._step(ids, 0, list(range(first, len(ids))))

    def greedy(self, prompt: list[int], num_tokens: int) -> list[int]:
        out = [int(self._step(prompt, 0, [len(prompt) - 1])[0].argmax())]
        while len(out) < num_tokens:
            out.append(int(self._step(out[-1:], len(prompt) + len(out) - 1, [0])[0].argmax()))
        return out


def _fidelity(models: dict, formats: list[str], prompts: list[list[int]], num_tokens: int
              ) -> dict:
    import torch
    from tqdm import tqdm

    longest = max(len(p) for p in prompts) + num_tokens + 1
    ref = _Paged(models["float32"], longest)
    paged = {fmt: _Paged(models[fmt], longest) for fmt in formats}
    acc = {fmt: {"prefix": 0.0, "identical": 0, "top1": 0, "kl": [], "positions": 0}
           for fmt in formats}
    for prompt in tqdm(prompts, desc="fidelity (turns)", file=sys.stderr):
        reply = ref.greedy(prompt, num_tokens)
        ids = prompt + reply[:-1]
        p_ref = torch.log_softmax(ref.logits(ids, len(prompt) - 1), -1)
        for fmt in formats:
            a = acc[fmt]
            own = paged[fmt].greedy(prompt, num_tokens)
            same = next((i for i, (x, y) in enumerate(zip(own, reply, strict=True)) if x != y),
                        num_tokens)
            a["prefix"] += same / num_tokens
            a["identical"] += same == num_tokens
            p = torch.log_softmax(paged[fmt].logits(ids, len(prompt) - 1), -1)
            a["top1"] += int((p.argmax(-1) == torch.tensor(reply)).sum())
            a["kl"] += (p_ref.exp() * (p_ref - p)).sum(-1).clamp_min(0).tolist()
            a["positions"] += len(reply)
    out = {}
    for fmt, a in acc.items():
        top1, mean_kl = a["top1"] / a["positions"], sum(a["kl"]) / len(a["kl"])
        out[fmt] = {"turns": len(prompts), "positions": a["positions"],
                    "greedy_agreement": round(a["prefix"] / len(prompts), 4),
                    "identical_replies": round(a["identical"] / len(prompts), 4),
                    "top1_agreement": round(top1, 4), "mean_kl": round(mean_kl, 5),
                    "max_kl": round(max(a["kl"]), 4),
                    "holds": top1 >= TOP1_MIN and mean_kl <= KL_MAX}
    return out
