"""`prefixgate up` as an operator meets it (tiny-random, one worker, started in a session
of its own as a terminal would, Ctrl-C sent to that whole session as a terminal sends it):
it prints how to reach it, the lines printed work as printed (the OpenAI SDK and curl
against --secure's TLS, an --http-port 0 chosen for it); Ctrl-C lets the reply in flight
finish, saying so, and a second Ctrl-C stops everything at once."""

from __future__ import annotations

import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time

import httpx

from prefixgate.wire.rpc import free_port
from tests.helpers import REPO, cli_env, process_alive, wait_for

PG = [sys.executable, "-m", "prefixgate"]


class Up:
    """`prefixgate up ARGS` leading its own session; its merged output collected."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([*PG, "up", "--model", "tiny-random", "--workers", "1",
                                      "--torch-threads", "1", *args], env=env, cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        wait_for(lambda: "Ctrl-C stops everything" in self.text or self.proc.poll() is not None,
                 timeout=180, what="prefixgate up to come up")
        assert self.proc.poll() is None, self.text
        wait_for(lambda: "OpenAI SDK:" in self.text, timeout=10, what="the reach lines")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def line(self, pattern: str) -> re.Match:
        match = re.search(pattern, self.text, re.MULTILINE)
        assert match, f"no {pattern!r} in:\n{self.text}"
        return match

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: its whole group

    def workers(self) -> list[int]:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)],
                             capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def _in_flight(base: str, **kwargs) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10, **kwargs).text
    return sum(float(v) for v in re.findall(
        r"^prefixgate:gateway_requests_in_flight\{[^}]*\} (\S+)$", text, re.MULTILINE))


def _long_chat(address: str, *extra: str, max_tokens: int = 2000) -> subprocess.Popen:
    return subprocess.Popen([*PG, "chat", "--address", address, *extra, "--message",
                             "tell me a long story", "--max-tokens", str(max_tokens),
                             "--temperature", "0", "--timeout", "120"], env=cli_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_secure_up_prints_lines_that_work_and_ctrl_c_lets_the_reply_finish(tmp_path) -> None:
    secure, port = tmp_path / "secure", free_port()
    up = Up(["--port", str(port), "--http-port", "0", "--secure", "--secure-dir", str(secure)],
            cli_env(PREFIXGATE_CACHE_DIR=str(tmp_path / "cache")))
    chat = None
    try:
        url = up.line(r"OpenAI-compatible API on (https://127\.0\.0\.1:(\d+)/v1)").group(1)
        assert int(up.line(r"API on https://127\.0\.0\.1:(\d+)/v1").group(1)) > 0
        ca, token = secure / "ca.crt", secure / "token"
        # The OpenAI SDK line as printed (its app: a model list), then curl's.
        sdk = up.line(r"^  OpenAI SDK: (.*) python your_app\.py$").group(1)
        assert f"SSL_CERT_FILE={ca}" in sdk and f"OPENAI_BASE_URL={url}" in sdk
        app = "import openai; print(openai.OpenAI().models.list().data[0].id)"
        r = subprocess.run(["bash", "-c", f"{sdk} {sys.executable} -c '{app}'"],
                           capture_output=True, text=True, timeout=60, env=cli_env())
        assert r.returncode == 0 and r.stdout.strip() == "tiny-random", r.stderr
        r = subprocess.run([sys.executable, "-c", app], capture_output=True, text=True,
                           timeout=60, env=cli_env(OPENAI_BASE_URL=url, OPENAI_API_KEY="x"))
        assert r.returncode != 0  # without the CA: the line above is what makes it work
        curl = up.line(r"^  curl: +(curl .*)$").group(1)
        assert f"--cacert {ca}" in curl
        if shutil.which("curl"):
            r = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and '"tiny-random"' in r.stdout, r.stdout + r.stderr
        chat_line = up.line(r"^  chat: +prefixgate chat (.*)$").group(1).split()
        assert chat_line == ["--address", f"127.0.0.1:{port}", "--tls-ca", str(ca),
                             "--token-file", str(token)]

        # Ctrl-C with a reply in flight: said, and the reply finishes; nothing warns.
        # Long enough to be in flight at Ctrl-C, well inside the drain on a busy host.
        chat = _long_chat(chat_line[1], *chat_line[2:], max_tokens=600)
        auth = {"verify": ssl.create_default_context(cafile=str(ca)),
                "headers": {"Authorization": f"Bearer {token.read_text().strip()}"}}
        base = url.removesuffix("/v1")
        wait_for(lambda: _in_flight(base, **auth) >= 1, timeout=60, what="a reply in flight")
        workers = up.workers()
        up.ctrl_c()
        wait_for(lambda: "in flight finish" in up.text, timeout=10, what="the message")
        assert up.line(r"stopping: the gateway lets 1 reply in flight finish \(up to 30 s\), "
                       r"then the workers stop; Ctrl-C again stops at once")
        out, err = chat.communicate(timeout=120)
        assert chat.returncode == 0 and "[worker worker-0 |" in out, out + err  # not cut
        assert up.proc.wait(60) == 0, up.text
        up.reader.join(10)
        assert "stopping the workers" in up.text
        assert "WARNING" not in up.text.split("stopping: ")[1], up.text  # no probe warning
        assert not any(process_alive(p) for p in workers)
    finally:
        if chat is not None and chat.poll() is None:
            chat.kill()
        up.close()


def test_a_second_ctrl_c_stops_at_once(tmp_path) -> None:
    port = free_port()
    up = Up(["--port", str(port), "--http-port", "0"],
            cli_env(PREFIXGATE_CACHE_DIR=str(tmp_path)))
    chat = None
    try:
        base = up.line(r"OpenAI-compatible API on (http://127\.0\.0\.1:\d+)/v1").group(1)
        assert httpx.get(base + "/v1/models", timeout=30).status_code == 200
        metrics = httpx.get(base + "/metrics", timeout=30).text  # counters, no _created twins
        assert "prefixgate:gateway_requests_total" in metrics and "_created" not in metrics
        chat = _long_chat(f"127.0.0.1:{port}")
        wait_for(lambda: _in_flight(base) >= 1, timeout=60, what="a reply in flight")
        workers = up.workers()
        up.ctrl_c()
        wait_for(lambda: "Ctrl-C again stops at once" in up.text, timeout=10, what="the message")
        started = time.monotonic()
        up.ctrl_c()
        code = up.proc.wait(30)
        assert time.monotonic() - started < 10, up.text
        assert code == 0 and "stopping at once" in up.text, up.text
        wait_for(lambda: not any(process_alive(p) for p in workers), timeout=10,
                 what="the workers to be gone")
        chat.wait(60)
        assert chat.returncode == 1  # its reply was cut: chat says it failed
    finally:
        if chat is not None and chat.poll() is None:
            chat.kill()
        up.close()
