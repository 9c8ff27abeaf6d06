"""Placement: where one attempt of a turn runs, and the bookkeeping that goes with sending
it there. The one step both the relay (gateway/turn.py) and the mid-stream resume
(gateway/resume.py) take, so a turn and its continuation are placed alike.

Contract
--------
`Placer(pool, index, router, hashers, hash_memo, feed)`:

  `route(prompt, namespace, conversation_id, exclude, memo)` -> (Turn, Decision): the
      prompt's block hashes (the workers' hashers; with `memo`, the HashMemo hashes only
      the blocks new since the conversation's last turn), then `Router.decide` over
      the healthy workers but `exclude`. `Decision.ranked` is empty when no worker is up;
      what that means is the caller's to say.
  `place(turn, decision, worker, request)` -> Placement: the pull the decision priced for
      `worker` set on `request` (gateway/pulls.py; cleared when there is none), the
      prompt's blocks predicted there (Router.dispatch, and shared through the feed), and
      a load lease on `worker` for the prefill the turn adds to its queue. The caller
      closes the Placement when the attempt ends, whatever the outcome (a context
      manager); `first_token` when its first token came.
  `mark_down(worker, why)`: the worker was lost (a transport failure): no more turns
      there until its probe answers again, and its predictions dropped (its events will
      not come).

No I/O, no transport: a Placement holds counters the router reads, nothing more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixgate.gateway import metrics, pulls
from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.pool import Lease, WorkerHandle, WorkerPool
from prefixgate.gateway.routing import Decision, Router, Turn
from prefixgate.radix import Hashers, HashMemo
from prefixgate.v1 import worker_pb2

if TYPE_CHECKING:
    from prefixgate.gateway.feeds import EventFeed

__all__ = ["Placement", "Placer"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Placement:
    """One attempt of a turn, sent to `worker` (see the module docstring)."""

    worker: WorkerHandle
    expected_cached_tokens: int  # what the decision predicted cached there
    charge: pulls.LinkCharge  # the pull's bytes on its holder's link
    holder: WorkerHandle | None  # the pull's holder (the charge forgets it once released)
    lease: Lease

    @property
    def expected_pulled_tokens(self) -> int:
        return self.charge.num_tokens

    def first_token(self, num_tokens: int = 1) -> None:
        """The attempt's first token came: its prefill (and any pull) is over."""
        self.lease.first_token(num_tokens)
        self.charge.release()

    def close(self) -> None:
        """The attempt ended (any outcome); closing twice is a no-op."""
        self.charge.release()
        self.lease.close()

    def __enter__(self) -> Placement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Placer:
    """The routing state a gateway places turns with (module docstring)."""

    def __init__(self, pool: WorkerPool, index: PrefixIndex, router: Router,
                 hashers: Hashers, hash_memo: HashMemo,
                 feed: EventFeed | None = None) -> None:
        self.pool, self.index, self.router = pool, index, router
        self.hashers, self.hash_memo, self.feed = hashers, hash_memo, feed

    def route(self, prompt: memoryview, namespace: str, conversation_id: str = "",
              exclude: WorkerHandle | None = None, memo: bool = True
              ) -> tuple[Turn, Decision]:
        t0 = time.perf_counter()
        hasher = self.hashers.get(namespace)
        hashes = (self.hash_memo.hash_blocks(hasher, prompt, conversation_id) if memo
                  else hasher.hash_blocks(prompt))
        turn = Turn(len(prompt), conversation_id, hashes, hasher.block_size)
        healthy = self.pool.healthy()
        if exclude is not None:
            healthy = [w for w in healthy if w is not exclude]
        decision = self.router.decide(healthy, turn)
        metrics.DECISION_SECONDS.observe(time.perf_counter() - t0)
        if log.isEnabledFor(logging.DEBUG):  # why a turn went where it went
            log.debug("route %s (%d tokens; %.2f turns/s, predictions %.2f confirmed): %s",
                      conversation_id or "-", len(prompt), self.router.arrival_rate_per_s(),
                      self.index.prediction_confidence, " ".join(
                f"{w.worker_id}[queued={w.num_queued_prefill_tokens} "
                f"rate={w.prefill_tokens_per_s:.0f} "
                f"cached={decision.cached_tokens.get(w.worker_id, 0)} "
                f"cost={decision.cost_s.get(w.worker_id, float('nan')):.2f}s"
                f"{' pull' if w.worker_id in decision.pulls else ''}]"
                for w in decision.ranked))
        return turn, decision

    def place(self, turn: Turn, decision: Decision, worker: WorkerHandle,
              request: worker_pb2.GenerateRequest,
              candidates: Sequence[WorkerHandle] | None = None) -> Placement:
        expected = decision.cached_tokens_of(worker.worker_id)
        # Block transfer: the leading blocks this worker lacks, from their holder.
        charge = pulls.attach(request, decision, worker,
                              decision.ranked if candidates is None else candidates)
        # Predictive ownership: the prompt's blocks are expected there from now on, here
        # and (Redis) at every gateway, until the worker's events confirm or drop them.
        self.router.dispatch(turn, worker.worker_id)
        if self.feed is not None:
            self.feed.predicted(worker.record, turn.block_hashes)
        # The prefill this turn adds to the worker's queue, until its first token.
        lease = worker.lease(max(0, turn.num_prompt_tokens - expected - charge.num_tokens),
                             pulled=charge.num_tokens > 0)
        return Placement(worker, expected, charge, charge.holder, lease)

    def mark_down(self, worker: WorkerHandle, why: str) -> None:
        self.pool.mark_down(worker, why)
        self.index.drop_predictions(worker.worker_id)
