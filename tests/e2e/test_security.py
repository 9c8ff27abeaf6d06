"""The trust model over real gRPC on loopback (tiny-random): bearer tokens bound to
namespaces, the workers' internal credential, TLS and mutual TLS with certificates made
here (a CA, a server certificate for 127.0.0.1, client certificates)."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixgate.security.auth import AuthConfig, hash_token, new_token
from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from prefixgate.wire.rpc import TLSConfig, free_port
from tests.helpers import start_gateway, start_worker, wait_for

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402


def _write_pair(directory: Path, name: str, cert, key) -> tuple[str, str]:
    cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def _certificate(subject: str, issuer_name, issuer_key, key, *, ca: bool = False):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name or
                            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def make_pki(directory: Path, name: str) -> dict[str, str]:
    """A CA and, signed by it, a server certificate (127.0.0.1, localhost) and a client
    certificate: {"ca", "server_cert", "server_key", "client_cert", "client_key"}."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate(f"{name} CA", None, None, ca_key, ca=True)
    ca_file, _ = _write_pair(directory, f"{name}-ca", ca, ca_key)
    out = {"ca": ca_file}
    for role in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(f"{name} {role}", ca.subject, ca_key, key)
        out[f"{role}_cert"], out[f"{role}_key"] = _write_pair(directory, f"{name}-{role}",
                                                              cert, key)
    return out


ACME, GLOBEX = new_token(), new_token()
INTERNAL = new_token()


@pytest.fixture(scope="module")
def secure(loop_thread, tiny_spec, tiny_model, tmp_path_factory):
    """One worker with TLS, mutual TLS (only clients with a certificate of the internal
    CA) and the internal credential; a gateway with TLS and tokens for two tenants."""
    d = tmp_path_factory.mktemp("pki")
    internal, public = make_pki(d, "internal"), make_pki(d, "public")
    (d / "tokens").write_text(f"{hash_token(ACME)} acme\n{hash_token(GLOBEX)} globex\n")
    (d / "internal").write_text(INTERNAL + "\n")
    health_port = free_port()
    w0, stop0 = start_worker(loop_thread, tiny_spec, tiny_model, "w0", worker_config=dict(
        health_port=health_port,
        tls=TLSConfig(internal["server_cert"], internal["server_key"], internal["ca"]),
        auth=AuthConfig(internal_token_file=str(d / "internal"))))
    gw, gstop = start_gateway(
        loop_thread, tiny_spec, [w0],
        tls=TLSConfig(public["server_cert"], public["server_key"]),
        worker_tls=TLSConfig(internal["client_cert"], internal["client_key"], internal["ca"]),
        auth=AuthConfig(tokens_file=str(d / "tokens"),
                        internal_token_file=str(d / "internal")))
    public_creds = grpc.ssl_channel_credentials(Path(public["ca"]).read_bytes())
    channel = grpc.secure_channel(gw, public_creds)
    stub = chat_pb2_grpc.ChatServiceStub(channel)
    wait_for(lambda: _models(stub, ACME).models[0].num_workers == 1,
             what="the gateway to reach its worker over mutual TLS")
    yield {"gateway": gw, "worker": w0, "stub": stub, "internal": internal, "public": public,
           "health_port": health_port}
    channel.close()
    for stop in (gstop, stop0):
        loop_thread.loop.call_soon_threadsafe(stop.set)


