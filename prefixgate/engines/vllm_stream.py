"""Follow one vLLM server's KV event publisher (ZMQ) into a `VLLMEventMapper`.

Contract
--------
`VLLMEventStream(endpoint, mapper, replay_endpoint)` subscribes (ZMQ SUB, connecting to
`endpoint`, e.g. ``tcp://vllm-host:5557``; topic `topic`, vLLM's default "") and, in
`run()` (until cancelled), applies each batch to the mapper in vLLM's sequence order.
vLLM's publisher frames are `(topic, seq, payload)`: `seq` counts batches from 0 per
publisher process (8 bytes big-endian), `payload` is engines/vllm_events.decode_batch's.

  - The next sequence number: applied.
  - A gap (batches lost: ZMQ drops when a subscriber is slow or reconnects): the missing
    batches are asked of vLLM's replay socket (`replay_endpoint`, its
    `--kv-events-config` `replay_endpoint`; a DEALER sends the first wanted sequence
    number and reads `(topic, seq, payload)` frames until seq -1; releases before 0.32
    sent `(seq, payload)`). When they cannot all be had
    (no replay endpoint, no answer within `replay_timeout_s`, or vLLM's buffer no longer
    holds them), the mapper is reset: this worker's blocks leave the index, because
    whatever vLLM removed meanwhile is unknown. The index never keeps a block vLLM
    dropped; it may miss blocks until they are used again.
  - A sequence number at or below the last one: the publisher restarted (vLLM was
    restarted, its cache is empty): reset, then applied.
  - The first batch after subscribing: with a replay endpoint, the history vLLM still
    buffers is replayed first, so blocks cached before this process started are known.
  - Stall: `expect_events()` says that vLLM must publish soon (a turn just computed full
    blocks). If no batch arrives within `stall_s` after that, the stream is *stale*: the
    mapper is suspended (the worker's blocks leave the index; routing to it uses load and
    predictions only) and the subscription is re-made. When batches flow again without a
    gap the mapper resumes (its blocks return to the index at once); after a gap, the
    rules above apply first.
Counters (`num_batches`, `num_gaps`, `num_replayed`, `num_resets`, `num_stalls`) and
`stale` are for metrics and tests. Malformed messages are logged and skipped.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from prefixgate.engines.vllm_events import VLLMEventMapper, decode_batch

log = logging.getLogger(__name__)

__all__ = ["VLLMEventStream"]

_END_SEQ = -1


class VLLMEventStream:
    def __init__(self, endpoint: str, mapper: VLLMEventMapper, replay_endpoint: str = "",
                 topic: str = "", stall_s: float = 5.0, replay_timeout_s: float = 2.0,
                 name: str = "") -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.mapper = mapper
        self.topic = topic.encode()
        self.stall_s = stall_s
        self.replay_timeout_s = replay_timeout_s
        self.name = name or endpoint
        self.last_seq: int | None = None
        self.last_batch_at = 0.0  # monotonic time of the last batch applied
        self._expect_since: float | None = None
        self.num_batches = self.num_gaps = self.num_replayed = 0
        self.num_resets = self.num_stalls = self.num_skipped_events = 0
        self.connected = asyncio.Event()  # set once the SUB socket is connected

    @property
    def stale(self) -> bool:
        return self.mapper.suspended

    def expect_events(self, since: float | None = None) -> None:
        """vLLM should publish a batch soon, after monotonic time `since` (default: now): the
        stall clock starts unless one is running."""
        if self._expect_since is None:
            self._expect_since = time.monotonic() if since is None else since

    async def run(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        while True:
            sub = ctx.socket(zmq.SUB)
            # Heartbeats let ZMQ notice a dead peer and reconnect on its own.
            sub.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.connect(self.endpoint)
            self.connected.set()
            try:
                await self._follow(sub)
            finally:
                sub.close(linger=0)

    async def _follow(self, sub: zmq.asyncio.Socket) -> None:
        """Apply batches until the stream stalls (then return to re-subscribe)."""
        tick_ms = max(10, int(self.stall_s * 250))
        while True:
            if await sub.poll(tick_ms):
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("vLLM events %s: a message of %d frames is not a KV event "
                                "batch; skipped", self.name, len(frames))
                    continue
                await self._on_batch(int.from_bytes(frames[1], "big"), frames[2])
                continue
            since = self._expect_since
            if since is not None and self.last_batch_at < since and \
                    time.monotonic() - since > self.stall_s:
                self._expect_since = None
                self.num_stalls += 1
                log.warning("vLLM events %s: no batch for %.1f s after a turn that cached "
                            "blocks: its blocks leave the index until events flow again",
                            self.name, self.stall_s)
                self.mapper.suspend()
                return

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if last is None:
            if self.replay_endpoint and seq > 0:
                await self._catch_up(0, seq)  # whatever history vLLM still holds
        elif seq <= last:
            log.warning("vLLM events %s: sequence went from %d back to %d: the server "
                        "restarted, its cache is empty", self.name, last, seq)
            self._reset()
            if self.replay_endpoint and seq > 0:
                await self._catch_up(0, seq)
        elif seq > last + 1:
            self.num_gaps += 1
            if not await self._catch_up(last + 1, seq):
                log.warning("vLLM events %s: batches %d..%d were lost and could not be "
                            "replayed: this worker's blocks leave the index", self.name,
                            last + 1, seq - 1)
                self._reset()
        self.mapper.resume()
        self._apply(seq, payload)

    def _reset(self) -> None:
        self.num_resets += 1
        self.mapper.reset()

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self.last_batch_at = time.monotonic()
        self._expect_since = None
        self.num_batches += 1
        try:
            _, events, skipped = decode_batch(payload)
        except ValueError as exc:
            log.warning("vLLM events %s: batch %d skipped: %s", self.name, seq, exc)
            return
        self.num_skipped_events += skipped
        self.mapper.apply(events)

    async def _catch_up(self, first: int, upto: int) -> bool:
        """Apply batches [first, upto) from the replay socket; False (nothing applied)
        unless all of them came."""
        if not self.replay_endpoint:
            return False
        got = await self._replay(first)
        want = [(s, p) for s, p in got if first <= s < upto]
        if [s for s, _ in want] != list(range(first, upto)):
            log.info("vLLM events %s: replay had %d of batches %d..%d", self.name, len(want),
                     first, upto - 1)
            return False
        for s, p in want:
            self._apply(s, p)
        self.num_replayed += len(want)
        return True

    async def _replay(self, first: int) -> list[tuple[int, bytes]]:
        ctx = zmq.asyncio.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", first.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left_ms = int((deadline - time.monotonic()) * 1e3)
                if left_ms <= 0 or not await dealer.poll(left_ms):
                    log.info("vLLM events %s: replay did not finish within %.1f s",
                             self.name, self.replay_timeout_s)
                    return out
                # [b"", topic, seq, payload] (vLLM 0.32) or [b"", seq, payload]
                frames = await dealer.recv_multipart()
                if len(frames) not in (3, 4) or len(frames[-2]) != 8:
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == _END_SEQ:
                    return out
                out.append((seq, frames[-1]))
        finally:
            dealer.close(linger=0)
