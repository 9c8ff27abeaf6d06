"""The gateway's OpenAI-compatible HTTP front (aiohttp, in the gateway's event loop).

Contract
--------
`HTTPFront(core)` serves, beside the gRPC ChatService and through the very same turn
core, which it holds (gateway/turn.py `TurnCore.turn`: the same validation, limits and
messages, tokenizing, routing, namespaces, retries and worker calls; only the wire format
differs; this front imports nothing of the gRPC one):

  POST /v1/chat/completions  messages -> a chat completion; `stream` (SSE, `data: [DONE]`
                             last), `stream_options.include_usage` (with `stream` only),
                             `n`, `stop`, `seed`,
                             `max_tokens` / `max_completion_tokens` (the latter wins),
                             `temperature`, `top_p` (left out: the model's defaults,
                             from its generation_config, as vLLM applies them; a model
                             without a temperature of its own: 1, OpenAI's),
                             `logprobs` + `top_logprobs` (0..20)
  POST /v1/completions       `prompt` as text (tokenized with the model's tokenizer, no
                             chat template) or as token ids; same sampling fields,
                             `logprobs` (alternatives per token, 0..20)
  GET  /v1/models            the served model (and /v1/models/{id})
  GET  /health               200 while a worker is routable, else 503
  GET  /metrics              Prometheus text, every series labelled model_name

`usage` always carries `prompt_tokens_details.cached_tokens`: prompt tokens the serving
worker found in its prefix cache. The worker that served the reply (its end, after a
mid-stream resume): the `X-Prefixgate-Worker` header of a whole reply, the
`prefixgate_worker` field of a stream's finishing chunk (known only once it ends).
Whether the reply was resumed on another worker after its own was lost mid-reply
(gateway/resume.py): `prefixgate_resumed`, the number of resumes (0: none), a field of a
whole reply's body and of a stream's finishing chunk, and the `X-Prefixgate-Resumed`
header of a whole reply.

Routing: prompts route by their cached prefix, as on gRPC. Conversation affinity (the
`session` policy, and the trace recorder's conversation id) comes from the request's
`prompt_cache_key` field, OpenAI's own field for cache affinity; `user` is not used.
prefixgate extensions in the body (the SDK's `extra_body`): `namespace` (cache namespace;
with --tokens-file the token's own), `top_k`, `context_overflow`, `shifted_reuse` (as
the gRPC SamplingParams names them: "keep-system-drop-oldest", "blend", ...), `resume`
(false: no mid-stream resume, ChatRequest.no_resume).

Authentication: with --tokens-file, `Authorization: Bearer <token>` as on gRPC (the
same tokens, the same namespace binding, prefixgate/security/auth.py), checked once, from
the headers, before the body is read, parsed or tokenized (`TurnCore.authenticate`; the
tenant goes to the core with the turn); /health and /metrics stay open
(probes, scrapers). Bodies are bounded by --max-request-bytes (413), long text prompts by
the gateway's bounded tokenizer pool (429 when it is full). TLS: the gateway's --tls-cert/--tls-key (and --tls-client-ca)
serve HTTPS here too.

Errors are OpenAI's error object `{"error": {"message", "type", "param", "code"}}` with the
HTTP status and `code` of the way the turn failed (gateway/turn.py `Failure`; ERRORS:
invalid argument 400 `invalid_argument`, unauthenticated 401, permission denied 403, an
unknown `model` 404 `model_not_found` as OpenAI and vLLM answer, exhausted 429
`resource_exhausted`, unavailable 503, deadline 504 `deadline_exceeded`, a worker's
failure on the request alone 500 `internal`). Every error about one field names it in
`param`, and the message and `param` name the body's own fields (`prompt_cache_key`,
`stop`, `max_tokens`, `messages` or `prompt`): the core's errors carry the field at
fault, which `HTTP_FIELDS` names for this front. A stream fails before its first byte with
that status when it can; after it has begun, with one SSE `data: {"error": ...}` event and
no `[DONE]`. A client that disconnects cancels its turn (and the worker's request).
Log probabilities are the model's own (log-softmax of its logits, before temperature and
filters, as vLLM reports them), computed by the worker only when asked
(SamplingParams.top_logprobs) and shaped by gateway/logprobs.py.
Unsupported OpenAI features (tools, penalties, ...) are refused with 400 when
asked for, never silently ignored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from prefixgate.gateway import metrics
from prefixgate.gateway.logprobs import OpenAILogprobs, merge_completion
from prefixgate.gateway.turn import Caller, Failure, TurnCore, TurnError
from prefixgate.telemetry import metrics_export, tracing
from prefixgate.v1 import chat_pb2, common_pb2
from prefixgate.wire import rpc
from prefixgate.wire.protocol import (
    MAX_SAMPLES,
    MAX_TOP_LOGPROBS,
    OVERFLOW_FROM_PROTO,
    SHIFTED_REUSE_FROM_PROTO,
    InvalidRequest,
    check_id,
)
from prefixgate.wire.token_ids import repeated_token_ids

log = logging.getLogger(__name__)

CHAT_ROUTE = "/v1/chat/completions"
# After the drain, what handlers still running (streams) get to end once cancelled. Not 0:
# aiohttp reads a shutdown timeout of 0 as "no timeout" and would wait for every stream.
CANCEL_GRACE_S = 1.0
COMPLETIONS_ROUTE = "/v1/completions"

# The HTTP status and OpenAI `code` of each way a turn fails (gateway/turn.py Failure).
ERRORS = {
    Failure.INVALID_ARGUMENT: (400, "invalid_argument"),
    Failure.UNKNOWN_MODEL: (404, "model_not_found"),
    Failure.UNAUTHENTICATED: (401, "unauthenticated"),
    Failure.PERMISSION_DENIED: (403, "permission_denied"),
    Failure.EXHAUSTED: (429, "resource_exhausted"),
    Failure.UNAVAILABLE: (503, "unavailable"),
    Failure.DEADLINE: (504, "deadline_exceeded"),
    Failure.FAILED: (500, "internal"),
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "invalid_request_error",
               429: "rate_limit_error"}
FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
          common_pb2.FINISH_REASON_CANCELLED: "stop"}
INTERNAL_MESSAGE = "internal error (the gateway's log has the details)"
# OpenAI fields prefixgate cannot honour, with the value that asks for nothing.
UNSUPPORTED = {"tools": None, "functions": None, "logit_bias": None, "presence_penalty": 0, "frequency_penalty": 0,
               "response_format": None, "echo": False, "best_of": 1, "suffix": None,
               "audio": None, "modalities": None, "prediction": None}
# OpenAI's temperature for a request that leaves it out, where the model has no default
# of its own (where it has one, that one: ModelSpec.generation, as vLLM does).
OPENAI_TEMPERATURE = 1.0
OVERFLOW_TO_PROTO = {name: value for value, name in OVERFLOW_FROM_PROTO.items() if name}
SHIFTED_REUSE_TO_PROTO = {name: value for value, name in SHIFTED_REUSE_FROM_PROTO.items()
                          if name}


# The body's name of each ChatRequest field the turn core's errors name (TurnError.field);
# "messages" and "prompt_token_ids" are the prompt: `messages` on /v1/chat/completions,
# `prompt` on /v1/completions.
HTTP_FIELDS = {"conversation_id": "prompt_cache_key", "sampling.stop": "stop",
               "sampling.stop_token_ids": "stop", "sampling.max_tokens": "max_tokens",
               "sampling.temperature": "temperature", "sampling.top_p": "top_p",
               "sampling.top_k": "top_k", "sampling.n": "n", "sampling.seed": "seed",
               "sampling.context_overflow": "context_overflow",
               "sampling.shifted_reuse": "shifted_reuse",
               "sampling.top_logprobs": "top_logprobs", "packed_prompt_token_ids": "prompt",
               "prompt_token_ids": "prompt"}


def param_of(field: str | None, route: str, body: dict | None = None) -> str | None:
    """The request body's name (OpenAI's `param`) of the ChatRequest field `field`."""
    if field is None:
        return None
    if field == "messages" and route == COMPLETIONS_ROUTE:
        return "prompt"
    if field == "sampling.max_tokens" and body and \
            body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"  # the body's name for it (it wins over max_tokens)
    return HTTP_FIELDS.get(field, field)


class TurnFailed(Exception):
    """A turn that ends with an error the client should see: its HTTP status, message,
    OpenAI `code` and `param` (the body field at fault)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.http_status, self.details, self.error_code, self.param = \
            status, message, code, param


