"""`smetric`: a conversation stays on its worker while its predicted TTFT holds a budget.

Source: vllm-router's conversation-affinity rule (an `smetric`-style score: stick to the
worker that served the conversation unless the time to first token there would break the
service level, then move to the worker with the lowest predicted TTFT). The predicted TTFT
on a worker is its queued prefill plus this turn's uncached prompt tokens at its measured
prefill rate; the budget is `RoutingConfig.ttft_budget_s` (the service's TTFT target, a
user's choice, not a tuned constant). A new conversation goes to the lowest predicted
TTFT.
"""

from __future__ import annotations

from prefixgate.gateway.policies.base import (
    Candidates,
    Ranking,
    RoutingPolicy,
    measured_rate,
    rendezvous,
)


class StickyTTFT(RoutingPolicy):
    name = "smetric"
    source = "vllm-router conversation affinity under a TTFT budget"

    def rank(self, c: Candidates) -> Ranking:
        rate = measured_rate(c.workers, self.config.default_prefill_tokens_per_s)
        ttft = {w.worker_id: (w.num_queued_prefill_tokens + c.uncached(w.worker_id))
                / rate[w.worker_id] for w in c.workers}
        stay = c.previous if c.previous in ttft and \
            ttft[c.previous] <= self.config.ttft_budget_s else None
        key = c.key
        return Ranking(sorted(c.workers, key=lambda w: (
            w.worker_id != stay, ttft[w.worker_id], -rendezvous(key, w.worker_id),
            w.worker_id)), cost_s=ttft)
