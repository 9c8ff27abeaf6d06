"""`prefixgate bench radix`: block hashing, prefix match/insert, eviction and memory.

Workload: conversations of 32k tokens (2,048 blocks of 16) sharing a 1k-token system
prompt, each with a one-block "regenerated reply" branch every 8 blocks, so the tree
has long shared runs and many small leaves. The same token sequences fill

* a worker tree: `RadixTree[int]` keyed by token ids, block_size=16, KV block ids as
  values;
* a gateway index: `OwnerIndex` keyed by chained block hashes (block_size=1), owner
  sets as values.

Queries are a resident conversation's first 8k or 32k tokens plus a 100-token tail
(the new turn). Memory is the tracemalloc-traced Python heap of the built structure
divided by its resident blocks. Progress goes to stderr; `run` returns the JSON document.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable
from typing import Any

from prefixgate.radix import BlockHasher, OwnerIndex, RadixTree

BLOCK_SIZE = 16
CONV_TOKENS = 32_768
SYSTEM_TOKENS = 1_024
BRANCH_EVERY = 8  # blocks between one-block branches
PROMPT_SIZES = (8_192, 32_768)

TARGETS = {
    "hash_match_32k_p50_ms": 2.0,  # gateway: hash + match of a 32k-token prompt
    "evict_1000_blocks_ms": 5.0,  # from a 1M-block tree
    "bytes_per_block": 300.0,  # Python heap per resident block
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="small trees (10k/100k blocks), fewer repeats"
    )
    parser.add_argument("--repeats", type=int, default=0, help="timed repeats (default: auto)")
    parser.add_argument("--seed", type=int, default=0)


def _log(msg: str) -> None:
    print(f"[bench radix] {msg}", file=sys.stderr, flush=True)


def _tokens(rng: random.Random, n: int) -> list[int]:
    # Random 16-bit token ids from bytes: fast, no per-token Python work.
    return array("H", rng.randbytes(2 * n)).tolist()


def _token_array(rng: random.Random, n: int) -> array:
    """Random 16-bit token ids as array('I'), the worker tree's key type."""
    return array("I", array("H", rng.randbytes(2 * n)))


def _pct(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_ms": round(statistics.median(s) * 1e3, 4),
        "p99_ms": round(s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3, 4),
    }


def _time_each(fn: Callable[[Any], Any], inputs: list[Any]) -> list[float]:
    """Seconds taken by fn(x) for each x (inputs are prepared outside the timing)."""
    out = []
    for x in inputs:
        t = time.perf_counter()
        fn(x)
        out.append(time.perf_counter() - t)
    return out


