"""`dynamo`: NVIDIA Dynamo 1.6's KV router cost, in KV blocks, the least wins.

Source: Dynamo's KV router (lib/llm/src/kv_router, `KvScheduler`; docs "KV Cache
Routing"), with its defaults (overlap score weight / prefill load scale 1.0, temperature
0: the lowest cost, ties at random):

    cost = prefill_load_scale x prefill_blocks + decode_blocks
    prefill_blocks = active prefill blocks (queued prefill tokens / block size)
                     + the prompt's blocks - the blocks the worker holds of it (overlap)
    decode_blocks  = blocks of the sequences active on the worker, as this router counts
                     them (its own turns, from dispatch to their end: `Candidates.active`)
                     plus this prompt's

Dynamo's tiered credit for host-cached blocks does not apply: prefixgate's workers hold
one tier (every cached block is on the device). Ties go to a rendezvous hash of the
conversation (Dynamo draws one at random).
"""

from __future__ import annotations

from prefixgate.gateway.policies.base import Candidates, Ranking, RoutingPolicy, rendezvous

PREFILL_LOAD_SCALE = 1.0  # Dynamo's default overlap_score_weight


class DynamoKV(RoutingPolicy):
    name = "dynamo"
    source = "NVIDIA Dynamo 1.6 KV router (KvScheduler cost, default weights)"

    def rank(self, c: Candidates) -> Ranking:
        bs = max(1, c.turn.block_size)
        prompt_blocks = -(-c.turn.num_prompt_tokens // bs)
        key = c.key
        cost: dict[str, float] = {}
        for w in c.workers:
            wid = w.worker_id
            overlap = c.credit.get(wid, 0.0) / bs
            prefill = w.num_queued_prefill_tokens / bs + prompt_blocks - overlap
            decode = c.active_tokens.get(wid, 0) / bs + prompt_blocks
            cost[wid] = PREFILL_LOAD_SCALE * prefill + decode
        ranked = sorted(c.workers, key=lambda w: (cost[w.worker_id],
                                                  -rendezvous(key, w.worker_id), w.worker_id))
        return Ranking(ranked)
