"""`prefixgate replay --fleet N`: replay a trace through real gateways in front of an
emulated fleet (prefixgate/emulate), brought up and torn down by the command.

Contract: `run_fleet(trace, plan, arrival, limits)` returns one report run (the dict
`prefixgate replay` writes) per gateway count in `plan.gateway_counts` and per policy in
`plan.policies` (default: prefix; "none": no prefixgate run), then, with
`plan.peer_router`, per gateway count with that many replicas of that HTTP router (e.g.
sglang-router) in place of the gateways; each on a fresh fleet (empty caches):

  * `plan.num_workers` emulated workers (`capacity_tokens` / block size = cache
    capacity, `plan.service`: the simulator's FleetPlan, so `--simulate` and `--fleet`
    model the same workers, replay/plan.py), optionally behind Redis (`plan.redis`);
  * the trace replayed under `arrival` with turns spread round-robin over the gateways;
    a chat turn asks for its recorded reply's length (`with_reply_lengths`, at most
    --max-tokens), as the simulator decodes it.

Time: `plan.time_scale` S runs the whole fleet S times faster than the emulated clock:
workers divide service times by S, arrivals (already divided by --speedup), think
times and the gaps between Poisson conversation starts are divided by S
(`wall_arrivals`), gateways push status every 50 ms / S (at least 10 ms:
`status_interval_ms`), and every reported time is emulated (wall-clock figures x S). At
S = 1 the fleet runs in real time; the trace's own clock is divided by --speedup in both.

Reported beside the client's figures (summary): `workers`: hit rate counted at the workers
(leading cached blocks x block size / prompt tokens), worker-side TTFT (queue + prefill)
and queue distributions, load max/mean over workers of prompt tokens and of turns; and
`decisions` when the gateways report them (regret: turns not sent to the worker the
gateway predicted to hold the longest cached prefix, and the cached tokens lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import sys
import tempfile
from pathlib import Path

from prefixgate.replay.loadgen import ArrivalConfig, Limits, run_load
from prefixgate.replay.metrics import distribution, summarize
from prefixgate.replay.plan import FleetPlan, fleet_model, status_interval_ms
from prefixgate.replay.targets import (
    GatewayTarget,
    OpenAITarget,
    Target,
    TurnRecord,
    TurnRequest,
)
from prefixgate.replay.traces import Trace, warm_block_runs


class RoundRobin(Target):
    """Turns spread over several front ends in turn (a load balancer in front of
    replicas): prefixgate gateways (host:port) or HTTP routers (http:// URLs, sent token
    ids as text, see OpenAITarget)."""

    def __init__(self, addresses: list[str], timeout_s: float,
                 conversation_ids: bool = True) -> None:
        self.targets = [OpenAITarget(a, timeout_s=timeout_s, text_token_ids=True)
                        if a.startswith("http") else
                        GatewayTarget(a, timeout_s=timeout_s, conversation_ids=conversation_ids)
                        for a in addresses]
        self.name = f"x{len(addresses)} front ends"
        self._next = itertools.cycle(self.targets)

    async def wait_ready(self, timeout_s: float) -> None:
        await asyncio.gather(*(t.wait_ready(timeout_s) for t in self.targets
                               if hasattr(t, "wait_ready")))

    async def send(self, request: TurnRequest) -> TurnRecord:
        return await next(self._next).send(request)

    async def close(self) -> None:
        for t in self.targets:
            await t.close()


def policy_flags(spec: str) -> list[str]:
    """`prefix:load_weight=0.5` -> gateway flags `--policy prefix --load-weight 0.5`; a
    switch of RoutingConfig set to 0 becomes its `--no-` flag (`transfer=0`:
    `--no-transfer`), set to 1 nothing (the default)."""
    from prefixgate.gateway.routing import RoutingConfig

    name, *fields = spec.split(":")
    out = ["--policy", name]
    for item in fields:
        key, _, value = item.partition("=")
        key, value = key.strip(), value.strip()
        flag = key.replace("_", "-")
        if isinstance(getattr(RoutingConfig, key, None), bool):
            out += [] if value not in ("0", "false") else [f"--no-{flag}"]
        else:
            out += [f"--{flag}", value]
    return out


def worker_summary(served: list[dict], workers: list[str]) -> dict:
    """Hit, worker-side TTFT/queue and load balance from the workers' own records."""
    prompt = sum(r["prompt_tokens"] for r in served)
    cached = sum(r["cached_tokens"] for r in served)
    per = {w: {"turns": 0, "prompt_tokens": 0, "cached_tokens": 0} for w in workers}
    for r in served:
        w = per.setdefault(r["worker"], {"turns": 0, "prompt_tokens": 0, "cached_tokens": 0})
        w["turns"] += 1
        w["prompt_tokens"] += r["prompt_tokens"]
        w["cached_tokens"] += r["cached_tokens"]
    n = max(1, len(per))
    turns = [w["turns"] for w in per.values()] or [0]
    toks = [w["prompt_tokens"] for w in per.values()] or [0]
    return {
        "requests": len(served),
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_s": distribution(r["ttft_s"] for r in served),
        "queue_s": distribution(r["queue_s"] for r in served),
        "load_balance": {
            "turns_max_over_mean": max(turns) / (sum(turns) / n) if sum(turns) else 0.0,
            "prompt_tokens_max_over_mean": max(toks) / (sum(toks) / n) if sum(toks) else 0.0},
        "per_worker": dict(sorted(per.items())),
    }


