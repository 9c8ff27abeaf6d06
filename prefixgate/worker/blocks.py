"""Block acquisition: the one way the engine gets KV blocks, and gives them back.

Contract
--------
`BlockManager.acquire(num_blocks, preempt)` returns `num_blocks` distinct fresh blocks
(one pool reference each) or None, trying in this order, the order of their cost:

1. free blocks of the pool;
2. evicting unlocked cached blocks for the shortfall (tails first, then LRU leaves;
   worker/prefix_cache.py): a cached block costs a recompute only if it is asked for
   again;
3. `preempt()`, when given: the caller frees a running sequence's blocks (recomputed
   later) and returns True to go on, or False when it cannot or must not (nothing left
   to preempt, or the requester itself was the victim). Every path that may not preempt
   (tail copy, shifted reuse, a fork's partial block) passes none and gets None instead.

Nothing is allocated when it returns None (what was evicted or preempted stays so).
`metrics.evictions` counts the blocks eviction really removed from the cache (the
result, not the shortfall asked for); a block still shared with a running sequence
leaves the cache without returning to the pool, which is why the loop re-reads the pool.

`release(seq)` drops the sequence's references on its block table and its lock on its
matched cache path; it is how every path hands a sequence's blocks back.
"""

from __future__ import annotations

from collections.abc import Callable

from prefixgate.worker.kv_pool import KVPool
from prefixgate.worker.prefix_cache import PrefixCache
from prefixgate.worker.sequence import Sequence
from prefixgate.workerapi.metrics import WorkerMetrics


class BlockManager:
    def __init__(self, pool: KVPool, cache: PrefixCache,
                 metrics: WorkerMetrics | None = None) -> None:
        self.pool = pool
        self.cache = cache
        self.metrics = metrics

    def acquire(self, num_blocks: int, preempt: Callable[[], bool] | None = None
                ) -> list[int] | None:
        while True:
            short = num_blocks - self.pool.num_free_blocks
            while short > 0:
                evicted = self.cache.evict(short)
                if not evicted:
                    break
                if self.metrics:
                    self.metrics.evictions.inc(evicted)
                short = num_blocks - self.pool.num_free_blocks
            if short <= 0:
                blocks = self.pool.allocate(num_blocks)
                assert blocks is not None
                return blocks
            if preempt is None or not preempt():
                return None

    def release(self, seq: Sequence, blocks: list[int] | None = None) -> None:
        """Release `blocks` (default: seq's whole block table, which is then emptied) and
        unlock seq's cache path."""
        if blocks is None:
            blocks, seq.block_table = seq.block_table, []
        self.pool.release(blocks)
        if seq.cache_handle is not None:
            self.cache.unlock(seq.cache_handle)
            seq.cache_handle = None
