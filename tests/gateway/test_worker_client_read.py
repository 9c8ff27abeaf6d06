"""A worker's server-streaming call read message by message (`read()`, what the gateway's
turn path uses on Generate: workerapi/client.py, gateway/resume.py), in process and over
real gRPC alike: each message, then `grpc.aio.EOF`; a refusal as the AioRpcError a gRPC
call raises; a call cancelled after its final message ends the worker's side."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from prefixgate.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from prefixgate.workerapi.calls import Refused
from prefixgate.workerapi.client import GrpcWorkerClient, InProcessWorkerClient


def _events(n: int) -> list[worker_pb2.GenerateEvent]:
    chunks = [worker_pb2.GenerateEvent(chunk=worker_pb2.GenerateChunk(token_ids=[t]))
              for t in range(n)]
    return [*chunks, worker_pb2.GenerateEvent(final=worker_pb2.GenerateFinal(
        usage=common_pb2.Usage(completion_tokens=n)))]


class _Service:
    """Call-level Generate (workerapi/calls.py form): `n` chunks and a final event, or a
    refusal; remembers whether its generator was closed."""

    def __init__(self, n: int = 2, refuse: bool = False, hold_open: bool = False) -> None:
        self.n, self.refuse, self.hold_open = n, refuse, hold_open
        self.closed = asyncio.Event()

    async def generate(self, request, scope):
        try:
            if self.refuse:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "scripted refusal", True)
            for ev in _events(self.n):
                yield ev
            if self.hold_open:  # a worker slow to end its call after the final event
                await asyncio.Event().wait()
        finally:
            self.closed.set()


class _GrpcService(worker_pb2_grpc.WorkerServiceServicer):
    """The same over gRPC (the other RPCs: UNIMPLEMENTED)."""

    def __init__(self, inner: _Service) -> None:
        self.inner = inner

    async def Generate(self, request, context):
        async for ev in self.inner.generate(request, None):
            yield ev


async def _read_all(call) -> list:
    out = []
    while (ev := await call.read()) is not grpc.aio.EOF:
        out.append(ev)
    return out


def test_in_process_read_gives_each_message_then_eof() -> None:
    async def main():
        client = InProcessWorkerClient(_Service(n=3))
        got = await _read_all(client.Generate(worker_pb2.GenerateRequest()))
        assert got == _events(3)

    asyncio.run(main())


def test_in_process_read_raises_a_refusal_as_grpc_would() -> None:
    async def main():
        client = InProcessWorkerClient(_Service(refuse=True))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.Generate(worker_pb2.GenerateRequest()).read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "scripted refusal"

    asyncio.run(main())


def test_in_process_cancel_after_the_final_event_closes_the_worker_side() -> None:
    async def main():
        service = _Service(n=1, hold_open=True)
        call = InProcessWorkerClient(service).Generate(worker_pb2.GenerateRequest())
        while not (await call.read()).HasField("final"):
            pass
        call.cancel()
        await asyncio.wait_for(service.closed.wait(), 5)

    asyncio.run(main())


def test_grpc_read_matches_in_process_and_cancel_ends_the_worker_side(loop_thread) -> None:
    async def main():
        done = _Service(n=2)
        held = _Service(n=1, hold_open=True)
        servers, clients = [], []
        for service in (done, held):
            server = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServiceServicer_to_server(_GrpcService(service), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            servers.append(server)
            clients.append(GrpcWorkerClient(grpc.aio.insecure_channel(f"127.0.0.1:{port}")))
        try:
            assert await _read_all(clients[0].Generate(worker_pb2.GenerateRequest())) \
                == _events(2)
            call = clients[1].Generate(worker_pb2.GenerateRequest())
            while not (await call.read()).HasField("final"):
                pass
            call.cancel()
            await asyncio.wait_for(held.closed.wait(), 5)
        finally:
            for c in clients:
                await c.close()
            for s in servers:
                await s.stop(0)

    loop_thread.run(main())
