"""The simulator against the fleet: the simulator's per-turn rows (the fleet's keys, the
turn as its worker sees it) and `fleet.agreement`, the join of a fleet run and a
simulated run of the same turns."""

from __future__ import annotations

import pytest

from prefixgate.emulate.service import ServiceModel
from prefixgate.gateway.routing import RoutingConfig
from prefixgate.replay.fleet import agreement, agreement_markdown
from prefixgate.replay.loadgen import ArrivalConfig
from prefixgate.replay.metrics import summarize
from prefixgate.replay.simulate import SimConfig, SimTurn, simulate, turn_rows
from prefixgate.replay.targets import TurnRecord


def test_simulated_turns_time_the_worker_side_after_a_pull() -> None:
    """A turn that pulls its prefix joins its worker's queue when the pull ends: its
    worker-side TTFT (as the emulated worker's records time it) is its TTFT less the
    pull; a turn without a pull is timed from its arrival."""
    prefix = tuple(range(1, 101))  # 100 blocks of 4 tokens
    convs = [[SimTurn("seed", 0, 404, 1, prefix + (9000,), prefix + (9000,), 0.0)]]
    for c in range(6):
        blocks = prefix + tuple(10_000 * (c + 1) + i for i in range(25))
        convs.append([SimTurn(f"c{c}", 0, len(blocks) * 4, 1, blocks, blocks, 1.0)])
    res = simulate(convs, SimConfig(
        num_workers=4, capacity_tokens=10_000, block_size=4,
        service=ServiceModel(prefill_tokens_per_s=1000, decode_s_per_token=0.01),
        arrival=ArrivalConfig("open"), transfer_bytes_per_s=1e6, kv_bytes_per_token=100,
        routing=RoutingConfig(transfer=True)))
    rows = {(r["conversation_id"], r["turn"]): r for r in turn_rows(res.records, res.at_worker)}
    assert len(rows) == 7
    pulled = [r for r in rows.values() if r["transferred_tokens"]]
    assert pulled
    for r in pulled:  # 400 tokens x 100 bytes over 1 MB/s: at least 40 ms of pull
        assert r["worker_arrival_s"] >= r["start_s"] + 0.04 - 1e-9
        assert r["worker_ttft_s"] == pytest.approx(
            r["ttft_s"] - (r["worker_arrival_s"] - r["start_s"]), abs=2e-4)
    plain = [r for r in rows.values() if not r["transferred_tokens"]]
    assert all(r["worker_arrival_s"] == r["start_s"] and r["worker_ttft_s"] == r["ttft_s"]
               for r in plain)


def _run(records: list[TurnRecord], worker_ttft: dict, fleet: bool) -> dict:
    summary = summarize(records, 10.0)
    turns = [{"conversation_id": r.conversation_id, "turn": r.turn_index, "status": r.status,
              "cached_tokens": r.cached_tokens, "transferred_tokens": r.transferred_tokens,
              "worker": r.worker, "ttft_s": r.ttft_s,
              "worker_ttft_s": worker_ttft[(r.conversation_id, r.turn_index)]}
             for r in records]
    if fleet:
        summary["workers"] = {"ttft_s": summarize(
            [TurnRecord("x", i, ttft_s=t, completion_tokens=1)
             for i, t in enumerate(worker_ttft.values())], 1.0)["ttft_s"]}
    return {"summary": summary, "turns": turns}


def test_agreement_joins_the_same_turns_and_names_what_differs() -> None:
    """Hit in points, TTFT relative, and per turn: same worker or not, and whether the
    tokens not recomputed differ there."""
    def rec(conv, cached, worker, ttft, moved=0):
        return TurnRecord(conv, 0, ttft_s=ttft, prompt_tokens=1000, cached_tokens=cached,
                          transferred_tokens=moved, completion_tokens=3, worker=worker)

    fleet = [rec("a", 500, "worker-0", 0.10), rec("b", 0, "worker-1", 0.20),
             rec("c", 800, "worker-1", 0.30), rec("d", 0, "worker-0", 0.40)]
    sim = [rec("a", 500, "worker-0", 0.10), rec("b", 200, "worker-1", 0.22),  # same worker
           rec("c", 0, "worker-0", 0.33, moved=800),  # another worker, pulled as much
           rec("d", 300, "worker-1", 0.40)]  # another worker, more
    f_run = _run(fleet, {(r.conversation_id, 0): r.ttft_s / 2 for r in fleet}, True)
    s_run = _run(sim, {(r.conversation_id, 0): r.ttft_s / 2 for r in sim}, False)
    a = agreement(f_run, s_run)
    assert a["hit"]["fleet"] == pytest.approx(1300 / 4000)
    assert a["hit"]["diff"] == pytest.approx((1000 - 1300) / 4000)
    assert a["not_recomputed"]["diff"] == pytest.approx((1800 - 1300) / 4000)
    assert a["ttft_client_p50"]["diff_rel"] == pytest.approx(
        a["ttft_client_p50"]["sim"] / a["ttft_client_p50"]["fleet"] - 1)
    assert a["ttft_worker_p99"]["fleet"] == pytest.approx(f_run["summary"]["workers"]
                                                          ["ttft_s"]["p99"])
    t = a["turns"]
    assert (t["joined"], t["same_worker"]) == (4, 2)
    assert t["not_recomputed_differs_same_worker"] == 1
    assert t["not_recomputed_differs_other_worker"] == 1
    assert t["not_recomputed_tokens_sim_minus_fleet"] == 200 + 300
    assert t["worker_ttft_sim_minus_fleet_s"]["max"] == pytest.approx(0.015)
    table = agreement_markdown([("prefix, 1 gateway", a)])
    assert "| prefix, 1 gateway | 32.50% / 25.00% (-7.50) |" in table
    assert "4 / 2 / 1, 1 |" in table


