"""`prefixgate replay --compare-policies` end to end through the CLI: one JSON document on
stdout for every trace and policy, a Markdown table and the plot."""

from __future__ import annotations

import json
import subprocess
import sys

from prefixgate.replay.compare import _row
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
