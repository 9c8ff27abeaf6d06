"""prefixgate.security.identity: per-worker Ed25519 keyrings, signed registrations,
bounded sequence numbers, signed lifecycle entries, the held-block set."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.registry.wire import pack_hashes, parent_bytes
from prefixgate.security.identity import (
    MAX_SEQ_AHEAD,
    HeldSet,
    Keyring,
    OwnershipSigner,
    held_set_message,
    new_gateway_key,
    new_worker_key,
    position_refused,
    reap_mac,
    sign_leave,
    sign_registration,
    verify_held_set,
    verify_lifecycle,
    verify_registration,
)
from prefixgate.wire.events import OwnershipEvent

W0_PRIVATE, W0_PUBLIC = new_worker_key("w0")
W1_PRIVATE, W1_PUBLIC = new_worker_key("w1")
GATEWAYS = new_gateway_key()


def test_keyrings_hold_one_key_per_worker_and_refuse_shared_ones() -> None:
    gateway = Keyring.parse(f"# gateways\n{W0_PUBLIC}\n{W1_PUBLIC}  # note\n{GATEWAYS}\n")
    assert len(gateway) == 2 and gateway.gateway_key is not None
    assert gateway.private_key("w0") is None and gateway.public_key("x") is None
    assert gateway.for_gateway("g") is gateway
    worker = Keyring.parse(f"{W0_PRIVATE}\n{W1_PUBLIC}\n")
    assert worker.for_worker("w0", "k") is worker and worker.public_key("w0") is not None
    with pytest.raises(ValueError, match="private key of worker 'w0'"):
        worker.for_gateway("g")
    with pytest.raises(ValueError, match="no 'ed25519-private:' line for worker id 'w1'"):
        worker.for_worker("w1", "k")
    with pytest.raises(ValueError, match="also holds the private key of worker 'w1'"):
        Keyring.parse(f"{W0_PRIVATE}\n{W1_PRIVATE}").for_worker("w0", "k")
    with pytest.raises(ValueError, match="workers must not have it"):
        Keyring.parse(f"{W0_PRIVATE}\n{GATEWAYS}").for_worker("w0", "k")
    # The shared forms of earlier versions: a '*' master, a bare HMAC key per id.
    for text in (f"* {'ab' * 32}", f"w0 {'ab' * 32}", "w0 ed25519:abcd", "w0 ed25519:zz"):
        with pytest.raises(ValueError, match="no longer accepted"):
            Keyring.parse(text)
    for text, match in [("", "no worker keys"), ("w0", "expected"),
                        (f"{W0_PUBLIC}\n{W0_PUBLIC}", "twice"),
                        (f"w0 hmac:{'ab' * 32}", "only the '@gateways'"),
                        (f"{GATEWAYS}\n{GATEWAYS}", "twice")]:
        with pytest.raises(ValueError, match=match):
            Keyring.parse(text)


def test_registration_verifies_only_as_signed_by_that_workers_key() -> None:
    gateway = Keyring.parse(f"{W0_PUBLIC}\n{W1_PUBLIC}")
    k0 = Keyring.parse(W0_PRIVATE).private_key("w0")
    k1 = Keyring.parse(W1_PRIVATE).private_key("w1")
    sig = sign_registration(k0, "w0", "10.0.0.1:50061", "fp", 100)
    assert verify_registration(gateway, "w0", "10.0.0.1:50061", "fp", 100, sig) == ""
    assert "not signed" in verify_registration(gateway, "w0", "10.0.0.1:50061", "fp", 100, "")
    # The same signature for another address (a rogue reusing it) does not verify.
    assert "does not verify" in verify_registration(gateway, "w0", "10.6.6.6:1", "fp", 100, sig)
    assert "not in the gateway's" in verify_registration(gateway, "rogue", "a:1", "fp", 100, sig)
    # Worker w1's key (a rogue holding w1's files) cannot register as w0.
    forged = sign_registration(k1, "w0", "10.6.6.6:1", "fp", 100)
    assert "does not verify" in verify_registration(gateway, "w0", "10.6.6.6:1", "fp", 100,
                                                    forged)
    assert "does not verify" in verify_registration(gateway, "w0", "a:1", "fp", 100, "zz")


def test_sequence_numbers_are_bounded_and_never_replayed() -> None:
    assert position_refused(None, (3, 1)) == ""
    assert position_refused(None, (3, 10**6)) == ""  # a gateway starting late follows on
    assert position_refused((3, 5), (3, 6)) == ""
    assert position_refused((3, 5), (3, 5 + MAX_SEQ_AHEAD)) == ""
    for refused in [(3, 5), (3, 4), (2, 9), (3, 10**12), (3, 0), (4, 10**12), (10**12, 1)]:
        assert position_refused((3, 5), refused), refused
    assert position_refused((3, 5), (4, 1)) == ""  # a new epoch starts again at 1


def test_leave_is_signed_by_the_worker_and_reap_by_a_gateway() -> None:
    gateway = Keyring.parse(f"{W0_PUBLIC}\n{GATEWAYS}")
    k0 = Keyring.parse(W0_PRIVATE).private_key("w0")
    k1 = Keyring.parse(W1_PRIVATE).private_key("w1")
    assert verify_lifecycle(gateway, "leave", "w0", 4, sign_leave(k0, "w0", 4))
    assert not verify_lifecycle(gateway, "leave", "w0", 5, sign_leave(k0, "w0", 4))
    assert not verify_lifecycle(gateway, "leave", "w0", 4, sign_leave(k1, "w0", 4))
    assert not verify_lifecycle(gateway, "leave", "w0", 4, b"")
    assert verify_lifecycle(gateway, "reap", "w0", 4, reap_mac(gateway.gateway_key, "w0", 4))
    assert not verify_lifecycle(gateway, "reap", "w0", 4, reap_mac(b"x" * 32, "w0", 4))
    assert not verify_lifecycle(gateway, "reap", "w0", 4, b"")
    assert not verify_lifecycle(gateway, "join", "w0", 4, sign_leave(k0, "w0", 4))


def _apply(held: dict[int, int | None], ev: OwnershipEvent) -> None:
    """What the registry's Lua does to pg:kv for one event (the model)."""
    if ev.kind == "store":
        parent = ev.parent_hash
        for h in ev.block_hashes:
            held[h] = parent
            parent = h
    elif ev.kind == "remove":
        for h in ev.block_hashes:
            held.pop(h, None)
    else:
        held.clear()


