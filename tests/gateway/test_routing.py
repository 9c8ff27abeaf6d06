"""Routing policies and the event-fed prefix index, without gRPC (unit + property tests)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.routing import (
    POLICIES,
    LoadSnapshot,
    Router,
    RoutingConfig,
    Turn,
    make_turn,
    queued_prefill_tokens,
    reusable_tokens,
)
from prefixgate.radix import BlockHasher

BS = 4
HASHER = BlockHasher(BS, model_fingerprint="fp")


def tokens(*parts: range | list[int]) -> list[int]:
    return [t for p in parts for t in p]


def serve(index: PrefixIndex, worker: str, ids: list[int]) -> None:
    """What a worker's events say after it cached `ids`."""
    index.stored(worker, 1, None, HASHER.hash_blocks(ids))


def workers(n: int, **loads: tuple[int, int]) -> list[LoadSnapshot]:
    return [LoadSnapshot(f"w{i}", *loads.get(f"w{i}", (0, 0))) for i in range(n)]


def test_prefix_policy_prefers_the_longest_cached_prefix() -> None:
    index = PrefixIndex()
    router = Router(RoutingConfig(), index)
    serve(index, "w1", list(range(40)))
    serve(index, "w2", list(range(20)))
    turn = make_turn(list(range(44)), HASHER, "c")
    d = router.decide(workers(3), turn)
    assert [w.worker_id for w in d.ranked] == ["w1", "w2", "w0"]
    assert d.expected_cached_tokens == 40 and d.cached_tokens_of("w2") == 20
    # A hit never covers the last prompt token.
    assert router.decide(workers(3), make_turn(list(range(40)), HASHER)).expected_cached_tokens == 39


def test_matched_tokens_round_down_to_the_engines_reuse_block() -> None:
    """A worker whose engine reuses prefixes in whole blocks of 8 tokens (twice the
    gateway's 4, as vLLM at 32 behind a gateway at 16) is credited only the whole blocks
    of its own that the match covers, the last prompt token's block part included."""
    assert [reusable_tokens(m, 99, 8) for m in (0, 4, 8, 12, 20, 24)] == [0, 0, 8, 8, 16, 24]
    assert reusable_tokens(24, 23, 8) == 16 and reusable_tokens(24, 23, 1) == 23
    index = PrefixIndex()
    shared = list(range(12))  # 3 gateway blocks: ends inside the engine's second block
    serve(index, "coarse", shared + [50] * 12)
    serve(index, "fine", shared + [60] * 12)
    router = Router(RoutingConfig(), index)
    ws = [LoadSnapshot("coarse", reuse_block_tokens=8), LoadSnapshot("fine")]
    d = router.decide(ws, make_turn(shared + [70] * 9, HASHER))
    assert d.cached_tokens_of("coarse") == 8 and d.certain_tokens["coarse"] == 8
    assert d.cached_tokens_of("fine") == 12  # no reuse block: as before
    assert d.ranked[0].worker_id == "fine"  # 4 more tokens really cached there
    # A whole prompt matched: the engine computes its last token, so its last block too.
    d = router.decide(ws, make_turn(shared + [50] * 4, HASHER))
    assert d.cached_tokens_of("coarse") == 8 and d.cached_tokens_of("fine") == 12


def test_load_outweighs_a_small_prefix_but_not_a_large_one() -> None:
    index = PrefixIndex()
    serve(index, "w0", list(range(400)))
    router = Router(RoutingConfig(running_weight=0), index)
    busy = workers(2, w0=(1000, 0))
    assert router.rank(busy, make_turn(list(range(410)), HASHER))[0].worker_id == "w1"
    light = workers(2, w0=(100, 0))
    assert router.rank(light, make_turn(list(range(410)), HASHER))[0].worker_id == "w0"
    # Running sequences count through running_weight.
    router = Router(RoutingConfig(running_weight=64), index)
    assert router.rank(workers(2, w0=(0, 8)), make_turn(list(range(410)), HASHER))[0].worker_id \
        == "w1"


