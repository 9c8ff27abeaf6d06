"""Routing simulator: compare the gateway's routing policies on whole traces without a model.

Contract: `simulate(turns, config)` replays prepared turns (`prepare_turns`) through
`num_workers` simulated workers behind `num_gateways` simulated gateways, each routing with
the gateway's own `prefixgate.gateway.routing.Router` over its own `PrefixIndex`, and
returns a `SimResult` with one `TurnRecord` per turn (emulated seconds). Deterministic:
equal inputs give equal results. It models what `prefixgate replay --fleet` runs (real
gateways in front of emulated workers, prefixgate/emulate), so the two agree on hit:

Worker (SimConfig; the emulated worker's model, emulate/engine.py, with the same
`emulate.cache.BlockCache`):
  cache    chained block hashes, at most `capacity_tokens // block_size` blocks, least
           recently used leaves evicted first; blocks of turns being served are locked
           (they may overflow the capacity, counted in `overflow_blocks`)
  prefill  one prompt at a time, first come first served: a turn waits for the prompts
           queued before it, then takes (prompt - cached tokens) / prefill_tokens_per_s
           (`service`: emulate/service.py, the emulated worker's ServiceModel);
           cached = the leading blocks its cache holds when its prefill starts × block size,
           at most prompt - 1 tokens. TTFT = prefill end - arrival.
  transfer a turn the gateway routes with a pull (Router's pull option) starts it at
           arrival: the holder's leading blocks the worker lacks cross the holder's link
           (`transfer_bytes_per_s`, one pull after another: a link's queue) at
           `kv_bytes_per_token`; the holder keeps them locked meanwhile; at the end they
           are stored (and published) on the worker, and the turn joins its prefill queue
           (as a worker does: pull, then queue; emulate/transfer.py); cached = its own
           leading blocks, transferred = the pulled ones it found at its prefill's start.
  decode   batched and never slowing prefill: the first token at the prefill's end, the
           other output tokens `decode_s_per_token` apart (output = the recorded length,
           capped at `max_output_tokens`). E2E = TTFT + (output - 1) × decode_s_per_token.
  publish  a prompt's blocks enter the cache, and the gateways' indexes, when its prefill
           completes (after `event_delay_s`; `publish_at` "finish": only when the request
           ends); when the reply ends the blocks of prompt and reply are stored. `reply_blocks`: "private" (default: the worker's own reply,
           which a replay's next prompt, carrying the recorded reply, does not share) or
           "recorded" (the reply is the trace's: the next turn's prompt reuses it).
  status   the link's rate and KV bytes per token (from the start: the link is known);
           queued prefill tokens (expected uncached tokens of the turns waiting, as at
           their arrival, and the share not yet computed of the one in prefill, counting as cached the blocks the turns ahead of
           them store at their prefill's end: BlockCache.reserve), running (decoding) sequences, KV fill, and its
           rates once a finished request measured them (workerapi/rates.py), as the worker
           reports them; a gateway sees them `status_interval_s` old at most (pushed on
           change); queued: that less its own prefill in it that ended since, plus its own
           turns' uncached prompt tokens sent since and waiting for their first token;
           running: the larger of that less what it saw end since and its own turns in
           flight (as gateway/pool.py's WorkerHandle does).

Gateways: turns go to the gateways in turn (round-robin, as a load balancer in front of
replicas). Each routes by its own index, fed with every worker's events; its routing
predictions (Router.dispatch) reach the other gateways' indexes only with
`shared_predictions` (Redis); with `conversation_ids` False turns carry no conversation
id (routing by cached prefix alone, as for agents). `time_scale` is the fleet's (emulated seconds per wall
second): the gateway's wall-clock constants (prediction TTL, status interval) are
multiplied by it.

Arrivals (ArrivalConfig, as the load generator's, in emulated time): open loop at trace
timestamps / speedup (resampled for a seed other than 0: loadgen.open_arrival_times);
closed loop (`concurrency` conversations, `think_time_s`); Poisson conversation starts.
A user's next turn arrives `think_time_s` plus a turnaround after its reply ends: one of
`turnaround_s` (wall seconds x time_scale, drawn per turn), what the fleet's client and
gateway take to read a reply, send the next turn and route it; with
events delayed (`event_delay_s`), it decides whether a follow-up is routed knowing its
previous turn's blocks.

Bounds (`bounds`): the same turns with instant prefill (no queueing; decoding and think
times as configured, so conversations arrive and end as in the policy runs) through one
cache with unlimited capacity (`infinite_cache`: no routing beats it) and through one LRU
cache holding the workers' combined capacity (`combined_lru`: what routing with perfect
knowledge could expect of that memory; LRU is not optimal, so a policy may land above it).
"""

