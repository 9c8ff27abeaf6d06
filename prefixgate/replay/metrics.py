"""Metrics of one run: latency percentiles, prefix hit rate, load balance, errors, throughput.

Contract: `summarize(records, duration_s, workers=...)` turns the `TurnRecord`s of a run (real
or simulated) into one JSON-serialisable dict. Units: seconds for latencies and times,
tokens for sizes, fractions in [0, 1] for rates. Definitions:

  ttft_s, itl_s, e2e_s   p50/p90/p99/mean/max over successful turns (itl: every gap
                         between successive content chunks of every reply); None when empty
  hit_rate               sum(cached tokens) / sum(prompt tokens) over successful turns
  transferred_rate       sum(transferred tokens: KV pulled from another worker) / prompt
  not_recomputed_rate    (cached + transferred) / prompt tokens: the share not prefilled
  per_worker             turns, prompt/cached/transferred/completion tokens and hit rate per
                         worker; `workers` lists the ones that must appear even with no turn
  load_balance           max/mean over workers of turns, of prompt tokens and of computed
                         prompt tokens (the prefill each did: prompt - cached -
                         transferred) (1.0 = even)
  hit_rate_over_time     per bin of turn start times: hit rate and turns
  errors                 failed turns by status
  throughput             turns/s, prompt and completion tokens/s over `duration_s`
Percentiles interpolate linearly between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from prefixgate.replay.targets import TurnRecord


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, linear interpolation."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values: Iterable[float]) -> dict | None:
    v = sorted(values)
    if not v:
        return None
    return {"p50": percentile(v, 50), "p90": percentile(v, 90), "p99": percentile(v, 99),
            "mean": sum(v) / len(v), "max": v[-1], "count": len(v)}


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def summarize(records: Sequence[TurnRecord], duration_s: float, *,
              workers: Sequence[str] = (), num_time_bins: int = 20) -> dict:
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    transferred = sum(r.transferred_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    def zero() -> dict:
        return {"turns": 0, "prompt_tokens": 0, "cached_tokens": 0, "transferred_tokens": 0,
                "completion_tokens": 0}

    per_worker: dict[str, dict] = {w: zero() for w in workers}
    for r in ok:
        if not r.worker:
            continue
        w = per_worker.setdefault(r.worker, zero())
        w["turns"] += 1
        w["prompt_tokens"] += r.prompt_tokens
        w["cached_tokens"] += r.cached_tokens
        w["transferred_tokens"] += r.transferred_tokens
        w["completion_tokens"] += r.completion_tokens
    for w in per_worker.values():
        w["hit_rate"] = _ratio(w["cached_tokens"], w["prompt_tokens"])
    balance = None
    if per_worker:
        n = len(per_worker)
        turns = [w["turns"] for w in per_worker.values()]
        toks = [w["prompt_tokens"] for w in per_worker.values()]
        work = [w["prompt_tokens"] - w["cached_tokens"] - w["transferred_tokens"]
                for w in per_worker.values()]
        balance = {"turns_max_over_mean": _ratio(max(turns), sum(turns) / n),
                   "prompt_tokens_max_over_mean": _ratio(max(toks), sum(toks) / n),
                   "computed_tokens_max_over_mean": _ratio(max(work), sum(work) / n)}
    span = max((r.start_s for r in ok), default=0.0)
    width = span / num_time_bins if span > 0 else 1.0
    bins: dict[int, list[int]] = {}
    for r in ok:
        b = bins.setdefault(min(int(r.start_s / width), num_time_bins - 1), [0, 0, 0])
        b[0] += r.cached_tokens
        b[1] += r.prompt_tokens
        b[2] += 1
    return {
        "turns": len(records),
        "turns_ok": len(ok),
        "duration_s": duration_s,
        "ttft_s": distribution(r.ttft_s for r in ok if r.completion_tokens),
        "itl_s": distribution(g for r in ok for g in r.itl_s),
        "e2e_s": distribution(r.e2e_s for r in ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "hit_rate": _ratio(cached, prompt),
        "transferred_tokens": transferred,
        "computed_tokens": prompt - cached - transferred,
        "transferred_rate": _ratio(transferred, prompt),
        "not_recomputed_rate": _ratio(cached + transferred, prompt),
        "per_worker": dict(sorted(per_worker.items())),
        "load_balance": balance,
        "hit_rate_over_time": [{"t_s": round(i * width, 3), "hit_rate": _ratio(c, p), "turns": k}
                               for i, (c, p, k) in sorted(bins.items())],
        "errors": dict(Counter(r.status for r in records if not r.ok)),
        "throughput": {"turns_per_s": _ratio(len(ok), duration_s),
                       "prompt_tokens_per_s": _ratio(prompt, duration_s),
                       "completion_tokens_per_s": _ratio(completion, duration_s)},
    }