def test_conversation_tie_breaker_and_no_index() -> None:
    router = Router(RoutingConfig())  # no index: load, then the previous worker
    ws = workers(4)
    first = router.rank(ws, make_turn(list(range(8)), HASHER, "conv"))[0]
    router.record(make_turn(list(range(8)), HASHER, "conv"), "w3")
    assert router.rank(ws, make_turn(list(range(12)), HASHER, "conv"))[0].worker_id == "w3"
    assert first.worker_id in {w.worker_id for w in ws}
    # A loaded previous worker loses: the tie-breaker is only a tie-breaker.
    assert router.rank(workers(4, w3=(50, 0)), make_turn(list(range(12)), HASHER, "conv")
                       )[0].worker_id != "w3"


def _shared_prompt_run(config: RoutingConfig, n_workers: int = 4, n_convs: int = 16):
    """New conversations sharing a 64-token system prompt arrive one at a time; each
    served turn is reported back as the worker's stored blocks. Returns (first-turn
    placement, whether every second turn went back to its conversation's worker)."""
    index = PrefixIndex(spread_fanout=config.spread_fanout)
    router = Router(config, index)
    system = list(range(1000, 1064))
    placed: dict[str, str] = {}
    for c in range(n_convs):
        prompt = tokens(system, range(c * 100, c * 100 + 10))
        turn = make_turn(prompt, HASHER, f"c{c}")
        w = router.rank(workers(n_workers), turn)[0].worker_id
        router.record(turn, w)
        serve(index, w, prompt + [7, 7, 7, 7, 7])  # prompt and reply cached
        placed[f"c{c}"] = w
    sticky = True
    for c in range(n_convs):
        prompt = tokens(system, range(c * 100, c * 100 + 10), [7] * 5, range(50, 60))
        d = router.decide(workers(n_workers), make_turn(prompt, HASHER, f"c{c}"))
        sticky &= d.ranked[0].worker_id == placed[f"c{c}"] and d.expected_cached_tokens >= 72
    return Counter(placed.values()), sticky


def test_shared_system_prompt_spreads_new_conversations() -> None:
    spread, sticky = _shared_prompt_run(RoutingConfig())
    assert sorted(spread.values()) == [4, 4, 4, 4] and sticky
    # Without the spread rule, the first holder of the system prompt takes every idle
    # new conversation (the hot spot the rule exists to prevent).
    hot, sticky = _shared_prompt_run(RoutingConfig(shared_prefix_weight=1.0))
    assert max(hot.values()) == 16 and sticky


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_ranks_each_worker_once(policy: str) -> None:
    router = Router(RoutingConfig(policy=policy, seed=1), PrefixIndex())
    ws = workers(5, w2=(10, 1))
    for i in range(6):
        ranked = router.rank(ws, make_turn(list(range(i, i + 9)), HASHER, f"c{i % 2}"))
        assert sorted(w.worker_id for w in ranked) == sorted(w.worker_id for w in ws)
    assert router.rank([], make_turn([1, 2, 3, 4], HASHER)) == []


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        RoutingConfig(policy="best")
    with pytest.raises(ValueError, match="load_weight"):
        RoutingConfig(load_weight=-1)


def test_epochs_fence_stale_events_and_orphans_are_counted() -> None:
    index = PrefixIndex()
    hs = HASHER.hash_blocks(list(range(16)))
    index.stored("w", 1, None, hs)
    index.reset_worker("w", 2)  # restarted: starts clean
    assert index.match(hs).cached_blocks == {}
    index.stored("w", 1, None, hs)  # a late event of the dead incarnation
    assert index.num_blocks == 0
    index.stored("w", 2, None, hs[:2])
    index.stored("w", 2, hs[1], hs[2:])  # continuation of a known block
    assert index.match(hs).cached_blocks == {"w": 4}
    index.stored("w", 2, 12345, [1, 2])  # unknown parent: dropped, counted
    assert index.num_orphan_events == 1 and index.num_blocks == 4
    index.stored("w", 3, None, hs[:1])  # a newer epoch resets first
    assert index.match(hs).cached_blocks == {"w": 1}
    index.remove_worker("w")
    assert index.num_blocks == 0 and index.workers() == {}


def test_max_blocks_bounds_memory() -> None:
    index = PrefixIndex(max_blocks=50)
    for c in range(20):
        serve(index, f"w{c % 3}", list(range(c * 1000, c * 1000 + 40)))
    assert index.num_blocks <= 50


