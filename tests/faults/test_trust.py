"""Faults: the attacks on a shared Redis, made with one worker pod's files in hand (its
private key, its Redis user), against real redis-server, real workers and gateways over
gRPC on loopback (tiny-random).

Before per-worker keys every pod held one `*` master keyring: with it a rogue worker got 30
of 30 turns, ownership forged for another worker steered 8 of 8, and one batch numbered
10^12 fenced off a worker's genuine batches; a worker reporting 10^9 prefill tokens/s drew
30 of 30 new conversations. Each test also runs a gateway without the keyring beside the
one with it, to show the attack is real in the test and that only the keys stop it.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
import redis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from prefixgate.gateway.index import PrefixIndex
from prefixgate.radix import BlockHasher
from prefixgate.registry import RedisRegistry, WorkerRecord
from prefixgate.security.auth import AuthConfig
from prefixgate.security.identity import Keyring, new_gateway_key, new_worker_key
from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from prefixgate.wire.events import OwnershipEvent
from tests.faults.fleet import report
from tests.helpers import start_worker, wait_for

BLOCK = 16


@pytest.fixture
def keys(tmp_path) -> dict:
    """Worker w0's and w1's own keyrings (their pods' files) and the gateways' keyring
    file (public keys and the gateways' key)."""
    lines = {w: new_worker_key(w) for w in ("w0", "w1")}
    path = tmp_path / "gateways.keyring"
    path.write_text("".join(public + "\n" for _, public in lines.values())
                    + new_gateway_key() + "\n")
    return {"gateways": str(path), **{w: Keyring.parse(private)
                                      for w, (private, _) in lines.items()}}


def _as(worker_id: str, stolen: Keyring, owner: str) -> Keyring:
    """A keyring that signs as `worker_id` with `owner`'s key (a rogue holding owner's
    files, claiming another identity)."""
    return Keyring(private={worker_id: stolen.private_key(owner)})


def _redis_worker(loop_thread, spec, model, worker_id, url, keyring=None):
    """A worker registered in Redis that publishes its KV events there, signing with its
    key when given a keyring (as `prefixgate worker --redis-url --worker-keyring`)."""
    from prefixgate.workerapi.events import EventLog, RedisPublisher

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


def _turn(stub, ids, conversation_id="", max_tokens=2):
    req = chat_pb2.ChatRequest(conversation_id=conversation_id,
                               sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
    req.prompt_token_ids.token_ids.extend(ids)
    return list(stub.Chat(req, timeout=60))[-1].final


def _prompts(n, salt, length=64):
    return [[3 + (salt * 31 + 7 * i + j) % 250 for j in range(length)] for i in range(n)]


def _generate(address: str, ids: list[int]) -> None:
    """One request straight to a worker (its stored event follows on the stream)."""
    with grpc.insecure_channel(address) as wc:
        list(worker_pb2_grpc.WorkerServiceStub(wc).Generate(worker_pb2.GenerateRequest(
            prompt_token_ids=ids, sampling=common_pb2.SamplingParams(max_tokens=1)),
            timeout=60))


def _stop_all(loop_thread, *stops):
    for stop in stops:
        loop_thread.loop.call_soon_threadsafe(stop.set)


def test_a_rogue_worker_with_a_worker_pods_files_gets_no_turns(
        loop_thread, tiny_spec, tiny_model, redis_flush, keys) -> None:
    url = redis_flush
    _, s0, _, _ = _redis_worker(loop_thread, tiny_spec, tiny_model, "w0", url, keys["w0"])
    _, s1, _, _ = _redis_worker(loop_thread, tiny_spec, tiny_model, "w1", url, keys["w1"])
    # The rogues: the public model fingerprint, real worker processes. One with no key,
    # one with a key of its own, one signing a new identity with w1's key (w1's files).
    rogues = {"rogue": None, "rogue-2": Keyring(private={"rogue-2": Ed25519PrivateKey.generate()}),
              "rogue-3": _as("rogue-3", keys["w1"], "w1")}
    started = {rid: _redis_worker(loop_thread, tiny_spec, tiny_model, rid, url, ring)
               for rid, ring in rogues.items()}
    guarded, gstop, _ = _gateway(loop_thread, tiny_spec, url, keys["gateways"])
    open_gw, ostop, _ = _gateway(loop_thread, tiny_spec, url)
    stops = [gstop, ostop, s0, s1, *(r[1] for r in started.values())]
    try:
        with grpc.insecure_channel(guarded) as c, grpc.insecure_channel(open_gw) as o:
            stub, open_stub = chat_pb2_grpc.ChatServiceStub(c), chat_pb2_grpc.ChatServiceStub(o)
            # Without the keyring all five are routable: the rogues are really registered.
            wait_for(lambda: _num_workers(open_stub) == 5, what="the open gateway to list 5")
            wait_for(lambda: _num_workers(stub) == 2, what="the guarded gateway to list 2")
            served = Counter(_turn(stub, ids, f"c{i}").worker_id
                             for i, ids in enumerate(_prompts(30, salt=1)))
            # The rogue with w1's files claims to be w0, at its own address: w1's key does
            # not sign for w0, so the gateway keeps routing to the genuine w0 only.
            impostor = RedisRegistry(url, keyring=_as("w0", keys["w1"], "w1"))
            loop_thread.run(impostor.register(
                WorkerRecord("w0", started["rogue"][0], tiny_spec.fingerprint), 2000))
            loop_thread.run(impostor.close())
            served.update(_turn(stub, ids, f"d{i}").worker_id
                          for i, ids in enumerate(_prompts(10, salt=5)))
            rogue_turns = sum(r[2].snapshot()[1] for r in started.values())
            report("rogue_worker_with_a_pods_files", turns=sum(served.values()),
                   rogue_turns=rogue_turns, served=dict(served))
            assert sum(served.values()) == 40 and set(served) <= {"w0", "w1"}
            # Nothing ever reached the rogues' engines.
            assert rogue_turns == 0
    finally:
        _stop_all(loop_thread, *stops)


def _forged_owner(index, hasher, ids) -> int:
    return index.match(hasher.hash_blocks(ids)).cached_blocks.get("w1", 0)


def test_forged_ownership_with_a_worker_pods_files_steers_no_turns(
        loop_thread, tiny_spec, tiny_model, redis_flush, keys) -> None:
    url = redis_flush
    w0_address, s0, _, pub0 = _redis_worker(loop_thread, tiny_spec, tiny_model, "w0", url,
                                            keys["w0"])
    w1_address, s1, _, pub1 = _redis_worker(loop_thread, tiny_spec, tiny_model, "w1", url,
                                            keys["w1"])
    guarded, gstop, index = _gateway(loop_thread, tiny_spec, url, keys["gateways"])
    open_gw, ostop, open_index = _gateway(loop_thread, tiny_spec, url)
    hasher = BlockHasher(BLOCK, model_fingerprint=tiny_spec.fingerprint)
    forged = _prompts(8, salt=2)
    stops = [gstop, ostop, s0, s1]
    try:
        with grpc.insecure_channel(guarded) as c:
            stub = chat_pb2_grpc.ChatServiceStub(c)
            wait_for(lambda: _num_workers(stub) == 2, what="the gateway to list w0 and w1")
            wait_for(lambda: pub1.record.epoch > 0, what="w1 to register")
            w1_own = _prompts(1, salt=11)[0]  # blocks w1 really holds, indexed
            _generate(w1_address, w1_own)
            wait_for(lambda: _forged_owner(index, hasher, w1_own) >= 3, what="w1's own blocks")
            # The attacker holds w0's pod files: it writes ownership for w1 with w1's
            # current epoch (it can read it from Redis), claiming the blocks of 8 prompts,
            # signed with w0's key, through the same fenced script a worker uses.
            attacker = RedisRegistry(url, keyring=_as("w1", keys["w0"], "w0"))
            record = WorkerRecord("w1", "anywhere", tiny_spec.fingerprint, pub1.record.epoch)
            events = [OwnershipEvent("store", hasher.hash_blocks(ids)) for ids in forged]
            assert loop_thread.run(attacker.publish(record, events))
            loop_thread.run(attacker.close())
            # As w0 itself (its key is in hand), a batch numbered 10^12: it may not move
            # what gateways expect of w0 next.
            far = RedisRegistry(url, keyring=keys["w0"])
            far._signer("w0").seq = 10**12 - 1
            assert loop_thread.run(far.publish(pub0.record, [OwnershipEvent(
                "store", hasher.hash_blocks(_prompts(1, salt=9)[0]))]))
            loop_thread.run(far.close())
            # A genuine turn after the forgery: once the guarded gateway indexed it, it has
            # read the forged entry too (the stream is ordered).
            genuine = _prompts(1, salt=3)[0]
            served = _turn(stub, genuine, "genuine").worker_id
            for ix in (index, open_index):
                wait_for(lambda ix=ix: ix.match(hasher.hash_blocks(genuine)).cached_blocks
                         .get(served, 0) >= 3, what="the genuine turn to be indexed")
            # Without the keyring the forgery steers all 8; with it, none.
            open_steered = sum(_forged_owner(open_index, hasher, ids) > 0 for ids in forged)
            steered = sum(_forged_owner(index, hasher, ids) > 0 for ids in forged)
            finals = [_turn(stub, ids + [5], f"f{i}") for i, ids in enumerate(forged)]
            report("forged_ownership_with_a_pods_files", forged=8, steered=steered,
                   steered_without_keys=open_steered,
                   cached_tokens=sum(f.usage.cached_tokens for f in finals))
            assert open_steered == 8 and steered == 0
            assert all(f.usage.cached_tokens == 0 for f in finals)
            # Unsigned leave and reap entries for w1 (anyone who can XADD): without keys
            # they make gateways forget w1's blocks; with keys, nothing.
            r = redis.Redis.from_url(url)
            for kind in ("leave", "reap"):
                r.xadd("pg:events", {"w": "w1", "e": pub1.record.epoch, "k": kind})
            r.close()
            # The far-future batch fenced nothing: w0's genuine batches still apply, and
            # the forged leave/reap removed nothing of w1's.
            assert index.match(hasher.hash_blocks(_prompts(1, salt=9)[0])).cached_blocks \
                .get("w0", 0) == 0
            w0_next = _prompts(1, salt=10)[0]
            _generate(w0_address, w0_next)
            wait_for(lambda: index.match(hasher.hash_blocks(w0_next)).cached_blocks
                     .get("w0", 0) >= 3, what="w0's genuine batch after one numbered 10^12")
            assert _forged_owner(index, hasher, w1_own) >= 3  # no forged leave/reap applied
            # A forged "join" with a far higher epoch would fence off w1's genuine batches
            # (unsigned: Redis writes joins); the guarded gateway skips joins.
            r = redis.Redis.from_url(url)
            r.xadd("pg:events", {"w": "w1", "e": pub1.record.epoch + 100, "k": "join"})
            r.close()
            later = _prompts(1, salt=4)[0]  # served by w1 directly: its signed batch follows
            _generate(w1_address, later)
            wait_for(lambda: _forged_owner(index, hasher, later) >= 3,
                     what="w1's genuine blocks after a forged join")
        # A gateway that starts now rebuilds from the pg:kv hashes, where the forged
        # blocks are too: it leaves out w1's unverifiable set instead of trusting it (and
        # w0's, which the batch numbered 10^12 wrote to as well), then follows both.
        late, lstop, late_index = _gateway(loop_thread, tiny_spec, url, keys["gateways"])
        stops.append(lstop)
        with grpc.insecure_channel(late) as c:
            wait_for(lambda: _num_workers(chat_pb2_grpc.ChatServiceStub(c)) == 2,
                     what="the late gateway to list w0 and w1")
        marker = _prompts(1, salt=12)[0]
        _generate(w1_address, marker)
        wait_for(lambda: _forged_owner(late_index, hasher, marker) >= 3,
                 what="the late gateway to follow w1's genuine batches")
        assert sum(_forged_owner(late_index, hasher, ids) > 0 for ids in forged) == 0
    finally:
        _stop_all(loop_thread, *stops)


class _ClaimsFastPrefill:
    """A worker's ServiceRates that reports 10^9 prefill tokens/s and a 1 ns decode step
    whatever it measured (the worker's own figures, pushed in its status)."""

    prefill_tokens_per_s = 1e9
    decode_step_s = 1e-9

    def observe(self, final) -> None:
        pass


def test_a_worker_reporting_a_huge_prefill_rate_draws_no_extra_turns(
        loop_thread, tiny_spec, monkeypatch) -> None:
    """Two emulated workers (30 ms a token): an honest one prefilling 20,000 tokens/s and
    a liar prefilling 5,000 that reports 10^9 tokens/s and a 1 ns step. The gateway
    credits a reported rate only up to what it saw the worker deliver, so the lie draws
    no new conversations: the faster, honest worker gets most of them."""
    import concurrent.futures

    import prefixgate.workerapi.server as worker_server
    from prefixgate.emulate.service import ServiceModel
    from tests.helpers import start_emulated_worker, start_gateway

    honest, s_honest, _ = start_emulated_worker(loop_thread, tiny_spec, "honest")
    with monkeypatch.context() as m:
        m.setattr(worker_server, "ServiceRates", _ClaimsFastPrefill)
        liar, s_liar, _ = start_emulated_worker(
            loop_thread, tiny_spec, "liar", service=ServiceModel(prefill_tokens_per_s=5_000.0))
    gw, gstop = start_gateway(loop_thread, tiny_spec, [honest, liar])
    try:
        with grpc.insecure_channel(gw) as c:
            stub = chat_pb2_grpc.ChatServiceStub(c)
            wait_for(lambda: _num_workers(stub) == 2, what="the gateway to list both")
            prompts = _prompts(30, salt=7, length=400)
            with concurrent.futures.ThreadPoolExecutor(3) as pool:  # some load at once
                served = Counter(f.worker_id for f in pool.map(
                    lambda i: _turn(stub, prompts[i], f"new{i}", max_tokens=4), range(30)))
        report("worker_reporting_1e9_prefill_tokens_per_s", turns=30, served=dict(served))
        assert sum(served.values()) == 30
        # The liar is four times slower than the honest worker: credited by what it
        # delivers it draws only what the honest one's load leaves (credited by its
        # claim, it drew 28 of 30).
        assert served["liar"] <= 10, served
    finally:
        _stop_all(loop_thread, gstop, s_honest, s_liar)


def test_a_token_holders_streams_past_the_workers_waiting_bound_are_refused(
        loop_thread, tiny_spec, tiny_model) -> None:
    """At most 2 requests waiting for their first token: with the worker's one sequence
    slot held by a long reply, of 8 long token-id prompts sent at once (repeated and
    packed forms alike: no form skips the bound) 2 are admitted and 6 are refused with
    RESOURCE_EXHAUSTED naming the limit and its flag; the admitted ones finish, and the
    worker serves again after. (Unbounded, all 8 were queued: one token holder could
    queue streams of 128k-token prompts without end.) The held slot keeps every burst
    request waiting however slowly a busy host delivers them: without it, one that
    started decoding before the last arrived was no longer waiting and a third was
    rightly admitted."""
    from prefixgate.wire.token_ids import pack

    address, stop = start_worker(loop_thread, tiny_spec, tiny_model, "bounded", max_num_seqs=1,
                                 worker_config=dict(max_waiting_requests=2))

    async def burst() -> list:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)

            async def one(i: int):
                ids = [3 + (i * 13 + j) % 250 for j in range(400)]
                req = worker_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
                    max_tokens=40, temperature=0.0))
                if i % 2:
                    req.packed_prompt_token_ids = pack(ids).tobytes()
                else:
                    req.prompt_token_ids.extend(ids)
                try:
                    return [ev async for ev in stub.Generate(req, timeout=120)][-1].final
                except grpc.aio.AioRpcError as exc:
                    return exc
            # The slot's holder: decoding (not waiting) before the burst is sent.
            hold = stub.Generate(worker_pb2.GenerateRequest(
                prompt_token_ids=[5] * 20,
                sampling=common_pb2.SamplingParams(max_tokens=1500, temperature=0.0)),
                timeout=300)
            first = await hold.read()
            assert first.HasField("chunk")
            results = await asyncio.gather(*(one(i) for i in range(8)))
            last = first
            while (ev := await hold.read()) is not grpc.aio.EOF:
                last = ev
            held = last.final
            assert held.usage.completion_tokens == 1500  # it held the slot all along
            return results
    try:
        results = loop_thread.run(burst())
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        served = [r for r in results if not isinstance(r, grpc.aio.AioRpcError)]
        report("streams_past_the_workers_waiting_bound", sent=8, served=len(served),
               refused=len(refused))
        assert len(served) == 2 and len(refused) == 6
        for exc in refused:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-waiting-requests 2" in exc.details()
        assert all(f.usage.completion_tokens == 40 for f in served)
        with grpc.insecure_channel(address) as c:  # the bound is on requests waiting now
            list(worker_pb2_grpc.WorkerServiceStub(c).Generate(worker_pb2.GenerateRequest(
                prompt_token_ids=[5] * 20, sampling=common_pb2.SamplingParams(max_tokens=1)),
                timeout=60))
    finally:
        _stop_all(loop_thread, stop)
