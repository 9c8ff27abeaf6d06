"""`prefixgate bench router`: routing decision latency, Redis round trips per turn, event
ingestion, index memory, and prefix hits with two gateways against one.

Index workload: conversations of 8k tokens (512 blocks of 16) behind a shared 1k-token
system prompt held by every worker; each conversation is held by one worker and carries a
one-block side branch every 32 blocks (the tail of an earlier turn), so paths cross many
nodes, as in a real multi-turn index. Indexes of 10k, 100k and 1M blocks, 8 and 64 workers.

* decision latency: `make_turn` (hashing an 8k-token prompt) + `Router.decide` (prefix
  policy, workers with random loads), half for a resident conversation plus a 100-token
  new turn, half for a new conversation behind the shared system prompt; wall clock and
  the thread's CPU time (on a shared machine, wall-clock tails are mostly time spent
  descheduled). Baseline in the same run: hashing alone (decision / hash ratio).
* Redis round trips per routed turn: the index is bootstrapped from a real redis-server,
  then turns are routed while the server's `total_commands_processed` is watched.
* ingestion: blocks/s a gateway applies from the Redis event stream (and in process, and
  bootstrapping from the ownership hashes), plus the worker side's publish rate.
* memory: tracemalloc-traced Python heap of the index per block.
* two gateways: a multi-turn workload (synthetic: shared system prompt; or `--trace`, a
  recorded one such as the ShareGPT conversations; 32 conversations interleaved) through
  8 simulated LRU workers holding about half the working set; turns go to one gateway, or at random to one of two
  gateways that follow the same Redis stream, or to two gateways that each learn only
  from the turns they routed (replicas without a shared record). Reported: cached prompt
  tokens actually found on the chosen worker, and the loss against one gateway.

Redis parts use `--redis-url`, else a private redis-server started here (skipped with a
note when none is installed). Progress goes to stderr; `run` returns the JSON document.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import sys
import time
import tracemalloc
from array import array
from typing import Any

BLOCK_SIZE = 16
PROMPT_TOKENS = 8_192
SYSTEM_TOKENS = 1_024
BRANCH_EVERY = 32  # blocks between one-block side branches

TARGETS = {
    "decision_p99_ms_at_1M_blocks": 1.0,
    "redis_round_trips_per_turn": 0,
    "two_gateway_hit_loss": 0.01,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="10k/100k blocks, fewer decisions and conversations")
    parser.add_argument("--decisions", type=int, default=0,
                        help="timed decisions per configuration (default: 2000, quick 300)")
    parser.add_argument("--redis-url", default="",
                        help="Redis to use (default: start a private redis-server)")
    parser.add_argument("--conversations", type=int, default=0,
                        help="two-gateway workload size (default: 300, quick 80)")
    parser.add_argument("--trace", default="",
                        help="two-gateway workload from this trace (prefixgate replay's "
                             "formats, e.g. ../shared/traces/sharegpt_multiturn_dev.jsonl.gz) "
                             "instead of the synthetic one")
    parser.add_argument("--model", default="smollm2-135m",
                        help="tokenizer for a chat --trace")
    parser.add_argument("--skip-latency", action="store_true",
                        help="only the Redis and two-gateway parts")
    parser.add_argument("--plot", default="",
                        help="write a PNG: decision latency by index size, and prefix hits "
                             "of one gateway, two sharing Redis, two learning alone")
    parser.add_argument("--seed", type=int, default=0)


def _log(msg: str) -> None:
    print(f"[bench router] {msg}", file=sys.stderr, flush=True)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return array("H", rng.randbytes(2 * n)).tolist()


def _pct(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50_ms": round(statistics.median(s) * 1e3, 4),
            "p99_ms": round(s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3, 4)}


# --------------------------------------------------------------------------- index workload


class _IndexWorkload:
    """Conversations resident in a PrefixIndex (see the module docstring)."""

    def __init__(self, num_blocks: int, num_workers: int, seed: int, trace: bool = False) -> None:
        from prefixgate.gateway.index import PrefixIndex
        from prefixgate.radix import BlockHasher

        rng = self.rng = random.Random(seed)
        self.hasher = BlockHasher(BLOCK_SIZE, "bench-model", "bench")
        self.system = _tokens(rng, SYSTEM_TOKENS)
        self.workers = [f"worker-{i}" for i in range(num_workers)]
        sys_blocks = SYSTEM_TOKENS // BLOCK_SIZE
        conv_blocks = PROMPT_TOKENS // BLOCK_SIZE
        per_conv = conv_blocks - sys_blocks + len(range(sys_blocks + BRANCH_EVERY, conv_blocks,
                                                        BRANCH_EVERY))
        n_convs = max(1, -(-(num_blocks - sys_blocks) // per_conv))
        self.convs = [self.system + _tokens(rng, PROMPT_TOKENS - SYSTEM_TOKENS)
                      for _ in range(n_convs)]
        hashes = [self.hasher.hash_blocks(c) for c in self.convs]
        branches = [[self.hasher.hash_blocks(_tokens(rng, BLOCK_SIZE), h[b - 1])
                     for b in range(sys_blocks + BRANCH_EVERY, conv_blocks, BRANCH_EVERY)]
                    for h in hashes]
        if trace:
            tracemalloc.start()
        gc.collect()
        base = tracemalloc.get_traced_memory()[0] if trace else 0
        index = self.index = PrefixIndex()
        sys_hashes = hashes[0][:sys_blocks]
        for w in self.workers:
            index.stored(w, 1, None, sys_hashes)
        for i, (h, br) in enumerate(zip(hashes, branches, strict=True)):
            owner = self.workers[i % num_workers]
            index.stored(owner, 1, None, h)
            for k, b in enumerate(range(sys_blocks + BRANCH_EVERY, conv_blocks, BRANCH_EVERY)):
                index.stored(owner, 1, h[b - 1], br[k])
        if trace:
            gc.collect()
            self.index_bytes = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()

    def prompts(self, n: int) -> list[list[int]]:
        """Half resident conversations + a new turn, half new conversations."""
        out = []
        for i in range(n):
            if i % 2 == 0:
                conv = self.rng.choice(self.convs)
                out.append(conv[: PROMPT_TOKENS - 100] + _tokens(self.rng, 100))
            else:
                out.append(self.system + _tokens(self.rng, PROMPT_TOKENS - SYSTEM_TOKENS))
        return out


def _latency(sizes: list[int], worker_counts: list[int], decisions: int, seed: int,
             progress: Any) -> list[dict]:
    from prefixgate.gateway.routing import LoadSnapshot, Router, RoutingConfig, make_turn

    out = []
    for size in sizes:
        for nw in worker_counts:
            t0 = time.perf_counter()
            wl = _IndexWorkload(size, nw, seed)
            build_s = time.perf_counter() - t0
            router = Router(RoutingConfig(), wl.index)
            rng = random.Random(seed)
            loads = [LoadSnapshot(w, rng.randrange(0, 4096), rng.randrange(0, 16))
                     for w in wl.workers]
            prompts = wl.prompts(decisions)
            hash_s, decide_s, decide_cpu = [], [], []
            chosen_cached = 0
            for p in progress(prompts, desc=f"{size} blocks, {nw} workers"):
                t = time.perf_counter()
                wl.hasher.hash_blocks(p)
                hash_s.append(time.perf_counter() - t)
                c = time.thread_time()
                t = time.perf_counter()
                d = router.decide(loads, make_turn(p, wl.hasher, ""))
                decide_s.append(time.perf_counter() - t)
                decide_cpu.append(time.thread_time() - c)
                chosen_cached += d.expected_cached_tokens
            row = {"size": size, "indexed_blocks": wl.index.num_blocks, "workers": nw,
                   "decision": _pct(decide_s), "decision_cpu": _pct(decide_cpu),
                   "hash_only": _pct(hash_s),
                   "decision_over_hash_p50": round(statistics.median(decide_s)
                                                   / statistics.median(hash_s), 2),
                   "mean_expected_cached_tokens": round(chosen_cached / len(prompts), 1),
                   "build_s": round(build_s, 2)}
            _log(f"{row['indexed_blocks']} blocks, {nw} workers: decision "
                 f"p50 {row['decision']['p50_ms']} ms, p99 {row['decision']['p99_ms']} ms "
                 f"(CPU time p99 {row['decision_cpu']['p99_ms']} ms)")
            out.append(row)
            del wl, router
            gc.collect()
    return out


# --------------------------------------------------------------------------- Redis


class _Redis:
    """A redis-server for the benchmark: the given URL, or a private one (url "" when
    redis-server is not installed)."""

    def __init__(self, url: str) -> None:
        from prefixgate.launch.redis_server import RedisServer

        self.server: RedisServer | None = None
        self.url = url
        if not url:
            server = RedisServer()
            if server.available():
                self.server = server.start()
                self.url = server.url

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


async def _round_trips_and_ingestion(url: str, seed: int, quick: bool) -> dict:
    import redis.asyncio as aioredis

    from prefixgate.gateway.index import PrefixIndex
    from prefixgate.gateway.redis_feed import RedisStreamFeed
    from prefixgate.gateway.routing import LoadSnapshot, Router, RoutingConfig, make_turn
    from prefixgate.radix import BlockHasher
    from prefixgate.registry import RedisRegistry, WorkerRecord
    from prefixgate.wire.events import OwnershipEvent

    raw = aioredis.Redis.from_url(url)
    await raw.flushall()
    rng = random.Random(seed)
    hasher = BlockHasher(BLOCK_SIZE, "bench-model", "bench")
    reg = RedisRegistry(url, stream_maxlen=10**7)
    workers = [await reg.register(WorkerRecord(f"worker-{i}", "h", "bench-model"), 600_000)
               for i in range(8)]
    n_batches = 200 if quick else 1000
    events_per_batch, blocks_per_event = 10, 16
    # Each event stores a 16-block continuation of a conversation the worker holds.
    heads: dict[str, int | None] = {w.worker_id: None for w in workers}
    batches = []
    for i in range(n_batches):
        w = workers[i % len(workers)]
        evs = []
        for _ in range(events_per_batch):
            parent = heads[w.worker_id] if rng.random() < 0.9 else None
            hs = hasher.hash_blocks(_tokens(rng, blocks_per_event * BLOCK_SIZE), parent)
            heads[w.worker_id] = hs[-1]
            evs.append(OwnershipEvent("store", hs, parent))
        batches.append((w, evs))
    gw_reg = RedisRegistry(url)
    index = PrefixIndex()
    feed = RedisStreamFeed(index, gw_reg, block_ms=1)
    await feed.rebuild()  # an empty stream: follow from its start
    t = time.perf_counter()
    for w, evs in batches:
        await reg.publish(w, evs)
    publish_s = time.perf_counter() - t
    total_blocks = n_batches * events_per_batch * blocks_per_event
    t = time.perf_counter()
    while feed.consumed < n_batches + len(workers):
        await feed.step()
    follow_s = time.perf_counter() - t
    assert index.num_blocks == total_blocks, (index.num_blocks, total_blocks)
    # Bootstrap: a late gateway reads the ownership hashes.
    late = RedisStreamFeed(PrefixIndex(), RedisRegistry(url))
    t = time.perf_counter()
    await late.rebuild()
    bootstrap_s = time.perf_counter() - t
    # In process: the same events straight into an index.
    direct = PrefixIndex()
    t = time.perf_counter()
    for w, evs in batches:
        for ev in evs:
            direct.stored(w.worker_id, w.epoch, ev.parent_hash, ev.block_hashes)
    direct_s = time.perf_counter() - t
    # Round trips per routed turn: nothing else talks to this Redis while turns are routed.
    router = Router(RoutingConfig(), index)
    loads = [LoadSnapshot(w.worker_id) for w in workers]
    n_turns = 1000

    async def processed() -> int:
        return int((await raw.info("stats"))["total_commands_processed"])

    a = await processed()
    b = await processed()  # what one INFO adds by itself
    for _ in range(n_turns):
        router.decide(loads, make_turn(_tokens(rng, 2048), hasher, "c"))
    c = await processed()
    round_trips = ((c - b) - (b - a)) / n_turns
    for r in (reg, gw_reg, late.registry):
        await r.close()
    await raw.aclose()
    return {
        "redis_round_trips_per_turn": round_trips,
        "ingestion": {
            "blocks": total_blocks, "events": n_batches * events_per_batch,
            "batches": n_batches,
            "worker_publish_blocks_per_s": round(total_blocks / publish_s),
            "gateway_stream_blocks_per_s": round(total_blocks / follow_s),
            "gateway_bootstrap_blocks_per_s": round(total_blocks / bootstrap_s),
            "in_process_apply_blocks_per_s": round(total_blocks / direct_s),
        },
    }


# --------------------------------------------------------------------------- two gateways


@dataclasses.dataclass(frozen=True)
class _SimTurn:
    """One turn: the prompt's chained block hashes and what the worker caches after it
    (prompt and reply). Same fields as prefixgate.replay.simulate.SimTurn."""

    num_prompt_tokens: int
    block_hashes: tuple[int, ...]
    keep_hashes: tuple[int, ...]


def _synthetic_conversations(n_convs: int, seed: int) -> list[list[_SimTurn]]:
    """n_convs conversations × 6 turns behind a shared 512-token system prompt; user
    messages 30-200 tokens, replies 50-400."""
    from prefixgate.radix import BlockHasher

    rng = random.Random(seed)
    hasher = BlockHasher(BLOCK_SIZE, "bench-model", "")
    system = _tokens(rng, 512)
    convs = []
    for _ in range(n_convs):
        text, turns = list(system), []
        for _ in range(6):
            prompt = text + _tokens(rng, rng.randrange(30, 200))
            text = prompt + _tokens(rng, rng.randrange(50, 400))
            turns.append(_SimTurn(len(prompt), tuple(hasher.hash_blocks(prompt)),
                                  tuple(hasher.hash_blocks(text))))
        convs.append(turns)
    return convs


def _trace_conversations(path: str, model: str, limit: int) -> list[list[Any]]:
    """A recorded trace's conversations, prepared by the replay tooling."""
    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.replay.simulate import prepare_turns
    from prefixgate.replay.traces import read_trace

    trace = read_trace(path)
    if limit:
        trace = dataclasses.replace(trace, conversations=trace.conversations[:limit])
    tokenizer = ChatTokenizer(resolve_model(model)) if trace.is_chat else None
    return [c for c in prepare_turns(trace, BLOCK_SIZE, tokenizer, progress=True) if c]


