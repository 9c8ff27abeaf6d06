"""vLLM KV events mapped onto prefixgate's block hashes: decoding both encodings, the
rules of engines/vllm_events.py, a property test against a simple model of vLLM's
cache for every pair of block sizes, and the router's predicted cached tokens at a vLLM
worker (its matches rounded to whole vLLM blocks) against vLLM's own hit."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.engines.vllm_events import (
    Cleared,
    Removed,
    Stored,
    VLLMEventMapper,
    decode_batch,
)
from prefixgate.gateway.feeds import apply_event
from prefixgate.gateway.index import PrefixIndex
from prefixgate.gateway.routing import LoadSnapshot, Router, RoutingConfig, make_turn
from prefixgate.radix import BlockHasher, Hashers
from prefixgate.wire.events import KVEventSink
from tests.engines.vllm_wire import STRUCTS, encode, stored_chain, vhash

FP = "fp-test"


class SetSink(KVEventSink):
    """The blocks a reader of the sink's events believes are held."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.calls: list[tuple] = []

    def stored(self, parent_hash, block_hashes) -> None:
        self.blocks.update(block_hashes)
        self.calls.append(("store", parent_hash, tuple(block_hashes)))

    def removed(self, block_hashes) -> None:
        self.blocks.difference_update(block_hashes)
        self.calls.append(("remove", tuple(block_hashes)))

    def cleared(self) -> None:
        self.blocks.clear()
        self.calls.append(("clear",))


def ours(tokens: list[int], gbs: int, namespace: str = "") -> list[int]:
    return BlockHasher(gbs, FP, namespace).hash_blocks(tokens)


def mapper(gbs: int, **kw) -> tuple[VLLMEventMapper, SetSink]:
    sink = SetSink()
    return VLLMEventMapper(Hashers(gbs, FP), sink, **kw), sink


def apply(m: VLLMEventMapper, *events: tuple, array_like: bool = False) -> None:
    _, evs, _ = decode_batch(encode(list(events), array_like))
    m.apply(evs)


@pytest.mark.parametrize("array_like", [False, True])
def test_decode_both_encodings(array_like: bool) -> None:
    tokens = list(range(32))
    payload = encode([stored_chain(tokens, 16, 0, 2, salt="tenant"),
                      ("removed", [vhash(tokens[:16], "tenant")]), ("cleared",)],
                     array_like, ts=12.5)
    ts, events, skipped = decode_batch(payload)
    assert ts == 12.5 and skipped == 0
    assert events[0] == Stored((vhash(tokens[:16], "tenant"), vhash(tokens, "tenant")), None,
                               tuple(tokens), 16, "tenant", True)
    assert events[1] == Removed((vhash(tokens[:16], "tenant"),))
    assert events[2] == Cleared()


def test_decode_a_batch_encoded_by_vllm_itself() -> None:
    """data/vllm-0.32.0-kv-event-batch.msgpack: vLLM 0.32.0's own KVEventBatch structs,
    encoded by its msgspec encoder (two chained stores with the cache salt in the first
    block's extra keys, a removal, a store of a second KV cache group, a clear)."""
    import hashlib
    from pathlib import Path

    def h(t):
        return hashlib.sha256(repr(t).encode()).digest()

    toks = list(range(100, 164))
    payload = (Path(__file__).parent / "data" / "vllm-0.32.0-kv-event-batch.msgpack").read_bytes()
    ts, events, skipped = decode_batch(payload)
    assert ts == 1234.5 and skipped == 1  # the second group's store
    assert events[0] == Stored((h(toks[:16]), h(toks[:32])), None, tuple(toks[:32]), 16,
                               "acme", True)
    assert events[1].parent == h(toks[:32]) and events[1].salt is None
    assert events[2] == Removed((h(toks[:64]),)) and events[3] == Cleared()
    m, sink = mapper(16)
    m.apply(events[:3])
    assert sink.blocks == set(ours(toks, 16, "acme")[:3])


def test_decode_refuses_garbage() -> None:
    with pytest.raises(ValueError):
        decode_batch(b"\xc1not msgpack")
    with pytest.raises(ValueError):
        decode_batch(encode([])[:0] or b"\x05")


