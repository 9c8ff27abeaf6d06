"""Replay: trace readers, token synthesis, load generator timing and bounds, metrics,
reports, the OpenAI-compatible target against a fake server on loopback, the simulator."""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.emulate.service import ServiceModel
from prefixgate.gateway.routing import RoutingConfig
from prefixgate.radix import BlockHasher
from prefixgate.replay.loadgen import ArrivalConfig, Limits, build_request, run_load
from prefixgate.replay.metrics import percentile, summarize
from prefixgate.replay.report import write_report
from prefixgate.replay.simulate import SimConfig, SimTurn, bounds, prepare_turns, simulate
from prefixgate.replay.targets import OpenAITarget, Target, TurnRecord, TurnRequest
from prefixgate.replay.traces import (
    Conversation,
    Trace,
    TraceError,
    TraceTurn,
    read_trace,
    synth_block_tokens,
    synth_prompt,
)
from prefixgate.telemetry.trace_recorder import TraceRecorder

SHAREGPT = [
    {"id": "a", "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "How are you?"}, {"from": "gpt", "value": "Fine."}]},
    {"id": "b", "conversations": [
        {"from": "human", "value": "One"}, {"from": "gpt", "value": " "},
        {"from": "human", "value": "Two"},
        {"from": "gpt", "value": "Three"}, {"from": "human", "value": "Last"}]},
]


def _write_lines(path: Path, lines: list[str], gz: bool = False) -> Path:
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


# --- readers -----------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["jsonl", "jsonl.gz", "json"])
def test_sharegpt_reader_builds_histories_from_recorded_replies(tmp_path, form) -> None:
    if form == "json":
        path = tmp_path / "t.json"
        path.write_text(json.dumps(SHAREGPT))
    else:
        path = _write_lines(tmp_path / f"t.{form}", [json.dumps(c) for c in SHAREGPT],
                            gz=form.endswith("gz"))
    trace = read_trace(path)
    assert trace.kind == "sharegpt" and trace.num_turns == 4 and not trace.has_timestamps
    a, b = trace.conversations
    assert a.messages(1) == [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"),
                             ("user", "How are you?")]
    # Consecutive user messages are one turn; a trailing user message is a turn too.
    assert [t.user for t in b.turns] == ["One\n\nTwo", "Last"]
    assert b.messages(1) == [("user", "One\n\nTwo"), ("assistant", "Three"), ("user", "Last")]


def test_malformed_lines_fail_naming_the_line_or_are_skipped(tmp_path) -> None:
    lines = [json.dumps(SHAREGPT[0]), "{not json", json.dumps({"conversations": [
        {"from": "robot", "value": "x"}]}), json.dumps(SHAREGPT[1])]
    path = _write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(TraceError, match=r"bad.jsonl:2: malformed sharegpt record"):
        read_trace(path, "sharegpt")
    trace = read_trace(path, "sharegpt", skip_malformed=True)
    assert trace.num_skipped == 2 and len(trace.conversations) == 2

    moon = _write_lines(tmp_path / "m.jsonl", [
        json.dumps({"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}),
        json.dumps({"timestamp": 5, "input_length": 2000, "output_length": 3, "hash_ids": [1]}),
        json.dumps({"timestamp": 9, "input_length": 10, "output_length": 3}),
    ])
    with pytest.raises(TraceError, match=r"m.jsonl:2: .*cannot hold input_length 2000"):
        read_trace(moon)
    assert read_trace(moon, skip_malformed=True).num_skipped == 2
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "missing.jsonl")


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=-2**70, max_value=2**70), st.integers(min_value=1, max_value=700),
       st.sampled_from([32000, 320, 100, 49152]))
def test_synthesised_tokens_are_the_documented_xxh64(hash_id, num_tokens, vocab_size) -> None:
    """The vectorised synthesis gives exactly `first + XXH64(u32_le(i), seed) mod span`,
    computed here one token at a time with xxhash itself."""
    import xxhash

    first = 256 if vocab_size > 512 else 0
    want = [first + xxhash.xxh64_intdigest(i.to_bytes(4, "little"), hash_id % 2**64)
            % (vocab_size - first) for i in range(num_tokens)]
    assert synth_block_tokens(hash_id, num_tokens, vocab_size) == want


def test_warming_a_trace_derives_each_block_once_and_changes_no_prompt(tmp_path) -> None:
    """warm_block_runs derives every distinct block of a token trace before a replay; the
    prompts built afterwards are the ones built without it."""
    from prefixgate.replay import traces

    path = _write_lines(tmp_path / "m.jsonl", [
        json.dumps({"timestamp": 0, "input_length": 1100, "output_length": 5,
                    "hash_ids": [90001, 90002, 90003]}),
        json.dumps({"timestamp": 1, "input_length": 600, "output_length": 2,
                    "hash_ids": [90001, 90004]})])
    trace = read_trace(path)
    cold = [synth_prompt(c.turns[0], 512, 1000) for c in trace.conversations]
    traces._BLOCK_RUNS.clear()
    assert traces.warm_block_runs(trace, 1000, batch_blocks=3) == 4
    assert traces.warm_block_runs(trace, 1000) == 0  # all remembered
    assert [synth_prompt(c.turns[0], 512, 1000) for c in trace.conversations] == cold
    sharegpt = read_trace(_write_lines(tmp_path / "s.jsonl", [json.dumps(
        {"id": "x", "conversations": [{"from": "human", "value": "hi"},
                                      {"from": "gpt", "value": "hello"}]})]))
    assert traces.warm_block_runs(sharegpt, 1000) == 0


