"""The service rates a worker measures on its own finished requests, for routing by cost.

Contract
--------
`ServiceRates.observe(final)` takes one finished request's `FinalEvent` (engine timings in
milliseconds from its arrival: queue until first scheduled, time to first token, total)
and keeps running means (exponentially weighted over about `window` requests):
  prefill_tokens_per_s  uncached prompt tokens / (ttft - queue): the prefill as it ran,
                        with whatever decode steps were interleaved with it, so a router
                        needs no separate decode term for it (WorkerStatus says so with
                        prefill_chunk_tokens = 0);
  decode_step_s         (total - ttft) / (completion tokens - 1): seconds per output token
                        of a running sequence, i.e. per decode step at the batch it ran in.
A figure is 0 until a request could measure it (too few uncached tokens or output tokens,
or timings under a millisecond, are skipped: their ratio says nothing). Thread-safe
enough for one asyncio loop (the worker's server calls it); no I/O, torch-free.
"""

from __future__ import annotations

from prefixgate.worker.api import FinalEvent

MIN_PREFILL_TOKENS = 32  # fewer uncached tokens measure the step overhead, not the rate
MIN_MS = 1.0


class ServiceRates:
    def __init__(self, window: int = 20) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.alpha = 2.0 / (window + 1)
        self.prefill_tokens_per_s = 0.0
        self.decode_step_s = 0.0

    def _mean(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.alpha * (new - old)

    def observe(self, final: FinalEvent) -> None:
        prefill_ms = final.ttft_ms - final.queue_ms
        uncached = final.prompt_tokens - final.cached_tokens
        if uncached >= MIN_PREFILL_TOKENS and prefill_ms >= MIN_MS:
            self.prefill_tokens_per_s = self._mean(self.prefill_tokens_per_s,
                                                   uncached / (prefill_ms / 1e3))
        decode_ms = final.total_ms - final.ttft_ms
        if final.completion_tokens > 1 and decode_ms >= MIN_MS:
            self.decode_step_s = self._mean(
                self.decode_step_s, decode_ms / 1e3 / (final.completion_tokens - 1))


MIN_TRANSFER_BYTES = 64 << 10  # smaller pulls measure the call's latency, not the rate


class TransferRate:
    """Bytes per second of KV pulled from peers (running mean over about `window` pulls
    of at least MIN_TRANSFER_BYTES, set-up included: what a router pays); 0 until one."""

    def __init__(self, window: int = 10) -> None:
        self.alpha = 2.0 / (window + 1)
        self.bytes_per_s = 0.0

    def observe(self, num_bytes: int, seconds: float) -> None:
        if num_bytes < MIN_TRANSFER_BYTES or seconds <= 0:
            return
        rate = num_bytes / seconds
        old = self.bytes_per_s
        self.bytes_per_s = rate if old == 0.0 else old + self.alpha * (rate - old)
