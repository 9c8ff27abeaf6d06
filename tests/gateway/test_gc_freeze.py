"""The gateway keeps long-lived objects out of the cyclic collector's full scans without
running a full collection itself while it serves (gateway/server.py)."""

from __future__ import annotations

import gc

import pytest

from prefixgate.gateway import server


@pytest.fixture
def collections(monkeypatch) -> list[int]:
    """The generation of each gc.collect the gateway runs (none is run for real)."""
    seen: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: seen.append(generation) or 0)
    monkeypatch.setattr(gc, "freeze", lambda: seen.append(-1))
    return seen


def test_index_doubling_freezes_without_a_full_collection(collections) -> None:
    assert server._freeze_long_lived(9_999, 0) == 0  # below the floor: nothing
    assert collections == []
    assert server._freeze_long_lived(10_000, 0) == 10_000
    assert collections == [1, -1]  # the young generations only, then the freeze
    assert server._freeze_long_lived(19_999, 10_000) == 10_000  # not doubled yet
    assert server._freeze_long_lived(20_000, 10_000) == 20_000
    assert 2 not in collections


def test_startup_heap_is_frozen_before_serving(collections) -> None:
    server._freeze_startup()
    assert collections == [2, -1]
