"""The gateway's retry rule (issue 13): a failure that belongs to the request goes back to
the client, is never retried elsewhere and never marks the worker down; any other failure
before the first token is retried at most once; only transport failures mark a worker
down; a registry that comes back empty keeps live workers."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from prefixgate.gateway.pool import WorkerPool
from prefixgate.registry import EmbeddedRegistry, WorkerRecord
from prefixgate.v1 import chat_pb2, chat_pb2_grpc
from prefixgate.wire.protocol import REQUEST_SCOPED
from tests.gateway.test_gateway_failover import FakeWorker, start_fake
from tests.helpers import start_gateway, wait_for


class ScriptedWorker(FakeWorker):
    """FakeWorker with more Generate scripts: "poison" (INTERNAL marked as the request's),
    "internal" (INTERNAL, unattributed), "unavailable" (transport-like failure)."""

    async def WatchStatus(self, request, context):  # the gateway polls GetStatus instead
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no status stream")
        yield

    async def Generate(self, request, context):
        if self.mode in ("poison", "internal", "unavailable"):
            self.generate_calls += 1
            code = grpc.StatusCode.UNAVAILABLE if self.mode == "unavailable" \
                else grpc.StatusCode.INTERNAL
            await context.abort(code, f"scripted {self.mode}",
                                REQUEST_SCOPED if self.mode == "poison" else ())
        async for ev in super().Generate(request, context):
            yield ev


@pytest.fixture
def scripted(loop_thread, tiny_spec):
    started = []

    def make(worker_id: str, mode: str):
        fake = ScriptedWorker(worker_id, tiny_spec.fingerprint, mode)
        address, server = start_fake(loop_thread, fake)
        started.append(server)
        return fake, address

    yield make
    for server in started:
        loop_thread.run(server.stop(0))


def _turn(stub) -> grpc.RpcError | None:
    req = chat_pb2.ChatRequest(conversation_id="c")
    req.prompt_token_ids.token_ids.extend(range(3, 40))
    try:
        list(stub.Chat(req, timeout=20))
    except grpc.RpcError as exc:
        return exc
    return None


def _workers(stub) -> int:
    return stub.ListModels(chat_pb2.ListModelsRequest()).models[0].num_workers


def test_request_scoped_failure_is_returned_not_retried(loop_thread, tiny_spec, scripted) -> None:
    fakes = [scripted(f"w{i}", "poison") for i in range(3)]
    gw, stop = start_gateway(loop_thread, tiny_spec, [a for _, a in fakes])
    try:
        with grpc.insecure_channel(gw) as ch:
            stub = chat_pb2_grpc.ChatServiceStub(ch)
            wait_for(lambda: _workers(stub) == 3, what="gateway to see the workers")
            for _ in range(3):
                exc = _turn(stub)
                assert exc is not None and exc.code() == grpc.StatusCode.INTERNAL
                assert "scripted poison" in exc.details()
            # One worker tried per turn, and all three still listed.
            assert sum(f.generate_calls for f, _ in fakes) == 3
            assert _workers(stub) == 3
    finally:
        loop_thread.run(stop.set() or asyncio.sleep(0))


def test_unattributed_failure_is_retried_once(loop_thread, tiny_spec, scripted) -> None:
    fakes = [scripted(f"w{i}", "internal") for i in range(3)]
    gw, stop = start_gateway(loop_thread, tiny_spec, [a for _, a in fakes])
    try:
        with grpc.insecure_channel(gw) as ch:
            stub = chat_pb2_grpc.ChatServiceStub(ch)
            wait_for(lambda: _workers(stub) == 3, what="gateway to see the workers")
            exc = _turn(stub)
            assert exc is not None and exc.code() == grpc.StatusCode.UNAVAILABLE
            assert "retrying is safe" in exc.details()
            assert sum(f.generate_calls for f, _ in fakes) == 2  # first try + one retry
            assert _workers(stub) == 3  # INTERNAL is not a transport failure
    finally:
        loop_thread.run(stop.set() or asyncio.sleep(0))


def test_transport_failure_marks_down_and_retries(loop_thread, tiny_spec, scripted) -> None:
    bad, bad_addr = scripted("a-bad", "unavailable")
    good, good_addr = scripted("b-good", "ok")
    gw, stop = start_gateway(loop_thread, tiny_spec, [bad_addr, good_addr],
                             refresh_interval_s=60)
    try:
        with grpc.insecure_channel(gw) as ch:
            stub = chat_pb2_grpc.ChatServiceStub(ch)
            wait_for(lambda: _workers(stub) == 2, what="gateway to see the workers")
            outcomes = [_turn(stub) for _ in range(4)]
            assert outcomes == [None] * 4
            assert bad.generate_calls <= 1 and _workers(stub) == 1
    finally:
        loop_thread.run(stop.set() or asyncio.sleep(0))


def test_empty_registry_keeps_live_workers(loop_thread, tiny_spec, scripted) -> None:
    """A registry that lost its records (Redis restarted empty) drops nobody who still
    answers, until `absent_grace_s`; a worker that is also down goes at once."""
    _, live = scripted("live", "ok")
    registry = EmbeddedRegistry()

    async def scenario() -> list[list[str]]:
        pool = WorkerPool(registry, tiny_spec.fingerprint, absent_grace_s=0.5)
        await registry.register(WorkerRecord("live", live, tiny_spec.fingerprint), 60_000)
        await registry.register(WorkerRecord("dead", "127.0.0.1:1", tiny_spec.fingerprint),
                                60_000)
        seen = []
        await pool.refresh()
        seen.append([w.worker_id for w in pool.healthy()])
        await registry.deregister(await _record(registry, "live"))
        await registry.deregister(await _record(registry, "dead"))
        await pool.refresh()
        seen.append([w.worker_id for w in pool.healthy()])
        seen.append(sorted(pool.workers))
        await asyncio.sleep(0.6)
        await pool.refresh()
        seen.append(sorted(pool.workers))
        await pool.close()
        return seen

    assert loop_thread.run(scenario()) == [["live"], ["live"], ["live"], []]


async def _record(registry, worker_id: str) -> WorkerRecord:
    return next(r for r in await registry.list_workers() if r.worker_id == worker_id)
