"""`prefixgate gateway --processes 2`: two gateway processes serve one port, and both
route a shared prefix to the worker holding it (tiny-random workers over real gRPC)."""

from __future__ import annotations

import json
import signal
import socket
import urllib.request

import grpc
import pytest

from prefixgate.launch.processes import ProcessGroup
from prefixgate.v1 import chat_pb2, chat_pb2_grpc, common_pb2
from prefixgate.wire.rpc import free_port
from tests.helpers import REPO, cli_env, start_worker, wait_for

CONNECTIONS = 16  # all on one of two processes: chance 2**-15


def turns_served(metrics_port: int) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.decode().splitlines()
               if line.startswith("prefixgate:router_turns_total"))


@pytest.fixture(scope="module")
def workers(loop_thread, tiny_spec, tiny_model):
    """Two tiny-random workers, stopped after the test's engine checks have run."""
    started = [start_worker(loop_thread, tiny_spec, tiny_model, wid) for wid in ("p0", "p1")]
    yield [address for address, _ in started]
    for _, stop in started:
        loop_thread.loop.call_soon_threadsafe(stop.set)


def listening_sockets(port: int) -> int:
    """How many sockets listen on TCP `port` (Linux /proc/net/tcp*, state 0A = LISTEN)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            count += state == "0A" and int(local.rsplit(":", 1)[1], 16) == port
    return count


def free_port_pair() -> int:
    """A port P with P and P + 1 free a moment ago (process i serves metrics on P + i)."""
    for _ in range(100):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise AssertionError("no two adjacent free ports")


def test_two_processes_share_a_port_and_route_alike(workers, tiny_spec) -> None:
    port, metrics = free_port(), free_port_pair()
    group = ProcessGroup(env=cli_env(PREFIXGATE_LOG_LEVEL="WARNING"), cwd=REPO)
    gw = group.start_prefixgate(
        "gateway", "gateway", "--processes", "2", "--port", str(port),
        "--model", "tiny-random", "--cache-dir", str(tiny_spec.model_dir.parent.parent),
        "--metrics-port", str(metrics), "--drain-seconds", "1", "--http-port", "-1",
        *(a for address in workers for a in ("--worker", address)))
    # Connections opened before both processes listen would all land on the first one.
    wait_for(lambda: gw.poll() is not None or listening_sockets(port) >= 2, timeout=120,
             what="both gateway processes listening")
    # One connection per channel (gRPC would share one between channels to one target).
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}",
                                      options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(CONNECTIONS)]
    stubs = [chat_pb2_grpc.ChatServiceStub(ch) for ch in channels]
    sampling = common_pb2.SamplingParams(max_tokens=2)

    def chat(stub, ids):
        events = list(stub.Chat(chat_pb2.ChatRequest(
            prompt_token_ids=chat_pb2.TokenIds(token_ids=ids), sampling=sampling), timeout=60))
        return events[-1].final

    def all_see_both_workers() -> bool:
        assert gw.poll() is None, f"the gateway exited with code {gw.returncode} (log above)"
        try:
            return all(s.ListModels(chat_pb2.ListModelsRequest(), timeout=5).models[0]
                       .num_workers == 2 for s in stubs)
        except grpc.RpcError:
            return False

    try:
        wait_for(all_see_both_workers, timeout=120, what="both gateway processes up")
        prefix = list(range(10, 90))  # 5 blocks of 16
        first = chat(stubs[0], prefix)
        # Every process learns the blocks from the worker's events (as replicas do).
        wait_for(lambda: chat(stubs[1], prefix + [1]).usage.cached_tokens >= 64, timeout=20,
                 what="the prefix to reach the index")
        finals = [chat(s, prefix + [3, 4, i]) for i, s in enumerate(stubs)]
        assert {f.worker_id for f in finals} == {first.worker_id}
        assert all(f.usage.cached_tokens >= 64 for f in finals)
        served = [turns_served(metrics), turns_served(metrics + 1)]
        assert min(served) > 0, f"one process served every connection: {served}"
    finally:
        for ch in channels:
            ch.close()
        try:
            assert group.signal("gateway", signal.SIGTERM, wait_s=30) == 0
        finally:
            group.stop(timeout_s=1)


def test_bench_gateway_runs_and_reports_both_kinds(capsys) -> None:
    """`prefixgate bench gateway` end to end, tiny (the figures are in docs/benchmarks.md):
    an emulated worker, `gateway --processes 2`, every request answered."""
    from prefixgate.cli import main

    assert main(["bench", "gateway", "--processes", "2", "--prompt-tokens", "64", "--idle", "2",
                 "--bursts", "1", "--burst", "2", "--new-tokens", "16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {(r["processes"], r["kind"]) for r in report["results"]} == {(2, "turn"), (2, "fresh")}
    for r in report["results"]:
        for shape in ("idle", "burst"):
            for path in ("direct_ms", "gateway_ms", "relay_ms"):  # relay: the floor
                assert r[shape][path]["errors"] == 0 and r[shape][path]["p50"] > 0


def test_bench_gateway_sustain_and_relay_variants(capsys) -> None:
    """`bench gateway --sustain-rates` reports each offered rate for the gateway and the
    direct path; `--relay-impls` measures each relay variant as its own path."""
    from prefixgate.cli import main

    assert main(["bench", "gateway", "--processes", "1", "--prompt-tokens", "64", "--idle", "2",
                 "--bursts", "1", "--burst", "2", "--new-tokens", "16", "--kinds", "turn",
                 "--relay-impls", "aio", "sync", "--sustain-rates", "4", "8",
                 "--sustain-seconds", "0.5", "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["results"]
    for path in ("relay_ms", "relay_sync_ms"):
        assert r["idle"][path]["errors"] == 0 and r["idle"][path]["p50"] > 0
    for path in ("gateway", "direct"):
        rows = r["sustain"][path]["rates"]
        assert [row["offered_per_s"] for row in rows] == [4, 8]
        assert all(row["errors"] == 0 and row["n"] >= 2 for row in rows)