async def _two_gateways(url: str, convs: list[list[Any]], seed: int, progress: Any) -> dict:
    """Cached prompt tokens with one gateway, two sharing Redis, two learning alone."""
    import redis.asyncio as aioredis

    from prefixgate.gateway.index import PrefixIndex
    from prefixgate.gateway.redis_feed import RedisStreamFeed
    from prefixgate.gateway.routing import LoadSnapshot, Router, RoutingConfig, Turn
    from prefixgate.radix import RadixTree
    from prefixgate.registry import RedisRegistry, WorkerRecord
    from prefixgate.wire.events import OwnershipEvent

    num_workers, active = 8, 32
    n_convs = len(convs)
    order_rng = random.Random(seed + 1)
    order: list[int] = []  # conversation of each step, interleaved `active` at a time
    pending, nxt, done = list(range(min(active, n_convs))), min(active, n_convs), {}
    while pending:
        c = order_rng.choice(pending)
        order.append(c)
        done[c] = done.get(c, 0) + 1
        if done[c] == len(convs[c]):
            pending.remove(c)
            if nxt < n_convs:
                pending.append(nxt)
                nxt += 1
    working_set = len({h for conv in convs for t in conv for h in t.keep_hashes})
    capacity = max(1, working_set // num_workers // 2)  # the caches hold about half of it
    gateway_of_turn = [random.Random(seed + 2 + i).randrange(2) for i in range(len(order))]
    ids = [f"worker-{i}" for i in range(num_workers)]

    async def one_run(mode: str) -> dict:
        raw = aioredis.Redis.from_url(url)
        await raw.flushall()
        await raw.aclose()
        reg = RedisRegistry(url, stream_maxlen=10**7)
        records = {w: await reg.register(WorkerRecord(w, "h", "bench-model"), 600_000)
                   for w in ids}
        n_gw = 1 if mode == "one" else 2
        indexes = [PrefixIndex() for _ in range(n_gw)]
        routers = [Router(RoutingConfig(), ix) for ix in indexes]
        feeds = []
        if mode != "independent":
            for ix in indexes:
                feed = RedisStreamFeed(ix, RedisRegistry(url), block_ms=1)
                await feed.rebuild()
                feeds.append(feed)
        caches = {w: RadixTree(1) for w in ids}
        loads = [LoadSnapshot(w) for w in ids]
        turn_no = dict.fromkeys(range(n_convs), 0)
        hit_tokens = prompt_tokens = published = 0
        for step, c in enumerate(progress(order, desc=mode)):
            t = convs[c][turn_no[c]]
            turn_no[c] += 1
            g = 0 if n_gw == 1 else gateway_of_turn[step]
            turn = Turn(t.num_prompt_tokens, f"conv-{c}", t.block_hashes, BLOCK_SIZE)
            w = routers[g].decide(loads, turn).ranked[0].worker_id
            routers[g].record(turn, w)
            cache = caches[w]
            cached = cache.match(t.block_hashes).num_blocks * BLOCK_SIZE
            hit_tokens += min(cached, t.num_prompt_tokens - 1)
            prompt_tokens += t.num_prompt_tokens
            # The worker caches prompt and reply, evicting LRU blocks beyond its capacity.
            keep = list(t.keep_hashes)
            m = cache.insert(keep, keep).num_cached_blocks
            events = []
            if m < len(keep):
                events.append(OwnershipEvent("store", keep[m:], keep[m - 1] if m else None))
            over = cache.num_blocks - capacity
            if over > 0:
                events.append(OwnershipEvent("remove", cache.evict(over)))
            if not events:
                continue
            if mode == "independent":  # only the gateway that routed the turn learns of it
                for ev in events:
                    if ev.kind == "store":
                        indexes[g].stored(w, 1, ev.parent_hash, ev.block_hashes)
                    else:
                        indexes[g].removed(w, 1, ev.block_hashes)
                continue
            await reg.publish(records[w], events)
            published += 1
            for feed in feeds:  # the next turn comes long after the stream delivered this
                while feed.consumed < published + num_workers:
                    await feed.step()
        for feed in feeds:
            await feed.registry.close()
        await reg.close()
        return {"prompt_tokens": prompt_tokens, "cached_tokens": hit_tokens,
                "hit_rate": round(hit_tokens / prompt_tokens, 4)}

    runs = {mode: await one_run(mode) for mode in ("one", "shared_redis", "independent")}
    base = runs["one"]["cached_tokens"]
    for mode in ("shared_redis", "independent"):
        runs[mode]["loss_vs_one"] = round(1 - runs[mode]["cached_tokens"] / base, 6)
    return {"workers": num_workers, "conversations": n_convs, "turns": len(order),
            "capacity_blocks_per_worker": capacity, **runs}


# --------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> dict:
    import asyncio

    from tqdm import tqdm

    def progress(items, desc):
        return tqdm(items, desc=desc, file=sys.stderr, leave=False, mininterval=1.0)

    quick = args.quick
    sizes = [10_000, 100_000] if quick else [10_000, 100_000, 1_000_000]
    decisions = args.decisions or (300 if quick else 2000)
    n_convs = args.conversations or (80 if quick else 300)
    out: dict[str, Any] = {"block_size": BLOCK_SIZE, "prompt_tokens": PROMPT_TOKENS,
                           "targets": TARGETS}
    out["latency"] = []
    if not args.skip_latency:
        _log("decision latency")
        out["latency"] = _latency(sizes, [8, 64], decisions, args.seed, progress)
        _log("index memory (tracemalloc, 100k blocks, 8 workers)")
        wl = _IndexWorkload(100_000, 8, args.seed, trace=True)
        out["memory"] = {"indexed_blocks": wl.index.num_blocks,
                         "bytes_per_block": round(wl.index_bytes / wl.index.num_blocks, 1)}
        del wl
        gc.collect()
    redis = _Redis(args.redis_url)
    try:
        if not redis.url:
            out["redis"] = "skipped: no redis-server installed and no --redis-url"
        else:
            _log("Redis round trips per turn and event ingestion")
            out.update(asyncio.run(_round_trips_and_ingestion(redis.url, args.seed, quick)))
            _log("two gateways against one")
            if args.trace:
                convs = _trace_conversations(args.trace, args.model, args.conversations)
            else:
                convs = _synthetic_conversations(n_convs, args.seed)
            out["two_gateways"] = asyncio.run(_two_gateways(redis.url, convs, args.seed,
                                                            progress))
            out["two_gateways"]["workload"] = args.trace or "synthetic"
    finally:
        redis.close()
    if args.plot:
        plot(out, args.plot)
        out["plot"] = args.plot
    at_1m = [r for r in out["latency"] if r["size"] == 1_000_000]
    out["meets"] = {
        "decision_p99_ms_at_1M_blocks": (max(r["decision_cpu"]["p99_ms"] for r in at_1m)
                                         <= TARGETS["decision_p99_ms_at_1M_blocks"]
                                         if at_1m else None),
        "redis_round_trips_per_turn": (out.get("redis_round_trips_per_turn") == 0
                                       if "redis_round_trips_per_turn" in out else None),
        "two_gateway_hit_loss": (out["two_gateways"]["shared_redis"]["loss_vs_one"]
                                 < TARGETS["two_gateway_hit_loss"]
                                 if "two_gateways" in out else None),
    }
    return out


def plot(result: dict, path: str) -> None:
    """PNG of a `run` result: decision latency by index size (p50 wall, p99 CPU time, the
    1 ms target) and, when present, the two-gateway hit rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("latency", "two_gateways") if result.get(k)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "latency":
            for nw, color in ((8, "tab:blue"), (64, "tab:orange")):
                rows = sorted((r for r in result["latency"] if r["workers"] == nw),
                              key=lambda r: r["indexed_blocks"])
                xs = [r["indexed_blocks"] for r in rows]
                ax.plot(xs, [r["decision"]["p50_ms"] for r in rows], "o-", color=color,
                        label=f"{nw} workers, p50")
                ax.plot(xs, [r["decision_cpu"]["p99_ms"] for r in rows], "s--", color=color,
                        label=f"{nw} workers, p99 (CPU time)")
            ax.axhline(1.0, color="gray", linestyle=":", label="target p99 1 ms")
            ax.set_xscale("log")
            ax.set_ylim(bottom=0)
            ax.set_xlabel("indexed blocks")
            ax.set_ylabel("ms per decision (8k-token prompt, hashed)")
            ax.set_title("Routing decision latency")
            ax.legend(fontsize=8)
        else:
            tg = result["two_gateways"]
            modes = [("one", "one gateway"), ("shared_redis", "two gateways,\nshared Redis"),
                     ("independent", "two gateways,\neach learning alone")]
            rates = [tg[m]["hit_rate"] for m, _ in modes]
            bars = ax.bar([label for _, label in modes], rates,
                          color=["tab:green", "tab:blue", "tab:red"])
            for bar, (m, _) in zip(bars, modes, strict=True):
                loss = tg[m].get("loss_vs_one")
                text = f"{tg[m]['hit_rate']:.3f}" + (f"\nloss {loss:.1%}" if loss is not None else "")
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text,
                        ha="center", va="bottom", fontsize=8)
            ax.set_ylim(0, 1.1)
            ax.set_ylabel("share of prompt tokens cached")
            name = str(tg.get("workload", "synthetic")).rsplit("/", 1)[-1]
            ax.set_title(f"Prefix hits, {tg['turns']} turns ({name}), {tg['workers']} workers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
