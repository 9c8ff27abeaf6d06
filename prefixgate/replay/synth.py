"""Synthetic multi-turn traces with the properties that separate routing rules.

Contract: `generate(kind, seed) -> list[dict]` returns the turns of one synthetic trace as
prefixgate trace records (docs/traces.md, "prefixgate's recorded traces": conversation id,
arrival `time_s`, exact `prompt_tokens`, the prompt's full-block ids `hash_ids` at
`block_size` tokens, `output_tokens`), in arrival order; `write(path, records)` writes them
as JSONL that `prefixgate replay --trace` reads (open loop: every turn at its time).
Deterministic for a seed. `python -m prefixgate.replay.synth --out DIR` writes every kind.

Each conversation's context only grows: turn i's prompt is the shared part (a tenant's
system prompt, a document), then every earlier user message and recorded reply, then the
new user message; a block id names a block's content, so prompts share exactly the leading
blocks they share in content (the shared part's blocks across conversations, the
conversation's own across its turns). Kinds:

  system-prompts  24 tenants, each with a system prompt of 1-6k tokens, drawn by a Zipf
                  popularity; 1,200 conversations of 1-8 turns start as a Poisson process
                  (8 a second)
  long-documents  80 documents of 12-40k tokens, drawn by a Zipf popularity; each of 500
                  conversations (4 a second) asks 1-4 short questions about one
  bursts          the system-prompts mix, but conversations start in bursts (40 within a
                  second, every 6 s): load arrives faster than any worker drains it
  skewed-lengths  600 conversations (8 a second) whose lengths follow a Pareto law: most
                  1-2 turns, a few of 40 or more whose context grows to 32k tokens
Think time between a reply and the next user turn: exponential, 20 s mean (a user
reading), plus the reply's own decode time at 30 ms per token. The rates offer 8 workers
of the default simulated speed (20k prefill tokens/s each) roughly twice their prefill
rate in prompt tokens: what caching saves decides whether they keep up.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import xxhash

KINDS = ("system-prompts", "long-documents", "bursts", "skewed-lengths")
BLOCK_SIZE = 256
DECODE_S_PER_TOKEN = 0.030
THINK_MEAN_S = 20.0


def _block_id(*key: object) -> int:
    return xxhash.xxh3_64_intdigest("\0".join(map(str, key)).encode())


def _zipf(rng: random.Random, n: int, s: float = 1.1) -> int:
    weights = [1 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights)[0]


class _Conversation:
    """A growing context: a shared head (`head_key`, `head_tokens`) and its own turns."""

    def __init__(self, cid: str, head_key: str, head_tokens: int) -> None:
        self.cid, self.head_key, self.head_tokens = cid, head_key, head_tokens
        self.tokens = head_tokens

    def turn(self, t: float, user_tokens: int, output_tokens: int) -> dict:
        prompt = self.tokens + user_tokens
        full = prompt // BLOCK_SIZE
        shared = self.head_tokens // BLOCK_SIZE  # blocks wholly inside the shared head
        ids = [_block_id(self.head_key, k) if k < shared else _block_id(self.cid, k)
               for k in range(full)]
        self.tokens = prompt + output_tokens  # the recorded reply joins the context
        return {"v": 1, "time_s": round(t, 4), "conversation_id": self.cid,
                "prompt_tokens": prompt, "block_size": BLOCK_SIZE, "hash_ids": ids,
                "output_tokens": output_tokens}


def _play(rng: random.Random, conv: _Conversation, start: float, num_turns: int,
          user: tuple[int, int], reply: tuple[int, int], max_tokens: int) -> list[dict]:
    out, t = [], start
    for _ in range(num_turns):
        u, r = rng.randint(*user), rng.randint(*reply)
        if conv.tokens + u >= max_tokens:
            break
        out.append(conv.turn(t, u, r))
        t += r * DECODE_S_PER_TOKEN + rng.expovariate(1 / THINK_MEAN_S)
    return out


def generate(kind: str, seed: int = 0) -> list[dict]:
    """The records of one synthetic trace of `kind` (module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"unknown synthetic trace {kind!r}: use one of {', '.join(KINDS)}")
    rng = random.Random(f"{kind}:{seed}")
    records: list[dict] = []
    if kind in ("system-prompts", "bursts"):
        prompts = [rng.randint(1024, 6144) for _ in range(24)]
        if kind == "bursts":
            starts = [4.0 * b + rng.random() for b in range(25) for _ in range(60)]
        else:
            starts, t = [], 0.0
            for _ in range(1500):
                t += rng.expovariate(16.0)
                starts.append(t)
        for i, start in enumerate(starts):
            tenant = _zipf(rng, len(prompts))
            conv = _Conversation(f"{kind}-{i}", f"system-{tenant}", prompts[tenant])
            records += _play(rng, conv, start, rng.randint(1, 8), (40, 3000), (50, 400),
                             32_768)
    elif kind == "long-documents":
        docs = [rng.randint(12_288, 40_960) for _ in range(400)]
        t = 0.0
        for i in range(600):
            t += rng.expovariate(4.0)
            d = _zipf(rng, len(docs), 0.8)
            conv = _Conversation(f"doc-{i}", f"document-{d}", docs[d])
            records += _play(rng, conv, t, rng.randint(1, 4), (20, 120), (30, 300), 65_536)
    else:  # skewed-lengths
        t = 0.0
        for i in range(800):
            t += rng.expovariate(8.0)
            turns = min(80, int(math.floor(rng.paretovariate(1.1))))
            conv = _Conversation(f"skew-{i}", f"skew-system-{i % 4}", 768)
            records += _play(rng, conv, t, turns, (50, 1500), (100, 600), 32_768)
    records.sort(key=lambda r: r["time_s"])
    return records


def write(path: str | Path, records: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m prefixgate.replay.synth",
                                description="write the synthetic routing traces (JSONL)")
    p.add_argument("--out", default="synthetic-traces", help="directory to write them to")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kind", action="append", choices=KINDS, help="only these (default: all)")
    args = p.parse_args(argv)
    for kind in args.kind or KINDS:
        recs = generate(kind, args.seed)
        path = write(Path(args.out) / f"{kind}.jsonl", recs)
        convs = len({r["conversation_id"] for r in recs})
        tokens = sum(r["prompt_tokens"] for r in recs)
        print(f"{path}: {len(recs)} turns, {convs} conversations, {tokens:,} prompt tokens")


if __name__ == "__main__":
    main()
