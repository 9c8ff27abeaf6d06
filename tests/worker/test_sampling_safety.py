"""Sampling cannot fail on any accepted input (issue 13: the query of death).

Property: for every SamplingParams that prefixgate.wire.protocol accepts and any logits
(NaN, +-inf, huge, tiny), `Sampler.sample` returns a token id in range without raising.
"""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.v1 import common_pb2
from prefixgate.wire.protocol import MIN_TEMPERATURE, InvalidRequest, sampling_from_proto
from prefixgate.worker.sampling import Sampler

_float32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@settings(max_examples=400, deadline=None)
@given(temperature=_float32, top_p=_float32, top_k=st.integers(0, 2**32 - 1),
       seed=st.none() | st.integers(0, 2**64 - 1),
       logits=st.lists(_float32, min_size=1, max_size=40))
def test_accepted_params_never_fail(temperature, top_p, top_k, seed, logits) -> None:
    msg = common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    if seed is not None:
        msg.seed = seed
    try:
        cfg = sampling_from_proto(msg, 4, 64)
    except InvalidRequest:
        return
    token = Sampler(cfg).sample(torch.tensor(logits, dtype=torch.float32))
    assert 0 <= token < len(logits)


def test_tiny_temperatures() -> None:
    """Below the smallest normal float32 the request is refused with the bound in the
    message; at the bound, huge logits still sample the argmax."""
    for t in (1e-39, 1e-45):
        try:
            sampling_from_proto(common_pb2.SamplingParams(temperature=t), 4, 64)
        except InvalidRequest as exc:
            assert "1.18e-38" in str(exc) and "use 0 for greedy" in str(exc)
        else:
            raise AssertionError(f"temperature {t} accepted")
    cfg = sampling_from_proto(common_pb2.SamplingParams(temperature=MIN_TEMPERATURE), 4, 64)
    logits = torch.tensor([1e4, -3e38, 2e4, float("nan"), 1.99e4])
    assert Sampler(cfg).sample(logits) == 2
    assert Sampler(cfg).sample(logits.half()) == 2  # any float dtype


def test_no_finite_logit_gives_a_token() -> None:
    cfg = sampling_from_proto(common_pb2.SamplingParams(temperature=0.7, top_p=0.5), 4, 64)
    for bad in (float("nan"), float("-inf")):
        assert Sampler(cfg).sample(torch.full((5,), bad)) == 0
    assert Sampler(cfg).sample(torch.tensor([0.0, math.inf, 1.0])) == 1
