"""Baselines to compare the cost rules against: session, least-loaded, round-robin,
random (no cached prefix in the rule), and best-cached (nothing but the cached prefix)."""

from __future__ import annotations

import itertools
import random

from prefixgate.gateway.policies.base import (
    Candidates,
    Ranking,
    RoutingPolicy,
    load_key,
    rendezvous,
)


class LeastLoaded(RoutingPolicy):
    """Fewest queued prefill tokens, then fewest running sequences, then id."""

    name = "least-loaded"

    def rank(self, c: Candidates) -> Ranking:
        return Ranking(sorted(c.workers, key=load_key))


class Session(RoutingPolicy):
    """Rendezvous hash of the conversation id: a conversation's turns stay on one worker
    while it is up; a turn without an id goes to the least-loaded worker."""

    name = "session"

    def rank(self, c: Candidates) -> Ranking:
        conv = c.turn.conversation_id
        if not conv:
            return Ranking(sorted(c.workers, key=load_key))
        return Ranking(sorted(c.workers, key=lambda w: rendezvous(conv, w.worker_id),
                              reverse=True))


class RoundRobin(RoutingPolicy):
    """Rotate through the workers."""

    name = "round-robin"

    def __init__(self, config) -> None:
        super().__init__(config)
        self._counter = itertools.count()

    def rank(self, c: Candidates) -> Ranking:
        ws = c.workers
        start = next(self._counter) % len(ws) if ws else 0
        return Ranking(ws[start:] + ws[:start])


class Random(RoutingPolicy):
    """A uniform shuffle (seeded by `RoutingConfig.seed`)."""

    name = "random"

    def __init__(self, config) -> None:
        super().__init__(config)
        self._rng = random.Random(config.seed)

    def rank(self, c: Candidates) -> Ranking:
        return Ranking(self._rng.sample(c.workers, len(c.workers)))


class BestCached(RoutingPolicy):
    """The most credited cached tokens, then the least loaded: every turn on its
    best-cached worker whatever waits there (the hit a router gives up nothing for)."""

    name = "best-cached"

    def rank(self, c: Candidates) -> Ranking:
        return Ranking(sorted(c.workers, key=lambda w: (-c.credit.get(w.worker_id, 0.0),
                                                        *load_key(w))))
