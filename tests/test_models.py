"""Model resolution, fingerprints and tokenization."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prefixgate.model.catalog import ModelError, resolve_model
from prefixgate.model.tokenizer import ChatTokenizer


def test_tiny_random_is_deterministic(tmp_path, tiny_spec) -> None:
    again = resolve_model("tiny-random", tmp_path)
    assert again.fingerprint == tiny_spec.fingerprint
    assert again.max_context_tokens == 2048


def test_unknown_model_says_what_to_use() -> None:
    with pytest.raises(ModelError, match="smollm2-135m, tiny-random"):
        resolve_model("gpt-17")


def test_checkpoint_dir_needs_its_files(tmp_path) -> None:
    with pytest.raises(ModelError, match="missing config.json"):
        resolve_model(str(tmp_path))


def test_checkpoint_dir_round_trip(tmp_path, tiny_spec, tiny_model) -> None:
    """A local checkpoint directory (here: tiny-random's files) resolves and fingerprints
    by content; different weights give a different fingerprint."""
    import os
    import shutil

    d, cache = tmp_path / "ckpt", tmp_path / "cache"
    shutil.copytree(tiny_spec.model_dir, d, ignore=shutil.ignore_patterns("*.lock"))
    a = resolve_model(str(d), cache)
    assert a.source == "hf-dir" and a.fingerprint == resolve_model(str(d), cache).fingerprint
    assert len(list((cache / "digests").iterdir())) == 1  # weights read once, then remembered
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x01")
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as a real rewrite would
    assert resolve_model(str(d), cache).fingerprint != a.fingerprint


def test_gateway_side_never_imports_torch(tiny_spec) -> None:
    code = ("import sys; from prefixgate.model.catalog import resolve_model; "
            "from prefixgate.model.tokenizer import ChatTokenizer; import prefixgate.gateway.server; "
            "import prefixgate.cli; import prefixgate.radix; "
            "import prefixgate.gateway.redis_feed, prefixgate.gateway.feeds, prefixgate.registry; "
            "import prefixgate.workerapi.events; import prefixgate.model.overflow; "
            "import prefixgate.engines.vllm, prefixgate.workerapi.client; "
            "import prefixgate.replay.simulate, prefixgate.replay.targets, prefixgate.replay.report; "
            f"ChatTokenizer(resolve_model('tiny-random', __import__('pathlib').Path({str(tiny_spec.model_dir.parent.parent)!r})))"
            ".encode_messages([('user', 'hi')]); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers_gguf(smollm2_spec) -> None:
    """Our torch-free GGUF tokenizer equals transformers' own GGUF conversion."""
    from transformers import AutoTokenizer

    assert smollm2_spec.gguf_path is not None
    ref = AutoTokenizer.from_pretrained(str(smollm2_spec.gguf_path.parent),
                                        gguf_file=smollm2_spec.gguf_path.name)
    ours = ChatTokenizer(smollm2_spec)
    messages = [("system", "Be brief."), ("user", "In 2024, 12345 people said 'héllo' 🤖!"),
                ("assistant", "Numbers: 3.14159 and  spaces\t\ttabs"), ("user", "Why?")]
    expected = ref.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.encode_messages(messages) == list(expected)
    assert smollm2_spec.max_context_tokens == 8192


def test_generation_defaults_come_from_generation_config(tmp_path, tiny_spec, tiny_model) -> None:
    """A checkpoint's generation_config.json gives the sampling defaults (not the
    fingerprint); a model without one has none; a bad value is a clear error."""
    import json
    import shutil

    from prefixgate.model.catalog import GenerationDefaults

    assert tiny_spec.generation == GenerationDefaults()
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_spec.model_dir, d, ignore=shutil.ignore_patterns("*.lock"))
    plain = resolve_model(str(d), tmp_path)
    (d / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "bos_token_id": 1}))
    spec = resolve_model(str(d), tmp_path)
    assert spec.generation == GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert spec.fingerprint == plain.fingerprint
    (d / "generation_config.json").write_text(json.dumps({"top_p": 2}))
    with pytest.raises(ModelError, match="top_p is 2"):
        resolve_model(str(d), tmp_path)


def test_unset_sampling_fields_take_the_models_defaults() -> None:
    from prefixgate.model.catalog import GenerationDefaults
    from prefixgate.v1 import common_pb2
    from prefixgate.wire.protocol import sampling_from_proto, with_generation_defaults

    defaults = GenerationDefaults(temperature=0.2, top_p=0.9)
    unset = common_pb2.SamplingParams(max_tokens=4)
    filled = sampling_from_proto(with_generation_defaults(unset, defaults), 10, 100)
    assert (filled.temperature, filled.top_p, filled.top_k) == pytest.approx((0.2, 0.9, 0))
    assert not unset.HasField("temperature")  # the request itself is left as it was
    # A value the request sets wins, 0 (greedy) included.
    greedy = common_pb2.SamplingParams(temperature=0, top_p=0.5, top_k=3)
    mine = sampling_from_proto(with_generation_defaults(greedy, defaults), 10, 100)
    assert (mine.temperature, mine.top_p, mine.top_k) == pytest.approx((0, 0.5, 3))
    # A model with no defaults: the proto's meaning (greedy).
    assert sampling_from_proto(with_generation_defaults(unset, GenerationDefaults()),
                               10, 100).temperature == 0


def test_smollm2_ships_its_recommended_sampling(smollm2_spec) -> None:
    assert (smollm2_spec.generation.temperature, smollm2_spec.generation.top_p) == (0.2, 0.9)