# --- property test against a simple model --------------------------------------------------

_paths = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple)
_events = st.lists(st.tuples(st.sampled_from(["store", "remove", "clear", "restart"]),
                             st.sampled_from(["a", "b", "c"]), _paths, st.integers(0, 5)),
                   max_size=40)


@settings(max_examples=150, deadline=None)
@given(_events, st.lists(_paths, min_size=1, max_size=5))
# A chain stored on a parent whose own parent an earlier removal named.
@example([("store", "a", (0,), 0), ("store", "b", (0, 0), 0), ("remove", "b", (0,), 0),
          ("store", "b", (0, 0, 0), 2)], [(0,), (1,)])
def test_index_matches_a_set_model(events, queries) -> None:
    ids: dict[tuple, int] = {}

    def h(path: tuple) -> int:  # a unique "chained hash" per path prefix
        return ids.setdefault(path, len(ids) + 1)

    index = PrefixIndex()
    held: dict[str, set[int]] = {"a": set(), "b": set(), "c": set()}
    epoch = {"a": 1, "b": 1, "c": 1}
    for kind, w, path, k in events:
        if kind == "store":
            # The engine extends a chain it holds (or starts one at the root).
            k = min(k, len(path) - 1)
            while k and h(path[:k]) not in held[w]:
                k -= 1
            parent = h(path[:k]) if k else None
            hs = [h(path[: i + 1]) for i in range(k, len(path))]
            index.stored(w, epoch[w], parent, hs)
            # Extending a prefix means holding it: its ancestors too, even one an earlier
            # removal named (the index's contract for `stored`).
            held[w].update(hs, (h(path[:i]) for i in range(1, k + 1)))
        elif kind == "remove":
            hs = [h(path[: i + 1]) for i in range(min(k, len(path) - 1), len(path))]
            index.removed(w, epoch[w], hs)
            held[w].difference_update(hs)
        elif kind == "clear":
            index.cleared(w, epoch[w])
            held[w].clear()
        else:
            epoch[w] += 1
            index.reset_worker(w, epoch[w])
            held[w].clear()
    for q in queries:
        hs = [h(q[: i + 1]) for i in range(len(q))]
        expected = {}
        for w, s in held.items():
            n = 0
            while n < len(hs) and hs[n] in s:
                n += 1
            if n:
                expected[w] = n
        assert index.match(hs).cached_blocks == expected
    # Resident blocks are exactly the held blocks and the paths leading to them.
    path_of = {v: p for p, v in ids.items()}
    on_paths = {h(path_of[b][:i]) for s in held.values() for b in s
                for i in range(1, len(path_of[b]) + 1)}
    assert index.num_blocks == len(on_paths)
    for w, s in held.items():
        assert index.num_owned_blocks(w) == len(s)


def test_router_benchmark_smoke() -> None:
    """`prefixgate bench router`'s latency part on a small index (not timed)."""
    from prefixgate.bench.router import _latency

    rows = _latency([3000], [8], 6, seed=1, progress=lambda items, desc: items)
    (row,) = rows
    assert row["indexed_blocks"] >= 3000 and row["workers"] == 8
    assert row["mean_expected_cached_tokens"] > 0  # resident conversations are found


# --- the cost rule ------------------------------------------------------------------------


def test_a_miss_costs_the_re_prefill_of_what_it_evicts() -> None:
    """A (512 cached, 600 queued) against B (idle, empty) for a 1024-token prompt: on TTFT
    alone B wins (1024 < 600 + 512 tokens of prefill); once reuse is measured, the 512
    tokens B would store again (evicting as many from its full cache) tip it to A. The
    turns come at one instant (no arrival rate measured: the work cost is 0)."""
    index = PrefixIndex(clock=lambda: 0.0)
    router = Router(RoutingConfig(), index)
    serve(index, "w0", list(range(512)))
    turn = make_turn(list(range(1024)), HASHER, "c")
    loads = [LoadSnapshot("w0", 600), LoadSnapshot("w1")]
    router.reuse = 0.0  # no measured reuse: a miss costs nothing later
    d = router.decide(loads, turn)
    assert d.ranked[0].worker_id == "w1" and d.regret_tokens("w1") == 512
    assert d.cost_s["w1"] == pytest.approx(1024 / 10_000)
    router.reuse = 0.5
    d = router.decide(loads, turn)
    assert d.ranked[0].worker_id == "w0" and d.regret_tokens("w0") == 0
    assert d.cost_s["w1"] == pytest.approx((1024 + 512 * 0.5) / 10_000)
    # An empty cache evicts nothing: the duplicate is free later.
    d = router.decide([LoadSnapshot("w0", 600), LoadSnapshot("w1", kv_fill=0.0)], turn)
    assert d.ranked[0].worker_id == "w1"


