"""OpenAI's `logprobs` objects, from the log probabilities a turn's deltas carry.

Contract
--------
`OpenAILogprobs(token_text)`, where `token_text(token_id)` is the token's text (special
tokens included), turns ChatDelta token ids and their `common_pb2.TokenLogprob`s (one per
id; the worker computes them when the request sets `sampling.top_logprobs`) into:

  chat(ids, lps)          the chat completion's `logprobs.content` entries, one per token:
                          {"token", "logprob", "bytes", "top_logprobs": [{"token",
                          "logprob", "bytes"}, ...]} (most likely first)
  completion(ids, lps, offset)
                          the text completion's `logprobs` for these tokens: parallel lists
                          "tokens", "token_logprobs", "top_logprobs" (token -> logprob) and
                          "text_offset" (each token's first character in the completion,
                          from `offset` on; a token's width is the text its delta added)

A token whose bytes end inside a UTF-8 character reads as U+FFFD in "token"; "bytes"
carries its text's UTF-8 bytes, as OpenAI's does. Token texts are memoised (a bounded LRU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from prefixgate.v1 import common_pb2


class OpenAILogprobs:
    def __init__(self, token_text: Callable[[int], str]) -> None:
        self.text = functools.lru_cache(maxsize=1 << 16)(token_text)

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def chat(self, ids: Sequence[int], lps: Sequence[common_pb2.TokenLogprob]) -> list[dict]:
        return [{**self._entry(i, lp.logprob),
                 "top_logprobs": [self._entry(t, v) for t, v in
                                  zip(lp.top_token_ids, lp.top_logprobs, strict=True)]}
                for i, lp in zip(ids, lps, strict=True)]

    def completion(self, ids: Sequence[int], lps: Sequence[common_pb2.TokenLogprob],
                   offset: int, width: int) -> dict:
        """`width`: characters the delta holding these tokens added to the text (all at
        the first token: a delta's text is not split per token)."""
        offsets = [offset] + [offset + width] * (len(ids) - 1) if ids else []
        return {"tokens": [self.text(i) for i in ids],
                "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self.text(t): v for t, v in
                                  zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
                                 for lp in lps],
                "text_offset": offsets}


def merge_completion(parts: Sequence[dict]) -> dict:
    """The `completion()` dicts of one choice's deltas, as one."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key, values in part.items():
            out[key] += values
    return out
