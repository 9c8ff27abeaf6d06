"""The vLLM event stream over real ZMQ sockets speaking vLLM's protocol: in-order batches,
gaps replayed or reset, a restarted publisher (numbering below or past the last batch
seen), a reconnection to the same publisher proven continuous, history whose start
vLLM's buffer no longer holds, a stall marking the worker stale."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from prefixgate.engines.vllm_events import VLLMEventMapper
from prefixgate.engines.vllm_stream import VLLMEventStream
from prefixgate.radix import Hashers
from tests.engines.test_vllm_events import FP, SetSink, ours
from tests.engines.vllm_wire import Publisher, stored_chain, vhash

TOKENS = list(range(16 * 6))


class Harness:
    def __init__(self, replay: bool, array_like: bool = False, stall_s: float = 5.0) -> None:
        self.pub = Publisher(array_like=array_like, replay=replay)
        self.sink = SetSink()
        self.mapper = VLLMEventMapper(Hashers(16, FP), self.sink)
        self.stream = VLLMEventStream(self.pub.endpoint, self.mapper, self.pub.replay_endpoint,
                                      stall_s=stall_s, replay_timeout_s=1.0)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._replayer = threading.Thread(target=self._serve_replay, daemon=True)

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self.pub.serve_replay(0)
            time.sleep(0.005)

    def publish(self, events, send: bool = True) -> None:
        with self._lock:
            self.pub.publish(events, send)

    async def __aenter__(self):
        self.task = asyncio.create_task(self.stream.run())
        await self.stream.connected.wait()
        await asyncio.sleep(0.3)  # ZMQ's subscription reaches the publisher
        if self.pub.router is not None:
            self._replayer.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self._stop.set()
        if self._replayer.is_alive():
            self._replayer.join()
        self.pub.close()

    async def until(self, cond, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, "condition not reached"
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("array_like", [False, True])
def test_batches_in_order(array_like: bool) -> None:
    async def main():
        async with Harness(replay=False, array_like=array_like) as h:
            h.publish([stored_chain(TOKENS, 16, 0, 3)])
            h.publish([stored_chain(TOKENS, 16, 3, 6)])
            await h.until(lambda: h.stream.num_batches == 2)
            assert h.sink.blocks == set(ours(TOKENS, 16))
            h.publish([("removed", [vhash(TOKENS[:96])])])
            await h.until(lambda: h.stream.num_batches == 3)
            assert h.sink.blocks == set(ours(TOKENS, 16)[:5])
    asyncio.run(main())


def test_gap_is_replayed() -> None:
    async def main():
        async with Harness(replay=True) as h:
            h.publish([stored_chain(TOKENS, 16, 0, 3)])
            h.publish([stored_chain(TOKENS, 16, 3, 6)], send=False)  # lost on the way
            h.publish([("removed", [vhash(TOKENS[:16])])], send=False)  # lost too
            h.publish([stored_chain(TOKENS, 16, 0, 1)])  # vLLM recomputed block 0
            await h.until(lambda: h.stream.num_batches == 4)
            # 1 and 2 were lost; 3 came live too (after the replay had applied it)
            assert h.stream.num_gaps == 1 and h.stream.num_replayed == 3
            assert h.stream.num_resets == 0
            assert h.sink.blocks == set(ours(TOKENS, 16))
    asyncio.run(main())


def test_gap_without_replay_resets_the_worker() -> None:
    async def main():
        async with Harness(replay=False) as h:
            h.publish([stored_chain(TOKENS, 16, 0, 6)])
            await h.until(lambda: h.stream.num_batches == 1)
            h.publish([("removed", [vhash(TOKENS[:48])])], send=False)  # lost: unknown
            other = [t + 500 for t in TOKENS]
            h.publish([stored_chain(other, 16, 0, 2)])
            await h.until(lambda: h.stream.num_batches == 2)
            # Nothing of before the gap is kept (block 2 was dropped and nobody knows).
            assert h.stream.num_resets == 1
            assert h.sink.blocks == set(ours(other, 16)[:2])
    asyncio.run(main())


def test_restarted_publisher_resets() -> None:
    async def main():
        async with Harness(replay=False) as h:
            h.publish([stored_chain(TOKENS, 16, 0, 6)])
            h.publish([])
            await h.until(lambda: h.stream.num_batches == 2)
            h.pub.seq = 0  # a new vLLM process numbers from 0 again
            h.publish([stored_chain(TOKENS, 16, 0, 1)])
            await h.until(lambda: h.stream.num_batches == 3)
            assert h.stream.num_resets == 1
            assert h.sink.blocks == set(ours(TOKENS, 16)[:1])
    asyncio.run(main())


def test_history_is_replayed_on_subscribe() -> None:
    async def main():
        h = Harness(replay=True)
        h.pub.publish([stored_chain(TOKENS, 16, 0, 3)], send=False)  # before we subscribed
        async with h:
            h.publish([stored_chain(TOKENS, 16, 3, 6)])
            await h.until(lambda: h.stream.num_batches == 2)
            assert h.sink.blocks == set(ours(TOKENS, 16))
    asyncio.run(main())


@pytest.mark.parametrize("replay", [True, False])
def test_stall_marks_stale_then_resumes(replay: bool) -> None:
    """After a stall the stream subscribes anew: with the replay socket, continuity with
    the same publisher is proven and the blocks return; without, it cannot be: reset."""
    async def main():
        async with Harness(replay=replay, stall_s=0.2) as h:
            h.publish([stored_chain(TOKENS, 16, 0, 6)])
            await h.until(lambda: h.stream.num_batches == 1)
            h.stream.expect_events()  # a turn computed blocks; no event comes
            await h.until(lambda: h.stream.num_stalls == 1)
            assert ("clear",) in h.sink.calls  # its blocks left the index
            await h.until(lambda: h.stream.in_step)  # re-subscribed
            await asyncio.sleep(0.3)  # the subscription reached the publisher
            h.publish([("removed", [vhash(TOKENS[:96])])])  # the next batch, no gap
            await h.until(lambda: not h.stream.stale and h.stream.num_batches == 2)
            if replay:
                assert h.sink.blocks == set(ours(TOKENS, 16)[:5]) and not h.stream.num_resets
            else:
                assert h.sink.blocks == set() and h.stream.num_resets == 1
    asyncio.run(main())


def _rebind(h: Harness, seq: int, keep_buffer: bool) -> None:
    """The publisher's sockets closed and bound again at the same ports: the same process
    after a network fault (`keep_buffer`), or a restarted one numbering from `seq`."""
    with h._lock:
        pub = h.pub
        pub.pub.close(linger=0)
        pub.router.close(linger=0)
        time.sleep(0.2)
        pub.pub = pub.ctx.socket(zmq.PUB)
        pub.pub.bind(pub.endpoint)
        pub.router = pub.ctx.socket(zmq.ROUTER)
        pub.router.bind(pub.replay_endpoint)
        pub.seq = seq
        if not keep_buffer:
            pub.buffer = []


def test_a_restarted_publisher_numbering_past_the_last_seen_resets() -> None:
    """A new vLLM process that published more batches than the old one had before the
    stream heard from it: its first batch numbers past the last one seen. Not taken for
    a gap replayed from the new server: the old server's blocks leave the index."""
    async def main():
        async with Harness(replay=True) as h:
            h.publish([stored_chain(TOKENS, 16, 0, 6)])
            h.publish([])
            await h.until(lambda: h.stream.num_batches == 2)
            _rebind(h, 0, keep_buffer=False)
            other = [t + 500 for t in TOKENS]
            for _ in range(4):  # batches 0..3 of the new process, before we reconnect
                h.publish([], send=False)
            h.publish([stored_chain(other, 16, 0, 2)], send=False)
            await h.until(lambda: h.stream.num_disconnects >= 1)
            await h.until(lambda: h.stream.in_step)
            assert h.stream.num_resets == 1
            assert h.sink.blocks == set(ours(other, 16)[:2])
            h.publish([("removed", [vhash(other[:32], "")])])  # batch 5: live, in step
            await h.until(lambda: h.stream.last_seq == 5)
            assert h.sink.blocks == set(ours(other, 16)[:1])
    asyncio.run(main())


