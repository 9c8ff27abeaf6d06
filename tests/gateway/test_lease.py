"""WorkerHandle.lease: a turn's load on its worker is given back exactly once, on every
path out of the turn (first token or not, failure or not)."""

from __future__ import annotations

import pytest

from prefixgate.gateway.pool import WorkerHandle
from prefixgate.registry import WorkerRecord
from prefixgate.v1 import worker_pb2


def _handle() -> WorkerHandle:
    return WorkerHandle(WorkerRecord("w", "127.0.0.1:1"), None, None)  # type: ignore[arg-type]


def test_a_lease_counts_the_turn_until_it_closes() -> None:
    h = _handle()
    h.set_status(worker_pb2.WorkerStatus(num_queued_prefill_tokens=0, num_running_requests=0))
    with h.lease(1000) as lease:
        assert (h.in_flight, h.in_flight_prompt_tokens) == (1, 1000)
        assert h.num_queued_prefill_tokens == 1000 and h.num_running_requests == 1
        lease.first_token()
        lease.first_token()  # once only
        assert h.in_flight_prompt_tokens == 0 and h.prefilled_since_status == 1000
        assert h.num_queued_prefill_tokens == 0 and h.num_running_requests == 1
    assert (h.in_flight, h.in_flight_prompt_tokens) == (0, 0)
    assert (h.finished_since_status, h.prefilled_since_status) == (1, 1000)
    lease.close()  # closing again changes nothing
    assert (h.in_flight, h.finished_since_status) == (0, 1)


def test_a_failed_turn_gives_its_queued_prefill_back() -> None:
    h = _handle()
    with pytest.raises(RuntimeError), h.lease(300):
        with h.lease(200):
            assert (h.in_flight, h.in_flight_prompt_tokens) == (2, 500)
        assert (h.in_flight, h.in_flight_prompt_tokens) == (1, 300)
        raise RuntimeError("the worker failed before its first token")
    assert (h.in_flight, h.in_flight_prompt_tokens, h.finished_since_status) == (0, 0, 2)


def test_a_reported_rate_counts_only_up_to_what_the_gateway_saw() -> None:
    """A worker's self-reported prefill rate is a claim: before the gateway has seen it
    deliver a first token it counts as unmeasured (0: the peers' mean), after that at most
    the fastest prefill seen (own queued tokens ahead included), and a turn that never got
    its first token shows nothing."""
    import time

    h = _handle()
    h.set_status(worker_pb2.WorkerStatus(prefill_tokens_per_s=1e9))
    assert h.prefill_tokens_per_s == 0.0
    with h.lease(500):
        pass  # failed before its first token
    assert h.prefill_tokens_per_s == 0.0
    with h.lease(300), h.lease(200) as second:  # 300 tokens queued ahead of the second
        time.sleep(0.05)
        second.first_token()
    seen = h.observed_prefill_tokens_per_s
    assert 0 < seen <= 500 / 0.05
    assert h.prefill_tokens_per_s == seen < 1e9
    h.set_status(worker_pb2.WorkerStatus(prefill_tokens_per_s=seen / 2))  # slower: as said
    assert h.prefill_tokens_per_s == seen / 2


def test_a_pulled_turn_shows_the_link_not_the_prefill() -> None:
    """A turn that pulled its prefix waited for the pull too: its few computed tokens over
    that wait are no prefill rate, so it measures none (`transferred` measures the link)."""
    h = _handle()
    h.set_status(worker_pb2.WorkerStatus(prefill_tokens_per_s=180.0))
    lease = h.lease(55, pulled=True)  # 1,920 tokens pulled, 55 computed, 2.5 s
    lease.sent_at -= 2.5
    lease.first_token()
    lease.close()
    assert h.observed_prefill_tokens_per_s == 0.0 and h.prefill_tokens_per_s == 0.0
    assert h.in_flight_prompt_tokens == 0


def test_figures_measured_in_this_process_count_as_they_are() -> None:
    """A vLLM server the gateway follows through its adapter in this process reports what
    the adapter timed: no claim to bound, once the gateway has seen a turn there (before,
    it is unmeasured, as any worker). A 14-token turn 0.45 s to its first token does not
    hold it at 31 tokens/s."""
    h = WorkerHandle(WorkerRecord("v", "127.0.0.1:1"), None, None,  # type: ignore[arg-type]
                     measured_here=True)
    h.set_status(worker_pb2.WorkerStatus(prefill_tokens_per_s=180.0, decode_step_s=0.05,
                                         transfer_bytes_per_s=1.7e8))
    assert (h.prefill_tokens_per_s, h.decode_step_s) == (0.0, 0.0)  # a probe alone
    lease = h.lease(14)
    lease.sent_at -= 0.45
    lease.first_token()
    lease.decoded(1)
    lease.close()
    h.observed_decode_step_s = 0.01
    assert h.decode_step_s == 0.05
    assert h.observed_prefill_tokens_per_s == pytest.approx(14 / 0.45, rel=0.05)
    assert h.prefill_tokens_per_s == 180.0 and h.transfer_bytes_per_s == 1.7e8
    remote = _handle()  # a worker's own report is still bounded by what was seen
    remote.set_status(worker_pb2.WorkerStatus(prefill_tokens_per_s=180.0))
    remote.observed_prefill_tokens_per_s = h.observed_prefill_tokens_per_s
    assert remote.prefill_tokens_per_s < 35


