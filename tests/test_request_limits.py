"""Edge limits (protocol.RequestLimits): cheap checks that run before tokenizing."""

import pytest

from prefixgate.v1 import chat_pb2, worker_pb2
from prefixgate.wire.protocol import (
    InvalidRequest,
    RequestLimits,
    check_chat_fields,
    check_generate_fields,
    check_prompt_tokens,
    clip,
)

LIMITS = RequestLimits(max_id_chars=8, max_messages=2, max_stop=2, max_stop_chars=4,
                       max_stop_token_ids=3, max_prompt_tokens=10)


def chat(**fields) -> chat_pb2.ChatRequest:
    req = chat_pb2.ChatRequest(**fields)
    req.messages.messages.add(role="user", content="hi")
    return req


@pytest.mark.parametrize("fields, match", [
    (dict(conversation_id="x" * 9), "conversation_id is 9 characters long: at most 8"),
    (dict(namespace="x" * 9), "namespace is 9"),
    (dict(model="m" * 10_000), "model is 10000"),
])
def test_ids(fields: dict, match: str) -> None:
    check_chat_fields(chat(conversation_id="x" * 8), LIMITS)
    with pytest.raises(InvalidRequest, match=match) as exc:
        check_chat_fields(chat(**fields), LIMITS)
    assert len(str(exc.value)) < 200  # never echoes the field


def test_messages_and_stops() -> None:
    req = chat()
    req.messages.messages.add(role="user", content="again")
    check_chat_fields(req, LIMITS)
    req.messages.messages.add(role="user", content="more")
    with pytest.raises(InvalidRequest, match="3 messages: at most 2"):
        check_chat_fields(req, LIMITS)
    for sampling, match in ((dict(stop=["a", "b", "c"]), "3 strings"),
                            (dict(stop=["abcde"]), "5 characters"),
                            (dict(stop_token_ids=[1, 2, 3, 4]), "4 ids")):
        with pytest.raises(InvalidRequest, match=match):
            check_chat_fields(chat(sampling=sampling), LIMITS)
        with pytest.raises(InvalidRequest, match=match):
            check_generate_fields(worker_pb2.GenerateRequest(sampling=sampling), LIMITS)


def test_prompt_tokens_and_clip() -> None:
    check_prompt_tokens(10, LIMITS)
    with pytest.raises(InvalidRequest, match="11 tokens: at most 10"):
        check_prompt_tokens(11, LIMITS)
    assert clip("a" * 100, 4) == "aaaa...(+96 chars)" and clip("ab") == "ab"
    assert RequestLimits().worker_receive_bytes > 4 * RequestLimits().max_prompt_tokens


def test_limit_flags_and_env(monkeypatch) -> None:
    from prefixgate.cli.flags import Parser
    from prefixgate.cli.limits import limit_flags, request_limits

    monkeypatch.setenv("PREFIXGATE_MAX_STOP", "3")
    p = Parser()
    limit_flags(p)
    got = request_limits(p.parse_args(["--max-request-bytes", "1000"]))
    assert got == RequestLimits(max_request_bytes=1000, max_stop=3)
