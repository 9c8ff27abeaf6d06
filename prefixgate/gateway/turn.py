"""The turn core: admit → place → relay → account, with no transport in it.

Contract
--------
`TurnCore.turn(request, caller, request_id, prompt_text)` runs one chat turn and yields
its `ChatEvent`s: `ChatDelta`s as the serving worker streams them, then exactly one
`ChatFinal` (usage, finish reason, serving worker, gateway-side timings, the decision's
predicted and best predicted cached tokens). It either ends after that final event or
raises `TurnError(kind, message, field)`: a `Failure` kind that says nothing of any wire
(invalid argument, exhausted, unavailable, deadline, ...), an actionable message and the
request field at fault (its ChatRequest path, e.g. "sampling.max_tokens"), which each
front maps to its own status and field names (gateway/grpc_front.py: the call's gRPC status;
gateway/http.py: an HTTP status and OpenAI error body with `param`).

`Caller` is what the core needs of the front: the tenant the front authenticated (once, at
its edge, with `TurnCore.authenticate`: the gRPC call guard, the HTTP headers) and the
turn's deadline (monotonic seconds; None: none).

Steps (each a method, in order):
  `admit`     namespace (the tenant's, auth.bind_namespace), the tenant's turns in flight
              (at most `RequestLimits.max_turns_per_tenant`, whatever the prompt's form:
              EXHAUSTED), request fields and limits (prefixgate.wire.protocol), the prompt
              as packed token ids (text, chat messages or a plain `prompt_text`, is
              tokenized here and only here, on threads when long: `off_loop`):
              INVALID_ARGUMENT (UNKNOWN_MODEL for a model not served here) before any
              worker is called.
  `route`     `Placer.route` (gateway/placement.py): block hashes, then the router's
              ranking of the healthy workers. No worker: UNAVAILABLE, at once.
  `relay`     the ranked workers in order, at most 1 + `MAX_RETRIES`, each attempt placed
              by `Placer.place` (pull, prediction, load lease) and streamed through
              gateway/resume.py `Reply` (which places a continuation the same way).
  `account`   metrics, one debug log line, the trace recorder, the final event.

Failures (docs/reliability.md): a failure that belongs to the request (INVALID_ARGUMENT,
or a status the worker marks with trailing metadata `prefixgate-error-scope: request`)
goes back as the worker said it, never retried and never held against the worker; any
other failure before the first token is retried once on the next ranked worker within the
deadline; only UNAVAILABLE (the transport) marks the worker down; after some text the turn
ends with UNAVAILABLE saying how many tokens were sent and that a retry is safe; the
deadline passing is DEADLINE.

Worker seam: `WorkerHandle.client.Generate(GenerateRequest, timeout=s)` returns an async
iterator of `GenerateEvent`s and fails with `grpc.aio.AioRpcError`, over gRPC or in
process alike (workerapi/client.py `WorkerClient`): the worker's status codes are read
here, and only here, into `Failure` kinds.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from prefixgate.gateway import metrics, resume
from prefixgate.gateway.config import GatewayConfig
from prefixgate.gateway.feeds import EventFeed
from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.placement import Placer
from prefixgate.gateway.pool import WorkerHandle, WorkerPool
from prefixgate.gateway.routing import Decision, Router, Turn
from prefixgate.gateway.tokenize_pool import INLINE_CHARS, TokenizePool, TokenizerBusy
from prefixgate.model.catalog import ModelSpec
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.radix import Hashers, HashMemo
from prefixgate.security import auth
from prefixgate.telemetry import tracing
from prefixgate.telemetry.trace_recorder import TraceRecorder
from prefixgate.v1 import chat_pb2, common_pb2, worker_pb2
from prefixgate.wire.protocol import (
    ERROR_SCOPE_KEY,
    ERROR_SCOPE_REQUEST,
    OVERFLOW_FROM_PROTO,
    InvalidRequest,
    UnknownModel,
    check_chat_fields,
    check_prompt_tokens,
    sampling_from_proto,
    with_generation_defaults,
)
from prefixgate.wire.token_ids import pack, packed_token_ids, repeated_token_ids

log = logging.getLogger(__name__)

__all__ = ["Caller", "Failure", "TurnCore", "TurnError", "MAX_RETRIES",
           "INLINE_TOKENIZE_CHARS"]

# Other workers a turn is tried on after a failure not attributed to the request.
MAX_RETRIES = 1
INLINE_TOKENIZE_CHARS = INLINE_CHARS  # shorter text is tokenized on the event loop
OVERFLOW_TO_PROTO = {name: value for value, name in OVERFLOW_FROM_PROTO.items() if name}
T = TypeVar("T")


class Failure(enum.Enum):
    """What went wrong with a turn, in no wire's words (each front has its own table)."""

    INVALID_ARGUMENT = "invalid_argument"  # the request: change it (`field` names what)
    UNKNOWN_MODEL = "unknown_model"  # the request names a model not served here
    UNAUTHENTICATED = "unauthenticated"  # no credential, or an unknown one
    PERMISSION_DENIED = "permission_denied"  # a credential asking for what it may not
    EXHAUSTED = "exhausted"  # a limit of the gateway or the worker: retry later
    UNAVAILABLE = "unavailable"  # no worker could serve it (retrying is safe)
    DEADLINE = "deadline"  # the caller's deadline passed
    FAILED = "failed"  # the worker failed on this request alone (not retried)


