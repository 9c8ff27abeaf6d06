"""`cache-aware`: smg's (sgl-model-gateway, sglang-router) cache_aware thresholds.

Source: smg 1.13 / sglang-router `cache_aware` policy with its defaults (cache_threshold
0.3, balance_abs_threshold 64, balance_rel_threshold 1.5):

  * the load is imbalanced when max - min running requests > balance_abs_threshold and
    max > balance_rel_threshold x min: the least loaded worker (running requests);
  * else the worker with the highest prefix match rate (matched / prompt tokens) when it
    exceeds cache_threshold;
  * else the worker with the most cache room (smg: the smallest tree; here the fewest
    indexed blocks).

smg matches the request's text against its own tree of what it routed; prefixgate's rule
reads the event-fed index (`Candidates.credit`), which only knows more. The rest of the
ranking (failover order) is least loaded first.
"""

from __future__ import annotations

from prefixgate.gateway.policies.base import Candidates, Ranking, RoutingPolicy, load_key

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


class CacheAware(RoutingPolicy):
    name = "cache-aware"
    source = "smg 1.13 / sglang-router cache_aware (defaults 0.3, 64, 1.5)"

    def rank(self, c: Candidates) -> Ranking:
        ws = c.workers
        if not ws:
            return Ranking([])
        running = [w.num_running_requests for w in ws]
        lo, hi = min(running), max(running)
        rest = sorted(ws, key=load_key)
        if hi - lo > BALANCE_ABS_THRESHOLD and hi > BALANCE_REL_THRESHOLD * lo:
            first = min(ws, key=lambda w: (w.num_running_requests, w.worker_id))
        else:
            prompt = max(1, c.turn.num_prompt_tokens)
            best = max(ws, key=lambda w: (c.credit.get(w.worker_id, 0.0), -ws.index(w)))
            if c.credit.get(best.worker_id, 0.0) / prompt > CACHE_THRESHOLD:
                first = best
            else:
                first = min(ws, key=lambda w: (c.occupancy.get(w.worker_id, 0),
                                               w.num_running_requests, w.worker_id))
        return Ranking([first] + [w for w in rest if w is not first])
