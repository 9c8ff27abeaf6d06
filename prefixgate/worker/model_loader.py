"""Load a resolved model's weights into a transformers model (torch).

Contract: `load_model(spec, dtype, device, weights)` returns an eval-mode causal LM on the
CPU (or the given device) whose weights come from `spec.weights_path`. The first call for
a model materialises that file once, under the model directory's lock:
  gguf         dequantize the GGUF tensors with transformers' GGUF loader (20-70 s here),
  tiny-random  initialise with a fixed seed,
and later starts load the safetensors file in seconds. Every worker of one model thus
loads bit-identical weights, which is what makes their fingerprints comparable.
The folder is a Hugging Face checkpoint as other engines read it (vLLM serves it as it
is): a tied output embedding is stored once, under the input embedding's name
(`model.embed_tokens.weight`), as `save_pretrained` does. Engines that load checkpoints
themselves skip `lm_head.weight` when the config ties it, so a file holding only that
name leaves their embedding unset (vLLM then answers every token with logprob
log(1/vocab)). A file written in that layout by an earlier version is rewritten once.

Weight formats (`WeightsConfig`, the worker's `--weights` / `--kv-dtype`):
  float32   the reference; every other format is measured against it
            (`prefixgate bench worker`, fidelity).
  bfloat16 / float16
            weights, activations and (by default) KV in that dtype.
  q4_1      GGUF's blocks of 32 weights: every linear layer Q4_1 (a float16 scale and
            min per block, 4-bit codes), the LM head Q8_0 (a scale per block, 8-bit codes);
            activations, norms, attention and KV float32. CPU only (kernels on an AVX-512
            or an AVX2 + FMA path, whichever the CPU runs: worker/kernels/cpu_quant.py).
            On a model shipped as such a GGUF (SmolLM2) the blocks are recovered exactly
            from the float32 reference (checked at load: `model.quantization_error` ==
            0), so it is lossless against float32 while a decode streams 0.625 bytes per
            weight instead of 4. The CPU default where it is lossless
            (`default_weights`); on any other model it is plain round-to-nearest 4-bit,
            opt-in, and its fidelity is measured like int8's.
  q4_1-a8   q4_1's weights with 8-bit activations, as llama.cpp computes them: every
            product's input rows quantized per block of 32 (int8 codes, a float scale
            max |x| / 127: ggml's Q8_1) and multiplied by integer dot products (AVX2
            maddubs; worker/kernels/cpu_quant.py), about half the instructions per weight
            block of q4_1's float32 activations. Prefill chunks multiply the same
            quantized rows through torch's GEMM. Lossy against float32 (each activation
            moves by up to half its block's step), so an option, measured by the fidelity
            figures like int8's; never what `--weights auto` picks unless it holds the bar.
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

import functools
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from prefixgate.model.catalog import KV_DTYPES, TINY_RANDOM_SEED, WEIGHT_FORMATS, ModelSpec, locked
from prefixgate.worker.kernels import cpu_quant

log = logging.getLogger(__name__)


def materialize_weights(spec: ModelSpec) -> None:
    """Write `spec.weights_path` if it does not exist yet, or put an earlier version's
    file into the layout above (no-op for checkpoint dirs)."""
    if spec.source == "hf-dir":
        return
    with locked(spec.model_dir):
        if spec.weights_path.is_file():
            _store_tied_under_input_name(spec.weights_path)
            return
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
        save_checkpoint(model, spec.weights_path)
        log.info("materialised %s weights in %.1f s", spec.name, time.monotonic() - start)


def save_checkpoint(model: torch.nn.Module, path) -> None:
    """Write `model`'s weights to the safetensors file `path` (atomically) in Hugging
    Face's layout: a tensor shared by several names (tied embeddings) is stored once,
    under the first name in the state dict (the input embedding's, before lm_head)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.contiguous()
    tmp = Path(path).with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)


def _store_tied_under_input_name(path: Path) -> None:
    """Rewrite a file that holds a tied embedding only as `lm_head.weight` (safetensors'
    save_model, used by earlier versions, kept that name) under the input embedding's name;
    a no-op for any other file. Takes a second: no dequantization."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), "pt") as f:
        names = set(f.keys())
    if "lm_head.weight" not in names or "model.embed_tokens.weight" in names:
        return
    config = json.loads((path.parent / "config.json").read_text())
    if not config.get("tie_word_embeddings", False):
        return
    tensors = load_file(str(path))
    tensors["model.embed_tokens.weight"] = tensors.pop("lm_head.weight")
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)
    log.info("%s: tied embedding stored under model.embed_tokens.weight", path)


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

    def resolved(self, device: str, spec: ModelSpec | None = None) -> WeightsConfig:
        """This config with "auto" weights replaced by the device's (and model's)
        default."""
        if self.weights != "auto":
            return self
        fmt, why = _default_weights(device, spec)
        log.info("--weights auto: %s (%s)", fmt, why)
        return WeightsConfig(fmt, self.kv_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of activations and of the weights left unquantized."""
        if self.weights == "auto":
            raise ValueError("resolve 'auto' weights for a device first (resolved())")
        if self.weights in ("q4_1", "q4_1-a8"):
            return torch.float32
        return torch.bfloat16 if self.weights == "int8" else getattr(torch, self.weights)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return self.compute_dtype if self.kv_dtype == "auto" else getattr(torch, self.kv_dtype)


