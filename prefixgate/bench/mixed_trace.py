"""A chat workload where moving KV between servers matters: ShareGPT chats plus
conversations over long shared documents.

Contract: `generate(sharegpt, config, tokenizer) -> list[dict]` returns conversations in
ShareGPT's format (`{"id", "conversations": [{"from", "value"}, ...]}`, the format
`prefixgate replay --trace` reads as a chat trace), in the order a replay starts them
(`--arrival poisson` starts conversations in trace order). Deterministic for a config.
`python -m prefixgate.bench.mixed_trace --sharegpt PATH --out PATH.jsonl.gz` writes it.

What it holds (sizes in tokens of the model's chat template, measured with `tokenizer`):
  chats      the first `num_chats` ShareGPT conversations with at least two user turns,
             cut to `max_chat_turns` user turns and to `max_prompt_tokens` a prompt;
             they share only the chat template's head.
  documents  `num_documents` documents of `document_tokens` (lo, hi) tokens each, made of
             real text (the replies of ShareGPT conversations past the chats), carried as
             the system message; `num_document_conversations` conversations each ask
             1-`max_document_turns` real short ShareGPT questions about one document,
             drawn by a Zipf popularity, so a popular document is asked about again while
             its holder is still busy with other work.
The two kinds are interleaved at random. Why this load separates routers: a document is
expensive to compute (seconds of prefill on a CPU server) and cheap to move (a pull of its
blocks), and its questions arrive while the server that holds it is often busy computing
another document or a chat. A router can queue the question behind its holder, recompute
the document on an idle server, or — prefixgate with transfer — pull the document's blocks
to the idle server.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import random
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = ["MixedTraceConfig", "generate", "main", "write"]


class _Encoder(Protocol):
    def encode_messages(self, messages: list[tuple[str, str]]) -> list[int]: ...

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class MixedTraceConfig:
    """Sizes of the workload (tokens are the model's chat-template tokens)."""

    num_chats: int = 12
    max_chat_turns: int = 3
    max_prompt_tokens: int = 3584
    num_documents: int = 4
    document_tokens: tuple[int, int] = (1536, 3072)
    num_document_conversations: int = 20
    max_document_turns: int = 3
    max_question_tokens: int = 96  # a "short question": a real ShareGPT user message
    zipf_s: float = 1.0
    seed: int = 0

    def check(self) -> None:
        lo, hi = self.document_tokens
        if self.num_chats < 0 or self.num_documents < 0 or self.num_document_conversations < 0:
            raise ValueError("counts must be >= 0")
        if self.num_document_conversations and not self.num_documents:
            raise ValueError("document conversations need at least one document")
        if not 0 < lo <= hi or hi >= self.max_prompt_tokens:
            raise ValueError(f"document_tokens {self.document_tokens} must be 0 < lo <= hi "
                             f"< max_prompt_tokens ({self.max_prompt_tokens})")
        if self.max_chat_turns < 1 or self.max_document_turns < 1:
            raise ValueError("turn limits must be >= 1")


def _turns(conv: dict) -> list[tuple[str, str]]:
    """(user, reply) pairs of a ShareGPT record: consecutive messages of a role merged."""
    out: list[list[str]] = []
    for m in conv.get("conversations") or ():
        role, value = m.get("from"), (m.get("value") or "").strip()
        if not value or role not in ("human", "gpt"):
            continue
        if role == "human":
            if out and not out[-1][1]:
                out[-1][0] += "\n\n" + value
            else:
                out.append([value, ""])
        elif out:
            out[-1][1] = f"{out[-1][1]}\n\n{value}" if out[-1][1] else value
    return [(u, r) for u, r in out if r]


def _cut_chat(turns: list[tuple[str, str]], config: MixedTraceConfig, tok: _Encoder
              ) -> list[tuple[str, str]]:
    """The leading turns whose prompts stay within `max_prompt_tokens`."""
    kept: list[tuple[str, str]] = []
    for user, reply in turns[:config.max_chat_turns]:
        messages = [m for u, r in kept for m in (("user", u), ("assistant", r))]
        if len(tok.encode_messages(messages + [("user", user)])) > config.max_prompt_tokens:
            break
        kept.append((user, reply))
    return kept


def _document(texts: Iterator[str], num_tokens: int, tok: _Encoder) -> str:
    """Real text of about `num_tokens` tokens (whole paragraphs, the last one cut)."""
    parts: list[str] = []
    have = 0
    while have < num_tokens:
        text = next(texts)
        ids = tok.encode_text(text)
        take = ids[:num_tokens - have]
        parts.append(text if len(take) == len(ids) else tok.decode(take))
        have += len(take)
    return "\n\n".join(parts)


def generate(sharegpt: Iterable[dict], config: MixedTraceConfig, tokenizer: _Encoder
             ) -> list[dict]:
    """The workload's conversations in start order (module docstring)."""
    config.check()
    rng = random.Random(f"mixed:{config.seed}")
    records = list(sharegpt)
    chats: list[dict] = []
    used = 0  # records read for the chats; the rest give the documents and questions
    while len(chats) < config.num_chats and used < len(records):
        turns = _cut_chat(_turns(records[used]), config, tokenizer)
        used += 1
        if len(turns) >= 2:
            chats.append(_record(f"chat-{len(chats)}", "", turns))
    rest = [turn for rec in records[used:] for turn in _turns(rec)]
    questions = [u for u, _ in rest
                 if len(tokenizer.encode_text(u)) <= config.max_question_tokens]
    replies = [r for _, r in rest if len(r) > 200]
    if config.num_document_conversations and (not questions or not replies):
        raise ValueError("the ShareGPT records past the chats hold no short questions or "
                         "long replies to build documents from: give more records")
    rng.shuffle(questions)
    rng.shuffle(replies)
    text = itertools.cycle(replies)  # a small input still fills the documents
    docs = [_document(text, rng.randint(*config.document_tokens), tokenizer)
            for _ in range(config.num_documents)]
    weights = [1 / (k + 1) ** config.zipf_s for k in range(config.num_documents)]
    asked = itertools.cycle(questions)
    short_replies = [r for _, r in rest if 40 <= len(r) <= 600] or replies
    doc_convs = []
    for i in range(config.num_document_conversations):
        d = rng.choices(range(config.num_documents), weights)[0]
        turns = [(next(asked), rng.choice(short_replies))
                 for _ in range(rng.randint(1, config.max_document_turns))]
        doc_convs.append(_record(f"doc{d}-{i}", docs[d], turns))
    out = chats + doc_convs
    rng.shuffle(out)
    return out


def _record(cid: str, system: str, turns: list[tuple[str, str]]) -> dict:
    msgs = [{"from": "system", "value": system}] if system else []
    for user, reply in turns:
        msgs += [{"from": "human", "value": user}, {"from": "gpt", "value": reply}]
    return {"id": cid, "conversations": msgs}


def write(path: str | Path, conversations: list[dict]) -> Path:
    """Gzip JSONL when `path` ends in .gz, else JSONL."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as f:
        for rec in conversations:
            f.write(json.dumps(rec) + "\n")
    return path


def _read_jsonl(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m prefixgate.bench.mixed_trace",
                                description="write the mixed chat + shared-document workload")
    p.add_argument("--sharegpt", required=True, type=Path, help="a ShareGPT JSONL(.gz) trace")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--model", default="smollm2-135m", help="whose chat template sizes it")
    p.add_argument("--chats", type=int, default=MixedTraceConfig.num_chats)
    p.add_argument("--documents", type=int, default=MixedTraceConfig.num_documents)
    p.add_argument("--document-conversations", type=int,
                   default=MixedTraceConfig.num_document_conversations)
    p.add_argument("--document-tokens", type=int, nargs=2,
                   default=MixedTraceConfig.document_tokens, metavar=("LO", "HI"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from prefixgate.model.catalog import resolve_model
    from prefixgate.model.tokenizer import ChatTokenizer

    tok = ChatTokenizer(resolve_model(args.model))
    config = MixedTraceConfig(num_chats=args.chats, num_documents=args.documents,
                              num_document_conversations=args.document_conversations,
                              document_tokens=tuple(args.document_tokens), seed=args.seed)
    convs = generate(_read_jsonl(args.sharegpt), config, tok)
    write(args.out, convs)
    turns = sum(len([m for m in c["conversations"] if m["from"] == "human"]) for c in convs)
    print(f"{args.out}: {len(convs)} conversations, {turns} turns", file=sys.stderr)


if __name__ == "__main__":
    main()