# A worker's status for a failure it marked as the request's, as a Failure.
_WORKER_FAILURES = {
    grpc.StatusCode.INVALID_ARGUMENT: Failure.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE: Failure.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION: Failure.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Failure.EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE: Failure.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: Failure.DEADLINE,
}


class TurnError(Exception):
    """A turn ends with this failure (module docstring); `field` is the ChatRequest field
    at fault, when one is (its path: "sampling.max_tokens", "messages", ...)."""

    def __init__(self, kind: Failure, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.field = kind, message, field

    @classmethod
    def invalid(cls, exc: InvalidRequest) -> TurnError:
        return cls(Failure.UNKNOWN_MODEL if isinstance(exc, UnknownModel)
                   else Failure.INVALID_ARGUMENT, str(exc), exc.field)

    def message_for(self, name: str | None) -> str:
        """The message with the field called `name` (a front's own name for it)."""
        return InvalidRequest(self.message, self.field).message_for(name)


@dataclass(frozen=True, slots=True)
class Caller:
    """What the core needs of a turn's front."""

    tenant: auth.Tenant | None = None  # who the front authenticated (None: tokens off)
    deadline: float | None = None  # time.monotonic() seconds; None: no deadline
    # W3C trace context the caller sent (traceparent, tracestate: telemetry/tracing.py).
    trace_headers: tuple[tuple[str, str], ...] = ()
    # Filled by the core when the turn's span starts (tracing on): the `traceresponse`
    # header the front returns (HTTP response header, gRPC initial metadata).
    trace_reply: list[tuple[str, str]] = field(default_factory=list)

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


class TurnCore:
    """One gateway's turn path (see the module docstring). Owns the routing state (index,
    router, hashers, hash memo: its `placer`), the tokenizer threads and the tenants' turns
    in flight; each front holds one."""

    def __init__(self, spec: ModelSpec, tokenizer: ChatTokenizer, pool: WorkerPool,
                 config: GatewayConfig, *, index: PrefixIndex | None = None,
                 feed: EventFeed | None = None,
                 tokens: auth.TokenStore | None = None) -> None:
        """`index`: the routing index to route by (default: a new one, `new_index`);
        `feed`: shares routing predictions with the index's other readers (None: kept
        here); `tokens`: the bearer tokens callers must present (None: open)."""
        self.spec = spec
        self.tokenizer = tokenizer
        self.pool = pool
        self.config = config
        self.index = index if index is not None else new_index(config)
        self.router = Router(config.routing, self.index, on_claim=metrics.count_claim)
        self.tokens = tokens
        self.placer = Placer(pool, self.index, self.router,
                             Hashers(config.block_size, spec.fingerprint),  # the workers'
                             HashMemo(config.hash_memo_bytes), feed)
        self.resumer = resume.Resumer(self.placer, tokenizer, spec.max_context_tokens)
        self.recorder = (TraceRecorder(config.record_trace, config.block_size)
                         if config.record_trace else None)
        # Tokenizing a long prompt off the event loop, on a bounded pool (tokenize_pool.py).
        self._tokenize_pool = TokenizePool(config.limits.tokenize_threads,
                                           config.limits.max_tokenize_waiting)
        self._in_flight: dict[str, int] = {}  # turns running per tenant (namespace)

    def close(self) -> None:
        """Stop the tokenizer threads (tokenizations in progress finish)."""
        self._tokenize_pool.close()

    def authenticate(self, authorization: str | None) -> auth.Tenant | None:
        """The tenant of an `Authorization` value (None when tokens are off); TurnError
        UNAUTHENTICATED otherwise. Each front calls it once per call, at its edge, before
        reading the request's body."""
        if self.tokens is None:
            return None
        try:
            return self.tokens.authenticate(authorization)
        except auth.AuthError as exc:
            raise TurnError(Failure.PERMISSION_DENIED if isinstance(exc, auth.PermissionDenied)
                            else Failure.UNAUTHENTICATED, str(exc)) from None

    async def off_loop(self, num_chars: int, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)`, a tokenizer call on `num_chars` characters of text, run on the
        tokenizer threads unless the text is short (`INLINE_TOKENIZE_CHARS`). The tokenizer
        releases the GIL (tokenizer.py), so the event loop keeps relaying other turns'
        streams while a long prompt is tokenized (~40 ms at 48k characters). Raises
        TokenizerBusy when the pool's threads and waiting line are full."""
        return await self._tokenize_pool.run(num_chars, fn, *args)

    # ------------------------------------------------------------------ the turn

    async def turn(self, request: chat_pb2.ChatRequest, caller: Caller, request_id: str,
                   prompt_text: str | None = None) -> AsyncIterator[chat_pb2.ChatEvent]:
        """One turn's events (module docstring); raises TurnError. `prompt_text`: a plain
        text prompt, tokenized without a chat template, in place of the request's input
        (OpenAI's /v1/completions). Traced (when tracing is on) as a span continuing the
        caller's trace context."""
        arrival = time.monotonic()
        span = tracing.start("prefixgate.turn", caller.trace_headers, "server", {
            "prefixgate.request_id": request_id,
            "prefixgate.conversation_id": request.conversation_id})
        caller.trace_reply[:] = tracing.response_headers(span)
        error: BaseException | str | None = None
        figures: dict = {}
        namespace = None
        try:
            namespace = self._enter(request, caller)
            prompt = await self.admit(request, prompt_text)
            turn, decision = self.route(prompt, namespace, request.conversation_id)
            gen = worker_pb2.GenerateRequest(request_id=request_id,
                                             packed_prompt_token_ids=prompt.obj,
                                             sampling=request.sampling, namespace=namespace)
            if not gen.sampling.context_overflow:
                gen.sampling.context_overflow = OVERFLOW_TO_PROTO[self.config.context_overflow]
            async for ev in self.relay(turn, decision, gen, caller, arrival,
                                       no_resume=request.no_resume, span=span):
                if span is not None and ev.HasField("final"):
                    usage = ev.final.usage
                    figures = {"prefixgate.worker_id": ev.final.worker_id,
                               "prefixgate.prompt_tokens": usage.prompt_tokens,
                               "prefixgate.cached_tokens": usage.cached_tokens,
                               "prefixgate.completion_tokens": usage.completion_tokens}
                yield ev
        except GeneratorExit:
            error = "the client went away"
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            if namespace is not None:
                self._leave(namespace)
            tracing.end(span, error, figures)

    def _enter(self, request: chat_pb2.ChatRequest, caller: Caller) -> str:
        """The turn's namespace, counted among its tenant's turns in flight (`_leave`
        gives it back); EXHAUSTED past `max_turns_per_tenant`. Before any tokenizing, so
        no form of prompt (text or token ids) holds gateway memory beyond the bound."""
        namespace = self._namespace(request, caller)
        limit = self.config.limits.max_turns_per_tenant
        running = self._in_flight.get(namespace, 0)
        if limit and running >= limit:
            raise TurnError(Failure.EXHAUSTED,
                            f"namespace {namespace!r} already has {running} turns in flight, "
                            f"its limit (the gateway's --max-turns-per-tenant, {limit}): "
                            "wait for a reply to finish and retry")
        self._in_flight[namespace] = running + 1
        return namespace

    def _leave(self, namespace: str) -> None:
        left = self._in_flight[namespace] - 1
        if left:
            self._in_flight[namespace] = left
        else:
            del self._in_flight[namespace]

    async def admit(self, request: chat_pb2.ChatRequest,
                    prompt_text: str | None = None) -> memoryview:
        """The packed prompt of a valid request; TurnError otherwise."""
        try:
            check_chat_fields(request, self.config.limits)
            prompt = await self._prompt(request, prompt_text)
            check_prompt_tokens(len(prompt), self.config.limits)
            # Unset temperature / top_p / top_k: the model's defaults, made explicit for
            # the worker (the HTTP front leaves them unset too, so both fronts agree).
            request.sampling.CopyFrom(with_generation_defaults(request.sampling,
                                                               self.spec.generation))
            sampling_from_proto(request.sampling, len(prompt), self.spec.max_context_tokens,
                                default_overflow=self.config.context_overflow)
        except InvalidRequest as exc:
            raise TurnError.invalid(exc) from None
        except TokenizerBusy as exc:
            raise TurnError(Failure.EXHAUSTED, str(exc)) from None
        return prompt

    def route(self, prompt: memoryview, namespace: str,
              conversation_id: str) -> tuple[Turn, Decision]:
        """The turn's block hashes and the router's ranking; UNAVAILABLE without workers."""
        turn, decision = self.placer.route(prompt, namespace, conversation_id)
        if not decision.ranked:
            raise TurnError(Failure.UNAVAILABLE,
                            "no worker is available: start a worker (prefixgate worker) or "
                            "check that the workers' model matches the gateway's")
        return turn, decision

    async def relay(self, turn: Turn, decision: Decision, gen: worker_pb2.GenerateRequest,
                    caller: Caller, arrival: float, no_resume: bool = False,
                    span: object = None) -> AsyncIterator[chat_pb2.ChatEvent]:
        """Stream the reply of the first ranked worker that answers (failover rules in the
        module docstring; a worker lost mid-reply: gateway/resume.py), then the final event
        (`account`)."""
        failures = []
        for attempt, worker in enumerate(decision.ranked[:1 + MAX_RETRIES]):
            remaining = caller.time_remaining()
            if remaining is not None and remaining <= 0:
                break
            if attempt:
                metrics.FAILOVERS.inc()
            sent_tokens = 0
            # This attempt's span; its trace context goes to the worker with the call.
            call = tracing.start("prefixgate.worker_call", span, "client", {
                "prefixgate.worker_id": worker.worker_id, "prefixgate.attempt": attempt})
            call_error: Exception | None = None
            with self.placer.place(turn, decision, worker, gen) as placed:
                try:
                    ttft_ms = 0.0
                    reply = resume.Reply(self.resumer, worker, gen, caller.time_remaining,
                                         no_resume, metadata=tracing.headers(call))
                    # Closed here, as soon as the final event is relayed: the worker call
                    # ends then (a no-op cancel after its last message), not whenever the
                    # loop's async-generator finalizer gets to it (a task a turn).
                    async with contextlib.aclosing(aiter(reply)) as events:
                        async for ev in events:
                            if ev.HasField("chunk"):
                                chunk = ev.chunk
                                token_ids = chunk.token_ids
                                if token_ids and not ttft_ms:
                                    ttft_ms = (time.monotonic() - arrival) * 1e3
                                    placed.first_token(len(token_ids))
                                sent_tokens += len(token_ids)
                                yield chat_pb2.ChatEvent(delta=chat_pb2.ChatDelta(
                                    text=chunk.text, token_ids=token_ids, index=chunk.index,
                                    logprobs=chunk.logprobs))
                                continue
                            if reply.worker is worker:  # not resumed elsewhere: its own pace
                                placed.lease.decoded(sent_tokens)
                                usage = ev.final.usage
                                placed.lease.transferred(
                                    usage.transferred_tokens * worker.kv_bytes_per_token,
                                    placed.holder, usage.prompt_tokens - usage.cached_tokens
                                    - usage.transferred_tokens)
                            yield self.account(turn, decision, reply.worker, ev.final, arrival,
                                               ttft_ms, attempt, placed.expected_pulled_tokens,
                                               reply.num_resumes)
                            return
                    # A stream that ends without its final event is a lost worker.
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE,
                                               grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               "stream ended without a final event")
                except grpc.aio.AioRpcError as exc:
                    call_error = exc
                    failures.append(self._failed(worker, exc, sent_tokens))
                finally:
                    tracing.end(call, call_error)
        remaining = caller.time_remaining()
        if remaining is not None and remaining <= 0:
            raise TurnError(Failure.DEADLINE, "the deadline passed before any worker answered")
        raise TurnError(Failure.UNAVAILABLE,
                        "every worker failed before answering (" + "; ".join(failures) +
                        "); retrying is safe")

    def account(self, turn: Turn, decision: Decision, worker: WorkerHandle,
                final: worker_pb2.GenerateFinal, arrival: float, ttft_ms: float,
                attempt: int, expected_transferred: int = 0,
                num_resumes: int = 0) -> chat_pb2.ChatEvent:
        """Count, log and record a served turn; its ChatFinal event. `worker` served the
        reply's end (after a resume, the worker that continued it)."""
        now = time.monotonic()
        # Gateway-side timings: worker queue plus what happened before it.
        handoff_ms = max(0.0, (now - arrival) * 1e3 - final.timings.total_ms)
        wid = worker.worker_id
        policy = decision.policy
        expected = decision.cached_tokens_of(wid)
        best = decision.best_cached_tokens
        usage = final.usage
        self.router.record(turn, wid, usage.cached_tokens if not num_resumes else None)
        metrics.count_turn(wid, policy, expected, best, usage.cached_tokens,
                           turn.num_prompt_tokens, usage.transferred_tokens,
                           expected_transferred)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("turn conv=%s policy=%s worker=%s prompt=%d expected_cached=%d "
                      "best_cached=%d cached=%d completion=%d ttft=%.1fms attempt=%d",
                      turn.conversation_id or "-", policy, wid, usage.prompt_tokens,
                      expected, best, usage.cached_tokens, usage.completion_tokens, ttft_ms,
                      attempt + 1)
        if self.recorder is not None:
            self.recorder.record(
                arrival_unix_s=time.time() - (now - arrival),
                conversation_id=turn.conversation_id,
                num_prompt_tokens=turn.num_prompt_tokens, block_hashes=turn.block_hashes,
                output_tokens=usage.completion_tokens, worker_id=wid,
                cached_tokens=usage.cached_tokens)
        return chat_pb2.ChatEvent(final=chat_pb2.ChatFinal(
            usage=usage, finish_reason=final.finish_reason,
            sample_finish_reasons=final.sample_finish_reasons, worker_id=wid,
            predicted_cached_tokens=expected, best_predicted_cached_tokens=best,
            predicted_transferred_tokens=expected_transferred, num_resumes=num_resumes,
            timings=common_pb2.Timings(queue_ms=handoff_ms + final.timings.queue_ms,
                                       ttft_ms=ttft_ms or (now - arrival) * 1e3,
                                       total_ms=(now - arrival) * 1e3)))

    # ------------------------------------------------------------------ internals

    def _failed(self, worker: WorkerHandle, exc: grpc.aio.AioRpcError, sent_tokens: int) -> str:
        """Classify a worker call's failure: raise TurnError when the turn must end now,
        else return the failure's summary (the next ranked worker is tried)."""
        code = exc.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT or _request_scoped(exc):
            raise TurnError(_WORKER_FAILURES.get(code, Failure.FAILED),
                            exc.details() or "invalid request")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise TurnError(Failure.DEADLINE, "the deadline passed before the reply was "
                                              "complete; retry with a longer deadline")
        if code == grpc.StatusCode.UNAVAILABLE:  # transport: the worker, not the turn
            self.placer.mark_down(worker, f"{code.name}: {exc.details()}")
        if sent_tokens:
            raise TurnError(Failure.UNAVAILABLE,
                            f"worker {worker.worker_id} was lost after {sent_tokens} tokens of "
                            "the reply were sent; the reply is incomplete: discard it and retry "
                            "the turn (retrying is safe)")
        return f"{worker.worker_id}: {code.name}"

    def _namespace(self, request: chat_pb2.ChatRequest, caller: Caller) -> str:
        """The namespace the turn runs in: with tokens, the caller's tenant's
        (auth.bind_namespace: another tenant's namespace is PERMISSION_DENIED)."""
        if self.tokens is None:
            return request.namespace
        if caller.tenant is None:  # a front that skipped `authenticate`: refuse, never open
            raise TurnError(Failure.UNAUTHENTICATED, "no credential: send a bearer token")
        try:
            return auth.bind_namespace(caller.tenant, request.namespace)
        except auth.AuthError as exc:
            raise TurnError(Failure.PERMISSION_DENIED, str(exc), "namespace") from None

    async def _prompt(self, request: chat_pb2.ChatRequest,
                      prompt_text: str | None = None) -> memoryview:
        """The prompt as packed token ids (prefixgate/wire/token_ids.py): hashed and forwarded
        to the worker as these bytes, never as a list."""
        if request.model and request.model != self.spec.name:
            raise UnknownModel(f"model {request.model!r} is not served here: this gateway "
                               f"serves {self.spec.name!r} (or leave model empty)", "model")
        if prompt_text is not None:
            if not prompt_text:
                raise InvalidRequest("prompt is empty: send some text or token ids", "prompt")
            return pack(await self.off_loop(len(prompt_text), self.tokenizer.encode_text,
                                            prompt_text, True))
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
        raise InvalidRequest("the request has no input: set messages or prompt_token_ids",
                             "messages")


def _request_scoped(exc: grpc.aio.AioRpcError) -> bool:
    """True when the worker marked its failure as belonging to the request."""
    return any(key == ERROR_SCOPE_KEY and value == ERROR_SCOPE_REQUEST
               for key, value in (exc.trailing_metadata() or ()))


def new_index(config: GatewayConfig) -> PrefixIndex:
    """A routing index sized and tuned by `config`."""
    return PrefixIndex(max_blocks=config.index_max_blocks,
                       spread_fanout=config.routing.spread_fanout,
                       prediction_ttl_s=config.routing.prediction_ttl_s)
