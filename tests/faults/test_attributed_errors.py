"""An engine error that belongs to one request, end to end over real gRPC (gateway and two
workers on loopback, one model failure injected on a poison token): the poison request
fails alone with INTERNAL saying so, is tried on one worker only, and every concurrent
valid stream on both workers succeeds; no worker is marked down, no block leaks."""

from __future__ import annotations

import asyncio

import grpc

from prefixgate.v1 import chat_pb2, chat_pb2_grpc
from tests.faults.fleet import chat_request, concurrently, counts, report, turn
from tests.helpers import make_engine, start_gateway, wait_for

POISON = [250, 7, 251, 7, 252, 7]  # a prompt run the injected model failure reacts to


def _poisoned(input_ids) -> bool:
    ids = list(input_ids)
    return any(ids[i:i + len(POISON)] == POISON for i in range(len(ids) - len(POISON) + 1))


def _start_worker(loop_thread, spec, model, worker_id: str):
    from prefixgate.workerapi.events import EventLog
    from prefixgate.workerapi.server import WorkerConfig, WorkerService, serve

    events = EventLog()
    engine = make_engine(spec, model, event_sink=events, num_blocks=256)
    forward = engine.runner.forward
    failures: list[int] = []

    def faulty(input_ids, *args, **kwargs):
        if _poisoned(input_ids):
            failures.append(len(input_ids))
            raise RuntimeError("injected model failure")
        return forward(input_ids, *args, **kwargs)

    engine.runner.forward = faulty
    service = WorkerService(engine, spec, WorkerConfig(worker_id=worker_id, drain_seconds=1),
                            vocab_size=engine.tokenizer.vocab_size, events=events)

    async def start():
        stop = asyncio.Event()
        started = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(service, stop, started))
        return await started, (stop, task)

    port, stop = loop_thread.run(start())
    return f"127.0.0.1:{port}", stop, engine, failures


def test_engine_error_fails_only_its_request(loop_thread, tiny_spec, tiny_model) -> None:
    workers = [_start_worker(loop_thread, tiny_spec, tiny_model, f"aw{i}") for i in range(2)]
    gw, gw_stop = start_gateway(loop_thread, tiny_spec, [w[0] for w in workers])
    try:
        with grpc.insecure_channel(gw) as ch:
            stub = chat_pb2_grpc.ChatServiceStub(ch)
            models = lambda: stub.ListModels(chat_pb2.ListModelsRequest()).models[0]  # noqa: E731
            wait_for(lambda: models().num_workers == 2, what="gateway to see the workers")
            valid = [("valid", chat_request(f"v{i}", [3 + (i * 5 + j) % 200 for j in range(48)],
                                            40)) for i in range(12)]
            poison = [("poison", chat_request(f"p{i}", [3, 4, 5, *POISON, 6, i], 40))
                      for i in range(3)]
            cases = valid[:6] + poison + valid[6:]
            outcomes = concurrently(lambda kind, r: turn(stub, r, 60), cases)
            num_workers_after = models().num_workers
        got = {"valid": [], "poison": []}
        for (kind, _), o in zip(cases, outcomes, strict=True):
            got[kind].append(o)
        report("engine error on one request beside 12 valid streams",
               valid=counts(got["valid"]), poison=counts(got["poison"]),
               workers_that_saw_poison=sum(bool(w[3]) for w in workers),
               workers_listed_after=num_workers_after)
        assert counts(got["valid"]) == {"OK": 12}
        assert counts(got["poison"]) == {"INTERNAL": 3}
        assert all("alone" in o.details and "not retried" in o.details for o in got["poison"])
        assert num_workers_after == 2
        # Each poison request reached one worker only (no retry across the fleet).
        assert sum(len(w[3]) for w in workers) >= 3
        for w in workers:
            w[2].check_integrity()
    finally:
        loop_thread.run(_set(gw_stop))
        for w in workers:  # stopped (engine thread joined) before the integrity check
            loop_thread.run(_stop(*w[1]))


async def _set(event: asyncio.Event) -> None:
    event.set()


async def _stop(event: asyncio.Event, task: asyncio.Task) -> None:
    event.set()
    await task
