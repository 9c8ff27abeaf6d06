"""Worker engines: turn requests of token ids into streams of generated tokens.

`Engine` is the contract the Worker gRPC service is written against; `SimpleEngine` is
the first implementation: one request at a time on a background thread, with a small
LRU of contiguous transformers caches for prefix reuse. The paged engine (paged KV pool,
radix-tree prefix cache, continuous batching, eviction events) replaces it behind the
same contract.
"""

from __future__ import annotations

import copy
import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch
from transformers import DynamicCache

from prefixgate.worker.detokenizer import Decoder, StreamDecoder
from prefixgate.worker.sampling import Sampler, SamplingConfig

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


@dataclass(frozen=True)
class FinalEvent:
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_ms: float
    ttft_ms: float
    total_ms: float


Event = TokenEvent | FinalEvent
EmitFn = Callable[[Event], None]


@dataclass(frozen=True)
class EngineStatus:
    num_running_requests: int
    num_waiting_requests: int
    num_queued_prefill_tokens: int
    kv_used_tokens: int
    kv_capacity_tokens: int


class Engine(ABC):
    """Contract shared by all engines.

    - `submit` is thread-safe and returns at once. `emit` is then called from the engine's
      thread with zero or more TokenEvents and exactly one FinalEvent, in order; it must
      not block (the gRPC service hands events to its event loop).
    - `cancel` is idempotent; a cancelled request frees its resources at its next step
      and ends with FinalEvent(CANCELLED).
    - `status`, `flush_cache` are thread-safe. `shutdown` finishes nothing new and returns
      once the engine thread has stopped.
    """

    @abstractmethod
    def submit(self, request: Request, emit: EmitFn) -> None: ...

    @abstractmethod
    def cancel(self, request_id: str) -> None: ...

    @abstractmethod
    def status(self) -> EngineStatus: ...

    @abstractmethod
    def flush_cache(self) -> int:
        """Drop every cached prefix; returns the number of cached tokens dropped."""

    @abstractmethod
    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class SimpleEngineConfig:
    # Contiguous caches kept for prefix reuse (each holds one sequence's full KV).
    max_cached_sequences: int = 8
    eos_token_ids: tuple[int, ...] = ()
    max_context_tokens: int = 2048


@dataclass
class _Pending:
    request: Request
    emit: EmitFn
    arrival: float = field(default_factory=time.monotonic)


