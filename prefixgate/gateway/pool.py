"""The gateway's view of its workers: connections, identity checks, load counters.

Contract: `WorkerPool.refresh()` reads the registry, connects to new workers (GetInfo
within `connect_timeout_s`) and closes the clients of workers that left it (turns already
streaming get `close_grace_s` to finish). Each worker is called through its
`WorkerHandle.client` (workerapi/client.py `WorkerClient`): a `GrpcWorkerClient` over a
channel, or, for a worker served in this process (`local`: e.g. a vLLM server behind its
adapter), the `InProcessWorkerClient` given for its registry address. A worker
registered again at the same address (a new epoch) keeps its connection and in-flight
turns. A worker whose model fingerprint differs from the gateway's is refused: logged,
listed in `refused`, never routed to (so is one whose block size differs: its block
hashes would never match). A worker's load (`WorkerHandle.status`) is pushed to it by
gateway/status.py; this gateway's own turns there count through
`WorkerHandle.lease(prompt_tokens)` (a `Lease` held from sending a turn until it ends),
never through counters updated by hand. `healthy()` lists the workers a turn may be
routed to, sorted by id.

Health comes from probes and transport errors only, never from one request's outcome:
a worker is down when its probe (GetInfo, then `WorkerClient.serving`: the
grpc.health.v1 check of the worker service, NOT_SERVING while it drains, or an in-process
worker's own `serving()`) fails, or when the gateway's call to it fails at the transport
(`mark_down`, for UNAVAILABLE); the next successful probe brings it back. A probe that
only times out (DEADLINE_EXCEEDED) does not take down a worker that pushed its status
within the probe timeout: it is alive and busy (a host saturated by a burst answers
probes late), and taking it down would send its conversations elsewhere to recompute. A
worker that neither answers nor pushes is down. A worker missing from the registry is
dropped once it is down or has been missing for `absent_grace_s`: a registry that comes
back empty (Redis restarted) never drops live workers before they register again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc

from prefixgate.gateway.routing import queued_prefill_tokens
from prefixgate.registry import Registry, WorkerRecord
from prefixgate.security import identity
from prefixgate.security.auth import InternalCredential
from prefixgate.v1 import worker_pb2
from prefixgate.wire import rpc
from prefixgate.workerapi.client import GrpcWorkerClient, WorkerClient

log = logging.getLogger(__name__)

# A worker channel that lost its connection reconnects after at most 1 s. gRPC's default
# backoff grows to 120 s; while it waits, every call (probes included) fails at once, so a
# worker restarted at the same address stayed out of service for seconds after it served
# again. One connection attempt a second to a dead address costs nothing that matters.
WORKER_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 200),
                          ("grpc.min_reconnect_backoff_ms", 200),
                          ("grpc.max_reconnect_backoff_ms", 1000))


@dataclass
class WorkerHandle:
    record: WorkerRecord
    client: WorkerClient  # how the gateway calls it (workerapi/client.py)
    info: worker_pb2.WorkerInfo | None = None
    up: bool = False
    # Turns this gateway routed here and not finished yet, and the prompt tokens of those
    # still waiting for their first token (prefill this gateway knows is queued).
    in_flight: int = 0
    in_flight_prompt_tokens: int = 0
    # The worker's own figures (all gateways' requests), pushed (gateway/status.py).
    status: worker_pb2.WorkerStatus | None = None
    # This gateway's turns here that ended, and prompt tokens whose prefill it saw end,
    # since `status` was set: the status is up to an interval old, and a turn that just
    # ended must not count against the worker its conversation's next turn prefers.
    finished_since_status: int = 0
    prefilled_since_status: int = 0
    in_flight_prompt_tokens_at_status: int = 0  # in_flight_prompt_tokens when it was set
    # Bytes of the pulls this gateway routed from this worker, not finished (its link's
    # queue as this gateway knows it; gateway/pulls.py).
    export_queued_bytes: int = 0
    absent_since: float | None = None  # monotonic time it was first missing from the registry
    heard_at: float = 0.0  # monotonic time of its last pushed status (0: never)
    said_down: bool = False  # its being down or unreachable was logged (once per outage)
    # The fastest prefill this gateway has seen the worker deliver (tokens per second; 0:
    # none yet). Its self-reported rate counts only up to this.
    observed_prefill_tokens_per_s: float = 0.0
    # The fastest pull this gateway has seen land at, or leave, the worker: bytes pulled
    # over the time from sending the turn to its first token (bytes per second; 0: none
    # yet). Its self-reported transfer rate counts only up to this once there is one.
    observed_transfer_bytes_per_s: float = 0.0
    # Signs the pull tickets of pulls from this worker (gateway/pulls.py); None: unsigned.
    tickets: identity.TicketSigner | None = None
    # The shortest time per generated token this gateway has seen in one of its replies
    # from the worker (seconds; 0: none yet). Its self-reported decode step counts as at
    # least this: one step makes one token per stream, so a stream's time per token is at
    # least the step the worker really runs.
    observed_decode_step_s: float = 0.0
    # Its figures are measured in this process, not claimed by a worker: a vLLM server
    # this gateway follows through its adapter (`WorkerPool.local`) reports what the
    # adapter timed itself (its probe and its turns, fitted net of what every request
    # pays: workerapi/rates.py). Once the gateway has seen it deliver, as for any worker,
    # they count as reported, unclamped by what it saw.
    measured_here: bool = False

    def lease(self, prompt_tokens: int, pulled: bool = False) -> Lease:
        """Count one turn sent here, with `prompt_tokens` of prefill queued for it, in this
        worker's load until the lease closes (`Lease`); `pulled`: it pulls blocks first."""
        return Lease(self, prompt_tokens, pulled)

    @property
    def worker_id(self) -> str:
        """The id the worker reports (static workers are listed under their address)."""
        return self.info.worker_id if self.info is not None else self.record.worker_id

    def set_status(self, status: worker_pb2.WorkerStatus | None) -> None:
        self.status = status
        if status is not None:
            self.heard_at = time.monotonic()
        self.finished_since_status = self.prefilled_since_status = 0
        # No status (the stream failed): the own count alone stands for the load.
        self.in_flight_prompt_tokens_at_status = (self.in_flight_prompt_tokens
                                                  if status is not None else 0)

    # The routing.WorkerLoad view. The worker's status lags by up to its push interval
    # and this gateway's counters miss other gateways' turns. Queued prefill: the status,
    # less this gateway's prefill in it that ended since, plus this gateway's prompt tokens
    # sent since the status and still waiting for their first token (the worker queues
    # first come first served, so the prefill that ended since was the older turns'
    # first). A burst routed here counts at once, and a prompt being prefilled counts
    # with what is left of it, as the worker reports it: the own count alone holds a
    # turn's whole prompt until its first token, which made a long prefill that was
    # nearly done look like a whole one ahead of the next turn. Running: the larger of
    # the status (less what ended here since) and the own count.
    @property
    def num_queued_prefill_tokens(self) -> int:
        if self.status is None:
            return queued_prefill_tokens(0, self.prefilled_since_status,
                                         self.in_flight_prompt_tokens,
                                         self.in_flight_prompt_tokens_at_status)
        # The loosest credible rate bounds what the worker computed since its status: a
        # rate set too low would only hold a finished turn's remainder in the queue until
        # the next status, one set too high subtracts no more than the turns that ended.
        rate = max(self.status.prefill_tokens_per_s, self.observed_prefill_tokens_per_s)
        computable = ((time.monotonic() - self.heard_at) * rate if rate > 0
                      else float("inf"))
        return queued_prefill_tokens(self.status.num_queued_prefill_tokens,
                                     self.prefilled_since_status,
                                     self.in_flight_prompt_tokens,
                                     self.in_flight_prompt_tokens_at_status, computable)

    @property
    def num_running_requests(self) -> int:
        polled = self.status.num_running_requests if self.status is not None else 0
        return max(polled - self.finished_since_status, self.in_flight)

    # The worker's measured rates (routing by cost; 0 = not measured) and cache fill.
    # A worker's own figure is a claim: a worker that reported 10^9 tokens/s drew every
    # new conversation. The prefill rate counts up to the fastest this gateway has seen
    # the worker deliver, and as unmeasured (its peers' mean) before it has seen any. What
    # the gateway sees is below the true rate (the time to a first token also holds
    # transport and interleaved decode steps), but it is measured alike for every worker,
    # so an honest worker loses nothing against its peers and a lying one gains nothing;
    # a lower report (a worker that slowed down) still counts as it is. What the gateway
    # sees is a lower bound, and a loose one for a short prompt (its first token is mostly
    # what any request pays): where the figures are this process's own measurements
    # (`measured_here`), there is no claim to bound and they count as they are, from the
    # first turn seen there (before, the adapter's figure is its start-up probe alone,
    # one pair of timings, which on a loaded host read one server at twice its peer's
    # rate; unmeasured, it is priced at its peers'). (A vLLM CPU server that drew a
    # 14-token turn first, its first token 0.45 s later, read 31 tokens/s against the 180
    # its adapter measured, and priced so it drew no longer turn.)
    @property
    def prefill_tokens_per_s(self) -> float:
        reported = self.status.prefill_tokens_per_s if self.status is not None else 0.0
        seen = self.observed_prefill_tokens_per_s
        if self.measured_here:  # as reported, once seen (a probe alone is one noisy pair)
            return reported if seen > 0 else 0.0
        return min(reported, seen)

    @property
    def decode_step_s(self) -> float:
        reported = self.status.decode_step_s if self.status is not None else 0.0
        if reported <= 0 or self.observed_decode_step_s <= 0:
            return 0.0  # not measured (a claim alone is not a measure)
        return reported if self.measured_here else max(reported, self.observed_decode_step_s)

    @property
    def prefill_chunk_tokens(self) -> int:
        return self.status.prefill_chunk_tokens if self.status is not None else 0

    # The transfer rate is a claim too, clamped like the prefill rate once a pull to or
    # from the worker has been seen (the time to first token holds the pull, the rest of
    # the prefill and any queue: below the true rate, for every worker alike). Before any,
    # the claim counts as it is: a router offers no pull without a rate, so a fleet that
    # never pulled would never start, and a pull is priced at the slower end's rate, so
    # one worker's inflated claim is capped by its honest peer's until the first pull
    # between them is seen.
    @property
    def transfer_bytes_per_s(self) -> float:
        reported = self.status.transfer_bytes_per_s if self.status is not None else 0.0
        seen = self.observed_transfer_bytes_per_s
        return min(reported, seen) if seen > 0 and not self.measured_here else reported

    @property
    def transfer_setup_s(self) -> float:
        return self.status.transfer_setup_s if self.status is not None else 0.0

    @property
    def kv_bytes_per_token(self) -> int:
        return self.status.kv_bytes_per_token if self.status is not None else 0

    @property
    def reuse_block_tokens(self) -> int:
        """Tokens the worker's engine reuses a prefix in whole multiples of (0: any
        length; routing.reusable_tokens)."""
        return self.info.reuse_block_tokens if self.info is not None else 0

    @property
    def kv_fill(self) -> float:
        s = self.status
        if s is None or not s.kv_capacity_tokens:
            return 1.0
        return min(1.0, s.kv_used_tokens / s.kv_capacity_tokens)


