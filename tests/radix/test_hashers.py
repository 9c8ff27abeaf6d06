"""Per-namespace hashers: equal to a fresh BlockHasher, and bounded."""

from prefixgate.radix import BlockHasher
from prefixgate.radix.hashers import Hashers


def test_hashers_equal_fresh_ones_and_stay_bounded() -> None:
    hashers = Hashers(16, "model-x", max_namespaces=3)
    tokens = list(range(40))
    for i in range(10):
        ns = f"tenant-{i % 5}"
        assert hashers.get(ns).hash_blocks(tokens) == \
            BlockHasher(16, "model-x", ns).hash_blocks(tokens)
        assert len(hashers) <= 3
    assert hashers.get("a") is hashers.get("a")
    assert hashers.get("a").root_hash != hashers.get("b").root_hash
