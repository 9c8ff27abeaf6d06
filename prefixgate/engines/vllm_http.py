"""HTTP client of one vLLM OpenAI-compatible server: completions, tokenizer, metrics.

Contract
--------
`VLLMClient(base_url)` holds one pooled aiohttp session (HTTP/1.1 keep-alive, no limit
on connections: each streaming turn holds one) for the server at `base_url` (e.g.
``http://vllm-0:8000``). Every call raises `VLLMError(code, message)` on failure, `code`
the gRPC status the gateway answers with:
  UNAVAILABLE        the server cannot be reached, closed the connection, or says 503
                     (down, restarting, overloaded): the turn may go to another worker;
  INVALID_ARGUMENT   400 / 422: vLLM refused the request itself (message relayed);
  DEADLINE_EXCEEDED  the call's timeout passed;
  INTERNAL           any other status (500: vLLM failed).
Calls:
  models()                     GET /v1/models: the served models' entries
  tokenize(body)               POST /tokenize: token ids (prompt or chat messages)
  metrics()                    GET /metrics: `VLLMMetrics` (running / waiting requests,
                               KV usage, and the cache configuration: block size, blocks,
                               whether prefix caching is on)
  completions(body, timeout)   POST /v1/completions with `stream: true`: an async
                               iterator of the server-sent JSON chunks (until [DONE]).
                               Closing the iterator early closes the connection, which
                               makes vLLM abort the request.
  reset_prefix_cache()         POST /reset_prefix_cache (vLLM serves it only in its dev
                               mode): False when the server does not offer it.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp
import grpc

__all__ = ["VLLMClient", "VLLMError", "VLLMMetrics", "parse_metrics"]

_JSON = {"Content-Type": "application/json"}


class VLLMError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class VLLMMetrics:
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    block_size: int = 0  # tokens per vLLM block (0: not reported)
    num_blocks: int = 0  # KV blocks (0: not reported)
    prefix_caching: bool | None = None  # None: not reported
    start_time: float = 0.0  # the server process's start (Unix seconds; 0: not reported)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_size * self.num_blocks


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_WANTED = ("process_start_time_seconds", "vllm:num_requests_running", "vllm:num_requests_waiting{", "vllm:num_requests_waiting ",
           "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:cache_config_info")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> VLLMMetrics:
    """The figures routing needs from vLLM's Prometheus text (summed over its engines), and
    its process's start time (a restart empties its cache)."""
    running = waiting = 0.0
    usage: list[float] = []
    block_size = num_blocks = 0
    caching: bool | None = None
    start = 0.0
    for line in text.splitlines():
        # vLLM serves ~650 lines (histograms mostly); a C-level prefix test skips them
        # (0.1 ms a poll instead of 1 ms with the pattern on every line).
        if not line.startswith(_WANTED):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        try:
            v = float(value)
        except ValueError:
            continue
        if name == "process_start_time_seconds":
            start = v
        elif name == "vllm:num_requests_running":
            running += v
        elif name == "vllm:num_requests_waiting":
            waiting += v
        elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            usage.append(v)
        elif name == "vllm:cache_config_info":
            info = dict(_LABEL.findall(labels))
            block_size = int(info.get("block_size") or 0)
            num_blocks = int(info.get("num_gpu_blocks") or 0)
            if "enable_prefix_caching" in info:
                caching = info["enable_prefix_caching"].lower() == "true"
    return VLLMMetrics(int(running), int(waiting), max(usage) if usage else 0.0, block_size,
                       num_blocks, caching, start)


