"""Prefix routing end to end (tiny-random, real gRPC on loopback, real redis-server): worker
KV events reach the gateway's index (WatchEvents without Redis, the Redis stream with it),
the next conversation with the same prefix goes to the worker holding it, two gateways on
one Redis agree, and failover before the first token is invisible."""

from __future__ import annotations

import asyncio
import time

import grpc

from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.routing import RoutingConfig
from prefixgate.radix import BlockHasher
from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2
from tests.helpers import start_worker, wait_for

BLOCK = 16


def start_gateway_with_index(loop_thread, spec, workers=(), registry=None, **config):
    """A gateway whose routing index the test can inspect; returns (address, stop, index)."""
    from prefixgate.gateway.server import GatewayConfig, serve
    from prefixgate.registry import EmbeddedRegistry

    index = PrefixIndex()
    config.setdefault("refresh_interval_s", 0.3)
    cfg = GatewayConfig(static_workers=tuple(workers), drain_seconds=1, **config)

    async def start():
        stop = asyncio.Event()
        started = asyncio.get_running_loop().create_future()
        asyncio.create_task(serve(spec, registry or EmbeddedRegistry(), cfg, stop, started,
                                  index=index))
        return await started, stop

    port, stop = loop_thread.run(start())
    return f"127.0.0.1:{port}", stop, index


def chat(stub, token_ids, conversation_id, max_tokens=4, timeout=60):
    req = chat_pb2.ChatRequest(conversation_id=conversation_id,
                               sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
    req.prompt_token_ids.token_ids.extend(token_ids)
    return list(stub.Chat(req, timeout=timeout))[-1].final


def wait_workers(stub, n):
    wait_for(lambda: stub.ListModels(chat_pb2.ListModelsRequest(), timeout=5).models[0]
             .num_workers == n, what=f"gateway to see {n} workers")


def prompts(n, length=80):
    return [[3 + (7 * i + j) % 250 for j in range(length)] for i in range(n)]


def owners(index, hasher, ids):
    return index.match(hasher.hash_blocks(ids)).cached_blocks


def test_events_reach_the_index_and_route_the_next_conversation(loop_thread, tiny_spec,
                                                                 tiny_model) -> None:
    a, a_stop = start_worker(loop_thread, tiny_spec, tiny_model, "a")
    b, b_stop = start_worker(loop_thread, tiny_spec, tiny_model, "b")
    gw, g_stop, index = start_gateway_with_index(loop_thread, tiny_spec, [a, b])
    hasher = BlockHasher(BLOCK, model_fingerprint=tiny_spec.fingerprint)
    try:
        with grpc.insecure_channel(gw) as ch:
            stub = chat_pb2_grpc.ChatServiceStub(ch)
            wait_workers(stub, 2)
            for i, p in enumerate(prompts(3)):
                served = chat(stub, p, f"first-{i}").worker_id
                # The worker's events list it as the owner of the prompt's full blocks.
                wait_for(lambda p=p, s=served: owners(index, hasher, p).get(s, 0) >= 80 // BLOCK,
                         what="the serving worker's blocks in the gateway index")
                # A new conversation with the same prefix goes to that worker and hits.
                final = chat(stub, p + [7, 8, 9], f"second-{i}")
                assert final.worker_id == served
                assert final.usage.cached_tokens >= 80 // BLOCK * BLOCK
            # Counted: expected and reported cached tokens per worker and policy.
            from prometheus_client import REGISTRY

            expected = REGISTRY.get_sample_value(
                "prefixgate:router_expected_cached_tokens_total",
                {"worker": final.worker_id, "policy": "prefix"})
            assert expected is not None and expected >= 80 // BLOCK * BLOCK
            # A flushed cache is forgotten by the gateway too.
            import prefixgate.v1.worker_pb2 as wpb
            import prefixgate.v1.worker_pb2_grpc as wgrpc

            for addr in (a, b):
                with grpc.insecure_channel(addr) as wch:
                    wgrpc.WorkerServiceStub(wch).FlushCache(wpb.FlushCacheRequest(), timeout=5)
            wait_for(lambda: index.num_blocks == 0, what="flushed blocks to leave the index")
    finally:
        for stop in (g_stop, a_stop, b_stop):
            loop_thread.loop.call_soon_threadsafe(stop.set)


def test_failover_from_the_prefix_holder_is_invisible(loop_thread, tiny_spec, tiny_model) -> None:
    from prefixgate.gateway import metrics

    a, a_stop = start_worker(loop_thread, tiny_spec, tiny_model, "fa")
    b, b_stop = start_worker(loop_thread, tiny_spec, tiny_model, "fb")
    gw, g_stop, index = start_gateway_with_index(loop_thread, tiny_spec, [a, b],
                                                 refresh_interval_s=60)
    hasher = BlockHasher(BLOCK, model_fingerprint=tiny_spec.fingerprint)
    try:
        with grpc.insecure_channel(gw) as ch:
            stub = chat_pb2_grpc.ChatServiceStub(ch)
            wait_workers(stub, 2)
            p = prompts(1)[0]
            served = chat(stub, p, "holder").worker_id
            wait_for(lambda: owners(index, hasher, p).get(served, 0) >= 5, what="index")
            # The holder dies; the gateway still ranks it first (no refresh for 60 s).
            loop_thread.loop.call_soon_threadsafe((a_stop if served == "fa" else b_stop).set)
            time.sleep(1.5)
            before = metrics.FAILOVERS._value.get()
            final = chat(stub, p + [5, 6], "holder")
            assert final.worker_id == ("fb" if served == "fa" else "fa")
            assert final.usage.completion_tokens > 0
            assert metrics.FAILOVERS._value.get() == before + 1
    finally:
        for stop in (g_stop, a_stop, b_stop):
            loop_thread.loop.call_soon_threadsafe(stop.set)


def start_redis_worker(loop_thread, spec, model, worker_id, url, lease_ms=2000):
    """A worker registered in Redis that publishes its KV events there (as `prefixgate
    worker --redis-url` does)."""
    from prefixgate.registry import RedisRegistry, WorkerRecord
    from prefixgate.workerapi.events import EventLog, RedisPublisher

    events = EventLog()
    address, stop = start_worker(loop_thread, spec, model, worker_id, events=events)
    pub = RedisPublisher(events, RedisRegistry(url),
                         WorkerRecord(worker_id, address, spec.fingerprint), lease_ms)
    loop_thread.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(pub.run(stop)))
    return address, stop


