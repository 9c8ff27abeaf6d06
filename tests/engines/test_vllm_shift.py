"""Context overflow on vLLM, the parts that run without vLLM: the shift parameters' wire
form, the layouts the adapter names (their chains are the ones the connector's store
keeps), the RoPE read from the model's config against transformers' own, and the
connector's shifted K/V against keys computed at the new positions by transformers'
`apply_rotary_pos_emb` and against prefixgate's own re-index (worker/reindex.py). (A real
vLLM server moving a conversation's kept turns: tests/e2e/test_vllm_overflow.py.)"""

from __future__ import annotations

import random

import pytest
import torch

from prefixgate.model.overflow import (
    layout_hashes,
    plan_overflow,
    salted_parent,
    shift_layouts,
)
from prefixgate.radix import BlockHasher
from prefixgate.vllm_connector.params import ShiftParams, TransferParams
from prefixgate.vllm_connector.shift import choose_layout, rope_of, shifted_kv
from prefixgate.vllm_connector.store import HostStore, Page
from prefixgate.worker.reindex import RopeSpec, UnsupportedRope

TURN = (1, 2)  # opens a user turn
B = 16


def _chat(rnd: random.Random, preamble: int, turns: list[int]) -> list[int]:
    out = [rnd.randrange(10, 1000) for _ in range(preamble)]
    for n in turns:
        out += list(TURN) + [rnd.randrange(10, 1000) for _ in range(n - len(TURN))]
    return out


def test_shift_params_round_trip_and_malformed_ones_are_none() -> None:
    params = TransferParams(16, "fp", (1, 2), shift=ShiftParams(37, ((100, (5, 6, 7)),
                                                                     (0, (8,)))))
    assert TransferParams.from_json(params.to_json()) == params
    doc = params.to_json()
    doc["prefixgate"]["shift"]["layouts"][0]["delta"] = -1
    assert TransferParams.from_json(doc) is None
    doc["prefixgate"]["shift"] = {"n_keep": 3}
    assert TransferParams.from_json(doc) is None


def test_layouts_name_the_chains_earlier_turns_were_kept_under() -> None:
    """The undropped layout's chain is the full prompt's (what the previous, fitting turn
    stored); the current layout's salted chain is what an earlier overflowing turn with the
    same drop stored; salted chains share the preamble's whole blocks and nothing after."""
    rnd = random.Random(1)
    hasher = BlockHasher(B, "fp", "ns")
    full = _chat(rnd, 37, [300, 250, 280, 200])
    plan = plan_overflow(full, 100, 900, TURN)
    assert plan is not None and plan.fits and plan.dropped_tokens > 0
    limit = len(plan.kept) - 1
    layouts = shift_layouts(plan, hasher, limit, 8)
    deltas = [d for d, _ in layouts]
    assert deltas[0] == deltas[1] == plan.dropped_tokens and deltas[-1] == 0
    plain, salted = layouts[0][1], layouts[1][1]
    whole = hasher.hash_blocks(full)
    assert plain == whole[:len(plain)]
    assert len(plain) * B >= limit + plan.dropped_tokens - B  # reaches the kept prompt's end
    gap = plan.n_keep // B
    assert salted[:gap] == whole[:gap] and not set(salted[gap:]) & set(whole)
    assert salted[gap] == hasher.hash_blocks(full[gap * B:(gap + 1) * B],
                                             parent_hash=salted_parent(whole[gap - 1]))[0]
    # What the adapter sends as the shifted prompt's own hashes (kept under in the store)
    # is the delta-0 salted layout of the same drop: the next such turn finds it in place.
    own = layout_hashes(hasher, plan.kept, len(plan.kept) // B, gap, salted=True)
    assert layouts[-1][1] == own[:len(layouts[-1][1])]
    # At most max_layouts layouts: the undropped one and the most recent drops.
    many = plan_overflow(_chat(rnd, 20, [40] * 30), 10, 600, TURN)
    assert many is not None
    few = shift_layouts(many, hasher, len(many.kept) - 1, 3)
    assert [d for d, _ in few[::2]] == [d for _, d in many.layouts()[:1] + many.layouts()[-2:]]


def test_rope_of_the_config_is_transformers_rotation(smollm2_spec) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(smollm2_spec.model_dir))
    rope = rope_of(config)
    model = AutoModelForCausalLM.from_config(config)
    ref = RopeSpec.from_model(model)
    assert (rope.head_dim, rope.interleaved) == (ref.head_dim, False)
    assert torch.allclose(torch.tensor(rope.inv_freq), torch.tensor(ref.inv_freq),
                          rtol=1e-7, atol=0)
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(UnsupportedRope, match="dynamic"):
        rope_of(config)


