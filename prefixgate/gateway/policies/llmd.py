"""`llm-d`: llm-d's inference scheduler, weighted scorers, the highest total wins.

Source: llm-d inference scheduler (llm-d/llm-d-inference-scheduler, the default
scheduling profile of its "precise prefix cache" guide): prefix-cache-scorer weight 2,
kv-cache-utilization-scorer 1, queue-scorer 1, max-score picker. Each scorer gives a
worker a score in [0, 1]:

    prefix  share of the prompt's tokens cached there (`Candidates.credit` / prompt)
    kv      1 - the worker's KV cache utilisation (`kv_fill`)
    queue   (max queue - its queue) / (max queue - min queue) over the candidates (1
            when all are equal); llm-d counts waiting requests, prefixgate's load view
            counts the queued prefill tokens they hold

Ties (the picker draws at random) go to a rendezvous hash of the conversation.
"""

from __future__ import annotations

from prefixgate.gateway.policies.base import Candidates, Ranking, RoutingPolicy, rendezvous

WEIGHTS = {"prefix": 2.0, "kv": 1.0, "queue": 1.0}  # llm-d's defaults


class LlmD(RoutingPolicy):
    name = "llm-d"
    source = "llm-d inference scheduler (prefix 2, KV utilisation 1, queue 1)"

    def rank(self, c: Candidates) -> Ranking:
        prompt = max(1, c.turn.num_prompt_tokens)
        queues = [w.num_queued_prefill_tokens for w in c.workers]
        lo, hi = min(queues, default=0), max(queues, default=0)
        key = c.key
        score: dict[str, float] = {}
        for w in c.workers:
            wid = w.worker_id
            prefix = min(1.0, c.credit.get(wid, 0.0) / prompt)
            kv = 1.0 - min(1.0, max(0.0, w.kv_fill))
            queue = (hi - w.num_queued_prefill_tokens) / (hi - lo) if hi > lo else 1.0
            score[wid] = (WEIGHTS["prefix"] * prefix + WEIGHTS["kv"] * kv
                          + WEIGHTS["queue"] * queue)
        return Ranking(sorted(c.workers, key=lambda w: (-score[w.worker_id],
                                                        -rendezvous(key, w.worker_id),
                                                        w.worker_id)))
