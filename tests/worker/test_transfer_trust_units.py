"""The torch-free trust contracts of block transfer against simple models: page digests
(security/kv_pages.py) and pull tickets (security/tickets.py)."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixgate.security.auth import PermissionDenied
from prefixgate.security.kv_pages import block_digest, chunk_digests, verify_chunk
from prefixgate.security.tickets import TicketSigner, check_ticket, ticket_key


def _chunk(blocks: list[tuple[bytes, bytes]], num_layers: int) -> tuple[bytes, bytes]:
    """The wire layout of a chunk made of one-block chunks: per layer, each block's run."""
    def join(i: int) -> bytes:
        per = len(blocks[0][i]) // num_layers
        return b"".join(b[i][layer * per:(layer + 1) * per]
                        for layer in range(num_layers) for b in blocks)
    return join(0), join(1)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 8), st.data())
def test_chunk_digests_are_each_blocks_own(num_layers, num_blocks, run, data) -> None:
    size = num_layers * run
    blocks = [(data.draw(st.binary(min_size=size, max_size=size)),
               data.draw(st.binary(min_size=size, max_size=size))) for _ in range(num_blocks)]
    k, v = _chunk(blocks, num_layers)
    want = [block_digest(bk, bv, num_layers) for bk, bv in blocks]
    assert chunk_digests(k, v, num_blocks, num_layers) == want
    # The model: SHA-256 over the domain, then K's layer runs, then V's.
    assert want[0] == hashlib.sha256(b"pg-kv-block1" + blocks[0][0] + blocks[0][1]).digest()
    assert verify_chunk(k, v, want, num_blocks, num_layers, True) == (num_blocks, "")
    bad = data.draw(st.integers(0, num_blocks - 1))
    byte = data.draw(st.integers(0, size - 1))
    corrupt = list(blocks)
    corrupt[bad] = (blocks[bad][0], bytes(x ^ (i == byte) for i, x in enumerate(blocks[bad][1])))
    ok, why = verify_chunk(*_chunk(corrupt, num_layers), want, num_blocks, num_layers, False)
    assert ok == bad and why
    assert verify_chunk(k, v, [], num_blocks, num_layers, False) == (num_blocks, "")
    assert verify_chunk(k, v, [], num_blocks, num_layers, True)[0] == 0


def test_tickets_bind_receiver_holder_chain_expiry_and_key() -> None:
    key = ticket_key(b"g" * 32)
    signer = TicketSigner(key, ttl_s=60)
    chain = [11, 22, 33]
    t = signer.sign("r", "h", "ns", chain, now=1000.0)
    ok = check_ticket(t, [key.public_key()], "h", chain, {"r", "r.svc"}, now=1059.0)
    assert (ok.receiver, ok.holder, ok.namespace, ok.num_blocks) == ("r", "h", "ns", 3)
    assert check_ticket(t, [key.public_key()], "h", chain, (), now=1000.0)  # no names known
    refusals = [
        (t, "h", chain, {"r"}, 1061.0),  # expired
        (t, "other", chain, {"r"}, 1000.0),  # another holder
        (t, "h", chain[:2], {"r"}, 1000.0),  # another chain
        (t, "h", [11, 22, 34], {"r"}, 1000.0),
        (t, "h", chain, {"someone"}, 1000.0),  # another receiver's certificate
        (b"", "h", chain, {"r"}, 1000.0),
        (t[:-1] + bytes([t[-1] ^ 1]), "h", chain, {"r"}, 1000.0),  # signature
        (t.replace(b"ns", b"nt"), "h", chain, {"r"}, 1000.0),  # a field changed
        (b"pgt1garbage", "h", chain, {"r"}, 1000.0),
    ]
    for ticket, holder, ch, names, now in refusals:
        with pytest.raises(PermissionDenied):
            check_ticket(ticket, [key.public_key()], holder, ch, names, now=now)
    other = ticket_key(b"x" * 32)
    with pytest.raises(PermissionDenied):
        check_ticket(t, [other.public_key()], "h", chain, {"r"}, now=1000.0)
    assert check_ticket(t, [other.public_key(), key.public_key()], "h", chain, {"r"},
                        now=1000.0)
