"""The gateway's OpenAI-compatible HTTP front, driven by the real `openai` SDK (sync and
async, streaming and not), raw HTTP for the edges, and prefixgate's own replay OpenAI
target; tiny-random workers on loopback."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from prefixgate.wire.rpc import free_port
from tests.helpers import start_gateway, start_worker, wait_for

USER = "tell me about the weather on a long walk in the hills " * 4


@pytest.fixture(scope="module")
def front(loop_thread, tiny_spec, tiny_model):
    w0, stop0 = start_worker(loop_thread, tiny_spec, tiny_model, "h0")
    w1, stop1 = start_worker(loop_thread, tiny_spec, tiny_model, "h1")
    http_port = free_port()
    gw, gstop = start_gateway(loop_thread, tiny_spec, [w0, w1], http_port=http_port)
    base = f"http://127.0.0.1:{http_port}"
    wait_for(lambda: httpx.get(base + "/health").status_code == 200 and
             httpx.get(base + "/v1/models").json()["data"][0]["num_workers"] == 2,
             what="the HTTP front to see both workers")
    yield {"base": base, "grpc": gw, "model": tiny_spec.name}
    for stop in (gstop, stop0, stop1):
        loop_thread.loop.call_soon_threadsafe(stop.set)


@pytest.fixture
def client(front) -> openai.OpenAI:
    with openai.OpenAI(base_url=front["base"] + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_sdk_multi_turn_chat_reports_cached_tokens_on_turn_two(client, front) -> None:
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": USER}]
    r1 = client.chat.completions.create(model=front["model"], messages=messages, max_tokens=8,
                                        temperature=0, prompt_cache_key="conv-a")
    assert r1.object == "chat.completion" and r1.model == front["model"]
    assert r1.choices[0].finish_reason in ("stop", "length")
    assert r1.usage.completion_tokens == 8 or r1.choices[0].finish_reason == "stop"
    assert r1.usage.total_tokens == r1.usage.prompt_tokens + r1.usage.completion_tokens
    messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "and in winter?"}]
    r2 = client.chat.completions.create(model=front["model"], messages=messages, max_tokens=8,
                                        temperature=0, prompt_cache_key="conv-a")
    # Turn 1's prompt is reused in whole 16-token blocks on the worker that holds it.
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens // 16 * 16 > 0


def test_sdk_streaming_with_usage_matches_the_whole_reply(client, front) -> None:
    kwargs = dict(model=front["model"], messages=[{"role": "user", "content": USER}],
                  max_completion_tokens=12, temperature=0, seed=3)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # Without include_usage no chunk carries usage.
    plain = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices


def test_sdk_n_stop_and_seed(client, front) -> None:
    kwargs = dict(model=front["model"], messages=[{"role": "user", "content": USER}],
                  max_tokens=10, temperature=1.0, top_p=0.9, seed=11, n=3)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    greedy = client.chat.completions.create(model=front["model"], max_tokens=10, temperature=0,
                                            messages=[{"role": "user", "content": USER}])
    text = greedy.choices[0].message.content
    if len(text) > 3:
        stop = text[2:4]
        stopped = client.chat.completions.create(
            model=front["model"], max_tokens=10, temperature=0, stop=[stop],
            messages=[{"role": "user", "content": USER}])
        assert stop not in stopped.choices[0].message.content
        assert stopped.choices[0].finish_reason == "stop"


def test_sdk_streams_n_choices_by_index(client, front) -> None:
    """n > 1 streamed: each chunk's choices carry their index; per index, the same text and
    one finish_reason as the whole reply of the same seed."""
    kwargs = dict(model=front["model"], messages=[{"role": "user", "content": USER}],
                  max_tokens=8, temperature=1.0, seed=5, n=2)
    whole = client.chat.completions.create(**kwargs)
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index].append(c.finish_reason)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: [c.finish_reason] for c in whole.choices}


def test_async_sdk_streams_completions_from_text_and_token_ids(front) -> None:
    async def run() -> tuple[str, str, int]:
        async with openai.AsyncOpenAI(base_url=front["base"] + "/v1", api_key="x",
                                      max_retries=0) as c:
            text = await c.completions.create(model=front["model"], prompt="Once upon a time",
                                              max_tokens=6, temperature=0)
            ids = await c.completions.create(model=front["model"], prompt=[1, 2, 3, 4, 5],
                                             max_tokens=6, temperature=0)
            stream = await c.completions.create(model=front["model"], prompt="Once upon a time",
                                                max_tokens=6, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
            streamed, usage = "", 0
            async for chunk in stream:
                streamed += "".join(ch.text for ch in chunk.choices)
                usage = chunk.usage.completion_tokens if chunk.usage else usage
            assert ids.usage.prompt_tokens == 5 and ids.object == "text_completion"
            return text.choices[0].text, streamed, usage

    whole, streamed, usage = asyncio.run(run())
    assert streamed == whole and 0 < usage <= 6


def test_errors_are_openai_error_objects_with_the_right_status(client, front) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=front["model"], messages=[])
    assert "messages is empty" in err.value.message
    assert err.value.body["code"] == "invalid_argument"
    # An unknown model is 404 model_not_found (OpenAI's and vLLM's answer), as on /v1/models.
    with pytest.raises(openai.NotFoundError, match="is not served here") as err:
        client.chat.completions.create(model="gpt-4o",
                                       messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    r = httpx.post(front["base"] + "/v1/completions", json={"model": "gpt-4o", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="tools is not supported"):
        client.chat.completions.create(
            model=front["model"], messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=front["model"], max_tokens=0,
                                       messages=[{"role": "user", "content": "hi"}])
    # A streaming request refused before it starts gets the status, not a 200 stream.
    r = httpx.post(front["base"] + "/v1/chat/completions",
                   json={"model": front["model"], "stream": True, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="stream_options is only allowed"):
        client.chat.completions.create(model=front["model"], stream_options={
            "include_usage": True}, messages=[{"role": "user", "content": "hi"}])
    r = httpx.post(front["base"] + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(front["base"] + "/v1/chat/completions", content=b"x" * (1 << 20))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(front["base"] + "/v1/completions",
                   json={"model": front["model"], "prompt": [1, 10**9]})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]
    assert httpx.get(front["base"] + "/v1/models/nope").status_code == 404


def test_same_limits_and_messages_as_grpc(front) -> None:
    """One turn path: a request the gRPC front refuses is refused here with its message."""
    import grpc

    from prefixgate.v1 import chat_pb2, chat_pb2_grpc

    long_id = "c" * 300
    with grpc.insecure_channel(front["grpc"]) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(chat_pb2_grpc.ChatServiceStub(ch).Chat(chat_pb2.ChatRequest(
                conversation_id=long_id, messages=chat_pb2.Messages(
                    messages=[chat_pb2.ChatMessage(role="user", content="hi")]))))
    r = httpx.post(front["base"] + "/v1/chat/completions", json={
        "model": front["model"], "prompt_cache_key": long_id,
        "messages": [{"role": "user", "content": "hi"}]})
    # The same message, naming the field the HTTP client sent.
    assert "conversation_id is 300 characters" in err.value.details()
    error = r.json()["error"]
    assert r.status_code == 400 and error["message"] == err.value.details().replace(
        "conversation_id", "prompt_cache_key") and error["param"] == "prompt_cache_key"
    r = httpx.post(front["base"] + "/v1/chat/completions", json={
        "model": front["model"], "stop": ["x"] * 17,
        "messages": [{"role": "user", "content": "hi"}]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["message"].startswith("stop has 17 strings") \
        and "sampling." not in error["message"] and error["param"] == "stop"
    r = httpx.post(front["base"] + "/v1/chat/completions", json={
        "model": front["model"], "max_tokens": 10**6,
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "max_tokens is 1000000: it must be between 1 and ")


@pytest.mark.parametrize("route, fields, param", [
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "hi " * 3000}]}, "messages"),
    ("chat", {"stop": ["x"] * 17}, "stop"),
    ("chat", {"n": 17}, "n"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"temperature": -1}, "temperature"),
    ("chat", {"top_p": 2}, "top_p"),
    ("chat", {"seed": -1}, "seed"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"context_overflow": "drop-everything"}, "context_overflow"),
    ("chat", {"tools": [{"type": "function"}]}, "tools"),
    ("chat", {"prompt_cache_key": 5}, "prompt_cache_key"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": [1, 10**9]}, "prompt"),
    ("completions", {"prompt": [7] * 3000}, "prompt"),
])
def test_every_field_error_names_its_param(front, route, fields, param) -> None:
    """A refused field is OpenAI's `param`, by the body's own name, and the message names
    it so too (never the gRPC field)."""
    body = {"model": front["model"], "max_tokens": 2,
            **({"messages": [{"role": "user", "content": "hi"}]} if route == "chat"
               else {"prompt": "hi"}), **fields}
    r = httpx.post(front["base"] + ("/v1/chat/completions" if route == "chat"
                                    else "/v1/completions"), json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, error
    assert "sampling." not in error["message"] and "prompt_token_ids" not in error["message"]


@pytest.mark.parametrize("value", [-1, 0, 2**32, 10**6])
def test_max_tokens_out_of_range_says_one_range(front, value) -> None:
    """Every out-of-range max_tokens is refused with a range that holds: at least 1 (0 is
    refused as -1 is), at most what the context leaves."""
    messages = [{"role": "user", "content": "hi"}]
    for name in ("max_tokens", "max_completion_tokens"):
        r = httpx.post(front["base"] + "/v1/chat/completions",
                       json={"model": front["model"], name: value, "messages": messages})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == name, error
        assert error["message"].startswith(f"{name} is {value}: it must be ") and \
            ("between 1 and " in error["message"] or "at least 1" in error["message"])
        assert "4294967295" not in error["message"] and "between 0" not in error["message"]
    ok = httpx.post(front["base"] + "/v1/chat/completions",
                    json={"model": front["model"], "max_tokens": 1, "messages": messages})
    assert ok.status_code == 200


def test_metrics_health_and_request_counts(client, front) -> None:
    client.chat.completions.create(model=front["model"], max_tokens=2,
                                   messages=[{"role": "user", "content": "hello"}])
    text = httpx.get(front["base"] + "/metrics").text
    model = f'model_name="{front["model"]}"'
    ok = [line for line in text.splitlines() if line.startswith(
        "prefixgate:gateway_requests_total{") and 'route="/v1/chat/completions"' in line
        and 'status="200"' in line]
    assert ok and model in ok[0] and float(ok[0].split()[-1]) >= 1
    assert "prefixgate:gateway_time_to_first_token_seconds_bucket" in text
    assert any(line.startswith("prefixgate:gateway_cached_tokens_total{") and model in line
               for line in text.splitlines())
    assert httpx.get(front["base"] + "/health").json()["workers"] == 2


def test_replay_openai_target_against_the_front(front, tmp_path) -> None:
    from prefixgate.replay.loadgen import ArrivalConfig, Limits, run_load
    from prefixgate.replay.targets import OpenAITarget
    from prefixgate.replay.traces import read_trace

    trace = tmp_path / "chat.json"
    conversations = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": USER + str(i)}, {"from": "gpt", "value": "fine weather"},
        {"from": "human", "value": "and tomorrow?"}, {"from": "gpt", "value": "rain"}]}
        for i in range(3)]
    trace.write_text(json.dumps(conversations))

    async def run():
        target = OpenAITarget(front["base"], model=front["model"])
        try:
            return await run_load(read_trace(str(trace)), target, ArrivalConfig("closed", 1, 2),
                                  Limits(max_tokens=4), progress=False)
        finally:
            await target.close()

    records = asyncio.run(run()).records
    assert len(records) == 6 and all(r.ok for r in records), [r.error for r in records]
    second = [r for r in records if r.turn_index == 1]
    assert all(r.cached_tokens > 0 for r in second)


def test_bearer_tokens_bind_namespaces_as_on_grpc(loop_thread, tiny_spec, tiny_model,
                                                  tmp_path) -> None:
    """--tokens-file: the SDK's api_key is the bearer token; the same tokens, statuses and
    namespace binding as the gRPC front; /health and /metrics stay open."""
    from prefixgate.security.auth import AuthConfig, hash_token, new_token

    acme, globex = new_token(), new_token()
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{hash_token(acme)} acme\n{hash_token(globex)} globex\n")
    w, wstop = start_worker(loop_thread, tiny_spec, tiny_model, "auth0")
    http_port = free_port()
    _, gstop = start_gateway(loop_thread, tiny_spec, [w], http_port=http_port,
                             auth=AuthConfig(tokens_file=str(tokens)))
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_for(lambda: httpx.get(base + "/health").status_code == 200, what="a worker")
        messages = [{"role": "user", "content": USER}]
        with openai.OpenAI(base_url=base + "/v1", api_key=acme, max_retries=0) as c:
            assert c.models.list().data[0].id == tiny_spec.name
            r = c.chat.completions.create(model=tiny_spec.name, messages=messages, max_tokens=2)
            assert r.usage.completion_tokens >= 1
            with pytest.raises(openai.PermissionDeniedError):
                c.chat.completions.create(model=tiny_spec.name, messages=messages, max_tokens=2,
                                          extra_body={"namespace": "globex"})
            # Namespaces do not share cache: globex's copy of the same prompt is cold.
            again = c.chat.completions.create(model=tiny_spec.name, messages=messages,
                                              max_tokens=2)
            assert again.usage.prompt_tokens_details.cached_tokens > 0
        with openai.OpenAI(base_url=base + "/v1", api_key=globex, max_retries=0) as c:
            cold = c.chat.completions.create(model=tiny_spec.name, messages=messages,
                                             max_tokens=2)
            assert cold.usage.prompt_tokens_details.cached_tokens == 0
        with openai.OpenAI(base_url=base + "/v1", api_key="pg_wrong", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError, match="not valid here"):
                c.chat.completions.create(model=tiny_spec.name, messages=messages)
            with pytest.raises(openai.AuthenticationError):
                c.models.list()
        assert httpx.get(base + "/metrics").status_code == 200
    finally:
        for stop in (gstop, wstop):
            loop_thread.loop.call_soon_threadsafe(stop.set)


def test_one_structured_log_line_per_turn_with_its_request_id(front, caplog) -> None:
    import logging

    from prefixgate.telemetry.logs import JsonFormatter

    caplog.set_level(logging.INFO, logger="prefixgate.turns")
    ok = httpx.post(front["base"] + "/v1/chat/completions", timeout=60,
                    headers={"X-Request-Id": "req-42"},
                    json={"model": front["model"], "max_tokens": 2,
                          "messages": [{"role": "user", "content": "hi"}]})
    bad = httpx.post(front["base"] + "/v1/chat/completions", json={"messages": "nope"})
    assert ok.headers["X-Request-Id"] == "req-42" and ok.json()["id"] == "chatcmpl-req-42"
    assert bad.status_code == 400
    done = [r for r in caplog.records if getattr(r, "event", "") == "turn done"]
    failed = [r for r in caplog.records if getattr(r, "event", "") == "turn failed"]
    assert [r.fields["request_id"] for r in done] == ["req-42"]
    assert len(failed) == 1 and failed[0].fields["status"] == "400"
    line = json.loads(JsonFormatter().format(done[0]))
    assert line["message"] == "turn done" and line["request_id"] == "req-42"
    assert line["prompt_tokens"] > 0 and "cached_tokens" in line and "ttft_ms" in line


def test_bench_http_runs_and_reports_both_fronts(capsys) -> None:
    """`prefixgate bench http` end to end on a small prompt (the figures are in
    docs/benchmarks.md)."""
    from prefixgate.cli import main

    assert main(["bench", "http", "--prompt-tokens", "64", "--turns", "3", "--warmup", "1",
                 "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["turns"] == 3 and row["prompt_tokens"] > 32
    assert row["grpc_ttft_ms"]["p50"] > 0 and row["http_ttft_ms"]["p50"] > 0


def test_client_that_disconnects_cancels_its_turn(front, caplog, tiny_spec) -> None:
    import logging

    def gone_count() -> float:  # finished chat requests with status 499, this process
        lines = [ln for ln in httpx.get(front["base"] + "/metrics").text.splitlines()
                 if ln.startswith("prefixgate:gateway_requests_total{")
                 and 'route="/v1/chat/completions"' in ln and 'status="499"' in ln]
        return float(lines[0].split()[-1]) if lines else 0.0

    caplog.set_level(logging.INFO, logger="prefixgate.turns")
    gone_before = gone_count()
    body = {"model": front["model"], "stream": True, "temperature": 0,
            "max_tokens": tiny_spec.max_context_tokens - 64,
            "messages": [{"role": "user", "content": "count"}]}
    with httpx.stream("POST", front["base"] + "/v1/chat/completions", json=body,
                      headers={"X-Request-Id": "gone-1"}, timeout=60) as r:
        next(r.iter_lines())  # the stream has begun; now go away
    wait_for(lambda: any(getattr(rec, "fields", {}).get("request_id") == "gone-1"
                         for rec in caplog.records), what="the cancelled turn's log line")
    (line,) = [rec for rec in caplog.records
               if getattr(rec, "fields", {}).get("request_id") == "gone-1"]
    assert line.event == "turn failed" and line.fields["status"] == "499", line.fields
    assert line.fields["e2e_ms"] < 20_000, line.fields  # cancelled, not run to the end
    time.sleep(0.2)  # the handler's cancellation has left the middleware too
    assert gone_count() == gone_before + 1  # counted once (the turn), not again (the route)
    assert "prefixgate:gateway_requests_in_flight" in httpx.get(front["base"] + "/metrics").text
    in_flight = [ln for ln in httpx.get(front["base"] + "/metrics").text.splitlines()
                 if ln.startswith("prefixgate:gateway_requests_in_flight{")
                 and "/v1/chat/completions" in ln]
    assert in_flight and float(in_flight[0].split()[-1]) == 0


def test_https_with_the_gateways_certificate_and_mutual_tls(loop_thread, tiny_spec, tiny_model,
                                                             tmp_path) -> None:
    """--tls-cert/--tls-key (and --tls-client-ca) serve HTTPS on the HTTP front too."""
    import ssl

    from prefixgate.wire.rpc import TLSConfig
    from tests.e2e.test_security import make_pki

    pki = make_pki(tmp_path, "http")
    w, wstop = start_worker(loop_thread, tiny_spec, tiny_model, "tls0")
    http_port = free_port()
    _, gstop = start_gateway(loop_thread, tiny_spec, [w], http_port=http_port,
                             tls=TLSConfig(pki["server_cert"], pki["server_key"], pki["ca"]))
    base = f"https://127.0.0.1:{http_port}"
    context = ssl.create_default_context(cafile=pki["ca"])
    context.load_cert_chain(pki["client_cert"], pki["client_key"])
    try:
        with httpx.Client(verify=context) as c:
            wait_for(lambda: c.get(base + "/health").status_code == 200, what="a worker")
            r = c.post(base + "/v1/chat/completions", json={
                "model": tiny_spec.name, "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
        with pytest.raises(httpx.HTTPError):  # no client certificate: refused
            httpx.get(base + "/health", verify=ssl.create_default_context(cafile=pki["ca"]))
    finally:
        for stop in (gstop, wstop):
            loop_thread.loop.call_soon_threadsafe(stop.set)


def test_requests_without_sampling_fields_take_the_models_defaults(loop_thread, tiny_spec,
                                                                   tiny_model) -> None:
    """A model whose generation_config says temperature 0 (greedy): an HTTP
    request that leaves them out decodes greedily (not at OpenAI's temperature 1), as does
    a gRPC request; a value the request gives wins."""
    import dataclasses

    import grpc

    from prefixgate.model.catalog import GenerationDefaults
    from prefixgate.model.tokenizer import ChatTokenizer
    from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2

    spec = dataclasses.replace(tiny_spec, generation=GenerationDefaults(temperature=0.0))
    worker, wstop = start_worker(loop_thread, spec, tiny_model, "gen0")
    http_port = free_port()
    gw, gstop = start_gateway(loop_thread, spec, [worker], http_port=http_port)
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_for(lambda: httpx.get(base + "/health").status_code == 200, what="the worker")

        def http(**fields) -> str:
            r = httpx.post(base + "/v1/completions", timeout=60, json={
                "model": spec.name, "max_tokens": 16, "seed": 7, "prompt": USER, **fields})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        left_out = http()
        assert left_out == http(temperature=0)
        assert left_out != http(temperature=1.0)  # what a left-out temperature used to be
        ids = ChatTokenizer(spec).encode_text(USER, add_special_tokens=True)
        with grpc.insecure_channel(gw) as ch:
            request = chat_pb2.ChatRequest(sampling=common_pb2.SamplingParams(max_tokens=16,
                                                                               seed=7))
            request.prompt_token_ids.token_ids.extend(ids)
            events = list(chat_pb2_grpc.ChatServiceStub(ch).Chat(request, timeout=60))
        assert "".join(e.delta.text for e in events if e.HasField("delta")) == left_out
    finally:
        for stop in (gstop, wstop):
            loop_thread.loop.call_soon_threadsafe(stop.set)


def test_logprobs_on_chat_and_completions_streamed_or_not(client, front) -> None:
    """logprobs / top_logprobs (evaluation harnesses ask for them): one entry per
    generated token with its top alternatives, the same streamed and whole; the greedy
    token is its own most likely alternative."""
    kwargs = dict(model=front["model"], messages=[{"role": "user", "content": USER}],
                  max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.bytes == list(entry.token.encode())
    streamed = [e for chunk in client.chat.completions.create(**kwargs, stream=True)
                for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == \
        [(e.token, round(e.logprob, 4)) for e in content]
    assert client.chat.completions.create(**{**kwargs, "logprobs": False,
                                             "top_logprobs": None}).choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(**{**kwargs, "logprobs": False})
    with pytest.raises(openai.BadRequestError, match="top_logprobs is 21"):
        client.chat.completions.create(**{**kwargs, "top_logprobs": 21})
    text = client.completions.create(model=front["model"], prompt="Once upon a time",
                                     max_tokens=5, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    # Greedy: no alternative is more likely than the token (tokens whose text reads alike,
    # partial UTF-8 here, share one key of OpenAI's token -> logprob map).
    assert all(1 <= len(top) <= 2 and max(top.values()) <= v + 1e-5
               for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
