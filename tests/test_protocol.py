"""Request validation shared by gateway and worker."""

import pytest

from prefixgate.v1 import common_pb2
from prefixgate.wire.protocol import (
    DEFAULT_MAX_TOKENS,
    InvalidRequest,
    check_messages,
    check_token_ids,
    sampling_from_proto,
)


def test_defaults_fit_the_context() -> None:
    s = sampling_from_proto(common_pb2.SamplingParams(), 10, 2048)
    assert s.max_tokens == DEFAULT_MAX_TOKENS and s.temperature == 0 and s.top_p == 1.0
    assert sampling_from_proto(common_pb2.SamplingParams(), 2000, 2048).max_tokens == 48


@pytest.mark.parametrize("params, num_prompt, match", [
    (dict(max_tokens=0), 10, "max_tokens is 0: it must be between 1 and 2038"),
    (dict(max_tokens=100), 2000, "must be between 1 and 48"),
    (dict(), 2048, "context window is 2048"),
    (dict(temperature=-1), 10, "temperature"),
    (dict(top_p=1.5), 10, "top_p"),
    (dict(top_logprobs=21), 10, "top_logprobs is 21: it must be between 0 and 20"),
])
def test_bad_sampling(params: dict, num_prompt: int, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        sampling_from_proto(common_pb2.SamplingParams(**params), num_prompt, 2048)


def test_seed_and_stops_pass_through() -> None:
    s = sampling_from_proto(common_pb2.SamplingParams(seed=7, stop=["a", ""], stop_token_ids=[3]),
                            1, 100)
    assert (s.seed, s.stop, s.stop_token_ids) == (7, ("a",), (3,))


def test_messages() -> None:
    check_messages([("system", "s"), ("user", "u"), ("assistant", ""), ("user", "again")])
    with pytest.raises(InvalidRequest, match="empty"):
        check_messages([])
    with pytest.raises(InvalidRequest, match="role is 'robot'"):
        check_messages([("robot", "hi")])
    with pytest.raises(InvalidRequest, match=r"messages\[0\].content is empty"):
        check_messages([("user", "")])
    with pytest.raises(InvalidRequest, match="end with a user message"):
        check_messages([("user", "a"), ("assistant", "b")])


def test_token_ids() -> None:
    check_token_ids([0, 5], 6)
    with pytest.raises(InvalidRequest, match="empty"):
        check_token_ids([], 6)
    with pytest.raises(InvalidRequest, match="6 is out of range"):
        check_token_ids([1, 6], 6)
