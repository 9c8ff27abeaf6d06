"""Routing simulator: compare the gateway's routing policies on whole traces without a model.

Contract: `simulate(turns, config)` replays prepared turns (`prepare_turns`) through
`num_workers` simulated workers, routing each turn with the gateway's own
`prefixgate.gateway.routing.Router` over the gateway's own `PrefixIndex` (fed with the
simulated workers' stored/removed block events, as the gateway's event feed would), and
returns a `SimResult` with one `TurnRecord` per turn (virtual seconds). Deterministic: equal
inputs give equal results.

Simulated worker (SimConfig):
  cache    a prefixgate.radix.RadixTree of the prompt's chained block hashes holding at most
           `capacity_tokens // block_size` blocks, least recently used leaves evicted first;
           blocks of turns being served are locked (they may overflow the capacity, counted
           in `overflow_blocks`)
  prefill  one prompt at a time, first come first served: a turn waits for the prompts
           queued before it, then takes (prompt - cached tokens) / prefill_tokens_per_s;
           cached = the leading blocks its cache holds when its prefill starts × block size,
           at most prompt - 1 tokens. TTFT = prefill end - arrival.
  decode   batched and never slowing prefill: output tokens × decode_s_per_token after the
           prefill. E2E = TTFT + that.
  caching  the prompt's blocks enter the cache when its prefill starts; when the reply ends,
           a chat turn's cache also holds its reply: the blocks of the next turn's prompt
           that cover this prompt plus its reply length.
  load     the router sees, per worker, `num_queued_prefill_tokens` (uncached prompt tokens
           waiting or in prefill) and `num_running_requests` (sequences decoding).

Arrivals (ArrivalConfig, as the load generator's, in virtual time): open loop at trace
timestamps / speedup; closed loop (`concurrency` conversations, `think_time_s`); Poisson
conversation starts.

Bounds (`bounds`): the same turns with instant prefill (no queueing; decoding and think
times as configured, so conversations arrive and end as in the policy runs) through one
cache with unlimited capacity (`infinite_cache`: no routing beats it) and through one LRU
cache holding the workers' combined capacity (`combined_lru`: what routing with perfect
knowledge could expect of that memory; LRU is not optimal, so a policy may land above it).
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.routing import POLICIES, LoadSnapshot, Router, RoutingConfig, Turn
from prefixgate.radix import BlockHasher, RadixTree
from prefixgate.replay.loadgen import ArrivalConfig
from prefixgate.replay.metrics import summarize
from prefixgate.replay.targets import TurnRecord
from prefixgate.replay.traces import Trace


@dataclass(frozen=True)
class SimConfig:
    num_workers: int = 8
    capacity_tokens: int = 2_048_000  # per worker
    block_size: int = 512  # tokens per block (= the prepared turns' block size)
    prefill_tokens_per_s: float = 20_000.0
    decode_s_per_token: float = 0.030
    routing: RoutingConfig = RoutingConfig()
    arrival: ArrivalConfig = ArrivalConfig(mode="open")

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.capacity_tokens < self.block_size or self.block_size < 1:
            raise ValueError("need num_workers >= 1 and capacity_tokens >= block_size >= 1")
        if self.prefill_tokens_per_s <= 0 or self.decode_s_per_token < 0:
            raise ValueError("prefill_tokens_per_s must be > 0 and decode_s_per_token >= 0")

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_tokens // self.block_size


@dataclass(frozen=True, slots=True)
class SimTurn:
    """A turn reduced to what the simulator needs (block hashes, not tokens)."""

    conversation_id: str
    turn_index: int
    num_prompt_tokens: int
    num_output_tokens: int
    block_hashes: tuple[int, ...]  # the prompt's blocks, chained
    keep_hashes: tuple[int, ...]  # blocks cached once the reply is done (prompt [+ reply])
    timestamp_s: float | None = None


@dataclass
class SimResult:
    records: list[TurnRecord] = field(default_factory=list)
    duration_s: float = 0.0
    workers: list[str] = field(default_factory=list)
    overflow_blocks: int = 0  # blocks held beyond capacity because they were locked
    wall_s: float = 0.0


# --- preparing turns ---------------------------------------------------------------------


def chain_ids(hash_ids: Sequence[int]) -> tuple[int, ...]:
    """Chained u64 keys for a trace's block ids, so that a key names its whole prefix even
    if a trace reused an id at another position."""
    out, h = [], 0
    for i in hash_ids:
        h = xxhash.xxh3_64_intdigest(h.to_bytes(8, "little") + (i % 2**64).to_bytes(8, "little"))
        out.append(h)
    return tuple(out)


def prepare_turns(trace: Trace, block_size: int = 16, tokenizer=None,
                  progress: bool = False) -> list[list[SimTurn]]:
    """Turns per conversation. Token traces use their hash ids (the block size is the
    trace's); chat traces are tokenized with `tokenizer` (a prefixgate ChatTokenizer: chat
    template + the recorded replies) and hashed in blocks of `block_size`."""
    if not trace.is_chat:
        return [[SimTurn(c.conversation_id, i, t.num_prompt_tokens, t.num_output_tokens,
                         keys, keys, t.timestamp_s)
                 for i, t in enumerate(c.turns) for keys in (chain_ids(t.hash_ids),)]
                for c in trace.conversations]
    if tokenizer is None:
        raise ValueError("simulating a chat trace needs a tokenizer to count its tokens")
    from tqdm import tqdm

    hasher = BlockHasher(block_size)
    out = []
    convs = trace.conversations
    chunk = 64  # conversations per encode_batch call (the tokenizer batches in Rust)
    bar = tqdm(total=len(convs), desc="tokenizing", unit="conv", file=sys.stderr,
               disable=not progress)
    for lo in range(0, len(convs), chunk):
        group = convs[lo:lo + chunk]
        texts = [tokenizer.render(c.messages(i)) for c in group for i in range(len(c.turns))]
        texts += [t.reply for c in group for t in c.turns]
        encoded = tokenizer.tokenizer.encode_batch(texts, add_special_tokens=False)
        n = len(texts) // 2
        prompt_ids, reply_lens = [e.ids for e in encoded[:n]], [len(e.ids) for e in encoded[n:]]
        k = 0
        for c in group:
            prompts = prompt_ids[k:k + len(c.turns)]
            replies = reply_lens[k:k + len(c.turns)]
            k += len(c.turns)
            hashes = [hasher.hash_blocks(p) for p in prompts]
            turns = []
            for i, p in enumerate(prompts):
                keep = hashes[i]
                if i + 1 < len(prompts):
                    keep = hashes[i + 1][: (len(p) + replies[i]) // block_size]
                turns.append(SimTurn(c.conversation_id, i, len(p), max(1, replies[i]),
                                     tuple(hashes[i]), tuple(keep), c.turns[i].timestamp_s))
            out.append(turns)
        bar.update(len(group))
    bar.close()
    return out


# --- the simulation ----------------------------------------------------------------------


class _Worker:
    __slots__ = ("wid", "cache", "queue", "queued_tokens", "busy", "running", "overflow")

    def __init__(self, wid: str) -> None:
        self.wid = wid
        self.cache: RadixTree[int] = RadixTree(1)  # each block's value is its own hash
        self.queue: deque[_Req] = deque()
        self.queued_tokens = 0
        self.busy = False
        self.running = 0
        self.overflow = 0


@dataclass(slots=True)
class _Req:
    turn: SimTurn
    arrival: float
    worker: _Worker | None = None
    expected_uncached: int = 0
    cached: int = 0
    handle: object = None
    ttft: float = 0.0


class _Sim:
    def __init__(self, convs: list[list[SimTurn]], cfg: SimConfig, *, ideal: bool = False,
                 capacity_blocks: int | None = None) -> None:
        self.convs, self.cfg, self.ideal = convs, cfg, ideal
        n = 1 if ideal else cfg.num_workers
        self.capacity = cfg.capacity_blocks if capacity_blocks is None else capacity_blocks
        self.workers = [_Worker(f"worker-{i:03d}") for i in range(n)]
        self.by_id = {w.wid: w for w in self.workers}
        self.index = PrefixIndex(spread_fanout=cfg.routing.spread_fanout)
        for w in self.workers:
            self.index.reset_worker(w.wid, 1)
        self.router = Router(cfg.routing, self.index)
        self.events: list = []
        self.seq = 0
        self.records: list[TurnRecord] = []
        self.now = 0.0
        # Request -> the conversation turn it releases when done (closed loop, Poisson).
        self._next_of: dict[int, tuple | None] = {}
        self._users: deque | None = None  # closed loop: conversations not started yet

    def at(self, t: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn, args))

    # -- cache, with index events ------------------------------------------------------

    def _store(self, w: _Worker, hashes: Sequence[int]) -> None:
        if not hashes:
            return
        res = w.cache.insert(hashes, hashes)
        if res.num_new_blocks:
            self.index.stored(w.wid, 1, None, hashes)
        self._evict(w)

    def _evict(self, w: _Worker) -> None:
        over = w.cache.num_blocks - self.capacity
        if over > 0:
            gone = w.cache.evict(over)
            if gone:
                self.index.removed(w.wid, 1, gone)
            w.overflow = max(w.overflow, over - len(gone))

    # -- events ------------------------------------------------------------------------

    def arrive(self, conv: list[SimTurn], i: int, chained: bool) -> None:
        t = conv[i]
        req = _Req(t, self.now)
        loads = [LoadSnapshot(w.wid, w.queued_tokens, w.running) for w in self.workers]
        turn = Turn(t.num_prompt_tokens, t.conversation_id, t.block_hashes, self.cfg.block_size)
        choice = self.router.decide(loads, turn).ranked[0]
        self.router.record(turn, choice.worker_id)
        w = req.worker = self.by_id[choice.worker_id]
        m = w.cache.match(t.block_hashes, touch=False).num_blocks
        req.expected_uncached = t.num_prompt_tokens - min(m * self.cfg.block_size,
                                                          t.num_prompt_tokens - 1)
        w.queue.append(req)
        w.queued_tokens += req.expected_uncached
        req_next = (conv, i + 1) if chained and i + 1 < len(conv) else None
        self._next_of[id(req)] = req_next
        if not w.busy:
            self._start_prefill(w)

    def _start_prefill(self, w: _Worker) -> None:
        req = w.queue.popleft()
        w.busy = True
        t = req.turn
        m = w.cache.match(t.block_hashes).num_blocks
        req.cached = min(m * self.cfg.block_size, t.num_prompt_tokens - 1)
        if t.block_hashes:
            res = w.cache.insert(t.block_hashes, t.block_hashes)
            w.cache.lock(res.node)
            req.handle = res.node
            if res.num_new_blocks:
                self.index.stored(w.wid, 1, None, t.block_hashes)
            self._evict(w)
        dur = 0.0 if self.ideal else (t.num_prompt_tokens - req.cached) / self.cfg.prefill_tokens_per_s
        self.at(self.now + dur, self.prefill_done, req)

    def prefill_done(self, req: _Req) -> None:
        w = req.worker
        w.busy = False
        w.queued_tokens -= req.expected_uncached
        req.ttft = self.now - req.arrival
        w.running += 1
        dur = req.turn.num_output_tokens * self.cfg.decode_s_per_token
        self.at(self.now + dur, self.decode_done, req)
        if w.queue:
            self._start_prefill(w)

    def decode_done(self, req: _Req) -> None:
        w, t = req.worker, req.turn
        w.running -= 1
        if req.handle is not None:
            w.cache.unlock(req.handle)
        if t.keep_hashes != t.block_hashes:
            self._store(w, t.keep_hashes)
        else:
            self._evict(w)
        self.records.append(TurnRecord(
            t.conversation_id, t.turn_index, start_s=req.arrival, ttft_s=req.ttft,
            e2e_s=self.now - req.arrival, prompt_tokens=t.num_prompt_tokens,
            cached_tokens=req.cached, completion_tokens=t.num_output_tokens, worker=w.wid))
        nxt = self._next_of.pop(id(req))
        if nxt is not None:
            self.at(self.now + self.cfg.arrival.think_time_s, self.arrive, nxt[0], nxt[1], True)
        elif self._users is not None and self._users:
            self._start_user_conversation()

    # -- arrivals ----------------------------------------------------------------------

    def _start_user_conversation(self) -> None:
        conv = self._users.popleft()
        self.at(self.now, self.arrive, conv, 0, True)

    def run(self) -> SimResult:
        a = self.cfg.arrival
        convs = [c for c in self.convs if c]
        if a.mode == "open":
            for c in convs:
                for i, t in enumerate(c):
                    if t.timestamp_s is None:
                        raise ValueError("open-loop simulation needs a trace with timestamps: "
                                         "use --arrival closed or poisson")
                    self.at(t.timestamp_s / a.speedup, self.arrive, c, i, False)
        elif a.mode == "closed":
            self._users = deque(convs)
            for _ in range(min(a.concurrency, len(convs))):
                self._start_user_conversation()
        else:
            import random

            rng, t = random.Random(a.seed), 0.0
            for c in convs:
                t += rng.expovariate(a.rate_per_s)
                self.at(t, self.arrive, c, 0, True)
        while self.events:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(*args)
        return SimResult(self.records, self.now, [w.wid for w in self.workers],
                         max((w.overflow for w in self.workers), default=0))


def simulate(convs: list[list[SimTurn]], cfg: SimConfig) -> SimResult:
    start = time.perf_counter()
    result = _Sim(convs, cfg).run()
    result.wall_s = time.perf_counter() - start
    return result


def bounds(convs: list[list[SimTurn]], cfg: SimConfig) -> dict[str, float]:
    """Hit rates of the two bounds (module docstring) for `cfg`'s workers and arrivals."""
    out = {}
    for name, capacity in (("infinite_cache", 2**62),
                           ("combined_lru", cfg.capacity_blocks * cfg.num_workers)):
        sim = _Sim(convs, cfg, ideal=True, capacity_blocks=capacity)
        records = sim.run().records
        prompt = sum(r.prompt_tokens for r in records)
        out[name] = sum(r.cached_tokens for r in records) / prompt if prompt else 0.0
    return out


