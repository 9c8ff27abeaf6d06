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

`OwnershipEvent` is the record of one such change as it travels: a worker's publisher
buffers them, the Worker API's WatchEvents stream and the Redis registry carry them, and
gateways apply them to their routing index. The one record for every hop.

`chains(blocks)` turns a set of cached blocks (hash -> parent hash) back into `stored`
chains in an order a reader can apply (snapshots of a worker's cache).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class OwnershipEvent:
    """One change of a worker's cached blocks.

    kind: "store" (`block_hashes` as one chain extending `parent_hash`; None: the root),
    "remove" (`block_hashes`, in any order) or "clear" (every block; no hashes)."""

    kind: str
    block_hashes: Sequence[int] = ()
    parent_hash: int | None = None


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


def chains(blocks: Mapping[int, int | None]) -> list[tuple[int | None, list[int]]]:
    """`(parent_hash, block_hashes)` chains that store exactly `blocks` (block hash ->
    parent hash, None for a chain's first block at the root), each chain after the chain
    holding its parent; single-child runs form one chain. A block whose parent is not in
    `blocks` starts a chain with that parent (a reader that cannot place it drops it)."""
    children: dict[int | None, list[int]] = {}
    orphans: list[int] = []
    for h, parent in blocks.items():
        if parent is not None and parent not in blocks:
            orphans.append(h)
        else:
            children.setdefault(parent, []).append(h)
    out: list[tuple[int | None, list[int]]] = []
    stack: list[tuple[int | None, int]] = [(blocks[h], h) for h in reversed(orphans)]
    stack += [(None, h) for h in reversed(children.get(None, []))]
    while stack:
        parent, h = stack.pop()
        chain = [h]
        while len(children.get(chain[-1], ())) == 1:
            chain.append(children[chain[-1]][0])
        out.append((parent, chain))
        stack.extend((chain[-1], c) for c in reversed(children.get(chain[-1], [])))
    return out
