"""Chat gRPC service of the gateway: validate, tokenize, route, relay.

Contract
--------
Chat turns a ChatRequest into token ids (chat template, or raw ids; text longer than
`INLINE_TOKENIZE_CHARS` is tokenized on a thread pool, so that a long prompt does not stall
the event loop that relays every other turn), validates it with
prefixgate.wire.protocol (INVALID_ARGUMENT, before any worker is called), ranks the healthy
workers with the Router (prefix policy: the prompt's block hashes, hashed like the workers
hash them, matched against the event-fed PrefixIndex: no Redis call per turn) and streams
the first one's reply as ChatDelta events, then one ChatFinal with usage, finish reason,
serving worker, gateway-side timings and the decision's quality (cached tokens predicted
on the serving worker and the best predicted on any). Sending a turn to a worker records
its blocks as expected there at once (Router.dispatch; with Redis, shared with every
gateway through the feed), so the next turn is not routed blind to this decision. The
choice, the predicted, best and reported cached tokens are logged and counted
(gateway/metrics.py).

Index feeds (gateway/feeds.py): with Redis, the gateway follows the shared event stream
(gateway/redis_feed.py) and reaps expired workers on each refresh; without, it follows
each worker's WatchEvents stream. A Redis outage leaves routing on the last known index and
workers, reported by the health service "prefixgate.registry" (NOT_SERVING while degraded;
the gateway itself stays SERVING) and the `prefixgate:registry_degraded` gauge.

Failure handling (docs/reliability.md):
  - a failure that belongs to the request (INVALID_ARGUMENT, or any status a worker marks
    with trailing metadata `prefixgate-error-scope: request`, protocol.ERROR_SCOPE_KEY)
    goes back to the client as the worker said it: never retried on another worker (it
    would fail there too) and never held against the worker;
  - any other failure before the first token is retried once (`MAX_RETRIES`) on the next
    ranked worker, within the client's deadline; more would let one poison request walk
    the fleet. Only a transport failure (UNAVAILABLE) marks the worker down until its next
    probe: health comes from probes and transport errors (gateway/pool.py);
  - after some text: the stream ends with UNAVAILABLE saying how many tokens were sent and
    that a retry is safe (no text is ever duplicated or silently cut);
  - no worker at all: UNAVAILABLE, at once.
The deadline is the client's: DEADLINE_EXCEEDED when it passes.
Request fields are bounded (`GatewayConfig.limits`, protocol.RequestLimits): the server
refuses a message over `max_request_bytes` before parsing it, and identifiers, message
count and stop lists are checked before tokenizing.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2

from prefixgate.gateway import metrics
from prefixgate.gateway.feeds import EventFeed, WorkerStreamFeed
from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.pool import WorkerPool
from prefixgate.gateway.routing import Router, RoutingConfig, Turn
from prefixgate.gateway.status import StatusFollower
from prefixgate.model.catalog import ModelSpec
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.radix import Hashers, HashMemo
from prefixgate.registry import Registry, WorkerRecord
from prefixgate.security import auth, identity
from prefixgate.telemetry.trace_recorder import TraceRecorder
from prefixgate.v1 import chat_pb2, common_pb2, worker_pb2
from prefixgate.wire import rpc
from prefixgate.wire.protocol import (
    ERROR_SCOPE_KEY,
    ERROR_SCOPE_REQUEST,
    OVERFLOW_FROM_PROTO,
    InvalidRequest,
    RequestLimits,
    UnknownModel,
    check_chat_fields,
    check_prompt_tokens,
    sampling_from_proto,
)
from prefixgate.wire.token_ids import pack, packed_token_ids, repeated_token_ids

log = logging.getLogger(__name__)

SERVICE = chat_pb2.DESCRIPTOR.services_by_name["ChatService"]
REGISTRY_HEALTH = "prefixgate.registry"  # health name: NOT_SERVING while Redis is unreachable
# Other workers a turn is tried on after a failure not attributed to the request.
MAX_RETRIES = 1
# Text shorter than this is tokenized on the event loop: handing it to a thread costs
# ~50 us, what tokenizing ~100 characters costs (~0.5 us a character on SmolLM2's
# tokenizer, chat template included); longer text would stall every stream meanwhile.
INLINE_TOKENIZE_CHARS = 128
T = TypeVar("T")


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 0
    block_size: int = 16
    routing: RoutingConfig = RoutingConfig()
    # Workers given by address (embedded registry); with Redis, workers register themselves.
    static_workers: tuple[str, ...] = ()
    refresh_interval_s: float = 2.0  # registry, worker probes, index feeds
    # Worker load is pushed at most this often (WatchStatus; polled where unsupported).
    status_interval_ms: int = 50
    # Recent prompts kept so that a turn hashes only its new blocks (radix.HashMemo).
    hash_memo_bytes: int = 64 << 20
    drain_seconds: float = 30.0
    record_trace: str = ""  # append one line per finished turn here (prefixgate.telemetry.trace_recorder)
    index_max_blocks: int = 0  # hard cap on the routing index (0: bounded by the workers)
    # Overflow policy for requests that do not choose one: "fail" or
    # "keep-system-drop-oldest". It is made explicit on the way to the worker, so every
    # worker answers a turn alike whatever its own default.
    context_overflow: str = "fail"
    tls: rpc.TLSConfig = rpc.TLSConfig()  # the Chat API's certificate (+ client CA: mTLS)
    health_port: int = 0  # plaintext grpc.health.v1 only, for probes without TLS (0: off)
    worker_tls: rpc.TLSConfig = rpc.TLSConfig()  # to workers: their CA, our client cert
    auth: auth.AuthConfig = auth.AuthConfig()  # tokens (public), internal credential
    limits: RequestLimits = RequestLimits()  # what one request may carry
    # The OpenAI-compatible HTTP front (gateway/http.py) on this port: -1 off, 0 any free.
    http_port: int = -1
    # Several gateway processes serve these ports (SO_REUSEPORT; gateway/processes.py).
    # Off, binding a port something already listens on fails with a clear message instead
    # of silently sharing it with that listener.
    share_port: bool = False


OVERFLOW_TO_PROTO = {name: value for value, name in OVERFLOW_FROM_PROTO.items() if name}


class ChatService:
    def __init__(self, spec: ModelSpec, tokenizer: ChatTokenizer, pool: WorkerPool,
                 config: GatewayConfig, index: PrefixIndex | None = None) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.pool = pool
        self.index = index if index is not None else PrefixIndex(
            max_blocks=config.index_max_blocks, spread_fanout=config.routing.spread_fanout,
            prediction_ttl_s=config.routing.prediction_ttl_s)
        self.feed: EventFeed | None = None  # serve() sets it: shares routing predictions
        self.router = Router(config.routing, self.index)
        self.config = config
        self.recorder = (TraceRecorder(config.record_trace, config.block_size)
                         if config.record_trace else None)
        self.hashers = Hashers(config.block_size, spec.fingerprint)  # the workers' hashers
        self.hash_memo = HashMemo(config.hash_memo_bytes)
        self.tokens: auth.TokenStore | None = None  # serve() loads them from config.auth
        # Tokenizing a long prompt off the event loop: one thread per core is what runs.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                                                 thread_name_prefix="tokenize")

    async def _namespace(self, request: chat_pb2.ChatRequest,
                         context: grpc.aio.ServicerContext) -> str:
        """The namespace the turn runs in: with tokens, the token's (auth.bind_namespace:
        another tenant's namespace is PERMISSION_DENIED)."""
        if self.tokens is None:
            return request.namespace
        try:
            tenant = self.tokens.authenticate(
                auth.metadata_value(context.invocation_metadata(), "authorization"))
            return auth.bind_namespace(tenant, request.namespace)
        except auth.AuthError as exc:
            await rpc.abort_refused(context, exc)
            raise

    async def off_loop(self, num_chars: int, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)`, a tokenizer call on `num_chars` characters of text, run on the
        tokenizer threads unless the text is short (`INLINE_TOKENIZE_CHARS`). The tokenizer
        releases the GIL (tokenizer.py), so the event loop keeps relaying other turns'
        streams while a long prompt is tokenized (~40 ms at 48k characters)."""
        if num_chars < INLINE_TOKENIZE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def close(self) -> None:
        """Stop the tokenizer threads (tokenizations in progress finish)."""
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    async def _prompt(self, request: chat_pb2.ChatRequest) -> memoryview:
        """The prompt as packed token ids (prefixgate/wire/token_ids.py): hashed and forwarded
        to the worker as these bytes, never as a list."""
        if request.model and request.model != self.spec.name:
            raise UnknownModel(f"model {request.model!r} is not served here: this gateway "
                                 f"serves {self.spec.name!r} (or leave model empty)")
        which = request.WhichOneof("input")
        if which == "messages":
            messages = [(m.role, m.content) for m in request.messages.messages]
            return pack(await self.off_loop(sum(len(c) for _, c in messages),
                                            self.tokenizer.encode_messages, messages))
        if which == "packed_prompt_token_ids":
            return packed_token_ids(request.packed_prompt_token_ids, self.tokenizer.vocab_size)
        if which == "prompt_token_ids":
            return repeated_token_ids(request.prompt_token_ids.token_ids,
                                      self.tokenizer.vocab_size)
        raise InvalidRequest("the request has no input: set messages or prompt_token_ids")

    async def Chat(self, request: chat_pb2.ChatRequest, context: grpc.aio.ServicerContext):
        """The gRPC entry: `chat_events`, observed (request metrics, one log line per turn)."""
        request_id = uuid.uuid4().hex
        async for ev in metrics.observe_turn(
                "grpc:Chat", self.chat_events(request, context, request_id),
                request_id=request_id, conversation_id=request.conversation_id,
                status_of=metrics.grpc_status_of(context)):
            yield ev

    async def chat_events(self, request: chat_pb2.ChatRequest, context, request_id: str):
        """One turn's ChatEvents. `context` is the gRPC ServicerContext, or any object with
        its `invocation_metadata()`, `time_remaining()` and `abort(code, details)` (which
        raises): the HTTP front (gateway/http.py) runs turns through here with its own."""
        arrival = time.monotonic()
        namespace = await self._namespace(request, context)
        try:
            check_chat_fields(request, self.config.limits)
            prompt = await self._prompt(request)
            check_prompt_tokens(len(prompt), self.config.limits)
            sampling_from_proto(request.sampling, len(prompt), self.spec.max_context_tokens,
                                default_overflow=self.config.context_overflow)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND if isinstance(exc, UnknownModel)
                                else grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        t0 = time.perf_counter()
        hasher = self.hashers.get(namespace)
        turn = Turn(len(prompt), request.conversation_id,  # make_turn, new blocks only
                    self.hash_memo.hash_blocks(hasher, prompt, request.conversation_id),
                    hasher.block_size)
        decision = self.router.decide(self.pool.healthy(), turn)
        metrics.DECISION_SECONDS.observe(time.perf_counter() - t0)
        candidates = decision.ranked
        if not candidates:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "no worker is available: start a worker (prefixgate worker) or "
                                "check that the workers' model matches the gateway's")
        gen = worker_pb2.GenerateRequest(request_id=request_id,
                                         packed_prompt_token_ids=prompt.obj,
                                         sampling=request.sampling, namespace=namespace)
        if not gen.sampling.context_overflow:
            gen.sampling.context_overflow = OVERFLOW_TO_PROTO[self.config.context_overflow]
        failures = []
        policy = decision.policy
        for attempt, worker in enumerate(candidates[:1 + MAX_RETRIES]):
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                break
            if attempt:
                metrics.FAILOVERS.inc()
            sent_tokens = 0
            expected = decision.cached_tokens_of(worker.worker_id)
            # Predictive ownership: the prompt's blocks are expected there from now on, here
            # and (Redis) at every gateway, until the worker's events confirm or drop them.
            self.router.dispatch(turn, worker.worker_id)
            if self.feed is not None:
                self.feed.predicted(worker.record, turn.block_hashes)
            # Prefill this turn adds to the worker's queue until its first token.
            pending = max(0, len(prompt) - expected)
            worker.in_flight += 1
            worker.in_flight_prompt_tokens += pending
            try:
                ttft_ms = 0.0
                async for ev in worker.stub.Generate(gen, timeout=remaining):
                    if ev.HasField("chunk"):
                        chunk = ev.chunk
                        token_ids = chunk.token_ids
                        if token_ids and not ttft_ms:
                            ttft_ms = (time.monotonic() - arrival) * 1e3
                            worker.in_flight_prompt_tokens -= pending
                            worker.prefilled_since_status += pending
                            pending = 0
                        sent_tokens += len(token_ids)
                        yield chat_pb2.ChatEvent(delta=chat_pb2.ChatDelta(
                            text=chunk.text, token_ids=token_ids, index=chunk.index))
                        continue
                    final = ev.final
                    # Gateway-side timings: worker queue plus what happened before it.
                    handoff_ms = max(0.0, (time.monotonic() - arrival) * 1e3 - final.timings.total_ms)
                    wid = worker.worker_id
                    self.router.record(turn, wid)
                    metrics.TURNS.labels(wid, policy).inc()
                    metrics.EXPECTED_CACHED.labels(wid, policy).inc(expected)
                    metrics.CACHED.labels(wid, policy).inc(final.usage.cached_tokens)
                    metrics.PROMPT_TOKENS.labels(wid, policy).inc(len(prompt))
                    best = decision.best_cached_tokens
                    metrics.DECISIONS.labels("true" if expected >= best else "false").inc()
                    metrics.REGRET_TOKENS.inc(best - expected)
                    metrics.PREDICTION_ERROR.observe(expected - final.usage.cached_tokens)
                    log.debug("turn conv=%s policy=%s worker=%s prompt=%d expected_cached=%d "
                             "best_cached=%d cached=%d completion=%d ttft=%.1fms attempt=%d",
                             request.conversation_id or "-", policy, wid,
                             final.usage.prompt_tokens, expected, best,
                             final.usage.cached_tokens,
                             final.usage.completion_tokens, ttft_ms, attempt + 1)
                    if self.recorder is not None:
                        self.recorder.record(
                            arrival_unix_s=time.time() - (time.monotonic() - arrival),
                            conversation_id=request.conversation_id,
                            num_prompt_tokens=len(prompt), block_hashes=turn.block_hashes,
                            output_tokens=final.usage.completion_tokens,
                            worker_id=worker.worker_id,
                            cached_tokens=final.usage.cached_tokens)
                    yield chat_pb2.ChatEvent(final=chat_pb2.ChatFinal(
                        usage=final.usage, finish_reason=final.finish_reason,
                        sample_finish_reasons=final.sample_finish_reasons,
                        worker_id=worker.worker_id,
                        predicted_cached_tokens=expected, best_predicted_cached_tokens=best,
                        timings=common_pb2.Timings(
                            queue_ms=handoff_ms + final.timings.queue_ms,
                            ttft_ms=ttft_ms or (time.monotonic() - arrival) * 1e3,
                            total_ms=(time.monotonic() - arrival) * 1e3)))
                    return
                # A stream that ends without its final event is a lost worker.
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "stream ended without a final event")
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT or _request_scoped(exc):
                    await context.abort(code, exc.details() or "invalid request")
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    await context.abort(code, "the deadline passed before the reply was complete; "
                                              "retry with a longer deadline")
                if code == grpc.StatusCode.UNAVAILABLE:  # transport: the worker, not the turn
                    self.pool.mark_down(worker, f"{code.name}: {exc.details()}")
                    self.index.drop_predictions(worker.worker_id)
                if sent_tokens:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"worker {worker.worker_id} was lost after {sent_tokens} tokens of the "
                        "reply were sent; the reply is incomplete: discard it and retry the turn "
                        "(retrying is safe)")
                failures.append(f"{worker.worker_id}: {code.name}")
            finally:
                worker.in_flight -= 1
                worker.in_flight_prompt_tokens -= pending
                worker.finished_since_status += 1
                worker.prefilled_since_status += pending
        if context.time_remaining() is not None and context.time_remaining() <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the deadline passed before any worker answered")
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            "every worker failed before answering (" + "; ".join(failures) +
                            "); retrying is safe")

    async def ListModels(self, request, context) -> chat_pb2.ListModelsResponse:
        return chat_pb2.ListModelsResponse(models=[chat_pb2.ModelInfo(
            name=self.spec.name, fingerprint=self.spec.fingerprint,
            max_context_tokens=self.spec.max_context_tokens,
            max_completion_tokens=self.spec.max_context_tokens - 1,
            block_size=self.config.block_size, num_workers=len(self.pool.healthy()))])


async def serve(spec: ModelSpec, registry: Registry, config: GatewayConfig, stop: asyncio.Event,
                started: asyncio.Future[int] | None = None,
                index: PrefixIndex | None = None) -> None:
    """Run the gateway until `stop` is set. `started` receives the bound port. `index`:
    the routing index to fill and route by (default: a new one, from `config`)."""
    tokenizer = ChatTokenizer(spec)
    for address in config.static_workers:
        # Static workers stay listed; the pool's probes decide whether they are up.
        await registry.register(WorkerRecord(address, address), lease_ms=2**62)
    internal = (auth.InternalCredential.from_file(config.auth.internal_token_file)
                if config.auth.internal_token_file else None)
    keyring = _worker_keyring(registry, config.auth)
    pool = WorkerPool(registry, spec.fingerprint, block_size=config.block_size,
                      tls=config.worker_tls, credential=internal, keyring=keyring)
    service = ChatService(spec, tokenizer, pool, config, index)
    feed = service.feed = make_feed(registry, service.index)
    status = StatusFollower(config.status_interval_ms)
    server = grpc.aio.server(options=[
        *config.limits.server_options(config.limits.max_request_bytes),
        ("grpc.so_reuseport", int(config.share_port))])
    service.tokens = auth.load_tokens(config.auth, "gateway")
    rpc.add_service(server, SERVICE, service,
                    None if service.tokens is None else auth.tokens_guard(service.tokens))
    health = rpc.add_health_and_reflection(server, [SERVICE.full_name])
    port = rpc.bind(server, config.host, config.port, config.tls, "gateway")
    await server.start()
    health_server = await rpc.start_health_port(health, config.host, config.health_port,
                                                share_port=config.share_port)
    http = None
    if config.http_port >= 0:
        from prefixgate.gateway.http import HTTPFront

        http = HTTPFront(service)
        try:
            http_port = await http.start(config.host, config.http_port, config.tls,
                                         share_port=config.share_port)
        except rpc.BindError:
            await server.stop(0)
            raise
        log.info("gateway serving the OpenAI-compatible HTTP API on %s:%d", config.host,
                 http_port)
    log.info("gateway serving %s on %s:%d (policy %s)", spec.name, config.host, port,
             config.routing.policy)
    if started is not None:
        started.set_result(port)
    frozen_blocks = 0
    try:
        while not stop.is_set():
            try:
                await pool.refresh()
            except Exception as exc:  # a registry outage degrades service; it never stops it
                log.warning("worker refresh failed: %s", exc)
            try:
                await feed.sync(pool.healthy())
            except Exception:
                log.exception("index feed sync failed")
            status.sync(pool.healthy())
            await rpc.set_serving(health, [SERVICE.full_name], bool(pool.healthy()))
            # Not set_serving: that would also flip the gateway's overall status.
            await health.set(REGISTRY_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING
                             if feed.degraded else health_pb2.HealthCheckResponse.SERVING)
            metrics.REGISTRY_DEGRADED.set(1 if feed.degraded else 0)
            metrics.INDEX_BLOCKS.set(service.index.num_blocks)
            _drop_predictions_of_lost_workers(service.index, pool.healthy())
            metrics.EXPECTED_BLOCKS.set(service.index.num_expected_blocks())
            metrics.PREDICTION_CONFIDENCE.set(service.index.prediction_confidence)
            frozen_blocks = _freeze_long_lived(service.index.num_blocks, frozen_blocks)
            try:
                await asyncio.wait_for(stop.wait(), config.refresh_interval_s)
            except TimeoutError:
                pass
    finally:
        await rpc.set_serving(health, [SERVICE.full_name], False)
        await feed.close()
        await status.close()
        # One drain for both fronts, at once: turns on either get the same drain_seconds.
        await asyncio.gather(server.stop(config.drain_seconds),
                             *([http.stop(config.drain_seconds)] if http is not None else []))
        if health_server is not None:
            await health_server.stop(0)
        if service.recorder is not None:
            await asyncio.to_thread(service.recorder.close)
        service.close()
        await pool.close()
        await registry.close()


def _request_scoped(exc: grpc.aio.AioRpcError) -> bool:
    """True when the worker marked its failure as belonging to the request."""
    return any(key == ERROR_SCOPE_KEY and value == ERROR_SCOPE_REQUEST
               for key, value in (exc.trailing_metadata() or ()))


def _drop_predictions_of_lost_workers(index: PrefixIndex, healthy: list) -> None:
    """Workers that are down or gone keep no predictions (their events will not come)."""
    for wid in index.expected_workers() - {w.worker_id for w in healthy}:
        index.drop_predictions(wid)


def _freeze_long_lived(num_blocks: int, frozen_blocks: int) -> int:
    """Keep the routing index out of the cyclic garbage collector's full scans.

    A 1M-block index is ~250k GC-tracked objects; a full collection walks them all
    (~180 ms here) and blocks the event loop, i.e. every stream and routing decision. Once
    the index has doubled since the last time, collect once and `gc.freeze()` what is
    alive: frozen objects are never scanned again, so later collections cost what is new.
    Freed index nodes are still reclaimed (the tree unlinks them, so reference counting
    frees them). Returns the index size at the last freeze."""
    if num_blocks < max(10_000, 2 * frozen_blocks):
        return frozen_blocks
    gc.collect()
    gc.freeze()
    return num_blocks


def _worker_keyring(registry: Registry, config: auth.AuthConfig) -> identity.Keyring | None:
    """The keyring registered workers must sign with (Redis only: static workers are
    trusted by configuration). The Redis registry verifies ownership with it too."""
    from prefixgate.registry import RedisRegistry

    if not isinstance(registry, RedisRegistry):
        return None
    if not config.worker_keyring_file:
        log.warning("gateway: no --worker-keyring: worker registrations and block ownership "
                    "in Redis are not verified (anyone who can write to Redis can register a "
                    "worker and receive turns)")
        return None
    keyring = identity.Keyring.from_file(config.worker_keyring_file)
    registry.keyring = keyring  # the feed reads only ownership signed by its worker
    log.info("gateway: registered workers must prove their identity (%d keys)", len(keyring))
    return keyring


def make_feed(registry: Registry, index: PrefixIndex) -> EventFeed:
    """The index feed for `registry`: the Redis event stream, else the workers' streams."""
    from prefixgate.registry import RedisRegistry

    if isinstance(registry, RedisRegistry):
        from prefixgate.gateway.redis_feed import RedisStreamFeed

        return RedisStreamFeed(index, registry)
    return WorkerStreamFeed(index)
