"""Block transfer between workers over real gRPC on loopback (workerapi/transfer.py).

Correctness by comparison: a reply computed on pulled KV equals the reply of a full
recompute (greedy tokens), and the pulled pages equal the sender's bit for bit.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from prefixgate.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from prefixgate.wire.token_ids import pack
from tests.helpers import start_worker, wait_for


def _generate(stub, prompt, max_tokens=12, pull=None, logprobs=None, metadata=None):
    """Greedy tokens and the final event (with `logprobs`, a list to fill with each
    token's top-5 log probabilities)."""
    request = worker_pb2.GenerateRequest(
        request_id="r", packed_prompt_token_ids=pack(prompt).tobytes(),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                           top_logprobs=5 if logprobs is not None else None),
        pull=pull)
    tokens, final = [], None
    for ev in stub.Generate(request, timeout=120, metadata=metadata):
        if ev.HasField("chunk"):
            tokens += ev.chunk.token_ids
            if logprobs is not None:
                logprobs += [list(lp.top_logprobs) for lp in ev.chunk.logprobs]
        else:
            final = ev.final
    return tokens, final


def _workers(loop_thread, spec, model):
    """A function starting workers of `model` on loopback, and their stops."""
    made = {}

    def start(name, **config):
        address, stop = start_worker(loop_thread, spec, model, name, **config)
        channel = grpc.insecure_channel(address)
        made[name] = (address, stop, channel, worker_pb2_grpc.WorkerServiceStub(channel))
        return made[name]

    def stop_all():
        for _, stop, channel, _ in made.values():
            channel.close()
            loop_thread.loop.call_soon_threadsafe(stop.set)
    return start, stop_all


@pytest.fixture
def workers(loop_thread, tiny_spec, tiny_model):
    """Workers of tiny-random on loopback: e.g. holder, puller, a reference with no cache."""
    start, stop_all = _workers(loop_thread, tiny_spec, tiny_model)
    yield start
    stop_all()


def test_pulled_kv_equals_recompute_smollm2(loop_thread, smollm2_spec, smollm2_model) -> None:
    """SmolLM2 in the worker's weights (q4_1 on the CPU): a follow-up turn on pulled KV
    gives the greedy tokens and log probabilities of a full recompute."""
    start, stop_all = _workers(loop_thread, smollm2_spec, smollm2_model)
    try:
        holder_addr, _, _, holder = start("holder", num_blocks=96)
        _, _, _, puller = start("puller", num_blocks=96)
        _, _, _, reference = start("reference", num_blocks=96, enable_prefix_cache=False)
        prompt = [(i * 7919) % 40000 + 100 for i in range(300)]
        first, _ = _generate(holder, prompt, max_tokens=8)
        follow_up = prompt + first + [(i * 104729) % 40000 + 100 for i in range(40)]
        pull = worker_pb2.PullSpec(peer_address=holder_addr, num_blocks=len(follow_up) // 16)
        got_lp, want_lp = [], []
        got, final = _generate(puller, follow_up, pull=pull, logprobs=got_lp)
        want, _ = _generate(reference, follow_up, logprobs=want_lp)
        assert final.usage.transferred_tokens == (len(prompt) + len(first) - 1) // 16 * 16
        assert got == want
        assert torch.allclose(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-3)
    finally:
        stop_all()


def _service_engine(stub, metadata=None):
    """The in-process engine behind a worker (tests run them in this process)."""
    import gc

    from prefixgate.workerapi.server import WorkerService
    worker_id = stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=metadata).worker_id
    for obj in gc.get_objects():
        if type(obj) is WorkerService and obj.config.worker_id == worker_id:
            return obj.engine
    raise LookupError(worker_id)