def test_reuse_is_the_re_prefills_per_evicted_token() -> None:
    """A hot prefix (w0 holds its 512 tokens) followed by tails asked for once: each turn
    serves 512 cached tokens per 128 computed (4 reuses per computed token), but what a
    duplicate would evict is a cold tail, asked for again once in four turns. Until a
    token was computed again (nothing evicted yet) the reuses per computed token stand in;
    afterwards reuse = tokens computed again that were routed before / tokens computed,
    over the last `reuse_window_turns` turns."""
    index = PrefixIndex()
    router = Router(RoutingConfig(reuse_window_turns=4), index)
    hot = list(range(512))
    serve(index, "w0", hot)

    def tail(k: int) -> Turn:
        return make_turn(hot + list(range(10_000 * (k + 1), 10_000 * (k + 1) + 128)), HASHER,
                         f"c{k}")

    for k in range(4):
        router.decide(workers(2), tail(k))
    assert router.reuse == pytest.approx(4.0)  # no eviction seen: cached / computed
    router.decide(workers(2), tail(0))  # tail 0 again: its 128 tokens were evicted
    assert router.reuse == pytest.approx(128 / (4 * 128))
    for k in range(4, 8):
        router.decide(workers(2), tail(k))
    assert router.reuse == 0.0  # the window holds tails never asked for again


def test_a_cold_tail_does_not_outweigh_an_idle_worker() -> None:
    """The turn above's next tail on w0 (its prefix cached, 2.8 s of queue) or on idle w1
    (a cold prefill): with the eviction priced at the measured re-prefills of what it
    evicts (cold tails, asked for again once in four turns) w1 wins; priced at the
    reuses of an average cached token (4), w0 did. The turns come at one instant (no
    arrival rate measured: the work cost is 0)."""
    index = PrefixIndex(clock=lambda: 0.0)
    router = Router(RoutingConfig(reuse_window_turns=4, transfer=False), index)
    hot = list(range(512))
    serve(index, "w0", hot)

    def tail(k: int) -> Turn:
        return make_turn(hot + list(range(10_000 * (k + 1), 10_000 * (k + 1) + 128)), HASHER,
                         f"c{k}")

    for k in (0, 1, 2, 3, 0):
        router.decide(workers(2), tail(k))
    loads = [LoadSnapshot("w0", 2_000), LoadSnapshot("w1")]
    d = router.decide(loads, tail(9))
    assert router.reuse == pytest.approx(128 / (4 * 128))
    assert d.ranked[0].worker_id == "w1"
    assert d.cost_s["w1"] == pytest.approx((640 + 512 * 0.25) / 10_000)


def test_measured_rates_rank_workers_and_unmeasured_count_at_the_mean() -> None:
    router = Router(RoutingConfig(), PrefixIndex())
    turn = make_turn(list(range(400)), HASHER, "c")
    fast, slow, new = (LoadSnapshot("w0", 100, prefill_tokens_per_s=40_000),
                       LoadSnapshot("w1", 0, prefill_tokens_per_s=10_000), LoadSnapshot("w2", 50))
    d = router.decide([fast, slow, new], turn)
    assert [w.worker_id for w in d.ranked] == ["w0", "w2", "w1"]  # 12.5, 18, 40 ms
    assert d.cost_s["w2"] == pytest.approx(450 / 25_000)
    d = Router(RoutingConfig(measured_rates=False), PrefixIndex()).decide([fast, slow, new], turn)
    assert d.ranked[0].worker_id == "w1"  # the least queued, all at the default rate


