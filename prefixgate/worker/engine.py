"""The worker engine: continuous batching over a paged KV pool with exact prefix reuse.

`Engine` is the contract the Worker gRPC service is written against. `PagedEngine` runs
it on one background thread; every step:

1. admits waiting requests (FIFO) while the pool can hold their prompt: the prompt's
   full blocks are hashed and matched in the prefix cache; the matched blocks join the
   request's block table (shared, reference counted, locked against eviction), and the
   cached tail of a partial block after them is copied in, so only the uncached suffix
   is computed. The hit never covers the last prompt token: its logits are needed.
2. schedules a flat batch under `max_num_batched_tokens`: one token for each decoding
   request first, then prefill chunks, so a long prompt never stalls running decodes.
   Blocks for the step's new tokens are allocated now; when the pool is short, unlocked
   cached blocks are evicted (LRU leaves first), and only then is the most recently
   admitted request preempted (blocks freed, re-queued at the front, recomputed later:
   an accepted request never fails for memory it could get by waiting).
3. runs the model once (ModelRunner: K/V written into the pool, attention through block
   tables), samples where a request's last token was computed, streams text, stops.
4. finishes requests: their computed full blocks (prompt and reply) go into the prefix
   cache and their partial last block is kept as a tail, so the next turn of the
   conversation (same history re-rendered plus a new user message) hits all of it;
   duplicates are freed.

Each request owns only its block table, so the batch may change every step.

Context overflow (prefixgate.overflow, docs/reindex.md): a request whose prompt and
max_tokens exceed the context under "keep-system-drop-oldest" has its oldest turns
dropped at submission. At admission its kept turns may still be cached where an earlier
turn of the conversation left them, Δ positions later; unless the request's shifted
reuse mode is "recompute", the longest such run is moved back into fresh blocks (keys
re-rotated by -Δ, prefixgate.worker.reindex) and serves as its prefix ("blend" then
recomputes the first `blend_tokens` tokens after the gap before the rest). K/V that were
moved (or computed after moved ones) are approximate, so such a sequence hashes its
blocks from the gap on in a separate, salted chain: an exact request never matches them,
while the conversation's next overflowing turn finds them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from enum import Enum

import torch
import xxhash

from prefixgate.events import KVEventSink
from prefixgate.overflow import OverflowPlan, plan_overflow
from prefixgate.protocol import SamplingConfig
from prefixgate.radix import BlockHasher, Node
from prefixgate.worker.detokenizer import Decoder, StreamDecoder
from prefixgate.worker.kv_pool import KVPool
from prefixgate.worker.metrics import WorkerMetrics
from prefixgate.worker.model_runner import ModelRunner, pool_config_for
from prefixgate.worker.paged_attention import StepMetadata
from prefixgate.worker.prefix_cache import PrefixCache
from prefixgate.worker.reindex import reindex_slots, rope_spec_or_none
from prefixgate.worker.sampling import Sampler

log = logging.getLogger(__name__)


class FinishReason(Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"  # the engine failed on this request; the service reports INTERNAL


@dataclass(frozen=True)
class Request:
    """One generation request. `prompt_token_ids` is non-empty and, with
    `sampling.max_tokens`, fits the model's context (the service validates this)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingConfig
    namespace: str = ""


@dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    text: str
    index: int = 0  # sample index, 0..n-1


@dataclass(frozen=True)
class FinalEvent:
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_ms: float
    ttft_ms: float
    total_ms: float
    index: int = 0  # sample index, 0..n-1
    dropped_tokens: int = 0  # of the prompt as sent, to fit the context (prompt_tokens: kept)


Event = TokenEvent | FinalEvent
EmitFn = Callable[[Event], None]


@dataclass(frozen=True)
class EngineStatus:
    num_running_requests: int
    num_waiting_requests: int
    num_queued_prefill_tokens: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    kv_cached_tokens: int = 0


