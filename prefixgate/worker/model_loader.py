"""Load a resolved model's weights into a transformers model (torch).

Contract: `load_model(spec, dtype)` returns an eval-mode causal LM on the CPU (or the
given device) whose weights come from `spec.weights_path`. The first call for a model
materialises that file once, under the model directory's lock:
  gguf         dequantize the GGUF tensors with transformers' GGUF loader (20-70 s here),
  tiny-random  initialise with a fixed seed,
and later starts load the safetensors file in seconds. Every worker of one model thus
loads bit-identical weights, which is what makes their fingerprints comparable.
"""

from __future__ import annotations

import logging
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from prefixgate.models import TINY_RANDOM_SEED, ModelSpec, locked

log = logging.getLogger(__name__)


def materialize_weights(spec: ModelSpec) -> None:
    """Write `spec.weights_path` if it does not exist yet (no-op for checkpoint dirs)."""
    if spec.source == "hf-dir":
        return
    with locked(spec.model_dir):
        if spec.weights_path.is_file():
            return
        from safetensors.torch import save_model

        start = time.monotonic()
        if spec.source == "gguf":
            assert spec.gguf_path is not None
            log.info("dequantizing %s once into %s (takes 20-70 s; later starts take seconds)",
                     spec.gguf_path.name, spec.model_dir)
            model = AutoModelForCausalLM.from_pretrained(
                str(spec.gguf_path.parent), gguf_file=spec.gguf_path.name, dtype=torch.float32)
        else:
            config = LlamaConfig.from_pretrained(str(spec.model_dir))
            torch.manual_seed(TINY_RANDOM_SEED)
            model = LlamaForCausalLM(config)
        tmp = spec.weights_path.with_suffix(".tmp")
        # save_model (not save_file) handles tied embeddings, which share storage.
        save_model(model, str(tmp))
        tmp.replace(spec.weights_path)
        log.info("materialised %s weights in %.1f s", spec.name, time.monotonic() - start)


def load_model(spec: ModelSpec, dtype: torch.dtype = torch.float32,
               device: str = "cpu") -> torch.nn.Module:
    """Materialise (once) and load the model; returns it in eval mode on `device`."""
    materialize_weights(spec)
    model = AutoModelForCausalLM.from_pretrained(str(spec.model_dir), dtype=dtype)
    return model.to(device).eval()
