"""The worker engine: continuous batching over a paged KV pool with exact prefix reuse.

`PagedEngine` runs the `Engine` contract (workerapi/api.py) on one background thread. Its
parts, one job each:

  worker/sequence.py   one sequence's state (tokens, block table, what is computed);
  worker/scheduler.py  admission, the step's batch (decodes first, prefill chunks under
                       a token budget), preemption;
  worker/reuse.py      the reuse planner: exact prefix hits, cached tails, shifted reuse
                       of overflowing prompts, and what a finished sequence leaves cached;
  worker/blocks.py     the one block-acquisition path (free -> evict -> preempt);
  worker/model_runner.py + paged_attention.py  the model over the pool, one flat batch.

This module is the loop. Calls from other threads become typed messages in the inbox
(`Submit`, `Cancel`, `Flush`, `CheckIntegrity`, `Call`, `Shutdown`); the engine thread drains
them between steps, so every structure below is touched by that thread only. A step:

1. ends cancelled requests, admits waiting ones, schedules a batch;
2. runs the model once (K/V written into the pool, attention through block tables),
   samples where a sequence's last pending token was computed, streams text, stops;
3. caches a sequence's prompt blocks as soon as its prefill has produced the first token
   (`ReusePlanner.commit`: published as `stored` then, not when the reply ends), and
   finishes sequences: their computed blocks go to the prefix cache (reuse planner), so
   the next turn of the conversation hits all of it.

Containment (docs/reliability.md): an exception inside a step is attributed to the
request that caused it, and only that request fails (FinishReason.ERROR, every sample of
it; its blocks are released, none of its K/V is cached); the others go on with their
caches intact. (A request failing after its first token leaves its prompt's blocks
cached: that K/V was committed when it produced a token.) Admission fails the sequence
being admitted; a failed model forward is retried on halves of the batch until the
failing sequence is alone (the forward writes K/V only into each sequence's own slots
and nothing advances until it succeeds, so a retry is safe); sampling and streaming fail
the one sequence. Only an exception nothing can be attributed to (scheduling) fails
every running request, with FinishReason.FAILED: the service reports that without the
request marker, so the gateway retries it once.

A request with `sampling.n > 1` computes its prompt once: sample 0 forks the others when
its prompt is done (they share its full blocks and copy its partial one).

Context overflow (prefixgate.model.overflow, docs/reindex.md): a request whose prompt and
max_tokens exceed the context under "keep-system-drop-oldest" has its oldest turns
dropped at submission; the reuse planner may then reuse its kept turns from where an
earlier turn left them.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace

import torch

from prefixgate.model.detokenizer import Decoder, StreamDecoder
from prefixgate.model.overflow import plan_overflow
from prefixgate.wire.events import KVEventSink
from prefixgate.wire.protocol import clip
from prefixgate.worker.blocks import BlockManager
from prefixgate.worker.kv_pool import KVPool
from prefixgate.worker.model_runner import ModelRunner, pool_config_for
from prefixgate.worker.paged_attention import StepMetadata, resolve_backend
from prefixgate.worker.prefix_cache import PrefixCache
from prefixgate.worker.reindex import rope_spec_or_none
from prefixgate.worker.reuse import ReusePlanner
from prefixgate.worker.sampling import Sampler
from prefixgate.worker.scheduler import Batch, Scheduler
from prefixgate.worker.sequence import Sequence
from prefixgate.workerapi.api import (
    EmitFn,
    Engine,
    EngineConfig,
    EngineStatus,
    FinalEvent,
    FinishReason,
    Request,
    TokenEvent,
    TokenLogprob,
)
from prefixgate.workerapi.metrics import WorkerMetrics

log = logging.getLogger(__name__)


# --- inbox messages (any thread -> engine thread) ---------------------------------------

@dataclass(frozen=True)
class Submit:
    request: Request
    emit: EmitFn
    arrival: float


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class Flush:
    done: Future[int]  # the number of cached tokens dropped


@dataclass(frozen=True)
class CheckIntegrity:
    done: Future[None]  # AssertionError naming the first broken invariant


@dataclass(frozen=True)
class Call:
    fn: Callable[[], object]  # run on the engine thread between steps
    done: Future[object]


@dataclass(frozen=True)
class Shutdown:
    pass


Message = Submit | Cancel | Flush | CheckIntegrity | Call | Shutdown


class PagedEngine(Engine):
    def __init__(self, model: torch.nn.Module, tokenizer: Decoder, config: EngineConfig,
                 event_sink: KVEventSink | None = None,
                 metrics: WorkerMetrics | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.pool = KVPool(pool_config_for(model, config.block_size, config.num_blocks))
        self.runner = ModelRunner(model, self.pool, num_token_ids=tokenizer.vocab_size)
        self.attention_backend = resolve_backend(config.attention_backend, self.pool,
                                                 model.config.num_attention_heads)
        self.cache = PrefixCache(self.pool, event_sink)
        self.blocks = BlockManager(self.pool, self.cache, metrics)
        self.reuse = ReusePlanner(config, self.cache, self.blocks, rope_spec_or_none(model))
        self.scheduler = Scheduler(config, self.blocks, self.reuse, metrics)
        self._metrics = metrics
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._cancelled: set[str] = set()
        self._status = EngineStatus(0, 0, 0, 0, self.pool.config.num_tokens)
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        from prefixgate.worker.kv_transfer import PagedBlockTransfer

        self._transfer = PagedBlockTransfer(self) if config.enable_prefix_cache else None

    @property
    def metrics(self) -> WorkerMetrics | None:
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: WorkerMetrics | None) -> None:
        self._metrics = self.blocks.metrics = self.scheduler.metrics = metrics

    @property
    def capacity_tokens(self) -> int:
        return self.pool.config.num_tokens

    @property
    def context_overflow(self) -> str:
        return self.config.context_overflow

    @property
    def transfer(self):
        return self._transfer

    # --- contract (any thread) ------------------------------------------------------------

    def submit(self, request: Request, emit: EmitFn) -> None:
        self._inbox.put(Submit(request, emit, time.monotonic()))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(Cancel(request_id))

    def status(self) -> EngineStatus:
        return self._status

    def flush_cache(self) -> int:
        done: Future[int] = Future()
        self._inbox.put(Flush(done))
        return done.result(timeout=60)

    def on_engine_thread(self, fn: Callable[[], object], timeout_s: float = 60.0) -> object:
        """Run `fn` on the engine thread between steps and return its result (raise its
        exception). For short changes of the cache or pool from other threads."""
        if not self._thread.is_alive():
            raise RuntimeError("the engine has stopped")
        done: Future[object] = Future()
        self._inbox.put(Call(fn, done))
        return done.result(timeout=timeout_s)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every pool reference is accounted for: each block's
        reference count equals its references from the prefix cache (tree and tails) plus
        its occurrences in live block tables, and the free list holds exactly the blocks
        with none. Checked between steps on the engine thread (directly once stopped)."""
        done: Future[None] = Future()
        if self._thread.is_alive():
            self._inbox.put(CheckIntegrity(done))
        # The loop may stop (Shutdown queued first) without reaching the message: then the
        # pool is no longer touched by anyone and is checked here.
        for _ in range(600):
            if not self._thread.is_alive() and not done.done():
                self._check_integrity()
                return
            with contextlib.suppress(FutureTimeout):
                return done.result(timeout=0.1)
        raise FutureTimeout("the engine thread did not check its integrity within 60 s")

    def shutdown(self) -> None:
        self._inbox.put(Shutdown())
        self._thread.join()

    # --- engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            try:
                msg: Message | None = self._inbox.get(block=self.scheduler.idle)
            except queue.Empty:
                msg = None
            while msg is not None:
                if isinstance(msg, Shutdown):
                    for seq in self.scheduler.sequences():
                        self._finish(seq, FinishReason.CANCELLED)
                    return
                self._handle(msg)
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    msg = None
            try:
                self._step()
            except Exception:  # unattributed (see Containment): fail the step's requests
                log.exception("engine step failed; failing every running request")
                for seq in list(self.scheduler.running):
                    self._finish(seq, FinishReason.FAILED)
            self._publish_status()

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, Submit):
            seq = Sequence(msg.request, msg.emit, Sampler(msg.request.sampling),
                           StreamDecoder(self.tokenizer, msg.request.sampling.stop),
                           list(msg.request.prompt_token_ids), arrival=msg.arrival)
            if self._plan_overflow(seq):
                self.scheduler.waiting.append(seq)
        elif isinstance(msg, Cancel):
            self._cancelled.add(msg.request_id)
        elif isinstance(msg, Flush):
            msg.done.set_result(self.cache.flush())
        elif isinstance(msg, Call):
            try:
                msg.done.set_result(msg.fn())
            except Exception as exc:
                msg.done.set_exception(exc)
        elif isinstance(msg, CheckIntegrity):
            try:
                self._check_integrity()
                msg.done.set_result(None)
            except AssertionError as e:
                msg.done.set_exception(e)

    def _plan_overflow(self, seq: Sequence) -> bool:
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
                 seq.request_id, plan.dropped_tokens, len(plan.full),
                 self.config.max_context_tokens)
        if len(seq.tokens) < self.config.max_context_tokens:
            return True  # may still end LENGTH early: the context is what is left
        log.warning("request %s: the system prompt and the last turn alone (%d tokens) fill "
                    "the context of %d", seq.request_id, len(seq.tokens),
                    self.config.max_context_tokens)
        for i in range(sampling.n):
            seq.emit(FinalEvent(FinishReason.LENGTH, len(seq.tokens), 0, 0, 0.0, 0.0,
                                (time.monotonic() - seq.arrival) * 1e3, i, plan.dropped_tokens))
        return False

    def _step(self) -> None:
        if self._cancelled:
            for seq in self.scheduler.sequences():
                if seq.request_id in self._cancelled:
                    self._finish(seq, FinishReason.CANCELLED)
            self._cancelled.clear()
        self._admit()
        batch = self.scheduler.schedule()
        if batch:
            self._run(batch)

    def _admit(self) -> None:
        """Admit waiting sequences; one whose admission raises fails alone."""
        while True:
            before = self.scheduler.sequences()
            try:
                self.scheduler.admit()
                return
            except Exception as exc:
                # The failing sequence is the one being admitted: popped from the queue but
                # not running yet, or still at its head.
                live = set(map(id, self.scheduler.sequences()))
                lost = [s for s in before if id(s) not in live]
                self._fail(lost[0] if lost else self.scheduler.waiting[0], exc)

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        """End `seq`'s request (all its samples) with ERROR: the step raised on it."""
        log.error("request %s failed in the engine and alone (the others go on): %s: %s",
                  clip(seq.request_id), type(exc).__name__, exc, exc_info=exc)
        samples = [s for s in self.scheduler.sequences() if s.request is seq.request]
        for sample in [seq, *(s for s in samples if s is not seq)]:
            self._finish(sample, FinishReason.ERROR)

    def _run(self, batch: Batch) -> None:
        for seq, row in self._forward(batch):
            try:
                first = not seq.num_generated
                if first and seq.request.sampling.n > 1 and seq.index == 0:
                    for child in self._fork(seq):
                        token = child.sampler.sample(row)
                        self._append(child, token, child.sampler.logprobs(row, token))
                token = seq.sampler.sample(row)
                if first:  # the prompt is computed and produced a token: cache and publish it
                    self.reuse.commit(seq)
                self._append(seq, token, seq.sampler.logprobs(row, token))
            except Exception as exc:
                self._fail(seq, exc)

    def _forward(self, batch: Batch) -> list[tuple[Sequence, torch.Tensor]]:
        """Run the model on `batch`: (sequence, next-token logits) for every sequence whose
        last pending token was computed. A forward that raises is retried on each half of
        the batch; a sequence that fails alone fails its request."""
        try:
            return self._forward_once(batch)
        except Exception as exc:
            if len(batch) == 1:
                self._fail(batch[0][0], exc)
                return []
        mid = len(batch) // 2
        return self._forward(batch[:mid]) + self._forward(batch[mid:])

    def _forward_once(self, batch: Batch) -> list[tuple[Sequence, torch.Tensor]]:
        input_ids: list[int] = []
        positions: list[int] = []
        sample_indices: list[int] = []
        samplers: list[Sequence] = []
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
                                  [n for _, n in batch], self.attention_backend)
        logits = self.runner.forward(input_ids, positions, step, sample_indices)
        for seq, n in batch:
            seq.advance(n)
        return list(zip(samplers, logits, strict=True))

    def _fork(self, parent: Sequence) -> list[Sequence]:
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
            child = Sequence(req, parent.emit, Sampler(sampling),
                             StreamDecoder(self.tokenizer, sampling.stop),
                             list(parent.tokens), arrival=parent.arrival, index=i,
                             overflow=parent.overflow,
                             block_hashes=list(parent.block_hashes),
                             first_scheduled=parent.first_scheduled)
            child.num_cached_tokens = parent.num_cached_tokens
            self.pool.ref(parent.block_table[:full])
            child.block_table = parent.block_table[:full]
            if partial:
                copy = self.blocks.acquire(1)
                if copy is None:  # no room to share: this sample recomputes its prompt later
                    self.blocks.release(child)
                    self.scheduler.waiting.append(child)
                    continue
                self.pool.copy_prefix(parent.block_table[full], copy[0], partial)
                child.block_table += copy
            child.num_computed_tokens = parent.num_computed_tokens
            self.scheduler.running.append(child)
            children.append(child)
        return children

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> None:
        now = time.monotonic()
        lp = (logprob,) if logprob is not None else ()
        if self._metrics:
            if seq.first_token:
                self._metrics.inter_token.observe(now - seq.last_token)
            else:
                self._metrics.ttft.observe(now - seq.arrival)
        seq.first_token = seq.first_token or now
        seq.last_token = now
        seq.tokens.append(token)
        sampling = seq.request.sampling
        if token in self.config.eos_token_ids or token in sampling.stop_token_ids:
            seq.emit(TokenEvent((token,), seq.decoder.flush(), seq.index, lp))
            self._finish(seq, FinishReason.STOP)
            return
        text = seq.decoder.push(token)
        if seq.decoder.stopped:
            seq.emit(TokenEvent((token,), text, seq.index, lp))
            self._finish(seq, FinishReason.STOP)
        elif seq.num_generated >= sampling.max_tokens or \
                len(seq.tokens) >= self.config.max_context_tokens:
            seq.emit(TokenEvent((token,), text + seq.decoder.flush(), seq.index, lp))
            self._finish(seq, FinishReason.LENGTH)
        else:
            seq.emit(TokenEvent((token,), text, seq.index, lp))

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.remove(seq)
        if reason in (FinishReason.ERROR, FinishReason.FAILED):
            self.blocks.release(seq)  # its K/V may be wrong: cache none of it
        else:
            self.reuse.store(seq)
        end = time.monotonic()
        start = seq.first_scheduled or end
        prompt_tokens = len(seq.request.prompt_token_ids) - seq.num_dropped_tokens
        seq.emit(FinalEvent(reason, prompt_tokens, max(seq.num_cached_tokens, 0),
                            seq.num_generated, (start - seq.arrival) * 1e3,
                            ((seq.first_token or end) - seq.arrival) * 1e3,
                            (end - seq.arrival) * 1e3, seq.index, seq.num_dropped_tokens))
        if seq.index == 0 and not seq.num_generated and seq.request.sampling.n > 1:
            # Ended before forking (cancelled, failed): its other samples end with it.
            for i in range(1, seq.request.sampling.n):
                seq.emit(FinalEvent(reason, prompt_tokens, 0, 0, 0.0, 0.0,
                                    (end - seq.arrival) * 1e3, i, seq.num_dropped_tokens))

    def _publish_status(self) -> None:
        bs = self.config.block_size
        self._status = EngineStatus(
            num_running_requests=len(self.scheduler.running),
            num_waiting_requests=len(self.scheduler.waiting),
            num_queued_prefill_tokens=self.scheduler.num_queued_prefill_tokens(),
            kv_used_tokens=self.pool.num_used_blocks * bs,
            kv_capacity_tokens=self.pool.config.num_tokens,
            kv_cached_tokens=self.cache.num_blocks * bs)
        if self._metrics:
            self._metrics.update_status(self._status)

    def _check_integrity(self) -> None:
        expected = [0] * self.pool.config.num_blocks
        for block in self.cache.referenced_blocks():
            expected[block] += 1
        live = self.scheduler.sequences()
        for seq in live:
            for block in seq.block_table:
                expected[block] += 1
        for block, want in enumerate(expected):
            got = self.pool.refcount(block)
            assert got == want, (f"block {block}: {got} pool references, {want} from the "
                                 "prefix cache and block tables")
        self.pool.check_free_list()
        holders = sum(seq.cache_handle is not None for seq in live)
        assert holders or self.cache.tree.num_locked_blocks == 0, \
            "cache blocks locked with no sequence holding a lock"
