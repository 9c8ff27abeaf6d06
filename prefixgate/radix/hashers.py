"""The `BlockHasher` of each namespace, for one block size and model fingerprint.

Contract: `Hashers(block_size, model_fingerprint).get(namespace)` returns a hasher equal
to `BlockHasher(block_size, model_fingerprint, namespace)`. At most `max_namespaces` are
kept (namespaces are client-chosen, so an unbounded map is a memory leak); past that the
map starts over, which costs one salt hash per namespace when next used.
"""

from __future__ import annotations

from prefixgate.radix.hashing import BlockHasher

__all__ = ["Hashers"]


class Hashers:
    def __init__(self, block_size: int, model_fingerprint: str,
                 max_namespaces: int = 4096) -> None:
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        self.max_namespaces = max_namespaces
        self._by_namespace: dict[str, BlockHasher] = {}

    def get(self, namespace: str) -> BlockHasher:
        h = self._by_namespace.get(namespace)
        if h is None:
            if len(self._by_namespace) >= self.max_namespaces:
                self._by_namespace.clear()
            h = self._by_namespace[namespace] = BlockHasher(
                self.block_size, self.model_fingerprint, namespace)
        return h

    def __len__(self) -> int:
        return len(self._by_namespace)
