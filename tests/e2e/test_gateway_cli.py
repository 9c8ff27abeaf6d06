"""`prefixgate worker|gateway --redis-url` as processes (tiny-random, a real redis-server):
workers register and publish their blocks, the gateway routes a new conversation to the
worker holding its prefix, SIGTERM deregisters, and a SIGKILLed worker's lease expires and
its blocks are reaped."""

from __future__ import annotations

import asyncio
import signal
import time

import redis

from prefixgate.launch.processes import ProcessGroup
from prefixgate.v1 import common_pb2
from prefixgate.wire.rpc import free_port
from tests.helpers import REPO, cli_env, wait_for

FOUR = common_pb2.SamplingParams(max_tokens=4)


def test_workers_and_gateway_on_redis(tmp_path, redis_flush) -> None:
    from prefixgate.wire.client import ChatClient

    env = cli_env(PREFIXGATE_CACHE_DIR=str(tmp_path), PREFIXGATE_MODEL="tiny-random",
                  PREFIXGATE_REDIS_URL=redis_flush, PREFIXGATE_LOG_LEVEL="WARNING")
    r = redis.Redis.from_url(redis_flush)
    procs = ProcessGroup(tmp_path / "logs", env=env, cwd=REPO)
    gw_port = free_port()
    try:
        for wid in ("cw0", "cw1"):
            procs.start_prefixgate(
                wid, "worker", "--port", "0", "--worker-id", wid, "--lease-ms", "1500",
                "--num-blocks", "256", "--torch-threads", "1", "--drain-seconds", "2")
        procs.start_prefixgate("gw", "gateway", "--port", str(gw_port))
        wait_for(lambda: r.scard("pg:workers") == 2, timeout=120, what="workers to register")

        async def conversation() -> tuple[str, str, int]:
            client = ChatClient(f"127.0.0.1:{gw_port}")
            await client.wait_ready(60)
            for _ in range(200):
                if (await client.list_models()).models[0].num_workers == 2:
                    break
                await asyncio.sleep(0.1)
            system = "You are a terse assistant who answers in one short sentence. " * 4
            first = await client.turn([("system", system), ("user", "hello")],
                                      conversation_id="one", sampling=FOUR)
            # Wait until the gateway could know: the worker's blocks are in Redis.
            for _ in range(100):
                if r.hlen(f"pg:kv:{first.worker_id}"):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
            second = await client.turn([("system", system), ("user", "something else")],
                                       conversation_id="two", sampling=FOUR)
            await client.close()
            return first.worker_id, second.worker_id, second.cached_tokens

        w1, w2, cached = asyncio.run(conversation())
        assert w1 == w2 and cached >= 32  # the system prompt's blocks were reused
        holder, other = w1, ("cw1" if w1 == "cw0" else "cw0")
        # SIGKILL: no deregistration; the lease expires and the gateway reaps the blocks.
        assert r.hlen(f"pg:kv:{holder}") > 0
        procs.signal(holder, signal.SIGKILL)
        wait_for(lambda: not r.sismember("pg:workers", holder) and not r.exists(f"pg:kv:{holder}"),
                 timeout=20, what="the killed worker to be reaped")
        entries = r.xrange("pg:events")
        assert any(f[b"k"] == b"reap" and f[b"w"] == holder.encode() for _, f in entries)
        # SIGTERM: the worker deregisters itself (a "leave" entry), then exits.
        assert procs.signal(other, signal.SIGTERM, wait_s=60) == 0
        entries = r.xrange("pg:events")
        assert any(f[b"k"] == b"leave" and f[b"w"] == other.encode() for _, f in entries)
        assert r.scard("pg:workers") == 0
    finally:
        procs.stop(timeout_s=10)


def test_workers_on_port_0_take_their_ids_from_their_bound_ports(tmp_path, redis_flush) -> None:
    """`--port 0` without --worker-id: each worker is worker-<the port it got>, so two of
    them register as two workers (not both as worker-0, taking each other's lease)."""
    env = cli_env(PREFIXGATE_CACHE_DIR=str(tmp_path), PREFIXGATE_MODEL="tiny-random",
                  PREFIXGATE_REDIS_URL=redis_flush, PREFIXGATE_LOG_LEVEL="WARNING")
    r = redis.Redis.from_url(redis_flush)
    procs = ProcessGroup(tmp_path / "logs", env=env, cwd=REPO)
    for i in range(2):
        procs.start_prefixgate(f"w{i}", "worker", "--emulate", "--port", "0", "--lease-ms",
                               "1500")
    try:
        wait_for(lambda: r.scard("pg:workers") == 2, timeout=60, what="two workers to register")
        ids = sorted(m.decode() for m in r.smembers("pg:workers"))
        assert all(i.startswith("worker-") and int(i.split("-")[1]) > 0 for i in ids), ids
        # The lease cycle (1.5 s) passes: both stay, neither displaces the other.
        time.sleep(2)
        assert sorted(m.decode() for m in r.smembers("pg:workers")) == ids
    finally:
        procs.stop(timeout_s=30)
