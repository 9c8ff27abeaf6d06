"""Process faults under load, as clients see them: a worker SIGKILLed mid-stream, a worker
drained by SIGTERM, a worker restarted with the same id, Redis killed and restarted empty
at several offsets. No stream hangs, none ends INTERNAL/UNKNOWN, a lost stream says a
retry is safe, and the fleet recovers."""

from __future__ import annotations

import signal
import threading
import time

import grpc

from prefixgate.v1 import chat_pb2_grpc
from tests.faults.fleet import (
    Fleet,
    chat_request,
    concurrently,
    counts,
    prompt_for,
    report,
    turn,
)
from tests.helpers import wait_for

DEADLINE_S = 60.0


def _streams(fleet: Fleet, n: int, max_tokens: int, tag: str, started: threading.Event,
             min_tokens: int):
    """n concurrent streams; `started` is set once `min_tokens` tokens arrived in all."""
    seen = [0]
    lock = threading.Lock()

    def on_token() -> None:
        with lock:
            seen[0] += 1
            if seen[0] >= min_tokens:
                started.set()

    def one(i: int):
        with grpc.insecure_channel(fleet.address) as ch:
            return turn(chat_pb2_grpc.ChatServiceStub(ch),
                        chat_request(f"{tag}{i}", prompt_for(i), max_tokens), DEADLINE_S,
                        on_token)

    holder: list = []
    thread = threading.Thread(target=lambda: holder.extend(concurrently(
        one, [(i,) for i in range(n)], DEADLINE_S + 10)), daemon=True)
    thread.start()
    return thread, holder


def _follow_ups(fleet: Fleet, n: int, tag: str) -> list:
    with grpc.insecure_channel(fleet.address) as ch:
        stub = chat_pb2_grpc.ChatServiceStub(ch)
        return [turn(stub, chat_request(f"{tag}{i}", prompt_for(i + 100), 8), 30)
                for i in range(n)]


def _assert_clean(outcomes) -> None:
    for o in outcomes:
        assert o.code in ("OK", "UNAVAILABLE"), (o.code, o.details)
        if o.code == "UNAVAILABLE":
            assert "retry" in o.details, o.details


def test_worker_sigkill_mid_stream(fleet: Fleet) -> None:
    started = threading.Event()
    thread, outcomes = _streams(fleet, 12, 400, "kill", started, min_tokens=60)
    assert started.wait(DEADLINE_S), "streams did not start"
    t_kill = time.monotonic()
    fleet.signal_worker("fw0", signal.SIGKILL)
    thread.join(DEADLINE_S + 15)
    assert len(outcomes) == 12
    _assert_clean(outcomes)
    # Recovery: the gateway stops listing the dead worker, and every follow-up succeeds.
    wait_for(lambda: fleet.num_workers() == 1, timeout=30, what="the dead worker to go")
    dropped_s = time.monotonic() - t_kill
    after = _follow_ups(fleet, 30, "after-kill")
    report("worker SIGKILL mid-stream", streams=counts(outcomes),
           lost_mid_stream=sum(o.code == "UNAVAILABLE" and o.num_tokens > 0 for o in outcomes),
           hangs=sum(o.code == "HANG" for o in outcomes), dead_worker_dropped_s=round(dropped_s, 2),
           follow_ups=counts(after))
    assert counts(after) == {"OK": 30}
    fleet.start_worker("fw0")
    fleet.wait_workers(2)


def test_sigterm_drains_in_flight_streams(fleet: Fleet) -> None:
    started = threading.Event()
    thread, outcomes = _streams(fleet, 8, 60, "drain", started, min_tokens=16)
    assert started.wait(DEADLINE_S), "streams did not start"
    t0 = time.monotonic()
    fleet.signal_worker("fw1", signal.SIGTERM, wait_s=60)
    exited_s = time.monotonic() - t0
    during = _follow_ups(fleet, 10, "during-drain")
    thread.join(DEADLINE_S + 15)
    report("worker SIGTERM drain", streams=counts(outcomes), worker_exit_s=round(exited_s, 2),
           turns_after=counts(during))
    assert counts(outcomes) == {"OK": 8}
    assert counts(during) == {"OK": 10}
    fleet.start_worker("fw1")
    fleet.wait_workers(2)


def test_worker_restarted_with_the_same_id(fleet: Fleet) -> None:
    """fw0 is SIGKILLed and started again at once with the same id and address (a new,
    empty process): the next turns of every conversation succeed, and those first served
    by fw0 are not steered back to it by its old ownership (it holds nothing now)."""
    first = _follow_ups(fleet, 20, "same-id")
    assert counts(first) == {"OK": 20}
    on_fw0 = {i for i, o in enumerate(first) if o.worker_id == "fw0"}
    fleet.signal_worker("fw0", signal.SIGKILL)
    t0 = time.monotonic()
    fleet.start_worker("fw0")
    fleet.wait_workers(2)
    time.sleep(2.5)  # one gateway refresh: the new process is probed and its events read
    again = _follow_ups(fleet, 20, "same-id")  # the same conversations' next turns
    stale = [o for i, o in enumerate(again) if i in on_fw0 and o.worker_id == "fw0"]
    report("worker restarted with the same id", turns=counts(again),
           conversations_first_on_fw0=len(on_fw0), their_next_turn_on_restarted_fw0=len(stale),
           cached_tokens_there=sum(o.cached_tokens for o in stale),
           cached_tokens_elsewhere=sum(o.cached_tokens for i, o in enumerate(again)
                                       if i not in on_fw0),
           back_in_service_s=round(time.monotonic() - t0, 2))
    assert counts(again) == {"OK": 20}


def _load(fleet: Fleet, k: int, tag: str, stop: threading.Event, outcomes: list) -> None:
    with grpc.insecure_channel(fleet.address) as ch:
        stub = chat_pb2_grpc.ChatServiceStub(ch)
        i = 0
        while not stop.is_set():
            outcomes.append(turn(stub, chat_request(f"{tag}-{k}-{i % 5}", prompt_for(i + k), 4),
                                 30))
            i += 1


def test_redis_restarted_empty_at_several_offsets(fleet: Fleet) -> None:
    """Redis is SIGKILLed and comes back empty after 0.5, 2 and 5 s, while clients keep
    chatting: every turn succeeds, and the workers register again."""
    import redis

    for offset_s in (0.5, 2.0, 5.0):
        stop = threading.Event()
        outcomes: list = []
        threads = [threading.Thread(target=_load, args=(fleet, k, f"redis{offset_s}", stop,
                                                        outcomes), daemon=True)
                   for k in range(3)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        fleet.kill_redis()
        time.sleep(offset_s)
        fleet.start_redis()
        t_back = time.monotonic()
        r = redis.Redis.from_url(fleet.redis.url)
        while r.scard("pg:workers") < 2:
            assert time.monotonic() - t_back < 30, "workers did not register again"
            time.sleep(0.05)
        reregistered_s = time.monotonic() - t_back
        time.sleep(3.0)  # past the gateway's next refreshes
        stop.set()
        for t in threads:
            t.join(40)
        report("Redis killed, restarted empty", offset_s=offset_s, turns=counts(outcomes),
               workers_reregistered_s=round(reregistered_s, 2),
               workers_listed_after=fleet.num_workers())
        assert counts(outcomes) == {"OK": len(outcomes)}, [
            o.details for o in outcomes if o.code != "OK"][:3]
        assert fleet.num_workers() == 2
