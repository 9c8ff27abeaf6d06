"""The routing policy interface: what a policy reads, what it returns, and its guarantees.

A policy is a small class behind `RoutingPolicy`: given the candidate workers of one turn
(`Candidates`: each worker's load, as the `WorkerLoad` protocol declares it, and what the
router predicts each holds of the turn's prompt) it returns a `Ranking`: every candidate
exactly once, best first (the gateway tries them in that order, failover before the first
token). Policies do no I/O and read nothing of a worker but the `WorkerLoad` fields; the
state shared by every policy (the prefix index, the conversation map, the measured reuse,
per-worker confidence) is the `Router`'s (gateway/routing.py), which builds `Candidates`.
The gateway and the replay simulator rank with the same classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import xxhash

if TYPE_CHECKING:
    from prefixgate.gateway.index import PrefixMatch


class WorkerLoad(Protocol):
    """The load view of one worker a policy ranks: all a policy may read of it.

    `gateway.pool.WorkerHandle` provides it from the worker's last pushed status (less
    the turns that ended here since, and at least this gateway's own in-flight turns);
    a simulator or a test passes `routing.LoadSnapshot`s. Units are in the names; a
    measured figure is 0 where it is not measured yet."""

    @property
    def worker_id(self) -> str: ...

    @property
    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted and not yet prefilled."""

    @property
    def num_running_requests(self) -> int:
        """Sequences running (the batch)."""

    @property
    def prefill_tokens_per_s(self) -> float:
        """Measured prefill rate (0: not measured)."""

    @property
    def decode_step_s(self) -> float:
        """Measured decode step time (0: not measured)."""

    @property
    def prefill_chunk_tokens(self) -> int:
        """Prefill chunk size where decode steps interleave with it (0: prefilled alone)."""

    @property
    def kv_fill(self) -> float:
        """Used share of the KV cache, 0..1 (1 when unknown: the steady state)."""

    @property
    def transfer_bytes_per_s(self) -> float:
        """Rate its block transfers run at (0: not measured)."""

    @property
    def transfer_setup_s(self) -> float:
        """Set-up time of one pull into it, whatever its size."""

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one cached token takes (0: unknown; it neither pulls nor is pulled
        from)."""

    @property
    def export_queued_bytes(self) -> int:
        """Bytes of pulls from it routed and not finished (its link's queue)."""

    @property
    def reuse_block_tokens(self) -> int:
        """Its engine reuses a cached prefix only in whole multiples of this (0: any)."""


@dataclass(frozen=True)
class Turn:
    """One request to route. `block_hashes` are the chained hashes of the prompt's full
    blocks (`BlockHasher.hash_blocks`); empty when routing without an index."""

    num_prompt_tokens: int
    conversation_id: str = ""
    block_hashes: Sequence[int] = ()
    block_size: int = 16


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


@dataclass
class Candidates:
    """One turn's candidates as the router sees them (built by `Router.decide`).

    cached     worker id -> predicted reusable tokens (held or expected blocks; > 0 only)
    certain    worker id -> reusable tokens its events alone say it holds (> 0 only)
    credit     worker id -> tokens a policy should count as cached there (every worker):
               certain tokens, plus the expected rest at the index's prediction
               confidence, times the worker's own confidence (claims its served turns
               confirmed), times the shared-prefix weight where that applies
    previous   the worker of the conversation's previous turn (None: none known)
    """

    turn: Turn
    workers: list
    cached: dict[str, int]
    certain: dict[str, int]
    credit: dict[str, float]
    match: PrefixMatch | None = None
    previous: str | None = None
    occupancy: dict[str, int] = field(default_factory=dict)  # indexed blocks per worker
    reuse: float = 0.0  # measured re-prefills per evicted token (prefix policy, miss_s)
    trust: dict[str, float] = field(default_factory=dict)  # worker id -> confidence 0..1
    # worker id -> prompt tokens of this router's turns active there (dispatched, not ended)
    active_tokens: dict[str, int] = field(default_factory=dict)
    # Turns per second arriving at this router, the whole fleet's (Router.arrival_rate_per_s;
    # 0: not measured yet). The prefix policy's work cost reads it.
    arrival_rate_per_s: float = 0.0

    @property
    def best_credit(self) -> float:
        return max(self.credit.values(), default=0.0)

    def uncached(self, worker_id: str) -> float:
        """Prompt tokens the turn would prefill on `worker_id` (its credit aside)."""
        return max(0.0, self.turn.num_prompt_tokens - self.credit.get(worker_id, 0.0))

    @property
    def key(self) -> str:
        """What turns of one conversation share: its id, else the first block's hash."""
        t = self.turn
        return t.conversation_id or (str(t.block_hashes[0]) if t.block_hashes else "")


@dataclass
class Ranking:
    """A policy's answer: every candidate once, best first, with what it priced."""

    ranked: list
    cost_s: dict[str, float] = field(default_factory=dict)  # per worker (cost policies)
    pulls: dict[str, Pull] = field(default_factory=dict)  # worker id -> the pull it assumes


def rendezvous(key: str, worker_id: str) -> int:
    """Highest-random-weight hash of (key, worker): stable while the worker is up."""
    return xxhash.xxh3_64_intdigest(f"{key}\0{worker_id}".encode())


def load_key(w: WorkerLoad) -> tuple[int, int, str]:
    """Least loaded first: queued prefill tokens, then running sequences, then id."""
    return (w.num_queued_prefill_tokens, w.num_running_requests, w.worker_id)


def measured_rate(workers: Sequence[WorkerLoad], default: float) -> dict[str, float]:
    """Each worker's prefill rate, a worker that has measured none counting at its peers'
    mean (a constant would make it look slower or faster than it is), `default` while no
    worker has measured one."""
    rates = [w.prefill_tokens_per_s for w in workers if w.prefill_tokens_per_s > 0]
    mean = sum(rates) / len(rates) if rates else default
    return {w.worker_id: w.prefill_tokens_per_s or mean for w in workers}


class RoutingPolicy:
    """One routing rule.

    Contract: `rank(c)` returns a `Ranking` holding every worker of `c.workers` exactly
    once, best first, reading only the `WorkerLoad` fields of each and what `c` carries
    (no I/O, no clock, no other worker state). A policy may keep its own state across turns
    (a counter, a seeded generator); it is called from one thread (the gateway's event
    loop, or the simulator). `name` is what `--policy` and `RoutingConfig.policy` call it;
    `source` says where the rule is published (docs/routing.md)."""

    name: ClassVar[str] = ""
    source: ClassVar[str] = "prefixgate"
    _named: ClassVar[list[str]] = []  # every named policy class's name, as defined

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name and cls.name not in RoutingPolicy._named:
            RoutingPolicy._named.append(cls.name)

    @staticmethod
    def names() -> tuple[str, ...]:
        """The names of the policy classes defined (gateway/policies/ defines them all)."""
        return tuple(sorted(RoutingPolicy._named))

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config

    def rank(self, c: Candidates) -> Ranking:
        raise NotImplementedError


@dataclass(frozen=True)
class RoutingConfig:
    """Policy and scoring weights: which policy the router ranks with (`policy`, a
    `RoutingPolicy.name`) and what the policies read (gateway/routing.py's docstring
    states the prefix rule these weight; docs/routing.md every rule)."""

    policy: str = "prefix"
    seed: int | None = None
    # Multipliers of the two halves of the cost, both in seconds (1: a second of waiting
    # counts as much as a second of prefill, now or later):
    prefix_weight: float = 1.0  # x (prefill_s + miss_s): this turn's and later prefill
    load_weight: float = 1.0  # x (queue_s + decode_s): the work ahead of it on the worker
    # x work_s: the delay the prefill a choice adds imposes on the turns arriving behind it
    # (prefix policy; 0, the default: a choice is priced by this turn's seconds alone).
    # Off by default: measured, it did not pay its way (docs/routing.md, "What the choice
    # costs the turns behind it").
    work_weight: float = 0.0
    # Turns over which the router measures the arrival rate (Router.arrival_rate_per_s).
    arrival_window_turns: int = 64
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
    # smetric: a conversation stays on its worker while its predicted TTFT is within this
    # (the service's TTFT target).
    ttft_budget_s: float = 2.0
    # Turns with a claim over which a worker's confidence is measured (Router docstring).
    confidence_window_turns: int = 32

    def __post_init__(self) -> None:
        names = RoutingPolicy.names()
        if self.policy not in names:
            raise ValueError(f"unknown routing policy {self.policy!r}: use one of "
                             f"{', '.join(names)}")
        for name in ("prefix_weight", "load_weight", "work_weight", "running_weight",
                     "shared_prefix_weight",
                     "occupancy_slack", "prediction_ttl_s", "ttft_budget_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.spread_fanout < 1:
            raise ValueError(f"spread_fanout must be >= 1, got {self.spread_fanout}")
        if self.default_prefill_tokens_per_s <= 0 or self.reuse_window_turns < 1 \
                or self.confidence_window_turns < 1 or self.arrival_window_turns < 1:
            raise ValueError("default_prefill_tokens_per_s must be > 0, reuse_window_turns, "
                             "confidence_window_turns and arrival_window_turns >= 1")
