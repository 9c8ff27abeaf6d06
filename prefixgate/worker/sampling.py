"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seed.

Contract: `Sampler(params).sample(logits)` takes the next-token logits of one sequence
(shape [vocab], any float dtype) and returns one token id. With temperature 0 it is the
argmax. Otherwise the result depends only on the logits and the request's seed (a
private torch.Generator per request), so the same seed gives the same output whatever
else the worker runs. Filters apply in the order temperature, top-k, top-p.
"""

from __future__ import annotations

import torch

from prefixgate.protocol import SamplingConfig


class Sampler:
    def __init__(self, params: SamplingConfig) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator()
            seed = params.seed if params.seed is not None else torch.seed()
            self.generator.manual_seed(seed % (1 << 63))

    def sample(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.temperature <= 0:
            return int(torch.argmax(logits))
        logits = logits.float() / p.temperature
        if 0 < p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest set whose mass reaches top_p (the first token always stays).
            drop = torch.cumsum(sorted_probs, 0) - sorted_probs > p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
