"""The state of one sequence (one sample of one request) as the engine runs it.

Contract
--------
`tokens` is the prompt as kept (after overflow dropped turns) followed by the reply so
far. The first `num_computed_tokens` of them have their K/V in the blocks of
`block_table` (block i holds positions [i * block_size, (i + 1) * block_size)); the rest
are pending: one for a decoding sequence, a prompt suffix for a prefilling one.
`block_hashes` are the chained hashes of `tokens`' full blocks (kept current by the
reuse planner). `cache_handle` is the prefix-cache path the sequence holds locked (its
matched blocks); whoever releases `block_table` unlocks it (worker/blocks.py).

Under "blend" shifted reuse `resume = (stop, restart)`: compute up to position `stop`,
then continue at `restart` (the K/V in between were moved in, worker/reuse.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prefixgate.model.detokenizer import StreamDecoder
from prefixgate.model.overflow import OverflowPlan
from prefixgate.radix import Node
from prefixgate.worker.sampling import Sampler
from prefixgate.workerapi.api import EmitFn, Request


@dataclass(eq=False)
class Sequence:
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
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_dropped_tokens(self) -> int:
        return self.overflow.dropped_tokens if self.overflow else 0

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt_token_ids) + self.num_dropped_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V are still to be computed (1 while decoding)."""
        return len(self.tokens) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_pending_tokens > 1

    @property
    def compute_until(self) -> int:
        """Position the next chunk may run up to (exclusive): a blend's stop, or the end."""
        return self.resume[0] if self.resume else len(self.tokens)

    def advance(self, num_tokens: int) -> None:
        """`num_tokens` more tokens were computed; jump over a blend's moved run."""
        self.num_computed_tokens += num_tokens
        if self.resume is not None and self.num_computed_tokens == self.resume[0]:
            self.num_computed_tokens, self.resume = self.resume[1], None

    def reset(self) -> None:
        """Back to nothing computed (preempted): the block table was released."""
        self.block_table, self.num_computed_tokens, self.resume = [], 0, None
        self.cache_handle = None
