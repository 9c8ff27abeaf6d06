"""Shifted loads: an overflowing conversation's kept turns, moved back from an earlier layout.

When a conversation outgrows the context, the adapter (engines/vllm.py) drops its oldest
turns (model/overflow.py) and sends vLLM the kept prompt with `ShiftParams` (params.py):
the preamble's length `n_keep` and the chains of the earlier layouts the kept run may be
cached under in the connector's host store (store.py). This module is the connector's
math for it (torch; no vLLM, so it is tested without one):

- `rope_of(hf_config)` -> `worker/reindex.RopeSpec` of the model vLLM serves (its
  Hugging Face config: `rope_theta` / `rope_parameters`, `head_dim`,
  `partial_rotary_factor`; the frequencies computed in float32 as vLLM's own rotary
  embedding computes them, so the inverse rotation undoes exactly the angles the keys were
  cached with). Rotate-half pairs (Llama, Mistral, Qwen...: vLLM's neox style) unless the
  architecture is one that interleaves (GPT-J style). `UnsupportedRope` (saying why) for
  rope types whose frequencies depend on the sequence length (dynamic NTK, LongRoPE) or
  that are not plain rotations; the connector then loads nothing and vLLM computes.
- `choose_layout(run, shift, block_size, limit)` -> (end, delta, pages): the layout whose
  run held (in the store: `run` = `lambda c: store.run(c, 0)`) reaches furthest into the
  new prompt (new positions [0, end), end <= limit), None when none reaches past the
  preamble.
- `shifted_kv(pages, n_keep, delta, start, stop, rope)` -> (k, v), each
  `[layers, stop - start, kv_heads, head_dim]`: new positions [start, stop) read from
  the layout's pages at p (p < n_keep: the preamble, moved by 0) or p + delta, keys
  rotated back by delta (`R(-delta) K(p + delta) = K(p)`; per token, so the gap need not
  be block-aligned) in float32 from the stored keys, values copied. The caller rounds to
  the cache's dtype once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from prefixgate.vllm_connector.params import ShiftParams
from prefixgate.vllm_connector.store import Page
from prefixgate.worker.reindex import PURE_ROTATION_TYPES, RopeSpec, UnsupportedRope, rotate_keys

__all__ = ["UnsupportedRope", "choose_layout", "rope_of", "shifted_kv"]

# Architectures whose rotary pairs are interleaved (2i, 2i + 1) in vLLM (is_neox_style
# False); every other rotary model vLLM serves rotates halves (i, i + r/2).
INTERLEAVED_ARCHITECTURES = frozenset({"GPTJForCausalLM", "ChatGLMModel",
                                       "ChatGLMForConditionalGeneration"})


def rope_of(hf_config: Any) -> RopeSpec:
    """The rotation of the model whose Hugging Face config is `hf_config` (see module)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    params = dict(getattr(text, "rope_parameters", None) or
                  getattr(text, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in PURE_ROTATION_TYPES:
        raise UnsupportedRope(f"rope_type {rope_type!r} is not a fixed rotation (its "
                              "frequencies depend on the sequence length): no shifted loads")
    heads = getattr(text, "num_attention_heads", 0)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
    theta = params.get("rope_theta", getattr(text, "rope_theta", None))
    if not head_dim or theta is None:
        raise UnsupportedRope(f"{type(text).__name__} has no rotary embedding "
                              "(no rope_theta): no shifted loads")
    partial = float(params.get("partial_rotary_factor",
                               getattr(text, "partial_rotary_factor", 1.0) or 1.0))
    rotary_dim = int(head_dim * partial)
    if rope_type == "default":
        # As vLLM's RotaryEmbedding._compute_inv_freq (float32), read exactly in float64.
        inv = 1.0 / (float(theta) ** (torch.arange(0, rotary_dim, 2, dtype=torch.float)
                                      / rotary_dim))
    elif rope_type == "linear":
        inv = 1.0 / (float(theta) ** (torch.arange(0, rotary_dim, 2, dtype=torch.float)
                                      / rotary_dim)) / float(params["factor"])
    else:  # llama3, yarn: transformers' own frequencies (the ones its models cache with)
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, _ = ROPE_INIT_FUNCTIONS[rope_type](text, "cpu")
    archs = set(getattr(hf_config, "architectures", None) or ())
    return RopeSpec(tuple(inv.to(torch.float64).tolist()), int(head_dim),
                    interleaved=bool(archs & INTERLEAVED_ARCHITECTURES))


def choose_layout(run: Callable[[Sequence[int]], Sequence[Any]], shift: ShiftParams,
                  block_size: int, limit: int) -> tuple[int, int, Sequence[Any]] | None:
    """(end, delta, held) of the layout whose held run reaches furthest into the new prompt
    (new positions [0, end), end <= limit). `run(chain)` is what is held of a chain from
    its first block on (the store's pages: `HostStore.run(chain, 0)`; or any sequence as
    long, e.g. what an export says it holds); the pages cover old positions [0, end +
    delta) in whole blocks. Layouts are tried in order of how far they could reach, and
    no further once none left could beat the best. None when none reaches past the
    preamble."""
    def reach(layout: tuple[int, tuple[int, ...]]) -> int:
        delta, chain = layout
        return min(len(chain) * block_size - delta, limit)

    best: tuple[int, int, Sequence[Any]] | None = None
    for delta, chain in sorted(shift.layouts, key=reach, reverse=True):
        if reach((delta, chain)) <= (best[0] if best else shift.n_keep):
            break
        need = -(-(limit + delta) // block_size)  # blocks covering new positions < limit
        held = run(chain[:need])
        end = min(len(held) * block_size - delta, limit)
        if end > shift.n_keep and (best is None or end > best[0]):
            best = (end, delta, held)
    return best


def shifted_kv(pages: Sequence[Page], n_keep: int, delta: int, start: int, stop: int,
               rope: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """K (float32, rotated) and V of new positions [start, stop) from a layout's pages."""
    pos = torch.arange(start, stop)
    bs = pages[0].block_size
    # Old positions read: the preamble's part at its own, the rest `delta` later: two
    # contiguous runs, copied as page slices in one concatenation (no indexed gather).
    runs = [(start, min(stop, n_keep)), (max(start, n_keep) + delta, stop + delta)]
    ks, vs = [], []
    for lo, hi in runs:
        for b in range(lo // bs, -(-hi // bs)) if hi > lo else ():
            a, z = max(lo, b * bs) - b * bs, min(hi, (b + 1) * bs) - b * bs
            ks.append(pages[b].k[:, a:z])
            vs.append(pages[b].v[:, a:z])
    keys, values = torch.cat(ks, dim=1), torch.cat(vs, dim=1)  # [layers, tokens, heads, dim]
    shift = torch.where(pos < n_keep, 0, delta)
    cos, sin, partner = rope.tables(shift, "cpu")
    if rope.interleaved:
        return rotate_keys(keys, cos, sin, partner), values
    # Rotate-half: each dim's partner is the other half's (rotate_keys' gather, as slices:
    # a contiguous copy instead of an indexed one, several times faster on a CPU).
    x = keys.to(torch.float32)
    half, r = rope.rotary_dim // 2, rope.rotary_dim
    partners = torch.cat([x[..., half:r], x[..., :half], x[..., r:]], dim=-1)
    return x.mul_(cos[:, None, :]).addcmul_(partners, sin[:, None, :]), values