def test_mooncake_reader_and_deterministic_token_synthesis(tmp_path) -> None:
    path = _write_lines(tmp_path / "m.jsonl", [
        json.dumps({"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [7, 8]}),
        json.dumps({"timestamp": 1500, "input_length": 512, "output_length": 2,
                    "hash_ids": [7]}),
    ])
    trace = read_trace(path)
    assert trace.kind == "mooncake" and trace.block_size == 512 and trace.has_timestamps
    t1, t2 = (c.turns[0] for c in trace.conversations)
    assert (t1.num_prompt_tokens, t1.num_output_tokens, t2.timestamp_s) == (700, 5, 1.5)
    p1, p2 = synth_prompt(t1, 512, 32000), synth_prompt(t2, 512, 32000)
    assert len(p1) == 700 and len(p2) == 512
    assert p1[:512] == p2  # equal ids, equal tokens
    assert p1[512:] == synth_block_tokens(8, 188, 32000)
    assert synth_block_tokens(7, 512, 32000) != synth_block_tokens(8, 512, 32000)
    assert all(256 <= t < 32000 for t in p1)
    # Pinned values: the synthesis is a documented function, stable across runs.
    assert synth_block_tokens(7, 4, 32000) == synth_block_tokens(7, 4, 32000)
    assert all(0 <= t < 320 for t in synth_block_tokens(2**64 - 1, 64, 320))
    assert len(synth_prompt(t1, 512, 32000, max_tokens=100)) == 100


def test_recorded_trace_round_trip(tmp_path) -> None:
    hasher = BlockHasher(4, "fp")
    rec = TraceRecorder(tmp_path / "rec" / "trace.jsonl", 4)

    def record(t: float, cid: str, prompt: list[int], out: int, worker: str, cached: int):
        rec.record(arrival_unix_s=t, conversation_id=cid, num_prompt_tokens=len(prompt),
                   block_hashes=hasher.hash_blocks(prompt), output_tokens=out, worker_id=worker,
                   cached_tokens=cached)

    prompt = list(range(10))
    record(1000.0, "c1", prompt, 3, "w0", 0)
    record(1002.5, "c1", prompt + [1, 2, 3, 4, 5], 2, "w0", 8)
    record(1001.0, "c2", [5] * 3, 1, "w1", 0)
    rec.close()
    text = (tmp_path / "rec" / "trace.jsonl").read_text()
    assert "[0,1,2" not in text  # hashes, never the tokens
    trace = read_trace(tmp_path / "rec" / "trace.jsonl")
    assert trace.kind == "prefixgate" and trace.block_size == 4
    c1, c2 = trace.conversations
    assert [t.timestamp_s for t in c1.turns] == [0.0, 2.5] and c2.turns[0].timestamp_s == 1.0
    t0, t1 = c1.turns
    assert len(t0.hash_ids) == 2 and t1.hash_ids[:2] == t0.hash_ids and len(t1.hash_ids) == 3
    assert (t1.num_prompt_tokens, t1.num_output_tokens, t1.worker_id, t1.num_cached_tokens) == \
        (15, 2, "w0", 8)
    # Replayed prompts share exactly the recorded shared blocks.
    p0, p1 = synth_prompt(t0, 4, 320), synth_prompt(t1, 4, 320)
    assert len(p0) == 10 and len(p1) == 15 and p1[:8] == p0[:8]


# --- load generator ----------------------------------------------------------------------


class FakeTarget(Target):
    """Replies after `delay_s`, recording what it was sent and the concurrency."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.requests: list[TurnRequest] = []
        self.in_flight = self.max_in_flight = 0

    async def send(self, request: TurnRequest) -> TurnRecord:
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        n = len(request.prompt_token_ids or ()) or 10
        return TurnRecord(request.conversation_id, request.turn_index, ttft_s=self.delay_s,
                          e2e_s=self.delay_s, prompt_tokens=n, cached_tokens=n // 2,
                          completion_tokens=2, worker="w0")


def _token_trace(times_s: list[float], blocks: int = 2, block_size: int = 4) -> Trace:
    return Trace("mooncake", tuple(
        Conversation(f"r{i}", (TraceTurn(hash_ids=tuple(range(i, i + blocks)),
                                         num_prompt_tokens=blocks * block_size,
                                         num_output_tokens=3, timestamp_s=t),))
        for i, t in enumerate(times_s)), block_size)


def test_open_loop_follows_trace_timestamps_without_waiting_for_replies() -> None:
    times = [0.0, 0.2, 0.4, 0.6, 0.8]
    target = FakeTarget(delay_s=0.5)  # slower than the gaps: open loop must not wait
    result = asyncio.run(run_load(_token_trace(times), target, ArrivalConfig("open", speedup=2.0),
                                  Limits(vocab_size=320), progress=False))
    starts = sorted(r.start_s for r in result.records)
    assert len(starts) == 5 and target.max_in_flight >= 2
    for got, want in zip(starts, [t / 2 for t in times], strict=True):
        assert abs(got - want) < 0.05, (starts, times)
    assert max(target.requests[0].prompt_token_ids) < 320
    assert target.requests[0].max_tokens == 3  # the recorded output length


def test_bounds_in_count_and_time_and_open_loop_needs_timestamps() -> None:
    trace = _token_trace([0.0] * 10)
    result = asyncio.run(run_load(trace, FakeTarget(), ArrivalConfig("open"),
                                  Limits(max_turns=4, vocab_size=320), progress=False))
    assert len(result.records) == 4
    trace = _token_trace([i * 0.1 for i in range(20)])
    t0 = time.monotonic()
    result = asyncio.run(run_load(trace, FakeTarget(), ArrivalConfig("open"),
                                  Limits(max_duration_s=0.35, vocab_size=320), progress=False))
    assert 3 <= len(result.records) <= 5 and time.monotonic() - t0 < 1.5
    chat = Trace("sharegpt", (Conversation("a", (TraceTurn(user="hi"),)),))
    with pytest.raises(ValueError, match="no timestamps"):
        asyncio.run(run_load(chat, FakeTarget(), ArrivalConfig("open"), Limits(), progress=False))


def _chat_trace(n: int, turns: int) -> Trace:
    return Trace("sharegpt", tuple(
        Conversation(f"c{i}", tuple(TraceTurn(user=f"q{i}.{k}", reply=f"a{i}.{k}")
                                    for k in range(turns))) for i in range(n)))


def test_closed_loop_keeps_concurrency_and_sends_recorded_histories() -> None:
    target = FakeTarget(delay_s=0.01)
    trace = _chat_trace(6, 3)
    result = asyncio.run(run_load(trace, target, ArrivalConfig("closed", concurrency=2),
                                  Limits(max_tokens=7), progress=False))
    assert len(result.records) == 18 and target.max_in_flight == 2
    by_conv: dict[str, list[TurnRequest]] = {}
    for r in target.requests:
        by_conv.setdefault(r.conversation_id, []).append(r)
    for cid, reqs in by_conv.items():
        assert [r.turn_index for r in reqs] == [0, 1, 2]
        i = cid[1:]
        assert reqs[2].messages == [("user", f"q{i}.0"), ("assistant", f"a{i}.0"),
                                    ("user", f"q{i}.1"), ("assistant", f"a{i}.1"),
                                    ("user", f"q{i}.2")]
        assert reqs[0].max_tokens == 7


def test_poisson_starts_are_seeded_and_spread() -> None:
    def starts(seed: int) -> list[float]:
        target = FakeTarget()
        res = asyncio.run(run_load(_chat_trace(5, 1), target,
                                   ArrivalConfig("poisson", rate_per_s=50.0, seed=seed), Limits(),
                                   progress=False))
        return sorted(r.start_s for r in res.records)

    a = starts(1)
    assert len(a) == 5 and a[-1] > 0.01
    # The same seed gives the same schedule (within timer noise).
    assert all(abs(x - y) < 0.03 for x, y in zip(a, starts(1), strict=True))


# --- metrics and reports -----------------------------------------------------------------


def test_summary_figures() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    recs = [TurnRecord("c", 0, start_s=0.0, ttft_s=0.1, e2e_s=0.5, itl_s=[0.01, 0.03],
                       prompt_tokens=100, cached_tokens=0, completion_tokens=3, worker="w0"),
            TurnRecord("c", 1, start_s=1.0, ttft_s=0.3, e2e_s=0.7, itl_s=[0.02],
                       prompt_tokens=200, cached_tokens=150, completion_tokens=2, worker="w0"),
            TurnRecord("d", 0, start_s=2.0, status="UNAVAILABLE", error="x")]
    s = summarize(recs, 4.0, workers=["w0", "w1"])
    assert s["hit_rate"] == pytest.approx(0.5)
    assert s["ttft_s"]["p50"] == pytest.approx(0.2) and s["itl_s"]["count"] == 3
    assert s["errors"] == {"UNAVAILABLE": 1} and s["turns_ok"] == 2
    assert s["per_worker"]["w1"]["turns"] == 0
    assert s["load_balance"]["turns_max_over_mean"] == pytest.approx(2.0)
    assert s["throughput"]["turns_per_s"] == pytest.approx(0.5)
    assert [b["hit_rate"] for b in s["hit_rate_over_time"]] == [0.0, 0.75]


def test_report_writes_json_markdown_and_plots(tmp_path) -> None:
    recs = [TurnRecord("c", i, start_s=i, ttft_s=0.1 * (i + 1), e2e_s=1.0, prompt_tokens=10,
                       cached_tokens=i, completion_tokens=2, worker=f"w{i % 2}") for i in range(6)]
    run = {"label": "test run", "config": {}, "summary": summarize(recs, 6.0),
           "ttft_samples_s": sorted(r.ttft_s for r in recs)}
    paths = write_report([run, {**run, "label": "other"}], tmp_path, "r")
    assert {p.name for p in paths} == {"r.json", "r.md", "r-ttft-cdf.png", "r-hit-rate.png",
                                       "r-load.png"}
    assert "| test run | 6 | 0 | 25.0% |" in (tmp_path / "r.md").read_text()
    assert all((tmp_path / n).read_bytes()[:4] == b"\x89PNG" for n in ("r-load.png",))
    assert len(json.loads((tmp_path / "r.json").read_text())["runs"]) == 2


def _run(label: str, workers: dict[str, int]) -> dict:
    recs = [TurnRecord("c", i, start_s=i, ttft_s=0.1 * (i + 1), e2e_s=1.0, prompt_tokens=n,
                       completion_tokens=2, worker=w)
            for i, (w, n) in enumerate(workers.items())]
    return {"label": label, "config": {}, "summary": summarize(recs, 6.0),
            "ttft_samples_s": sorted(r.ttft_s for r in recs)}


def test_load_plot_ranks_workers_in_whole_numbers_and_names_runs_without_workers() -> None:
    """Two workers give two integer ranks with a bar per run (not a line between two
    ranks with fractional ticks); a run whose target names no worker (an HTTP server
    that is not a prefixgate gateway) is named on the plot, not left empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from prefixgate.replay.report import _load_plot

    runs = [_run("grpc a", {"w0": 30, "w1": 10}), _run("grpc b", {"w0": 20, "w1": 20}),
            _run("http", {"": 40})]
    fig = _load_plot(runs, "r")
    ax = fig.axes[0]
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    heights = sorted(round(p.get_height(), 3) for p in ax.patches)
    assert heights == [0.5, 1.0, 1.0, 1.5]  # 2 runs x 2 ranks
    assert any("http" in t.get_text() for t in ax.texts)
    plt.close(fig)


def test_plot_legends_sit_below_the_axes() -> None:
    """Long labels of several runs go under the axes, clear of the curves and each
    other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from prefixgate.replay.report import _cdf_plot

    runs = [_run(f"prefix x8, a long label number {i}", {"w0": 10 + i}) for i in range(5)]
    fig = _cdf_plot(runs, "r")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent(renderer)
    assert legend.y1 <= ax.get_window_extent(renderer).y0  # wholly under the axes
    texts = [t.get_window_extent(renderer) for t in ax.get_legend().get_texts()]
    assert not any(a.overlaps(b) for i, a in enumerate(texts) for b in texts[i + 1:])
    plt.close(fig)


# --- OpenAI-compatible target --------------------------------------------------------------


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Streams three chunks in OpenAI's SSE format; model "down" answers 503, model "cut"
    ends the stream after one chunk with neither a finish reason nor [DONE]."""

    protocol_version = "HTTP/1.0"
    seen: list[tuple[str, dict]] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        # /v1/models lists nothing until a worker "registers" (the second call), as a
        # router does before its workers answer.
        _FakeOpenAI.seen.append((self.path, {}))
        listed = sum(p == "/v1/models" for p, _ in _FakeOpenAI.seen) > 1
        doc = {"object": "list", "data": [{"id": "served-model"}] if listed else []}
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps(doc).encode())

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _FakeOpenAI.seen.append((self.path, body))
        if body.get("model") == "down":
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b'{"error": "overloaded"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chat = self.path == "/v1/chat/completions"
        for piece in ("He", "llo", "!"):
            choice = {"delta": {"content": piece}} if chat else {"text": piece}
            doc = json.dumps({'choices': [choice]}, indent=1)
            if body.get("model") == "sse":  # what the SSE format also allows a server
                # A comment (keep-alive) line, and an event's data over several lines.
                lines = "".join(f"data: {line}\n" for line in doc.splitlines())
                self.wfile.write(f": keep-alive\n\nevent: message\n{lines}\n".encode())
            else:
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.wfile.flush()
            if body.get("model") == "cut":
                return
            time.sleep(0.02)
        usage = {"prompt_tokens": 40, "completion_tokens": 3,
                 "prompt_tokens_details": {"cached_tokens": 32}}
        last = {"choices": [], "usage": usage}
        if body.get("model") == "m":  # as a prefixgate gateway names its serving worker
            last["prefixgate_worker"] = "w7"
        self.wfile.write(f"data: {json.dumps(last)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake_openai():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _FakeOpenAI.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_openai_target_waits_for_a_listed_model_and_names_it(fake_openai) -> None:
    """Without --openai-model the target sends the first model the server lists (smg
    1.13 routes a request naming no model to no worker), once it lists one."""
    async def go():
        target = OpenAITarget(fake_openai)
        await target.wait_ready(5)
        rec = await target.send(TurnRequest("c", 0, 8, messages=[("user", "hi")]))
        await target.close()
        return target.model, rec

    model, rec = asyncio.run(go())
    assert model == "served-model" and rec.ok
    assert [p for p, _ in _FakeOpenAI.seen] == ["/v1/models", "/v1/models",
                                                 "/v1/chat/completions"]
    assert _FakeOpenAI.seen[-1][1]["model"] == "served-model"


def test_openai_target_streams_chat_and_token_prompts(fake_openai) -> None:
    async def go():
        target = OpenAITarget(fake_openai, model="m")
        chat = await target.send(TurnRequest("c", 0, 8, messages=[("user", "hi")]))
        toks = await target.send(TurnRequest("c", 1, 8, prompt_token_ids=[5, 6, 7]))
        await target.close()
        down = OpenAITarget(fake_openai, model="down")
        failed = await down.send(TurnRequest("c", 2, 8, messages=[("user", "hi")]))
        await down.close()
        cut = OpenAITarget(fake_openai, model="cut")
        dropped = await cut.send(TurnRequest("c", 3, 8, messages=[("user", "hi")]))
        await cut.close()
        sse = OpenAITarget(fake_openai, model="sse")
        multiline = await sse.send(TurnRequest("c", 4, 8, messages=[("user", "hi")]))
        await sse.close()
        return chat, toks, failed, dropped, multiline

    chat, toks, failed, dropped, multiline = asyncio.run(go())
    assert dropped.status == "incomplete" and "after 1 content chunks" in dropped.error
    for rec in (chat, toks, multiline):
        assert rec.ok and rec.completion_tokens == 3 and rec.cached_tokens == 32
        assert len(rec.itl_s) == 2 and all(g > 0.01 for g in rec.itl_s)
        assert 0 < rec.ttft_s < rec.e2e_s
    assert failed.status == "HTTP 503" and "overloaded" in failed.error
    assert chat.worker == toks.worker == "w7" and multiline.worker == ""
    (p1, b1), (p2, b2), _, _, _ = _FakeOpenAI.seen
    assert p1 == "/v1/chat/completions" and b1["messages"] == [{"role": "user", "content": "hi"}]
    assert b1["stream"] is True and b1["max_tokens"] == 8
    assert p2 == "/v1/completions" and b2["prompt"] == [5, 6, 7]


def test_openai_target_unreachable_is_a_status() -> None:
    from prefixgate.wire.rpc import free_port

    async def go():
        target = OpenAITarget(f"http://127.0.0.1:{free_port()}")
        rec = await target.send(TurnRequest("c", 0, 8, messages=[("user", "hi")]))
        await target.close()
        return rec

    assert asyncio.run(go()).status == "connect error"


# --- simulator ---------------------------------------------------------------------------


def _repeating_trace(num_convs: int = 24, turns: int = 4, block_size: int = 4) -> Trace:
    """Multi-turn token conversations: each turn extends the previous prompt by 3 blocks."""
    convs = []
    for c in range(num_convs):
        ids: list[int] = []
        ts = []
        for k in range(turns):
            ids = ids + [c * 1000 + k * 10 + j for j in range(3)]
            ts.append(TraceTurn(hash_ids=tuple(ids), num_prompt_tokens=len(ids) * block_size,
                                num_output_tokens=4, timestamp_s=c * 0.05 + k * 0.5))
        convs.append(Conversation(f"c{c}", tuple(ts)))
    return Trace("prefixgate", tuple(convs), block_size)


def test_simulator_prefix_beats_round_robin_and_bounds_hold() -> None:
    convs = prepare_turns(_repeating_trace())
    base = dict(num_workers=4, capacity_tokens=400, block_size=4,
                service=ServiceModel(prefill_tokens_per_s=2000, decode_s_per_token=0.01))
    hits = {}
    for policy in ("prefix", "round-robin", "random", "least-loaded", "session"):
        res = simulate(convs, SimConfig(**base, routing=RoutingConfig(policy=policy, seed=1)))
        s = summarize(res.records, res.duration_s, workers=res.workers)
        assert s["turns_ok"] == 96 and len(s["per_worker"]) == 4
        hits[policy] = s["hit_rate"]
    b = bounds(convs, SimConfig(**base))
    assert b["infinite_cache"] >= b["combined_lru"]
    assert all(b["infinite_cache"] + 1e-9 >= h for h in hits.values()), (b, hits)
    assert hits["prefix"] > hits["round-robin"] + 0.15, hits
    # Every turn after the first extends its previous prompt by 3 of its 3*(k+1) blocks.
    assert b["infinite_cache"] > 0.5


def test_simulator_is_deterministic_and_caches_chat_replies(tiny_spec) -> None:
    from prefixgate.model.tokenizer import ChatTokenizer

    trace = _chat_trace(4, 3)
    convs = prepare_turns(trace, 4, ChatTokenizer(tiny_spec))
    t0, t1 = convs[0][0], convs[0][1]
    # After turn 0 the worker keeps turn 1's prefix covering prompt 0 plus its reply.
    assert t0.keep_hashes == t1.block_hashes[: len(t0.keep_hashes)]
    assert len(t0.keep_hashes) > len(t0.block_hashes)
    cfg = SimConfig(num_workers=2, capacity_tokens=10_000, block_size=4,
                    arrival=ArrivalConfig("closed", concurrency=2, think_time_s=0.1),
                    routing=RoutingConfig(policy="prefix"))
    a, b = simulate(convs, cfg), simulate(convs, cfg)
    assert [(r.conversation_id, r.turn_index, r.ttft_s, r.cached_tokens, r.worker)
            for r in a.records] == [(r.conversation_id, r.turn_index, r.ttft_s, r.cached_tokens,
                                     r.worker) for r in b.records]
    prompt_of = {(t.conversation_id, t.turn_index): t.num_prompt_tokens for c in convs for t in c}
    # The worker's own reply is cached, but a replay's next prompt carries the recorded one:
    # turn k+1 reuses turn k's prompt (its full blocks), not more.
    later = [r for r in a.records if r.turn_index > 0]
    assert all(prompt_of[(r.conversation_id, r.turn_index - 1)] - 4 < r.cached_tokens
               <= prompt_of[(r.conversation_id, r.turn_index - 1)] for r in later)
    # A worker that reproduced the recorded reply would cache it too: more than the prompt.
    recorded = simulate(convs, SimConfig(**{**vars(cfg), "reply_blocks": "recorded"}))
    assert all(r.cached_tokens > prompt_of[(r.conversation_id, r.turn_index - 1)]
               for r in recorded.records if r.turn_index > 0)


def test_build_request_caps_prompt_and_tokens() -> None:
    trace = _token_trace([0.0], blocks=3, block_size=4)
    req = build_request(trace, trace.conversations[0], 0, Limits(max_tokens=2,
                                                                 max_prompt_tokens=5,
                                                                 vocab_size=320))
    assert len(req.prompt_token_ids) == 5 and req.max_tokens == 2


def test_cli_simulate_and_combine(tmp_path, capsys) -> None:
    from prefixgate.cli import main

    lines = [{"timestamp": i * 300, "input_length": 2048, "output_length": 4,
              "hash_ids": [i % 5, 10 + i % 5, 20 + i, 30 + i]} for i in range(40)]
    trace = _write_lines(tmp_path / "m.jsonl", [json.dumps(x) for x in lines])
    assert main(["replay", "--simulate", "--trace", str(trace), "--sim-workers", "2,4",
                 "--capacity-tokens", "8192", "--sim-policies",
                 # Identical workers at the default rate: until each worker measured its own
                 # rate, a measured one would look faster and draw these light early turns.
                 "prefix:shared_prefix_weight=1:measured_rates=0,round-robin",
                 "--out", str(tmp_path / "sim"), "--name", "s", "--json", "--no-progress",
                 "--no-plots"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    prefix = "prefix:shared_prefix_weight=1:measured_rates=0"
    assert [r["label"] for r in runs] == [f"{prefix} x2", "round-robin x2", f"{prefix} x4",
                                          "round-robin x4"]
    assert all(r["summary"]["turns_ok"] == 40 and r["config"]["arrival"]["mode"] == "open"
               for r in runs)
    # Two of every four blocks repeat (5 leading pairs, 16 blocks per worker): prefix
    # routing splits the pairs between the workers, round-robin makes both hold all.
    assert runs[0]["summary"]["hit_rate"] > runs[1]["summary"]["hit_rate"]
    assert runs[0]["bounds"]["infinite_cache"] >= runs[0]["summary"]["hit_rate"]
    with pytest.raises(SystemExit, match="unknown routing field"):
        main(["replay", "--simulate", "--trace", str(trace), "--sim-policies", "prefix:bogus=1",
              "--out", str(tmp_path / "x"), "--no-progress"])
    assert main(["replay", "--combine", str(tmp_path / "sim" / "s.json"), "--out",
                 str(tmp_path / "c"), "--name", "c", "--no-plots"]) == 0
    # Two round-robin runs, each in the runs table and in the decisions (regret) table.
    assert (tmp_path / "c" / "c.md").read_text().count("| round-robin x") == 4


# --- properties --------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
       st.floats(0, 100))
def test_percentile_matches_numpy(values: list[float], q: float) -> None:
    np = pytest.importorskip("numpy")
    assert percentile(sorted(values), q) == pytest.approx(float(np.percentile(values, q)),
                                                          rel=1e-9, abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=6),
       st.lists(st.integers(0, 2**64 - 1), max_size=4), st.integers(1, 16),
       st.integers(2, 70000))
def test_synthesised_prompts_share_exactly_their_shared_blocks(
        shared: list[int], tail: list[int], block_size: int, vocab: int) -> None:
    a = TraceTurn(hash_ids=tuple(shared + tail), num_prompt_tokens=0)
    b = TraceTurn(hash_ids=tuple(shared + [t ^ 1 for t in tail]), num_prompt_tokens=0)
    pa, pb = synth_prompt(a, block_size, vocab), synth_prompt(b, block_size, vocab)
    n = len(shared) * block_size
    assert len(pa) == len(pb) == (len(shared) + len(tail)) * block_size
    assert pa[:n] == pb[:n] and all(0 <= t < vocab for t in pa)


def test_block_cache_counts_blocks_reserved_by_requests_ahead() -> None:
    """A request queued behind one that stores a prefix at its prefill's end will find that
    prefix cached when it starts: `expected` counts reserved blocks (after the held ones,
    in chain order), without holding, publishing or evicting them."""
    from prefixgate.emulate.cache import BlockCache

    cache = BlockCache(4)
    cache.store(None, [1, 2])
    assert cache.expected([1, 2, 3, 4]) == 2
    cache.reserve([1, 2, 3])
    cache.reserve([1, 2, 3, 5])
    assert cache.expected([1, 2, 3, 4]) == 3 and cache.expected([1, 2, 3, 5, 6]) == 4
    assert cache.expected([9, 2, 3]) == 0 and cache.num_blocks == 2
    cache.unreserve([1, 2, 3, 5])
    assert cache.expected([1, 2, 3, 5]) == 3
    cache.unreserve([1, 2, 3])
    assert cache.expected([1, 2, 3]) == 2


def test_simulated_redis_event_delay_is_the_publishers_batching() -> None:
    """--simulate --fleet-redis delays events by at least the worker's Redis batching
    interval (the measured delay adds the round trips on the fleet's host)."""
    import inspect

    from prefixgate.replay.simulate import REDIS_EVENT_DELAY_S
    from prefixgate.workerapi.events import RedisPublisher

    flush = inspect.signature(RedisPublisher.__init__).parameters["flush_interval_s"].default
    assert flush <= REDIS_EVENT_DELAY_S < 10 * flush


def _two_turns(num_conversations: int = 1) -> list[list[SimTurn]]:
    """Conversations of two turns: 64 prompt tokens, then 128 starting with those 64."""
    out = []
    for c in range(num_conversations):
        blocks = tuple(1000 * c + i for i in range(1, 9))
        out.append([SimTurn(f"c{c}", 0, 64, 4, blocks[:4], blocks[:4]),
                    SimTurn(f"c{c}", 1, 128, 4, blocks, blocks)])
    return out


def test_simulated_turnaround_delays_each_follow_up_and_decides_the_race() -> None:
    """A follow-up arrives think time + a turnaround (wall seconds x time scale, one of
    turnaround_s per turn) after its reply ends; with events 5 ms late and no predictions,
    it is routed knowing its previous turn's blocks only when its turnaround is longer."""
    base = dict(num_workers=2, capacity_tokens=10_000, block_size=16, time_scale=20.0,
                arrival=ArrivalConfig("closed", concurrency=1, think_time_s=0.1),
                publish_at="finish", conversation_ids=False, event_delay_s=0.005,
                routing=RoutingConfig(policy="prefix", prediction_ttl_s=0))

    def gaps(res) -> list[float]:
        by = {(r.conversation_id, r.turn_index): r for r in res.records}
        return [round(r.start_s - (p.start_s + p.e2e_s), 9) for (c, i), r in by.items()
                if (p := by.get((c, i - 1)))]

    def known(res) -> list[int]:
        return [r.best_predicted_cached_tokens for r in res.records if r.turn_index == 1]

    convs = _two_turns(40)
    fixed = simulate(convs, SimConfig(**base, turnaround_s=(0.002,)))
    assert gaps(fixed) == [0.14] * 40  # 0.1 s think + 2 ms x 20
    drawn = simulate(convs, SimConfig(**base, turnaround_s=(0.002, 0.010)))
    assert set(gaps(drawn)) == {0.14, 0.3}
    again = simulate(convs, SimConfig(**base, turnaround_s=(0.002, 0.010)))
    assert gaps(again) == gaps(drawn)  # seeded: deterministic
    # The race: events reach the gateways 100 ms (emulated) after the reply ends.
    assert known(simulate(convs, SimConfig(**{**base, "arrival": ArrivalConfig(
        "closed", concurrency=1)}, turnaround_s=(0.002,)))) == [0] * 40
    assert known(simulate(convs, SimConfig(**{**base, "arrival": ArrivalConfig(
        "closed", concurrency=1)}, turnaround_s=(0.010,)))) == [64] * 40
    assert known(simulate(convs, SimConfig(**{**base, "arrival": ArrivalConfig(
        "closed", concurrency=1)}))) == [0] * 40  # no turnaround: always blind


def test_fleet_turnaround_joins_client_and_worker_records() -> None:
    """summary.turnaround: a turn's end at its worker to the next turn's send and arrival
    there (emulated), client and worker records joined by worker, prompt and nearest time."""
    from prefixgate.replay.fleet import turnaround_summary, worker_times

    scale, t0 = 20.0, 1000.0
    recs = [TurnRecord("a", 0, start_s=0.0, e2e_s=1.0, prompt_tokens=100, worker="worker-0"),
            TurnRecord("a", 1, start_s=1.2, e2e_s=1.0, prompt_tokens=200, worker="worker-1"),
            TurnRecord("b", 0, start_s=0.1, e2e_s=0.5, prompt_tokens=100, worker="worker-0")]
    # Worker arrivals in wall unix time; b's turn shares a's prompt length and worker.
    served = [{"worker": "worker-0", "prompt_tokens": 100, "arrival_unix_s": t0 + 0.05 / scale,
               "total_s": 0.9, "ttft_s": 0.3, "first_token_late_s": 0.01},
              {"worker": "worker-0", "prompt_tokens": 100, "arrival_unix_s": t0 + 0.12 / scale,
               "total_s": 0.4, "ttft_s": 0.1},
              {"worker": "worker-1", "prompt_tokens": 200, "arrival_unix_s": t0 + 1.4 / scale,
               "total_s": 0.8, "ttft_s": 0.2}]
    at = worker_times(recs, served, t0, scale)
    assert at[("a", 0)] == pytest.approx((0.05, 0.95, 0.3, 0.01)) and at[("b", 0)] == pytest.approx(
        (0.12, 0.52, 0.1, 0.0))
    s = turnaround_summary(recs, at)
    assert s["to_send_s"]["count"] == 1
    assert s["to_send_s"]["p50"] == pytest.approx(1.2 - 0.95)
    assert s["to_worker_s"]["p50"] == pytest.approx(1.4 - 0.95)
    assert s["client_s"]["p50"] == pytest.approx(1.2 - 1.0)


def test_simulated_transfer_moves_kv_instead_of_work() -> None:
    """A 400-token prefix cached on one worker, then a burst of 6 turns extending it: with
    transfer (a link 10x the prefill rate) the turns the holder cannot serve at once pull
    the prefix to idle workers instead of recomputing it or queueing behind the holder."""
    prefix = tuple(range(1, 101))  # 100 blocks of 4 tokens
    convs = [[SimTurn("seed", 0, 404, 1, prefix + (9000,), prefix + (9000,), 0.0)]]
    for c in range(6):
        blocks = prefix + tuple(10_000 * (c + 1) + i for i in range(25))
        convs.append([SimTurn(f"c{c}", 0, len(blocks) * 4, 1, blocks, blocks, 1.0)])
    base = dict(num_workers=4, capacity_tokens=10_000, block_size=4,
                service=ServiceModel(prefill_tokens_per_s=1000, decode_s_per_token=0.01),
                arrival=ArrivalConfig("open"),
                transfer_bytes_per_s=1e6, kv_bytes_per_token=100)
    runs = {t: simulate(convs, SimConfig(**base, routing=RoutingConfig(transfer=t)))
            for t in (True, False)}
    s = {t: summarize(r.records, r.duration_s) for t, r in runs.items()}
    assert s[False]["transferred_tokens"] == 0
    pulled = [r for r in runs[True].records if r.transferred_tokens]
    assert pulled and all(r.transferred_tokens == 400 and r.worker != "worker-0"
                          for r in pulled)
    assert all(r.cached_tokens + r.transferred_tokens + r.computed_tokens == r.prompt_tokens
               for r in runs[True].records)
    assert s[True]["not_recomputed_rate"] > s[False]["not_recomputed_rate"]
    assert s[True]["ttft_s"]["mean"] < s[False]["ttft_s"]["mean"]
    # Without a link (0 bytes/s) nothing is pulled.
    none = simulate(convs, SimConfig(**{**base, "transfer_bytes_per_s": 0.0}))
    assert not any(r.transferred_tokens for r in none.records)


def test_fleet_ttft_breakdown_splits_client_ttft_at_the_worker() -> None:
    """summary.ttft_breakdown: each turn's client TTFT split into the way to its worker,
    the worker's own TTFT and the way back; the front's own TTFT where it reports one."""
    from prefixgate.replay.fleet import ttft_breakdown

    recs = [TurnRecord("a", 0, start_s=1.0, ttft_s=0.9, e2e_s=2.0, completion_tokens=5,
                       prompt_tokens=100, worker="worker-0", gateway_ttft_s=0.6),
            TurnRecord("b", 0, start_s=2.0, ttft_s=0.5, e2e_s=1.0, completion_tokens=5,
                       prompt_tokens=100, worker="worker-0")]  # a front without its own TTFT
    at = {("a", 0): (1.2, 3.0, 0.3, 0.05), ("b", 0): (2.1, 3.0, 0.2, 0.0)}
    s = ttft_breakdown(recs, at)
    assert s["to_worker_s"]["count"] == 2 and s["to_worker_s"]["max"] == pytest.approx(0.2)
    assert s["worker_s"]["max"] == pytest.approx(0.3)
    assert s["from_worker_s"]["max"] == pytest.approx(0.4)  # 0.9 - 0.2 - 0.3
    assert s["from_worker_s"]["mean"] == pytest.approx(0.3)  # and 0.5 - 0.1 - 0.2
    assert s["worker_late_s"]["max"] == pytest.approx(0.05)
    assert s["front_s"]["count"] == 1 and s["front_s"]["p50"] == pytest.approx(0.6)
    assert s["client_side_s"]["p50"] == pytest.approx(0.3)
    assert ttft_breakdown(recs, {}) is None