def test_two_gateways_on_one_redis_route_alike(loop_thread, tiny_spec, tiny_model,
                                               redis_flush) -> None:
    from prefixgate.registry import RedisRegistry

    a, a_stop = start_redis_worker(loop_thread, tiny_spec, tiny_model, "ra", redis_flush)
    b, b_stop = start_redis_worker(loop_thread, tiny_spec, tiny_model, "rb", redis_flush)
    gw1, s1, index1 = start_gateway_with_index(loop_thread, tiny_spec,
                                               registry=RedisRegistry(redis_flush))
    gw2, s2, index2 = start_gateway_with_index(loop_thread, tiny_spec,
                                               registry=RedisRegistry(redis_flush))
    hasher = BlockHasher(BLOCK, model_fingerprint=tiny_spec.fingerprint)
    try:
        with grpc.insecure_channel(gw1) as c1, grpc.insecure_channel(gw2) as c2:
            st1, st2 = chat_pb2_grpc.ChatServiceStub(c1), chat_pb2_grpc.ChatServiceStub(c2)
            wait_workers(st1, 2)
            wait_workers(st2, 2)
            for i, p in enumerate(prompts(3)):
                served = chat(st1, p, f"g1-{i}").worker_id
                for index in (index1, index2):  # both learn it from the Redis stream
                    wait_for(lambda p=p, s=served, ix=index: owners(ix, hasher, p).get(s, 0) >= 5,
                             what="both gateways to index the turn")
                final = chat(st2, p + [4, 4], f"g2-{i}")
                assert final.worker_id == served and final.usage.cached_tokens >= 80
    finally:
        for stop in (s1, s2, a_stop, b_stop):
            loop_thread.loop.call_soon_threadsafe(stop.set)


