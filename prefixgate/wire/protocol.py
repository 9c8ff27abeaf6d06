"""Validation and conversion between the v1 protobuf messages and internal types.

Torch-free: the gateway and the worker validate with the same code, so a request the
gateway accepts is one the worker accepts. Every check raises `InvalidRequest` with a
message that tells the user what to change; servers map it to INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixgate.v1 import chat_pb2, common_pb2, worker_pb2

DEFAULT_MAX_TOKENS = 256
ROLES = ("system", "user", "assistant")
# Workers sample in float32 and divide by the temperature after subtracting the largest
# logit, so every scaled logit is <= 0 and the largest is exactly 0. That holds for any
# temperature that is a normal float32 (>= 2**-126); below it the division runs on
# subnormals or zero (0/0: NaN), so smaller temperatures are refused (0 means greedy).
MIN_TEMPERATURE = 2.0 ** -126


class InvalidRequest(ValueError):
    """Bad input; the message says what to change. `field`: the request field at fault,
    by its protobuf path ("sampling.max_tokens", "messages", "prompt_token_ids"), or None
    when no one field is. A message that names the field names it first, so a front whose
    clients call it otherwise (OpenAI's `max_tokens`) says it in their words:
    `message_for(name)`."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def message_for(self, name: str | None) -> str:
        """The message with `field` called `name` (None or no field: as it is)."""
        message = str(self)
        if self.field and name and message.startswith(self.field):
            return name + message[len(self.field):]
        return message


class UnknownModel(InvalidRequest):
    """The request names a model this server does not serve (gRPC NOT_FOUND, HTTP 404
    `model_not_found`, as OpenAI and vLLM answer)."""


class AuthError(Exception):
    """A call that may not proceed (prefixgate.security.auth raises it); `str(exc)` says
    what to do about it."""


class Unauthenticated(AuthError):
    """No credential, or one that is not known (gRPC UNAUTHENTICATED, HTTP 401)."""


class PermissionDenied(AuthError):
    """A known credential asking for what it may not have (gRPC PERMISSION_DENIED, HTTP 403)."""


@dataclass(frozen=True)
class RequestLimits:
    """What one request may carry, checked at the edge (gateway and worker) before any
    large allocation: the gRPC servers refuse a message over `max_request_bytes` before
    parsing it, and the field checks below run before tokenizing or routing. Every
    client-chosen string ends up in logs, metrics or per-namespace maps, hence the bounds
    (units: characters, items, bytes)."""

    # One serialized ChatRequest (the gateway's gRPC max receive size). Tokenizing holds
    # the gateway's event loop (~0.4 s per MiB here, the tokenizer keeps the GIL), so this
    # bounds how long one request can stall every other stream.
    max_request_bytes: int = 512 << 10
    # Prompt tokens after tokenizing (more than any context: keep-system-drop-oldest lets
    # a client send a history longer than the context and the worker drops its oldest turns).
    max_prompt_tokens: int = 1 << 17
    # Calls a server has accepted but its event loop has not picked up yet. gRPC's own
    # default (1,000, then random refusals up to 3,000) made a burst of 2,000 concurrent
    # streams end 5-10 % CANCELLED with no message; past this bound calls are refused.
    max_pending_calls: int = 1 << 14
    max_id_chars: int = 256  # conversation_id, namespace, request_id, model
    max_messages: int = 4096
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 256  # per stop string
    max_stop_token_ids: int = 256
    # Gateway: long prompts are tokenized on this many threads, with at most this many
    # more waiting; beyond that RESOURCE_EXHAUSTED (gateway/tokenize_pool.py). Each
    # running tokenization of a max_request_bytes prompt holds tens of MB, so the threads
    # bound the gateway's memory, not the node's core count.
    tokenize_threads: int = 2
    max_tokenize_waiting: int = 16
    # Gateway: turns one tenant (its namespace: a token's own, else the one requested) may
    # have in flight, whatever the form of their prompts; more are refused with
    # RESOURCE_EXHAUSTED (HTTP 429). Each holds its prompt (up to max_prompt_tokens ids)
    # and a worker stream, so this bounds what one token holder can pin. 0: no bound.
    max_turns_per_tenant: int = 1024

    def server_options(self, max_receive_bytes: int) -> list[tuple[str, int]]:
        """gRPC server options enforcing these limits (receive size, pending calls)."""
        return [("grpc.max_receive_message_length", max_receive_bytes),
                ("grpc.server.max_pending_requests", self.max_pending_calls),
                ("grpc.server.max_pending_requests_hard_limit", self.max_pending_calls)]

    @property
    def worker_receive_bytes(self) -> int:
        """A worker's gRPC max receive size: a GenerateRequest of `max_prompt_tokens` ids
        (at most 5 bytes each) plus the rest of a request."""
        return 5 * self.max_prompt_tokens + self.max_request_bytes


DEFAULT_LIMITS = RequestLimits()


def check_prompt_tokens(num_tokens: int, limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """Raise when a prompt has more than `max_prompt_tokens` tokens."""
    if num_tokens > limits.max_prompt_tokens:
        raise InvalidRequest(f"the prompt is {num_tokens} tokens: at most "
                             f"{limits.max_prompt_tokens} are accepted (drop the oldest turns)",
                             "messages")


def clip(text: str, max_chars: int = 64) -> str:
    """`text` cut for a log line or an error message (client strings can be megabytes)."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}...(+{len(text) - max_chars} chars)"


def check_id(field_name: str, value: str, limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """Raise unless the client-chosen identifier `value` is at most `max_id_chars` long."""
    if len(value) > limits.max_id_chars:
        raise InvalidRequest(f"{field_name} is {len(value)} characters long: at most "
                             f"{limits.max_id_chars} are accepted", field_name)


def check_stops(msg: common_pb2.SamplingParams, limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """Raise unless the stop strings and stop token ids are within `limits` (every stop
    string is searched for after each token, so their count and length are bounded)."""
    if len(msg.stop) > limits.max_stop:
        raise InvalidRequest(f"sampling.stop has {len(msg.stop)} strings: at most "
                             f"{limits.max_stop} are accepted", "sampling.stop")
    longest = max((len(s) for s in msg.stop), default=0)
    if longest > limits.max_stop_chars:
        raise InvalidRequest(f"sampling.stop has a string {longest} characters long: at most "
                             f"{limits.max_stop_chars} are accepted", "sampling.stop")
    if len(msg.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequest(f"sampling.stop_token_ids has {len(msg.stop_token_ids)} ids: at "
                             f"most {limits.max_stop_token_ids} are accepted",
                             "sampling.stop_token_ids")


@dataclass(frozen=True)
class SamplingConfig:
    """Validated sampling parameters of one request (units: tokens)."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1  # samples sharing the prompt
    # Context overflow (prefixgate.model.overflow.POLICIES): "fail" is validated away here;
    # "keep-system-drop-oldest" lets the worker drop the oldest turns. "" = engine default.
    context_overflow: str = ""
    shifted_reuse: str = ""  # "recompute" | "shift" | "blend"; "" = engine default
    # Log probabilities wanted with each token: None none, k the token's and the top k's.
    top_logprobs: int | None = None
    # Draws of the seed's random stream already spent: sampling starts past them (a
    # resumed reply continues the stream of the reply it continues).
    seed_offset_tokens: int = 0


MAX_SAMPLES = 16
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's and vLLM's default bound)

OVERFLOW_FROM_PROTO = {
    common_pb2.CONTEXT_OVERFLOW_UNSPECIFIED: "",
    common_pb2.CONTEXT_OVERFLOW_FAIL: "fail",
    common_pb2.CONTEXT_OVERFLOW_KEEP_SYSTEM_DROP_OLDEST: "keep-system-drop-oldest",
}
SHIFTED_REUSE_FROM_PROTO = {
    common_pb2.SHIFTED_REUSE_UNSPECIFIED: "",
    common_pb2.SHIFTED_REUSE_RECOMPUTE: "recompute",
    common_pb2.SHIFTED_REUSE_SHIFT: "shift",
    common_pb2.SHIFTED_REUSE_BLEND: "blend",
}


def with_generation_defaults(msg: common_pb2.SamplingParams, defaults
                             ) -> common_pb2.SamplingParams:
    """`msg` with the temperature, top_p and top_k it leaves unset taken from the model's
    `defaults` (model/catalog.GenerationDefaults; a copy when any is filled). Both fronts
    of the gateway and the worker call it, so a request means the same wherever it
    enters; a field neither sets keeps the proto's meaning (greedy, no top_p, no top_k)."""
    fill = {name: value for name in ("temperature", "top_p", "top_k")
            if not msg.HasField(name) and (value := getattr(defaults, name)) is not None}
    if not fill:
        return msg
    out = common_pb2.SamplingParams()
    out.CopyFrom(msg)
    for name, value in fill.items():
        setattr(out, name, value)
    return out


def sampling_from_proto(msg: common_pb2.SamplingParams, num_prompt_tokens: int,
                        max_context_tokens: int, default_overflow: str = "fail",
                        limits: RequestLimits = DEFAULT_LIMITS) -> SamplingConfig:
    """Validate `msg` for a prompt of `num_prompt_tokens` tokens in a context window of
    `max_context_tokens`. An unset max_tokens becomes min(256, what the context leaves).
    Under context_overflow "keep-system-drop-oldest" (from `msg`, else `default_overflow`)
    a prompt that does not fit is accepted (the worker drops its oldest turns); max_tokens
    must then leave room for a prompt, and unset it is min(256, max_context_tokens / 2)."""
    overflow = OVERFLOW_FROM_PROTO.get(msg.context_overflow)
    reuse = SHIFTED_REUSE_FROM_PROTO.get(msg.shifted_reuse)
    if overflow is None or reuse is None:
        raise InvalidRequest(
            f"sampling.{'context_overflow' if overflow is None else 'shifted_reuse'} has an "
            "unknown value: use one of the ContextOverflow / ShiftedReuse enums",
            f"sampling.{'context_overflow' if overflow is None else 'shifted_reuse'}")
    if (overflow or default_overflow) == "keep-system-drop-oldest" and \
            num_prompt_tokens + (msg.max_tokens if msg.HasField("max_tokens") else 1) \
            > max_context_tokens:
        limit = max_context_tokens - 1
        if msg.HasField("max_tokens") and not 1 <= msg.max_tokens <= limit:
            raise InvalidRequest(
                f"sampling.max_tokens is {msg.max_tokens}: it must be between 1 and {limit} "
                f"(the context window is {max_context_tokens} tokens)", "sampling.max_tokens")
        max_tokens = msg.max_tokens if msg.HasField("max_tokens") else \
            min(DEFAULT_MAX_TOKENS, max_context_tokens // 2)
        return _sampling(msg, max_tokens, overflow, reuse, limits)
    if num_prompt_tokens >= max_context_tokens:
        raise InvalidRequest(
            f"the prompt is {num_prompt_tokens} tokens but the model's context window is "
            f"{max_context_tokens} tokens (prompt and reply together): shorten the "
            "conversation, e.g. drop its oldest turns", "messages")
    room = max_context_tokens - num_prompt_tokens
    if msg.HasField("max_tokens"):
        if not 1 <= msg.max_tokens <= room:
            raise InvalidRequest(
                f"sampling.max_tokens is {msg.max_tokens}: it must be between 1 and {room} "
                f"(the prompt is {num_prompt_tokens} tokens and the context window "
                f"{max_context_tokens}; leave it unset for min({DEFAULT_MAX_TOKENS}, {room}), "
                "or shorten the prompt for more)", "sampling.max_tokens")
        max_tokens = msg.max_tokens
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    return _sampling(msg, max_tokens, overflow, reuse, limits)


def _sampling(msg: common_pb2.SamplingParams, max_tokens: int, overflow: str,
              reuse: str, limits: RequestLimits) -> SamplingConfig:
    if not math.isfinite(msg.temperature) or msg.temperature < 0:
        raise InvalidRequest("sampling.temperature must be >= 0 (0 means greedy)",
                             "sampling.temperature")
    if 0 < msg.temperature < MIN_TEMPERATURE:
        raise InvalidRequest(
            f"sampling.temperature={msg.temperature:.3g} is below {MIN_TEMPERATURE:.3g}, the "
            "smallest value the workers' float32 sampling can divide by: use 0 for greedy "
            "decoding or a temperature of at least that", "sampling.temperature")
    if not math.isfinite(msg.top_p) or not 0 <= msg.top_p <= 1:
        raise InvalidRequest("sampling.top_p must be in (0, 1] (0 or unset means 1)",
                             "sampling.top_p")
    if msg.n > MAX_SAMPLES:
        raise InvalidRequest(f"sampling.n is {msg.n}: it must be between 1 and {MAX_SAMPLES} "
                             "(0 means 1)", "sampling.n")
    if msg.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"sampling.top_logprobs is {msg.top_logprobs}: it must be between "
                             f"0 and {MAX_TOP_LOGPROBS} (alternatives per token)",
                             "sampling.top_logprobs")
    if msg.seed_offset_tokens > limits.max_prompt_tokens:
        raise InvalidRequest(f"sampling.seed_offset_tokens is {msg.seed_offset_tokens}: it "
                             f"must be between 0 and {limits.max_prompt_tokens} (tokens of "
                             "the reply already sampled)", "sampling.seed_offset_tokens")
    check_stops(msg, limits)
    return SamplingConfig(
        n=max(1, msg.n),
        max_tokens=max_tokens,
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) or 1.0,
        top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        stop=tuple(s for s in msg.stop if s),
        stop_token_ids=tuple(msg.stop_token_ids),
        context_overflow=overflow,
        shifted_reuse=reuse,
        top_logprobs=int(msg.top_logprobs) if msg.HasField("top_logprobs") else None,
        seed_offset_tokens=int(msg.seed_offset_tokens),
    )


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Raise unless `token_ids` is non-empty and every id is in [0, vocab_size)."""
    if not token_ids:
        raise InvalidRequest("prompt_token_ids is empty: send at least one token id",
                             "prompt_token_ids")
    bad = next((t for t in token_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt_token_ids: token id {bad} is out of range: the model's "
                             f"vocabulary has {vocab_size} tokens (ids 0..{vocab_size - 1})",
                             "prompt_token_ids")


def check_messages(messages: list[tuple[str, str]]) -> None:
    """Raise unless there is at least one message, every role is known, only assistant
    messages are empty (a reply can be empty) and the last message is not from the
    assistant."""
    if not messages:
        raise InvalidRequest("messages is empty: send at least one user message", "messages")
    for i, (role, content) in enumerate(messages):
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role is {role!r}: use one of "
                                 f"{', '.join(ROLES)}", "messages")
        if not content and role != "assistant":
            raise InvalidRequest(f"messages[{i}].content is empty: every message needs text",
                                 "messages")
    if messages[-1][0] == "assistant":
        raise InvalidRequest("the last message is from the assistant: end with a user message",
                             "messages")


def check_chat_fields(request: chat_pb2.ChatRequest,
                      limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """Raise unless a ChatRequest's identifiers, message count and stop lists are within
    `limits`. Cheap (no tokenizing): the gateway runs it first."""
    check_id("conversation_id", request.conversation_id, limits)
    check_id("namespace", request.namespace, limits)
    check_id("model", request.model, limits)
    if request.WhichOneof("input") == "messages" and \
            len(request.messages.messages) > limits.max_messages:
        raise InvalidRequest(f"messages has {len(request.messages.messages)} messages: at "
                             f"most {limits.max_messages} are accepted (drop the oldest turns)",
                             "messages")
    check_stops(request.sampling, limits)


def check_generate_fields(request: worker_pb2.GenerateRequest,
                          limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """Raise unless a GenerateRequest's identifiers and stop lists are within `limits`."""
    check_id("request_id", request.request_id, limits)
    check_id("namespace", request.namespace, limits)
    check_stops(request.sampling, limits)


# Trailing metadata a worker sets on a failed Generate whose failure belongs to the
# request (bad input, or an engine error bisected to it): the gateway returns the status
# to the client as it is, never retries it on another worker (it would fail there too)
# and never marks the worker down for it.
ERROR_SCOPE_KEY = "prefixgate-error-scope"
ERROR_SCOPE_REQUEST = "request"
REQUEST_SCOPED = ((ERROR_SCOPE_KEY, ERROR_SCOPE_REQUEST),)