def _rotated(x: torch.Tensor, pos: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb of x [tokens, heads, dim] at positions `pos`."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inv = torch.tensor(rope.inv_freq, dtype=torch.float64)
    freqs = pos.to(torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[None], emb.sin()[None]  # [1, tokens, dim]
    q = x.to(torch.float64).transpose(0, 1)[None]  # [1, heads, tokens, dim]
    out, _ = apply_rotary_pos_emb(q, q, cos, sin)
    return out[0].transpose(0, 1).to(torch.float32)


def test_shifted_keys_are_the_keys_at_the_new_positions() -> None:
    """Pages of an old layout hold keys rotated at their old positions; the connector's
    shifted K for new positions [start, stop) equals transformers' rotation of the same
    raw keys at the new positions (the preamble at its own), per token, with a gap that
    is not block-aligned; V is copied bit for bit."""
    g = torch.Generator().manual_seed(0)
    layers, heads, dim, n_keep, delta = 2, 3, 64, 37, 123
    rope = RopeSpec(tuple((1.0 / (1e5 ** (torch.arange(0, dim, 2).double() / dim))).tolist()),
                    dim)
    old_tokens = 20 * B
    raw_k = torch.randn(layers, old_tokens, heads, dim, generator=g)
    raw_v = torch.randn(layers, old_tokens, heads, dim, generator=g)
    pos = torch.arange(old_tokens)
    cached = torch.stack([_rotated(raw_k[i], pos, rope) for i in range(layers)])
    pages = [Page("fp", B, cached[:, b * B:(b + 1) * B].clone(), raw_v[:, b * B:(b + 1) * B])
             for b in range(old_tokens // B)]
    start, stop = 32, old_tokens - delta  # new positions; [32, 37) is the preamble's tail
    k, v = shifted_kv(pages, n_keep, delta, start, stop, rope)
    new = torch.arange(start, stop)
    src = torch.where(new < n_keep, new, new + delta)
    want = torch.stack([_rotated(raw_k[i, src], new, rope) for i in range(layers)])
    assert (k - want).abs().max() < 2e-5
    assert torch.equal(v, raw_v[:, src])


def test_shifted_keys_equal_prefixgates_reindex() -> None:
    """The same move through worker/reindex.py's pool path: equal to float32 rounding."""
    from prefixgate.worker.kv_pool import KVPool, KVPoolConfig
    from prefixgate.worker.reindex import reindex_slots_torch

    layers, heads, dim, n_keep, delta = 3, 2, 32, 21, 50
    rope = RopeSpec(tuple((1.0 / (1e4 ** (torch.arange(0, 16, 2).double() / 16))).tolist()),
                    dim, interleaved=True)  # partial rotary, interleaved pairs
    pool = KVPool(KVPoolConfig(num_layers=layers, num_kv_heads=heads, head_dim=dim,
                             block_size=B, num_blocks=16, dtype=torch.float32))
    g = torch.Generator().manual_seed(1)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    old = 8 * B  # slots [0, old) hold the old layout; moved into slots from 8 * B on
    pages = [Page("fp", B, pool.k[:, b * B:(b + 1) * B].clone(),
                  pool.v[:, b * B:(b + 1) * B].clone()) for b in range(old // B)]
    new = torch.arange(0, old - delta)
    src = torch.where(new < n_keep, new, new + delta)
    reindex_slots_torch(pool, src, new + old, torch.where(new < n_keep, 0, delta), rope)
    k, v = shifted_kv(pages, n_keep, delta, 0, old - delta, rope)
    assert (k - pool.k[:, old:2 * old - delta]).abs().max() < 1e-6
    assert torch.equal(v, pool.v[:, old:2 * old - delta])


def test_the_store_layout_reaching_furthest_is_chosen() -> None:
    store = HostStore(64 << 20)
    page = Page("fp", B, torch.zeros(1, B, 1, 2), torch.zeros(1, B, 1, 2))
    far, near = list(range(100, 120)), list(range(200, 220))
    for h in far[:15]:  # reaches new positions < 15 * 16 - 64 = 176
        store.put(h, page)
    for h in near[:10]:  # < 10 * 16 - 0 = 160
        store.put(h, page)
    shift = ShiftParams(40, ((64, tuple(far)), (0, tuple(near))))
    end, delta, pages = choose_layout(lambda c: store.run(c, 0), shift, B, 1000)
    assert (end, delta, len(pages)) == (176, 64, 15)
    assert choose_layout(lambda c: store.run(c, 0), shift, B, 100)[0] == 100  # never past the limit
    assert choose_layout(lambda c: store.run(c, 0), ShiftParams(180, shift.layouts), B,
                         1000) is None


def test_the_scheduler_learns_what_the_export_holds_without_reading_pages() -> None:
    """held_blocks: the export's header count (real gRPC on loopback); 0 for none held,
    None for an export that cannot be asked."""
    import grpc

    from prefixgate.vllm_connector.export import ExportServer, held_blocks
    from prefixgate.wire.rpc import free_port

    store = HostStore(64 << 20)
    chain = list(range(300, 310))
    for h in chain[:6]:
        store.put(h, Page("fp", B, torch.zeros(2, B, 3, 4), torch.zeros(2, B, 3, 4)))
    server = ExportServer(store, "w", "127.0.0.1", free_port(), (2, 3, 4, "float32"))
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            assert held_blocks(channel, chain, 5) == 6
            assert held_blocks(channel, chain[:3], 5) == 3
            assert held_blocks(channel, [1, 2], 5) == 0
            shift = ShiftParams(20, ((32, tuple(chain)), (0, (1, 2, 3))))
            end, delta, _ = choose_layout(lambda c: range(held_blocks(channel, c, 5) or 0),
                                          shift, B, 1000)
            assert (end, delta) == (6 * B - 32, 32)
    finally:
        server.stop()
    with grpc.insecure_channel(f"127.0.0.1:{free_port()}") as channel:
        assert held_blocks(channel, chain, 1) is None


def test_the_adapter_sends_an_overflowing_turn_shifted_or_exact(smollm2_spec) -> None:
    """What the adapter sends vLLM for an overflowing turn: with the connector and a
    shifting mode, the layouts and salted hashes under a cache salt of its own, never
    mapped back to a namespace; `recompute` (or no connector) the kept prompt as any turn."""
    from prefixgate.engines.vllm import VLLMConfig, VLLMWorker
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.workerapi.server import WorkerConfig

    tok = ChatTokenizer(smollm2_spec)
    rnd = random.Random(2)
    messages = [("system", "Be brief.")]
    for _ in range(4):
        messages += [("user", " ".join(str(rnd.randrange(1000)) for _ in range(150))),
                     ("assistant", "Noted.")]
    full = tok.encode_messages(messages + [("user", "Sum them up.")])

    def worker(export: str) -> VLLMWorker:
        return VLLMWorker(smollm2_spec, tok, WorkerConfig("w", block_size=B),
                          VLLMConfig("http://127.0.0.1:1", "tcp://127.0.0.1:2", export=export))

    w = worker("127.0.0.1:3")
    plan = plan_overflow(full, 64, len(full) - 200, w.turn_prefix)
    assert plan is not None and plan.fits and plan.dropped_tokens >= 200
    hasher = w.hashers.get("tenant")
    params, salt = w._overflow_params(plan, "tenant", "shift")
    assert salt and salt != w._salt("tenant") and salt not in w._salts
    assert params.pull is None and params.shift.n_keep == plan.n_keep
    assert params.block_hashes == tuple(layout_hashes(
        hasher, plan.kept, len(plan.kept) // B, plan.n_keep // B, salted=True))
    assert params.shift.layouts[0] == (plan.dropped_tokens, tuple(
        hasher.hash_blocks(full)[:len(params.shift.layouts[0][1])]))
    body = w._body(list(plan.kept), _greedy(), "tenant", params, salt)
    assert body["cache_salt"] == salt and body["kv_transfer_params"]["prefixgate"]["shift"]
    assert w._overflow_params(plan, "tenant", "blend")[1] == salt  # blend runs as shift
    exact, no_salt = w._overflow_params(plan, "tenant", "recompute")
    assert no_salt == "" and exact.shift is None
    assert exact.block_hashes == tuple(hasher.hash_blocks(plan.kept))
    assert worker("")._overflow_params(plan, "tenant", "shift") == (None, "")


def _greedy():
    from prefixgate.wire.protocol import SamplingConfig

    return SamplingConfig(max_tokens=8)


def test_the_benchmarks_top_k_kl_is_a_lower_bound_of_the_full_kl() -> None:
    """bench vllm-overflow's KL over top-k alternatives (the rest lumped): 0 for equal
    distributions, never above the full KL, and near it when the top k hold the mass."""
    import math

    from prefixgate.bench.vllm_overflow import kl_top

    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        p = torch.log_softmax(3 * torch.randn(500, generator=g), -1)
        q = torch.log_softmax(p + 0.3 * torch.randn(500, generator=g), -1)
        full = float((p.exp() * (p - q)).sum())

        def top(x, k=20):
            vals, ids = x.topk(k)
            return dict(zip(ids.tolist(), vals.tolist(), strict=True))

        assert kl_top(top(p), top(p)) == pytest.approx(0, abs=1e-9)
        assert kl_top(top(p), top(q)) <= full + 1e-6
        assert kl_top(top(p, 400), top(q, 400)) == pytest.approx(full, rel=0.05, abs=1e-4)
        assert not math.isnan(kl_top(top(p), top(q)))
