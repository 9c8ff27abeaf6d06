"""An emulated engine: the `workerapi.api.Engine` contract with no model (torch-free).

`prefixgate worker --emulate` serves it through the real `WorkerService`, so gateways see
a real worker over gRPC: Generate, GetInfo, GetStatus, FlushCache, WatchEvents and, with
Redis, a lease and published KV events, from the same `EventLog` a real worker uses.

Model of one worker (EmulationConfig; times below are *emulated* seconds, which run
`time_scale` times faster than wall-clock seconds):

  cache    a `RadixTree` of the prompt's chained block hashes (the real `BlockHasher`,
           salted with the model fingerprint and the request's namespace: exactly the keys
           a real worker caches and publishes), at most `capacity_blocks` blocks, least
           recently used leaves evicted first. Blocks of a request being served are locked
           (they may hold the cache over its capacity until the request ends).
  prefill  one prompt at a time, first come first served. At its start a request matches
           its prompt's leading cached blocks (cached tokens = blocks x block size, at most
           prompt - 1 tokens), then takes (prompt - cached) / `service.prefill_tokens_per_s`. The
           schedule is computed from arrival times (a late timer on a busy host delays what
           the worker sends, never the emulated start of the next prefill or the reported
           timings).
  publish  when the prefill completes (`publish_at` "prefill"), the prompt's full blocks
           enter the cache and the event log (`stored`), as an engine's do once computed;
           evictions publish `removed`. When the reply ends, the full blocks of prompt +
           reply are stored (`publish_at` "finish": only then, prompt included, as engines
           that publish with the reply do: the window in which a gateway cannot know them
           from events is the whole request).
  decode   batched, never slowing prefill: the first token at the end of the prefill
           (TTFT = queue + prefill), the rest `service.decode_s_per_token` apart; the reply is
           streamed as the first token, then the remaining tokens in one chunk at the end
           (the gateway's per-chunk work stays small). Reply token ids are a deterministic
           function of the prompt, so equal prompts give equal replies (as greedy
           decoding does).
  transfer with a link (`kv_bytes_per_token`, `transfer_bytes_per_s`) the worker exports
           and imports blocks through the real WorkerService path, timed as the model's
           bytes on that link (emulate/transfer.py); a Generate with a pull first pulls
           (the WorkerService does), then queues for the rest's prefill.
  status   `num_queued_prefill_tokens`: the uncached prompt tokens of the requests waiting
           or in prefill (the one in prefill with the share of it not yet computed; the
           others with their expected uncached part when they arrived, counting as
           cached the blocks that the requests ahead of them store at their prefill's end:
           a burst sharing a new prefix is one prefill of it, BlockCache.reserve);
           `num_running_requests`: requests decoding; `num_waiting_requests`: queued.

The final event reports prompt and cached tokens and the worker-side timings (queue, TTFT,
total; emulated milliseconds). `records` keeps one `ServedRecord` per finished request
for the fleet's report (hit and TTFT measured at the workers).

All state lives on the asyncio loop of the first `submit`; `submit` and `cancel` may be
called from any thread. `status` reads one immutable snapshot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

import xxhash

from prefixgate.emulate.cache import BlockCache
from prefixgate.emulate.service import ServiceModel
from prefixgate.radix import BlockHasher, Hashers, Node
from prefixgate.wire.events import KVEventSink
from prefixgate.workerapi.api import (
    EmitFn,
    Engine,
    EngineStatus,
    FinalEvent,
    FinishReason,
    Request,
    TokenEvent,
)

__all__ = ["PUBLISH_AT", "EmulatedEngine", "EmulationConfig", "ServedRecord",
           "prefill_computed", "reply_token_ids"]

PUBLISH_AT = ("prefill", "finish")


def prefill_computed(uncached: int, start: float, end: float, now: float) -> int:
    """Tokens computed by `now` of a prefill of `uncached` tokens that runs from `start` to
    `end` at an even rate (what a worker's status no longer counts as queued)."""
    if end <= start:
        return 0
    return int(uncached * min(1.0, max(0.0, (now - start) / (end - start))))


# Reply token ids avoid the lowest ids, where tokenizers keep their special tokens.
_FIRST_REPLY_TOKEN_ID = 256


@dataclass(frozen=True)
class EmulationConfig:
    """One emulated worker. Units: blocks, tokens, emulated seconds."""

    capacity_blocks: int = 4000
    block_size: int = 512
    service: ServiceModel = ServiceModel()  # prefill and decode speed (emulate/service.py)
    time_scale: float = 1.0  # emulated seconds per wall-clock second
    model_fingerprint: str = ""
    vocab_size: int = 32000
    max_context_tokens: int = 1 << 20
    # When a prompt's blocks are cached and published: "prefill" (when its prefill
    # completes, as engines that publish computed blocks do, prefixgate's included) or
    # "finish" (with the reply, when the request ends: the widest window for the race).
    publish_at: str = "prefill"
    # Block transfer (emulate/transfer.py): the KV bytes one token of the emulated model
    # takes and the worker's link, bytes per emulated second; 0 for either: none.
    kv_bytes_per_token: int = 0
    transfer_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.publish_at not in PUBLISH_AT:
            raise ValueError(f"publish_at must be one of {PUBLISH_AT}, not {self.publish_at!r}")
        if self.capacity_blocks < 1 or self.block_size < 1:
            raise ValueError("capacity_blocks and block_size must be >= 1")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")


@dataclass(frozen=True, slots=True)
class ServedRecord:
    """One finished request as the worker saw it (emulated seconds)."""

    request_id: str
    arrival_unix_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_s: float
    ttft_s: float
    total_s: float
    finish_reason: str
    # How much later than its computed time the first token left (emulated seconds): the
    # host's delay of this worker's timer, which the timings above leave out.
    first_token_late_s: float = 0.0


def reply_token_ids(prompt_hashes: list[int], root_hash: int, num_tokens: int,
                    vocab_size: int) -> list[int]:
    """The emulated reply: token i = first + XXH64(u32(i), seed=h) mod span, where h is the
    hash of the prompt's last full block (or the namespace's root hash) mixed with the
    prompt length, so equal prompts give equal replies."""
    first = _FIRST_REPLY_TOKEN_ID if vocab_size > 2 * _FIRST_REPLY_TOKEN_ID else 0
    span = vocab_size - first
    seed = (prompt_hashes[-1] if prompt_hashes else root_hash) % 2**64
    f = xxhash.xxh64_intdigest
    return [first + f(i.to_bytes(4, "little"), seed) % span for i in range(num_tokens)]


@dataclass(eq=False)
class _Req:
    request: Request
    emit: EmitFn
    arrival: float  # wall clock (loop time)
    hashes: list[int]  # the prompt's full blocks
    hasher: BlockHasher
    expected_uncached: int = 0
    cached: int = 0
    started: float = 0.0
    first_token: float = 0.0
    first_token_late: float = 0.0  # loop seconds the first token left after first_token
    done_at: float = 0.0
    handle: Node[int] | None = None
    timer: asyncio.TimerHandle | None = None
    stage: str = "queued"  # queued | prefill | decode | done
    reserved: bool = False  # its blocks are reserved in the cache (BlockCache.reserve)
    reply: list[int] = field(default_factory=list)


class EmulatedEngine(Engine):
    @property
    def reports_logprobs(self) -> bool:  # no model, no probabilities
        return False

    def __init__(self, config: EmulationConfig, events: KVEventSink | None = None) -> None:
        self.config = config
        self.cache = BlockCache(config.capacity_blocks, events)
        self.records: list[ServedRecord] = []
        self._hashers = Hashers(self.config.block_size, self.config.model_fingerprint)
        self._queue: deque[_Req] = deque()
        self._prefilling: _Req | None = None
        self._decoding: dict[str, _Req] = {}
        self._by_id: dict[str, _Req] = {}
        self._queued_tokens = 0
        self._free_at = 0.0  # loop time the current prefill ends (computed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._status = self._snapshot()
        self._transfer = None
        if config.kv_bytes_per_token > 0 and config.transfer_bytes_per_s > 0:
            from prefixgate.emulate.transfer import EmulatedTransfer

            self._transfer = EmulatedTransfer(self, config.kv_bytes_per_token,
                                              config.transfer_bytes_per_s)

    # ------------------------------------------------------------------ the contract

    @property
    def capacity_tokens(self) -> int:
        return self.config.max_context_tokens

    @property
    def transfer(self):
        """Block transfer (emulate/transfer.py); None without a link configured."""
        return self._transfer

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop the engine's state lives on, before the first `submit` (transfers
        change the cache from other threads through it)."""
        self._loop = self._loop or loop

    def refresh_status(self) -> None:
        """Recompute the status snapshot (after a change outside a request: a transfer)."""
        self._status = self._snapshot()

    def submit(self, request: Request, emit: EmitFn) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._loop.call_soon_threadsafe(self._arrive, request, emit, self._loop.time())

    def cancel(self, request_id: str) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._cancel, request_id)

    def status(self) -> EngineStatus:
        # The prompt in prefill counts with what is left of it, as a real engine's pending
        # tokens shrink chunk by chunk (worker/scheduler.py): a gateway must not see a long
        # prefill that is nearly done as a whole one ahead of the next turn.
        status, req, loop = self._status, self._prefilling, self._loop
        if req is None or loop is None:
            return status
        computed = prefill_computed(req.expected_uncached, req.started, req.first_token,
                                    loop.time())
        if not computed:
            return status
        return dataclasses.replace(status, num_queued_prefill_tokens=max(
            0, status.num_queued_prefill_tokens - computed))

    def flush_cache(self) -> int:
        n = self.cache.flush()
        self._status = self._snapshot()
        return n * self.config.block_size

    def shutdown(self) -> None:
        self._closed = True
        for req in list(self._by_id.values()):
            self._end(req, FinishReason.CANCELLED)

    # ------------------------------------------------------------------ the model

    def _wall(self, emulated_s: float) -> float:
        return emulated_s / self.config.time_scale

    def _usable(self, req: _Req) -> list[int]:
        # Cap the hit so that at least the last prompt token is computed.
        n = len(req.request.prompt_token_ids)
        return req.hashes[: (n - 1) // self.config.block_size]

    def _arrive(self, request: Request, emit: EmitFn, arrival: float) -> None:
        if self._closed:
            return
        hasher = self._hashers.get(request.namespace)
        req = _Req(request, emit, arrival, hasher.hash_blocks(request.prompt_token_ids), hasher)
        m = self.cache.expected(self._usable(req))
        req.expected_uncached = len(request.prompt_token_ids) - m * self.config.block_size
        if self.config.publish_at == "prefill":  # stored before the requests behind it start
            self.cache.reserve(req.hashes)
            req.reserved = True
        self._queued_tokens += req.expected_uncached
        self._by_id[request.request_id] = req
        self._queue.append(req)
        if self._prefilling is None:
            self._start_prefill()
        self._status = self._snapshot()

    def _start_prefill(self) -> None:
        if not self._queue:
            return
        req = self._queue.popleft()
        assert self._loop is not None
        req.handle, m = self.cache.acquire(self._usable(req))
        req.cached = m * self.config.block_size
        uncached = len(req.request.prompt_token_ids) - req.cached
        # The schedule is computed, not measured: the prefill starts when the worker is
        # free (the previous prefill's computed end) or the request arrived, whichever is
        # later, however late a busy host runs this callback; so worker-side timings are
        # the model's, and only arrival times carry the host's delays.
        req.started = max(req.arrival, self._free_at)
        req.first_token = self._free_at = req.started + self._wall(
            self.config.service.prefill_s(uncached))
        self._prefilling, req.stage = req, "prefill"
        req.timer = self._loop.call_at(req.first_token, self._prefill_done, req)

    def _prefill_done(self, req: _Req) -> None:
        assert self._loop is not None
        self._prefilling, req.stage = None, "decode"
        self._queued_tokens -= req.expected_uncached
        if self.config.publish_at == "prefill":
            req.handle = self.cache.store(req.handle, req.hashes)
        self._unreserve(req)
        max_tokens = req.request.sampling.max_tokens
        req.reply = reply_token_ids(req.hashes, req.hasher.root_hash, max_tokens,
                                    self.config.vocab_size)
        req.emit(TokenEvent((req.reply[0],), "x"))
        req.first_token_late = max(0.0, self._loop.time() - req.first_token)
        req.done_at = req.first_token + self._wall(
            self.config.service.decode_s(max_tokens - 1))
        if max_tokens > 1:
            self._decoding[req.request.request_id] = req
            req.timer = self._loop.call_at(req.done_at, self._decode_done, req)
        else:
            self._store_reply(req)
            self._end(req, FinishReason.LENGTH)
        self._start_prefill()
        self._status = self._snapshot()

    def _decode_done(self, req: _Req) -> None:
        rest = tuple(req.reply[1:])
        req.emit(TokenEvent(rest, "x" * len(rest)))
        self._store_reply(req)
        self._end(req, FinishReason.LENGTH)
        self._status = self._snapshot()

    def _store_reply(self, req: _Req) -> None:
        """Prompt and reply are computed (but the last reply token): cache their blocks."""
        tokens = (*req.request.prompt_token_ids, *req.reply[:-1])
        full = len(tokens) // self.config.block_size
        more: list[int] = []
        if full > len(req.hashes):
            bs = self.config.block_size
            more = req.hasher.hash_blocks(tokens[len(req.hashes) * bs: full * bs],
                                          parent_hash=req.hashes[-1] if req.hashes else None)
        if more or self.config.publish_at == "finish":
            req.handle = self.cache.store(req.handle, req.hashes + more)

    def _unreserve(self, req: _Req) -> None:
        if req.reserved:
            req.reserved = False
            self.cache.unreserve(req.hashes)

    def _cancel(self, request_id: str) -> None:
        req = self._by_id.get(request_id)
        if req is not None:
            self._end(req, FinishReason.CANCELLED)
            self._status = self._snapshot()

    def _end(self, req: _Req, reason: FinishReason) -> None:
        if req.stage == "done":
            return
        rid = req.request.request_id
        if req.timer is not None:
            req.timer.cancel()
        self._unreserve(req)
        if req.stage == "queued":
            self._queue.remove(req)
            self._queued_tokens -= req.expected_uncached
        elif req.stage == "prefill":
            self._prefilling = None
            self._queued_tokens -= req.expected_uncached
            if self._loop is not None and not self._closed:
                self._loop.call_soon(self._start_prefill)
        self._decoding.pop(rid, None)
        self._by_id.pop(rid, None)
        req.stage = "done"
        self.cache.release(req.handle)
        req.handle = None
        now = self._loop.time() if self._loop is not None else time.monotonic()
        if reason is not FinishReason.CANCELLED and req.done_at:
            now = req.done_at  # the computed end (see _start_prefill)
        scale = self.config.time_scale
        start = req.started or now
        first = req.first_token or now
        completion = len(req.reply) if reason is not FinishReason.CANCELLED else 0
        final = FinalEvent(reason, len(req.request.prompt_token_ids), req.cached, completion,
                           (start - req.arrival) * scale * 1e3,
                           (first - req.arrival) * scale * 1e3, (now - req.arrival) * scale * 1e3)
        if reason is not FinishReason.CANCELLED:
            self.records.append(ServedRecord(
                rid, time.time() - (now - req.arrival), final.prompt_tokens, req.cached,
                completion, final.queue_ms / 1e3, final.ttft_ms / 1e3, final.total_ms / 1e3,
                reason.value, req.first_token_late * scale))
        req.emit(final)

    def _snapshot(self) -> EngineStatus:
        bs = self.config.block_size
        return EngineStatus(
            num_running_requests=len(self._decoding), num_waiting_requests=len(self._queue),
            num_queued_prefill_tokens=self._queued_tokens,
            kv_used_tokens=self.cache.num_blocks * bs,
            kv_capacity_tokens=self.config.capacity_blocks * bs,
            kv_cached_tokens=self.cache.num_blocks * bs)
