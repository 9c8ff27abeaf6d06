"""Packed prompt token ids over real gRPC (tiny-random): the packed and the repeated form
route, hash and generate alike; malformed packed ids are INVALID_ARGUMENT; workers take
the packed form and push their status."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from prefixgate.v1 import chat_pb2, common_pb2, worker_pb2, worker_pb2_grpc
from tests.helpers import two_worker_cluster

SAMPLING = common_pb2.SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def cluster(loop_thread, tiny_spec, tiny_model):
    with two_worker_cluster(loop_thread, tiny_spec, tiny_model) as c:
        yield c


def packed(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def turn(stub, **kwargs):
    events = list(stub.Chat(chat_pb2.ChatRequest(sampling=SAMPLING, **kwargs), timeout=60))
    return [t for e in events if e.HasField("delta") for t in e.delta.token_ids], events[-1].final


def test_packed_and_repeated_route_hash_and_generate_alike(cluster) -> None:
    ids = list(range(40, 120))
    out_a, a = turn(cluster["stub"], prompt_token_ids=chat_pb2.TokenIds(token_ids=ids))
    # Same prompt, packed, no conversation id: the prefix index (hashed from the bytes)
    # must send it to the worker that cached it under the repeated form.
    out_b, b = turn(cluster["stub"], packed_prompt_token_ids=packed(ids))
    assert out_a == out_b and b.worker_id == a.worker_id
    assert b.usage.prompt_tokens == a.usage.prompt_tokens == len(ids)
    assert b.usage.cached_tokens >= len(ids) - 16
    # And the other way round, longer.
    _, c = turn(cluster["stub"], prompt_token_ids=chat_pb2.TokenIds(token_ids=ids + [7] * 20))
    assert c.worker_id == a.worker_id and c.usage.cached_tokens >= b.usage.cached_tokens


@pytest.mark.parametrize("data, needle", [
    (b"\x05\x00\x00\x00\x06", "5 bytes, not a multiple of 4"),
    (packed([5, 6, 999_999]), "token id 999999 at position 2 is out of range"),
    (b"", "is empty"),
])
def test_malformed_packed_ids_are_invalid_argument(cluster, data, needle) -> None:
    with pytest.raises(grpc.RpcError) as err:
        turn(cluster["stub"], packed_prompt_token_ids=data)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details() and "packed_prompt_token_ids" in err.value.details()


def test_worker_takes_packed_ids_and_pushes_status(cluster) -> None:
    with grpc.insecure_channel(cluster["workers"][0]) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)

        def generate(**kwargs):
            events = stub.Generate(worker_pb2.GenerateRequest(sampling=SAMPLING, **kwargs),
                                   timeout=60)
            return [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids]

        ids = list(range(200, 230))
        assert generate(packed_prompt_token_ids=packed(ids)) == generate(prompt_token_ids=ids)
        with pytest.raises(grpc.RpcError) as err:
            generate(prompt_token_ids=ids, packed_prompt_token_ids=packed(ids))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        status_stream = stub.WatchStatus(worker_pb2.WatchStatusRequest(min_interval_ms=20),
                                         timeout=30)
        first = next(status_stream)  # the current status at once
        assert first.kv_capacity_tokens > 0
        status_stream.cancel()