def turn_failed(exc: TurnError, route: str, body: dict | None = None) -> TurnFailed:
    """The HTTP form of the turn core's failure on `route` (for a request `body`)."""
    status, code = ERRORS[exc.kind]
    param = param_of(exc.field, route, body)
    return TurnFailed(status, exc.message_for(param), code, param)


def invalid(exc: InvalidRequest, route: str) -> TurnFailed:
    """The HTTP form of a body this front could not read into a ChatRequest."""
    return turn_failed(TurnError.invalid(exc), route)


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message,
                      "type": ERROR_TYPES.get(status, "server_error" if status >= 500
                                              else "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None,
                   param: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, code, param), status=status)


# --- request fields -------------------------------------------------------------------------


def _field(body: dict, name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__.replace("str", "string").replace("int", "integer")
                            .replace("float", "number") for k in kinds)
        raise InvalidRequest(f"{name} must be {names}, not {json.dumps(value)[:40]}", name)
    return value


def _count(body: dict, name: str, lo: int, hi: int) -> int | None:
    """An integer field of the body within [lo, hi] (None when left out)."""
    value = _field(body, name, (int,))
    if value is not None and not lo <= value <= hi:
        raise InvalidRequest(f"{name} is {value}: it must be between {lo} and {hi}", name)
    return value


