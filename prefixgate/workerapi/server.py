"""Worker gRPC service: prefixgate.v1.WorkerService over an `Engine`.

Contract
--------
- Each RPC is a call-level method taking (request, `CallScope`) and refusing with
  `Refused` (workerapi/calls.py: `generate`, `get_info`, `pull_blocks`, ...); `serve()`
  registers them through `calls.grpc_servicer`, which turns a refusal into the call's
  status, message and trailing metadata; the gateway calls a service held in its own
  process through workerapi/client.py `InProcessWorkerClient`, with no gRPC.
- Generate validates the request with `prefixgate.wire.protocol` (INVALID_ARGUMENT on bad
  input; `WorkerServiceBase._checked_generate`, which the vLLM adapter calls too),
  submits it to the engine and streams one GenerateChunk per engine TokenEvent,
  then one GenerateFinal. A client that goes away (or whose deadline passes) cancels the
  request in the engine, which frees its resources.
- GetInfo/GetStatus/FlushCache answer from the engine without waiting for it; WatchStatus
  pushes the status on change (prefixgate/wire/status.py). The status carries the service
  rates measured on finished requests (workerapi/rates.py) for routing by cost.
- The prompt comes repeated or packed (prefixgate/wire/token_ids.py).
- WatchEvents streams the worker's KV events from its `EventLog` (workerapi/events.py, the
  sink the engine reports to): a snapshot of the cached blocks first unless the caller
  resumes a cursor of this incarnation the log still holds, then live batches; the
  streams end when the server shuts down (they do not hold the drain).
- The health service reports SERVING once the model is loaded; on shutdown it turns
  NOT_SERVING first, then in-flight streams get `drain_seconds` to finish; meanwhile the
  worker hands its most reused chains off to peers with room (workerapi/handoff.py).
- Block transfer (workerapi/transfer.py): ExportBlocks streams a cached chain's KV pages;
  PullBlocks, and Generate with a `pull` spec, fetch a chain's missing leading blocks from
  a peer, store and publish them, and compute what did not come. Usage splits the prompt
  into cached, transferred and computed tokens. Trust (docs/transfer.md, "Trust"):
  peers are called over TLS with the certificate checked against the peer's worker id
  (never in plain text while this worker's own API is secured), with the peer
  credential; with the gateways' ticket key in the worker's keyring, ExportBlocks
  needs a pull ticket naming this worker, the chain and the caller (security/tickets.py);
  pulled pages are stored only where they match the digests the holder recorded.
- Admission: at most `max_waiting_requests` requests wait for their first token (pulls
  and prefills included); past it Generate answers RESOURCE_EXHAUSTED naming the limit
  and its flag, whatever the prompt's form (text tokenized by the gateway, token ids).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import grpc

from prefixgate.model.catalog import ModelSpec
from prefixgate.security import auth
from prefixgate.security.tickets import TicketSigner, check_ticket
from prefixgate.telemetry import tracing
from prefixgate.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from prefixgate.wire import rpc
from prefixgate.wire.events import OwnershipEvent
from prefixgate.wire.protocol import (
    InvalidRequest,
    RequestLimits,
    SamplingConfig,
    check_generate_fields,
    check_prompt_tokens,
    clip,
    sampling_from_proto,
    with_generation_defaults,
)
from prefixgate.wire.status import watch_status
from prefixgate.wire.token_ids import prompt_token_ids
from prefixgate.workerapi.api import Engine, FinalEvent, FinishReason, Request, TokenEvent
from prefixgate.workerapi.calls import CallScope, Refused, grpc_servicer
from prefixgate.workerapi.events import EventLog
from prefixgate.workerapi.handoff import HandoffChain, hand_off
from prefixgate.workerapi.rates import LinearFit, ServiceRates, TransferRate
from prefixgate.workerapi.transfer import (
    MAX_MESSAGE_BYTES,
    PullAuth,
    PullResult,
    TransferError,
    export_events,
)
from prefixgate.workerapi.transfer import pull as pull_blocks

log = logging.getLogger(__name__)

# The transfer probe (WorkerService.probe_transfer): bytes moved at most by one pull
# (enough that the rate shows past the set-up, few enough to take milliseconds at the
# speed of memory), rounds of a one-block and a whole-chain pull, and the salt that
# renames the chain it imports.
PROBE_BYTES = 16 << 20
PROBE_ROUNDS = 3
PROBE_SALT = 0x9E3779B97F4A7C15
SERVICE = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]

FINISH_TO_PROTO = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}


@dataclass(frozen=True)
class WorkerConfig:
    # "": worker-<the port it is bound to>, set by serve() once bound (not the requested
    # port: with port 0, every worker would be worker-0 and take the others' lease).
    worker_id: str
    host: str = "127.0.0.1"
    port: int = 0
    block_size: int = 16
    drain_seconds: float = 30.0
    tls: rpc.TLSConfig = rpc.TLSConfig()  # certificate (+ client CA: only gateways with one)
    health_port: int = 0  # plaintext grpc.health.v1 only, for probes without TLS (0: off)
    auth: auth.AuthConfig = auth.AuthConfig()  # internal credential every call must carry
    limits: RequestLimits = RequestLimits()  # what one request may carry
    # How this worker calls peers (block pulls, drain hand-off): TLS as a client (a CA,
    # and a client certificate for mutual TLS); the internal credential is auth's.
    peer_tls: rpc.TLSConfig = rpc.TLSConfig()
    pull_timeout_s: float = 60.0  # one pull from a peer, at most (then compute the rest)
    # The link rate this worker was declared to have (bytes/s; `--transfer-bytes-per-s`),
    # reported until its pulls measure it; 0: none declared, probed at start-up instead.
    transfer_bytes_per_s: float = 0.0
    # Without a declared rate, probe the copy path once blocks are cached
    # (WorkerService.probe_transfer; `prefixgate worker` always does; off here so that
    # in-process workers that do not ask for it see no extra pins or pulls).
    transfer_probe: bool = False
    # Requests admitted and waiting for their first token (pulls and prefills included),
    # at most (`--max-waiting-requests`): past it Generate answers RESOURCE_EXHAUSTED.
    # 4,096 by default: a burst of 2,000 streams at one worker is served whole
    # (tests/faults/test_burst.py), while a queue of prompts at the 131,072-token limit
    # stays within 2 GiB of packed ids.
    max_waiting_requests: int = 4096


@dataclass(frozen=True)
class PeerTrust:
    """How a worker calls peers and checks them (set by `serve` from the configuration).

    secured: this worker's own API is secured (a credential or TLS): peers are then
             called only over TLS (never a credential in plain text).
    metadata: the credential sent to peers (the peer credential, else the internal one
              when this worker holds the token itself; none when it holds only a hash).
    ticket_keys: the keys a pull ticket must verify with (the gateways' ticket key and
                 this worker's own); empty: ExportBlocks takes no ticket.
    own_signer: this worker's own key, signing tickets for pulls of its own blocks.
    require_digests: pulled pages without recorded digests are refused (secured)."""

    secured: bool = False
    metadata: tuple = ()
    ticket_keys: tuple = ()
    own_signer: TicketSigner | None = None
    require_digests: bool = False
    guard: object = None

    @classmethod
    def of(cls, cfg: WorkerConfig, internal: auth.InternalCredential | None,
           peer: auth.InternalCredential | None, guard: object) -> PeerTrust:
        from prefixgate.security.identity import Keyring

        secured = internal is not None or peer is not None or cfg.tls.enabled
        if peer is not None:
            metadata = peer.metadata
        elif internal is not None and internal.can_send:
            metadata = internal.metadata
        else:
            metadata = ()
        keys: tuple = ()
        signer = None
        if cfg.auth.worker_keyring_file:
            ring = Keyring.from_file(cfg.auth.worker_keyring_file)
            own = ring.private_key(cfg.worker_id)
            signer = TicketSigner(own) if own is not None else None
            if ring.ticket_key is not None:
                keys = (ring.ticket_key,) + ((own.public_key(),) if own is not None else ())
        if secured and not cfg.peer_tls.enabled:
            log.warning("worker %s: its API is secured but --peer-tls-ca is not set: it will "
                        "not pull blocks from peers (never in plain text); set --peer-tls-ca, "
                        "--peer-tls-cert and --peer-tls-key", cfg.worker_id)
        if secured and not keys:
            log.warning("worker %s: its --worker-keyring has no '@tickets' line: any caller "
                        "with the peer or internal credential may export any cached chain",
                        cfg.worker_id)
        return cls(secured, metadata, keys, signer, secured, guard)

    def channel(self, address: str, peer_id: str, tls: rpc.TLSConfig) -> grpc.aio.Channel:
        """A channel to peer `peer_id` at `address`: over TLS with the peer's certificate
        checked against `peer_id` (its subject alternative names must include it as a DNS
        name) when `tls` says so; TransferError when the peer may not be called (secured,
        without TLS or without a worker id to check)."""
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        if tls.enabled:
            if not peer_id:
                raise TransferError(grpc.StatusCode.UNAUTHENTICATED,
                                    f"no worker id for the peer at {address}: its TLS "
                                    "certificate cannot be checked, so it is not called")
            options.append(("grpc.ssl_target_name_override", peer_id))
        elif self.secured:
            raise TransferError(grpc.StatusCode.FAILED_PRECONDITION,
                                "peers are called only over TLS while this worker's API is "
                                "secured: set --peer-tls-ca (--peer-tls-cert, --peer-tls-key)")
        return rpc.channel(address, tls, self.metadata, options=options)


class WorkerServiceBase:
    """What every implementation of the Worker API shares, and all `serve()` needs: its
    configuration, model, Generate's validation (`_checked_generate`), KV event log with
    the WatchEvents streams over it (`watch_events`), GetStatus and WatchStatus over the
    subclass's `_status()` (`get_status`, `watch_status`), and `shutdown()` (after the
    server drained). Subclasses answer the other calls (`get_info`, `generate`,
    `flush_cache`, `export_blocks`, `pull_blocks`; workerapi/calls.py): `WorkerService`
    over an `Engine`, engines/vllm.py over a vLLM server."""

    def __init__(self, spec: ModelSpec, config: WorkerConfig,
                 events: EventLog | None = None) -> None:
        self.spec = spec
        self.config = config
        # The sink the engine reports to (an empty log when the engine reports nothing).
        self.events = events if events is not None else EventLog()
        self._closing = False
        self._watchers: set[asyncio.Event] = set()
        self._peers: dict[tuple[str, str],
                          tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerServiceStub]] = {}
        self._credential: auth.InternalCredential | None = None  # set by serve()
        self._trust = PeerTrust()  # set by serve(): how peers are called and checked

    async def shutdown(self) -> None:
        """Stop serving requests (the server has drained)."""

    @property
    def hands_off(self) -> bool:
        """Whether this worker can offer its cached chains to peers when it drains
        (workerapi/handoff.py): peers then pull them from its ExportBlocks."""
        return False

    async def handoff_chains(self) -> list[HandoffChain]:
        """The cached chains to offer peers on the drain, the most reused first."""
        return []

    def own_ticket(self, receiver: str, chain) -> PullAuth:
        """What a pull of this worker's own blocks `chain` by `receiver` shows: a ticket
        this worker signs itself (the drain hand-off, the copy-path probe), when it
        checks tickets."""
        signer = self._trust.own_signer
        ticket = (signer.sign(receiver, self.config.worker_id, "", list(chain))
                  if signer is not None and self._trust.ticket_keys else b"")
        return PullAuth(ticket, list(chain), self._trust.require_digests)

    def _peer(self, address: str, peer_id: str) -> worker_pb2_grpc.WorkerServiceStub:
        """A stub for the peer `peer_id` at `address` (PeerTrust.channel); TransferError
        when this worker may not call it."""
        key = (address, peer_id)
        if key not in self._peers:
            channel = self._trust.channel(address, peer_id, self.config.peer_tls)
            self._peers[key] = (channel, worker_pb2_grpc.WorkerServiceStub(channel))
        return self._peers[key][1]

    async def close_peers(self) -> None:
        for channel, _ in self._peers.values():
            await channel.close()
        self._peers.clear()

    def _checked_generate(self, request: worker_pb2.GenerateRequest, *, vocab_size: int,
                          max_context_tokens: int,
                          context_overflow: str) -> tuple[memoryview, SamplingConfig]:
        """Generate's validation, one for every implementation: the request's fields
        within `config.limits`, its prompt (repeated or packed ids, each below
        `vocab_size`), its sampling with the model's generation defaults filled in for
        unset fields, within `max_context_tokens` (prompt and reply together;
        `context_overflow`: the policy of a request that leaves it unset). Returns (the
        prompt's token ids, the sampling); bad input is `Refused` INVALID_ARGUMENT,
        request-scoped (the gateway returns it to its client and never retries it on
        another worker)."""
        try:
            check_generate_fields(request, self.config.limits)
            prompt = prompt_token_ids(request.prompt_token_ids,
                                      request.packed_prompt_token_ids, vocab_size)
            check_prompt_tokens(len(prompt), self.config.limits)
            sampling = sampling_from_proto(
                with_generation_defaults(request.sampling, self.spec.generation), len(prompt),
                max_context_tokens, context_overflow)
        except InvalidRequest as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc), request_scoped=True) from None
        return prompt, sampling

    def _status(self) -> worker_pb2.WorkerStatus:
        """The load now (what GetStatus and WatchStatus send)."""
        raise NotImplementedError

    async def get_status(self, request: worker_pb2.GetStatusRequest,
                         scope: CallScope) -> worker_pb2.WorkerStatus:
        return self._status()

    async def watch_status(self, request: worker_pb2.WatchStatusRequest, scope: CallScope):
        """Push the load: now, then on change (prefixgate/wire/status.py)."""
        async for status in watch_status(self._status, request.min_interval_ms,
                                         lambda: self._closing):
            yield status

    async def watch_events(self, request: worker_pb2.WatchEventsRequest, scope: CallScope):
        """Stream the event log: a snapshot first unless the subscriber's cursor is of this
        incarnation and still held, then live batches (see workerapi/events.py)."""
        events = self.events
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        self._watchers.add(wake)
        unsubscribe = events.subscribe(lambda: loop.call_soon_threadsafe(wake.set))
        cursor: int | None = (request.after_seq if request.incarnation == events.incarnation
                              else None)
        try:
            while not self._closing:
                wake.clear()
                got = events.read(cursor) if cursor is not None else None
                if got is None:
                    chains, cursor = events.snapshot()
                    for i, batch in enumerate(_chunks(chains)):
                        yield self._batch(batch, cursor, snapshot=i == 0)
                    continue
                batch, cursor = got
                if batch:
                    yield self._batch(batch, cursor, snapshot=False)
                    continue
                await wake.wait()
        finally:
            unsubscribe()
            self._watchers.discard(wake)

    def _batch(self, batch: list[OwnershipEvent], last_seq: int, snapshot: bool
               ) -> worker_pb2.KVEventBatch:
        out = worker_pb2.KVEventBatch(worker_id=self.config.worker_id,
                                      incarnation=self.events.incarnation, last_seq=last_seq,
                                      snapshot=snapshot)
        for ev in batch:
            if ev.kind == "store":
                out.events.add(stored=worker_pb2.KVStored(
                    has_parent=ev.parent_hash is not None, parent_hash=ev.parent_hash or 0,
                    block_hashes=ev.block_hashes))
            elif ev.kind == "remove":
                out.events.add(removed=worker_pb2.KVRemoved(block_hashes=ev.block_hashes))
            else:
                out.events.add(cleared=worker_pb2.KVCleared())
        return out

    def close_watchers(self) -> None:
        """End every WatchEvents and WatchStatus stream (shutdown: they would otherwise
        hold the drain; status streams end within their interval)."""
        self._closing = True
        for wake in self._watchers:
            wake.set()


class WorkerService(WorkerServiceBase):
    def __init__(self, engine: Engine, spec: ModelSpec, config: WorkerConfig,
                 vocab_size: int, events: EventLog | None = None) -> None:
        super().__init__(spec, config, events)
        self.engine = engine
        self.vocab_size = vocab_size
        self.rates = ServiceRates()  # measured on finished requests, reported in the status
        self.transfer_rate = TransferRate()  # measured on pulls, reported in the status
        if config.transfer_bytes_per_s > 0:
            self.transfer_rate.assume(config.transfer_bytes_per_s, 0.0, "declared")
        self._waiting = 0  # requests admitted, before their first token
        self._own_address = ""  # how this worker reaches its own server; set by serve()
        self._probing: asyncio.Task | None = None  # the transfer probe, once started

    async def shutdown(self) -> None:
        if self._probing is not None:  # milliseconds: let it give its blocks back
            done, _ = await asyncio.wait({self._probing}, timeout=5.0)
            if not done:
                self._probing.cancel()
                await asyncio.gather(self._probing, return_exceptions=True)
        await self.close_peers()
        self.engine.shutdown()

    @property
    def hands_off(self) -> bool:
        return self.engine.transfer is not None

    async def handoff_chains(self) -> list[HandoffChain]:
        """Its prefix cache's chains, the most reused first (`BlockTransfer.hot_chains`);
        peers store pulled pages by hash: no token ids needed."""
        if self.engine.transfer is None:
            return []
        chains = await asyncio.to_thread(self.engine.transfer.hot_chains)
        return [HandoffChain(tuple(c)) for c in chains]

    async def generate(self, request: worker_pb2.GenerateRequest, scope: CallScope):
        """`_generate`, traced (when tracing is on: telemetry/tracing.py) as a span that
        continues the gateway's trace context from the call's metadata."""
        if not tracing.enabled():
            async for ev in self._generate(request, scope):
                yield ev
            return
        span = tracing.start("prefixgate.worker.generate",
                             tracing.incoming(scope.metadata), "server",
                             {"prefixgate.worker_id": self.config.worker_id,
                              "prefixgate.request_id": request.request_id})
        error: BaseException | None = None
        figures: dict = {}
        try:
            async for ev in self._generate(request, scope):
                if ev.HasField("final"):
                    usage = ev.final.usage
                    figures = {"prefixgate.prompt_tokens": usage.prompt_tokens,
                               "prefixgate.cached_tokens": usage.cached_tokens,
                               "prefixgate.completion_tokens": usage.completion_tokens}
                yield ev
        except BaseException as exc:
            error = exc
            raise
        finally:
            tracing.end(span, error, figures)

    async def _generate(self, request: worker_pb2.GenerateRequest, scope: CallScope):
        # Failures that belong to this request are refused request-scoped: the gateway
        # returns them to the client, never retries them elsewhere.
        prompt, sampling = self._checked_generate(
            request, vocab_size=self.vocab_size,
            max_context_tokens=self.spec.max_context_tokens,
            context_overflow=self.engine.context_overflow)
        if sampling.top_logprobs is not None and not self.engine.reports_logprobs:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"worker {self.config.worker_id} is emulated (no model): it has "
                          "no log probabilities; leave sampling.top_logprobs unset",
                          request_scoped=True)
        # An over-long prompt accepted under context overflow is cut to fit the context.
        need = min(len(prompt) + sampling.max_tokens, self.spec.max_context_tokens)
        if need > self.engine.capacity_tokens:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request needs KV for {need} tokens (prompt {len(prompt)} + max_tokens "
                f"{sampling.max_tokens}) but worker {self.config.worker_id} holds "
                f"{self.engine.capacity_tokens}: lower max_tokens or shorten the prompt",
                request_scoped=True)
        limit = self.config.max_waiting_requests
        if limit and self._waiting >= limit:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"worker {self.config.worker_id} has {self._waiting} requests waiting for their "
                f"first token, its limit (--max-waiting-requests {limit}): retry later or "
                "on another worker")
        self._waiting += 1
        waiting = True
        try:
            request_id = request.request_id or uuid.uuid4().hex
            pulled: PullResult | None = None
            if request.HasField("pull") and need == len(prompt) + sampling.max_tokens:
                pulled = await self._pull_prompt(request_id, prompt, request.namespace,
                                                 request.pull)
            async for ev in self._run(request, request_id, prompt, sampling, pulled):
                if waiting:
                    waiting = False
                    self._waiting -= 1
                yield ev
        finally:
            if waiting:
                self._waiting -= 1

    async def _run(self, request: worker_pb2.GenerateRequest, request_id: str, prompt,
                   sampling, pulled: PullResult | None):
        """Run an admitted request in the engine and stream its events."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent | FinalEvent] = asyncio.Queue()
        self.engine.submit(
            Request(request_id, tuple(prompt.tolist()), sampling, request.namespace),
            lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        finished = False
        finals: dict[int, FinalEvent] = {}  # one per sample; the stream ends after all n
        try:
            while len(finals) < sampling.n:
                ev = await events.get()
                if isinstance(ev, TokenEvent):
                    yield worker_pb2.GenerateEvent(chunk=worker_pb2.GenerateChunk(
                        token_ids=ev.token_ids, text=ev.text, index=ev.index,
                        logprobs=[common_pb2.TokenLogprob(
                            logprob=lp.logprob, top_token_ids=lp.top_token_ids,
                            top_logprobs=lp.top_logprobs) for lp in ev.logprobs]))
                    continue
                if ev.finish_reason is FinishReason.ERROR:
                    finished = True
                    # The engine attributed the failure to this request (it retried the
                    # step without it and the others went on): retrying elsewhere would
                    # fail the same way.
                    raise Refused(
                        grpc.StatusCode.INTERNAL,
                        f"worker {self.config.worker_id} failed on this request alone (its log "
                        f"has request {clip(request_id)}); other requests went on. It is not "
                        "retried: the same request would fail again", request_scoped=True)
                if ev.finish_reason is FinishReason.FAILED:  # not this request's: retry once
                    finished = True
                    raise Refused(
                        grpc.StatusCode.INTERNAL,
                        f"worker {self.config.worker_id} failed a step of every running request "
                        "(see its log); retrying on another worker is safe")
                finals[ev.index] = ev
            finished = True
            first = finals[0]
            self.rates.observe(first)  # the engine's own timings: the pull is not prefill
            self._maybe_probe_transfer(prompt, request.namespace)
            transferred, pull_ms = self._transferred_tokens(pulled, first.cached_tokens)
            yield worker_pb2.GenerateEvent(final=worker_pb2.GenerateFinal(
                usage=common_pb2.Usage(
                    prompt_tokens=first.prompt_tokens,
                    cached_tokens=first.cached_tokens - transferred,
                    transferred_tokens=transferred,
                    completion_tokens=sum(f.completion_tokens for f in finals.values()),
                    dropped_tokens=first.dropped_tokens),
                finish_reason=FINISH_TO_PROTO[first.finish_reason],
                sample_finish_reasons=[FINISH_TO_PROTO[finals[i].finish_reason]
                                       for i in range(sampling.n)],
                timings=common_pb2.Timings(
                    queue_ms=pull_ms + first.queue_ms,
                    ttft_ms=pull_ms + min(f.ttft_ms for f in finals.values()),
                    total_ms=pull_ms + max(f.total_ms for f in finals.values()))))
        finally:
            if not finished:  # client gone or deadline passed: free the engine's resources
                self.engine.cancel(request_id)

    async def get_info(self, request: worker_pb2.GetInfoRequest,
                       scope: CallScope) -> worker_pb2.WorkerInfo:
        status = self.engine.status()
        return worker_pb2.WorkerInfo(
            worker_id=self.config.worker_id, model_name=self.spec.name,
            model_fingerprint=self.spec.fingerprint, block_size=self.config.block_size,
            max_context_tokens=self.spec.max_context_tokens,
            kv_capacity_tokens=status.kv_capacity_tokens)

    def _status(self) -> worker_pb2.WorkerStatus:
        s = self.engine.status()
        return worker_pb2.WorkerStatus(
            num_running_requests=s.num_running_requests,
            num_waiting_requests=s.num_waiting_requests,
            num_queued_prefill_tokens=s.num_queued_prefill_tokens,
            kv_used_tokens=s.kv_used_tokens, kv_capacity_tokens=s.kv_capacity_tokens,
            prefill_tokens_per_s=self.rates.prefill_tokens_per_s,
            decode_step_s=self.rates.decode_step_s,
            kv_bytes_per_token=(self.engine.transfer.format.bytes_per_token
                                if self.engine.transfer is not None else 0),
            transfer_bytes_per_s=self.transfer_rate.bytes_per_s,
            transfer_setup_s=self.transfer_rate.setup_s,
            transfer_rate_source=self.transfer_rate.source)

    # --- block transfer (workerapi/transfer.py) ---------------------------------------------

    async def export_blocks(self, request: worker_pb2.ExportBlocksRequest, scope: CallScope):
        """Stream the KV pages of the longest cached run of a chain of blocks."""
        transfer = self.engine.transfer
        if transfer is None:
            raise Refused(grpc.StatusCode.UNIMPLEMENTED,
                          f"worker {self.config.worker_id} cannot export KV blocks "
                          "(its prefix cache is off, or its engine has none)")
        if self._trust.ticket_keys:
            try:
                check_ticket(request.ticket, self._trust.ticket_keys, self.config.worker_id,
                             request.block_hashes, scope.caller_names)
            except auth.PermissionDenied as exc:
                log.warning("worker %s: export refused: %s", self.config.worker_id, exc)
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, str(exc)) from None
        try:
            async for event in export_events(transfer, request, self.config.worker_id):
                yield event
        except TransferError as exc:
            raise Refused(exc.code, str(exc)) from None

    async def pull_blocks(self, request: worker_pb2.PullBlocksRequest,
                          scope: CallScope) -> worker_pb2.PullBlocksResponse:
        """Fetch a chain of blocks from a peer into the prefix cache."""
        if self.engine.transfer is None:
            raise Refused(grpc.StatusCode.UNIMPLEMENTED,
                          f"worker {self.config.worker_id} cannot import KV blocks")
        if not request.peer_address or not request.block_hashes:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          "PullBlocks needs peer_address and block_hashes")
        if (self._trust.guard is not None
                and self._trust.guard("PullBlocks", scope.metadata) == auth.PEER
                and request.peer_worker_id not in scope.caller_names):
            # A peer may hand off its own blocks (the drain), never make this worker pull
            # from a third one.
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          "with the peer credential, PullBlocks may only hand off the "
                          "caller's own blocks: peer_worker_id must be the worker its "
                          "certificate names")
        got = await self.pull(request.peer_address, request.peer_worker_id,
                              request.block_hashes, ticket=request.ticket)
        if got.error is not None and not got.num_cached:
            raise Refused(got.error.code, str(got.error))
        return worker_pb2.PullBlocksResponse(
            num_cached_blocks=got.num_cached, num_pulled_blocks=got.num_pulled,
            num_bytes=got.num_bytes, seconds=got.seconds)

    async def pull(self, address: str, peer_id: str, chain,
                   timeout_s: float | None = None, ticket: bytes = b"",
                   ticket_chain=None) -> PullResult:
        """Pull the blocks of `chain` this worker lacks from the peer at `address`, showing
        it `ticket` (which covers `ticket_chain`, default `chain`)."""
        assert self.engine.transfer is not None
        peer = f"worker {peer_id or '?'} at {address}"
        try:
            stub = self._peer(address, peer_id)
        except TransferError as exc:
            got = PullResult(0, 0, 0, 0.0, exc)
        else:
            got = await pull_blocks(stub, self.engine.transfer, chain, peer,
                                    timeout_s or self.config.pull_timeout_s,
                                    auth=PullAuth(ticket, list(ticket_chain or chain),
                                                  self._trust.require_digests))
        self.transfer_rate.observe(got.num_bytes, got.seconds)
        if got.error is not None:
            log.warning("worker %s: pull of %d blocks from %s stopped after %d: %s (%s); "
                        "the rest is computed", self.config.worker_id, len(chain),
                        peer_id or address, got.num_pulled, got.error, got.error.code.name)
        return got

    async def _pull_prompt(self, request_id: str, prompt, namespace: str,
                           spec: worker_pb2.PullSpec) -> PullResult | None:
        """Pull a prompt's leading blocks per `spec` (never the block of its last token,
        which is computed for its logits); None when there is nothing to pull."""
        transfer = self.engine.transfer
        usable = (len(prompt) - 1) // self.config.block_size
        num_blocks = min(spec.num_blocks, usable)
        if transfer is None or not num_blocks or not spec.peer_address:
            return None
        chain = transfer.chain(prompt[:num_blocks * self.config.block_size], namespace)
        # A pull that stalls must not hold the request much longer than computing would
        # have: at the measured rate, 4x the expected time and 2 s of slack.
        timeout_s = None
        if self.transfer_rate.bytes_per_s > 0:
            expected_s = len(chain) * transfer.format.bytes_per_block / self.transfer_rate.bytes_per_s
            timeout_s = min(self.config.pull_timeout_s, 2.0 + 4.0 * expected_s)
        # The ticket covers the gateway's num_blocks; this worker pulls a leading run of it.
        ticket_chain = (transfer.chain(prompt[:spec.num_blocks * self.config.block_size],
                                       namespace) if spec.ticket else chain)
        got = await self.pull(spec.peer_address, spec.peer_worker_id, chain, timeout_s,
                              spec.ticket, ticket_chain)
        log.info("request %s: %d blocks cached here, %d pulled from %s (%.1f MB in %.0f ms)",
                 clip(request_id), got.num_cached_before, got.num_pulled,
                 spec.peer_worker_id or spec.peer_address, got.num_bytes / 1e6,
                 got.seconds * 1e3)
        return got

    def _maybe_probe_transfer(self, prompt, namespace: str) -> None:
        """Once, when nothing has given this worker a transfer rate yet (no pull, no
        declaration) and a finished request left at least two full blocks cached here:
        measure its own copy path on them (`probe_transfer`), off the engine loop."""
        transfer = self.engine.transfer
        num_blocks = len(prompt) // self.config.block_size
        if transfer is not None:  # as many as PROBE_BYTES hold: the rate shows past set-up
            num_blocks = min(num_blocks, max(2, PROBE_BYTES // transfer.format.bytes_per_block))
        if (transfer is None or not self.config.transfer_probe or self.transfer_rate.source
                or self._probing is not None or self._closing  # none while draining
                or not self._own_address or num_blocks < 2):
            return
        status = self.engine.status()
        # Only into free blocks: a probe must not evict what is cached.
        if status.kv_capacity_tokens - status.kv_used_tokens < 2 * num_blocks * self.config.block_size:
            return
        chain = transfer.chain(prompt[:num_blocks * self.config.block_size], namespace)
        self._probing = asyncio.create_task(self.probe_transfer(chain))

    async def probe_transfer(self, chain: list[int]) -> None:
        """Measure this worker's own copy path, so that it reports a transfer rate before
        its first pull (without one no router offers it a pull, and a fleet of workers
        that never pulled would never start). Over its own gRPC server: the KV pages of
        `chain` (cached here) are exported and imported into fresh blocks that are then
        given back, not stored (so nothing is cached, evicted-for-good or published; the
        pins hold the chain's blocks for the milliseconds it takes). After one uncounted
        pull, PROBE_ROUNDS times one block and the whole chain; the line through the
        fastest pull of each size separates set-up from rate (rates.py LinearFit; a
        line that is no rate falls back to bytes over seconds). Nothing is reported when
        a pull has measured the rate meanwhile, or the probe fails (logged)."""
        transfer = self.engine.transfer
        assert transfer is not None and self._own_address
        # The same blocks under names nothing else uses: the reservation takes fresh ones.
        target = [h ^ PROBE_SALT for h in chain]
        try:
            stub = self._peer(self._own_address, self.config.worker_id)
        except TransferError as exc:
            log.warning("worker %s: no transfer probe: %s", self.config.worker_id, exc)
            return
        # Per size, the fastest of the rounds (bytes, seconds): the copy path's own cost,
        # without the pauses other threads on a busy host add to some pulls. The first
        # pull is not counted: it pays once-only costs (threads started, buffers grown).
        best: dict[int, tuple[int, float]] = {}
        try:
            for round_ in range(PROBE_ROUNDS + 1):
                for n in ((1,) if round_ == 0 else (1, len(chain))):
                    got = await pull_blocks(stub, transfer, target[:n], "itself",
                                            self.config.pull_timeout_s, source_chain=chain[:n],
                                            keep=False, auth=self.own_ticket(
                                                self.config.worker_id, chain[:n]))
                    if got.error is not None:
                        raise got.error
                    if round_ and (n not in best or got.seconds < best[n][1]):
                        best[n] = (got.num_bytes, got.seconds)
        except (grpc.aio.AioRpcError, TransferError) as exc:
            # Draining: its own server stopped taking calls; nothing to warn of.
            (log.debug if self._closing else log.warning)(
                "worker %s: transfer probe failed (%s): no transfer rate until a pull or a "
                "later probe measures one", self.config.worker_id, exc)
            self._probing = None  # e.g. the chain was evicted meanwhile: a later request
            return
        fit = LinearFit()  # two sizes: the line through both points
        for num_bytes, seconds in best.values():
            fit.observe(num_bytes, seconds)
        self.transfer_rate.assume(fit.rate, fit.setup_s, "probed")
        # Debug, not info: the probe runs after a worker's first request, mid-conversation,
        # and its figure is in every status (transfer_rate_source "probed") anyway.
        log.debug("worker %s: transfer probe: %.0f MB/s after %.2f ms set-up",
                 self.config.worker_id, fit.rate / 1e6, fit.setup_s * 1e3)

    def _transferred_tokens(self, pulled: PullResult | None, cached_tokens: int
                            ) -> tuple[int, float]:
        """(prompt tokens the pull supplied, the pull's milliseconds): the engine counts
        pulled blocks as cached; those past what was cached here before came over."""
        if pulled is None:
            return 0, 0.0
        bs = self.config.block_size
        transferred = min(pulled.num_pulled * bs,
                          max(0, cached_tokens - pulled.num_cached_before * bs))
        return transferred, pulled.seconds * 1e3

    async def flush_cache(self, request: worker_pb2.FlushCacheRequest,
                          scope: CallScope) -> worker_pb2.FlushCacheResponse:
        return worker_pb2.FlushCacheResponse(num_flushed_tokens=self.engine.flush_cache())

def _chunks(chains: list[OwnershipEvent], max_hashes: int = 65536) -> list[list[OwnershipEvent]]:
    """Split a snapshot into messages of at most about `max_hashes` hashes (one empty
    batch for an empty cache: the subscriber must still learn that it is empty)."""
    out: list[list[OwnershipEvent]] = [[]]
    size = 0
    for ev in chains:
        if size and size + len(ev.block_hashes) > max_hashes:
            out.append([])
            size = 0
        out[-1].append(ev)
        size += len(ev.block_hashes)
    return out


HANDOFF_SHARE = 0.8  # of the drain time the hand-off may take; streams drain meanwhile

Peers = Callable[[], Awaitable[list[tuple[str, str]]]]


async def serve(service: WorkerServiceBase, stop: asyncio.Event,
                started: asyncio.Future[int] | None = None, peers: Peers | None = None,
                advertise_address: str = "") -> None:
    """Serve until `stop` is set, then drain. `started` receives the bound port. With
    `peers` ((worker id, address) of the fleet's other workers, e.g. from the registry),
    the drain first hands the most reused cached chains off to peers with room
    (workerapi/handoff.py: they pull them from this worker, reached at `advertise_address`,
    default host:port), within HANDOFF_SHARE of the drain time, while in-flight streams
    go on."""
    limits = service.config.limits
    # No SO_REUSEPORT (gRPC's default is on): a second worker on a busy port must fail.
    server = grpc.aio.server(options=[*limits.server_options(limits.worker_receive_bytes),
                                      ("grpc.so_reuseport", 0)])
    internal = auth.load_internal(service.config.auth,
                                  f"worker {service.config.worker_id or service.config.port}")
    peer = auth.load_peer(service.config.auth)
    service._credential = internal
    guard = None if internal is None and peer is None else auth.worker_guard(internal, peer)
    rpc.add_service(server, SERVICE, grpc_servicer(service, SERVICE), guard)
    health = rpc.add_health_and_reflection(server, [SERVICE.full_name])
    cfg = service.config
    port = rpc.bind(server, cfg.host, cfg.port, cfg.tls,
                    f"worker {cfg.worker_id or 'on port ' + str(cfg.port)}")
    if not cfg.worker_id:
        cfg = service.config = replace(cfg, worker_id=f"worker-{port}")
    service._trust = PeerTrust.of(cfg, internal, peer, guard)
    await server.start()
    health_server = await rpc.start_health_port(health, cfg.host, cfg.health_port)
    await rpc.set_serving(health, [SERVICE.full_name], True)
    log.info("worker %s serving %s on %s:%d", cfg.worker_id, service.spec.name, cfg.host, port)
    if started is not None:
        started.set_result(port)
    if isinstance(service, WorkerService):  # its transfer probe calls it there
        host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
        service._own_address = advertise_address or f"{host}:{port}"
    await stop.wait()
    log.info("worker %s draining: NOT_SERVING, in-flight requests get up to %.0f s",
             cfg.worker_id, cfg.drain_seconds)
    await rpc.set_serving(health, [SERVICE.full_name], False)
    service.close_watchers()
    draining = time.monotonic()
    if peers is not None and service.hands_off:
        try:
            others = [p for p in await asyncio.wait_for(peers(), 5.0) if p[0] != cfg.worker_id]
        except Exception as exc:  # no registry now: leave without a hand-off
            log.warning("worker %s: no peers for a hand-off: %s", cfg.worker_id, exc)
            others = []
        await hand_off(service, others, advertise_address or f"{cfg.host}:{port}",
                       HANDOFF_SHARE * cfg.drain_seconds - (time.monotonic() - draining))
    await server.stop(max(0.0, cfg.drain_seconds - (time.monotonic() - draining)))
    if health_server is not None:
        await health_server.stop(0)
    await service.shutdown()
    log.info("worker %s stopped", cfg.worker_id)
