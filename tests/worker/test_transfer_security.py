"""Trust in block transfer, over real gRPC on loopback (tiny-random workers):

- peers are called over TLS with the certificate checked against the worker id the pull
  names, and no credential reaches a peer that fails that check (nor one in plain text
  while the worker's own API is secured);
- ExportBlocks needs a pull ticket for that chain, holder and receiver; the peer
  credential is good for block pulls only, and workers may hold just the hash of the
  gateways' internal credential;
- pages that do not match the digests their holder recorded are never committed: the
  turn computes them and answers as a clean run does.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from prefixgate.security.auth import AuthConfig, hash_token, new_token
from prefixgate.security.identity import Keyring, new_gateway_key, new_worker_key
from prefixgate.security.local import _certificate
from prefixgate.security.tickets import TicketSigner, ticket_key, ticket_public_line
from prefixgate.v1 import worker_pb2, worker_pb2_grpc
from prefixgate.wire.rpc import TLSConfig
from tests.helpers import start_worker
from tests.worker.test_transfer import _generate, _service_engine

PROMPT = [(i * 11) % 250 + 3 for i in range(130)]  # 8 full blocks and 2 tokens


def make_worker_pki(directory: Path, worker_ids) -> dict:
    """A CA and one certificate per worker id, naming it (as deploy/secrets.sh makes
    them): {"ca": path, id: TLSConfig(cert, key, ca)} (server and client alike)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("test CA", ca_key, None, None, None)
    out: dict = {"ca": str(directory / "ca.crt")}
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for wid in worker_ids:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(wid, key, ca, ca_key, [ExtendedKeyUsageOID.SERVER_AUTH,
                                                   ExtendedKeyUsageOID.CLIENT_AUTH], [wid])
        (directory / f"{wid}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{wid}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        out[wid] = TLSConfig(str(directory / f"{wid}.crt"), str(directory / f"{wid}.key"),
                             out["ca"])
    return out


