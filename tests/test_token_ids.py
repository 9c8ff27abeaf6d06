"""Prompt token ids on the wire: the packed form and the repeated form are one prompt."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixgate.radix import BlockHasher
from prefixgate.v1 import chat_pb2, worker_pb2
from prefixgate.wire.protocol import InvalidRequest
from prefixgate.wire.token_ids import pack, packed_token_ids, prompt_token_ids, repeated_token_ids

VOCAB = 1000


def le_u32(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


@given(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=200))
def test_both_forms_give_one_prompt(ids):
    # Through real messages: the repeated field as parsed by protobuf, and the bytes.
    wire = chat_pb2.ChatRequest(prompt_token_ids=chat_pb2.TokenIds(token_ids=ids))
    repeated = chat_pb2.ChatRequest.FromString(wire.SerializeToString()).prompt_token_ids
    a = repeated_token_ids(repeated.token_ids, VOCAB)
    b = packed_token_ids(le_u32(ids), VOCAB)
    assert a.tolist() == b.tolist() == pack(ids).tolist() == ids
    assert a.obj == b.obj  # the bytes the worker is handed
    hasher = BlockHasher(4, "fp", "ns")
    assert hasher.hash_blocks(a) == hasher.hash_blocks(b) == hasher.hash_blocks(ids)


def test_packed_bytes_are_not_copied():
    data = le_u32([1, 2, 3])
    assert packed_token_ids(data, VOCAB).obj is data


@pytest.mark.parametrize("data, needle", [
    (b"\x01\x00\x00\x00\x02", "is 5 bytes, not a multiple of 4"),
    (b"", "is empty"),
    (le_u32([1, 2, VOCAB, 3]), f"token id {VOCAB} at position 2 is out of range"),
    (le_u32([2**32 - 1]), "vocabulary has 1000 tokens (ids 0..999)"),
])
def test_malformed_packed_ids_say_what_to_change(data, needle):
    with pytest.raises(InvalidRequest) as err:
        packed_token_ids(data, VOCAB)
    assert needle in str(err.value) and "packed_prompt_token_ids" in str(err.value)


@pytest.mark.parametrize("ids, needle", [([], "is empty"), ([1, VOCAB], "out of range"),
                                         ([1, -1], "not a token id")])
def test_bad_repeated_ids(ids, needle):
    with pytest.raises(InvalidRequest, match=needle):
        repeated_token_ids(ids, VOCAB)


def test_generate_request_takes_one_form():
    both = worker_pb2.GenerateRequest(prompt_token_ids=[1], packed_prompt_token_ids=le_u32([1]))
    with pytest.raises(InvalidRequest, match="both"):
        prompt_token_ids(both.prompt_token_ids, both.packed_prompt_token_ids, VOCAB)
    req = worker_pb2.GenerateRequest(packed_prompt_token_ids=le_u32([7, 8]))
    assert prompt_token_ids(req.prompt_token_ids, req.packed_prompt_token_ids, VOCAB).tolist() \
        == [7, 8]
