"""Tokenizing a long prompt runs off the gateway's event loop (gateway/turn.py,
`TurnCore.off_loop`): the loop keeps serving other streams meanwhile, and the ids are
the tokenizer's own."""

from __future__ import annotations

import asyncio

from prefixgate.gateway.config import GatewayConfig
from prefixgate.gateway.pool import WorkerPool
from prefixgate.gateway.turn import INLINE_TOKENIZE_CHARS, TurnCore
from prefixgate.model.catalog import ModelSpec
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.registry import make_registry


def _loop_ticks_while(service: TurnCore, num_chars: int, messages: list) -> tuple[list, int]:
    """Tokenize through `service.off_loop` (as if the text had `num_chars` characters)
    while a task ticks every millisecond; returns the ids and the ticks seen meanwhile."""

    async def main() -> tuple[list, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        before = ticks
        ids = await service.off_loop(num_chars, service.tokenizer.encode_messages, messages)
        during = ticks - before
        task.cancel()
        return ids, during

    return asyncio.run(main())


def test_a_long_prompt_is_tokenized_off_the_event_loop(tiny_spec: ModelSpec) -> None:
    tokenizer = ChatTokenizer(tiny_spec)
    service = TurnCore(tiny_spec, tokenizer,
                       WorkerPool(make_registry(None), tiny_spec.fingerprint), GatewayConfig())
    try:
        text = "the quick brown fox jumps over the lazy dog " * 20_000  # 880k characters
        messages = [("user", text)]
        expected = tokenizer.encode_messages(messages)
        # On the loop (what a short text gets): nothing else runs until it is done.
        ids, ticks_inline = _loop_ticks_while(service, INLINE_TOKENIZE_CHARS - 1, messages)
        assert ids == expected and ticks_inline <= 1
        ids, ticks_off = _loop_ticks_while(service, len(text), messages)
        assert ids == expected
        assert ticks_off >= 5, ticks_off  # the loop went on while the text was tokenized
    finally:
        service.close()


def test_the_tokenizer_pool_refuses_beyond_its_threads_and_waiting_line() -> None:
    import threading

    import pytest

    from prefixgate.gateway.tokenize_pool import INLINE_CHARS, TokenizePool, TokenizerBusy

    release = threading.Event()
    pool = TokenizePool(threads=1, max_waiting=1)

    async def main() -> list:
        running = [asyncio.create_task(pool.run(INLINE_CHARS, release.wait, 10))
                   for _ in range(2)]
        await asyncio.sleep(0.05)
        assert pool.in_flight == 2
        with pytest.raises(TokenizerBusy, match="retry shortly"):
            await pool.run(INLINE_CHARS, release.wait, 10)
        assert await pool.run(INLINE_CHARS - 1, len, "short") == 5  # short: inline
        release.set()
        done = await asyncio.gather(*running)
        assert pool.in_flight == 0
        return done

    assert asyncio.run(main()) == [True, True]
    pool.close()
