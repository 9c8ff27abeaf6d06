"""A routed pull on the wire: the PullSpec a turn carries to its worker, and the bytes it
puts on the holder's link while it runs.

Contract: `attach(gen, decision, worker, candidates)` sets `gen.pull` to the pull the
router's decision priced for `worker` (`Decision.pull_of`: the holder's address and id
and the prompt's leading blocks to take from it), or clears it when the decision has
none for that worker (a failover to the next worker must not carry the previous one's
pull); the holder must be among `candidates` (a worker the gateway routes to, so its
address is known). It returns a `LinkCharge` that counts the pull's bytes (predicted
tokens x the worker's KV bytes per token) on the holder's `export_queued_bytes`, the
queue the router prices the next pulls from that holder behind (gateway/routing.py),
until `release()`: at the turn's first token (the pull ended before the prefill that
produced it) or when the attempt ends, whichever comes first; releasing twice is a no-op.

Pull tickets: when the gateway signs them (its --worker-keyring has the `@gateways` line:
`WorkerHandle.tickets`), the PullSpec carries a ticket for the serving worker to read
the prompt's first `num_blocks` blocks (their chained hashes in the request's namespace:
`block_hashes`, the turn's own; hashed from the request when not given) from the holder,
for `tickets.ttl_s` (security/tickets.py). Holders with the gateways' ticket key refuse
pulls without one. The drain hand-off's pulls carry tickets the holder signs itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from prefixgate.gateway import metrics
from prefixgate.gateway.pool import WorkerHandle
from prefixgate.gateway.routing import Decision
from prefixgate.radix import Hashers
from prefixgate.v1 import worker_pb2
from prefixgate.wire.token_ids import prompt_token_ids

__all__ = ["LinkCharge", "attach"]


class LinkCharge:
    """Bytes of one pull counted on its holder's link until released."""

    __slots__ = ("holder", "num_bytes", "num_tokens")

    def __init__(self, holder: WorkerHandle | None = None, num_bytes: int = 0,
                 num_tokens: int = 0) -> None:
        self.holder, self.num_bytes, self.num_tokens = holder, num_bytes, num_tokens
        if holder is not None:
            holder.export_queued_bytes += num_bytes

    def release(self) -> None:
        if self.holder is not None:
            self.holder.export_queued_bytes -= self.num_bytes
            self.holder = None



def attach(gen: worker_pb2.GenerateRequest, decision: Decision, worker: WorkerHandle,
           candidates: Sequence[WorkerHandle],
           block_hashes: Sequence[int] | None = None) -> LinkCharge:
    gen.ClearField("pull")
    pull = decision.pull_of(worker.worker_id)
    if pull is None:
        return LinkCharge()
    holder = next((w for w in candidates if w.worker_id == pull.holder_id), None)
    if holder is None:
        return LinkCharge()
    gen.pull.peer_address = holder.record.address
    gen.pull.peer_worker_id = holder.worker_id
    gen.pull.num_blocks = pull.num_blocks
    if worker.tickets is not None:
        chain = (list(block_hashes[:pull.num_blocks]) if block_hashes is not None
                 else _chain(gen, worker, pull.num_blocks))
        gen.pull.ticket = worker.tickets.sign(worker.worker_id, holder.worker_id,
                                              gen.namespace, chain)
    metrics.PULLS.labels(worker.worker_id, holder.worker_id).inc()
    return LinkCharge(holder, pull.num_tokens * worker.kv_bytes_per_token, pull.num_tokens)


@lru_cache(maxsize=8)
def _hashers(block_size: int, model_fingerprint: str) -> Hashers:
    return Hashers(block_size, model_fingerprint)


def _chain(gen: worker_pb2.GenerateRequest, worker: WorkerHandle, num_blocks: int) -> list[int]:
    """The chained hashes of the request prompt's first `num_blocks` blocks, as the
    workers hash them (when attach is not given the turn's)."""
    info = worker.info
    assert info is not None  # routed to: probed
    ids = prompt_token_ids(gen.prompt_token_ids, gen.packed_prompt_token_ids, 1 << 31)
    return _hashers(info.block_size, info.model_fingerprint).get(gen.namespace).hash_blocks(
        ids[:num_blocks * info.block_size])
