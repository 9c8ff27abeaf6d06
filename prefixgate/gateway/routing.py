"""The router: one turn's candidates, ranked by a policy (no I/O, no gRPC).

Interface (shared by the gateway and the replay simulator)
----------------------------------------------------------
* `WorkerLoad` (protocol, gateway/policies/base.py): all a policy may read of a worker: its
  id, queued prefill tokens, running sequences and the measured figures (prefill rate,
  decode step, prefill chunk, KV fill, transfer rate and set-up, KV bytes per token, its
  link's queue, the engine's reuse block). `gateway.pool.WorkerHandle` provides it from
  the worker's last status (gateway/status.py) less the turns that ended here since, and
  at least this gateway's own in-flight turns; a simulator passes `LoadSnapshot`s.
* `Turn`: one request: its prompt length in tokens, the chained block hashes of its full
  blocks (`make_turn` computes them with the same `BlockHasher` the workers use) and the
  conversation id.
* `PrefixIndex` (gateway/index.py): block hash -> owner workers, fed by worker events.
* `Router(config, index).decide(workers, turn) -> Decision`: every given worker exactly
  once, best first (the gateway tries them in that order: failover before the first
  token), with the predicted cached tokens per worker and the best of them (regret = best
  minus the chosen worker's). The ranking is the policy's (`RoutingConfig.policy`, one
  class each in gateway/policies/, docs/routing.md). `Router.dispatch(turn, worker_id)`
  says the turn is being sent there now: its blocks become *expected* on that worker in
  the index (predictive ownership, gateway/index.py) until the worker's events confirm or
  drop them. `Router.record(turn, worker_id, cached_tokens)` tells the router where a turn
  was served (the conversation tie-breaker) and what the worker found cached (its
  confidence). `rank` = decide().ranked. The router never calls Redis or the network;
  its state is the conversation map (bounded LRU), the measured reuse (a window of turns),
  the turns in flight per worker, each worker's confidence and the measured arrival rate.

Arrival rate (`Router.arrival_rate_per_s`, turns per second)
------------------------------------------------------------
The last `arrival_window_turns` + 1 turns `decide` saw, on the index's `clock` (the
simulator's simulated clock; the gateway's monotonic clock; `time.monotonic` without an
index): (gaps - 1) / the seconds from the oldest of them to now, the unbiased estimate of
a Poisson stream's rate from that many gaps (gaps / seconds overstates it, without bound
over two turns a moment apart); 0 until three turns have come, apart in time. A gap of
quiet before a turn lowers the rate at once. It is the whole fleet's rate as this router
sees it: behind several gateway replicas, each measures its own share of the turns (about
1/replicas of them) and so charges the prefix policy's work cost (policies/prefix.py) for
that share of the turns delayed: less than their whole delay, never more.

What every policy is given (`policies.Candidates`)
--------------------------------------------------
Cached tokens of a worker: the leading blocks it holds (events) plus, credited at the
index's measured `prediction_confidence`, the blocks it is *expected* to hold (routed
there, not yet confirmed), x block size, capped at prompt length - 1 (one token is always
computed), rounded down to a whole multiple of the worker's `reuse_block_tokens` (what its
engine really reuses), and credited at the worker's *confidence*:

Per-worker confidence (claims the turns do not confirm)
-------------------------------------------------------
A worker's events are its claims. When a turn it served ends, the router compares the
tokens its events claimed of that prompt when the turn was routed (`Decision.certain_tokens`)
with the cached tokens the worker reported serving it; over the last
`confidence_window_turns` turns with a claim, confidence = confirmed / claimed tokens (1
with none). Every policy sees a worker's claimed prefix credited at that share (the expected
value of what it will really find), and the prefix policy's pulls trust a holder as much:
a worker whose turns keep finding less than it claimed (a stolen key publishing blocks it
never stored, a cache that lies) stops drawing turns by its claims, while its load still
draws them as any worker's, so it recovers once its claims hold again. An honest worker
loses only what eviction races take between routing and prefill. Reported by the
`on_claim` callback (gateway metrics: prefixgate:router_worker_confidence) and logged when
a worker's confidence falls below or recovers above 1/2.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from prefixgate.gateway import policies
from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.policies import Candidates, Pull, RoutingPolicy, Turn, WorkerLoad
from prefixgate.gateway.policies.base import RoutingConfig
from prefixgate.radix import BlockHasher

__all__ = ["POLICIES", "Decision", "LoadSnapshot", "Pull", "Router", "RoutingConfig", "Turn",
           "WorkerLoad", "make_turn", "queued_prefill_tokens", "reusable_tokens"]

log = logging.getLogger(__name__)

POLICIES = tuple(policies.POLICIES)  # every policy's name, the default first


def queued_prefill_tokens(polled: int, prefilled_since: int, own: int,
                          own_at_status: int,
                          computable_since: float = float("inf")) -> int:
    """A worker's queued prefill tokens as one gateway sees them (gateway/pool.py
    WorkerHandle; the replay simulator): its last status `polled`, less this gateway's
    prefill in it that ended since (`prefilled_since`, of the `own_at_status` prompt
    tokens it had waiting there when the status came), plus its prompt tokens sent since
    and still waiting for their first token (`own` waiting now).

    `computable_since` bounds what can have left the status: the prefill tokens the
    worker can have computed since it was taken (its age times the worker's prefill rate;
    unbounded when the rate is not known). The status counts a prompt being prefilled
    with only its unfinished part, while this gateway counts the whole prompt ending at
    its first token: subtracting the whole of it took the other turns queued behind it off
    too, and a worker with 22,913 tokens queued read 0 until its next status."""
    ended = min(prefilled_since, own_at_status)  # this gateway's turns in the status
    left = polled - min(ended, computable_since)
    return max(0, int(left)) + max(0, own - own_at_status + ended)


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


class Router:
    """Ranks workers for turns (see the module docstring)."""

    # Turns remembered between decide() and record() (their claims) and in flight per
    # worker (dispatch() to record()); a turn that never ends here (every worker failed,
    # a resumed reply's continuation) leaves its entry until this many newer ones push it
    # out.
    MAX_TRACKED_TURNS = 65_536

    def __init__(self, config: RoutingConfig, index: PrefixIndex | None = None,
                 on_claim: Callable[[str, int, int, float], None] | None = None) -> None:
        self.config = config
        self.index = index
        self.policy: RoutingPolicy = policies.POLICIES[config.policy](config)
        # on_claim(worker_id, claimed_tokens, confirmed_tokens, confidence) per served turn
        # whose worker claimed cached tokens (gateway metrics).
        self.on_claim = on_claim
        self._last_worker: OrderedDict[str, str] = OrderedDict()
        # Re-prefills per evicted token over the last reuse_window_turns turns: tokens
        # computed again that this router saw before / tokens computed (docs/routing.md,
        # miss_s; _measure_reuse).
        self.reuse = 0.0
        self._reuse_window: deque[tuple[int, int, int]] = deque()  # again, computed, cached
        self._reuse_again = self._reuse_computed = self._reuse_cached = 0
        self._evicted = False  # a token was computed again: caches have evicted
        self._seen: OrderedDict[int, None] = OrderedDict()  # blocks routed, oldest first
        self._claims: OrderedDict[int, dict[str, int]] = OrderedDict()  # id(turn) -> certain
        self._active: OrderedDict[int, tuple[str, int]] = OrderedDict()  # id(turn) -> (w, n)
        self._active_tokens: dict[str, int] = {}
        # worker id -> its last confidence_window_turns (claimed, confirmed) tokens, sums
        self._confidence: dict[str, tuple[deque, list[int]]] = {}
        self.clock: Callable[[], float] = index.clock if index is not None else time.monotonic
        self._arrivals: deque[float] = deque()  # clock() of the last turns decided, oldest first

    # ------------------------------------------------------------------ per turn

    def decide(self, workers: Sequence[W], turn: Turn) -> Decision:
        workers = list(workers)
        self._arrive()
        c = self._candidates(workers, turn)
        ranking = self.policy.rank(c)
        self._claims[id(turn)] = c.certain
        self._claims.move_to_end(id(turn))
        if len(self._claims) > self.MAX_TRACKED_TURNS:
            self._claims.popitem(last=False)
        if turn.num_prompt_tokens > 0 and workers:
            self._measure_reuse(turn, max(c.cached.values(), default=0),
                                sum(c.occupancy.values()))
        return Decision(ranking.ranked, self.config.policy, c.cached,
                        bool(c.match and c.match.shared), c.certain, ranking.cost_s,
                        ranking.pulls)

    def rank(self, workers: Sequence[W], turn: Turn) -> list[W]:
        return self.decide(workers, turn).ranked

    def dispatch(self, turn: Turn, worker_id: str) -> int:
        """`turn` is being sent to `worker_id` now: its prompt's blocks are expected there
        (PrefixIndex.predict), and it counts as active there until `record`. Returns the
        blocks newly predicted."""
        self._end(turn)
        self._active[id(turn)] = (worker_id, turn.num_prompt_tokens)
        self._active_tokens[worker_id] = (self._active_tokens.get(worker_id, 0)
                                          + turn.num_prompt_tokens)
        if len(self._active) > self.MAX_TRACKED_TURNS:
            self._end_entry(self._active.popitem(last=False)[1])
        if self.index is None or not turn.block_hashes:
            return 0
        return self.index.predict(worker_id, turn.block_hashes)

    def record(self, turn: Turn, worker_id: str, cached_tokens: int | None = None) -> None:
        """`turn` was served by `worker_id` (the next turn's tie-breaker), which found
        `cached_tokens` of its prompt cached (None: not known; its confidence is not
        measured)."""
        self._end(turn)
        claims = self._claims.pop(id(turn), None)
        if cached_tokens is not None and claims:
            claimed = claims.get(worker_id, 0)
            if claimed > 0:
                self._confirm(worker_id, claimed, min(claimed, max(0, cached_tokens)))
        if not turn.conversation_id:
            return
        last = self._last_worker
        last[turn.conversation_id] = worker_id
        last.move_to_end(turn.conversation_id)
        while len(last) > self.config.max_conversations:
            last.popitem(last=False)

    def previous_worker(self, conversation_id: str) -> str | None:
        return self._last_worker.get(conversation_id) if conversation_id else None

    def arrival_rate_per_s(self) -> float:
        """Turns per second arriving at this router (module docstring; 0: not measured)."""
        arrivals = self._arrivals
        gaps = len(arrivals) - 1
        span_s = self.clock() - arrivals[0] if arrivals else 0.0
        # k gaps of a Poisson stream sum to a Gamma(k, rate) span, E[1/span] = rate/(k-1):
        # (k-1)/span is unbiased where k/span overstates a short window (two turns a
        # millisecond apart are no rate of 1,000 turns a second).
        return (gaps - 1) / span_s if gaps > 1 and span_s > 0 else 0.0

    def confidence(self, worker_id: str) -> float:
        """Share of its claimed cached tokens that `worker_id`'s served turns confirmed
        (module docstring; 1 before any claim)."""
        entry = self._confidence.get(worker_id)
        if entry is None or entry[1][0] <= 0:
            return 1.0
        return entry[1][1] / entry[1][0]

    # ------------------------------------------------------------------ internals

    def _candidates(self, workers: list, turn: Turn) -> Candidates:
        index = self.index
        match = (index.match(turn.block_hashes)
                 if index is not None and turn.block_hashes else None)
        cached: dict[str, int] = {}
        certain: dict[str, int] = {}
        if match is not None:
            cap = max(0, turn.num_prompt_tokens - 1)
            bs = turn.block_size
            unit = {w.worker_id: w.reuse_block_tokens or 1 for w in workers}
            certain = {w: reusable_tokens(n * bs, cap, unit.get(w, 1))
                       for w, n in match.cached_blocks.items()}
            cached = {w: reusable_tokens(n * bs, cap, unit.get(w, 1))
                      for w, n in match.expected_blocks.items() if n}
        predicted = index.prediction_confidence if index is not None else 1.0
        trust = {w.worker_id: self.confidence(w.worker_id) for w in workers}
        credit = {}
        for w in workers:
            wid = w.worker_id
            sure = certain.get(wid, 0)
            credit[wid] = trust[wid] * (sure + predicted * (cached.get(wid, 0) - sure))
        occupancy = {w.worker_id: index.num_owned_blocks(w.worker_id) if index is not None
                     else 0 for w in workers}
        return Candidates(turn, workers, cached, certain, credit, match,
                          self.previous_worker(turn.conversation_id), occupancy, self.reuse,
                          trust, self._active_tokens, self.arrival_rate_per_s())

    def _arrive(self) -> None:
        """Count a turn's arrival now (arrival_rate_per_s)."""
        arrivals = self._arrivals
        arrivals.append(self.clock())
        if len(arrivals) > self.config.arrival_window_turns + 1:
            arrivals.popleft()

    def _confirm(self, worker_id: str, claimed: int, confirmed: int) -> None:
        before = self.confidence(worker_id)
        window, sums = self._confidence.setdefault(worker_id, (deque(), [0, 0]))
        window.append((claimed, confirmed))
        sums[0] += claimed
        sums[1] += confirmed
        if len(window) > self.config.confidence_window_turns:
            old_claimed, old_confirmed = window.popleft()
            sums[0] -= old_claimed
            sums[1] -= old_confirmed
        after = self.confidence(worker_id)
        if before >= 0.5 > after:
            log.warning("worker %s: its served turns confirmed %.0f%% of the cached tokens "
                        "it claimed; routing credits its claims at that share",
                        worker_id, 100 * after)
        elif before < 0.5 <= after:
            log.info("worker %s: its claims hold again (%.0f%% confirmed)", worker_id,
                     100 * after)
        if self.on_claim is not None:
            self.on_claim(worker_id, claimed, confirmed, after)

    def _end(self, turn: Turn) -> None:
        entry = self._active.pop(id(turn), None)
        if entry is not None:
            self._end_entry(entry)

    def _end_entry(self, entry: tuple[str, int]) -> None:
        wid, n = entry
        left = self._active_tokens.get(wid, 0) - n
        if left > 0:
            self._active_tokens[wid] = left
        else:
            self._active_tokens.pop(wid, None)

    def _measure_reuse(self, turn: Turn, cached: int, held_blocks: int) -> None:
        """Re-prefills per evicted token: what the miss cost charges for each cached token
        a duplicate evicts. A token is worth keeping only if it is asked for again before
        it would be evicted anyway, and a duplicate evicts the least recently used tokens
        of its worker, not average ones: the reuses of an average cached token (what this
        measured before: cached / computed tokens, 1.9-4.2 on Mooncake, whose shared
        prefixes are hot while its one-turn requests leave cold tails) overprice the
        eviction many times over, enough to turn a turn away from an idle worker that
        would pull its prefix in 0.3 s towards a 2.8 s queue.

        So it is measured where it happens: of the tokens a turn must compute (beyond the
        best predicted cached run, whoever is chosen), those in blocks this router routed
        before were computed once and evicted since: each is a re-prefill an eviction
        caused. In steady state every computed token is stored and evicts one once caches
        are full (the cost's kv_fill scales that), so re-prefills / computed tokens over
        the window is how often an evicted token is asked for again. One-turn traffic
        that never comes back measures 0 and pays nothing for a miss. Until a token was
        computed again (nothing evicted yet, or nothing evicted was wanted) there is no
        such measurement, and the reuses per average computed token stand in (at most the
        window's length in turns): duplicates stored then fill the caches whose evictions
        come later. Counted in tokens, over at most `reuse_window_turns` turns; a block
        computed counts as seen until twice the blocks the fleet holds (at least
        MAX_TRACKED_TURNS) have been computed after it: one asked for later than that
        counts as new, and the memory stays in proportion to the fleet's. Only the
        computed part of a prompt is looked at (a 12k-token follow-up: its new blocks,
        not the 750 of its history), so the cost per turn is that of its prefill's
        blocks."""
        hashes, bs = turn.block_hashes, turn.block_size
        first = min(len(hashes), cached // bs) if bs > 0 else len(hashes)
        seen = self._seen
        again = 0
        for h in hashes[first:]:  # the cached run is held: only what is computed is new
            if h in seen:
                again += 1
                seen.move_to_end(h)  # most recent last
            else:
                seen[h] = None
        limit = max(self.MAX_TRACKED_TURNS, 2 * held_blocks)
        while len(seen) > limit:
            seen.popitem(last=False)
        computed = max(0, turn.num_prompt_tokens - cached)
        again = min(computed, again * bs)
        window = self._reuse_window
        hit = min(cached, turn.num_prompt_tokens)
        window.append((again, computed, hit))
        self._reuse_again += again
        self._reuse_computed += computed
        self._reuse_cached += hit
        self._evicted = self._evicted or again > 0
        if len(window) > self.config.reuse_window_turns:
            old_again, old_computed, old_hit = window.popleft()
            self._reuse_again -= old_again
            self._reuse_computed -= old_computed
            self._reuse_cached -= old_hit
        if self._evicted:
            self.reuse = self._reuse_again / max(1, self._reuse_computed)
        else:
            self.reuse = min(float(len(window)),
                             self._reuse_cached / max(1, self._reuse_computed))