@pytest.mark.parametrize("vbs,gbs", [(16, 16), (32, 16), (16, 32), (16, 24), (24, 16)])
def test_store_then_remove_maps_to_our_hashes(vbs: int, gbs: int) -> None:
    tokens = [random.Random(vbs * gbs).randrange(1000) for _ in range(6 * vbs)]
    m, sink = mapper(gbs)
    apply(m, stored_chain(tokens, vbs, 0, 3), stored_chain(tokens, vbs, 3, 6))
    expected = ours(tokens, gbs)
    assert sink.blocks == set(expected)
    assert m.held_prefix_blocks(expected) == len(expected)
    # Removing vLLM block 2 removes every gateway block overlapping tokens [2v, 3v).
    apply(m, ("removed", [vhash(tokens[:3 * vbs])]))
    gone = {h for j, h in enumerate(expected) if j * gbs < 3 * vbs and (j + 1) * gbs > 2 * vbs}
    assert gone and sink.blocks == set(expected) - gone
    # vLLM recomputes it (a request missed there): the gateway blocks come back.
    apply(m, stored_chain(tokens, vbs, 2, 3))
    assert sink.blocks == set(expected)


def test_duplicate_copies_are_counted() -> None:
    tokens = list(range(32))
    m, sink = mapper(16)
    apply(m, stored_chain(tokens, 16, 0, 2))
    apply(m, stored_chain(tokens, 16, 0, 2))  # vLLM cached the same content twice
    apply(m, ("removed", [vhash(tokens[:16]), vhash(tokens)]))
    assert sink.blocks == set(ours(tokens, 16))  # one copy of each is still cached
    apply(m, ("removed", [vhash(tokens[:16]), vhash(tokens)]))
    assert sink.blocks == set()


def test_unknown_parent_is_skipped_and_namespaces_follow_the_salt() -> None:
    tokens = list(range(64))
    m, sink = mapper(16)
    apply(m, stored_chain(tokens, 16, 2, 4))  # subscribed late: parent never seen
    assert sink.blocks == set() and m.num_unplaced_blocks == 2
    apply(m, stored_chain(tokens, 16, 0, 2, salt="acme"),
          stored_chain(tokens, 16, 2, 4, salt="acme"))
    assert sink.blocks == set(ours(tokens, 16, "acme"))
    assert not sink.blocks & set(ours(tokens, 16, ""))


def test_without_extra_keys_the_namespace_is_asked() -> None:
    tokens = list(range(32))
    asked = []

    def namespace_of(first_block):
        asked.append(tuple(first_block))
        return "acme"

    m, sink = mapper(16, namespace_of=namespace_of)
    apply(m, stored_chain(tokens, 16, 0, 2, salt="acme", with_keys=False))
    assert asked == [tuple(tokens[:16])] and sink.blocks == set(ours(tokens, 16, "acme"))
    m2, sink2 = mapper(16, namespace_of=lambda _: None)  # ambiguous: not placed
    apply(m2, stored_chain(tokens, 16, 0, 2, with_keys=False))
    assert sink2.blocks == set() and m2.num_unplaced_blocks == 2


def test_bounded_memory_removes_what_it_forgets() -> None:
    m, sink = mapper(16, max_blocks=4)
    seqs = [[s * 1000 + i for i in range(32)] for s in range(3)]
    for s in seqs:
        apply(m, stored_chain(s, 16, 0, 2))
    # 6 vLLM blocks, room for 4: the oldest sequence's blocks were forgotten and removed.
    assert sink.blocks == set(ours(seqs[1], 16)) | set(ours(seqs[2], 16))
    apply(m, ("removed", [vhash(seqs[0][:16])]))  # unknown now: ignored, counted
    assert m.num_unknown_removals == 1


