"""Hypothesis fuzz of ChatService (through the gateway) and WorkerService (straight to a
worker) on a fleet of processes: every field from its whole wire range (NaN and infinite
floats, ids up to 2**32 - 1, unknown enum values, invalid UTF-8 in packed bytes, empty
and oversized lists, arbitrary unicode). Asserted for every case: no INTERNAL or UNKNOWN,
no hang past the deadline; at the end: every process alive, memory bounded.

Cases: $PREFIXGATE_FUZZ_CASES per service (default 1500 each, 3000 in all, what CI runs);
the long run is `PREFIXGATE_FUZZ_CASES=50000 pytest tests/faults/test_fuzz.py` (100,000
in all; docs/reliability.md has its figures).
"""

from __future__ import annotations

import os
import struct
import time
from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from tests.faults.fleet import Fleet, report, rss_mb

CASES = int(os.environ.get("PREFIXGATE_FUZZ_CASES", "1500"))
DEADLINE_S = 30.0
FORBIDDEN = {"INTERNAL", "UNKNOWN", "HANG"}
# The suite's per-test timeout scaled to the cases (0.2 s each: ten times the loaded rate).
pytestmark = pytest.mark.timeout(max(600, int(CASES * 0.2)))
SETTINGS = settings(max_examples=CASES, deadline=None, database=None, derandomize=False,
                    suppress_health_check=list(HealthCheck))

u32 = st.integers(0, 2**32 - 1)
f32 = st.floats(width=32)
text = st.text(max_size=40) | st.text(max_size=400)


def mostly(sane: st.SearchStrategy, wild: st.SearchStrategy) -> st.SearchStrategy:
    """`sane` 9 times in 10, else `wild`: each field is usually valid, so a good share of
    cases is served (and exercises the engine) while every field is sometimes hostile."""
    return st.integers(0, 9).flatmap(lambda k: wild if k == 0 else sane)


@st.composite
def sampling(draw) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=draw(mostly(st.sampled_from([0.0, 0.7, 1.0]) | st.floats(0, 2), f32)),
        top_p=draw(mostly(st.sampled_from([0.0, 0.9, 1.0]) | st.floats(0, 1), f32)),
        top_k=draw(mostly(st.sampled_from([0, 1, 40]), u32)),
        n=draw(mostly(st.sampled_from([0, 1, 1, 1, 2, 3]), st.integers(0, 20) | u32)),
        context_overflow=draw(mostly(st.integers(0, 2), st.integers(0, 2**31 - 1))),
        shifted_reuse=draw(mostly(st.integers(0, 3), st.integers(0, 2**31 - 1))))
    # Mostly short replies (unset means up to 256 tokens: rare, to keep cases fast).
    max_tokens = draw(mostly(st.integers(1, 8), st.just(None) | st.integers(0, 20) | u32))
    if max_tokens is not None:
        msg.max_tokens = max_tokens
    seed = draw(st.none() | st.integers(0, 2**64 - 1))
    if seed is not None:
        msg.seed = seed
    msg.stop.extend(draw(mostly(st.lists(st.text(max_size=8), max_size=2),
                                st.lists(text, max_size=20))))
    msg.stop_token_ids.extend(draw(mostly(st.lists(st.integers(0, 300), max_size=2),
                                          st.lists(u32, max_size=400))))
    return msg


token_ids = mostly(st.lists(st.integers(0, 258), min_size=1, max_size=80),
                   st.lists(u32, max_size=20))
ROLES = ["system", "user", "assistant"]
messages = mostly(
    st.lists(st.tuples(st.sampled_from(ROLES), st.text(min_size=1, max_size=200)), max_size=5)
    .map(lambda ms: [*ms, ("user", "hello")]),
    st.lists(st.tuples(st.sampled_from(ROLES) | st.text(max_size=10), st.text(max_size=200)),
             max_size=6))


@st.composite
def chat_request(draw) -> chat_pb2.ChatRequest:
    req = chat_pb2.ChatRequest(conversation_id=draw(mostly(st.text(max_size=40), text)),
                               namespace=draw(mostly(st.sampled_from(["", "a", "b"]), text)),
                               model=draw(mostly(st.sampled_from(["", "tiny-random"]), text)),
                               sampling=draw(sampling()))
    which = draw(mostly(st.sampled_from(["messages", "ids", "packed"]), st.just("none")))
    if which == "messages":
        for r, c in draw(messages):
            req.messages.messages.add(role=r, content=c)
    elif which == "ids":
        req.prompt_token_ids.token_ids.extend(draw(token_ids))
    elif which == "packed":
        req.packed_prompt_token_ids = draw(packed)
    return req


