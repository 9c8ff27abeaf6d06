"""Incremental detokenization with stop strings.

Contract: feed generated token ids one at a time to `StreamDecoder.push`; it returns the
text that is final so far: never half a UTF-8 character (held back while the decode ends
in U+FFFD) and never text that could still turn into a stop string (held back while the
tail is a prefix of one). When a stop string appears, `stopped` becomes True and the
returned text ends just before it. `flush()` returns what was held back at the end.
Decoding re-reads only a short window of recent tokens (vLLM's prefix/read offsets), so a
step costs O(1) in the length of the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    vocab_size: int  # token ids the tokenizer can decode: [0, vocab_size)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class StreamDecoder:
    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # tokens before this are decoded into self.text already
        self.read_offset = 0
        self.text = ""  # all final text so far (before stop handling)
        self.emitted = 0  # chars of self.text already returned
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._release(final=False)

    def flush(self) -> str:
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        # A stop string may start in text already emitted and end in the new text.
        search_from = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        cut = min((i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            end = cut
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        end = max(end, self.emitted)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:n]):
                    held = n
                    break
        return held
