"""Prometheus metrics of a worker, named the way vLLM and SGLang users already scrape.

One `WorkerMetrics` per process, registered in the registry it is given (the default
registry in `prefixgate worker`; a private one in tests). Token counters count tokens,
not requests: hit rate = prefix_cache_hits_total / prefix_cache_queries_total.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from prefixgate.workerapi.api import EngineStatus

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=registry)

        self.prefix_queries = counter("prefixgate:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefixgate:prefix_cache_hits",
                                   "Prompt tokens served from the prefix cache.")
        self.evictions = counter("prefixgate:kv_cache_evicted_blocks",
                                 "Cached KV blocks evicted (LRU) to make room.")
        self.preemptions = counter("prefixgate:num_preemptions",
                                   "Requests preempted (blocks freed, recomputed later).")
        self.running = gauge("prefixgate:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("prefixgate:num_requests_waiting", "Requests waiting for admission.")
        self.queued_prefill = gauge("prefixgate:num_queued_prefill_tokens",
                                    "Prompt tokens admitted or waiting but not yet computed.")
        self.kv_usage = gauge("prefixgate:kv_cache_usage_perc",
                              "Fraction of KV blocks in use (running requests and cache).")
        self.ttft = Histogram("prefixgate:time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.inter_token = Histogram("prefixgate:inter_token_latency_seconds",
                                     "Time between consecutive generated tokens.",
                                     buckets=_LATENCY_BUCKETS, registry=registry)

    def update_status(self, status: EngineStatus) -> None:
        self.running.set(status.num_running_requests)
        self.waiting.set(status.num_waiting_requests)
        self.queued_prefill.set(status.num_queued_prefill_tokens)
        self.kv_usage.set(status.kv_used_tokens / max(1, status.kv_capacity_tokens))
