"""Context overflow and shifted reuse in the engine: the policy (property-tested), exact
recompute, moved runs found under earlier layouts, approximate blocks kept apart from
exact ones, a uniform shift exact against recompute (tiny model and SmolLM2)."""

from __future__ import annotations

import queue

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.model.overflow import find_turn_starts, plan_overflow, user_turn_prefix
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.v1 import common_pb2
from prefixgate.wire.protocol import InvalidRequest, SamplingConfig, sampling_from_proto
from prefixgate.worker.engine import PagedEngine
from prefixgate.worker.kv_pool import KVPool
from prefixgate.worker.model_runner import ModelRunner, pool_config_for
from prefixgate.worker.paged_attention import StepMetadata
from prefixgate.worker.reindex import RopeSpec, reindex_slots
from prefixgate.workerapi.api import EngineConfig, FinalEvent, FinishReason, Request
from tests.helpers import track

TURN = (1, 2)  # a made-up user-turn prefix for the pure policy tests


# --- policy ------------------------------------------------------------------------------

@st.composite
def chats(draw: st.DrawFn) -> tuple[list[int], int, int]:
    preamble = draw(st.lists(st.integers(3, 9), max_size=12))
    turns = draw(st.lists(st.lists(st.integers(3, 9), max_size=20), min_size=1, max_size=8))
    tokens = preamble + [t for turn in turns for t in (*TURN, *turn)]
    return tokens, draw(st.integers(1, 40)), draw(st.integers(8, 200))


@settings(max_examples=300, deadline=None)
@given(chats())
def test_plan_keeps_preamble_and_drops_fewest_oldest_turns(chat) -> None:
    tokens, max_tokens, context = chat
    plan = plan_overflow(tokens, max_tokens, context, TURN)
    if len(tokens) + max_tokens <= context:
        assert plan is None
        return
    assert plan is not None
    starts = find_turn_starts(tokens, TURN)
    assert plan.n_keep == starts[0] and plan.drop_to in starts
    assert plan.kept == tuple(tokens[:plan.n_keep] + tokens[plan.drop_to:])
    assert plan.dropped_tokens == len(tokens) - len(plan.kept)
    earlier = [s for s in starts if s < plan.drop_to]
    if earlier:  # dropping one turn fewer would not have fitted
        assert len(tokens) - (earlier[-1] - plan.n_keep) + max_tokens > context
    assert plan.fits == (len(plan.kept) + max_tokens <= context)
    if not plan.fits:
        assert plan.drop_to == starts[-1]  # everything but the last turn went
    assert [d for _, d in plan.layouts()] == [plan.drop_to - s for s in starts if s <= plan.drop_to]


def test_plan_without_turns_drops_nothing() -> None:
    plan = plan_overflow([5] * 30, 10, 32, TURN)
    assert plan is not None and plan.dropped_tokens == 0 and not plan.fits


def test_user_turn_prefix_of_a_chat_template(tiny_spec) -> None:
    tok = ChatTokenizer(tiny_spec)
    prefix = user_turn_prefix(tok)
    assert tok.decode(list(prefix), skip_special_tokens=False) == "<|im_start|>user"
    ids = tok.encode_messages([("system", "s"), ("user", "a"), ("assistant", "b"), ("user", "c")])
    assert len(find_turn_starts(ids, prefix)) == 2


def test_validation_accepts_overflow_only_when_asked() -> None:
    msg = common_pb2.SamplingParams(max_tokens=50)
    with pytest.raises(InvalidRequest, match="context window"):
        sampling_from_proto(msg, 1000, 1024)
    msg.context_overflow = common_pb2.CONTEXT_OVERFLOW_KEEP_SYSTEM_DROP_OLDEST
    msg.shifted_reuse = common_pb2.SHIFTED_REUSE_SHIFT
    cfg = sampling_from_proto(msg, 5000, 1024)
    assert (cfg.max_tokens, cfg.context_overflow, cfg.shifted_reuse) == \
        (50, "keep-system-drop-oldest", "shift")
    unset = common_pb2.SamplingParams(context_overflow=msg.context_overflow)
    assert sampling_from_proto(unset, 5000, 1024).max_tokens == 256
    assert sampling_from_proto(unset, 5000, 300).max_tokens == 150
    assert sampling_from_proto(common_pb2.SamplingParams(), 5000, 1024,
                               default_overflow="keep-system-drop-oldest").max_tokens == 256
    with pytest.raises(InvalidRequest, match="between 1 and 1023"):
        sampling_from_proto(common_pb2.SamplingParams(
            max_tokens=1024, context_overflow=msg.context_overflow), 10, 1024)


# --- engine ------------------------------------------------------------------------------

