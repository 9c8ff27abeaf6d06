"""Long tokenizations off the gateway's event loop, on a bounded pool (torch-free).

Contract
--------
`TokenizePool(threads, max_waiting).run(num_chars, fn, *args)` returns `fn(*args)`, a
tokenizer call on `num_chars` characters: inline when the text is short
(`INLINE_CHARS`), else on one of `threads` threads. At most `threads` tokenizations run
and at most `max_waiting` more wait; one beyond that raises `TokenizerBusy` at once
(the gateway answers RESOURCE_EXHAUSTED / HTTP 429) instead of queueing without bound.

Why bounded: a tokenization holds its text, the encoding and its offsets (tens of MB for
a 512 KiB prompt), so an unbounded queue, or one thread per core on a 16-core node, let a
burst of long prompts take the gateway past its pod's memory limit (1.6-2 GB measured
with 64 such requests). Memory in tokenizing is now bounded by `threads` prompts, time by
`max_waiting` more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# Text shorter than this is tokenized on the event loop: handing it to a thread costs
# ~50 us, what tokenizing ~100 characters costs (~0.5 us a character on SmolLM2's
# tokenizer, chat template included); longer text would stall every stream meanwhile.
INLINE_CHARS = 128


class TokenizerBusy(Exception):
    """Every tokenizer thread is busy and the waiting line is full; `str(exc)` says so."""


class TokenizePool:
    def __init__(self, threads: int, max_waiting: int) -> None:
        if threads < 1 or max_waiting < 0:
            raise ValueError("tokenize threads must be >= 1 and the waiting line >= 0")
        self.threads = threads
        self.max_waiting = max_waiting
        self.in_flight = 0  # running + waiting (event-loop side: no lock needed)
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    async def run(self, num_chars: int, fn: Callable[..., T], *args: object) -> T:
        if num_chars < INLINE_CHARS:
            return fn(*args)
        if self.in_flight >= self.threads + self.max_waiting:
            raise TokenizerBusy(
                f"the gateway is tokenizing {self.in_flight} long prompts already (its "
                f"--tokenize-threads {self.threads} plus --max-tokenize-waiting "
                f"{self.max_waiting}): retry shortly, or send token ids")
        self.in_flight += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        """Stop the threads (tokenizations in progress finish)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