def decision_summary(records: list[TurnRecord]) -> dict | None:
    """Regret from the gateways' predictions (None when they report none)."""
    ok = [r for r in records if r.ok and r.best_predicted_cached_tokens >= 0]
    if not ok:
        return None
    # A turn that pulls what the best-cached worker holds loses nothing by going elsewhere.
    off = [r for r in ok if r.predicted_cached_tokens + r.predicted_transferred_tokens
           < r.best_predicted_cached_tokens]
    exact = sum(r.predicted_cached_tokens == r.cached_tokens for r in ok)
    return {"turns": len(ok),
            "turns_off_best": len(off),
            "share_on_best": 1 - len(off) / len(ok),
            "cached_tokens_lost": sum(r.best_predicted_cached_tokens - r.predicted_cached_tokens
                                      - r.predicted_transferred_tokens for r in off),
            "turns_pulled": sum(r.predicted_transferred_tokens > 0 for r in ok),
            "predicted_transferred_tokens": sum(r.predicted_transferred_tokens for r in ok),
            "predicted_exact_share": exact / len(ok),
            "predicted_minus_actual_tokens": sum(r.predicted_cached_tokens - r.cached_tokens
                                                 for r in ok)}


def worker_times(records: list[TurnRecord], served: list[dict], started_unix_s: float,
                 scale: float) -> dict[tuple[str, int], tuple[float, float, float, float]]:
    """(conversation, turn) -> (arrival, end, TTFT, late) of that turn at its worker,
    emulated seconds, arrival and end from the run's start (the client records' clock),
    TTFT the worker's own (queue + prefill), late how much after its computed time the
    worker's timer sent the first token (the host's delay of the worker): client records
    (emulated, from the run's start) are joined to the workers' (`served`) by worker,
    prompt tokens and the nearest arrival to the client's send."""
    pool: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    for s in served:
        arrival = (s["arrival_unix_s"] - started_unix_s) * scale
        pool.setdefault((s["worker"], s["prompt_tokens"]), []).append(
            (arrival, arrival + s["total_s"], s.get("ttft_s", 0.0),
             s.get("first_token_late_s", 0.0)))
    out = {}
    for r in sorted((r for r in records if r.ok), key=lambda r: r.start_s):
        cands = pool.get((r.worker, r.prompt_tokens))
        if cands:
            best = min(cands, key=lambda c: abs(c[0] - r.start_s))
            cands.remove(best)
            out[(r.conversation_id, r.turn_index)] = best
    return out