@pytest.mark.slow
@pytest.mark.integration
def test_cli_fleet_with_simulate_compares_each_run_with_its_simulation(tmp_path, capsys) -> None:
    """`replay --fleet 2 --simulate`: the fleet run, then the simulator on the same turns,
    the fleet run carrying its agreement (the two agree on this trace) and the Markdown a
    table of it."""
    import json

    from prefixgate.cli import main

    # Ten 4-block prompts open with one of ten 3-block prefixes, each back twice later.
    lines = [{"timestamp": k * 250, "input_length": 2048, "output_length": 4,
              "hash_ids": [k % 10, 100 + k % 10, 200 + k % 10, 1000 + k]} for k in range(30)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    assert main(["replay", "--trace", str(trace), "--tokenizer-model", "tiny-random",
                 "--vocab-size", "259", "--time-scale", "2", "--fleet", "2", "--simulate",
                 "--out", str(out), "--name", "both", "--json", "--no-progress",
                 "--no-plots"]) == 0
    fleet, sim = json.loads(capsys.readouterr().out)["runs"]
    assert sim["label"].startswith("--simulate prefix") and sim["config"]["simulate"]
    a = fleet["summary"]["simulated"]
    assert a["turns"]["joined"] == 30
    # The simulator finds every repeat's prefix (deterministic); the fleet's figures are
    # its run's (a loaded host may send a repeat elsewhere: tests/e2e's fleet test holds
    # the two together).
    assert a["hit"]["sim"] == pytest.approx(0.5) == sim["summary"]["hit_rate"]
    assert a["hit"]["fleet"] == fleet["summary"]["hit_rate"]
    assert a["ttft_worker_p50"]["sim"] == pytest.approx(512 / 20_000)  # the fresh block
    assert "Fleet against `--simulate`" in (out / "both.md").read_text()
    with pytest.raises(SystemExit, match="max-conversations"):
        main(["replay", "--trace", str(trace), "--tokenizer-model", "tiny-random",
              "--fleet", "2", "--simulate", "--max-turns", "5", "--out", str(out)])


def test_fleet_plays_poisson_starts_on_its_clock() -> None:
    """A fleet S times faster sends what the simulator plays, S times sooner: trace times,
    think times and Poisson conversation starts (the same draws) all divided by S."""
    import random

    from prefixgate.replay.fleet import wall_arrivals

    a = ArrivalConfig("poisson", rate_per_s=8.0, think_time_s=5.0, seed=3)
    w = wall_arrivals(a, 20.0)
    assert (w.mode, w.seed, w.speedup, w.think_time_s) == ("poisson", 3, 20.0, 0.25)
    emulated, wall = random.Random(a.seed), random.Random(w.seed)
    for _ in range(5):  # the load generator's draws, one per conversation start
        assert wall.expovariate(w.rate_per_s) * 20 == pytest.approx(
            emulated.expovariate(a.rate_per_s))


def test_fleet_chat_turns_ask_for_their_recorded_reply_length(tiny_spec) -> None:
    """A chat turn sent through the fleet asks for as many tokens as its recorded reply
    has (capped at --max-tokens), the length the simulator decodes; token traces keep
    their recorded lengths."""
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.replay.fleet import with_reply_lengths
    from prefixgate.replay.loadgen import Limits, build_request
    from prefixgate.replay.simulate import prepare_turns
    from prefixgate.replay.traces import Conversation, Trace, TraceTurn

    conv = Conversation("c", (TraceTurn("hello there", "a reply of a few words"),
                              TraceTurn("and?", "x " * 300), TraceTurn("last", "")))
    trace = Trace("sharegpt", (conv,))
    tok = ChatTokenizer(tiny_spec)
    out = with_reply_lengths(trace, tok)
    sim = prepare_turns(trace, 4, tok)[0]
    lengths = [t.num_output_tokens for t in out.conversations[0].turns]
    assert lengths == [t.num_output_tokens for t in sim]
    assert lengths[0] > 1 and lengths[1] > 256 and lengths[2] == 1
    limits = Limits(max_tokens=256)
    assert [build_request(out, out.conversations[0], i, limits).max_tokens for i in range(3)] == [
        lengths[0], 256, 1]
    # Before: every chat turn asked for the cap.
    assert build_request(trace, conv, 0, limits).max_tokens == 256
    tokens = Trace("mooncake", (Conversation("m", (TraceTurn(num_prompt_tokens=10,
                                                             num_output_tokens=7),)),), 512)
    assert with_reply_lengths(tokens, tok) is tokens
