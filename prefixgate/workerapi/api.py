"""The engine contract: requests in, events out, status, configuration.

`Engine` is what the Worker gRPC service (workerapi/server.py) is written against; the one
implementation is `prefixgate.worker.engine.PagedEngine`. Everything here is plain data
or an abstract method, so the engine's parts (sequence state, scheduler, reuse planner,
block acquisition) import it without importing each other.
"""

from __future__ import annotations

import queue
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from prefixgate.wire.protocol import SamplingConfig

if TYPE_CHECKING:
    from prefixgate.workerapi.transfer import BlockTransfer


class FinishReason(Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"  # the engine failed on this request alone; the service reports INTERNAL
    # The engine failed as a whole, not because of this request (docs/reliability.md):
    # another worker may serve it.
    FAILED = "failed"


@dataclass(frozen=True)
class Request:
    """One generation request. `prompt_token_ids` is non-empty and, with
    `sampling.max_tokens`, fits the model's context (the service validates this)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingConfig
    namespace: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    """Log probabilities at one generated position (SamplingConfig.top_logprobs): the
    generated token's, and the most likely tokens' (most likely first)."""

    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    text: str
    index: int = 0  # sample index, 0..n-1
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asked


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
    # Token ids opening a user turn in the chat template (prefixgate.model.overflow.user_turn_prefix);
    # empty: no turn can be dropped.
    turn_prefix: tuple[int, ...] = ()
    # How an overflowing turn reuses its kept turns' KV: "recompute", "shift" or "blend".
    shifted_reuse: str = "blend"
    blend_tokens: int = 64  # recomputed after the gap under "blend" (docs/reindex.md)
    reindex_backend: str = "auto"  # "torch", "triton" or "auto" (triton on CUDA)
    # Key of prefixgate.worker.paged_attention.BACKENDS that attends every step, or
    # "auto" (the fastest that runs here: paged_attention.resolve_backend).
    attention_backend: str = "auto"

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)


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
        """Overflow policy for requests that leave it unset (prefixgate.model.overflow.POLICIES)."""
        return "fail"

    @property
    def reports_logprobs(self) -> bool:
        """Whether TokenEvents carry the logprobs a request asks for (SamplingConfig.
        top_logprobs); an engine without a model (emulation) cannot, and the service
        refuses such requests instead of answering without them."""
        return True

    @property
    def transfer(self) -> BlockTransfer | None:
        """This engine's side of block transfer (workerapi/transfer.py); None: it cannot
        export or import KV blocks."""
        return None

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

    def run_batch(self, requests: Sequence[Request], timeout_s: float = 600.0
                  ) -> list[FinalEvent]:
        """Submit every request at once (so they share steps) and block until each ends:
        their sample-0 final events, in order. For benchmarks; the service streams."""
        queues: list[queue.Queue[Event]] = []
        for request in requests:
            queues.append(queue.Queue())
            self.submit(request, queues[-1].put)
        finals: list[FinalEvent] = []
        for events in queues:
            while not (isinstance(ev := events.get(timeout=timeout_s), FinalEvent)
                       and ev.index == 0):
                pass
            finals.append(ev)
        return finals

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
