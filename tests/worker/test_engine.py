"""The paged engine is exact: output with the prefix cache equals output without it,
under concurrency, eviction and preemption, and no block leaks."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.wire.protocol import SamplingConfig
from prefixgate.worker.engine import PagedEngine
from prefixgate.workerapi.api import FinalEvent, FinishReason, Request, TokenEvent
from tests.helpers import make_engine, track


def submit(engine: PagedEngine, prompt: list[int], rid: str, max_tokens: int = 16,
           **sampling) -> queue.Queue:
    events: queue.Queue = queue.Queue()
    engine.submit(Request(rid, tuple(prompt), SamplingConfig(max_tokens=max_tokens, **sampling)),
                  events.put)
    return events


def collect(events: queue.Queue) -> tuple[list[int], FinalEvent]:
    tokens: list[int] = []
    while True:
        ev = events.get(timeout=120)
        if isinstance(ev, TokenEvent):
            tokens.extend(ev.token_ids)
        else:
            return tokens, ev


def run(engine: PagedEngine, prompt: list[int], max_tokens: int = 16, rid: str = "r",
        **sampling) -> tuple[list[int], FinalEvent]:
    return engine.run_to_completion(
        Request(rid, tuple(prompt), SamplingConfig(max_tokens=max_tokens, **sampling)), 120)


def prompts(n: int, seed: int = 0, lo: int = 20, hi: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, 259, (length,), generator=g).tolist() for length in lengths]


def assert_no_leak(engine: PagedEngine) -> None:
    engine.check_integrity()
    engine.flush_cache()
    assert engine.pool.num_free_blocks == engine.pool.config.num_blocks
    assert engine.cache.num_blocks == 0


def test_cache_on_equals_off_and_turn_two_hits(tiny_spec, tiny_model) -> None:
    cached = make_engine(tiny_spec, tiny_model)
    uncached = make_engine(tiny_spec, tiny_model, enable_prefix_cache=False)
    for i, p in enumerate(prompts(6)):
        out, _ = run(cached, p, rid=f"a{i}")
        assert out == run(uncached, p, rid=f"b{i}")[0]
        turn2 = p + out + [5, 6, 7]
        out2, final = run(cached, turn2, rid=f"c{i}")
        ref2, ref_final = run(uncached, turn2, rid=f"d{i}")
        assert out2 == ref2 and ref_final.cached_tokens == 0
        # Everything computed in turn 1 (all but its last sampled token), including its
        # last partial block (the cached tail).
        assert final.cached_tokens == len(p) + len(out) - 1
    assert_no_leak(cached)
    assert_no_leak(uncached)
    cached.shutdown()
    uncached.shutdown()


def test_tiny_pool_evicts_and_preempts_but_stays_exact(tiny_spec, tiny_model) -> None:
    """40 blocks for 8 concurrent requests of up to ~20 blocks each: constant eviction
    and preemption; every output equals the uncached one and nothing leaks."""
    from prometheus_client import CollectorRegistry

    from prefixgate.workerapi.metrics import WorkerMetrics

    ps = prompts(8, seed=1)
    reference = make_engine(tiny_spec, tiny_model, enable_prefix_cache=False)
    expected = [run(reference, p, rid=f"r{i}", max_tokens=24)[0] for i, p in enumerate(ps)]
    metrics = WorkerMetrics(CollectorRegistry())
    small = make_engine(tiny_spec, tiny_model, num_blocks=40, max_num_batched_tokens=64)
    small.metrics = metrics
    for round_ in range(2):  # the second round hits (and evicts) what the first cached
        queues = [submit(small, p, f"s{round_}-{i}", max_tokens=24) for i, p in enumerate(ps)]
        assert [collect(q)[0] for q in queues] == expected
    assert metrics.preemptions._value.get() > 0
    assert metrics.evictions._value.get() > 0
    assert_no_leak(small)
    small.shutdown()
    reference.shutdown()


def test_concurrent_conversations_equal_sequential(tiny_spec, tiny_model) -> None:
    engine = make_engine(tiny_spec, tiny_model, max_num_batched_tokens=128)
    convs = prompts(16, seed=2, lo=10, hi=120)
    sequential = [run(engine, p, rid=f"q{i}")[0] for i, p in enumerate(convs)]
    engine.flush_cache()
    results: list = [None] * len(convs)

    def client(i: int) -> None:
        results[i] = run(engine, convs[i], rid=f"c{i}")[0]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == sequential
    assert_no_leak(engine)
    engine.shutdown()


def test_namespaces_never_share_blocks(tiny_spec, tiny_model) -> None:
    engine = make_engine(tiny_spec, tiny_model)
    p = prompts(1, seed=4, lo=100, hi=101)[0]
    events: queue.Queue = queue.Queue()
    engine.submit(Request("a", tuple(p), SamplingConfig(max_tokens=4), "tenant-a"), events.put)
    collect(events)
    engine.submit(Request("b", tuple(p), SamplingConfig(max_tokens=4), "tenant-b"), events.put)
    assert collect(events)[1].cached_tokens == 0
    engine.submit(Request("c", tuple(p), SamplingConfig(max_tokens=4), "tenant-a"), events.put)
    assert collect(events)[1].cached_tokens == 99  # all but the last prompt token
    engine.shutdown()


def test_events_report_every_stored_and_removed_block(tiny_spec, tiny_model) -> None:
    from prefixgate.radix import BlockHasher
    from prefixgate.wire.events import KVEventSink

    class Mirror(KVEventSink):
        def __init__(self) -> None:
            self.blocks: set[int] = set()
            self.parents: dict[int, int | None] = {}

        def stored(self, parent_hash, block_hashes) -> None:
            for h in block_hashes:
                self.parents[h] = parent_hash
                parent_hash = h
            self.blocks.update(block_hashes)

        def removed(self, block_hashes) -> None:
            self.blocks.difference_update(block_hashes)

        def cleared(self) -> None:
            self.blocks.clear()

    mirror = Mirror()
    tok = ChatTokenizer(tiny_spec)
    from prefixgate.workerapi.api import EngineConfig

    engine = track(PagedEngine(tiny_model, tok, EngineConfig(
        num_blocks=24, max_num_batched_tokens=64, eos_token_ids=tok.eos_token_ids,
        model_fingerprint=tiny_spec.fingerprint), event_sink=mirror))
    hasher = BlockHasher(16, tiny_spec.fingerprint, "")
    for i, p in enumerate(prompts(6, seed=5, lo=40, hi=150)):
        out, _ = run(engine, p, rid=f"e{i}", max_tokens=8)
        expected = hasher.hash_blocks(p + out[:-1])
        assert set(expected) <= mirror.blocks or len(mirror.blocks) <= 24
        assert len(mirror.blocks) == engine.cache.num_blocks  # mirror tracks evictions too
    hashes = {h for h in mirror.blocks}
    assert hashes == {h for path, _ in engine.cache.tree.items() for h in path}
    engine.flush_cache()
    assert mirror.blocks == set()
    engine.shutdown()


def test_seeded_sampling_and_cancel(tiny_spec, tiny_model) -> None:
    engine = make_engine(tiny_spec, tiny_model)
    p = prompts(1, seed=6)[0]
    a, _ = run(engine, p, rid="s1", temperature=1.0, top_p=0.9, seed=5)
    b, _ = run(engine, p, rid="s2", temperature=1.0, top_p=0.9, seed=5)
    assert a == b
    engine.cancel("gone")  # cancel before submit is ignored...
    q = submit(engine, p, "gone2", max_tokens=1000)
    engine.cancel("gone2")  # ...cancel after submit ends the request at the next step
    tokens, final = collect(q)
    assert final.finish_reason is FinishReason.CANCELLED and len(tokens) < 1000
    assert_no_leak(engine)
    engine.shutdown()


def test_samples_only_ids_the_tokenizer_can_decode(tiny_spec, tiny_model) -> None:
    """tiny-random has more embedding rows than tokens (as many real models do): a reply
    never holds an id the tokenizer cannot decode, so it can come back as a prompt."""
    engine = make_engine(tiny_spec, tiny_model)
    vocab_size = engine.tokenizer.vocab_size
    assert tiny_model.config.vocab_size > vocab_size  # the case under test exists
    # Sampled at temperature 1 from a random model, about one token in five would fall in
    # the extra rows (320 vs 259) if they were offered.
    tokens, _ = run(engine, prompts(1, seed=7)[0], max_tokens=200, temperature=1.0, seed=3)
    assert len(tokens) >= 20 and max(tokens) < vocab_size
    assert_no_leak(engine)
    engine.shutdown()


def test_stop_strings_and_token_ids(tiny_spec, tiny_model) -> None:
    engine = make_engine(tiny_spec, tiny_model)
    p = prompts(1, seed=7)[0]
    free, _ = run(engine, p, rid="f", max_tokens=12)
    stop_id = free[5]
    tokens, final = run(engine, p, rid="t", max_tokens=12, stop_token_ids=(stop_id,))
    assert tokens == free[:free.index(stop_id) + 1]
    assert final.finish_reason is FinishReason.STOP
    engine.shutdown()


@pytest.mark.slow
def test_multi_turn_cache_on_equals_off_smollm2(smollm2_spec, smollm2_model) -> None:
    """A real conversation on SmolLM2: identical greedy replies with and without reuse,
    and turn N+1 reuses turn N's prompt and reply."""
    tok = ChatTokenizer(smollm2_spec)
    cached = make_engine(smollm2_spec, smollm2_model)
    uncached = make_engine(smollm2_spec, smollm2_model, enable_prefix_cache=False)
    history: list[tuple[str, str]] = []
    previous = 0
    for i, question in enumerate(("What is the capital of France?", "And of Italy?",
                                  "Which of the two cities is bigger?")):
        history.append(("user", question))
        prompt = tok.encode_messages(history)
        a, fa = run(cached, prompt, max_tokens=24, rid=f"a{i}")
        b, _ = run(uncached, prompt, max_tokens=24, rid=f"b{i}")
        assert a == b
        if previous:
            assert fa.cached_tokens >= previous
        previous = len(prompt) + len(a) - 1
        history.append(("assistant", tok.decode(a)))
    assert "Paris" in history[1][1]
    cached.shutdown()
    uncached.shutdown()


