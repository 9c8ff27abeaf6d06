"""Faults: a rogue worker and forged ownership in a shared Redis (real redis-server, real
workers and gateways over gRPC on loopback, tiny-random).

Both attacks worked before workers proved their identity (issue 13: a rogue worker got 30
of 30 turns; ownership forged with another worker's epoch steered 8 of 8). Each test also
runs a gateway without the keyring beside the one with it, to show the attack is real in
the test and that only the keyring stops it.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter

import grpc
import pytest
import redis

from prefixgate.gateway.index import PrefixIndex
from prefixgate.radix import BlockHasher
from prefixgate.registry import RedisRegistry, WorkerRecord
from prefixgate.security.auth import AuthConfig
from prefixgate.security.identity import Keyring
from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from prefixgate.wire.events import OwnershipEvent
from tests.helpers import start_worker, wait_for

BLOCK = 16


@pytest.fixture
def keyring_file(tmp_path) -> str:
    path = tmp_path / "keyring"
    path.write_text("".join(f"{w} {secrets.token_hex(32)}\n" for w in ("w0", "w1")))
    return str(path)


def _redis_worker(loop_thread, spec, model, worker_id, url, keyring=None):
    """A worker registered in Redis that publishes its KV events there, signing with its
    key when given a keyring (as `prefixgate worker --redis-url --worker-keyring`)."""
    from prefixgate.worker.events import EventLog, RedisPublisher

    events = EventLog()
    address, stop = start_worker(loop_thread, spec, model, worker_id, events=events)
    pub = RedisPublisher(events, RedisRegistry(url, keyring=keyring),
                         WorkerRecord(worker_id, address, spec.fingerprint), 2000)
    loop_thread.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(pub.run(stop)))
    return address, stop, events, pub


def _gateway(loop_thread, spec, url, keyring_file=""):
    """A gateway on `url` whose routing index the test can read: (address, stop, index)."""
    from prefixgate.gateway.server import GatewayConfig, serve

    index = PrefixIndex()
    cfg = GatewayConfig(drain_seconds=1, refresh_interval_s=0.3,
                        auth=AuthConfig(worker_keyring_file=keyring_file))

    async def start():
        stop = asyncio.Event()
        started = asyncio.get_running_loop().create_future()
        asyncio.create_task(serve(spec, RedisRegistry(url), cfg, stop, started, index=index))
        return await started, stop

    port, stop = loop_thread.run(start())
    return f"127.0.0.1:{port}", stop, index


def _num_workers(stub) -> int:
    return stub.ListModels(chat_pb2.ListModelsRequest(), timeout=5).models[0].num_workers


def _turn(stub, ids, conversation_id=""):
    req = chat_pb2.ChatRequest(conversation_id=conversation_id,
                               sampling=common_pb2.SamplingParams(max_tokens=2))
    req.prompt_token_ids.token_ids.extend(ids)
    return list(stub.Chat(req, timeout=60))[-1].final


def _prompts(n, salt, length=64):
    return [[3 + (salt * 31 + 7 * i + j) % 250 for j in range(length)] for i in range(n)]


def _stop_all(loop_thread, *stops):
    for stop in stops:
        loop_thread.loop.call_soon_threadsafe(stop.set)


def test_a_rogue_worker_without_a_valid_credential_gets_no_turns(
        loop_thread, tiny_spec, tiny_model, redis_flush, keyring_file) -> None:
    url, keys = redis_flush, Keyring.from_file(keyring_file)
    _, s0, _, _ = _redis_worker(loop_thread, tiny_spec, tiny_model, "w0", url, keys)
    _, s1, _, _ = _redis_worker(loop_thread, tiny_spec, tiny_model, "w1", url, keys)
    # The rogue: the public model fingerprint, a real worker process, no key at all.
    _, sr, rogue_events, _ = _redis_worker(loop_thread, tiny_spec, tiny_model, "rogue", url)
    # ... and one signing with a key the gateways do not hold.
    stranger = Keyring({"rogue-2": secrets.token_bytes(32)})
    _, sr2, rogue2_events, _ = _redis_worker(loop_thread, tiny_spec, tiny_model, "rogue-2",
                                             url, stranger)
    guarded, gstop, _ = _gateway(loop_thread, tiny_spec, url, keyring_file)
    open_gw, ostop, _ = _gateway(loop_thread, tiny_spec, url)
    try:
        with grpc.insecure_channel(guarded) as c, grpc.insecure_channel(open_gw) as o:
            stub, open_stub = chat_pb2_grpc.ChatServiceStub(c), chat_pb2_grpc.ChatServiceStub(o)
            # Without the keyring all four are routable: the rogues are really registered.
            wait_for(lambda: _num_workers(open_stub) == 4, what="the open gateway to list 4")
            wait_for(lambda: _num_workers(stub) == 2, what="the guarded gateway to list 2")
            served = Counter(_turn(stub, ids, f"c{i}").worker_id
                             for i, ids in enumerate(_prompts(30, salt=1)))
            assert served["rogue"] == served["rogue-2"] == 0
            assert sum(served.values()) == 30 and set(served) <= {"w0", "w1"}
            # Nothing ever reached the rogues' engines.
            assert rogue_events.snapshot()[1] == 0 and rogue2_events.snapshot()[1] == 0
    finally:
        _stop_all(loop_thread, gstop, ostop, s0, s1, sr, sr2)


def _forged_owner(index, hasher, ids) -> int:
    return index.match(hasher.hash_blocks(ids)).cached_blocks.get("w1", 0)


def test_forged_ownership_for_another_worker_steers_no_turns(
        loop_thread, tiny_spec, tiny_model, redis_flush, keyring_file) -> None:
    url, keys = redis_flush, Keyring.from_file(keyring_file)
    _, s0, _, _ = _redis_worker(loop_thread, tiny_spec, tiny_model, "w0", url, keys)
    w1_address, s1, _, pub1 = _redis_worker(loop_thread, tiny_spec, tiny_model, "w1", url,
                                            keys)
    guarded, gstop, index = _gateway(loop_thread, tiny_spec, url, keyring_file)
    open_gw, ostop, open_index = _gateway(loop_thread, tiny_spec, url)
    hasher = BlockHasher(BLOCK, model_fingerprint=tiny_spec.fingerprint)
    forged = _prompts(8, salt=2)
    stops = [gstop, ostop, s0, s1]
    try:
        with grpc.insecure_channel(guarded) as c:
            stub = chat_pb2_grpc.ChatServiceStub(c)
            wait_for(lambda: _num_workers(stub) == 2, what="the gateway to list w0 and w1")
            wait_for(lambda: pub1.record.epoch > 0, what="w1 to register")
            # The attacker writes ownership for w1 with w1's current epoch (it can read it
            # from Redis), claiming the blocks of 8 prompts: unsigned, through the same
            # fenced script a worker uses.
            attacker = RedisRegistry(url)
            record = WorkerRecord("w1", "anywhere", tiny_spec.fingerprint, pub1.record.epoch)
            events = [OwnershipEvent("store", hasher.hash_blocks(ids)) for ids in forged]
            assert loop_thread.run(attacker.publish(record, events))
            loop_thread.run(attacker.close())
            # A genuine turn after the forgery: once the guarded gateway indexed it, it has
            # read the forged entry too (the stream is ordered).
            genuine = _prompts(1, salt=3)[0]
            served = _turn(stub, genuine, "genuine").worker_id
            for ix in (index, open_index):
                wait_for(lambda ix=ix: ix.match(hasher.hash_blocks(genuine)).cached_blocks
                         .get(served, 0) >= 3, what="the genuine turn to be indexed")
            # Without the keyring the forgery steers all 8; with it, none.
            assert sum(_forged_owner(open_index, hasher, ids) > 0 for ids in forged) == 8
            assert sum(_forged_owner(index, hasher, ids) > 0 for ids in forged) == 0
            finals = [_turn(stub, ids + [5], f"f{i}") for i, ids in enumerate(forged)]
            assert all(f.usage.cached_tokens == 0 for f in finals)
            # A forged "join" with a far higher epoch would fence off w1's genuine batches
            # (unsigned: Redis writes joins); the guarded gateway skips joins.
            r = redis.Redis.from_url(url)
            r.xadd("pg:events", {"w": "w1", "e": pub1.record.epoch + 100, "k": "join"})
            r.close()
            later = _prompts(1, salt=4)[0]  # served by w1 directly: its signed batch follows
            with grpc.insecure_channel(w1_address) as wc:
                list(worker_pb2_grpc.WorkerServiceStub(wc).Generate(worker_pb2.GenerateRequest(
                    prompt_token_ids=later, sampling=common_pb2.SamplingParams(max_tokens=1)),
                    timeout=60))
            wait_for(lambda: _forged_owner(index, hasher, later) >= 3,
                     what="w1's genuine blocks after a forged join")
        # A gateway that starts now rebuilds from the pg:kv hashes, where the forged
        # blocks are too: it leaves out w1's unverifiable set instead of trusting it.
        late, lstop, late_index = _gateway(loop_thread, tiny_spec, url, keyring_file)
        stops.append(lstop)
        with grpc.insecure_channel(late) as c:
            wait_for(lambda: _num_workers(chat_pb2_grpc.ChatServiceStub(c)) == 2,
                     what="the late gateway to list w0 and w1")
        wait_for(lambda: late_index.epoch_of("w0") > 0, what="the late gateway's rebuild")
        assert sum(_forged_owner(late_index, hasher, ids) > 0 for ids in forged) == 0
    finally:
        _stop_all(loop_thread, *stops)
