"""Worker-to-worker block pulls use the same mutual TLS and internal credential as
gateway calls: a worker with a client certificate of the internal CA and the credential
pulls; one without a client certificate is refused by its peer and computes instead."""

from __future__ import annotations

from pathlib import Path

import grpc

from prefixgate.security.auth import AuthConfig, new_token
from prefixgate.v1 import worker_pb2, worker_pb2_grpc
from prefixgate.wire.rpc import TLSConfig
from tests.e2e.test_security import make_pki
from tests.helpers import start_worker
from tests.worker.test_transfer import _generate


def test_pulls_need_mutual_tls_and_the_internal_credential(loop_thread, tiny_spec, tiny_model,
                                                           tmp_path: Path) -> None:
    pki = make_pki(tmp_path, "internal")
    token = new_token()
    (tmp_path / "internal").write_text(token + "\n")
    auth = AuthConfig(internal_token_file=str(tmp_path / "internal"))
    server_tls = TLSConfig(pki["server_cert"], pki["server_key"], pki["ca"])
    client_tls = TLSConfig(pki["client_cert"], pki["client_key"], pki["ca"])
    started = {}
    for name, peer_tls in (("holder", client_tls), ("puller", client_tls),
                           ("no-cert", TLSConfig(ca_file=pki["ca"]))):
        started[name] = start_worker(loop_thread, tiny_spec, tiny_model, name, worker_config=dict(
            tls=server_tls, auth=auth, peer_tls=peer_tls))
    creds = grpc.ssl_channel_credentials(Path(pki["ca"]).read_bytes(),
                                         Path(pki["client_key"]).read_bytes(),
                                         Path(pki["client_cert"]).read_bytes())
    md = (("authorization", f"Bearer {token}"),)
    channels = {n: grpc.secure_channel(a, creds) for n, (a, _) in started.items()}
    stubs = {n: worker_pb2_grpc.WorkerServiceStub(c) for n, c in channels.items()}
    try:
        prompt = [(i * 11) % 250 + 3 for i in range(130)]
        want, _ = _generate(stubs["holder"], prompt, metadata=md)
        pull = worker_pb2.PullSpec(peer_address=started["holder"][0], num_blocks=8)
        got, final = _generate(stubs["puller"], prompt, pull=pull, metadata=md)
        assert got == want and final.usage.transferred_tokens == 128
        got, final = _generate(stubs["no-cert"], prompt, pull=pull, metadata=md)
        assert got == want and final.usage.transferred_tokens == 0  # refused: computed
    finally:
        for c in channels.values():
            c.close()
        for _, stop in started.values():
            loop_thread.loop.call_soon_threadsafe(stop.set)
