"""Predictive ownership in the PrefixIndex against a simple model (hypothesis state
machine), and its life cycle through the feeds (worker restart, failure)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from prefixgate.gateway.feeds import apply_batch
from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.routing import LoadSnapshot, Router, RoutingConfig, Turn
from prefixgate.v1 import worker_pb2

WORKERS = ("a", "b", "c")
TTL = 10.0
NODES = range(1, 60)


def path(h: int) -> list[int]:
    """The chained path from the root to block `h` in a fixed tree (parent = h // 3): a
    block hash always has the same parent, as chained hashes do."""
    out = []
    while h:
        out.append(h)
        h //= 3
    return out[::-1]


class PredictionMachine(RuleBasedStateMachine):
    """Model: per worker, the set of blocks its events say it holds, and the blocks it
    is expected to hold with their expiry (the latest prediction wins)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.index = PrefixIndex(prediction_ttl_s=TTL, clock=lambda: self.now)
        self.epoch = dict.fromkeys(WORKERS, 1)
        for w in WORKERS:
            self.index.reset_worker(w, 1)
        self.held: dict[str, set[int]] = {w: set() for w in WORKERS}
        self.expected: dict[str, dict[int, float]] = {w: {} for w in WORKERS}
        self.confirmed = 0
        self.expired = 0

    def _expire(self) -> None:
        for w in WORKERS:
            stale = [h for h, t in self.expected[w].items() if t <= self.now]
            for h in stale:
                del self.expected[w][h]
            self.expired += len(stale)

    @rule(w=st.sampled_from(WORKERS), h=st.sampled_from(NODES))
    def predict(self, w: str, h: int) -> None:
        self._expire()
        p = path(h)
        new = [b for b in p if b not in self.held[w]]
        assert self.index.predict(w, p) == sum(1 for b in new if b not in self.expected[w])
        for b in new:
            self.expected[w][b] = self.now + TTL

    @rule(w=st.sampled_from(WORKERS), h=st.sampled_from(NODES))
    def stored(self, w: str, h: int) -> None:
        p = path(h)
        self.index.stored(w, self.epoch[w], None, p)
        self.held[w].update(p)
        for b in p:
            if self.expected[w].pop(b, None) is not None:
                self.confirmed += 1

    @rule(w=st.sampled_from(WORKERS), hs=st.lists(st.sampled_from(NODES), max_size=5))
    def removed(self, w: str, hs: list[int]) -> None:
        self.index.removed(w, self.epoch[w], hs)
        self.held[w].difference_update(hs)
        for b in hs:
            self.expected[w].pop(b, None)

    @rule(w=st.sampled_from(WORKERS))
    def cleared(self, w: str) -> None:
        self.index.cleared(w, self.epoch[w])
        self.held[w].clear()
        self.expected[w].clear()

    @rule(w=st.sampled_from(WORKERS))
    def restarted(self, w: str) -> None:
        """A new epoch (the worker registered again): its first event resets it."""
        self.epoch[w] += 1
        self.index.reset_worker(w, self.epoch[w])
        self.held[w].clear()
        self.expected[w].clear()

    @rule(w=st.sampled_from(WORKERS))
    def failed(self, w: str) -> None:
        self.index.drop_predictions(w)
        self.expected[w].clear()

    @rule(dt=st.sampled_from([0.5, 3.0, 9.99, 10.0, 25.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(w=st.sampled_from(WORKERS), h=st.sampled_from(NODES))
    def stale_event_is_ignored(self, w: str, h: int) -> None:
        """A late event of a dead incarnation neither stores nor confirms."""
        if self.epoch[w] > 1:
            self.index.stored(w, self.epoch[w] - 1, None, path(h))

    @invariant()
    def matches_agree(self) -> None:
        self._expire()
        self.index.expire_predictions()
        for h in NODES:
            p = path(h)
            m = self.index.match(p)
            for w in WORKERS:
                run = next((i for i, b in enumerate(p) if b not in self.held[w]), len(p))
                exp = next((i for i, b in enumerate(p)
                            if b not in self.held[w] and b not in self.expected[w]), len(p))
                assert m.cached_blocks.get(w, 0) == run, (h, w)
                assert m.expected_blocks.get(w, 0) == exp, (h, w)
        for w in WORKERS:
            assert self.index.num_expected_blocks(w) == len(self.expected[w])
            assert self.index.num_owned_blocks(w) == len(self.held[w])
        assert self.index.num_confirmed_blocks == self.confirmed
        assert self.index.num_expired_blocks == self.expired


TestPredictions = PredictionMachine.TestCase
TestPredictions.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_expected_blocks_are_credited_at_the_measured_confidence() -> None:
    now = [0.0]
    index = PrefixIndex(prediction_ttl_s=5.0, clock=lambda: now[0])
    router = Router(RoutingConfig(), index)
    workers = [LoadSnapshot("a"), LoadSnapshot("b")]
    for w in ("a", "b"):
        index.reset_worker(w, 1)
    first = Turn(64, "", path(40), 16)  # 4 blocks
    router.dispatch(first, "b")
    d = router.decide(workers, Turn(80, "", path(40 * 3), 16))
    assert d.cached_tokens == {"b": 64} and d.certain_tokens == {}
    assert d.ranked[0].worker_id == "b" and d.best_cached_tokens == 64
    assert index.prediction_confidence == 0.5  # nothing decided yet: the prior
    index.stored("b", 1, None, path(40)[:2])  # half confirmed ...
    now[0] = 6.0
    index.expire_predictions()  # ... half expired
    assert (index.num_confirmed_blocks, index.num_expired_blocks) == (2, 2)
    assert index.prediction_confidence == 0.5


def test_a_worker_restart_drops_its_predictions() -> None:
    """A WatchEvents snapshot of a new incarnation (the worker restarted) resets the
    worker: no prediction survives, while other workers' predictions stay."""
    index = PrefixIndex()
    apply_batch(index, "a", 7, worker_pb2.KVEventBatch(snapshot=True), "worker")
    apply_batch(index, "b", 3, worker_pb2.KVEventBatch(snapshot=True), "worker")
    index.predict("a", path(50))
    index.predict("b", path(50))
    assert index.match(path(50)).expected_blocks == {"a": 4, "b": 4}
    restart = worker_pb2.KVEventBatch(snapshot=True, incarnation=8, events=[
        worker_pb2.KVEvent(stored=worker_pb2.KVStored(block_hashes=path(16)))])
    apply_batch(index, "a", 8, restart, "worker")
    m = index.match(path(50))
    assert m.expected_blocks == {"a": 3, "b": 4} and m.cached_blocks == {"a": 3}
    assert index.num_expected_blocks("a") == 0


def test_predictions_evicted_by_the_index_cap_are_forgotten() -> None:
    """`max_blocks` may evict expected blocks: they stop counting as expected (and are
    neither confirmed nor expired later), as they are no longer in the tree."""
    now = [0.0]
    index = PrefixIndex(max_blocks=3, prediction_ttl_s=5.0, clock=lambda: now[0])
    index.reset_worker("a", 1)
    assert index.predict("a", [1, 2, 3, 4, 5]) == 5
    assert index.num_blocks == 3
    assert index.num_expected_blocks("a") == index.num_expected_blocks() == 3
    assert index.match([1, 2, 3, 4, 5]).expected_blocks == {"a": 3}
    index.stored("a", 1, None, [1, 2, 3])
    now[0] = 6.0
    assert index.expire_predictions() == 0
    assert (index.num_confirmed_blocks, index.num_expired_blocks) == (3, 0)
