"""OpenTelemetry traces (telemetry/tracing.py): a turn continues the client's W3C trace
context, over gRPC metadata and HTTP headers, into the gateway's turn span, its worker
call and the worker's own span; off unless configured."""

from __future__ import annotations

import grpc
import httpx
import pytest

from prefixgate.telemetry import tracing
from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2
from prefixgate.wire.rpc import free_port
from tests.helpers import start_gateway, start_worker, wait_for

pytest.importorskip("opentelemetry.sdk")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def spans():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.configure(exporter, "prefixgate-test")
    yield exporter
    tracing.configure("off")


def _chat(address: str, metadata=()) -> list[chat_pb2.ChatEvent]:
    with grpc.insecure_channel(address) as ch:
        request = chat_pb2.ChatRequest(sampling=common_pb2.SamplingParams(max_tokens=3),
                                       messages=chat_pb2.Messages(messages=[
                                           chat_pb2.ChatMessage(role="user", content="hi")]))
        return list(chat_pb2_grpc.ChatServiceStub(ch).Chat(request, metadata=metadata,
                                                           timeout=60))


def test_turn_spans_continue_the_callers_trace_into_the_worker(loop_thread, tiny_spec,
                                                               tiny_model, spans) -> None:
    worker, wstop = start_worker(loop_thread, tiny_spec, tiny_model, "tw")
    http_port = free_port()
    gateway, gstop = start_gateway(loop_thread, tiny_spec, [worker], http_port=http_port)
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_for(lambda: httpx.get(base + "/health").status_code == 200, what="the worker")
        traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
        with grpc.insecure_channel(gateway) as ch:
            call = chat_pb2_grpc.ChatServiceStub(ch).Chat(chat_pb2.ChatRequest(
                sampling=common_pb2.SamplingParams(max_tokens=3),
                messages=chat_pb2.Messages(messages=[chat_pb2.ChatMessage(
                    role="user", content="hi")])), metadata=(("traceparent", traceparent),),
                timeout=60)
            assert list(call)[-1].HasField("final")
            grpc_reply = dict(call.initial_metadata())["traceresponse"]
        r = httpx.post(base + "/v1/chat/completions", headers={"traceparent": traceparent},
                       timeout=60, json={"model": tiny_spec.name, "max_tokens": 3,
                                         "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=60, json={
                "model": tiny_spec.name, "max_tokens": 3, "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}) as streamed:
            assert streamed.status_code == 200
            streamed.read()
        # Each reply names its turn's span (traceresponse): the caller's trace, where the
        # caller sent one; a new trace of the gateway's own where it did not.
        replies = [grpc_reply, r.headers["traceresponse"], streamed.headers["traceresponse"]]
        assert [h.split("-")[1] == TRACE_ID for h in replies] == [True, True, False]
        wait_for(lambda: len(spans.get_finished_spans()) >= 9, what="nine spans")
        done = [s for s in spans.get_finished_spans()
                if format(s.context.trace_id, "032x") == TRACE_ID]
        by_name: dict[str, list] = {}
        for s in done:
            by_name.setdefault(s.name, []).append(s)
        assert {k: len(v) for k, v in by_name.items()} == {
            "prefixgate.turn": 2, "prefixgate.worker_call": 2, "prefixgate.worker.generate": 2}
        for turn in by_name["prefixgate.turn"]:
            # The client's trace, the client's span as parent: one trace end to end.
            assert format(turn.context.trace_id, "032x") == TRACE_ID
            assert format(turn.parent.span_id, "016x") == CLIENT_SPAN
            assert turn.attributes["prefixgate.worker_id"] == "tw"
            assert turn.attributes["prefixgate.completion_tokens"] >= 1
            assert any(h.split("-")[2] == format(turn.context.span_id, "016x")
                       for h in replies)
            call = next(c for c in by_name["prefixgate.worker_call"]
                        if c.parent.span_id == turn.context.span_id)
            served = next(w for w in by_name["prefixgate.worker.generate"]
                          if w.parent.span_id == call.context.span_id)
            assert format(served.context.trace_id, "032x") == TRACE_ID
            assert served.attributes["prefixgate.worker_id"] == "tw"
        # A turn that fails is an error span, the gRPC status as its description.
        spans.clear()
        with pytest.raises(grpc.RpcError):
            with grpc.insecure_channel(gateway) as ch:
                list(chat_pb2_grpc.ChatServiceStub(ch).Chat(chat_pb2.ChatRequest(
                    messages=chat_pb2.Messages()), timeout=60))
        wait_for(lambda: spans.get_finished_spans(), what="the failed turn's span")
        (failed,) = spans.get_finished_spans()
        assert not failed.status.is_ok and "messages is empty" in failed.status.description
        # Off: no spans, turns as before.
        tracing.configure("off")
        spans.clear()
        assert _chat(gateway, metadata=(("traceparent", traceparent),))[-1].HasField("final")
        assert spans.get_finished_spans() == ()
    finally:
        for stop in (gstop, wstop):
            loop_thread.loop.call_soon_threadsafe(stop.set)
