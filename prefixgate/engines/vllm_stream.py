"""Follow one vLLM server's KV event publisher (ZMQ) into a `VLLMEventMapper`.

Contract
--------
`VLLMEventStream(endpoint, mapper, replay_endpoint)` subscribes (ZMQ SUB, connecting to
`endpoint`, e.g. ``tcp://vllm-host:5557``; topic `topic`, vLLM's default "") and, in
`run()` (until cancelled), applies each batch to the mapper in vLLM's sequence order.
vLLM's publisher frames are `(topic, seq, payload)`: `seq` counts batches from 0 per
publisher process (8 bytes big-endian), `payload` is engines/vllm_events.decode_batch's.
vLLM's replay socket (`replay_endpoint`, its `--kv-events-config` `replay_endpoint`; a
DEALER sends the first wanted sequence number and reads `(topic, seq, payload)` frames
until seq -1; releases before 0.32 sent `(seq, payload)`) answers with the batches its
buffer still holds (`buffer_steps`, 10,000 by default) from that number on.

Continuity (why: a sequence number alone cannot tell one vLLM process from the next: a
restarted server numbers from 0 again and may be past the last number seen here by the
time this stream hears from it):
  - The stream is *in step* with the server only from a point where continuity is
    proven. Every (re)connection of the SUB socket to the publisher (ZMQ reconnects on
    its own after a restart, a network fault, or a peer that stopped answering
    heartbeats: a process paused by SIGSTOP) and every gap in the sequence puts it out
    of step. Out of step, the mapper is suspended (this worker's blocks leave the index,
    routing to it uses load and predictions only) and live batches are not applied.
  - Resynchronising (at once when the connection's handshake completes, or at a gap):
    the replay socket is asked from the last batch applied here. Continuity is proven
    when its answer starts with that very batch, byte for byte (digest compared: the
    batch's timestamp and events make another process's batch of the same number
    differ); the batches after it are then applied and the mapper resumes. Otherwise (no
    replay socket, no answer within `replay_timeout_s`, another process, or its buffer
    no longer holds that batch) the mapper is reset: everything this worker held leaves
    the index, since whatever vLLM dropped meanwhile is unknown.
  - After a reset, and at the first subscription, what vLLM's buffer still holds is
    applied (from the oldest batch it keeps) to the empty mapper, then the live stream.
    Applying history whose start is missing is safe: a block is placed only from a
    BlockStored in the applied part (a chain from the root, or after a parent placed
    from it: a chain whose parent was stored earlier stays unplaced), and every later
    removal of that block is in the applied part too, so nothing placed is held unless
    vLLM still holds it. Only under-reporting remains: blocks stored before the buffer's
    start and still cached are not placed until vLLM stores them again, and a block
    whose earlier copy was stored before that start leaves at its first removal.
  - A sequence number at or below the last one that is not a replayed batch seen again
    is another publisher process: out of step, as above.
  - Live batches that queued while a replay was read are recognised by their digests
    and skipped.
  - Stall: `expect_events()` says that vLLM must publish soon (a turn just computed full
    blocks). If no batch arrives within `stall_s` after that, the stream is *stale*: the
    mapper is suspended and the subscription is re-made (a new connection: resynchronised
    as above before anything returns to the index).
Counters (`num_batches`, `num_gaps`, `num_replayed`, `num_resets`, `num_stalls`,
`num_disconnects`, `num_resyncs`) and `stale` / `in_step` are for metrics and tests.
Malformed messages are logged and skipped.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from prefixgate.engines.vllm_events import VLLMEventMapper, decode_batch

log = logging.getLogger(__name__)

__all__ = ["VLLMEventStream"]

_END_SEQ = -1
_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class VLLMEventStream:
    def __init__(self, endpoint: str, mapper: VLLMEventMapper, replay_endpoint: str = "",
                 topic: str = "", stall_s: float = 5.0, replay_timeout_s: float = 2.0,
                 name: str = "") -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.mapper = mapper
        self.topic = topic.encode()
        self.stall_s = stall_s
        self.replay_timeout_s = replay_timeout_s  # most wait for each replayed frame
        self.name = name or endpoint
        self.last_seq: int | None = None  # None: the next batch is taken as the start
        self.last_digest = b""  # of the batch numbered `last_seq`
        self.in_step = False  # continuity with the connected publisher is proven
        self.last_batch_at = 0.0  # monotonic time of the last batch applied
        self._expect_since: float | None = None
        self._replayed: dict[int, bytes] = {}  # seq -> digest, of the latest replay
        self.num_batches = self.num_gaps = self.num_replayed = 0
        self.num_resets = self.num_stalls = self.num_skipped_events = 0
        self.num_disconnects = self.num_resyncs = 0
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
            # Heartbeats let ZMQ notice a dead or stopped peer and reconnect on its own.
            sub.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            monitor = sub.get_monitor_socket(_MONITORED)
            self._out_of_step("a new subscription")
            sub.connect(self.endpoint)
            self.connected.set()
            try:
                await self._follow(sub, monitor)
            finally:
                self.in_step = False  # following no more (stalled, or stopped)
                sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)

    async def _follow(self, sub: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """Apply batches until the stream stalls (then return to re-subscribe)."""
        tick_ms = max(10, int(self.stall_s * 250))
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll(tick_ms))
            if await self._connection_events(monitor):
                await self._resync()
            if sub in ready:
                try:
                    frames = await sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                # A disconnect seen only now may have come before this message: it could
                # be the next publisher's. Not applied; the resync's replay has it.
                if await self._connection_events(monitor):
                    await self._resync()
                    continue
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("vLLM events %s: a message of %d frames is not a KV event "
                                "batch; skipped", self.name, len(frames))
                    continue
                if self.in_step:
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

    async def _connection_events(self, monitor: zmq.asyncio.Socket) -> bool:
        """Read the SUB socket's connection events; True when a connection to the
        publisher was (re)made and the stream is out of step (resynchronise now)."""
        handshake = False
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return handshake and not self.in_step
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.num_disconnects += 1
                self._out_of_step("the connection to the publisher was lost")
                handshake = False
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                handshake = True

    def _out_of_step(self, why: str) -> None:
        if self.in_step:
            log.warning("vLLM events %s: %s: its blocks leave the index until continuity "
                        "is proven", self.name, why)
        self.in_step = False
        if self.last_seq is not None:
            self.mapper.suspend()

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if last is None or seq == last + 1:
            self._apply(seq, payload)
            return
        if seq <= last:
            if self._replayed.get(seq) == _digest(payload):
                return  # queued while the replay that applied it was read
            log.warning("vLLM events %s: sequence went from %d back to %d: another "
                        "publisher process", self.name, last, seq)
        else:
            self.num_gaps += 1
            log.info("vLLM events %s: batches %d..%d missing", self.name, last + 1, seq - 1)
        self.in_step = False
        await self._resync()
        last = self.last_seq
        if last is None or seq == last + 1:
            self._apply(seq, payload)
        elif seq > last + 1 or self._replayed.get(seq) != _digest(payload):
            # The replay did not reach it (or it is none of the replayed): start afresh
            # here; what came before it is unknown.
            self._reset(f"batch {seq} follows no batch the replay had")
            self._apply(seq, payload)

    async def _resync(self) -> None:
        """Prove continuity from the last batch applied, or reset and apply what vLLM's
        buffer still holds (module docstring); then the mapper resumes."""
        self.num_resyncs += 1
        last, digest = self.last_seq, self.last_digest
        self._replayed = {}
        if last is not None:
            got = await self._replay(last)
            if got and got[0][0] == last and _digest(got[0][1]) == digest:
                self._apply_replayed(got[1:])
                self._in_step()
                return
            self._reset("continuity with the publisher is not proven (restarted, or "
                        "events lost beyond its replay buffer)")
        self._apply_replayed(await self._replay(0))
        self._in_step()

    def _in_step(self) -> None:
        self.in_step = True
        self.mapper.resume()

    def _apply_replayed(self, batches: list[tuple[int, bytes]]) -> None:
        """Apply replayed batches in order, from the first one after `last_seq` (any, after
        a reset), stopping at a hole (a later live batch shows the gap)."""
        for seq, payload in batches:
            if self.last_seq is not None and seq != self.last_seq + 1:
                if seq <= self.last_seq:
                    continue
                break
            self._apply(seq, payload)
            self._replayed[seq] = self.last_digest
            self.num_replayed += 1

    def _reset(self, why: str) -> None:
        if self.last_seq is not None:
            log.warning("vLLM events %s: %s: this worker's blocks leave the index", self.name,
                        why)
        self.num_resets += 1
        self.last_seq, self.last_digest = None, b""
        self.mapper.reset()

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq, self.last_digest = seq, _digest(payload)
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

    async def _replay(self, first: int) -> list[tuple[int, bytes]]:
        """The batches vLLM's replay socket holds from `first` on, in order ([] without a
        replay endpoint, or when it does not answer: each frame within
        `replay_timeout_s`, the end marker included)."""
        if not self.replay_endpoint:
            return []
        ctx = zmq.asyncio.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while True:
                if not await dealer.poll(int(self.replay_timeout_s * 1e3)):
                    log.info("vLLM events %s: replay from %d did not finish (no frame within "
                             "%.1f s)", self.name, first, self.replay_timeout_s)
                    return []
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