def test_a_reported_decode_step_counts_as_at_least_what_the_gateway_saw() -> None:
    """A decode step reported shorter than the time per token the gateway saw in a reply
    counts as what it saw; before any reply it counts as not measured (0)."""
    import time

    h = _handle()
    h.set_status(worker_pb2.WorkerStatus(decode_step_s=1e-9))
    assert h.decode_step_s == 0.0
    with h.lease(10) as lease:
        lease.first_token(3)
        lease.decoded(3)  # all in the first chunk: no pace seen
    assert h.decode_step_s == 0.0
    with h.lease(10) as lease:
        lease.first_token()
        time.sleep(0.04)
        lease.decoded(5)  # 4 tokens after the first in >= 40 ms
    assert h.observed_decode_step_s >= 0.01
    assert h.decode_step_s == h.observed_decode_step_s
    h.set_status(worker_pb2.WorkerStatus(decode_step_s=1.0))  # slower than seen: as said
    assert h.decode_step_s == 1.0


def test_a_reported_transfer_rate_counts_only_up_to_the_pulls_the_gateway_saw() -> None:
    """A worker's transfer rate counts as reported until a pull to or from it has been
    seen (a fleet that never pulled must be able to start), then at most the fastest
    pull seen: bytes over the time to the turn's first token, at both ends of the link."""
    import time

    receiver, holder = _handle(), _handle()
    for h in (receiver, holder):
        h.set_status(worker_pb2.WorkerStatus(transfer_bytes_per_s=1e15))
    assert receiver.transfer_bytes_per_s == holder.transfer_bytes_per_s == 1e15
    with receiver.lease(100) as lease:
        lease.transferred(1 << 20, holder)  # no first token yet: nothing seen
    assert receiver.transfer_bytes_per_s == 1e15
    with receiver.lease(100) as lease:
        time.sleep(0.05)
        lease.first_token()
        lease.transferred(1 << 20, holder)  # 1 MiB before a first token >= 50 ms later
    seen = receiver.observed_transfer_bytes_per_s
    assert 0 < seen <= (1 << 20) / 0.05
    assert receiver.transfer_bytes_per_s == holder.transfer_bytes_per_s == seen
    receiver.set_status(worker_pb2.WorkerStatus(transfer_bytes_per_s=seen / 4))  # slower
    assert receiver.transfer_bytes_per_s == seen / 4


def test_the_seen_transfer_rate_leaves_out_the_prefill_the_turn_waited_for() -> None:
    """A pull into a busy worker: the time to its first token is mostly the prefill queued
    ahead and its own computed tokens, at the worker's prefill rate; only the rest is the
    pull's. A pull that hid wholly behind that prefill measures nothing."""
    import time

    receiver, holder = _handle(), _handle()
    for h in (receiver, holder):
        h.set_status(worker_pb2.WorkerStatus(transfer_bytes_per_s=1e15,
                                             prefill_tokens_per_s=1000.0))
        h.observed_prefill_tokens_per_s = 1000.0
    with receiver.lease(50) as ahead, receiver.lease(10) as lease:  # 50 tokens queued ahead
        assert lease.ahead == 50
        time.sleep(0.1)  # 0.06 s of prefill (50 + 10 tokens at 1000/s), >= 0.04 s of pull
        lease.first_token()
        ahead.first_token()
        lease.transferred(1 << 20, holder, computed_tokens=10)
    seen = receiver.observed_transfer_bytes_per_s
    elapsed = lease.first_at - lease.sent_at
    assert seen == pytest.approx((1 << 20) / (elapsed - 0.06))
    assert seen > (1 << 20) / elapsed  # what the whole time to first token would say
    assert holder.observed_transfer_bytes_per_s == seen
    fresh = _handle()
    fresh.set_status(worker_pb2.WorkerStatus(transfer_bytes_per_s=1e15,
                                             prefill_tokens_per_s=10.0))
    fresh.observed_prefill_tokens_per_s = 10.0
    with fresh.lease(10) as lease:  # 1 s of its own prefill: the pull hid behind it
        lease.first_token()
        lease.transferred(1 << 20, None, computed_tokens=10)
    assert fresh.observed_transfer_bytes_per_s == 0