def test_n_samples_share_the_prompt_blocks(tiny_spec, tiny_model) -> None:
    """n=4 computes and stores the prompt once: the samples' blocks beyond the prompt are
    their own, and each sample equals a single-sample request with its seed."""
    p = prompts(1, seed=8, lo=200, hi=201)[0]  # 12 full blocks + 8 tokens
    engine = make_engine(tiny_spec, tiny_model, num_blocks=128)
    one = engine.pool.num_free_blocks
    q = submit(engine, p, "n4", max_tokens=10, temperature=1.0, seed=11, n=4)
    samples: dict[int, list[int]] = {}
    finals = {}
    peak = 0
    while len(finals) < 4:
        ev = q.get(timeout=60)
        peak = max(peak, one - engine.pool.num_free_blocks)
        if isinstance(ev, TokenEvent):
            samples.setdefault(ev.index, []).extend(ev.token_ids)
        else:
            finals[ev.index] = ev
    # Prompt: 13 blocks once; each sample: a copy of the partial block (+1 more when
    # its 10 tokens cross a block boundary). Four separate prompts would need 52+.
    assert peak <= 13 + 4 * 2
    assert all(f.completion_tokens == len(samples[i]) for i, f in finals.items())
    for i in range(4):
        alone, _ = run(engine, p, rid=f"alone{i}", max_tokens=10, temperature=1.0, seed=11 + i)
        assert samples[i] == alone
    assert len({tuple(v) for v in samples.values()}) > 1
    assert_no_leak(engine)
    engine.shutdown()


