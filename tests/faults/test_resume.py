"""Mid-stream resume (gateway/resume.py) against real processes: a worker killed while it
streams 10 long greedy replies; every stream completes on the other worker, token for token
what an uninterrupted run gives, with no client error; seeded sampled replies likewise (the
continuation's random stream starts past the tokens already sent, never replaying them);
the same over HTTP (SSE), whose finishing chunk says the reply was resumed. And the
opt-out: a client that asks for no resume gets UNAVAILABLE ("retry is safe") as before.

The streams are placed on the worker to kill by the `session` policy (a rendezvous hash of
the conversation id): conversation ids that rank fw0 first. The continuation carries no
conversation id, so it goes to the least-loaded healthy worker: fw1.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
import xxhash

from prefixgate.launch.redis_server import RedisServer
from prefixgate.v1 import chat_pb2_grpc
from prefixgate.wire.rpc import free_port
from tests.faults.fleet import Fleet, chat_request, concurrently, prompt_for, report, turn
from tests.helpers import wait_for

DEADLINE_S = 90.0
NUM_STREAMS = 10
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def session_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if not RedisServer().available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    f = Fleet(tmp_path_factory.mktemp("resume"))
    try:
        f.start_redis()
        f.start_worker("fw0", wait=False)
        f.start_worker("fw1", wait=False)
        f.http_port = free_port()
        f.start_gateway("--policy", "session", "--http-port", str(f.http_port))
        f.wait_workers(2, timeout_s=180)
        yield f
    finally:
        f.stop()


def _on(worker_id: str, n: int) -> list[str]:
    """n conversation ids the session policy sends to `worker_id` (of fw0, fw1)."""
    def rank(conv: str, wid: str) -> int:  # routing._rendezvous
        return xxhash.xxh3_64_intdigest(f"{conv}\0{wid}".encode())
    other = "fw1" if worker_id == "fw0" else "fw0"
    return [c for c in (f"resume-{i}" for i in range(10 * n))
            if rank(c, worker_id) > rank(c, other)][:n]


class _Stream:
    """One Chat call's token ids, text, final and status, as the client saw them."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.final = None
        self.code = "OK"
        self.details = ""
        self.resumed: int | None = None  # HTTP: the finishing chunk's prefixgate_resumed


def _run(fleet: Fleet, conv: str, prompt: list[int], progress: list[int] | None = None,
         i: int = 0, sampling: dict | None = None, **extra) -> _Stream:
    out = _Stream()
    req = chat_request(conv, prompt, MAX_TOKENS, temperature=0.0)
    for k, v in (sampling or {}).items():
        setattr(req.sampling, k, v)
    for k, v in extra.items():
        setattr(req, k, v)
    try:
        with grpc.insecure_channel(fleet.address) as ch:
            for ev in chat_pb2_grpc.ChatServiceStub(ch).Chat(req, timeout=DEADLINE_S):
                if ev.HasField("delta"):
                    out.token_ids.extend(ev.delta.token_ids)
                    out.text += ev.delta.text
                    if progress is not None:
                        progress[i] = len(out.token_ids)
                else:
                    out.final = ev.final
    except grpc.RpcError as exc:
        out.code, out.details = exc.code().name, exc.details() or ""
    return out


def _run_http(fleet: Fleet, conv: str, prompt: list[int], progress: list[int] | None = None,
              i: int = 0, **extra) -> _Stream:
    """One streamed /v1/completions call (token-id prompt), as an OpenAI client sees it:
    its text deltas, and an error event or a failed status as the code."""
    out = _Stream()
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
            "prompt_cache_key": conv, **extra}
    url = f"http://127.0.0.1:{fleet.http_port}/v1/completions"
    with httpx.stream("POST", url, json=body, timeout=DEADLINE_S) as r:
        if r.status_code != 200:
            out.code, out.details = f"HTTP {r.status_code}", r.read().decode()
            return out
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.code, out.details = "error", event["error"]["message"]
                continue
            for choice in event.get("choices", ()):
                out.text += choice.get("text") or ""
                out.token_ids.append(len(out.text))  # progress only: chunks seen
                if choice.get("finish_reason"):
                    out.final = choice["finish_reason"]
                    out.resumed = event.get("prefixgate_resumed")
            if progress is not None:
                progress[i] = len(out.token_ids)
    return out


