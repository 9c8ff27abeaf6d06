"""Service rates a worker measures on its finished requests (worker/rates.py)."""

from __future__ import annotations

import pytest

from prefixgate.worker.api import FinalEvent, FinishReason
from prefixgate.worker.rates import ServiceRates


def final(prompt: int, cached: int, completion: int, queue_ms: float, ttft_ms: float,
          total_ms: float) -> FinalEvent:
    return FinalEvent(FinishReason.LENGTH, prompt, cached, completion, queue_ms, ttft_ms,
                      total_ms)


def test_rates_follow_the_timings_as_running_means() -> None:
    r = ServiceRates(window=3)  # alpha 0.5
    assert (r.prefill_tokens_per_s, r.decode_step_s) == (0.0, 0.0)
    r.observe(final(1000, 200, 11, queue_ms=50, ttft_ms=90, total_ms=390))
    assert r.prefill_tokens_per_s == pytest.approx(800 / 0.040)
    assert r.decode_step_s == pytest.approx(0.300 / 10)
    r.observe(final(1000, 0, 11, queue_ms=0, ttft_ms=100, total_ms=600))
    assert r.prefill_tokens_per_s == pytest.approx((20_000 + 10_000) / 2)
    assert r.decode_step_s == pytest.approx((0.030 + 0.050) / 2)


def test_requests_that_measure_nothing_change_nothing() -> None:
    r = ServiceRates()
    r.observe(final(40, 32, 1, queue_ms=1, ttft_ms=5, total_ms=5))  # 8 uncached, 1 token
    r.observe(final(900, 0, 5, queue_ms=3, ttft_ms=3.5, total_ms=3.9))  # under 1 ms
    assert (r.prefill_tokens_per_s, r.decode_step_s) == (0.0, 0.0)
