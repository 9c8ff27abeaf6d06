"""Reports of one or more runs: a JSON document, a Markdown summary and PNG plots.

Contract: a *run* is a dict {"label", "config", "summary" (prefixgate.replay.metrics), and
"ttft_samples_s" (sorted TTFTs, for the CDF)}; a simulation adds "bounds". `write_report(
runs, out_dir, name)` writes `<name>.json` (every run), `<name>.md` (one table row per run)
and three plots, returning their paths:

  <name>-ttft-cdf.png   TTFT CDF, one line per run
  <name>-hit-rate.png   prefix hit rate over time, one line per run
  <name>-load.png       prompt tokens per worker over the mean, workers ranked by it, one
                        bar per run and rank (1.0 everywhere = perfectly even); runs whose
                        target names no serving worker are listed on it
  <name>-fleet.png      replay --fleet runs side by side: hit and load at the workers,
                        TTFT p50 and p99 at the client and at the workers

Runs measured at emulated workers (summary "workers") or reporting routing decisions
(summary "decisions") get a second Markdown table: hit, load and TTFT as the workers
counted them, and regret.

matplotlib is imported only here, with the non-interactive Agg backend.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def _ms(dist: dict | None, key: str) -> str:
    return f"{dist[key] * 1e3:.0f}" if dist else "-"


def markdown(runs: Sequence[dict], title: str = "replay") -> str:
    with_bounds = any(r.get("bounds") for r in runs)
    lines = [f"### {title}", "",
             "| run | turns ok | errors | hit rate | TTFT p50 / p90 / p99 ms | ITL p50 / p99 ms "
             "| E2E p50 / p99 ms | load max/mean (turns, tokens) | turns/s |"
             + (" bounds: infinite cache / combined LRU |" if with_bounds else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if with_bounds else "")]
    for run in runs:
        s = run["summary"]
        t, i, e = s["ttft_s"], s["itl_s"], s["e2e_s"]
        lb = s["load_balance"]
        load = (f"{lb['turns_max_over_mean']:.2f}, {lb['prompt_tokens_max_over_mean']:.2f}"
                if lb else "-")
        errors = ", ".join(f"{k} {v}" for k, v in sorted(s["errors"].items())) or "0"
        lines.append(
            f"| {run['label']} | {s['turns_ok']} | {errors} | {s['hit_rate']:.1%} | "
            f"{_ms(t, 'p50')} / {_ms(t, 'p90')} / {_ms(t, 'p99')} | {_ms(i, 'p50')} / "
            f"{_ms(i, 'p99')} | {_ms(e, 'p50')} / {_ms(e, 'p99')} | {load} | "
            f"{s['throughput']['turns_per_s']:.2f} |")
        b = run.get("bounds")
        if with_bounds:
            lines[-1] += (f" {b['infinite_cache']:.1%} / {b['combined_lru']:.1%} |" if b
                          else " - |")
    if with_bounds:
        lines += ["", "Bounds: the same turns with instant prefill through one unlimited "
                      "cache, and through one LRU cache of the workers' combined capacity."]
    lines += _decisions_and_workers(runs)
    return "\n".join(lines) + "\n"


def _decisions_and_workers(runs: Sequence[dict]) -> list[str]:
    """Rows of the runs measured at emulated workers (replay --fleet) and of the runs that
    report routing decisions (regret): hit, TTFT and load as the workers counted them."""
    rows = []
    for run in runs:
        s = run["summary"]
        w, d = s.get("workers"), s.get("decisions")
        if not w and not d:
            continue
        wt = w["ttft_s"] if w else None
        lb = (w or s)["load_balance"]
        regret = (f"{d['turns_off_best']} / {d['cached_tokens_lost']} / "
                  f"{d['predicted_exact_share']:.1%}" if d else "-")
        rows.append(
            f"| {run['label']} | {(w or s)['hit_rate']:.1%} | "
            f"{lb['prompt_tokens_max_over_mean']:.2f} | "
            f"{_ms(s['ttft_s'], 'p50')} / {_ms(s['ttft_s'], 'p99')} | "
            f"{_ms(wt, 'p50')} / {_ms(wt, 'p99')} | {regret} |")
    if not rows:
        return []
    return ["", "| run | hit (at the workers) | load max/mean (tokens) | TTFT p50 / p99 ms "
                "(client) | TTFT p50 / p99 ms (worker: queue + prefill) | regret: turns off "
                "the best-cached worker / cached tokens lost / predicted exactly |",
            "|---|---|---|---|---|---|", *rows]


def plot(runs: Sequence[dict], out_dir: Path, name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [_save(_cdf_plot(runs, name), out_dir / f"{name}-ttft-cdf.png")]

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        pts = run["summary"]["hit_rate_over_time"]
        ax.plot([p["t_s"] for p in pts], [p["hit_rate"] for p in pts], marker=".",
                label=run["label"])
    shared = {json.dumps(r.get("bounds"), sort_keys=True) for r in runs}
    common = runs[0].get("bounds") if len(shared) == 1 else None
    for key, value in (common or {}).items():
        ax.axhline(value, linestyle="--", linewidth=0.8, color="grey")
        ax.annotate(key.replace("_", " "), (0, value), fontsize=7, color="grey",
                    xytext=(2, 2), textcoords="offset points")
    ax.set(xlabel="turn start (s from the run's start)", ylabel="prefix hit rate",
           ylim=(0, 1), title=f"{name}: hit rate over time")
    ax.grid(alpha=0.3)
    _legend_below(ax, len(runs))
    paths.append(_save(fig, out_dir / f"{name}-hit-rate.png"))

    paths.append(_save(_load_plot(runs, name), out_dir / f"{name}-load.png"))
    if any(r["summary"].get("workers") for r in runs):
        paths.append(_fleet_plot([r for r in runs if r["summary"].get("workers")], out_dir,
                                 name))
    return paths


def ttft_cdf_plot(runs: Sequence[dict], title: str, path: Path) -> Path:
    """A TTFT CDF, one line per run (`label`, `ttft_samples_s`), saved at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    return _save(_cdf_plot(runs, title), path)


