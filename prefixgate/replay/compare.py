"""Routing report: every policy on every trace, side by side (`prefixgate replay
--compare-policies`).

Contract: `compare(traces, plan, arrival_of, limits, ttft_target_s)` simulates each trace
(`[(path, Trace)]`) under every policy of `plan.policies` (default: all the gateway has)
with `run_simulations` (replay/simulate.py: the gateway's own router and policy classes
over simulated workers), and returns one JSON-serialisable document:

  {"ttft_target_s": float, "traces": [{"trace": path, "turns": int,
     "bounds": {"infinite_cache", "combined_lru"},       hit-rate bounds (simulate.py)
     "policies": [{"policy", "source",
        "ttft_s": {"p50", "p90", "p99"},                 seconds, turns that answered
        "goodput": float,                                turns with TTFT <= target / all
        "hit_rate": float,                               cached / prompt tokens
        "not_recomputed_rate": float,                    (cached + pulled) / prompt
        "tokens_not_recomputed": int,                    cached + pulled tokens
        "load": {"prompt_tokens_max_over_mean",          per worker, 1.0 = even
                 "computed_tokens_max_over_mean"}}]}]}

`markdown(doc)` is one table per trace (the best TTFT p99 and goodput in bold);
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


def compare(traces: Sequence[tuple[str, Trace]], plan: FleetPlan,
            arrival_of: Callable[[Trace], ArrivalConfig], limits: Limits,
            ttft_target_s: float) -> dict:
    from prefixgate.replay.simulate import run_simulations

    names = tuple(plan.policies) or tuple(policies.POLICIES)
    out = []
    for path, trace in traces:
        runs = run_simulations(trace, dataclasses.replace(plan, trace_path=path,
                                                          policies=names),
                               arrival_of(trace), limits)
        rows = [_row(r, ttft_target_s) for r in runs]
        out.append({"trace": path, "turns": trace.num_turns,
                    "arrival": vars(arrival_of(trace)),
                    "bounds": runs[0]["bounds"] if runs else {}, "policies": rows})
    return {"ttft_target_s": ttft_target_s,
            "workers": (list(plan.worker_counts) or [8])[0],
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
                  f"{b.get('combined_lru', 0):.1%})", "",
                  f"| policy | TTFT p50 / p90 / p99 ms | goodput (TTFT ≤ {target:g} s) | hit "
                  "| not recomputed (tokens) | load max/mean (prompt, computed) |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            t = r["ttft_s"]
            p99 = f"{t['p99'] * 1e3:.0f}"
            good = f"{r['goodput']:.1%}"
            lines.append(
                f"| {r['policy']} | {t['p50'] * 1e3:.0f} / {t['p90'] * 1e3:.0f} / "
                f"{'**' + p99 + '**' if t['p99'] == best_p99 else p99} | "
                f"{'**' + good + '**' if r['goodput'] == best_good else good} | "
                f"{r['hit_rate']:.1%} | {r['not_recomputed_rate']:.1%} "
                f"({r['tokens_not_recomputed']:,}) | "
                f"{r['load']['prompt_tokens_max_over_mean']:.2f}, "
                f"{r['load']['computed_tokens_max_over_mean']:.2f} |")
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
        panels = (("TTFT p99 (s)", [r["ttft_s"]["p99"] for r in rows]),
                  (f"goodput (TTFT ≤ {doc['ttft_target_s']:g} s)", [r["goodput"] for r in rows]),
                  ("hit rate", [r["hit_rate"] for r in rows]))
        for ax, (title, values) in zip(row, panels, strict=True):
            ax.barh(list(ys), values, color=colors)
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
