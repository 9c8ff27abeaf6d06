"""Drain hand-off: a leaving worker offers its most reused chains to peers with room.

Contract
--------
`hand_off(service, peers, own_address, budget_s)` runs while a draining worker still
serves (NOT_SERVING, in-flight streams finishing, ExportBlocks answered). It

1. asks each peer (`peers`: (worker id, address) of the same model, self excluded) for
   its status and keeps those with room: free KV tokens = capacity - used;
2. walks the worker's cached chains, the most reused first (`service.handoff_chains()`:
   a prefixgate worker's `BlockTransfer.hot_chains`; a vLLM server's, engines/vllm.py,
   the prompts it served whose blocks it still holds, each with its token ids), giving
   each to the peer with the most room left that can take it whole (room is debited as
   chains are assigned, so a peer is never offered more than it had free);
3. has each peer pull its chains from this worker (`PullBlocks`, which stores and
   publishes them there like computed blocks; the chain's token ids and namespace go
   with it when known, which a vLLM peer needs: it loads KV only for a request, so it
   prefills those tokens with the pull attached), one at a time per peer, peers in
   parallel, until `budget_s` runs out (calls in flight are cancelled then).

Either side may be a vLLM server with prefixgate's KV connector: a draining vLLM worker's
ExportBlocks relays its connector's. Peers are called as in block pulls (`service._peer`:
TLS with each peer's certificate checked against its worker id, the peer credential), and
each PullBlocks carries a pull ticket this worker signs for its own chain
(`service.own_ticket`), which its ExportBlocks then accepts.
A peer that fails is skipped (logged); the hand-off never delays the drain past its
budget and never raises. Returns what was handed off, per peer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from prefixgate.v1 import worker_pb2
from prefixgate.workerapi.transfer import TransferError

log = logging.getLogger(__name__)


class _Config(Protocol):
    worker_id: str
    block_size: int


class _Ticket(Protocol):
    ticket: bytes


class HandingOff(Protocol):
    """What the hand-off uses of the draining worker (workerapi/server.py's
    WorkerServiceBase provides it): whether it hands off, its id and block size, its
    chains, its own tickets and its peers' stubs."""

    config: _Config

    @property
    def hands_off(self) -> bool: ...

    async def handoff_chains(self) -> list[HandoffChain]: ...

    def own_ticket(self, receiver: str, chain: Sequence[int]) -> _Ticket: ...

    def _peer(self, address: str, peer_id: str): ...


@dataclass(frozen=True)
class HandoffChain:
    """One cached chain to offer: its block hashes from the first block, and (when the
    worker knows them) its token ids, block_size per hash, and the namespace it was
    hashed in."""

    block_hashes: tuple[int, ...]
    token_ids: tuple[int, ...] = ()
    namespace: str = ""


@dataclass
class HandoffReport:
    chains: dict[str, int] = field(default_factory=dict)  # peer id -> chains it took
    blocks: dict[str, int] = field(default_factory=dict)  # peer id -> blocks it pulled
    seconds: float = 0.0


async def hand_off(service: HandingOff, peers: Sequence[tuple[str, str]],
                   own_address: str, budget_s: float) -> HandoffReport:
    report = HandoffReport()
    if not service.hands_off or not peers or budget_s <= 0:
        return report
    began = time.monotonic()
    try:
        await asyncio.wait_for(_hand_off(service, peers, own_address, report), budget_s)
    except TimeoutError:
        log.warning("worker %s: hand-off stopped at its %.1f s budget", service.config.worker_id,
                    budget_s)
    except Exception:  # the drain goes on whatever happens here
        log.exception("worker %s: hand-off failed", service.config.worker_id)
    report.seconds = time.monotonic() - began
    log.info("worker %s: handed off %s chains (%s blocks) in %.1f s", service.config.worker_id,
             report.chains, report.blocks, report.seconds)
    return report


async def _hand_off(service: HandingOff, peers: Sequence[tuple[str, str]],
                    own_address: str, report: HandoffReport) -> None:
    bs = service.config.block_size

    async def room(peer_id: str, address: str) -> int:
        try:
            s = await service._peer(address, peer_id).GetStatus(worker_pb2.GetStatusRequest(),
                                                                timeout=2)
        except (grpc.aio.AioRpcError, TransferError) as exc:
            log.info("worker %s: peer %s takes no hand-off: %s", service.config.worker_id,
                     peer_id, exc)
            return 0
        return max(0, s.kv_capacity_tokens - s.kv_used_tokens) // bs
    rooms = await asyncio.gather(*(room(p, a) for p, a in peers))
    free = {p: r for p, r in zip(peers, rooms, strict=True) if r > 0}
    if not free:
        log.info("worker %s: no peer has room for a hand-off", service.config.worker_id)
        return
    chains = await service.handoff_chains()
    plan: dict[tuple[str, str], list[HandoffChain]] = {p: [] for p in free}
    for chain in chains:
        peer = max(free, key=free.__getitem__)
        if free[peer] < len(chain.block_hashes):
            continue  # too long for any peer: a shorter one may still fit
        free[peer] -= len(chain.block_hashes)
        plan[peer].append(chain)

    async def give(peer: tuple[str, str], todo: list[HandoffChain]) -> None:
        peer_id, address = peer
        for chain in todo:
            hashes = list(chain.block_hashes)
            try:
                got = await service._peer(address, peer_id).PullBlocks(
                    worker_pb2.PullBlocksRequest(
                        peer_address=own_address, peer_worker_id=service.config.worker_id,
                        block_hashes=hashes, ticket=service.own_ticket(peer_id, hashes).ticket,
                        token_ids=chain.token_ids, namespace=chain.namespace))
            except TransferError as exc:
                log.warning("worker %s: hand-off to %s: %s", service.config.worker_id,
                            peer_id, exc)
                return
            except grpc.aio.AioRpcError as exc:
                log.warning("worker %s: hand-off to %s: %s %s", service.config.worker_id,
                            peer_id, exc.code().name, exc.details())
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED,
                                  grpc.StatusCode.FAILED_PRECONDITION,
                                  grpc.StatusCode.UNAUTHENTICATED,
                                  grpc.StatusCode.PERMISSION_DENIED):
                    return  # this peer will not take any
                continue
            report.chains[peer_id] = report.chains.get(peer_id, 0) + 1
            report.blocks[peer_id] = report.blocks.get(peer_id, 0) + got.num_pulled_blocks
    await asyncio.gather(*(give(p, todo) for p, todo in plan.items() if todo))