def turnaround_summary(records: list[TurnRecord],
                       at_worker: dict[tuple[str, int], tuple[float, float, float, float]]
                       ) -> dict | None:
    """The turnaround of follow-ups, emulated seconds: from the end of a turn at its worker
    (its reply's last token, when a worker publishing at finish stores its blocks) to the
    next turn of the conversation being sent by the client (`to_send_s`) and arriving at
    its worker (`to_worker_s`: the gateway tokenized and routed it in between; its routing
    decision is a gRPC hop before that arrival); `client_s`: the client's own part (its
    reply's end to its next send). None without follow-ups."""
    by_turn = {(r.conversation_id, r.turn_index): r for r in records if r.ok}
    send, worker, client = [], [], []
    for (conv, i), (_, end, *_) in at_worker.items():
        nxt, after = by_turn.get((conv, i + 1)), at_worker.get((conv, i + 1))
        if nxt is not None and after is not None:
            r = by_turn[(conv, i)]
            send.append(nxt.start_s - end)
            worker.append(after[0] - end)
            client.append(nxt.start_s - (r.start_s + r.e2e_s))
    if not send:
        return None
    return {"to_send_s": distribution(send), "to_worker_s": distribution(worker),
            "client_s": distribution(client)}


def ttft_breakdown(records: list[TurnRecord],
                   at_worker: dict[tuple[str, int], tuple[float, float, float, float]]
                   ) -> dict | None:
    """Where each turn's client TTFT went, emulated seconds, as distributions over the
    turns joined to their worker's record: `to_worker_s` (the client's send to the turn's
    arrival at its worker: the client, the front, its routing and both hops), `worker_s`
    (the worker's own queue + prefill), `from_worker_s` (the rest: the first token's way
    back through the front to the client, and any lateness of the worker's send on a busy
    host), `worker_late_s` (that lateness alone: the emulated worker's timer firing after
    its computed time); and, where the front reports its own TTFT (prefixgate's
    ChatFinal), `front_s` (the gateway's handler start to the first token it relayed) and
    `client_side_s` (client TTFT less that: the client and the hops to and from the
    front). None when no turn joined."""
    to_worker, worker, back, late, front, client = [], [], [], [], [], []
    for r in records:
        w = at_worker.get((r.conversation_id, r.turn_index))
        if w is None or not r.ok or not r.completion_tokens:
            continue
        to_worker.append(w[0] - r.start_s)
        worker.append(w[2])
        back.append(r.ttft_s - (w[0] - r.start_s) - w[2])
        late.append(w[3])
        if r.gateway_ttft_s >= 0:
            front.append(r.gateway_ttft_s)
            client.append(r.ttft_s - r.gateway_ttft_s)
    if not to_worker:
        return None
    out = {"to_worker_s": distribution(to_worker), "worker_s": distribution(worker),
           "from_worker_s": distribution(back), "worker_late_s": distribution(late)}
    if front:
        out.update(front_s=distribution(front), client_side_s=distribution(client))
    return out


def _scaled(rec: TurnRecord, scale: float) -> TurnRecord:
    return dataclasses.replace(rec, start_s=rec.start_s * scale, ttft_s=rec.ttft_s * scale,
                               e2e_s=rec.e2e_s * scale, itl_s=[g * scale for g in rec.itl_s],
                               gateway_ttft_s=(rec.gateway_ttft_s * scale
                                               if rec.gateway_ttft_s >= 0 else -1.0))


def wall_arrivals(arrival: ArrivalConfig, scale: float) -> ArrivalConfig:
    """`arrival` (emulated seconds, as the simulator plays it) on the wall clock of a
    fleet running `scale` times faster: trace times, think times and the gaps between
    Poisson conversation starts divided by `scale`."""
    return dataclasses.replace(arrival, speedup=arrival.speedup * scale,
                               think_time_s=arrival.think_time_s / scale,
                               rate_per_s=arrival.rate_per_s * scale)


