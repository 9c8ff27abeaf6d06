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
  int8      weight-only int8: every nn.Linear (projections, MLP, LM head) keeps its
            weight as int8 with one bfloat16 scale per output channel (symmetric, round to
            nearest); activations, norms, RoPE, attention and (by default) KV are bfloat16.
            CPU only. Why: decode at batch 1 streams every weight once per token, and int8
            moves half of bfloat16's bytes. Up to 16 rows (64 for the LM head: decode
            batches) multiply through torch's own int8 weight-only kernel
            (aten._weight_int8pack_mm, the one torchao and gpt-fast use on CPUs); longer
            inputs (prefill chunks) through a bfloat16 matmul on the dequantized weight,
            which is faster there and costs one dequantization per chunk. Rejected, as
            measured on SmolLM2: torch.ao's dynamic int8 linears (activations quantized
            per tensor: mean KL 1.5 nats against float32, outlier activations swamp the
            scale) and torchao's int8 configs (50-100x slower in eager mode here: they are
            written for torch.compile).
A model loaded with `weights` carries `kv_cache_dtype` (a torch.dtype): the KV pool's
element type (`model_runner.pool_config_for` reads it; without it, the model's dtype).
"""

from __future__ import annotations

import logging
import time
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
    "auto" for the compute dtype (bfloat16 under int8)."""

    weights: str = "float32"
    kv_dtype: str = "auto"  # "auto": the compute dtype

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
        if self.weights == "auto":
            raise ValueError("resolve 'auto' weights for a device first (resolved())")
        return torch.bfloat16 if self.weights == "int8" else getattr(torch, self.weights)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return self.compute_dtype if self.kv_dtype == "auto" else getattr(torch, self.kv_dtype)


def default_weights(device: str) -> str:
    """The fastest format whose quality holds on that device (docs/benchmarks.md, weight
    formats): float32 on the CPU (int8 misses the quality bar, top-1 agreement 0.956 <
    0.97; bfloat16 holds but runs no faster there in eager mode), bfloat16 on GPUs."""
    return "float32" if torch.device(device).type == "cpu" else "bfloat16"


def load_model(spec: ModelSpec, dtype: torch.dtype = torch.float32, device: str = "cpu",
               weights: WeightsConfig | None = None) -> torch.nn.Module:
    """Materialise (once) and load the model; returns it in eval mode on `device`, in
    `dtype`, or in the format `weights` names (which then decides the dtype)."""
    materialize_weights(spec)
    if weights is not None:
        weights = weights.resolved(device)
        dtype = weights.compute_dtype
    int8 = weights is not None and weights.weights == "int8"
    # int8 scales come from the float32 weights, not from rounded bfloat16 ones.
    model = AutoModelForCausalLM.from_pretrained(str(spec.model_dir),
                                                 dtype=torch.float32 if int8 else dtype)
    model = model.to(device).eval()
    if int8:
        model = quantize_int8(model).to(dtype)  # .to leaves the int8 buffers as they are
    if weights is not None:
        model.kv_cache_dtype = weights.kv_torch_dtype
    return model


# Rows up to which the int8 kernel beats dequantize + bfloat16 matmul. Measured here (one
# thread): the kernel's cost grows with rows (a pass over the weight per row), the other
# path's is one dequantization plus a matmul. A 1536x576 layer: 16 rows 399 vs 489 us,
# 32 rows 786 vs 635 us. The LM head (49152x576), whose dequantized copy does not stay in
# cache: 32 rows 50 vs 85 ms, 64 rows even, 128 rows 200 vs 108 ms.
INT8_KERNEL_MAX_ROWS = 16
INT8_KERNEL_MAX_ROWS_LARGE = 64  # for weights of more than LARGE_WEIGHT_ELEMENTS
LARGE_WEIGHT_ELEMENTS = 8 << 20


class Int8Linear(torch.nn.Module):
    """A linear layer with an int8 weight [out, in] and a per-output-channel scale [out]
    (bfloat16), computing x @ (weight * scale).T in x's dtype (bfloat16)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127)
                             .to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.bias = None if linear.bias is None else torch.nn.Parameter(
            linear.bias.detach().to(torch.bfloat16), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.max_kernel_rows = INT8_KERNEL_MAX_ROWS_LARGE if w.numel() > LARGE_WEIGHT_ELEMENTS \
            else INT8_KERNEL_MAX_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= self.max_kernel_rows:
            if rows.dtype != torch.bfloat16:
                rows = rows.to(torch.bfloat16)
            y = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scale)
        else:
            y = torch.nn.functional.linear(rows, self.weight_int8.to(rows.dtype)
                                           * self.scale.to(rows.dtype)[:, None])
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Every nn.Linear of a CPU `model` -> Int8Linear, in place (tied weights stay tied
    where they are not linear: the input embedding keeps its bfloat16 table); returns
    the model."""
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 weights run on the CPU only (aten._weight_int8pack_mm); "
                         "use --weights bfloat16 on a GPU")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, Int8Linear(child))
    return model