from __future__ import annotations

import heapq
import itertools
import random
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from prefixgate.emulate.cache import BlockCache
from prefixgate.emulate.engine import PUBLISH_AT, prefill_computed
from prefixgate.emulate.service import (
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_TRANSFER_BYTES_PER_S,
    ServiceModel,
)
from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.routing import (
    POLICIES,
    LoadSnapshot,
    Router,
    RoutingConfig,
    Turn,
    queued_prefill_tokens,
)
from prefixgate.radix import BlockHasher, packed
from prefixgate.replay.loadgen import ArrivalConfig, Limits, open_arrival_times
from prefixgate.replay.metrics import summarize
from prefixgate.replay.plan import FleetPlan, fleet_model, status_interval_ms
from prefixgate.replay.targets import TurnRecord
from prefixgate.replay.traces import Trace, synth_prompt_array
from prefixgate.wire.events import KVEventSink

# Wall seconds a worker's events take to reach the gateways through Redis in the emulated
# fleet: its publisher sends a batch 5 ms after the batch's first event (workerapi/events.py
# RedisPublisher flush_interval_s, so bursts share a round trip), then the round trips to
# Redis and on to the gateways on the fleet's host. Measured (docs/traces.md, "Turnaround
# and event delay"): the turnaround that best separates the follow-ups a gateway routed
# knowing their previous turn's stored event from those it routed blind, 12 ms (243 ms
# emulated at time scale 20, in each of two runs). WatchEvents streams each batch at once (0 here).
REDIS_EVENT_DELAY_S = 0.012
# Wall seconds from a reply's end at its worker to the follow-up's arrival at a worker
# (the client reads the reply and sends the next turn; a gateway tokenizes and routes it),
# as measured in the emulated fleet (docs/traces.md): the deciles of 772 follow-ups (two
# runs), drawn one per follow-up. The race of a follow-up against its previous turn's
# event is decided by these and REDIS_EVENT_DELAY_S together.
FLEET_TURNAROUND_S = (0.0068, 0.0082, 0.0089, 0.0095, 0.0103, 0.0113, 0.0127, 0.0141,
                      0.0171, 0.0266)


