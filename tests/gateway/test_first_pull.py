"""The pull option starts on a fleet of real workers (tiny-random, real gRPC on loopback,
a real gateway): a worker probes its own copy path once it holds blocks and reports that
rate until a pull measures it, so the first follow-up whose history is cached on a busy
worker is served by the other worker with a pull, no pull having happened before it
(docs/transfer.md, "Before the first pull")."""

from __future__ import annotations

import time

import grpc

from prefixgate.v1 import chat_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from prefixgate.wire.token_ids import pack
from tests.helpers import one_token_turn, start_gateway, start_worker, wait_for, wait_for_workers


def _status(address: str) -> worker_pb2.WorkerStatus:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.WorkerServiceStub(ch).GetStatus(
            worker_pb2.GetStatusRequest(), timeout=5)


def _generate(stub, prompt: list[int], max_tokens: int, request_id: str):
    """A streaming Generate straight to a worker, left running (cancel it when done)."""
    return stub.Generate(worker_pb2.GenerateRequest(
        request_id=request_id, packed_prompt_token_ids=pack(prompt).tobytes(),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)),
        timeout=60)


def test_first_pull_on_real_workers_needs_no_earlier_pull(loop_thread, tiny_spec,
                                                          tiny_model) -> None:
    # One sequence at a time, so that work sent to a worker queues there as prefill.
    # As `prefixgate worker` runs them: no declared rate, so each probes its copy path.
    workers = {wid: start_worker(loop_thread, tiny_spec, tiny_model, wid, max_num_seqs=1,
                                 worker_config={"transfer_probe": True})
               for wid in ("a", "b")}
    gstop = None
    try:
        for address, _ in workers.values():  # nothing to measure on yet
            assert _status(address).transfer_rate_source == ""
            assert _status(address).transfer_bytes_per_s == 0
        gw, gstop = start_gateway(loop_thread, tiny_spec, [a for a, _ in workers.values()])
        with grpc.insecure_channel(gw) as ch:
            stub = chat_pb2_grpc.ChatServiceStub(ch)
            wait_for_workers(stub, 2)

            def chat(ids: list[int]):
                return one_token_turn(stub, ids, timeout=60)

            prompt = [3 + (i * 11) % 250 for i in range(1200)]
            holder = chat(prompt).worker_id
            other = "b" if holder == "a" else "a"
            busy = workers[holder][0]
            wait_for(lambda: _status(busy).transfer_rate_source == "probed",
                     what="the holder's transfer probe on the blocks it now holds")
            status = _status(busy)
            assert status.transfer_bytes_per_s > 0 and status.transfer_setup_s >= 0
            # The probe stored nothing: the turn's 75 or 76 blocks (a stored probe: +16).
            assert status.kv_used_tokens <= 76 * 16
            # The other worker has no rate of its own: it counts at the holder's.
            assert _status(workers[other][0]).transfer_rate_source == ""
            with grpc.insecure_channel(busy) as wch:
                wstub = worker_pb2_grpc.WorkerServiceStub(wch)
                # The holder decodes a long reply, with 4,500 cold tokens queued behind it.
                running = _generate(wstub, [7 + i % 200 for i in range(200)], 1800, "long")
                queued = []
                try:
                    wait_for(lambda: _status(busy).num_running_requests == 1,
                             what="the holder to run the long reply")
                    queued = [_generate(wstub, [9 + j + i % 200 for i in range(1500)], 1,
                                        f"queued-{j}") for j in range(3)]
                    wait_for(lambda: _status(busy).num_waiting_requests == 3,
                             what="the holder to queue the cold prompts")
                    time.sleep(0.3)  # its pushed status reaches the gateway
                    seen = {w: _status(a) for w, (a, _) in workers.items()}
                    final = chat(prompt + list(range(40, 80)))
                finally:
                    running.cancel()
                    for call in queued:
                        call.cancel()
        assert final.worker_id == other, (final, seen)
        assert final.usage.transferred_tokens == 1200 and final.predicted_transferred_tokens == 1200
        assert _status(workers[other][0]).transfer_rate_source == "measured"
    finally:
        if gstop is not None:
            loop_thread.loop.call_soon_threadsafe(gstop.set)
        for _, stop in workers.values():
            loop_thread.loop.call_soon_threadsafe(stop.set)
