"""Prometheus metrics of the gateway (process-wide, in prometheus_client's default registry,
served by `--metrics-port`), named like the worker's (`prefixgate:...`).

Routing:  prefixgate:router_turns_total{worker,policy}          turns routed (first choice)
          prefixgate:router_expected_cached_tokens_total{worker,policy}
                                                                 cached tokens the router
                                                                 expected of its choice
          prefixgate:router_cached_tokens_total{worker,policy}   cached tokens the worker
                                                                 reported for them
          prefixgate:router_prompt_tokens_total{worker,policy}   their prompt tokens
          prefixgate:router_failovers_total                      turns re-routed before the
                                                                 first token
          prefixgate:router_decision_seconds                     hashing + ranking time
Decision quality (per served turn; docs/routing.md):
          prefixgate:router_decisions_total{on_best}             "true" when the serving
                                                                 worker had the most
                                                                 predicted cached tokens of
                                                                 any candidate; share on the
                                                                 best = true / all
          prefixgate:router_regret_tokens_total                  predicted cached tokens lost
                                                                 by serving off the best
          prefixgate:router_cached_prediction_error_tokens       histogram: predicted minus
                                                                 reported cached tokens
Predictions: prefixgate:index_expected_blocks                    blocks expected (routed,
                                                                 not yet confirmed)
          prefixgate:index_prediction_confidence                 share of predicted blocks
                                                                 confirmed by events
Index:    prefixgate:index_blocks                                distinct blocks indexed
          prefixgate:index_events_total{source,kind}             worker events applied
          prefixgate:index_event_blocks_total{source}            blocks named by them
          prefixgate:index_resyncs_total{source}                 rebuilds from a snapshot
Registry: prefixgate:registry_degraded                           1 while Redis is unreachable
          prefixgate:registry_reaped_workers_total               expired workers reaped here
Expected hit rate = expected_cached_tokens_total / prompt_tokens_total; the actual one uses
cached_tokens_total (a gap between them means the index is stale or lagging).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TURNS = Counter("prefixgate:router_turns", "Turns routed, by first-choice worker and policy.",
                ["worker", "policy"])
EXPECTED_CACHED = Counter("prefixgate:router_expected_cached_tokens",
                          "Cached prompt tokens the router expected of its first choice.",
                          ["worker", "policy"])
CACHED = Counter("prefixgate:router_cached_tokens",
                 "Cached prompt tokens the chosen worker reported (compare with expected).",
                 ["worker", "policy"])
PROMPT_TOKENS = Counter("prefixgate:router_prompt_tokens", "Prompt tokens of routed turns.",
                        ["worker", "policy"])
FAILOVERS = Counter("prefixgate:router_failovers",
                    "Turns re-routed to the next worker before the first token.")
DECISION_SECONDS = Histogram("prefixgate:router_decision_seconds",
                             "Time to hash a prompt and rank the workers.",
                             buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1))
INDEX_BLOCKS = Gauge("prefixgate:index_blocks", "Distinct KV blocks in the routing index.")
EVENTS = Counter("prefixgate:index_events", "Worker KV events applied to the routing index.",
                 ["source", "kind"])
EVENT_BLOCKS = Counter("prefixgate:index_event_blocks", "Blocks named by applied KV events.",
                       ["source"])
RESYNCS = Counter("prefixgate:index_resyncs", "Routing index rebuilds from a snapshot.",
                  ["source"])
REGISTRY_DEGRADED = Gauge("prefixgate:registry_degraded",
                          "1 while the shared registry (Redis) is unreachable: routing uses "
                          "the last known index and workers.")
REAPED = Counter("prefixgate:registry_reaped_workers",
                 "Workers whose lease expired, reaped (ownership removed) by this gateway.")
DECISIONS = Counter("prefixgate:router_decisions",
                    "Served turns, by whether the serving worker had the most predicted cached "
                    "tokens of any candidate.", ["on_best"])
REGRET_TOKENS = Counter("prefixgate:router_regret_tokens",
                        "Predicted cached tokens lost by serving turns off the best-cached "
                        "worker.")
PREDICTION_ERROR = Histogram(
    "prefixgate:router_cached_prediction_error_tokens",
    "Predicted minus reported cached prompt tokens of the serving worker, per turn.",
    buckets=(-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096))
EXPECTED_BLOCKS = Gauge("prefixgate:index_expected_blocks",
                        "Blocks expected on workers (routed there, not yet confirmed).")
PREDICTION_CONFIDENCE = Gauge("prefixgate:index_prediction_confidence",
                              "Share of predicted blocks that worker events confirmed.")
