"""Context overflow over real gRPC (tiny-random, two workers, a gateway): refused unless
asked, then served with the oldest turns dropped and reported, on the worker that holds
the conversation, reusing its kept turns; a worker-side default for direct clients."""

from __future__ import annotations

import grpc
import pytest

from prefixgate.model.overflow import user_turn_prefix
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from tests.helpers import start_gateway, start_worker, wait_for

OVERFLOW = common_pb2.CONTEXT_OVERFLOW_KEEP_SYSTEM_DROP_OLDEST


@pytest.fixture(scope="module")
def cluster(loop_thread, tiny_spec, tiny_model):
    prefix = user_turn_prefix(ChatTokenizer(tiny_spec))
    w0, stop0 = start_worker(loop_thread, tiny_spec, tiny_model, "ov0", turn_prefix=prefix,
                             context_overflow="keep-system-drop-oldest")
    w1, stop1 = start_worker(loop_thread, tiny_spec, tiny_model, "ov1", turn_prefix=prefix)
    gw, gstop = start_gateway(loop_thread, tiny_spec, [w0, w1])
    channel = grpc.insecure_channel(gw)
    stub = chat_pb2_grpc.ChatServiceStub(channel)
    wait_for(lambda: stub.ListModels(chat_pb2.ListModelsRequest()).models[0].num_workers == 2,
             what="gateway to see both workers")
    yield {"stub": stub, "workers": {"ov0": w0, "ov1": w1}, "gateway": gw}
    channel.close()
    for stop in (gstop, stop0, stop1):
        loop_thread.loop.call_soon_threadsafe(stop.set)


def _messages(num_turns: int) -> list[tuple[str, str]]:
    out = [("system", "You answer briefly.")]
    for i in range(num_turns):
        out.append(("user", f"turn {i}: " + "describe the weather on a long walk " * 12))
        if i < num_turns - 1:
            out.append(("assistant", f"reply {i}: " + "sunny then cloudy with some wind " * 8))
    return out


def _chat(stub, messages, **sampling) -> chat_pb2.ChatFinal:
    req = chat_pb2.ChatRequest(conversation_id="long-chat",
                               sampling=common_pb2.SamplingParams(max_tokens=8, **sampling))
    for role, content in messages:
        req.messages.messages.add(role=role, content=content)
    return list(stub.Chat(req, timeout=120))[-1].final


def test_overflowing_turn_is_refused_unless_asked_then_reuses_the_kept_turns(
        cluster, tiny_spec) -> None:
    tok = ChatTokenizer(tiny_spec)
    stub = cluster["stub"]
    fits = next(n for n in range(1, 20)
                if len(tok.encode_messages(_messages(n + 1))) + 8 > tiny_spec.max_context_tokens)
    previous = _chat(stub, _messages(fits))
    assert previous.usage.dropped_tokens == 0
    with pytest.raises(grpc.RpcError) as err:
        _chat(stub, _messages(fits + 1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    final = _chat(stub, _messages(fits + 1), context_overflow=OVERFLOW,
                  shifted_reuse=common_pb2.SHIFTED_REUSE_SHIFT)
    full = len(tok.encode_messages(_messages(fits + 1)))
    assert final.usage.dropped_tokens > 0
    assert final.usage.prompt_tokens + final.usage.dropped_tokens == full
    assert final.usage.prompt_tokens + 8 <= tiny_spec.max_context_tokens
    # Routed by the full prompt's leading blocks to the worker holding the conversation,
    # which moved the kept part of the previous prompt instead of recomputing it.
    assert final.worker_id == previous.worker_id
    kept_of_previous = previous.usage.prompt_tokens - final.usage.dropped_tokens
    assert final.usage.cached_tokens >= kept_of_previous - 2 * 16
    # The next overflowing turn drops more; it finds the moved (salted) run on that worker.
    later = _chat(stub, _messages(fits + 2), context_overflow=OVERFLOW,
                  shifted_reuse=common_pb2.SHIFTED_REUSE_BLEND)
    assert later.worker_id == previous.worker_id
    assert later.usage.dropped_tokens > final.usage.dropped_tokens
    kept_of_final = final.usage.prompt_tokens - (later.usage.dropped_tokens
                                                 - final.usage.dropped_tokens)
    assert later.usage.cached_tokens >= kept_of_final - 64 - 2 * 16


def test_worker_default_policy_serves_direct_clients(cluster, tiny_spec) -> None:
    tok = ChatTokenizer(tiny_spec)
    prompt = tok.encode_messages(_messages(12))
    assert len(prompt) > tiny_spec.max_context_tokens
    sampling = common_pb2.SamplingParams(max_tokens=4)
    with grpc.insecure_channel(cluster["workers"]["ov0"]) as ch:  # default: drop oldest
        events = list(worker_pb2_grpc.WorkerServiceStub(ch).Generate(
            worker_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling), timeout=120))
    usage = events[-1].final.usage
    assert usage.dropped_tokens > 0 and usage.prompt_tokens + usage.dropped_tokens == len(prompt)
    with grpc.insecure_channel(cluster["workers"]["ov1"]) as ch:  # default: fail
        with pytest.raises(grpc.RpcError) as err:
            list(worker_pb2_grpc.WorkerServiceStub(ch).Generate(
                worker_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_chat_client_and_cli_show_dropped_tokens(cluster, loop_thread, tiny_spec) -> None:
    from prefixgate.cli import build_parser
    from prefixgate.cli.chat import figures, overflow_params
    from prefixgate.wire.client import ChatClient

    args = build_parser().parse_args(["chat", "--context-overflow", "keep-system-drop-oldest",
                                      "--shifted-reuse", "blend"])
    params = overflow_params(args)
    assert params == {"context_overflow": OVERFLOW, "shifted_reuse": common_pb2.SHIFTED_REUSE_BLEND}
    default = overflow_params(build_parser().parse_args(["chat"]))
    assert default == {"context_overflow": 0, "shifted_reuse": 0}

    async def turn():
        client = ChatClient(cluster["gateway"])
        try:
            return await client.turn(_messages(12), sampling=common_pb2.SamplingParams(
                max_tokens=4, **params), timeout_s=120)
        finally:
            await client.close()

    result = loop_thread.run(turn())
    assert result.dropped_tokens > 0
    assert f"dropped {result.dropped_tokens} tok" in figures(result)


def test_gateway_default_policy_applies_to_every_worker(cluster, loop_thread, tiny_spec) -> None:
    """A gateway started with --context-overflow keep-system-drop-oldest accepts an
    overflowing turn that chose no policy, and makes the choice explicit, so even a worker
    whose own default is "fail" serves it."""
    w1 = cluster["workers"]["ov1"]  # its default is "fail"
    gw, gstop = start_gateway(loop_thread, tiny_spec, [w1],
                              context_overflow="keep-system-drop-oldest")
    with grpc.insecure_channel(gw) as ch:
        stub = chat_pb2_grpc.ChatServiceStub(ch)
        wait_for(lambda: stub.ListModels(chat_pb2.ListModelsRequest()).models[0].num_workers == 1)
        final = _chat(stub, _messages(12))
    assert final.worker_id == "ov1" and final.usage.dropped_tokens > 0
    loop_thread.loop.call_soon_threadsafe(gstop.set)
