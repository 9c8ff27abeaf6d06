"""Re-index cached K/V for shifted positions: RoPE re-rotation over the paged pool.

Keys are cached after RoPE at their absolute positions: K(p) = R(p)k, with R(p) rotating
each dimension pair i by the angle p * inv_freq[i]. Rotations compose, so
R(-d)K(p) = K(p - d): a cached key moves back by d positions by one more rotation, and
its value does not depend on the position at all. This module moves token slots of the
pool: for every token n it reads slot `src[n]` of every layer, rotates the key by
-`delta[n]` positions (values are copied as they are) and writes slot `dst[n]`, in one
fused gather + rotate + scatter pass (`reindex_slots`).

Contract
--------
- `RopeSpec.from_model(model)` describes the model's rotation (`inv_freq`, the rotary
  dimensions, the pair layout) or raises `UnsupportedRope` with the reason: dynamic NTK
  and LongRoPE change `inv_freq` with the sequence length (a cached key is then not a
  pure rotation of the same angles), and a model without rotary embeddings has nothing
  to rotate. Callers fall back to recomputing.
- Frequencies come from `inv_freq`, never from the model's cos/sin: those carry
  `attention_scaling` (YaRN's mscale), which the stored keys already include; rotating by
  a pure rotation keeps it exactly once. default / linear / llama3 / YaRN are all pure
  rotations with their own `inv_freq`.
- Pair layouts: `rotate_half` (pairs (i, i + r/2), Llama/NeoX) and `interleaved` (pairs
  (2i, 2i + 1), GPT-J). Partial rotary: only the first `rotary_dim` dims rotate; the
  rest are copied.
- Precision: angles delta * inv_freq are computed in float64 and their cos/sin rounded
  to float32 once; the rotation runs in float32 from the stored keys and is rounded to
  the pool's dtype once. Callers rotate once by the total shift from the stored keys,
  never by accumulating small shifts (each rounding to bf16 would add error).
- `dst` slots must not overlap `src` slots (writes go to fresh blocks); both are 1-D
  int64 tensors of pool slot indices, `delta` a 1-D int64 tensor of positions (0 copies).
- `reindex_slots(pool, src, dst, delta, rope, backend)`: backend "torch" runs anywhere;
  "triton" runs `prefixgate.worker.kernels.reindex_triton` (a GPU, or CPU under
  TRITON_INTERPRET=1 for tests); "auto" picks triton when the pool is on a CUDA device
  and triton imports, else torch. Both give the same result to float32 rounding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from prefixgate.worker.kv_pool import KVPool

log = logging.getLogger(__name__)

# rope_type values whose inv_freq is fixed: a cached key is a pure rotation.
PURE_ROTATION_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedRope(ValueError):
    """The model's position encoding cannot be re-rotated; the message says why."""