def _md(token: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {token}"),)


def _models(stub, token: str) -> chat_pb2.ListModelsResponse:
    return stub.ListModels(chat_pb2.ListModelsRequest(), metadata=_md(token), timeout=10)


def _turn(stub, token: str | None, ids: list[int], namespace: str = "") -> common_pb2.Usage:
    req = chat_pb2.ChatRequest(namespace=namespace,
                               sampling=common_pb2.SamplingParams(max_tokens=2))
    req.prompt_token_ids.token_ids.extend(ids)
    events = list(stub.Chat(req, metadata=_md(token) if token else None, timeout=60))
    return events[-1].final.usage


def test_a_tenant_cannot_read_or_probe_another_tenants_cache(secure) -> None:
    stub, ids = secure["stub"], list(range(20, 100))
    _turn(stub, ACME, ids)
    assert _turn(stub, ACME, ids + [7]).cached_tokens >= len(ids) - 1  # acme's own cache
    # The same prompt from globex: its own namespace, nothing of acme's is visible.
    assert _turn(stub, GLOBEX, ids + [7]).cached_tokens == 0
    # Claiming acme's namespace is refused, saying which one the token has.
    with pytest.raises(grpc.RpcError) as err:
        _turn(stub, GLOBEX, ids + [7], namespace="acme")
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "bound to namespace 'globex'" in err.value.details()
    # Naming its own namespace explicitly is the same as naming none.
    assert _turn(stub, ACME, ids + [7], namespace="acme").cached_tokens >= len(ids) - 1


@pytest.mark.parametrize("token, needle", [(None, "requires a bearer token"),
                                           ("pg_wrong", "not valid here")])
def test_calls_without_a_valid_token_are_unauthenticated(secure, token, needle) -> None:
    for call in (lambda: _turn(secure["stub"], token, [1, 2, 3]),
                 lambda: _models(secure["stub"], token) if token else
                 secure["stub"].ListModels(chat_pb2.ListModelsRequest(), timeout=10)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert needle in err.value.details()


def _worker_channel(secure, with_client_cert: bool) -> grpc.Channel:
    internal = secure["internal"]
    ca = Path(internal["ca"]).read_bytes()
    if with_client_cert:
        creds = grpc.ssl_channel_credentials(ca, Path(internal["client_key"]).read_bytes(),
                                             Path(internal["client_cert"]).read_bytes())
    else:
        creds = grpc.ssl_channel_credentials(ca)
    return grpc.secure_channel(secure["worker"], creds)


def test_worker_calls_need_the_internal_credential(secure) -> None:
    with _worker_channel(secure, with_client_cert=True) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        calls = {
            "Generate": lambda md: list(stub.Generate(worker_pb2.GenerateRequest(
                prompt_token_ids=[1, 2, 3]), metadata=md, timeout=10)),
            "FlushCache": lambda md: stub.FlushCache(worker_pb2.FlushCacheRequest(),
                                                     metadata=md, timeout=10),
            "WatchEvents": lambda md: next(iter(stub.WatchEvents(
                worker_pb2.WatchEventsRequest(), metadata=md, timeout=10))),
            "GetStatus": lambda md: stub.GetStatus(worker_pb2.GetStatusRequest(),
                                                   metadata=md, timeout=10),
        }
        for name, call in calls.items():
            for md, needle in ((None, "requires the internal credential"),
                               (_md(ACME), "wrong internal credential")):
                with pytest.raises(grpc.RpcError) as err:
                    call(md)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
                assert needle in err.value.details(), name
        assert stub.GetStatus(worker_pb2.GetStatusRequest(), metadata=_md(INTERNAL),
                              timeout=10).kv_capacity_tokens > 0
        # Probes stay open: the standard health service needs no credential.
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_mutual_tls_refuses_clients_without_a_certificate(secure) -> None:
    with _worker_channel(secure, with_client_cert=False) as channel:
        with pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.WorkerServiceStub(channel).GetInfo(
                worker_pb2.GetInfoRequest(), metadata=_md(INTERNAL), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_plain_text_clients_cannot_talk_to_a_tls_gateway(secure) -> None:
    with grpc.insecure_channel(secure["gateway"]) as channel:
        with pytest.raises(grpc.RpcError) as err:
            _models(chat_pb2_grpc.ChatServiceStub(channel), ACME)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_chat_client_speaks_tls_with_a_token(secure, loop_thread) -> None:
    from prefixgate.wire.client import ChatClient

    async def turn() -> tuple[str, int]:
        client = ChatClient(secure["gateway"], TLSConfig(ca_file=secure["public"]["ca"]),
                            token=ACME)
        try:
            result = await client.turn(prompt_token_ids=[5, 6, 7, 8],
                                       sampling=common_pb2.SamplingParams(max_tokens=3),
                                       timeout_s=60)
            return result.worker_id, result.completion_tokens
        finally:
            await client.close()

    assert loop_thread.run(turn()) == ("w0", 3)


def test_the_health_port_answers_probes_in_plain_text(secure) -> None:
    """Kubernetes' gRPC probes cannot speak TLS: --health-port serves only the health
    service, in plain text, with the same statuses."""
    with grpc.insecure_channel(f"127.0.0.1:{secure['health_port']}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="prefixgate.v1.WorkerService"), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:  # and nothing else
            worker_pb2_grpc.WorkerServiceStub(channel).GetInfo(
                worker_pb2.GetInfoRequest(), metadata=_md(INTERNAL), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
