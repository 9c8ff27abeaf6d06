"""telemetry/metrics_export.py: the exposition gateways and workers serve at /metrics."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from prefixgate.telemetry.metrics_export import exposition

TEST_COUNTER = Counter("prefixgate:test_exposition_things", "Things counted.", ["kind"])
TEST_HISTOGRAM = Histogram("prefixgate:test_exposition_seconds", "Seconds.")


def test_series_are_labelled_with_the_model_and_carry_no_created_series() -> None:
    TEST_COUNTER.labels("a").inc(2)
    TEST_HISTOGRAM.observe(0.5)
    text = exposition("tiny-random").decode()
    assert 'prefixgate:test_exposition_things_total{kind="a",model_name="tiny-random"} 2.0' \
        in text
    assert 'prefixgate:test_exposition_seconds_count{model_name="tiny-random"} 1.0' in text
    assert "_created" not in text, [line for line in text.splitlines() if "_created" in line]