def _max_tokens(body: dict, name: str) -> int | None:
    """`max_tokens` / `max_completion_tokens`: at least 1; the most is what the context
    window leaves after the prompt, which the core checks once the prompt is tokenized
    (its message names the range for this prompt)."""
    value = _field(body, name, (int,))
    if value is not None and not 1 <= value < 2**32:
        raise InvalidRequest(f"{name} is {value}: it must be at least 1 and fit in the "
                             "model's context window with the prompt", name)
    return value


def logprobs_wanted(body: dict, chat: bool) -> int | None:
    """Alternatives per token the body asks log probabilities for (None: no logprobs).
    Chat: `logprobs` true, with `top_logprobs` alternatives (0..20, needs `logprobs`);
    completions: `logprobs` alternatives (0..20; OpenAI allows 5, vLLM 20)."""
    if not chat:
        return _count(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    wanted = _field(body, "logprobs", (bool,), False)
    top = _count(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def sampling_params(body: dict, chat: bool = True) -> common_pb2.SamplingParams:
    """SamplingParams of an OpenAI request (`chat`: of /v1/chat/completions, else of
    /v1/completions); InvalidRequest naming a bad field. Ranges the gRPC path checks (n,
    temperature, max_tokens against the context) are left to it, so both fronts say the
    same."""
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != off and value != [] and value != {} and not (
                name == "response_format" and isinstance(value, dict)
                and value.get("type") == "text"):
            raise InvalidRequest(f"{name} is not supported by prefixgate: leave it out", name)
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise InvalidRequest("tool_choice is not supported by prefixgate: leave it out",
                             "tool_choice")
    params = common_pb2.SamplingParams(n=_count(body, "n", 1, MAX_SAMPLES) or 0)
    # Left out: unset, for the model's defaults (HTTPFront._events, wire/protocol.py).
    for name in ("temperature", "top_p"):
        value = _field(body, name, (int, float))
        if value is not None:
            setattr(params, name, float(value))
    max_tokens = _max_tokens(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _max_tokens(body, "max_tokens")
    if max_tokens is not None:
        params.max_tokens = max_tokens
    seed = _count(body, "seed", 0, 2**64 - 1)
    if seed is not None:
        params.seed = seed
    top_k = _count(body, "top_k", -1, 2**32 - 1)
    if top_k is not None:
        params.top_k = max(0, top_k)  # -1 (vLLM) and 0: off
    top_logprobs = logprobs_wanted(body, chat)
    if top_logprobs is not None:
        params.top_logprobs = top_logprobs
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequest("stop must be a string or a list of strings", "stop")
        params.stop.extend(stop)
    for name, table, field in (("context_overflow", OVERFLOW_TO_PROTO, "context_overflow"),
                               ("shifted_reuse", SHIFTED_REUSE_TO_PROTO, "shifted_reuse")):
        value = _field(body, name, (str,), "")
        if value:
            if value not in table:
                raise InvalidRequest(f"{name} is {value!r}: use one of {', '.join(table)}",
                                     name)
            setattr(params, field, table[value])
    return params


def _text_content(i: int, content: Any) -> str:
    """A message's text: a string, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise InvalidRequest(f"messages[{i}].content: only text parts "
                                     '({"type": "text", "text": ...}) are supported',
                                     "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts",
                         "messages")


def _common_fields(body: dict, request: chat_pb2.ChatRequest, chat: bool) -> None:
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise InvalidRequest("stream_options is only allowed with stream: true",
                             "stream_options")
    request.model = _field(body, "model", (str,), "")
    request.conversation_id = _field(body, "prompt_cache_key", (str,), "")
    request.namespace = _field(body, "namespace", (str,), "")
    request.no_resume = _field(body, "resume", (bool,), True) is False
    request.sampling.CopyFrom(sampling_params(body, chat))


def chat_request(body: dict) -> chat_pb2.ChatRequest:
    """The ChatRequest of a /v1/chat/completions body."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest("messages must be a list of {role, content} objects", "messages")
    request = chat_pb2.ChatRequest()
    request.messages.SetInParent()  # an empty list is still messages (the path says so)
    out = request.messages.messages
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"messages[{i}] must be an object with a role and content",
                                 "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.add(role=role, content=_text_content(i, m.get("content")))
    _common_fields(body, request, chat=True)
    return request


def completion_request(body: dict, vocab_size: int) -> tuple[chat_pb2.ChatRequest, str | None]:
    """The ChatRequest of a /v1/completions body (one prompt), and its prompt when it is
    text (tokenized by the turn core, where chat messages are: `TurnCore.turn`'s
    `prompt_text`); token ids are checked and packed here, as on gRPC."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    request = chat_pb2.ChatRequest()
    text = None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        # The gRPC path's own check (token_ids.py), packed once here as on gRPC.
        request.packed_prompt_token_ids = repeated_token_ids(prompt, vocab_size, "prompt").obj
    else:
        raise InvalidRequest("prompt must be a string or a list of token ids (one prompt per "
                             "request)", "prompt")
    _common_fields(body, request, chat=False)
    return request, text


# --- responses ---------------------------------------------------------------------------


def usage_json(usage: common_pb2.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def finish_reasons(final: chat_pb2.ChatFinal, n: int) -> list[str]:
    reasons = list(final.sample_finish_reasons) or [final.finish_reason] * n
    return [FINISH.get(r, "stop") for r in reasons] + ["stop"] * (n - len(reasons))


class _Turn:
    """One HTTP turn's identity and shape: ids, route, number of choices, chat or text."""

    def __init__(self, route: str, request_id: str, model: str, n: int,
                 logprobs: bool = False) -> None:
        self.route, self.request_id, self.model, self.n = route, request_id, model, n
        self.chat = route == CHAT_ROUTE
        self.logprobs = logprobs  # the request asked for logprobs
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + request_id
        self.object = "chat.completion" if self.chat else "text_completion"
        self.created = int(time.time())

    def envelope(self, choices: list, **extra) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def chunk(self, choices: list, **extra) -> bytes:
        doc = {"id": self.id, "object": "chat.completion.chunk" if self.chat
               else "text_completion", "created": self.created, "model": self.model,
               "choices": choices, **extra}
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

    def piece(self, index: int, text: str | None, finish: str | None,
              logprobs: dict | None = None) -> dict:
        if self.chat:
            delta = {} if text is None else {"content": text}
            return {"index": index, "delta": delta, "logprobs": logprobs,
                    "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": logprobs,
                "finish_reason": finish}


# --- the server ----------------------------------------------------------------------------


class HTTPFront:
    """The OpenAI-compatible HTTP server of one gateway process (see the module docstring)."""

    def __init__(self, core: TurnCore) -> None:
        self.core = core
        self.model = core.spec.name
        self.app = web.Application(client_max_size=core.config.limits.max_request_bytes,
                                   middlewares=[self._errors])
        self.app.add_routes([
            web.post(CHAT_ROUTE, self.chat_completions),
            web.post(COMPLETIONS_ROUTE, self.completions),
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model:.+}", self.model_info),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
        ])
        self.runner: web.AppRunner | None = None
        self.turns_in_flight = 0
        tokenizer = core.tokenizer
        self.openai_logprobs = OpenAILogprobs(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))

    async def start(self, host: str, port: int, tls: rpc.TLSConfig | None = None,
                    share_port: bool = False) -> int:
        """Listen on host:port (0: any free port); returns the bound port. `share_port`:
        other gateway processes listen on the same port (SO_REUSEPORT)."""
        # handler_cancellation: a client that disconnects cancels its turn at once.
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=CANCEL_GRACE_S)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=_ssl_context(tls),
                           reuse_port=share_port)
        try:
            await site.start()
        except OSError as exc:
            await self.runner.cleanup()
            raise rpc.BindError(f"gateway HTTP front: cannot listen on {host}:{port}: "
                                f"{exc.strerror or exc}; choose another --http-port (-1: "
                                "off)") from exc
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self, drain_seconds: float) -> None:
        """Stop accepting; let turns in flight finish for up to `drain_seconds`, then cancel
        the rest (their streams end, their worker requests are cancelled): returns within
        `drain_seconds` + CANCEL_GRACE_S."""
        if self.runner is None:
            return
        for site in list(self.runner.sites):
            await site.stop()
        deadline = time.monotonic() + drain_seconds
        while self.turns_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.runner.cleanup()

    # --- middleware: every answer counted; every failure as OpenAI's error object --------

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        route = request.match_info.route.resource.canonical if request.match_info.route.resource \
            else "other"
        try:
            response = await handler(request)
        except TurnFailed as exc:
            response = error_response(exc.http_status, exc.details, exc.error_code, exc.param)
        except web.HTTPRequestEntityTooLarge:
            limit = self.core.config.limits.max_request_bytes
            response = error_response(413, f"the request body is over {limit} bytes: send a "
                                           "shorter prompt", "request_too_large")
        except web.HTTPException as exc:
            response = error_response(exc.status, exc.reason, None)
        except asyncio.CancelledError:  # the client went away
            if not request.get("counted"):
                metrics.REQUESTS.labels(route, "499").inc()
            raise
        except Exception:
            log.exception("HTTP %s %s failed", request.method, request.path)
            response = error_response(500, INTERNAL_MESSAGE, "internal")
        if not request.get("counted"):
            metrics.REQUESTS.labels(route, str(response.status)).inc()
        return response

    # --- routes ---------------------------------------------------------------------------

    def _authenticate(self, request: web.Request, route: str = ""):
        """The caller's tenant (None when tokens are off), from the `Authorization`
        header alone: every route but /health and /metrics checks it first, once."""
        try:
            return self.core.authenticate(request.headers.get("Authorization"))
        except TurnError as exc:
            raise turn_failed(exc, route) from None

    async def models(self, request: web.Request) -> web.Response:
        self._authenticate(request)
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model_info(self, request: web.Request) -> web.Response:
        self._authenticate(request)
        if request.match_info["model"] != self.model:
            return error_response(404, f"model {request.match_info['model']!r} is not served "
                                       f"here: this gateway serves {self.model!r}",
                                  "model_not_found", "model")
        return web.json_response(self._model_card())

    def _model_card(self) -> dict:
        spec = self.core.spec
        return {"id": spec.name, "object": "model", "created": 0, "owned_by": "prefixgate",
                "max_model_len": spec.max_context_tokens, "fingerprint": spec.fingerprint,
                "num_workers": len(self.core.pool.healthy())}

    async def health(self, request: web.Request) -> web.Response:
        workers = len(self.core.pool.healthy())
        return web.json_response({"status": "ok" if workers else "no workers",
                                  "workers": workers}, status=200 if workers else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(body=metrics_export.exposition(self.model),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, CHAT_ROUTE)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._turn(request, COMPLETIONS_ROUTE)

    async def _turn(self, request: web.Request, route: str) -> web.StreamResponse:
        # The credential first: a caller without one costs no body read, parse or
        # tokenizing (the body stays unread; aiohttp discards it).
        tenant = self._authenticate(request, route)
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise TurnFailed(400, "the request body is not valid JSON",
                             "invalid_argument") from None
        if not isinstance(body, dict):
            raise TurnFailed(400, "the request body must be a JSON object", "invalid_argument")
        request_id = _request_id(request)
        stream = body.get("stream") is True
        options = body.get("stream_options") or {}
        include_usage = stream and isinstance(options, dict) and \
            options.get("include_usage") is True
        n = body.get("n") if type(body.get("n")) is int and body.get("n") > 0 else 1
        asked = body.get("logprobs")  # checked by sampling_params; here only its shape
        turn = _Turn(route, request_id, self.model, n, logprobs=asked is True if
                     route == CHAT_ROUTE else type(asked) is int)
        # No deadline: a client ends its turn by disconnecting.
        caller = Caller(tenant, trace_headers=tracing.incoming(request.headers))
        conversation_id = body.get("prompt_cache_key")
        request["counted"] = True  # observe_turn counts the turn routes
        events = metrics.observe_turn(
            route, self._events(route, body, caller, request_id), request_id=request_id,
            conversation_id=conversation_id if isinstance(conversation_id, str) else "",
            status_of=_http_status_of, ok_status="200")
        self.turns_in_flight += 1
        try:
            if stream:
                return await self._stream(request, turn, events, include_usage, caller)
            return await self._collect(turn, events, caller)
        finally:
            self.turns_in_flight -= 1
            await events.aclose()

    async def _events(self, route: str, body: dict, caller: Caller, request_id: str
                      ) -> AsyncIterator[chat_pb2.ChatEvent]:
        """The turn's events: the body read into a ChatRequest (and a completion's text
        prompt), run by the core; every failure a TurnFailed."""
        try:
            if route == CHAT_ROUTE:
                chat, text = chat_request(body), None
            else:
                chat, text = completion_request(body, self.core.tokenizer.vocab_size)
        except InvalidRequest as exc:
            raise invalid(exc, route) from None
        if not chat.sampling.HasField("temperature") and \
                self.core.spec.generation.temperature is None:
            chat.sampling.temperature = OPENAI_TEMPERATURE  # no model default: OpenAI's
        try:
            async for ev in self.core.turn(chat, caller, request_id, text):
                yield ev
        except TurnError as exc:
            raise turn_failed(exc, route, body) from None

    async def _collect(self, turn: _Turn, events: AsyncIterator[chat_pb2.ChatEvent],
                       caller: Caller) -> web.Response:
        texts: list[list[str]] = [[] for _ in range(turn.n)]
        logprobs: list[list[dict]] = [[] for _ in range(turn.n)]
        offsets = [0] * turn.n
        final = None
        async for ev in events:
            if ev.HasField("delta"):
                i = ev.delta.index
                if i < turn.n:
                    if turn.logprobs:
                        logprobs[i].append(self._logprobs(turn, ev.delta, offsets[i]))
                    texts[i].append(ev.delta.text)
                    offsets[i] += len(ev.delta.text)
            else:
                final = ev.final
        assert final is not None  # a turn ends with a final event or raises
        reasons = finish_reasons(final, turn.n)
        merged = [None if not turn.logprobs else merge_logprobs(turn, parts)
                  for parts in logprobs]
        if turn.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": "".join(t)},
                        "logprobs": merged[i], "finish_reason": reasons[i]}
                       for i, t in enumerate(texts)]
        else:
            choices = [{"index": i, "text": "".join(t), "logprobs": merged[i],
                        "finish_reason": reasons[i]} for i, t in enumerate(texts)]
        return web.json_response(
            turn.envelope(choices, usage=usage_json(final.usage),
                          prefixgate_resumed=final.num_resumes),
            headers={"X-Request-Id": turn.request_id, "X-Prefixgate-Worker": final.worker_id,
                     "X-Prefixgate-Resumed": str(final.num_resumes),
                     **dict(caller.trace_reply)})

    def _logprobs(self, turn: _Turn, delta: chat_pb2.ChatDelta, offset: int) -> dict:
        """The OpenAI logprobs of one delta's tokens (gateway/logprobs.py); `offset`:
        the characters of its choice sent before it."""
        if turn.chat:
            return {"content": self.openai_logprobs.chat(delta.token_ids, delta.logprobs)}
        return self.openai_logprobs.completion(delta.token_ids, delta.logprobs, offset,
                                               len(delta.text))

    async def _stream(self, request: web.Request, turn: _Turn,
                      events: AsyncIterator[chat_pb2.ChatEvent], include_usage: bool,
                      caller: Caller) -> web.StreamResponse:
        # The first event comes before the headers, so a turn refused before it started
        # (bad input, no worker, auth) gets its HTTP status instead of a 200 stream.
        first = await anext(events)
        response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Request-Id": turn.request_id, **dict(caller.trace_reply)})
        await response.prepare(request)
        usage_none = {"usage": None} if include_usage else {}
        if turn.chat:  # OpenAI's first chunk of each choice names the role
            await response.write(turn.chunk(
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for i in range(turn.n)], **usage_none))
        ev: chat_pb2.ChatEvent | None = first
        offsets = [0] * turn.n  # characters sent per choice (completions' text_offset)
        try:
            while ev is not None:
                if ev.HasField("delta"):
                    delta = ev.delta
                    # A token that completes no character yet still has its logprob.
                    if delta.text or (turn.logprobs and delta.logprobs):
                        lp = None
                        if turn.logprobs and delta.index < turn.n:
                            lp = merge_logprobs(turn, [self._logprobs(
                                turn, delta, offsets[delta.index])])
                            offsets[delta.index] += len(delta.text)
                        await response.write(turn.chunk(
                            [turn.piece(delta.index, delta.text, None, lp)], **usage_none))
                else:
                    final = ev.final
                    reasons = finish_reasons(final, turn.n)
                    await response.write(turn.chunk(
                        [turn.piece(i, None if turn.chat else "", reasons[i])
                         for i in range(turn.n)], **usage_none,
                        prefixgate_worker=final.worker_id,
                        prefixgate_resumed=final.num_resumes))
                    if include_usage:
                        await response.write(turn.chunk([], usage=usage_json(final.usage)))
                    await response.write(b"data: [DONE]\n\n")
                ev = await anext(events, None)
        except ConnectionResetError:  # the client went away mid-stream: nothing to say
            return response
        except Exception as exc:  # after the headers: the error is the stream's last event
            if isinstance(exc, TurnFailed):
                body = error_body(exc.http_status, exc.details, exc.error_code, exc.param)
            else:  # a bug; the middleware cannot answer a stream already begun
                log.exception("HTTP %s stream %s failed", turn.route, turn.request_id)
                body = error_body(500, INTERNAL_MESSAGE, "internal")
            await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        await response.write_eof()
        return response


def merge_logprobs(turn: _Turn, parts: list[dict]) -> dict:
    """One choice's `logprobs` object from its deltas' (HTTPFront._logprobs)."""
    if turn.chat:
        return {"content": [entry for part in parts for entry in part["content"]]}
    return merge_completion(parts)


def _request_id(request: web.Request) -> str:
    """The client's X-Request-Id when it is a sane identifier, else a new one."""
    given = request.headers.get("X-Request-Id", "")
    if given and given.isascii() and given.isprintable() and " " not in given:
        try:
            check_id("X-Request-Id", given)
            return given
        except InvalidRequest:
            pass
    return uuid.uuid4().hex


def _http_status_of(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, TurnFailed):
        return str(exc.http_status), exc.details
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit, ConnectionResetError)):
        return "499", "the client went away"
    return "500", f"{type(exc).__name__}: {exc}"


def _ssl_context(tls: rpc.TLSConfig | None) -> ssl.SSLContext | None:
    """HTTPS with the gateway's certificate; client certificates required when it has a
    client CA (mutual TLS), as on gRPC."""
    if tls is None or not tls.enabled:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.ca_file:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(tls.ca_file)
    return context
