"""How `prefixgate up --engine vllm` starts vLLM (prefixgate/launch/vllm.py), without vLLM:
the CPU split, the command line's required settings, and the message when no vLLM
environment is named. (Against real vLLM: tests/e2e/test_up_vllm.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixgate.cli import main
from prefixgate.launch.vllm import VLLMLaunch, VLLMServer, cpu_binding, vllm_argv


@pytest.mark.parametrize(("index", "count", "cpus", "share"), [
    (0, 2, [0, 1], "0"), (1, 2, [0, 1], "1"),
    (0, 2, [0, 1, 2, 3, 4], "0,1,2"), (1, 2, [0, 1, 2, 3, 4], "3,4"),
    (2, 3, [4, 5, 6, 7, 8, 9, 10], "9,10"),
    (2, 3, [0, 1], "0"),  # fewer CPUs than servers: shared, one each
])
def test_cpus_are_split_between_servers(index, count, cpus, share) -> None:
    assert cpu_binding(index, count, cpus) == share


def test_every_cpu_goes_to_exactly_one_server() -> None:
    cpus = list(range(13))
    shares = [cpu_binding(i, 4, cpus).split(",") for i in range(4)]
    assert sorted(int(c) for s in shares for c in s) == cpus


def test_the_command_line_switches_on_what_the_gateway_needs(tmp_path: Path) -> None:
    argv = vllm_argv(VLLMLaunch("/venv/bin/python", tmp_path, "smollm2-135m",
                                extra_args=("--max-num-seqs", "4")),
                     VLLMServer("vllm-0", "127.0.0.1", 8001, 5557, 5558,
                                events_on_all_interfaces=True))
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    options = dict(zip(argv[3::1], argv[4::1], strict=False))
    assert options["--model"] == str(tmp_path) and options["--port"] == "8001"
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--enforce-eager"} <= set(argv)
    assert options["--block-size"] == "32" and options["--dtype"] == "float32"
    events = json.loads(options["--kv-events-config"])
    # vLLM binds its publisher only on '*' or ipc://.
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    assert argv[-2:] == ["--max-num-seqs", "4"]
    server = VLLMServer("vllm-0", "127.0.0.1", 8001, 5557, 5558)
    assert server.worker_spec == "http://127.0.0.1:8001,tcp://127.0.0.1:5557,tcp://127.0.0.1:5558"


def test_up_binds_events_to_a_private_directory_and_loads_the_connector(tmp_path) -> None:
    """`up`'s servers: KV events on ipc:// sockets in a 0700 directory (never on every
    interface), prefixgate's KV connector with its ExportBlocks on loopback, and the
    gateway's --vllm-worker form naming it."""
    from prefixgate.launch.processes import ProcessGroup
    from prefixgate.launch.vllm import VLLMFleet, vllm_env
    from prefixgate.vllm_connector.params import CLASS, MODULE

    fleet = VLLMFleet(VLLMLaunch("/venv/bin/python", tmp_path, "m"), ProcessGroup(tmp_path))
    started = []
    fleet.group.start = lambda name, argv, env=None: started.append((name, argv, env))
    (server,) = fleet.start(1)
    name, argv, env = started[0]
    options = dict(zip(argv[3::1], argv[4::1], strict=False))
    events = json.loads(options["--kv-events-config"])
    ipc_dir = Path(server.ipc_dir)
    assert events["endpoint"] == f"ipc://{ipc_dir}/vllm-0-events"
    assert events["replay_endpoint"] == f"ipc://{ipc_dir}/vllm-0-replay"
    assert ipc_dir.stat().st_mode & 0o077 == 0
    assert "*" not in options["--kv-events-config"]
    kv = json.loads(options["--kv-transfer-config"])
    assert (kv["kv_connector"], kv["kv_connector_module_path"], kv["kv_role"]) == \
        (CLASS, MODULE, "kv_both")
    extra = kv["kv_connector_extra_config"]
    assert extra["export_host"] == "127.0.0.1" and extra["export_port"] == server.export_port
    assert server.worker_spec.endswith(f",grpc://127.0.0.1:{server.export_port}")
    # vLLM's python finds this prefixgate, and nothing else of this environment.
    path = Path(env["PYTHONPATH"])
    assert [p.name for p in path.iterdir()] == ["prefixgate"]
    assert (path / "prefixgate" / "vllm_connector" / "connector.py").is_file()
    assert "VLLM_API_KEY" not in env
    secured = vllm_env(VLLMLaunch("/venv/bin/python", tmp_path, "m", api_key="k"), tmp_path / "p")
    assert secured["VLLM_API_KEY"] == "k"