def test_prompt_blocks_are_cached_and_published_when_prefill_ends(tiny_spec, tiny_model) -> None:
    """A prompt's full blocks are `stored` before its first token is streamed (not when the
    reply ends), and a request with the same prefix arriving while the first one is still
    decoding reuses them; outputs equal the uncached engine's."""
    from prefixgate.radix import BlockHasher
    from prefixgate.wire.events import KVEventSink

    class Stored(KVEventSink):
        def __init__(self) -> None:
            self.blocks: list[int] = []

        def stored(self, parent_hash, block_hashes) -> None:
            self.blocks += block_hashes

        def removed(self, block_hashes) -> None:
            pass

        def cleared(self) -> None:
            pass

    sink = Stored()
    engine = make_engine(tiny_spec, tiny_model, event_sink=sink)
    uncached = make_engine(tiny_spec, tiny_model, enable_prefix_cache=False)
    p = prompts(1, seed=11, lo=100, hi=101)[0]  # 6 full blocks of 16 and 4 tokens
    follow = p + [7, 8]
    prompt_blocks = BlockHasher(16, tiny_spec.fingerprint, "").hash_blocks(p)
    seen_at_first_token: list[list[int]] = []
    a_events: queue.Queue = queue.Queue()
    b_events: queue.Queue = queue.Queue()

    def emit_a(ev) -> None:  # engine thread
        if isinstance(ev, TokenEvent) and not seen_at_first_token:
            seen_at_first_token.append(list(sink.blocks))
            engine.submit(Request("b", tuple(follow), SamplingConfig(max_tokens=4)), b_events.put)
        a_events.put(ev)

    engine.submit(Request("a", tuple(p), SamplingConfig(max_tokens=48)), emit_a)
    out_b, final_b = collect(b_events)
    out_a, final_a = collect(a_events)
    assert seen_at_first_token[0][:len(prompt_blocks)] == prompt_blocks
    assert final_b.cached_tokens == 96, "b was admitted while a decoded: a's prompt blocks"
    assert final_a.completion_tokens > final_b.completion_tokens  # a still ran when b ended
    assert out_a == run(uncached, p, max_tokens=48, rid="ra")[0]
    assert out_b == run(uncached, follow, max_tokens=4, rid="rb")[0]
    assert_no_leak(engine)
    engine.shutdown()
    uncached.shutdown()