class Recorder(grpc.GenericRpcHandler):
    """A server that answers nothing and records the metadata of every call it gets."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    def service(self, details):
        with self.lock:
            self.calls.append((details.method, dict(details.invocation_metadata)))
        return None


def _recorder(tls: TLSConfig | None) -> tuple[str, Recorder, grpc.Server]:
    rec = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((rec,))
    if tls is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
            [(Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())]))
    server.start()
    return f"127.0.0.1:{port}", rec, server


def _secure_stub(address: str, tls: TLSConfig, name: str):
    creds = grpc.ssl_channel_credentials(Path(tls.ca_file).read_bytes(),
                                         Path(tls.key_file).read_bytes(),
                                         Path(tls.cert_file).read_bytes())
    channel = grpc.secure_channel(address, creds,
                                  options=[("grpc.ssl_target_name_override", name)])
    return channel, worker_pb2_grpc.WorkerServiceStub(channel)


def test_peers_are_called_over_tls_checked_against_their_worker_id(
        loop_thread, tiny_spec, tiny_model, tmp_path: Path) -> None:
    pki = make_worker_pki(tmp_path, ["holder", "puller", "plain", "rogue"])
    token = new_token()
    (tmp_path / "internal").write_text(token + "\n")
    auth = AuthConfig(internal_token_file=str(tmp_path / "internal"))
    md = (("authorization", f"Bearer {token}"),)
    started = {}
    for name, peer_tls in (("holder", pki["holder"]), ("puller", pki["puller"]),
                           ("plain", TLSConfig())):  # secured, but no peer TLS
        started[name] = start_worker(loop_thread, tiny_spec, tiny_model, name, worker_config=dict(
            tls=pki[name], auth=auth, peer_tls=peer_tls))
    rogue_tls, rogue_rec, rogue = _recorder(pki["rogue"])  # a valid certificate, not holder's
    plain_addr, plain_rec, plain = _recorder(None)
    stubs = {n: _secure_stub(a, pki[n], n) for n, (a, _) in started.items()}
    try:
        want, _ = _generate(stubs["holder"][1], PROMPT, metadata=md)
        holder_addr = started["holder"][0]

        def pull(worker, address, peer_id):
            spec = worker_pb2.PullSpec(peer_address=address, peer_worker_id=peer_id,
                                       num_blocks=8)
            got, final = _generate(stubs[worker][1], PROMPT, pull=spec, metadata=md)
            assert got == want
            stubs[worker][1].FlushCache(worker_pb2.FlushCacheRequest(), metadata=md)
            return final.usage.transferred_tokens
        assert pull("puller", holder_addr, "holder") == 128
        # The holder's certificate does not name "plain-holder": refused before any call.
        assert pull("puller", holder_addr, "someone-else") == 0
        # A server with a valid certificate of the same CA, for another worker id, at the
        # address a pull names for "holder": the handshake fails, nothing is sent.
        assert pull("puller", rogue_tls, "holder") == 0
        # A pull with no worker id to check the certificate against is not made.
        assert pull("puller", holder_addr, "") == 0
        # A secured worker without peer TLS never calls a peer in plain text.
        assert pull("plain", plain_addr, "holder") == 0
        time.sleep(0.2)
        assert rogue_rec.calls == [] and plain_rec.calls == []
    finally:
        rogue.stop(0)
        plain.stop(0)
        for c, _ in stubs.values():
            c.close()
        for _, stop in started.values():
            loop_thread.loop.call_soon_threadsafe(stop.set)


@pytest.fixture
def ticketed(loop_thread, tiny_spec, tiny_model, tmp_path: Path):
    """Holder and puller whose keyrings have the gateways' ticket key; their internal
    credential file holds only its hash; they call each other with the peer credential."""
    pki = make_worker_pki(tmp_path, ["holder", "puller", "client", "leaving"])
    internal, peer = new_token(), new_token()
    (tmp_path / "internal.sha256").write_text(hash_token(internal) + "\n")
    (tmp_path / "peer").write_text(peer + "\n")
    gateways = new_gateway_key()
    gateway_key = bytes.fromhex(gateways.split(":", 1)[1])
    started = {}

    def config(name: str) -> dict:
        private, _ = new_worker_key(name)
        ring = tmp_path / f"{name}.keyring"
        ring.write_text(f"{private}\n{ticket_public_line(gateway_key)}\n")
        Keyring.from_file(ring).for_worker(name, str(ring))  # a worker's keyring, as checked
        return dict(tls=pki[name], peer_tls=pki[name], auth=AuthConfig(
            internal_token_file=str(tmp_path / "internal.sha256"),
            peer_token_file=str(tmp_path / "peer"), worker_keyring_file=str(ring)))
    for name in ("holder", "puller"):
        started[name] = start_worker(loop_thread, tiny_spec, tiny_model, name,
                                     worker_config=config(name))
    channels = {n: _secure_stub(a, pki["client"], n) for n, (a, _) in started.items()}
    yield dict(started=started, stubs={n: s for n, (_, s) in channels.items()},
               internal=(("authorization", f"Bearer {internal}"),),
               peer=(("authorization", f"Bearer {peer}"),),
               signer=TicketSigner(ticket_key(gateway_key)), config=config, pki=pki)
    for c, _ in channels.values():
        c.close()
    for _, stop in started.values():
        loop_thread.loop.call_soon_threadsafe(stop.set)


def test_exports_need_a_ticket_for_that_chain_holder_and_receiver(ticketed) -> None:
    stubs, md, signer = ticketed["stubs"], ticketed["internal"], ticketed["signer"]
    holder_addr = ticketed["started"]["holder"][0]
    want, _ = _generate(stubs["holder"], PROMPT, metadata=md)
    chain = _service_engine(stubs["puller"], md).transfer.chain(PROMPT[:128], "")

    def pull(ticket: bytes) -> int:
        spec = worker_pb2.PullSpec(peer_address=holder_addr, peer_worker_id="holder",
                                   num_blocks=8, ticket=ticket)
        got, final = _generate(stubs["puller"], PROMPT, pull=spec, metadata=md)
        assert got == want
        stubs["puller"].FlushCache(worker_pb2.FlushCacheRequest(), metadata=md)
        return final.usage.transferred_tokens
    assert pull(b"") == 0  # no ticket: PERMISSION_DENIED, computed
    assert pull(signer.sign("someone", "holder", "", chain)) == 0  # another receiver
    assert pull(signer.sign("puller", "other", "", chain)) == 0  # another holder
    assert pull(signer.sign("puller", "holder", "", chain[:7])) == 0  # another chain
    assert pull(signer.sign("puller", "holder", "", chain, now=time.time() - 600)) == 0
    forged = TicketSigner(ticket_key(b"\x01" * 32))  # not the gateways' key
    assert pull(forged.sign("puller", "holder", "", chain)) == 0
    assert pull(signer.sign("puller", "holder", "", chain)) == 128


def test_the_peer_credential_is_good_for_block_pulls_only(ticketed) -> None:
    stubs, peer, signer = ticketed["stubs"], ticketed["peer"], ticketed["signer"]
    holder = stubs["holder"]
    _generate(holder, PROMPT, metadata=ticketed["internal"])  # gateways' credential: served
    chain = _service_engine(holder, ticketed["internal"]).transfer.chain(PROMPT[:128], "")
    for call in (lambda: _generate(holder, PROMPT, metadata=peer),
                 lambda: holder.FlushCache(worker_pb2.FlushCacheRequest(), metadata=peer),
                 lambda: next(iter(holder.WatchEvents(worker_pb2.WatchEventsRequest(),
                                                      metadata=peer, timeout=5))),
                 # A peer may not make a worker pull from a third worker.
                 lambda: holder.PullBlocks(worker_pb2.PullBlocksRequest(
                     peer_address=ticketed["started"]["puller"][0], peer_worker_id="puller",
                     block_hashes=chain), metadata=peer, timeout=30),
                 # ExportBlocks itself needs a ticket.
                 lambda: list(holder.ExportBlocks(worker_pb2.ExportBlocksRequest(
                     block_hashes=chain), metadata=peer, timeout=30))):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
    # The internal credential's token itself is not in the worker's files: its hash
    # checks it. A ticketed export with the peer credential streams the pages.
    events = list(holder.ExportBlocks(worker_pb2.ExportBlocksRequest(
        block_hashes=chain, ticket=signer.sign("client", "holder", "", chain)),
        metadata=peer, timeout=30))
    assert events[0].header.num_blocks == 8
    assert sum(e.chunk.num_blocks for e in events[1:]) == 8
    assert all(len(e.chunk.block_digests) == e.chunk.num_blocks for e in events[1:])
    with pytest.raises(grpc.RpcError) as err:
        _generate(holder, PROMPT, metadata=(("authorization", "Bearer " + new_token()),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_lying_holders_pages_are_refused_and_the_turn_computes(workers) -> None:
    """A holder whose export sends other pages than the ones it computed (a rogue
    process answering for it, a corrupted pool): the receiver commits only the blocks
    whose pages match the digests recorded when they were computed; the turn computes
    the rest and answers as a clean run does."""
    holder_addr, _, _, holder = workers("liar")
    _, _, _, puller = workers("liar's puller")
    _, _, _, reference = workers("clean", enable_prefix_cache=False)
    want, _ = _generate(reference, PROMPT)
    _generate(holder, PROMPT)
    transfer = _service_engine(holder).transfer
    honest = transfer.read

    def lying(pin, start, count, bad_from):
        k, v = honest(pin, start, count)
        if start + count <= bad_from:
            return k, v
        v = bytearray(v)  # the last layer's last value of each block from bad_from on
        per_layer = len(v) // transfer.format.num_layers
        run = per_layer // count
        for j in range(max(0, bad_from - start), count):
            v[(transfer.format.num_layers - 1) * per_layer + (j + 1) * run - 1] ^= 0x40
        return k, bytes(v)
    pull = worker_pb2.PullSpec(peer_address=holder_addr, peer_worker_id="liar", num_blocks=8)
    for bad_from, kept in ((0, 0), (3, 3)):
        transfer.read = lambda pin, s, c, b=bad_from: lying(pin, s, c, b)
        got, final = _generate(puller, PROMPT, pull=pull)
        assert got == want
        assert final.usage.transferred_tokens == kept * 16
        # Nothing of the lie is cached: the next turn finds only the verified blocks and
        # what the turn computed itself (the prompt's own full blocks, computed right).
        engine = _service_engine(puller)
        chain = engine.transfer.chain(PROMPT[:128], "")
        assert engine.on_engine_thread(
            lambda e=engine, c=chain: e.cache.tree.match(c, touch=False).num_blocks) == 8
        again, _ = _generate(puller, PROMPT)
        assert again == want
        puller.FlushCache(worker_pb2.FlushCacheRequest())
    transfer.read = honest
    _, final = _generate(puller, PROMPT, pull=pull)
    assert final.usage.transferred_tokens == 128


@pytest.fixture
def workers(loop_thread, tiny_spec, tiny_model):
    from tests.worker.test_transfer import _workers

    start, stop_all = _workers(loop_thread, tiny_spec, tiny_model)
    yield start
    stop_all()


def test_the_gateways_planned_pull_carries_a_ticket_the_holder_accepts(ticketed,
                                                                      tiny_spec) -> None:
    """gateway/pulls.attach signs the ticket where the gateway plans the pull (with the
    gateways' key, from its keyring's '@gateways' line): the planned turn is served on
    pulled blocks; the same turn planned by a gateway that signs no tickets computes."""
    from prefixgate.gateway.pool import WorkerHandle
    from prefixgate.gateway.pulls import attach
    from prefixgate.gateway.routing import Decision, Pull
    from prefixgate.radix import BlockHasher
    from prefixgate.registry import WorkerRecord
    from prefixgate.wire.token_ids import pack

    stubs, md, started = ticketed["stubs"], ticketed["internal"], ticketed["started"]
    want, _ = _generate(stubs["holder"], PROMPT, metadata=md)

    def handle(wid: str, signer) -> WorkerHandle:
        return WorkerHandle(WorkerRecord(wid, started[wid][0], tiny_spec.fingerprint), None,
                            info=worker_pb2.WorkerInfo(
                                worker_id=wid, block_size=16,
                                model_fingerprint=tiny_spec.fingerprint), tickets=signer)
    decision = Decision(ranked=[], policy="prefix",
                        pulls={"puller": Pull("holder", 8, 128, 0.01)})
    hashes = BlockHasher(16, model_fingerprint=tiny_spec.fingerprint).hash_blocks(PROMPT)
    for signer, block_hashes, transferred in ((ticketed["signer"], None, 128),
                                              (ticketed["signer"], hashes, 128),
                                              (None, None, 0)):
        holder, puller = handle("holder", signer), handle("puller", signer)
        gen = worker_pb2.GenerateRequest(
            request_id="r", packed_prompt_token_ids=pack(PROMPT).tobytes(),
            sampling=worker_pb2.GenerateRequest().sampling)
        gen.sampling.max_tokens, gen.sampling.temperature = 12, 0.0
        charge = attach(gen, decision, puller, [holder, puller], block_hashes)
        charge.release()
        assert bool(gen.pull.ticket) == (signer is not None)
        got, final = [], None
        for ev in stubs["puller"].Generate(gen, timeout=60, metadata=md):
            if ev.HasField("chunk"):
                got += ev.chunk.token_ids
            else:
                final = ev.final
        assert got == want and final.usage.transferred_tokens == transferred
        stubs["puller"].FlushCache(worker_pb2.FlushCacheRequest(), metadata=md)


def test_a_secured_drain_hands_off_with_tickets_it_signs_itself(loop_thread, tiny_spec,
                                                                tiny_model, ticketed) -> None:
    """The drain hand-off under the same trust: the leaving worker asks its peer (peer
    credential, TLS checked against the peer's id) to pull its own chain, with a ticket
    it signs itself; the conversation's next turn hits it on the peer."""
    import asyncio

    from tests.worker.test_transfer import start_leaving

    port, stop, done = start_leaving(loop_thread, tiny_spec, tiny_model,
                                     ticketed["config"]("leaving"),
                                     [("puller", ticketed["started"]["puller"][0])])
    channel, leaving = _secure_stub(f"127.0.0.1:{port}", ticketed["pki"]["client"], "leaving")
    md = ticketed["internal"]
    _generate(leaving, PROMPT, metadata=md)
    loop_thread.loop.call_soon_threadsafe(stop.set)
    loop_thread.run(asyncio.wait_for(asyncio.shield(done), 30))
    channel.close()
    _, final = _generate(ticketed["stubs"]["puller"], PROMPT + [1, 2, 3], metadata=md)
    assert final.usage.cached_tokens >= 128