CONTEXT = 320


def _engine(spec, model, **config) -> PagedEngine:
    tok = ChatTokenizer(spec)
    config.setdefault("num_blocks", 256)
    return track(PagedEngine(model, tok, EngineConfig(
        eos_token_ids=(), max_context_tokens=CONTEXT, model_fingerprint=spec.fingerprint,
        turn_prefix=user_turn_prefix(tok),
        block_size=8, **config)))


def _generate(engine: PagedEngine, prompt: list[int], mode: str, rid: str,
              max_tokens: int = 12) -> tuple[list[int], FinalEvent]:
    sampling = SamplingConfig(max_tokens=max_tokens, context_overflow="keep-system-drop-oldest",
                              shifted_reuse=mode)
    return engine.run_to_completion(Request(rid, tuple(prompt), sampling), timeout_s=120)


def _conversation(tok: ChatTokenizer, num_turns: int) -> list[list[int]]:
    """Prompts of a chat whose replies are fixed text, turn by turn."""
    messages = [("system", "You are terse.")]
    out = []
    for i in range(num_turns):
        messages.append(("user", f"question {i}: cats or dogs?"))
        out.append(tok.encode_messages(messages))
        messages.append(("assistant", f"answer {i}: both make fine pets."))
    return out


def _serve(engine: PagedEngine, prompts: list[list[int]], mode: str) -> list[FinalEvent]:
    return [_generate(engine, p, mode, f"{mode}{i}")[1] for i, p in enumerate(prompts)]


def _common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


NUM_TURNS = 9


def test_recompute_is_exact_and_usage_reports_dropped(tiny_spec, tiny_model) -> None:
    tok = ChatTokenizer(tiny_spec)
    engine, fresh = _engine(tiny_spec, tiny_model), _engine(tiny_spec, tiny_model)
    prompts = _conversation(tok, NUM_TURNS)
    _serve(engine, prompts[:-1], "recompute")
    last = prompts[-1]
    out, final = _generate(engine, last, "recompute", "over")
    plan = plan_overflow(last, 12, CONTEXT, engine.config.turn_prefix)
    assert plan is not None and plan.dropped_tokens > 0
    assert final.dropped_tokens == plan.dropped_tokens
    assert final.prompt_tokens == len(plan.kept)
    assert final.completion_tokens == len(out) == 12
    fresh_out, _ = _generate(fresh, list(plan.kept), "recompute", "ref")
    assert out == fresh_out
    for e in (engine, fresh):
        e.shutdown()


@pytest.mark.parametrize("mode,blend", [("shift", 0), ("blend", 16)])
def test_shift_and_blend_reuse_the_kept_turns(tiny_spec, tiny_model, mode: str, blend: int) -> None:
    tok = ChatTokenizer(tiny_spec)
    prompts = _conversation(tok, NUM_TURNS)
    engine = _engine(tiny_spec, tiny_model, blend_tokens=blend or 32)
    prefix, bs = engine.config.turn_prefix, engine.config.block_size
    finals = _serve(engine, prompts, mode)
    plans = [plan_overflow(p, 12, CONTEXT, prefix) for p in prompts]
    overflowing = [i for i, p in enumerate(plans) if p is not None]
    assert len(overflowing) >= 3
    for i in overflowing:
        plan, final = plans[i], finals[i]
        assert final.dropped_tokens == plan.dropped_tokens > 0
        assert final.finish_reason is FinishReason.LENGTH and final.completion_tokens == 12
        # The previous turn's prompt (in its own layout) was cached; the part of it that
        # this turn keeps was moved back, not recomputed (less the blend and a block).
        prev = plans[i - 1]
        prev_dropped = prev.dropped_tokens if prev else 0
        kept_before = len(prompts[i - 1]) - prev_dropped - (plan.dropped_tokens - prev_dropped)
        assert final.cached_tokens >= kept_before - blend - 2 * bs > plan.n_keep
    # Moved K/V are approximate: an exact request for the same kept prompt matches none
    # of them (salted chain), and its output equals a fresh engine's.
    kept = list(plans[-1].kept)
    exact_out, exact = _generate(engine, kept, "recompute", "exact")
    fresh = _engine(tiny_spec, tiny_model)
    _serve(fresh, prompts[:-1], "recompute")  # the same exact blocks a recompute engine has
    assert exact_out == _generate(fresh, kept, "recompute", "ref")[0]
    assert exact.cached_tokens <= max(_common_prefix(kept, p) for p in prompts[:-1]) + bs
    fresh.shutdown()
    engine.flush_cache()
    assert engine.pool.num_free_blocks == engine.pool.config.num_blocks
    engine.shutdown()