@dataclass(frozen=True)
class SimConfig:
    num_workers: int = 8
    capacity_tokens: int = 2_048_000  # per worker
    block_size: int = 512  # tokens per block (= the prepared turns' block size)
    service: ServiceModel = ServiceModel()  # each worker's speed (emulate/service.py)
    routing: RoutingConfig = RoutingConfig()
    arrival: ArrivalConfig = ArrivalConfig(mode="open")
    max_output_tokens: int = 0  # reply cap (the replay's --max-tokens); 0: none
    reply_blocks: str = "private"  # "private" | "recorded" (module docstring)
    num_gateways: int = 1
    shared_predictions: bool = False  # gateways share routing predictions (Redis)
    status_interval_s: float = 0.050  # wall seconds: the gateways' status push interval
    event_delay_s: float = 0.0  # wall seconds from a worker's event to the indexes
    time_scale: float = 1.0  # emulated seconds per wall second (the fleet's)
    publish_at: str = "prefill"  # "prefill" | "finish" (emulate/engine.py)
    conversation_ids: bool = True  # False: turns reach the gateways without their id
    # Wall seconds from a reply's end to the next turn of its user (follow-up or next
    # conversation) arriving, on top of the think time: one drawn per turn, equally likely
    # (seeded with arrival.seed); () for none (the follow-up arrives as the reply ends).
    turnaround_s: tuple[float, ...] = ()
    # Block transfer (module docstring): each worker's link, bytes per emulated second,
    # and the KV bytes of one token; 0 for either: no transfers.
    transfer_bytes_per_s: float = DEFAULT_TRANSFER_BYTES_PER_S
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN

    def __post_init__(self) -> None:
        if self.num_workers < 1 or self.capacity_tokens < self.block_size or self.block_size < 1:
            raise ValueError("need num_workers >= 1 and capacity_tokens >= block_size >= 1")
        if self.publish_at not in PUBLISH_AT:
            raise ValueError(f"publish_at must be prefill or finish, not {self.publish_at!r}")
        if self.reply_blocks not in ("private", "recorded"):
            raise ValueError(f"reply_blocks must be private or recorded, not {self.reply_blocks!r}")
        if self.num_gateways < 1 or self.time_scale <= 0 or self.status_interval_s < 0 \
                or self.event_delay_s < 0 or self.max_output_tokens < 0 \
                or any(t < 0 for t in self.turnaround_s) or self.transfer_bytes_per_s < 0 \
                or self.kv_bytes_per_token < 0:
            raise ValueError("need num_gateways >= 1, time_scale > 0 and non-negative "
                             "intervals, delays and caps")

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
    # (conversation, turn) -> (when it joined its worker's prefill queue, its TTFT from
    # then): the turn as its worker sees it, as the emulated worker's records time it (a
    # pull ends before the worker's engine gets the turn; emulate/engine.py).
    at_worker: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)


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
                  progress: bool = False, hasher: BlockHasher | None = None,
                  vocab_size: int = 32000, max_prompt_tokens: int = 0) -> list[list[SimTurn]]:
    """Turns per conversation. Token traces use their hash ids (the block size is the
    trace's), or, given `hasher`, the hashes of the token ids a replay synthesises for them
    (`synth_prompt_array` with `vocab_size` and `max_prompt_tokens`): exactly the keys a
    gateway with that hasher routes by. Chat traces are tokenized with `tokenizer` (a
    prefixgate ChatTokenizer: chat template + the recorded replies) and hashed in blocks of
    `block_size` (with `hasher` when given)."""
    if not trace.is_chat and hasher is not None:
        if hasher.block_size != trace.block_size:
            raise ValueError(f"hasher block size {hasher.block_size} is not the trace's "
                             f"{trace.block_size}")
        out = []
        for c in trace.conversations:
            turns = []
            for i, t in enumerate(c.turns):
                ids = synth_prompt_array(t, trace.block_size, vocab_size, max_prompt_tokens)
                keys = tuple(hasher.hash_blocks(packed(ids.tobytes())))
                turns.append(SimTurn(c.conversation_id, i, len(ids), t.num_output_tokens,
                                     keys, keys, t.timestamp_s))
            out.append(turns)
        return out
    if not trace.is_chat:
        return [[SimTurn(c.conversation_id, i, t.num_prompt_tokens, t.num_output_tokens,
                         keys, keys, t.timestamp_s)
                 for i, t in enumerate(c.turns) for keys in (chain_ids(t.hash_ids),)]
                for c in trace.conversations]
    if tokenizer is None:
        raise ValueError("simulating a chat trace needs a tokenizer to count its tokens")
    from tqdm import tqdm

    hasher = hasher or BlockHasher(block_size)
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
    __slots__ = ("wid", "cache", "queue", "queued_tokens", "busy", "running", "status",
                 "prefill_rate", "decode_step_s", "prefilling", "link_free_at", "status_at")

    def __init__(self, wid: str, cache: BlockCache) -> None:
        self.wid = wid
        self.cache = cache
        self.queue: deque[_Req] = deque()
        self.queued_tokens = 0  # expected uncached tokens of the turns queued or in prefill
        self.busy = False
        self.prefilling: _Req | None = None
        self.running = 0  # sequences decoding
        # Rates the worker reports once a finished request measured them (workerapi/rates.py).
        self.prefill_rate = 0.0
        self.decode_step_s = 0.0
        self.status: tuple = (0, 0, 0.0, 0.0, 0.0)  # what the gateways last saw
        self.status_at = 0.0  # when it was pushed
        self.link_free_at = 0.0  # when the pulls queued on its outbound link are done


class _Gateway:
    __slots__ = ("index", "router", "in_flight", "in_flight_tokens", "finished_since",
                 "prefilled_since", "tokens_at_status", "export_bytes")

    def __init__(self, cfg: SimConfig, clock) -> None:
        self.index = PrefixIndex(spread_fanout=cfg.routing.spread_fanout,
                                 prediction_ttl_s=cfg.routing.prediction_ttl_s * cfg.time_scale,
                                 clock=clock)
        self.router = Router(cfg.routing, self.index)
        self.in_flight: dict[str, int] = {}
        self.in_flight_tokens: dict[str, int] = {}
        # Per worker, since its last status push: this gateway's turns that ended there and
        # the prompt tokens whose prefill it saw end (gateway/pool.py WorkerHandle).
        self.finished_since: dict[str, int] = {}
        self.prefilled_since: dict[str, int] = {}
        self.tokens_at_status: dict[str, int] = {}  # in_flight_tokens when the status came
        # Bytes of the pulls it routed from each holder, until their turns' first token.
        self.export_bytes: dict[str, int] = {}


