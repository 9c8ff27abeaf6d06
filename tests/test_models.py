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
            "import prefixgate.worker.events; import prefixgate.model.overflow; "
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
