"""`prefixgate worker|gateway|chat` as processes with every security flag on (tiny-random,
a real redis-server): TLS and mutual TLS, a token bound to a namespace, the internal
credential, a signed worker registration; a client without a token is turned away."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import redis

from prefixgate.launch.processes import ProcessGroup
from prefixgate.security.auth import hash_token, new_token
from prefixgate.security.identity import new_gateway_key, new_worker_key
from prefixgate.wire.client import ChatClient
from prefixgate.wire.rpc import TLSConfig, free_port
from tests.e2e.test_security import make_pki
from tests.helpers import REPO, cli_env, start_up, wait_for

PG = [sys.executable, "-m", "prefixgate"]


def test_secure_worker_gateway_and_chat(tmp_path, redis_flush) -> None:
    internal, public = make_pki(tmp_path, "internal"), make_pki(tmp_path, "public")
    token = new_token()
    (tmp_path / "tokens").write_text(f"{hash_token(token)} acme\n")
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "internal").write_text(new_token() + "\n")
    private, public_line = new_worker_key("sw0")
    (tmp_path / "worker-keyring").write_text(private + "\n")
    (tmp_path / "gateway-keyring").write_text(f"{public_line}\n{new_gateway_key()}\n")
    env = cli_env(PREFIXGATE_CACHE_DIR=str(tmp_path), PREFIXGATE_MODEL="tiny-random",
                  PREFIXGATE_REDIS_URL=redis_flush, PREFIXGATE_LOG_LEVEL="WARNING",
                  PREFIXGATE_INTERNAL_TOKEN_FILE=str(tmp_path / "internal"))
    gw_port, worker_port = free_port(), free_port()
    procs = ProcessGroup(tmp_path / "logs", env=env, cwd=REPO)
    try:
        procs.start_prefixgate(
            "worker", "worker", "--port", str(worker_port), "--worker-id", "sw0",
            "--num-blocks", "256", "--torch-threads", "1", "--drain-seconds", "1",
            "--tls-cert", internal["server_cert"], "--tls-key", internal["server_key"],
            "--tls-client-ca", internal["ca"],
            "--worker-keyring", str(tmp_path / "worker-keyring"))
        procs.start_prefixgate(
            "gateway", "gateway", "--port", str(gw_port), "--drain-seconds", "1",
            "--tls-cert", public["server_cert"], "--tls-key", public["server_key"],
            "--tokens-file", str(tmp_path / "tokens"),
            "--worker-tls-ca", internal["ca"], "--worker-tls-cert", internal["client_cert"],
            "--worker-tls-key", internal["client_key"],
            "--worker-keyring", str(tmp_path / "gateway-keyring"))
        r = redis.Redis.from_url(redis_flush)
        wait_for(lambda: r.hget("pg:worker:sw0", "sig"), timeout=120,
                 what="the worker to register, signed")
        chat = [*PG, "chat", "--address", f"127.0.0.1:{gw_port}", "--tls-ca", public["ca"],
                "--message", "hello", "--max-tokens", "3", "--timeout", "60"]

        def run(*extra: str) -> str:
            done = subprocess.run([*chat, *extra], env=env, cwd=REPO, capture_output=True,
                                  text=True, timeout=120)
            return done.stdout + done.stderr

        async def workers() -> int:
            client = ChatClient(f"127.0.0.1:{gw_port}", TLSConfig(ca_file=public["ca"]), token)
            try:
                return (await client.list_models()).models[0].num_workers
            except grpc.aio.AioRpcError:
                return 0
            finally:
                await client.close()

        wait_for(lambda: asyncio.run(workers()) == 1, timeout=60,
                 what="the gateway to reach the worker over mutual TLS")
        ok = run("--token-file", str(tmp_path / "token"))
        assert "worker sw0" in ok and "error:" not in ok, ok
        assert "error: UNAUTHENTICATED" in run() and "bearer token" in run()
        other = run("--token-file", str(tmp_path / "token"), "--namespace", "globex")
        assert "error: PERMISSION_DENIED" in other and "bound to namespace 'acme'" in other
    finally:
        procs.stop(timeout_s=20)


def test_up_secure_runs_everything_with_fresh_local_credentials(tmp_path) -> None:
    """`prefixgate up --secure`: the gateway speaks TLS and wants the generated token (gRPC
    and HTTPS), the workers want the gateway's client certificate and the internal
    credential; the printed chat command works as printed."""
    import re
    import ssl

    import httpx

    from prefixgate.v1 import chat_pb2, chat_pb2_grpc, worker_pb2, worker_pb2_grpc

    secure = tmp_path / "secure"
    port, http_port = free_port(), free_port()
    env = cli_env(PREFIXGATE_CACHE_DIR=str(tmp_path / "cache"), PREFIXGATE_LOG_LEVEL="INFO")
    up = start_up(["--model", "tiny-random", "--workers", "1", "--port", str(port),
                   "--http-port", str(http_port), "--secure", "--secure-dir", str(secure),
                   "--torch-threads", "1"], env)
    try:
        assert oct(secure.stat().st_mode & 0o777) == "0o700"
        assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in secure.iterdir())
        (worker,) = re.search(r"workers (\S+)", up.startup_lines[-1]).group(1).split(",")
        ca, token = str(secure / "ca.crt"), (secure / "token").read_text().strip()
        chat = subprocess.run(
            [*PG, "chat", "--address", f"127.0.0.1:{port}", "--tls-ca", ca,
             "--token-file", str(secure / "token"), "--message", "hi", "--max-tokens", "2",
             "--timeout", "60"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert "worker worker-0" in chat.stdout + chat.stderr, chat.stdout + chat.stderr

        async def refused() -> list:
            codes = []
            calls = [ChatClient(f"127.0.0.1:{port}", TLSConfig(ca_file=ca)),  # no token
                     ChatClient(f"127.0.0.1:{port}", TLSConfig(ca_file=ca), "pg_wrong")]
            for client in calls:
                try:
                    await client.list_models()
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
                finally:
                    await client.close()
            return codes

        assert asyncio.run(refused()) == [grpc.StatusCode.UNAUTHENTICATED] * 2
        with grpc.insecure_channel(f"127.0.0.1:{port}") as plain:  # no TLS: no answer
            try:
                chat_pb2_grpc.ChatServiceStub(plain).ListModels(chat_pb2.ListModelsRequest(),
                                                                timeout=5)
                raise AssertionError("the gateway answered in plain text")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
        base, verify = f"https://127.0.0.1:{http_port}/v1/models", ssl.create_default_context(
            cafile=ca)
        assert httpx.get(base, verify=verify, timeout=30).status_code == 401
        assert httpx.get(base, verify=verify, timeout=30,
                         headers={"Authorization": f"Bearer {token}"}).status_code == 200
        # Another local process cannot flush the worker: not without the gateway's client
        # certificate, nor with it but without the internal credential.
        for tls in (TLSConfig(ca_file=ca), TLSConfig(str(secure / "client.crt"),
                                                      str(secure / "client.key"), ca)):
            async def flush(tls=tls):
                from prefixgate.wire import rpc

                async with rpc.channel(worker, tls) as ch:
                    await worker_pb2_grpc.WorkerServiceStub(ch).FlushCache(
                        worker_pb2.FlushCacheRequest(), timeout=10)
            try:
                asyncio.run(flush())
                raise AssertionError("the worker flushed its cache for an unknown caller")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() in (grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.UNAUTHENTICATED), exc
    finally:
        up.terminate()
        up.wait(60)
