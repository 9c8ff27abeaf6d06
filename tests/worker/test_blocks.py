"""Block acquisition (evict -> allocate -> preempt) and what the cache reports dropping,
on a one-layer pool (no model)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from prefixgate.wire.protocol import SamplingConfig
from prefixgate.worker.blocks import BlockManager
from prefixgate.worker.kv_pool import KVPool, KVPoolConfig
from prefixgate.worker.prefix_cache import PrefixCache
from prefixgate.worker.sequence import Sequence
from prefixgate.workerapi.api import Request
from prefixgate.workerapi.metrics import WorkerMetrics


def _parts(num_blocks: int) -> tuple[KVPool, PrefixCache, BlockManager, WorkerMetrics]:
    pool = KVPool(KVPoolConfig(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4,
                               num_blocks=num_blocks))
    cache = PrefixCache(pool)
    metrics = WorkerMetrics(CollectorRegistry())
    return pool, cache, BlockManager(pool, cache, metrics), metrics


def _evicted(metrics: WorkerMetrics) -> float:
    return metrics.evictions._value.get()


def test_acquire_evicts_only_the_shortfall_and_counts_what_left_the_cache() -> None:
    pool, cache, blocks, metrics = _parts(6)
    cached = pool.allocate(4)
    cache.insert([11, 12, 13, 14], cached)  # 4 cached, 2 free
    assert blocks.acquire(3) is not None  # short by 1: one leaf evicted
    assert _evicted(metrics) == 1 and cache.num_blocks == 3
    # A cached block a sequence still references leaves the cache without returning to
    # the pool: the eviction counts, and acquisition goes on evicting until it has room.
    _, shared = cache.match([11, 12, 13])
    cache.unlock(_)
    pool.release(shared[:2])  # keep one extra reference, on the deepest block only
    assert blocks.acquire(1) is not None
    assert _evicted(metrics) == 3 and pool.refcount(shared[2]) == 1


def test_acquire_without_room_preempts_or_gives_none() -> None:
    pool, cache, blocks, metrics = _parts(4)
    held = pool.allocate(3)
    assert blocks.acquire(2) is None and _evicted(metrics) == 0
    assert pool.num_free_blocks == 1  # nothing taken on failure
    calls: list[int] = []

    def preempt() -> bool:
        calls.append(1)
        pool.release(held[:1])
        return True

    assert blocks.acquire(2, preempt) is not None and calls == [1]
    seq = Sequence(Request("r", (1,), SamplingConfig()), print, None, None, [1],  # type: ignore[arg-type]
                   block_table=list(held[1:]))
    blocks.release(seq)
    assert seq.block_table == [] and pool.num_free_blocks == 2


def test_flush_counts_tokens_not_blocks_times_block_size() -> None:
    pool, cache, _, _ = _parts(8)
    full = pool.allocate(2)
    cache.insert([1, 2], full)
    tail = pool.allocate(1)
    cache.store_tail(2, [5, 6, 7], tail[0])  # 3 tokens in a block of 4
    assert cache.num_evictable_blocks == 3
    assert cache.flush() == 2 * 4 + 3
    assert pool.num_free_blocks == 8
