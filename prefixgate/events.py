"""KV cache events: what a worker's cache stored, removed or cleared (torch-free).

Contract
--------
The worker's engine reports every change of its prefix cache to a `KVEventSink`, from its
own thread, in the order the changes happened:
  stored(parent_hash, block_hashes)  full blocks now cached, as one chain: block_hashes[0]
                                     extends the block whose hash is `parent_hash` (None:
                                     the chain starts at the namespace's root)
  removed(block_hashes)              blocks no longer cached (evicted or flushed)
  cleared()                          the whole cache was dropped
Hashes are `prefixgate.radix.BlockHasher` chained hashes salted with the model fingerprint
and the request's namespace, so a gateway hashing the same prompt finds the same values.
A sink must not block the engine: it buffers and publishes elsewhere (batched).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class KVEventSink(ABC):
    @abstractmethod
    def stored(self, parent_hash: int | None, block_hashes: Sequence[int]) -> None: ...

    @abstractmethod
    def removed(self, block_hashes: Sequence[int]) -> None: ...

    @abstractmethod
    def cleared(self) -> None: ...


class NullSink(KVEventSink):
    """Drops every event (a worker that publishes to nobody)."""

    def stored(self, parent_hash: int | None, block_hashes: Sequence[int]) -> None:
        pass

    def removed(self, block_hashes: Sequence[int]) -> None:
        pass

    def cleared(self) -> None:
        pass
