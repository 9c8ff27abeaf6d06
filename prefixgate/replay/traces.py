"""Trace readers: ShareGPT conversations, Mooncake request traces, prefixgate's own traces.

Contract: `read_trace(path, fmt="auto", skip_malformed=False)` returns a `Trace`: a tuple of
`Conversation`s, each a tuple of `TraceTurn`s in order. Formats (docs/traces.md):

  sharegpt   JSON (a list) or JSONL, optionally gzipped: {"id", "conversations": [{"from":
             "human"|"gpt"|"system", "value"}]}. Chat turns: a turn's prompt is the whole
             history (system, then every earlier user message and its *recorded* reply) plus
             its own user message, so every setup replays the same prompts. Blank messages
             are dropped; consecutive messages of one role are joined.
  mooncake   JSONL: {"timestamp" (ms), "input_length", "output_length", "hash_ids"}: one
             single-turn conversation per line; each hash id names a block of
             `block_size` (512) tokens, synthesised by `synth_block_tokens`.
  prefixgate JSONL written by the gateway's `--record-trace` (prefixgate.telemetry.trace_recorder):
             token turns like Mooncake, grouped by conversation id, in file order.

A malformed line raises `TraceError` naming the file and line; with `skip_malformed` it is
skipped and counted in `Trace.num_skipped`. Readers only read: no tokenizer, no network.
"""

from __future__ import annotations

import gzip
import io
import json
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prefixgate.telemetry.trace_recorder import RECORD_VERSION

FORMATS = ("auto", "sharegpt", "mooncake", "prefixgate")
MOONCAKE_BLOCK_SIZE = 512
# Synthesised token ids avoid the lowest ids, where tokenizers keep their special tokens.
SYNTH_FIRST_TOKEN_ID = 256


class TraceError(ValueError):
    """A trace cannot be read; the message names the file, the line and what is wrong."""


@dataclass(frozen=True, slots=True)
class TraceTurn:
    """One request. Chat traces set `user` (and `reply`, the recorded answer); token traces
    set `hash_ids` and `num_prompt_tokens` (exact). `timestamp_s` is the arrival time from
    the trace's start, when the trace has one."""

    user: str = ""
    reply: str = ""
    hash_ids: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # recorded reply length in tokens (0: unknown)
    timestamp_s: float | None = None
    # Recorded traces only: what the recording gateway saw.
    worker_id: str = ""
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Conversation:
    conversation_id: str
    turns: tuple[TraceTurn, ...]
    system: str = ""

    def messages(self, index: int) -> list[tuple[str, str]]:
        """Chat prompt of turn `index`: system, earlier turns with recorded replies, user."""
        out = [("system", self.system)] if self.system else []
        for t in self.turns[:index]:
            out += [("user", t.user), ("assistant", t.reply)]
        out.append(("user", self.turns[index].user))
        return out