_hashes = st.lists(st.integers(1, 40), min_size=1, max_size=6)
_events = st.one_of(
    st.builds(OwnershipEvent, st.just("store"), _hashes, st.none() | st.integers(1, 40)),
    st.builds(OwnershipEvent, st.just("remove"), _hashes),
    st.just(OwnershipEvent("clear")))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(_events, max_size=4), max_size=8), st.booleans())
def test_signer_tracks_the_set_the_registry_holds(batches, resend) -> None:
    ring = Keyring.parse(W0_PRIVATE)
    signer, held = OwnershipSigner(ring.private_key("w0"), "w0"), {}
    signer.registration("a:1", "fp", 0)
    sig = b""
    for batch in batches:
        wire = [(e.kind.encode(), parent_bytes(e.parent_hash), pack_hashes(e.block_hashes))
                for e in batch]
        bsig, sig = signer.sign(7, batch, wire)
        if resend:  # a batch whose reply was lost is sent again, as the next batch
            again = signer.sign(7, batch, wire)
            assert again[0] != bsig  # another sequence number: not a replay of the first
            sig = again[1]
        for ev in batch:
            _apply(held, ev)
        assert verify_held_set(ring, "w0", 7, signer.seq, held, sig.hex())  # twice: same set
    if batches:
        seq = signer.seq
        # One forged block, another epoch, an older batch or another worker: no match.
        assert not verify_held_set(ring, "w0", 7, seq, {**held, 999: None}, sig.hex())
        assert not verify_held_set(ring, "w0", 8, seq, held, sig.hex())
        assert not verify_held_set(ring, "w0", 7, seq - 1, held, sig.hex())
        other = Keyring.parse(f"w0 {W1_PUBLIC.split()[1]}")
        assert not verify_held_set(other, "w0", 7, seq, held, sig.hex())


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.integers(1, 2**64 - 1), st.none() | st.integers(1, 2**64 - 1),
                       max_size=30))
def test_the_held_set_hash_is_order_free_and_incremental(blocks) -> None:
    held = HeldSet()
    for b, p in reversed(list(blocks.items())):
        held.add(b, p or 0)
    assert held.digest() == HeldSet.of(blocks).digest() and held.count == len(blocks)
    held.add(7, 8)
    held.remove(7, 8)
    assert held.digest() == HeldSet.of(blocks).digest()
    if blocks:
        b, p = next(iter(blocks.items()))
        held.remove(b, p or 0)
        assert held.digest() != HeldSet.of(blocks).digest()
    assert held_set_message("w", 1, 1, held) != held_set_message("w", 1, 2, held)
