"""Page digests: a KV block's pages tied to what its holder recorded (torch-free).

Why: a pulled block enters the receiver's prefix cache and serves later turns there. The
holder records a digest of each block's pages when it computes them (stores them in its
prefix cache: worker/kv_transfer.py) and sends the digests with the pages
(`KVBlocksChunk.block_digests`); the receiver commits a block only when the pages that
came hash to its digest. Pages that changed after they were computed (a corrupted or
tampered pool, a rewritten block, a rogue process answering with other pages than the
ones the digests were recorded for) are refused and computed instead.

What digests do not prove (docs/reliability.md, "Trust"): that the pages are the model's
output on the chain's tokens. A holder whose own code is replaced (its key and
certificate in an attacker's hands) records digests of whatever it sends. That case is
bounded elsewhere: pulls only of chains a gateway ticketed for that holder, the gateways'
per-worker confidence in claims, and the attacker can reach only tenants whose turns
the gateway would route to that worker anyway.

Contract (any receiver of `ExportBlocks` pages calls `verify_chunk` on each chunk before
it commits any of its blocks; a vLLM KV connector included)
--------
The wire layout of a chunk of `num_blocks` blocks (KV_LAYOUT_LAYER_TOKEN_HEAD_DIM): `k`
and `v` are each [num_layers, num_blocks * block_size, num_kv_heads, head_dim] row-major,
so block j's K is, per layer l, the contiguous run
k[l * L + j * R : l * L + (j + 1) * R] with L = len(k) / num_layers, R = L / num_blocks.

  block_digest(k, v, num_layers) -> 32 bytes
      SHA-256 over b"pg-kv-block1", then block 0's K runs layer by layer, then its V runs,
      of a chunk of ONE block (how a holder records a block it computed).
  chunk_digests(k, v, num_blocks, num_layers) -> list of 32-byte digests, one per block
      (equal to block_digest of each block on its own; no copies of the pages).
  verify_chunk(k, v, digests, num_blocks, num_layers, required) -> (num_ok, why)
      num_ok: the leading blocks of the chunk whose pages match `digests` (commit only
      those); why: "" when all did, else the refusal to log. With no digests, every
      block passes unless `required` (a holder that records none is then refused).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

DIGEST_BYTES = 32
_DOMAIN = b"pg-kv-block1"


def chunk_digests(k: bytes | memoryview, v: bytes | memoryview, num_blocks: int,
                  num_layers: int) -> list[bytes]:
    """One digest per block of a chunk (module docstring)."""
    mk, mv = memoryview(k).cast("B"), memoryview(v).cast("B")
    if num_blocks <= 0 or len(mk) != len(mv) or len(mk) % (num_layers * num_blocks):
        raise ValueError(f"{len(mk)} bytes of K and {len(mv)} of V are not {num_blocks} "
                         f"blocks of {num_layers} layers")
    per_layer = len(mk) // num_layers
    run = per_layer // num_blocks
    out = []
    for j in range(num_blocks):
        h = hashlib.sha256(_DOMAIN)
        for pages in (mk, mv):
            for layer in range(num_layers):
                at = layer * per_layer + j * run
                h.update(pages[at:at + run])
        out.append(h.digest())
    return out


def block_digest(k: bytes | memoryview, v: bytes | memoryview, num_layers: int) -> bytes:
    """The digest of one block's pages (a chunk of one block)."""
    return chunk_digests(k, v, 1, num_layers)[0]


def verify_chunk(k: bytes | memoryview, v: bytes | memoryview, digests: Sequence[bytes],
                 num_blocks: int, num_layers: int, required: bool) -> tuple[int, str]:
    """(leading blocks whose pages match `digests`, why the rest were refused or "")."""
    if not digests:
        if required:
            return 0, ("the holder sent no page digests: pages it did not vouch for when it "
                       "computed them are not committed here")
        return num_blocks, ""
    if len(digests) != num_blocks:
        return 0, f"{len(digests)} page digests for {num_blocks} blocks"
    for j, (got, want) in enumerate(zip(chunk_digests(k, v, num_blocks, num_layers), digests,
                                        strict=True)):
        if got != want:
            return j, (f"block {j} of the chunk: its pages do not match the digest the holder "
                       "recorded when it computed them (refused, computed here instead)")
    return num_blocks, ""
