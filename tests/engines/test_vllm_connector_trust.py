"""Trust on vLLM's transfer path under `prefixgate up --secure --engine vllm`, on real parts
without a vLLM server: the credentials `up` gives each server's connector (launch/vllm.py,
security/local.py), the tickets the gateway signs for the servers it follows (its pool,
gateway/pulls.py, the adapter's pull parameters), and the connector's real ExportBlocks
server (vllm_connector/export.py) over real gRPC on loopback checking them."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import grpc
import pytest
import torch

from prefixgate.engines.vllm import VLLMConfig, VLLMWorker
from prefixgate.gateway.config import GatewayConfig
from prefixgate.gateway.policies.base import Pull
from prefixgate.gateway.pool import WorkerPool
from prefixgate.gateway.pulls import attach
from prefixgate.gateway.routing import Decision
from prefixgate.gateway.server import _local_ticket_signer
from prefixgate.launch.processes import ProcessGroup
from prefixgate.launch.vllm import VLLMFleet, VLLMLaunch, VLLMServer
from prefixgate.model.tokenizer import ChatTokenizer
from prefixgate.radix import Hashers
from prefixgate.registry import EmbeddedRegistry, WorkerRecord
from prefixgate.security.auth import AuthConfig
from prefixgate.security.local import (
    LocalCredentials,
    issue_worker,
    make_local_credentials,
    tls_name,
)
from prefixgate.v1 import worker_pb2, worker_pb2_grpc
from prefixgate.vllm_connector.export import (
    ExportServer,
    ExportTLS,
    pull_chain,
    ticket_keys_of,
)
from prefixgate.vllm_connector.store import HostStore, Page
from prefixgate.workerapi.client import InProcessWorkerClient
from prefixgate.workerapi.server import WorkerConfig
from prefixgate.workerapi.transfer import KVFormat, TransferError

LAYERS, HEADS, DIM, B = 2, 3, 4, 16


def _page(seed: int, fingerprint: str) -> Page:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, B, HEADS, DIM, generator=g)
    return Page(fingerprint, B, k, k + 1000)


def _secure_fleet(tmp_path: Path, n: int = 2) -> tuple[LocalCredentials, list[VLLMServer],
                                                       list[list[str]]]:
    """`up --secure --engine vllm`'s servers as its fleet starts them (the processes not
    run: their command lines recorded)."""
    creds = make_local_credentials(tmp_path / "secure", ["worker-0"])
    fleet = VLLMFleet(VLLMLaunch("/venv/bin/python", tmp_path, "m", credentials=creds),
                      ProcessGroup(tmp_path))
    argvs: list[list[str]] = []
    fleet.group.start = lambda name, argv, env=None: argvs.append(list(argv))
    return creds, fleet.start(n), argvs


def _connector_extra(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]


def _export_of(server: VLLMServer, store: HostStore) -> ExportServer:
    """The server's export as its connector starts it (connector.py register_kv_caches):
    its worker id, the keys of the keyring its --kv-transfer-config names."""
    return ExportServer(store, server.worker_id, server.host, server.export_port,
                        (LAYERS, HEADS, DIM, "float32"),
                        ticket_keys=ticket_keys_of(str(server.files.keyring), server.worker_id))


def test_up_secure_gives_each_vllm_connector_a_keyring_of_its_own(tmp_path: Path) -> None:
    """Each server's connector gets a keyring file of its own (its worker id's private
    key and the gateways' `@tickets` key), 0600 in the 0700 credentials directory, named
    by path: no key on any command line."""
    creds, servers, argvs = _secure_fleet(tmp_path)
    assert creds.directory.stat().st_mode & 0o077 == 0
    keyrings = set()
    for server, argv in zip(servers, argvs, strict=True):
        extra = _connector_extra(argv)
        assert extra["worker_id"] == server.worker_id
        assert extra["keyring"] == str(server.files.keyring)
        keyrings.add(extra["keyring"])
        path = Path(extra["keyring"])
        assert path.parent == creds.directory and path.stat().st_mode & 0o777 == 0o600
        text = path.read_text()
        assert text.count("ed25519-private:") == 1 and "@tickets ed25519:" in text
        keys = {word.split(":", 1)[1] for word in text.split() if ":" in word
                and word.startswith("ed25519")}
        assert not [a for a in argv for k in keys if k in a]  # never on the command line
        assert len(ticket_keys_of(extra["keyring"], server.worker_id)) == 2
    assert len(keyrings) == 2  # one each: a server's key signs as that server only


def test_the_gateway_signs_pulls_between_the_vllm_servers_it_follows_and_only_those_pass(
        tmp_path: Path, tiny_spec) -> None:
    """The whole ticket path of `up --secure --engine vllm`, its parts real: the gateway's
    pool gives the servers it follows in its process the signer of its keyring (the same
    directory's gateway.keyring), a routed pull carries a ticket naming receiver, holder
    and chain (gateway/pulls.py), the receiver's adapter passes it on unchanged in the
    connector's parameters, and the holder's export (as its connector starts it, with its
    own keyring) serves it over gRPC. A pull with no ticket, one signed by another
    gateway (another `up --secure`'s directory), or one made out for another holder or
    another chain is PERMISSION_DENIED, saying why, and no page leaves."""
    creds, (holder, receiver), _ = _secure_fleet(tmp_path)
    signer = _local_ticket_signer(GatewayConfig(
        auth=AuthConfig(worker_keyring_file=str(creds.gateway_keyring))))
    assert signer is not None
    bs = 16
    tokens = [(i * 7) % 200 + 3 for i in range(8 * bs + 5)]
    chain = Hashers(bs, tiny_spec.fingerprint).get("ns").hash_blocks(tokens)
    assert len(chain) == 8
    store = HostStore(64 << 20)
    for i, h in enumerate(chain[:6]):  # the holder computed 6 of the prompt's blocks
        store.put(h, _page(i, tiny_spec.fingerprint))
    export = _export_of(holder, store)
    export.start()

    async def route() -> worker_pb2.GenerateRequest:
        tokenizer = ChatTokenizer(tiny_spec)
        adapters = {s.worker_id: VLLMWorker(tiny_spec, tokenizer, WorkerConfig(
            s.worker_id, block_size=bs), VLLMConfig.parse(s.worker_spec))
            for s in (holder, receiver)}
        for w in adapters.values():  # as start_local_workers links them
            w.peers = {v.config.worker_id: v.vllm.export for v in adapters.values()}
        registry = EmbeddedRegistry()
        local = {}
        for w in adapters.values():
            await registry.register(WorkerRecord(w.vllm.address, w.vllm.address), lease_ms=2**62)
            local[w.vllm.address] = InProcessWorkerClient(w)
        pool = WorkerPool(registry, tiny_spec.fingerprint, connect_timeout_s=0.2, local=local,
                          local_tickets=signer)
        try:
            await pool.refresh()  # the servers are not running: listed, down
            handles = {}
            for h in pool.workers.values():
                assert h.tickets is signer
                wid = next(a for a in adapters.values() if a.vllm.address == h.record.address
                           ).config.worker_id
                h.info = worker_pb2.WorkerInfo(worker_id=wid, block_size=bs,  # GetInfo's
                                               model_fingerprint=tiny_spec.fingerprint)
                handles[wid] = h
            gen = worker_pb2.GenerateRequest(request_id="r", namespace="ns",
                                             prompt_token_ids=tokens)
            decision = Decision([handles[receiver.worker_id]], "prefix",
                                pulls={receiver.worker_id: Pull(holder.worker_id, 8, 8 * bs, 0.1)})
            charge = attach(gen, decision, handles[receiver.worker_id], list(handles.values()),
                            block_hashes=chain)
            charge.release()
            params = adapters[receiver.worker_id]._pull_params(gen, chain)
            assert params is not None and params.pull is not None
            assert params.pull.peer == f"127.0.0.1:{holder.export_port}"
            assert params.pull.ticket == gen.pull.ticket != b""
            return gen
        finally:
            await pool.close()
            for w in adapters.values():
                await w.close()

    fmt = KVFormat(tiny_spec.fingerprint, B, "float32", LAYERS, HEADS, DIM)
    got: list[int] = []

    def on_chunk(first: int, n: int, k: bytes, v: bytes) -> None:
        got.extend(range(first, first + n))

    peer = f"127.0.0.1:{holder.export_port}"
    try:
        gen = asyncio.run(route())
        ticket = gen.pull.ticket
        # As the receiver's connector pulls: the whole ticketed chain, cut at max_blocks.
        assert pull_chain(peer, chain[:8], 0, ticket, fmt, on_chunk, 10, max_blocks=8) == 6
        assert got == list(range(6))
        other = make_local_credentials(tmp_path / "other", ["worker-0"])
        stranger = _local_ticket_signer(GatewayConfig(
            auth=AuthConfig(worker_keyring_file=str(other.gateway_keyring))))
        refused = {  # what the refusal says -> (chain asked for, ticket)
            "signed by a gateway": (chain, b""),
            "signature does not verify": (chain, stranger.sign(
                receiver.worker_id, holder.worker_id, "ns", chain)),
            "for holder": (chain, signer.sign(receiver.worker_id, receiver.worker_id, "ns",
                                              chain)),
            "another chain": (chain[:5], ticket),
        }
        got.clear()
        for why, (asked, bad) in refused.items():
            with pytest.raises(TransferError) as exc:
                pull_chain(peer, asked, 0, bad, fmt, on_chunk, 10)
            assert exc.value.code == grpc.StatusCode.PERMISSION_DENIED, why
            assert why in str(exc.value)
        assert got == []
    finally:
        export.stop()


def test_the_credentials_directory_holds_each_servers_files_private(tmp_path: Path) -> None:
    """What `issue_worker` writes: 0600 files in the 0700 directory, the server's public
    key added to the gateway's keyring (gateways verify what it signs)."""
    creds, servers, _ = _secure_fleet(tmp_path, 1)
    (server,) = servers
    ring = creds.gateway_keyring.read_text()
    assert f"{server.worker_id} ed25519:" in ring
    for path in (server.files.keyring, server.files.cert, server.files.key):
        assert path.parent == creds.directory
        assert os.stat(path).st_mode & 0o777 == 0o600


def _pull_all(peer: str, chain, ticket: bytes, tls: ExportTLS | None, peer_worker_id: str,
              fingerprint: str, got: list[int]) -> int:
    fmt = KVFormat(fingerprint, B, "float32", LAYERS, HEADS, DIM)
    return pull_chain(peer, chain, 0, ticket, fmt,
                      lambda first, n, k, v: got.extend(range(first, first + n)), 10,
                      tls=tls, peer_worker_id=peer_worker_id)


def test_the_export_is_served_over_mutual_tls_and_a_ticket_only_to_the_receiver_it_names(
        tmp_path: Path) -> None:
    """`up --secure`'s connectors: the export listens on loopback, over mutual TLS with
    the server's own certificate (`grpcs://` in the gateway's form). A receiver pulling
    with its own certificate and the gateway's ticket is served; the same ticket shown by
    another server (its certificate names another worker) is PERMISSION_DENIED, saying
    so; a caller without a certificate from the CA (plain text, none, another
    `up --secure`'s) does not connect at all; and a puller that expects another worker at
    that address (the holder's certificate names the holder) does not send its ticket."""
    creds, (holder, receiver, third), argvs = _secure_fleet(tmp_path, 3)
    for server, argv in zip((holder, receiver, third), argvs, strict=True):
        extra = _connector_extra(argv)
        assert extra["export_host"] == "127.0.0.1"  # loopback, never every interface
        assert (extra["tls_cert"], extra["tls_key"], extra["tls_ca"]) == (
            str(server.files.cert), str(server.files.key), str(creds.ca))
        assert server.worker_spec.endswith(f",grpcs://127.0.0.1:{server.export_port}")
    signer = _local_ticket_signer(GatewayConfig(
        auth=AuthConfig(worker_keyring_file=str(creds.gateway_keyring))))
    chain = list(range(300, 306))
    store = HostStore(64 << 20)
    for i, h in enumerate(chain):
        store.put(h, _page(i, "fp"))
    files = holder.files
    export = ExportServer(store, holder.worker_id, "127.0.0.1", holder.export_port,
                          (LAYERS, HEADS, DIM, "float32"),
                          ticket_keys=ticket_keys_of(str(files.keyring), holder.worker_id),
                          tls=ExportTLS.of(str(files.cert), str(files.key), str(files.ca)))
    export.start()
    peer = f"127.0.0.1:{holder.export_port}"

    def tls_of(server: VLLMServer) -> ExportTLS:
        f = server.files
        return ExportTLS.of(str(f.cert), str(f.key), str(f.ca))

    ticket = signer.sign(receiver.worker_id, holder.worker_id, "ns", chain)
    got: list[int] = []
    try:
        assert _pull_all(peer, chain, ticket, tls_of(receiver), holder.worker_id, "fp",
                         got) == 6
        assert got == list(range(6))
        got.clear()
        with pytest.raises(TransferError) as copied:  # the ticket, shown by another worker
            _pull_all(peer, chain, ticket, tls_of(third), holder.worker_id, "fp", got)
        assert copied.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert f"for worker {receiver.worker_id!r}" in str(copied.value)
        with pytest.raises(TransferError) as plain:
            _pull_all(peer, chain, ticket, None, "", "fp", got)
        assert plain.value.code == grpc.StatusCode.UNAVAILABLE
        other = make_local_credentials(tmp_path / "other", ["worker-0"])
        stranger = issue_worker(other, receiver.worker_id)  # same name, another CA
        with pytest.raises(TransferError) as foreign:
            _pull_all(peer, chain, ticket, ExportTLS.of(
                str(stranger.cert), str(stranger.key), str(creds.ca)), holder.worker_id,
                "fp", got)
        assert foreign.value.code == grpc.StatusCode.UNAVAILABLE
        ca_only = grpc.secure_channel(peer, grpc.ssl_channel_credentials(creds.ca.read_bytes()),
                                      options=[("grpc.ssl_target_name_override",
                                                tls_name(holder.worker_id))])
        with ca_only, pytest.raises(grpc.RpcError) as anonymous:
            ca_only.unary_unary("/prefixgate.v1.WorkerService/GetStatus")(b"", timeout=5)
        assert anonymous.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(TransferError) as impostor:  # expects `third` at that address
            _pull_all(peer, chain, ticket, tls_of(receiver), third.worker_id, "fp", got)
        assert impostor.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(TransferError) as unnamed:
            _pull_all(peer, chain, ticket, tls_of(receiver), "", "fp", got)
        assert unnamed.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert got == []  # not a page left but for the receiver's pull
        with pytest.raises(ValueError, match="tls_key"):
            ExportTLS.of(str(files.cert), "", str(files.ca))
        with pytest.raises(ValueError, match="tls_ca"):
            ExportTLS.of(str(files.cert), str(files.key), str(tmp_path / "missing.crt"))
    finally:
        export.stop()


def test_the_gateways_adapter_reaches_a_tls_export_with_its_client_certificate(
        tmp_path: Path, tiny_spec) -> None:
    """The adapter the gateway follows a server with calls its export (GetStatus: the
    link the connector measured) over TLS with the gateway's worker TLS files (`up
    --secure`'s client certificate), checking the server's certificate against its
    worker id; without a client certificate the export refuses the connection."""
    from prefixgate.wire.rpc import TLSConfig

    creds, (holder,), _ = _secure_fleet(tmp_path, 1)
    files = holder.files
    export = ExportServer(HostStore(1 << 20), holder.worker_id, "127.0.0.1", holder.export_port,
                          (LAYERS, HEADS, DIM, "float32"),
                          tls=ExportTLS.of(str(files.cert), str(files.key), str(files.ca)))
    export.link.observe(50_000_000, 0.1)
    export.start()

    async def status(client_tls: TLSConfig) -> worker_pb2.WorkerStatus:
        cfg = VLLMConfig.parse(holder.worker_spec, export_client_tls=client_tls)
        assert cfg.export_tls and cfg.export == f"127.0.0.1:{holder.export_port}"
        w = VLLMWorker(tiny_spec, ChatTokenizer(tiny_spec), WorkerConfig(holder.worker_id), cfg)
        try:
            stub = worker_pb2_grpc.WorkerServiceStub(w._export())
            return await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
        finally:
            await w.close()

    try:
        gateway_tls = TLSConfig(str(creds.client_cert), str(creds.client_key), str(creds.ca))
        assert asyncio.run(status(gateway_tls)).transfer_bytes_per_s > 0
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(status(TLSConfig(ca_file=str(creds.ca))))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        export.stop()


def test_overflow_asks_its_own_ticket_checking_export_with_a_ticket_of_its_own(
        tmp_path: Path) -> None:
    """Context overflow on a server whose export checks tickets (`up --secure`): vLLM's
    scheduler asks its own export what the host store holds of each earlier layout of
    the conversation (the store lives in vLLM's worker process) with a ticket it signs
    for itself with its own key, over its own TLS (`StoreProbe`, as connector.py makes
    it), so the kept turns are claimed and moved instead of computed. Unticketed, the
    export refuses the ask (nothing would be claimed); another server's self-signed ask
    is refused too; a keyring without the server's own key cannot ask at all."""
    from prefixgate.vllm_connector.export import StoreProbe
    from prefixgate.vllm_connector.params import ShiftParams
    from prefixgate.vllm_connector.shift import choose_layout

    creds, (server, other), _ = _secure_fleet(tmp_path, 2)
    f = server.files
    tls = ExportTLS.of(str(f.cert), str(f.key), str(f.ca))
    layout = list(range(500, 510))  # the conversation's previous prompt, 10 blocks
    store = HostStore(64 << 20)
    for i, h in enumerate(layout[:8]):  # what vLLM computed of it here
        store.put(h, _page(i, "fp"))
    export = ExportServer(store, server.worker_id, "127.0.0.1", server.export_port,
                          (LAYERS, HEADS, DIM, "float32"),
                          ticket_keys=ticket_keys_of(str(f.keyring), server.worker_id), tls=tls)
    export.start()
    address = f"127.0.0.1:{server.export_port}"
    probes = []
    try:
        own = StoreProbe(address, server.worker_id, tls, str(f.keyring))
        probes.append(own)
        assert own.usable and own.held(layout, 5) == 8
        # The scheduler's claim: the new prompt's kept run (2 preamble blocks kept, 2
        # blocks' worth of the oldest turns dropped: delta 32) as far as the held layout
        # reaches once moved back, in whole blocks of 16.
        shift = ShiftParams(n_keep=2 * B, layouts=((2 * B, tuple(layout)),))
        best = choose_layout(lambda chain: range(own.held(chain, 5) or 0), shift, B, 10 * B)
        assert best is not None and best[0] == 8 * B - 2 * B
        unticketed = StoreProbe(address, server.worker_id, tls)
        probes.append(unticketed)
        assert unticketed.usable and unticketed.held(layout, 5) is None  # refused
        g = other.files
        stranger = StoreProbe(address, other.worker_id,
                              ExportTLS.of(str(g.cert), str(g.key), str(g.ca)), str(g.keyring))
        probes.append(stranger)
        assert stranger.held(layout, 5) is None  # its certificate is not the holder's
        foreign = tmp_path / "foreign.keyring"  # the `@tickets` line, another server's key
        foreign.write_text("\n".join(line for line in g.keyring.read_text().splitlines()))
        assert not StoreProbe(address, server.worker_id, tls, str(foreign)).usable
    finally:
        for p in probes:
            p.close()
        export.stop()


def _listeners(port: int) -> set:
    """The local addresses listening on TCP `port` (/proc/net/tcp and tcp6; an IPv4 one
    mapped into IPv6 as its IPv4 address)."""
    import ipaddress

    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state != "0A" or int(local.rsplit(":", 1)[1], 16) != port:
                    continue
                raw = bytes.fromhex(local.rsplit(":", 1)[0])  # 32-bit words, host order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                ip = ipaddress.ip_address(words)
                found.add(getattr(ip, "ipv4_mapped", None) or ip)
    return found


@pytest.mark.integration
def test_up_secure_engine_vllm_moves_kv_only_with_the_gateways_ticket_over_tls(
        smollm2_spec, tmp_path: Path) -> None:
    """`prefixgate up --secure --engine vllm --workers 2` with real vLLM servers: each
    connector's export listens on loopback only, its keyring and certificate named by
    path in its private credentials directory (no key on a command line). On the holder's
    real export, a caller in plain text, without a ticket or with a ticket another
    gateway signed is refused; the up's gateway key's ticket, shown with the receiver's
    certificate, is served. Through the receiver's own connector inside vLLM: a pull with
    a foreign ticket loads nothing (the reply is computed, greedy-equal), one with the
    gateway's ticket loads the prompt over TLS and its greedy reply equals the holder's."""
    import random
    import re
    import shutil
    import threading
    import time
    import urllib.request

    from prefixgate.security.identity import Keyring
    from prefixgate.vllm_connector.export import export_channel, held_blocks
    from prefixgate.vllm_connector.params import PullParams, ShiftParams, TransferParams
    from tests.e2e.test_up_vllm import _servers, stop_up
    from tests.engines.vllm_server import vllm_python
    from tests.helpers import cli_env, start_up

    secure = tmp_path / "secure"
    env = cli_env(PREFIXGATE_VLLM_PYTHON=vllm_python(), PREFIXGATE_LOG_LEVEL="INFO")
    proc = start_up(["--secure", "--secure-dir", str(secure), "--engine", "vllm",
                     "--workers", "2", "--model", "smollm2-135m", "--port", "0",
                     "--http-port", "-1", "--vllm-kv-cache-mib", "512"], env, timeout_s=900)
    threading.Thread(target=shutil.copyfileobj,
                     args=(proc.stdout, (tmp_path / "up.log").open("w")), daemon=True).start()
    servers = _servers(proc.pid)
    try:
        logdir = Path(re.search(r"their logs: (\S+)", "".join(proc.startup_lines)).group(1))
        found = {}
        for port, pid in sorted(servers.items()):
            argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
            extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])[
                "kv_connector_extra_config"]
            environ = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes()
                           .decode(errors="replace").split("\0") if "=" in kv)
            api_key = environ["VLLM_API_KEY"]
            for name in ("keyring", "tls_cert", "tls_key", "tls_ca"):
                assert Path(extra[name]).parent == secure
            private = Path(extra["keyring"]).read_text().split()[1]
            assert not [a for a in argv if api_key in a or private.split(":")[1] in a]
            assert extra["export_host"] == "127.0.0.1"
            listening = _listeners(extra["export_port"])
            assert listening and all(a.is_loopback for a in listening), listening
            found[port] = (extra, api_key)
        (h_port, (holder, h_key)), (r_port, (receiver, r_key)) = sorted(found.items())

        def complete(port: int, key: str, body: dict) -> dict:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                json.dumps({"model": "smollm2-135m", "max_tokens": 8, "temperature": 0,
                            **body}).encode(),
                {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(req, timeout=600) as resp:
                return json.load(resp)

        rnd = random.Random(5)
        ids = [rnd.randrange(200, 20000) for _ in range(20 * 16 + 5)]
        fp = smollm2_spec.fingerprint
        chain = Hashers(16, fp).get("default").hash_blocks(ids)
        reference = complete(h_port, h_key, {"prompt": ids, "kv_transfer_params":
                                             TransferParams(16, fp, tuple(chain)).to_json()})
        gateway = Keyring.from_file(secure / "gateway.keyring").ticket_signer()
        other = make_local_credentials(tmp_path / "other", ["worker-0"])
        stranger = Keyring.from_file(other.gateway_keyring).ticket_signer()
        h_id, r_id = holder["worker_id"], receiver["worker_id"]
        ticket = gateway.sign(r_id, h_id, "default", chain)
        forged = stranger.sign(r_id, h_id, "default", chain)
        h_export = f"127.0.0.1:{holder['export_port']}"

        # The holder's real export, called as the receiver's connector calls it.
        r_tls = ExportTLS.of(receiver["tls_cert"], receiver["tls_key"], receiver["tls_ca"])
        fmt = KVFormat(fp, 16, "float32", 30, 3, 64)
        for tls, bad, code in ((None, ticket, grpc.StatusCode.UNAVAILABLE),
                               (r_tls, b"", grpc.StatusCode.PERMISSION_DENIED),
                               (r_tls, forged, grpc.StatusCode.PERMISSION_DENIED)):
            with pytest.raises(TransferError) as refused:
                pull_chain(h_export, chain, 0, bad, fmt, lambda *a: None, 30, tls=tls,
                           peer_worker_id=h_id)
            assert refused.value.code == code, refused.value
        with export_channel(h_export, r_tls, h_id) as channel:
            deadline = time.monotonic() + 30  # the holder keeps blocks after its step
            while held_blocks(channel, chain, 10, ticket) != len(chain):
                assert time.monotonic() < deadline, "the holder's export never held the prompt"
                time.sleep(0.5)

        # Through the receiver's connector inside vLLM.
        def pull_body(t: bytes) -> dict:
            return {"prompt": ids, "kv_transfer_params": TransferParams(
                16, fp, tuple(chain), PullParams(h_export, h_id, len(chain), t)).to_json()}

        def load_lines() -> list[str]:
            return [ln for f in sorted(logdir.glob("vllm-*.log"))
                    for ln in f.read_text(errors="replace").splitlines()
                    if "prefixgate connector:" in ln and f"from {h_export}" in ln]

        computed = complete(r_port, r_key, {**pull_body(forged), "cache_salt": "refused"})
        assert computed["choices"][0]["text"] == reference["choices"][0]["text"]
        deadline = time.monotonic() + 20
        while not load_lines() and time.monotonic() < deadline:
            time.sleep(0.5)
        (refused_load,) = load_lines()
        assert "loaded 0 of 320 tokens" in refused_load, refused_load
        assert "signature does not verify" in refused_load, refused_load
        pulled = complete(r_port, r_key, pull_body(ticket))
        assert pulled["choices"][0]["text"] == reference["choices"][0]["text"]
        deadline = time.monotonic() + 20
        while len(load_lines()) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        loaded = load_lines()[1]
        assert "loaded 320 of 320 tokens" in loaded and loaded.rstrip().endswith("s)"), loaded
        assert pulled["usage"]["prompt_tokens_details"]["cached_tokens"] >= 320

        # Context overflow on the holder, whose export checks tickets: the conversation's
        # oldest 64 tokens after a 32-token preamble dropped, the kept run's KV (the
        # prompt above, in its host store) moved back by 64 positions. Its scheduler asks
        # its own export with a ticket it signs itself, over its TLS, and claims them.
        kept = ids[:32] + ids[96:] + [rnd.randrange(200, 20000) for _ in range(40)]
        shift = ShiftParams(n_keep=32, layouts=((64, tuple(chain)),))
        shifted = complete(h_port, h_key, {
            "prompt": kept, "cache_salt": "shifted",  # nothing from vLLM's own cache
            "kv_transfer_params": TransferParams(16, fp, tuple(
                Hashers(16, fp).get("shifted").hash_blocks(kept)), shift=shift).to_json()})
        deadline = time.monotonic() + 20
        moves: list[str] = []
        while not moves and time.monotonic() < deadline:
            moves = [ln for f in sorted(logdir.glob("vllm-*.log"))
                     for ln in f.read_text(errors="replace").splitlines()
                     if "prefixgate connector:" in ln and "back by 64 positions" in ln]
            time.sleep(0.5)
        (moved,) = moves
        assert "moved 256 of 256 tokens" in moved and moved.rstrip().endswith("s)"), moved
        assert shifted["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    finally:
        stop_up(proc, servers)