def test_decode_steps_delay_a_prefill_only_where_they_interleave() -> None:
    router = Router(RoutingConfig(), PrefixIndex())
    turn = make_turn(list(range(1000)), HASHER, "c")
    common = dict(prefill_tokens_per_s=10_000, decode_step_s=0.02)
    busy = LoadSnapshot("w0", 0, 8, prefill_chunk_tokens=256, **common)
    alone = LoadSnapshot("w1", 0, 8, prefill_chunk_tokens=0, **common)
    d = router.decide([busy, alone], turn)
    assert d.cost_s["w0"] == pytest.approx(0.1 + 4 * 0.02)  # 4 chunks, a decode step each
    assert d.cost_s["w1"] == pytest.approx(0.1) and d.ranked[0].worker_id == "w1"
    d = router.decide([LoadSnapshot("w0", 0, 2), LoadSnapshot("w1")], turn)
    assert d.cost_s["w0"] == pytest.approx((1000 + 2 * 64) / 10_000)  # nothing measured


def _spread_new_conversations(rates: list[float]) -> tuple[Counter, str]:
    """16 new conversations, one at a time, on idle workers with these measured rates
    (512-token prompts, no shared prefix), each served turn reported back as stored blocks;
    then a fresh conversation's second turn (no cache anywhere). Returns (placement,
    where that second turn went)."""
    index = PrefixIndex()
    router = Router(RoutingConfig(), index)
    loads = [LoadSnapshot(f"w{i}", prefill_tokens_per_s=r) for i, r in enumerate(rates)]
    placed: Counter = Counter()
    for c in range(16):
        prompt = list(range(c * 1000, c * 1000 + 512))
        turn = make_turn(prompt, HASHER, f"c{c}")
        w = router.rank(loads, turn)[0].worker_id
        router.record(turn, w)
        serve(index, w, prompt)
        placed[w] += 1
    router = Router(RoutingConfig())  # no index: only the tie-breakers can place it
    router.record(make_turn([1, 2, 3, 4], HASHER, "conv"), "w2")
    return placed, router.rank(loads, make_turn(list(range(64)), HASHER, "conv"))[0].worker_id


def test_rates_that_differ_by_measurement_noise_are_a_tie() -> None:
    """Identical workers report rates that differ by float noise (a running mean of
    tokens / seconds): their costs differ by ~1e-12 s, far below anything the score
    resolves. They must place turns as workers with exactly equal rates do (spread by the
    emptier cache; a conversation's turn back on its worker), not all on the worker that
    measured a hair faster."""
    exact, affinity = _spread_new_conversations([20_000.0] * 4)
    assert sorted(exact.values()) == [4, 4, 4, 4] and affinity == "w2"
    noisy = [20_000.0 * (1 + k * 1e-12) for k in (3, -1, 2, 0)]
    assert _spread_new_conversations(noisy) == (exact, affinity)
    # Real workers' estimates differ by a few percent: still a tie for a turn whose costs
    # differ by less than half a block of prefill ...
    assert _spread_new_conversations([20_000.0, 20_100.0, 19_950.0, 20_050.0])[1] == "w2"
    # ... while a real difference (a worker twice as fast) still decides.
    fast = _spread_new_conversations([20_000.0, 20_000.0, 40_000.0, 20_000.0])
    assert fast[0]["w2"] == 16


def test_gateway_load_view_counts_status_plus_turns_sent_since() -> None:
    """WorkerHandle's queued prefill: the worker's status (a prompt in prefill with what
    is left of it) plus this gateway's turns sent since that status, less its own prefill
    in the status that ended since; not the own count's whole prompts until first token."""
    from prefixgate.gateway.pool import WorkerHandle
    from prefixgate.registry import WorkerRecord
    from prefixgate.v1 import worker_pb2

    h = WorkerHandle(WorkerRecord("w", "127.0.0.1:1"), None, None)  # type: ignore[arg-type]

    def send(tokens: int) -> None:
        h.in_flight_prompt_tokens += tokens

    def first_token(tokens: int) -> None:
        h.in_flight_prompt_tokens -= tokens
        h.prefilled_since_status += tokens

    send(1000)
    assert h.num_queued_prefill_tokens == 1000  # no status yet: the own count
    h.set_status(worker_pb2.WorkerStatus(num_queued_prefill_tokens=400))  # 600 computed
    assert h.num_queued_prefill_tokens == 400
    send(300)
    assert h.num_queued_prefill_tokens == 700
    first_token(1000)
    assert h.num_queued_prefill_tokens == 300  # only the turn the status has not seen
    h.set_status(worker_pb2.WorkerStatus(num_queued_prefill_tokens=2000))  # others' turns
    assert h.num_queued_prefill_tokens == 2000
    h.set_status(None)  # the status stream failed: the own count again
    assert h.num_queued_prefill_tokens == 300


