"""The vLLM event stream over real ZMQ sockets speaking vLLM's protocol: in-order batches,
gaps replayed or reset, a restarted publisher, a stall marking the worker stale."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

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
            assert h.stream.num_gaps == 1 and h.stream.num_replayed == 2
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


def test_stall_marks_stale_then_resumes() -> None:
    async def main():
        async with Harness(replay=False, stall_s=0.2) as h:
            h.publish([stored_chain(TOKENS, 16, 0, 6)])
            await h.until(lambda: h.stream.num_batches == 1)
            h.stream.expect_events()  # a turn computed blocks; no event comes
            await h.until(lambda: h.stream.stale)
            assert h.sink.blocks == set() and h.stream.num_stalls == 1
            await h.stream.connected.wait()
            await asyncio.sleep(0.3)  # re-subscribed
            h.publish([("removed", [vhash(TOKENS[:96])])])  # the next batch, no gap
            await h.until(lambda: not h.stream.stale)
            assert h.sink.blocks == set(ours(TOKENS, 16)[:5])
    asyncio.run(main())
