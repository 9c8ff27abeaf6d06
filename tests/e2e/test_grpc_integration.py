"""Gateway and workers over real gRPC on loopback (tiny-random): streaming, statuses,
health, reflection, failover and fingerprint refusal."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from tests.helpers import start_gateway, start_worker, two_worker_cluster, wait_for


@pytest.fixture(scope="module")
def cluster(loop_thread, tiny_spec, tiny_model):
    with two_worker_cluster(loop_thread, tiny_spec, tiny_model) as c:
        yield c


def chat(stub, messages=None, token_ids=None, timeout=60, **kwargs):
    req = chat_pb2.ChatRequest(**kwargs)
    if token_ids is not None:
        req.prompt_token_ids.token_ids.extend(token_ids)
    for role, content in messages or ():
        req.messages.messages.add(role=role, content=content)
    return list(stub.Chat(req, timeout=timeout))


def test_chat_streams_deltas_then_final(cluster) -> None:
    events = chat(cluster["stub"], [("user", "hello")], conversation_id="c1",
                  sampling=common_pb2.SamplingParams(max_tokens=12))
    deltas = [e.delta for e in events if e.HasField("delta")]
    final = events[-1].final
    assert events[-1].HasField("final") and len(deltas) >= 1
    assert sum(len(d.token_ids) for d in deltas) == final.usage.completion_tokens
    assert final.usage.prompt_tokens > 0 and final.worker_id in ("w0", "w1")
    assert final.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
    assert final.timings.ttft_ms > 0 and final.timings.total_ms >= final.timings.ttft_ms


def test_second_turn_hits_the_cache_on_the_same_worker(cluster) -> None:
    sampling = common_pb2.SamplingParams(max_tokens=8)
    first = chat(cluster["stub"], [("user", "tell me a story")], conversation_id="conv-2",
                 sampling=sampling)[-1].final
    second = chat(cluster["stub"], token_ids=list(range(3, 3 + first.usage.prompt_tokens + 20)),
                  conversation_id="conv-2", sampling=sampling)[-1].final
    assert second.worker_id == first.worker_id  # session affinity
    # Same token prefix sent twice: the second reuses it.
    ids = list(range(10, 90))
    chat(cluster["stub"], token_ids=ids, conversation_id="conv-3", sampling=sampling)
    again = chat(cluster["stub"], token_ids=ids + [5, 6, 7], conversation_id="conv-3",
                 sampling=sampling)[-1].final
    assert again.usage.cached_tokens >= len(ids) - 1


def test_raw_token_ids_match_messages(cluster, tiny_spec) -> None:
    from prefixgate.model.tokenizer import ChatTokenizer

    ids = ChatTokenizer(tiny_spec).encode_messages([("user", "same prompt")])
    sampling = common_pb2.SamplingParams(max_tokens=10)
    a = chat(cluster["stub"], [("user", "same prompt")], sampling=sampling)
    b = chat(cluster["stub"], token_ids=ids, sampling=sampling)
    toks = lambda evs: [t for e in evs if e.HasField("delta") for t in e.delta.token_ids]  # noqa: E731
    assert toks(a) == toks(b) and a[-1].final.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(messages=[]), "has no input"),
    (dict(messages=[("user", "")]), "content is empty"),
    (dict(messages=[("wizard", "hi")]), "role is 'wizard'"),
    (dict(messages=[("user", "hi")], sampling=common_pb2.SamplingParams(max_tokens=0)),
     "max_tokens is 0: it must be between 1 and"),
    (dict(token_ids=[5] * 3000), "context window is 2048"),
    (dict(token_ids=[99999]), "out of range"),
])
def test_bad_input_is_invalid_argument(cluster, kwargs, needle) -> None:
    with pytest.raises(grpc.RpcError) as err:
        chat(cluster["stub"], **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()


def test_unknown_model_is_not_found(cluster) -> None:
    with pytest.raises(grpc.RpcError) as err:
        chat(cluster["stub"], [("user", "hi")], model="llama-9000")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "not served here" in err.value.details()


def test_non_utf8_text_is_invalid_argument(cluster) -> None:
    # ChatRequest{messages{messages{role:"user" content:<0xff 0xfe>}}} encoded by hand.
    msg = b"\x0a\x04user" + b"\x12\x02\xff\xfe"
    raw = b"\x0a" + bytes([len(msg) + 2]) + b"\x0a" + bytes([len(msg)]) + msg
    call = cluster["channel"].unary_stream("/prefixgate.v1.ChatService/Chat",
                                           request_serializer=lambda b: b,
                                           response_deserializer=chat_pb2.ChatEvent.FromString)
    with pytest.raises(grpc.RpcError) as err:
        list(call(raw, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in err.value.details()


def test_health_and_reflection(cluster) -> None:
    for address in [cluster["gateway"], *cluster["workers"]]:
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            resp = next(stub.ServerReflectionInfo(iter([
                reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
            names = {s.name for s in resp.list_services_response.service}
            assert "grpc.health.v1.Health" in names
            assert names & {"prefixgate.v1.ChatService", "prefixgate.v1.WorkerService"}


def test_worker_status_and_flush(cluster) -> None:
    with grpc.insecure_channel(cluster["workers"][0]) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        status = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
        assert status.kv_capacity_tokens > 0
        info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
        assert info.worker_id == "w0" and info.model_name == "tiny-random"
        stub.FlushCache(worker_pb2.FlushCacheRequest(), timeout=5)
        assert stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5).kv_used_tokens == 0


def test_failover_before_first_token_and_unavailable(loop_thread, tiny_spec, tiny_model) -> None:
    from prefixgate.wire.rpc import free_port

    live, live_stop = start_worker(loop_thread, tiny_spec, tiny_model, "live")
    dead = f"127.0.0.1:{free_port()}"  # nothing listens here
    gw, gstop = start_gateway(loop_thread, tiny_spec, [live, dead])
    with grpc.insecure_channel(gw) as ch:
        stub = chat_pb2_grpc.ChatServiceStub(ch)
        wait_for(lambda: stub.ListModels(chat_pb2.ListModelsRequest()).models[0].num_workers == 1)
        for i in range(4):  # every turn lands on the live worker
            assert chat(stub, [("user", f"hi {i}")], conversation_id=f"c{i}",
                        sampling=common_pb2.SamplingParams(max_tokens=4))[-1].final.worker_id == "live"
        # Kill the live worker: the gateway must answer UNAVAILABLE quickly, not hang.
        loop_thread.loop.call_soon_threadsafe(live_stop.set)
        time.sleep(1.5)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            chat(stub, [("user", "anyone?")], timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 10
    loop_thread.loop.call_soon_threadsafe(gstop.set)


def test_worker_marked_down_fails_over_invisibly(loop_thread, tiny_spec, tiny_model) -> None:
    a, a_stop = start_worker(loop_thread, tiny_spec, tiny_model, "a")
    b, b_stop = start_worker(loop_thread, tiny_spec, tiny_model, "b")
    gw, gstop = start_gateway(loop_thread, tiny_spec, [a, b], refresh_interval_s=60)
    with grpc.insecure_channel(gw) as ch:
        stub = chat_pb2_grpc.ChatServiceStub(ch)
        wait_for(lambda: stub.ListModels(chat_pb2.ListModelsRequest()).models[0].num_workers == 2)
        served = chat(stub, [("user", "x")], conversation_id="sticky",
                      sampling=common_pb2.SamplingParams(max_tokens=2))[-1].final.worker_id
        # Stop the worker this conversation is pinned to; the gateway still believes it is
        # up (no refresh for 60 s), so the next turn must fail over transparently.
        loop_thread.loop.call_soon_threadsafe((a_stop if served == "a" else b_stop).set)
        time.sleep(1.5)
        final = chat(stub, [("user", "x")], conversation_id="sticky",
                     sampling=common_pb2.SamplingParams(max_tokens=2))[-1].final
        assert final.worker_id == ("b" if served == "a" else "a")
    loop_thread.loop.call_soon_threadsafe(gstop.set)
    for stop in (a_stop, b_stop):
        loop_thread.loop.call_soon_threadsafe(stop.set)


def test_gateway_refuses_a_worker_of_another_model(loop_thread, tiny_spec, tiny_model) -> None:
    from dataclasses import replace

    w, w_stop = start_worker(loop_thread, replace(tiny_spec, fingerprint="other"), tiny_model, "x")
    gw, gstop = start_gateway(loop_thread, tiny_spec, [w])
    with grpc.insecure_channel(gw) as ch:
        stub = chat_pb2_grpc.ChatServiceStub(ch)
        time.sleep(1.0)
        assert stub.ListModels(chat_pb2.ListModelsRequest()).models[0].num_workers == 0
        with pytest.raises(grpc.RpcError) as err:
            chat(stub, [("user", "hi")])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    loop_thread.loop.call_soon_threadsafe(gstop.set)
    loop_thread.loop.call_soon_threadsafe(w_stop.set)


def test_n_samples_stream_with_their_index(cluster) -> None:
    events = chat(cluster["stub"], [("user", "three takes")],
                  sampling=common_pb2.SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=1))
    final = events[-1].final
    per_sample: dict[int, int] = {}
    for e in events[:-1]:
        per_sample[e.delta.index] = per_sample.get(e.delta.index, 0) + len(e.delta.token_ids)
    assert sorted(per_sample) == [0, 1, 2]
    assert len(final.sample_finish_reasons) == 3
    assert final.usage.completion_tokens == sum(per_sample.values())
