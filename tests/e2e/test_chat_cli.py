"""`prefixgate chat` as a process against a real gateway process serving TLS (gRPC and its
OpenAI-compatible HTTPS front, tiny-random, no worker reachable): a client that was not
given the CA is told the gateway speaks TLS and to pass --tls-ca, not that nothing answers;
a turn that fails makes chat exit non-zero; no HTTP client log line lands in a reply."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from prefixgate.launch.processes import ProcessGroup
from prefixgate.wire.rpc import free_port
from tests.e2e.test_security import make_pki
from tests.helpers import REPO, cli_env, run_side_by_side, wait_for

PG = [sys.executable, "-m", "prefixgate", "chat"]


def _listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def tls_gateway(tmp_path_factory: pytest.TempPathFactory):
    """(gRPC port, HTTP port, the CA of the gateway's certificate)."""
    tmp = tmp_path_factory.mktemp("chat")
    pki = make_pki(tmp, "public")
    port, http_port = free_port(), free_port()
    procs = ProcessGroup(tmp / "logs", env=cli_env(PREFIXGATE_CACHE_DIR=str(tmp)), cwd=REPO)
    procs.start_prefixgate(
        "gateway", "gateway", "--model", "tiny-random", "--worker", f"127.0.0.1:{free_port()}",
        "--port", str(port), "--http-port", str(http_port), "--drain-seconds", "1",
        "--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"])
    try:
        wait_for(lambda: procs.check_alive() or (_listens(port) and _listens(http_port)),
                 timeout=120, what="the gateway to listen")
        yield port, http_port, pki["ca"]
    finally:
        procs.stop(timeout_s=20)


def _chats(*arg_lists: list[str]) -> list[subprocess.CompletedProcess]:
    """`prefixgate chat ARGS --message hi` for each ARGS, side by side (a client that gets
    no answer waits its 10 s for the gateway before it says why: the waits overlap)."""
    return run_side_by_side([[*PG, *args, "--message", "hi", "--max-tokens", "2",
                              "--timeout", "30"] for args in arg_lists],
                            env=cli_env(), cwd=REPO)


def test_a_tls_gateway_without_its_ca_is_named_as_tls(tls_gateway) -> None:
    port, http_port, _ = tls_gateway
    cases = [(["--address", f"127.0.0.1:{port}"], "pass the gateway's CA"),
             (["--http", f"https://127.0.0.1:{http_port}/v1"], "pass the gateway's CA"),
             (["--http", f"http://127.0.0.1:{http_port}/v1"], "use an https:// URL")]
    for r, (_, says) in zip(_chats(*(args for args, _ in cases)), cases, strict=True):
        assert r.returncode != 0 and "speaks TLS" in r.stderr and "--tls-ca" in r.stderr \
            and says in r.stderr, r.stderr
        assert "no gateway answers" not in r.stderr


def test_a_failed_turn_exits_non_zero_and_no_http_log_lands_in_the_reply(tls_gateway) -> None:
    port, http_port, ca = tls_gateway
    for r in _chats(["--address", f"127.0.0.1:{port}", "--tls-ca", ca],
                    ["--http", f"https://127.0.0.1:{http_port}/v1", "--tls-ca", ca]):
        assert r.returncode == 1 and "error:" in r.stdout, r.stdout + r.stderr
        assert "HTTP Request" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_request_choices_show_no_empty_choice() -> None:
    out = subprocess.run([*PG, "--help"], capture_output=True, text=True, check=True,
                         env=cli_env(), timeout=60).stdout
    assert "{fail,keep-system-drop-oldest}" in out and "{recompute,shift,blend}" in out, out
    assert "{," not in out and ",}" not in out
