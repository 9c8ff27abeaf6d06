"""Worker membership: embedded and a real redis-server share one contract."""

from __future__ import annotations

import asyncio

import pytest

from prefixgate.registry import EmbeddedRegistry, RedisRegistry, WorkerRecord


@pytest.fixture(params=["embedded", "redis"])
def make(request):
    if request.param == "embedded":
        return EmbeddedRegistry
    url = request.getfixturevalue("redis_flush")
    return lambda: RedisRegistry(url)


def test_register_renew_expire_and_fence(make) -> None:
    async def scenario() -> None:
        reg = make()
        a = await reg.register(WorkerRecord("w1", "127.0.0.1:1", "fp"), lease_ms=300)
        assert a.epoch == 1
        assert [r.worker_id for r in await reg.list_workers()] == ["w1"]
        assert await reg.renew(a, lease_ms=300)
        # Restart under the same id: a new epoch; the old incarnation can neither renew
        # nor deregister the new one.
        b = await reg.register(WorkerRecord("w1", "127.0.0.1:2", "fp"), lease_ms=300)
        assert b.epoch == 2
        assert not await reg.renew(a, lease_ms=300)
        await reg.deregister(a)
        assert [(r.address, r.epoch) for r in await reg.list_workers()] == [("127.0.0.1:2", 2)]
        # A lease that is not renewed expires.
        await asyncio.sleep(0.5)
        assert await reg.list_workers() == []
        assert not await reg.renew(b, lease_ms=300)
        c = await reg.register(WorkerRecord("w2", "127.0.0.1:3"), lease_ms=10_000)
        await reg.deregister(c)
        assert await reg.list_workers() == []
        await reg.close()

    asyncio.run(scenario())


def test_redis_password_never_reaches_logs() -> None:
    from prefixgate.registry import RedisRegistry, redact_url

    assert redact_url("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert "s3cret" not in RedisRegistry("redis://:s3cret@127.0.0.1:1/0").url
