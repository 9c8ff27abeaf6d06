"""`prefixgate worker|gateway|chat` as processes with every security flag on (tiny-random,
a real redis-server): TLS and mutual TLS, a token bound to a namespace, the internal
credential, a signed worker registration; a client without a token is turned away."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import redis

from prefixgate.security.auth import hash_token, new_token
from prefixgate.security.identity import new_gateway_key, new_worker_key
from prefixgate.wire.client import ChatClient
from prefixgate.wire.rpc import TLSConfig, free_port
from tests.e2e.test_security import make_pki
from tests.helpers import REPO, cli_env, wait_for

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
    procs = []
    try:
        procs.append(subprocess.Popen(
            [*PG, "worker", "--port", str(worker_port), "--worker-id", "sw0",
             "--num-blocks", "256", "--torch-threads", "1", "--drain-seconds", "1",
             "--tls-cert", internal["server_cert"], "--tls-key", internal["server_key"],
             "--tls-client-ca", internal["ca"],
             "--worker-keyring", str(tmp_path / "worker-keyring")], env=env, cwd=REPO))
        procs.append(subprocess.Popen(
            [*PG, "gateway", "--port", str(gw_port), "--drain-seconds", "1",
             "--tls-cert", public["server_cert"], "--tls-key", public["server_key"],
             "--tokens-file", str(tmp_path / "tokens"),
             "--worker-tls-ca", internal["ca"], "--worker-tls-cert", internal["client_cert"],
             "--worker-tls-key", internal["client_key"],
             "--worker-keyring", str(tmp_path / "gateway-keyring")], env=env, cwd=REPO))
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
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