def test_logprobs_are_the_models_and_equal_with_and_without_the_cache(
        tiny_spec, tiny_model, tiny_reference_model) -> None:
    """With top_logprobs, each token carries its log probability and the top k's: those
    of a plain transformers forward over prompt + reply (log-softmax of the logits of the
    tokenizer's ids), the
    same whether the prompt came from the prefix cache or not."""
    engine = track(make_engine(tiny_spec, tiny_model))
    try:
        prompt = prompts(1, seed=9, lo=40, hi=41)[0]

        def logprobs(rid: str) -> tuple[list[int], list]:
            events = submit(engine, prompt, rid, max_tokens=6, top_logprobs=3,
                            temperature=0.8, seed=4)
            tokens, lps = [], []
            while not isinstance(ev := events.get(timeout=120), FinalEvent):
                tokens.extend(ev.token_ids)
                lps.extend(ev.logprobs)
            return tokens, lps

        tokens, cold = logprobs("cold")
        again, warm = logprobs("warm")  # the prompt's blocks are cached now
        assert again == tokens and len(cold) == len(tokens) == 6
        vocab = ChatTokenizer(tiny_spec).vocab_size  # the engine samples the tokenizer's ids
        with torch.no_grad():
            ref = torch.log_softmax(tiny_reference_model(
                input_ids=torch.tensor([prompt + tokens])).logits[0, :, :vocab].float(), -1)
        for i, (token, a, b) in enumerate(zip(tokens, cold, warm, strict=True)):
            row = ref[len(prompt) - 1 + i]
            assert a.logprob == pytest.approx(float(row[token]), abs=1e-4)
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
            top = torch.topk(row, 3)
            assert list(a.top_token_ids) == top.indices.tolist()
            assert a.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-4)
        # Not asked: none computed.
        events = submit(engine, prompt, "none", max_tokens=2)
        while not isinstance(ev := events.get(timeout=120), FinalEvent):
            assert ev.logprobs == ()
    finally:
        engine.shutdown()
