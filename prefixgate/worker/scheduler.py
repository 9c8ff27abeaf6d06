"""The scheduler: which sequences run, and how many tokens each computes, every step.

Contract
--------
- `waiting` (FIFO) and `running` hold every live sequence; a sequence is in exactly one.
- `admit()` moves waiting sequences to running, in order, while fewer than
  `max_num_seqs` run and the pool can hold the prompt (free blocks plus evictable cached
  ones); a sequence that does not fit waits for running ones to finish (the head of the
  queue is never overtaken). Admission takes the reuse planner's hit (worker/reuse.py),
  so only the uncached suffix is computed.
- `schedule()` returns the step's batch `[(seq, num_tokens)]` under
  `max_num_batched_tokens`: one token for every decoding sequence first, then prefill
  chunks, so a long prompt never stalls running decodes. The blocks for the step's new
  tokens are acquired now (worker/blocks.py); when eviction is not enough, the most
  recently admitted running sequence is preempted: its blocks are released and it goes
  back to the front of the queue to be recomputed later. An accepted request never fails
  for memory it could get by waiting.
"""

from __future__ import annotations

import logging
from collections import deque

from prefixgate.worker.blocks import BlockManager
from prefixgate.worker.reuse import ReusePlanner
from prefixgate.worker.sequence import Sequence
from prefixgate.workerapi.api import EngineConfig
from prefixgate.workerapi.metrics import WorkerMetrics

log = logging.getLogger(__name__)

Batch = list[tuple[Sequence, int]]


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, reuse: ReusePlanner,
                 metrics: WorkerMetrics | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.reuse = reuse
        self.metrics = metrics
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def sequences(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    def remove(self, seq: Sequence) -> None:
        """Forget `seq` (finished); its blocks are the caller's to release."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def num_queued_prefill_tokens(self) -> int:
        return sum(s.num_pending_tokens for s in self.waiting) + sum(
            s.num_pending_tokens for s in self.running if s.is_prefilling)

    # --- admission -------------------------------------------------------------------------

    def admit(self) -> None:
        pool, cache, bs = self.blocks.pool, self.blocks.cache, self.config.block_size
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            matched = self.reuse.match(seq)
            need = self.config.blocks_for(len(seq.tokens)) - len(matched)
            if need > pool.num_free_blocks + cache.num_evictable_blocks and self.running:
                self.blocks.release(seq, matched)  # wait until running requests finish
                break
            self.waiting.popleft()
            seq.block_table = matched
            seq.num_computed_tokens = len(matched) * bs
            self.reuse.extend(seq)
            if seq.num_cached_tokens < 0:  # first admission (not a preempted one)
                seq.num_cached_tokens = seq.num_computed_tokens
                if seq.resume is not None:  # blend: the moved run after the recomputed tokens
                    seq.num_cached_tokens += seq.resume[1] - seq.resume[0]
                if self.metrics:
                    self.metrics.prefix_queries.inc(len(seq.tokens))
                    self.metrics.prefix_hits.inc(seq.num_computed_tokens)
            self.running.append(seq)

    # --- the step's batch ------------------------------------------------------------------

    def schedule(self) -> Batch:
        budget = self.config.max_num_batched_tokens
        batch: Batch = []
        for seq in sorted(self.running, key=lambda s: s.is_prefilling):  # decodes first
            if budget == 0:
                break
            if seq not in self.running:  # preempted by an earlier acquisition this step
                continue
            n = min(seq.compute_until - seq.num_computed_tokens, budget)
            extra = self.config.blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
            if extra > 0:
                blocks = self.blocks.acquire(extra, lambda s=seq: self._preempt_for(s))
                if blocks is None:
                    continue
                seq.block_table += blocks
            batch.append((seq, n))
            budget -= n
        return [(s, n) for s, n in batch if s in self.running]

    def _preempt_for(self, seq: Sequence) -> bool:
        """Preempt the most recently admitted running sequence to make room for `seq`;
        False when that was `seq` itself (it waits now)."""
        victim = self.running[-1]
        self.preempt(victim)
        return victim is not seq

    def preempt(self, seq: Sequence) -> None:
        log.info("preempting %s (%d tokens) for memory", seq.request_id, len(seq.tokens))
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.reset()
        self.waiting.appendleft(seq)
        if self.metrics:
            self.metrics.preemptions.inc()