class Engine(ABC):
    """Contract shared by all engines.

    - `submit` is thread-safe and returns at once. `emit` is then called from the engine's
      thread with, for each of the request's `sampling.n` samples, zero or more
      TokenEvents and exactly one FinalEvent carrying that sample's index, in order per
      sample; it must not block (the gRPC service hands events to its event loop).
    - `cancel` is idempotent; a cancelled request frees its resources at the next step
      and ends with FinalEvent(CANCELLED).
    - `status` and `flush_cache` are thread-safe. `shutdown` returns once the engine
      thread has stopped; requests still in flight end CANCELLED.
    """

    @property
    @abstractmethod
    def capacity_tokens(self) -> int:
        """Most tokens of KV one request can hold (prompt + max_tokens must fit)."""

    @property
    def context_overflow(self) -> str:
        """Overflow policy for requests that leave it unset (prefixgate.overflow.POLICIES)."""
        return "fail"

    @abstractmethod
    def submit(self, request: Request, emit: EmitFn) -> None: ...

    @abstractmethod
    def cancel(self, request_id: str) -> None: ...

    @abstractmethod
    def status(self) -> EngineStatus: ...

    @abstractmethod
    def flush_cache(self) -> int:
        """Drop every unlocked cached block; returns the number of cached tokens dropped."""

    @abstractmethod
    def shutdown(self) -> None: ...

    def run_to_completion(self, request: Request, timeout_s: float = 600.0
                          ) -> tuple[list[int], FinalEvent]:
        """Submit `request` and block until it ends: (sample 0's token ids, its final
        event). For benchmarks and tests; the gRPC service streams instead."""
        events: queue.Queue[Event] = queue.Queue()
        self.submit(request, events.put)
        tokens: list[int] = []
        while True:
            ev = events.get(timeout=timeout_s)
            if isinstance(ev, FinalEvent):
                if ev.index == 0:
                    return tokens, ev
            elif ev.index == 0:
                tokens += ev.token_ids


@dataclass(frozen=True)
class EngineConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 32
    # Tokens per step (decodes + prefill chunks): bounds step latency for running decodes.
    max_num_batched_tokens: int = 512
    enable_prefix_cache: bool = True
    eos_token_ids: tuple[int, ...] = ()
    max_context_tokens: int = 2048
    # Salts block hashes, so caches of different models never match.
    model_fingerprint: str = ""
    # Context overflow (requests that leave it unset): "fail" or "keep-system-drop-oldest".
    context_overflow: str = "fail"
    # Token ids opening a user turn in the chat template (prefixgate.overflow.user_turn_prefix);
    # empty: no turn can be dropped.
    turn_prefix: tuple[int, ...] = ()
    # How an overflowing turn reuses its kept turns' KV: "recompute", "shift" or "blend".
    shifted_reuse: str = "blend"
    blend_tokens: int = 64  # recomputed after the gap under "blend" (docs/reindex.md)
    reindex_backend: str = "auto"  # "torch", "triton" or "auto" (triton on CUDA)


@dataclass(eq=False)
class _Sequence:
    request: Request
    emit: EmitFn
    sampler: Sampler
    decoder: StreamDecoder
    tokens: list[int]  # prompt + generated so far
    arrival: float = field(default_factory=time.monotonic)
    block_hashes: list[int] = field(default_factory=list)  # of tokens' full blocks
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in block_table's blocks
    num_cached_tokens: int = -1  # prompt tokens served from cache (set at first admission)
    cache_handle: Node[int] | None = None
    first_scheduled: float = 0.0
    first_token: float = 0.0
    last_token: float = 0.0
    index: int = 0  # sample index; sample 0 forks the others once the prompt is computed
    overflow: OverflowPlan | None = None  # the turns dropped to fit the context
    # Blend: compute up to resume[0], then continue at resume[1] (moved K/V in between).
    resume: tuple[int, int] | None = None

    @property
    def num_generated(self) -> int:
        dropped = self.overflow.dropped_tokens if self.overflow else 0
        return len(self.tokens) - len(self.request.prompt_token_ids) + dropped


