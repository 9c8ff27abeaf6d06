"""launch/processes.py `ProcessGroup`: children start cleanly from a process that is busy
with gRPC (no fork handlers run: launch/with_parent.py), and a child ends when the
process that started it dies, even by SIGKILL. Each scenario runs in its own interpreter,
so a crash stays there."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

from tests.helpers import REPO, process_alive

BUSY_GRPC_PARENT = textwrap.dedent("""
    import asyncio, sys
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from prefixgate.launch.processes import ProcessGroup

    async def main():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def busy():
                while True:
                    await stub.Check(health_pb2.HealthCheckRequest())

            tasks = [asyncio.create_task(busy()) for _ in range(4)]

            def spawn():
                group = ProcessGroup()
                codes = []
                for i in range(int(sys.argv[1])):
                    proc = group.start(f"c{i}", [sys.executable, "-c", "pass"])
                    codes.append(proc.wait(30))
                return codes

            codes = await asyncio.to_thread(spawn)
            for t in tasks:
                t.cancel()
        print("codes", *codes)

    asyncio.run(main())
""")


def test_children_start_cleanly_while_the_parent_is_busy_with_grpc() -> None:
    out = subprocess.run([sys.executable, "-c", BUSY_GRPC_PARENT, "30"], cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    codes = out.stdout.split("codes", 1)[1].split()
    assert codes == ["0"] * 30, (codes, out.stderr[-2000:])


ORPHANING_PARENT = textwrap.dedent("""
    import os, signal, sys, time
    from prefixgate.launch.processes import ProcessGroup

    proc = ProcessGroup().start("sleeper", ["sleep", "60"])
    time.sleep(0.5)  # the guard has execed into sleep
    print(proc.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_child_ends_when_its_parent_is_killed() -> None:
    out = subprocess.run([sys.executable, "-c", ORPHANING_PARENT], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while process_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(child), "the child outlived its SIGKILLed parent"


def test_free_ports_are_distinct_and_below_the_kernels_ephemeral_range() -> None:
    """wire.rpc.free_port: never the same port twice in a process, and none the kernel
    could hand to another process's port-0 bind or outgoing connection meanwhile."""
    from prefixgate.wire.rpc import _ephemeral_low, free_port

    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    if _ephemeral_low() > 11000:
        assert all(10000 <= p < _ephemeral_low() for p in ports)