def test_a_reconnection_to_the_same_publisher_keeps_its_blocks() -> None:
    """A network fault: the same process (its buffer and numbering go on) is reached
    again; its replay proves continuity, the batches missed meanwhile are applied."""
    async def main():
        async with Harness(replay=True) as h:
            h.publish([stored_chain(TOKENS, 16, 0, 6)])
            await h.until(lambda: h.stream.num_batches == 1)
            _rebind(h, 1, keep_buffer=True)
            h.publish([("removed", [vhash(TOKENS[:96])])], send=False)  # missed
            await h.until(lambda: h.stream.num_disconnects >= 1)
            await h.until(lambda: h.stream.in_step and h.stream.last_seq == 1)
            assert h.stream.num_resets == 0
            assert h.sink.blocks == set(ours(TOKENS, 16)[:5])
    asyncio.run(main())


def test_a_reconnection_without_replay_resets() -> None:
    async def main():
        async with Harness(replay=True) as h:
            h.stream.replay_endpoint = ""  # continuity cannot be proven
            h.publish([stored_chain(TOKENS, 16, 0, 6)])
            await h.until(lambda: h.stream.num_batches == 1)
            _rebind(h, 1, keep_buffer=True)
            await h.until(lambda: h.stream.num_disconnects >= 1)
            await h.until(lambda: h.stream.in_step)
            assert h.stream.num_resets == 1 and h.sink.blocks == set()
    asyncio.run(main())


def test_history_whose_start_the_buffer_lost_is_applied() -> None:
    """A gateway subscribing after vLLM's replay buffer wrapped: the chains stored from
    the root within what the buffer holds are placed, removals of blocks it never saw
    are ignored, and a chain whose parent came before the buffer's start is not."""
    async def main():
        h = Harness(replay=True)
        a, c = TOKENS, [t + 700 for t in TOKENS]
        h.pub.publish([stored_chain(a, 16, 0, 3)], send=False)  # 0: lost from the buffer
        h.pub.publish([stored_chain(c, 16, 0, 3)], send=False)  # 1
        h.pub.publish([("removed", [vhash(a[:32])])], send=False)  # 2
        h.pub.publish([stored_chain(a, 16, 3, 6)], send=False)  # 3: parent before start
        h.pub.buffer = h.pub.buffer[1:]  # vLLM's buffer keeps its last batches only
        async with h:
            await h.until(lambda: h.stream.num_batches == 3)
            assert h.sink.blocks == set(ours(c, 16)[:3])
            assert h.stream.mapper.num_unplaced_blocks == 3
            h.publish([stored_chain(a, 16, 0, 2)])  # live: seq 4
            await h.until(lambda: h.stream.num_batches == 4)
            assert h.sink.blocks == set(ours(c, 16)[:3]) | set(ours(a, 16)[:2])
    asyncio.run(main())
