"""Load a resolved model's weights into a transformers model (torch).

Contract: `load_model(spec, dtype, device, weights)` returns an eval-mode causal LM on the
CPU (or the given device) whose weights come from `spec.weights_path`. The first call for
a model materialises that file once, under the model directory's lock:
  gguf         dequantize the GGUF tensors with transformers' GGUF loader (20-70 s here),
  tiny-random  initialise with a fixed seed,
and later starts load the safetensors file in seconds. Every worker of one model thus
loads bit-identical weights, which is what makes their fingerprints comparable.

Weight formats (`WeightsConfig`, the worker's `--weights` / `--kv-dtype`):
  float32   the reference; every other format is measured against it
            (`prefixgate bench worker`, fidelity).
  bfloat16 / float16
            weights, activations and (by default) KV in that dtype.
  int8      every nn.Linear (projections, MLP, LM head) becomes torch.ao's dynamic int8
            linear: weights int8 with one scale per output channel, activations quantized
            per call (per tensor) and multiplied by fbgemm's int8 kernels; everything else
            (embeddings, norms, RoPE, attention, KV) stays float32. CPU only. Why: decode
            at batch 1 streams every weight once per token, and int8 moves a quarter of
            float32's bytes; torchao's int8 configs run 50-100x slower than this in eager
            mode on this CPU (they are written for torch.compile), so torch's own kernels
            are used. Because activations are quantized per call, an int8 step is not
            batch-invariant: a token's logits may differ in the last bits with the rest of
            the step's batch (float formats are unaffected).
A model loaded with `weights` carries `kv_cache_dtype` (a torch.dtype): the KV pool's
element type (`model_runner.pool_config_for` reads it; without it, the model's dtype).
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass

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


WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8")
KV_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class WeightsConfig:
    """How a worker holds its model. `weights`: one of WEIGHT_FORMATS (or "auto": the
    default for the device, `default_weights`); `kv_dtype`: the KV pool's element type,
    "auto" for the compute dtype (float32 under int8)."""

    weights: str = "float32"
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.weights not in (*WEIGHT_FORMATS, "auto"):
            raise ValueError(f"unknown weight format {self.weights!r} "
                             f"(choose from {', '.join(WEIGHT_FORMATS)})")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown KV dtype {self.kv_dtype!r} "
                             f"(choose from {', '.join(KV_DTYPES)})")

    def resolved(self, device: str) -> WeightsConfig:
        """This config with "auto" weights replaced by the device's default."""
        if self.weights != "auto":
            return self
        return WeightsConfig(default_weights(device), self.kv_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of activations and of the weights left unquantized."""
        return torch.float32 if self.weights in ("int8", "auto") else getattr(torch, self.weights)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return self.compute_dtype if self.kv_dtype == "auto" else getattr(torch, self.kv_dtype)


def default_weights(device: str) -> str:
    """The fastest format whose quality holds on that device (docs/benchmarks.md,
    fidelity): int8 on the CPU, bfloat16 on GPUs."""
    return "int8" if torch.device(device).type == "cpu" else "bfloat16"


def load_model(spec: ModelSpec, dtype: torch.dtype = torch.float32, device: str = "cpu",
               weights: WeightsConfig | None = None) -> torch.nn.Module:
    """Materialise (once) and load the model; returns it in eval mode on `device`, in
    `dtype`, or in the format `weights` names (which then decides the dtype)."""
    materialize_weights(spec)
    if weights is not None:
        weights = weights.resolved(device)
        dtype = weights.compute_dtype
    model = AutoModelForCausalLM.from_pretrained(str(spec.model_dir), dtype=dtype)
    model = model.to(device).eval()
    if weights is not None:
        if weights.weights == "int8":
            model = quantize_int8(model)
        model.kv_cache_dtype = weights.kv_torch_dtype
    return model


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Every nn.Linear of a CPU float32 `model` -> torch.ao's dynamic int8 linear (weights
    per output channel, symmetric), in place; returns the model."""
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 weights run on the CPU only (torch.ao's fbgemm kernels); "
                         "use --weights bfloat16 on a GPU")
    with warnings.catch_warnings():
        # torch.ao's eager quantization warns that it moves to torchao; see the module
        # docstring for why it is still the one used here.
        warnings.simplefilter("ignore")
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        return quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig},
                                dtype=torch.qint8, inplace=True)