class _Workload:
    """The resident conversations and both structures built from them."""

    def __init__(self, resident_blocks: int, seed: int, trace: bool) -> None:
        rng = random.Random(seed)
        self.rng = rng
        self.hasher = BlockHasher(BLOCK_SIZE, "bench-model", "bench")
        system = _token_array(rng, SYSTEM_TOKENS)
        conv_blocks = CONV_TOKENS // BLOCK_SIZE
        per_conv = conv_blocks + (conv_blocks - SYSTEM_TOKENS // BLOCK_SIZE) // BRANCH_EVERY
        n_convs = max(1, resident_blocks // per_conv)
        # Compact arrays made before tracing starts, so they are not counted as tree heap.
        self.convs = [
            system + _token_array(rng, CONV_TOKENS - SYSTEM_TOKENS) for _ in range(n_convs)
        ]
        next_id = 0

        if trace:
            tracemalloc.start()
        gc.collect()
        base = tracemalloc.get_traced_memory()[0] if trace else 0
        worker: RadixTree[int] = RadixTree(BLOCK_SIZE, key_typecode="I")
        for conv in self.convs:
            # array('I') slices go into the tree without conversion: no temporary ints,
            # which keeps tracemalloc (and the build) fast.
            worker.insert(conv, list(range(next_id, next_id + conv_blocks)))
            next_id += conv_blocks
            for b in range(SYSTEM_TOKENS // BLOCK_SIZE + BRANCH_EVERY, conv_blocks, BRANCH_EVERY):
                branch = conv[: (b - 1) * BLOCK_SIZE] + _token_array(rng, BLOCK_SIZE)
                next_id += worker.insert(branch, list(range(next_id, next_id + b))).num_new_blocks
        self.worker = worker
        if trace:
            gc.collect()
            self.worker_bytes = tracemalloc.get_traced_memory()[0] - base
            base = tracemalloc.get_traced_memory()[0]

        index = OwnerIndex()
        for i, conv in enumerate(self.convs):
            owner = f"worker-{i % 8}"
            hashes = self.hasher.hash_blocks(conv.tolist())
            index.add(hashes, owner)
            for b in range(SYSTEM_TOKENS // BLOCK_SIZE + BRANCH_EVERY, conv_blocks, BRANCH_EVERY):
                parent = hashes[b - 2]
                index.add(
                    hashes[: b - 1] + self.hasher.hash_blocks(_tokens(rng, 16), parent), owner
                )
        self.index = index
        if trace:
            gc.collect()
            self.index_bytes = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()

    def prompt(self, size: int) -> list[int]:
        conv = self.rng.choice(self.convs)
        return conv[: size - 100].tolist() + _tokens(self.rng, 100)


def _bench_hashing(repeats: int) -> dict[str, Any]:
    hasher = BlockHasher(BLOCK_SIZE)
    out = {}
    for size in PROMPT_SIZES:
        tokens = _tokens(random.Random(size), size)
        samples = _time_each(hasher.hash_blocks, [tokens] * repeats)
        med = statistics.median(samples)
        out[f"{size // 1024}k"] = {"tokens_per_s": round(size / med), **_pct(samples)}
    return out


def _bench_tree(w: _Workload, repeats: int) -> dict[str, Any]:
    res: dict[str, Any] = {
        "resident_blocks": w.worker.num_blocks,
        "gateway_resident_blocks": w.index.num_blocks,
    }
    for size in PROMPT_SIZES:
        key = f"{size // 1024}k"
        prompts = [w.prompt(size) for _ in range(repeats)]
        match = _time_each(w.worker.match, prompts)
        gw = _time_each(lambda p: w.index.match_owners(w.hasher.hash_blocks(p)), prompts)
        hashes = [w.hasher.hash_blocks(p) for p in prompts]
        gw_match = _time_each(w.index.match_owners, hashes)
        # Insert: a resident conversation's first half plus fresh tokens, then remove the
        # new blocks again (untimed) so the tree stays as it was.
        ins = []
        for _ in range(repeats):
            conv = w.rng.choice(w.convs)
            seq = conv[: size // 2].tolist() + _tokens(w.rng, size // 2)
            vals = list(range(size // BLOCK_SIZE))
            t = time.perf_counter()
            r = w.worker.insert(seq, vals)
            ins.append(time.perf_counter() - t)
            if r.num_new_blocks:
                w.worker.remove(seq[: (r.num_cached_blocks + 1) * BLOCK_SIZE])
        res[key] = {
            "worker_match": _pct(match),
            "worker_insert": _pct(ins),
            "gateway_match": _pct(gw_match),
            "gateway_hash_and_match": _pct(gw),
        }
    return res


def _bench_evict(w: _Workload, repeats: int, per_call: int = 1000) -> dict[str, Any]:
    tree = w.worker
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        n = len(tree.evict(per_call))
        samples.append(time.perf_counter() - t)
        assert n == per_call
    med = statistics.median(samples)
    return {
        "blocks_per_call": per_call,
        "resident_blocks_before": tree.num_blocks + per_call * repeats,
        **_pct(samples),
        "us_per_block": round(med / per_call * 1e6, 3),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = (10_000, 100_000) if args.quick else (100_000, 1_000_000)
    repeats = args.repeats or (30 if args.quick else 100)
    t0 = time.perf_counter()
    doc: dict[str, Any] = {
        "benchmark": "radix",
        "python": sys.version.split()[0],
        "block_size": BLOCK_SIZE,
        "workload": (
            f"{CONV_TOKENS}-token conversations sharing a {SYSTEM_TOKENS}-token system "
            f"prompt, a 1-block branch every {BRANCH_EVERY} blocks; prompts = a resident "
            "conversation's prefix + 100 new tokens"
        ),
        "quick": bool(args.quick),
        "repeats": repeats,
    }
    _log("hashing")
    doc["hashing"] = _bench_hashing(repeats)
    doc["trees"] = {}
    for size in sizes:
        # tracemalloc slows the build ~5x, so memory is traced on the smaller tree only;
        # the workload repeats one conversation shape, so bytes per block should not
        # depend much on size (not verified at 1M).
        trace = size == sizes[0]
        _log(f"building {size:,}-block trees (tracemalloc {'on' if trace else 'off'})")
        w = _Workload(size, args.seed, trace=trace)
        label = f"{size // 1000}k" if size < 1_000_000 else f"{size // 1_000_000}M"
        _log(f"timing match/insert at {label}")
        entry = _bench_tree(w, repeats)
        if trace:
            doc["memory"] = {
                "traced_resident_blocks": w.worker.num_blocks,
                "worker_bytes_per_block": round(w.worker_bytes / w.worker.num_blocks, 1),
                "gateway_bytes_per_block": round(w.index_bytes / w.index.num_blocks, 1),
            }
        _log(f"evicting at {label}")
        entry["evict"] = _bench_evict(w, max(1, min(20, w.worker.num_blocks // 2000)))
        doc["trees"][label] = entry
        del w
        gc.collect()
    big = doc["trees"][max(doc["trees"], key=lambda k: doc["trees"][k]["resident_blocks"])]
    measured = {
        "hash_match_32k_p50_ms": big["32k"]["gateway_hash_and_match"]["p50_ms"],
        "evict_1000_blocks_ms": big["evict"]["p50_ms"],
        "bytes_per_block": max(
            doc["memory"]["worker_bytes_per_block"], doc["memory"]["gateway_bytes_per_block"]
        ),
    }
    doc["targets"] = {
        name: {
            "target": TARGETS[name],
            "measured": measured[name],
            "pass": measured[name] <= TARGETS[name],
        }
        for name in TARGETS
    }
    doc["all_pass"] = all(t["pass"] for t in doc["targets"].values())
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    return doc
