"""RoPE re-rotation of cached keys: every layout against an independent reference, model
rope types (which are pure rotations, which are refused), and the Triton kernel under the
interpreter against the torch path."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from prefixgate.worker.kv_pool import KVPool, KVPoolConfig
from prefixgate.worker.reindex import (
    RopeSpec,
    UnsupportedRope,
    reindex_slots,
    rope_spec_or_none,
)

HEADS, HEAD_DIM, LAYERS, BS = 2, 16, 3, 4


def _inv_freq(rotary_dim: int, base: float = 10000.0) -> tuple[float, ...]:
    return tuple((1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64)
                                  / rotary_dim)).tolist())


def _rope_reference(x: torch.Tensor, pos: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate x [N, H, D] (unrotated) to positions `pos` [N], written independently of
    reindex.py: complex multiplication of the rotated pairs, float64."""
    r = spec.rotary_dim
    inv = torch.tensor(spec.inv_freq, dtype=torch.float64)
    phase = torch.polar(torch.ones(len(pos), r // 2, dtype=torch.float64),
                        pos.double()[:, None] * inv[None, :])[:, None, :]
    x = x.double()
    rot, rest = x[..., :r], x[..., r:]
    if spec.interleaved:
        z = torch.view_as_complex(rot.reshape(*rot.shape[:-1], r // 2, 2).contiguous()) * phase
        out = torch.view_as_real(z).reshape(rot.shape)
    else:
        z = torch.complex(rot[..., :r // 2], rot[..., r // 2:]) * phase
        out = torch.cat([z.real, z.imag], dim=-1)
    return torch.cat([out, rest], dim=-1)


def _pool(dtype: torch.dtype, num_blocks: int = 16) -> KVPool:
    return KVPool(KVPoolConfig(LAYERS, HEADS, HEAD_DIM, BS, num_blocks, dtype=dtype))


LAYOUTS = [(False, HEAD_DIM), (True, HEAD_DIM), (False, HEAD_DIM // 2), (True, HEAD_DIM // 4)]


def _fill(pool: KVPool, spec: RopeSpec, slots: torch.Tensor, pos: torch.Tensor,
          gen: torch.Generator) -> torch.Tensor:
    """Store random keys rotated to `pos` at `slots` of every layer; returns the raw keys."""
    raw = torch.randn(LAYERS, len(slots), HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
    for layer in range(LAYERS):
        pool.k[layer, slots] = _rope_reference(raw[layer], pos, spec).to(pool.k.dtype)
        pool.v[layer, slots] = torch.randn(len(slots), HEADS, HEAD_DIM, generator=gen).to(pool.v.dtype)
    return raw


@pytest.mark.parametrize("interleaved,rotary_dim", LAYOUTS)
def test_shift_matches_rotation_at_the_new_position(interleaved: bool, rotary_dim: int) -> None:
    spec = RopeSpec(_inv_freq(rotary_dim), HEAD_DIM, interleaved)
    gen = torch.Generator().manual_seed(rotary_dim + interleaved)
    pool = _pool(torch.float32)
    src = torch.arange(5, 22)  # not block aligned
    dst = torch.arange(40, 57)
    pos = torch.arange(1000, 1017) + torch.randint(0, 3000, (1,), generator=gen)
    delta = torch.randint(0, 900, (len(src),), generator=gen)  # per-token shifts
    raw = _fill(pool, spec, src, pos, gen)
    v_before = pool.v[:, src].clone()
    k_src_before = pool.k[:, src].clone()
    reindex_slots(pool, src, dst, delta, spec, backend="torch")
    for layer in range(LAYERS):
        want = _rope_reference(raw[layer], pos - delta, spec).float()
        torch.testing.assert_close(pool.k[layer, dst], want, atol=2e-5, rtol=1e-5)
    assert torch.equal(pool.v[:, dst], v_before)
    assert torch.equal(pool.k[:, src], k_src_before)  # the source is left as it was
    if rotary_dim < HEAD_DIM:  # dims past the rotary part are copied bit for bit
        assert torch.equal(pool.k[:, dst, :, rotary_dim:], k_src_before[..., rotary_dim:])


def test_rotate_half_matches_transformers() -> None:
    """Keys rotated by transformers' own apply_rotary_pos_emb at p, moved back by d, equal
    its keys at p - d."""
    spec = RopeSpec(_inv_freq(HEAD_DIM), HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    inv = torch.tensor(spec.inv_freq, dtype=torch.float32)

    def hf_rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x [N, H, D]
        freqs = pos.float()[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        k = x.transpose(0, 1)[None]  # [1, H, N, D]
        _, out = apply_rotary_pos_emb(k, k, emb.cos()[None], emb.sin()[None])
        return out[0].transpose(0, 1)

    pool = _pool(torch.float32)
    raw = torch.randn(12, HEADS, HEAD_DIM, generator=gen)
    pos = torch.arange(500, 512)
    src, dst = torch.arange(12), torch.arange(20, 32)
    for layer in range(LAYERS):
        pool.k[layer, src] = hf_rotate(raw, pos)
    reindex_slots(pool, src, dst, torch.full((12,), 137), spec, backend="torch")
    torch.testing.assert_close(pool.k[1, dst], hf_rotate(raw, pos - 137), atol=1e-4, rtol=1e-4)


def _llama(rope_parameters: dict) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, rope_parameters=rope_parameters)
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_model_rope_types_are_pure_rotations(params: dict) -> None:
    """From the model's inv_freq; keys stored with the model's own cos/sin (YaRN's
    attention scaling included) move to the model's keys at the new position: the scaling
    is applied once, not twice."""
    model = _llama(params)
    spec = RopeSpec.from_model(model)
    rotary = model.model.rotary_emb
    assert spec.inv_freq == tuple(rotary.inv_freq.double().tolist())
    if params["rope_type"] == "yarn":
        assert rotary.attention_scaling != 1.0
    head_dim = spec.head_dim
    x = torch.randn(1, 1, 10, head_dim)

    def stored(pos: torch.Tensor) -> torch.Tensor:  # [10, 1, D] as the pool holds them
        cos, sin = rotary(x, pos[None])
        _, k = apply_rotary_pos_emb(x, x, cos, sin)
        return k[0].transpose(0, 1)

    pool = KVPool(KVPoolConfig(1, 1, head_dim, BS, 8))
    pos = torch.arange(200, 210)
    pool.k[0, :10] = stored(pos)
    reindex_slots(pool, torch.arange(10), torch.arange(16, 26), torch.full((10,), 150), spec)
    torch.testing.assert_close(pool.k[0, 16:26], stored(pos - 150), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("params", [
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
     "long_factor": [2.0] * 8, "original_max_position_embeddings": 64},
])
def test_length_dependent_rope_is_refused(params: dict, caplog: pytest.LogCaptureFixture) -> None:
    model = _llama(params)
    with pytest.raises(UnsupportedRope, match=params["rope_type"]):
        RopeSpec.from_model(model)
    assert rope_spec_or_none(model) is None
    assert params["rope_type"] in caplog.text


def test_model_without_rotary_embedding_is_refused() -> None:
    model = torch.nn.Linear(2, 2)
    model.config = LlamaConfig(hidden_size=32, num_attention_heads=2)
    with pytest.raises(UnsupportedRope, match="no rotary"):
        RopeSpec.from_model(model)


def test_bad_arguments() -> None:
    spec = RopeSpec(_inv_freq(HEAD_DIM), HEAD_DIM)
    pool = _pool(torch.float32)
    with pytest.raises(ValueError, match="same length"):
        reindex_slots(pool, torch.arange(3), torch.arange(2), torch.zeros(3, dtype=torch.long), spec)
    with pytest.raises(ValueError, match="backend"):
        reindex_slots(pool, torch.arange(3), torch.arange(4, 7), torch.zeros(3, dtype=torch.long),
                      spec, backend="cuda")
    with pytest.raises(ValueError, match="do not fit"):
        RopeSpec(_inv_freq(2 * HEAD_DIM), HEAD_DIM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved,rotary_dim", LAYOUTS)
def test_triton_kernel_matches_torch(dtype: torch.dtype, interleaved: bool, rotary_dim: int) -> None:
    pytest.importorskip("triton")
    spec = RopeSpec(_inv_freq(rotary_dim), HEAD_DIM, interleaved)
    gen = torch.Generator().manual_seed(7)
    pools = [_pool(dtype), _pool(dtype)]
    src = torch.randperm(32, generator=gen)[:11]  # scattered slots in the first 8 blocks
    dst = 32 + torch.randperm(32, generator=gen)[:11]
    delta = torch.randint(0, 5000, (11,), generator=gen)
    pos = delta + torch.randint(0, 3000, (11,), generator=gen)
    _fill(pools[0], spec, src, pos, gen)
    pools[1].k.copy_(pools[0].k)
    pools[1].v.copy_(pools[0].v)
    reindex_slots(pools[0], src, dst, delta, spec, backend="torch")
    reindex_slots(pools[1], src, dst, delta, spec, backend="triton")
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(pools[1].k.float(), pools[0].k.float(), atol=tol, rtol=tol)
    assert torch.equal(pools[1].v, pools[0].v)


def test_bench_smoke(tiny_spec, tiny_model, tmp_path) -> None:
    """`prefixgate bench reindex` on the tiny model and a small synthetic ShareGPT file:
    turns are picked, every mode is measured, recompute is its own baseline (KL 0)."""
    import argparse
    import json

    from prefixgate.bench import reindex as bench
    from prefixgate.model.tokenizer import ChatTokenizer

    conv = [{"from": "human" if i % 2 == 0 else "gpt",
             "value": f"message {i}: " + "words about the sea " * 4} for i in range(10)]
    trace = tmp_path / "chats.jsonl"
    trace.write_text("\n".join(json.dumps({"id": f"c{k}", "conversations": conv})
                               for k in range(2)))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--trace", str(trace), "--conversations", "2",
                              "--blend-tokens", "8", "--kernel-tokens", "32",
                              "--kernel-repeats", "1"])
    quality = bench._quality(args, tiny_spec, ChatTokenizer(tiny_spec), tiny_model, 500)
    assert len(quality["turns"]) == 2 and all(t["dropped_tokens"] > 0 for t in quality["turns"])
    assert quality["recompute"]["kl_mean"] == 0.0
    assert quality["recompute"]["greedy_match_of_32_mean"] == 32
    assert quality["shift"]["cached_tokens_mean"] > quality["recompute"]["cached_tokens_mean"]
    assert set(bench._target({"500": quality})) == {"500/blend-8"}
    kernel = bench._kernel(args, tiny_model)
    assert kernel["float32"]["torch_gb_s"] > 0
    assert kernel.get("triton_interpreter_max_abs_diff", 0.0) < 1e-4
