"""Routing policies: rank the candidate workers for one turn, best first (no I/O, no gRPC).

Interface (shared by the gateway and the replay simulator)
----------------------------------------------------------
* `WorkerLoad` (protocol): what the router needs of a worker: `worker_id`,
  `num_queued_prefill_tokens` (prompt tokens admitted but not yet prefilled) and
  `num_running_requests`. `gateway.pool.WorkerHandle` provides it from the worker's last
  status (pushed over WatchStatus, gateway/status.py) less the turns that ended here since,
  and at least this gateway's own in-flight turns; a simulator passes `LoadSnapshot`s.
* `Turn`: one request: its prompt length in tokens, the chained block hashes of its full
  blocks (`make_turn` computes them with the same `BlockHasher` the workers use) and the
  conversation id.
* `PrefixIndex` (gateway/index.py): block hash -> owner workers, fed by worker events.
* `Router(config, index).decide(workers, turn) -> Decision`: every given worker exactly
  once, best first (the gateway tries them in that order: failover before the first token),
  with the predicted cached tokens per worker and the best of them (regret = best minus
  the chosen worker's). `Router.dispatch(turn, worker_id)` says the turn is being sent
  there now: its blocks become *expected* on that worker in the index (predictive
  ownership, gateway/index.py) until the worker's events confirm or drop them.
  `Router.record(turn, worker_id)` tells the router where a turn was served (the
  conversation tie-breaker). `rank` = decide().ranked. The router never calls Redis or
  the network; its state is the conversation map (bounded LRU), the round-robin counter
  and the measured reuse (a window of turns).
* Optional `WorkerLoad` figures, read with defaults when absent (`LoadSnapshot` has them):
  `prefill_tokens_per_s` (0: not measured), `decode_step_s` (0: not measured),
  `prefill_chunk_tokens` (0: a prompt is prefilled alone, decode does not delay it),
  `kv_fill` (used share of the KV cache, 0..1; default 1: full, the steady state),
  `transfer_bytes_per_s` (the rate its block transfers run at; 0: not measured),
  `transfer_setup_s` (the set-up time of one pull into it, whatever its size),
  `kv_bytes_per_token` (KV bytes one cached token takes in its dtype and layout; 0:
  unknown, the worker neither pulls nor is pulled from), `export_queued_bytes` (bytes
  of pulls from it routed and not finished: its link's queue) and `reuse_block_tokens`
  (its engine reuses a cached prefix only in whole multiples of this many tokens; 0: any
  length up to the matched blocks and the last prompt token).

Policies (RoutingConfig.policy)
-------------------------------
  prefix       (default) the worker with the lowest *cost*, in seconds (docs/routing.md):
                 cost = load_weight   * (queue_s + decode_s)
                      + prefix_weight * (prefill_s + miss_s)
               queue_s    prefill queued ahead: queued prefill tokens / the worker's rate
               prefill_s  this turn's uncached prompt tokens / the worker's rate
               decode_s   the decode work running there that delays this prefill: engine
                          steps the prefill needs (tokens / prefill_chunk_tokens) x the
                          worker's decode step time, when it interleaves; without
                          measured figures, running_weight token-equivalents per running
                          sequence
               miss_s     what the choice costs later: the cached tokens it forgoes against
                          the best-cached worker are prefilled again here (duplicates) and
                          evict as many cached tokens of this worker once its cache is full;
                          each evicted token costs its prefill again as often as a cached
                          token is reused, measured over recent turns as the tokens the
                          best-cached workers held over the tokens they lacked (reuses per
                          computed token, `reuse`):
                            miss_s = (best - credited) / rate x reuse x kv_fill
               pull       a third way to serve on a worker: pull the leading blocks it lacks
                          from the best holder (WorkerService block transfer), then prefill
                          the rest. The worker pulls when the turn arrives, then queues
                          it; the prefill queued ahead of it runs meanwhile, so the rest's
                          prefill starts when both are done (turns arriving during the
                          pull may go first: not priced):
                            transfer_s = export_queued_bytes(holder) / bw
                                         + setup_s(worker)
                                         + pulled tokens x kv_bytes_per_token / bw
                            wait_s     = max(queue_s + decode_s, transfer_s)
                            cost       = load_weight x (queue_s + decode_s)
                                       + prefix_weight x (wait_s - queue_s - decode_s
                                                          + rest_s + miss_s)
                          bw: the slower end's measured transfer rate, setup_s the
                          receiver's measured set-up of a pull; holders: workers
                          whose *events* say they hold more leading blocks (a predicted
                          block may not be computed yet); the holder giving the lowest
                          cost. A worker's cost is the cheaper of its two ways (pull or
                          recompute), and the decision carries the pull (`Decision.pulls`)
                          for the worker it is chosen for. The best-cached worker's own
                          cost stands for waiting for it. miss_s is the same either way (a
                          pulled block is as much a duplicate as a recomputed one).
               Rates are what the worker measures and reports (`prefill_tokens_per_s`,
               `decode_step_s`, `prefill_chunk_tokens`, `kv_fill` in its status); a
               worker that has reported none counts at the mean of those that have, and
               `default_prefill_tokens_per_s` only stands in while none has.
               Cached tokens of a worker: the leading blocks it holds (events) plus,
               credited at the index's measured `prediction_confidence`, the blocks it is
               *expected* to hold (routed there, not yet confirmed), × block size, capped at
               prompt length - 1 (one token is always computed), rounded down to a whole
               multiple of the worker's `reuse_block_tokens` (the granularity its engine
               reuses a prefix at: vLLM's block size, which may exceed the gateway's; absent
               or 0: any length, as prefixgate workers, which copy a partial block): what
               the engine will really reuse.
               Shared-prefix spread: when the longest match ends at a block from which
               `spread_fanout` or more different continuations are already indexed (a
               system prompt other conversations share), those cached tokens are credited
               at `shared_prefix_weight` (default 0) on workers whose cache is fuller than
               (1 + occupancy_slack) x the mean: holding a popular prefix is no reason to
               attract a new conversation; load and cache occupancy place it.
               Ties: costs closer than half a block of prefill at the worker's rate
               (cached prefixes differ by whole blocks; a smaller difference is the
               rates' measurement noise) go, in order, to the worker of the
               conversation's previous turn, the less loaded (queued prefill tokens, then
               running sequences), the worker with fewer indexed blocks (emptier
               cache), a rendezvous hash of the conversation id (or of the first block),
               the worker id.
  session      rendezvous hash of conversation_id (turns of one conversation stay on one
               worker while it is up); turns without an id go to the least-loaded worker
  least-loaded fewest queued prefill tokens, then fewest running sequences, then id
  round-robin  rotate through the workers
  random       uniform shuffle (seeded by RoutingConfig.seed)
Every policy reports the expected cached tokens of its choice when an index is given.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import xxhash

from prefixgate.gateway.index import PrefixIndex, PrefixMatch
from prefixgate.radix import BlockHasher

__all__ = ["POLICIES", "Decision", "LoadSnapshot", "Pull", "Router", "RoutingConfig", "Turn",
           "WorkerLoad", "make_turn", "queued_prefill_tokens", "reusable_tokens"]

POLICIES = ("prefix", "session", "least-loaded", "round-robin", "random")


class WorkerLoad(Protocol):
    """The load view of one worker the router ranks."""

    @property
    def worker_id(self) -> str: ...

    @property
    def num_queued_prefill_tokens(self) -> int: ...

    @property
    def num_running_requests(self) -> int: ...


def queued_prefill_tokens(polled: int, prefilled_since: int, own: int,
                          own_at_status: int) -> int:
    """A worker's queued prefill tokens as one gateway sees them (gateway/pool.py
    WorkerHandle; the replay simulator): its last status `polled`, less this gateway's
    prefill in it that ended since (`prefilled_since`, of the `own_at_status` prompt
    tokens it had waiting there when the status came), plus its prompt tokens sent since
    and still waiting for their first token (`own` waiting now)."""
    ended = min(prefilled_since, own_at_status)  # of the turns in the status
    return max(0, polled - ended) + max(0, own - own_at_status + ended)


@dataclass(frozen=True)
class LoadSnapshot:
    """A plain `WorkerLoad` (simulators, tests), with the optional measured figures."""

    worker_id: str
    num_queued_prefill_tokens: int = 0
    num_running_requests: int = 0
    prefill_tokens_per_s: float = 0.0  # 0: not measured
    decode_step_s: float = 0.0  # 0: not measured
    prefill_chunk_tokens: int = 0  # 0: prompts are prefilled alone
    kv_fill: float = 1.0  # used share of the KV cache
    transfer_bytes_per_s: float = 0.0  # 0: not measured
    transfer_setup_s: float = 0.0  # set-up of one pull into it, seconds
    kv_bytes_per_token: int = 0  # 0: unknown (no transfers to or from it)
    export_queued_bytes: int = 0  # bytes of pulls from it routed and not finished
    reuse_block_tokens: int = 0  # its engine reuses prefixes in multiples of it (0: any)


W = TypeVar("W", bound=WorkerLoad)


@dataclass(frozen=True)
class RoutingConfig:
    """Policy and scoring weights (see the module docstring for the rule)."""

    policy: str = "prefix"
    seed: int | None = None
    # Multipliers of the two halves of the cost, both in seconds (1: a second of waiting
    # counts as much as a second of prefill, now or later):
    prefix_weight: float = 1.0  # x (prefill_s + miss_s): this turn's and later prefill
    load_weight: float = 1.0  # x (queue_s + decode_s): the work ahead of it on the worker
    # Prompt tokens of prefill one running sequence stands for, where a worker reports no
    # measured decode step (decode_s = running_weight x running / rate).
    running_weight: float = 64.0
    shared_prefix_weight: float = 0.0  # credit per cached token of a shared prefix ...
    # ... on a worker whose cache holds more than (1 + occupancy_slack) x the mean
    # indexed blocks; at or below that, a shared prefix is credited in full.
    occupancy_slack: float = 0.25
    spread_fanout: int = 2  # continuations after which a prefix counts as shared
    max_conversations: int = 100_000  # conversations remembered for the tie-breaker
    # Prefill rate assumed for a worker that has not reported a measured one yet.
    default_prefill_tokens_per_s: float = 10_000.0
    # Use the rates workers measure and report (False: every worker at the default rate
    # and running_weight, for identical workers whose measurement noise should not steer).
    measured_rates: bool = True
    # How long a routed turn's blocks count as expected on its worker without an event
    # confirming them (0: no predictions). Longer than a prefill's queue plus event delay.
    prediction_ttl_s: float = 30.0
    # Turns over which the measured reuse (reuses per computed token) is counted.
    reuse_window_turns: int = 200
    # Offer the pull option (move KV blocks between workers) where workers report a
    # transfer rate and their KV bytes per token (False: recompute or wait only).
    transfer: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}: use one of "
                             f"{', '.join(POLICIES)}")
        for name in ("prefix_weight", "load_weight", "running_weight", "shared_prefix_weight",
                     "occupancy_slack", "prediction_ttl_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.spread_fanout < 1:
            raise ValueError(f"spread_fanout must be >= 1, got {self.spread_fanout}")
        if self.default_prefill_tokens_per_s <= 0 or self.reuse_window_turns < 1:
            raise ValueError("default_prefill_tokens_per_s must be > 0 and "
                             "reuse_window_turns >= 1")


@dataclass(frozen=True)
class Turn:
    """One request to route. `block_hashes` are the chained hashes of the prompt's full
    blocks (`BlockHasher.hash_blocks`); empty when routing without an index."""

    num_prompt_tokens: int
    conversation_id: str = ""
    block_hashes: Sequence[int] = ()
    block_size: int = 16


def reusable_tokens(matched_tokens: int, max_tokens: int, unit_tokens: int) -> int:
    """Tokens of a prompt an engine serves from its cache when the gateway's index matches
    `matched_tokens` of it there: the engine computes the last prompt token itself (at most
    `max_tokens`, the prompt length - 1, come from cache) and reuses a prefix only in
    whole multiples of `unit_tokens`, its own reuse block (vLLM's block size; a match that
    ends inside one of its blocks gains nothing from that block's first part)."""
    return min(matched_tokens, max_tokens) // unit_tokens * unit_tokens


def make_turn(token_ids: Sequence[int], hasher: BlockHasher, conversation_id: str = "") -> Turn:
    """A Turn for `token_ids`, hashed by `hasher` (the workers' block size, model
    fingerprint and the request's namespace)."""
    return Turn(len(token_ids), conversation_id, hasher.hash_blocks(token_ids),
                hasher.block_size)


@dataclass(frozen=True)
class Pull:
    """Serve on a worker after pulling the prompt's first `num_blocks` blocks from
    `holder_id` (the worker skips those it holds). `num_tokens`: tokens predicted to cross
    the link (what the worker lacks of them); `transfer_s`: predicted seconds until they
    are in (the holder's link queue included)."""

    holder_id: str
    num_blocks: int
    num_tokens: int
    transfer_s: float


@dataclass(frozen=True)
class Decision:
    """A ranking and what the router expected of it."""

    ranked: list  # the candidate workers, best first
    policy: str
    # worker id -> predicted cached tokens (held or expected blocks; > 0 only)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    shared: bool = False  # the prompt's match ended at a shared prefix
    # worker id -> cached tokens known from events alone (> 0 only)
    certain_tokens: dict[str, int] = field(default_factory=dict)
    cost_s: dict[str, float] = field(default_factory=dict)  # prefix policy: cost per worker
    # worker id -> the pull that worker's cost assumes (only where pulling is cheaper)
    pulls: dict[str, Pull] = field(default_factory=dict)

    @property
    def expected_cached_tokens(self) -> int:
        """Predicted cached tokens of the first choice (0 when nothing is ranked)."""
        if not self.ranked:
            return 0
        return self.cached_tokens.get(self.ranked[0].worker_id, 0)

    @property
    def best_cached_tokens(self) -> int:
        """The most predicted cached tokens on any candidate worker."""
        ids = {w.worker_id for w in self.ranked}
        return max((n for w, n in self.cached_tokens.items() if w in ids), default=0)

    def cached_tokens_of(self, worker_id: str) -> int:
        return self.cached_tokens.get(worker_id, 0)

    def pull_of(self, worker_id: str) -> Pull | None:
        """The pull to send with the turn when it is served on `worker_id` (None: none)."""
        return self.pulls.get(worker_id)

    def transferred_tokens_of(self, worker_id: str) -> int:
        """Tokens predicted to arrive by transfer on `worker_id` (0: no pull)."""
        pull = self.pulls.get(worker_id)
        return pull.num_tokens if pull is not None else 0

    def regret_tokens(self, worker_id: str) -> int:
        """Predicted tokens recomputed by serving on `worker_id` that the best-cached
        worker holds (0: it is one of the best, or it pulls them)."""
        return max(0, self.best_cached_tokens - self.cached_tokens_of(worker_id)
                   - self.transferred_tokens_of(worker_id))


def _rendezvous(key: str, worker_id: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{key}\0{worker_id}".encode())


def _load(w: WorkerLoad) -> tuple[int, int, str]:
    return (w.num_queued_prefill_tokens, w.num_running_requests, w.worker_id)


class Router:
    """Ranks workers for turns (see the module docstring)."""

    def __init__(self, config: RoutingConfig, index: PrefixIndex | None = None) -> None:
        self.config = config
        self.index = index
        self._counter = itertools.count()
        self._rng = random.Random(config.seed)
        self._last_worker: OrderedDict[str, str] = OrderedDict()
        # Reuses per computed token over the last reuse_window_turns turns: best predicted
        # cached tokens / the rest of the prompt tokens (module docstring, miss_s).
        self.reuse = 0.0
        self._reuse_window: deque[tuple[int, int]] = deque()  # (cached, uncached) tokens
        self._reuse_cached = self._reuse_uncached = 0

    def dispatch(self, turn: Turn, worker_id: str) -> int:
        """`turn` is being sent to `worker_id` now: its prompt's blocks are expected there
        (PrefixIndex.predict). Returns the blocks newly predicted."""
        if self.index is None or not turn.block_hashes:
            return 0
        return self.index.predict(worker_id, turn.block_hashes)

    def record(self, turn: Turn, worker_id: str) -> None:
        """`turn` was served by `worker_id` (the next turn's tie-breaker)."""
        if not turn.conversation_id:
            return
        last = self._last_worker
        last[turn.conversation_id] = worker_id
        last.move_to_end(turn.conversation_id)
        while len(last) > self.config.max_conversations:
            last.popitem(last=False)

    def previous_worker(self, conversation_id: str) -> str | None:
        return self._last_worker.get(conversation_id) if conversation_id else None

    def rank(self, workers: Sequence[W], turn: Turn) -> list[W]:
        return self.decide(workers, turn).ranked

    def decide(self, workers: Sequence[W], turn: Turn) -> Decision:
        cfg = self.config
        policy = cfg.policy
        match = (self.index.match(turn.block_hashes)
                 if self.index is not None and turn.block_hashes else None)
        cached: dict[str, int] = {}
        certain: dict[str, int] = {}
        workers = list(workers)
        if match is not None:
            cap = max(0, turn.num_prompt_tokens - 1)
            bs = turn.block_size
            unit = {w.worker_id: getattr(w, "reuse_block_tokens", 0) or 1 for w in workers}
            certain = {w: reusable_tokens(n * bs, cap, unit.get(w, 1))
                       for w, n in match.cached_blocks.items()}
            cached = {w: reusable_tokens(n * bs, cap, unit.get(w, 1))
                      for w, n in match.expected_blocks.items() if n}
        shared = bool(match and match.shared)
        costs: dict[str, float] = {}
        pulls: dict[str, Pull] = {}
        if policy == "prefix":
            ranked = self._rank_prefix(workers, turn, cached, certain, match, costs, pulls)
        elif policy == "round-robin":
            start = next(self._counter) % len(workers) if workers else 0
            ranked = workers[start:] + workers[:start]
        elif policy == "random":
            ranked = self._rng.sample(workers, len(workers))
        elif policy == "session" and turn.conversation_id:
            ranked = sorted(workers, key=lambda w: _rendezvous(turn.conversation_id, w.worker_id),
                            reverse=True)
        else:  # least-loaded, and session without a conversation id
            ranked = sorted(workers, key=_load)
        return Decision(ranked, policy, cached, shared, certain, costs, pulls)

    def _measure_reuse(self, cached: int, prompt: int) -> None:
        """Reuses per computed token: in steady state every token computed is stored once
        and then served from cache `reuse` times on average, so a cached token that a
        duplicate evicts costs that many re-prefills. Counted in tokens (a turn-mean of hit
        ratios would let many short cold prompts outweigh the long ones that carry the
        reuse), over the best predicted hit (what the fleet holds, whoever is chosen), at
        most the window's length in turns (a token cannot be reused more often than turns
        arrived)."""
        window = self._reuse_window
        window.append((cached, prompt - cached))
        self._reuse_cached += cached
        self._reuse_uncached += prompt - cached
        if len(window) > self.config.reuse_window_turns:
            old_cached, old_uncached = window.popleft()
            self._reuse_cached -= old_cached
            self._reuse_uncached -= old_uncached
        self.reuse = min(float(len(window)), self._reuse_cached / max(1, self._reuse_uncached))

    def _decode_s(self, w: WorkerLoad, prefill_tokens: float, rate: float,
                  step_s: float) -> float:
        """Decode work on `w` that delays a prefill of `prefill_tokens` (queue included)."""
        if step_s > 0:  # measured: decode delays prefill only where steps interleave
            chunk = getattr(w, "prefill_chunk_tokens", 0)
            return (step_s * -(-prefill_tokens // chunk)
                    if chunk > 0 and w.num_running_requests else 0.0)
        return self.config.running_weight * w.num_running_requests / rate

    def _links(self, workers: list[W], certain: dict[str, int], match: PrefixMatch | None,
               turn: Turn) -> dict | None:
        """What the pull option needs: the holders (workers whose events say they hold
        leading blocks of the prompt), and each worker's link (its transfer rate, a worker
        that has measured none counting at the mean of those that have, and its KV bytes
        per token). None when no pull is possible (no holder, or no rate measured)."""
        if match is None or not certain:
            return None
        measured = [r for w in workers if (r := getattr(w, "transfer_bytes_per_s", 0.0)) > 0]
        if not measured:  # nothing measured: a pull cannot be priced
            return None
        mean = sum(measured) / len(measured)
        # The set-up as the rates: a worker that measured none counts at its peers' mean.
        setups = [getattr(w, "transfer_setup_s", 0.0) for w in workers
                  if getattr(w, "transfer_bytes_per_s", 0.0) > 0]
        setup = sum(setups) / len(setups)
        link = {w.worker_id: (getattr(w, "transfer_bytes_per_s", 0.0) or mean,
                              getattr(w, "kv_bytes_per_token", 0),
                              getattr(w, "export_queued_bytes", 0),
                              getattr(w, "transfer_setup_s", 0.0)
                              if getattr(w, "transfer_bytes_per_s", 0.0) > 0 else setup)
                for w in workers}
        holders = [(wid, tokens, min(match.cached_blocks[wid], len(turn.block_hashes)))
                   for wid, tokens in certain.items() if wid in link and link[wid][1] > 0]
        return {"link": link, "holders": holders} if holders else None

    @staticmethod
    def _pulls(w: WorkerLoad, have: float, links: dict):
        """Every pull into `w` (holding `have` tokens of the prompt) from a holder with more
        of it in the same KV layout (as `Pull`s)."""
        link = links["link"]
        rate, bpt, _, setup_s = link[w.worker_id]
        if bpt <= 0:
            return
        for hid, tokens, blocks in links["holders"]:
            if hid == w.worker_id or tokens <= have:
                continue
            h_rate, h_bpt, h_queued, _ = link[hid]
            if h_bpt != bpt:  # another dtype or layout: the receiver would refuse it
                continue
            bw = min(rate, h_rate)  # the slower end sets the pace
            num_tokens = int(tokens - have)
            yield Pull(hid, blocks, num_tokens,
                       setup_s + (h_queued + num_tokens * bpt) / bw)

    def _rank_prefix(self, workers: list[W], turn: Turn, cached: dict[str, int],
                     certain: dict[str, int], match: PrefixMatch | None,
                     costs: dict[str, float], pulls: dict[str, Pull]) -> list[W]:
        cfg = self.config
        previous = self.previous_worker(turn.conversation_id)
        index = self.index
        key = turn.conversation_id or (str(turn.block_hashes[0]) if turn.block_hashes else "")
        occupancy = {w.worker_id: index.num_owned_blocks(w.worker_id) if index is not None else 0
                     for w in workers}
        # A shared prefix pulls a turn only toward workers whose cache is not fuller than
        # the rest: the first holder of a system prompt does not collect every new
        # conversation, while caches that are all full (the steady state under a working
        # set larger than memory) keep following shared prefixes.
        limit = (1 + cfg.occupancy_slack) * sum(occupancy.values()) / max(1, len(workers))
        shared = match is not None and match.shared
        confidence = index.prediction_confidence if index is not None else 1.0

        def credited(wid: str) -> float:
            sure = certain.get(wid, 0)
            tokens = sure + confidence * (cached.get(wid, 0) - sure)
            return tokens * (cfg.shared_prefix_weight if shared and occupancy[wid] > limit
                             else 1.0)

        credit = {w.worker_id: credited(w.worker_id) for w in workers}
        best = max(credit.values(), default=0.0)
        prompt = turn.num_prompt_tokens
        reuse = self.reuse
        measured = cfg.measured_rates
        rates = [r for w in workers if (r := getattr(w, "prefill_tokens_per_s", 0.0)) > 0] \
            if measured else []
        # A worker that has measured nothing yet (new, or never chosen) counts at its
        # peers' mean rate: a constant would make it look slower or faster than it is.
        unmeasured = sum(rates) / len(rates) if rates else cfg.default_prefill_tokens_per_s
        links = self._links(workers, certain, match, turn) if cfg.transfer else None
        tie_s: dict[str, float] = {}
        for w in workers:
            wid = w.worker_id
            rate = (getattr(w, "prefill_tokens_per_s", 0.0) if measured else 0.0) or unmeasured
            tie_s[wid] = 0.5 * turn.block_size / rate
            queued = w.num_queued_prefill_tokens
            step_s = getattr(w, "decode_step_s", 0.0) if measured else 0.0
            miss_s = (best - credit[wid]) / rate * reuse * min(1.0, getattr(w, "kv_fill", 1.0))
            uncached = prompt - credit[wid]
            wait_s = queued / rate + self._decode_s(w, queued + uncached, rate, step_s)
            costs[wid] = (cfg.load_weight * wait_s
                          + cfg.prefix_weight * (uncached / rate + miss_s))
            for pull in self._pulls(w, credit[wid], links) if links else ():
                # The queue ahead drains while the blocks come: the rest's prefill starts
                # when both are done, so only the part of the transfer the queue does not
                # hide is paid.
                rest = prompt - credit[wid] - pull.num_tokens
                wait_s = queued / rate + self._decode_s(w, queued + rest, rate, step_s)
                cost = (cfg.load_weight * wait_s + cfg.prefix_weight * (
                    max(0.0, pull.transfer_s - wait_s) + rest / rate + miss_s))
                if cost < costs[wid]:
                    costs[wid] = cost
                    pulls[wid] = pull
        if prompt > 0 and workers:
            self._measure_reuse(min(prompt, max(cached.values(), default=0)), prompt)

        def tie_key(w: W) -> tuple:
            wid = w.worker_id
            return (wid != previous, w.num_queued_prefill_tokens, w.num_running_requests,
                    occupancy[wid], -_rendezvous(key, wid) if key else 0, wid)

        # Costs closer than half a block of prefill are a tie. Cached prefixes count in
        # whole blocks, so a real difference in what a turn finds cached is at least one
        # block's prefill; anything smaller comes from the rates, and rates are measured
        # (a running mean of tokens / seconds): identical workers report rates that differ
        # by float noise, real ones by their jitter. Comparing exact seconds would let that
        # noise pick the worker every time (all near-ties to whichever measured a hair
        # faster) and the tie-breakers would never run. Groups form in cost order: a
        # worker within the tolerance of its group's cheapest joins it; each group is
        # ordered by the tie-breakers.
        ranked: list[W] = []
        group: list[W] = []
        for w in sorted(workers, key=lambda w: costs[w.worker_id]):
            if group:
                lead = group[0].worker_id
                if costs[w.worker_id] - costs[lead] >= max(tie_s[lead], tie_s[w.worker_id]):
                    ranked += sorted(group, key=tie_key)
                    group = []
            group.append(w)
        return ranked + sorted(group, key=tie_key)
