"""The routing policies as classes: the interface (every policy reads only what
`WorkerLoad` declares) and each published rule's distinctive choice, plus per-worker
confidence (claims the served turns do not confirm)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from prefixgate.gateway import policies
from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.policies.base import WorkerLoad
from prefixgate.gateway.routing import POLICIES, LoadSnapshot, Router, RoutingConfig, make_turn
from prefixgate.radix import BlockHasher

BS = 4
HASHER = BlockHasher(BS, model_fingerprint="fp")


def serve(index: PrefixIndex, worker: str, ids: list[int]) -> None:
    index.stored(worker, 1, None, HASHER.hash_blocks(ids))


def first(router: Router, ws, ids, conv: str = "") -> str:
    return router.rank(ws, make_turn(ids, HASHER, conv))[0].worker_id


def test_load_snapshot_is_exactly_the_declared_worker_load() -> None:
    """A policy reads only what the protocol declares: `LoadSnapshot` carries exactly
    those fields (a policy reading anything else fails on it in every test)."""
    declared = {n for n in dir(WorkerLoad) if not n.startswith("_")}
    assert {f.name for f in dataclasses.fields(LoadSnapshot)} == declared
    assert set(POLICIES) == set(policies.POLICIES) and POLICIES[0] == "prefix"
    for name, cls in policies.POLICIES.items():
        assert cls.name == name and cls.__doc__ or cls.__module__


class _Strict:
    """A worker that raises on any attribute the protocol does not declare."""

    def __init__(self, snap: LoadSnapshot) -> None:
        self._snap = snap

    def __getattr__(self, name: str):
        if name not in {f.name for f in dataclasses.fields(LoadSnapshot)}:
            raise AssertionError(f"a policy read an undeclared worker field {name!r}")
        return getattr(self._snap, name)


@pytest.mark.parametrize("policy", POLICIES)
def test_policies_read_only_declared_fields(policy: str) -> None:
    index = PrefixIndex()
    serve(index, "w1", list(range(40)))
    router = Router(RoutingConfig(policy=policy, seed=3), index)
    ws = [_Strict(LoadSnapshot(f"w{i}", 10 * i, i, prefill_tokens_per_s=1000.0 * (i + 1),
                               transfer_bytes_per_s=1e9, kv_bytes_per_token=64))
          for i in range(3)]
    for conv in ("a", "b", ""):
        ranked = router.rank(ws, make_turn(list(range(44)), HASHER, conv))
        assert len({id(w) for w in ranked}) == 3


def test_lmetric_multiplies_new_prefill_tokens_by_batch_size() -> None:
    index = PrefixIndex()
    serve(index, "w0", list(range(400)))
    router = Router(RoutingConfig(policy="lmetric"), index)
    prompt = list(range(404))
    # w0 holds 400 of 404 tokens: 4 new prefill tokens x batch 8 = 32 < 404 x 1.
    ws = [LoadSnapshot("w0", 0, 8), LoadSnapshot("w1", 0, 1)]
    assert first(router, ws, prompt) == "w0"
    # ... but at 200 tokens queued there, (204) x 8 > 404 x 1.
    ws = [LoadSnapshot("w0", 200, 8), LoadSnapshot("w1", 0, 1)]
    assert first(router, ws, prompt) == "w1"
    # Idle batches: the product is 0 on both; the fewer prefill tokens win.
    assert first(router, [LoadSnapshot("w0", 200, 0), LoadSnapshot("w1", 0, 0)], prompt) == "w0"


def test_dynamo_cost_in_blocks_and_its_own_active_sequences() -> None:
    index = PrefixIndex()
    serve(index, "w0", list(range(40)))  # 10 blocks
    router = Router(RoutingConfig(policy="dynamo"), index)
    prompt = list(range(44))
    ws = [LoadSnapshot("w0", 0, 0), LoadSnapshot("w1", 0, 0)]
    assert first(router, ws, prompt) == "w0"
    # 12 queued prefill blocks on w0 outweigh its 10-block overlap.
    assert first(router, [LoadSnapshot("w0", 48, 0), LoadSnapshot("w1", 0, 0)], prompt) == "w1"
    # Decode blocks: turns this router sent to w0 and not ended count there until recorded.
    long = make_turn(list(range(500, 560)), HASHER)
    router.dispatch(long, "w0")
    assert first(router, ws, prompt) == "w1"
    router.record(long, "w0")
    assert first(router, ws, prompt) == "w0"


def test_llmd_weighs_prefix_twice_kv_and_queue_once() -> None:
    index = PrefixIndex()
    serve(index, "w0", list(range(40)))
    router = Router(RoutingConfig(policy="llm-d"), index)
    prompt = list(range(41))  # w0 holds 40 of 41: prefix score ~1 (x2)
    # w1 has an empty cache and no queue: kv 1 + queue 1 = 2 against w0's ~1.95 + 0 + 0.
    ws = [LoadSnapshot("w0", 100, 0, kv_fill=1.0), LoadSnapshot("w1", 0, 0, kv_fill=0.0)]
    assert first(router, ws, prompt) == "w1"
    ws = [LoadSnapshot("w0", 100, 0, kv_fill=0.5), LoadSnapshot("w1", 0, 0, kv_fill=0.0)]
    assert first(router, ws, prompt) == "w0"


def test_smetric_keeps_a_conversation_while_its_ttft_budget_holds() -> None:
    index = PrefixIndex()
    router = Router(RoutingConfig(policy="smetric", ttft_budget_s=1.0), index)
    prompt = list(range(40))
    ws = [LoadSnapshot("w0", 0, 0, prefill_tokens_per_s=1000.0),
          LoadSnapshot("w1", 0, 0, prefill_tokens_per_s=1000.0)]
    turn = make_turn(prompt, HASHER, "c")
    router.record(turn, "w1")
    # w1 is as fast but holds nothing; with 500 tokens queued (0.54 s) the turn stays.
    busy = [ws[0], LoadSnapshot("w1", 500, 0, prefill_tokens_per_s=1000.0)]
    assert first(router, busy, prompt, "c") == "w1"
    # At 2,000 queued (2.04 s predicted) the budget breaks: the lowest predicted TTFT.
    busy = [ws[0], LoadSnapshot("w1", 2000, 0, prefill_tokens_per_s=1000.0)]
    assert first(router, busy, prompt, "c") == "w0"


def test_cache_aware_thresholds() -> None:
    index = PrefixIndex()
    serve(index, "w1", list(range(40)))
    serve(index, "w2", list(range(100, 140)) + list(range(200, 240)))
    router = Router(RoutingConfig(policy="cache-aware"), index)
    ws = [LoadSnapshot(f"w{i}", 0, 4) for i in range(3)]
    # Match rate 40/44 > 0.3: the best match.
    assert first(router, ws, list(range(44))) == "w1"
    # No match above the threshold: the most cache room (w0 holds nothing).
    assert first(router, ws, list(range(300, 344))) == "w0"
    # Imbalanced (100 - 4 > 64 and 100 > 1.5 x 4): least loaded whatever the match.
    ws = [LoadSnapshot("w0", 0, 30), LoadSnapshot("w1", 0, 100), LoadSnapshot("w2", 0, 4)]
    assert first(router, ws, list(range(44))) == "w2"


def test_a_worker_whose_claims_are_not_confirmed_loses_its_credit(caplog) -> None:
    """w1's events claim a tenant's system prompt it never stored: the first turn it draws
    by that claim finds nothing cached, and from then on its claim counts for nothing;
    an honest worker's confirmed claims keep their full credit."""
    claims = []
    index = PrefixIndex()
    router = Router(RoutingConfig(), index,
                    on_claim=lambda *a: claims.append(a))
    system = list(range(400))
    serve(index, "w1", system)  # a lie
    ws = [LoadSnapshot("w0"), LoadSnapshot("w1")]
    turn = make_turn(system + [1, 2, 3, 4], HASHER, "t0")
    d = router.decide(ws, turn)
    assert d.ranked[0].worker_id == "w1"
    router.dispatch(turn, "w1")
    with caplog.at_level(logging.WARNING, "prefixgate.gateway.routing"):
        router.record(turn, "w1", cached_tokens=0)  # what w1 reports serving it
    assert router.confidence("w1") == 0.0 and claims == [("w1", 400, 0, 0.0)]
    assert "w1" in caplog.text and "confirmed 0%" in caplog.text
    drawn = []
    for i in range(1, 6):  # the tenant's later turns: w1's claim draws none of them
        turn = make_turn(system + [5, i, 6, 7], HASHER, f"t{i}")
        d = router.decide(ws, turn)
        wid = d.ranked[0].worker_id
        assert d.cached_tokens_of("w1") == 400  # the claim is still indexed ...
        # The honest w0 finds what its events say; the liar finds nothing.
        router.record(turn, wid, d.certain_tokens.get(wid, 0) if wid == "w0" else 0)
        serve(index, wid, system + [5, i, 6, 7])
        drawn.append(wid)
    assert drawn == ["w0"] * 5  # ... and draws nothing
    assert router.confidence("w0") == 1.0 and router.confidence("w1") == 0.0
