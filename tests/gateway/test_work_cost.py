"""The prefix rule's work cost (policies/prefix.py, work_s) and the arrival rate it reads
(Router.arrival_rate_per_s), on an injected clock."""

from __future__ import annotations

import pytest

from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.policies.prefix import work_s
from prefixgate.gateway.routing import LoadSnapshot, Router, RoutingConfig, Turn, make_turn
from prefixgate.radix import BlockHasher

HASHER = BlockHasher(16, model_fingerprint="fp")
RATE = 1_000.0  # prefill tokens per second of every worker here
DOC = list(range(2048))  # a long shared document
QUESTION = DOC + list(range(100_000, 100_064))  # a question about it: 64 new tokens


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def arrivals(router: Router, clock: Clock, num_turns: int, every_s: float) -> None:
    """`num_turns` small turns (no blocks) arriving `every_s` apart."""
    for _ in range(num_turns):
        clock.now += every_s
        router.decide([LoadSnapshot("w0"), LoadSnapshot("w1")], Turn(8))


def test_arrival_rate_on_the_injected_clock() -> None:
    clock = Clock()
    router = Router(RoutingConfig(arrival_window_turns=8), PrefixIndex(clock=clock))
    assert router.arrival_rate_per_s() == 0.0
    arrivals(router, clock, 2, 0.5)
    assert router.arrival_rate_per_s() == 0.0  # one gap: no estimate
    arrivals(router, clock, 1, 0.5)
    assert router.arrival_rate_per_s() == pytest.approx(1 / 1.0)  # (2 gaps - 1) / 1 s
    arrivals(router, clock, 20, 0.5)  # the window keeps the last 8 gaps, 4 s
    assert router.arrival_rate_per_s() == pytest.approx(7 / 4.0)
    clock.now += 12.0  # quiet: the rate falls before the next turn comes
    assert router.arrival_rate_per_s() == pytest.approx(7 / 16.0)
    arrivals(router, clock, 1, 0.0)
    assert router.arrival_rate_per_s() == pytest.approx(7 / 15.5)  # oldest gap dropped


def test_turns_at_one_instant_measure_no_rate() -> None:
    clock = Clock()
    router = Router(RoutingConfig(), PrefixIndex(clock=clock))
    arrivals(router, clock, 10, 0.0)
    assert router.arrival_rate_per_s() == 0.0


def test_work_s_is_the_delay_on_the_turns_behind() -> None:
    # 2 turns/s for 1 s of queue + 3 s of work: 2 turns delayed 3 s, 6 delayed 1.5 s.
    assert work_s(2.0, 3.0, 1.0) == pytest.approx(2 * 3 + 6 * 1.5)
    assert work_s(0.0, 3.0, 1.0) == 0.0
    assert work_s(2.0, 0.0, 5.0) == 0.0


def in_flight_document(every_s: float, **config) -> tuple[Router, list[LoadSnapshot]]:
    """Turns arriving `every_s` apart; then the document's first turn goes to w0, whose
    prefill of it is still queued (no event yet: its blocks are only predicted there).
    w1 is idle with an empty cache (nothing a duplicate would evict)."""
    clock = Clock()
    index = PrefixIndex(clock=clock)
    # Predictions have held so far (another worker's 1,000 blocks, all confirmed): the
    # router credits predicted blocks at 1001/1002.
    warm = HASHER.hash_blocks(list(range(200_000, 216_000)))
    index.predict("w9", warm)
    index.stored("w9", 1, None, warm)
    router = Router(RoutingConfig(transfer=False, **config), index)
    arrivals(router, clock, 12, every_s)
    clock.now += every_s
    doc = make_turn(DOC, HASHER, "doc")
    router.decide([LoadSnapshot("w0"), LoadSnapshot("w1")], doc)
    router.dispatch(doc, "w0")
    clock.now += every_s
    loads = [LoadSnapshot("w0", len(DOC), prefill_tokens_per_s=RATE),
             LoadSnapshot("w1", 0, prefill_tokens_per_s=RATE, kv_fill=0.0)]
    return router, loads


def index_confidence(router: Router) -> float:
    assert router.index is not None
    return router.index.prediction_confidence


def test_a_loaded_fleet_waits_for_the_holder_instead_of_prefilling_the_document_again() -> None:
    """Waiting for w0's prefill of the document, then 64 tokens, or recomputing all of it
    on idle w1 cost this turn the same (2.112 s). Without the work cost w1 wins the tie
    (less loaded) and the document is prefilled twice; with 2 turns/s arriving, the
    2.1 s it adds to w1 delays the turns behind it and the turn waits on w0."""
    question = make_turn(QUESTION, HASHER, "q")
    router, loads = in_flight_document(0.5, work_weight=0.0)
    d = router.decide(loads, question)
    assert d.certain_tokens == {} and d.cached_tokens["w0"] == len(DOC)  # predicted only
    assert d.ranked[0].worker_id == "w1"
    assert d.cost_s["w0"] == pytest.approx(d.cost_s["w1"], abs=0.01)

    router, loads = in_flight_document(0.5, work_weight=1.0)
    lam = router.arrival_rate_per_s()
    d = router.decide(loads, question)
    assert d.ranked[0].worker_id == "w0"
    per_worker = router.arrival_rate_per_s() / 2
    assert lam == pytest.approx(per_worker * 2, rel=0.1)
    new_s = (len(QUESTION) - d.cached_tokens["w0"] * index_confidence(router)) / RATE
    all_s, queue_s = len(QUESTION) / RATE, len(DOC) / RATE
    assert d.cost_s["w0"] == pytest.approx(queue_s + new_s
                                           + per_worker * new_s * (queue_s + new_s / 2))
    assert d.cost_s["w1"] == pytest.approx(all_s + per_worker * all_s * all_s / 2)


def test_an_idle_fleet_keeps_the_old_choice() -> None:
    """One turn a minute: the work cost is a few milliseconds and the choice without it
    stands (the tie goes to the idle w1)."""
    question = make_turn(QUESTION, HASHER, "q")
    router, loads = in_flight_document(60.0, work_weight=1.0)
    d = router.decide(loads, question)
    assert d.ranked[0].worker_id == "w1"
    assert d.cost_s["w1"] - len(QUESTION) / RATE < 0.05


def test_a_pull_is_charged_for_the_rest_it_computes() -> None:
    """w0 holds the document (events) behind a long queue; w1, idle, can pull it and
    compute 64 tokens. The pull's cost carries the work cost of those 64 tokens only."""
    clock = Clock()
    index = PrefixIndex(clock=clock)
    router = Router(RoutingConfig(work_weight=1.0), index)
    index.stored("w0", 1, None, HASHER.hash_blocks(DOC))
    arrivals(router, clock, 12, 0.5)
    clock.now += 0.5
    link = dict(prefill_tokens_per_s=RATE, transfer_bytes_per_s=1e9, kv_bytes_per_token=1000)
    loads = [LoadSnapshot("w0", 8_000, **link), LoadSnapshot("w1", 0, kv_fill=0.0, **link)]
    d = router.decide(loads, make_turn(QUESTION, HASHER, "q"))
    assert d.ranked[0].worker_id == "w1" and d.pull_of("w1") is not None
    per_worker = router.arrival_rate_per_s() / 2
    rest_s = 64 / RATE
    transfer_s = d.pull_of("w1").transfer_s
    assert d.cost_s["w1"] == pytest.approx(transfer_s + rest_s
                                           + per_worker * rest_s * rest_s / 2)