def default_weights(device: str, spec: ModelSpec | None = None) -> str:
    """The fastest format whose quality holds on that device (docs/benchmarks.md, weight
    formats). On the CPU: q4_1 when it is lossless for `spec` (a GGUF whose layer weights
    are Q4_1 and whose LM head is Q8_0, as the built-in SmolLM2's: q4_1 then carries
    exactly the float32 reference's values, in a fifth of the bytes) and its kernels build;
    float32 otherwise (bfloat16 holds the quality bar but runs no faster there in eager
    mode; int8 misses it, top-1 agreement 0.956 < 0.97). bfloat16 on GPUs."""
    return _default_weights(device, spec)[0]


def _default_weights(device: str, spec: ModelSpec | None) -> tuple[str, str]:
    """`default_weights` and why (a phrase for the log)."""
    if torch.device(device).type != "cpu":
        return "bfloat16", f"the default on {torch.device(device).type}"
    if spec is None or spec.gguf_path is None or not _gguf_is_q4_1(str(spec.gguf_path)):
        return "float32", "q4_1 is lossless only on a model shipped as a Q4_1 GGUF"
    if not cpu_quant.available():
        return "float32", f"q4_1 kernels unavailable: {cpu_quant.kernel_reason()}"
    return "q4_1", (f"{spec.gguf_path.name} is Q4_1 + Q8_0, lossless; kernels on the "
                    f"{cpu_quant.kernel_path()} path: {cpu_quant.kernel_reason()}")


@functools.lru_cache(maxsize=8)
def _gguf_is_q4_1(path: str) -> bool:
    """Whether every layer matrix of the GGUF at `path` is Q4_1 and its LM head (output,
    else the tied token embedding) Q8_0: the blocks the q4_1 format holds."""
    from gguf import GGUFReader

    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) > 1}
    head = types.get("output.weight", types.get("token_embd.weight"))
    layers = [v for k, v in types.items() if k.startswith("blk.")]
    return head == "Q8_0" and bool(layers) and all(v == "Q4_1" for v in layers)


def load_model(spec: ModelSpec, dtype: torch.dtype = torch.float32, device: str = "cpu",
               weights: WeightsConfig | None = None) -> torch.nn.Module:
    """Materialise (once) and load the model; returns it in eval mode on `device`, in
    `dtype`, or in the format `weights` names (which then decides the dtype)."""
    materialize_weights(spec)
    if weights is not None:
        weights = weights.resolved(device, spec)
        dtype = weights.compute_dtype
    fmt = weights.weights if weights is not None else None
    # int8 scales come from the float32 weights, not from rounded bfloat16 ones.
    model = AutoModelForCausalLM.from_pretrained(
        str(spec.model_dir), dtype=torch.float32 if fmt in ("int8", "q4_1", "q4_1-a8") else dtype)
    model = model.to(device).eval()
    if fmt == "int8":
        model = quantize_int8(model).to(dtype)  # .to leaves the int8 buffers as they are
    elif fmt in ("q4_1", "q4_1-a8"):
        model = quantize_q4_1(model, activations_int8=fmt == "q4_1-a8")
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


# Rows up to which the quantized kernels (worker/kernels/cpu_quant.py) multiply directly;
# longer inputs (prefill chunks) multiply through torch's float32 GEMM on a weight
# dequantized for the call, which costs one pass over the weight and wins once the GEMM's
# blocking beats the kernel's 8-row passes. Measured here (one thread, SmolLM2's
# 1536x576): 32 rows 0.71 ms kernel vs 0.66 ms dense, cache-hot, i.e. even; with the
# weight streamed from memory (a real step) the kernel's 5x fewer bytes decide.
QUANT_KERNEL_MAX_ROWS = 32