def test_pulled_kv_equals_recompute(workers) -> None:
    holder_addr, _, _, holder = workers("holder")
    _, _, _, puller = workers("puller")
    _, _, _, reference = workers("reference", enable_prefix_cache=False)
    prompt = [(i * 7919) % 250 + 5 for i in range(203)]  # 12 full blocks and a tail
    want, _ = _generate(reference, prompt)
    first, _ = _generate(holder, prompt)
    assert first == want
    follow_up = prompt + first + [11, 12, 13]
    pull = worker_pb2.PullSpec(peer_address=holder_addr, peer_worker_id="holder",
                               num_blocks=len(follow_up) // 16)
    got, final = _generate(puller, follow_up, pull=pull)
    assert got == _generate(reference, follow_up)[0]
    # The holder cached the prompt and reply's full blocks: all of them came over.
    held = (len(prompt) + len(first) - 1) // 16
    assert final.usage.transferred_tokens == held * 16
    assert final.usage.cached_tokens == 0
    # The pulled pages are the holder's, bit for bit, and the puller caches them.
    h_engine, p_engine = _service_engine(holder), _service_engine(puller)
    chain = p_engine.transfer.chain(follow_up[:held * 16], "")
    h_ids = h_engine.on_engine_thread(lambda: h_engine.cache.tree.match(chain, touch=False).values)
    p_ids = p_engine.on_engine_thread(lambda: p_engine.cache.tree.match(chain, touch=False).values)
    assert len(h_ids) == len(p_ids) == held
    for h, p in zip(h_ids, p_ids, strict=True):
        hs, ps = slice(h * 16, h * 16 + 16), slice(p * 16, p * 16 + 16)
        assert torch.equal(h_engine.pool.k[:, hs], p_engine.pool.k[:, ps])
        assert torch.equal(h_engine.pool.v[:, hs], p_engine.pool.v[:, ps])
    status = puller.GetStatus(worker_pb2.GetStatusRequest())
    assert status.kv_bytes_per_token == p_engine.pool.config.bytes_per_token
    # A second turn on the puller hits its own cache now.
    _, again = _generate(puller, follow_up + [14], pull=pull)
    assert again.usage.transferred_tokens == 0 and again.usage.cached_tokens >= held * 16


def test_unknown_chain_is_not_found_and_mismatch_recomputes(workers) -> None:
    holder_addr, _, _, holder = workers("holder")
    _, _, _, puller = workers("puller")
    with pytest.raises(grpc.RpcError) as err:
        list(holder.ExportBlocks(worker_pb2.ExportBlocksRequest(block_hashes=[1, 2, 3])))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    prompt = [(i * 31) % 250 + 3 for i in range(100)]
    want, _ = _generate(holder, prompt)
    # Pages in another dtype than the receiver's: refused, the prompt is computed.
    engine = _service_engine(puller)
    engine.transfer.format = dataclasses.replace(engine.transfer.format, dtype="bfloat16")
    pull = worker_pb2.PullSpec(peer_address=holder_addr, num_blocks=6)
    got, final = _generate(puller, prompt, pull=pull)
    assert got == want
    assert final.usage.transferred_tokens == 0 and final.usage.cached_tokens == 0
    puller.FlushCache(worker_pb2.FlushCacheRequest())
    with pytest.raises(grpc.RpcError) as err:
        puller.PullBlocks(worker_pb2.PullBlocksRequest(
            peer_address=holder_addr,
            block_hashes=engine.transfer.chain(prompt[:96], "")), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # The refused exports are cancelled by the puller; the holder releases their pins when
    # the cancellation reaches it (asynchronously), and then accounts for every block again.
    wait_for(lambda: _integral(_service_engine(holder)), timeout=10,
             what="the holder releasing the pins of the refused exports")


def _integral(engine) -> bool:
    try:
        engine.check_integrity()
    except AssertionError:
        return False
    return True


def test_pull_blocks_stores_and_publishes(workers) -> None:
    holder_addr, _, _, holder = workers("holder")
    _, _, _, puller = workers("puller")
    prompt = [(i * 13) % 250 + 7 for i in range(150)]
    _generate(holder, prompt)
    engine = _service_engine(puller)
    chain = engine.transfer.chain(prompt, "")
    got = puller.PullBlocks(worker_pb2.PullBlocksRequest(
        peer_address=holder_addr, peer_worker_id="holder", block_hashes=chain), timeout=30)
    assert got.num_cached_blocks == got.num_pulled_blocks == len(prompt) // 16 == 9
    assert got.num_bytes == 9 * 16 * engine.pool.config.bytes_per_token
    events = puller.WatchEvents(worker_pb2.WatchEventsRequest(), timeout=5)
    stored = [h for e in next(iter(events)).events for h in e.stored.block_hashes]
    events.cancel()
    assert stored == chain
    _, final = _generate(puller, prompt + [1, 2])
    assert final.usage.cached_tokens == 144


def start_leaving(loop_thread, spec, model, config: dict, peers: list[tuple[str, str]]):
    """A worker "leaving" (WorkerConfig fields `config`) served with `peers` for its drain
    hand-off: (port, stop event, the serve task)."""
    import asyncio

    from prefixgate.workerapi.events import EventLog
    from prefixgate.workerapi.server import WorkerConfig, WorkerService, serve
    from tests.helpers import make_engine

    events = EventLog()
    engine = make_engine(spec, model, event_sink=events)
    service = WorkerService(engine, spec, WorkerConfig(worker_id="leaving", drain_seconds=10,
                                                       **config),
                            vocab_size=engine.tokenizer.vocab_size, events=events)

    async def list_peers() -> list[tuple[str, str]]:
        return peers

    async def start():
        stop = asyncio.Event()
        started = asyncio.get_running_loop().create_future()
        done = asyncio.create_task(serve(service, stop, started, peers=list_peers))
        return await started, stop, done
    return loop_thread.run(start())


def test_drain_hands_the_most_reused_chain_to_a_peer(loop_thread, tiny_spec, tiny_model,
                                                      workers) -> None:
    """A worker told to stop offers its cached chains to its peers before it leaves: the
    conversation's next turn hits them on the peer."""
    import asyncio


    peer_addr, _, _, peer = workers("peer")
    port, stop, done = start_leaving(loop_thread, tiny_spec, tiny_model, {},
                                     [("leaving", "ignored: itself"), ("peer", peer_addr)])
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    leaving = worker_pb2_grpc.WorkerServiceStub(channel)
    history = [(i * 17) % 250 + 4 for i in range(120)]
    reply, _ = _generate(leaving, history)
    history += reply + [9, 8, 7]
    _, second = _generate(leaving, history)  # reuses the first turn: the hot chain
    assert second.usage.cached_tokens >= 112
    other = [(i * 5) % 250 + 2 for i in range(40)]  # a chain nobody reused
    _generate(leaving, other)
    loop_thread.loop.call_soon_threadsafe(stop.set)
    loop_thread.run(asyncio.wait_for(asyncio.shield(done), 30))
    channel.close()
    _, third = _generate(peer, history + [1, 2, 3])
    assert third.usage.cached_tokens >= len(history) // 16 * 16 - 16
    _, fourth = _generate(peer, other + [5])
    assert fourth.usage.cached_tokens == 32  # taken too: the peer had room


def test_pages_of_scattered_blocks_round_trip(tiny_spec, tiny_model) -> None:
    """read() of blocks scattered over the pool and write() into other scattered blocks
    move exactly their slots (runs of consecutive blocks copied as slices)."""
    from prefixgate.worker.kv_transfer import _Pin
    from prefixgate.workerapi.transfer import Reservation
    from tests.helpers import make_engine

    engine = make_engine(tiny_spec, tiny_model, num_blocks=64)
    transfer, pool = engine.transfer, engine.pool
    torch.manual_seed(0)
    pool.k.copy_(torch.randn_like(pool.k))
    pool.v.copy_(torch.randn_like(pool.v))
    src_ids, dst_ids = [3, 4, 9, 10, 11, 30], [50, 12, 13, 40, 41, 63]
    pin = _Pin(handle=None, block_ids=[1, *src_ids], from_block=1)
    k, v = transfer.read(pin, 0, len(src_ids))
    res = Reservation((), 0, len(dst_ids), (None, [], dst_ids))
    transfer.write(res, 0, k, v)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(pool.k[:, s * 16:(s + 1) * 16], pool.k[:, d * 16:(d + 1) * 16])
        assert torch.equal(pool.v[:, s * 16:(s + 1) * 16], pool.v[:, d * 16:(d + 1) * 16])


def test_exports_cancelled_while_the_threads_are_busy_release_their_pins(
        workers, loop_thread) -> None:
    """Pulls cancelled just after the export's header while every thread of the event
    loop's pool is busy: the holder's unpin still runs once a thread is free (a cancelled
    await of a queued `to_thread` never runs it), so every block is accounted for again."""
    import asyncio
    import time
    from concurrent.futures import ThreadPoolExecutor

    holder_addr, _, _, holder = workers("holder")
    prompt = [(i * 37) % 250 + 3 for i in range(100)]
    _generate(holder, prompt)
    engine = _service_engine(holder)
    chain = engine.transfer.chain(prompt[:96], "")

    async def cancel_exports() -> int:
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(1)
        loop.set_default_executor(pool)  # restored below: one thread, easy to keep busy
        headers = 0
        try:
            async with grpc.aio.insecure_channel(holder_addr) as channel:
                stub = worker_pb2_grpc.WorkerServiceStub(channel)
                for i in range(20):
                    call = stub.ExportBlocks(worker_pb2.ExportBlocksRequest(
                        block_hashes=chain), timeout=30)
                    headers += (await call.read()).HasField("header")
                    busy = loop.run_in_executor(None, time.sleep, 0.05)  # the one thread
                    await asyncio.sleep(0.001 * (i % 4))
                    call.cancel()
                    await busy
        finally:
            loop.set_default_executor(ThreadPoolExecutor())
            pool.shutdown(wait=False)
        return headers

    assert loop_thread.run(cancel_exports()) == 20
    wait_for(lambda: _integral(engine), timeout=10,
             what="the holder releasing the pins of the cancelled exports")