@dataclass(frozen=True)
class RopeSpec:
    """How keys are rotated. `inv_freq` has rotary_dim / 2 entries (radians per position)."""

    inv_freq: tuple[float, ...]
    head_dim: int
    interleaved: bool = False  # pairs (2i, 2i+1); False: rotate-half pairs (i, i + r/2)

    def __post_init__(self) -> None:
        if not self.inv_freq or 2 * len(self.inv_freq) > self.head_dim:
            raise ValueError(f"{len(self.inv_freq)} frequencies do not fit head_dim {self.head_dim}")

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)

    @staticmethod
    def from_model(model: torch.nn.Module) -> RopeSpec:
        """The rotation of a transformers decoder (Llama family: rotate-half pairs)."""
        config = model.config
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in PURE_ROTATION_TYPES:
            raise UnsupportedRope(
                f"rope_type {rope_type!r} is not a fixed rotation (its frequencies depend on "
                "the sequence length): shifted reuse recomputes instead")
        rotary = _find_rotary(model)
        if rotary is None:
            raise UnsupportedRope(f"{type(model).__name__} has no rotary embedding: "
                                  "shifted reuse recomputes instead")
        inv_freq = rotary.inv_freq.detach().to("cpu", torch.float64)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return RopeSpec(tuple(inv_freq.tolist()), head_dim, interleaved=False)

    def tables(self, delta: torch.Tensor, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        """Per-token rotation by -delta as float32 tables [N, head_dim]: `cos`, `sin`
        (signed per pair half; 1 and 0 on dims that do not rotate) and the int64 `partner`
        dim each output dim reads, so out = x * cos + x[partner] * sin for every layout."""
        d, r = self.head_dim, self.rotary_dim
        dims = torch.arange(d)
        if self.interleaved:
            freq_idx = dims // 2
            partner = dims ^ 1
            sign = torch.where(dims % 2 == 0, -1.0, 1.0)
        else:
            half = r // 2
            freq_idx = dims % half
            partner = torch.where(dims < half, dims + half, dims - half)
            sign = torch.where(dims < half, -1.0, 1.0)
        rot = dims < r
        partner = torch.where(rot, partner, dims)
        inv = torch.tensor(self.inv_freq, dtype=torch.float64)
        full = torch.where(rot, inv[freq_idx.clamp(max=len(self.inv_freq) - 1)], 0.0)
        angle = -delta.to("cpu", torch.float64)[:, None] * full[None, :]  # [N, D]
        cos = torch.where(rot, angle.cos(), 1.0).to(torch.float32)
        sin = torch.where(rot, angle.sin() * sign, 0.0).to(torch.float32)
        return cos.to(device), sin.to(device), partner.to(device)


def _find_rotary(model: torch.nn.Module) -> torch.nn.Module | None:
    for module in model.modules():
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            return module
    return None


def rope_spec_or_none(model: torch.nn.Module) -> RopeSpec | None:
    """`RopeSpec.from_model`, or None with the reason logged (shifted reuse is then off)."""
    try:
        return RopeSpec.from_model(model)
    except UnsupportedRope as exc:
        log.warning("shifted KV reuse disabled: %s", exc)
        return None


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                partner: torch.Tensor) -> torch.Tensor:
    """keys [..., N, H, D] in any float dtype -> rotated in float32 (tables from `tables`)."""
    x = keys.to(torch.float32)
    return x * cos[:, None, :] + x[..., partner] * sin[:, None, :]


def reindex_slots_torch(pool: KVPool, src: torch.Tensor, dst: torch.Tensor, delta: torch.Tensor,
                        rope: RopeSpec, layers_per_pass: int = 8) -> None:
    """The reference path: gather slots `src` of every layer, rotate keys, scatter to `dst`."""
    device = pool.k.device
    src, dst = src.to(device), dst.to(device)
    cos, sin, partner = rope.tables(delta, device)
    # A few layers per pass bounds the float32 temporaries (N x H x D x 4 bytes each).
    for lo in range(0, pool.config.num_layers, layers_per_pass):
        hi = min(lo + layers_per_pass, pool.config.num_layers)
        k = rotate_keys(pool.k[lo:hi, src], cos, sin, partner)
        pool.k[lo:hi, dst] = k.to(pool.k.dtype)
        pool.v[lo:hi, dst] = pool.v[lo:hi, src]


def reindex_slots(pool: KVPool, src: torch.Tensor, dst: torch.Tensor, delta: torch.Tensor,
                  rope: RopeSpec, backend: str = "auto") -> None:
    """Move token slots `src` -> `dst` in every layer, keys rotated back by `delta`."""
    if len(src) != len(dst) or len(src) != len(delta):
        raise ValueError("src, dst and delta must have the same length")
    if len(src) == 0:
        return
    if backend == "auto":
        backend = "triton" if pool.k.is_cuda and triton_available() else "torch"
    if backend == "triton":
        from prefixgate.worker.kernels.reindex_triton import reindex_slots_triton

        reindex_slots_triton(pool, src, dst, delta, rope)
    elif backend == "torch":
        reindex_slots_torch(pool, src, dst, delta, rope)
    else:
        raise ValueError(f"unknown reindex backend {backend!r}: use auto, torch or triton")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
