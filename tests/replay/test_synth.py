"""Synthetic routing traces: deterministic, readable by the replay's trace reader, and
with the property each kind exists for."""

from __future__ import annotations

from collections import Counter

import pytest

from prefixgate.replay.synth import BLOCK_SIZE, KINDS, generate, write
from prefixgate.replay.traces import read_trace


@pytest.fixture(scope="module")
def traces() -> dict[str, list[dict]]:
    return {k: generate(k, seed=1) for k in KINDS}


def test_deterministic_and_readable(traces, tmp_path) -> None:
    assert generate("bursts", seed=1) == traces["bursts"]
    assert generate("bursts", seed=2) != traces["bursts"]
    for kind, recs in traces.items():
        trace = read_trace(write(tmp_path / f"{kind}.jsonl", recs))
        assert trace.kind == "prefixgate" and trace.block_size == BLOCK_SIZE
        assert trace.has_timestamps and trace.num_turns == len(recs)
        for conv in trace.conversations:  # a context only grows: each turn extends the last
            for a, b in zip(conv.turns, conv.turns[1:], strict=False):
                assert b.hash_ids[:len(a.hash_ids)] == a.hash_ids
                assert b.num_prompt_tokens > a.num_prompt_tokens
                assert b.timestamp_s > a.timestamp_s
        for r in recs:
            assert len(r["hash_ids"]) == r["prompt_tokens"] // BLOCK_SIZE


def test_each_kind_has_its_property(traces) -> None:
    def firsts(recs):
        return {r["conversation_id"]: r for r in reversed(recs)}.values()

    # Shared system prompts: conversations of one tenant share their leading blocks.
    heads = Counter(r["hash_ids"][0] for r in firsts(traces["system-prompts"]))
    assert len(heads) <= 24 and heads.most_common(1)[0][1] > 100
    # Long documents: first prompts of 12k tokens or more, shared by their readers.
    docs = list(firsts(traces["long-documents"]))
    assert min(r["prompt_tokens"] for r in docs) >= 12_288
    assert Counter(r["hash_ids"][0] for r in docs).most_common(1)[0][1] >= 5
    # Bursts: conversations start within a second of each burst's start.
    starts = sorted(r["time_s"] for r in firsts(traces["bursts"]))
    assert Counter(int(t // 4) for t in starts).most_common(1)[0][1] >= 60
    # Skewed lengths: most conversations are short, a few very long.
    turns = Counter(r["conversation_id"] for r in traces["skewed-lengths"])
    lengths = sorted(turns.values())
    assert lengths[len(lengths) // 2] <= 2 and lengths[-1] >= 20
