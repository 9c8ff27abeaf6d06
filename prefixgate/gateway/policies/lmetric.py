"""`lmetric`: new prefill tokens x batch size, the least wins (no weight to tune).

Source: Zhang et al., "LMetric: Simple is Better - Multiplication May Be All You Need for
LLM Request Scheduling" (OSDI '26; arXiv:2603.15202). The score multiplies a KV-cache
indicator (the prefill tokens the instance would have to compute if the request went
there: its queued prefill plus this prompt's uncached tokens) by a load indicator (the
instance's current batch size, running sequences); as a product, the scale of each
cancels out in the comparison. Where the product is 0 on several workers (idle batches:
the paper's rare "both zero" case), the fewer prefill tokens win, then the batch size.
"""

from __future__ import annotations

from prefixgate.gateway.policies.base import Candidates, Ranking, RoutingPolicy, rendezvous


class LMetric(RoutingPolicy):
    name = "lmetric"
    source = "LMetric (OSDI '26, arXiv:2603.15202)"

    def rank(self, c: Candidates) -> Ranking:
        key = c.key

        def score(w) -> tuple:
            prefill = w.num_queued_prefill_tokens + c.uncached(w.worker_id)
            batch = w.num_running_requests
            return (prefill * batch, prefill, batch, -rendezvous(key, w.worker_id),
                    w.worker_id)

        return Ranking(sorted(c.workers, key=score))