def test_redis_restart_gateway_keeps_routing_and_resyncs(loop_thread, tiny_spec, tiny_model,
                                                         own_redis) -> None:
    """Redis goes away mid-run: the gateway reports degraded (health and metric), keeps
    routing from its index; Redis comes back empty: the index resyncs from the workers."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from prefixgate.gateway import metrics
    from prefixgate.registry import RedisRegistry

    url, start_redis, stop_redis = own_redis
    a, a_stop = start_redis_worker(loop_thread, tiny_spec, tiny_model, "xa", url, lease_ms=900)
    b, b_stop = start_redis_worker(loop_thread, tiny_spec, tiny_model, "xb", url, lease_ms=900)
    gw, g_stop, index = start_gateway_with_index(loop_thread, tiny_spec,
                                                 registry=RedisRegistry(url, timeout_s=1))
    hasher = BlockHasher(BLOCK, model_fingerprint=tiny_spec.fingerprint)

    def status(service: str) -> int:
        with grpc.insecure_channel(gw) as hc:
            return health_pb2_grpc.HealthStub(hc).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5).status

    serving = health_pb2.HealthCheckResponse.SERVING
    try:
        with grpc.insecure_channel(gw) as ch:
            stub = chat_pb2_grpc.ChatServiceStub(ch)
            wait_workers(stub, 2)
            p = prompts(1)[0]
            served = chat(stub, p, "before").worker_id
            wait_for(lambda: owners(index, hasher, p).get(served, 0) >= 5, what="index")
            assert status("prefixgate.registry") == serving
            stop_redis()
            wait_for(lambda: status("prefixgate.registry") != serving, what="degraded health")
            assert status("") == serving and metrics.REGISTRY_DEGRADED._value.get() == 1
            # Routing goes on from the local index: the holder still gets the prefix.
            final = chat(stub, p + [9, 9], "during")
            assert final.worker_id == served and final.usage.cached_tokens >= 64
            rebuilds = metrics.RESYNCS.labels("redis")._value.get()
            start_redis()  # empty: leases, blocks and the stream are gone
            wait_for(lambda: status("prefixgate.registry") == serving, timeout=30,
                     what="health to recover")
            # The workers register again and republish their caches: the index converges.
            wait_for(lambda: owners(index, hasher, p).get(served, 0) >= 5, timeout=30,
                     what="index to resync")
            assert metrics.RESYNCS.labels("redis")._value.get() > rebuilds
            wait_workers(stub, 2)
            assert chat(stub, p + [8], "after").worker_id == served
            # New events flow through the new stream.
            q = prompts(2)[1]
            served_q = chat(stub, q, "new-after").worker_id
            wait_for(lambda: owners(index, hasher, q).get(served_q, 0) >= 5, what="new events")
    finally:
        for stop in (g_stop, a_stop, b_stop):
            loop_thread.loop.call_soon_threadsafe(stop.set)


def test_shared_system_prompt_spreads_across_real_workers(loop_thread, tiny_spec,
                                                          tiny_model) -> None:
    """New conversations behind one system prompt, one at a time on idle workers: after
    the prompt is shared by two conversations the rest spread over both workers, and each
    conversation's next turn returns to its worker with its prefix cached."""
    a, a_stop = start_worker(loop_thread, tiny_spec, tiny_model, "sa")
    b, b_stop = start_worker(loop_thread, tiny_spec, tiny_model, "sb")
    # Identical workers: their live (pushed) measured rates are noise here, and would
    # outweigh the one block of prefix that tells the conversations apart.
    gw, g_stop, index = start_gateway_with_index(
        loop_thread, tiny_spec, [a, b], routing=RoutingConfig(measured_rates=False))
    hasher = BlockHasher(BLOCK, model_fingerprint=tiny_spec.fingerprint)
    system = [3 + (5 * j) % 200 for j in range(96)]
    try:
        with grpc.insecure_channel(gw) as ch:
            stub = chat_pb2_grpc.ChatServiceStub(ch)
            wait_workers(stub, 2)
            placed = {}
            for c in range(6):
                prompt = system + [10 + c] * 20
                placed[c] = chat(stub, prompt, f"conv-{c}").worker_id
                wait_for(lambda p=prompt, w=placed[c]: owners(index, hasher, p).get(w, 0) >= 7,
                         what="the turn's blocks in the index")
            assert set(placed.values()) == {"sa", "sb"}, placed
            for c in range(6):
                final = chat(stub, system + [10 + c] * 20 + [7, 7, 7, 7], f"conv-{c}")
                assert final.worker_id == placed[c] and final.usage.cached_tokens >= 112
    finally:
        for stop in (g_stop, a_stop, b_stop):
            loop_thread.loop.call_soon_threadsafe(stop.set)