def test_context_full_even_after_dropping_ends_at_once(tiny_spec, tiny_model) -> None:
    engine = _engine(tiny_spec, tiny_model)
    tok = ChatTokenizer(tiny_spec)
    prompt = tok.encode_messages([("system", "s"), ("user", "x" * 400)])
    out, final = _generate(engine, prompt, "blend", "full")
    assert out == [] and final.finish_reason is FinishReason.LENGTH
    engine.shutdown()


# --- uniform shift: exact --------------------------------------------------------------

def _uniform_shift_logits(model, tokens: list[int], delta: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logits after `tokens`: (computed at positions delta.., moved back by
    delta, then one more token at len(tokens)) and (computed at 0.. directly)."""
    bs, n = 16, len(tokens)
    pool = KVPool(pool_config_for(model, bs, 3 * ((n + bs) // bs) + 3))
    runner = ModelRunner(model, pool)
    nb = (n + bs) // bs
    shifted, moved, direct = (list(range(i * nb, (i + 1) * nb)) for i in range(3))
    step = StepMetadata.build(pool, [shifted], [n], [n])
    runner.forward(tokens, list(range(delta, delta + n)), step, [n - 1])
    slots = lambda blocks: torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)])  # noqa: E731
    reindex_slots(pool, slots(shifted), slots(moved), torch.full((n,), delta),
                  RopeSpec.from_model(model), backend="torch")
    nxt = [tokens[0]]
    got = runner.forward(nxt, [n], StepMetadata.build(pool, [moved], [n + 1], [1]), [0])
    want = runner.forward(tokens + nxt, list(range(n + 1)),
                          StepMetadata.build(pool, [direct], [n + 1], [n + 1]), [n])
    return got[0], want[0]


def test_uniform_shift_is_exact_tiny(tiny_model) -> None:
    tokens = torch.randint(3, 250, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    got, want = _uniform_shift_logits(tiny_model, tokens, 1234)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_uniform_shift_is_exact_on_smollm2(smollm2_spec, smollm2_model) -> None:
    """A whole cached sequence moved by delta equals recomputing it at its new positions
    (the architecture notes measured 4e-5 on SmolLM2)."""
    tok = ChatTokenizer(smollm2_spec)
    tokens = tok.encode_messages([("user", "Name three rivers in Europe and say which is longest.")])
    got, want = _uniform_shift_logits(smollm2_model, tokens, 700)
    assert got.argmax() == want.argmax()
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                    reduction="sum")
    assert kl < 1e-5


@settings(max_examples=8, deadline=None)
@given(st.data())
def test_random_overflowing_chats_never_leak_blocks(tiny_spec, tiny_model, data) -> None:
    """Interleaved conversations of random lengths in random modes, on a pool small enough
    to evict and preempt, some with several samples: every request ends, reports what it
    dropped, and flushing frees every block (no reference left behind)."""
    tok = ChatTokenizer(tiny_spec)
    engine = _engine(tiny_spec, tiny_model, num_blocks=data.draw(st.integers(44, 84)),
                     blend_tokens=data.draw(st.integers(1, 40)))
    try:
        chats = [[("system", "s" * data.draw(st.integers(1, 30)))] for _ in range(2)]
        for step in range(data.draw(st.integers(2, 6))):
            pending = []
            for k, chat in enumerate(chats):  # both chats' turns run concurrently
                chat.append(("user", "q" * data.draw(st.integers(20, 150))))
                prompt = tok.encode_messages(chat)
                n = data.draw(st.integers(1, 2))
                events: queue.Queue = queue.Queue()
                engine.submit(Request(f"r{step}.{k}", tuple(prompt), SamplingConfig(
                    max_tokens=8, n=n, context_overflow="keep-system-drop-oldest",
                    shifted_reuse=data.draw(st.sampled_from(["recompute", "shift", "blend"])))),
                    events.put)
                pending.append((prompt, n, events))
            for prompt, n, events in pending:
                finals = []
                while len(finals) < n:
                    ev = events.get(timeout=120)
                    if isinstance(ev, FinalEvent):
                        finals.append(ev)
                plan = plan_overflow(prompt, 8, CONTEXT, engine.config.turn_prefix)
                dropped = plan.dropped_tokens if plan else 0
                assert all(f.dropped_tokens == dropped for f in finals)
                assert all(f.prompt_tokens + dropped == len(prompt) for f in finals)
            engine.check_integrity()
            for chat in chats:
                chat.append(("assistant", "a" * data.draw(st.integers(0, 60))))
        engine.flush_cache()
        assert engine.pool.num_free_blocks == engine.pool.config.num_blocks
    finally:
        engine.shutdown()
