"""`prefixgate replay --fleet`: a trace replayed through real gateways (processes, the CLI)
in front of emulated workers, and the simulator agreeing with it on the same trace."""

from __future__ import annotations

import json
import shutil

import pytest

from prefixgate.cli import main

# Ten prompts of 4 blocks (512 tokens) open with one of ten 3-block prefixes; each prefix
# comes back twice, 2.5 s (trace time) later, on a fresh last block. A router that finds
# the holder hits the 3 prefix blocks of every repeat: 20 x 1536 / (30 x 2048) = 1/2.
REPEAT_HIT = 1 / 2


def _trace(tmp_path):
    lines = [{"timestamp": k * 250, "input_length": 2048, "output_length": 4,
              "hash_ids": [k % 10, 100 + k % 10, 200 + k % 10, 1000 + k]} for k in range(30)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def _replay(tmp_path, capsys, name: str, *args: str) -> list[dict]:
    assert main(["replay", "--trace", _trace(tmp_path), "--tokenizer-model", "tiny-random",
                 "--vocab-size", "259", "--time-scale", "2", "--out", str(tmp_path / name),
                 "--name", name, "--json", "--no-progress", "--no-plots", *args]) == 0
    return json.loads(capsys.readouterr().out)["runs"]


def test_fleet_replay_through_a_real_gateway_agrees_with_the_simulator(tmp_path, capsys) -> None:
    fleet = _replay(tmp_path, capsys, "fleet", "--fleet", "2")
    sim = _replay(tmp_path, capsys, "sim", "--simulate", "--sim-workers", "2",
                  "--sim-policies", "prefix")
    (run,), (simulated,) = fleet, sim
    s, w = run["summary"], run["summary"]["workers"]
    assert s["turns_ok"] == 30 and w["requests"] == 30
    # Hit counted at the workers is what the gateway reported to the client.
    assert w["hit_rate"] == pytest.approx(s["hit_rate"])
    assert s["hit_rate"] == pytest.approx(REPEAT_HIT, abs=0.01)
    assert abs(s["hit_rate"] - simulated["summary"]["hit_rate"]) <= 0.01
    # Worker-side TTFT (queue + prefill, emulated): at least the prefill of the tail.
    assert w["ttft_s"]["p50"] >= 512 / 20_000 - 1e-6
    assert s["ttft_s"]["p50"] >= w["ttft_s"]["p50"] * 0.9
    # The gateway's decisions: it predicted what the workers then reported.
    d = s["decisions"]
    assert d["turns"] == 30 and d["predicted_exact_share"] == 1.0


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_two_gateways_over_redis_keep_the_hit(tmp_path, capsys) -> None:
    (run,) = _replay(tmp_path, capsys, "redis", "--fleet", "2", "--gateways", "2",
                     "--fleet-redis")
    assert run["summary"]["turns_ok"] == 30 and "(Redis)" in run["label"]
    assert run["summary"]["workers"]["hit_rate"] == pytest.approx(REPEAT_HIT, abs=0.01)
