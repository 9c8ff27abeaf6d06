"""A follow-up sent at once, with no conversation id, finds its prefix cached (real gRPC,
tiny-random workers, a real Redis; the workers' events reach the gateways late, as under
load): routing predicts where the first turn's blocks went. A gateway with predictions
off, in the same fleet at the same moment, sends it to the other worker and misses."""

from __future__ import annotations

import asyncio

import grpc

from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.routing import LoadSnapshot, Router, RoutingConfig, make_turn
from prefixgate.radix import BlockHasher
from prefixgate.registry import RedisRegistry, WorkerRecord
from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from prefixgate.workerapi.events import EventLog, RedisPublisher
from tests.helpers import start_worker, wait_for

EVENT_DELAY_S = 3.0  # the workers publish their KV events this late
BLOCK = 16


def _start_gateway(loop_thread, spec, url: str, routing: RoutingConfig, index: PrefixIndex):
    from prefixgate.gateway.server import GatewayConfig, serve

    config = GatewayConfig(block_size=BLOCK, drain_seconds=1, routing=routing)

    async def start():
        stop = asyncio.Event()
        started = asyncio.get_running_loop().create_future()
        asyncio.create_task(serve(spec, RedisRegistry(url), config, stop, started, index))
        return await started, stop

    port, stop = loop_thread.run(start())
    return f"127.0.0.1:{port}", stop


def _chat(stub, ids: list[int], conversation_id: str = "") -> chat_pb2.ChatFinal:
    req = chat_pb2.ChatRequest(conversation_id=conversation_id,
                               sampling=common_pb2.SamplingParams(max_tokens=4))
    req.prompt_token_ids.token_ids.extend(ids)
    events = list(stub.Chat(req, timeout=60))
    return events[-1].final, [t for e in events if e.HasField("delta") for t in e.delta.token_ids]


def _split_conversation_id(prompt: list[int], hasher: BlockHasher,
                           index: PrefixIndex) -> tuple[str, str]:
    """A conversation id whose turn goes, on idle workers, to another worker than the same
    prompt without an id (the tie-breakers differ, given how full `index` says each
    worker's cache is): returns (id, the worker it picks)."""
    twin = PrefixIndex()  # same occupancy as the gateway's index, nothing of `prompt`
    for n, wid in enumerate(("w0", "w1")):
        twin.reset_worker(wid, 1)
        count = index.num_owned_blocks(wid)
        if count:
            twin.stored(wid, 1, None, [10**6 * (n + 1) + i for i in range(count)])
    router = Router(RoutingConfig(), twin)
    workers = [LoadSnapshot("w0"), LoadSnapshot("w1")]
    anonymous = router.decide(workers, make_turn(prompt, hasher)).ranked[0].worker_id
    for i in range(100):
        picked = router.decide(workers, make_turn(prompt, hasher, f"c{i}")).ranked[0].worker_id
        if picked != anonymous:
            return f"c{i}", picked
    raise AssertionError("no conversation id splits the tie")


def test_follow_up_sent_at_once_hits_the_cache(loop_thread, tiny_spec, tiny_model,
                                               redis_flush) -> None:
    stops, pubs, addresses = [], [], []
    for wid in ("w0", "w1"):
        log = EventLog()
        address, stop = start_worker(loop_thread, tiny_spec, tiny_model, wid, events=log,
                                     block_size=BLOCK)
        pub = RedisPublisher(log, RedisRegistry(redis_flush),
                             WorkerRecord(wid, address, tiny_spec.fingerprint),
                             lease_ms=30_000, flush_interval_s=EVENT_DELAY_S)
        loop_thread.spawn(pub.run(stop))
        stops.append(stop)
        pubs.append(pub)
        addresses.append(address)
    wait_for(lambda: all(p.connected for p in pubs), what="workers to register")
    on_index, off_index = PrefixIndex(), PrefixIndex(prediction_ttl_s=0)
    # Identical workers ranked alike (measured_rates off), so the tie-breakers below decide.
    on, on_stop = _start_gateway(loop_thread, tiny_spec, redis_flush,
                                 RoutingConfig(measured_rates=False), on_index)
    off, off_stop = _start_gateway(loop_thread, tiny_spec, redis_flush,
                                   RoutingConfig(prediction_ttl_s=0, measured_rates=False),
                                   off_index)
    stops += [on_stop, off_stop]
    hasher = BlockHasher(BLOCK, model_fingerprint=tiny_spec.fingerprint)
    try:
        channels = [grpc.insecure_channel(a) for a in (on, off)]
        stub_on, stub_off = (chat_pb2_grpc.ChatServiceStub(c) for c in channels)
        for stub in (stub_on, stub_off):
            wait_for(lambda s=stub: s.ListModels(chat_pb2.ListModelsRequest())
                     .models[0].num_workers == 2, what="gateways to see both workers")
        def settled() -> bool:  # every event out, both gateways agree, nothing expected
            return on_index.num_expected_blocks() == 0 and all(
                on_index.num_owned_blocks(w) == off_index.num_owned_blocks(w) for w in ("w0", "w1"))

        # Warm-up, one turn on each worker (the second goes to the emptier cache), so that
        # the caches are equally full and the tie-breakers below are known; the events
        # confirming its predictions give the measured confidence.
        for n in range(2):
            _chat(stub_on, [(i * 11 + n) % 200 + 20 for i in range(10 * BLOCK)], f"warm-{n}")
            wait_for(settled, timeout=EVENT_DELAY_S * 3, what="the warm-up's events")
        assert on_index.num_owned_blocks("w0") == on_index.num_owned_blocks("w1") > 0
        assert on_index.prediction_confidence > 0.9

        # Without predictions first: its first turn and its missing follow-up add as many
        # blocks to each worker, so the caches are equally full again for the second run.
        for stub, index, seed, predicting in ((stub_off, off_index, 5, False),
                                              (stub_on, on_index, 3, True)):
            wait_for(settled, timeout=EVENT_DELAY_S * 3, what="the fleet to settle")
            prompt = [(i * seed) % 230 + 20 for i in range(10 * BLOCK + 3)]
            cid, first_worker = _split_conversation_id(prompt, hasher, index)
            first, _ = _chat(stub, prompt, cid)
            assert first.worker_id == first_worker and first.usage.cached_tokens == 0
            # At once, no conversation id: the events of the first turn are not out yet.
            follow, _ = _chat(stub, prompt + [7, 8, 9])
            if predicting:
                assert follow.worker_id == first.worker_id
                assert follow.usage.cached_tokens >= 10 * BLOCK
                assert follow.predicted_cached_tokens >= 10 * BLOCK
                assert follow.best_predicted_cached_tokens == follow.predicted_cached_tokens
            else:  # blind to its own decision: the race the prediction closes
                assert follow.worker_id != first.worker_id
                assert follow.usage.cached_tokens == 0 and follow.predicted_cached_tokens == 0
        # The workers measure their service rates on these turns and report them.
        for address in addresses:
            with grpc.insecure_channel(address) as ch:
                status = worker_pb2_grpc.WorkerServiceStub(ch).GetStatus(
                    worker_pb2.GetStatusRequest(), timeout=10)
            assert status.prefill_tokens_per_s > 0 and status.decode_step_s > 0
        for c in channels:
            c.close()
    finally:
        for stop in stops:
            loop_thread.loop.call_soon_threadsafe(stop.set)
