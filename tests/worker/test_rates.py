"""Service rates a worker measures on its finished requests (workerapi/rates.py)."""

from __future__ import annotations

import pytest

from prefixgate.workerapi.api import FinalEvent, FinishReason
from prefixgate.workerapi.rates import ServiceRates


def final(prompt: int, cached: int, completion: int, queue_ms: float, ttft_ms: float,
          total_ms: float) -> FinalEvent:
    return FinalEvent(FinishReason.LENGTH, prompt, cached, completion, queue_ms, ttft_ms,
                      total_ms)


def test_rates_follow_the_timings() -> None:
    """The decode step is a running mean; the prefill rate is the plain one while every
    request had one size, then the fit's: the tokens a second beyond what any request
    pays."""
    r = ServiceRates(window=3)  # alpha 0.5
    assert (r.prefill_tokens_per_s, r.decode_step_s) == (0.0, 0.0)
    r.observe(final(1000, 200, 11, queue_ms=50, ttft_ms=90, total_ms=390))
    assert r.prefill_tokens_per_s == pytest.approx(800 / 0.040)
    assert r.decode_step_s == pytest.approx(0.300 / 10)
    r.observe(final(1000, 200, 11, queue_ms=0, ttft_ms=80, total_ms=580))
    assert r.prefill_tokens_per_s == pytest.approx(800 / 0.060)  # one size: mean over mean
    assert r.decode_step_s == pytest.approx((0.030 + 0.050) / 2)


def test_the_prefill_rate_is_net_of_what_every_request_pays() -> None:
    """A vLLM CPU server: 0.4 s whatever the prompt, then 180 tokens/s. A 14-token prompt
    alone reads 31 tokens/s over its whole time; fitted with the start-up probe's two
    points and longer prompts the rate is the server's."""
    r = ServiceRates()
    for tokens in (32, 544):  # the probe
        r.observe_prefill(tokens, 0.4 + tokens / 180)
    assert r.prefill_tokens_per_s == pytest.approx(180)
    for tokens in (46, 300, 14, 1975, 120, 34):
        r.observe(final(tokens, 0, 32, queue_ms=0, ttft_ms=(0.4 + tokens / 180) * 1e3,
                        total_ms=10_000))
    assert r.prefill_tokens_per_s == pytest.approx(180)
    assert 46 / (0.4 + 46 / 180) < 75  # what one short prompt's whole time reads


def test_requests_that_measure_nothing_change_nothing() -> None:
    r = ServiceRates()
    r.observe(final(40, 32, 1, queue_ms=1, ttft_ms=5, total_ms=5))  # 8 uncached, 1 token
    r.observe(final(900, 0, 5, queue_ms=3, ttft_ms=3.5, total_ms=3.9))  # under 1 ms
    assert (r.prefill_tokens_per_s, r.decode_step_s) == (0.0, 0.0)


def test_transfer_cost_is_fitted_as_set_up_plus_bytes_at_a_rate() -> None:
    """Pulls that take 50 ms of set-up plus their bytes at 1 GB/s: the fit finds both once
    pulls of different sizes were seen; before, the plain rate of the one size."""
    from prefixgate.workerapi.rates import TransferRate

    rate = TransferRate()
    assert rate.bytes_per_s == 0.0 and rate.setup_s == 0.0
    rate.observe(10_000_000, 0.05 + 0.01)
    assert rate.setup_s == 0.0 and abs(rate.bytes_per_s - 10e6 / 0.06) < 1e-3
    for size in (1_000_000, 100_000_000, 20_000_000, 3_000_000, 60_000_000):
        rate.observe(size, 0.05 + size / 1e9)
    assert abs(rate.setup_s - 0.05) < 1e-9 and abs(rate.bytes_per_s - 1e9) < 1e-3
    # A small pull is priced at its set-up, not at a rate averaged over pulls of all sizes.
    assert abs(rate.setup_s + 100_000 / rate.bytes_per_s - (0.05 + 1e-4)) < 1e-9
    rate.observe(0, 1.0)  # nothing came: no measure
    assert abs(rate.setup_s - 0.05) < 1e-9


def test_transfer_rate_sources_rank_measured_over_probed_or_declared() -> None:
    """A worker reports no rate, then the declared or probed one, until its first pull;
    a measurement then stands and no later declaration or probe replaces it."""
    from prefixgate.workerapi.rates import TransferRate

    rate = TransferRate()
    assert (rate.bytes_per_s, rate.setup_s, rate.source) == (0.0, 0.0, "")
    rate.assume(0.0, 0.0, "probed")  # a probe that measured nothing reports nothing
    assert rate.source == ""
    rate.assume(5e9, 0.0, "declared")
    assert (rate.bytes_per_s, rate.setup_s, rate.source) == (5e9, 0.0, "declared")
    rate.assume(2e9, 0.004, "probed")  # the later figure stands in until a pull
    assert (rate.bytes_per_s, rate.setup_s, rate.source) == (2e9, 0.004, "probed")
    rate.observe(10_000_000, 0.02)  # the first pull replaces it, wholly
    assert rate.source == "measured"
    assert rate.setup_s == 0.0 and abs(rate.bytes_per_s - 5e8) < 1e-3
    rate.assume(9e9, 0.0, "declared")  # too late: measured outranks it
    rate.assume(9e9, 0.0, "probed")
    assert rate.source == "measured" and abs(rate.bytes_per_s - 5e8) < 1e-3
    with pytest.raises(ValueError):
        rate.assume(1e9, 0.0, "measured")
