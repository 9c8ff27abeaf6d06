"""The emulated fleet (prefixgate/emulate) over real gRPC: an emulated worker publishes
exactly the block hashes a real (tiny-random) worker publishes for the same requests,
reports cached tokens and worker-side timings like one, and publishes a prompt's blocks
only when its prefill completes."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from prefixgate.emulate.service import ServiceModel
from prefixgate.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.helpers import start_emulated_worker, start_worker

PROMPT_320 = [3 + i % 250 for i in range(320)]  # 20 full blocks of 16


def _request(ids: list[int], max_tokens: int = 1, namespace: str = ""):
    req = worker_pb2.GenerateRequest(request_id="", namespace=namespace,
                                     sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
    req.prompt_token_ids.extend(ids)
    return req


def _generate(address: str, ids: list[int], max_tokens: int = 1, namespace: str = ""):
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        events = list(stub.Generate(_request(ids, max_tokens, namespace), timeout=60))
    return events[-1].final


def _blocks(events_log) -> set[tuple[int | None, tuple[int, ...]]]:
    chains, _ = events_log.snapshot()
    return {(c.parent_hash, tuple(c.block_hashes)) for c in chains}


@pytest.fixture(scope="module")
def pair(loop_thread, tiny_spec, tiny_model):
    from prefixgate.workerapi.events import EventLog

    real_log, emu_log = EventLog(), EventLog()
    real, stop_real = start_worker(loop_thread, tiny_spec, tiny_model, "real", events=real_log)
    emu, stop_emu, engine = start_emulated_worker(
        loop_thread, tiny_spec, "emulated", events=emu_log, service=ServiceModel(1e6, 0.0))
    yield {"real": real, "emu": emu, "real_log": real_log, "emu_log": emu_log,
           "engine": engine}
    for stop in (stop_real, stop_emu):
        loop_thread.loop.call_soon_threadsafe(stop.set)


def test_emulated_worker_publishes_the_real_workers_block_hashes(pair) -> None:
    # Three prompts sharing a 48-token prefix (3 blocks of 16), two namespaces; one
    # token of reply, so both workers cache exactly the prompts' full blocks.
    base = [5 + (i * 7) % 250 for i in range(48)]
    prompts = [(base + [9, 8, 7] * 7, ""), (base + list(range(30, 70)), ""),
               (base + [11] * 33, "tenant-a")]
    for ids, ns in prompts:
        for side in ("real", "emu"):
            _generate(pair[side], ids, namespace=ns)
    assert _blocks(pair["emu_log"]) == _blocks(pair["real_log"])
    assert len(_blocks(pair["emu_log"])) >= 3
    # The same follow-up hits the same cached tokens on both (it leaves the second prompt
    # at a block boundary: emulated workers keep no partial-block tails).
    follow = base + list(range(30, 62)) + [3] * 10
    real, emu = _generate(pair["real"], follow), _generate(pair["emu"], follow)
    assert emu.usage.cached_tokens == real.usage.cached_tokens == 80
    assert emu.usage.prompt_tokens == real.usage.prompt_tokens == len(follow)
    assert _blocks(pair["emu_log"]) == _blocks(pair["real_log"])


def test_emulated_final_reports_worker_side_timings(loop_thread, tiny_spec) -> None:
    # 2,000 tokens/s emulated, time x10: 320 uncached tokens take 0.16 s emulated.
    address, stop, engine = start_emulated_worker(
        loop_thread, tiny_spec, "timed", service=ServiceModel(2000.0, 0.01),
        time_scale=10.0)
    try:
        final = _generate(address, PROMPT_320, max_tokens=4)
        assert final.usage.cached_tokens == 0 and final.usage.completion_tokens == 4
        # The schedule is computed from the arrival, so the figures are exact (emulated ms):
        # 320 tokens at 2,000/s, then 3 more tokens 10 ms apart.
        assert final.timings.ttft_ms == pytest.approx(160.0, abs=0.01)
        assert final.timings.total_ms == pytest.approx(190.0, abs=0.01)
        again = _generate(address, PROMPT_320, max_tokens=4)
        assert again.usage.cached_tokens == 304  # 19 full blocks; the last token is computed
        assert again.timings.ttft_ms == pytest.approx(16 / 2000 * 1e3, abs=0.01)
        assert [r.cached_tokens for r in engine.records] == [0, 304]
        # The host's delay of each first token is recorded beside the computed timings
        # (emulated seconds; never negative).
        assert all(r.first_token_late_s >= 0 for r in engine.records)
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)


def test_blocks_are_published_when_the_prefill_completes(loop_thread, tiny_spec) -> None:
    from prefixgate.workerapi.events import EventLog

    log = EventLog()
    # 320 tokens at 200 tokens/s: the prefill takes 1.6 s (time x1).
    address, stop, engine = start_emulated_worker(
        loop_thread, tiny_spec, "slow", events=log, service=ServiceModel(200.0,
        0.0))
    try:
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            call = stub.Generate(_request(PROMPT_320, max_tokens=1), timeout=30)
            time.sleep(0.5)
            status = stub.GetStatus(worker_pb2.GetStatusRequest())
            time.sleep(0.3)
            later = stub.GetStatus(worker_pb2.GetStatusRequest())
            assert log.num_blocks == 0  # computing: nothing published yet
            # The prompt in prefill counts with what is left of it, shrinking as it runs.
            assert 0 < later.num_queued_prefill_tokens < status.num_queued_prefill_tokens <= 320
            list(call)
        assert log.num_blocks == 20
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)


def test_publish_at_finish_holds_the_blocks_back_until_the_reply_ends(loop_thread,
                                                                      tiny_spec) -> None:
    from prefixgate.workerapi.events import EventLog

    log = EventLog()
    # A 10-token reply at 0.2 s per token: the request ends 1.8 s after its first token.
    address, stop, _ = start_emulated_worker(
        loop_thread, tiny_spec, "late", events=log, service=ServiceModel(1e6,
        0.2), publish_at="finish")
    try:
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            call = stub.Generate(_request(PROMPT_320, max_tokens=10), timeout=30)
            first = next(call)
            assert first.HasField("chunk") and log.num_blocks == 0  # decoding: not yet
            list(call)
        assert log.num_blocks == 20  # 320 prompt + 9 computed reply tokens: 20 full blocks
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)


def test_http_face_serves_completions_from_the_same_cache(loop_thread, tiny_spec) -> None:
    import httpx

    _, stop, engine = start_emulated_worker(loop_thread, tiny_spec, "http",
                                           service=ServiceModel(1e6, 0.0))
    started = loop_thread.run(_start_http(engine, stop))
    try:
        url = f"http://127.0.0.1:{started}"
        prompt = " ".join(str(3 + i % 250) for i in range(100))  # ids as text (routers)
        with httpx.Client(timeout=10) as http:
            assert http.get(url + "/health").status_code == 200
            first = http.post(url + "/v1/completions",
                              json={"prompt": prompt, "max_tokens": 3}).json()
            chunks = [line for line in http.post(
                url + "/v1/completions",
                json={"prompt": prompt, "max_tokens": 3, "stream": True}).text.splitlines()
                if line.startswith("data: {")]
            bad = http.post(url + "/v1/completions", json={"prompt": "1 x 2"})
        assert first["usage"]["prompt_tokens"] == 100 and first["usage"]["completion_tokens"] == 3
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        last = json.loads(chunks[-1][6:])
        assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # 6 full blocks
        assert bad.status_code == 400 and "token ids" in bad.json()["error"]
        # gRPC and HTTP requests share the worker's cache and records.
        assert [r.cached_tokens for r in engine.records] == [0, 96]
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)


async def _start_http(engine, stop) -> int:
    import asyncio

    from prefixgate.emulate.http import serve_http

    started = asyncio.get_running_loop().create_future()
    asyncio.create_task(serve_http(engine, "127.0.0.1", 0, "tiny", stop, started))
    return await started


def test_gateway_moves_kv_to_an_idle_worker_when_the_holder_is_busy(loop_thread,
                                                                    tiny_spec) -> None:
    """Two emulated workers with a link 10x their prefill rate (1,000 tokens/s; 100 KV
    bytes per token at 1 MB/s: 10,000 tokens/s), behind a real gateway: a 400-token prompt
    is cached on one; that one then gets a 2 s prefill of its own; a follow-up extending
    the prompt goes to the idle worker, which pulls the 400 tokens over the real
    ExportBlocks path (0.04 s) instead of recomputing them (0.4 s) or waiting (2 s)."""
    from prefixgate.v1 import chat_pb2_grpc
    from tests.helpers import one_token_turn, start_gateway, wait_for_workers

    link = dict(service=ServiceModel(1000.0, 0.0), kv_bytes_per_token=100,
                transfer_bytes_per_s=1e6)
    workers = {wid: start_emulated_worker(loop_thread, tiny_spec, wid, **link)
               for wid in ("e0", "e1")}
    gw, gstop = start_gateway(loop_thread, tiny_spec, [a for a, _, _ in workers.values()])
    prompt = [3 + (i * 11) % 250 for i in range(400)]
    try:
        with grpc.insecure_channel(gw) as ch:
            stub = chat_pb2_grpc.ChatServiceStub(ch)
            wait_for_workers(stub, 2)

            def chat(ids: list[int]):
                return one_token_turn(stub, ids, timeout=30)

            holder = chat(prompt).worker_id
            other = "e1" if holder == "e0" else "e0"
            busy = workers[holder][0]
            # 2,000 cold tokens straight to the holder: 2 s of prefill there.
            with grpc.insecure_channel(busy) as wch:
                call = worker_pb2_grpc.WorkerServiceStub(wch).Generate(
                    _request([7 + i % 200 for i in range(2000)]), timeout=30)
                time.sleep(0.3)  # queued there; its pushed status reaches the gateway
                final = chat(prompt + list(range(40, 80)))
                call.cancel()
        assert final.worker_id == other
        assert final.predicted_transferred_tokens == 400
        assert final.usage.transferred_tokens == 400 and final.usage.cached_tokens == 0
        assert final.timings.ttft_ms < 400  # not the 440 ms of recomputing, nor the wait
    finally:
        loop_thread.loop.call_soon_threadsafe(gstop.set)
        for _, stop, _ in workers.values():
            loop_thread.loop.call_soon_threadsafe(stop.set)


def test_emulated_worker_refuses_logprobs_it_cannot_compute(loop_thread, tiny_spec) -> None:
    address, stop, _ = start_emulated_worker(loop_thread, tiny_spec, "nolp")
    try:
        req = _request(PROMPT_320, max_tokens=2)
        req.sampling.top_logprobs = 0
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
            list(worker_pb2_grpc.WorkerServiceStub(channel).Generate(req, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no log probabilities" in err.value.details()
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)


def test_http_face_reads_text_prompts_as_token_ids() -> None:
    """A text prompt is token ids separated by any whitespace, read whole or refused."""
    from prefixgate.emulate.http import BadRequest, _prompt_ids

    assert _prompt_ids(" 7  8\n9\t10 ") == (7, 8, 9, 10)
    assert _prompt_ids([7, 8]) == (7, 8)
    for bad in ("1 x 3", "1.5 2", "1,2", "", "-1 2", "4294967296 1", "99999999999999999999"):
        with pytest.raises(BadRequest):
            _prompt_ids(bad)
