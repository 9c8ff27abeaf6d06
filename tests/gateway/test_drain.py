"""A stopping gateway drains its turns for `drain_seconds`, on gRPC and HTTP alike, and
then ends the rest: it never waits for a long stream to finish by itself."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from prefixgate.wire.rpc import free_port
from tests.helpers import start_emulated_worker, wait_for


def test_http_stream_is_cut_after_drain_seconds(loop_thread, tiny_spec) -> None:
    from prefixgate.emulate.service import ServiceModel
    from prefixgate.gateway.server import GatewayConfig, serve
    from prefixgate.registry import EmbeddedRegistry

    # A reply of 400 tokens at 0.2 s a token: 80 s, far past the 1 s drain.
    worker, wstop, _ = start_emulated_worker(loop_thread, tiny_spec, "slow",
                                             service=ServiceModel(decode_s_per_token=0.2))
    http_port = free_port()
    config = GatewayConfig(static_workers=(worker,), drain_seconds=1.0, http_port=http_port)
    base = f"http://127.0.0.1:{http_port}"

    async def start() -> tuple[asyncio.Future, asyncio.Event]:
        stop = asyncio.Event()
        started = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(serve(tiny_spec, EmbeddedRegistry(), config, stop, started))
        await started
        return task, stop

    task, stop = loop_thread.run(start())
    try:
        wait_for(lambda: httpx.get(base + "/health").status_code == 200, what="a worker")
        first_chunk = threading.Event()

        def stream() -> None:
            body = {"model": tiny_spec.name, "stream": True, "max_tokens": 400,
                    "messages": [{"role": "user", "content": "a long story please"}]}
            try:
                with httpx.stream("POST", base + "/v1/chat/completions", json=body,
                                  timeout=120) as r:
                    for _ in r.iter_lines():
                        first_chunk.set()
            except httpx.HTTPError:
                pass

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        assert first_chunk.wait(30)
        t0 = time.monotonic()
        loop_thread.loop.call_soon_threadsafe(stop.set)

        async def stopped() -> None:
            await asyncio.wait_for(asyncio.shield(task), 30)

        loop_thread.run(stopped(), timeout=40)
        took = time.monotonic() - t0
        # drain (1 s) + the cancelled handlers' grace (1 s) + the gateway's own shutdown.
        assert took < 5, f"the gateway took {took:.1f} s to stop with drain_seconds=1"
        client.join(10)
        assert not client.is_alive(), "the client's stream did not end"
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)
        loop_thread.loop.call_soon_threadsafe(wstop.set)
