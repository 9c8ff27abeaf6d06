"""Weight formats (worker/model_loader.WeightsConfig): the options resolve as documented,
int8 replaces every linear layer (and its two matmul paths agree), the KV pool follows
--kv-dtype, and on SmolLM2 the
paged logits of bfloat16 and int8 stay within the stated tolerance of float32's."""

from __future__ import annotations

import pytest
import torch

from prefixgate.worker.kv_pool import KVPool
from prefixgate.worker.model_loader import WeightsConfig, default_weights, load_model
from prefixgate.worker.model_runner import ModelRunner, pool_config_for
from prefixgate.worker.paged_attention import StepMetadata

# The tolerance of a lower-precision format against float32, on the next-token
# distributions of a real chat: mean KL(float32 || format) per position, and the share of
# positions where both pick the same token. The KL bound is the one `prefixgate bench
# worker` holds a default format to (bench/weights.py: KL_MAX); the top-1 bound is looser
# than its TOP1_MIN (0.97 over 384 reply positions) because one short chat's ~100
# positions hold a few near-ties that either side may take.
KL_MAX = 0.05
TOP1_MIN = 0.9


def test_options_resolve() -> None:
    assert default_weights("cpu") == "float32" and default_weights("cuda") == "bfloat16"
    assert WeightsConfig("auto").resolved("cuda") == WeightsConfig("bfloat16")
    assert WeightsConfig("int8").compute_dtype == torch.bfloat16
    assert WeightsConfig("int8").kv_torch_dtype == torch.bfloat16
    assert WeightsConfig("int8", "float32").kv_torch_dtype == torch.float32
    assert WeightsConfig("bfloat16").kv_torch_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown weight format 'int4'"):
        WeightsConfig("int4")
    with pytest.raises(ValueError, match="unknown KV dtype"):
        WeightsConfig("int8", "int8")


def test_int8_replaces_every_linear_and_kv_follows_the_option(tiny_spec) -> None:
    from prefixgate.worker.model_loader import Int8Linear

    model = load_model(tiny_spec, weights=WeightsConfig("int8", kv_dtype="float32"))
    assert not [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert int8 and all(m.weight_int8.dtype == torch.int8 for m in int8)
    assert pool_config_for(model, 16, 4).dtype == torch.float32
    assert pool_config_for(load_model(tiny_spec, weights=WeightsConfig("float32")), 16, 4
                           ).dtype == torch.float32


def test_int8_kernel_and_dequantized_paths_agree() -> None:
    """Decode-sized inputs take the int8 kernel, longer ones a matmul on the dequantized
    weight: the same product either way, and close to the float32 layer's."""
    from prefixgate.worker.model_loader import INT8_KERNEL_MAX_ROWS, Int8Linear

    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True)
    layer = Int8Linear(linear)
    x = torch.randn(INT8_KERNEL_MAX_ROWS + 3, 64, generator=g).to(torch.bfloat16)
    long_rows = layer(x)
    short_rows = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
    torch.testing.assert_close(short_rows, long_rows, atol=2e-2, rtol=2e-2)
    with torch.no_grad():
        torch.testing.assert_close(long_rows.float(), linear(x.float()), atol=5e-2, rtol=5e-2)


def _paged_logits(model, ids: list[int]) -> torch.Tensor:
    """Every position's next-token logits, through the worker's paged path with the
    sequence's blocks scattered over the pool."""
    bs = 16
    n = -(-len(ids) // bs)
    pool = KVPool(pool_config_for(model, bs, 2 * n + 1))
    table = torch.randperm(2 * n + 1, generator=torch.Generator().manual_seed(0))[:n].tolist()
    step = StepMetadata.build(pool, [table], [len(ids)], [len(ids)])
    return ModelRunner(model, pool).forward(ids, list(range(len(ids))), step,
                                            list(range(len(ids))))


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_paged_logits_within_tolerance_of_float32(fmt, smollm2_spec, smollm2_model) -> None:
    from prefixgate.model.tokenizer import ChatTokenizer

    tok = ChatTokenizer(smollm2_spec)
    ids = tok.encode_messages([
        ("user", "What is the capital of France, and why is it famous?"),
        ("assistant", "The capital of France is Paris. It is famous for the Eiffel Tower, "
                      "the Louvre museum, its cafes and its long history as a centre of "
                      "art, fashion and science."),
        ("user", "Name three other large cities in France."),
    ])
    # The float32 reference runs the same paged path (itself checked against transformers
    # to 1e-4 in test_paged_attention.py): the session's model is switched to paged
    # attention by whichever engine test ran first, so a plain forward is not available.
    want = torch.log_softmax(_paged_logits(smollm2_model, ids), -1)
    model = load_model(smollm2_spec, weights=WeightsConfig(fmt))
    got = torch.log_softmax(_paged_logits(model, ids), -1)
    kl = (want.exp() * (want - got)).sum(-1)
    top1 = (want.argmax(-1) == got.argmax(-1)).float().mean()
    assert float(kl.mean()) <= KL_MAX, f"{fmt}: mean KL {float(kl.mean()):.4f}"
    assert float(top1) >= TOP1_MIN, f"{fmt}: top-1 agreement {float(top1):.3f}"


def _tied_checkpoint(tmp_path, tiny_spec):
    """tiny-random's files with tied embeddings, and a seeded model of that config."""
    import json
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from prefixgate.model.catalog import ModelSpec

    d = tmp_path / "tied"
    shutil.copytree(tiny_spec.model_dir, d, ignore=shutil.ignore_patterns("*.lock", "*.safetensors"))
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(str(d))).eval()
    spec = ModelSpec(name="tied", model_dir=d, fingerprint="f", max_context_tokens=2048,
                     source="tiny-random")
    return spec, model


def _names(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def _same_logits(spec, model) -> None:
    ids = torch.tensor([[5, 77, 130, 9, 260]])
    with torch.no_grad():
        expected = model(ids).logits
        got = load_model(spec)(ids).logits
    assert torch.equal(got, expected)


def test_tied_embedding_is_stored_under_the_input_name(tmp_path, tiny_spec) -> None:
    """The checkpoint holds a tied embedding once, as model.embed_tokens.weight (what
    engines that load checkpoints themselves read, vLLM among them), and loads back to
    the same logits."""
    from prefixgate.worker.model_loader import save_checkpoint

    spec, model = _tied_checkpoint(tmp_path, tiny_spec)
    save_checkpoint(model, spec.weights_path)
    names = _names(spec.weights_path)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    _same_logits(spec, model)


def test_a_file_of_the_earlier_layout_is_rewritten_once(tmp_path, tiny_spec) -> None:
    """A file that holds the tied embedding only as lm_head.weight (safetensors'
    save_model) is rewritten in place by materialize_weights, without a new model."""
    from safetensors.torch import save_model

    from prefixgate.worker.model_loader import materialize_weights

    spec, model = _tied_checkpoint(tmp_path, tiny_spec)
    save_model(model, str(spec.weights_path))
    assert "model.embed_tokens.weight" not in _names(spec.weights_path)
    materialize_weights(spec)
    names = _names(spec.weights_path)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    _same_logits(spec, model)
