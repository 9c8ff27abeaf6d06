"""A step error fails only the request it belongs to (issue 13, containment): the others
finish exactly as they would have alone, their caches stay intact and no block leaks."""

from __future__ import annotations

import torch

from prefixgate.worker import engine as engine_module
from prefixgate.worker.sampling import Sampler
from prefixgate.workerapi.api import FinishReason
from tests.helpers import make_engine, shifting_engine
from tests.worker.test_engine import assert_no_leak, collect, prompts, run, submit

POISON = 7  # the poison prompt is a run of it (a valid reply may contain one 7)


def _reference(tiny_spec, tiny_model, good: list[list[int]]) -> list[list[int]]:
    engine = make_engine(tiny_spec, tiny_model, num_blocks=256)
    try:
        return [run(engine, p, rid=f"ref{i}")[0] for i, p in enumerate(good)]
    finally:
        engine.shutdown()


def _good_prompts(n: int) -> list[list[int]]:
    return [[t if t != POISON else POISON + 1 for t in p] for p in prompts(n, seed=3)]


def _run_with_poison(engine, good: list[list[int]], poison: list[int], **poison_sampling):
    streams = [submit(engine, p, f"good{i}") for i, p in enumerate(good[:2])]
    bad = submit(engine, poison, "poison", **poison_sampling)
    streams += [submit(engine, p, f"good{i}") for i, p in enumerate(good[2:], 2)]
    outcomes = [collect(s) for s in streams]
    return outcomes, collect(bad)[1]


def test_forward_error_fails_only_its_request(tiny_spec, tiny_model) -> None:
    good = _good_prompts(5)
    want = _reference(tiny_spec, tiny_model, good)
    engine = make_engine(tiny_spec, tiny_model, num_blocks=256)
    forward = engine.runner.forward
    failed_sizes = []

    def faulty(input_ids, *args, **kwargs):  # a model failure on one request's tokens
        if [POISON] * 8 in (input_ids[i:i + 8] for i in range(len(input_ids) - 7)):
            failed_sizes.append(len(input_ids))
            raise RuntimeError("injected forward failure")
        return forward(input_ids, *args, **kwargs)

    engine.runner.forward = faulty
    try:
        outcomes, bad = _run_with_poison(engine, good, [POISON] * 40)
        assert bad.finish_reason is FinishReason.ERROR
        assert max(failed_sizes) > 40  # it shared a batch with others: bisected out
        assert [tokens for tokens, _ in outcomes] == want
        assert all(f.finish_reason is not FinishReason.ERROR for _, f in outcomes)
        # The others' caches are intact: the next turn of each hits its whole prompt.
        again = run(engine, good[0] + want[0] + [11, 12], rid="next")[1]
        assert again.cached_tokens >= (len(good[0]) + len(want[0])) // 16 * 16
        assert_no_leak(engine)
    finally:
        engine.shutdown()


def test_sampling_error_fails_only_its_request(tiny_spec, tiny_model, monkeypatch) -> None:
    class FaultySampler(Sampler):
        def sample(self, logits: torch.Tensor) -> int:
            if self.params.seed == 666:
                raise FloatingPointError("injected sampling failure")
            return super().sample(logits)

    monkeypatch.setattr(engine_module, "Sampler", FaultySampler)
    good = _good_prompts(4)
    want = _reference(tiny_spec, tiny_model, good)
    engine = make_engine(tiny_spec, tiny_model, num_blocks=256)
    try:
        outcomes, bad = _run_with_poison(engine, good, good[0][:30], seed=666, n=3,
                                         temperature=1.0)
        assert bad.finish_reason is FinishReason.ERROR
        assert [tokens for tokens, _ in outcomes] == want
        assert_no_leak(engine)
    finally:
        engine.shutdown()


def test_admission_error_fails_only_its_request(tiny_spec, tiny_model) -> None:
    good = _good_prompts(4)
    want = _reference(tiny_spec, tiny_model, good)
    engine = make_engine(tiny_spec, tiny_model, num_blocks=256)
    extend = engine.reuse.extend

    def faulty(seq):
        if seq.request_id == "poison":
            raise ValueError("injected admission failure")
        return extend(seq)

    engine.reuse.extend = faulty
    try:
        outcomes, bad = _run_with_poison(engine, good, [3, 4, 5] * 20)
        assert bad.finish_reason is FinishReason.ERROR
        assert [tokens for tokens, _ in outcomes] == want
        assert_no_leak(engine)
    finally:
        engine.shutdown()


def test_shifted_reuse_error_leaks_nothing(tiny_spec, tiny_model, monkeypatch) -> None:
    """A failure while moving cached K/V (after fresh blocks were taken) fails that
    request only and gives every block back."""
    from prefixgate.wire.protocol import SamplingConfig
    from prefixgate.worker import reuse
    from prefixgate.workerapi.api import Request

    engine, _, prompt = shifting_engine(tiny_spec, tiny_model, 40, 400)
    sampling = SamplingConfig(max_tokens=1, context_overflow="keep-system-drop-oldest")
    try:
        engine.run_to_completion(Request("prev", tuple(prompt[:-64]), sampling))

        def broken(*args, **kwargs):
            raise RuntimeError("injected reindex failure")

        monkeypatch.setattr(reuse, "reindex_slots", broken)
        _, final = engine.run_to_completion(Request("moved", tuple(prompt), sampling))
        assert final.finish_reason is FinishReason.ERROR
        assert run(engine, [3, 4, 5] * 10)[1].finish_reason is FinishReason.LENGTH  # goes on
        assert_no_leak(engine)
    finally:
        engine.shutdown()


def test_unattributed_step_error_fails_running_requests_as_failed(tiny_spec, tiny_model) -> None:
    """An exception nothing can be attributed to (scheduling) ends the running requests
    FAILED (retryable elsewhere), not ERROR; the engine goes on serving."""
    engine = make_engine(tiny_spec, tiny_model, num_blocks=256)
    schedule = engine.scheduler.schedule
    broken = [True]

    def faulty():
        if broken[0] and engine.scheduler.running:
            broken[0] = False
            raise RuntimeError("injected scheduling failure")
        return schedule()

    engine.scheduler.schedule = faulty
    try:
        assert run(engine, [3, 4, 5] * 10)[1].finish_reason is FinishReason.FAILED
        assert run(engine, [3, 4, 5] * 10)[1].finish_reason is FinishReason.LENGTH
        assert_no_leak(engine)
    finally:
        engine.shutdown()
