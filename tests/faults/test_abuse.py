"""Abusive requests against a fleet of processes: poison sampling parameters beside valid
streams, the overflow stall, oversize messages, and fields that used to grow memory
(long ids, unique namespaces, long model names). Each is refused early or served, never
INTERNAL/UNKNOWN, never a hang; valid streams around them all succeed; memory and logs
stay bounded."""

from __future__ import annotations

import os
import threading
import time

import grpc

from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from tests.faults.fleet import (
    Fleet,
    chat_request,
    concurrently,
    counts,
    prompt_for,
    report,
    rss_mb,
    turn,
)

FLEET_LOG_LEVEL = "INFO"  # the abuse cases measure what reaches the logs

REFUSED = [  # sampling parameters refused with INVALID_ARGUMENT
    dict(temperature=1e-39), dict(temperature=1e-45), dict(temperature=2.0 ** -127),
    dict(temperature=float("inf")), dict(temperature=float("nan")), dict(top_p=float("nan")),
    dict(top_p=-1.0), dict(n=1000), dict(max_tokens=2**32 - 1), dict(stop=["x"] * 10_000),
    dict(stop=["y" * 100_000]), dict(stop_token_ids=list(range(5000))),
]
EXTREME = [  # accepted, and served: extreme but valid values
    dict(temperature=1.2e-38), dict(temperature=3e38), dict(top_k=2**32 - 1, temperature=1.0),
    dict(top_p=1e-30, temperature=1.0), dict(seed=2**64 - 1, temperature=0.5),
    dict(n=16, temperature=1.0),
]


def _stub(fleet: Fleet):
    return chat_pb2_grpc.ChatServiceStub(grpc.insecure_channel(
        fleet.address, options=[("grpc.max_send_message_length", 64 << 20)]))


def test_poison_requests_beside_valid_streams(fleet: Fleet) -> None:
    stub = _stub(fleet)
    def request(kind: str, i: int, sampling: dict):
        req = chat_request(f"{kind}{i}", prompt_for(i), 8)
        for key, value in sampling.items():
            field = getattr(req.sampling, key)
            field.extend(value) if isinstance(value, list) else setattr(req.sampling, key, value)
        return kind, req

    cases = [request("valid", i, dict(max_tokens=80)) for i in range(12)]
    cases += [request("refused", i, s) for i, s in enumerate(REFUSED, 12)]
    cases += [request("extreme", i, s) for i, s in enumerate(EXTREME, 30)]
    cases = cases[::3] + cases[1::3] + cases[2::3]  # interleaved
    outcomes = concurrently(lambda kind, r: turn(stub, r, 60), cases)
    by_kind: dict[str, list] = {"valid": [], "refused": [], "extreme": []}
    for (kind, _), o in zip(cases, outcomes, strict=True):
        by_kind[kind].append(o)
    report("poison sampling beside 12 valid streams", workers_listed_after=fleet.num_workers(),
           **{kind: counts(got) for kind, got in by_kind.items()})
    assert counts(by_kind["valid"]) == {"OK": 12}
    assert counts(by_kind["refused"]) == {"INVALID_ARGUMENT": len(REFUSED)}
    assert counts(by_kind["extreme"]) == {"OK": len(EXTREME)}
    assert fleet.num_workers() == 2 and fleet.alive()


