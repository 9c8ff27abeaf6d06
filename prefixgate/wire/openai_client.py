"""A chat client of an OpenAI-compatible HTTP API (`prefixgate chat --http URL`).

Contract: `OpenAIChatClient(base_url, tls, token)` has ChatClient's (wire/client.py)
`wait_ready`, `turn` and `close`, so `prefixgate chat` holds the same conversation over
either front. A turn is one streamed `POST /v1/chat/completions` with
`stream_options.include_usage`; the conversation id goes as `prompt_cache_key` (the
gateway's affinity key), sampling as OpenAI's fields (`top_k`, `namespace`,
`context_overflow`, `shifted_reuse` as prefixgate's extensions, only when set).
`turn` returns a TurnResult: the reply, usage (cached tokens from
`prompt_tokens_details`), the finish reason and the time to first token and total
measured here, and the serving worker (the finishing chunk's `prefixgate_worker`: "-"
from a server that is not a prefixgate gateway). An error, as an
HTTP status or as the stream's error event, raises HTTPTurnError (status, message).
Server-sent events are read by httpx-sse.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence

from prefixgate.v1 import common_pb2
from prefixgate.wire import rpc
from prefixgate.wire.client import TurnResult
from prefixgate.wire.protocol import OVERFLOW_FROM_PROTO, SHIFTED_REUSE_FROM_PROTO


class HTTPTurnError(Exception):
    """A turn the server refused or failed: HTTP status (or the stream's error code)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


def request_body(messages: Sequence[tuple[str, str]], conversation_id: str, namespace: str,
                 sampling: common_pb2.SamplingParams | None, model: str) -> dict:
    """The /v1/chat/completions body of one turn (only the sampling fields that are set)."""
    body: dict = {"model": model, "messages": [{"role": r, "content": c} for r, c in messages],
                  "stream": True, "stream_options": {"include_usage": True}}
    if conversation_id:
        body["prompt_cache_key"] = conversation_id
    if namespace:
        body["namespace"] = namespace
    s = sampling or common_pb2.SamplingParams()
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if s.HasField(name):
            body[name] = getattr(s, name)
    body["stop"] = list(s.stop) or None
    if s.context_overflow:
        body["context_overflow"] = OVERFLOW_FROM_PROTO[s.context_overflow]
    if s.shifted_reuse:
        body["shifted_reuse"] = SHIFTED_REUSE_FROM_PROTO[s.shifted_reuse]
    return {k: v for k, v in body.items() if v is not None}


class OpenAIChatClient:
    def __init__(self, base_url: str, tls: rpc.TLSConfig | None = None,
                 token: str = "") -> None:
        import httpx

        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        verify: object = True
        cert = None
        if tls is not None and tls.enabled:
            verify = tls.ca_file or True
            if tls.cert_file:
                cert = (tls.cert_file, tls.key_file)
        self.http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {token}"} if token else {}, verify=verify,
            cert=cert, timeout=httpx.Timeout(None, connect=10.0))
        self.model = ""  # the served model, learnt by wait_ready

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until GET /v1/models answers; TimeoutError after `timeout_s`."""
        import asyncio

        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = await self.http.get(self.base_url + "/v1/models", timeout=2.0)
                if reply.status_code == 200:
                    self.model = reply.json()["data"][0]["id"]
                    return
                if reply.status_code in (401, 403):
                    raise HTTPTurnError(str(reply.status_code), _message(reply.text))
            except httpx.HTTPError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from {self.base_url}/v1/models")
            await asyncio.sleep(0.2)

    async def turn(self, messages: Sequence[tuple[str, str]] | None = None, *,
                   conversation_id: str = "", namespace: str = "",
                   sampling: common_pb2.SamplingParams | None = None,
                   timeout_s: float | None = None,
                   on_text: Callable[[str], None] | None = None) -> TurnResult:
        from httpx_sse import EventSource

        body = request_body(messages or (), conversation_id, namespace, sampling, self.model)
        result = TurnResult(worker_id="-")
        start = time.monotonic()
        async with self.http.stream("POST", self.base_url + "/v1/chat/completions",
                                    json=body, timeout=timeout_s) as reply:
            if reply.status_code != 200:
                raise HTTPTurnError(str(reply.status_code), _message(
                    (await reply.aread()).decode(errors="replace")))
            async for event in EventSource(reply).aiter_sse():
                if event.data == "[DONE]":
                    break
                doc = json.loads(event.data)
                if "error" in doc:
                    error = doc["error"]
                    raise HTTPTurnError(str(error.get("code")), str(error.get("message")))
                for choice in doc.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text:
                        if not result.client_ttft_ms:
                            result.client_ttft_ms = (time.monotonic() - start) * 1e3
                        result.text += text
                        if on_text is not None:
                            on_text(text)
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                result.worker_id = doc.get("prefixgate_worker") or result.worker_id
                usage = doc.get("usage")
                if usage:
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.completion_tokens = usage["completion_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0)
        result.total_ms = (time.monotonic() - start) * 1e3
        result.ttft_ms = result.client_ttft_ms or result.total_ms
        return result

    async def close(self) -> None:
        await self.http.aclose()


def _message(text: str) -> str:
    """The message of an OpenAI error object, else the text itself (shortened)."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:300]