def test_a_finished_prompt_takes_off_no_more_than_the_worker_computed_since_status() -> None:
    """The status counts a prompt in prefill with only its unfinished part; the gateway
    sees the whole prompt end at its first token. What leaves the status is bounded by
    the status's age times the worker's rate, so the turns queued behind it still count
    (the old subtraction of the whole prompt read 0 with 20,000 tokens queued)."""
    from prefixgate.gateway.pool import WorkerHandle
    from prefixgate.registry import WorkerRecord
    from prefixgate.v1 import worker_pb2

    h = WorkerHandle(WorkerRecord("w", "127.0.0.1:1"), None, None)  # type: ignore[arg-type]
    h.in_flight_prompt_tokens = 20_000  # this gateway's turn, 18,000 of it computed
    h.set_status(worker_pb2.WorkerStatus(num_queued_prefill_tokens=22_000,
                                         prefill_tokens_per_s=1000.0))  # 20,000 others'
    h.heard_at -= 2.0  # the status is 2 s old: at most 2,000 tokens computed since
    h.in_flight_prompt_tokens -= 20_000  # its first token
    h.prefilled_since_status += 20_000
    assert 19_900 <= h.num_queued_prefill_tokens <= 20_000
    # Unmeasured rate: nothing bounds it, as before.
    assert queued_prefill_tokens(22_000, 20_000, 0, 20_000) == 2_000
    assert queued_prefill_tokens(22_000, 20_000, 0, 20_000, 2_000.0) == 20_000
    # The own turns sent since the status still count in full.
    assert queued_prefill_tokens(22_000, 20_000, 500, 20_000, 2_000.0) == 20_500


def _link(wid: str, queued: int = 0, bps: float = 1e6, bpt: int = 100,
          export: int = 0) -> LoadSnapshot:
    return LoadSnapshot(wid, queued, 0, prefill_tokens_per_s=1000.0, decode_step_s=0.01,
                        kv_fill=0.5, transfer_bytes_per_s=bps, kv_bytes_per_token=bpt,
                        export_queued_bytes=export)


def test_pull_moves_kv_to_an_idle_worker_when_the_holder_is_busy() -> None:
    """A 400-token prefix cached on w0, which has 2 s of prefill queued: w1 (idle) pulls it
    (400 x 100 bytes at 1 MB/s = 0.04 s) and prefills 44 tokens, instead of waiting 2 s
    or recomputing 400 tokens (0.4 s)."""
    index = PrefixIndex()
    serve(index, "w0", list(range(400)))
    router = Router(RoutingConfig(), index)
    turn = make_turn(list(range(444)), HASHER, "c")
    d = router.decide([_link("w0", queued=2000), _link("w1")], turn)
    assert d.ranked[0].worker_id == "w1"
    pull = d.pull_of("w1")
    assert pull is not None and pull.holder_id == "w0"
    assert pull.num_blocks == 100 and pull.num_tokens == 400
    assert abs(pull.transfer_s - 0.04) < 1e-9
    assert abs(d.cost_s["w1"] - (0.04 + 44 / 1000)) < 1e-9
    assert d.pull_of("w0") is None and d.regret_tokens("w1") == 0
    # Without the option, w1 recomputes (0.444 s) and still beats waiting on w0 (2.044 s).
    plain = Router(RoutingConfig(transfer=False), index).decide(
        [_link("w0", queued=2000), _link("w1")], turn)
    assert plain.ranked[0].worker_id == "w1" and not plain.pulls
    assert plain.cost_s["w1"] > d.cost_s["w1"] + 0.3


