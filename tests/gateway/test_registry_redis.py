"""Block ownership in a real redis-server: publishing, fencing, reaping, gateway feeds
(bootstrap, catch-up, trimming, Redis restart) — driven through the worker's EventLog."""

from __future__ import annotations

import asyncio
import time

from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.redis_feed import RedisStreamFeed
from prefixgate.gateway.routing import LoadSnapshot, Router, RoutingConfig, make_turn
from prefixgate.radix import BlockHasher
from prefixgate.registry import OwnershipEvent, RedisRegistry, WorkerRecord
from prefixgate.workerapi.events import EventLog, RedisPublisher

HASHER = BlockHasher(4, model_fingerprint="fp")


def hashes(start: int, n_tokens: int) -> list[int]:
    return HASHER.hash_blocks(list(range(start, start + n_tokens)))


async def until(pred, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def follow(feed: RedisStreamFeed) -> asyncio.Task:
    await feed.sync([])
    await asyncio.wait_for(feed.ready.wait(), 10)
    return feed._task


def test_publish_is_fenced_by_the_lease_epoch(redis_flush) -> None:
    async def scenario() -> None:
        reg = RedisRegistry(redis_flush)
        a = await reg.register(WorkerRecord("w", "h:1", "fp"), lease_ms=10_000)
        hs = hashes(0, 16)
        assert await reg.publish(a, [OwnershipEvent("store", hs[:2]),
                                     OwnershipEvent("store", hs[2:], hs[1])])
        _, _, owners = await reg.ownership_snapshot()
        assert owners["w"][0] == a.epoch
        assert owners["w"][1] == {hs[0]: None, hs[1]: hs[0], hs[2]: hs[1], hs[3]: hs[2]}
        b = await reg.register(WorkerRecord("w", "h:2", "fp"), lease_ms=10_000)
        # The old incarnation can no longer write; the new one starts clean.
        assert not await reg.publish(a, [OwnershipEvent("store", hs)])
        _, _, owners = await reg.ownership_snapshot()
        assert owners == {"w": (b.epoch, {})}
        await reg.close()

    asyncio.run(scenario())


def test_lease_expiry_reaps_blocks_once_and_feeds_follow(redis_flush) -> None:
    async def scenario() -> None:
        reg, gw_reg = RedisRegistry(redis_flush), RedisRegistry(redis_flush)
        index = PrefixIndex()
        feed = RedisStreamFeed(index, gw_reg, block_ms=100)
        await follow(feed)
        w = await reg.register(WorkerRecord("w", "h:1", "fp"), lease_ms=300)
        hs = hashes(0, 32)
        assert await reg.publish(w, [OwnershipEvent("store", hs)])
        await until(lambda: index.match(hs).cached_blocks == {"w": 8}, what="blocks indexed")
        await asyncio.sleep(0.5)  # the worker died: its lease expires
        other = RedisRegistry(redis_flush)
        reaped = await asyncio.gather(gw_reg.reap_expired(), other.reap_expired())
        assert sorted(reaped, key=len) == [[], ["w"]]  # exactly one reaper wins
        await until(lambda: index.num_blocks == 0, what="reaped blocks to leave the index")
        _, _, owners = await other.ownership_snapshot()
        assert owners == {}
        # Restarted under the same id: new epoch, clean.
        w2 = await reg.register(WorkerRecord("w", "h:1", "fp"), lease_ms=10_000)
        assert w2.epoch == w.epoch + 1
        assert await reg.publish(w2, [OwnershipEvent("store", hs[:2])])
        await until(lambda: index.match(hs).cached_blocks == {"w": 2}, what="new epoch's blocks")
        await feed.close()
        for r in (reg, gw_reg, other):
            await r.close()

    asyncio.run(scenario())


def test_late_gateway_bootstraps_and_two_gateways_agree(redis_flush) -> None:
    async def scenario() -> None:
        reg = RedisRegistry(redis_flush)
        logs = {f"w{i}": EventLog() for i in range(3)}
        stop = asyncio.Event()
        pubs = [RedisPublisher(log, RedisRegistry(redis_flush), WorkerRecord(wid, "h", "fp"),
                               lease_ms=10_000) for wid, log in logs.items()]
        tasks = [asyncio.create_task(p.run(stop)) for p in pubs]
        early = PrefixIndex()
        feed1 = RedisStreamFeed(early, RedisRegistry(redis_flush), block_ms=100)
        await follow(feed1)
        prompts = {}
        for c in range(30):  # each "worker" caches some conversations, then evicts a few
            wid = f"w{c % 3}"
            prompts[c] = list(range(c * 1000, c * 1000 + 64))
            logs[wid].stored(None, HASHER.hash_blocks(prompts[c]))
        logs["w1"].removed(HASHER.hash_blocks(prompts[1])[8:])
        logs["w2"].cleared()
        logs["w2"].stored(None, HASHER.hash_blocks(prompts[2])[:4])
        total = sum(log.num_blocks for log in logs.values())
        await until(lambda: early.num_blocks == total, what="the early gateway to follow")
        late = PrefixIndex()
        feed2 = RedisStreamFeed(late, RedisRegistry(redis_flush), block_ms=100)
        await follow(feed2)
        assert late.num_blocks == total
        ws = [LoadSnapshot(wid) for wid in logs]
        r1, r2 = Router(RoutingConfig(), early), Router(RoutingConfig(), late)
        for c, prompt in prompts.items():
            turn = make_turn(prompt + [1, 2, 3], HASHER, f"new-{c}")
            d1, d2 = r1.decide(ws, turn), r2.decide(ws, turn)
            assert d1.ranked[0].worker_id == d2.ranked[0].worker_id
            assert d1.cached_tokens == d2.cached_tokens
            expected = {1: 32, 2: 16}.get(c, 64 if c % 3 != 2 else 0)
            assert d1.expected_cached_tokens == expected, c
        # One round trip per batch: a burst of events shares batches.
        before = sum(p.num_batches for p in pubs)
        for i in range(200):
            logs["w0"].stored(None, HASHER.hash_blocks(list(range(10**6 + i * 8, 10**6 + i * 8 + 8))))
        await until(lambda: early.num_blocks == total + 400, what="burst")
        assert sum(p.num_batches for p in pubs) - before < 20
        stop.set()
        await asyncio.gather(*tasks)
        await until(lambda: early.num_blocks == 0, what="deregistered workers to leave")
        await feed1.close()
        await feed2.close()
        await reg.close()

    asyncio.run(scenario())


def test_trimmed_stream_makes_the_gateway_rebuild(redis_flush) -> None:
    async def scenario() -> None:
        reg = RedisRegistry(redis_flush, stream_maxlen=10)
        index = PrefixIndex()
        feed = RedisStreamFeed(index, RedisRegistry(redis_flush), block_ms=50)
        await follow(feed)
        await feed.close()  # the gateway stops reading for a while
        w = await reg.register(WorkerRecord("w", "h", "fp"), lease_ms=10_000)
        hs = hashes(0, 4 * 400)
        for i in range(400):  # far more entries than the stream keeps
            await reg.publish(w, [OwnershipEvent("store", hs[i:i + 1], hs[i - 1] if i else None)])
        _, added, held = await reg.stream_state()
        assert added - held > feed.consumed  # entries the gateway never read are gone
        rebuilds = feed.num_rebuilds
        await feed.step()  # notices the gap
        assert feed.cursor is None
        feed.ready.clear()
        await follow(feed)
        assert feed.num_rebuilds == rebuilds + 1 and index.match(hs).cached_blocks == {"w": 400}
        await feed.close()
        await reg.close()

    asyncio.run(scenario())


def test_redis_restart_degrades_then_resyncs(own_redis) -> None:
    url, start, stop_redis = own_redis

    async def scenario() -> None:
        log = EventLog()
        stop = asyncio.Event()
        pub = RedisPublisher(log, RedisRegistry(url, timeout_s=1), WorkerRecord("w", "h", "fp"),
                             lease_ms=600)
        task = asyncio.create_task(pub.run(stop))
        index = PrefixIndex()
        feed = RedisStreamFeed(index, RedisRegistry(url, timeout_s=1), block_ms=100,
                               retry_s=0.1)
        await follow(feed)
        hs = hashes(0, 64)
        log.stored(None, hs)
        await until(lambda: index.num_blocks == 16, what="blocks indexed")
        await asyncio.to_thread(stop_redis)
        await until(lambda: feed.degraded, what="the feed to report degraded")
        log.stored(hs[-1], hashes(5000, 8))  # the cache keeps changing during the outage
        await asyncio.sleep(0.3)
        assert index.match(hs).cached_blocks == {"w": 16}  # still routing from what it knew
        await asyncio.to_thread(start)  # an empty Redis: every lease and block is gone
        await until(lambda: not feed.degraded and feed.num_rebuilds >= 2, timeout=15,
                    what="the feed to rebuild")
        # The worker re-registers and republishes its whole cache; the index converges.
        await until(lambda: index.num_blocks == 16 + 2, timeout=15, what="index to resync")
        assert index.match(hs + [0]).cached_blocks == {"w": 16}
        stop.set()
        await task
        await feed.close()

    asyncio.run(scenario())


def test_gateway_catches_up_after_a_disconnect_without_rebuilding(redis_flush) -> None:
    async def scenario() -> None:
        reg = RedisRegistry(redis_flush)
        index = PrefixIndex()
        feed = RedisStreamFeed(index, RedisRegistry(redis_flush), block_ms=50)
        await follow(feed)
        w = await reg.register(WorkerRecord("w", "h", "fp"), lease_ms=10_000)
        hs = hashes(0, 64)
        await reg.publish(w, [OwnershipEvent("store", hs[:8])])
        await until(lambda: index.num_blocks == 8, what="first events")
        await feed.close()  # disconnected
        await reg.publish(w, [OwnershipEvent("store", hs[8:], hs[7]),
                              OwnershipEvent("remove", hs[12:])])
        await feed.sync([])  # reconnects from its cursor
        await until(lambda: index.num_blocks == 12, what="catch-up")
        assert feed.num_rebuilds == 1 and index.match(hs).cached_blocks == {"w": 12}
        await feed.close()
        await reg.close()

    asyncio.run(scenario())


def test_two_gateways_see_each_others_predictions_until_events_win(redis_flush) -> None:
    """A turn routed by gateway A is expected on its worker at gateway B at once (Redis
    "predict" entries); the worker's stored event confirms it at both; a removal drops
    it; a restart (new epoch) drops the rest; A never applies its own entries twice."""
    async def scenario() -> None:
        reg = RedisRegistry(redis_flush)
        w = await reg.register(WorkerRecord("w", "h:1", "fp"), lease_ms=10_000)
        idx_a, idx_b = PrefixIndex(), PrefixIndex()
        feed_a = RedisStreamFeed(idx_a, RedisRegistry(redis_flush), block_ms=100)
        feed_b = RedisStreamFeed(idx_b, RedisRegistry(redis_flush), block_ms=100)
        await follow(feed_a)
        await follow(feed_b)
        await until(lambda: idx_a.epoch_of("w") == idx_b.epoch_of("w") == w.epoch,
                    what="both gateways to follow the worker")
        router_a = Router(RoutingConfig(), idx_a)
        turn = make_turn(list(range(32)), HASHER)  # 8 blocks of 4
        hs = list(turn.block_hashes)
        router_a.dispatch(turn, "w")  # what ChatService does when it sends the turn
        feed_a.predicted(w, hs)
        assert idx_a.match(hs).expected_blocks == {"w": 8}
        await until(lambda: idx_b.match(hs).expected_blocks == {"w": 8},
                    what="gateway B to learn A's prediction")
        assert idx_b.match(hs).cached_blocks == {}
        assert feed_a.num_predictions_applied == 0 and feed_b.num_predictions_applied == 1
        assert await reg.publish(w, [OwnershipEvent("store", hs[:6])])
        for ix in (idx_a, idx_b):
            await until(lambda ix=ix: ix.match(hs).cached_blocks == {"w": 6}, what="confirm")
            assert ix.num_confirmed_blocks == 6 and ix.num_expected_blocks("w") == 2
        assert await reg.publish(w, [OwnershipEvent("remove", hs[6:7])])
        await until(lambda: idx_b.num_expected_blocks("w") == 1, what="removal to win")
        assert idx_b.match(hs).expected_blocks == {"w": 6}
        w2 = await reg.register(WorkerRecord("w", "h:1", "fp"), lease_ms=10_000)  # restart
        for ix in (idx_a, idx_b):
            await until(lambda ix=ix: ix.epoch_of("w") == w2.epoch, what="the new epoch")
            assert ix.num_expected_blocks() == 0 and ix.match(hs).expected_blocks == {}
        # A prediction of the old epoch that arrives late is ignored.
        feed_a.predicted(w, hs)
        feed_a.predicted(w2, hs[:2])
        await until(lambda: idx_b.num_expected_blocks("w") == 2, what="the new prediction")
        assert idx_b.match(hs).expected_blocks == {"w": 2}
        for f in (feed_a, feed_b):
            await f.close()
        await reg.close()

    asyncio.run(scenario())


def test_a_replayed_signed_batch_is_refused(redis_flush) -> None:
    """With a keyring, a genuine batch copied back onto the stream later (anyone who can
    XADD can do it) is not applied again, by a gateway following the stream from its start
    nor by one that rebuilt from pg:kv before the copy: a replayed "store" would list
    blocks the worker has since evicted and steer turns there."""
    worker_ring, keyring = _keyrings()

    async def scenario() -> None:
        worker = RedisRegistry(redis_flush, keyring=worker_ring)
        rec = await worker.register(WorkerRecord("w", "h:1", "fp"), lease_ms=10_000)
        hs = hashes(0, 16)
        assert await worker.publish(rec, [OwnershipEvent("store", hs)])
        assert await worker.publish(rec, [OwnershipEvent("remove", hs)])
        following, rebuilt = (RedisRegistry(redis_flush, keyring=keyring) for _ in range(2))
        entries = await following.read_events(b"0-0", block_ms=100)
        assert [e.events[0].kind for e in entries if e.events] == ["store", "remove"]
        position, _, owners = await rebuilt.ownership_snapshot()
        assert owners == {"w": (rec.epoch, {})}
        store_id = next(e.entry_id for e in entries if e.events and e.events[0].kind == "store")
        ((_, fields),) = await worker.raw.xrange(worker.events_key, store_id, store_id)
        await worker.raw.xadd(worker.events_key, fields)  # the replay
        (replayed,) = await following.read_events(entries[-1].entry_id, block_ms=100)
        assert replayed.events == []
        (replayed,) = await rebuilt.read_events(position, block_ms=100)
        assert replayed.events == []
        # The worker's next genuine batch still applies at both.
        assert await worker.publish(rec, [OwnershipEvent("store", hs[:1])])
        for gw, after in ((following, replayed.entry_id), (rebuilt, replayed.entry_id)):
            (genuine,) = await gw.read_events(after, block_ms=100)
            assert [e.kind for e in genuine.events] == ["store"]
        for r in (worker, following, rebuilt):
            await r.close()

    asyncio.run(scenario())


def test_a_malformed_stream_entry_does_not_stop_the_feed(redis_flush) -> None:
    """An entry on pg:events that does not decode (written by anyone who can XADD) is
    skipped: the gateway goes on following the workers' genuine batches after it."""
    async def scenario() -> None:
        reg = RedisRegistry(redis_flush)
        w = await reg.register(WorkerRecord("w", "h:1", "fp"), lease_ms=10_000)
        index = PrefixIndex()
        feed = RedisStreamFeed(index, RedisRegistry(redis_flush), block_ms=100)
        await follow(feed)
        await reg.raw.xadd(reg.events_key, {"w": "w", "e": "not-a-number", "k": "leave"})
        await reg.raw.xadd(reg.events_key, {"w": "w", "e": w.epoch, "k": "batch", "n": "x"})
        hs = hashes(0, 16)
        assert await reg.publish(w, [OwnershipEvent("store", hs)])
        await until(lambda: index.match(hs).cached_blocks == {"w": 4},
                    what="the genuine batch after the malformed entries")
        assert not feed.degraded
        await feed.close()
        await reg.close()

    asyncio.run(scenario())


def test_with_a_keyring_only_signed_predictions_count(redis_flush) -> None:
    """Routing predictions are signed by the gateway that made them (with the gateways'
    key): a forged "predict" entry, or a genuine one copied back onto the stream, steers
    nothing; another gateway's genuine one is applied."""
    worker_ring, keyring = _keyrings()

    async def scenario() -> None:
        reg = RedisRegistry(redis_flush, keyring=worker_ring)
        w = await reg.register(WorkerRecord("w", "h:1", "fp"), lease_ms=10_000)
        idx_a, idx_b = PrefixIndex(), PrefixIndex()
        feed_a = RedisStreamFeed(idx_a, RedisRegistry(redis_flush, keyring=keyring),
                                 block_ms=100)
        feed_b = RedisStreamFeed(idx_b, RedisRegistry(redis_flush, keyring=keyring),
                                 block_ms=100)
        await follow(feed_a)
        await follow(feed_b)
        await until(lambda: idx_b.epoch_of("w") == w.epoch, what="B to follow the worker")
        forged, genuine = hashes(0, 16), hashes(100, 16)
        from prefixgate.registry import pack_hashes

        await reg.raw.xadd(reg.events_key, {"w": "w", "e": w.epoch, "k": "predict",
                                            "g": "rogue", "h": pack_hashes(forged)})
        feed_a.predicted(w, genuine)
        await until(lambda: idx_b.match(genuine).expected_blocks == {"w": 4},
                    what="B to apply A's signed prediction")
        assert idx_b.match(forged).expected_blocks == {}
        # Copy A's genuine entry back onto the stream once its prediction has expired.
        (entry,) = [e for e in await reg.raw.xrange(reg.events_key)
                    if e[1][b"k"] == b"predict" and e[1][b"g"] != b"rogue"]
        idx_b.drop_predictions("w")
        await reg.raw.xadd(reg.events_key, entry[1])
        assert await reg.publish(w, [OwnershipEvent("store", forged[:1])])  # a marker
        await until(lambda: idx_b.match(forged).cached_blocks == {"w": 1}, what="the marker")
        assert idx_b.match(genuine).expected_blocks == {}
        assert feed_b.num_predictions_applied == 1
        for f in (feed_a, feed_b):
            await f.close()
        await reg.close()

    asyncio.run(scenario())


def test_worker_that_cannot_reach_redis_says_so_once(caplog) -> None:
    """A Redis that is not there from the start is named in a warning (once, not per
    retry), with what it means: no gateway routes here meanwhile."""
    import logging
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"

    async def scenario() -> None:
        stop = asyncio.Event()
        pub = RedisPublisher(EventLog(), RedisRegistry(url, timeout_s=0.5),
                             WorkerRecord("w-alone", "h", "fp"), lease_ms=300)
        task = asyncio.create_task(pub.run(stop))
        await asyncio.sleep(1.0)  # several retries
        stop.set()
        await task

    with caplog.at_level(logging.WARNING, logger="prefixgate.workerapi.events"):
        asyncio.run(scenario())
    said = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(said) == 1 and url in said[0] and "w-alone" in said[0], said


def _keyrings():
    """(worker "w"'s own keyring, the gateways' keyring: w's public key, the gateways' key)."""
    from prefixgate.security.identity import Keyring, new_gateway_key, new_worker_key

    private, public = new_worker_key("w")
    return Keyring.parse(private), Keyring.parse(f"{public}\n{new_gateway_key()}")


def test_far_future_sequence_numbers_are_refused_and_fence_nothing(redis_flush) -> None:
    """A batch signed by the worker's own key but numbered 10^12 (its key's holder, or a
    bug) is refused, and the worker's genuine next batch still applies: what a gateway
    expects next never jumps."""
    worker_ring, keyring = _keyrings()

    async def scenario() -> None:
        worker = RedisRegistry(redis_flush, keyring=worker_ring)
        rec = await worker.register(WorkerRecord("w", "h:1", "fp"), lease_ms=10_000)
        hs = hashes(0, 16)
        assert await worker.publish(rec, [OwnershipEvent("store", hs[:1])])
        gateway = RedisRegistry(redis_flush, keyring=keyring)
        entries = await gateway.read_events(b"0-0", block_ms=100)
        signer = worker._signers["w"]
        for seq in (10**12, signer.seq + (1 << 17)):
            signer.seq = seq - 1  # sign the next batch under this number
            assert await worker.publish(rec, [OwnershipEvent("store", hs[1:2])])
            signer.seq = 1
            (far,) = await gateway.read_events(entries[-1].entry_id, block_ms=100)
            assert far.events == [], seq
            entries.append(far)
        assert await worker.publish(rec, [OwnershipEvent("store", hs[2:3])])  # number 2
        (genuine,) = await gateway.read_events(entries[-1].entry_id, block_ms=100)
        assert [e.kind for e in genuine.events] == ["store"]
        for r in (worker, gateway):
            await r.close()

    asyncio.run(scenario())


def test_a_forged_held_set_number_fences_nothing_at_a_starting_gateway(redis_flush) -> None:
    """Anyone with a worker's Redis user can run the publish script for another worker's
    id with a made-up signature and sequence number 10^12 (it writes kvseq beside pg:kv).
    A gateway that starts then neither trusts that set nor resumes after that number: the
    worker's genuine next batch applies there."""
    worker_ring, keyring = _keyrings()

    async def scenario() -> None:
        worker = RedisRegistry(redis_flush, keyring=worker_ring)
        rec = await worker.register(WorkerRecord("w", "h:1", "fp"), lease_ms=10_000)
        assert await worker.publish(rec, [OwnershipEvent("store", hashes(0, 16))])
        attacker = RedisRegistry(redis_flush)
        await attacker._publish(
            keys=[attacker._key("lease", "w"), attacker._key("kv", "w"), attacker.events_key,
                  attacker._key("worker", "w")],
            args=["w", rec.epoch, 1000, b"x" * 64, "ab" * 64, str(10**12), b"clear", b"", b""])
        gateway = RedisRegistry(redis_flush, keyring=keyring)
        position, _, owners = await gateway.ownership_snapshot()
        assert owners["w"] == (rec.epoch, {})  # nothing held: nothing to trust or forge
        assert await worker.publish(rec, [OwnershipEvent("store", hashes(100, 16))])
        *_, genuine = await gateway.read_events(position, block_ms=100)
        assert [e.kind for e in genuine.events] == ["store"]
        for r in (worker, attacker, gateway):
            await r.close()

    asyncio.run(scenario())


def test_unsigned_leave_and_reap_entries_are_refused(redis_flush) -> None:
    """With keys, a "leave" or "reap" entry written by anyone who can XADD (it would make
    gateways forget a live worker's blocks) is refused; the worker's own signed leave and a
    gateway's signed reap are applied."""
    worker_ring, keyring = _keyrings()

    async def scenario() -> None:
        worker = RedisRegistry(redis_flush, keyring=worker_ring)
        rec = await worker.register(WorkerRecord("w", "h:1", "fp"), lease_ms=10_000)
        hs = hashes(0, 16)
        assert await worker.publish(rec, [OwnershipEvent("store", hs)])
        index = PrefixIndex()
        feed = RedisStreamFeed(index, RedisRegistry(redis_flush, keyring=keyring), block_ms=100)
        await follow(feed)
        await until(lambda: index.match(hs).cached_blocks == {"w": 4}, what="w's blocks")
        for kind in ("leave", "reap"):
            await worker.raw.xadd(worker.events_key, {"w": "w", "e": rec.epoch, "k": kind})
            await worker.raw.xadd(worker.events_key, {"w": "w", "e": rec.epoch, "k": kind,
                                                      "s": b"x" * 64})
        assert await worker.publish(rec, [OwnershipEvent("store", hashes(50, 4))])  # marker
        await until(lambda: index.match(hashes(50, 4)).cached_blocks == {"w": 1},
                    what="the marker after the forged entries")
        assert index.match(hs).cached_blocks == {"w": 4}
        await worker.deregister(rec)  # signed by w
        await until(lambda: index.match(hs).cached_blocks == {}, what="w's signed leave")
        # A gateway's signed reap of an expired lease.
        rec = await worker.register(WorkerRecord("w", "h:1", "fp"), lease_ms=150)
        assert await worker.publish(rec, [OwnershipEvent("store", hs)])
        await until(lambda: index.match(hs).cached_blocks == {"w": 4}, what="w again")
        await asyncio.sleep(0.3)
        assert await feed.registry.reap_expired() == ["w"]
        await until(lambda: index.match(hs).cached_blocks == {}, what="the signed reap")
        await feed.close()
        await worker.close()

    asyncio.run(scenario())
