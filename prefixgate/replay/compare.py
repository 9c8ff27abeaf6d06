"""Routing report: every policy on every trace, side by side (`prefixgate replay
--compare-policies`).

Contract: `compare(traces, plan, arrival_of, limits, ttft_target_s, seeds)` simulates
each trace (`[(path, Trace)]`) under every policy of `plan.policies` (default: all the
gateway has) with `run_simulations` (replay/simulate.py: the gateway's own router and
policy classes over simulated workers), once per arrival seed of `seeds` (default: the
arrival's own seed only; open loop: seed 0 plays the trace's timestamps, another seed
resamples them, loadgen.open_arrival_times), and returns one JSON-serialisable document:

  {"ttft_target_s": float, "seeds": [int], "traces": [{"trace": path, "turns": int,
     "bounds": {"infinite_cache", "combined_lru"},       hit-rate bounds (simulate.py)
     "leads": {"ttft_p99": [[policy...] per seed],       at the lowest p99 of each seed's run
               "goodput": [[policy...] per seed]},       at the highest goodput (ties: all)
     "policies": [{"policy", "source",
        "ttft_s": {"p50", "p90", "p99"},                 seconds, turns that answered
        "goodput": float,                                turns with TTFT <= target / all
        "hit_rate": float,                               cached / prompt tokens
        "not_recomputed_rate": float,                    (cached + pulled) / prompt
        "tokens_not_recomputed": int,                    cached + pulled tokens
        "load": {"prompt_tokens_max_over_mean",          per worker, 1.0 = even
                 "computed_tokens_max_over_mean"},
        "per_seed": {"ttft_p99_s": [...], "goodput": [...], "hit_rate": [...]}}]}]}

A policy's figures are means over the seeds (each seed's run is one fleet; its p99 is that
run's), `per_seed` the figures of each run in `seeds` order. Routing rules within a percent
of each other swap places with the arrivals alone: "leads" is meant over seeds.

`markdown(doc)` is one table per trace (the best mean TTFT p99 and goodput in bold; with
several seeds, each with its range over them, and how many seeds each rule led in);
`plot(doc, out_dir, name)` writes `<name>-policies.png`: a row per trace, TTFT p99,
goodput and hit per policy (the combined-LRU bound dashed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from prefixgate.gateway import policies
from prefixgate.replay.loadgen import ArrivalConfig, Limits
from prefixgate.replay.plan import FleetPlan
from prefixgate.replay.traces import Trace


def _row(run: dict, ttft_target_s: float) -> dict:
    s = run["summary"]
    samples = run.get("ttft_samples_s") or []
    t = s["ttft_s"] or {}
    lb = s["load_balance"] or {}
    name = run["config"]["policy"]
    cls = policies.POLICIES.get(name.split(":")[0])
    return {
        "policy": name,
        "source": cls.source if cls is not None else "",
        "ttft_s": {k: t.get(k, 0.0) for k in ("p50", "p90", "p99")},
        "goodput": sum(x <= ttft_target_s for x in samples) / max(1, s["turns"]),
        "hit_rate": s["hit_rate"],
        "not_recomputed_rate": s["not_recomputed_rate"],
        "tokens_not_recomputed": s["cached_tokens"] + s["transferred_tokens"],
        "load": {"prompt_tokens_max_over_mean": lb.get("prompt_tokens_max_over_mean", 0.0),
                 "computed_tokens_max_over_mean": lb.get("computed_tokens_max_over_mean",
                                                         0.0)},
    }


def _mean(rows: list[dict]) -> dict:
    """One policy's rows (one per seed, same order of seeds) as one: every figure the mean,
    `per_seed` the p99s, goodputs and hits of each."""
    n = len(rows)

    def avg(get) -> float:
        return sum(get(r) for r in rows) / n

    first = rows[0]
    return {
        "policy": first["policy"], "source": first["source"],
        "ttft_s": {k: avg(lambda r, k=k: r["ttft_s"][k]) for k in ("p50", "p90", "p99")},
        "goodput": avg(lambda r: r["goodput"]),
        "hit_rate": avg(lambda r: r["hit_rate"]),
        "not_recomputed_rate": avg(lambda r: r["not_recomputed_rate"]),
        "tokens_not_recomputed": round(avg(lambda r: r["tokens_not_recomputed"])),
        "load": {k: avg(lambda r, k=k: r["load"][k]) for k in first["load"]},
        "per_seed": {"ttft_p99_s": [r["ttft_s"]["p99"] for r in rows],
                     "goodput": [r["goodput"] for r in rows],
                     "hit_rate": [r["hit_rate"] for r in rows]},
    }


def _leads(runs: list[list[dict]]) -> dict:
    """Per seed (`runs`: each seed's rows), the policies at the lowest TTFT p99 and those at
    the highest goodput (every one tied at the best; p99s to the microsecond, below which
    two runs differ only by float rounding)."""
    def p99(r: dict) -> float:
        return round(r["ttft_s"]["p99"], 6)

    return {"ttft_p99": [[r["policy"] for r in rows if p99(r) == min(map(p99, rows))]
                         for rows in runs],
            "goodput": [[r["policy"] for r in rows
                         if r["goodput"] == max(x["goodput"] for x in rows)]
                        for rows in runs]}


def compare(traces: Sequence[tuple[str, Trace]], plan: FleetPlan,
            arrival_of: Callable[[Trace], ArrivalConfig], limits: Limits,
            ttft_target_s: float, seeds: Sequence[int] = ()) -> dict:
    from prefixgate.replay.simulate import run_simulations

    names = tuple(plan.policies) or tuple(policies.POLICIES)
    out = []
    for path, trace in traces:
        arrival = arrival_of(trace)
        per_seed: list[list[dict]] = []
        bounds: list[dict] = []
        for seed in seeds or (arrival.seed,):
            runs = run_simulations(trace, dataclasses.replace(plan, trace_path=path,
                                                              policies=names),
                                   dataclasses.replace(arrival, seed=seed), limits)
            per_seed.append([_row(r, ttft_target_s) for r in runs])
            bounds.append(runs[0]["bounds"] if runs else {})
        rows = [_mean(list(by_policy)) for by_policy in zip(*per_seed, strict=True)]
        out.append({"trace": path, "turns": trace.num_turns, "arrival": vars(arrival),
                    "bounds": {k: sum(b.get(k, 0.0) for b in bounds) / len(bounds)
                               for k in bounds[0]},
                    "leads": _leads(per_seed), "policies": rows})
    return {"ttft_target_s": ttft_target_s,
            "workers": (list(plan.worker_counts) or [8])[0],
            "seeds": list(seeds) or [out[0]["arrival"]["seed"] if out else 0],
            "traces": out}


def markdown(doc: dict, title: str = "routing policies") -> str:
    target = doc["ttft_target_s"]
    lines = [f"### {title}", ""]
    for tr in doc["traces"]:
        rows = tr["policies"]
        if not rows:
            continue
        best_p99 = min(r["ttft_s"]["p99"] for r in rows)
        best_good = max(r["goodput"] for r in rows)
        b = tr["bounds"]
        lines += [f"**{Path(tr['trace']).name}** ({tr['turns']} turns, "
                  f"{tr['arrival']['mode']} arrivals; hit bounds: infinite cache "
                  f"{b.get('infinite_cache', 0):.1%}, combined LRU "
                  f"{b.get('combined_lru', 0):.1%}" + (
                      f"; mean (range) over seeds {', '.join(map(str, doc['seeds']))}"
                      if len(doc.get("seeds", ())) > 1 else "") + ")", "",
                  f"| policy | TTFT p50 / p90 / p99 ms | goodput (TTFT ≤ {target:g} s) | hit "
                  "| not recomputed (tokens) | load max/mean (prompt, computed) |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            t = r["ttft_s"]
            p99 = f"{t['p99'] * 1e3:.0f}"
            good = f"{r['goodput']:.1%}"
            seeds = r.get("per_seed") or {}
            if len(seeds.get("goodput", ())) > 1:  # the range over the seeds beside the mean
                p99 += (f" ({min(seeds['ttft_p99_s']) * 1e3:.0f}–"
                        f"{max(seeds['ttft_p99_s']) * 1e3:.0f})")
                good += f" ({min(seeds['goodput']):.1%}–{max(seeds['goodput']):.1%})"
            lines.append(
                f"| {r['policy']} | {t['p50'] * 1e3:.0f} / {t['p90'] * 1e3:.0f} / "
                f"{'**' + p99 + '**' if t['p99'] == best_p99 else p99} | "
                f"{'**' + good + '**' if r['goodput'] == best_good else good} | "
                f"{r['hit_rate']:.1%} | {r['not_recomputed_rate']:.1%} "
                f"({r['tokens_not_recomputed']:,}) | "
                f"{r['load']['prompt_tokens_max_over_mean']:.2f}, "
                f"{r['load']['computed_tokens_max_over_mean']:.2f} |")
        leads = tr.get("leads") or {}
        if len(leads.get("goodput", ())) > 1:  # seeds each policy was at the best in
            for key, what in (("ttft_p99", "lowest TTFT p99"), ("goodput", "highest goodput")):
                won = [name for seed in leads[key] for name in seed]
                lines += ["", f"At the {what} (ties included), of {len(leads[key])} seeds: "
                          + ", ".join(f"{name} {won.count(name)}"
                                      for name in dict.fromkeys(won)) + "."]
        lines.append("")
    return "\n".join(lines)


def plot(doc: dict, out_dir: str | Path, name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from prefixgate.replay.report import _save

    traces = [t for t in doc["traces"] if t["policies"]]
    if not traces:
        return []
    n = max(len(t["policies"]) for t in traces)
    fig, axes = plt.subplots(len(traces), 3, figsize=(13, (0.22 * n + 1.1) * len(traces)),
                             squeeze=False)
    for row, tr in zip(axes, traces, strict=True):
        rows = tr["policies"]
        labels = [r["policy"] for r in rows]
        ys = range(len(rows))
        colors = ["tab:orange" if r["policy"].startswith("prefix") else "tab:blue"
                  for r in rows]
        panels = (("TTFT p99 (s)", [r["ttft_s"]["p99"] for r in rows], "ttft_p99_s"),
                  (f"goodput (TTFT ≤ {doc['ttft_target_s']:g} s)", [r["goodput"] for r in rows],
                   "goodput"),
                  ("hit rate", [r["hit_rate"] for r in rows], "hit_rate"))
        for ax, (title, values, key) in zip(row, panels, strict=True):
            spread = [(r.get("per_seed") or {}).get(key) or [v] for r, v in zip(rows, values,
                                                                              strict=True)]
            err = ([[max(0.0, v - min(x)) for v, x in zip(values, spread, strict=True)],
                    [max(0.0, max(x) - v) for v, x in zip(values, spread, strict=True)]]
                   if any(len(x) > 1 for x in spread) else None)  # the seeds' range
            ax.barh(list(ys), values, color=colors, xerr=err, error_kw={"linewidth": 0.8})
            ax.set_title(f"{Path(tr['trace']).name}: {title}", fontsize=9)
            ax.grid(alpha=0.3, axis="x")
            ax.set_yticks(list(ys), labels if ax is row[0] else [""] * len(rows), fontsize=8)
            ax.invert_yaxis()
        bound = tr["bounds"].get("combined_lru")
        if bound:
            row[2].axvline(bound, color="grey", linestyle="--", linewidth=0.8)
            row[2].annotate("combined LRU", (bound, 0), fontsize=7, color="grey",
                            xytext=(-2, -10), textcoords="offset points", ha="right")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [_save(fig, out / f"{name}-policies.png")]
