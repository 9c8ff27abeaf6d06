"""The emulated worker's minimal HTTP face, for HTTP routers (sglang-router) in front of the
same emulated workers the gateway uses (`prefixgate worker --emulate --http-port N`).

Contract: `serve_http(engine, host, port, model, stop, started)` answers HTTP/1.1 (h11) on
`host:port` until `stop` is set:

  GET  /health, /health_generate      200 (the worker is up)
  GET  /get_model_info, /get_server_info, /v1/models   a little JSON naming `model`
  POST /v1/completions                OpenAI completions, streamed (SSE) or not. `prompt`
                                      is a list of token ids, or a string of token ids
                                      separated by spaces (routers that route on text
                                      see the same prefix structure as the ids);
                                      `max_tokens` caps the reply. The final usage has
                                      prompt_tokens_details.cached_tokens and the
                                      worker-side TTFT (`ttft_ms`, `queue_ms`; emulated).

Requests go to the same `EmulatedEngine` (namespace ""), so hit and timings are counted as
for gRPC requests. Anything else is 404. A malformed body is 400 with a message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
import warnings

import h11
import numpy as np

from prefixgate.wire.protocol import SamplingConfig
from prefixgate.workerapi.api import Engine, FinalEvent, Request, TokenEvent

log = logging.getLogger(__name__)

_MAX_BODY_BYTES = 16 << 20


class BadRequest(ValueError):
    pass


def _prompt_ids(prompt: object) -> tuple[int, ...]:
    if isinstance(prompt, str):
        # numpy's parser: a 15k-token prompt in ~0.8 ms, where int() per token took ~5 ms
        # of the worker's event loop (the HTTP routers' turns queued behind it, the
        # gateway's packed ids did not: an unequal harness).
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # text it cannot read to its end
            try:
                parsed = np.fromstring(prompt, dtype=np.int64, sep=" ")
            except (ValueError, DeprecationWarning):
                raise BadRequest("prompt: a string prompt must be token ids separated by "
                                 "spaces") from None
        if parsed.size and int(parsed.max()) >= 2**32:
            raise BadRequest("prompt: token ids must be below 2**32")
        ids = tuple(parsed.tolist())
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = tuple(prompt)
    else:
        raise BadRequest("prompt: give a list of token ids or a string of them")
    if not ids or min(ids) < 0:
        raise BadRequest("prompt: needs at least one token id, none negative")
    return ids


async def serve_http(engine: Engine, host: str, port: int, model: str, stop: asyncio.Event,
                     started: asyncio.Future[int] | None = None) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _connection(engine, model, reader, writer)
        except (ConnectionError, h11.ProtocolError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    server = await asyncio.start_server(handle, host, port)
    bound = server.sockets[0].getsockname()[1]
    log.info("emulated worker HTTP on %s:%d", host, bound)
    if started is not None:
        started.set_result(bound)
    async with server:
        await stop.wait()


async def _connection(engine: Engine, model: str, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
    conn = h11.Connection(h11.SERVER)
    while True:
        request, body = None, bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                conn.receive_data(data)
                if not data and conn.their_state is not h11.DONE:
                    return
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > _MAX_BODY_BYTES:
                    raise h11.ProtocolError("body too large")
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                return
        await _respond(engine, model, conn, writer, request, bytes(body))
        if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
            return
        conn.start_next_cycle()


async def _send(conn: h11.Connection, writer: asyncio.StreamWriter, *events) -> None:
    for ev in events:
        data = conn.send(ev)
        if data:
            writer.write(data)
    await writer.drain()


async def _json(conn, writer, status: int, obj: dict) -> None:
    body = json.dumps(obj).encode()
    await _send(conn, writer, h11.Response(status_code=status, headers=[
        ("content-type", "application/json"), ("content-length", str(len(body)))]),
        h11.Data(data=body), h11.EndOfMessage())


async def _respond(engine: Engine, model: str, conn: h11.Connection,
                   writer: asyncio.StreamWriter, request: h11.Request, body: bytes) -> None:
    path = request.target.decode().split("?")[0]
    method = request.method.decode()
    if method == "GET" and path in ("/health", "/health_generate"):
        return await _json(conn, writer, 200, {"status": "ok"})
    if method == "GET" and path in ("/get_model_info", "/get_server_info"):
        return await _json(conn, writer, 200, {"model_path": model, "is_generation": True,
                                                "tokenizer_path": model})
    if method == "GET" and path == "/v1/models":
        return await _json(conn, writer, 200, {"object": "list", "data": [
            {"id": model, "object": "model", "owned_by": "prefixgate"}]})
    if method != "POST" or path != "/v1/completions":
        return await _json(conn, writer, 404, {"error": f"{method} {path} is not served here"})
    try:
        req = json.loads(body)
        ids = _prompt_ids(req.get("prompt"))
        max_tokens = int(req.get("max_tokens") or 16)
        if max_tokens < 1:
            raise BadRequest("max_tokens must be >= 1")
    except (BadRequest, ValueError, TypeError, AttributeError) as exc:
        return await _json(conn, writer, 400, {"error": str(exc)})
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    rid = uuid.uuid4().hex
    engine.submit(Request(rid, ids, SamplingConfig(max_tokens=max_tokens)),
                  lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
    stream = bool(req.get("stream"))
    text, final = "", None
    try:
        if stream:
            await _send(conn, writer, h11.Response(status_code=200, headers=[
                ("content-type", "text/event-stream"), ("cache-control", "no-cache")]))
        while final is None:
            ev = await events.get()
            if isinstance(ev, TokenEvent):
                text += ev.text
                if stream:
                    chunk = {"id": rid, "object": "text_completion", "model": model,
                             "choices": [{"index": 0, "text": ev.text, "finish_reason": None}]}
                    await _send(conn, writer, h11.Data(data=f"data: {json.dumps(chunk)}\n\n"
                                                       .encode()))
            elif isinstance(ev, FinalEvent):
                final = ev
    except (ConnectionError, asyncio.CancelledError):
        engine.cancel(rid)
        raise
    usage = {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
             "total_tokens": final.prompt_tokens + final.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
             "ttft_ms": final.ttft_ms, "queue_ms": final.queue_ms}
    reason = final.finish_reason.value
    if stream:
        last = {"id": rid, "object": "text_completion", "model": model,
                "choices": [{"index": 0, "text": "", "finish_reason": reason}], "usage": usage}
        await _send(conn, writer, h11.Data(data=f"data: {json.dumps(last)}\n\n".encode()),
                    h11.Data(data=b"data: [DONE]\n\n"), h11.EndOfMessage())
    else:
        await _json(conn, writer, 200, {
            "id": rid, "object": "text_completion", "model": model, "usage": usage,
            "choices": [{"index": 0, "text": text, "finish_reason": reason}]})
