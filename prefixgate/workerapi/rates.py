"""The service rates a worker measures on its own finished requests, for routing by cost.

Contract
--------
`ServiceRates.observe(final)` takes one finished request's `FinalEvent` (engine timings in
milliseconds from its arrival: queue until first scheduled, time to first token, total)
and keeps (exponentially weighted over about `window` requests):
  prefill_tokens_per_s  the rate of a `LinearFit` of (ttft - queue) against the uncached
                        prompt tokens: the prefill as it ran, with whatever decode steps
                        were interleaved with it, so a router needs no separate decode
                        term for it (WorkerStatus says so with prefill_chunk_tokens = 0),
                        less what any request pays whatever its length (the fit's set-up:
                        on a vLLM CPU server 0.3-0.4 s, which tokens over the whole time
                        of a 14-token prompt read as 31 tokens/s where the server
                        prefills 180); `observe_prefill(num_tokens, seconds)` adds one
                        such point (a start-up probe's);
  decode_step_s         (total - ttft) / (completion tokens - 1): seconds per output token
                        of a running sequence, i.e. per decode step at the batch it ran in.
A figure is 0 until a request could measure it (too few uncached tokens or output tokens,
or timings under a millisecond, are skipped: their ratio says nothing). Thread-safe
enough for one asyncio loop (the worker's server calls it); no I/O, torch-free.

`LinearFit(window)`: `setup_s + size / rate` fitted by least squares over about `window`
recent points (exponentially weighted means of size, seconds and their products), the
form of a prefill's and of a pull's cost. Until points of different sizes have been seen
(or when the fit is not a rate: non-positive slope or negative set-up), the set-up is 0
and the rate the mean size over the mean seconds.
"""

from __future__ import annotations

from prefixgate.workerapi.api import FinalEvent

MIN_PREFILL_TOKENS = 32  # fewer uncached tokens measure the step overhead, not the rate
MIN_MS = 1.0


class LinearFit:
    """`setup_s + size / rate`, fitted (module docstring). `rate` and `setup_s` are 0 until
    a point is seen."""

    def __init__(self, window: int = 10) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.alpha = 2.0 / (window + 1)
        self.rate = 0.0
        self.setup_s = 0.0
        self._means: list[float] | None = None  # size, seconds, size^2, size*seconds

    def observe(self, size: float, seconds: float) -> None:
        """One point: `size` units (tokens, bytes) took `seconds`; ignored unless both > 0."""
        if size <= 0 or seconds <= 0:
            return
        x, y = float(size), seconds
        sample = (x, y, x * x, x * y)
        if self._means is None:
            self._means = list(sample)
        else:
            a = self.alpha
            self._means = [m + a * (v - m) for m, v in zip(self._means, sample, strict=True)]
        mx, my, mxx, mxy = self._means
        var, cov = mxx - mx * mx, mxy - mx * my
        slope = cov / var if var > 0 else 0.0
        intercept = my - slope * mx
        if slope > 0 and intercept >= 0:
            self.rate, self.setup_s = 1.0 / slope, intercept
        else:  # one size so far, or noise: the plain rate
            self.rate, self.setup_s = mx / my, 0.0


class ServiceRates:
    def __init__(self, window: int = 20) -> None:
        self._prefill = LinearFit(window)  # checks the window
        self.alpha = 2.0 / (window + 1)
        self.decode_step_s = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._prefill.rate

    def _mean(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.alpha * (new - old)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """One prefill of `num_tokens` uncached tokens that took `seconds` (module
        docstring)."""
        self._prefill.observe(num_tokens, seconds)

    def observe(self, final: FinalEvent) -> None:
        prefill_ms = final.ttft_ms - final.queue_ms
        uncached = final.prompt_tokens - final.cached_tokens
        if uncached >= MIN_PREFILL_TOKENS and prefill_ms >= MIN_MS:
            self._prefill.observe(uncached, prefill_ms / 1e3)
        decode_ms = final.total_ms - final.ttft_ms
        if final.completion_tokens > 1 and decode_ms >= MIN_MS:
            self.decode_step_s = self._mean(
                self.decode_step_s, decode_ms / 1e3 / (final.completion_tokens - 1))


class TransferRate:
    """What a pull from a peer costs, as a router prices it: `setup_s + bytes /
    bytes_per_s` (set-up: the calls, pins and reservations a pull makes whatever its size;
    then the bytes at the link's rate), a `LinearFit` over about `window` recent pulls:
    small pulls pin down the set-up, large ones the rate, so neither is mistaken for the
    other (a rate alone, averaged over pulls of every size, prices a small pull at a
    fraction of what its set-up takes).

    Before the first pull a worker still needs a figure, or no router ever offers it a
    pull (and so it never measures one): `assume(bytes_per_s, setup_s, source)` sets one
    that the first pull replaces. `source` says where the figures come from, in order of
    precedence: "measured" (this worker's own pulls), then "probed" (its start-up round
    trip through its own copy path, workerapi/server.py `probe_transfer`) or "declared" (the
    link rate it was started with, `--transfer-bytes-per-s`), else "" (0: none)."""

    def __init__(self, window: int = 10) -> None:
        self._fit = LinearFit(window)
        self.bytes_per_s = 0.0
        self.setup_s = 0.0
        self.source = ""

    def assume(self, bytes_per_s: float, setup_s: float, source: str) -> None:
        """Report these figures until a pull measures the real ones (ignored after one:
        a measurement outranks any declaration or probe)."""
        if source not in ("declared", "probed"):
            raise ValueError(f"source must be declared or probed, not {source!r}")
        if self.source == "measured" or bytes_per_s <= 0 or setup_s < 0:
            return
        self.bytes_per_s, self.setup_s, self.source = bytes_per_s, setup_s, source

    def adopt(self, bytes_per_s: float, setup_s: float) -> None:
        """Take figures measured where the pulls ran (a vLLM server's connector fits its own
        loads with a TransferRate of its own): source "measured", as if observed here."""
        if bytes_per_s > 0 and setup_s >= 0:
            self.bytes_per_s, self.setup_s, self.source = bytes_per_s, setup_s, "measured"

    def observe(self, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            return
        self.source = "measured"
        self._fit.observe(num_bytes, seconds)
        self.bytes_per_s, self.setup_s = self._fit.rate, self._fit.setup_s
