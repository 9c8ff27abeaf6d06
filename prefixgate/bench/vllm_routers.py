"""The side-by-side summary of scripts/bench_vllm.sh: routers in front of the same vLLM
servers, each replayed over the same workload, possibly over several rounds.

Contract: `summarize_runs(out_dir, labels, vllm_block_size) -> dict` reads each label's
replay report (`<out_dir>/<label>.json`, written by `prefixgate replay --name <label>`),
pools the turns of one router over its rounds (labels `<router>-r<k>`) and returns, per
router: turns ok / sent, hit rate (cached / prompt tokens), tokens not recomputed (cached
plus pulled from another server, over prompt tokens), TTFT p50 / p90 / p99 / mean
(seconds, client side) and the index truth when the router reported predicted cached
tokens (turns within one vLLM block of what vLLM reported). `comparison` sets prefixgate's
TTFT p99 and tokens not recomputed against the best other router's (the lowest p99 among
the routers not named prefixgate*). `python -m prefixgate.bench.vllm_routers OUT BLOCK
LABEL...` prints one line per router, writes summary.json, summary.md and a TTFT CDF plot
(vllm-routers-ttft-cdf.png) into OUT.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from prefixgate.replay.metrics import distribution

__all__ = ["summarize_runs"]

_ROUND = re.compile(r"-r\d+$")


def _router(label: str) -> str:
    return _ROUND.sub("", label)


def summarize_runs(out_dir: str | Path, labels: list[str], vllm_block_size: int) -> dict:
    out = Path(out_dir)
    turns: dict[str, list[dict]] = defaultdict(list)
    rounds: dict[str, int] = defaultdict(int)
    for label in labels:
        (run,) = json.loads((out / f"{label}.json").read_text())["runs"]
        turns[_router(label)] += run["turns"]
        rounds[_router(label)] += 1
    routers = {}
    for name, ts in turns.items():
        ok = [t for t in ts if t["status"] == "ok"]
        prompt = sum(t["prompt_tokens"] for t in ok)
        cached = sum(t["cached_tokens"] for t in ok)
        pulled = sum(t.get("transferred_tokens", 0) for t in ok)
        row = {"rounds": rounds[name], "turns": len(ts), "turns_ok": len(ok),
               "prompt_tokens": prompt, "cached_tokens": cached, "transferred_tokens": pulled,
               "hit_rate": cached / prompt if prompt else 0.0,
               "not_recomputed": (cached + pulled) / prompt if prompt else 0.0,
               "ttft_s": distribution(t["ttft_s"] for t in ok),
               "ttft_samples_s": sorted(t["ttft_s"] for t in ok)}
        predicted = [t for t in ok if t.get("predicted_cached_tokens", -1) >= 0]
        if predicted:
            within = sum(abs(t["predicted_cached_tokens"] + t.get(
                "predicted_transferred_tokens", 0) - t["cached_tokens"]
                - t.get("transferred_tokens", 0)) <= vllm_block_size for t in predicted)
            row["index_truth"] = {"turns": len(predicted), "within_one_block": within}
        routers[name] = row
    summary: dict = {"routers": routers}
    ours = routers.get("prefixgate")
    others = {n: r for n, r in routers.items() if not n.startswith("prefixgate")
              and r["ttft_s"]}
    if ours and ours["ttft_s"] and others:
        best = min(others, key=lambda n: others[n]["ttft_s"]["p99"])
        summary["comparison"] = {
            "best_other": best,
            "ttft_p99_ratio": ours["ttft_s"]["p99"] / others[best]["ttft_s"]["p99"],
            "ttft_p50_ratio": ours["ttft_s"]["p50"] / others[best]["ttft_s"]["p50"],
            "not_recomputed": ours["not_recomputed"],
            "best_other_not_recomputed": others[best]["not_recomputed"]}
    return summary


def _line(name: str, r: dict) -> str:
    d = r["ttft_s"] or {"p50": 0, "p90": 0, "p99": 0}
    line = (f"{name}: {r['turns_ok']}/{r['turns']} turns ok ({r['rounds']} rounds), "
            f"hit {r['hit_rate']:.1%}, not recomputed {r['not_recomputed']:.1%}, TTFT p50 "
            f"{d['p50'] * 1e3:.0f} p90 {d['p90'] * 1e3:.0f} p99 {d['p99'] * 1e3:.0f} ms")
    if "index_truth" in r:
        it = r["index_truth"]
        line += (f"; index truth {it['within_one_block']}/{it['turns']} turns within one "
                 "vLLM block")
    return line


def _markdown(summary: dict) -> str:
    rows = ["| router | turns ok | hit | not recomputed (pulled) | TTFT p50 / p90 / p99 ms |",
            "|---|---|---|---|---|"]
    for name, r in summary["routers"].items():
        d = r["ttft_s"] or {"p50": 0, "p90": 0, "p99": 0}
        rows.append(f"| {name} | {r['turns_ok']}/{r['turns']} | {r['hit_rate']:.1%} | "
                    f"{r['not_recomputed']:.1%} ({r['transferred_tokens']:,}) | "
                    f"{d['p50'] * 1e3:.0f} / {d['p90'] * 1e3:.0f} / {d['p99'] * 1e3:.0f} |")
    c = summary.get("comparison")
    if c:
        rows += ["", f"prefixgate against the best other router ({c['best_other']}): TTFT p99 "
                 f"{c['ttft_p99_ratio']:.2f}x, p50 {c['ttft_p50_ratio']:.2f}x; tokens not "
                 f"recomputed {c['not_recomputed']:.1%} against {c['best_other_not_recomputed']:.1%}"]
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3:
        raise SystemExit("usage: python -m prefixgate.bench.vllm_routers OUT BLOCK LABEL...")
    out, block, labels = Path(args[0]), int(args[1]), args[2:]
    summary = summarize_runs(out, labels, block)
    for name, r in summary["routers"].items():
        print(_line(name, r))
    (out / "summary.md").write_text(_markdown(summary))
    print(_markdown(summary).splitlines()[-1])
    slim = {"routers": {n: {k: v for k, v in r.items() if k != "ttft_samples_s"}
                        for n, r in summary["routers"].items()},
            "comparison": summary.get("comparison")}
    (out / "summary.json").write_text(json.dumps(slim, indent=1))
    from prefixgate.replay.report import ttft_cdf_plot

    runs = [{"label": n, "ttft_samples_s": r["ttft_samples_s"]}
            for n, r in summary["routers"].items()]
    ttft_cdf_plot(runs, "vLLM servers, routers side by side", out / "vllm-routers-ttft-cdf.png")


if __name__ == "__main__":
    main()
