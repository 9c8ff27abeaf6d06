"""The vLLM worker adapter without a vLLM server: configuration, vLLM's metrics text, and
what the gateway sees while the server is down (through the InProcessWorkerClient the
pool holds it by). With a real vLLM server: tests/engines/test_vllm_real.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from prefixgate.engines.vllm import VLLMConfig, VLLMWorker, worker_id_of
from prefixgate.engines.vllm_http import parse_metrics
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.v1 import worker_pb2
from prefixgate.wire.protocol import ERROR_SCOPE_KEY
from prefixgate.wire.rpc import free_port
from prefixgate.workerapi.client import InProcessWorkerClient
from prefixgate.workerapi.server import WorkerConfig

DATA = Path(__file__).parent / "data"


def test_config_parse() -> None:
    c = VLLMConfig.parse("http://h:8000, tcp://h:5557 ,tcp://h:5558")
    assert (c.url, c.events, c.replay) == ("http://h:8000", "tcp://h:5557", "tcp://h:5558")
    assert c.address == "vllm+http://h:8000" and worker_id_of(c.url) == "vllm-h:8000"
    for bad in ("http://h:8000", "h:8000,tcp://h:5557", "http://h:8000,h:5557",
                "http://a,tcp://b,tcp://c,tcp://d"):
        with pytest.raises(ValueError, match="URL,EVENTS"):
            VLLMConfig.parse(bad)


def test_metrics_of_vllm_itself() -> None:
    """data/vllm-0.32.0-metrics.txt: those series as vLLM 0.32.0 served them (CPU, block
    size 32, 182 blocks, prefix caching on; the process's start time)."""
    m = parse_metrics((DATA / "vllm-0.32.0-metrics.txt").read_text())
    assert (m.num_running_requests, m.num_waiting_requests, m.kv_usage) == (0, 0, 0.0)
    assert (m.block_size, m.num_blocks, m.prefix_caching) == (32, 182, True)
    assert m.kv_capacity_tokens == 32 * 182 and m.start_time == 1795702398.07
    busy = parse_metrics('vllm:num_requests_running{engine="0"} 3.0\n'
                         'vllm:num_requests_running{engine="1"} 2.0\n'
                         'vllm:num_requests_waiting{engine="0"} 4.0\n'
                         'vllm:kv_cache_usage_perc{engine="0"} 0.25\n')
    assert (busy.num_running_requests, busy.num_waiting_requests, busy.kv_usage) == (5, 4, 0.25)


def _codes(exc: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, bool]:
    scoped = any(k == ERROR_SCOPE_KEY for k, _ in exc.trailing_metadata() or ())
    return exc.code(), scoped


def test_a_server_that_is_down(tiny_spec) -> None:
    """Unreachable vLLM: GetInfo is UNAVAILABLE (the pool keeps it down), a turn is
    UNAVAILABLE and not the request's fault (the gateway may send it elsewhere), a bad
    turn is INVALID_ARGUMENT and the request's, before any call to vLLM."""
    port = free_port()

    async def main():
        w = VLLMWorker(tiny_spec, ChatTokenizer(tiny_spec), WorkerConfig("v", block_size=16),
                       VLLMConfig(f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_port()}"))
        await w.start(wait_s=5)
        stub = InProcessWorkerClient(w)
        try:
            assert not await stub.serving()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=1)
            assert _codes(info.value) == (grpc.StatusCode.UNAVAILABLE, False)
            with pytest.raises(grpc.aio.AioRpcError) as turn:
                async for _ in stub.Generate(worker_pb2.GenerateRequest(
                        request_id="r", prompt_token_ids=[1, 2, 3]), timeout=5):
                    pass
            assert _codes(turn.value) == (grpc.StatusCode.UNAVAILABLE, False)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                async for _ in stub.Generate(worker_pb2.GenerateRequest(
                        request_id="r", prompt_token_ids=[10**6]), timeout=5):
                    pass
            assert _codes(bad.value) == (grpc.StatusCode.INVALID_ARGUMENT, True)
            status = await stub.GetStatus(worker_pb2.GetStatusRequest())
            assert status.num_running_requests == 0 and status.kv_bytes_per_token == 0
        finally:
            await w.close()
    asyncio.run(main())


def test_a_worker_and_the_vllm_adapter_refuse_bad_requests_alike(tiny_spec) -> None:
    """Generate's validation is one (workerapi/server.py `_checked_generate`): each bad
    request gets the same request-scoped INVALID_ARGUMENT, word for word, from a worker's
    service (over an emulated engine; called in process and over gRPC alike) and from the
    vLLM adapter (whose server is down, so a request it lets through is UNAVAILABLE). A prompt over the context window under
    keep-system-drop-oldest is taken by both: the adapter drops old turns too."""
    from prefixgate.emulate.engine import EmulatedEngine, EmulationConfig
    from prefixgate.v1 import common_pb2
    from prefixgate.workerapi.client import GrpcWorkerClient
    from prefixgate.workerapi.server import WorkerService, serve

    tok = ChatTokenizer(tiny_spec)
    context = tiny_spec.max_context_tokens
    drop_oldest = common_pb2.CONTEXT_OVERFLOW_KEEP_SYSTEM_DROP_OLDEST
    bad = [
        worker_pb2.GenerateRequest(request_id="r", prompt_token_ids=[tok.vocab_size]),
        worker_pb2.GenerateRequest(request_id="r"),
        worker_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1],
                                   packed_prompt_token_ids=b"\x01"),
        worker_pb2.GenerateRequest(request_id="r" * 10_000, prompt_token_ids=[1]),
        worker_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2],
                                   sampling=common_pb2.SamplingParams(max_tokens=context)),
        worker_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1] * context),
        worker_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1],
                                   sampling=common_pb2.SamplingParams(context_overflow=99)),
    ]
    overflow = worker_pb2.GenerateRequest(
        request_id="o", prompt_token_ids=[1] * (context + 10),
        sampling=common_pb2.SamplingParams(max_tokens=4, context_overflow=drop_oldest))

    async def refusal(stub, request) -> tuple[grpc.StatusCode, bool, str] | None:
        try:
            async for _ in stub.Generate(request, timeout=30):
                return None  # taken: a first event came
        except grpc.aio.AioRpcError as exc:
            return (*_codes(exc), exc.details())
        return None

    async def main():
        engine = EmulatedEngine(EmulationConfig(
            capacity_blocks=4 * context // 16, block_size=16,
            model_fingerprint=tiny_spec.fingerprint, vocab_size=tok.vocab_size,
            max_context_tokens=context))
        service = WorkerService(engine, tiny_spec, WorkerConfig("w", block_size=16,
                                                                drain_seconds=0),
                                vocab_size=tok.vocab_size)
        worker = InProcessWorkerClient(service)
        stop = asyncio.Event()
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        served = asyncio.create_task(serve(service, stop, started))
        remote = GrpcWorkerClient(grpc.aio.insecure_channel(f"127.0.0.1:{await started}"))
        v = VLLMWorker(tiny_spec, tok, WorkerConfig("v", block_size=16),
                       VLLMConfig(f"http://127.0.0.1:{free_port()}",
                                  f"tcp://127.0.0.1:{free_port()}"))
        await v.start(wait_s=5)
        try:
            for request in bad:
                got = await refusal(worker, request)
                assert got is not None and got[:2] == (grpc.StatusCode.INVALID_ARGUMENT, True), \
                    (request, got)
                assert await refusal(remote, request) == got
                assert await refusal(InProcessWorkerClient(v), request) == got
            assert await refusal(worker, overflow) is None
            assert (await refusal(InProcessWorkerClient(v), overflow))[:2] == \
                (grpc.StatusCode.UNAVAILABLE, False)
            fine = worker_pb2.GenerateRequest(request_id="f", prompt_token_ids=[1, 2, 3])
            assert (await refusal(InProcessWorkerClient(v), fine))[:2] == \
                (grpc.StatusCode.UNAVAILABLE, False)
        finally:
            await remote.close()
            stop.set()
            await served
            await v.close()
    asyncio.run(main())


