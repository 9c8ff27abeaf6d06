"""Faults: nothing is read, parsed or tokenized before the credential is checked, and
what token holders can make the gateway tokenize is bounded (a real `prefixgate gateway`
process with --tokens-file and its HTTP front; real gRPC and HTTP on loopback;
tiny-random, whose byte-level tokenizer holds ~58 MB while it encodes a 500 KB text).

Before: /v1/completions tokenized a text prompt before checking the bearer token, so 64
unauthenticated 500 KB requests took the gateway to 369 MB here; a gRPC message was parsed
before its token was looked at.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import aiohttp
import grpc
import pytest

from prefixgate.launch.processes import ProcessGroup
from prefixgate.security.auth import hash_token, new_token
from prefixgate.wire.rpc import free_port
from tests.faults.fleet import report, rss_mb
from tests.helpers import REPO, cli_env, wait_for

TOKEN = new_token()
PROMPT = " ".join("lorem ipsum dolor sit amet" for _ in range(19_000))  # ~500 KB
NUM_REQUESTS = 64


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> tuple[subprocess.Popen, int, int]:
    d: Path = tmp_path_factory.mktemp("authfirst")
    (d / "tokens").write_text(f"{hash_token(TOKEN)} acme\n")
    port, http_port = free_port(), free_port()
    group = ProcessGroup(d, env=cli_env(PREFIXGATE_CACHE_DIR=str(d / "cache"),
                                        PREFIXGATE_MODEL="tiny-random",
                                        PREFIXGATE_LOG_LEVEL="WARNING"), cwd=REPO)
    proc = group.start_prefixgate(
        "gateway", "gateway", "--port", str(port), "--http-port", str(http_port),
        "--tokens-file", str(d / "tokens"), "--tokenize-threads", "1",
        "--max-tokenize-waiting", "1", "--worker", f"127.0.0.1:{free_port()}")

    def up() -> bool:  # the HTTP front listens last
        try:
            socket.create_connection(("127.0.0.1", http_port), timeout=1).close()
            return True
        except OSError:
            return False
    try:
        wait_for(up, timeout=120, what="the gateway to listen")
        yield proc, port, http_port
    finally:
        group.signal("gateway", signal.SIGKILL, 10)


class _PeakRSS:
    """The largest RSS of `pid` seen while the block runs (sampled every 10 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._done = pid, 0.0, threading.Event()

    def __enter__(self) -> _PeakRSS:
        def sample() -> None:
            while not self._done.is_set():
                self.peak = max(self.peak, rss_mb(self.pid))
                time.sleep(0.01)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.3)  # anything still growing after the answers
        self._done.set()
        self._thread.join()


async def _post_all(url: str, body: dict, headers: dict, n: int) -> list[int]:
    async with aiohttp.ClientSession() as session:
        async def one() -> int:
            async with session.post(url, json=body, headers=headers) as r:
                await r.read()
                return r.status
        return list(await asyncio.gather(*(one() for _ in range(n))))


def test_unauthenticated_requests_cost_no_parsing_or_tokenizing(gateway) -> None:
    proc, port, http_port = gateway
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    idle = rss_mb(proc.pid)
    body = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 1}
    with _PeakRSS(proc.pid) as rss:
        statuses = asyncio.run(_post_all(url, body, {}, NUM_REQUESTS))
        wrong = asyncio.run(_post_all(url, body, {"Authorization": "Bearer pg_wrong"},
                                      NUM_REQUESTS))
    assert statuses == [401] * NUM_REQUESTS and wrong == [401] * NUM_REQUESTS
    growth = rss.peak - idle
    report("unauthenticated_500kb_http", requests=2 * NUM_REQUESTS, statuses={"401": 128},
           idle_rss_mib=round(idle, 1), peak_rss_growth_mib=round(growth, 1))
    assert growth < 100, f"the gateway grew {growth:.0f} MiB on unauthenticated requests"
    # Not even the JSON is parsed: a body that is not JSON is 401 too, not 400.
    async def garbage() -> int:
        async with aiohttp.ClientSession() as s, s.post(url, data=b"\xff{") as r:
            return r.status
    assert asyncio.run(garbage()) == 401
    # gRPC: a message that does not parse, sent without a token, is UNAUTHENTICATED (the
    # guard runs before parsing), not INVALID_ARGUMENT.
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        chat = ch.unary_stream("/prefixgate.v1.ChatService/Chat")
        with pytest.raises(grpc.RpcError) as exc:
            list(chat(b"\x0a\x05\xff\xfe\xfd\xfc\xfb", timeout=10))
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_token_holders_long_prompts_wait_in_a_bounded_line(gateway) -> None:
    """With one tokenizer thread and one waiting place, a burst of long text prompts from
    a token holder is refused with 429 beyond the two, never queued without bound (each
    admitted prompt is tokenized, then refused: 500k byte tokens are over
    --max-prompt-tokens)."""
    proc, _, http_port = gateway
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    idle = rss_mb(proc.pid)
    body = {"model": "tiny-random", "prompt": PROMPT, "max_tokens": 1}
    with _PeakRSS(proc.pid) as rss:
        statuses = asyncio.run(_post_all(url, body, {"Authorization": f"Bearer {TOKEN}"}, 16))
    counts = {s: statuses.count(s) for s in set(statuses)}
    report("token_holder_500kb_burst_http", requests=16, statuses=counts,
           peak_rss_growth_mib=round(rss.peak - idle, 1))
    assert set(counts) <= {400, 429} and counts.get(429, 0) >= 1, counts
    assert counts.get(400, 0) >= 2, counts  # the bounded line did admit some


def test_token_holders_long_grpc_prompts_wait_in_a_bounded_line(gateway) -> None:
    """The same bound on gRPC: 16 concurrent 500 KB chat messages from a token holder; two
    are tokenized (then refused: over --max-prompt-tokens), the rest RESOURCE_EXHAUSTED at
    once, and the gateway's memory grows by about one tokenization."""
    from prefixgate.v1 import chat_pb2, chat_pb2_grpc

    proc, port, _ = gateway
    idle = rss_mb(proc.pid)
    request = chat_pb2.ChatRequest()
    request.messages.messages.add(role="user", content=PROMPT)

    def one(_: int) -> str:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            try:
                list(chat_pb2_grpc.ChatServiceStub(ch).Chat(
                    request, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=60))
                return "OK"
            except grpc.RpcError as exc:
                return exc.code().name

    import concurrent.futures

    with _PeakRSS(proc.pid) as rss, concurrent.futures.ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(one, range(16)))
    counts = {c: codes.count(c) for c in set(codes)}
    report("token_holder_500kb_burst_grpc", requests=16, statuses=counts,
           peak_rss_growth_mib=round(rss.peak - idle, 1))
    assert set(counts) <= {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}, counts
    assert counts.get("RESOURCE_EXHAUSTED", 0) >= 1 and counts.get("INVALID_ARGUMENT", 0) >= 2
