"""deploy/secrets.sh: the Secrets it makes work with prefixgate as the manifests use them
(tokens, keyring, internal credential; TLS and mutual TLS with its certificates, under the
names pods are reached by)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixgate.security.auth import InternalCredential, TokenStore
from prefixgate.security.identity import Keyring
from prefixgate.wire import rpc
from tests.helpers import REPO

NAMESPACE = "pg-test"


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    out = tmp_path_factory.mktemp("secrets")
    run = subprocess.run(["bash", str(REPO / "deploy" / "secrets.sh"), "-n", NAMESPACE,
                          "--dir", str(out)], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "TENANT": "acme"})
    assert run.returncode == 0, run.stderr
    return out, run.stdout.strip()


def test_credentials_load_and_bind_the_first_token(secrets) -> None:
    out, token = secrets
    tokens = TokenStore.from_file(out / "prefixgate-auth" / "tokens")
    assert tokens.authenticate(f"Bearer {token}").namespace == "acme"
    assert token not in (out / "prefixgate-auth" / "tokens").read_text()
    InternalCredential.from_file(out / "prefixgate-auth" / "internal-token")
    # Gateways: every worker's public key and the gateways' key, no private key. Each
    # worker: its own private key only, matching the public one gateways hold.
    gateways = Keyring.from_file(out / "prefixgate-auth" / "worker-keyring").for_gateway("g")
    assert gateways.gateway_key is not None
    keys = sorted((out / "prefixgate-worker-keys").glob("*.keyring"))
    assert [k.stem for k in keys] == sorted(f"prefixgate-worker-{i}" for i in range(16))
    raw = set()
    for k in keys:
        own = Keyring.from_file(k).for_worker(k.stem, str(k))
        raw.add(own.private_key(k.stem).private_bytes_raw())
        assert (own.public_key(k.stem).public_bytes_raw()
                == gateways.public_key(k.stem).public_bytes_raw())
    assert len(raw) == 16
    # Every role's Redis password is its own.
    passwords = {p.read_text() for p in (out / "prefixgate-redis").iterdir()}
    assert len(passwords) == 3


async def _health_over_tls(server_tls: rpc.TLSConfig, client_tls: rpc.TLSConfig,
                           name: str) -> int:
    server = grpc.aio.server()
    servicer = rpc.add_health_and_reflection(server, [])
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = rpc.bind(server, "127.0.0.1", 0, server_tls, "test")
    await server.start()
    try:
        channel = grpc.aio.secure_channel(
            f"127.0.0.1:{port}", rpc.channel_credentials(client_tls),
            options=[("grpc.ssl_target_name_override", name)])
        async with channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
            return reply.status
    finally:
        await server.stop(0)


def test_mutual_tls_between_gateway_and_worker_pods(secrets) -> None:
    d, keys = secrets[0] / "prefixgate-internal-tls", secrets[0] / "prefixgate-worker-keys"
    worker = rpc.TLSConfig(str(keys / "prefixgate-worker-3.crt"),
                           str(keys / "prefixgate-worker-3.key"), str(d / "ca.crt"))
    gateway = rpc.TLSConfig(str(d / "gateway.crt"), str(d / "gateway.key"), str(d / "ca.crt"))
    pod = f"prefixgate-worker-3.prefixgate-worker.{NAMESPACE}.svc.cluster.local"
    assert asyncio.run(_health_over_tls(worker, gateway, pod)) == \
        health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError):  # worker-3's files cannot pass for worker-0
        asyncio.run(_health_over_tls(worker, gateway, pod.replace("-3.", "-0.", 1)))
    with pytest.raises(grpc.aio.AioRpcError):  # no client certificate: refused
        asyncio.run(_health_over_tls(worker, rpc.TLSConfig(ca_file=str(d / "ca.crt")), pod))
    with pytest.raises(grpc.aio.AioRpcError):  # the worker certificate names only worker pods
        asyncio.run(_health_over_tls(worker, gateway, "redis.example"))


def test_clients_verify_the_gateway_certificate(secrets) -> None:
    d = secrets[0] / "prefixgate-tls"
    server = rpc.TLSConfig(str(d / "tls.crt"), str(d / "tls.key"))
    client = rpc.TLSConfig(ca_file=str(d / "ca.crt"))
    for name in ("prefixgate-gateway", f"prefixgate-gateway.{NAMESPACE}.svc.cluster.local",
                 "localhost"):
        assert asyncio.run(_health_over_tls(server, client, name)) == \
            health_pb2.HealthCheckResponse.SERVING


def test_a_relative_dir_is_the_callers_and_the_load_lines_keep_each_type(tmp_path) -> None:
    """`--dir out` writes under the caller's working directory (not the script's scratch
    folder, which it deletes), holding the hash of the token it prints, and says how to
    load each folder as its Secret (prefixgate-tls as kubernetes.io/tls)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    run = subprocess.run(["bash", str(REPO / "deploy" / "secrets.sh"), "--dir", "out",
                          "--workers", "1"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    out = tmp_path / "out"
    tokens = TokenStore.from_file(out / "prefixgate-auth" / "tokens")
    assert tokens.authenticate(f"Bearer {run.stdout.strip()}").namespace == "default"
    assert oct(out.stat().st_mode & 0o777) == "0o700"
    assert (f"kubectl -n prefixgate create secret generic prefixgate-tls "
            f"--type=kubernetes.io/tls --from-file={out}/prefixgate-tls") in run.stderr
    for name in ("prefixgate-redis", "prefixgate-internal-tls", "prefixgate-auth",
                 "prefixgate-worker-keys"):
        assert f"create secret generic {name} --type=Opaque --from-file={out}/{name}" \
            in run.stderr, run.stderr
