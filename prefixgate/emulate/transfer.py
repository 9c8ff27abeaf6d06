"""Block transfer of an emulated worker: the real transfer path (workerapi/transfer.py:
ExportBlocks between workers, the receiver's header checks, stored events), with pages
that stand for a model's and a link that takes the model's time (torch-free).

Contract: `EmulatedTransfer(engine, kv_bytes_per_token, link_bytes_per_s)` is an
`EmulatedEngine`'s `BlockTransfer`. The blocks it pins, reserves and commits are the
engine's `BlockCache` blocks (commit stores them like computed ones: `stored` events, the
engine's status), changed on the engine's loop. What crosses the wire:

  pages    `PAGE_BYTES_PER_TOKEN` bytes per token (zeros), not the model's
           `kv_bytes_per_token`: the emulated model's KV would be gigabytes per pull;
  time     reading a chunk for export waits the time the model's bytes take on the
           link, `n tokens x kv_bytes_per_token / link_bytes_per_s` emulated seconds
           (divided by the engine's time scale on the wall clock), one chunk after another
           per exporting worker (its link is a queue: concurrent pulls from it wait);
  clock    transfers are timed in emulated seconds (`clock`), so the worker's measured
           rate, in page bytes per emulated second, prices a pull (tokens x page bytes per
           token / rate) at exactly the model's time, as its status reports both.

Until a pull measured it, the worker reports its link's rate in page bytes
(`declared_bytes_per_s`): the link is part of the emulated machine, as the prefill rate is.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from prefixgate.workerapi.transfer import BlockTransfer, KVFormat, Reservation

if TYPE_CHECKING:
    from prefixgate.emulate.engine import EmulatedEngine

__all__ = ["PAGE_BYTES_PER_TOKEN", "EmulatedTransfer"]

# One float16 of K and one of V per token: the smallest pages the transfer format allows.
PAGE_BYTES_PER_TOKEN = 4


class EmulatedTransfer(BlockTransfer):
    def __init__(self, engine: EmulatedEngine, kv_bytes_per_token: int,
                 link_bytes_per_s: float) -> None:
        cfg = engine.config
        super().__init__(KVFormat(cfg.model_fingerprint, cfg.block_size, "float16",
                                  num_layers=1, num_kv_heads=1, head_dim=1))
        if kv_bytes_per_token <= 0 or link_bytes_per_s <= 0:
            raise ValueError("an emulated transfer needs kv_bytes_per_token > 0 and "
                             "link_bytes_per_s > 0")
        self.engine = engine
        scale = cfg.time_scale
        # Wall seconds one token takes on the link.
        self._wall_s_per_token = kv_bytes_per_token / link_bytes_per_s / scale
        self.clock: Callable[[], float] = lambda: time.monotonic() * scale
        self.declared_bytes_per_s = link_bytes_per_s * PAGE_BYTES_PER_TOKEN / kv_bytes_per_token
        self._link = threading.Lock()  # the exporting worker's link: one chunk at a time

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the engine's loop (its state lives there) and wait."""
        loop = self.engine.loop
        if loop is None:
            raise RuntimeError("the emulated engine has no loop yet (EmulatedEngine.attach)")
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn(*args))
            except BaseException as exc:  # handed to the waiting thread
                done.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return done.result()

    # -- export -------------------------------------------------------------------------

    def pin(self, chain: Sequence[int], from_block: int) -> Any | None:
        def pin() -> tuple | None:
            handle, n = self.engine.cache.acquire(list(chain))
            if n <= from_block:
                self.engine.cache.release(handle)
                return None
            return handle, n - from_block
        return self._on_loop(pin)

    def pinned_blocks(self, pin: Any) -> int:
        return pin[1]

    def read(self, pin: Any, start: int, count: int) -> tuple[bytes, bytes]:
        num_tokens = count * self.format.block_size
        with self._link:  # on the caller's thread (workerapi/transfer.py): the loop goes on
            time.sleep(num_tokens * self._wall_s_per_token)
        half = bytes(num_tokens * PAGE_BYTES_PER_TOKEN // 2)
        return half, half

    def unpin(self, pin: Any) -> None:
        self._on_loop(self.engine.cache.release, pin[0])

    # -- import -------------------------------------------------------------------------

    def reserve(self, chain: Sequence[int]) -> Reservation:
        def reserve() -> Reservation:
            handle, n = self.engine.cache.acquire(list(chain))
            return Reservation(tuple(chain), n, len(chain) - n, handle)
        return self._on_loop(reserve)

    def write(self, reservation: Reservation, start: int, k: bytes, v: bytes) -> None:
        pass  # the pages stand for the model's: nothing to keep

    def hot_chains(self) -> list[list[int]]:
        def chains() -> list[list[int]]:
            # No hit counts here: the longest chains first (the most tokens kept).
            return sorted((list(h) for h, _ in self.engine.cache.tree.items()), key=len,
                          reverse=True)
        return self._on_loop(chains)

    def commit(self, reservation: Reservation, num_blocks: int) -> int:
        def commit() -> int:
            engine = self.engine
            n = reservation.num_cached + num_blocks
            handle = engine.cache.store(reservation.handle, reservation.chain[:n])
            engine.cache.release(handle)
            engine.refresh_status()
            return n
        return self._on_loop(commit)
