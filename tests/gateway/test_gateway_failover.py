"""Failover semantics against scripted fake workers (real gRPC on loopback): a worker lost
after tokens were sent is resumed on another worker from the prompt plus the tokens sent
(gateway/resume.py; tests/faults/test_resume.py runs it against real workers), or, when
the client opts out, ends the stream with UNAVAILABLE saying a retry is safe (no
duplicated text either way); one failing before its first token is replaced invisibly."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from prefixgate.gateway.routing import RoutingConfig
from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2, worker_pb2
from prefixgate.wire import rpc
from tests.helpers import start_gateway, wait_for

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]


class FakeWorker:
    """Answers like a worker; `mode` scripts Generate: "ok", "slow" (a second per token),
    "die_after_tokens", "fail_first" (UNAVAILABLE before any token)."""

    def __init__(self, worker_id: str, fingerprint: str, mode: str, queued: int = 0) -> None:
        self.worker_id, self.fingerprint, self.mode, self.queued = worker_id, fingerprint, mode, queued
        self.generate_calls = 0
        self.requests: list[worker_pb2.GenerateRequest] = []

    async def GetInfo(self, request, context):
        return worker_pb2.WorkerInfo(worker_id=self.worker_id, model_name="tiny-random",
                                     model_fingerprint=self.fingerprint, block_size=16,
                                     max_context_tokens=2048, kv_capacity_tokens=4096)

    async def GetStatus(self, request, context):
        return worker_pb2.WorkerStatus(num_queued_prefill_tokens=self.queued,
                                       kv_capacity_tokens=4096)

    async def WatchStatus(self, request, context):
        yield await self.GetStatus(request, context)
        await asyncio.Event().wait()

    async def FlushCache(self, request, context):
        return worker_pb2.FlushCacheResponse()

    async def WatchEvents(self, request, context):
        yield worker_pb2.KVEventBatch(worker_id=self.worker_id, incarnation=1, snapshot=True)
        await asyncio.Event().wait()

    async def ExportBlocks(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no block transfer")

    async def PullBlocks(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no block transfer")

    async def Generate(self, request, context):
        self.generate_calls += 1
        self.requests.append(request)
        if self.mode == "fail_first":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted failure")
        for t in (11, 12):
            yield worker_pb2.GenerateEvent(chunk=worker_pb2.GenerateChunk(token_ids=[t],
                                                                          text=f"<{t}>"))
            await asyncio.sleep(1.0 if self.mode == "slow" else 0.01)
        if self.mode == "die_after_tokens":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted loss mid-reply")
        yield worker_pb2.GenerateEvent(final=worker_pb2.GenerateFinal(
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                   completion_tokens=2),
            finish_reason=common_pb2.FINISH_REASON_LENGTH))


def start_fake(loop_thread, fake: FakeWorker) -> tuple[str, object]:
    async def start():
        server = grpc.aio.server()
        rpc.add_service(server, SERVICE, fake)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return port, server

    port, server = loop_thread.run(start())
    return f"127.0.0.1:{port}", server


@pytest.fixture
def fakes(loop_thread, tiny_spec):
    started = []

    def make(worker_id: str, mode: str, queued: int = 0):
        fake = FakeWorker(worker_id, tiny_spec.fingerprint, mode, queued)
        address, server = start_fake(loop_thread, fake)
        started.append(server)
        return fake, address

    yield make
    for server in started:
        loop_thread.run(server.stop(0))


def _chat(gw: str, n_workers: int, **fields):
    with grpc.insecure_channel(gw) as ch:
        stub = chat_pb2_grpc.ChatServiceStub(ch)
        wait_for(lambda: stub.ListModels(chat_pb2.ListModelsRequest()).models[0].num_workers
                 == n_workers, what="gateway to see the workers")
        req = chat_pb2.ChatRequest(conversation_id="c", **fields)
        req.prompt_token_ids.token_ids.extend(range(3, 40))
        events = []
        try:
            for ev in stub.Chat(req, timeout=20):
                events.append(ev)
        except grpc.RpcError as exc:
            return events, exc
        return events, None


def test_lost_after_tokens_is_unavailable_when_the_client_opts_out(loop_thread, tiny_spec,
                                                                   fakes) -> None:
    dying, d_addr = fakes("dying", "die_after_tokens")
    healthy, h_addr = fakes("healthy", "ok", queued=10**6)  # ranked second (least-loaded)
    gw, stop = start_gateway(loop_thread, tiny_spec, [d_addr, h_addr],
                             routing=RoutingConfig(policy="least-loaded"))
    try:
        events, err = _chat(gw, 2, no_resume=True)
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
        assert "after 2 tokens" in err.details() and "retrying is safe" in err.details()
        assert [t for e in events for t in e.delta.token_ids] == [11, 12]  # each token once
        assert dying.generate_calls == 1 and healthy.generate_calls == 0
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)


def test_lost_after_tokens_resumes_from_the_prompt_and_the_tokens_sent(loop_thread, tiny_spec,
                                                                      fakes) -> None:
    dying, d_addr = fakes("dying2", "die_after_tokens")
    healthy, h_addr = fakes("healthy3", "ok", queued=10**6)  # ranked second (least-loaded)
    gw, stop = start_gateway(loop_thread, tiny_spec, [d_addr, h_addr],
                             routing=RoutingConfig(policy="least-loaded"))
    try:
        events, err = _chat(gw, 2, sampling=common_pb2.SamplingParams(max_tokens=10))
        assert err is None, err
        # The continuation was asked for the prompt plus the 2 tokens sent, 8 tokens more.
        cont = healthy.requests[0]
        sent = list(memoryview(cont.packed_prompt_token_ids).cast("I"))
        assert sent == [*range(3, 40), 11, 12] and cont.sampling.max_tokens == 8
        # The client saw the first worker's tokens once, then the continuation's (this fake
        # answers 11, 12 whatever it is asked); usage counts the original prompt.
        assert [t for e in events for t in e.delta.token_ids] == [11, 12, 11, 12]
        final = events[-1].final
        assert final.worker_id == "healthy3" and final.num_resumes == 1
        assert final.usage.prompt_tokens == 37 and final.usage.completion_tokens == 4
        assert dying.generate_calls == 1 and healthy.generate_calls == 1
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)


def test_failure_before_the_first_token_is_invisible(loop_thread, tiny_spec, fakes) -> None:
    failing, f_addr = fakes("failing", "fail_first")
    healthy, h_addr = fakes("healthy2", "ok", queued=10**6)
    gw, stop = start_gateway(loop_thread, tiny_spec, [f_addr, h_addr],
                             routing=RoutingConfig(policy="least-loaded"))
    try:
        events, err = _chat(gw, 2)
        assert err is None
        assert [t for e in events for t in e.delta.token_ids] == [11, 12]
        assert events[-1].final.worker_id == "healthy2"
        assert failing.generate_calls == 1 and healthy.generate_calls == 1
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)


def test_registry_changes_do_not_cut_streaming_turns(loop_thread, tiny_spec, fakes) -> None:
    """A worker registering again (new epoch, same address, as after a Redis restart) or
    leaving the registry while a turn streams from it: the turn completes."""
    from concurrent.futures import ThreadPoolExecutor

    from prefixgate.registry import EmbeddedRegistry, WorkerRecord

    slow, addr = fakes("slow", "slow")
    registry = EmbeddedRegistry()
    gw, stop = start_gateway(loop_thread, tiny_spec, [addr], registry=registry,
                             refresh_interval_s=0.1)
    try:
        with ThreadPoolExecutor(1) as pool:
            for i, change in enumerate(("new epoch", "left")):
                turn = pool.submit(_chat, gw, 1)
                wait_for(lambda i=i: slow.generate_calls > i, what="the turn to start")
                record = loop_thread.run(registry.register(WorkerRecord(addr, addr), 2**62))
                if change == "left":
                    loop_thread.run(registry.deregister(record))
                events, err = turn.result(timeout=30)
                assert err is None, (change, err)
                assert [t for e in events for t in e.delta.token_ids] == [11, 12]
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)


class BusyWorker(FakeWorker):
    """Answers probes late (a saturated host) while its status stream keeps pushing as long
    as `pushing` is set: alive and busy, then silent."""

    def __init__(self, *args, probe_delay_s: float) -> None:
        super().__init__(*args)
        self.probe_delay_s = 0.0
        self.late_delay_s = probe_delay_s
        self.pushing = asyncio.Event()

    async def GetInfo(self, request, context):
        await asyncio.sleep(self.probe_delay_s)
        return await super().GetInfo(request, context)

    async def WatchStatus(self, request, context):
        while True:
            await self.pushing.wait()
            yield await self.GetStatus(request, context)
            await asyncio.sleep(0.02)


def test_a_busy_worker_that_pushes_status_is_not_marked_down(loop_thread, tiny_spec) -> None:
    """A probe that times out takes a worker down only when it pushed no status within the
    probe timeout either: late probes from a saturated host are not a death."""
    from prefixgate.gateway.pool import WorkerPool
    from prefixgate.gateway.status import StatusFollower
    from prefixgate.registry import EmbeddedRegistry, WorkerRecord

    busy = BusyWorker("busy", tiny_spec.fingerprint, "ok", probe_delay_s=0.5)
    address, server = start_fake(loop_thread, busy)

    async def scenario() -> list[bool]:
        registry = EmbeddedRegistry()
        await registry.register(WorkerRecord("busy", address, tiny_spec.fingerprint), 60_000)
        pool = WorkerPool(registry, tiny_spec.fingerprint, connect_timeout_s=0.2)
        follower = StatusFollower(interval_ms=20)
        seen = []
        await pool.refresh()  # answers at once: up
        seen.append(pool.workers["busy"].up)
        busy.probe_delay_s = busy.late_delay_s
        busy.pushing.set()
        follower.sync(pool.workers.values())
        await asyncio.sleep(0.1)
        await pool.refresh()  # probe times out, status pushed 20 ms ago: kept up
        seen.append(pool.workers["busy"].up)
        busy.pushing.clear()
        await asyncio.sleep(0.3)
        await pool.refresh()  # probe times out and nothing pushed for 0.3 s: down
        seen.append(pool.workers["busy"].up)
        await follower.close()
        await pool.close()
        return seen

    try:
        assert loop_thread.run(scenario()) == [True, True, False]
    finally:
        loop_thread.run(server.stop(0))


def test_a_worker_address_nothing_answers_is_named_once(caplog) -> None:
    """A gateway given a wrong --worker address says so, naming it (once, not per probe)."""
    import logging
    import socket

    from prefixgate.gateway.pool import WorkerPool
    from prefixgate.registry import EmbeddedRegistry, WorkerRecord

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed

    async def scenario() -> None:
        registry = EmbeddedRegistry()
        await registry.register(WorkerRecord(address, address), lease_ms=2**62)
        pool = WorkerPool(registry, "fp", connect_timeout_s=0.5)
        for _ in range(3):
            await pool.refresh()
        assert not pool.healthy()
        await pool.close()

    with caplog.at_level(logging.WARNING, logger="prefixgate.gateway.pool"):
        asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records if address in r.getMessage()]
    assert len(said) == 1 and "not reachable" in said[0], said
