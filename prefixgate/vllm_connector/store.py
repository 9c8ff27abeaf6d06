"""The connector's host store: the KV pages of blocks vLLM computed, keyed by prefixgate
block hashes, so that peers can pull them (export.py) whatever vLLM does with its own cache.

Contract
--------
`HostStore(max_bytes)` holds `Page`s (one prefixgate block: K and V as CPU tensors
`[num_layers, block_size, num_kv_heads, head_dim]`, the wire layout, in vLLM's dtype) under their chained
block hash, least recently used first out once over `max_bytes`. Thread-safe: vLLM's
engine thread puts pages while export threads read runs. A run handed out holds its pages
(plain references), so an eviction meanwhile never changes what an export sends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Page:
    fingerprint: str  # model fingerprint the hash was made with
    block_size: int
    k: Any  # torch.Tensor (this module stays torch-free)
    v: Any

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class HostStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._pages: OrderedDict[int, Page] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def put(self, block_hash: int, page: Page) -> None:
        if page.num_bytes > self.max_bytes:
            return
        with self._lock:
            old = self._pages.pop(block_hash, None)
            if old is not None:
                self.num_bytes -= old.num_bytes
            self._pages[block_hash] = page
            self.num_bytes += page.num_bytes
            while self.num_bytes > self.max_bytes:
                _, dropped = self._pages.popitem(last=False)
                self.num_bytes -= dropped.num_bytes

    def run(self, chain: Sequence[int], start: int) -> list[Page]:
        """Pages of chain[start], chain[start + 1], ... while held (a run of one model and
        block size; touched as recently used)."""
        out: list[Page] = []
        with self._lock:
            for h in chain[start:]:
                page = self._pages.get(h)
                if page is None or (out and (page.fingerprint, page.block_size)
                                    != (out[0].fingerprint, out[0].block_size)):
                    break
                self._pages.move_to_end(h)
                out.append(page)
        return out
