"""`prefixgate replay`: replay a trace against a gateway or an OpenAI-compatible server.

`add_arguments(parser)` adds the replay flags (every flag has a PREFIXGATE_REPLAY_<FLAG>
variable, never a serving command's: cli/flags.py);
`run(args)` does one of

  * a real replay of --trace against --target (a prefixgate gateway host:port, or an
    OpenAI-compatible http(s):// base URL) under one arrival mode;
  * --simulate: the routing simulator over --trace for every --sim-policies policy and
    --sim-workers count;
  * --fleet N: real gateways in front of N emulated workers (replay/fleet.py); with
    --simulate too, the simulator on the same plan after it, each fleet run compared
    with its simulated run turn by turn (replay/fleet.py agreement: a table more);
  * --combine: one report from earlier reports' JSON files;
  * --compare-policies: every routing policy simulated on each of the --trace files
    (comma-separated), one document (replay/compare.py): TTFT, goodput, hit and load;

then writes <out>/<name>.json, .md and plots, prints the Markdown (or, with --json, the JSON
document) on stdout, and returns the exit code (1 when every turn failed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from prefixgate.cli.common import (
    log_flags,
    quiet_http_client_logs,
    service_flags,
    service_model,
    transfer_flags,
)
from prefixgate.cli.flags import flag, own_variables

HELP = ("replay a recorded trace against a gateway or an OpenAI-compatible server, or "
        "simulate routing")
DESCRIPTION = (
    "Replay a recorded trace (ShareGPT, Mooncake, or a gateway's --record-trace file) against "
    "a prefixgate gateway or an OpenAI-compatible server and report latency, prefix hit rate "
    "and load balance (JSON, Markdown, PNG plots); or, with --simulate, compare the gateway's "
    "routing policies on simulated workers without a model. See docs/traces.md.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    own_variables(p, "replay")  # PREFIXGATE_REPLAY_*: never a serving variable
    log_flags(p)
    flag(p, "--trace", default="", help="trace file: ShareGPT JSON/JSONL(.gz), Mooncake JSONL, "
                                        "or a gateway's --record-trace file")
    flag(p, "--trace-format", default="auto",
         choices=["auto", "sharegpt", "mooncake", "prefixgate"], help="trace format")
    flag(p, "--skip-malformed", action="store_true",
         help="skip malformed trace lines (counted) instead of stopping at the first")
    flag(p, "--max-conversations", type=int, default=0,
         help="use only the trace's first N conversations (0: all)")
    flag(p, "--target", default="127.0.0.1:50051",
         help="prefixgate gateway host:port, or an OpenAI-compatible server's http(s):// URL")
    flag(p, "--openai-model", default="", help="model name sent to an OpenAI-compatible target")
    flag(p, "--arrival", default="auto", choices=["auto", "open", "closed", "poisson"],
         help="open: trace timestamps / --speedup; closed: --concurrency conversations at "
              "a time; poisson: conversation starts at --rate per second; auto: open when "
              "the trace has timestamps, else closed")
    flag(p, "--speedup", type=float, default=1.0, help="open loop: trace time divided by this")
    flag(p, "--concurrency", type=int, default=8, help="closed loop: simultaneous conversations")
    flag(p, "--rate", type=float, default=1.0, help="poisson: conversation starts per second")
    flag(p, "--think-time", type=float, default=0.0,
         help="closed/poisson: seconds between a reply and the conversation's next turn")
    flag(p, "--seed", type=int, default=0, help="seed of Poisson arrivals and random routing")
    flag(p, "--max-turns", type=int, default=0, help="send at most this many turns (0: all)")
    flag(p, "--max-duration", type=float, default=0.0,
         help="start no turn after this many seconds (0: no bound)")
    flag(p, "--max-tokens", type=int, default=256,
         help="reply cap per turn (a shorter recorded output length wins)")
    flag(p, "--max-prompt-tokens", type=int, default=0,
         help="token traces: cut synthesised prompts to this many tokens (0: never)")
    flag(p, "--vocab-size", type=int, default=32000,
         help="token traces: synthesised token ids lie below this (the target model's vocab)")
    flag(p, "--timeout", type=float, default=300.0, help="deadline per turn in seconds")
    flag(p, "--label", default="", help="this run's name in reports (default: the target)")
    flag(p, "--out", default="replay-out", help="directory for the JSON, Markdown and plots")
    flag(p, "--name", default="replay", help="file name stem of the report and plots")
    flag(p, "--no-plots", action="store_true", help="skip the PNG plots")
    flag(p, "--no-progress", action="store_true", help="no progress bar")
    flag(p, "--json", action="store_true", help="print the JSON report on stdout, not Markdown")
    flag(p, "--combine", action="append",
         help="combine the runs of these earlier <name>.json reports into one report")
    # Routing simulator.
    flag(p, "--simulate", action="store_true",
         help="no model: simulate workers (LRU block caches, service-time model) and compare "
              "routing policies on the trace; with --fleet N: also simulate the fleet's "
              "runs and compare each with its fleet run (hit, TTFT, turn by turn)")
    flag(p, "--compare-policies", action="store_true",
         help="simulate every routing policy (or the --sim-policies) on each --trace (several "
              "separated by commas) and report each rule's TTFT p50/p90/p99, goodput, tokens "
              "not recomputed and load side by side (docs/bench/routing-policies.md)")
    flag(p, "--seeds", type=int, default=1,
         help="--compare-policies: run every policy under this many arrival seeds (--seed, "
              "--seed+1, ...) and report each figure's mean and range over them (open loop: "
              "seed 0 plays the trace's timestamps, another seed resamples them)")
    flag(p, "--ttft-target", type=float, default=1.0,
         help="--compare-policies: goodput counts the turns whose TTFT is within this many "
              "(emulated) seconds")
    flag(p, "--sim-policies", action="append",
         help="simulated routing policies (default: all the gateway has); a policy may set "
              "routing weights: prefix:shared_prefix_weight=1:load_weight=0.5")
    flag(p, "--sim-workers", action="append", type=int,
         help="simulated worker counts, e.g. 8,32 (default: 8)")
    flag(p, "--capacity-tokens", type=int, default=2_048_000,
         help="simulated KV capacity per worker in tokens")
    flag(p, "--sim-block-size", type=int, default=0,
         help="simulated cache block size in tokens (0: the trace's, 16 for chat traces)")
    service_flags(p, "--simulate/--fleet")
    transfer_flags(p, "--simulate/--fleet")
    flag(p, "--tokenizer-model", default="smollm2-135m",
         help="simulating a chat trace: the model whose tokenizer and chat template count "
              "its tokens")
    fleet_flags(p)  # --fleet: real gateways in front of emulated workers


def fleet_flags(p: argparse.ArgumentParser) -> None:
    """The --fleet flags (replay/fleet.py; the workers' model is the simulator's:
    --capacity-tokens, --sim-block-size, --prefill-tokens-per-s, --decode-s-per-token;
    --gateways, --fleet-redis and --time-scale also shape --simulate: replay/plan.py)."""
    flag(p, "--fleet", type=int, default=0,
         help="replay through real gateways in front of this many emulated workers, all "
              "started and stopped by this command (0: off; docs/traces.md)")
    flag(p, "--gateways", action="append", type=int,
         help="--fleet/--simulate: gateway replicas, one run per count, e.g. 1,2,4 (default: 1)")
    flag(p, "--fleet-redis", action="store_true",
         help="--fleet: workers register in and gateways follow a private Redis (else "
              "gateways list the workers and follow WatchEvents); --simulate: gateways "
              "share routing predictions")
    flag(p, "--time-scale", type=float, default=1.0,
         help="--fleet: emulated seconds per wall second (the whole fleet and the arrivals "
              "run this much faster; reported times are emulated); --simulate: the same "
              "fleet's, for the gateways' wall-clock constants")
    flag(p, "--publish-at", default="prefill", choices=("prefill", "finish"),
         help="--fleet/--simulate: workers publish a prompt's blocks when its prefill "
              "completes (as prefixgate's engine does), or only when the request finishes "
              "(as engines that publish with the reply do)")
    flag(p, "--no-conversation-ids", action="store_true",
         help="--fleet/--simulate: send turns without their conversation id, as agents and "
              "OpenAI-style clients do: a follow-up is routed by its cached prefix alone "
              "(the race routing predictions cover)")
    flag(p, "--sim-turnaround-ms", action="append", type=float,
         help="--simulate: wall milliseconds from a reply's end to its user's next turn "
              "arriving (x --time-scale), one drawn per turn from these, e.g. 6,9,15 "
              "(default: the emulated fleet's measured deciles, docs/traces.md; 0: none)")
    flag(p, "--gateway-args", default="",
         help="--fleet: more flags for every gateway, given with '=': "
              "--gateway-args='--prediction-ttl-s 0'")
    flag(p, "--peer-router", default="",
         help="--fleet: also run this HTTP router (its command; it gets --host, --port and "
              "--worker-urls; each {free_port} in it becomes a free port) in place of the "
              "gateways, e.g. '/path/python -m sglang_router.launch_router --policy "
              "cache_aware --prometheus-port {free_port}'")
    flag(p, "--peer-label", default="",
         help="--fleet: the peer router's name in reports")
    flag(p, "--fleet-logs", default="",
         help="--fleet: keep the processes' logs in this directory (default: a temporary one)")


def fleet_plan(args: argparse.Namespace):
    """The FleetPlan (replay/plan.py) the --simulate and --fleet flags stand for."""
    import shlex

    from prefixgate.replay.plan import FleetPlan

    return FleetPlan(
        trace_path=args.trace, label=args.label, tokenizer_model=args.tokenizer_model,
        block_size=args.sim_block_size, capacity_tokens=args.capacity_tokens,
        service=service_model(args), transfer_bytes_per_s=args.transfer_bytes_per_s,
        kv_bytes_per_token=args.kv_bytes_per_token, policies=tuple(args.sim_policies or ()),
        num_workers=args.fleet, worker_counts=tuple(args.sim_workers or ()),
        gateway_counts=tuple(args.gateways or (1,)), redis=args.fleet_redis,
        time_scale=args.time_scale, publish_at=args.publish_at,
        conversation_ids=not args.no_conversation_ids,
        turnaround_s=(tuple(t / 1e3 for t in args.sim_turnaround_ms)
                      if args.sim_turnaround_ms else None),
        gateway_args=tuple(shlex.split(args.gateway_args)),
        peer_router=tuple(shlex.split(args.peer_router)), peer_label=args.peer_label,
        logs_dir=args.fleet_logs, timeout_s=args.timeout, progress=not args.no_progress)


def limits(args: argparse.Namespace):
    from prefixgate.replay.loadgen import Limits

    return Limits(args.max_turns, args.max_duration, args.max_tokens, args.max_prompt_tokens,
                  args.vocab_size)


def arrival_config(args: argparse.Namespace, trace):
    from prefixgate.replay.loadgen import ArrivalConfig

    mode = args.arrival
    if mode == "auto":
        mode = "open" if trace.has_timestamps else "closed"
    return ArrivalConfig(mode, args.speedup, args.concurrency, args.rate, args.think_time,
                         args.seed)


def _target(args: argparse.Namespace):
    from prefixgate.replay.targets import GatewayTarget, OpenAITarget

    if args.target.startswith(("http://", "https://")):
        return OpenAITarget(args.target, model=args.openai_model, timeout_s=args.timeout)
    return GatewayTarget(args.target.removeprefix("grpc://"), timeout_s=args.timeout)


async def _replay(args: argparse.Namespace, trace) -> dict:
    from prefixgate.replay.loadgen import run_load
    from prefixgate.replay.metrics import summarize

    arrival = arrival_config(args, trace)
    turn_limits = limits(args)
    target = _target(args)
    try:
        if hasattr(target, "wait_ready"):
            try:
                await target.wait_ready(10)
            except TimeoutError:
                raise SystemExit(f"prefixgate replay: no gateway answers at {args.target}") from None
        result = await run_load(trace, target, arrival, turn_limits,
                                progress=not args.no_progress)
    finally:
        await target.close()
    summary = summarize(result.records, result.duration_s)
    return {"label": args.label or target.name,
            "config": {"trace": args.trace, "target": args.target, "arrival": vars(arrival),
                       "limits": vars(turn_limits), "started_unix_s": result.started_unix_s},
            "summary": summary,
            "ttft_samples_s": sorted(r.ttft_s for r in result.records
                                     if r.ok and r.completion_tokens),
            "turns": [{"conversation_id": r.conversation_id, "turn": r.turn_index,
                       "start_s": round(r.start_s, 4), "status": r.status,
                       "ttft_s": round(r.ttft_s, 4), "e2e_s": round(r.e2e_s, 4),
                       "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                       "transferred_tokens": r.transferred_tokens,
                       "completion_tokens": r.completion_tokens, "worker": r.worker,
                       # What a prefixgate gateway predicted cached (-1: not reported)
                       # and predicted to arrive by a pull from another worker.
                       "predicted_cached_tokens": r.predicted_cached_tokens,
                       "predicted_transferred_tokens": r.predicted_transferred_tokens}
                      for r in result.records]}


def _compare(args: argparse.Namespace) -> int:
    """--compare-policies: one document for every trace and policy (replay/compare.py)."""
    from prefixgate.replay import compare
    from prefixgate.replay.traces import TraceError, read_trace

    paths = [p for p in args.trace.split(",") if p]
    if not paths:
        raise SystemExit("prefixgate replay: --compare-policies needs --trace PATH[,PATH...]")
    traces = []
    for path in paths:
        try:
            trace = read_trace(path, args.trace_format, skip_malformed=args.skip_malformed)
        except TraceError as exc:
            raise SystemExit(f"prefixgate replay: {exc}") from None
        traces.append((path, trace.head(args.max_conversations)))
    if args.seeds < 1:
        raise SystemExit("prefixgate replay: --seeds must be at least 1")
    doc = compare.compare(traces, fleet_plan(args), lambda t: arrival_config(args, t),
                          limits(args), args.ttft_target,
                          range(args.seed, args.seed + args.seeds))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{args.name}.json", out / f"{args.name}.md"]
    written[0].write_text(json.dumps(doc, indent=1))
    written[1].write_text(compare.markdown(doc, args.name))
    if not args.no_plots:
        written += compare.plot(doc, out, args.name)
    print("prefixgate replay: wrote " + ", ".join(map(str, written)), file=sys.stderr)
    print(json.dumps(doc) if args.json else compare.markdown(doc, args.name))
    return 0


def _fleet_and_simulator(args: argparse.Namespace, trace) -> tuple[list[dict], list]:
    """--fleet N --simulate: the fleet runs, then the simulator on the same plan (N
    workers, the same gateway counts and policies, default prefix), each fleet run paired
    with the simulated run of its policy and gateway count; each fleet run's summary gets
    `simulated` (replay/fleet.py agreement). Returns the fleet runs, then the simulated
    ones, and the (label, agreement) pairs."""
    import dataclasses

    from prefixgate.replay.fleet import agreement, run_fleet
    from prefixgate.replay.simulate import run_simulations

    plan = fleet_plan(args)
    policies = tuple(p for p in (plan.policies or ("prefix",)) if p != "none")
    arrival, turn_limits = arrival_config(args, trace), limits(args)
    if turn_limits.max_turns or turn_limits.max_duration_s:
        raise SystemExit("prefixgate replay: --fleet with --simulate replays whole "
                         "conversations: bound the run with --max-conversations (the "
                         "simulator sends every turn of them)")
    fleet_runs = run_fleet(trace, plan, arrival, turn_limits)
    sim_runs = run_simulations(trace, dataclasses.replace(
        plan, policies=policies, worker_counts=(args.fleet,)), arrival, turn_limits) \
        if policies else []
    by_key = {(r["config"]["policy"], r["config"]["num_gateways"]): r for r in sim_runs}
    pairs = []
    for run in fleet_runs:
        sim = by_key.get((run["config"].get("policy"), run["config"]["fleet"]["num_gateways"]))
        if sim is not None and not run["config"]["fleet"]["peer_router"]:
            run["summary"]["simulated"] = agreement(run, sim)
            pairs.append((run["label"], run["summary"]["simulated"]))
    for sim in sim_runs:
        sim["label"] = f"--simulate {sim['label']}"
    return fleet_runs + sim_runs, pairs


def run(args: argparse.Namespace) -> int:
    from prefixgate.replay.report import load_runs, markdown, write_report
    from prefixgate.replay.traces import TraceError, read_trace

    quiet_http_client_logs()  # not one line per turn against an HTTP target
    if args.compare_policies:
        return _compare(args)
    agreements: list[tuple[str, dict]] = []
    if args.combine:
        runs = load_runs(args.combine)
    else:
        if not args.trace:
            raise SystemExit("prefixgate replay: give a trace with --trace PATH "
                             "(or --combine earlier reports)")
        try:
            trace = read_trace(args.trace, args.trace_format, skip_malformed=args.skip_malformed)
        except TraceError as exc:
            raise SystemExit(f"prefixgate replay: {exc}") from None
        if trace.num_skipped:
            print(f"prefixgate replay: skipped {trace.num_skipped} malformed lines of "
                  f"{args.trace}", file=sys.stderr)
        trace = trace.head(args.max_conversations)
        if args.fleet and args.simulate:
            runs, agreements = _fleet_and_simulator(args, trace)
        elif args.fleet:
            from prefixgate.replay.fleet import run_fleet

            runs = run_fleet(trace, fleet_plan(args), arrival_config(args, trace),
                             limits(args))
        elif args.simulate:
            from prefixgate.replay.simulate import run_simulations

            runs = run_simulations(trace, fleet_plan(args), arrival_config(args, trace),
                                   limits(args))
        else:
            try:
                runs = [asyncio.run(_replay(args, trace))]
            except ValueError as exc:
                raise SystemExit(f"prefixgate replay: {exc}") from None
    paths = write_report(runs, args.out, args.name, plots=not args.no_plots)
    text = markdown(runs, args.name)
    if agreements:  # the fleet against the simulator: a table more in the Markdown
        from prefixgate.replay.fleet import agreement_markdown

        extra = agreement_markdown(agreements)
        text += extra
        with Path(args.out, f"{args.name}.md").open("a") as f:
            f.write(extra)
    print("prefixgate replay: wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    print(json.dumps({"runs": runs}) if args.json else text)
    return 1 if runs and all(r["summary"]["turns"] and not r["summary"]["turns_ok"]
                             for r in runs) else 0
