"""`PagedBlockTransfer`: the `BlockTransfer` contract (workerapi/transfer.py) over a
`PagedEngine`'s prefix cache and KV pool.

Pins, reservations and commits run on the engine thread (`PagedEngine.on_engine_thread`,
between steps); page copies run on the caller's thread. That is safe because a pinned
block is locked in the radix tree and referenced (never evicted, and a block's K/V is
written once, before it is cached), and a reserved block is referenced by the
reservation alone until it is committed: no step reads or writes the slots copied.

Pages go out as `pool.k[:, slots]` and `pool.v[:, slots]` for the blocks' token slots:
[num_layers, num_blocks * block_size, num_kv_heads, head_dim], the pool's own dtype and
layout (KV_LAYOUT_LAYER_TOKEN_HEAD_DIM), and come in the same way.

Page digests: each block that enters the prefix cache (computed, or pulled and verified)
has the digest of its pages recorded then, on the engine thread (security/kv_pages.py
`chunk_digests`, each block's `block_digest`; a cached block's pages are never written
again), and exports send the recorded digests, not ones computed at export time.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from prefixgate.radix import Node
from prefixgate.security.kv_pages import chunk_digests
from prefixgate.workerapi.transfer import BlockTransfer, KVFormat, Reservation

if TYPE_CHECKING:
    from prefixgate.worker.engine import PagedEngine

# torch.frombuffer warns on read-only buffers (protobuf bytes): the pages are copied into
# the pool at once and the view never written through.
warnings.filterwarnings("ignore", message="The given buffer is not writable",
                        category=UserWarning)


@dataclass
class _Pin:
    handle: Node[int]
    block_ids: list[int]  # the whole matched run (one pool reference each)
    from_block: int


class PagedBlockTransfer(BlockTransfer):
    def __init__(self, engine: PagedEngine) -> None:
        pool = engine.pool.config
        super().__init__(KVFormat(
            model_fingerprint=engine.config.model_fingerprint, block_size=pool.block_size,
            dtype=str(pool.dtype).removeprefix("torch."), num_layers=pool.num_layers,
            num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim))
        self.engine = engine
        self.pool = engine.pool
        self.cache = engine.cache
        # block id -> the digest of its pages when it entered the cache (an entry of an
        # evicted block is stale until the block is cached again, and never read then:
        # exports read pinned blocks only).
        self._digests: dict[int, bytes] = {}
        self.cache.on_insert = self._record_digests

    # --- export ------------------------------------------------------------------------

    def pin(self, chain: Sequence[int], from_block: int) -> _Pin | None:
        def on_engine() -> _Pin | None:
            handle, ids = self.cache.match(chain)
            if len(ids) > from_block:
                return _Pin(handle, ids, from_block)
            self.pool.release(ids)
            self.cache.unlock(handle)
            return None
        return self.engine.on_engine_thread(on_engine)

    def pinned_blocks(self, pin: _Pin) -> int:
        return len(pin.block_ids) - pin.from_block

    def read(self, pin: _Pin, start: int, count: int) -> tuple[bytes, bytes]:
        first = pin.from_block + start
        runs = self._runs(pin.block_ids[first:first + count])
        return _gather(self.pool.k, runs), _gather(self.pool.v, runs)

    def digests(self, pin: _Pin, start: int, count: int) -> list[bytes]:
        first = pin.from_block + start
        return [self._digests.get(b, b"") for b in pin.block_ids[first:first + count]]

    def _record_digests(self, block_ids: Sequence[int]) -> None:
        """On the engine thread, as blocks enter the prefix cache: their pages gathered
        once (one copy off the device for all of them), then one digest per block."""
        if not block_ids:
            return
        runs = self._runs(block_ids)
        digests = chunk_digests(_gather(self.pool.k, runs), _gather(self.pool.v, runs),
                                len(block_ids), self.pool.config.num_layers)
        self._digests.update(zip(block_ids, digests, strict=True))

    def unpin(self, pin: _Pin) -> None:
        def on_engine() -> None:
            self.pool.release(pin.block_ids)
            self.cache.unlock(pin.handle)
        self.engine.on_engine_thread(on_engine)

    # --- import ------------------------------------------------------------------------

    def reserve(self, chain: Sequence[int]) -> Reservation:
        def on_engine() -> Reservation:
            handle, ids = self.cache.match(chain)
            # Only what can be had without preempting a running request: free blocks,
            # then unlocked cached ones (the run matched above is locked).
            room = self.pool.num_free_blocks + self.cache.num_evictable_blocks
            want = min(len(chain) - len(ids), room)
            fresh = (self.engine.blocks.acquire(want) or []) if want > 0 else []
            return Reservation(tuple(chain), len(ids), len(fresh), (handle, ids, fresh))
        return self.engine.on_engine_thread(on_engine)

    def write(self, reservation: Reservation, start: int, k: bytes, v: bytes) -> None:
        fresh = reservation.handle[2]
        c = self.pool.config
        n = len(k) // (c.block_size * c.num_layers * c.num_kv_heads * c.head_dim
                       * self.pool.k.element_size())
        shape = (c.num_layers, n * c.block_size, c.num_kv_heads, c.head_dim)
        runs = self._runs(fresh[start:start + n])
        for dst, data in ((self.pool.k, k), (self.pool.v, v)):
            if dst.device.type == "cpu":
                # numpy's strided assignment, on raw bytes (any dtype, bfloat16 included):
                # torch's copy_ into a [:, a:b] view of the pool ran ~90x slower here
                # (0.17 vs 15 GB/s, 2 busy cores).
                dst_np = dst.view(torch.uint8).numpy()
                src_np = np.frombuffer(data, np.uint8).reshape(
                    shape[0], shape[1], shape[2], -1)
                at = 0
                for a, b in runs:
                    dst_np[:, a:b] = src_np[:, at:at + b - a]
                    at += b - a
                continue
            src = torch.frombuffer(data, dtype=c.dtype).view(shape).to(dst.device)
            at = 0
            for a, b in runs:
                dst[:, a:b].copy_(src[:, at:at + b - a])
                at += b - a

    def commit(self, reservation: Reservation, num_blocks: int) -> int:
        handle, ids, fresh = reservation.handle
        chain = reservation.chain

        def on_engine() -> int:
            m = len(ids)
            if num_blocks:
                # Hands the references on ids (taken by match) and on the filled fresh
                # blocks to the cache; publishes `stored` for the new ones.
                self.cache.insert(chain[:m + num_blocks], [*ids, *fresh[:num_blocks]])
            else:
                self.pool.release(ids)
            self.pool.release(fresh[num_blocks:])
            self.cache.unlock(handle)
            return self.cache.tree.match(chain, touch=False).num_blocks
        return self.engine.on_engine_thread(on_engine)

    def hot_chains(self) -> list[list[int]]:
        return self.engine.on_engine_thread(self.cache.hot_chains)

    def _runs(self, block_ids: Sequence[int]) -> list[tuple[int, int]]:
        """The token slots of `block_ids`, in order, as [start, end) runs of consecutive
        blocks: slices copy at memory speed, where a gather of scattered slots (index_select
        over the token dimension) ran ~6x slower here."""
        bs = self.pool.config.block_size
        runs: list[tuple[int, int]] = []
        for b in block_ids:
            if runs and runs[-1][1] == b * bs:
                runs[-1] = (runs[-1][0], (b + 1) * bs)
            else:
                runs.append((b * bs, (b + 1) * bs))
        return runs


def _gather(pool: torch.Tensor, runs: list[tuple[int, int]]) -> bytes:
    """The bytes of pool[:, slots of runs] as one row-major [layers, tokens, heads, dim]
    array (any dtype, bfloat16 included): one copy for a single run. On the CPU through
    numpy (torch's strided copies ran far slower here, see `write`)."""
    raw = pool.view(torch.uint8)
    if raw.device.type == "cpu":
        arr = raw.numpy()
        if len(runs) == 1:
            return arr[:, runs[0][0]:runs[0][1]].tobytes()
        return np.concatenate([arr[:, a:b] for a, b in runs], axis=1).tobytes()
    t = torch.cat([raw[:, a:b] for a, b in runs], dim=1) if len(runs) > 1 else \
        raw[:, runs[0][0]:runs[0][1]]
    return t.cpu().numpy().tobytes()