class PagedEngine(Engine):
    def __init__(self, model: torch.nn.Module, tokenizer: Decoder, config: EngineConfig,
                 event_sink: KVEventSink | None = None,
                 metrics: WorkerMetrics | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.pool = KVPool(pool_config_for(model, config.block_size, config.num_blocks))
        self.runner = ModelRunner(model, self.pool)
        self.cache = PrefixCache(self.pool, event_sink)
        self.metrics = metrics
        self.rope = rope_spec_or_none(model)  # None: shifted reuse recomputes
        self._hashers: dict[str, BlockHasher] = {}
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._cancelled: set[str] = set()
        self._status = EngineStatus(0, 0, 0, 0, self.pool.config.num_tokens)
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    @property
    def capacity_tokens(self) -> int:
        return self.pool.config.num_tokens

    @property
    def context_overflow(self) -> str:
        return self.config.context_overflow

    # --- contract (any thread) ------------------------------------------------------------

    def submit(self, request: Request, emit: EmitFn) -> None:
        self._inbox.put(("submit", (request, emit, time.monotonic())))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def status(self) -> EngineStatus:
        return self._status

    def flush_cache(self) -> int:
        done: Future[int] = Future()
        self._inbox.put(("flush", done))
        return done.result(timeout=60)

    def shutdown(self) -> None:
        self._inbox.put(("shutdown", None))
        self._thread.join()

    # --- engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            idle = not self._running and not self._waiting
            try:
                kind, arg = self._inbox.get(block=idle)
            except queue.Empty:
                kind, arg = "", None
            while kind:
                if kind == "shutdown":
                    for seq in [*self._running, *self._waiting]:
                        self._finish(seq, FinishReason.CANCELLED)
                    return
                self._handle(kind, arg)
                try:
                    kind, arg = self._inbox.get_nowait()
                except queue.Empty:
                    kind = ""
            try:
                self._step()
            except Exception:  # never let one bad step kill the engine: fail its requests
                log.exception("engine step failed")
                for seq in list(self._running):
                    self._finish(seq, FinishReason.ERROR)
            self._publish_status()

    def _handle(self, kind: str, arg: object) -> None:
        if kind == "submit":
            request, emit, arrival = arg  # type: ignore[misc]
            seq = _Sequence(request, emit, Sampler(request.sampling),
                            StreamDecoder(self.tokenizer, request.sampling.stop),
                            list(request.prompt_token_ids), arrival=arrival)
            if self._plan_overflow(seq):
                self._waiting.append(seq)
        elif kind == "cancel":
            self._cancelled.add(arg)  # type: ignore[arg-type]
        elif kind == "flush":
            arg.set_result(self.cache.flush() * self.config.block_size)  # type: ignore[union-attr]

    def _plan_overflow(self, seq: _Sequence) -> bool:
        """Drop the oldest turns of an over-long prompt (per the request's policy); False
        when the request already ended (the context cannot hold even the kept turns)."""
        sampling = seq.request.sampling
        policy = sampling.context_overflow or self.config.context_overflow
        if policy != "keep-system-drop-oldest":
            return True
        plan = plan_overflow(seq.tokens, sampling.max_tokens, self.config.max_context_tokens,
                             self.config.turn_prefix)
        if plan is None:
            return True
        seq.overflow = plan
        seq.tokens = list(plan.kept)
        log.info("request %s: dropped %d of %d prompt tokens to fit the context of %d",
                 seq.request.request_id, plan.dropped_tokens, len(plan.full),
                 self.config.max_context_tokens)
        if len(seq.tokens) < self.config.max_context_tokens:
            return True  # may still end LENGTH early: the context is what is left
        log.warning("request %s: the system prompt and the last turn alone (%d tokens) fill "
                    "the context of %d", seq.request.request_id, len(seq.tokens),
                    self.config.max_context_tokens)
        for i in range(sampling.n):
            seq.emit(FinalEvent(FinishReason.LENGTH, len(seq.tokens), 0, 0, 0.0, 0.0,
                                (time.monotonic() - seq.arrival) * 1e3, i, plan.dropped_tokens))
        return False

    def _hasher(self, namespace: str) -> BlockHasher:
        h = self._hashers.get(namespace)
        if h is None:
            h = self._hashers[namespace] = BlockHasher(
                self.config.block_size, self.config.model_fingerprint, namespace)
        return h

    def _update_hashes(self, seq: _Sequence) -> None:
        bs = self.config.block_size
        have = len(seq.block_hashes)
        want = len(seq.tokens) // bs
        if want > have:
            parent = seq.block_hashes[-1] if have else None
            seq.block_hashes += self._hasher(seq.request.namespace).hash_blocks(
                seq.tokens[have * bs:want * bs], parent_hash=parent)

    def _step(self) -> None:
        if self._cancelled:
            for seq in [s for s in (*self._running, *self._waiting)
                        if s.request.request_id in self._cancelled]:
                self._finish(seq, FinishReason.CANCELLED)
            self._cancelled.clear()
        self._admit()
        batch = self._schedule()
        if batch:
            self._run(batch)

    def _blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.config.block_size - 1) // self.config.block_size

    def _admit(self) -> None:
        bs = self.config.block_size
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting[0]
            matched: list[int] = []
            if self.config.enable_prefix_cache:
                self._update_hashes(seq)
                # Cap the hit so that at least the last token is computed.
                usable = (len(seq.tokens) - 1) // bs
                seq.cache_handle, matched = self.cache.match(seq.block_hashes[:usable])
            need = self._blocks_for(len(seq.tokens)) - len(matched)
            available = self.pool.num_free_blocks + self.cache.num_evictable_blocks
            if need > available and self._running:
                self._release_blocks(seq, matched)  # wait until running requests finish
                break
            self._waiting.popleft()
            seq.block_table = matched
            seq.num_computed_tokens = len(matched) * bs
            if self.config.enable_prefix_cache:
                self._reuse_tail(seq)
                if seq.overflow is not None and seq.num_cached_tokens < 0:
                    self._shifted_reuse(seq)
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
                if seq.resume is not None:  # blend: the moved run after the recomputed tokens
                    seq.num_cached_tokens += seq.resume[1] - seq.resume[0]
                if self.metrics:
                    self.metrics.prefix_queries.inc(len(seq.tokens))
                    self.metrics.prefix_hits.inc(seq.num_computed_tokens)
            self._running.append(seq)

    def _parent_hash(self, seq: _Sequence, num_blocks: int) -> int:
        """Hash of seq's block num_blocks - 1, or its namespace's root for 0."""
        if num_blocks:
            return seq.block_hashes[num_blocks - 1]
        return self._hasher(seq.request.namespace).root_hash

    def _reuse_tail(self, seq: _Sequence) -> None:
        """Extend the hit into the next, partial block from a cached tail (copied, since
        this request will write the rest of the block)."""
        bs, start = self.config.block_size, seq.num_computed_tokens
        room = min(bs - 1, len(seq.tokens) - 1 - start)
        if room <= 0:
            return
        parent = self._parent_hash(seq, len(seq.block_table))
        tail_block, n = self.cache.match_tail(parent, seq.tokens[start:start + room])
        if n == 0:
            return
        blocks = self.pool.allocate(1)
        if blocks is None:
            return
        self.pool.copy_prefix(tail_block, blocks[0], n)
        seq.block_table += blocks
        seq.num_computed_tokens += n

    def _reuse_mode(self, seq: _Sequence) -> str:
        mode = seq.request.sampling.shifted_reuse or self.config.shifted_reuse
        return mode if self.rope is not None else "recompute"

    def _layout_hashes(self, tokens: tuple[int, ...], num_blocks: int, gap_block: int,
                       salted: bool, namespace: str) -> list[int]:
        """Hashes of the first `num_blocks` full blocks of `tokens`; with `salted`, the
        chain from block `gap_block` on is the approximate one (see `_salt`)."""
        hasher, bs = self._hasher(namespace), self.config.block_size
        head = hasher.hash_blocks(tokens[:min(gap_block, num_blocks) * bs])
        if num_blocks <= gap_block:
            return head
        parent = head[-1] if head else hasher.root_hash
        if salted:
            parent = _salt(parent)
        return head + hasher.hash_blocks(tokens[gap_block * bs:num_blocks * bs], parent_hash=parent)

    def _shifted_reuse(self, seq: _Sequence) -> None:
        """Replace the exact hit of an overflowing prompt by a longer run of its kept turns
        cached under an earlier layout of the conversation (see the module docstring)."""
        mode = self._reuse_mode(seq)
        if mode == "recompute":
            return
        plan, bs, ns = seq.overflow, self.config.block_size, seq.request.namespace
        assert plan is not None
        n_keep, gap_block = plan.n_keep, plan.n_keep // bs
        limit = len(seq.tokens) - 1  # the last prompt token is always computed
        best: tuple[int, int, list[int]] | None = None  # (end in new positions, delta, hashes)
        for start, delta in plan.layouts():
            tokens = plan.layout(start)
            usable = min(len(tokens) // bs, (limit + delta) // bs)
            for salted in (False, True):
                if delta == 0 and not salted:
                    continue  # the exact hit admission already took
                hashes = self._layout_hashes(tokens, usable, gap_block, salted, ns)
                end = self.cache.tree.match(hashes, touch=False).num_blocks * bs - delta
                if end > max(seq.num_computed_tokens, n_keep) and (best is None or end > best[0]):
                    best = (end, delta, hashes)
        if best is None or len(seq.block_table) < gap_block:
            return
        end, delta, hashes = best
        handle, blocks = self.cache.match(hashes[:(end + delta) // bs])
        if delta == 0:  # the previous overflowing turn's (approximate) blocks, in place
            self._release_blocks(seq, seq.block_table)
            seq.cache_handle, seq.block_table = handle, blocks
            seq.block_hashes = hashes
            seq.num_computed_tokens = len(blocks) * bs
            self._update_hashes(seq)
            self._reuse_tail(seq)
            return
        fresh = self._blocks_for(end) - gap_block
        if self.pool.num_free_blocks < fresh:
            self.cache.evict(fresh - self.pool.num_free_blocks)
        new_blocks = self.pool.allocate(fresh)
        if new_blocks is None:
            self.cache.unlock(handle)
            self.pool.release(blocks)
            return
        # New positions [gap_block * bs, end): the preamble's partial block is copied as
        # it is (delta 0), the kept turns come from delta positions later, rotated.
        pos = torch.arange(gap_block * bs, end)
        src_pos = torch.where(pos < n_keep, pos, pos + delta)
        src_blocks = torch.tensor(blocks, dtype=torch.long)
        dst_blocks = torch.tensor(new_blocks, dtype=torch.long)
        src = src_blocks[src_pos // bs] * bs + src_pos % bs
        dst = dst_blocks[pos // bs - gap_block] * bs + pos % bs
        shift = torch.where(pos < n_keep, 0, delta)
        reindex_slots(self.pool, src, dst, shift, self.rope, self.config.reindex_backend)
        self.cache.unlock(handle)
        self.pool.release(blocks)
        self.pool.release(seq.block_table[gap_block:])
        seq.block_table = seq.block_table[:gap_block] + new_blocks
        seq.block_hashes = self._layout_hashes(tuple(seq.tokens), len(seq.tokens) // bs,
                                               gap_block, True, ns)
        seq.num_computed_tokens = end
        if mode == "blend":
            redo = min(self.config.blend_tokens, end - n_keep)
            seq.num_computed_tokens = n_keep
            if n_keep + redo < end:
                seq.resume = (n_keep + redo, end)
        log.info("request %s: moved %d cached tokens back by %d positions (%s)",
                 seq.request.request_id, end - n_keep, delta, mode)

    def _release_blocks(self, seq: _Sequence, blocks: list[int]) -> None:
        self.pool.release(blocks)
        if seq.cache_handle is not None:
            self.cache.unlock(seq.cache_handle)
            seq.cache_handle = None

    def _allocate(self, seq: _Sequence, num_blocks: int) -> bool:
        """Give `seq` `num_blocks` more blocks: evict cached blocks, then preempt others.
        False when `seq` itself had to be preempted."""
        while True:
            blocks = self.pool.allocate(num_blocks)
            if blocks is not None:
                seq.block_table += blocks
                return True
            short = num_blocks - self.pool.num_free_blocks
            if self.cache.evict(short) and self.metrics:
                self.metrics.evictions.inc(short)
            if self.pool.num_free_blocks >= num_blocks:
                continue
            victim = self._running[-1]
            self._preempt(victim)
            if victim is seq:
                return False

    def _preempt(self, seq: _Sequence) -> None:
        log.info("preempting %s (%d tokens) for memory", seq.request.request_id, len(seq.tokens))
        self._running.remove(seq)
        self._release_blocks(seq, seq.block_table)
        seq.block_table, seq.num_computed_tokens, seq.resume = [], 0, None
        self._waiting.appendleft(seq)
        if self.metrics:
            self.metrics.preemptions.inc()

    def _schedule(self) -> list[tuple[_Sequence, int]]:
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[_Sequence, int]] = []
        # Decodes (one pending token) before prefill chunks.
        order = sorted(self._running, key=lambda s: len(s.tokens) - s.num_computed_tokens > 1)
        for seq in order:
            if budget == 0:
                break
            if seq not in self._running:  # preempted by an earlier allocation this step
                continue
            n = min((seq.resume[0] if seq.resume else len(seq.tokens)) - seq.num_computed_tokens,
                    budget)
            extra = self._blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
            if extra > 0 and not self._allocate(seq, extra):
                continue
            batch.append((seq, n))
            budget -= n
        return [(s, n) for s, n in batch if s in self._running]

    def _run(self, batch: list[tuple[_Sequence, int]]) -> None:
        input_ids: list[int] = []
        positions: list[int] = []
        sample_indices: list[int] = []
        samplers: list[_Sequence] = []
        now = time.monotonic()
        for seq, n in batch:
            start = seq.num_computed_tokens
            input_ids += seq.tokens[start:start + n]
            positions += range(start, start + n)
            if not seq.first_scheduled:
                seq.first_scheduled = now
            if start + n == len(seq.tokens):
                sample_indices.append(len(input_ids) - 1)
                samplers.append(seq)
        step = StepMetadata.build(self.pool, [s.block_table for s, _ in batch],
                                  [s.num_computed_tokens + n for s, n in batch],
                                  [n for _, n in batch])
        logits = self.runner.forward(input_ids, positions, step, sample_indices)
        for seq, n in batch:
            seq.num_computed_tokens += n
            if seq.resume is not None and seq.num_computed_tokens == seq.resume[0]:
                seq.num_computed_tokens, seq.resume = seq.resume[1], None
        for row, seq in zip(logits, samplers, strict=True):
            if seq.request.sampling.n > 1 and seq.index == 0 and not seq.num_generated:
                for child in self._fork(seq):
                    self._append(child, child.sampler.sample(row))
            self._append(seq, seq.sampler.sample(row))

    def _fork(self, parent: _Sequence) -> list[_Sequence]:
        """Samples 1..n-1 of a request whose prompt was just computed: they share the
        prompt's full blocks (one more reference each) and get a copy of its partial last
        block, so the prompt is computed and stored once."""
        req, bs = parent.request, self.config.block_size
        full, partial = divmod(parent.num_computed_tokens, bs)
        children = []
        for i in range(1, req.sampling.n):
            sampling = req.sampling
            if sampling.seed is not None:
                sampling = replace(sampling, seed=sampling.seed + i)
            child = _Sequence(req, parent.emit, Sampler(sampling),
                              StreamDecoder(self.tokenizer, sampling.stop),
                              list(parent.tokens), arrival=parent.arrival, index=i,
                              overflow=parent.overflow,
                              block_hashes=list(parent.block_hashes),
                              first_scheduled=parent.first_scheduled)
            child.num_cached_tokens = parent.num_cached_tokens
            self.pool.ref(parent.block_table[:full])
            child.block_table = parent.block_table[:full]
            if partial:
                if self.pool.num_free_blocks == 0:
                    self.cache.evict(1)
                copy = self.pool.allocate(1)
                if copy is None:  # no room to share: this sample recomputes its prompt later
                    self.pool.release(child.block_table)
                    child.block_table = []
                    self._waiting.append(child)
                    continue
                self.pool.copy_prefix(parent.block_table[full], copy[0], partial)
                child.block_table += copy
            child.num_computed_tokens = parent.num_computed_tokens
            self._running.append(child)
            children.append(child)
        return children

    def _append(self, seq: _Sequence, token: int) -> None:
        now = time.monotonic()
        if self.metrics:
            if seq.first_token:
                self.metrics.inter_token.observe(now - seq.last_token)
            else:
                self.metrics.ttft.observe(now - seq.arrival)
        seq.first_token = seq.first_token or now
        seq.last_token = now
        seq.tokens.append(token)
        sampling = seq.request.sampling
        if token in self.config.eos_token_ids or token in sampling.stop_token_ids:
            seq.emit(TokenEvent((token,), seq.decoder.flush(), seq.index))
            self._finish(seq, FinishReason.STOP)
            return
        text = seq.decoder.push(token)
        if seq.decoder.stopped:
            seq.emit(TokenEvent((token,), text, seq.index))
            self._finish(seq, FinishReason.STOP)
        elif seq.num_generated >= sampling.max_tokens or \
                len(seq.tokens) >= self.config.max_context_tokens:
            seq.emit(TokenEvent((token,), text + seq.decoder.flush(), seq.index))
            self._finish(seq, FinishReason.LENGTH)
        else:
            seq.emit(TokenEvent((token,), text, seq.index))

    def _finish(self, seq: _Sequence, reason: FinishReason) -> None:
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        bs = self.config.block_size
        full = seq.num_computed_tokens // bs
        if self.config.enable_prefix_cache and seq.num_computed_tokens and \
                reason is not FinishReason.ERROR:
            # Cache what was computed (prompt and reply), so the next turn reuses it.
            self._update_hashes(seq)
            self.cache.insert(seq.block_hashes[:full], seq.block_table[:full])
            rest = seq.block_table[full:]
            partial = seq.num_computed_tokens - full * bs
            if partial:
                self.cache.store_tail(self._parent_hash(seq, full),
                                      seq.tokens[full * bs:seq.num_computed_tokens], rest[0])
                rest = rest[1:]
            self._release_blocks(seq, rest)
        else:
            self._release_blocks(seq, seq.block_table)
        seq.block_table = []
        end = time.monotonic()
        start = seq.first_scheduled or end
        dropped = seq.overflow.dropped_tokens if seq.overflow else 0
        seq.emit(FinalEvent(reason, len(seq.request.prompt_token_ids) - dropped,
                            max(seq.num_cached_tokens, 0),
                            seq.num_generated, (start - seq.arrival) * 1e3,
                            ((seq.first_token or end) - seq.arrival) * 1e3,
                            (end - seq.arrival) * 1e3, seq.index, dropped))
        if seq.index == 0 and not seq.num_generated and seq.request.sampling.n > 1:
            # Ended before forking (cancelled, failed): its other samples end with it.
            for i in range(1, seq.request.sampling.n):
                seq.emit(FinalEvent(reason, len(seq.request.prompt_token_ids) - dropped, 0, 0,
                                    0.0, 0.0, (end - seq.arrival) * 1e3, i, dropped))

    def _publish_status(self) -> None:
        queued = sum(len(s.tokens) - s.num_computed_tokens for s in self._waiting) + sum(
            len(s.tokens) - s.num_computed_tokens for s in self._running
            if len(s.tokens) - s.num_computed_tokens > 1)
        bs = self.config.block_size
        self._status = EngineStatus(
            num_running_requests=len(self._running), num_waiting_requests=len(self._waiting),
            num_queued_prefill_tokens=queued, kv_used_tokens=self.pool.num_used_blocks * bs,
            kv_capacity_tokens=self.pool.config.num_tokens,
            kv_cached_tokens=self.cache.num_blocks * bs)
        if self.metrics:
            self.metrics.update_status(self._status)


def _salt(parent_hash: int) -> int:
    """Parent hash of the first block of an approximate (moved) chain: unrelated to every
    exact chain, the same in every process."""
    return xxhash.xxh3_64_intdigest(parent_hash.to_bytes(8, "little"), seed=0x5E1F7ED)