async def fleet_run(trace: Trace, fleet_config, arrival: ArrivalConfig, limits: Limits, *,
                    timeout_s: float, workdir: Path, label: str, progress: bool,
                    conversation_ids: bool = True, policy: str = "") -> dict:
    """One replay of `trace` through a fresh fleet (emulate.fleet.FleetConfig)."""
    from prefixgate.emulate.fleet import Fleet

    scale = fleet_config.time_scale
    wall_arrival = wall_arrivals(arrival, scale)
    fleet = Fleet(fleet_config, workdir)
    async with fleet:
        target = RoundRobin(fleet.gateways, timeout_s / scale, conversation_ids)
        try:
            await target.wait_ready(10)
            result = await run_load(trace, target, wall_arrival, limits, progress=progress)
        finally:
            await target.close()
    records = [_scaled(r, scale) for r in result.records]
    served = fleet.served()
    workers = [f"worker-{i}" for i in range(fleet_config.num_workers)]
    summary = summarize(records, result.duration_s * scale, workers=workers)
    summary["workers"] = worker_summary(served, workers)
    summary["decisions"] = decision_summary(records)
    at_worker = worker_times(records, served, result.started_unix_s, scale)
    summary["turnaround"] = turnaround_summary(records, at_worker)
    summary["ttft_breakdown"] = ttft_breakdown(records, at_worker)
    failed = {}
    for r in records:
        if not r.ok:
            failed.setdefault(f"{r.status}: {r.error}"[:300], 0)
            failed[f"{r.status}: {r.error}"[:300]] += 1
    summary["failures"] = failed
    # What the path around the workers added: client TTFT over the same turns' worker TTFT
    # is not joinable per turn, so compare the distributions' medians and tails.
    cfg = dataclasses.asdict(fleet_config)
    return {"label": label,
            "config": {"trace": trace.source, "fleet": cfg, "policy": policy,
                       "arrival": vars(arrival),
                       "limits": vars(limits), "started_unix_s": result.started_unix_s,
                       "wall_s": result.duration_s},
            "summary": summary,
            "ttft_samples_s": sorted(r.ttft_s for r in records if r.ok and r.completion_tokens),
            "worker_ttft_samples_s": sorted(r["ttft_s"] for r in served),
            "turns": [{"conversation_id": r.conversation_id, "turn": r.turn_index,
                       "start_s": round(r.start_s, 4), "status": r.status,
                       "ttft_s": round(r.ttft_s, 4), "e2e_s": round(r.e2e_s, 4),
                       "gateway_ttft_s": round(r.gateway_ttft_s, 4),
                       "prompt_tokens": r.prompt_tokens,
                       "cached_tokens": r.cached_tokens,
                       "transferred_tokens": r.transferred_tokens, "worker": r.worker,
                       "predicted_cached_tokens": r.predicted_cached_tokens,
                       "best_predicted_cached_tokens": r.best_predicted_cached_tokens,
                       "worker_arrival_s": round(w[0], 4) if w else None,
                       "worker_end_s": round(w[1], 4) if w else None,
                       "worker_ttft_s": round(w[2], 4) if w else None,
                       "worker_late_s": round(w[3], 4) if w else None}
                      for r in sorted(records, key=lambda r: r.start_s)
                      for w in (at_worker.get((r.conversation_id, r.turn_index)),)]}


def with_reply_lengths(trace: Trace, tokenizer) -> Trace:
    """A chat trace whose turns carry their recorded reply's length in tokens (at least
    1; `tokenizer`: a ChatTokenizer, the fleet's model's), so that each turn asks for that
    many (at most --max-tokens) as the simulator decodes them (simulate.prepare_turns):
    an emulated worker generates every token it is asked for, where a model would stop
    at the recorded reply's length; without it every chat turn decoded --max-tokens.
    Token traces, which record their output lengths, come back as they are."""
    if not trace.is_chat:
        return trace
    replies = [t.reply for c in trace.conversations for t in c.turns]
    lengths = iter([max(1, len(e.ids)) for e in tokenizer.tokenizer.encode_batch(
        replies, add_special_tokens=False)])
    convs = tuple(dataclasses.replace(c, turns=tuple(
        dataclasses.replace(t, num_output_tokens=next(lengths)) for t in c.turns))
        for c in trace.conversations)
    return dataclasses.replace(trace, conversations=convs)


