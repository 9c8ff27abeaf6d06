"""prefixgate.security.identity: keyrings, signed registrations, the held-block set MAC."""

from __future__ import annotations

import secrets

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.registry.wire import pack_hashes, parent_bytes
from prefixgate.security.identity import (
    Keyring,
    OwnershipSigner,
    kv_set_mac,
    sign_registration,
    verify_registration,
)
from prefixgate.wire.events import OwnershipEvent

KEY = bytes(range(32))


def test_keyring_parses_and_refuses_bad_lines() -> None:
    ring = Keyring.parse(f"# workers\nw0 {KEY.hex()}\nw1 {'ab' * 16}  # note\n")
    assert ring.key("w0") == KEY and ring.key("w1") == b"\xab" * 16 and ring.key("x") is None
    # A master key derives a distinct key per id without a line of its own.
    master = Keyring.parse(f"* {KEY.hex()}\nw0 {'cd' * 16}")
    assert master.key("w0") == b"\xcd" * 16
    assert len({master.key("w1"), master.key("w2"), KEY}) == 3
    for text, match in [("", "no keys"), ("w0", "expected"), ("w0 zz" + "0" * 40, "hex"),
                        ("w0 abcd", "at least 32"), (f"w0 {KEY.hex()}\nw0 {KEY.hex()}", "twice")]:
        with pytest.raises(ValueError, match=match):
            Keyring.parse(text)


def test_registration_verifies_only_as_signed() -> None:
    ring = Keyring({"w0": KEY})
    sig = sign_registration(KEY, "w0", "10.0.0.1:50061", "fp", 100)
    assert verify_registration(ring, "w0", "10.0.0.1:50061", "fp", 100, sig) == ""
    assert "not signed" in verify_registration(ring, "w0", "10.0.0.1:50061", "fp", 100, "")
    # The same signature for another address (a rogue reusing it) does not verify.
    assert "does not verify" in verify_registration(ring, "w0", "10.6.6.6:1", "fp", 100, sig)
    assert "not in the gateway's" in verify_registration(ring, "rogue", "a:1", "fp", 100, sig)


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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(_events, max_size=4), max_size=8), st.booleans())
def test_signer_tracks_the_set_the_registry_holds(batches, resend) -> None:
    signer, held = OwnershipSigner(KEY, "w0"), {}
    signer.registration("a:1", "fp", 0)
    for batch in batches:
        wire = [(e.kind.encode(), parent_bytes(e.parent_hash), pack_hashes(e.block_hashes))
                for e in batch]
        bmac, mac = signer.sign(7, batch, wire)
        if resend:  # a batch whose reply was lost is sent again, as the next batch
            again = signer.sign(7, batch, wire)
            assert again[0] != bmac  # another sequence number: not a replay of the first
            mac = again[1]
        for ev in batch:
            _apply(held, ev)
        assert mac == kv_set_mac(KEY, "w0", 7, signer.seq, held)  # applied twice: same set
    # One forged block, another epoch, an older batch or another key: no longer matches.
    seq = signer.seq
    assert kv_set_mac(KEY, "w0", 7, seq, {**held, 999: None}) != mac if batches else True
    if batches:
        assert kv_set_mac(KEY, "w0", 8, seq, held) != mac
        assert kv_set_mac(KEY, "w0", 7, seq - 1, held) != mac
        assert kv_set_mac(secrets.token_bytes(32), "w0", 7, seq, held) != mac