class Lease:
    """One turn's share of a worker's load as this gateway counts it (`WorkerHandle`'s
    in-flight counters), held from sending the turn until it ends there, whatever the
    outcome. `first_token()`: the turn's prefill is done (its prompt tokens leave the queue
    and count as prefill ended since the last status; the prefill this took, with the
    queue it waited behind, is what the gateway saw the worker deliver, unless the turn
    `pulled` blocks first: its wait holds the pull, which `transferred()` measures);
    closing does that too if it never came (a failed prefill is no longer queued either),
    and ends the turn.
    Use as a context manager, so that every path out of a turn gives the load back
    exactly once."""

    __slots__ = ("worker", "pending", "pulled", "ahead", "sent_at", "first_at", "first_tokens")

    def __init__(self, worker: WorkerHandle, prompt_tokens: int, pulled: bool = False) -> None:
        self.worker, self.pending, self.pulled = worker, prompt_tokens, pulled
        # This gateway's own prefill queued ahead of this turn (first come, first served:
        # done before its first token too). Not the worker's reported queue: a worker that
        # claimed a long queue would look as fast as it liked.
        self.ahead = worker.in_flight_prompt_tokens
        self.sent_at = time.monotonic()
        self.first_at = 0.0
        self.first_tokens = 0  # tokens of the reply's first chunk
        worker.in_flight += 1
        worker.in_flight_prompt_tokens += prompt_tokens

    def first_token(self, num_tokens: int = 1) -> None:
        w, pending = self.worker, self.pending
        if not self.first_at:
            self.first_at, self.first_tokens = time.monotonic(), num_tokens
        if pending:
            elapsed = self.first_at - self.sent_at
            if elapsed > 0 and not self.pulled:
                w.observed_prefill_tokens_per_s = max(w.observed_prefill_tokens_per_s,
                                                      (self.ahead + pending) / elapsed)
            w.in_flight_prompt_tokens -= pending
            w.prefilled_since_status += pending
            self.pending = 0

    def transferred(self, num_bytes: int, holder: WorkerHandle | None,
                    computed_tokens: int = 0) -> None:
        """The reply's first token came after `num_bytes` of KV were pulled from `holder`
        to this lease's worker and `computed_tokens` of the prompt were prefilled there:
        the rate both ends were seen to deliver at (at least). The time to first token
        less the prefill it waited for (this gateway's queued ahead and the turn's own
        computed tokens, at the worker's prefill rate as the gateway counts it) is the
        pull's. Without that subtraction a pull into a busy worker read as a link of
        hundreds of KB/s (a 1.5 MB pull behind 5 s of others' prefill), and clamped so,
        no pull was offered again; a pull that hid wholly behind the prefill says nothing
        of the link."""
        if not (self.first_at and num_bytes > 0):
            return
        elapsed = self.first_at - self.sent_at
        prefill = self.worker.prefill_tokens_per_s
        if prefill > 0:
            elapsed -= (self.ahead + computed_tokens) / prefill
        if elapsed <= 0:
            return
        rate = num_bytes / elapsed
        for w in (self.worker, holder):
            if w is not None:
                w.observed_transfer_bytes_per_s = max(w.observed_transfer_bytes_per_s, rate)

    def decoded(self, num_tokens: int) -> None:
        """The reply ended with `num_tokens` generated tokens in all: the time per token
        after its first chunk is the pace the gateway saw the worker deliver. (A worker
        that held tokens back to look quick sent its first chunk late: its prefill shows
        that instead.)"""
        later = num_tokens - self.first_tokens
        if self.worker is not None and self.first_at and later > 0:
            per_token = (time.monotonic() - self.first_at) / later
            w = self.worker
            w.observed_decode_step_s = (min(w.observed_decode_step_s, per_token)
                                        if w.observed_decode_step_s else per_token)

    def close(self) -> None:
        if self.worker is None:
            return
        w = self.worker
        if self.pending:  # no first token came: nothing was seen delivered
            w.in_flight_prompt_tokens -= self.pending
            w.prefilled_since_status += self.pending
            self.pending = 0
        w.in_flight -= 1
        w.finished_since_status += 1
        self.worker = None  # type: ignore[assignment]

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class WorkerPool:
    registry: Registry
    model_fingerprint: str
    connect_timeout_s: float = 2.0
    block_size: int = 0  # workers must use this block size (0: not checked)
    close_grace_s: float = 30.0  # in-flight turns of a worker that left may finish this long
    # A live worker missing from the registry stays this long: a registry that restarted
    # empty lists it again once it re-registers, normally within one lease renewal (under
    # load, 12 s was measured: docs/reliability.md); three default 10 s leases.
    absent_grace_s: float = 30.0
    workers: dict[str, WorkerHandle] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # worker id -> reason
    tls: rpc.TLSConfig | None = None  # worker channels over TLS (rpc.channel)
    credential: InternalCredential | None = None  # sent on every worker call
    # Registered workers must have signed their registration with their key from this
    # keyring (prefixgate.security.identity); others are refused before any connection is made.
    keyring: identity.Keyring | None = None
    # Workers served inside this process (workerapi/client.py InProcessWorkerClient: e.g.
    # a vLLM server behind its adapter), by registry address.
    local: dict[str, WorkerClient] = field(default_factory=dict)
    # Signs the pull tickets of the workers in `local` (None: unsigned): the keyring above
    # is for workers registered in Redis only.
    local_tickets: identity.TicketSigner | None = None
    _closing: set[asyncio.Task] = field(default_factory=set, repr=False)

    def healthy(self) -> list[WorkerHandle]:
        return [w for _, w in sorted(self.workers.items()) if w.up]

    def mark_down(self, worker: WorkerHandle, reason: str) -> None:
        # Logged once per outage, also for a worker never reached (a wrong --worker
        # address must be named, not silently retried).
        if worker.up or not worker.said_down:
            log.warning("worker %s at %s is %s: %s", worker.worker_id, worker.record.address,
                        "down" if worker.up else "not reachable (retrying)", reason)
        worker.up, worker.said_down = False, True

    async def refresh(self) -> None:
        records = {r.worker_id: r for r in await self.registry.list_workers()
                   if self.keyring is None or self._verified(r)}
        now = time.monotonic()
        for wid in list(self.workers):
            w = self.workers[wid]
            new = records.get(wid)
            if new is not None and new.address == w.record.address:
                # Same process address, maybe a new epoch (it registered again, e.g. after a
                # Redis restart): keep the connection and the turns streaming over it.
                w.record, w.absent_since = new, None
                continue
            if new is None and w.up:  # missing: kept while it answers, for a grace period
                w.absent_since = w.absent_since or now
                if now - w.absent_since < self.absent_grace_s:
                    continue
            del self.workers[wid]
            log.info("worker %s at %s left (deregistered, lease expired or replaced); turns "
                     "streaming from it may finish", wid, w.record.address)
            # Turns already streaming from it may finish; new ones no longer go there.
            task = asyncio.create_task(w.client.close(grace=self.close_grace_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        for wid, record in records.items():
            if wid not in self.workers and record.address in self.local:
                self.workers[wid] = WorkerHandle(record, self.local[record.address],
                                                 tickets=self.local_tickets, measured_here=True)
            elif wid not in self.workers:
                channel = rpc.channel(record.address, self.tls,
                                      self.credential.metadata if self.credential else (),
                                      options=WORKER_CHANNEL_OPTIONS)
                self.workers[wid] = WorkerHandle(
                    record, GrpcWorkerClient(channel),
                    tickets=self.keyring.ticket_signer() if self.keyring is not None else None)
        await asyncio.gather(*(self._probe(w) for w in self.workers.values()))

    def _verified(self, r: WorkerRecord) -> bool:
        """Whether `r` is signed by its worker's key; else refused, saying why."""
        assert self.keyring is not None
        reason = identity.verify_registration(self.keyring, r.worker_id, r.address,
                                              r.model_fingerprint, r.capacity_blocks,
                                              r.signature)
        if reason:
            if self.refused.get(r.worker_id) != reason:
                log.error("refusing worker %s at %s: %s", r.worker_id[:64], r.address[:64],
                          reason)
            self.refused[r.worker_id] = reason
        return not reason

    async def _probe(self, w: WorkerHandle) -> None:
        try:
            info = await w.client.GetInfo(worker_pb2.GetInfoRequest(),
                                          timeout=self.connect_timeout_s)
            serving = await w.client.serving(timeout=self.connect_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if (exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and w.up
                    and time.monotonic() - w.heard_at < self.connect_timeout_s):
                log.info("worker %s answered no probe within %.1f s but pushed its status "
                         "%.2f s ago: busy, kept up", w.worker_id, self.connect_timeout_s,
                         time.monotonic() - w.heard_at)
                return
            self.mark_down(w, f"{exc.code().name}: {exc.details()}")
            return
        if not serving:
            self.mark_down(w, "its health check says it is not serving (draining)")
            return
        reason = ""
        if info.model_fingerprint != self.model_fingerprint:
            reason = (f"model fingerprint {info.model_fingerprint} ({info.model_name}) differs "
                      f"from the gateway's {self.model_fingerprint}: start it with the same model")
        elif self.block_size and info.block_size and info.block_size != self.block_size:
            reason = (f"block size {info.block_size} differs from the gateway's "
                      f"{self.block_size}: start both with the same --block-size")
        if reason:
            if self.refused.get(w.worker_id) != reason:
                log.error("refusing worker %s at %s: %s", w.worker_id, w.record.address, reason)
            self.refused[w.worker_id] = reason
            w.up = False
            return
        self.refused.pop(w.worker_id, None)
        if not w.up:
            log.info("worker %s at %s is up (%s)", info.worker_id, w.record.address,
                     info.model_name)
        w.info, w.up, w.said_down = info, True, False

    async def close(self) -> None:
        for w in self.workers.values():
            await w.client.close()
        self.workers.clear()
        for task in list(self._closing):
            task.cancel()