def test_up_without_a_vllm_environment_says_how_to_name_one(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("PREFIXGATE_VLLM_PYTHON", raising=False)
    with pytest.raises(SystemExit, match="--vllm-python PATH or PREFIXGATE_VLLM_PYTHON"):
        main(["up", "--engine", "vllm", "--model", "tiny-random", "--cache-dir",
              str(tmp_path), "--port", "0", "--http-port", "-1"])
    with pytest.raises(SystemExit, match="not an executable file"):
        main(["up", "--engine", "vllm", "--model", "tiny-random", "--cache-dir",
              str(tmp_path), "--port", "0", "--http-port", "-1",
              "--vllm-python", str(tmp_path / "nothing")])


def test_up_secure_gives_vllm_an_api_key_the_gateway_reads_from_a_private_file(tmp_path) -> None:
    """`up --secure`: vLLM gets --api-key through VLLM_API_KEY (never on a command line),
    and the gateway's --vllm-worker form names a 0600 file holding it, which the adapter
    reads and sends."""
    import os

    from prefixgate.engines.vllm import VLLMConfig
    from prefixgate.launch.processes import ProcessGroup
    from prefixgate.launch.vllm import VLLMFleet

    fleet = VLLMFleet(VLLMLaunch("/venv/bin/python", tmp_path, "m", api_key="s3cret"),
                      ProcessGroup(tmp_path))
    started = []
    fleet.group.start = lambda name, argv, env=None: started.append((argv, env))
    (server,) = fleet.start(1)
    argv, env = started[0]
    assert env["VLLM_API_KEY"] == "s3cret" and not [a for a in argv if "s3cret" in a]
    assert os.stat(server.api_key_file).st_mode & 0o777 == 0o600
    assert "s3cret" not in server.worker_spec
    cfg = VLLMConfig.parse(server.worker_spec)
    assert cfg.api_key == "s3cret" and cfg.export == f"127.0.0.1:{server.export_port}"
    with pytest.raises(ValueError, match="API key file"):
        VLLMConfig.parse(f"{server.url},{server.events},key-file:{tmp_path}/missing")


def test_a_keyring_makes_the_connector_check_tickets_as_the_gateways_worker(tmp_path) -> None:
    """With a keyring (`up --secure`'s), the connector gets its path (never a key on a
    command line) and exports as the worker id the gateway's adapter gives the server, the
    holder its pull tickets name; without one, neither a keyring nor a check."""
    from prefixgate.engines.vllm import VLLMConfig, worker_id_of
    from prefixgate.launch.processes import ProcessGroup
    from prefixgate.launch.vllm import VLLMFleet
    from prefixgate.security.identity import new_gateway_key, new_worker_key
    from prefixgate.security.tickets import ticket_public_line

    gateways = bytes.fromhex(new_gateway_key().split(":", 1)[1])
    private, _ = new_worker_key("vllm")
    tickets = ticket_public_line(gateways)
    keyring = tmp_path / "vllm.keyring"
    keyring.write_text(f"{private}\n{tickets}\n")

    def extra_of(launch: VLLMLaunch) -> tuple[VLLMServer, list[str], dict]:
        fleet = VLLMFleet(launch, ProcessGroup(tmp_path))
        started = []
        fleet.group.start = lambda name, argv, env=None: started.append(argv)
        (server,) = fleet.start(1)
        options = dict(zip(started[0][3::1], started[0][4::1], strict=False))
        return server, started[0], \
            json.loads(options["--kv-transfer-config"])["kv_connector_extra_config"]

    server, argv, extra = extra_of(VLLMLaunch("/venv/bin/python", tmp_path, "m",
                                              keyring=str(keyring)))
    assert extra["keyring"] == str(keyring)
    assert not [a for a in argv if tickets.split(":")[1] in a or private.split(":")[1] in a]
    # The holder a gateway names in a ticket for this server: its adapter's worker id.
    assert extra["worker_id"] == worker_id_of(VLLMConfig.parse(server.worker_spec).url) \
        == server.worker_id == f"vllm-127.0.0.1:{server.port}"
    _, _, plain = extra_of(VLLMLaunch("/venv/bin/python", tmp_path, "m"))
    assert "keyring" not in plain and plain["worker_id"].startswith("vllm-127.0.0.1:")


def test_events_go_on_every_interface_only_when_asked() -> None:
    """vLLM binds a tcp:// publisher only on '*': without an ipc directory a server's
    events are refused unless the caller asks for every interface."""
    with pytest.raises(ValueError, match="events_on_all_interfaces"):
        VLLMServer("vllm-0", "127.0.0.1", 8001, 5557, 5558).bind_events()
