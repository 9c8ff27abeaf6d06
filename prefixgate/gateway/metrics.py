"""Prometheus metrics of the gateway (process-wide, in prometheus_client's default registry,
served by `--metrics-port`), named like the worker's (`prefixgate:...`).

Routing:  prefixgate:router_turns_total{worker,policy}          turns routed (first choice)
          prefixgate:router_expected_cached_tokens_total{worker,policy}
                                                                 cached tokens the router
                                                                 expected of its choice
          prefixgate:router_cached_tokens_total{worker,policy}   cached tokens the worker
                                                                 reported for them
          prefixgate:router_prompt_tokens_total{worker,policy}   their prompt tokens
          prefixgate:router_transferred_tokens_total{worker,policy}
                                                                 prompt tokens the worker
                                                                 pulled from a peer
          prefixgate:router_computed_tokens_total{worker,policy} prompt tokens it prefilled
                                                                 (prompt - cached -
                                                                 transferred)
          prefixgate:router_pulls_total{worker,holder}           turns sent with a pull from
                                                                 holder (block transfer)
          prefixgate:router_resumes_total{outcome}               replies continued on another
                                                                 worker after theirs was lost
                                                                 mid-stream ("resumed"), or
                                                                 not ("opted_out", "budget",
                                                                 "no_worker", "failed")
          prefixgate:router_failovers_total                      turns re-routed before the
                                                                 first token
          prefixgate:router_decision_seconds                     hashing + ranking time
Decision quality (per served turn; docs/routing.md):
          prefixgate:router_decisions_total{on_best}             "true" when the serving
                                                                 worker had the most
                                                                 predicted cached tokens of
                                                                 any candidate; share on the
                                                                 best = true / all
          prefixgate:router_regret_tokens_total                  predicted cached tokens lost
                                                                 by serving off the best
          prefixgate:router_cached_prediction_error_tokens       histogram: predicted minus
                                                                 reported cached tokens
Claims (per-worker confidence, gateway/routing.py):
          prefixgate:router_worker_confidence{worker}            share of the cached tokens
                                                                 its events claimed of the
                                                                 prompts it served that it
                                                                 found (routing credits its
                                                                 claims at this share)
          prefixgate:router_unconfirmed_claim_tokens_total{worker}
                                                                 claimed cached tokens its
                                                                 served turns did not find
Predictions: prefixgate:index_expected_blocks                    blocks expected (routed,
                                                                 not yet confirmed)
          prefixgate:index_prediction_confidence                 share of predicted blocks
                                                                 confirmed by events
Index:    prefixgate:index_blocks                                distinct blocks indexed
          prefixgate:index_events_total{source,kind}             worker events applied
          prefixgate:index_event_blocks_total{source}            blocks named by them
          prefixgate:index_resyncs_total{source}                 rebuilds from a snapshot
Registry: prefixgate:registry_degraded                           1 while Redis is unreachable
          prefixgate:registry_reaped_workers_total               expired workers reaped here
Requests (every front: route is "grpc:Chat", "grpc:ListModels" or the HTTP path):
          prefixgate:gateway_requests_total{route,status}        finished requests; status is
                                                                 the HTTP status (HTTP routes)
                                                                 or the gRPC code name
          prefixgate:gateway_requests_in_flight{route}           requests being served
          prefixgate:gateway_time_to_first_token_seconds{route}  histogram, arrival to first
                                                                 token
          prefixgate:gateway_e2e_request_latency_seconds{route}  histogram, arrival to the end
          prefixgate:gateway_inter_token_latency_seconds{route}  histogram, between tokens
          prefixgate:gateway_prompt_tokens_total{route}          prompt tokens of served turns
          prefixgate:gateway_cached_tokens_total{route}          ... served from a prefix cache
          prefixgate:gateway_completion_tokens_total{route}      generated tokens
Expected hit rate = expected_cached_tokens_total / prompt_tokens_total; the actual one uses
cached_tokens_total (a gap between them means the index is stale or lagging). Exposed with a
`model_name` label on every series (prefixgate/telemetry/metrics_export.py).

`observe_turn(route, events, ...)` wraps one turn's ChatEvent stream (gRPC or HTTP): it
keeps the request metrics above and logs one structured line per finished or failed turn
(logger "prefixgate.turns": `turn done key=value ...`; with --log-format json, one object
with the fields as keys).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from prometheus_client import Counter, Gauge, Histogram

from prefixgate.v1 import chat_pb2, common_pb2
from prefixgate.wire.protocol import clip  # client strings are logged cut (docs/reliability.md)

TURNS = Counter("prefixgate:router_turns", "Turns routed, by first-choice worker and policy.",
                ["worker", "policy"])
EXPECTED_CACHED = Counter("prefixgate:router_expected_cached_tokens",
                          "Cached prompt tokens the router expected of its first choice.",
                          ["worker", "policy"])
CACHED = Counter("prefixgate:router_cached_tokens",
                 "Cached prompt tokens the chosen worker reported (compare with expected).",
                 ["worker", "policy"])
PROMPT_TOKENS = Counter("prefixgate:router_prompt_tokens", "Prompt tokens of routed turns.",
                        ["worker", "policy"])
TRANSFERRED = Counter("prefixgate:router_transferred_tokens",
                      "Prompt tokens the chosen worker pulled from a peer instead of computing.",
                      ["worker", "policy"])
COMPUTED = Counter("prefixgate:router_computed_tokens",
                   "Prompt tokens the chosen worker prefilled (neither cached nor transferred).",
                   ["worker", "policy"])
PULLS = Counter("prefixgate:router_pulls",
                "Turns sent with a pull of their leading blocks from a peer (holder).",
                ["worker", "holder"])
RESUMES = Counter("prefixgate:router_resumes",
                  "Replies whose worker was lost mid-stream, by what the gateway did: "
                  "resumed on another worker, or not (and why).", ["outcome"])
FAILOVERS = Counter("prefixgate:router_failovers",
                    "Turns re-routed to the next worker before the first token.")
DECISION_SECONDS = Histogram("prefixgate:router_decision_seconds",
                             "Time to hash a prompt and rank the workers.",
                             buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1))
INDEX_BLOCKS = Gauge("prefixgate:index_blocks", "Distinct KV blocks in the routing index.")
EVENTS = Counter("prefixgate:index_events", "Worker KV events applied to the routing index.",
                 ["source", "kind"])
EVENT_BLOCKS = Counter("prefixgate:index_event_blocks", "Blocks named by applied KV events.",
                       ["source"])
RESYNCS = Counter("prefixgate:index_resyncs", "Routing index rebuilds from a snapshot.",
                  ["source"])
REGISTRY_DEGRADED = Gauge("prefixgate:registry_degraded",
                          "1 while the shared registry (Redis) is unreachable: routing uses "
                          "the last known index and workers.")
REAPED = Counter("prefixgate:registry_reaped_workers",
                 "Workers whose lease expired, reaped (ownership removed) by this gateway.")
DECISIONS = Counter("prefixgate:router_decisions",
                    "Served turns, by whether the serving worker had the most predicted cached "
                    "tokens of any candidate.", ["on_best"])
REGRET_TOKENS = Counter("prefixgate:router_regret_tokens",
                        "Predicted cached tokens lost by serving turns off the best-cached "
                        "worker.")
PREDICTION_ERROR = Histogram(
    "prefixgate:router_cached_prediction_error_tokens",
    "Predicted minus reported cached prompt tokens of the serving worker, per turn.",
    buckets=(-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096))
EXPECTED_BLOCKS = Gauge("prefixgate:index_expected_blocks",
                        "Blocks expected on workers (routed there, not yet confirmed).")
PREDICTION_CONFIDENCE = Gauge("prefixgate:index_prediction_confidence",
                              "Share of predicted blocks that worker events confirmed.")

WORKER_CONFIDENCE = Gauge("prefixgate:router_worker_confidence",
                          "Share of the cached tokens a worker's events claimed of the prompts "
                          "it served that it found cached (routing credits its claims at it).",
                          ["worker"])
UNCONFIRMED_CLAIMS = Counter("prefixgate:router_unconfirmed_claim_tokens",
                             "Cached tokens a worker's events claimed of prompts it served that "
                             "it did not find cached.", ["worker"])


def count_claim(worker_id: str, claimed: int, confirmed: int, confidence: float) -> None:
    """A served turn's claim (Router's on_claim): the worker's confidence and the tokens
    it claimed and did not find."""
    WORKER_CONFIDENCE.labels(worker_id).set(confidence)
    if claimed > confirmed:
        UNCONFIRMED_CLAIMS.labels(worker_id).inc(claimed - confirmed)


_BY_WORKER: dict[tuple[str, str], tuple] = {}  # (worker, policy) -> its counters' children
_ON_BEST = {True: DECISIONS.labels("true"), False: DECISIONS.labels("false")}


def count_turn(worker_id: str, policy: str, expected_cached: int, best_cached: int,
               cached: int, prompt_tokens: int, transferred: int = 0,
               expected_transferred: int = 0) -> None:
    """Count one served turn in the routing counters above. The labelled children are
    looked up once per (worker, policy): `labels()` takes a lock and builds a key each time
    (~2 us), six of them a turn. A turn that pulls what the best-cached worker holds
    (`expected_transferred`) is on the best: nothing it could have used is recomputed."""
    children = _BY_WORKER.get((worker_id, policy))
    if children is None:
        children = _BY_WORKER[(worker_id, policy)] = tuple(
            m.labels(worker_id, policy) for m in (TURNS, EXPECTED_CACHED, CACHED, PROMPT_TOKENS,
                                                  TRANSFERRED, COMPUTED))
    turns, expected, got, prompt, moved, computed = children
    turns.inc()
    expected.inc(expected_cached)
    got.inc(cached)
    prompt.inc(prompt_tokens)
    moved.inc(transferred)
    computed.inc(max(0, prompt_tokens - cached - transferred))
    kept = expected_cached + expected_transferred
    _ON_BEST[kept >= best_cached].inc()
    REGRET_TOKENS.inc(max(0, best_cached - kept))
    PREDICTION_ERROR.observe(expected_cached - cached)


# --- requests -----------------------------------------------------------------------------

# Seconds; from 1 ms (a cached short prompt on a GPU) to minutes (a long CPU prefill).
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
                    2.56, 5.12, 10.24, 20.48, 40.96, 81.92, 163.84)
REQUESTS = Counter("prefixgate:gateway_requests",
                   "Finished requests by route and status (HTTP status, or gRPC code name).",
                   ["route", "status"])
IN_FLIGHT = Gauge("prefixgate:gateway_requests_in_flight", "Requests being served.", ["route"])
TTFT = Histogram("prefixgate:gateway_time_to_first_token_seconds",
                 "Arrival at the gateway to the first generated token sent.", ["route"],
                 buckets=_LATENCY_BUCKETS)
E2E = Histogram("prefixgate:gateway_e2e_request_latency_seconds",
                "Arrival at the gateway to the last event of the turn.", ["route"],
                buckets=_LATENCY_BUCKETS)
INTER_TOKEN = Histogram("prefixgate:gateway_inter_token_latency_seconds",
                        "Time between successive token events of a turn.", ["route"],
                        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16,
                                 0.32, 0.64, 1.28, 2.56))
PROMPT = Counter("prefixgate:gateway_prompt_tokens", "Prompt tokens of served turns.", ["route"])
CACHED_PROMPT = Counter("prefixgate:gateway_cached_tokens",
                        "Prompt tokens of served turns found in a worker's prefix cache.",
                        ["route"])
COMPLETION = Counter("prefixgate:gateway_completion_tokens", "Generated tokens.", ["route"])

turn_log = logging.getLogger("prefixgate.turns")

FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                common_pb2.FINISH_REASON_CANCELLED: "cancelled"}


async def observe_turn(route: str, events: AsyncIterator[chat_pb2.ChatEvent], *,
                       request_id: str, conversation_id: str,
                       status_of: Callable[[BaseException], tuple[str, str]],
                       ok_status: str = "OK") -> AsyncIterator[chat_pb2.ChatEvent]:
    """Relay one turn's events, timing and counting them (route-labelled metrics) and
    logging one line when it ends. `status_of(exc)` gives (status, message) of a failure;
    the exception itself propagates unchanged."""
    arrival = last = time.monotonic()
    first = 0.0
    final = None
    status, error = ok_status, ""
    in_flight = IN_FLIGHT.labels(route)
    inter_token = INTER_TOKEN.labels(route)  # looked up once, not per token
    in_flight.inc()
    try:
        async for ev in events:
            if ev.HasField("delta"):
                now = time.monotonic()
                if ev.delta.token_ids:
                    if not first:
                        first = now
                        TTFT.labels(route).observe(now - arrival)
                    else:
                        inter_token.observe(now - last)
                    last = now
            else:
                final = ev.final
            yield ev
    except BaseException as exc:
        status, error = status_of(exc)
        raise
    finally:
        in_flight.dec()
        done = time.monotonic()
        REQUESTS.labels(route, status).inc()
        fields = {"request_id": request_id, "route": route, "status": status,
                  "conversation_id": clip(conversation_id), "e2e_ms": round((done - arrival) * 1e3, 2)}
        if first:
            fields["ttft_ms"] = round((first - arrival) * 1e3, 2)
        if final is not None:
            E2E.labels(route).observe(done - arrival)
            u = final.usage
            PROMPT.labels(route).inc(u.prompt_tokens)
            CACHED_PROMPT.labels(route).inc(u.cached_tokens)
            COMPLETION.labels(route).inc(u.completion_tokens)
            fields.update(worker=final.worker_id, prompt_tokens=u.prompt_tokens,
                          cached_tokens=u.cached_tokens, completion_tokens=u.completion_tokens,
                          dropped_tokens=u.dropped_tokens,
                          predicted_cached_tokens=final.predicted_cached_tokens,
                          best_predicted_cached_tokens=final.best_predicted_cached_tokens,
                          finish_reason=FINISH_NAMES.get(final.finish_reason, "unspecified"))
            _log_turn(logging.INFO, "turn done", fields)
        else:
            fields["error"] = error
            level = logging.INFO if status in ("CANCELLED", "499") else logging.WARNING
            _log_turn(level, "turn failed", fields)


def _log_turn(level: int, event: str, fields: dict) -> None:
    """One line: `event key=value ...` in text; in JSON (prefixgate/telemetry/logs.py) the message is
    `event` and the fields are keys."""
    if turn_log.isEnabledFor(level):
        text = " ".join(f"{k}={v!r}" if isinstance(v, str) and (not v or " " in v) else f"{k}={v}"
                        for k, v in fields.items())
        turn_log.log(level, "%s %s", event, text, extra={"fields": fields, "event": event})


def grpc_status_of(context: grpc.aio.ServicerContext) -> Callable[[BaseException], tuple[str, str]]:
    """status_of for a gRPC turn: the code and details the call was aborted with."""

    def status_of(exc: BaseException) -> tuple[str, str]:
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            return "CANCELLED", "the client cancelled the call or went away"
        code = context.code()
        if isinstance(code, grpc.StatusCode) and code != grpc.StatusCode.OK:
            return code.name, context.details() or ""
        return "UNKNOWN", f"{type(exc).__name__}: {exc}"

    return status_of
