"""Replay targets: where a turn is sent and how its timings are measured.

Contract: `await target.send(request)` sends one turn and returns a `TurnRecord` with the
client-side timings (seconds, from just before the request is sent): `ttft_s` to the first
content chunk, `itl_s` the gaps between successive content chunks, `e2e_s` to the end of
the reply. It never raises for a failed turn: the record's `status` is "ok" or the failure
("UNAVAILABLE", "HTTP 503", "timeout", "connect error", "incomplete", ...) with `error`
saying more. An HTTP stream is complete only when it ends with `data: [DONE]` or a choice
carrying a finish reason: a server that drops a stream mid-reply (llama-cpp-python's
server interrupts a running request when another arrives) leaves neither, and such a turn
is a failure, not a short reply.

Targets:
  GatewayTarget   a prefixgate gateway over gRPC (prefixgate.wire.client.ChatClient); reports
                  the serving worker and its cached tokens.
  OpenAITarget    any OpenAI-compatible HTTP server (vLLM, SGLang, llama.cpp, ...):
                  chat turns to /v1/chat/completions, token turns to /v1/completions with
                  a token-id prompt, both streaming; cached tokens from
                  usage.prompt_tokens_details.cached_tokens when the server reports them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import httpx
from httpx_sse import EventSource

from prefixgate.v1 import common_pb2
from prefixgate.wire.client import ChatClient


@dataclass(frozen=True)
class TurnRequest:
    conversation_id: str
    turn_index: int
    max_tokens: int
    messages: list[tuple[str, str]] | None = None  # chat turn
    prompt_token_ids: Sequence[int] | None = None  # token turn (an array('I'): sent packed)


@dataclass
class TurnRecord:
    conversation_id: str
    turn_index: int
    start_s: float = 0.0  # from the run's start (set by the load generator)
    status: str = "ok"
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    transferred_tokens: int = 0  # prompt tokens whose KV was pulled from another worker
    completion_tokens: int = 0
    worker: str = ""
    # The gateway's decision, when it reports it (-1: not reported): cached tokens it
    # predicted on the chosen worker and on the best-cached worker.
    predicted_cached_tokens: int = -1
    best_predicted_cached_tokens: int = -1
    predicted_transferred_tokens: int = 0  # ... and predicted to arrive by a pull
    # The gateway's own time to first token (its handler's start to the first token it
    # relayed, seconds; -1: not reported): the client's TTFT less this is the client and
    # the hops between them.
    gateway_ttft_s: float = -1.0

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens prefilled (neither cached nor transferred)."""
        return self.prompt_tokens - self.cached_tokens - self.transferred_tokens

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Target:
    """Base class: `name` labels results; `send` as in the module docstring."""

    name = "target"

    async def send(self, request: TurnRequest) -> TurnRecord:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class _Clock:
    """Chunk arrival times of one streamed reply."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.chunks: list[float] = []

    def chunk(self) -> None:
        self.chunks.append(time.monotonic())

    def fill(self, rec: TurnRecord) -> None:
        end = time.monotonic()
        rec.e2e_s = end - self.start
        if self.chunks:
            rec.ttft_s = self.chunks[0] - self.start
            rec.itl_s = [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


class GatewayTarget(Target):
    def __init__(self, address: str, *, timeout_s: float = 300.0, temperature: float = 0.0,
                 namespace: str = "", conversation_ids: bool = True) -> None:
        self.name = f"prefixgate {address}"
        self.conversation_ids = conversation_ids  # False: turns go without their id
        self.client = ChatClient(address)
        self.timeout_s = timeout_s
        self.temperature = temperature
        self.namespace = namespace

    async def wait_ready(self, timeout_s: float) -> None:
        await self.client.wait_ready(timeout_s)

    async def send(self, request: TurnRequest) -> TurnRecord:
        rec = TurnRecord(request.conversation_id, request.turn_index)
        clock = _Clock()
        sampling = common_pb2.SamplingParams(max_tokens=request.max_tokens,
                                             temperature=self.temperature)
        try:
            r = await self.client.turn(
                request.messages, prompt_token_ids=request.prompt_token_ids,
                conversation_id=request.conversation_id if self.conversation_ids else "",
                namespace=self.namespace,
                sampling=sampling, timeout_s=self.timeout_s, on_text=lambda _t: clock.chunk())
        except grpc.aio.AioRpcError as exc:
            clock.fill(rec)
            rec.status, rec.error = exc.code().name, exc.details() or ""
            return rec
        clock.fill(rec)
        rec.prompt_tokens, rec.cached_tokens = r.prompt_tokens, r.cached_tokens
        rec.completion_tokens, rec.worker = r.completion_tokens, r.worker_id
        rec.predicted_cached_tokens = r.predicted_cached_tokens
        rec.best_predicted_cached_tokens = r.best_predicted_cached_tokens
        rec.transferred_tokens = r.transferred_tokens
        rec.predicted_transferred_tokens = r.predicted_transferred_tokens
        rec.gateway_ttft_s = r.ttft_ms / 1e3
        return rec

    async def close(self) -> None:
        await self.client.close()


class OpenAITarget(Target):
    def __init__(self, base_url: str, *, model: str = "", timeout_s: float = 300.0,
                 temperature: float = 0.0, api_key: str = "", text_token_ids: bool = False
                 ) -> None:
        """`text_token_ids`: send a token turn's ids as one text prompt, the ids separated
        by spaces (for routers that route on a prompt's text, e.g. sglang-router in front
        of prefixgate's emulated workers)."""
        self.name = f"openai {base_url}"
        self.text_token_ids = text_token_ids
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.model = model
        self.temperature = temperature
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Several small connection pools, used in turn: httpcore assigns queued requests to
        # connections in time quadratic in the requests of one pool, so one pool carrying
        # hundreds of concurrent streams (an open-loop replay) spends the client's CPU
        # there instead of sending.
        self._pools = [httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                         headers=headers,
                                         limits=httpx.Limits(max_connections=64))
                       for _ in range(16)]
        self._next_pool = itertools.cycle(self._pools)

    async def wait_ready(self, timeout_s: float) -> None:
        """Until the server lists a model at GET /v1/models (a server without that
        endpoint: at once); TimeoutError after `timeout_s`. Without a model set, the first
        one listed is sent from then on: routers such as smg 1.13 route a request only to
        workers serving the model it names, and list none before a worker registered."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                resp = await self._pools[0].get(self.base_url + "/v1/models")
                if resp.status_code in (404, 405, 501):  # no such endpoint
                    return
                listed = [m["id"] for m in resp.json().get("data") or ()]
            except (httpx.HTTPError, ValueError, LookupError, TypeError, AttributeError):
                listed = []
            if listed:
                self.model = self.model or listed[0]
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.base_url} listed no model in {timeout_s:g} s")
            await asyncio.sleep(0.2)

    async def send(self, request: TurnRequest) -> TurnRecord:
        rec = TurnRecord(request.conversation_id, request.turn_index)
        body: dict = {"model": self.model, "max_tokens": request.max_tokens,
                      "temperature": self.temperature, "stream": True,
                      "stream_options": {"include_usage": True}}
        if request.prompt_token_ids is not None:
            path = "/v1/completions"
            body["prompt"] = (" ".join(map(str, request.prompt_token_ids))
                              if self.text_token_ids else list(request.prompt_token_ids))
        else:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": r, "content": c} for r, c in request.messages or ()]
        clock = _Clock()
        usage: dict = {}
        chunks = 0
        complete = False
        try:
            async with next(self._next_pool).stream("POST", self.base_url + path,
                                                    json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:300]
                    clock.fill(rec)
                    rec.status, rec.error = f"HTTP {resp.status_code}", text
                    return rec
                # Server-sent events parsed by httpx-sse (multi-line data, comments and
                # keep-alives as the SSE specification has them), not by hand.
                async for sse in EventSource(resp).aiter_sse():
                    if sse.data == "[DONE]":
                        complete = True
                        break
                    event = json.loads(sse.data)
                    if event.get("usage"):
                        usage = event["usage"]
                    # A prefixgate gateway names the serving worker in the finishing chunk.
                    rec.worker = event.get("prefixgate_worker") or rec.worker
                    for choice in event.get("choices") or ():
                        piece = (choice.get("delta") or {}).get("content") or choice.get("text")
                        if piece:
                            clock.chunk()
                            chunks += 1
                        complete = complete or bool(choice.get("finish_reason"))
                if not complete:
                    rec.status = "incomplete"
                    rec.error = (f"the stream ended after {chunks} content chunks without "
                                 "[DONE] or a finish reason")
        except httpx.TimeoutException as exc:
            rec.status, rec.error = "timeout", str(exc) or type(exc).__name__
        except httpx.HTTPError as exc:
            rec.status, rec.error = "connect error", str(exc) or type(exc).__name__
        except (json.JSONDecodeError, AttributeError) as exc:
            rec.status, rec.error = "bad response", str(exc)
        clock.fill(rec)
        rec.prompt_tokens = int(usage.get("prompt_tokens") or len(request.prompt_token_ids or ()))
        rec.completion_tokens = int(usage.get("completion_tokens") or chunks)
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0)
        return rec

    async def close(self) -> None:
        for pool in self._pools:
            await pool.aclose()