def test_in_process_calls_fail_as_grpc_calls_do() -> None:
    """A service called in process fails as the same call over gRPC would: a `Refused`
    arrives with its code, message and request scope, after the events already yielded;
    any other exception as UNKNOWN; a deadline that passes as DEADLINE_EXCEEDED, the
    service's generator closed."""
    from prefixgate.workerapi.calls import CallScope, Refused

    closed: list[str] = []

    class Service:
        async def get_info(self, request, scope: CallScope):
            raise RuntimeError("boom")

        async def get_status(self, request, scope: CallScope):
            await asyncio.sleep(10)

        async def generate(self, request, scope: CallScope):
            try:
                yield worker_pb2.GenerateEvent()
                if request.request_id == "slow":
                    await asyncio.sleep(10)
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", request_scoped=True)
            finally:
                closed.append(request.request_id)

    async def main():
        client = InProcessWorkerClient(Service())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.GetInfo(worker_pb2.GetInfoRequest())
        assert info.value.code() == grpc.StatusCode.UNKNOWN and "boom" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await client.GetStatus(worker_pb2.GetStatusRequest(), timeout=0.05)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as gen:
            async for ev in client.Generate(worker_pb2.GenerateRequest(request_id="r")):
                got.append(ev)
        assert len(got) == 1
        assert _codes(gen.value) == (grpc.StatusCode.RESOURCE_EXHAUSTED, True)
        assert gen.value.details() == "full"
        with pytest.raises(grpc.aio.AioRpcError) as slow:
            async for _ in client.Generate(worker_pb2.GenerateRequest(request_id="slow"),
                                           timeout=0.05):
                pass
        assert _codes(slow.value) == (grpc.StatusCode.DEADLINE_EXCEEDED, False)
        assert closed == ["r", "slow"]
        assert await client.serving()
    asyncio.run(main())


