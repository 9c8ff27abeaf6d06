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
                     VLLMServer("vllm-0", "127.0.0.1", 8001, 5557, 5558))
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    options = dict(zip(argv[3::1], argv[4::1], strict=False))
    assert options["--model"] == str(tmp_path) and options["--port"] == "8001"
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--enforce-eager"} <= set(argv)
    assert options["--block-size"] == "32" and options["--dtype"] == "float32"
    events = json.loads(options["--kv-events-config"])
    # vLLM binds only endpoints written with '*'.
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    assert argv[-2:] == ["--max-num-seqs", "4"]
    server = VLLMServer("vllm-0", "127.0.0.1", 8001, 5557, 5558)
    assert server.worker_spec == "http://127.0.0.1:8001,tcp://127.0.0.1:5557,tcp://127.0.0.1:5558"


def test_up_without_a_vllm_environment_says_how_to_name_one(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("PREFIXGATE_VLLM_PYTHON", raising=False)
    with pytest.raises(SystemExit, match="--vllm-python PATH or PREFIXGATE_VLLM_PYTHON"):
        main(["up", "--engine", "vllm", "--model", "tiny-random", "--cache-dir",
              str(tmp_path), "--port", "0", "--http-port", "-1"])
    with pytest.raises(SystemExit, match="not an executable file"):
        main(["up", "--engine", "vllm", "--model", "tiny-random", "--cache-dir",
              str(tmp_path), "--port", "0", "--http-port", "-1",
              "--vllm-python", str(tmp_path / "nothing")])
