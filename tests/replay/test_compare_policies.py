"""`prefixgate replay --compare-policies` end to end through the CLI: one JSON document on
stdout for every trace and policy, a Markdown table and the plot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prefixgate.replay.compare import _row
from prefixgate.replay.loadgen import open_arrival_times
from prefixgate.replay.synth import generate, write


def test_compare_policies_one_document_for_every_trace_and_policy(tmp_path) -> None:
    recs = [r for r in generate("skewed-lengths", seed=3) if r["time_s"] < 6]
    a = write(tmp_path / "a.jsonl", recs)
    b = write(tmp_path / "b.jsonl", recs[: len(recs) // 2])
    out = subprocess.run(
        [sys.executable, "-m", "prefixgate", "replay", "--compare-policies",
         "--trace", f"{a},{b}", "--sim-policies", "prefix", "--sim-policies", "round-robin",
         "--ttft-target", "0.2", "--json", "--no-progress", "--out", str(tmp_path / "out"),
         "--name", "cmp"], capture_output=True, text=True, timeout=300, check=True)
    doc = json.loads(out.stdout)
    assert doc["ttft_target_s"] == 0.2 and [t["trace"] for t in doc["traces"]] == [str(a), str(b)]
    for tr in doc["traces"]:
        assert [r["policy"] for r in tr["policies"]] == ["prefix", "round-robin"]
        assert 0 < tr["bounds"]["combined_lru"] <= tr["bounds"]["infinite_cache"]
        for r in tr["policies"]:
            assert 0 <= r["goodput"] <= 1 and r["ttft_s"]["p50"] <= r["ttft_s"]["p99"]
            assert r["hit_rate"] <= r["not_recomputed_rate"] <= 1
    # The second trace is the first's first half: fewer turns, the same rules.
    assert doc["traces"][1]["turns"] < doc["traces"][0]["turns"]
    md = (tmp_path / "out" / "cmp.md").read_text()
    assert "| prefix |" in md and "goodput (TTFT ≤ 0.2 s)" in md
    assert (tmp_path / "out" / "cmp-policies.png").read_bytes()[:4] == b"\x89PNG"


def test_goodput_counts_turns_within_the_target_over_all_turns() -> None:
    run = {"config": {"policy": "lmetric"}, "ttft_samples_s": [0.1, 0.5, 1.0, 3.0],
           "summary": {"turns": 5, "ttft_s": {"p50": 0.75, "p90": 2.4, "p99": 2.9},
                       "hit_rate": 0.5, "not_recomputed_rate": 0.6, "cached_tokens": 50,
                       "transferred_tokens": 10, "load_balance": None}}
    row = _row(run, 1.0)
    assert row["goodput"] == 3 / 5  # a failed turn (no sample) is not good
    assert row["tokens_not_recomputed"] == 60 and "OSDI" in row["source"]


def test_seeds_report_the_mean_and_range_and_who_led_in_each(tmp_path) -> None:
    recs = [r for r in generate("bursts", seed=1) if r["time_s"] < 8]
    a = write(tmp_path / "a.jsonl", recs)
    out = subprocess.run(
        [sys.executable, "-m", "prefixgate", "replay", "--compare-policies", "--trace", str(a),
         "--sim-policies", "prefix", "--sim-policies", "random", "--seeds", "3", "--json",
         "--no-progress", "--no-plots", "--out", str(tmp_path / "out"), "--name", "cmp"],
        capture_output=True, text=True, timeout=300, check=True)
    doc = json.loads(out.stdout)
    assert doc["seeds"] == [0, 1, 2]
    (tr,) = doc["traces"]
    assert len(tr["leads"]["ttft_p99"]) == len(tr["leads"]["goodput"]) == 3
    for r in tr["policies"]:
        seeds = r["per_seed"]
        assert len(seeds["ttft_p99_s"]) == len(seeds["goodput"]) == 3
        assert r["ttft_s"]["p99"] == pytest.approx(sum(seeds["ttft_p99_s"]) / 3)
        assert min(seeds["goodput"]) <= r["goodput"] <= max(seeds["goodput"])
    # Resampled arrivals are other runs: the seeds' figures differ.
    assert len({round(x, 9) for r in tr["policies"] for x in r["per_seed"]["ttft_p99_s"]}) > 2
    md = (tmp_path / "out" / "cmp.md").read_text()
    assert "mean (range) over seeds 0, 1, 2" in md and "of 3 seeds: " in md


def test_open_arrivals_resampled_keep_order_and_local_rate() -> None:
    """Seed 0 plays the timestamps; another seed draws each gap as an exponential with the
    recorded gap as its mean: order kept, simultaneous turns kept together, a burst stays
    denser than the quiet stretch around it, and the mean gap holds over many turns."""
    burst = [10.0 + 0.01 * i for i in range(200)]
    quiet = [float(i) for i in range(10)] + burst + [12.0 + i for i in range(10)] + [30.0, 30.0]
    assert open_arrival_times(quiet, speedup=2.0) == [t / 2 for t in quiet]
    a, b = open_arrival_times(quiet, seed=1), open_arrival_times(quiet, seed=2)
    assert a != b and a != quiet and a == open_arrival_times(quiet, seed=1)
    assert all(x <= y for x, y in zip(a, a[1:], strict=False)) and a[-1] == a[-2]
    # The burst's mean gap (0.01 s recorded) stays far below the quiet stretch's (1 s).
    assert (a[209] - a[10]) / 199 < 0.1 * (a[9] - a[0]) / 9
    many = open_arrival_times([0.1 * i for i in range(20_000)], seed=3)
    assert many[-1] == pytest.approx(0.1 * 19_999, rel=0.03)
