"""Worker engine on SmolLM2: prefix-hit TTFT, decode throughput, step costs, KV bytes per token.

The worker runs in `--weights` (default auto: the format a worker picks, q4_1 for SmolLM2
on the CPU); "transformers" below is float32 transformers.

Every figure is compared with a baseline measured in the same run:
- TTFT of a turn whose 1k / 4k-token history is cached, vs the same turn with the prefix
  cache disabled, vs transformers itself with a contiguous DynamicCache already holding
  the history (the unpaged ideal), and the prefill of the new tokens alone (the floor);
- decode tokens/s at batch 1, 8 and 32 vs transformers' own `generate` at batch 1;
- model steps (`steps`, the model runner alone, no scheduler): decode batch 1/8/32 at a
  1k context (aggregate tok/s vs batch 1), and a mixed step (16 decodes + one 256-token
  prefill chunk) vs the same work as two separate steps, per attention backend; wall
  time and process CPU time (CPU time is steadier on a shared machine);
- per weight format (`weights`, bench/weights.py): decode batch 1/8/32 and fidelity
  against float32 on the ShareGPT dev chats; with --llama-cpp-url, llama.cpp's batch-1
  decode on the same GGUF in the same run;
- KV bytes per token, measured from the pool vs 2 x layers x kv_heads x head_dim x bytes;
- multi-turn reuse on real ShareGPT conversations (when ../shared/traces is present):
  the share of turn N's prompt and reply tokens that turn N+1 finds cached.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

from prefixgate.bench import weights

DEFAULT_TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / \
    "sharegpt_multiturn_dev.jsonl.gz"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model to benchmark")
    parser.add_argument("--history-tokens", type=int, nargs="+", default=[1024, 4096],
                        help="cached history lengths for the TTFT comparison")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens of the new message")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per figure")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32],
                        help="decode batch sizes")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per request")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                        help="ShareGPT conversations for the multi-turn reuse measurement")
    parser.add_argument("--conversations", type=int, default=12,
                        help="ShareGPT conversations replayed for the reuse measurement")
    parser.add_argument("--reply-tokens", type=int, default=48,
                        help="most tokens per generated reply in the reuse measurement")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS,
                        help="which figures to measure")
    parser.add_argument("--step-context", type=int, default=1024,
                        help="context tokens of every sequence in the step figures")
    parser.add_argument("--attention-backends", nargs="+", default=["torch", "auto"],
                        help="attention backends compared in the step figures")
    parser.add_argument("--weights", default="auto",
                        help="the worker's weight format for the ttft, decode, steps and reuse "
                             "sections (auto: the worker's default, q4_1 for SmolLM2 on the "
                             "CPU; the weights section measures --weight-formats)")
    parser.add_argument("--step-threads", type=int, default=0,
                        help="torch threads for the step figures (0: unchanged); 1 makes "
                             "CPU time a clean measure of work on a shared machine")
    weights.add_arguments(parser)  # the "weights" section: per weight format (bench/weights.py)


SECTIONS = ("ttft", "decode", "steps", "reuse", "weights")


def _log(msg: str) -> None:
    print(f"[bench worker] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict:
    from prefixgate.workerapi.startup import passive_omp_wait

    passive_omp_wait()  # measure the threads as the worker runs them
    import torch

    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.wire.protocol import SamplingConfig
    from prefixgate.worker.engine import PagedEngine
    from prefixgate.worker.model_loader import WeightsConfig, load_model
    from prefixgate.workerapi.api import EngineConfig, FinalEvent, Request

    spec = resolve_model(args.model)
    tok = ChatTokenizer(spec)
    served = WeightsConfig(args.weights).resolved("cpu", spec)
    _log(f"loading {spec.name} ({served.weights} weights)")
    paged_model, hf_model = load_model(spec, weights=served), load_model(spec)
    max_len = max(args.history_tokens) + args.new_tokens + args.decode_tokens + 64
    num_blocks = max(2 * max(args.batches) * (args.decode_tokens + 200) // 16,
                     4 * max_len // 16) + 64

    def engine(prefix_cache: bool) -> PagedEngine:
        # No EOS: decode exactly the requested number of tokens.
        return PagedEngine(paged_model, tok, EngineConfig(
            num_blocks=num_blocks, enable_prefix_cache=prefix_cache,
            max_context_tokens=spec.max_context_tokens, model_fingerprint=spec.fingerprint))

    cached, uncached = engine(True), engine(False)
    counter = iter(range(10**9))

    def generate(eng: PagedEngine, prompts: list[list[int]], max_tokens: int) -> list[FinalEvent]:
        return eng.run_batch([Request(f"b{next(counter)}", tuple(p),
                                      SamplingConfig(max_tokens=max_tokens)) for p in prompts])

    text_ids = tok.tokenizer.encode(_filler_text(), add_special_tokens=False).ids
    g = torch.Generator().manual_seed(0)

    def fresh(n: int) -> list[int]:
        start = int(torch.randint(0, len(text_ids) - n, (1,), generator=g))
        return text_ids[start:start + n]

    result: dict = {"model": spec.name, "weights_format": served.weights,
                    "torch_threads": torch.get_num_threads(), "ttft": {}}
    for hist_len in args.history_tokens if "ttft" in args.sections else []:
        _log(f"TTFT with a {hist_len}-token history")
        history = fresh(hist_len)
        generate(cached, [history], 1)  # caches the history
        timings: dict[str, list[float]] = {"cached": [], "uncached": [], "transformers": [],
                                           "floor": []}
        from transformers import DynamicCache

        with torch.inference_mode():
            hf_cache = DynamicCache()
            hf_model(input_ids=torch.tensor([history]), past_key_values=hf_cache, use_cache=True)
        for _ in range(args.repeats):
            new = fresh(args.new_tokens)
            prompt = history + new
            timings["cached"].append(generate(cached, [prompt], 1)[0].ttft_ms)
            timings["uncached"].append(generate(uncached, [prompt], 1)[0].ttft_ms)
            with torch.inference_mode():
                start = time.perf_counter()
                out = hf_model(input_ids=torch.tensor([new]), past_key_values=hf_cache,
                               use_cache=True, logits_to_keep=1)
                int(out.logits[0, -1].argmax())
                timings["transformers"].append((time.perf_counter() - start) * 1e3)
                hf_cache.crop(-len(new))
                start = time.perf_counter()
                int(hf_model(input_ids=torch.tensor([new]), logits_to_keep=1).logits[0, -1].argmax())
                timings["floor"].append((time.perf_counter() - start) * 1e3)
        med = {k: statistics.median(v) for k, v in timings.items()}
        result["ttft"][str(hist_len)] = {
            "cached_ms": round(med["cached"], 2), "uncached_ms": round(med["uncached"], 2),
            "transformers_dynamic_cache_ms": round(med["transformers"], 2),
            "new_tokens_floor_ms": round(med["floor"], 2),
            "speedup_vs_uncached": round(med["uncached"] / med["cached"], 2),
            "ratio_vs_transformers": round(med["cached"] / med["transformers"], 3),
        }
        cached.flush_cache()

    if "decode" in args.sections:
        _log("decode throughput")
        prompt_len = 128
        with torch.inference_mode():
            ids = torch.tensor([fresh(prompt_len)])
            kw = dict(do_sample=False, min_new_tokens=args.decode_tokens, max_new_tokens=args.decode_tokens)
            hf_model.generate(ids, **{**kw, "min_new_tokens": 2, "max_new_tokens": 2})  # warm up
            start = time.perf_counter()
            hf_model.generate(ids, **{**kw, "min_new_tokens": 1, "max_new_tokens": 1})
            t_prefill = time.perf_counter() - start
            start = time.perf_counter()
            hf_model.generate(ids, **kw)
            t_all = time.perf_counter() - start
        hf_rate = (args.decode_tokens - 1) / max(1e-9, t_all - t_prefill)
        decode = {"transformers_generate_batch1_tok_s": round(hf_rate, 1)}
        for batch in args.batches:
            finals = generate(uncached, [fresh(prompt_len) for _ in range(batch)], args.decode_tokens)
            # Aggregate decode rate: tokens after the first, over the time after the last first token.
            span_ms = max(f.total_ms for f in finals) - max(f.ttft_ms for f in finals)
            rate = batch * (args.decode_tokens - 1) / max(1e-9, span_ms / 1e3)
            decode[f"batch{batch}_tok_s"] = round(rate, 1)
        decode["batch1_vs_transformers"] = round(decode.get("batch1_tok_s", 0) / hf_rate, 3)
        if 1 in args.batches and 32 in args.batches:
            decode["batch32_vs_batch1"] = round(decode["batch32_tok_s"] / decode["batch1_tok_s"], 2)
        result["decode"] = decode
    if "steps" in args.sections:
        threads = torch.get_num_threads()
        if args.step_threads:
            torch.set_num_threads(args.step_threads)
        result["steps"] = {be: step_figures(paged_model, args.step_context, args.repeats, be)
                           for be in args.attention_backends}
        result["steps"]["torch_threads"] = torch.get_num_threads()
        torch.set_num_threads(threads)

    if "weights" in args.sections:
        result["weights"] = weights.weight_figures(args, spec, tok, fresh)
    pc = cached.pool.config
    measured = (cached.pool.k.nbytes + cached.pool.v.nbytes) // pc.num_tokens
    result["kv_bytes_per_token"] = {"measured": measured, "formula": pc.bytes_per_token,
                                    "layers": pc.num_layers, "kv_heads": pc.num_kv_heads,
                                    "head_dim": pc.head_dim}
    if "reuse" in args.sections and args.trace.is_file() and args.conversations > 0:
        chat_engine = PagedEngine(paged_model, tok, EngineConfig(
            num_blocks=num_blocks, eos_token_ids=tok.eos_token_ids,
            max_context_tokens=spec.max_context_tokens, model_fingerprint=spec.fingerprint))

        def generate_tokens(eng: PagedEngine, prompt: list[int], max_tokens: int):
            tokens, ev = eng.run_to_completion(Request(
                f"m{next(counter)}", tuple(prompt), SamplingConfig(max_tokens=max_tokens)))
            if tokens and tokens[-1] in tok.eos_token_ids:
                tokens.pop()  # the template closes the reply itself
            return tokens, ev

        result["multi_turn_reuse"] = _multi_turn_reuse(args, tok, chat_engine, generate_tokens,
                                                       spec)
        chat_engine.shutdown()
    cached.shutdown()
    uncached.shutdown()
    sp4 = result["ttft"].get("4096", {})
    decode = result.get("decode", {})
    steps = result.get("steps", {}).get("auto", {})
    result["targets"] = {
        "ttft_speedup_4k_ge_30x": sp4.get("speedup_vs_uncached", 0) >= 30,
        "ttft_vs_transformers_le_1_25x": sp4.get("ratio_vs_transformers", 99) <= 1.25,
        "decode_batch1_ge_0_8x_transformers": decode.get("batch1_vs_transformers", 0) >= 0.8,
        "decode_batch32_ge_5x_batch1": decode.get("batch32_vs_batch1", 0) >= 5,
        "turn_reuse_ge_99pct": result.get("multi_turn_reuse", {}).get("reuse", 0) >= 0.99,
        "mixed_step_le_1_1x_separate": steps.get("mixed", {}).get("ratio_wall", 99) <= 1.1,
        "decode_1k_batch32_ge_8x_batch1": steps.get("decode", {}).get(
            "batch32_vs_batch1_wall", 0) >= 8,
        "decode_batch1_ge_0_5x_llama_cpp": weights.default_over_llama_cpp(result) >= 0.5,
    }
    return result


def step_figures(model, context_tokens: int, repeats: int, backend: str = "auto",
                 batches: tuple[int, ...] = (1, 8, 32), num_mixed_decodes: int = 16,
                 chunk_tokens: int = 256) -> dict:
    """Cost of single model steps on `model` (the model runner alone, no scheduler), all
    sequences at `context_tokens` of context, each in blocks of its own:

    - decode: one step of B decodes for B in `batches`: ms per step, aggregate tok/s,
      batch max(B) vs batch 1 (aggregate rate ratio);
    - mixed: `num_mixed_decodes` decodes plus one `chunk_tokens` prefill chunk (after
      `context_tokens` computed tokens) in one step, vs the same two parts as separate
      steps: ratio = mixed / (decodes + chunk), <= 1 when batching pays.
    Fastest of `repeats` (others' load only ever adds time), wall and process CPU time
    (the latter steadier when others share the machine). K/V contents are random: cost
    does not depend on them."""
    import torch

    from prefixgate.worker.kv_pool import KVPool
    from prefixgate.worker.model_runner import ModelRunner, pool_config_for
    from prefixgate.worker.paged_attention import StepMetadata, resolve_backend

    bs = 16
    per_seq = -(-(context_tokens + chunk_tokens) // bs)
    num_seqs = max(max(batches), num_mixed_decodes + 1)
    pool = KVPool(pool_config_for(model, bs, num_seqs * per_seq))
    pool.k.normal_()
    pool.v.normal_()
    runner = ModelRunner(model, pool)
    name = resolve_backend(backend, pool, model.config.num_attention_heads)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
    g = torch.Generator().manual_seed(0)

    def prepare(seqs: list[tuple[int, int]]):
        """One step over (sequence, new tokens) pairs, each after `context_tokens`."""
        ids, pos, last = [], [], []
        for _, n in seqs:
            ids += torch.randint(0, min(1000, model.config.vocab_size), (n,), generator=g).tolist()
            pos += range(context_tokens, context_tokens + n)
            last.append(len(ids) - 1)
        ctx = [context_tokens + n for _, n in seqs]

        def run() -> None:
            step = StepMetadata.build(pool, [tables[i] for i, _ in seqs], ctx,
                                      [n for _, n in seqs], name)
            runner.forward(ids, pos, step, last)
            if pool.k.is_cuda:  # the step's kernels are queued, not done, until then
                torch.cuda.synchronize()
        return run

    decodes = [(i, 1) for i in range(num_mixed_decodes)]
    chunk = [(num_mixed_decodes, chunk_tokens)]
    steps = {f"batch{b}": prepare([(i, 1) for i in range(b)]) for b in batches}
    steps.update(decodes=prepare(decodes), chunk=prepare(chunk),
                 mixed=prepare(decodes + chunk))
    _log(f"step figures ({name} attention, {context_tokens}-token contexts)")
    # Rounds interleave the kinds, so that load from others hits them alike; the fastest
    # of each kind is kept (load only ever adds time). The first round warms up.
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for r in range(repeats + 1):
        for kind, run in steps.items():
            w, c = time.perf_counter(), time.process_time()
            run()
            w, c = (time.perf_counter() - w) * 1e3, (time.process_time() - c) * 1e3
            if r:
                wall[kind], cpu[kind] = min(wall.get(kind, w), w), min(cpu.get(kind, c), c)
    decode: dict = {f"batch{b}": {"step_ms": round(wall[f"batch{b}"], 1),
                                  "cpu_ms": round(cpu[f"batch{b}"], 1),
                                  "tok_s": round(b / wall[f"batch{b}"] * 1e3, 1)}
                    for b in batches}
    lo, hi = min(batches), max(batches)
    for label, t in (("wall", wall), ("cpu", cpu)):
        decode[f"batch{hi}_vs_batch{lo}_{label}"] = round(
            (hi / t[f"batch{hi}"]) / (lo / t[f"batch{lo}"]), 2)
    mixed: dict = {k: {"step_ms": round(wall[k], 1), "cpu_ms": round(cpu[k], 1)}
                   for k in ("decodes", "chunk", "mixed")}
    for label, t in (("wall", wall), ("cpu", cpu)):
        mixed[f"ratio_{label}"] = round(t["mixed"] / (t["decodes"] + t["chunk"]), 3)
    return {"backend": name, "context_tokens": context_tokens, "decode": decode,
            "mixed": {"num_decodes": num_mixed_decodes, "chunk_tokens": chunk_tokens, **mixed}}


def _multi_turn_reuse(args, tok, engine, generate_tokens, spec) -> dict:
    """Hold real ShareGPT conversations: recorded user messages, replies generated by the
    model (greedy, capped), each turn re-rendered by the chat template. How much of turn
    N's prompt + reply does turn N+1 find cached?"""
    from tqdm import tqdm

    engine.flush_cache()
    reusable = hit = pairs = 0
    with gzip.open(args.trace, "rt") as f:
        convs = [json.loads(line) for _, line in zip(range(args.conversations), f, strict=False)]
    roles = {"human": "user", "system": "system"}
    for conv in tqdm(convs, desc="multi-turn reuse", file=sys.stderr):
        history: list[tuple[str, str]] = []
        previous = 0
        for msg in conv["conversations"]:
            role = roles.get(msg["from"])
            if role is None:  # recorded replies are replaced by the model's own
                continue
            history.append((role, msg["value"]))
            if role != "user":
                continue
            prompt = tok.encode_messages(history)
            if len(prompt) + args.reply_tokens + 1 > spec.max_context_tokens:
                break
            reply, final = generate_tokens(engine, prompt, args.reply_tokens)
            if previous:
                reusable += previous
                hit += min(final.cached_tokens, previous)
                pairs += 1
            previous = len(prompt) + len(reply)
            history.append(("assistant", tok.decode(reply)))
    return {"conversations": len(convs), "turn_pairs": pairs, "reply_tokens": args.reply_tokens,
            "reusable_tokens": reusable, "cached_tokens": hit,
            "reuse": round(hit / reusable, 4) if reusable else 0.0}


def _filler_text() -> str:
    words = ("the of and to in is that for it as was with be by on not he this are or his "
             "from at which but have an they you were her she there had all one word can "
             "what said more some will would make like time about many then them write so "
             "these her long thing see him two has look more day could go come did number "
             "sound no most people my over know water than call first who may down side").split()
    import random

    rng = random.Random(0)
    return " ".join(rng.choice(words) for _ in range(20000))