@dataclass(frozen=True)
class Trace:
    kind: str  # "sharegpt" | "mooncake" | "prefixgate"
    conversations: tuple[Conversation, ...]
    block_size: int = 0  # tokens per hash id (token traces); 0 for chat traces
    num_skipped: int = 0
    source: str = ""

    @property
    def is_chat(self) -> bool:
        return self.kind == "sharegpt"

    @property
    def num_turns(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    @property
    def has_timestamps(self) -> bool:
        return all(t.timestamp_s is not None for c in self.conversations for t in c.turns)

    def head(self, max_conversations: int) -> Trace:
        """The first `max_conversations` conversations (all when <= 0)."""
        if max_conversations <= 0 or max_conversations >= len(self.conversations):
            return self
        return Trace(self.kind, self.conversations[:max_conversations], self.block_size,
                     self.num_skipped, self.source)


# --- token synthesis ---------------------------------------------------------------------


def synth_block_tokens(hash_id: int, num_tokens: int, vocab_size: int,
                       first_token_id: int = SYNTH_FIRST_TOKEN_ID) -> list[int]:
    """The fixed run of token ids standing for block `hash_id` (its first `num_tokens`).

    Token i is `first + XXH64(u32_le(i), seed=hash_id mod 2**64) mod (vocab_size - first)`:
    equal ids give equal tokens on every machine and run; different ids give unrelated
    runs. `first_token_id` is lowered to 0 for vocabularies too small to skip it.
    """
    return _synth_runs([hash_id], num_tokens, vocab_size, first_token_id)[0].tolist()


# XXH64's primes; a 4-byte input takes the short path of the algorithm (xxhash's spec).
_P1, _P2, _P3, _P5 = (np.uint64(p) for p in (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F,
                                               0x165667B19E3779F9, 0x27D4EB2F165667C5))


def _synth_runs(hash_ids: Sequence[int], num_tokens: int, vocab_size: int,
                first_token_id: int = SYNTH_FIRST_TOKEN_ID) -> np.ndarray:
    """`synth_block_tokens` of each of `hash_ids`, one row each (u32), computed as XXH64
    of the 4-byte inputs 0..num_tokens-1 in numpy: the same values as `xxhash.xxh64` (a
    test compares them), about 30x faster than one call per token, which made a replay's
    client spend most of its CPU deriving prompts (0.6 ms a 512-token block) while it
    was timing the server."""
    first = first_token_id if vocab_size > 2 * first_token_id else 0
    span = vocab_size - first
    if span <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    seeds = np.fromiter((h % 2**64 for h in hash_ids), dtype=np.uint64, count=len(hash_ids))
    i = np.arange(num_tokens, dtype=np.uint64)
    with np.errstate(over="ignore"):  # u64 arithmetic wraps, as XXH64's does
        acc = (seeds[:, None] + (_P5 + np.uint64(4))) ^ (i * _P1)[None, :]
        acc = ((acc << np.uint64(23)) | (acc >> np.uint64(41))) * _P2 + _P3
        acc ^= acc >> np.uint64(33)
        acc *= _P2
        acc ^= acc >> np.uint64(29)
        acc *= _P3
        acc ^= acc >> np.uint64(32)
    return (acc % np.uint64(span) + np.uint64(first)).astype(np.uint32)


_BLOCK_RUNS_MAX = 1 << 17  # remembered block runs (2 KB each at 512-token blocks)
_BLOCK_RUNS: OrderedDict[tuple[int, int, int], array] = OrderedDict()


def _block_run(hash_id: int, block_size: int, vocab_size: int) -> array:
    """`synth_block_tokens` of a whole block, packed and remembered (least recently used
    forgotten first): traces repeat blocks (Mooncake: 64 % of blocks were seen before), and
    a replay must not spend its client's CPU re-deriving them while it is timing the
    server."""
    key = (hash_id, block_size, vocab_size)
    run = _BLOCK_RUNS.get(key)
    if run is None:
        run = _packed(_synth_runs([hash_id], block_size, vocab_size)[0])
        _remember(key, run)
    else:
        _BLOCK_RUNS.move_to_end(key)
    return run


def _remember(key: tuple[int, int, int], run: array) -> None:
    _BLOCK_RUNS[key] = run
    if len(_BLOCK_RUNS) > _BLOCK_RUNS_MAX:
        _BLOCK_RUNS.popitem(last=False)


def _packed(row: np.ndarray) -> array:
    run = array("I")
    run.frombytes(row.astype("<u4", copy=False).tobytes())
    return run


def warm_block_runs(trace: Trace, vocab_size: int, batch_blocks: int = 2048) -> int:
    """Derive and remember the token runs of a token trace's blocks (as many as the memo
    holds, in trace order) before a replay starts its clock, so that no run's client
    derives them while timing its server, and no run of a process finds them derived by
    an earlier one (e.g. a peer router's after prefixgate's) when the first did not;
    returns the number of blocks derived. Chat traces: 0."""
    if trace.is_chat:
        return 0
    wanted: dict[int, None] = {}
    for conv in trace.conversations:
        for turn in conv.turns:
            wanted.update(dict.fromkeys(turn.hash_ids))
    missing = [h for h in list(wanted)[:_BLOCK_RUNS_MAX]
               if (h, trace.block_size, vocab_size) not in _BLOCK_RUNS]
    for at in range(0, len(missing), batch_blocks):
        batch = missing[at:at + batch_blocks]
        for h, row in zip(batch, _synth_runs(batch, trace.block_size, vocab_size),
                          strict=True):
            _remember((h, trace.block_size, vocab_size), _packed(row))
    return len(missing)


def synth_prompt(turn: TraceTurn, block_size: int, vocab_size: int,
                 max_tokens: int = 0) -> list[int]:
    """Token ids of a token turn: its blocks' runs, cut to `num_prompt_tokens` (the last
    block may be partial) and, when `max_tokens` > 0, to its first `max_tokens`. Tokens past
    the hashed blocks (a recorded prompt's unhashed tail) come from the last block's id."""
    return synth_prompt_array(turn, block_size, vocab_size, max_tokens).tolist()


def synth_prompt_array(turn: TraceTurn, block_size: int, vocab_size: int,
                       max_tokens: int = 0) -> array:
    """`synth_prompt` as an array of u32 ids (what a client sends packed)."""
    n = turn.num_prompt_tokens or len(turn.hash_ids) * block_size
    if max_tokens > 0:
        n = min(n, max_tokens)
    run = array("I")
    for h in turn.hash_ids:
        if len(run) >= n:
            break
        run += _block_run(h, block_size, vocab_size)
    del run[n:]
    if len(run) < n:
        tail_seed = (turn.hash_ids[-1] if turn.hash_ids else 0) ^ 0x9E3779B97F4A7C15
        run += array("I", synth_block_tokens(tail_seed, n - len(run), vocab_size))
    return run


# --- reading -----------------------------------------------------------------------------


def _open_text(path: Path) -> io.TextIOBase:
    raw = path.open("rb")
    magic = raw.peek(2)[:2] if hasattr(raw, "peek") else b""
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.GzipFile(fileobj=raw), encoding="utf-8")
    return io.TextIOWrapper(raw, encoding="utf-8")


