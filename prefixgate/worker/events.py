"""Worker-side KV event publishing: the engine's sink and the transports that follow it.

Contract
--------
`EventLog` is the one `KVEventSink` a worker gives its engine. Called from the engine's
thread, it only appends under a lock (never blocks on I/O): each event gets a sequence
number (1, 2, ...) in a bounded ring, and a mirror of the blocks the cache holds now
(block hash -> parent hash) is kept up to date, so a snapshot needs no engine API.
Transports read it from the asyncio side, each with its own cursor:

  WorkerService.WatchEvents  (server.py) streams it to gateways that follow the worker
                             directly (embedded registry, `prefixgate up` without Redis);
  RedisEventPublisher        (below) applies it to Redis: block ownership and the shared
                             event stream, one round trip per batch, fenced by the lease's
                             epoch.

`read(after_seq)` returns the events after a cursor, or None when the ring no longer holds
them (the reader fell behind): it then takes `snapshot()` (the whole cache as stored
chains, parents first, and the sequence number it reflects) and continues from there.
`incarnation` (nanoseconds since the epoch at creation) identifies this process's log: a
reader holding a cursor of another incarnation must start from a snapshot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prefixgate.events import KVEventSink

log = logging.getLogger(__name__)

__all__ = ["EventLog", "KVEvent"]


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One cache change. kind: "stored" (parent_hash, block_hashes), "removed"
    (block_hashes) or "cleared"."""

    kind: str
    block_hashes: tuple[int, ...] = ()
    parent_hash: int | None = None


class EventLog(KVEventSink):
    """Sequenced, bounded log of cache events plus a mirror of the cached blocks."""

    def __init__(self, capacity_events: int = 65536) -> None:
        if capacity_events < 1:
            raise ValueError("capacity_events must be >= 1")
        self.incarnation = time.time_ns()
        self._lock = threading.Lock()
        self._ring: deque[KVEvent] = deque(maxlen=capacity_events)
        self._seq = 0  # sequence number of the newest event
        self._blocks: dict[int, int | None] = {}  # cached block -> its parent (None: root)
        self._listeners: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ sink (engine thread)

    def stored(self, parent_hash: int | None, block_hashes: Sequence[int]) -> None:
        if not block_hashes:
            return
        hs = tuple(block_hashes)
        with self._lock:
            blocks = self._blocks
            parent = parent_hash
            for h in hs:
                blocks[h] = parent
                parent = h
            self._append(KVEvent("stored", hs, parent_hash))

    def removed(self, block_hashes: Sequence[int]) -> None:
        if not block_hashes:
            return
        hs = tuple(block_hashes)
        with self._lock:
            for h in hs:
                self._blocks.pop(h, None)
            self._append(KVEvent("removed", hs))

    def cleared(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._append(KVEvent("cleared"))

    def _append(self, event: KVEvent) -> None:
        self._ring.append(event)
        self._seq += 1
        for notify in self._listeners:
            try:
                notify()
            except Exception:  # a closed loop of a gone reader must not break the engine
                log.debug("event listener failed", exc_info=True)

    # ------------------------------------------------------------------ readers

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def num_blocks(self) -> int:
        """Blocks the cache holds now (per the events)."""
        return len(self._blocks)

    def subscribe(self, notify: Callable[[], None]) -> Callable[[], None]:
        """Call `notify()` (from the engine's thread: make it thread-safe and quick) after
        each new event; returns the function that unsubscribes."""
        with self._lock:
            self._listeners = [*self._listeners, notify]

        def unsubscribe() -> None:
            with self._lock:
                self._listeners = [f for f in self._listeners if f is not notify]
        return unsubscribe

    def read(self, after_seq: int, max_events: int = 4096) -> tuple[list[KVEvent], int] | None:
        """Up to `max_events` events after `after_seq` and the sequence number of the last
        one returned; None when they are no longer held (take a snapshot)."""
        with self._lock:
            seq, ring = self._seq, self._ring
            first = seq - len(ring) + 1  # sequence number of ring[0]
            if after_seq > seq or after_seq < first - 1:
                return None
            start = after_seq - first + 1
            n = min(max_events, seq - after_seq)
            events = [ring[i] for i in range(start, start + n)]
            return events, after_seq + n

    def snapshot(self) -> tuple[list[KVEvent], int]:
        """The cached blocks as stored chains (each chain's parent comes earlier, or is
        None) and the sequence number they reflect."""
        with self._lock:
            blocks = dict(self._blocks)
            seq = self._seq
        children: dict[int | None, list[int]] = {}
        for h, parent in blocks.items():
            # A block whose parent is gone still hangs where the engine put it.
            children.setdefault(parent if parent is None or parent in blocks else -1,
                                []).append(h)
        out: list[KVEvent] = []
        # Orphans (parent no longer cached) are emitted with their parent: a reader that
        # cannot place them drops them, as it would have live.
        stack: list[tuple[int | None, int]] = [(None, h) for h in reversed(children.get(None, []))]
        stack += [(blocks[h], h) for h in reversed(children.get(-1, []))]
        while stack:
            parent, h = stack.pop()
            chain = [h]
            while len(children.get(chain[-1], ())) == 1:  # follow single-child runs
                chain.append(children[chain[-1]][0])
            out.append(KVEvent("stored", tuple(chain), parent))
            stack.extend((chain[-1], c) for c in reversed(children.get(chain[-1], [])))
        return out, seq
