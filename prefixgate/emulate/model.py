"""The model an emulated fleet serves: a real tokenizer with a context long enough for
token traces (Mooncake prompts reach 190k tokens), and no weights.

Contract: `emulation_model_dir(base, max_context_tokens, cache_dir)` writes (once; safe
under concurrency) a checkpoint directory holding `base`'s tokenizer and chat template,
its config with `max_position_embeddings = max_context_tokens`, and an empty
`model.safetensors`, and returns its path. Gateways and emulated workers given that path
as `--model` resolve the same fingerprint (so they pair, and block hashes agree); a real
worker refuses it (no weights). Torch-free.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from prefixgate.model.catalog import default_cache_dir, locked, resolve_model, write_atomic

# An empty safetensors file: an 8-byte little-endian header length, then the JSON header.
_EMPTY_SAFETENSORS = (2).to_bytes(8, "little") + b"{}"


def emulation_model_dir(base: str = "smollm2-135m", max_context_tokens: int = 1 << 18,
                        cache_dir: Path | None = None) -> Path:
    cache_dir = cache_dir or default_cache_dir()
    spec = resolve_model(base, cache_dir)
    out = cache_dir / "models" / f"emulated-{spec.fingerprint[:16]}-ctx{max_context_tokens}"
    with locked(out):
        if not (out / "config.json").is_file():
            out.mkdir(parents=True, exist_ok=True)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(spec.model_dir / name, out / name)
            write_atomic(out / "model.safetensors", _EMPTY_SAFETENSORS)
            config = json.loads((spec.model_dir / "config.json").read_text())
            config["max_position_embeddings"] = max_context_tokens
            write_atomic(out / "config.json", json.dumps(config, indent=1).encode())
    return out