def _records(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON or the exception) for each non-blank line; a file whose
    first non-blank character is '[' is one JSON list (element i is "line" i + 1)."""
    with _open_text(path) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}: not valid JSON: {exc}") from None
        yield from enumerate(items, 1)
        return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            yield number, exc


def sniff_format(path: Path) -> str:
    """Guess the format from the first record's keys."""
    for _, rec in _records(path):
        if isinstance(rec, dict):
            if "conversations" in rec:
                return "sharegpt"
            if "hash_ids" in rec and "conversation_id" in rec:
                return "prefixgate"
            if "hash_ids" in rec:
                return "mooncake"
        break
    raise TraceError(f"{path}: cannot tell the trace format from its first record: give "
                     "--trace-format sharegpt, mooncake or prefixgate")


def read_trace(path: str | Path, fmt: str = "auto", *, skip_malformed: bool = False) -> Trace:
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file")
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}: use one of {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = sniff_format(path)
    parse = {"sharegpt": _sharegpt, "mooncake": _mooncake, "prefixgate": _recorded}[fmt]
    skipped = 0
    parsed = []
    for number, rec in _records(path):
        try:
            if isinstance(rec, Exception):
                raise ValueError(f"not JSON ({rec})")
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
            parsed.append(parse(rec, number))
        except (ValueError, TypeError, KeyError) as exc:
            if not skip_malformed:
                raise TraceError(f"{path}:{number}: malformed {fmt} record: {exc} (fix the line "
                                 "or pass --skip-malformed to skip such lines)") from None
            skipped += 1
    parsed = [p for p in parsed if p is not None]
    if fmt == "sharegpt":
        return Trace("sharegpt", tuple(parsed), 0, skipped, str(path))
    if fmt == "mooncake":
        return Trace("mooncake", tuple(parsed), MOONCAKE_BLOCK_SIZE, skipped, str(path))
    return _group_recorded(parsed, skipped, str(path))


def _need(rec: dict, key: str, kind: type | tuple[type, ...]):
    if key not in rec:
        raise KeyError(f"missing {key!r}")
    value = rec[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"{key!r} has the wrong type ({type(value).__name__})")
    return value


def _hash_ids(rec: dict) -> tuple[int, ...]:
    ids = _need(rec, "hash_ids", list)
    if not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**64 for h in ids):
        raise ValueError("'hash_ids' must be unsigned 64-bit integers")
    return tuple(ids)