class _IndexFeed(KVEventSink):
    """A worker's cache events, delivered to every gateway's index."""

    def __init__(self, sim: _Sim, wid: str) -> None:
        self.sim, self.wid = sim, wid

    def stored(self, parent_hash: int | None, block_hashes: Sequence[int]) -> None:
        self.sim.deliver(lambda ix: ix.stored(self.wid, 1, parent_hash, block_hashes))

    def removed(self, block_hashes: Sequence[int]) -> None:
        self.sim.deliver(lambda ix: ix.removed(self.wid, 1, block_hashes))

    def cleared(self) -> None:
        self.sim.deliver(lambda ix: ix.cleared(self.wid, 1))


@dataclass(slots=True)
class _Req:
    turn: SimTurn
    arrival: float
    gateway: _Gateway
    worker: _Worker
    usable: tuple[int, ...]  # the prompt's blocks a hit may cover (not its last token)
    num_output_tokens: int
    predicted: int = 0  # cached tokens the gateway predicted on its choice
    best_predicted: int = 0  # ... and on the best-cached worker
    pending: int = 0  # uncached prompt tokens the gateway counts until the first token
    expected_uncached: int = 0
    cached: int = 0
    handle: object = None
    ttft: float = 0.0
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    routed: Turn | None = None  # the turn as the gateway routed it (Router.record's too)
    pull_from: int = 0  # pulled blocks: usable[pull_from:pull_to]
    pull_to: int = 0
    predicted_transferred: int = 0
    transferred: int = 0
    export_bytes: int = 0  # what the gateway counts on the holder's link for it
    holder: str = ""
    queued_at: float = 0.0  # when it joined its worker's prefill queue (after any pull)


def _reply_hashes(last: int, n: int) -> list[int]:
    """`n` block hashes standing for a worker's own reply after the block hash `last`
    (equal prompts give equal replies; unrelated to every prompt's blocks)."""
    out = []
    for _ in range(n):
        last = xxhash.xxh3_64_intdigest(last.to_bytes(8, "little"), seed=0x5EB1)
        out.append(last)
    return out