def _stored_event(tokens: list[int], bs: int, *, lora: str | None = None,
                  keys: list | None = None, medium: str = "GPU", group: int = 0) -> bytes:
    """One BlockStored from the root, with vLLM's LoRA fields, extra keys, medium, group."""
    stored_t, _, _, batch_t = STRUCTS[False]
    n = len(tokens) // bs
    hashes = [vhash(tokens[:(i + 1) * bs], repr((lora, keys))) for i in range(n)]
    return msgspec.msgpack.encode(batch_t(0.0, [stored_t(
        hashes, None, tokens, bs, 1 if lora else None, medium, lora, keys, group)]))


def test_foreign_chains_are_skipped_not_misfiled() -> None:
    """A LoRA adapter's chain, another KV group's, another medium's, one whose salt this
    process never sent, and blocks keyed by a multimodal item: none is filed under
    namespace "" (nor any other); blocks before a multimodal item are placed."""
    tokens = list(range(64))
    m, sink = mapper(16, namespace_of_salt={"salt-of-acme": "acme"}.get)
    for payload in (_stored_event(tokens, 16, lora="adapter-1",
                                  keys=[("adapter-1",), ("adapter-1",), ("adapter-1",),
                                        ("adapter-1",)]),
                    _stored_event(tokens, 16, group=1),
                    _stored_event(tokens, 16, medium="CPU"),
                    _stored_event(tokens, 16, keys=[("salt-of-someone-else",), None, None,
                                                    None])):
        m.apply(decode_batch(payload)[1])
    assert sink.blocks == set() and m.num_held_blocks == 0 and not m._blocks
    assert m.num_foreign_blocks == 4 + 4  # LoRA, unknown salt (group and medium: decoded out)
    assert decode_batch(_stored_event(tokens, 16, group=1))[2] == 1
    # A multimodal item in block 2: blocks 0 and 1 are the tokens' alone.
    m.apply(decode_batch(_stored_event(tokens, 16, keys=[("salt-of-acme",), None,
                                                         (("img-1", 0),), None]))[1])
    assert sink.blocks == set(ours(tokens, 16, "acme")[:2])
    assert m.num_foreign_blocks == 8 + 2


def test_the_map_follows_the_servers_block_count_and_drops_zero_counts() -> None:
    m, sink = mapper(16)
    seqs = [[s * 1000 + i for i in range(32)] for s in range(4)]
    for s in seqs:
        apply(m, stored_chain(s, 16, 0, 2))
    assert len(m._blocks) == 8
    m.set_engine_blocks(6)  # vLLM's num_gpu_blocks: it cannot cache more
    assert len(m._blocks) == 6 and sink.blocks == set().union(*(ours(s, 16) for s in seqs[1:]))
    # Two copies of one block (vLLM does not deduplicate), then its removals.
    apply(m, stored_chain(seqs[3], 16, 0, 1))
    apply(m, ("removed", [vhash(seqs[3][:16])]))
    assert vhash(seqs[3][:16]) in m._blocks and ours(seqs[3], 16)[0] in sink.blocks
    apply(m, ("removed", [vhash(seqs[3][:16])]))
    assert vhash(seqs[3][:16]) not in m._blocks  # dropped at 0 copies
    assert ours(seqs[3], 16)[0] not in sink.blocks
    apply(m, ("removed", [vhash(s[:32]) for s in seqs[1:]]))
    assert len(m._blocks) == 2 and m.num_held_blocks == 2


def test_suspend_resume_and_clear() -> None:
    tokens = list(range(48))
    m, sink = mapper(16)
    apply(m, stored_chain(tokens, 16, 0, 3))
    m.suspend()
    assert sink.blocks == set()
    apply(m, ("removed", [vhash(tokens[:48])]))  # still followed while suspended
    m.resume()
    assert sink.blocks == set(ours(tokens, 16)[:2])
    apply(m, ("cleared",))
    assert sink.blocks == set() and m.num_held_blocks == 0