class VLLMClient:
    def __init__(self, base_url: str, connect_timeout_s: float = 2.0,
                 api_key: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # limit=0: no cap on connections (a streaming turn holds one for its reply);
            # kept alive between turns, so a turn costs no TCP handshake.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _timeout(self, total_s: float | None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total_s, sock_connect=self.connect_timeout_s)

    async def _json(self, method: str, path: str, body: dict | None = None,
                    timeout_s: float = 5.0) -> dict:
        try:
            async with self.session.request(method, self.base_url + path, json=body,
                                            timeout=self._timeout(timeout_s)) as resp:
                await _raise_for_status(resp)
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError) as exc:
            raise _transport(self.base_url, exc) from None
        except TimeoutError:
            raise VLLMError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"vLLM at {self.base_url} did not answer {path} within "
                            f"{timeout_s:.1f} s") from None

    async def models(self) -> list[dict]:
        return list((await self._json("GET", "/v1/models")).get("data") or [])

    async def tokenize(self, body: dict) -> list[int]:
        return list((await self._json("POST", "/tokenize", body)).get("tokens") or [])

    async def metrics(self, timeout_s: float = 2.0) -> VLLMMetrics:
        try:
            async with self.session.get(self.base_url + "/metrics",
                                        timeout=self._timeout(timeout_s)) as resp:
                await _raise_for_status(resp)
                return parse_metrics(await resp.text())
        except (aiohttp.ClientError, OSError) as exc:
            raise _transport(self.base_url, exc) from None
        except TimeoutError:
            raise VLLMError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"vLLM at {self.base_url} did not answer /metrics") from None

    async def reset_prefix_cache(self) -> bool:
        try:
            await self._json("POST", "/reset_prefix_cache")
        except VLLMError as exc:
            if "404" in exc.message or "405" in exc.message:
                return False
            raise
        return True

    async def completions(self, body: dict, timeout_s: float | None,
                          headers: Sequence[tuple[str, str]] = ()) -> AsyncIterator[dict]:
        """The chunks of a streamed /v1/completions; `headers` go with the request (the
        caller's W3C trace context: a vLLM with --otlp-traces-endpoint continues it)."""
        payload = json.dumps(body, separators=(",", ":")).encode()
        sent = {**_JSON, **dict(headers)} if headers else _JSON
        for attempt in (0, 1):
            answered = False
            try:
                async with self.session.post(
                        self.base_url + "/v1/completions", data=payload,
                        headers=sent, timeout=self._timeout(timeout_s)) as resp:
                    answered = True
                    await _raise_for_status(resp)
                    async for line in resp.content:
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            return
                        chunk = json.loads(data)
                        if "error" in chunk and "choices" not in chunk:
                            err = chunk["error"]
                            raise VLLMError(grpc.StatusCode.INTERNAL, "vLLM failed the request: "
                                            + str(err.get("message") if isinstance(err, dict)
                                                  else err))
                        yield chunk
                return
            except aiohttp.ServerDisconnectedError as exc:
                # A kept-alive connection the server closed as we reused it (uvicorn drops
                # idle ones after 5 s): nothing was answered, so vLLM never ran the
                # request; one fresh connection, not a worker marked down.
                if attempt or answered:
                    raise _transport(self.base_url, exc) from None
            except (aiohttp.ClientError, OSError) as exc:
                raise _transport(self.base_url, exc) from None
            except (TimeoutError, asyncio.TimeoutError):
                raise VLLMError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the deadline passed before vLLM finished the reply") from None


def _transport(base_url: str, exc: BaseException) -> VLLMError:
    return VLLMError(grpc.StatusCode.UNAVAILABLE,
                     f"vLLM at {base_url} is unreachable: {type(exc).__name__}: {exc}")


async def _raise_for_status(resp: aiohttp.ClientResponse) -> None:
    if resp.status < 400:
        return
    text = (await resp.text())[:2000]
    message = text
    try:
        body = json.loads(text)
        err = body.get("error", body) if isinstance(body, dict) else body
        message = str(err.get("message") or err.get("detail") or text) \
            if isinstance(err, dict) else str(err)
    except ValueError:
        pass
    if resp.status in (400, 422):
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif resp.status in (502, 503, 504):
        code = grpc.StatusCode.UNAVAILABLE
    else:
        code = grpc.StatusCode.INTERNAL
    raise VLLMError(code, f"vLLM answered {resp.status} {resp.reason}: {message}")
