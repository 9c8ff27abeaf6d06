"""Drain hand-off: a worker stopped with SIGTERM gives its most reused chains to its peer
(workerapi/handoff.py), so the conversation's next turn, now served by the peer, finds its
history cached there instead of recomputing it."""

from __future__ import annotations

import signal
import time

from tests.faults.fleet import Fleet, chat_request, prompt_for, report, turn


def test_sigterm_hands_hot_chains_to_the_peer(fleet: Fleet) -> None:
    import grpc

    from prefixgate.v1 import chat_pb2_grpc

    with grpc.insecure_channel(fleet.address) as ch:
        stub = chat_pb2_grpc.ChatServiceStub(ch)
        history = prompt_for(11, 200)
        first = turn(stub, chat_request("drain-1", history, max_tokens=8, temperature=0.0))
        assert first.code == "OK", first
        history += prompt_for(12, 40)  # the conversation's next user message
        second = turn(stub, chat_request("drain-1", history, max_tokens=8, temperature=0.0))
        assert second.code == "OK" and second.worker_id == first.worker_id, (first, second)
        holder = first.worker_id
        peer = next(w for w in fleet.workers if w != holder)
        began = time.monotonic()
        fleet.signal_worker(holder, signal.SIGTERM, wait_s=30)
        drained_s = time.monotonic() - began
        try:
            fleet.wait_workers(1, timeout_s=60)
            history += prompt_for(13, 30)
            third = turn(stub, chat_request("drain-1", history, max_tokens=8, temperature=0.0))
            report("drain_handoff", drain_s=round(drained_s, 2), follow_up_worker=third.worker_id,
                   follow_up_cached_tokens=third.cached_tokens, prompt_tokens=len(history))
            assert third.code == "OK" and third.worker_id == peer, third
            # The first turn's 200-token prompt alone is 12 full blocks; the hand-off
            # carried at least those.
            assert third.cached_tokens >= 192, (third, fleet.log_tail(holder), fleet.log_tail(peer))
            assert drained_s < 5 + 10  # within --drain-seconds (5) and process exit
        finally:
            fleet.start_worker(holder)
            fleet.wait_workers(2, timeout_s=180)