def test_completions_pass_the_callers_trace_context_on() -> None:
    """The vLLM adapter sends the caller's W3C trace headers with the completion request
    (vLLM's own tracing continues the trace), whether or not its process traces, and
    sends none it was not given."""
    from aiohttp import web

    from prefixgate.engines.vllm_http import VLLMClient
    from prefixgate.telemetry.tracing import trace_context

    seen: list[dict[str, str]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": "hi", "token_ids": [1]}]}'
                         b'\n\ndata: [DONE]\n\n')
        return resp

    async def main() -> list[list[dict]]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        client = VLLMClient(f"http://127.0.0.1:{port}")
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        metadata = (("authorization", "Bearer x"), ("traceparent", parent),
                    ("tracestate", "pg=1"))
        try:
            got = []
            for md in (metadata, ()):
                got.append([c async for c in client.completions(
                    {"prompt": [1]}, 10, trace_context(md))])
            return got
        finally:
            await client.close()
            await runner.cleanup()

    replies = asyncio.run(main())
    assert [len(r) for r in replies] == [1, 1]
    assert seen[0]["traceparent"].startswith("00-0af7651916cd43dd8448eb211c80319c-")
    assert seen[0]["tracestate"] == "pg=1"
    assert "Authorization" not in seen[0]  # only the trace headers go on
    assert "traceparent" not in seen[1]


def test_a_resumed_seeded_reply_does_not_replay_the_spent_draws_on_vllm() -> None:
    """vLLM cannot skip draws: a continuation after tokens already sent gets a seed of its
    own (deterministic in the caller's seed and the offset), never the caller's again."""
    from prefixgate.engines.vllm import continuation_seed

    assert continuation_seed(1234, 0) == 1234
    seeds = {continuation_seed(1234, n) for n in range(1, 50)}
    assert 1234 not in seeds and len(seeds) == 49
    assert continuation_seed(1234, 7) == continuation_seed(1234, 7)
    assert all(0 <= s < 1 << 63 for s in seeds)


def test_the_prefill_queue_counts_a_prefix_still_in_flight_once() -> None:
    """The vLLM adapter's queued prefill: a turn sharing a prefix with a prompt sent to the
    same server and not ended counts only the rest (vLLM reuses the blocks the earlier one
    computes), a turn the events say is held counts the rest of that, and the shared
    blocks are forgotten once every turn holding them ends."""
    from prefixgate.engines.vllm import PrefillQueue

    q = PrefillQueue(block_size=16)
    doc = list(range(100, 100 + 125))  # a 2,000-token document's chained block hashes
    first = q.admit(2005, 0, doc)  # the document and a 5-token question
    assert q.num_queued_tokens == 2005
    second = q.admit(2046, 0, doc + [2, 3])  # another question, same server, in flight
    assert q.num_queued_tokens == 2005 + 46
    other = q.admit(500, 0, [7, 8])  # nothing shared
    assert q.num_queued_tokens == 2005 + 46 + 500
    q.first_token(first)
    q.end(first)
    q.end(first)  # twice: no change
    assert q.num_queued_tokens == 46 + 500
    third = q.admit(2010, 0, doc)  # `second` still holds the document's blocks
    assert q.num_queued_tokens == 46 + 500 + 10
    for t in (second, third, other):
        q.end(t)
    assert q.num_queued_tokens == 0
    alone = q.admit(2010, 0, doc)  # nothing in flight: the whole prompt
    assert q.num_queued_tokens == 2010
    q.end(alone)
    held = q.admit(64, 48, [1, 2, 3, 4])  # the events say 48 are held
    assert q.num_queued_tokens == 16
    whole = q.admit(32, 0, [1, 2])  # all shared: the last token is still computed
    assert q.num_queued_tokens == 16 + 1
    q.end(held)
    q.end(whole)
    assert q.num_queued_tokens == 0