packed = mostly(token_ids.map(lambda ids: struct.pack(f"<{len(ids)}I", *ids)),
                st.binary(max_size=200))


@st.composite
def generate_request(draw) -> worker_pb2.GenerateRequest:
    req = worker_pb2.GenerateRequest(request_id=draw(mostly(st.text(max_size=40), text)),
                                     namespace=draw(mostly(st.sampled_from(["", "a"]), text)),
                                     sampling=draw(sampling()))
    if draw(st.booleans()):
        req.prompt_token_ids.extend(draw(token_ids))
    else:
        req.packed_prompt_token_ids = draw(packed)
    return req


def _call(stream, deadline_s: float = DEADLINE_S) -> str:
    t0 = time.monotonic()
    try:
        for _ in stream:
            pass
        return "OK"
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and \
                time.monotonic() - t0 >= deadline_s * 0.99:
            return "HANG"
        return exc.code().name


@pytest.fixture(scope="module")
def seen(fleet: Fleet):
    got: dict[str, Counter] = {"chat": Counter(), "worker": Counter()}
    rss0 = _rss(fleet)
    t0 = time.monotonic()
    yield got
    rss1 = _rss(fleet)
    report("fuzz", cases={k: sum(v.values()) for k, v in got.items()},
           statuses={k: dict(v) for k, v in got.items()}, seconds=round(time.monotonic() - t0),
           rss_mib_before=rss0, rss_mib_after=rss1, alive=fleet.alive())


def _count(seen: dict[str, Counter], service: str, code: str, fleet: Fleet) -> None:
    """Count one case; every 5,000 cases a progress line goes to the report (a long run
    cut short still says how far it got)."""
    seen[service][code] += 1
    total = sum(sum(c.values()) for c in seen.values())
    if total % 5000 == 0:
        report("fuzz progress", cases=total, statuses={k: dict(v) for k, v in seen.items()},
               rss_mib=_rss(fleet), alive=fleet.alive())


def _rss(fleet: Fleet) -> dict[str, float]:
    return {"gateway": round(rss_mb(fleet.gateway.pid)), **{
        w: round(rss_mb(p.pid)) for w, p in fleet.workers.items()}}


def test_fuzz_chat_service(fleet: Fleet, seen) -> None:
    channel = grpc.insecure_channel(fleet.address)
    stub = chat_pb2_grpc.ChatServiceStub(channel)

    @SETTINGS
    @given(req=chat_request())
    def case(req: chat_pb2.ChatRequest) -> None:
        code = _call(stub.Chat(req, timeout=DEADLINE_S))
        _count(seen, "chat", code, fleet)
        assert code not in FORBIDDEN, (code, req)

    try:
        case()
    finally:
        channel.close()
    assert fleet.alive() and fleet.num_workers() == 2


def test_fuzz_worker_service(fleet: Fleet, seen) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{fleet.worker_ports['fw0']}")
    stub = worker_pb2_grpc.WorkerServiceStub(channel)

    @SETTINGS
    @given(req=generate_request(), other=st.integers(0, 19))
    def case(req: worker_pb2.GenerateRequest, other: int) -> None:
        if other == 0:  # now and then the unary calls, with and without a cache to flush
            for call, msg in ((stub.GetInfo, worker_pb2.GetInfoRequest()),
                              (stub.GetStatus, worker_pb2.GetStatusRequest()),
                              (stub.FlushCache, worker_pb2.FlushCacheRequest())):
                call(msg, timeout=DEADLINE_S)
        code = _call(stub.Generate(req, timeout=DEADLINE_S))
        _count(seen, "worker", code, fleet)
        assert code not in FORBIDDEN, (code, req)

    try:
        case()
    finally:
        channel.close()
    assert fleet.alive() and fleet.num_workers() == 2
    rss = _rss(fleet)
    assert rss["gateway"] < 400 and max(rss["fw0"], rss["fw1"]) < 1500, rss