def run_fleet(trace: Trace, plan: FleetPlan, arrival: ArrivalConfig,
              limits: Limits) -> list[dict]:
    """The --fleet runs of `prefixgate replay` (module docstring)."""
    from prefixgate.emulate.fleet import FleetConfig

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    spec, block_size = fleet_model(trace, plan, limits.max_tokens)
    if trace.is_chat:
        from prefixgate.model.tokenizer import ChatTokenizer

        trace = with_reply_lengths(trace, ChatTokenizer(spec))
    # Every run's client sends the same prompts: derive them before any run's clock starts
    # (the first run's client would otherwise derive them while timing its front, and the
    # later runs of this process would find them done).
    warm_block_runs(trace, limits.vocab_size)
    context = spec.max_context_tokens
    # "none": no prefixgate runs (only the --peer-router's).
    policies = [p for p in (plan.policies or ("prefix",)) if p != "none"]
    fronts = [(g, policy, ()) for g in plan.gateway_counts for policy in policies]
    if plan.peer_router:
        fronts += [(g, "", plan.peer_router) for g in plan.gateway_counts]
    runs = []
    for gateways, policy, router in fronts:
        config = FleetConfig(
            num_workers=plan.num_workers, num_gateways=gateways,
            capacity_blocks=plan.capacity_tokens // block_size, block_size=block_size,
            service=plan.service, time_scale=plan.time_scale,
            redis=plan.redis and not router, model=plan.tokenizer_model,
            max_context_tokens=context, peer_router=router, publish_at=plan.publish_at,
            transfer_bytes_per_s=plan.transfer_bytes_per_s,
            kv_bytes_per_token=plan.kv_bytes_per_token,
            gateway_flags=() if router else (
                "--status-interval-ms", str(status_interval_ms(plan.time_scale)),
                *policy_flags(policy), *plan.gateway_args),
            cache_dir=str(plan.cache_dir or ""))
        plural = "s" if gateways > 1 else ""
        if router:
            label = f"{plan.peer_label or 'peer router'}, {gateways} replica{plural}"
        else:
            label = (f"prefixgate {policy}, {gateways} gateway{plural}"
                     f"{' (Redis)' if config.redis else ''}")
        label = f"{plan.label} {label}" if plan.label else label
        print(f"prefixgate replay: {label} in front of {plan.num_workers} emulated workers",
              file=sys.stderr)
        with contextlib.ExitStack() as stack:
            workdir = Path(plan.logs_dir) if plan.logs_dir else Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="prefixgate-fleet-")))
            try:
                runs.append(asyncio.run(fleet_run(
                    trace, config, arrival, limits, timeout_s=plan.timeout_s, workdir=workdir,
                    label=label, progress=plan.progress,
                    conversation_ids=plan.conversation_ids, policy=policy)))
            except RuntimeError as exc:  # a fleet that did not come up: report, go on
                print(f"prefixgate replay: {label}: {exc}", file=sys.stderr)
    if not runs:
        raise SystemExit("prefixgate replay: no fleet run completed (see above)")
    return runs


# --- the fleet against the simulator ------------------------------------------------------

def _figure(fleet: float | None, sim: float | None, relative: bool) -> dict | None:
    if fleet is None or sim is None:
        return None
    diff = (sim - fleet) / fleet if relative and fleet else sim - fleet
    return {"fleet": fleet, "sim": sim, ("diff_rel" if relative else "diff"): diff}


def _p(dist: dict | None, key: str) -> float | None:
    return dist[key] if dist else None


