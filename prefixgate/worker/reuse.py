"""The reuse planner: how much of a sequence's prompt is already computed, and what a
finished sequence leaves for the next turn.

Contract
--------
- `hashes(seq)` keeps `seq.block_hashes` current: chained hashes of its full blocks,
  salted by model fingerprint and namespace (`prefixgate.radix.BlockHasher`, the keys the
  gateway routes on), one per namespace (`prefixgate.radix.hashers.Hashers`, bounded:
  namespaces are client-chosen).
- `match(seq)` (admission) takes the exact hit: the longest cached run of seq's full
  prompt blocks, locked and referenced (`seq.cache_handle`); never the block holding the
  last prompt token, whose logits are needed. Returns the matched block ids; the caller
  puts them in the block table or hands them back with `BlockManager.release`.
- `extend(seq)` (right after admission) extends the hit: from a cached tail (the partial
  block a finished turn left: its matching tokens are copied into a fresh block, since
  this sequence will write the rest), and, for an overflowing prompt, by shifted reuse.
- `commit(seq)` (prefill done: the prompt's first token was sampled) caches the
  sequence's computed full blocks while it keeps running: they are shared with the
  cache (one more pool reference), locked for as long as the sequence holds them, and
  published as `stored` now. A request arriving meanwhile with the same prefix reuses
  them, and gateways learn where the conversation lives before its reply ends (a reply
  of 1,000 tokens takes tens of seconds; routing the next turn blind for that long
  sends concurrent turns elsewhere). vLLM caches each block as it fills, SGLang each
  prefill chunk; the prompt's end is the point where its K/V has produced a token.
- `store(seq)` (finish) hands the sequence's computed full blocks to the prefix cache
  and keeps its partial last block as a tail, so the next turn of the conversation reuses
  all of it; the rest of its blocks are released.

Shifted reuse (docs/reindex.md): an overflowing prompt's kept turns may still be cached
where an earlier turn of the conversation left them, Δ positions later. Unless the
request's mode is "recompute", the longest such run is moved back into fresh blocks (keys
re-rotated by -Δ, worker/reindex.py) and serves as its prefix ("blend" then recomputes
the first `blend_tokens` tokens after the gap). Moved K/V (and K/V computed after them)
are approximate, so such a sequence hashes its blocks from the gap on in a separate,
salted chain: an exact request never matches them, the conversation's next overflowing
turn finds them.

The search is bounded, since a client may send a prompt of any length with as many turn
starts as it likes (every request waits while it runs on the engine thread): at most
`MAX_LAYOUTS` earlier layouts are tried (the undropped one and the most recent drops), the
preamble's hashes are computed once, and each layout is hashed lazily, in doubling runs
of blocks, only as far as the cache holds it; an uncached layout costs one run. So the
work is linear in the prompt (and in what is cached), not in prompt x turns.

Every block comes from `BlockManager.acquire` without preemption: reuse is an
optimisation and gives way (computes instead) when memory is short.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import torch

from prefixgate.model.overflow import OverflowPlan
from prefixgate.model.overflow import salted_parent as _salt
from prefixgate.radix import BlockHasher, Hashers
from prefixgate.worker.blocks import BlockManager
from prefixgate.worker.prefix_cache import PrefixCache
from prefixgate.worker.reindex import RopeSpec, reindex_slots
from prefixgate.worker.sequence import Sequence
from prefixgate.workerapi.api import EngineConfig

log = logging.getLogger(__name__)

MAX_LAYOUTS = 64  # earlier layouts shifted reuse tries (see the module docstring)
FIRST_RUN_BLOCKS = 4  # blocks hashed before a layout's first cache lookup, then doubling


class ReusePlanner:
    def __init__(self, config: EngineConfig, cache: PrefixCache, blocks: BlockManager,
                 rope: RopeSpec | None) -> None:
        self.config = config
        self.cache = cache
        self.pool = cache.pool
        self.blocks = blocks
        self.rope = rope  # None: shifted reuse recomputes
        self._hashers = Hashers(config.block_size, config.model_fingerprint)

    # --- hashing ---------------------------------------------------------------------------

    def hasher(self, namespace: str) -> BlockHasher:
        return self._hashers.get(namespace)

    def hashes(self, seq: Sequence) -> list[int]:
        bs = self.config.block_size
        have, want = len(seq.block_hashes), len(seq.tokens) // bs
        if want > have:
            parent = seq.block_hashes[-1] if have else None
            seq.block_hashes += self.hasher(seq.request.namespace).hash_blocks(
                seq.tokens[have * bs:want * bs], parent_hash=parent)
        return seq.block_hashes

    def _parent_hash(self, seq: Sequence, num_blocks: int) -> int:
        """Hash of seq's block num_blocks - 1, or its namespace's root for 0."""
        if num_blocks:
            return seq.block_hashes[num_blocks - 1]
        return self.hasher(seq.request.namespace).root_hash

    # --- admission -------------------------------------------------------------------------

    def match(self, seq: Sequence) -> list[int]:
        if not self.config.enable_prefix_cache:
            return []
        usable = (len(seq.tokens) - 1) // self.config.block_size
        seq.cache_handle, matched = self.cache.match(self.hashes(seq)[:usable])
        return matched

    def extend(self, seq: Sequence) -> None:
        if not self.config.enable_prefix_cache:
            return
        self._reuse_tail(seq)
        if seq.overflow is not None and seq.num_cached_tokens < 0:
            self._shifted_reuse(seq)

    def _reuse_tail(self, seq: Sequence) -> None:
        bs, start = self.config.block_size, seq.num_computed_tokens
        room = min(bs - 1, len(seq.tokens) - 1 - start)
        if room <= 0:
            return
        parent = self._parent_hash(seq, len(seq.block_table))
        tail_block, n = self.cache.match_tail(parent, seq.tokens[start:start + room])
        if n == 0:
            return
        self.pool.ref([tail_block])  # acquiring may evict the tail itself
        blocks = self.blocks.acquire(1)
        if blocks is not None:
            self.pool.copy_prefix(tail_block, blocks[0], n)
        self.pool.release([tail_block])
        if blocks is None:
            return
        seq.block_table += blocks
        seq.num_computed_tokens += n

    def _mode(self, seq: Sequence) -> str:
        mode = seq.request.sampling.shifted_reuse or self.config.shifted_reuse
        return mode if self.rope is not None else "recompute"

    def _layout_hashes(self, tokens: Seq[int], num_blocks: int, gap_block: int,
                       salted: bool, namespace: str) -> list[int]:
        """Hashes of the first `num_blocks` full blocks of `tokens`; with `salted`, the
        chain from block `gap_block` on is the approximate one (see `_salt`)."""
        hasher, bs = self.hasher(namespace), self.config.block_size
        head = hasher.hash_blocks(tokens[:min(gap_block, num_blocks) * bs])
        if num_blocks <= gap_block:
            return head
        parent = head[-1] if head else hasher.root_hash
        if salted:
            parent = _salt(parent)
        return head + hasher.hash_blocks(tokens[gap_block * bs:num_blocks * bs], parent_hash=parent)

    def _match_layout(self, plan: OverflowPlan, start: int, num_blocks: int, head: list[int],
                      salted: bool, namespace: str) -> tuple[list[int], int]:
        """(hashes, cached blocks) of the layout of `plan` starting at turn start `start`:
        its first `num_blocks` blocks are hashed (the chain salted after the preamble's
        `head` blocks when `salted`) only as far as the cache holds them, so the hashes
        returned cover at least the cached run."""
        bs, hasher = self.config.block_size, self.hasher(namespace)
        hashes = head[:num_blocks]
        if num_blocks <= len(head):
            return hashes, self.cache.tree.match(hashes, touch=False).num_blocks
        parent = hashes[-1] if hashes else hasher.root_hash
        if salted:
            parent = _salt(parent)
        run = FIRST_RUN_BLOCKS
        while len(hashes) < num_blocks:
            lo = len(hashes) * bs
            hi = min(num_blocks, len(hashes) + run) * bs
            # Layout positions [lo, hi): the preamble up to n_keep, then full from start on.
            tokens = plan.full[lo:min(hi, plan.n_keep)] + \
                plan.full[start + max(lo - plan.n_keep, 0):start + hi - plan.n_keep]
            hashes += hasher.hash_blocks(tokens, parent_hash=parent)
            parent = hashes[-1]
            matched = self.cache.tree.match(hashes, touch=False).num_blocks
            if matched < len(hashes):
                return hashes, matched
            run *= 2
        return hashes, len(hashes)

    def _shifted_reuse(self, seq: Sequence) -> None:
        """Replace the exact hit of an overflowing prompt by a longer run of its kept turns
        cached under an earlier layout of the conversation (see the module docstring)."""
        mode = self._mode(seq)
        if mode == "recompute":
            return
        plan, bs, ns = seq.overflow, self.config.block_size, seq.request.namespace
        assert plan is not None
        n_keep, gap_block = plan.n_keep, plan.n_keep // bs
        limit = len(seq.tokens) - 1  # the last prompt token is always computed
        head = self.hasher(ns).hash_blocks(plan.full[:gap_block * bs])  # every layout's
        if self.cache.tree.match(head, touch=False).num_blocks < len(head):
            return  # the preamble is not cached: no layout can reach past it
        layouts = plan.layouts()
        if len(layouts) > MAX_LAYOUTS:  # the undropped layout and the most recent drops
            layouts = layouts[:1] + layouts[1 - MAX_LAYOUTS:]
        best: tuple[int, int, list[int]] | None = None  # (end in new positions, delta, hashes)
        for start, delta in layouts:
            usable = min((n_keep + len(plan.full) - start) // bs, (limit + delta) // bs)
            for salted in (False, True):
                if delta == 0 and not salted:
                    continue  # the exact hit admission already took
                hashes, matched = self._match_layout(plan, start, usable, head, salted, ns)
                end = matched * bs - delta
                if end > max(seq.num_computed_tokens, n_keep) and (best is None or end > best[0]):
                    best = (end, delta, hashes)
        if best is None or len(seq.block_table) < gap_block:
            return
        end, delta, hashes = best
        handle, found = self.cache.match(hashes[:(end + delta) // bs])
        if delta == 0:  # the previous overflowing turn's (approximate) blocks, in place
            self.blocks.release(seq)
            seq.cache_handle, seq.block_table = handle, found
            seq.block_hashes = hashes
            seq.num_computed_tokens = len(found) * bs
            self.hashes(seq)
            self._reuse_tail(seq)
            return
        new_blocks = self.blocks.acquire(self.config.blocks_for(end) - gap_block)
        if new_blocks is None:
            self.cache.unlock(handle)
            self.pool.release(found)
            return
        # New positions [gap_block * bs, end): the preamble's partial block is copied as
        # it is (delta 0), the kept turns come from delta positions later, rotated.
        pos = torch.arange(gap_block * bs, end)
        src_pos = torch.where(pos < n_keep, pos, pos + delta)
        src_blocks = torch.tensor(found, dtype=torch.long)
        dst_blocks = torch.tensor(new_blocks, dtype=torch.long)
        src = src_blocks[src_pos // bs] * bs + src_pos % bs
        dst = dst_blocks[pos // bs - gap_block] * bs + pos % bs
        shift = torch.where(pos < n_keep, 0, delta)
        assert self.rope is not None
        try:
            reindex_slots(self.pool, src, dst, shift, self.rope, self.config.reindex_backend)
        except Exception:  # the engine fails this request: give back what it holds only here
            self.pool.release(new_blocks)
            raise
        finally:
            self.cache.unlock(handle)
            self.pool.release(found)
        self.pool.release(seq.block_table[gap_block:])
        seq.block_table = seq.block_table[:gap_block] + new_blocks
        seq.block_hashes = self._layout_hashes(seq.tokens, len(seq.tokens) // bs,
                                               gap_block, True, ns)
        seq.num_computed_tokens = end
        if mode == "blend":
            redo = min(self.config.blend_tokens, end - n_keep)
            seq.num_computed_tokens = n_keep
            if n_keep + redo < end:
                seq.resume = (n_keep + redo, end)
        log.info("request %s: moved %d cached tokens back by %d positions (%s)",
                 seq.request_id, end - n_keep, delta, mode)

    # --- prefill done ----------------------------------------------------------------------

    def commit(self, seq: Sequence) -> None:
        """Cache seq's computed full blocks now; seq keeps running on them (see the module
        docstring). Blocks the cache already holds (its exact hit, or a duplicate another
        sequence committed first) stay seq's alone until `store` releases them."""
        full = seq.num_computed_tokens // self.config.block_size
        if not self.config.enable_prefix_cache or not full:
            return
        blocks = seq.block_table[:full]
        self.pool.ref(blocks)  # the cache's reference; seq keeps its own
        node = self.cache.insert(self.hashes(seq)[:full], blocks)
        assert node is not None
        # Lock the longer path before unlocking the matched one: the blocks seq computes on
        # must not be evicted (the eviction would free nothing while seq holds them).
        self.cache.tree.lock(node)
        if seq.cache_handle is not None:
            self.cache.unlock(seq.cache_handle)
        seq.cache_handle = node

    # --- finish ----------------------------------------------------------------------------

    def store(self, seq: Sequence) -> None:
        """Cache what `seq` computed (prompt and reply) and release the rest."""
        if not self.config.enable_prefix_cache or not seq.num_computed_tokens:
            self.blocks.release(seq)
            return
        bs = self.config.block_size
        full, partial = divmod(seq.num_computed_tokens, bs)
        self.cache.insert(self.hashes(seq)[:full], seq.block_table[:full])
        rest = seq.block_table[full:]
        if partial:
            self.cache.store_tail(self._parent_hash(seq, full),
                                  seq.tokens[full * bs:seq.num_computed_tokens], rest[0])
            rest = rest[1:]
        self.blocks.release(seq, rest)
        seq.block_table = []