def test_chains_reach_a_real_prefix_index() -> None:
    """The sink's calls place every block in the gateway's index (parents first)."""
    tokens = list(range(16 * 8))

    class IndexSink(KVEventSink):
        def __init__(self, index):
            self.index = index

        def stored(self, parent_hash, block_hashes):
            apply_event(self.index, "v1", 1, "store", parent_hash, block_hashes, "test")

        def removed(self, block_hashes):
            apply_event(self.index, "v1", 1, "remove", None, block_hashes, "test")

        def cleared(self):
            apply_event(self.index, "v1", 1, "clear", None, (), "test")

    index = PrefixIndex()
    m = VLLMEventMapper(Hashers(16, FP), IndexSink(index))
    _, evs, _ = decode_batch(encode([stored_chain(tokens, 32, 0, 2),
                                     stored_chain(tokens, 32, 2, 4)]))
    m.apply(evs)
    assert index.match(ours(tokens, 16)).cached_blocks == {"v1": 8}
    _, evs, _ = decode_batch(encode([("removed", [vhash(tokens[:96])])]))
    m.apply(evs)
    assert index.match(ours(tokens, 16)).cached_blocks == {"v1": 4}


# ---------------------------------------------------------------- property test

# Sequences share prefixes (a tiny vocabulary, common stems) like conversations do.
_ops = st.lists(st.tuples(st.sampled_from(["store", "store", "remove", "clear"]),
                          st.integers(0, 5), st.integers(0, 7), st.integers(1, 7)),
                max_size=40)


@settings(max_examples=150, deadline=None)
@given(vbs=st.sampled_from([2, 3, 4, 6]), gbs=st.sampled_from([2, 3, 4, 5]),
       stems=st.lists(st.lists(st.integers(0, 2), min_size=8, max_size=8), min_size=6,
                      max_size=6),
       salts=st.lists(st.sampled_from(["", "a"]), min_size=6, max_size=6), ops=_ops)