def _cdf_plot(runs: Sequence[dict], name: str):
    """TTFT CDF, one line per run, log time axis."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        xs = run.get("ttft_samples_s") or []
        if xs:
            ax.plot(xs, [(k + 1) / len(xs) for k in range(len(xs))], label=run["label"])
    ax.set(xscale="log", xlabel="time to first token (s, log)", ylabel="fraction of turns",
           ylim=(0, 1.02), title=f"{name}: TTFT CDF")
    ax.grid(alpha=0.3)
    _legend_below(ax, len(runs))
    return fig


def _legend_below(ax, num_runs: int) -> None:
    """The runs' legend under the axes, in columns: inside, long labels of many runs cover
    the curves and each other."""
    if num_runs:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16),
                  ncol=min(3, num_runs), frameon=False)


def _load_plot(runs: Sequence[dict], name: str):
    """Prompt tokens per worker over the mean, workers sorted by load (rank 1 = the most
    loaded): one group of bars per rank, one bar per run, integer ranks. A run whose
    target names no serving worker (an OpenAI-compatible server other than a prefixgate
    gateway) is listed as such instead of drawing nothing."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.2))
    series, missing = [], []
    for run in runs:
        per = run["summary"].get("per_worker") or {}
        toks = sorted((w["prompt_tokens"] for w in per.values()), reverse=True)
        if toks and sum(toks):
            mean = sum(toks) / len(toks)
            series.append((run["label"], [t / mean for t in toks]))
        else:
            missing.append(run["label"])
    width = 0.8 / max(1, len(series))
    for k, (label, ys) in enumerate(series):
        xs = [i + 1 - 0.4 + width * (k + 0.5) for i in range(len(ys))]
        ax.bar(xs, ys, width=width, label=label)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    top = max((y for _, ys in series for y in ys), default=1.0)
    ax.set_ylim(0, 1.2 * max(1.0, top))  # room for the note above the bars
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if missing:
        where = (0.5, 0.5, "center", "center") if not series else (0.99, 0.97, "right", "top")
        ax.text(where[0], where[1], "no serving worker reported by the target for: "
                + ", ".join(missing), transform=ax.transAxes, ha=where[2], va=where[3],
                fontsize=8, color="dimgrey",
                bbox={"facecolor": "white", "edgecolor": "lightgrey", "alpha": 0.9})
    ax.set(xlabel="worker rank (1 = most prompt tokens)", ylabel="prompt tokens / mean",
           title=f"{name}: per-worker load")
    ax.grid(alpha=0.3, axis="y")
    _legend_below(ax, len(series))
    return fig


def _fleet_plot(runs: Sequence[dict], out_dir: Path, name: str) -> Path:
    """Side by side per run: hit and load max/mean at the workers, TTFT p50 and p99 at
    the client and at the workers."""
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in runs]
    ws = [r["summary"]["workers"] for r in runs]
    cs = [r["summary"]["ttft_s"] or {} for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(15, 0.5 * len(runs) + 2.2), sharey=True)
    ys = range(len(runs))
    panels = [
        ("hit rate (at the workers)", [w["hit_rate"] for w in ws], None),
        ("load max/mean (prompt tokens)",
         [w["load_balance"]["prompt_tokens_max_over_mean"] for w in ws], None),
        ("TTFT p50 (s)", [c.get("p50", 0) for c in cs], [w["ttft_s"]["p50"] for w in ws]),
        ("TTFT p99 (s)", [c.get("p99", 0) for c in cs], [w["ttft_s"]["p99"] for w in ws]),
    ]
    for ax, (title, values, worker_values) in zip(axes, panels, strict=True):
        if worker_values is None:
            ax.barh(ys, values, color="tab:blue")
        else:
            ax.barh([y + 0.2 for y in ys], values, height=0.4, label="client")
            ax.barh([y - 0.2 for y in ys], worker_values, height=0.4, label="worker")
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(list(ys), labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(f"{name}: routers in front of the same emulated workers", fontsize=10)
    return _save(fig, out_dir / f"{name}-fleet.png")


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_report(runs: Sequence[dict], out_dir: str | Path, name: str = "replay",
                 *, plots: bool = True) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps({"runs": list(runs)}, indent=1))
    md_path = out / f"{name}.md"
    md_path.write_text(markdown(runs, name))
    return [json_path, md_path] + (plot(runs, out, name) if plots else [])


def load_runs(paths: Sequence[str | Path]) -> list[dict]:
    """Runs from earlier `<name>.json` reports, for combining them into one report."""
    runs = []
    for p in paths:
        runs += json.loads(Path(p).read_text())["runs"]
    return runs