class _Sim:
    def __init__(self, convs: list[list[SimTurn]], cfg: SimConfig, *, ideal: bool = False,
                 capacity_blocks: int | None = None) -> None:
        self.convs, self.cfg, self.ideal = convs, cfg, ideal
        n = 1 if ideal else cfg.num_workers
        capacity = cfg.capacity_blocks if capacity_blocks is None else capacity_blocks
        self.now = 0.0
        self.gateways = [_Gateway(cfg, lambda: self.now)
                         for _ in range(1 if ideal else cfg.num_gateways)]
        self.workers = []
        for i in range(n):
            wid = f"worker-{i}"  # as the emulated fleet names them (tie-breaks hash ids)
            self.workers.append(_Worker(wid, BlockCache(capacity, _IndexFeed(self, wid))))
            for g in self.gateways:
                g.index.reset_worker(wid, 1)
        self.by_id = {w.wid: w for w in self.workers}
        self.events: list = []
        self.seq = 0
        self.records: list[TurnRecord] = []
        self.at_worker: dict[tuple[str, int], tuple[float, float]] = {}
        self.num_arrivals = 0
        # Request -> the conversation turn it releases when done (closed loop, Poisson).
        self._next_of: dict[int, tuple | None] = {}
        self._users: deque | None = None  # closed loop: conversations not started yet
        self.event_delay = 0.0 if ideal else cfg.event_delay_s * cfg.time_scale
        self.turnaround = tuple(t * cfg.time_scale for t in cfg.turnaround_s)
        self._rng = random.Random(cfg.arrival.seed)
        self.status_interval = 0.0 if ideal else cfg.status_interval_s * cfg.time_scale

    def at(self, t: float, fn, *args) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, fn, args))

    def deliver(self, apply, to: Sequence[_Gateway] | None = None) -> None:
        """Apply an index update at every gateway (or `to`), `event_delay` from now."""
        targets = self.gateways if to is None else to
        if self.event_delay:
            self.at(self.now + self.event_delay, lambda: [apply(g.index) for g in targets])
        else:
            for g in targets:
                apply(g.index)

    # -- load, as the gateways see it ---------------------------------------------------

    def _live_status(self, w: _Worker) -> tuple:
        queued, req = w.queued_tokens, w.prefilling
        if req is not None:  # less the part computed
            queued -= prefill_computed(req.expected_uncached, req.prefill_start,
                                       req.prefill_end, self.now)
        return (queued, w.running,
                min(1.0, w.cache.num_blocks / w.cache.capacity_blocks), w.prefill_rate,
                w.decode_step_s)

    def _tick(self) -> None:
        for w in self.workers:
            live = self._live_status(w)
            if live != w.status:  # pushed on change only
                w.status, w.status_at = live, self.now
                for g in self.gateways:
                    g.finished_since[w.wid] = g.prefilled_since[w.wid] = 0
                    g.tokens_at_status[w.wid] = g.in_flight_tokens.get(w.wid, 0)
        if self.events:  # keep ticking while anything else is pending
            self.at(self.now + self.status_interval, self._tick)

    def _loads(self, g: _Gateway) -> list[LoadSnapshot]:
        out = []
        for w in self.workers:
            own = g.in_flight_tokens.get(w.wid, 0)
            if self.status_interval:  # as gateway/pool.py WorkerHandle combines them
                queued, running, fill, rate, step_s = w.status
                computable = (self.now - w.status_at) * rate if rate > 0 else float("inf")
                queued = queued_prefill_tokens(queued, g.prefilled_since.get(w.wid, 0), own,
                                               g.tokens_at_status.get(w.wid, 0), computable)
                running -= g.finished_since.get(w.wid, 0)
            else:
                queued, running, fill, rate, step_s = self._live_status(w)
                queued = max(queued, own)
            out.append(LoadSnapshot(
                w.wid, queued,
                max(running, g.in_flight.get(w.wid, 0)), prefill_tokens_per_s=rate,
                decode_step_s=step_s, prefill_chunk_tokens=0, kv_fill=fill,
                transfer_bytes_per_s=self.cfg.transfer_bytes_per_s,
                kv_bytes_per_token=self.cfg.kv_bytes_per_token,
                export_queued_bytes=g.export_bytes.get(w.wid, 0)))
        return out

    # -- events ------------------------------------------------------------------------

    def arrive(self, conv: list[SimTurn], i: int, chained: bool) -> None:
        cfg, t = self.cfg, conv[i]
        g = self.gateways[self.num_arrivals % len(self.gateways)]
        self.num_arrivals += 1
        turn = Turn(t.num_prompt_tokens, t.conversation_id if cfg.conversation_ids else "",
                    t.block_hashes, cfg.block_size)
        decision = g.router.decide(self._loads(g), turn)
        wid = decision.ranked[0].worker_id
        w = self.by_id[wid]
        g.router.dispatch(turn, wid)
        if cfg.shared_predictions and len(self.gateways) > 1:
            self.deliver(lambda ix: ix.predict(wid, t.block_hashes),
                         [o for o in self.gateways if o is not g])
        out = t.num_output_tokens
        if cfg.max_output_tokens:
            out = min(out, cfg.max_output_tokens)
        req = _Req(t, self.now, g, w, t.block_hashes[:(t.num_prompt_tokens - 1) // cfg.block_size],
                   max(1, out), decision.cached_tokens_of(wid), decision.best_cached_tokens)
        req.routed = turn
        pull = decision.pull_of(wid)
        if pull is not None:
            req.predicted_transferred = pull.num_tokens
            req.holder = pull.holder_id
            req.export_bytes = pull.num_tokens * cfg.kv_bytes_per_token
            g.export_bytes[req.holder] = g.export_bytes.get(req.holder, 0) + req.export_bytes
        req.pending = max(0, t.num_prompt_tokens - req.predicted - req.predicted_transferred)
        g.in_flight[wid] = g.in_flight.get(wid, 0) + 1
        g.in_flight_tokens[wid] = g.in_flight_tokens.get(wid, 0) + req.pending
        self._next_of[id(req)] = (conv, i + 1) if chained and i + 1 < len(conv) else None
        if pull is None or not self._start_pull(req, pull.num_blocks):
            self._enqueue(req)

    def _enqueue(self, req: _Req) -> None:
        """The turn joins its worker's prefill queue (at arrival, or once its pull ended)."""
        w, t = req.worker, req.turn
        req.queued_at = self.now
        req.expected_uncached = t.num_prompt_tokens - w.cache.expected(req.usable) * \
            self.cfg.block_size
        if self.cfg.publish_at == "prefill":  # stored before the turns queued behind it start
            w.cache.reserve(t.block_hashes)
        w.queue.append(req)
        w.queued_tokens += req.expected_uncached
        if not w.busy:
            self._start_prefill(w)

    def _start_pull(self, req: _Req, num_blocks: int) -> bool:
        """Start pulling the leading blocks the holder has (of the first `num_blocks`) that
        the worker lacks; False when there are none (the turn queues at once)."""
        cfg, w, h = self.cfg, req.worker, self.by_id[req.holder]
        own = w.cache.held(req.usable)
        handle, n = h.cache.acquire(req.usable[:num_blocks])  # locked while they are read
        if n <= own:
            h.cache.release(handle)
            return False
        req.pull_from, req.pull_to = own, n
        num_bytes = (n - own) * cfg.block_size * cfg.kv_bytes_per_token
        h.link_free_at = max(self.now, h.link_free_at) + num_bytes / cfg.transfer_bytes_per_s
        self.at(h.link_free_at, self._pull_done, req, handle)
        return True

    def _pull_done(self, req: _Req, holder_handle) -> None:
        self.by_id[req.holder].cache.release(holder_handle)
        # Stored (and published) like computed blocks, locked for the turn until it starts.
        req.handle = req.worker.cache.store(req.handle, req.usable[:req.pull_to])
        self._enqueue(req)

    def _start_prefill(self, w: _Worker) -> None:
        req = w.queue.popleft()
        w.busy = True
        held = req.handle
        req.handle, m = w.cache.acquire(req.usable)
        if held is not None:
            w.cache.release(held)
        bs = self.cfg.block_size
        req.transferred = max(0, min(m, req.pull_to) - req.pull_from) * bs
        req.cached = m * bs - req.transferred
        uncached = req.turn.num_prompt_tokens - req.cached - req.transferred
        dur = 0.0 if self.ideal else self.cfg.service.prefill_s(uncached)
        req.prefill_start, req.prefill_end = self.now, self.now + dur
        w.prefilling = req
        self.at(self.now + dur, self.prefill_done, req)

    def prefill_done(self, req: _Req) -> None:
        w, g = req.worker, req.gateway
        w.busy, w.prefilling = False, None
        w.queued_tokens -= req.expected_uncached
        if self.cfg.publish_at == "prefill":
            req.handle = w.cache.store(req.handle, req.turn.block_hashes)
            w.cache.unreserve(req.turn.block_hashes)
        req.ttft = self.now - req.arrival
        if req.export_bytes:  # the gateway sees the pull ended with the first token
            g.export_bytes[req.holder] -= req.export_bytes
        g.in_flight_tokens[w.wid] -= req.pending
        g.prefilled_since[w.wid] = g.prefilled_since.get(w.wid, 0) + req.pending
        if req.num_output_tokens > 1:
            w.running += 1
            dur = self.cfg.service.decode_s(req.num_output_tokens - 1)
            self.at(self.now + dur, self.decode_done, req)
        else:
            self.decode_done(req)
        if w.queue:
            self._start_prefill(w)

    def decode_done(self, req: _Req) -> None:
        w, g, t, cfg = req.worker, req.gateway, req.turn, self.cfg
        if req.num_output_tokens > 1:
            w.running -= 1
        # Prompt and reply are computed (but the last reply token): their blocks stay.
        if cfg.reply_blocks == "recorded" and t.keep_hashes != t.block_hashes:
            req.handle = w.cache.store(req.handle, t.keep_hashes)
        else:
            full = (t.num_prompt_tokens + req.num_output_tokens - 1) // cfg.block_size
            extra = full - len(t.block_hashes)
            if extra > 0 or cfg.publish_at == "finish":
                last = t.block_hashes[-1] if t.block_hashes else 0
                req.handle = w.cache.store(req.handle, (*t.block_hashes,
                                                        *_reply_hashes(last, max(0, extra))))
        w.cache.release(req.handle)
        g.in_flight[w.wid] -= 1
        g.finished_since[w.wid] = g.finished_since.get(w.wid, 0) + 1
        # The worker measures its rates on finished requests (workerapi/rates.py thresholds).
        if t.num_prompt_tokens - req.cached - req.transferred >= 32:
            w.prefill_rate = cfg.service.prefill_tokens_per_s
        if req.num_output_tokens > 1 and cfg.service.decode_s_per_token:
            w.decode_step_s = cfg.service.decode_s_per_token
        g.router.record(req.routed, w.wid, req.cached)
        self.at_worker[(t.conversation_id, t.turn_index)] = (
            req.queued_at, req.prefill_end - req.queued_at)
        self.records.append(TurnRecord(
            t.conversation_id, t.turn_index, start_s=req.arrival, ttft_s=req.ttft,
            e2e_s=self.now - req.arrival, prompt_tokens=t.num_prompt_tokens,
            cached_tokens=req.cached, transferred_tokens=req.transferred,
            completion_tokens=req.num_output_tokens, worker=w.wid,
            predicted_cached_tokens=req.predicted,
            best_predicted_cached_tokens=req.best_predicted,
            predicted_transferred_tokens=req.predicted_transferred))
        nxt = self._next_of.pop(id(req))
        if nxt is not None:
            self.at(self.now + cfg.arrival.think_time_s + self._turnaround(), self.arrive,
                    nxt[0], nxt[1], True)
        elif self._users is not None and self._users:
            self._start_user_conversation(self._turnaround())

    # -- arrivals ----------------------------------------------------------------------

    def _turnaround(self) -> float:
        """Emulated seconds from a reply's end to its user's next turn arriving."""
        return self._rng.choice(self.turnaround) if self.turnaround else 0.0

    def _start_user_conversation(self, delay: float = 0.0) -> None:
        conv = self._users.popleft()
        self.at(self.now + delay, self.arrive, conv, 0, True)

    def run(self) -> SimResult:
        a = self.cfg.arrival
        convs = [c for c in self.convs if c]
        if a.mode == "open":
            order = []
            for c in convs:
                for i, t in enumerate(c):
                    if t.timestamp_s is None:
                        raise ValueError("open-loop simulation needs a trace with timestamps: "
                                         "use --arrival closed or poisson")
                    order.append((t.timestamp_s, i, c))
            order.sort(key=lambda x: x[0])  # stable: equal times keep the trace's order
            times = open_arrival_times([x[0] for x in order], a.speedup, a.seed)
            for at, (_, i, c) in zip(times, order, strict=True):
                self.at(at, self.arrive, c, i, False)
        elif a.mode == "closed":
            self._users = deque(convs)
            for _ in range(min(a.concurrency, len(convs))):
                self._start_user_conversation()
        else:
            rng, t = random.Random(a.seed), 0.0
            for c in convs:
                t += rng.expovariate(a.rate_per_s)
                self.at(t, self.arrive, c, 0, True)
        if self.status_interval:
            self.at(0.0, self._tick)
        while self.events:
            self.now, _, fn, args = heapq.heappop(self.events)
            fn(*args)
        return SimResult(self.records, self.now, [w.wid for w in self.workers],
                         max((w.cache.overflow_blocks for w in self.workers), default=0),
                         at_worker=self.at_worker)


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


def run_simulations(trace: Trace, plan: FleetPlan, arrival: ArrivalConfig,
                    limits: Limits) -> list[dict]:
    """Every policy of `plan` (default: all the gateway has) at every worker count
    (default: 8) on `trace` under `arrival`; one run each."""
    from tqdm import tqdm

    from prefixgate.replay.fleet import decision_summary

    policies = list(plan.policies) or list(POLICIES)
    try:
        routings = {p: routing_config(p, arrival.seed) for p in policies}
    except ValueError as exc:
        raise SystemExit(f"prefixgate replay: {exc}") from None
    counts = list(plan.worker_counts) or [8]
    # Hash as the emulated fleet's gateways do (prefixgate replay --fleet: same model, so
    # the same fingerprint and the same keys), so the two can be compared turn by turn.
    spec, block_size = fleet_model(trace, plan, limits.max_tokens)
    hasher = BlockHasher(block_size, spec.fingerprint)
    if trace.is_chat:
        from prefixgate.model.catalog import resolve_model
        from prefixgate.model.tokenizer import ChatTokenizer

        tokenizer = ChatTokenizer(resolve_model(plan.tokenizer_model, plan.cache_dir))
        convs = prepare_turns(trace, block_size, tokenizer, plan.progress, hasher=hasher)
    else:
        convs = prepare_turns(trace, hasher=hasher, vocab_size=limits.vocab_size,
                              max_prompt_tokens=limits.max_prompt_tokens)
    gateway_counts = list(plan.gateway_counts) or [1]
    turnaround = FLEET_TURNAROUND_S if plan.turnaround_s is None else plan.turnaround_s
    runs = []
    bar = tqdm(total=len(counts) * (len(policies) * len(gateway_counts) + 1), desc="simulating",
               unit="run", file=sys.stderr, disable=not plan.progress)
    for n in counts:
        base = SimConfig(num_workers=n, capacity_tokens=plan.capacity_tokens,
                         block_size=block_size, service=plan.service, arrival=arrival,
                         max_output_tokens=limits.max_tokens,
                         shared_predictions=plan.redis,
                         event_delay_s=REDIS_EVENT_DELAY_S if plan.redis else 0.0,
                         time_scale=plan.time_scale,
                         status_interval_s=status_interval_ms(plan.time_scale) / 1e3,
                         publish_at=plan.publish_at,
                         conversation_ids=plan.conversation_ids,
                         turnaround_s=turnaround,
                         transfer_bytes_per_s=plan.transfer_bytes_per_s,
                         kv_bytes_per_token=plan.kv_bytes_per_token)
        bnd = bounds(convs, base)
        bar.update(1)
        for policy, gateways in itertools.product(policies, gateway_counts):
            cfg = SimConfig(**{**vars(base), "routing": routings[policy],
                               "num_gateways": gateways})
            res = simulate(convs, cfg)
            bar.update(1)
            records = res.records
            summary = summarize(records, res.duration_s, workers=res.workers)
            summary["decisions"] = decision_summary(records)
            plural = "s" if gateways > 1 else ""
            runs.append({
                "label": f"{policy} x{n}" + (f", {gateways} gateway{plural}"
                                             if len(gateway_counts) > 1 else ""),
                "config": {"trace": plan.trace_path, "simulate": True, "policy": policy,
                           "num_workers": n, "num_gateways": gateways,
                           "capacity_tokens": cfg.capacity_tokens, "block_size": block_size,
                           "prefill_tokens_per_s": cfg.service.prefill_tokens_per_s,
                           "decode_s_per_token": cfg.service.decode_s_per_token,
                           "transfer_bytes_per_s": cfg.transfer_bytes_per_s,
                           "kv_bytes_per_token": cfg.kv_bytes_per_token,
                           "time_scale": cfg.time_scale,
                           "arrival": vars(arrival), "wall_s": res.wall_s,
                           "overflow_blocks": res.overflow_blocks},
                "summary": summary,
                "bounds": bnd,
                "ttft_samples_s": sorted(r.ttft_s for r in records),
                "turns": turn_rows(records, res.at_worker),
            })
    bar.close()
    return runs


def turn_rows(records: list[TurnRecord],
              at_worker: dict[tuple[str, int], tuple[float, float]]) -> list[dict]:
    """One row per simulated turn, in arrival order, with the keys of a fleet run's
    `turns` (replay/fleet.py), so the two runs can be joined turn by turn; emulated
    seconds (`worker_arrival_s`: when it joined its worker's queue, after any pull)."""
    rows = []
    for r in sorted(records, key=lambda r: r.start_s):
        arrival, ttft = at_worker.get((r.conversation_id, r.turn_index), (r.start_s, r.ttft_s))
        rows.append({"conversation_id": r.conversation_id, "turn": r.turn_index,
                     "start_s": round(r.start_s, 4), "status": r.status,
                     "ttft_s": round(r.ttft_s, 4), "e2e_s": round(r.e2e_s, 4),
                     "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                     "transferred_tokens": r.transferred_tokens, "worker": r.worker,
                     "predicted_cached_tokens": r.predicted_cached_tokens,
                     "best_predicted_cached_tokens": r.best_predicted_cached_tokens,
                     "worker_arrival_s": round(arrival, 4),
                     "worker_end_s": round(r.start_s + r.e2e_s, 4),
                     "worker_ttft_s": round(ttft, 4)})
    return rows