class SimpleEngine(Engine):
    """One request at a time; prefix reuse through an LRU of (tokens, DynamicCache).

    A hit copies the cached KV of the longest matching sequence and crops it to the
    common prefix (never the whole prompt: the last prompt token is always computed to
    get logits). Correct and simple; its cost is a copy per hit and one sequence at a
    time, which is what the paged engine removes.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Decoder,
                 config: SimpleEngineConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        # (namespace, tokens) -> cache holding exactly those tokens' KV
        self._cache: OrderedDict[tuple[str, tuple[int, ...]], DynamicCache] = OrderedDict()
        self._waiting_prefill_tokens = 0
        self._running = 0
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # --- contract -----------------------------------------------------------------------

    def submit(self, request: Request, emit: EmitFn) -> None:
        with self._lock:
            self._waiting_prefill_tokens += len(request.prompt_token_ids)
        self._queue.put(_Pending(request, emit))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def status(self) -> EngineStatus:
        with self._lock:
            used = sum(len(k[1]) for k in self._cache)
            return EngineStatus(
                num_running_requests=self._running,
                num_waiting_requests=self._queue.qsize(),
                num_queued_prefill_tokens=self._waiting_prefill_tokens,
                kv_used_tokens=used,
                kv_capacity_tokens=self.config.max_cached_sequences * self.config.max_context_tokens,
            )

    def flush_cache(self) -> int:
        with self._lock:
            dropped = sum(len(k[1]) for k in self._cache)
            self._cache.clear()
        return dropped

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join()

    # --- engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            with self._lock:
                self._running = 1
                self._waiting_prefill_tokens -= len(item.request.prompt_token_ids)
            try:
                self._run(item)
            except Exception as exc:  # never let one request kill the engine thread
                log.exception("request %s failed: %s", item.request.request_id, exc)
                item.emit(FinalEvent(FinishReason.ERROR, len(item.request.prompt_token_ids),
                                     0, 0, 0.0, 0.0, (time.monotonic() - item.arrival) * 1e3))
            finally:
                with self._lock:
                    self._running = 0
                    self._cancelled.discard(item.request.request_id)

    def _is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._cancelled

    def _lookup(self, namespace: str, prompt: tuple[int, ...]) -> tuple[int, DynamicCache | None]:
        """Longest cached prefix of `prompt` (capped at len - 1) and a private cache copy."""
        best_len, best_key = 0, None
        with self._lock:
            for key in self._cache:
                if key[0] != namespace:
                    continue
                n = len(os.path.commonprefix([key[1], prompt]))
                if n > best_len:
                    best_len, best_key = n, key
            best_len = min(best_len, len(prompt) - 1)
            if best_key is None or best_len == 0:
                return 0, None
            self._cache.move_to_end(best_key)
            cache = copy.deepcopy(self._cache[best_key])
        # transformers' crop takes a negative count of tokens to drop from the end.
        if cache.get_seq_length() > best_len:
            cache.crop(best_len - cache.get_seq_length())
        return best_len, cache

    def _store(self, namespace: str, tokens: tuple[int, ...], cache: DynamicCache) -> None:
        with self._lock:
            self._cache[(namespace, tokens)] = cache
            self._cache.move_to_end((namespace, tokens))
            while len(self._cache) > self.config.max_cached_sequences:
                self._cache.popitem(last=False)

    @torch.inference_mode()
    def _run(self, item: _Pending) -> None:
        req, emit = item.request, item.emit
        start = time.monotonic()
        queue_ms = (start - item.arrival) * 1e3
        prompt = req.prompt_token_ids
        cached, cache = self._lookup(req.namespace, prompt)
        cache = cache if cache is not None else DynamicCache()
        sampler = Sampler(req.sampling)
        decoder = StreamDecoder(self.tokenizer, req.sampling.stop)
        stop_ids = set(self.config.eos_token_ids) | set(req.sampling.stop_token_ids)
        limit = min(req.sampling.max_tokens, self.config.max_context_tokens - len(prompt))
        tokens = list(prompt)
        generated: list[int] = []
        ttft_ms = 0.0
        finish = FinishReason.LENGTH
        new_ids = torch.tensor([prompt[cached:]])
        while len(generated) < limit:
            if self._is_cancelled(req.request_id):
                finish = FinishReason.CANCELLED
                break
            out = self.model(input_ids=new_ids, past_key_values=cache, use_cache=True,
                             logits_to_keep=1)
            token = sampler.sample(out.logits[0, -1])
            generated.append(token)
            tokens.append(token)
            if not ttft_ms:
                ttft_ms = (time.monotonic() - item.arrival) * 1e3
            if token in stop_ids:
                finish = FinishReason.STOP
                emit(TokenEvent((token,), decoder.flush()))
                break
            text = decoder.push(token)
            emit(TokenEvent((token,), text))
            if decoder.stopped:
                finish = FinishReason.STOP
                break
            new_ids = torch.tensor([[token]])
        else:
            tail = decoder.flush()
            if tail:
                emit(TokenEvent((), tail))
        # The cache holds KV for every token fed to the model: all but the last sampled.
        self._store(req.namespace, tuple(tokens[:cache.get_seq_length()]), cache)
        emit(FinalEvent(finish, len(prompt), cached, len(generated), queue_ms, ttft_ms,
                        (time.monotonic() - item.arrival) * 1e3))
