"""gateway/processes.py: a busy port is refused before anything binds (SO_REUSEPORT would
otherwise let a second gateway join the first one's port), processes spawned onto the
caller's port join it, and a child that exits after listening is reported by the parent."""

from __future__ import annotations

import logging
import socket
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest

from prefixgate.gateway import processes
from prefixgate.gateway.server import GatewayConfig
from prefixgate.wire.rpc import BindError


@dataclass(frozen=True)
class Startup:
    """What `spawn` hands each child (as gateway/startup.py's GatewayStartup)."""

    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0


def listen_reuseport() -> socket.socket:
    """A listener as every gateway process opens it (SO_REUSEPORT)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_port_another_gateway_listens_on_is_refused() -> None:
    with listen_reuseport() as other:
        port = other.getsockname()[1]
        # What the gateway would do without the probe: join silently.
        with socket.socket() as joiner:
            joiner.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            joiner.bind(("127.0.0.1", port))
        with pytest.raises(BindError, match=f"cannot listen on 127.0.0.1:{port}.*another server"):
            processes.refuse_busy_port("127.0.0.1", port)
        with pytest.raises(BindError):
            processes.refuse_busy_port("0.0.0.0", port)
    processes.refuse_busy_port("127.0.0.1", port)  # free again
    processes.refuse_busy_port("127.0.0.1", 0)  # the caller picks a free one


def test_a_grpc_server_port_is_refused() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(BindError):
            processes.refuse_busy_port("127.0.0.1", port)
    finally:
        server.stop(0)


@pytest.mark.parametrize("which", ["port", "http_port", "health_port"])
def test_every_shared_port_is_checked(which) -> None:
    with listen_reuseport() as other:
        config = GatewayConfig(**{"host": "127.0.0.1", "port": 0, "http_port": -1,
                                  "health_port": 0, which: other.getsockname()[1]})
        with pytest.raises(BindError, match=str(other.getsockname()[1])):
            processes.refuse_busy_ports(config)
    processes.refuse_busy_ports(config)


def test_spawn_joins_a_port_the_caller_already_listens_on() -> None:
    # `prefixgate up` binds process 0 first, then spawns the others onto its port.
    parent = listen_reuseport()
    port = parent.getsockname()[1]
    children = processes.spawn(_listen, Startup(port=port), 1)
    try:
        processes.wait_ready(children, timeout_s=60)
        assert all(c.process.is_alive() for c in children)
        parent.close()  # the caller's listener gone, the port still answers: the child's
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass
    finally:
        parent.close()
        processes.stop(children, 5)


def _listen(startup: Startup, on_listening) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((startup.host, startup.port))
        s.listen()
        on_listening()
        time.sleep(60)


def _listen_then_exit(startup: Startup, on_listening) -> None:
    on_listening()
    raise SystemExit(3)


def test_a_child_that_exits_after_listening_is_logged(caplog) -> None:
    caplog.set_level(logging.ERROR, logger=processes.__name__)
    children = processes.spawn(_listen_then_exit, Startup(), 1)
    try:
        processes.wait_ready(children, timeout_s=60)
        deadline = time.monotonic() + 30
        while "exited with code 3" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "prefixgate-gateway-1 exited with code 3; 1 of 2 processes" in caplog.text
    finally:
        processes.stop(children, 5)