# --- the CLI's --simulate ----------------------------------------------------------------


def _ints(items: Sequence[str]) -> list[int]:
    try:
        return [int(v) for item in items for v in str(item).split(",") if v]
    except ValueError:
        raise SystemExit("prefixgate replay: --sim-workers takes worker counts, e.g. 8,32") from None


def routing_config(spec: str, seed: int | None = None) -> RoutingConfig:
    """`policy[:field=value...]`, e.g. `prefix:shared_prefix_weight=1:load_weight=0.5`: a
    RoutingConfig with those fields set (numbers; ValueError naming what is wrong)."""
    name, *params = spec.split(":")
    fields = {f for f in RoutingConfig.__dataclass_fields__ if f not in ("policy", "seed")}
    kwargs: dict = {}
    for param in params:
        key, _, value = param.partition("=")
        if key not in fields:
            raise ValueError(f"policy {spec!r}: unknown routing field {key!r} (use "
                             f"{', '.join(sorted(fields))})")
        try:
            kwargs[key] = int(value) if value.isdigit() else float(value)
        except ValueError:
            raise ValueError(f"policy {spec!r}: {key} needs a number, got {value!r}") from None
    return RoutingConfig(policy=name, seed=seed, **kwargs)


def run_simulations(trace: Trace, args: argparse.Namespace, *, progress: bool = True) -> list[dict]:
    """Every --sim-policies policy at every --sim-workers count on `trace`; one run each."""
    from tqdm import tqdm

    from prefixgate.replay.cli import _appended, arrival_config

    policies = [p for item in _appended(args, "sim_policies") for p in item.split(",") if p] \
        or list(POLICIES)
    try:
        routings = {p: routing_config(p, args.seed) for p in policies}
    except ValueError as exc:
        raise SystemExit(f"prefixgate replay: {exc}") from None
    counts = _ints(_appended(args, "sim_workers")) or [8]
    if trace.is_chat:
        from prefixgate.models import resolve_model
        from prefixgate.tokenizer import ChatTokenizer

        block_size = args.sim_block_size or 16
        tokenizer = ChatTokenizer(resolve_model(args.tokenizer_model))
        convs = prepare_turns(trace, block_size, tokenizer, progress)
    else:
        if args.sim_block_size and args.sim_block_size != trace.block_size:
            raise SystemExit(f"prefixgate replay: a {trace.kind} trace has blocks of "
                             f"{trace.block_size} tokens; --sim-block-size must be that or 0")
        block_size = trace.block_size
        convs = prepare_turns(trace)
    arrival = arrival_config(args, trace)
    runs = []
    bar = tqdm(total=len(counts) * (len(policies) + 1), desc="simulating", unit="run",
               file=sys.stderr, disable=not progress)
    for n in counts:
        base = SimConfig(num_workers=n, capacity_tokens=args.capacity_tokens,
                         block_size=block_size, prefill_tokens_per_s=args.prefill_tokens_per_s,
                         decode_s_per_token=args.decode_s_per_token, arrival=arrival)
        bnd = bounds(convs, base)
        bar.update(1)
        for policy in policies:
            cfg = SimConfig(**{**vars(base), "routing": routings[policy]})
            res = simulate(convs, cfg)
            bar.update(1)
            runs.append({
                "label": f"{policy} x{n}",
                "config": {"trace": args.trace, "simulate": True, "policy": policy,
                           "num_workers": n, "capacity_tokens": cfg.capacity_tokens,
                           "block_size": block_size,
                           "prefill_tokens_per_s": cfg.prefill_tokens_per_s,
                           "decode_s_per_token": cfg.decode_s_per_token,
                           "arrival": vars(arrival), "wall_s": res.wall_s,
                           "overflow_blocks": res.overflow_blocks},
                "summary": summarize(res.records, res.duration_s, workers=res.workers),
                "bounds": bnd,
                "ttft_samples_s": sorted(r.ttft_s for r in res.records),
            })
    bar.close()
    return runs