def test_a_worker_claiming_blocks_it_never_stored_stops_drawing_a_tenants_turns(
        loop_thread, tiny_spec, tiny_model) -> None:
    """Ownership events for worker "lb" claim the whole prompts of 8 conversations of a
    tenant that it never stored (what a stolen key can publish). The first turn drawn by
    the claim finds nothing cached there; from then on lb's claims count for nothing (its
    confidence is 0, in the gateway's metrics), so it draws none of the other 7 by them,
    while the honest worker's real blocks keep drawing their follow-ups."""
    from prefixgate.gateway import metrics

    a, a_stop = start_worker(loop_thread, tiny_spec, tiny_model, "la")
    b, b_stop = start_worker(loop_thread, tiny_spec, tiny_model, "lb")
    gw, g_stop, index = start_gateway_with_index(
        loop_thread, tiny_spec, [a, b], routing=RoutingConfig(measured_rates=False))
    hasher = BlockHasher(BLOCK, model_fingerprint=tiny_spec.fingerprint)
    forged = [[3 + (11 * i + 3 * j) % 240 for j in range(96)] for i in range(8)]
    try:
        with grpc.insecure_channel(gw) as ch:
            stub = chat_pb2_grpc.ChatServiceStub(ch)
            wait_workers(stub, 2)
            wait_for(lambda: index.epoch_of("lb") >= 0, what="the index to follow lb")

            async def forge() -> None:  # applied on the gateway's loop, as an event is
                for ids in forged:
                    index.stored("lb", index.epoch_of("lb"), None, hasher.hash_blocks(ids))

            loop_thread.run(forge())
            assert all(owners(index, hasher, ids).get("lb", 0) == 6 for ids in forged)
            finals = [chat(stub, ids + [5, 6], f"tenant-{i}") for i, ids in enumerate(forged)]
            served = [f.worker_id for f in finals]
            assert served[0] == "lb" and finals[0].usage.cached_tokens == 0
            assert served[1:].count("lb") == 0, served  # the claims draw nothing more
            assert metrics.WORKER_CONFIDENCE.labels("lb")._value.get() == 0.0
            assert metrics.UNCONFIRMED_CLAIMS.labels("lb")._value.get() >= 96
            # The honest worker's own blocks still draw their conversations' next turns.
            for i in (1, 2):
                wait_for(lambda i=i: owners(index, hasher, forged[i] + [5, 6]).get("la", 0)
                         >= 6, what="la's blocks in the index")
                final = chat(stub, forged[i] + [5, 6, 7, 7, 7, 7], f"tenant-{i}")
                assert final.worker_id == "la" and final.usage.cached_tokens >= 96
    finally:
        for stop in (g_stop, a_stop, b_stop):
            loop_thread.loop.call_soon_threadsafe(stop.set)
