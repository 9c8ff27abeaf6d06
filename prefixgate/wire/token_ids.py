"""Prompt token ids on the wire: the packed form, read and checked at C speed.

Token ids travel packed end to end: 4 bytes per id, each a little-endian uint32, which is
also the block hash's own byte form (radix/hashing.py). The public ChatRequest carries
them in `packed_prompt_token_ids` and the worker's GenerateRequest in the field of the
same name; the repeated `prompt_token_ids` fields still work and are read once into the
packed form. The gateway checks the bytes, hashes them and forwards the very bytes it was
given: no Python object per id anywhere on its per-turn path (a 12k-token prompt costs
about 3 us to check, where a list of ints cost 0.3 ms to convert and check).

Contract: every function returns a `radix.packed` view (len() = number of ids; `.obj`
is the bytes) or raises `protocol.InvalidRequest` with a message saying what to change;
an accepted prompt has at least one id and every id in [0, vocab_size). Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prefixgate.radix import packed, tokens_to_bytes
from prefixgate.wire.protocol import InvalidRequest

__all__ = ["pack", "packed_token_ids", "prompt_token_ids", "repeated_token_ids"]

PACKED_FIELD = "packed_prompt_token_ids"
REPEATED_FIELD = "prompt_token_ids"


def pack(token_ids: Sequence[int]) -> memoryview:
    """Trusted ids (e.g. the tokenizer's output) in the packed form, unchecked."""
    return packed(tokens_to_bytes(token_ids))


def packed_token_ids(data: bytes, vocab_size: int, field: str = PACKED_FIELD) -> memoryview:
    """Check ids sent packed in `field` and view them without copying. Raises unless the
    length is a non-zero multiple of 4 and every id is below `vocab_size`."""
    if len(data) % 4:
        raise InvalidRequest(
            f"{field} is {len(data)} bytes, not a multiple of 4: send each token id as 4 "
            "bytes, a little-endian uint32 (e.g. numpy.asarray(ids, '<u4').tobytes())", field)
    if not data:
        raise InvalidRequest(f"{field} is empty: send at least one token id", field)
    ids = np.frombuffer(data, dtype="<u4")
    if int(ids.max()) >= vocab_size:
        at = int(np.argmax(ids >= vocab_size))
        raise InvalidRequest(
            f"{field}: token id {int(ids[at])} at position {at} is out of range: the model's "
            f"vocabulary has {vocab_size} tokens (ids 0..{vocab_size - 1})", field)
    return packed(data)


def repeated_token_ids(token_ids: Sequence[int], vocab_size: int,
                       field: str = REPEATED_FIELD) -> memoryview:
    """`token_ids` (a repeated uint32 field, or a list of ints) read once into the packed
    form and checked like `packed_token_ids`. A protobuf repeated field is copied in C
    (numpy reads it through its `__array__`), not id by id."""
    if not len(token_ids):
        raise InvalidRequest(f"{field} is empty: send at least one token id", field)
    try:
        data = np.asarray(token_ids, dtype="<u4").tobytes()
    except (OverflowError, TypeError, ValueError):  # a Python list only: proto ids are u32
        raise InvalidRequest(f"{field} holds a value that is not a token id: ids are integers "
                             f"in 0..{vocab_size - 1}", field) from None
    return packed_token_ids(data, vocab_size, field)


def prompt_token_ids(repeated: Sequence[int], data: bytes, vocab_size: int) -> memoryview:
    """A request's prompt from whichever form it was sent in (exactly one may be set)."""
    if data and len(repeated):
        raise InvalidRequest(f"both {REPEATED_FIELD} and {PACKED_FIELD} are set: send the "
                             "prompt in one of them", PACKED_FIELD)
    if data:
        return packed_token_ids(data, vocab_size)
    return repeated_token_ids(repeated, vocab_size)