def _sharegpt(rec: dict, number: int) -> Conversation | None:
    turns = _need(rec, "conversations", list)
    system, pending_user, out = "", None, []
    for t in turns:
        role, value = _need(t, "from", str), _need(t, "value", str)
        if not value.strip():
            continue  # a blank message is no message (servers refuse empty content)
        if role == "system":
            system = f"{system}\n\n{value}" if system else value
        elif role == "human":
            # Consecutive user messages are one turn (the template expects alternation).
            pending_user = value if pending_user is None else f"{pending_user}\n\n{value}"
        elif role == "gpt":
            if pending_user is None:
                if out:  # consecutive replies: one reply
                    last = out[-1]
                    out[-1] = TraceTurn(user=last.user, reply=f"{last.reply}\n\n{value}")
                continue  # a reply before any user message has no turn to belong to
            out.append(TraceTurn(user=pending_user, reply=value))
            pending_user = None
        else:
            raise ValueError(f"unknown role {role!r} (use human, gpt or system)")
    if pending_user is not None:
        out.append(TraceTurn(user=pending_user))
    if not out:
        return None
    return Conversation(str(rec.get("id", f"line-{number}")), tuple(out), system)


def _token_counts(rec: dict, in_key: str, out_key: str) -> tuple[int, int]:
    n_in, n_out = _need(rec, in_key, int), _need(rec, out_key, int)
    if n_in < 1 or n_out < 0:
        raise ValueError(f"{in_key!r} must be >= 1 and {out_key!r} >= 0")
    return n_in, n_out


def _mooncake(rec: dict, number: int) -> Conversation:
    ts = _need(rec, "timestamp", (int, float))
    n_in, n_out = _token_counts(rec, "input_length", "output_length")
    ids = _hash_ids(rec)
    if len(ids) * MOONCAKE_BLOCK_SIZE < n_in:
        raise ValueError(f"{len(ids)} hash ids of {MOONCAKE_BLOCK_SIZE} tokens cannot hold "
                         f"input_length {n_in}")
    return Conversation(f"req-{number}", (TraceTurn(
        hash_ids=ids, num_prompt_tokens=n_in, num_output_tokens=n_out,
        timestamp_s=ts / 1e3),))


def _recorded(rec: dict, number: int) -> tuple[str, int, TraceTurn]:
    if rec.get("v", RECORD_VERSION) != RECORD_VERSION:
        raise ValueError(f"record version {rec.get('v')} is not {RECORD_VERSION}")
    n_in, n_out = _token_counts(rec, "prompt_tokens", "output_tokens")
    block_size = _need(rec, "block_size", int)
    turn = TraceTurn(hash_ids=_hash_ids(rec), num_prompt_tokens=n_in, num_output_tokens=n_out,
                     timestamp_s=_need(rec, "time_s", (int, float)),
                     worker_id=str(rec.get("worker", "")),
                     num_cached_tokens=int(rec.get("cached_tokens", 0)))
    return str(rec.get("conversation_id", "")) or f"line-{number}", block_size, turn


def _group_recorded(parsed: Sequence[tuple[str, int, TraceTurn]], skipped: int,
                    source: str) -> Trace:
    sizes = {bs for _, bs, _ in parsed}
    if len(sizes) > 1:
        raise TraceError(f"{source}: records with different block sizes {sorted(sizes)}")
    t0 = min((t.timestamp_s for _, _, t in parsed), default=0.0)
    convs: dict[str, list[TraceTurn]] = {}
    for cid, _, t in parsed:
        convs.setdefault(cid, []).append(TraceTurn(
            hash_ids=t.hash_ids, num_prompt_tokens=t.num_prompt_tokens,
            num_output_tokens=t.num_output_tokens, timestamp_s=t.timestamp_s - t0,
            worker_id=t.worker_id, num_cached_tokens=t.num_cached_tokens))
    return Trace("prefixgate", tuple(Conversation(c, tuple(ts)) for c, ts in convs.items()),
                 sizes.pop() if sizes else 16, skipped, source)
