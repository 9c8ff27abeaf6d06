"""Chat tokenization shared by gateway and worker: the model's tokenizer and chat template, no torch.

Contract: `ChatTokenizer(spec).encode_messages(messages)` renders `messages` (role,
content pairs, validated by prefixgate.protocol.check_messages) with the model's chat
template plus the assistant generation prompt and returns the token ids, exactly as the
model's own tokenizer would (tests compare with transformers' GGUF tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import AutoTokenizer

from prefixgate.models import ModelSpec
from prefixgate.protocol import check_messages


class ChatTokenizer:
    def __init__(self, spec: ModelSpec) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(str(spec.model_dir))
        self.vocab_size: int = len(self.tokenizer)
        eos = self.tokenizer.convert_tokens_to_ids(self.tokenizer.eos_token)
        self.eos_token_ids: tuple[int, ...] = (eos,)

    def encode_messages(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        check_messages(list(messages))
        return list(self.tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages],
            add_generation_prompt=True, tokenize=True, return_dict=False))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