def test_mapping_matches_a_simple_model(vbs, gbs, stems, salts, ops) -> None:
    """After any sequence of vLLM-consistent events, the gateway blocks the sink believes
    held are exactly those whose every overlapping vLLM block is cached."""
    seqs = [(stems[i % 2][:4] + stems[i]) * 3 for i in range(6)]  # 24 tokens each
    m, sink = mapper(gbs)
    copies: dict[bytes, int] = {}  # the model: vLLM's cached blocks (content -> copies)
    for op, s, a, b in ops:
        tokens, salt = seqs[s], salts[s]
        nblocks = len(tokens) // vbs
        if op == "store":
            # vLLM stores a request's new blocks after the prefix it holds (cached, in use
            # by the request: a parent is never evicted before its child is stored).
            cached = 0
            while cached < nblocks and copies.get(vhash(tokens[:(cached + 1) * vbs], salt)):
                cached += 1
            first = min(a, cached)
            upto = min(nblocks, first + b)
            if first >= upto:
                continue
            apply(m, stored_chain(tokens, vbs, first, upto, salt))
            for i in range(first, upto):
                k = vhash(tokens[:(i + 1) * vbs], salt)
                copies[k] = copies.get(k, 0) + 1
        elif op == "remove":
            i = a % nblocks
            k = vhash(tokens[:(i + 1) * vbs], salt)
            if copies.get(k, 0) > 0:
                apply(m, ("removed", [k]))
                copies[k] -= 1
        else:
            apply(m, ("cleared",))
            copies.clear()
        expected = set()
        for tok, sl in zip(seqs, salts, strict=True):
            for j, h in enumerate(ours(tok, gbs, sl)):
                over = range(j * gbs // vbs, -(-(j + 1) * gbs // vbs))
                if all(copies.get(vhash(tok[:(i + 1) * vbs], sl), 0) > 0 for i in over):
                    expected.add(h)
        assert sink.blocks == expected
        assert {h for h in expected if m.holds(h)} == expected
        assert m.num_held_blocks == len(expected)
        # The map holds what vLLM caches, nothing more (no zero-count entries).
        assert len(m._blocks) == sum(1 for c in copies.values() if c > 0)


def test_a_shared_block_keeps_no_entries_of_forgotten_children() -> None:
    """vLLM 16, gateway 32: each gateway block overlaps two vLLM blocks, so a shared first
    block is told of every child; children the bounded map forgot do not pile up there."""
    m, sink = mapper(32, max_blocks=20)
    root = list(range(16))
    apply(m, stored_chain(root, 16, 0, 1))
    for i in range(500):
        apply(m, stored_chain(root + [1000 + i] * 16, 16, 1, 2))
    assert len(m._dependents[vhash(root)]) < 20
    assert sink.blocks == {ours(root + [1000 + i] * 16, 32)[0] for i in range(500 - 19, 500)}


# ------------------------------------------- what the router predicts against vLLM's hit

class _IndexSink(KVEventSink):
    """A worker's mapped events into a real gateway index, as gateway/feeds.py applies them."""

    def __init__(self, index: PrefixIndex, worker_id: str) -> None:
        self.index, self.worker_id = index, worker_id

    def stored(self, parent_hash, block_hashes):
        apply_event(self.index, self.worker_id, 1, "store", parent_hash, block_hashes, "test")

    def removed(self, block_hashes):
        apply_event(self.index, self.worker_id, 1, "remove", None, block_hashes, "test")

    def cleared(self):
        apply_event(self.index, self.worker_id, 1, "clear", None, (), "test")


def _vllm_hit(cached: set[bytes], prompt: list[int], vbs: int) -> int:
    """vLLM's cached_tokens for `prompt`: its leading whole blocks in the cache, never the
    block holding the last prompt token (vLLM's find_longest_cache_hit over num_tokens - 1)."""
    k = 0
    while k < (len(prompt) - 1) // vbs and vhash(prompt[:(k + 1) * vbs]) in cached:
        k += 1
    return k * vbs


def _predicted(cached_seqs: list[list[int]], prompts: list[list[int]], vbs: int, gbs: int
               ) -> list[tuple[int, int]]:
    """(router's predicted cached tokens, vLLM's hit) per prompt, for a vLLM worker that
    cached `cached_seqs` (their whole blocks) with the gateway's blocks of `gbs` tokens."""
    index = PrefixIndex()
    m = VLLMEventMapper(Hashers(gbs, FP), _IndexSink(index, "v1"))
    vllm_cache: set[bytes] = set()
    for seq in cached_seqs:
        n = len(seq) // vbs
        if n:
            m.apply(decode_batch(encode([stored_chain(seq, vbs, 0, n)]))[1])
            vllm_cache.update(vhash(seq[:(i + 1) * vbs]) for i in range(n))
    router = Router(RoutingConfig(), index)
    worker = LoadSnapshot("v1", reuse_block_tokens=m.engine_block_size)
    hasher = BlockHasher(gbs, FP)
    return [(router.decide([worker], make_turn(p, hasher)).cached_tokens_of("v1"),
             _vllm_hit(vllm_cache, p, vbs)) for p in prompts]


def test_a_match_inside_a_vllm_block_is_not_predicted() -> None:
    """vLLM at 32 tokens a block, the gateway at 16: a new conversation sharing one gateway
    block (a chat template's system prompt) with a cached one finds nothing at vLLM, and
    the router predicts nothing; longer matches are predicted in whole vLLM blocks."""
    system = list(range(1000, 1016))
    chat = system + list(range(2000, 2080))  # 96 tokens: three vLLM blocks cached
    new = system + list(range(3000, 3050))
    later = chat[:80] + list(range(4000, 4030))  # 80 shared: five gateway blocks, 2.5 vLLM
    assert _predicted([chat], [new, later, chat, chat + [1]], 32, 16) == [
        (0, 0), (64, 64), (64, 64), (96, 96)]


@settings(max_examples=60, deadline=None)
@given(sizes=st.sampled_from([(4, 2), (8, 2), (8, 4), (6, 3), (4, 4)]),
       stems=st.lists(st.lists(st.integers(0, 2), min_size=4, max_size=30), min_size=2,
                      max_size=6))
def test_router_predicts_vllms_own_hit(sizes: tuple[int, int], stems: list[list[int]]) -> None:
    """For any vLLM block size that is a multiple of the gateway's, the router's predicted
    cached tokens at a vLLM worker equal vLLM's hit, prompt for prompt."""
    vbs, gbs = sizes
    cached, prompts = stems[: len(stems) // 2], stems[len(stems) // 2:]
    for predicted, hit in _predicted(cached, prompts + cached, vbs, gbs):
        assert predicted == hit
