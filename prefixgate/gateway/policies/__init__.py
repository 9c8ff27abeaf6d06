"""Routing policies, one class per rule behind `RoutingPolicy` (base.py: the contract).

  prefix        the default: the least cost in seconds, from measured rates (prefix.py)
  session       rendezvous hash of the conversation id (simple.py)
  least-loaded  fewest queued prefill tokens, then running sequences (simple.py)
  round-robin   rotate (simple.py)
  random        seeded shuffle (simple.py)
  best-cached   the most cached tokens, then the least loaded (simple.py)
  lmetric       LMetric (OSDI '26): new prefill tokens x batch size (lmetric.py)
  dynamo        NVIDIA Dynamo 1.6's KV router cost (dynamo.py)
  llm-d         llm-d's weighted scorers: prefix 2, KV utilisation 1, queue 1 (llmd.py)
  smetric       vllm-router-style affinity while a TTFT budget holds (smetric.py)
  cache-aware   smg / sglang-router cache_aware thresholds (cache_aware.py)

`POLICIES` maps each name to its class; docs/routing.md documents each rule and its source.
"""

from __future__ import annotations

from prefixgate.gateway.policies.base import (
    Candidates,
    Pull,
    Ranking,
    RoutingPolicy,
    Turn,
    WorkerLoad,
)
from prefixgate.gateway.policies.cache_aware import CacheAware
from prefixgate.gateway.policies.dynamo import DynamoKV
from prefixgate.gateway.policies.llmd import LlmD
from prefixgate.gateway.policies.lmetric import LMetric
from prefixgate.gateway.policies.prefix import PrefixCost
from prefixgate.gateway.policies.simple import (
    BestCached,
    LeastLoaded,
    Random,
    RoundRobin,
    Session,
)
from prefixgate.gateway.policies.smetric import StickyTTFT

__all__ = ["POLICIES", "PUBLISHED", "Candidates", "Pull", "Ranking", "RoutingPolicy", "Turn",
           "WorkerLoad"]

POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (
    PrefixCost, Session, LeastLoaded, RoundRobin, Random, BestCached,
    LMetric, DynamoKV, LlmD, StickyTTFT, CacheAware)}
# The rules published elsewhere, for side-by-side reports.
PUBLISHED = ("lmetric", "dynamo", "llm-d", "smetric", "cache-aware")
