"""`prefixgate bench gpu`: every GPU check and figure in one run (scripts/gpu_check.sh).

On a CUDA device, against baselines measured in the same run:

  attention   the Triton paged-attention kernel against the torch reference
              (paged_attention.torch_attention) on SmolLM2's geometry (9 heads, 3 KV heads,
              head_dim 64, blocks of 16): a batch of 32 decodes at 4k contexts and a mixed
              step (decodes + a prefill chunk after cached context), bfloat16 KV; max abs
              difference (pass: within `ATTENTION_TOL`) and ms per call of each
  reindex     the Triton re-rotation kernel (worker/kernels/reindex_triton.py) against the
              torch path: max abs difference of the moved K and V (pass: within
              `REINDEX_TOL`), and its bandwidth as a share of a plain gather + copy of the
              same slots (bytes read + written of K and V)
  steps       model steps (bench/worker.py step_figures) per attention backend (torch,
              triton): decode batch 1/8/32 at a 1k context, a mixed step vs separate ones
  engine      the paged engine on the device (the worker's default format and attention
              backend there: bfloat16, Triton): TTFT of a turn whose 4k-token history is
              cached vs the same turn with the prefix cache off, decode tok/s at batch 1
              and 32; and greedy tokens with the cache equal to those without (pass), in
              float32 with the torch attention backend: random weights leave near-ties
              that bfloat16's rounding would flip whatever the cache does (the bfloat16
              engine's share of equal tokens is reported beside it)
  cuda_graphs whether the worker captures CUDA graphs (it does not yet: reported, not run)

The model is SmolLM2-135M's geometry with seeded random weights and the tiny-random
byte-level tokenizer (timings depend on shapes, not on weights; the GGUF is too large to
ship to a bare GPU machine). `--dry-run` (no GPU needed) runs every section on the CPU at
tiny shapes, the Triton kernels in the interpreter: what it proves is that the GPU run will
not stop on an import, an argument or a shape. `passed` is true when every check passed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Agreement within the arithmetic's precision, as torch.testing.assert_close counts it
# (|got - want| <= atol + rtol x |want|): attention reduces in float32 but Triton's dot
# multiplies float32 tiles in TF32 (10-bit mantissa) and bfloat16 queries round the output;
# the re-rotation rounds float32 math back to bfloat16 (one ulp is 2^-8 relative). A wrong
# slot, block or position is off by O(1), far outside either.
ATTENTION_TOL = {"atol": 2e-3, "rtol": 2e-2}
REINDEX_TOL = {"atol": 1e-2, "rtol": 1e-2}
SMOLLM2_GEOMETRY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "hidden_act": "silu", "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny shapes, Triton interpreter: check that the GPU run "
                             "would run (imports, arguments, shapes), measure nothing")
    parser.add_argument("--out", default="", help="also write the JSON document to this file")
    parser.add_argument("--history-tokens", type=int, default=4096,
                        help="cached history of the TTFT figure")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per request")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per figure")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)


SECTIONS = ("attention", "reindex", "steps", "engine", "cuda_graphs")


def _log(msg: str) -> None:
    print(f"[bench gpu] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict:
    import os

    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cpu" and not args.dry_run:
        raise SystemExit("bench gpu: no CUDA device (use --dry-run to check the run on a CPU)")
    out: dict = {"dry_run": args.dry_run, "env": _env(device)}
    small = args.dry_run
    if small:  # shapes the interpreter and a CPU run in seconds
        args.history_tokens, args.decode_tokens, args.repeats = 64, 4, 1
    checks: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="prefixgate-gpu-") as tmp:
        spec = _model(Path(tmp), small)
        if "attention" in args.sections:
            _log("Triton paged attention vs torch")
            out["attention"] = _attention(device, small, args.repeats)
            checks["attention"] = all(c["pass"] for c in out["attention"]["cases"].values())
        if "reindex" in args.sections:
            _log("Triton re-rotation vs torch, bandwidth vs copy")
            out["reindex"] = _reindex(spec, device, small, args.repeats)
            checks["reindex"] = out["reindex"]["pass"]
        if "steps" in args.sections:
            _log("model steps per attention backend")
            out["steps"] = _steps(spec, device, small, args.repeats)
        if "engine" in args.sections:
            _log(f"engine: TTFT at a {args.history_tokens}-token cached history, decode")
            out["engine"] = _engine(spec, device, args)
            checks["greedy_cache_equal"] = out["engine"]["greedy_cache_equal"]
        if "cuda_graphs" in args.sections:
            out["cuda_graphs"] = {"built": False,
                                  "note": "the worker runs steps eagerly; no graph capture"}
    out["checks"] = checks
    out["passed"] = all(checks.values())
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        _log(f"wrote {args.out}")
    return out


def _env(device: str) -> dict:
    import platform

    import torch

    env = {"device": device, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count, cuda=torch.version.cuda)
    return env


def _model(tmp: Path, small: bool):
    """The ModelSpec measured: tiny-random for a dry run, else a checkpoint directory with
    SmolLM2-135M's geometry, seeded random weights and tiny-random's tokenizer."""
    import shutil

    import torch
    from safetensors.torch import save_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from prefixgate.model.catalog import resolve_model

    tiny = resolve_model("tiny-random", tmp / "cache")
    if small:
        return tiny
    model_dir = tmp / "smollm2-geometry"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny.model_dir / name, model_dir / name)
    (model_dir / "config.json").write_text(json.dumps(SMOLLM2_GEOMETRY))
    torch.manual_seed(0)
    save_model(LlamaForCausalLM(LlamaConfig.from_pretrained(str(model_dir))),
               str(model_dir / "model.safetensors"))
    return resolve_model(str(model_dir), tmp / "cache")


def _timed(device: str, repeats: int, fn, *a, **k) -> float:
    """Median seconds of `repeats` calls after a warm-up (synchronised on CUDA)."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn(*a, **k)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*a, **k)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _attention(device: str, small: bool, repeats: int) -> dict:
    import torch

    from prefixgate.worker.kernels.paged_attention_triton import triton_attention
    from prefixgate.worker.kv_pool import KVPool, KVPoolConfig
    from prefixgate.worker.paged_attention import StepMetadata, torch_attention

    heads, kv_heads, head_dim, bs = (4, 2, 16, 8) if small else (9, 3, 64, 16)
    ctx = 40 if small else 4096
    cases = {
        "decode_batch32_ctx4k": [(1, ctx)] * (4 if small else 32),
        "mixed_16_decodes_256_chunk": [(1, ctx)] * (2 if small else 16)
        + [(8 if small else 256, ctx + (8 if small else 256))],
    }
    kv_dtype = torch.float32 if small else torch.bfloat16
    result: dict = {"kv_dtype": str(kv_dtype).removeprefix("torch."), "heads": heads,
                    "kv_heads": kv_heads, "head_dim": head_dim, "cases": {}}
    g = torch.Generator().manual_seed(0)
    for name, seqs in cases.items():
        per_seq = [-(-c // bs) for _, c in seqs]
        pool = KVPool(KVPoolConfig(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim,
                                   block_size=bs, num_blocks=sum(per_seq) + 1, dtype=kv_dtype,
                                   device=device))
        pool.k.copy_(torch.randn(pool.k.shape, generator=g))
        pool.v.copy_(torch.randn(pool.v.shape, generator=g))
        order = torch.randperm(sum(per_seq), generator=g).tolist()  # scattered blocks
        tables, at = [], 0
        for n in per_seq:
            tables.append(order[at:at + n])
            at += n
        step = StepMetadata.build(pool, tables, [c for _, c in seqs], [q for q, _ in seqs])
        num_tokens = sum(q for q, _ in seqs)
        query = torch.randn(num_tokens, heads, head_dim, generator=g).to(device, kv_dtype)
        scale = head_dim ** -0.5
        got = triton_attention(query, pool.k[0], pool.v[0], step, scale)
        want = torch_attention(query, pool.k[0], pool.v[0], step, scale)
        diff = float((got.float() - want.float()).abs().max())
        close = bool(torch.allclose(got.float(), want.float(), **ATTENTION_TOL))
        t_triton = _timed(device, repeats, triton_attention, query, pool.k[0], pool.v[0], step,
                          scale)
        t_torch = _timed(device, repeats, torch_attention, query, pool.k[0], pool.v[0], step,
                         scale)
        result["cases"][name] = {
            "sequences": len(seqs), "query_tokens": num_tokens, "max_abs_diff": diff,
            "pass": close, "triton_ms": round(t_triton * 1e3, 4),
            "torch_ms": round(t_torch * 1e3, 4),
            "triton_speedup": round(t_torch / t_triton, 2)}
    return result


def _reindex(spec, device: str, small: bool, repeats: int) -> dict:
    import torch

    from prefixgate.bench.reindex import _copy_slots
    from prefixgate.worker.kv_pool import KVPool
    from prefixgate.worker.model_loader import load_model
    from prefixgate.worker.model_runner import pool_config_for
    from prefixgate.worker.reindex import RopeSpec, reindex_slots

    model = load_model(spec)  # the geometry and RoPE only; no forward pass
    rope = RopeSpec.from_model(model)
    n, bs = (64, 16) if small else (8192, 16)
    dtype = torch.float32 if small else torch.bfloat16
    cfg = pool_config_for(model, bs, 2 * n // bs + 2)
    cfg = type(cfg)(**{**cfg.__dict__, "dtype": dtype, "device": device})
    pools = [KVPool(cfg), KVPool(cfg)]
    pools[0].k.normal_()
    pools[0].v.normal_()
    pools[1].k.copy_(pools[0].k)
    pools[1].v.copy_(pools[0].v)
    g = torch.Generator().manual_seed(0)
    src = torch.randperm(n, generator=g).to(device)  # scattered sources, fresh destinations
    dst = (n + torch.arange(n)).to(device)
    delta = torch.full((n,), 517).to(device)
    reindex_slots(pools[0], src, dst, delta, rope, backend="torch")
    reindex_slots(pools[1], src, dst, delta, rope, backend="triton")
    pairs = [(p[0][:, dst].float(), p[1][:, dst].float())
             for p in ((pools[0].k, pools[1].k), (pools[0].v, pools[1].v))]
    diff = max(float((a - b).abs().max()) for a, b in pairs)
    close = all(torch.allclose(b, a, **REINDEX_TOL) for a, b in pairs)
    moved = 2 * n * cfg.bytes_per_token  # K and V, each read once and written once
    t_triton = _timed(device, repeats, reindex_slots, pools[1], src, dst, delta, rope,
                      backend="triton")
    t_torch = _timed(device, repeats, reindex_slots, pools[0], src, dst, delta, rope,
                     backend="torch")
    t_copy = _timed(device, repeats, _copy_slots, pools[0], src, dst)
    return {"tokens_per_call": n, "dtype": str(dtype).removeprefix("torch."),
            "bytes_moved": moved, "max_abs_diff": diff, "pass": close,
            "triton_gb_s": float(f"{moved / t_triton / 1e9:.3g}"),
            "torch_gb_s": float(f"{moved / t_torch / 1e9:.3g}"),
            "plain_copy_gb_s": float(f"{moved / t_copy / 1e9:.3g}"),
            "triton_share_of_copy": round(t_copy / t_triton, 3),
            "torch_share_of_copy": round(t_copy / t_torch, 3)}


def _steps(spec, device: str, small: bool, repeats: int) -> dict:
    from prefixgate.bench.worker import step_figures
    from prefixgate.worker.model_loader import WeightsConfig, load_model

    model = load_model(spec, device=device, weights=WeightsConfig("auto").resolved(device))
    context, chunk = (32, 8) if small else (1024, 256)
    out = {be: step_figures(model, context, repeats, be, batches=(1, 2) if small else (1, 8, 32),
                            num_mixed_decodes=2 if small else 16, chunk_tokens=chunk)
           for be in ("torch", "triton")}
    out["context_tokens"] = context
    return out


def _engine(spec, device: str, args: argparse.Namespace) -> dict:
    import torch

    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.wire.protocol import SamplingConfig
    from prefixgate.worker.engine import PagedEngine
    from prefixgate.worker.model_loader import WeightsConfig, load_model
    from prefixgate.workerapi.api import EngineConfig, Request

    tok = ChatTokenizer(spec)
    hist, new, decode = args.history_tokens, 32, args.decode_tokens
    batches = (1, 2) if args.dry_run else (1, 32)
    num_blocks = max(2 * (hist + new + decode), max(batches) * (128 + decode)) // 16 + 64
    context = max(spec.max_context_tokens, hist + new + decode + 16)
    counter = iter(range(10**9))
    g = torch.Generator().manual_seed(0)

    def fresh(n: int) -> list[int]:
        return (torch.randint(3, tok.vocab_size, (n,), generator=g)).tolist()

    def request(prompt: list[int], max_tokens: int) -> Request:
        return Request(f"g{next(counter)}", tuple(prompt), SamplingConfig(max_tokens=max_tokens))

    def pair(weights: str, backend: str):
        """(cached, uncached) engines over one model; no EOS: every request decodes
        exactly the tokens asked for."""
        resolved = WeightsConfig(weights).resolved(device, spec)
        model = load_model(spec, device=device, weights=resolved)
        return resolved.weights, [PagedEngine(model, tok, EngineConfig(
            num_blocks=num_blocks, enable_prefix_cache=cache, max_context_tokens=context,
            model_fingerprint=spec.fingerprint, attention_backend=backend))
            for cache in (True, False)]

    def turns(cached, uncached, history: list[int], repeats: int, max_tokens: int):
        """TTFTs of `repeats` turns (history + new tokens) with the history cached and
        without, and how many of their greedy tokens agree."""
        cached.run_batch([request(history, 1)])  # caches the history (and warms up)
        uncached.run_batch([request(fresh(64), 2)])  # warm-up
        ttft: dict[str, list[float]] = {"cached": [], "uncached": []}
        same = total = 0
        hit = True
        for _ in range(repeats):
            prompt = history + fresh(new)
            a, fa = cached.run_to_completion(request(prompt, max_tokens))
            b, fb = uncached.run_to_completion(request(prompt, max_tokens))
            hit &= fa.cached_tokens >= len(history) - 16 and fb.cached_tokens == 0
            same += sum(x == y for x, y in zip(a, b, strict=True))
            total += len(a)
            ttft["cached"].append(fa.ttft_ms)
            ttft["uncached"].append(fb.ttft_ms)
        return {k: statistics.median(v) for k, v in ttft.items()}, same, total, hit

    fmt, (cached, uncached) = pair("auto", "auto")
    try:
        med, same, total, hit = turns(cached, uncached, fresh(hist), args.repeats, 8)
        out: dict = {"model": "SmolLM2-135M geometry, random weights" if not args.dry_run
                     else spec.name, "weights": fmt,
                     "ttft": {"history_tokens": hist, "new_tokens": new,
                              "cached_ms": round(med["cached"], 2),
                              "uncached_ms": round(med["uncached"], 2),
                              "speedup_vs_uncached": round(med["uncached"] / med["cached"], 2)},
                     "greedy_equal_share": round(same / total, 3), "decode": {}}
        for batch in batches:
            finals = uncached.run_batch([request(fresh(128), decode) for _ in range(batch)])
            span_ms = max(f.total_ms for f in finals) - max(f.ttft_ms for f in finals)
            out["decode"][f"batch{batch}_tok_s"] = round(
                batch * (decode - 1) / max(1e-9, span_ms / 1e3), 1)
        rates = list(out["decode"].values())
        out["decode"]["largest_vs_batch1"] = round(rates[-1] / rates[0], 2)
    finally:
        cached.shutdown()
        uncached.shutdown()
    _, (cached, uncached) = pair("float32", "torch")
    try:
        _, same, total, hit32 = turns(cached, uncached, fresh(hist), 2, 16)
    finally:
        cached.shutdown()
        uncached.shutdown()
    out["greedy_cache_equal"] = bool(hit and hit32 and same == total)
    out["greedy_float32_torch"] = {"tokens": total, "equal": same}
    return out
