"""Prefix reuse is exact: output with the cache equals output without it."""

from __future__ import annotations

import queue

import pytest
import torch

from prefixgate.protocol import SamplingConfig
from prefixgate.tokenizer import ChatTokenizer
from prefixgate.worker.engine import (FinalEvent, FinishReason, Request, SimpleEngine,
                                      SimpleEngineConfig, TokenEvent)


def run(engine: SimpleEngine, prompt: list[int], max_tokens: int = 16, rid: str = "r",
        **sampling) -> tuple[list[int], FinalEvent]:
    events: queue.Queue = queue.Queue()
    engine.submit(Request(rid, tuple(prompt), SamplingConfig(max_tokens=max_tokens, **sampling)),
                  events.put)
    tokens = []
    while True:
        ev = events.get(timeout=120)
        if isinstance(ev, TokenEvent):
            tokens.extend(ev.token_ids)
        else:
            return tokens, ev


def make_engine(spec, model, **kw) -> SimpleEngine:
    tok = ChatTokenizer(spec)
    return SimpleEngine(model, tok, SimpleEngineConfig(
        eos_token_ids=tok.eos_token_ids, max_context_tokens=spec.max_context_tokens, **kw))


def test_cached_logits_match_recompute_tiny(tiny_model) -> None:
    """The engine's hit path (copy + crop a cache, feed the rest) gives the logits of a
    full recompute."""
    from transformers import DynamicCache

    ids = torch.randint(3, 259, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = tiny_model(input_ids=ids).logits[0, -1]
        cache = DynamicCache()
        tiny_model(input_ids=ids[:, :40], past_key_values=cache, use_cache=True)
        cache.crop(30 - cache.get_seq_length())
        part = tiny_model(input_ids=ids[:, 30:], past_key_values=cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(part, full, atol=1e-5, rtol=1e-5)


def test_engine_cache_on_equals_off_tiny(tiny_spec, tiny_model) -> None:
    cached = make_engine(tiny_spec, tiny_model)
    uncached = make_engine(tiny_spec, tiny_model, max_cached_sequences=0)
    base = list(range(3, 120))
    for turn in range(3):
        prompt = base + list(range(200, 200 + 7 * turn))
        a, fa = run(cached, prompt)
        b, fb = run(uncached, prompt)
        assert a == b
        assert fb.cached_tokens == 0
        if turn:
            assert fa.cached_tokens >= len(base)
    cached.shutdown()
    uncached.shutdown()


def test_seeded_sampling_is_reproducible(tiny_spec, tiny_model) -> None:
    engine = make_engine(tiny_spec, tiny_model)
    a, _ = run(engine, list(range(3, 30)), temperature=1.0, top_p=0.9, seed=5)
    b, _ = run(engine, list(range(3, 30)), temperature=1.0, top_p=0.9, seed=5)
    assert a == b
    engine.shutdown()


def test_cancel_ends_the_request(tiny_spec, tiny_model) -> None:
    engine = make_engine(tiny_spec, tiny_model)
    engine.cancel("gone")
    tokens, final = run(engine, list(range(3, 30)), max_tokens=500, rid="gone")
    assert final.finish_reason is FinishReason.CANCELLED and len(tokens) < 500
    engine.shutdown()


@pytest.mark.slow
def test_multi_turn_cache_on_equals_off_smollm2(smollm2_spec, smollm2_model) -> None:
    """A real conversation on SmolLM2: identical greedy replies with and without reuse,
    and turn N+1 reuses turn N's prompt and reply."""
    tok = ChatTokenizer(smollm2_spec)
    cached = make_engine(smollm2_spec, smollm2_model)
    uncached = make_engine(smollm2_spec, smollm2_model, max_cached_sequences=0)
    history: list[tuple[str, str]] = []
    previous = 0
    for question in ("What is the capital of France?", "And of Italy?", "Which is bigger?"):
        history.append(("user", question))
        prompt = tok.encode_messages(history)
        a, fa = run(cached, prompt, max_tokens=24)
        b, _ = run(uncached, prompt, max_tokens=24)
        assert a == b
        if previous:
            assert fa.cached_tokens >= previous - 1
        previous = len(prompt) + len(a)
        history.append(("assistant", tok.decode(a)))
    assert "Paris" in history[1][1]
    cached.shutdown()
    uncached.shutdown()
