"""`prefixgate replay` end to end: subprocesses against `prefixgate up` (tiny-random, two
workers, prefix routing) over real gRPC on a loopback port."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixgate.wire.rpc import free_port
from tests.helpers import REPO, cli_env, start_up

PG = [sys.executable, "-m", "prefixgate"]
RECORDED: list[Path] = []


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The gateway's address; it records its traffic to RECORDED[0]."""
    port = free_port()
    env = cli_env(PREFIXGATE_CACHE_DIR=str(tmp_path_factory.mktemp("cache")))
    RECORDED[:] = [tmp_path_factory.mktemp("rec") / "recorded.jsonl"]
    up = start_up(["--model", "tiny-random", "--workers", "2", "--port", str(port), "--policy",
                   "prefix", "--record-trace", str(RECORDED[0])], env)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        up.terminate()
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()


def _replay(*args: str) -> dict:
    r = subprocess.run([*PG, "replay", "--no-progress", "--json", "--no-plots", *args],
                       capture_output=True, text=True, timeout=180, env=cli_env(), cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return json.loads(r.stdout)["runs"][0]


def test_replay_sharegpt_through_prefixgate_up(gateway, tmp_path) -> None:
    convs = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Conversation {i}: tell me about topic number {i}."},
        {"from": "gpt", "value": f"Topic {i} is an interesting subject with many facets."},
        {"from": "human", "value": "Tell me more, please, in some detail."},
        {"from": "gpt", "value": "There is a lot more: history, uses, and open questions."},
        {"from": "human", "value": "Thanks, and one last thing?"}]} for i in range(3)]
    trace = tmp_path / "chat.jsonl"
    trace.write_text("\n".join(json.dumps(c) for c in convs) + "\n")
    run = _replay("--trace", str(trace), "--target", gateway, "--arrival", "closed",
                  "--concurrency", "2", "--max-tokens", "6", "--out", str(tmp_path / "out"),
                  "--label", "tiny")
    s = run["summary"]
    assert s["turns_ok"] == 9 and s["errors"] == {}
    assert set(s["per_worker"]) <= {"worker-0", "worker-1"} and s["per_worker"]
    # Later turns reuse their conversation's earlier prompt on the worker that holds it.
    assert s["hit_rate"] > 0.3, s
    assert s["ttft_s"]["p50"] > 0 and s["e2e_s"]["p99"] >= s["ttft_s"]["p99"]
    assert run["label"] == "tiny"
    assert (tmp_path / "out" / "replay.md").read_text().startswith("### replay")


def test_replay_mooncake_token_trace_open_loop(gateway, tmp_path) -> None:
    lines = [{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]},
             {"timestamp": 300, "input_length": 900, "output_length": 3, "hash_ids": [1, 2]},
             {"timestamp": 600, "input_length": 300, "output_length": 3, "hash_ids": [9]}]
    trace = tmp_path / "m.jsonl"
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    run = _replay("--trace", str(trace), "--target", gateway, "--arrival", "open",
                  "--speedup", "2", "--vocab-size", "259", "--out", str(tmp_path / "o"))
    s = run["summary"]
    assert s["turns_ok"] == 3 and s["prompt_tokens"] == 1800
    assert 3 <= s["completion_tokens"] <= 9  # the recorded output length caps each reply
    assert len(run["ttft_samples_s"]) == 3


def test_failed_turns_are_counted_by_status(gateway, tmp_path) -> None:
    trace = tmp_path / "m.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 100, "output_length": 3,
                                 "hash_ids": [1]}) + "\n")
    # Token ids up to 32000 are outside tiny-random's vocabulary: INVALID_ARGUMENT.
    r = subprocess.run([*PG, "replay", "--no-progress", "--json", "--no-plots", "--trace",
                        str(trace), "--target", gateway, "--vocab-size", "32000", "--out",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120,
                       env=cli_env(), cwd=REPO)
    assert r.returncode == 1, r.stderr[-2000:]  # every turn failed
    s = json.loads(r.stdout)["runs"][0]["summary"]
    assert s["errors"] == {"INVALID_ARGUMENT": 1} and s["turns_ok"] == 0
    assert json.loads(r.stdout)["runs"][0]["turns"][0]["status"] == "INVALID_ARGUMENT"


def test_replay_recorded_trace_reuses_the_conversation_prefix(gateway, tmp_path) -> None:
    from prefixgate.radix import BlockHasher
    from prefixgate.telemetry.trace_recorder import TraceRecorder

    hasher = BlockHasher(16)
    rec = TraceRecorder(tmp_path / "rec.jsonl", 16)
    first = list(range(100, 500))
    for i, prompt in enumerate((first, first + list(range(40)))):
        rec.record(arrival_unix_s=100.0 + i, conversation_id="c1", num_prompt_tokens=len(prompt),
                   block_hashes=hasher.hash_blocks(prompt), output_tokens=4, worker_id="w",
                   cached_tokens=0)
    rec.close()
    run = _replay("--trace", str(tmp_path / "rec.jsonl"), "--target", gateway,
                  "--arrival", "closed", "--vocab-size", "259", "--out", str(tmp_path / "o"))
    s = run["summary"]
    assert s["turns_ok"] == 2 and s["prompt_tokens"] == 840
    # Turn 2 goes where turn 1 went and reuses its 25 synthesised blocks (at most 399 tokens).
    assert s["cached_tokens"] >= 24 * 16, s


def test_gateway_records_a_trace_that_replays(gateway, tmp_path) -> None:
    from prefixgate.replay.traces import read_trace

    before = RECORDED[0].read_text().count("\n") if RECORDED[0].exists() else 0
    conv = {"id": "rec", "conversations": [
        {"from": "human", "value": "Record this conversation, please, it is a test."},
        {"from": "gpt", "value": "Recorded."}, {"from": "human", "value": "And this turn."}]}
    trace = tmp_path / "chat.jsonl"
    trace.write_text(json.dumps(conv) + "\n")
    run = _replay("--trace", str(trace), "--target", gateway, "--max-tokens", "4",
                  "--out", str(tmp_path / "o"))
    assert run["summary"]["turns_ok"] == 2
    lines = RECORDED[0].read_text().splitlines()[before:]
    assert len(lines) == 2
    assert "Record this" not in RECORDED[0].read_text()  # hashes, never text
    recorded = read_trace(RECORDED[0])
    assert recorded.kind == "prefixgate" and recorded.block_size == 16
    (conv_rec,) = [c for c in recorded.conversations if c.conversation_id == "rec"]
    t0, t1 = conv_rec.turns
    assert t1.hash_ids[: len(t0.hash_ids)] == t0.hash_ids and t1.num_cached_tokens > 0
    assert t0.worker_id in {"worker-0", "worker-1"} and t0.num_output_tokens <= 4
    # Replaying the recording gives the same prompt lengths.
    again = _replay("--trace", str(RECORDED[0]), "--target", gateway, "--vocab-size", "259",
                    "--arrival", "closed", "--out", str(tmp_path / "o2"))
    assert again["summary"]["turns_ok"] == recorded.num_turns
    assert again["summary"]["prompt_tokens"] == sum(
        t.num_prompt_tokens for c in recorded.conversations for t in c.turns)