def test_overflow_stall_is_bounded(fleet: Fleet) -> None:
    """A 100k-token prompt under keep-system-drop-oldest + shift (with many turn starts)
    sent straight to one worker while short requests run there: their latency stays
    near the idle figure."""
    with grpc.insecure_channel(f"127.0.0.1:{fleet.worker_ports['fw0']}",
                               options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        del info
        turn_ids = [1, 87, 85, 71, 84]  # tiny-random's user-turn prefix (overflow.user_turn_prefix)
        prompt = [90] * 100
        for i in range(12_500):
            prompt += [*turn_ids, 100 + i % 50, 150 + i // 50 % 50, 200]
        overflow = common_pb2.SamplingParams(
            max_tokens=1, context_overflow=common_pb2.CONTEXT_OVERFLOW_KEEP_SYSTEM_DROP_OLDEST,
            shifted_reuse=common_pb2.SHIFTED_REUSE_SHIFT)

        def generate(ids: list[int], sampling, rid: str) -> float:
            t0 = time.monotonic()
            list(stub.Generate(worker_pb2.GenerateRequest(
                request_id=rid, prompt_token_ids=ids, sampling=sampling), timeout=120))
            return time.monotonic() - t0

        short = common_pb2.SamplingParams(max_tokens=4)
        idle = sorted(generate(prompt_for(i), short, f"idle{i}") for i in range(5))[2]
        latencies: list[float] = []
        done = threading.Event()

        def shorts() -> None:
            while not done.is_set():
                n = len(latencies)
                latencies.append(generate(prompt_for(n), short, f"s{n}"))

        t = threading.Thread(target=shorts)
        t.start()
        generate(prompt[:-64], overflow, "previous")  # the conversation's previous turn
        big = [generate(prompt, overflow, f"big{i}") for i in range(3)]
        done.set()
        t.join()
    report("overflow stall (100k tokens, 12.5k turn starts, shift)", prompt_tokens=len(prompt),
           overflow_request_s=round(max(big), 3), short_idle_s=round(idle, 3),
           short_max_s=round(max(latencies), 3), short_requests=len(latencies))
    assert max(latencies) < idle + 2.0


def test_oversize_message_refused_before_it_blocks(fleet: Fleet) -> None:
    stub = _stub(fleet)
    huge = chat_pb2.ChatRequest(conversation_id="big")
    huge.messages.messages.add(role="user", content="word " * 700_000)  # 3.5 MB
    gaps: list[float] = []
    done = threading.Event()

    def stream() -> None:  # a valid stream running meanwhile: its longest wait per token
        last = time.monotonic()

        def tick() -> None:
            nonlocal last
            now = time.monotonic()
            gaps.append(now - last)
            last = now

        while not done.is_set():
            turn(stub, chat_request("bystander", prompt_for(1), 40), 60, tick)
            last = time.monotonic()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    outcomes = concurrently(lambda r: turn(stub, r, 30), [(huge,)] * 8)
    refused_s = time.monotonic() - t0
    done.set()
    t.join(60)
    report("8 x 3.5 MB messages at once", outcomes=counts(outcomes),
           all_refused_s=round(refused_s, 3), bystander_max_token_gap_s=round(max(gaps), 3))
    assert counts(outcomes) == {"RESOURCE_EXHAUSTED": 8}
    assert refused_s < 2.0 and max(gaps) < 1.0


def test_abusive_fields_keep_memory_and_logs_bounded(fleet: Fleet) -> None:
    stub = _stub(fleet)
    pids = {"gateway": fleet.gateway.pid, **{w: p.pid for w, p in fleet.workers.items()}}
    logs = {name: fleet.workdir / f"{name}.log" for name in ("gateway", "fw0", "fw1")}
    rss0 = {name: rss_mb(pid) for name, pid in pids.items()}
    log0 = {name: p.stat().st_size for name, p in logs.items()}
    long_ids = [chat_request("c" * 400_000 + str(i), prompt_for(i), 1) for i in range(150)]
    refused = [turn(stub, r, 30) for r in long_ids]
    huge_id = [turn(stub, chat_request("c" * (1 << 20), prompt_for(0), 1), 30)]
    model = chat_request("m", prompt_for(0), 1)
    model.model = "m" * 10_000
    many = chat_pb2.ChatRequest()
    for _ in range(5000):
        many.messages.messages.add(role="user", content="hi")
    odd = [turn(stub, model, 30), turn(stub, many, 30)]
    namespaced = []
    for i in range(400):  # unique 256-character namespaces, each a valid turn
        req = chat_request("n", prompt_for(i), 1)
        req.namespace = f"{i:08d}" + "n" * 248
        namespaced.append(turn(stub, req, 30))
    growth = {name: round(rss_mb(pid) - rss0[name], 1) for name, pid in pids.items()}
    log_growth = {name: p.stat().st_size - log0[name] for name, p in logs.items()}
    report("abusive fields", long_conversation_ids=counts(refused), one_mib_id=counts(huge_id),
           model_name_and_5000_messages=counts(odd), unique_namespaces=counts(namespaced),
           rss_growth_mib=growth, log_growth_bytes=log_growth)
    assert counts(refused) == {"INVALID_ARGUMENT": 150}
    assert counts(huge_id) == {"RESOURCE_EXHAUSTED": 1}
    assert counts(odd) == {"INVALID_ARGUMENT": 2}
    assert counts(namespaced) == {"OK": 400}
    assert all(g < 60 for g in growth.values()), growth
    assert all(g < 1 << 20 for g in log_growth.values()), log_growth
    assert fleet.alive() and os.path.exists(logs["gateway"])