class QuantLinear(torch.nn.Module):
    """A bias-free linear layer whose weight [out, in] is held as GGUF-style blocks of 32
    (`kind` "q4_1": scale and min per block, 4-bit codes; "q8_0": scale per block, 8-bit
    codes; layouts in worker/kernels/cpu_quant.py). float32 in, float32 out. `a8`: the
    input rows are quantized to 8 bits per block of 32 first (the q4_1-a8 format;
    `cpu_quant.quantize_activations`), in the kernel's integer products and in the
    prefill path alike, so a token's result does not depend on the path it took."""

    def __init__(self, linear: torch.nn.Linear, kind: str, a8: bool = False) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("quantized linears take no bias (Llama's have none)")
        self.kind, self.a8 = kind, a8
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        pack = cpu_quant.pack_q8_0 if kind == "q8_0" else cpu_quant.pack_q4_1
        self.register_buffer("packed", pack(w))
        # How far the blocks are from the weight they replace (0 on a GGUF model's weights:
        # the blocks it was dequantized from come back exactly).
        deq = cpu_quant.unpack_reference(self.packed, self.in_features, kind == "q8_0")
        self.max_abs_error = float((deq - w).abs().max())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= QUANT_KERNEL_MAX_ROWS:
            fn = _KERNELS[self.kind, self.a8]
            y = fn(rows, self.packed, self.out_features)
        else:
            if self.a8:
                rows = cpu_quant.quantize_activations(rows)
            y = torch.nn.functional.linear(rows.float(), self.dequantized(_scratch(
                self.out_features * self.in_features)))
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    @staticmethod
    def concat(mods: list[QuantLinear]) -> QuantLinear:
        """One QuantLinear computing `mods` side by side (same kind and in_features)."""
        fused = QuantLinear.__new__(QuantLinear)
        torch.nn.Module.__init__(fused)
        fused.kind, fused.a8, fused.in_features = mods[0].kind, mods[0].a8, mods[0].in_features
        fused.out_features = sum(m.out_features for m in mods)
        fused.register_buffer("packed", torch.cat([m.packed for m in mods]))
        fused.max_abs_error = max(m.max_abs_error for m in mods)
        return fused

    def dequantized(self, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight [out, in]: a fresh tensor, or a view of `buffer` (at least
        out * in float32 elements) holding it."""
        fn = cpu_quant.dequantize_q8_0 if self.kind == "q8_0" else cpu_quant.dequantize_q4_1
        out = None if buffer is None else \
            buffer[:self.out_features * self.in_features].view(self.out_features, -1)
        return fn(self.packed, self.in_features, out)


# (kind, a8) -> the kernel multiplying up to QUANT_KERNEL_MAX_ROWS rows.
_KERNELS = {("q4_1", False): cpu_quant.q4_1_linear, ("q8_0", False): cpu_quant.q8_0_linear,
            ("q4_1", True): cpu_quant.q4_1_a8_linear, ("q8_0", True): cpu_quant.q8_0_a8_linear}


_scratch_local = threading.local()


def _scratch(num_elements: int) -> torch.Tensor:
    """A float32 buffer of at least `num_elements`, one per thread, reused by every
    QuantLinear's prefill product: one buffer of the largest layer (7 MB for SmolLM2's
    gate|up) stays in cache between layers instead of a fresh allocation per layer.
    Measured (SmolLM2, a 256-token chunk after 100 tokens, same run, load 1.5): two
    threads 515 ms with it, 586 ms without, float32 weights 477 ms; one thread 839 ms
    either way (float32 814)."""
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.numel() < num_elements:
        buf = _scratch_local.buf = torch.empty(num_elements, dtype=torch.float32)
    return buf


def quantize_q4_1(model: torch.nn.Module, activations_int8: bool = False) -> torch.nn.Module:
    """Every nn.Linear of a float32 CPU `model` -> QuantLinear in place: the LM head Q8_0,
    the rest Q4_1 (the formats of llama.cpp's Q4_1 GGUFs, SmolLM2's included: there the
    weights are lossless against the float32 reference), with 8-bit activations when
    `activations_int8` (the q4_1-a8 format). Sets `model.quantization_error` (the largest
    |dequantized - float32| of any weight); returns the model."""
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("q4_1 weights run on the CPU only; use --weights bfloat16 on a GPU")
    if not cpu_quant.available():
        raise ValueError(f"q4_1 weights need the CPU kernels (a C compiler or the prebuilt "
                         f"library, and AVX-512 or AVX2 + FMA + F16C), unavailable here: "
                         f"{cpu_quant.kernel_reason()}; use --weights float32")
    head = model.get_output_embeddings()
    error = 0.0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                q = QuantLinear(child, "q8_0" if child is head else "q4_1", activations_int8)
                error = max(error, q.max_abs_error)
                setattr(module, name, q)
    model.quantization_error = error
    log.info("q4_1 weights%s: largest |dequantized - float32| %.3g",
             ", 8-bit activations" if activations_int8 else "", error)
    return model


def main(argv: list[str] | None = None) -> int:
    """`python -m prefixgate.worker.model_loader MODEL [CACHE_DIR]`: materialise MODEL's
    folder (weights included) and print its path, for engines that read the folder
    themselves (`prefixgate up --engine vllm` runs it, keeping torch out of its own
    process, which hosts the gateway)."""
    import sys

    from prefixgate.model.catalog import resolve_model

    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = resolve_model(argv[0], Path(argv[1]) if len(argv) > 1 else None)
    materialize_weights(spec)
    print(spec.model_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
