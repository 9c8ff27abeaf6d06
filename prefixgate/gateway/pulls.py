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
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixgate.gateway import metrics
from prefixgate.gateway.pool import WorkerHandle
from prefixgate.gateway.routing import Decision
from prefixgate.v1 import worker_pb2

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
           candidates: Sequence[WorkerHandle]) -> LinkCharge:
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
    metrics.PULLS.labels(worker.worker_id, holder.worker_id).inc()
    return LinkCharge(holder, pull.num_tokens * worker.kv_bytes_per_token, pull.num_tokens)
