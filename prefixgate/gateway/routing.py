"""Routing policies: rank the healthy workers for one turn, best first.

Contract: `Router(config).rank(workers, turn)` returns every given worker exactly once,
best first; the gateway tries them in that order (failover before the first token).
Policies:
  session      rendezvous hash of conversation_id (turns of one conversation stay on
               one worker while it is up; its cache holds their prefix); turns without
               an id go to the least-loaded worker
  least-loaded fewest queued prompt tokens in flight, then fewest turns, then id
  round-robin  rotate through the workers
  random       uniform shuffle
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import xxhash

from prefixgate.gateway.pool import WorkerHandle

POLICIES = ("session", "least-loaded", "round-robin", "random")


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "session"
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}: use one of {', '.join(POLICIES)}")


@dataclass(frozen=True)
class Turn:
    num_prompt_tokens: int
    conversation_id: str = ""


def _load_key(w: WorkerHandle) -> tuple[int, int, str]:
    return (w.in_flight_prompt_tokens, w.in_flight, w.worker_id)


class Router:
    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._counter = itertools.count()
        self._rng = random.Random(config.seed)

    def rank(self, workers: list[WorkerHandle], turn: Turn) -> list[WorkerHandle]:
        policy = self.config.policy
        if policy == "round-robin" and workers:
            start = next(self._counter) % len(workers)
            return workers[start:] + workers[:start]
        if policy == "random":
            return self._rng.sample(workers, len(workers))
        if policy == "session" and turn.conversation_id:
            return sorted(workers, key=lambda w: xxhash.xxh3_64_intdigest(
                f"{turn.conversation_id}\0{w.worker_id}".encode()), reverse=True)
        return sorted(workers, key=_load_key)
