"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seed.

Contract: `Sampler(params).sample(logits)` takes the next-token logits of one sequence
(shape [vocab], any float dtype) and returns one token id in [0, vocab). With temperature
0 it is the argmax. Otherwise the result depends only on the logits and the request's seed
(a private torch.Generator per request), so the same seed gives the same output whatever
else the worker runs. Filters apply in the order temperature, top-k, top-p. Each sampled
token takes one draw of the stream (a multinomial over the vocabulary, whose consumption
of the generator does not depend on the probabilities); `params.seed_offset_tokens`
draws are skipped before the first, so a resumed reply samples on where it stood.

It never raises for parameters `prefixgate.wire.protocol` accepts, whatever the logits hold:
NaN counts as -inf, +inf as the largest float32; the largest logit is subtracted before
dividing by the temperature (>= protocol.MIN_TEMPERATURE, a normal float32), so scaled
logits are <= 0 with the largest exactly 0, softmax never sees inf - inf, and the kept
mass is never zero. Logits with no finite value at all (a broken model) give token 0.

`logprobs(logits, token)` (None unless the request set top_logprobs): the token's log
probability and the top_logprobs most likely tokens', from the model's own distribution
(log-softmax of the logits, before temperature and filters: what vLLM reports by default).
"""

from __future__ import annotations

import torch

from prefixgate.wire.protocol import SamplingConfig
from prefixgate.workerapi.api import TokenLogprob


class Sampler:
    def __init__(self, params: SamplingConfig) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator()
            seed = params.seed if params.seed is not None else torch.seed()
            self.generator.manual_seed(seed % (1 << 63))
        self._skip_draws = params.seed_offset_tokens if self.generator is not None else 0

    def sample(self, logits: torch.Tensor) -> int:
        p = self.params
        logits = torch.nan_to_num(logits.float(), nan=float("-inf"), neginf=float("-inf"),
                                  posinf=torch.finfo(torch.float32).max)
        top = torch.argmax(logits)
        if not torch.isfinite(logits[top]):
            return 0
        if p.temperature <= 0:
            return int(top)
        logits = (logits - logits[top]) / p.temperature
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
        if self._skip_draws:  # the draws of the tokens sampled before a resume
            spent = torch.ones_like(probs)
            for _ in range(self._skip_draws):
                torch.multinomial(spent, 1, generator=self.generator)
            self._skip_draws = 0
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def logprobs(self, logits: torch.Tensor, token: int) -> TokenLogprob | None:
        k = self.params.top_logprobs
        if k is None:
            return None
        logprobs = torch.log_softmax(torch.nan_to_num(
            logits.float(), nan=float("-inf"), neginf=float("-inf"),
            posinf=torch.finfo(torch.float32).max), dim=-1)
        if k:
            top = torch.topk(logprobs, min(k, logprobs.numel()))
            ids, values = tuple(top.indices.tolist()), tuple(top.values.tolist())
        else:
            ids, values = (), ()
        return TokenLogprob(float(logprobs[token]), ids, values)
