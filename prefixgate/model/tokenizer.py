"""Chat tokenization shared by gateway and worker: tokenizer.json + chat template.

Contract: `ChatTokenizer(spec).encode_messages(messages)` renders `messages` (role,
content pairs, validated by prefixgate.wire.protocol.check_messages) with the model's chat
template plus the assistant generation prompt and returns the token ids exactly as
transformers' `apply_chat_template(..., tokenize=True)` would (a test compares them on
SmolLM2). Encoding is thread-safe and releases the GIL (`encode_text`): the gateway runs
long prompts on a thread pool, off its event loop. It uses only `tokenizers` and jinja2,
so the gateway needs neither transformers nor torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from prefixgate.model.catalog import ModelSpec
from prefixgate.wire.protocol import check_messages


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _template_env() -> ImmutableSandboxedEnvironment:
    # The same environment transformers renders chat templates in.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTokenizer:
    def __init__(self, spec: ModelSpec) -> None:
        self.tokenizer = Tokenizer.from_file(str(spec.model_dir / "tokenizer.json"))
        config = json.loads((spec.model_dir / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        template_file = spec.model_dir / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        if not isinstance(template, str):
            raise ValueError(f"{spec.model_dir} has no chat template (tokenizer_config.json "
                             "chat_template or chat_template.jinja)")
        self.template = _template_env().from_string(template)
        self.special_tokens = {k: _token_text(config.get(k)) for k in
                               ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.vocab_size: int = self.tokenizer.get_vocab_size(with_added_tokens=True)
        eos = self.tokenizer.token_to_id(self.special_tokens["eos_token"] or "")
        self.eos_token_ids: tuple[int, ...] = (eos,) if eos is not None else ()

    def render(self, messages: Sequence[tuple[str, str]]) -> str:
        check_messages(list(messages))
        return self.template.render(
            messages=[{"role": r, "content": c} for r, c in messages],
            add_generation_prompt=True, **self.special_tokens)

    def encode_messages(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return self.encode_text(self.render(messages))

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of `text`, as `Tokenizer.encode` gives them. Thread-safe, and it lets
        other threads run meanwhile: `encode_batch` releases the GIL where `encode` holds
        it for the whole text (~40 ms for 48k characters), so a caller may run it off its
        event loop without stalling that loop."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)


def _token_text(value: object) -> str | None:
    # tokenizer_config.json stores a special token as a string or as {"content": ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None
