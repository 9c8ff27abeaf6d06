"""Load generator: play a trace's turns against a target under one arrival mode.

Contract: `await run_load(trace, target, arrival, limits)` sends turns and returns a
`LoadResult` holding one `TurnRecord` per turn sent (in completion order; `start_s` is the
send time from the run's start). Arrival modes (`ArrivalConfig.mode`):

  open     every turn at its trace timestamp divided by `speedup`, whether or not earlier
           turns have finished (needs a trace with timestamps: Mooncake, recorded); with
           a `seed` other than 0, at resampled times (`open_arrival_times`): the trace's
           order and local rate, arrivals Poisson within it;
  closed   `concurrency` simulated users, each taking the next conversation and sending its
           turns one after another, `think_time_s` after each reply;
  poisson  conversations start at Poisson times (`rate_per_s`, seeded), each then plays its
           turns one after another with `think_time_s` between them.

Chat turns send the conversation's history with the *recorded* replies, never the target's,
so every target sees the same prompts. Token turns send synthesised token ids
(prefixgate.replay.traces.synth_prompt_array: u32 arrays, sent packed). Bounds: at most `max_turns` turns are sent and none
is started after `max_duration_s`; turns already sent finish (each under the target's own
timeout), so a run always stops by itself. A tqdm bar on stderr shows progress.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixgate.replay.targets import Target, TurnRecord, TurnRequest
from prefixgate.replay.traces import Conversation, Trace, synth_prompt_array

ARRIVAL_MODES = ("open", "closed", "poisson")


@dataclass(frozen=True)
class ArrivalConfig:
    mode: str = "closed"
    speedup: float = 1.0  # open: trace time / speedup
    concurrency: int = 8  # closed: simultaneous conversations
    rate_per_s: float = 1.0  # poisson: conversation starts per second
    think_time_s: float = 0.0  # closed, poisson: pause after a reply before the next turn
    seed: int = 0  # poisson: the starts; open: 0 plays the timestamps, others resample

    def __post_init__(self) -> None:
        if self.mode not in ARRIVAL_MODES:
            raise ValueError(f"unknown arrival mode {self.mode!r}: use {', '.join(ARRIVAL_MODES)}")
        if self.speedup <= 0 or self.concurrency < 1 or self.rate_per_s <= 0 \
                or self.think_time_s < 0:
            raise ValueError("speedup and rate must be > 0, concurrency >= 1, think time >= 0")


@dataclass(frozen=True)
class Limits:
    max_turns: int = 0  # 0: every turn of the trace
    max_duration_s: float = 0.0  # 0: no time bound; no turn starts after it
    max_tokens: int = 256  # reply cap; a recorded output length below it wins
    max_prompt_tokens: int = 0  # token turns: cut synthesised prompts to this (0: never)
    vocab_size: int = 32000  # token turns: synthesised ids lie below it


@dataclass
class LoadResult:
    records: list[TurnRecord] = field(default_factory=list)
    duration_s: float = 0.0
    started_unix_s: float = 0.0


def build_request(trace: Trace, conv: Conversation, index: int, limits: Limits) -> TurnRequest:
    turn = conv.turns[index]
    max_tokens = limits.max_tokens
    if turn.num_output_tokens:
        max_tokens = max(1, min(max_tokens, turn.num_output_tokens))
    if trace.is_chat:
        return TurnRequest(conv.conversation_id, index, max_tokens, messages=conv.messages(index))
    ids = synth_prompt_array(turn, trace.block_size, limits.vocab_size, limits.max_prompt_tokens)
    return TurnRequest(conv.conversation_id, index, max_tokens, prompt_token_ids=ids)


def open_arrival_times(timestamps_s: Sequence[float], speedup: float = 1.0,
                       seed: int = 0) -> list[float]:
    """Open-loop arrival times for turns recorded at `timestamps_s` (sorted), in seconds
    from the start: the timestamps / `speedup` for seed 0; for another seed, each gap
    between consecutive arrivals multiplied by its own Exp(1) draw (seeded).

    One recording is one draw of its arrivals: routing rules that differ by a percent can
    swap places with the arrival times alone. A resampled run keeps what the trace says
    about load (the order of turns, the mean gap in every stretch of it, so bursts stay
    bursts and quiet spells quiet; turns recorded together stay together) and draws when
    within it each turn arrives, as a Poisson process whose rate follows the trace's. No
    constant is chosen: the scale of each draw is the recorded gap."""
    times = [t / speedup for t in timestamps_s]
    if seed == 0 or not times:
        return times
    rng = random.Random(f"open:{seed}")
    out, at, prev = [], 0.0, 0.0
    for t in times:
        at += (t - prev) * rng.expovariate(1.0)
        out.append(at)
        prev = t
    return out


class _Run:
    def __init__(self, trace: Trace, target: Target, limits: Limits, progress: bool) -> None:
        from tqdm import tqdm

        self.trace, self.target, self.limits = trace, target, limits
        self.t0 = time.monotonic()
        self.sent = 0
        self.result = LoadResult(started_unix_s=time.time())
        total = trace.num_turns if not limits.max_turns else min(trace.num_turns, limits.max_turns)
        self.bar = tqdm(total=total, unit="turn", file=sys.stderr, disable=not progress,
                        dynamic_ncols=True)
        self.errors = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def may_send(self) -> bool:
        if self.limits.max_turns and self.sent >= self.limits.max_turns:
            return False
        return not (self.limits.max_duration_s and self.now() >= self.limits.max_duration_s)

    async def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            await asyncio.sleep(delay)

    async def turn(self, conv: Conversation, index: int) -> TurnRecord | None:
        """Send one turn if the bounds allow it (None when they do not)."""
        if not self.may_send():
            return None
        self.sent += 1
        request = build_request(self.trace, conv, index, self.limits)
        start = self.now()
        rec = await self.target.send(request)
        rec.start_s = start
        self.result.records.append(rec)
        self.errors += not rec.ok
        self.bar.update(1)
        if self.errors:
            self.bar.set_postfix(errors=self.errors, refresh=False)
        return rec

    async def conversation(self, conv: Conversation, think_time_s: float) -> None:
        for i in range(len(conv.turns)):
            if i and think_time_s:
                await asyncio.sleep(think_time_s)
            rec = await self.turn(conv, i)
            if rec is None or not rec.ok:
                return  # a failed turn's history would differ from the trace's: stop here


async def run_load(trace: Trace, target: Target, arrival: ArrivalConfig, limits: Limits,
                   *, progress: bool = True) -> LoadResult:
    run = _Run(trace, target, limits, progress)
    try:
        if arrival.mode == "open":
            if not trace.has_timestamps:
                raise ValueError(f"{trace.kind} traces have no timestamps: use --arrival closed "
                                 "or --arrival poisson")
            order = sorted(((t.timestamp_s, i, c) for c in trace.conversations
                            for i, t in enumerate(c.turns)), key=lambda x: (x[0], x[1]))
            times = open_arrival_times([x[0] for x in order], arrival.speedup, arrival.seed)
            schedule = [(at, i, c) for at, (_, i, c) in zip(times, order, strict=True)]
            tasks = []
            for at, i, conv in schedule:
                await run.sleep_until(at)
                if not run.may_send():
                    break
                tasks.append(asyncio.create_task(run.turn(conv, i)))
            await asyncio.gather(*tasks)
        elif arrival.mode == "closed":
            queue = list(reversed(trace.conversations))

            async def user() -> None:
                while queue and run.may_send():
                    await run.conversation(queue.pop(), arrival.think_time_s)

            await asyncio.gather(*(user() for _ in range(arrival.concurrency)))
        else:
            rng = random.Random(arrival.seed)
            at, tasks = 0.0, []
            for conv in trace.conversations:
                at += rng.expovariate(arrival.rate_per_s)
                await run.sleep_until(at)
                if not run.may_send():
                    break
                tasks.append(asyncio.create_task(run.conversation(conv, arrival.think_time_s)))
            await asyncio.gather(*tasks)
    finally:
        run.bar.close()
    run.result.duration_s = run.now()
    return run.result