def agreement(fleet: dict, sim: dict) -> dict:
    """How a `--simulate` run of the same turns agrees with a fleet run (both report
    dicts): hit (cached / prompt tokens, as the gateways reported them to the client; the
    simulator's), not recomputed (cached + pulled), in points; TTFT p50 / p99 at the
    workers (queue + prefill from the turn's arrival at its worker's engine, after any
    pull; the simulator's the same) and at the client (the simulator has no host: its
    TTFT from the gateway's arrival), as sim / fleet - 1; and the turns joined by
    (conversation, turn): how many went to the same worker, how many found a different
    number of tokens not recomputed (on the same worker, and on another), and the
    per-turn difference of worker-side TTFT."""
    fs, ss = fleet["summary"], sim["summary"]
    fw = fs.get("workers") or {}
    sim_turns = {(t["conversation_id"], t["turn"]): t for t in sim.get("turns", ())
                 if t["status"] == "ok"}
    sim_worker_ttft = distribution(t["worker_ttft_s"] for t in sim_turns.values())
    joined = same_worker = differ_same = differ_other = 0
    token_diff = 0
    ttft_diff = []
    for t in fleet.get("turns", ()):
        s = sim_turns.get((t["conversation_id"], t["turn"]))
        if s is None or t["status"] != "ok":
            continue
        joined += 1
        fk = t["cached_tokens"] + t.get("transferred_tokens", 0)
        sk = s["cached_tokens"] + s.get("transferred_tokens", 0)
        same = t["worker"] == s["worker"]
        same_worker += same
        if fk != sk:
            differ_same += same
            differ_other += not same
            token_diff += sk - fk
        if t.get("worker_ttft_s") is not None:
            ttft_diff.append(s["worker_ttft_s"] - t["worker_ttft_s"])
    return {
        "hit": _figure(fs["hit_rate"], ss["hit_rate"], False),
        "not_recomputed": _figure(fs["not_recomputed_rate"], ss["not_recomputed_rate"], False),
        "ttft_worker_p50": _figure(_p(fw.get("ttft_s"), "p50"), _p(sim_worker_ttft, "p50"), True),
        "ttft_worker_p99": _figure(_p(fw.get("ttft_s"), "p99"), _p(sim_worker_ttft, "p99"), True),
        "ttft_client_p50": _figure(_p(fs["ttft_s"], "p50"), _p(ss["ttft_s"], "p50"), True),
        "ttft_client_p99": _figure(_p(fs["ttft_s"], "p99"), _p(ss["ttft_s"], "p99"), True),
        "turns": {"fleet": fs["turns_ok"], "sim": ss["turns_ok"], "joined": joined,
                  "same_worker": same_worker,
                  "not_recomputed_differs_same_worker": differ_same,
                  "not_recomputed_differs_other_worker": differ_other,
                  "not_recomputed_tokens_sim_minus_fleet": token_diff,
                  "worker_ttft_sim_minus_fleet_s": distribution(ttft_diff)},
    }


def agreement_markdown(rows: list[tuple[str, dict]]) -> str:
    """A table of `agreement` documents, one row per (label, document)."""
    def pts(f: dict | None) -> str:
        return (f"{f['fleet']:.2%} / {f['sim']:.2%} ({f['diff'] * 100:+.2f})" if f else "-")

    def rel(f: dict | None) -> str:
        return (f"{f['fleet'] * 1e3:.0f} / {f['sim'] * 1e3:.0f} ({f['diff_rel']:+.1%})"
                if f else "-")

    lines = ["", "Fleet against `--simulate` on the same turns: fleet / simulator "
                 "(simulator - fleet: points of hit, TTFT relative); TTFT in ms, worker: "
                 "queue + prefill at the worker, client: the fleet's client (the simulator "
                 "has no host)", "",
             "| run | hit | not recomputed | TTFT p50 (worker) | TTFT p99 (worker) | "
             "TTFT p50 (client) | TTFT p99 (client) | turns joined / same worker / "
             "not recomputed differs (same worker, other) |",
             "|---|---|---|---|---|---|---|---|"]
    for label, a in rows:
        t = a["turns"]
        lines.append(
            f"| {label} | {pts(a['hit'])} | {pts(a['not_recomputed'])} | "
            f"{rel(a['ttft_worker_p50'])} | {rel(a['ttft_worker_p99'])} | "
            f"{rel(a['ttft_client_p50'])} | {rel(a['ttft_client_p99'])} | "
            f"{t['joined']} / {t['same_worker']} / "
            f"{t['not_recomputed_differs_same_worker']}, "
            f"{t['not_recomputed_differs_other_worker']} |")
    return "\n".join(lines) + "\n"