def _routed_to(fleet: Fleet, convs: list[str]) -> set[str]:
    """The workers one-token turns of `convs` are served by now."""
    with grpc.insecure_channel(fleet.address) as ch:
        stub = chat_pb2_grpc.ChatServiceStub(ch)
        return {turn(stub, chat_request(c, prompt_for(999, 8), 1), 30).worker_id
                for c in convs}


def _kill_mid_stream(fleet: Fleet, convs: list[str], prompts: list[list[int]],
                     run=_run, **extra) -> tuple[list[_Stream], list[int]]:
    """Run the streams; SIGKILL fw0 once every one has tokens and none has ended; restart
    it after. Returns the streams and the tokens each had when the kill came."""
    # Every stream must start on fw0: after a restart the gateway lists fw0 again only once
    # its probe reached the new process, so wait until these conversations route there.
    wait_for(lambda: _routed_to(fleet, convs) == {"fw0"}, timeout=60,
             what="the conversations to route to fw0")
    progress = [0] * len(convs)
    results: list = []
    thread = threading.Thread(target=lambda: results.extend(concurrently(
        lambda i: run(fleet, convs[i], prompts[i], progress, i, **extra),
        [(i,) for i in range(len(convs))], DEADLINE_S + 10)), daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while min(progress) < 8 and time.monotonic() < deadline:
        time.sleep(0.005)
    at_kill = list(progress)
    fleet.signal_worker("fw0", signal.SIGKILL)
    thread.join(DEADLINE_S + 15)
    fleet.start_worker("fw0")
    fleet.wait_workers(2)
    return results, at_kill


def test_greedy_streams_continue_on_another_worker_token_for_token(
        session_fleet: Fleet) -> None:
    fleet = session_fleet
    convs = _on("fw0", NUM_STREAMS)
    prompts = [prompt_for(i, 48) for i in range(NUM_STREAMS)]
    # The uninterrupted run, on fw0 too (the session policy places them alike).
    reference = concurrently(lambda i: _run(fleet, convs[i], prompts[i]),
                             [(i,) for i in range(NUM_STREAMS)], DEADLINE_S)
    assert all(r.code == "OK" and r.final.worker_id == "fw0" for r in reference), \
        [(r.code, r.details) for r in reference]
    streams, at_kill = _kill_mid_stream(fleet, convs, prompts)
    report("worker SIGKILL mid-stream, resume", streams=len(streams),
           ok=sum(s.code == "OK" for s in streams),
           resumed=sum(bool(s.final and s.final.num_resumes) for s in streams),
           identical=sum(s.token_ids == r.token_ids for s, r in zip(streams, reference, strict=True)),
           tokens_at_kill=at_kill, reply_tokens=[len(r.token_ids) for r in reference])
    assert [s.code for s in streams] == ["OK"] * NUM_STREAMS, \
        [(s.code, s.details) for s in streams]
    # Killed mid-generation: every stream had tokens, and (most) were not done.
    assert all(n > 0 for n in at_kill)
    resumed = [s for s in streams if s.final.num_resumes]
    assert len(resumed) >= NUM_STREAMS // 2, at_kill
    for s, r in zip(streams, reference, strict=True):
        assert s.token_ids == r.token_ids  # nothing missing, nothing repeated
        assert s.text == r.text
        assert s.final.usage.completion_tokens == r.final.usage.completion_tokens
        assert s.final.usage.prompt_tokens == r.final.usage.prompt_tokens
        assert s.final.finish_reason == r.final.finish_reason
    assert all(s.final.worker_id == "fw1" for s in resumed)


def test_the_sampler_skips_the_draws_of_the_tokens_sent() -> None:
    """The worker's half of a seeded resume: a Sampler told `seed_offset_tokens` = k draws
    the tokens an uninterrupted one draws from its (k+1)-th on; without it, the stream
    restarts (the draws already spent come again)."""
    import torch

    from prefixgate.wire.protocol import SamplingConfig
    from prefixgate.worker.sampling import Sampler

    torch.manual_seed(0)
    logits = [torch.randn(300) for _ in range(40)]
    params = dict(temperature=1.0, seed=7, top_k=50, top_p=0.9)
    whole = Sampler(SamplingConfig(**params))
    tokens = [whole.sample(x) for x in logits]
    for sent in (1, 15, 39):
        resumed = Sampler(SamplingConfig(**params, seed_offset_tokens=sent))
        assert [resumed.sample(x) for x in logits[sent:]] == tokens[sent:]
    restarted = Sampler(SamplingConfig(**params))
    assert [restarted.sample(x) for x in logits[15:]] != tokens[15:]


def test_seeded_streams_continue_their_random_stream(session_fleet: Fleet) -> None:
    """Seeded sampling (temperature 1): the resumed reply is the uninterrupted one, token
    for token; the continuation does not replay the seed's first draws."""
    fleet = session_fleet
    n = 4
    convs = _on("fw0", n)
    prompts = [prompt_for(400 + i, 48) for i in range(n)]
    sampling = {"temperature": 1.0, "seed": 1234}
    reference = concurrently(lambda i: _run(fleet, convs[i], prompts[i], sampling=sampling),
                             [(i,) for i in range(n)], DEADLINE_S)
    assert all(r.code == "OK" and r.final.worker_id == "fw0" for r in reference), \
        [(r.code, r.details) for r in reference]
    streams, at_kill = _kill_mid_stream(fleet, convs, prompts, sampling=sampling)
    report("worker SIGKILL mid-stream, seeded resume", streams=len(streams),
           resumed=sum(bool(s.final and s.final.num_resumes) for s in streams),
           identical=sum(s.token_ids == r.token_ids for s, r in zip(streams, reference,
                                                                    strict=True)),
           tokens_at_kill=at_kill)
    assert [s.code for s in streams] == ["OK"] * n, [(s.code, s.details) for s in streams]
    assert any(s.final.num_resumes for s in streams), at_kill
    for s, r in zip(streams, reference, strict=True):
        assert s.token_ids == r.token_ids


def test_a_client_that_opts_out_sees_the_loss(session_fleet: Fleet) -> None:
    fleet = session_fleet
    convs = _on("fw0", 3)
    prompts = [prompt_for(100 + i, 48) for i in range(3)]
    streams, at_kill = _kill_mid_stream(fleet, convs, prompts, no_resume=True)
    report("worker SIGKILL mid-stream, resume opted out",
           codes=[s.code for s in streams], tokens_at_kill=at_kill)
    for s in streams:
        if s.code != "OK":  # a stream that had finished before the kill is fine
            assert s.code == "UNAVAILABLE" and "retry" in s.details, (s.code, s.details)
    assert any(s.code == "UNAVAILABLE" for s in streams)


def test_http_streams_continue_too(session_fleet: Fleet) -> None:
    """The same over the OpenAI-compatible HTTP front (one turn core): the SSE stream of
    every completion goes on, its text that of an uninterrupted run, no error event; with
    `"resume": false` the stream ends with an error event saying a retry is safe."""
    fleet = session_fleet
    convs = _on("fw0", 4)
    prompts = [prompt_for(200 + i, 48) for i in range(4)]
    reference = [_run_http(fleet, c, p) for c, p in zip(convs, prompts, strict=True)]
    assert all(r.code == "OK" and r.final for r in reference), [r.details for r in reference]
    streams, at_kill = _kill_mid_stream(fleet, convs, prompts, run=_run_http)
    report("worker SIGKILL mid-stream, resume over HTTP", codes=[s.code for s in streams],
           identical=sum(s.text == r.text for s, r in zip(streams, reference, strict=True)),
           chunks_at_kill=at_kill)
    assert [s.code for s in streams] == ["OK"] * 4, [s.details for s in streams]
    assert [s.text for s in streams] == [r.text for r in reference]
    assert [s.final for s in streams] == [r.final for r in reference]
    # The finishing chunk says whether the reply was resumed (gateway/http.py).
    assert [r.resumed for r in reference] == [0] * 4
    assert all(s.resumed in (0, 1) for s in streams) and any(s.resumed for s in streams)
    opted, _ = _kill_mid_stream(fleet, convs[:2], [prompt_for(300 + i, 48) for i in range(2)],
                                run=_run_http, resume=False)
    assert any(s.code == "error" for s in opted), [(s.code, s.details) for s in opted]
    assert all("retry" in s.details for s in opted if s.code == "error")