def test_pull_is_priced_at_the_link_and_the_holders_queue() -> None:
    index = PrefixIndex()
    serve(index, "w0", list(range(400)))
    turn = make_turn(list(range(444)), HASHER, "c")
    # A link slower than recomputing (400 x 100 bytes at 50 kB/s = 0.8 s > 0.4 s): w1
    # recomputes.
    d = Router(RoutingConfig(), index).decide(
        [_link("w0", queued=2000), _link("w1", bps=5e4)], turn)
    assert d.ranked[0].worker_id == "w1" and d.pull_of("w1") is None
    # The holder's link busy with 1 s of other pulls: recompute is cheaper again.
    d = Router(RoutingConfig(), index).decide(
        [_link("w0", queued=2000, export=1_000_000), _link("w1")], turn)
    assert d.pull_of("w1") is None
    # A pull hidden behind the receiver's own queue costs nothing beyond it.
    d = Router(RoutingConfig(), index).decide(
        [_link("w0", queued=2000), _link("w1", queued=300)], turn)
    assert d.pull_of("w1") is not None and abs(d.cost_s["w1"] - (0.3 + 0.044)) < 1e-9
    # An idle holder is cheapest: waiting for the cached worker wins.
    d = Router(RoutingConfig(), index).decide([_link("w0"), _link("w1")], turn)
    assert d.ranked[0].worker_id == "w0" and not d.pull_of("w0")


def test_no_pull_without_a_measured_rate_or_across_kv_layouts() -> None:
    index = PrefixIndex()
    serve(index, "w0", list(range(400)))
    turn = make_turn(list(range(444)), HASHER, "c")
    none = Router(RoutingConfig(), index).decide(
        [_link("w0", queued=2000, bps=0), _link("w1", bps=0)], turn)
    assert not none.pulls
    other = Router(RoutingConfig(), index).decide(
        [_link("w0", queued=2000), _link("w1", bpt=200)], turn)
    assert not other.pulls
    # A worker that has measured no rate yet counts at its peers' mean.
    mean = Router(RoutingConfig(), index).decide(
        [_link("w0", queued=2000), _link("w1", bps=0)], turn)
    assert mean.pull_of("w1") is not None


def test_pull_takes_only_blocks_the_holders_events_confirm() -> None:
    """Blocks only predicted on a worker (routed there, not yet computed) are not pulled."""
    index = PrefixIndex()
    router = Router(RoutingConfig(), index)
    turn = make_turn(list(range(444)), HASHER, "c")
    router.dispatch(turn, "w0")  # expected on w0, no event yet
    d = router.decide([_link("w0", queued=2000), _link("w1")], turn)
    assert not d.pulls
    serve(index, "w0", list(range(200)))  # half of it confirmed
    d = router.decide([_link("w0", queued=2000), _link("w1")], turn)
    assert d.pull_of("w1").num_blocks == 50


def test_a_pulls_set_up_is_paid_whatever_its_size() -> None:
    """A 400-token prefix at 1 MB/s is 0.04 s of bytes; with 0.5 s of measured set-up per
    pull, recomputing it (0.4 s) is cheaper, and a 4,000-token prefix still pulls."""
    index = PrefixIndex()
    serve(index, "w0", list(range(400)))
    slow_setup = [LoadSnapshot(w, q, 0, prefill_tokens_per_s=1000.0, decode_step_s=0.01,
                               transfer_bytes_per_s=1e6, transfer_setup_s=0.5,
                               kv_bytes_per_token=100) for w, q in (("w0", 5000), ("w1", 0))]
    d = Router(RoutingConfig(), index).decide(slow_setup, make_turn(list(range(444)), HASHER))
    assert d.ranked[0].worker_id == "w1" and d.pull_of("w1") is None
    serve(index, "w0", [t % 250 for t in range(4000)])
    d = Router(RoutingConfig(), index).decide(
        slow_setup, make_turn([t % 250 for t in range(4040)], HASHER))
    pull = d.pull_of("w1")
    assert pull is not None and abs(pull.transfer_s - (0.5 + 0.4)) < 1e-9
